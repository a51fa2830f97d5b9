"""A send of :mod:`hisparse_cupy.pd` in flight (:class:`PendingSend`), driven through the
:class:`Link` its :class:`~hisparse_cupy.pd._send.KVSender` gives it."""

from __future__ import annotations

import collections
import contextlib
import time

from . import _nixl, _protocol

__all__ = ["Link", "PendingSend"]

GRACE_S = 1.0  # a pull past its deadline: how long the receiver has to answer its withdrawal
Sent = _nixl.Sent
Link = collections.namedtuple("Link", "agent conn word progress settle unpin")
Link.__doc__ = """What a send needs of its sender: its NIXL ``agent``, its connection-only
metadata ``conn`` (a begin's), ``word(tag)`` (the receiver's next word for a send, or None),
``progress(send)`` (the sender's other sends polled, queued ones started), ``settle(send, ok)``
(the send ended) and ``unpin(key)`` (a registration's user gone)."""


class PendingSend:
    """A send in flight. :attr:`kind`: ``"pull"`` (an offer: done when the receiver says its
    READ completed), ``"write"`` (a NIXL WRITE: queued behind the sender's earlier WRITEs to
    that receiver, then asks for a grant, writes, and is done when the receiver has checked
    its notification) or ``"copy"`` (the same-node path: a grant, the copies, then the same
    check). :meth:`wait` (or :meth:`poll` until True) drives it, and the sender's earlier sends,
    to the end. :attr:`state`: ``"QUEUED"``, ``"PROC"`` or ``"DONE"``."""

    def __init__(self, link: Link, t: dict, kind: str, t0: float, deadline: float, *,
                 handle=None, pin=None, keep=None, copy=None, sums=None):
        self._link, self._handle, self._copy, self._event = link, handle, copy, None
        self._sums = sums  # per-layer sums of kv (a verified ticket's), sent with begin/done
        self._keep = keep  # the send's kv, alive until it ends (freed, its memory is reused)
        self.pin_key, self.kind, self.pull = pin, kind, kind == "pull"
        self.req_id, self.xfer_id, self.agent = t.get("req_id"), t["xfer_id"], t["agent"]
        self.tag, self._token, self._digest = t["tag"], t["token"], t["digest"]
        self.bytes = t["n_layers"] * t["n_tokens"] * t["row_bytes"]
        self.descriptors, self.t0, self.deadline = len(t["descs"]), t0, deadline
        self.result, self._ended, self.error, self._released = None, False, None, False
        self.stale = False  # NIXL failed to reach the receiver (its metadata may be stale)
        self._refused = False  # NIXL refused to release the WRITE once: never abort after
        self.state = "QUEUED" if kind == "write" else "PROC"
        # queued -> asking (begin sent) -> writing (granted) -> told (waits for the receiver's
        # word); a pull is told from its offer on
        self._phase = "told" if self.pull else "queued"

    @property
    def ended(self) -> bool:
        """Done or failed (no more progress to make)."""
        return self._ended

    def _say(self, kind: str, **fields) -> None:
        self._link.agent.send_notif(self.agent, _protocol.message(
            kind, xfer_id=self.xfer_id, token=self._token, tag=self.tag, **fields))

    def start(self) -> None:
        """Ask the receiver for a grant (a queued WRITE's turn, or a copy at once)."""
        self.state, self._phase = "PROC", "asking"
        try:
            self._say("begin", how=self.kind, digest=self._digest,
                      verify=self._sums is not None, metadata=self._link.conn)
        except Exception as e:
            self.stale = True
            self.fail(RuntimeError(f"the begin of {self.xfer_id} to {self.agent!r} did not leave "
                                   f"({e!r}): the receiver is gone, or its metadata is stale"))

    def _go(self) -> None:
        """Granted: post the WRITE, or queue the copies."""
        self._phase = "writing"
        if self._copy is not None:
            try:
                self._event = self._copy()
            except Exception as e:  # (what was queued has run: the copier waits for it)
                self._abort(RuntimeError(f"the copies of {self.xfer_id} did not start ({e!r})"))
            return
        try:
            st = self._link.agent.transfer(self._handle)
        except Exception as e:
            st = f"ERR ({e!r})"
        if st not in ("PROC", "DONE"):
            self.stale = True
            self._abort(RuntimeError(f"NIXL transfer {self.xfer_id} to {self.agent!r} failed "
                                     f"({st})"))

    def _abort(self, error: Exception) -> None:
        """The write failed: fail, and tell the receiver (its pages may go back) once it can
        write no more, i.e. for a WRITE once NIXL released its handle; a handle NIXL keeps (it
        may still be writing) is tried again when the send lets go, and the receiver is not
        told: it quarantines the granted pages at its deadline."""
        if self._copy is not None or (self._release_handle() and not self._refused):
            with contextlib.suppress(Exception):
                self._say("abort", why=str(error)[:200])
        self._phase = "told"
        self.fail(error)

    def _release_handle(self) -> bool:
        """Release the WRITE's NIXL handle, if any (NIXL stops what it can of the transfer, or
        refuses): True once none is held. A refusal is remembered: a later release that NIXL
        takes may not have stopped anything (some versions drop the request then without
        cancelling it), so the receiver is never told abort after one."""
        if self._handle is None:
            return True
        try:
            self._link.agent.release_xfer_handle(self._handle)
        except Exception:
            self._refused = True
            return False
        self._handle = None
        return True

    def _writing(self) -> str:
        """``"PROC"`` while the granted WRITE or copies may still write, ``"DONE"``, or
        ``"ERR ..."``."""
        if self._copy is not None:
            return "DONE" if self._event.done else "PROC"
        try:
            return self._link.agent.check_xfer_state(self._handle)
        except Exception as e:
            return f"ERR ({e!r})"

    def _check(self) -> None:
        """One look at this send, if it is started and not ended."""
        if self._ended or self._phase == "queued":
            return
        if self._phase == "asking":
            w = self._link.word(self.tag)
            if w == "grant":
                self._go()
            elif w is not None:
                self._phase = "told"
                self.fail(RuntimeError(f"NIXL transfer {self.xfer_id} to {self.agent!r} was "
                                       f"refused (the receiver: {w})"))
        if self._phase == "writing":
            st = self._writing()
            if st == "DONE" and self._copy is not None:
                try:  # (a WRITE's done is NIXL's notification, sent once it is complete)
                    self._say("done", digest=self._digest, sums=self._sums)
                except Exception as e:
                    self._phase, self.stale = "told", True
                    self.fail(RuntimeError(f"the done of {self.xfer_id} to {self.agent!r} did "
                                           f"not leave ({e!r}): the receiver is gone"))
                    return
            if st == "DONE":
                self._phase = "told"
            elif st != "PROC":
                self.stale = True
                self._abort(RuntimeError(f"NIXL transfer {self.xfer_id} to {self.agent!r} "
                                         f"failed ({st})"))
        if self._phase == "told" and not self._ended:
            w = self._link.word(self.tag)
            if w == "ok":
                self._finish(ok=True)
            elif w is not None:
                self.fail(RuntimeError(f"NIXL transfer {self.xfer_id} to {self.agent!r} failed "
                                       f"(the receiver: {w})"))

    def fail(self, error: Exception) -> None:
        """End it unsent or failed: :meth:`poll` and :meth:`wait` raise ``error``."""
        if not self._ended:
            self.error = error
            self._finish(ok=False)

    def expire(self) -> None:
        """End it past its deadline with a ``TimeoutError`` that says where it was. A WRITE or
        copies in progress are left to end (the sender keeps ``kv`` and tells the receiver)."""
        what = {"queued": "start in time (the sender's earlier WRITEs took it)",
                "asking": "get the receiver's grant in time (is it polling?)",
                "writing": "complete in time",
                "told": "hear from the receiver in time (is it polling?)"}[self._phase]
        self.fail(TimeoutError(f"NIXL transfer {self.xfer_id} to {self.agent!r} did not {what}"))

    def advance(self, force: bool = False) -> bool:
        """Poll this send alone (errors kept for its own :meth:`poll`); for an ended one, let
        go of what it holds once its WRITE or copies can write no more (``force``: release a
        WRITE still in progress; NIXL tries to cancel it, its receiver is not told). True while
        it needs more polling."""
        if not self._ended:
            self._check()
            return not self._ended or not self._let_go()
        if force and self._phase == "writing" and self._copy is None:
            self._phase = "told"  # (released below, in progress: its pages stay quarantined)
        return not self._let_go()

    def poll(self) -> bool:
        """Progress the transfer (and the sender's earlier ones); True once done
        (``RuntimeError`` if it failed, ``TimeoutError`` if it ended past its deadline)."""
        if self.result is None and not self._ended:
            self._link.progress(self)
        self._check()
        if self._ended and self.result is None:
            raise self.error or RuntimeError(f"NIXL transfer {self.xfer_id} to {self.agent!r} "
                                             f"already failed")
        return self.result is not None

    def wait(self, timeout_s: float | None = None) -> Sent:
        """Poll to the end: :class:`Sent`; ``TimeoutError`` past the deadline. A pull is then
        withdrawn (the receiver fails the reservation, its READ waited out) and the receiver
        given ``GRACE_S`` to answer: if its READ had completed, the send succeeds after all; if
        it does not answer (not polling, gone), it may still read ``kv`` until its reservation
        ends. Every kind needs the receiver to poll."""
        end = self.deadline if timeout_s is None else \
            time.perf_counter() + _nixl.seconds("timeout_s", timeout_s)
        while not self.poll():
            if time.perf_counter() > end:
                if self.pull and self._withdraw():
                    return self.result
                self.expire()
                raise self.error
            time.sleep(0)
        return self.result

    def _withdraw(self) -> bool:
        """Tell the receiver a pull is given up, and wait up to ``GRACE_S`` for its answer:
        True if its READ had completed (the send succeeded after all)."""
        with contextlib.suppress(Exception):
            self._say("withdraw")
        end = time.perf_counter() + GRACE_S
        while time.perf_counter() < end:
            w = self._link.word(self.tag)
            if w == "ok":
                self._finish(ok=True)
                return True
            if w is not None:
                break
            time.sleep(0.001)
        return False

    def _finish(self, ok: bool) -> None:
        if self._ended:
            return
        self._ended = True
        self._link.settle(self, ok)
        if ok:
            self.state = "DONE"
            self.result = Sent(self.req_id, self.xfer_id, self.bytes,
                               time.perf_counter() - self.t0, self.descriptors)

    def _let_go(self) -> bool:
        """Release what the send holds (its WRITE handle, kv, registration) once nothing it
        started can still write; True then. A granted WRITE or copy still in progress is
        kept, and its end told to the receiver (an abort, or NIXL's done) when it comes."""
        if self._released:
            return True
        if self._phase == "asking":  # a grant may be on its way: given back
            with contextlib.suppress(Exception):
                self._say("abort", why=f"the sender gave up ({self.error})"[:200])
            self._phase = "told"
        if self._phase == "writing":
            st = self._writing()
            if st == "PROC" or not self._release_handle():  # may still write: kept
                return False
            if (st != "DONE" or self._copy is not None) and not self._refused:  # (a WRITE's
                with contextlib.suppress(Exception):  # done went with it)
                    self._say("abort", why=f"the sender gave up ({st})")
            self._phase = "told"
        if not self._release_handle():  # NIXL kept the handle: so are kv and its registration
            return False
        self._keep = None
        self._link.unpin(self.pin_key)
        self._released = True
        return True
