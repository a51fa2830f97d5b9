"""A send's end against its receiver (``hisparse_cupy.pd._pending.PendingSend``), with a
stand-in NIXL agent that records what the sender does, in order: no NIXL, no GPU."""

from __future__ import annotations

import types

import numpy as np

from hisparse_cupy.pd import _pending


def _send(states, *, release_fails: int = 0, words=("grant",)):
    """A WRITE whose receiver says ``words`` in turn (a grant at once), whose NIXL states are
    ``states`` (then ``"ERR"``), and the calls the sender makes; NIXL refuses the first
    ``release_fails`` handle releases."""
    calls, st, fails = [], iter(states), [release_fails]

    def release(h):
        calls.append(("release", h))
        if fails[0]:
            fails[0] -= 1
            raise RuntimeError("NIXL: the transfer is still in progress")

    agent = types.SimpleNamespace(
        send_notif=lambda a, m: calls.append(("say", m.split(b":")[0].decode())),
        transfer=lambda h: "PROC", check_xfer_state=lambda h: next(st, "ERR"),
        release_xfer_handle=release)
    words = iter(words)
    link = _pending.Link(agent, "conn", lambda tag: next(words, None), lambda s: None,
                         lambda s, ok: None, lambda k: calls.append(("unpin", k)))
    t = {"req_id": "a", "xfer_id": "x", "agent": "rx", "tag": "x/0", "token": "t",
         "digest": "d", "n_layers": 1, "n_tokens": 1, "row_bytes": 16,
         "descs": np.zeros((1, 2))}
    return _pending.PendingSend(link, t, "write", 0.0, 1e9, handle="H", pin="K"), calls


def _drive(p, rounds=5, *, start=True):
    if start:
        p.start()
    for _ in range(rounds):
        p.advance()


def test_a_failed_write_lets_its_receiver_have_the_pages_only_after_nixl_let_it_go():
    """NIXL says ERR for a granted WRITE: its handle is released first, and only then the
    receiver told ``abort`` (its pages go back to its free list at once: a WRITE still landing
    would write into another request's pages)."""
    p, calls = _send(["PROC", "ERR"])
    _drive(p)
    assert p.ended and p.result is None and "failed (ERR)" in str(p.error)
    assert calls == [("say", "begin"), ("release", "H"), ("say", "abort"), ("unpin", "K")]


def test_a_write_nixl_will_not_let_go_is_never_aborted():
    """NIXL refuses to release the failed WRITE's handle (it may still be writing): no
    ``abort`` (the receiver quarantines the granted pages at its deadline), the send's KV and
    registration are kept, and the release is tried again until NIXL takes it."""
    p, calls = _send(["PROC", "ERR"], release_fails=3)
    _drive(p, rounds=2)
    assert p.ended and ("say", "abort") not in calls and ("unpin", "K") not in calls
    _drive(p, rounds=5, start=False)
    assert calls[-2:] == [("release", "H"), ("unpin", "K")]
    assert ("say", "abort") not in calls  # the receiver's quarantine decides, not the sender


def test_a_completed_write_is_released_without_an_abort():
    """A WRITE that completed (its done is NIXL's notification) ends at the receiver's ``ok``
    and lets go of its handle then, with no ``abort``."""
    p, calls = _send(["PROC", "DONE"], words=("grant", "ok"))
    _drive(p)
    assert p.result is not None and p.error is None
    assert calls == [("say", "begin"), ("release", "H"), ("unpin", "K")]


def test_a_write_whose_release_was_refused_once_is_never_aborted():
    """The send expires while its WRITE may still write; NIXL refuses the release once, then
    takes it when the WRITE reports ERR. A release taken after a refusal may have stopped
    nothing (some NIXL versions drop the request without cancelling it then): the receiver is
    not told abort, and quarantines the granted pages at its deadline."""
    p, calls = _send(["PROC", "DONE", "ERR"], release_fails=1)
    p.start()
    p.advance()  # granted: the WRITE is posted, PROC
    p.expire()  # the sender gives up while it writes
    for _ in range(4):
        p.advance()
    assert ("release", "H") in calls and ("say", "abort") not in calls
    assert calls[-1] == ("unpin", "K")
