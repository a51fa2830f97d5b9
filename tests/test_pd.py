"""Prefill -> decode over NIXL (``hisparse_cupy.pd``), on the CPU: DRAM -> DRAM over UCX.

100 requests of mixed sizes with several in flight (one process, two agents), a sender in
another process, and the faults: bad kv, bad or stale tickets and metadata, duplicate, late and
unknown notifications, timeouts, a cancelled reservation, a sender killed mid-transfer. After
each, pages are accounted for (every page put back exactly once) and the other requests' rows
are checked byte for byte. The hostile peer's cases (malformed, forged, stale, altered and bare
messages, raw NIXL agents, cancels during a transfer) are in ``test_pd_trust.py``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import types
import weakref
from pathlib import Path

import numpy as np
import pytest

from hisparse_cupy.host._pages import HostPages, PoolExhausted
from hisparse_cupy.pd import _protocol

try:
    from hisparse_cupy.pd import KVReceiver, KVSender, nixl_api

    nixl_api()
except ImportError as e:
    pytest.skip(f"NIXL is not installed: {e}", allow_module_level=True)

from _pd_peer import host_zeros, make_kv  # noqa: E402

L, P, RB = 3, 16, 64
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_pd_peer.py")


class CountingPages(HostPages):
    """HostPages that counts each page's takes and puts: every take is matched by exactly one
    put when ``takes - puts == held`` (a put too many would drop another holder's hold)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.takes = np.zeros(self.n_pages, np.int64)
        self.puts = np.zeros(self.n_pages, np.int64)

    def take(self, n):
        got = super().take(n)
        self.takes[got] += 1
        return got

    def put(self, pages):
        super().put(pages)
        self.puts[np.asarray(pages, np.int64)] += 1

    def check(self):
        super().check()
        assert (self.takes - self.puts == self.held).all()


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeCache:
    """What a paged HotBufferCache.admit does to the host pool, on the host only."""

    def __init__(self, pool, pages):
        self.pool, self.pages, self.next = pool, pages, 0

    def admit(self, n, kv=None, pages=None, stream=None):
        rid, self.next = self.next, self.next + 1
        self.pages.admit(rid, n, pages=pages)
        shared = 0 if pages is None else len(pages) * P
        assert (kv is None) == (shared == n) and (kv is None or kv.shape[1] == n - shared)
        if kv is not None:
            self.pool[:, self.pages.rows(rid, shared, n)] = kv
        return rid


def rows_of(pages, n):
    t = np.arange(n)
    return np.asarray(pages, np.int64)[t // P] * P + t % P


def ticket_rows(t, pool):
    """The pool rows a ticket's layer-0 descriptors name, token after token."""
    base, rb = pool.ctypes.data, pool.shape[2]
    return np.concatenate([np.arange((a - base) // rb, (a - base + n) // rb)
                           for a, n in t["descs"][: len(t["runs"])]])


# receiver -> what its polls inside send() / finish() found (weak: a receiver gone takes its
# entry along; keyed by id(), a later receiver at the same address read an earlier one's)
_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _poll(rx):
    """One poll of ``rx``; what it found is kept for :func:`arrivals` and :func:`failures`."""
    polled = rx.poll()
    seen = _SEEN.setdefault(rx, {"done": [], "failed": [], "timed_out": []})
    for k in seen:
        seen[k] += getattr(polled, k)
    return polled


def _take(rx, what):
    seen = _SEEN.get(rx, {})
    got, seen[what] = seen.get(what, []), []
    return got


def finish(rx, p, wait_s=20.0):
    """Poll ``rx`` and send ``p`` until ``p`` ends: its :class:`Sent` (its error raised)."""
    end = time.monotonic() + wait_s
    while not p.poll():
        _poll(rx)
        if time.perf_counter() > p.deadline:
            return p.wait(timeout_s=1e-6)  # (its deadline's handling: TimeoutError)
        assert time.monotonic() < end, "the send did not end"
    return p.result


def settle(rx, wait_s=10.0):
    """Poll ``rx`` until no transfer is quarantined (its READs in progress end)."""
    end = time.monotonic() + wait_s
    while rx.quarantined:
        _poll(rx)
        assert time.monotonic() < end, rx.quarantined


def send(s, rx, t, kv, **kw):
    """``s.send(t, kv)`` with ``rx`` polled meanwhile (one thread drives both)."""
    return finish(rx, s.send(t, kv, wait=False, **kw))


def arrivals(rx, want, wait_s=10.0):
    """Poll until ``want`` arrivals (or ``wait_s``); asserts that nothing timed out or failed."""
    got, end = _take(rx, "done"), time.monotonic() + wait_s
    assert _take(rx, "timed_out") == [] and _take(rx, "failed") == []
    while len(got) < want and time.monotonic() < end:
        polled = rx.poll()
        assert polled.timed_out == [] and polled.failed == [], polled
        got += polled.done
    return got


@pytest.fixture(scope="module")
def tx():
    s = KVSender()  # a pull, or a WRITE for a KVReceiver(push=True)'s ticket
    yield s
    s.close()


def receiver(n_pages=64, rb=RB, **kw):
    pages = CountingPages(n_pages, P)
    pool = host_zeros((L, n_pages * P, rb))  # (pages of its own: _pd_peer.host_zeros)
    return KVReceiver(pool, pages, **kw), pool, pages


class Peer:
    """A sender in a child process (tests/_pd_peer.py), spoken to in JSON lines."""

    def __init__(self):
        env = dict(os.environ, NIXL_LOG_LEVEL="WARN")
        self.p = subprocess.Popen([sys.executable, PEER, "send"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.buf, self.log = b"", []
        assert "ready" in self.read()

    def read(self, timeout=20.0, rx=None):
        """The child's next answer; ``rx`` (the receiver it sends to) is polled meanwhile."""
        end = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                if line.startswith(b"@pd "):
                    return json.loads(line[4:])
                self.log.append(line.decode(errors="replace"))
            left = end - time.monotonic()
            assert left > 0, f"no answer from the sender process; its output: {self.log}"
            if rx is not None:
                _poll(rx)
            if select.select([self.p.stdout], [], [], left if rx is None else 0.001)[0]:
                chunk = os.read(self.p.stdout.fileno(), 65536)
                assert chunk, f"the sender process exited; its output: {self.log}"
                self.buf += chunk

    def ask(self, rx=None, **msg):
        self.tell(**msg)
        return self.read(rx=rx)

    def tell(self, **msg):
        self.p.stdin.write((json.dumps(msg) + "\n").encode())
        self.p.stdin.flush()

    def close(self):
        try:
            self.p.stdin.write(b'{"quit": true}\n')
            self.p.stdin.close()
            self.p.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait(10)


# ---------------------------------------------------------------------- transfers
@pytest.mark.slow
@pytest.mark.parametrize("push", [False, True])
def test_100_requests_several_in_flight(tx, rng, push):
    """Mixed sizes, up to 8 reserved at once, sent in random order (some one at a time, some
    posted together and driven to the end in another order), by pulls (the receiver READs) or
    granted WRITEs, admitted as they arrive; every admitted request's rows exact; pages
    accounted for; random releases fragment the pool so requests span several runs."""
    rx, pool, pages = receiver(256, push=push)
    cache = FakeCache(pool, pages)
    kvs, live, nbytes, wall, runs, req = {}, {}, 0, 0.0, 0, 0
    while req < 100:
        k = min(int(rng.integers(1, 9)), 100 - req)
        tickets = []
        for _ in range(k):
            n = int(rng.integers(1, 301))
            kvs[req] = make_kv(req, L, n, RB)
            tickets.append(rx.reserve(req, n))
            req += 1
        rng.shuffle(tickets)
        posted, t0 = [], time.perf_counter()
        for t in tickets:
            runs = max(runs, len(t["runs"]))
            if rng.random() < 0.5:
                nbytes += send(tx, rx, t, kvs[t["req_id"]]).bytes
            else:
                posted.append(tx.send(t, kvs[t["req_id"]], wait=False))
        nbytes += sum(finish(rx, p).bytes for p in posted[::-1])
        assert all(p.kind == ("write" if push else "pull") for p in posted)
        got = arrivals(rx, len(tickets))
        wall += time.perf_counter() - t0
        assert sorted(a.req_id for a in got) == sorted(t["req_id"] for t in tickets)
        for a in got:
            np.testing.assert_array_equal(pool[:, rows_of(a.pages, a.n_tokens)], kvs[a.req_id])
            live[rx.admit(cache, a)] = a.req_id
        for rid in list(live):  # free some, so that later reservations get scattered pages
            if rng.random() < 0.4:
                pages.release(rid)
                del live[rid]
        pages.check()
    assert rx.stats["done"] == 100 and not rx.in_flight and runs > 1
    for rid, req in live.items():
        np.testing.assert_array_equal(pool[:, pages.rows(rid)], kvs[req])
    assert pages.held.sum() == 0
    pages.check()
    print(f"\n100 requests (1-300 tokens), {nbytes / 2**20:.1f} MiB: {nbytes / wall / 1e9:.3f} "
          f"GB/s (send -> arrival, DRAM -> DRAM, one process, {'push' if push else 'pull'})")
    rx.close()


@pytest.mark.slow
def test_a_sender_in_another_process(rng):
    """30 small requests of mixed sizes, 5 in flight at a time, then 4 large ones (6 MiB)."""
    peer = Peer()
    try:
        for rb, n_pages, sizes, push in [(RB, 128, rng.integers(1, 301, 30), True),
                                         (8192, 64, [256] * 4, False)]:
            rx, pool, pages = receiver(n_pages, rb, push=push)
            nbytes, secs = [], []
            for i in range(0, len(sizes), 5):
                tickets = [rx.reserve(i + j, int(n)) for j, n in enumerate(sizes[i: i + 5])]
                rng.shuffle(tickets)
                for t in tickets:
                    ans = peer.ask(rx, ticket=t, seed=t["req_id"])
                    assert "error" not in ans, ans
                    nbytes.append(ans["bytes"])
                    secs.append(ans["seconds"])
                got = arrivals(rx, len(tickets))
                assert len(got) == len(tickets)
                for a in got:
                    np.testing.assert_array_equal(pool[:, rows_of(a.pages, a.n_tokens)],
                                                  make_kv(a.req_id, L, a.n_tokens, rb))
                    rx.release(a)
            assert rx.stats["done"] == len(sizes) and pages.free_pages == n_pages
            pages.check()
            rx.close()
            print(f"\n{len(sizes)} requests from another process, {sum(nbytes) / 2**20:.1f} MiB "
                  f"({rb}-byte rows): {sum(nbytes) / sum(secs) / 1e9:.3f} GB/s; median send "
                  f"{np.median(secs) * 1e3:.2f} ms")
    finally:
        peer.close()


def test_descriptors_cut_into_pieces_land_whole_and_notify_once(rng):
    """KVSender(desc_bytes=): every descriptor cut into pieces (here of 3 rows and 8 bytes:
    pieces end inside rows); each request arrives byte exact, once; bad sizes are refused."""
    from hisparse_cupy.pd._nixl import cut as _cut

    d = np.array([[1000, 250, 0], [5000, 100, 0], [9000, 1, 0]], np.uint64)
    got = _cut(d, 100)
    assert got[:, 0].tolist() == [1000, 1100, 1200, 5000, 9000]
    assert got[:, 1].tolist() == [100, 100, 50, 100, 1] and (got[:, 2] == 0).all()
    rx, pool, pages = receiver(64, push=True)
    s = KVSender(desc_bytes=3 * RB + 8, pull=False)
    try:
        assert KVSender.__init__.__kwdefaults__["desc_bytes"] == 3 << 20
        want = {}
        for r, n in enumerate([1, 37, 64, 200, 130]):
            kv = make_kv(50 + r, L, n, RB)
            assert send(s, rx, rx.reserve(r, n), kv).bytes == kv.size
            want[r] = kv
        arrived = arrivals(rx, len(want))
        assert sorted(a.req_id for a in arrived) == list(want)
        for a in arrived:
            rows = (np.asarray(a.pages)[:, None] * P + np.arange(P)).ravel()[:a.n_tokens]
            np.testing.assert_array_equal(pool[:, rows], want[a.req_id])
        time.sleep(0.2)
        assert not rx.poll().done and rx.stats["done"] == len(want)
        assert rx.stats["duplicate"] == 0 and rx.stats["unknown"] == 0
    finally:
        s.close()
        rx.close()
    for bad in (0, -1, 1.5):
        with pytest.raises((ValueError, TypeError), match="desc_bytes"):
            KVSender(desc_bytes=bad)


def test_ucx_backend_parameters_reach_both_agents_and_bad_ones_are_refused():
    """``ucx_params`` (NIXL's UCX backend parameters) start both agents with them, and the
    sends still land byte exact; a name the backend does not take, or a value that is not an
    int or str, is refused naming ``ucx_params`` before any agent starts."""
    rx, pool, pages = receiver(16, ucx_params={"num_workers": 2}, push=True)
    s = KVSender(ucx_params={"num_workers": "2", "num_threads": 2})
    try:
        assert s._agent.get_backend_params("UCX")["num_workers"] == "2"
        assert rx._agent.get_backend_params("UCX")["num_workers"] == "2"
        want = {r: make_kv(70 + r, L, n, RB) for r, n in enumerate([5, 40, 80])}
        for r, kv in want.items():
            send(s, rx, rx.reserve(r, kv.shape[1]), kv)
        got = arrivals(rx, len(want))
        assert sorted(a.req_id for a in got) == list(want)
        for a in got:
            np.testing.assert_array_equal(pool[:, rows_of(a.pages, a.n_tokens)], want[a.req_id])
    finally:
        s.close()
        rx.close()
    for bad, err, what in [({"num_worker": 2}, ValueError, r"\['num_worker'\]"),
                           ({"num_workers": True}, TypeError, "int or str"),
                           ({"num_workers": 1.5}, TypeError, "int or str"),
                           ([("num_workers", 2)], TypeError, "dict")]:
        with pytest.raises(err, match=f"ucx_params.*{what}|{what}.*ucx_params"):
            KVSender(ucx_params=bad)
    with pytest.raises(RuntimeError, match="ucx_params"):
        KVSender(ucx_params={"num_workers": "many"})


def test_a_shared_pools_ticket_names_it_and_is_checked(tx):
    """A receiver over a shared pool (a stand-in with a HostKVPool's name, identity and
    numpy) puts ``shm`` in its tickets; host memory ``kv`` still goes over NIXL (the same-node
    path is GPU memory's), byte exact; an ``shm`` that is not a pool's, or that does not hold
    every descriptor, is refused naming ``ticket['shm']`` before any transfer."""
    from hisparse_cupy.host import _shm as host_shm

    pages = CountingPages(8, P)
    pool = host_zeros((L, 8 * P, RB))
    ident = [host_shm.node_id(), 1, 2]
    stand_in = types.SimpleNamespace(numpy=pool, name="kv-test", identity=tuple(ident))
    rx = KVReceiver(stand_in, pages)
    try:
        t = rx.reserve("a", 20)
        assert t["shm"] == {"name": "kv-test", "identity": ident, "base": pool.ctypes.data,
                            "bytes": pool.nbytes}
        assert "shm" not in receiver(4)[0].reserve(0, 1)  # a NumPy pool: none
        kv = make_kv(5, L, 20, RB)
        copied = tx.stats["copied"]
        top = max(a + n for a, n in t["descs"])  # the end of the highest descriptor
        for change in ({"name": 7}, {"identity": [1, 2]}, {"base": -1}, {"bytes": RB},
                       {"bytes": top - t["shm"]["base"] - 1}, {"base": top - RB}):
            with pytest.raises(ValueError, match=r"ticket\['shm'\]"):
                tx.send({**t, "shm": {**t["shm"], **change}}, kv)
        with pytest.raises(ValueError, match=r"ticket\['shm'\]"):
            tx.send({**t, "shm": "kv-test"}, kv)
        time.sleep(0.05)
        assert not rx.poll().done and not pool.any()
        send(tx, rx, t, kv)
        (a,) = arrivals(rx, 1)
        np.testing.assert_array_equal(pool[:, rows_of(a.pages, 20)], kv)
        assert tx.stats["copied"] == copied  # host memory: over NIXL
        rx.release(a)
        # GPU kv would try the pool: one that cannot be attached is tried once, then NIXL
        gone = {**t, "shm": {**t["shm"], "name": f"hs-none-{os.getpid()}"}}
        missed = tx.stats["not_attached"]
        assert tx._local_pool(gone) is None and tx._local_pool(gone) is None
        assert tx.stats["not_attached"] == missed + 1
    finally:
        rx.close()
    with pytest.raises(TypeError, match="same_node"):
        KVSender(same_node=1)


@pytest.mark.slow
def test_writes_wait_their_turn_and_land_exact(rng):
    """KVSender(max_in_flight=k): WRITEs sent together to one receiver start (ask for their
    grant, write) k at a time (default 1), the rest queued in order and started as earlier ones
    end, whichever send is driven; None starts all at once; two receivers get one each at
    once; every request byte exact, pages accounted for; bad values refused."""
    assert KVSender.__init__.__kwdefaults__["max_in_flight"] == 1
    for k in (1, 2, None):
        rx, pool, pages = receiver(256, push=True)
        s = KVSender(max_in_flight=k, pull=False)
        try:
            want, sends, most = {}, [], 0
            for r in range(7):
                n = int(rng.integers(1, 120))
                want[r] = make_kv(300 + r, L, n, RB)
                sends.append(s.send(rx.reserve(r, n), want[r], wait=False))
                cap = 7 if k is None else k
                assert s.in_flight <= cap and (k is not None or s.queued == 0)
                assert s.in_flight + s.queued == sum(p.state != "DONE" for p in sends)
                most = max(most, s.queued)
            # (a WRITE needs its grant, so the first k are still in flight)
            assert (most == 0) == (k is None), most
            for i in rng.permutation(len(sends)):  # driven to the end in any order
                assert finish(rx, sends[i]).bytes == want[int(i)].size
            assert s.in_flight == s.queued == 0
            got = arrivals(rx, len(want))
            assert sorted(a.req_id for a in got) == list(want)
            for a in got:
                np.testing.assert_array_equal(pool[:, rows_of(a.pages, a.n_tokens)],
                                              want[a.req_id])
                rx.release(a)
            pages.check()
        finally:
            s.close()
            rx.close()
    # receivers do not wait for each other: one WRITE in flight to each
    (rx1, pool1, _), (rx2, pool2, _) = receiver(64, push=True), receiver(64, push=True)
    s = KVSender(pull=False)
    try:
        kv = {r: make_kv(400 + r, L, 30, RB) for r in range(6)}
        sends = [s.send((rx1, rx2)[r % 2].reserve(r, 30), kv[r], wait=False) for r in range(6)]
        assert s.in_flight == 2 and s.queued == 4
        assert [p.state for p in sends[:2]] == ["PROC", "PROC"]
        for i, p in list(enumerate(sends))[::-1]:
            finish((rx1, rx2)[i % 2], p)
            _poll((rx1, rx2)[1 - i % 2])
        for rx, pool, rs in ((rx1, pool1, (0, 2, 4)), (rx2, pool2, (1, 3, 5))):
            got = arrivals(rx, 3)
            assert sorted(a.req_id for a in got) == list(rs)
            for a in got:
                np.testing.assert_array_equal(pool[:, rows_of(a.pages, 30)], kv[a.req_id])
    finally:
        s.close()
        rx1.close()
        rx2.close()
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises((ValueError, TypeError), match="max_in_flight"):
            KVSender(max_in_flight=bad)


def test_a_queued_write_past_its_deadline_ends_unsent_and_close_ends_the_queue():
    """A send whose deadline passes before its turn fails with a TimeoutError and writes
    nothing (its pages keep their poison; the receiver can take the resend); a send done stays
    done through close()."""
    rx, pool, pages = receiver(64, timeout_s=30, push=True)
    pool[:] = 0xA5
    s = KVSender(max_in_flight=1, pull=False)
    try:
        first = s.send(rx.reserve(0, 40), make_kv(1, L, 40, RB), wait=False)
        t = rx.reserve(1, 30)
        late = s.send(t, make_kv(2, L, 30, RB), wait=False, timeout_s=1e-9)
        with pytest.raises(TimeoutError, match="did not start in time"):
            late.wait()
        with pytest.raises(TimeoutError, match="did not start in time"):
            late.poll()  # the same error again, nothing posted
        assert finish(rx, first).bytes == L * 40 * RB
        assert (pool[:, ticket_rows(t, pool)] == 0xA5).all()
        assert send(s, rx, t, make_kv(2, L, 30, RB)).bytes == L * 30 * RB  # the resend lands
        got = {a.req_id: a for a in arrivals(rx, 2)}
        assert sorted(got) == [0, 1]
        np.testing.assert_array_equal(pool[:, rows_of(got[1].pages, 30)], make_kv(2, L, 30, RB))
        for a in got.values():
            rx.release(a)
    finally:
        s.close()
    assert first.result is not None and first.state == "DONE"  # done stays done
    rx.close()
    pages.check()


def test_close_fails_the_sends_not_ended():
    """close() ends every send not ended (here a WRITE waiting for a grant from a receiver that
    does not poll, and two queued behind it) with an error naming it; nothing was written, and
    the receiver, polled afterwards, ends the reservations as they time out."""
    clock = Clock()
    rx, pool, pages = receiver(64, push=True, clock=clock, timeout_s=5)
    pool[:] = 0xA5
    s = KVSender(pull=False)
    sends = [s.send(rx.reserve(r, 20), make_kv(r, L, 20, RB), wait=False) for r in range(3)]
    assert [p.state for p in sends] == ["PROC", "QUEUED", "QUEUED"] and s.queued == 2
    assert not sends[0].poll()
    s.close()
    for w in sends:
        with pytest.raises(RuntimeError, match="closed before this send ended"):
            w.wait()
    assert s.queued == 0 and s.in_flight == 0
    clock.t = 6
    polled = rx.poll()  # the begin of the first: ended by the sender's abort (or late)
    assert sorted(polled.timed_out + [r for r, _ in polled.failed]) == [0, 1, 2]
    settle(rx)  # (granted, then timed out before the abort came: quarantined until it does)
    assert (pool == 0xA5).all() and pages.free_pages == 64 and not rx.quarantined
    pages.check()
    rx.close()


def test_gpu_arrays_are_read_through_cuda_array_interface():
    """A GPU ``kv`` (here a stand-in: no device) goes the same way, registered as VRAM."""
    from hisparse_cupy.pd._send import kv_source as _source

    class Dev:
        id = 3

    class GpuArray:
        device = Dev()

        def __init__(self, shape, strides=None):
            self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "version": 3,
                                             "data": (1 << 40, False), "strides": strides}

    assert _source(GpuArray((L, 5, RB)), L, 5, RB) == (1 << 40, 5 * RB, "VRAM", 3)
    assert _source(GpuArray((L, 5, RB), (9 * RB, RB, 1)), L, 5, RB)[1] == 9 * RB
    with pytest.raises(ValueError, match="rows must follow"):
        _source(GpuArray((L, 5, RB), (RB, 2 * RB, 1)), L, 5, RB)
    with pytest.raises(ValueError, match=r"uint8 \[3, 6, 64\]"):
        _source(GpuArray((L, 5, RB)), L, 6, RB)


# ---------------------------------------------------------------------- faults
def test_bad_input_is_refused_before_any_transfer(tx):
    rx, pool, pages = receiver(8, push=True)
    t = rx.reserve("r", 20)
    good = make_kv(0, L, 20, RB)
    for kv, what in [(good[:, :19], r"uint8 \[3, 20, 64\]"), (good.astype(np.int8), "uint8"),
                     (np.zeros((L, 20, 2 * RB), np.uint8)[:, :, :RB], "rows must follow"),
                     (list(good), "NumPy array")]:
        with pytest.raises((ValueError, TypeError), match=what):
            tx.send(t, kv)
    bad = [({"version": 1}, "version"), ({"descs": t["descs"][:-1]}, "do not match"),
           ({"runs": [[0, 19]]}, "consecutive runs"), ({"mem": "VRAM"}, "DRAM"),
           ({"n_tokens": 0}, "n_tokens"), ({"metadata": "%%%"}, "base64"),
           ({"metadata": "Z2FyYmFnZQ==", "instance": "x"}, "did not load"),
           ({"token": None}, "token"), ({"mode": "write"}, "mode"), ({"verify": 1}, "verify"),
           ({"descs": [[a + (1 << 40), b] for a, b in t["descs"]]}, "refused")]
    for change, what in bad:
        with pytest.raises(ValueError, match=what):
            tx.send({**t, **change}, good)
    with pytest.raises(TypeError, match="ticket"):
        tx.send([t], good)
    time.sleep(0.05)
    assert rx.poll() == ([], [], []) and not pool.any()  # nothing was written, nothing arrived
    send(tx, rx, t, good)  # the ticket itself still works
    (a,) = arrivals(rx, 1)
    np.testing.assert_array_equal(pool[:, rows_of(a.pages, 20)], good)
    # the receiver's own checks
    rx.reserve("x", 1)
    with pytest.raises(ValueError, match="req_id 'x' already"):
        rx.reserve("x", 1)
    with pytest.raises(TypeError, match="req_id"):
        rx.reserve(True, 1)
    with pytest.raises(ValueError, match="n_tokens"):
        rx.reserve("y", 0)
    with pytest.raises(TypeError, match="verify"):
        rx.reserve("y", 1, verify=1)
    free = pages.free_pages
    with pytest.raises(PoolExhausted):
        rx.reserve("y", 8 * P)
    assert pages.free_pages == free and "y" not in rx.in_flight
    with pytest.raises(KeyError, match="no reservation"):
        rx.cancel("nobody")
    with pytest.raises(KeyError, match="not quarantined"):
        rx.release_quarantined("nobody")
    with pytest.raises(ValueError, match="pages are not"):
        rx.admit(FakeCache(pool, HostPages(8, P)), a)
    rx.release(a)
    with pytest.raises(ValueError, match="already admitted or released"):
        rx.release(a)
    with pytest.raises(TypeError, match="pool"):
        KVReceiver(pool.astype(np.int8), pages)
    for k in ("push", "verify"):
        with pytest.raises(TypeError, match=k):
            KVReceiver(pool, pages, **{k: 1})
    with pytest.raises(ValueError, match="multiple of 8"):
        KVReceiver(np.zeros((L, 8 * P, 12), np.uint8), pages, verify=True)
    with pytest.raises(TypeError, match="pull"):
        KVSender(pull=1)
    KVReceiver(types.SimpleNamespace(numpy=pool), pages).close()  # a HostKVPool's .numpy
    with pytest.raises(ValueError, match="rows per layer"):
        KVReceiver(np.zeros((L, 10, RB), np.uint8), pages)
    rx.close()
    assert pages.free_pages == 8
    pages.check()


@pytest.mark.parametrize("push", [False, True])
def test_duplicate_late_unknown_and_cancelled(tx, push):
    """Only a live reservation's messages count, once; a send after a cancel or a timeout is
    refused (its sender told why) and writes nothing; no page is put back twice; the admitted
    request's rows stay exact through every fault."""
    clock = Clock()
    rx, pool, pages = receiver(32, clock=clock, timeout_s=5, push=push)
    cache = FakeCache(pool, pages)
    kv_a = make_kv(1, L, 40, RB)
    ta = rx.reserve("a", 40)
    send(tx, rx, ta, kv_a)
    (a,) = arrivals(rx, 1)
    rid = rx.admit(cache, a)
    done = _protocol.message("done", xfer_id=ta["xfer_id"], token=ta["token"], tag="x")
    tx._agent.send_notif(rx.name, done)  # a duplicate
    tx._agent.send_notif(rx.name, b"\xff not a message")
    tx._agent.send_notif(rx.name, _protocol.message("done", xfer_id="0" * 32, token="0" * 32))
    tb = rx.reserve("b", 30)  # cancelled before its sender writes
    b_pages = [g for g in range(32) if pages.held[g]]
    puts = pages.puts.copy()
    rx.cancel("b")
    assert (pages.puts - puts == np.isin(np.arange(32), b_pages)).all()
    tc = rx.reserve("c", 50, timeout_s=1)  # times out before its sender writes
    c_pages = [g for g in range(32) if pages.held[g]]
    puts = pages.puts.copy()
    clock.t = 2
    got = rx.poll()
    assert got.timed_out == ["c"] and got.done == []
    assert (pages.puts - puts == np.isin(np.arange(32), c_pages)).all()
    puts = pages.puts.copy()
    for t, seed, why in ((tb, 2, "cancelled"), (tc, 3, "timed_out")):  # their ids are dead
        with pytest.raises(RuntimeError, match=f"the reservation ended \\({why}\\)"):
            send(tx, rx, t, make_kv(seed, L, t["n_tokens"], RB))
    for _ in range(50):
        assert rx.poll() == ([], [], [])
    assert (rx.stats["duplicate"] + rx.stats["late"], rx.stats["unknown"]) == (3, 1)
    assert rx.stats["malformed"] == 1
    assert rx.stats["cancelled"] == 1 and rx.stats["timed_out"] == 1
    assert (pages.puts == puts).all()  # the late transfers put nothing back
    assert pages.free_pages == 32 - pages.pages_for(40)
    for t, seed in ((tb, 2), (tc, 3)):  # and no row of theirs landed
        rows = pool[:, ticket_rows(t, pool)]
        assert not (rows == make_kv(seed, L, t["n_tokens"], RB)).all(axis=(0, 2)).any()
    np.testing.assert_array_equal(pool[:, pages.rows(rid)], kv_a)
    assert pages.held.sum() == 0
    pages.check()
    with pytest.raises(KeyError):
        rx.cancel("c")
    rx.close()


def test_stale_metadata_and_a_restarted_receiver(tx):
    rx, pool, pages = receiver(8, name="hisparse-test-rx")
    send(tx, rx, rx.reserve(1, 5), make_kv(1, L, 5, RB))
    old = rx.reserve(2, 5)
    rx.close()  # the receiver is gone: its ticket fails, with the reason
    stale = (RuntimeError, ValueError, TimeoutError)
    with pytest.raises(stale, match="gone|stale|in time"):
        tx.send(old, make_kv(2, L, 5, RB), timeout_s=1)
    rx2, pool2, _ = receiver(8, name="hisparse-test-rx")  # same name, new instance
    with pytest.raises(stale, match="gone|stale|in time"):
        send(tx, rx2, old, make_kv(2, L, 5, RB), timeout_s=1)
    assert not pool2.any()
    send(tx, rx2, rx2.reserve(1, 5), make_kv(7, L, 5, RB))
    (a,) = arrivals(rx2, 1)
    np.testing.assert_array_equal(pool2[:, rows_of(a.pages, 5)], make_kv(7, L, 5, RB))
    rx2.close()
    rx3, pool3, _ = receiver(8, name="hisparse-test-rx")  # the sender still has rx2's cached
    send(tx, rx3, rx3.reserve(1, 5), make_kv(8, L, 5, RB))
    (a,) = arrivals(rx3, 1)
    np.testing.assert_array_equal(pool3[:, rows_of(a.pages, 5)], make_kv(8, L, 5, RB))
    with pytest.raises(ValueError, match="belongs to agent 'hisparse-test-rx', not 'someone-else'"):
        tx.send({**rx3.reserve(2, 5), "agent": "someone-else"}, make_kv(8, L, 5, RB))
    rx3.close()


def test_a_sender_killed_mid_write_leaves_its_pages_quarantined():
    """The child is granted a WRITE, writes part of it (layer 0) and is killed: the
    reservation times out and its pages stay out of the free list (the sender might still be
    writing them) until the engine, knowing the process is gone, gives them back, once;
    nothing is admitted, the other request's rows stay."""
    clock = Clock()
    rx, pool, pages = receiver(32, clock=clock, timeout_s=5, push=True)
    peer = Peer()
    try:
        tb = rx.reserve("b", 70)
        assert "error" not in peer.ask(rx, ticket=tb, seed=5)
        (b,) = arrivals(rx, 1)
        ta = rx.reserve("a", 200)
        rows = ticket_rows(ta, pool)
        a_pages = np.unique(rows // P)
        assert (pages.held[a_pages] == 1).all() and not np.isin(a_pages, b.pages).any()
        puts = pages.puts.copy()
        assert peer.ask(rx, ticket=ta, seed=6, partial=True) == {"partial": True}
        os.kill(peer.p.pid, signal.SIGKILL)
        peer.p.wait(10)
        kv_a = make_kv(6, L, 200, RB)
        np.testing.assert_array_equal(pool[0, rows], kv_a[0])  # it did write, part of it
        assert not pool[1:, rows].any()
        for _ in range(20):
            assert rx.poll().done == [] and rx.in_flight == {"a": 200}
        assert (pages.puts == puts).all()
        clock.t = 6
        assert rx.poll() == ([], ["a"], [])
        assert rx.quarantined == {ta["xfer_id"]: ("a", len(a_pages))}
        assert (pages.puts == puts).all() and pages.free_pages == 32 - 5 - len(a_pages)
        with pytest.raises(PoolExhausted):  # the quarantined pages are not handed out
            rx.reserve("c", 32 * P - 5 * P - len(a_pages) * P + 1)
        for _ in range(20):
            assert rx.poll().done == []
        rx.release_quarantined(ta["xfer_id"])
        assert (pages.puts - puts == np.isin(np.arange(32), a_pages)).all()
        assert not rx.quarantined
        pages.check()
        np.testing.assert_array_equal(pool[:, rows_of(b.pages, 70)], make_kv(5, L, 70, RB))
        rx.release(b)
        assert pages.free_pages == 32 and pages.held.sum() == 0
        pages.check()
    finally:
        peer.close()
        rx.close()


def test_the_fence_runs_after_the_pages_are_taken_and_before_the_ticket_leaves():
    """``fence`` (an engine's own hook) runs once per reservation, with
    the pages already taken: a writer never sees pages a released request's queued work reads."""
    seen = []
    rx, _, pages = receiver(16, fence=lambda: seen.append(int(pages.held.sum())))
    rx.reserve("a", 40)  # 3 pages of 16
    rx.reserve("b", 10)
    assert seen == [3, 4]
    rx.close()


def _pd_example():
    """examples/pd_decode.py as a module its spawned prefill process can import too."""
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import pd_decode

    return pd_decode


@pytest.mark.slow
@pytest.mark.parametrize("how", ["push", "pull"])
def test_the_pd_example_decodes_on_kv_that_came_over_nixl(capsys, how):
    """examples/pd_decode.py: a prefill process offers every prompt's KV for the decode process
    to read into its pool's pages (or, ``--push``, writes it there once granted); the decode
    loop (NumPy backend) then passes its bit-for-bit self-check, and fails it when one
    request's received rows are altered (the check sees the transfer)."""
    from hisparse_cupy.demo._args import cpu_config
    from hisparse_cupy.demo._cpu import run

    ex = _pd_example()
    assert ex.main(["--cpu", "--batch", "3", "--context", "1000", "--steps", "3",
                    "--quiet"] + ["--push"] * (how == "push")) == 0
    out = capsys.readouterr().out
    assert ("read by the decode process" if how == "pull" else
            "written by the prefill process") + " from host memory" in out
    assert "self-check passed" in out
    if how == "pull":
        return

    def altered(cfg, hp, host, host_locs):
        ex.admit_over_nixl(cfg, hp, host, host_locs)
        host[:, host_locs[1, :cfg.context]] += np.float32(1.0)

    cfg = cpu_config(["--batch", "3", "--context", "1000", "--steps", "2", "--quiet"])
    with pytest.raises(SystemExit, match="SELF-CHECK FAILED"):
        run(cfg, admit=altered)


@pytest.mark.gpu
@pytest.mark.parametrize("pull", [False, True])
@pytest.mark.parametrize("verify", [False, True])
def test_kv_in_gpu_memory_lands_in_a_pinned_pool_byte_exact(rng, pull, verify):
    """Sends from VRAM (NIXL's VRAM -> DRAM, a WRITE or the receiver's READ): CuPy arrays,
    one inside a registered buffer (a layer-strided view), into a pinned HostKVPool's scattered
    pages; every received row equals the source, and every byte outside the reservations keeps
    its poison."""
    import cupy

    from hisparse_cupy.host._pool import HostKVPool

    L, rb, P, n_pages = 3, 656, 16, 48
    sizes = [1, 17, 100, 257, 16]
    with HostKVPool(L, n_pages * P, rb) as pool:
        host = pool.numpy
        host[:] = 0xA5
        pages = HostPages(n_pages, P)
        held = pages.take(n_pages)
        pages.put(list(rng.permutation(held)))  # pages handed out in random order
        rx, tx = KVReceiver(pool, pages, push=not pull, verify=verify), KVSender(pull=pull)
        big = cupy.asarray(rng.integers(0, 256, (L, 400, rb), dtype=np.uint8))
        tx.register(big)
        try:
            want, sends = {}, []
            for i, n in enumerate(sizes):
                if i == 3:  # rows of a registered buffer: layers 400 rows apart
                    kv, src = big[:, 100:100 + n], cupy.asnumpy(big[:, 100:100 + n])
                else:
                    src = rng.integers(0, 256, (L, n, rb), dtype=np.uint8)
                    kv = cupy.asarray(src)
                sends.append((tx.send(rx.reserve(i, n), kv, wait=False), kv))
                want[i] = src
            got = {a.req_id: a for a in drive(rx, [p for p, _ in sends], len(sizes), 30)}
            assert [p.result.bytes for p, _ in sends] == [L * n * rb for n in sizes]
            assert {p.kind for p, _ in sends} == {"pull" if pull else "write"}
            assert sorted(got) == list(range(len(sizes)))
            mask = np.zeros(n_pages * P, bool)
            for i, a in got.items():
                rows = (np.asarray(a.pages)[:, None] * P + np.arange(P)).ravel()[:sizes[i]]
                np.testing.assert_array_equal(host[:, rows], want[i])
                mask[rows] = True
            assert (host[:, ~mask] == 0xA5).all()
        finally:
            tx.close()
            rx.close()


@pytest.mark.gpu
def test_the_same_node_path_copies_into_a_shared_pool_byte_exact(rng, monkeypatch):
    """GPU ``kv`` for a receiver over a shared HostKVPool: the sender attaches the pool once
    and copies into its pages (pages in random order: the copy kernel; in order: 2-D copies,
    cut at the registrations' edges, 1 MiB apart here), each arrival notified once, byte
    exact, poison kept outside the reservations;
    ``same_node=False`` sends over NIXL into the same pool; a ticket whose ``shm`` does not
    describe the pool is refused; a pool made anew under that name is attached anew."""
    import cupy

    from hisparse_cupy.host import _pool as hp

    monkeypatch.setattr(hp, "_REGISTER_CHUNK", 1 << 20)
    L, rb, P, n_pages = 3, 656, 16, 200
    name = f"hs-test-pd-{os.getpid()}"

    def run(pool, tx, sizes, shuffle=True):
        host = pool.numpy
        host[:] = 0xA5
        pages = HostPages(n_pages, P)
        if shuffle:  # pages in random order: short runs (the copy kernel); else 2-D copies
            pages.put(list(rng.permutation(pages.take(n_pages))))
        rx = KVReceiver(pool, pages)
        try:
            want = {i: rng.integers(0, 256, (L, n, rb), dtype=np.uint8)
                    for i, n in enumerate(sizes)}
            sends = [tx.send(rx.reserve(i, w.shape[1]), cupy.asarray(w), wait=False)
                     for i, w in want.items()]
            got = {a.req_id: a for a in drive(rx, sends, len(sizes), 30)}
            assert sorted(got) == list(want)
            mask = np.zeros(n_pages * P, bool)
            for i, a in got.items():
                rows = rows_of(a.pages, sizes[i])
                np.testing.assert_array_equal(host[:, rows], want[i])
                mask[rows] = True
            assert (host[:, ~mask] == 0xA5).all()
            time.sleep(0.1)
            assert not rx.poll().done and rx.stats["duplicate"] == rx.stats["unknown"] == 0
            return rx.reserve("spare", 5)
        finally:
            rx.close()

    sizes = [1, 17, 300, 1000, 16]
    tx, tx_nixl = KVSender(), KVSender(same_node=False)
    try:
        with hp.HostKVPool(L, n_pages * P, rb, shared_name=name) as pool:
            assert len(pool.chunk_edges) >= 4  # registrations' edges inside the layers
            t = run(pool, tx, sizes)
            assert tx.stats["copied"] == len(sizes) and tx.stats["not_attached"] == 0
            first = tx._pools[name]
            run(pool, tx_nixl, sizes)
            assert tx_nixl.stats["copied"] == 0 and not tx_nixl._pools
            run(pool, tx, sizes[:2])
            run(pool, tx, sizes, shuffle=False)  # long runs across the registrations' edges
            assert tx.stats["copied"] == 2 * len(sizes) + 2 and tx._pools[name] is first
            with pytest.raises(ValueError, match="does not describe"):
                tx.send({**t, "shm": {**t["shm"], "bytes": t["shm"]["bytes"] - rb}},
                        cupy.zeros((L, 5, rb), cupy.uint8))
        with hp.HostKVPool(L, n_pages * P, rb, shared_name=name) as pool:
            run(pool, tx, sizes[:3])
            assert tx._pools[name] is not first and first.closed
            assert list(tx._pools[name].identity) == list(pool.identity)
    finally:
        tx.close()
        tx_nixl.close()
    assert not tx._pools


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["push", "pull", "shared"])
def test_the_pd_example_runs_the_gpu_decode_loop_on_kv_sent_from_vram(capsys, how):
    """examples/pd_decode.py on a GPU: the prefill process makes each prompt's KV in VRAM and
    the decode process reads it into its pool (or NIXL writes it there, or, the pool shared,
    the prefill process copies it in); every offloaded run's self-check passes."""
    ex = _pd_example()
    assert ex.main(["--batch", "4", "--context", "3000", "--steps", "4", "--warmup", "2",
                    "--layers", "12", "--hot", "1024", "--top-k", "256", "--quiet"] +
                   {"push": ["--push"], "pull": [], "shared": ["--shared-pool"]}[how]) == 0
    out = capsys.readouterr().out
    said = {"pull": "read by the decode process", "push": "written by the prefill process",
            "shared": "copied by the prefill process"}[how]
    assert out.count(f"{said} from VRAM") == 3  # offload, overlap, predict
    assert out.count("copied on this node into the shared pool") == 3 * (how == "shared")
    assert "self-check passed" in out


@pytest.mark.gpu
def test_the_pd_example_admits_requests_resident_under_a_device_budget(capsys):
    """The same decode loop on KV pulled over NIXL into engine-held pages, under device
    budgets: one that holds every request resident, and one sized for 2 resident and a block
    for each other (the demo's plan, passed as ``KVReceiver.admit(resident=)``); every
    offloaded run's self-check passes and its log says how many were resident."""
    ex = _pd_example()
    for flags, k in ((["--device-budget", "auto"], 4), (["--resident-requests", "2"], 2)):
        assert ex.main(["--batch", "4", "--context", "3000", "--steps", "4", "--warmup", "2",
                        "--layers", "12", "--hot", "1024", "--top-k", "256"] + flags) == 0
        out = capsys.readouterr().out
        assert out.count(f", {k} of 4 requests resident") == 3, flags  # offload, overlap, predict
        assert "self-check passed" in out, flags


# --- pulls: KVSender(pull=True) offers, the receiver READs ---------------------------------------

def drive(rx, sends, want, wait_s=10.0):
    """Poll the receiver and the pending sends until ``want`` arrivals and every send is done."""
    got, end = _take(rx, "done"), time.monotonic() + wait_s
    while (len(got) < want or not all(p.result for p in sends)) and time.monotonic() < end:
        polled = rx.poll()
        assert polled.timed_out == [] and polled.failed == [], polled
        got += polled.done
        for p in sends:
            if p.result is None:
                p.poll()
    assert len(got) == want and all(p.result for p in sends), (len(got), want)
    return got


@pytest.fixture(scope="module")
def puller():
    s = KVSender(pull=True)
    yield s
    s.close()


def test_pulls_and_writes_mixed_at_random_land_exact(tx, puller, rng):
    """60 requests of mixed sizes, up to 6 in flight, each sent at random by a WRITE or a pull
    (the receiver READs), kv registered per send or inside a registered buffer; every arrival
    exact, the pull's Sent reported, pages accounted for; random releases scatter the pages."""
    rx, pool, pages = receiver(256, push=True)
    cache = FakeCache(pool, pages)
    big = make_kv(99, L, 4000, RB)
    puller.register(big)
    live, req, pulls = {}, 0, 0
    while req < 60:
        sends, kvs, writes = [], {}, 0
        for _ in range(int(rng.integers(1, 7))):
            n = int(rng.integers(1, 301))
            t = rx.reserve(req, n)
            if rng.random() < 0.5:  # a view of the registered buffer
                at = int(rng.integers(0, 4000 - n))
                kvs[req] = big[:, at: at + n]
            else:
                kvs[req] = make_kv(req, L, n, RB)
            if rng.random() < 0.6:
                sends.append(puller.send(t, kvs[req], wait=False))
                pulls += 1
            else:
                writes += 1
                assert send(tx, rx, t, kvs[req]).bytes == kvs[req].nbytes
            req += 1
        got = drive(rx, sends, len(kvs))
        for p in sends:
            assert p.pull and p.result.bytes == L * kvs[p.req_id].shape[1] * RB
        for a in got:
            np.testing.assert_array_equal(pool[:, rows_of(a.pages, a.n_tokens)], kvs[a.req_id])
            live[rx.admit(cache, a)] = (a.req_id, np.array(kvs[a.req_id]))
        for rid in list(live):
            if rng.random() < 0.4:
                pages.release(rid)
                del live[rid]
        pages.check()
    for rid, (_, kv) in live.items():
        np.testing.assert_array_equal(pool[:, pages.rows(rid)], kv)
    assert rx.stats["done"] == req and pulls > 10 and not rx.in_flight
    assert not puller._words and puller.stats["late"] == 0
    rx.close()


@pytest.mark.slow
def test_a_pull_from_another_process():
    """A pulling sender in a child process: the decode side polls (posting the READs) while the
    child waits for the READs' end."""
    peer = Peer()
    rx, pool, pages = receiver(64, 4096)
    try:
        for i, n in enumerate([1, 63, 64, 200, 512]):
            peer.tell(ticket=rx.reserve(i, n), seed=i, pull=True)
            (a,) = arrivals(rx, 1)
            ans = peer.read()
            assert ans.get("bytes") == L * n * 4096, ans
            np.testing.assert_array_equal(pool[:, rows_of(a.pages, n)], make_kv(i, L, n, 4096))
            rx.release(a)
        assert pages.free_pages == 64
        pages.check()
    finally:
        peer.close()
        rx.close()


def failures(rx, wait_s=5.0):
    """Poll until a transfer fails (or ``wait_s``): the failures; asserts nothing arrived."""
    end = time.monotonic() + wait_s
    assert _take(rx, "done") == []
    failed = _take(rx, "failed")
    while not failed and time.monotonic() < end:
        polled = rx.poll()
        assert polled.done == []
        failed = polled.failed
    return failed


def test_pull_faults_end_cleanly(puller, tx):
    """An offer that does not match its reservation, a withdrawn pull, a late offer, a WRITE
    for a receiver that takes pulls only: each a clear error or failure, pages put back once,
    other rows intact."""
    rx, pool, pages = receiver(16)
    keep = rx.reserve("keep", 40)
    keep_kv = make_kv(5, L, 40, RB)
    send(tx, rx, keep, keep_kv)
    (k,) = arrivals(rx, 1)
    # 1. the offer's descriptors are another reservation's shape under this one's id and token
    a, b = rx.reserve(1, 40), rx.reserve(2, 8)
    p = puller.send({**b, "xfer_id": a["xfer_id"], "token": a["token"]}, make_kv(2, L, 8, RB),
                    wait=False)
    failed = failures(rx)
    assert [r for r, _ in failed] == [1] and "do not match" in failed[0][1]
    with pytest.raises(RuntimeError, match="the receiver: fail: its offer was refused"):
        p.wait(timeout_s=5)
    assert rx.in_flight == {2: 8}
    # 2. withdrawn: the sender gave up (and the receiver did not answer in the grace)
    p = puller.send(b, make_kv(2, L, 8, RB), wait=False, timeout_s=0.05)
    with pytest.raises(TimeoutError):
        p.wait()
    failed = failures(rx)  # the offer and its withdrawal come together: nothing is read
    assert [r for r, _ in failed] == [2] and "withdrew" in failed[0][1] and not rx.in_flight
    # 3. an offer for a reservation already ended: refused, its sender told at once
    late = rx.stats["late"]
    with pytest.raises(RuntimeError, match=r"the reservation ended \(failed\)"):
        send(puller, rx, b, make_kv(2, L, 8, RB), timeout_s=5)
    assert rx.stats["late"] == late + 1
    # 4. a WRITE for a receiver that takes pulls only: refused by the sender; a ticket
    # altered to say push does not help (its metadata holds no key of the pool)
    t = rx.reserve(3, 4)
    w = KVSender(pull=False)
    with pytest.raises(ValueError, match="takes pulls only"):
        w.send(t, make_kv(3, L, 4, RB))
    with pytest.raises(ValueError, match="NIXL refused the WRITE"):
        w.send({**t, "mode": "push"}, make_kv(3, L, 4, RB))
    w.close()
    rx.cancel(3)
    np.testing.assert_array_equal(pool[:, rows_of(k.pages, 40)], keep_kv)
    rx.release(k)
    settle(rx)  # (the withdrawn READ, if it was in progress, is waited out)
    assert (pages.free_pages, rx.stats["failed"], rx.quarantined) == (16, 2, {}), dict(rx.stats)
    pages.check()
    rx.close()
