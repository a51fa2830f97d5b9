"""A hostile or buggy prefill peer against ``hisparse_cupy.pd``'s receiver, on the CPU (DRAM ->
DRAM over UCX): malformed control messages between legitimate completions; sends after a
cancel, a timeout or an admission with the pages reused at once; cancels during a large READ
or WRITE (UCX over TCP, so the transfer is still in progress) with the pages wanted at once;
tickets cut, widened, shifted or redirected; bare, forged and guessed messages; checksums that
do not match; raw NIXL agents holding a ticket's metadata. In each, every other request's rows
are checked byte for byte, no byte outside what the receiver reserved changes, and every page
is accounted for. The last test mixes all of them with legitimate traffic at random.
"""

from __future__ import annotations

import base64
import os
import time

import numpy as np
import pytest

from hisparse_cupy._kernels import sums as _sums
from hisparse_cupy.host._pages import PoolExhausted
from hisparse_cupy.pd import _nixl, _protocol

try:
    from hisparse_cupy.pd import KVReceiver, KVSender, nixl_api

    nixl_api()
except ImportError as e:
    pytest.skip(f"NIXL is not installed: {e}", allow_module_level=True)

from _pd_peer import make_kv  # noqa: E402
from test_pd import (  # noqa: E402
    RB,
    Clock,
    CountingPages,
    FakeCache,
    L,
    P,
    _poll,
    _take,
    arrivals,
    failures,
    finish,
    receiver,
    rows_of,
    send,
    settle,
    ticket_rows,
)

POISON = 0xA5


def poisoned(n_pages=64, rb=RB, **kw):
    rx, pool, pages = receiver(n_pages, rb, **kw)
    pool[:] = POISON
    return rx, pool, pages


class Ledger:
    """What each byte of a receiver's pool must hold: the poison, or a request's rows."""

    def __init__(self, pool):
        self.pool, self.want = pool, {}  # name -> (rows, kv)

    def hold(self, name, rows, kv):
        self.want[name] = (np.asarray(rows), np.asarray(kv))

    def drop(self, name):
        self.want.pop(name, None)

    def check(self, free_rows=()):
        """Every held request's rows exact; ``free_rows`` (reserved by no one, written by no
        one since the poison) still poison."""
        for name, (rows, kv) in self.want.items():
            np.testing.assert_array_equal(self.pool[:, rows], kv, err_msg=str(name))
        if len(free_rows):
            assert (self.pool[:, np.asarray(free_rows)] == POISON).all()


IGNORED = ("malformed", "unknown", "forged", "refused", "late", "duplicate")


def counted(rx, n, wait_s=10.0):
    """Poll ``rx`` (nothing may arrive, fail or time out) until it has counted and ignored
    ``n`` messages."""
    end = time.monotonic() + wait_s
    while sum(rx.stats[k] for k in IGNORED) < n:
        assert rx.poll() == ([], [], [])
        assert time.monotonic() < end, dict(rx.stats)
    for _ in range(10):
        assert rx.poll() == ([], [], [])
    assert sum(rx.stats[k] for k in IGNORED) == n, dict(rx.stats)


def raw_agent():
    return _nixl.agent(None, "raw")[1]


def say(agent, rx, kind, **fields):
    agent.send_notif(rx.name, _protocol.message(kind, **fields))


# -------------------------------------------------------------------- 1. malformed messages
JUNK = [b"offer:{not json", b"withdraw:\xff", b"begin:[]", b"done:null", b"abort:", b"x",
        b"\xff\xfe\xfd", b"done:" + b"[" * 50000, b'offer:{"xfer_id": 5}',
        b'withdraw:{"tag": ["a"]}', b'done:{"token": 7}', b"ok:{}", b"grant:{}",
        b'begin:"a string"', b"offer:" + "é".encode() * 10, b":{}", b"done:{}" + b" " * 100000]


def test_parse_never_raises_and_refuses_junk():
    for msg in JUNK + [None, 5, object(), b"done:1e999999", b"offer:" + b"{" * 10]:
        got = _protocol.parse(msg, _protocol.TO_RECEIVER)
        assert got is None or got[0] in _protocol.TO_RECEIVER
    assert _protocol.parse(b'done:{"xfer_id": "a", "token": "b"}', _protocol.TO_RECEIVER) == \
        ("done", {"xfer_id": "a", "token": "b"})
    assert _protocol.parse(b'done:{"xfer_id": "a"}', _protocol.TO_SENDER) is None  # not its kind
    assert _protocol.parse(b"done:{}" + b" " * (1 << 26), _protocol.TO_RECEIVER) is None  # too long
    assert _protocol.same_secret("ab", "ab") and not _protocol.same_secret("ab", "ac")
    assert not _protocol.same_secret(None, None) and not _protocol.same_secret(b"ab", "ab")


@pytest.mark.parametrize("push", [False, True])
def test_malformed_messages_between_completions_lose_nothing(push):
    """Junk of every kind in the same batch of notifications as legitimate offers, begins and
    dones: every completion is still reported, every arrival exact, every junk message counted
    and ignored, every page accounted for; the sender's own poll survives junk too."""
    rx, pool, pages = poisoned(128, push=push)
    tx = KVSender()
    try:
        sends, kvs, sent_junk = [], {}, 0
        for r, n in enumerate([5, 16, 33, 100, 64, 7]):
            kvs[r] = make_kv(600 + r, L, n, RB)
            t = rx.reserve(r, n)
            if r:  # (the first send loads the receiver's metadata; then junk around each)
                for j in JUNK[r::3]:
                    tx._agent.send_notif(rx.name, j)
                    sent_junk += 1
            sends.append(tx.send(t, kvs[r], wait=False))
            for j in JUNK[r + 1::4]:
                tx._agent.send_notif(rx.name, j)
                sent_junk += 1
        finish(rx, sends[0])  # (the receiver knows the sender now: junk to the sender, too)
        rx._agent.send_notif(tx.name, b"fail:{not json")
        rx._agent.send_notif(tx.name, b"\xff")
        for p in sends[1:]:
            finish(rx, p)
        got = {a.req_id: a for a in arrivals(rx, 0)}
        got.update((a.req_id, a) for a in arrivals(rx, len(kvs) - len(got)))
        assert sorted(got) == list(kvs) and rx.stats["done"] == len(kvs)
        assert rx.stats["malformed"] + rx.stats["unknown"] == sent_junk, dict(rx.stats)
        assert rx.stats["malformed"] == sum(_protocol.parse(j, _protocol.TO_RECEIVER) is None
                                            for r in range(1, 6) for j in JUNK[r::3] +
                                            JUNK[r + 1::4]) + len(JUNK[1::4])
        end = time.monotonic() + 10
        while tx.stats["unknown"] < 2:  # (read by the sender's next look, whenever it came)
            tx._word("no such tag")
            assert time.monotonic() < end, tx.stats
        used = np.zeros(pool.shape[1], bool)
        for r, a in got.items():
            rows = rows_of(a.pages, a.n_tokens)
            np.testing.assert_array_equal(pool[:, rows], kvs[r])
            used[rows] = True
            rx.release(a)
        assert (pool[:, ~used] == POISON).all()
        assert pages.free_pages == 128 and not rx.quarantined
        pages.check()
    finally:
        tx.close()
        rx.close()


# ------------------------------------------------- 2. sends after cancel / timeout / admission
@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize("end", ["cancel", "timeout", "admit"])
def test_a_send_after_its_reservation_ended_lands_nowhere(push, end):
    """A's reservation ends (cancelled, timed out, or arrived and admitted); B takes its pages
    at once; A's ticket sent again (a slow or repeated sender) is refused, its sender told why,
    and B's rows (and the admitted A's) stay exact."""
    clock = Clock()
    n = 3 * P  # the pool holds A's pages and the admitted request's, nothing more
    rx, pool, pages = poisoned(6 if end == "admit" else 3, push=push, clock=clock, timeout_s=5)
    cache, ledger = FakeCache(pool, pages), Ledger(pool)
    tx = KVSender()
    try:
        ta = rx.reserve("a", n)
        a_rows = ticket_rows(ta, pool)
        if end == "cancel":
            rx.cancel("a")
        elif end == "timeout":
            clock.t = 6
            assert rx.poll().timed_out == ["a"]
        else:
            send(tx, rx, ta, make_kv(1, L, n, RB))
            (a,) = arrivals(rx, 1)
            rid = rx.admit(cache, a)
            ledger.hold("a", pages.rows(rid), make_kv(1, L, n, RB))
        tb = rx.reserve("b", n)  # A's pages, reused at once (or, admitted, the rest)
        b_rows = ticket_rows(tb, pool)
        if end != "admit":
            assert sorted(b_rows) == sorted(a_rows)
        with pytest.raises(RuntimeError, match="the reservation ended"):
            send(tx, rx, ta, make_kv(2, L, n, RB))  # the late or repeated send
        ledger.check(free_rows=b_rows)  # nothing of A's late kv landed
        send(tx, rx, tb, make_kv(3, L, n, RB))
        (b,) = arrivals(rx, 1)
        ledger.hold("b", rows_of(b.pages, n), make_kv(3, L, n, RB))
        with pytest.raises(RuntimeError, match="the reservation ended"):
            send(tx, rx, ta, make_kv(2, L, n, RB))  # and again, now that B is in place
        ledger.check()
        assert rx.stats["late"] == 2 and not rx.quarantined
        rx.release(b)
        pages.check()
    finally:
        tx.close()
        rx.close()


# -------------------------------------------------- 3. a cancel during a large transfer
@pytest.fixture
def tcp_only(monkeypatch):
    """UCX over TCP for the agents made in the test: a large transfer stays in progress for
    a while (shared memory copies it inside the call that posts it). NIXL refuses a UCX_TLS
    without cuda_copy where a GPU is present (UCX warns that it is missing where none is)."""
    monkeypatch.setenv("UCX_TLS", "tcp,self,cuda_copy")


@pytest.mark.slow
@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize("end", ["cancel", "timeout"])
def test_a_cancel_during_a_large_transfer_quarantines_its_pages(tcp_only, push, end):
    """A 72 MiB request's READ (or granted WRITE) in progress when its reservation is
    cancelled or times out: its pages are not handed out (a reservation needing them is
    refused) until the transfer can write no more; then B takes them, and B's rows are exact
    (the late bytes of A landed before, never after)."""
    clock = Clock()
    rb, n = 4096, 6144  # 72 MiB
    rx, pool, pages = poisoned(n // P + 1, rb, push=push, clock=clock, timeout_s=30)
    tx = KVSender(desc_bytes=None)
    try:
        kv_a = make_kv(7, L, n, rb)
        ta = rx.reserve("a", n)
        p = tx.send(ta, kv_a, wait=False)
        end_t = time.monotonic() + 20
        while not rx.in_flight["a"] or rx._live["a"].writer is None or \
                (push and p._phase != "writing"):
            rx.poll()
            p.poll()
            assert time.monotonic() < end_t, "the transfer did not start"
        if end == "cancel":
            rx.cancel("a")
        else:
            clock.t = 31
            assert rx.poll().timed_out == ["a"]
        assert list(rx.quarantined) == [ta["xfer_id"]], "the transfer was not in progress"
        with pytest.raises(PoolExhausted):  # A's pages are not free
            rx.reserve("b", n)
        with pytest.raises(RuntimeError, match="cancelled|timed out"):
            finish(rx, p, wait_s=60)
        settle(rx, 60)
        assert pages.free_pages == pages.n_pages
        tb = rx.reserve("b", n)
        assert sorted(ticket_rows(tb, pool)) == sorted(ticket_rows(ta, pool))
        kv_b = make_kv(8, L, n, rb)
        send(tx, rx, tb, kv_b)
        (b,) = arrivals(rx, 1)
        time.sleep(0.2)  # (were any of A's bytes still on the way, they would land now)
        for _ in range(10):
            assert rx.poll() == ([], [], [])
        np.testing.assert_array_equal(pool[:, rows_of(b.pages, n)], kv_b)
        rx.release(b)
        assert rx.stats["quarantined"] == 1
        pages.check()
    finally:
        tx.close()
        rx.close()


@pytest.mark.slow
@pytest.mark.parametrize("push", [False, True])
def test_one_refused_send_leaves_the_others_to_its_receiver_going(tcp_only, push):
    """Five sends posted together to one receiver (over TCP: each stays in flight a while); the
    first is cancelled once granted (or its READ posted): it fails with the receiver's words,
    and the four others, started before and after its failure, all land byte exact (a refusal
    is not a stale receiver: the sender keeps its metadata)."""
    rb = 4096
    rx, pool, pages = poisoned(640, rb, push=push)
    tx = KVSender()
    try:
        kvs = {r: make_kv(700 + r, L, 1500 + 100 * r, rb) for r in range(5)}
        sends = [tx.send(rx.reserve(r, kv.shape[1]), kv, wait=False) for r, kv in kvs.items()]
        end = time.monotonic() + 10
        while 0 not in rx.in_progress:
            _poll(rx)
            sends[0].advance()
            assert time.monotonic() < end
        rx.cancel(0)
        with pytest.raises(RuntimeError, match="the receiver cancelled it|reservation ended"):
            finish(rx, sends[0])
        got = {}
        for p in sends[1:]:
            finish(rx, p)
        settle(rx)
        got.update((a.req_id, a) for a in arrivals(rx, 4))
        assert sorted(got) == [1, 2, 3, 4]
        for r, a in got.items():
            np.testing.assert_array_equal(pool[:, rows_of(a.pages, a.n_tokens)], kvs[r])
            rx.release(a)
        assert pages.free_pages == 640
        pages.check()
    finally:
        tx.close()
        rx.close()


def _heard(agent, rx, want_s=10.0):
    """The next control message to ``agent`` (a raw agent playing a sender), ``rx`` polled
    meanwhile: (kind, fields)."""
    end = time.monotonic() + want_s
    while time.monotonic() < end:
        for _, msgs in agent.get_new_notifs().items():
            for m in msgs:
                return _protocol.parse(m, _protocol.TO_SENDER)
        _poll(rx)
    raise AssertionError("no answer")


def test_the_same_node_paths_copies_are_granted_like_writes():
    """A receiver over a shared pool (a stand-in with a pool's name, identity and array; the
    sender's copies played by NumPy in this process): a copy's begin with the ticket's digest is
    granted and its done makes the arrival; a begin for a reservation cancelled and reused, or
    with a digest of another pool base (an altered ``shm``), is refused and its sender told; a
    receiver without a shared pool refuses copies."""
    import types

    from hisparse_cupy.host import _shm as host_shm

    pages = CountingPages(16, P)
    pool = np.full((L, 16 * P, RB), POISON, np.uint8)
    ident = (host_shm.node_id(), 1, 2)
    rx = KVReceiver(types.SimpleNamespace(numpy=pool, name="kv-test", identity=ident), pages)
    plain, _, _ = poisoned(16)
    raw = raw_agent()
    conn = _nixl.metadata(raw, keys=False)

    def begin(t, shm, tag, to=rx):
        say(raw, to, "begin", xfer_id=t["xfer_id"], token=t["token"], tag=tag, how="copy",
            verify=False, metadata=conn,
            digest=_protocol.digest(L, t["n_tokens"], RB, np.asarray(t["descs"], np.uint64), shm))

    try:
        ta = rx.reserve("a", 40)
        shm = ta["shm"]
        raw.add_remote_agent(base64.b64decode(ta["metadata"]))
        begin(ta, shm, "a/0")
        assert _heard(raw, rx) == ("grant", {"tag": "a/0"})
        kv = make_kv(40, L, 40, RB)
        pool[:, ticket_rows(ta, pool)] = kv  # the sender's copies
        say(raw, rx, "done", xfer_id=ta["xfer_id"], token=ta["token"], tag="a/0",
            digest=_protocol.digest(L, 40, RB, np.asarray(ta["descs"], np.uint64), shm))
        assert _heard(raw, rx) == ("ok", {"tag": "a/0"})
        (a,) = arrivals(rx, 1)
        tb = rx.reserve("b", 20)
        rx.cancel("b")
        tc = rx.reserve("c", 20)  # b's pages, at once
        assert sorted(ticket_rows(tc, pool)) == sorted(ticket_rows(tb, pool))
        begin(tb, shm, "b/0")
        kind, f = _heard(raw, rx)
        assert kind == "fail" and "ended (cancelled)" in f["why"]
        begin(tc, {**shm, "base": shm["base"] + RB}, "c/0")  # an altered shm's digest
        kind, f = _heard(raw, rx)
        failed = failures(rx)
        assert [r for r, _ in failed] == ["c"] and "altered" in failed[0][1]
        assert kind == "fail" and "altered" in f["why"]
        tp = plain.reserve("p", 10)  # a receiver without a shared pool takes no copies
        raw.add_remote_agent(base64.b64decode(tp["metadata"]))
        begin(tp, None, "p/0", to=plain)
        failed = failures(plain)
        assert [r for r, _ in failed] == ["p"] and "no 'copy' writes" in failed[0][1]
        assert (pool[:, ticket_rows(tc, pool)] == POISON).all()
        np.testing.assert_array_equal(pool[:, rows_of(a.pages, 40)], kv)
        rx.release(a)
        assert pages.free_pages == 16 and not rx.quarantined
        pages.check()
    finally:
        rx.close()
        plain.close()


# ------------------------------------------------------------------- 4. altered tickets
def _cut(t, n_new):
    """``t`` cut to its first ``n_new`` tokens, its runs and descriptors cut to match."""
    runs, descs, rb = [], [], t["row_bytes"]
    left = n_new
    for f, c in t["runs"]:
        if left <= 0:
            break
        runs.append([f, min(c, left)])
        left -= min(c, left)
    R = len(t["runs"])
    for layer in range(t["n_layers"]):
        for j, (_, c) in enumerate(runs):
            descs.append([t["descs"][layer * R + j][0], c * rb])
    return {**t, "n_tokens": n_new, "runs": runs, "descs": descs}


def _widen(t, more):
    """``t`` widened by ``more`` tokens: a run appended to every layer, just past its last."""
    R, rb, n = len(t["runs"]), t["row_bytes"], t["n_tokens"]
    descs = []
    for layer in range(t["n_layers"]):
        mine = t["descs"][layer * R: (layer + 1) * R]
        descs += mine + [[mine[-1][0] + mine[-1][1], more * rb]]
    return {**t, "n_tokens": n + more, "runs": t["runs"] + [[n, more]], "descs": descs}


def _alterations(t, other):
    R = len(t["runs"])
    move = other["descs"][0][0] - t["descs"][0][0]
    return {
        "cut to fewer tokens": _cut(t, t["n_tokens"] - 3),
        "cut to fewer layers": {**t, "n_layers": 2, "descs": t["descs"][: 2 * R]},
        "widened by a page": _widen(t, P),
        "row_bytes doubled": {**t, "row_bytes": 2 * RB,
                              "descs": [[a, 2 * b] for a, b in t["descs"]]},
        "shifted by a byte": {**t, "descs": [[a + 1, b] for a, b in t["descs"]]},
        "redirected to another request's pages": {**t, "descs": [[a + move, b]
                                                                  for a, b in t["descs"]]},
    }


@pytest.mark.parametrize("push", [False, True])
def test_altered_tickets_land_nothing_outside_the_reservation(push):
    """A ticket cut, widened, shifted or redirected by a buggy sender: a pull lands only where
    the receiver's own descriptors say (or its offer is refused), a write's begin is refused
    (its digest is not the reservation's); either way no byte outside the reservation changes,
    the other request's rows stay exact, and pages are accounted for."""
    rx, pool, pages = poisoned(64, push=push)
    ledger = Ledger(pool)
    tx = KVSender()
    try:
        tk = rx.reserve("keep", 40)
        send(tx, rx, tk, make_kv(9, L, 40, RB))
        (k,) = arrivals(rx, 1)
        ledger.hold("keep", rows_of(k.pages, 40), make_kv(9, L, 40, RB))
        for i, (what, _) in enumerate(_alterations(tk, tk).items()):
            t = rx.reserve(i, 30)
            bad = _alterations(t, tk)[what]
            n_bad = bad["n_tokens"]
            kv = make_kv(20 + i, bad["n_layers"], n_bad, bad["row_bytes"])
            try:
                got = send(tx, rx, bad, kv, timeout_s=5)
            except (RuntimeError, ValueError) as e:
                got = e
            if isinstance(got, Exception):  # refused: the reservation failed or is live
                failed = failures(rx, 0.01)  # (its failure, if the receiver refused it)
                assert [r for r, _ in failed] in ([], [i])
                if i in rx.in_flight:
                    rx.cancel(i)
                ledger.check(free_rows=ticket_rows(t, pool))
                continue
            # landed: only a pull (its READ uses the receiver's own descriptors, whatever the
            # ticket's addresses say), only into its own pages, only when the sizes match
            assert not push and what in ("shifted by a byte",
                                         "redirected to another request's pages"), what
            (a,) = arrivals(rx, 1)
            np.testing.assert_array_equal(pool[:, rows_of(a.pages, 30)], kv)
            ledger.check()
            rx.release(a)
            pool[:, rows_of(a.pages, 30)] = POISON  # (free again: the next may take them)
        ledger.check()
        rx.release(k)
        assert pages.free_pages == 64 and not rx.quarantined
        pages.check()
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("push", [False, True])
def test_a_bare_or_forged_notification_completes_nothing(push):
    """A done with the ticket's token but no grant (or for a pull), a done, withdraw, abort or
    offer carrying another reservation's transfer id with this ticket's token, a guessed id:
    each counted and ignored; both reservations then arrive exact through their real sends.
    Transfer ids and tokens are 128 random bits, unrelated from one reservation to the next."""
    rx, pool, pages = poisoned(64, push=push)
    tx = KVSender()
    raw = raw_agent()
    try:
        ta, tb = rx.reserve("a", 20), rx.reserve("b", 30)
        ids = [rx.reserve(f"x{i}", 1)["xfer_id"] for i in range(4)] + [ta["xfer_id"]]
        toks = [ta["token"], tb["token"]]
        for x in ids + toks:
            assert len(x) == 32 and int(x, 16) >= 0
        assert len(set(ids + toks)) == len(ids) + 2 and not any(
            a[:8] == b[:8] for a in ids for b in ids if a != b)  # no shared prefix
        raw.add_remote_agent(base64.b64decode(ta["metadata"]))
        digest = _protocol.digest(L, 20, RB, np.asarray(ta["descs"], np.uint64), None)
        said = [("done", ta["xfer_id"], ta["token"], {"digest": digest}),  # bare
                ("done", tb["xfer_id"], ta["token"], {}),  # another's id, this token
                ("withdraw", tb["xfer_id"], ta["token"], {}),
                ("abort", tb["xfer_id"], ta["token"], {}),
                ("offer", tb["xfer_id"], ta["token"], {"descs": tb["descs"]}),
                ("done", rx.instance + ".1", ta["token"], {}),  # a guessed id
                ("withdraw", ta["xfer_id"] + "/0", None, {})]
        for kind, xid, tok, more in said:
            say(raw, rx, kind, xfer_id=xid, tag=f"{xid}/0", **({"token": tok} if tok else {}),
                **more)
        counted(rx, len(said))
        assert rx.stats["forged"] == 4 and rx.stats["refused"] == 1, dict(rx.stats)
        assert rx.stats["unknown"] == 2 and sorted(rx.in_flight)[:2] == ["a", "b"]
        ledger = Ledger(pool)
        for t, seed in ((ta, 1), (tb, 2)):
            kv = make_kv(seed, L, t["n_tokens"], RB)
            send(tx, rx, t, kv)
            (a,) = arrivals(rx, 1)
            ledger.hold(t["req_id"], rows_of(a.pages, t["n_tokens"]), kv)
        ledger.check()
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("push", [False, True])
def test_verify_refuses_rows_that_do_not_match_the_senders_sums(push, monkeypatch):
    """``verify=True``: a verified arrival is exact; sums that do not match the rows that
    landed (here the sender's sums of other bytes) fail the reservation and give its pages
    back; a ticket that asks for sums and a sender that sends none: refused."""
    rx, pool, pages = poisoned(64, push=push, verify=True)
    tx = KVSender()
    try:
        kv = make_kv(30, L, 50, RB)
        t = rx.reserve("ok", 50)
        assert t["verify"] is True
        send(tx, rx, t, kv)
        (a,) = arrivals(rx, 1)
        np.testing.assert_array_equal(pool[:, rows_of(a.pages, 50)], kv)
        rx.release(a)
        real = _sums.kv_sums
        monkeypatch.setattr(_sums, "kv_sums", lambda x: real(x[:, ::-1].copy()))  # rows moved
        t = rx.reserve("bad", 50)
        with pytest.raises(RuntimeError, match="do not match the sender's checksums"):
            send(tx, rx, t, kv)
        monkeypatch.setattr(_sums, "kv_sums", lambda x: None)  # no sums at all
        t = rx.reserve("none", 50)
        with pytest.raises(RuntimeError, match="sums|verify"):
            send(tx, rx, t, kv)
        assert [r for r, _ in failures(rx, 0.1)] in ([], ["bad", "none"], ["none"])
        assert rx.stats["failed"] == 2 and not rx.in_flight
        settle(rx)
        assert pages.free_pages == 64
        pages.check()
    finally:
        tx.close()
        rx.close()


# --------------------------------------------------------------- 5. raw NIXL agents
def test_a_pull_tickets_metadata_reaches_no_memory_of_the_receiver():
    """The default (pull) ticket carries the receiver's connection details only: a raw NIXL
    agent holding it can notify, but NIXL refuses every WRITE or READ it builds into the pool
    (the reservation's pages or any other). A push ticket carries the pool's keys: there a raw
    agent can build one (the documented boundary: push senders are trusted)."""
    rx, pool, pages = poisoned(16)
    rx_push, pool_push, _ = poisoned(16, push=True)
    raw = raw_agent()
    src = np.full(4 * RB, 7, np.uint8)
    reg = raw.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    try:
        t = rx.reserve("a", 20)
        assert t["mode"] == "pull"
        assert raw.add_remote_agent(base64.b64decode(t["metadata"])).decode() == rx.name
        local = _nixl.xfer_descs(raw, np.array([[src.ctypes.data, 4 * RB]], np.uint64), 0,
                                 "DRAM")
        for addr in (t["descs"][0][0], pool.ctypes.data, pool.ctypes.data + pool.nbytes // 2):
            remote = _nixl.xfer_descs(raw, np.array([[addr, 4 * RB]], np.uint64), 0, "DRAM")
            for op in ("WRITE", "READ"):
                with pytest.raises(Exception, match="NOT_FOUND|not found|NotFound"):
                    raw.initialize_xfer(op, local, remote, rx.name, b"")
        raw.send_notif(rx.name, b"hello")  # it can notify (counted, ignored)
        counted(rx, 1)
        assert rx.stats["malformed"] == 1
        assert (pool == POISON).all()
        tp = rx_push.reserve("a", 20)
        assert tp["mode"] == "push"
        raw.add_remote_agent(base64.b64decode(tp["metadata"]))
        remote = _nixl.xfer_descs(raw, np.array([[pool_push.ctypes.data, 4 * RB]], np.uint64),
                                  0, "DRAM")
        h = raw.initialize_xfer("WRITE", local, remote, rx_push.name, b"")
        raw.release_xfer_handle(h)
    finally:
        raw.deregister_memory(reg)
        rx.close()
        rx_push.close()


def test_an_offers_metadata_reaches_only_its_kv():
    """A pull's offer carries the keys of ``kv``'s registration alone: a receiver (here a raw
    agent holding that metadata) can read ``kv`` and nothing else the sender registered."""
    sender, raw = raw_agent(), raw_agent()
    a, b = np.full(4096, 1, np.uint8), np.full(4096, 2, np.uint8)
    reg_a = sender.register_memory([(a.ctypes.data, a.nbytes, 0, "")], "DRAM")
    reg_b = sender.register_memory([(b.ctypes.data, b.nbytes, 0, "")], "DRAM")
    dst = np.zeros(4096, np.uint8)
    reg_d = raw.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    try:
        name = raw.add_remote_agent(base64.b64decode(_nixl.metadata(sender, reg_a)))
        local = _nixl.xfer_descs(raw, np.array([[dst.ctypes.data, 4096]], np.uint64), 0, "DRAM")
        h = raw.initialize_xfer("READ", local, _nixl.xfer_descs(
            raw, np.array([[a.ctypes.data, 4096]], np.uint64), 0, "DRAM"), name, b"")
        raw.transfer(h)
        end = time.monotonic() + 10
        while raw.check_xfer_state(h) == "PROC":
            assert time.monotonic() < end
        assert (dst == 1).all()
        raw.release_xfer_handle(h)
        with pytest.raises(Exception, match="NOT_FOUND|not found|NotFound"):
            raw.initialize_xfer("READ", local, _nixl.xfer_descs(
                raw, np.array([[b.ctypes.data, 4096]], np.uint64), 0, "DRAM"), name, b"")
    finally:
        for ag, r in ((sender, reg_a), (sender, reg_b), (raw, reg_d)):
            ag.deregister_memory(r)


# ------------------------------------------------------- all of it, mixed with real traffic
@pytest.mark.slow
def test_hostile_traffic_mixed_with_real_requests_at_random(rng):
    """Rounds of up to 5 real requests (pulls and granted WRITEs, some verified) mixed at
    random with a peer's faults: junk, forged and guessed messages, stale resends of ended
    tickets, altered tickets, cancels mid-flight; after every round every admitted request's
    rows are exact, every free row that nothing legitimate wrote since is still poison, and
    every page is accounted for; at the end nothing is quarantined or held."""
    clock = Clock()
    pages = CountingPages(96, P)
    pool = np.full((L, 96 * P, RB), POISON, np.uint8)
    rx = KVReceiver(pool, pages, push=True, clock=clock, timeout_s=30)
    cache, ledger = FakeCache(pool, pages), Ledger(pool)
    tx, puller, raw = KVSender(), KVSender(pull=True), raw_agent()
    raw_known, ended, live, req, faults = False, [], {}, 0, 0
    try:
        for _ in range(14):
            kvs, sends, cancelled = {}, [], []
            for _ in range(int(rng.integers(1, 6))):
                n = int(rng.integers(1, 120))
                t = rx.reserve(req, n, verify=bool(rng.random() < 0.3))
                kvs[req] = make_kv(1000 + req, L, n, RB)
                if not raw_known:
                    raw.add_remote_agent(base64.b64decode(t["metadata"]))
                    raw_known = True
                fault = rng.integers(0, 6)
                faults += 1
                if fault == 0:  # junk and guessed ids
                    for j in rng.choice(len(JUNK), 3):
                        raw.send_notif(rx.name, JUNK[j])
                    say(raw, rx, "done", xfer_id=os.urandom(16).hex(), token=t["token"])
                elif fault == 1 and ended:  # a stale resend of an ended ticket
                    old = ended[int(rng.integers(len(ended)))]
                    p = (tx if rng.random() < 0.5 else puller).send(
                        old, make_kv(7, L, old["n_tokens"], RB), wait=False)
                    with pytest.raises((RuntimeError, TimeoutError)):
                        finish(rx, p, 10)
                elif fault == 2:  # forged: this ticket's token on another id, a bare done
                    other = ended[-1]["xfer_id"] if ended else t["xfer_id"][::-1]
                    say(raw, rx, "done", xfer_id=other, token=t["token"], tag="z")
                    say(raw, rx, "abort", xfer_id=t["xfer_id"], token=t["token"][::-1])
                    say(raw, rx, "done", xfer_id=t["xfer_id"], token=t["token"], tag="z")
                elif fault == 3:  # an altered ticket (the real one is cancelled after)
                    what = list(_alterations(t, t))[int(rng.integers(6))]
                    bad = _alterations(t, t)[what]
                    if what not in ("shifted by a byte",
                                    "redirected to another request's pages"):
                        kv = make_kv(5, bad["n_layers"], bad["n_tokens"], bad["row_bytes"])
                        with pytest.raises((RuntimeError, ValueError, TimeoutError)):
                            send(tx, rx, bad, kv, timeout_s=5)
                elif fault == 4:  # cancelled before or while its sender sends
                    cancelled.append(req)
                s = (tx if rng.random() < 0.5 else puller).send(t, kvs[req], wait=False) \
                    if req not in cancelled else None
                if req in cancelled:
                    rx.cancel(req)
                    ended.append(t)
                elif s is not None:
                    sends.append((s, t))
                req += 1
            for s, t in sends:
                try:
                    finish(rx, s, 20)
                except (RuntimeError, TimeoutError):  # failed by a fault: the pages went back
                    assert t["req_id"] not in rx.in_flight
                ended.append(t)
            _poll(rx)
            got = {a.req_id: a for a in _take(rx, "done")}
            _take(rx, "failed")
            assert _take(rx, "timed_out") == []
            for r in list(rx.in_flight):
                rx.cancel(r)
            settle(rx)
            for r, a in got.items():
                np.testing.assert_array_equal(pool[:, rows_of(a.pages, a.n_tokens)], kvs[r])
                rid = rx.admit(cache, a)
                live[rid] = r
                ledger.hold(rid, pages.rows(rid), kvs[r])
            ledger.check()
            for rid in list(live):
                if rng.random() < 0.4:
                    pages.release(rid)
                    ledger.drop(rid)
                    del live[rid]
            pages.check()
            clock.t += 1
        assert faults >= 14 and rx.stats["done"] >= 10
        assert not rx.in_flight and not rx.quarantined and pages.held.sum() == 0
        for key in ("forged", "late", "malformed"):
            assert rx.stats[key] > 0, (key, dict(rx.stats))
    finally:
        tx.close()
        puller.close()
        rx.close()


def test_a_copy_ticket_naming_another_shared_pool_is_refused():
    """The same-node path writes the pool the ticket *names* (attached by name and identity)
    at the rows its descriptors give: a ticket whose ``shm`` names another pool of the same
    shape on the node, with this pool's base and descriptors kept, would land the copies in that
    other pool's rows while this receiver counted an arrival nobody wrote. Its begin carries
    the digest the sender computes from the ticket it holds: refused as altered, nothing
    granted, the pages untouched."""
    import types

    from hisparse_cupy.host import _shm as host_shm

    pages = CountingPages(16, P)
    pool = np.full((L, 16 * P, RB), POISON, np.uint8)
    rx = KVReceiver(types.SimpleNamespace(numpy=pool, name="kv-a", identity=(
        host_shm.node_id(), 1, 2)), pages)
    raw = raw_agent()
    conn = _nixl.metadata(raw, keys=False)
    try:
        for field, value in (("name", "kv-b"), ("identity", [host_shm.node_id(), 3, 4]),
                             ("bytes", pool.nbytes + P * RB)):
            t = rx.reserve(field, 20)
            raw.add_remote_agent(base64.b64decode(t["metadata"]))
            other = _protocol.check_ticket({**t, "shm": {**t["shm"], field: value}})
            say(raw, rx, "begin", xfer_id=t["xfer_id"], token=t["token"], tag=f"{field}/0",
                how="copy", verify=False, metadata=conn,
                digest=_protocol.ticket_digest(other))
            kind, f = _heard(raw, rx)
            assert kind == "fail" and "altered" in f["why"], (field, kind, f)
            assert [r for r, _ in failures(rx)] == [field]
            assert (pool[:, ticket_rows(t, pool)] == POISON).all()
        assert not rx.in_progress and pages.free_pages == 16 and not rx.quarantined
        pages.check()
    finally:
        rx.close()
