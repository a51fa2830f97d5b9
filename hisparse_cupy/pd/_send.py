"""The prefill side of :mod:`hisparse_cupy.pd`: :class:`KVSender` offers a request's KV for the
receiver to read (a pull: one NIXL READ, posted by the receiver), or, granted by the receiver,
writes it into the ticket's pages (one NIXL WRITE, or on the receiver's node copies into its
shared pool); :class:`PendingSend` drives each to the end."""

from __future__ import annotations

import collections
import itertools
import time

import cupy
import numpy as np

from .. import _checks
from .._kernels import sums as _sums
from .._kernels.rows import store_rows
from ..host import HostKVPool
from . import _nixl, _protocol
from ._pending import GRACE_S, Link, PendingSend

__all__ = ["KVSender", "PendingSend"]


class KVSender:
    """The prefill side: a NIXL agent (``name``: default unique) that sends requests' KV into
    the pages of receivers' tickets.

    ``pull``: None (default) follows the ticket: a pull, unless the receiver takes WRITEs
    (``KVReceiver(push=True)``: its ticket's ``mode`` is ``"push"``); True: always a pull (the
    receiver READs ``kv``; it must be polling for a pull to progress); False: a WRITE (refused
    for a pull receiver's ticket). GPU ``kv`` for a ticket whose pool is a shared
    ``HostKVPool`` on this node takes the same-node path instead when ``same_node`` (default
    True): stored into the pool (2-D ``cudaMemcpyAsync`` per run of pages, after the current
    stream's work, on a stream of the sender's) once the receiver grants it, and the receiver
    told once the copies are done. The pool stays attached until :meth:`close` (or a ticket
    names another pool of its name); a pool that cannot be attached (another mount namespace,
    its creator's PID namespace not visible) is sent over NIXL (counted in
    ``stats["not_attached"]``; ``stats["copied"]``: the sends that took the same-node path).
    Every kind needs the receiver to poll: a write asks for its grant first.

    ``desc_bytes``: a WRITE's descriptors cut into pieces of at most this many bytes (default
    3 MiB: on one H200 box UCX's pipeline moved a WRITE from VRAM at 26-30 GB/s in pieces up to
    its fragment size, ``UCX_RNDV_FRAG_SIZE``, 4 MiB for GPU memory by default, and at
    2.7-3.8 GB/s in larger ones, ``benchmarks/bench_pd.py``); None: as the ticket gives them.
    ``max_in_flight``: WRITEs started at once to one receiver (default 1; None: no limit);
    later ones wait in order. ``ucx_params``: NIXL's UCX backend parameters for the sender's
    agent (e.g. ``{"num_workers": 4}``; default NIXL's)."""

    def __init__(self, *, name: str | None = None, desc_bytes: int | None = 3 << 20,
                 pull: bool | None = None, max_in_flight: int | None = 1,
                 ucx_params: dict | None = None, same_node: bool = True):
        self.desc_bytes = None if desc_bytes is None else \
            _checks.integer("desc_bytes", desc_bytes, 1)
        self.max_in_flight = None if max_in_flight is None else \
            _checks.integer("max_in_flight", max_in_flight, 1)
        if pull is not None and not isinstance(pull, bool):
            raise TypeError(f"pull must be a bool or None, got {type(pull).__name__}")
        if not isinstance(same_node, bool):
            raise TypeError(f"same_node must be a bool, got {type(same_node).__name__}")
        self.pull, self.same_node = pull, same_node
        self._flight: dict = collections.defaultdict(list)  # receiver -> WRITEs started
        self._queue: dict = collections.defaultdict(collections.deque)  # -> WRITEs waiting
        self._pools: dict = {}  # shared pool name -> HostKVPool attached (the same-node path)
        self._streams: dict = {}  # device -> the stream of its copies
        self._unreachable: set = set()  # (name, *identity) of shared pools not attachable here
        self.name, self._agent = _nixl.agent(name, "tx", _nixl.ucx_params(ucx_params))
        self._link = Link(self._agent, _nixl.metadata(self._agent, keys=False), self._word,
                          self._progress, self._settle, self._unpin)
        self._remote = _nixl.Peers(self._agent, replace=True)  # receivers' connections
        self._fixed: list = []  # (mem, dev, lo, hi, reg), from register()
        self._pins: dict = {}  # (mem, dev, lo, hi) -> [reg, users], registered for sends
        self._abandoned: list = []  # ended sends whose WRITE or copies may still write
        self._others: set = set()  # pulls and copies not ended (WRITEs: _queue, _flight)
        self._words: dict = {}  # tag -> deque of the receiver's words, of the sends not ended
        self._reading_done = False  # (inside _progress: notifications already read this round)
        self._attempt = itertools.count()
        self.stats: dict = {"late": 0, "unknown": 0, "copied": 0, "not_attached": 0}

    def register(self, buf) -> None:
        """Register ``buf`` (a NumPy or GPU array: the engine's KV buffer) for the sender's
        lifetime: a ``kv`` inside it is then sent without registering it again (a pull's
        receiver can then read all of ``buf``)."""
        self._open()
        if (where := memory_of(buf)) is None or not buf.nbytes:
            raise TypeError(f"buf must be a non-empty NumPy or GPU array, got {buf!r:.80}")
        lo, mem, dev = where
        reg = _nixl.register(self._agent, "buf", lo, int(buf.nbytes), dev, mem)
        self._fixed.append((mem, dev, lo, lo + int(buf.nbytes), reg))

    def _open(self) -> None:
        if self._agent is None:
            raise RuntimeError("KVSender is closed")

    def send(self, ticket: dict, kv, *, timeout_s: float | None = None, wait: bool = True):
        """Send ``kv`` (uint8 ``[n_layers, n_tokens, row_bytes]`` of the ticket) into the
        ticket's pages (a pull's offer, a WRITE or the same-node copies): :class:`Sent` once the
        receiver has checked it, or (``wait=False``) a :class:`PendingSend` to poll to the end,
        which holds ``kv`` until then (a temporary's memory is not reused while it is read);
        ``kv``'s bytes must be complete at the call (GPU memory: the work writing them
        synchronized, as NIXL reads without waiting for any stream) and stay unchanged until
        then. ``timeout_s``: default half the ticket's. Bad input raises before any transfer.
        After a pull timed out, the receiver may still be reading ``kv`` until its reservation
        ends (the ticket's ``timeout_s`` after it was made): keep ``kv`` until then."""
        self._open()
        t0 = time.perf_counter()
        t = _protocol.check_ticket(ticket)
        L, n, rb = t["n_layers"], t["n_tokens"], t["row_bytes"]
        ptr, stride, mem, dev = kv_source(kv, L, n, rb)
        limit = _nixl.seconds("timeout_s", timeout_s if timeout_s is not None else
                              float(t.get("timeout_s") or 60.0) / 2)
        pull = t["mode"] == "pull" if self.pull is None else self.pull
        pool = self._local_pool(t) if mem == "VRAM" and self.pull is not True else None
        if pool is None and not pull and t["mode"] != "push":  # (copies: any receiver's)
            raise ValueError("ticket's receiver takes pulls only (KVReceiver(push=True) takes "
                             "WRITEs): send it with KVSender(pull=None or True)")
        name = self._connect(t)
        t["digest"] = _protocol.ticket_digest(t)
        t["tag"] = f"{t['xfer_id']}/{next(self._attempt)}"  # a resend's words told apart
        if any(w.rsplit("/", 1)[0] == t["xfer_id"] for w in self._words):
            raise ValueError(f"ticket {t['xfer_id']} is being sent already")
        sums = _sums.kv_sums(kv) if t["verify"] else None
        if pool is not None:
            p = PendingSend(self._link, t, "copy", t0, t0 + limit, keep=kv, sums=sums,
                            copy=self._copier(t, pool, dev, kv))
            self.stats["copied"] += 1
            self._track(p)
            p.start()
            return p.wait() if wait else p
        local = (ptr + np.arange(L)[:, None] * stride + t["runs"][:, 0] * rb).ravel()
        local = np.stack([local.astype(np.uint64), t["descs"][:, 1]], -1)
        key, reg = self._pin(mem, dev, ptr, ptr + (L - 1) * stride + n * rb)
        try:
            if pull:
                offer = {"xfer_id": t["xfer_id"], "token": t["token"], "tag": t["tag"],
                         "agent": self.name, "mem": mem, "dev": dev, "descs": local.tolist(),
                         "metadata": _nixl.metadata(self._agent, reg), "sums": sums}
                try:
                    self._agent.send_notif(name, _protocol.message("offer", **offer))
                except Exception as e:
                    raise RuntimeError(f"the offer of {t['xfer_id']} to {name!r} did not leave "
                                       f"({e!r}): the receiver is gone, or its metadata is "
                                       f"stale") from e
                p = PendingSend(self._link, t, "pull", t0, t0 + limit, pin=key, keep=kv,
                                sums=sums)
                self._track(p)
                return p.wait() if wait else p
            remote = t["descs"]
            if self.desc_bytes is not None:
                local = _nixl.cut(local, self.desc_bytes)
                remote = _nixl.cut(remote, self.desc_bytes)
            try:
                handle = self._agent.initialize_xfer(
                    "WRITE", _nixl.xfer_descs(self._agent, local, dev, mem),
                    _nixl.xfer_descs(self._agent, remote, t["dev"], "DRAM"), name,
                    _protocol.message("done", xfer_id=t["xfer_id"], token=t["token"], tag=t["tag"],
                                  digest=t["digest"], sums=sums))
            except Exception as e:
                raise ValueError(f"NIXL refused the WRITE to {name!r} ({e!r}): the ticket's "
                                 f"descriptors are not in memory that agent registered (a "
                                 f"stale or altered ticket)") from None
        except Exception:
            self._unpin(key)
            raise
        p = PendingSend(self._link, t, "write", t0, t0 + limit, handle=handle, pin=key,
                        keep=kv, sums=sums)
        self._track(p)
        self._queue[name].append(p)
        self._launch()
        return p.wait() if wait else p

    def _track(self, p: PendingSend) -> None:
        self._words[p.tag] = collections.deque()
        if p.kind != "write":
            self._others.add(p)

    def _word(self, tag: str):
        """The receiver's next word for send ``tag`` (``"grant"``, ``"ok"``, ``"fail: why"``),
        or None; the new notifications read first, unless :meth:`_progress` read them for the
        sends it is advancing (one NIXL read a round, not one a send)."""
        if not self._reading_done:
            self._drain()
        q = self._words.get(tag)
        return q.popleft() if q else None

    def _drain(self) -> None:
        """The new notifications into the words of the sends in flight (a word for none, or from
        an agent other than the one it was sent to, is counted and dropped)."""
        for sender, kind, f in _nixl.messages(self._agent, _protocol.TO_SENDER, self.stats,
                                              "unknown"):
            x = f.get("tag")
            if x not in self._words or x.rsplit("/", 1)[0] not in self._sent_to(sender):
                self.stats["late"] += 1
                continue
            self._words[x].append(kind if kind != "fail" else
                                  f"fail: {_protocol.text(f.get('why'), 500)}")

    def _sent_to(self, sender: str) -> set:
        """Transfer ids of the sends in flight to agent ``sender``."""
        return {p.xfer_id for p in self._pending() if p.agent == sender}

    def _pending(self):
        yield from (p for f in self._flight.values() for p in f)
        yield from (p for q in self._queue.values() for p in q)
        yield from self._others

    @property
    def in_flight(self) -> int:
        """WRITEs started and not ended."""
        return sum(map(len, self._flight.values()))

    @property
    def queued(self) -> int:
        """WRITEs waiting for their turn."""
        return sum(not q.ended for d in self._queue.values() for q in d)

    def _launch(self) -> None:
        """Start each receiver's queued WRITEs, in order, while fewer than ``max_in_flight`` are
        in flight to it; one whose deadline passed in the queue ends unsent."""
        for name, queue in list(self._queue.items()):
            flight = self._flight[name]
            while queue and (self.max_in_flight is None or len(flight) < self.max_in_flight):
                q = queue.popleft()
                if q.ended:
                    continue
                if time.perf_counter() > q.deadline:
                    q.expire()
                    continue
                flight.append(q)
                q.start()
            if not queue:
                del self._queue[name]

    def _progress(self, caller) -> None:
        """Poll every send started but ``caller`` (a granted copy or WRITE starts when its
        grant is seen, whichever send is waited on), let go of the ended sends whose writes
        ended, then start what the queue allows."""
        self._drain()
        self._reading_done = True
        try:
            for p in [*(p for flight in self._flight.values() for p in flight), *self._others]:
                if p is not caller:
                    p.advance()
            self._abandoned = [p for p in self._abandoned if p.advance()]
        finally:
            self._reading_done = False
        self._launch()

    def _local_pool(self, t: dict):
        """The ticket's shared pool attached here, if it offers one on this node and
        ``same_node`` is on (attached once; None: send over NIXL)."""
        shm = t.get("shm")
        if not self.same_node or shm is None or shm["identity"][0] != HostKVPool.node_id():
            return None
        pool = self._pools.get(shm["name"])
        if pool is not None and list(pool.identity) != shm["identity"]:
            self._sync()  # that name is another pool now: the old one goes
            self._pools.pop(shm["name"]).close()
            pool = None
        if pool is None:
            if (key := (shm["name"], *shm["identity"])) in self._unreachable:
                return None
            try:
                pool = HostKVPool.attach(shm["name"], identity=shm["identity"])
            except (OSError, ValueError):  # not visible from here (namespaces), or gone
                self.stats["not_attached"] += 1
                self._unreachable.add(key)  # (not tried again for this pool)
                return None
            self._pools[shm["name"]] = pool
        if pool.numpy.nbytes != shm["bytes"] or pool.n_layers != t["n_layers"] or \
                pool.row_bytes != t["row_bytes"]:
            raise ValueError(f"ticket['shm'] does not describe host pool {shm['name']!r} "
                             f"({pool.n_layers} layers of {pool.row_bytes}-byte rows, "
                             f"{pool.numpy.nbytes} bytes): a stale or altered ticket")
        return pool

    def _copier(self, t, pool, dev, kv):
        """The same-node path: a function that stores ``kv`` into the ticket's rows of ``pool``
        (``_kernels.rows.store_rows``: a 2-D copy of every layer per run of pages, the package's
        copy kernel where runs are short) on this sender's stream of ``dev``, after the work
        the current stream had at the send, and returns the event of their end."""
        L, rb, LB = t["n_layers"], t["row_bytes"], pool.layer_bytes
        off = (t["descs"][:, 0].astype(np.int64) - t["shm"]["base"]).reshape(L, -1)
        if (off[0] % rb).any() or (off - off[:1] != np.arange(L)[:, None] * LB).any():
            raise ValueError("ticket['shm']: its descriptors are not rows of the pool's layers "
                             "(a stale or altered ticket)")
        rows = np.concatenate([np.arange(r, r + c) for r, c in
                               zip(off[0] // rb, t["runs"][:, 1].astype(np.int64), strict=True)])
        with cupy.cuda.Device(dev):
            ready = cupy.cuda.get_current_stream().record()

        def copy():
            with cupy.cuda.Device(dev):
                if dev not in self._streams:
                    self._streams[dev] = cupy.cuda.Stream(non_blocking=True)
                s = self._streams[dev]
                s.wait_event(ready)
                try:
                    store_rows(pool, rows, cupy.asarray(kv), s)
                except BaseException:  # one copy per run: runs queued before the failure land
                    s.synchronize()  # before the abort gives the receiver its pages back
                    raise
                return s.record()

        return copy

    def _sync(self) -> None:
        for s in self._streams.values():
            s.synchronize()

    def _connect(self, t: dict) -> str:
        """Load the ticket's receiver metadata (again when it changed). Metadata that does not
        load over the connection the sender has to that name (a receiver restarted under the
        same name) replaces it only while no send to it is in flight, and only once it has
        loaded on its own (``_nixl.Peers``); a ticket refused leaves the connection as it was,
        so the sends in flight on it go on."""
        name = t["agent"]
        self._remote.load(name, t["metadata"], "ticket['metadata']", self._busy)
        return name

    def _busy(self, name: str) -> bool:
        """Whether a send to receiver ``name`` is queued, in flight, or ended with its WRITE or
        copies still writing."""
        return any(p.agent == name for p in self._pending()) or \
            any(p.agent == name for p in self._abandoned)

    def _settle(self, p: PendingSend, ok: bool) -> None:
        """A send ended: its words go; what it holds is let go once nothing it started can
        still write (else kept, and polled); a WRITE's end lets the next queued one start."""
        self._words.pop(p.tag, None)
        self._others.discard(p)
        if p.advance():
            self._abandoned.append(p)
        flight = self._flight.get(p.agent, ())
        if p in flight:
            flight.remove(p)  # (the list stays: _launch may be appending to it)
        if p.stale:  # NIXL could not reach the receiver: its metadata is reloaded next ticket
            self._forget(p.agent)  # (not on the receiver's refusal: its other sends go on)

    def _forget(self, name: str) -> None:
        """Drop a receiver's metadata (stale: the next ticket reloads it), unless another send
        to it is in flight (dropping a connection in use loses its transfers' state)."""
        if self._agent is not None:
            self._remote.forget(name, self._busy)

    def _pin(self, mem: str, dev: int, lo: int, hi: int):
        """``(key, registration)`` of memory ``[lo, hi)``: a buffer given to :meth:`register`
        that holds it (key None), else a registration of its own, counted per user."""
        for m, d, a, b, reg in self._fixed:
            if m == mem and d == dev and a <= lo and hi <= b:
                return None, reg
        key = (mem, dev, lo, hi)
        if key not in self._pins:
            self._pins[key] = [_nixl.register(self._agent, "kv", lo, hi - lo, dev, mem), 0]
        self._pins[key][1] += 1
        return key, self._pins[key][0]

    def _unpin(self, key) -> None:
        ent = self._pins.get(key)
        if ent is not None:
            ent[1] -= 1
            if ent[1] == 0:
                del self._pins[key]
                self._agent.deregister_memory(ent[0])

    def close(self) -> None:
        """Fail the sends not ended, wait up to ``GRACE_S`` for the WRITEs and copies still
        writing (their receivers told), forget every receiver, deregister every buffer, drop
        the agent. A WRITE still in progress then is released (NIXL tries to cancel it) without
        telling its receiver, whose pages stay quarantined."""
        if self._agent is None:
            return
        for p in list(self._pending()):
            p.fail(RuntimeError("KVSender closed before this send ended"))
        self._queue.clear()
        end = time.perf_counter() + GRACE_S
        while self._abandoned and time.perf_counter() < end:
            self._abandoned = [p for p in self._abandoned if p.advance()]
        for p in self._abandoned:
            p.advance(force=True)
        self._abandoned = []
        self._sync()  # (a copy in flight writes into an attached pool)
        self._remote.clear()
        for reg in [e[0] for e in self._pins.values()] + [f[-1] for f in self._fixed]:
            self._agent.deregister_memory(reg)
        self._pins, self._fixed, self._agent = {}, [], None
        self._link = None  # (its agent, which the sends' bound methods would keep alive)
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def memory_of(x):
    """``(address, memory type, device id)`` of a NumPy array or a GPU array."""
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0], "DRAM", 0
    if not hasattr(x, "__cuda_array_interface__"):
        return None
    dev = getattr(x, "device", None)  # CuPy's .id, torch's .index
    ids = [getattr(dev, a, None) for a in ("id", "index")]
    return x.__cuda_array_interface__["data"][0], "VRAM", next(
        (i for i in ids if isinstance(i, int)), 0)


def kv_source(kv, L: int, n: int, rb: int):
    """``(address, layer stride, memory type, device id)`` of ``kv``, checked: uint8
    ``[L, n, rb]``, each layer's rows one after the other."""
    if (where := memory_of(kv)) is None:
        raise TypeError(f"kv must be a NumPy array or a GPU array (__cuda_array_interface__), "
                        f"got {type(kv).__name__}")
    cai = None if isinstance(kv, np.ndarray) else kv.__cuda_array_interface__
    shape, dtype = (kv.shape, kv.dtype) if cai is None else \
        (tuple(cai["shape"]), np.dtype(cai["typestr"]))
    if dtype != np.uint8 or tuple(shape) != (L, n, rb):
        raise ValueError(f"kv must be uint8 [{L}, {n}, {rb}] (the ticket's n_layers, n_tokens, "
                         f"row_bytes), got {dtype} {list(shape)}")
    strides = kv.strides if cai is None else (cai.get("strides") or (n * rb, rb, 1))
    if strides[2] != 1 or strides[1] != rb or strides[0] < 0:
        raise ValueError(f"kv's rows must follow each other in each layer (strides [>= 0, "
                         f"{rb}, 1]), got strides {list(strides)}: pass a contiguous copy")
    return where[0], strides[0], where[1], where[2]
