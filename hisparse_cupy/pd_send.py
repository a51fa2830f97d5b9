"""The prefill side of :mod:`hisparse_cupy.pd`: :class:`KVSender` writes a request's KV into the
pages of a receiver's ticket (one NIXL WRITE, or on the receiver's node copies into its shared
pool), or offers it for the receiver to read (a pull: one NIXL READ, posted by the receiver);
:class:`PendingSend` drives each to the end."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import time

import cupy
import numpy as np

from . import _checks, _nixl, host_shm
from .host_pool import HostKVPool
from .host_rows import store_rows

__all__ = ["KVSender", "PendingSend"]

TICKET_VERSION = 1
_GRACE_S = 1.0  # a pull past its deadline: how long the receiver has to answer its withdrawal
Sent = _nixl.Sent


class PendingSend:
    """A send in flight: a WRITE (NIXL sends the receiver the notification once it is
    complete), queued behind the sender's earlier WRITEs until it is posted, or a pull's offer
    (done when the receiver says its READ completed). :meth:`wait` (or :meth:`poll` until True)
    drives it, and the sender's earlier sends, to the end. :attr:`state`: ``"QUEUED"``,
    ``"PROC"`` or ``"DONE"``; :attr:`kind`: ``"write"``, ``"pull"`` (an offer) or ``"copy"``
    (the same-node path: done once its copies are and the receiver is notified)."""

    def __init__(self, agent, settle, handle, key, t: dict, t0: float, deadline: float,
                 heard=None, progress=None, copied=None, keep=None):
        self._agent, self._settle, self._handle, self._heard = agent, settle, handle, heard
        self._keep = keep  # the send's kv, alive until it ends (freed, its memory is reused)
        self._progress = progress  # the sender's: its other sends polled, queued ones posted
        self._copied = copied  # a copy's: "PROC" until its copies are done and notified
        self.pin_key, self.pull = key, heard is not None
        self.kind = "pull" if self.pull else "copy" if copied is not None else "write"
        self.req_id, self.xfer_id, self.agent = t.get("req_id"), t["xfer_id"], t["agent"]
        self.bytes = t["n_layers"] * t["n_tokens"] * t["row_bytes"]
        self.descriptors, self.t0, self.deadline = len(t["descs"]), t0, deadline
        self.tag = t.get("tag")  # a pull's: its offer's tag (the receiver's answers name it)
        self.result, self._ended, self.error = None, False, None
        self.state = "QUEUED" if self.kind == "write" else "PROC"  # (KVSender posts WRITEs)

    @property
    def ended(self) -> bool:
        """Done or failed (no more progress to make)."""
        return self._ended

    def start(self) -> None:
        """Post a queued WRITE (its sender's turn)."""
        self.state = "PROC"
        self._step(lambda: self._agent.transfer(self._handle))

    def _step(self, call) -> None:
        try:
            st = call()
        except Exception as e:
            self.fail(RuntimeError(f"NIXL transfer {self.xfer_id} to {self.agent!r} failed "
                                   f"({e!r}): the receiver is gone, or its metadata is stale"))
            raise self.error from e
        if st not in ("PROC", "DONE"):
            self.fail(RuntimeError(f"NIXL transfer {self.xfer_id} to {self.agent!r} failed "
                                   f"({st})"))
            raise self.error
        if st == "DONE":
            self._finish(ok=True)

    def fail(self, error: Exception) -> None:
        """End it unsent or failed: :meth:`poll` and :meth:`wait` raise ``error``."""
        if not self._ended:
            self.error = error
            self._finish(ok=False)

    def expire(self) -> None:
        """End it past its deadline: a ``TimeoutError`` that says whether it was posted."""
        self.fail(TimeoutError(
            f"NIXL transfer {self.xfer_id} to {self.agent!r} did not " +
            ("start in time (the sender's earlier WRITEs took it)" if self.state == "QUEUED"
             else "complete in time")))

    def _check(self) -> None:
        """One look at this send's state, if it is posted and not ended."""
        if self.result is None and not self._ended and self.state != "QUEUED":
            self._step(lambda: self._heard(self.tag) if self.pull else self._copied()
                       if self._copied is not None else self._agent.check_xfer_state(self._handle))

    def advance(self) -> None:
        """Poll this send alone (errors kept for its own :meth:`poll`)."""
        with contextlib.suppress(RuntimeError):
            self._check()

    def poll(self) -> bool:
        """Progress the transfer (and the sender's earlier ones); True once done
        (``RuntimeError`` if it failed, ``TimeoutError`` if it waited in the queue past its
        deadline)."""
        if self.result is None and not self._ended and self._progress is not None:
            self._progress(self)
        self._check()
        if self._ended and self.result is None:
            raise self.error or RuntimeError(f"NIXL transfer {self.xfer_id} to {self.agent!r} "
                                             f"already failed")
        return self.result is not None

    def wait(self, timeout_s: float | None = None) -> Sent:
        """Poll to the end: :class:`Sent`; ``TimeoutError`` past the deadline. A WRITE's handle
        is released then (NIXL tries to cancel); a pull is withdrawn (the receiver cancels its
        READ and fails the reservation) and the receiver given ``_GRACE_S`` to answer: if its
        READ had completed, the send succeeds after all; if it does not answer (not polling,
        gone), it may still read ``kv`` until its reservation ends."""
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
        """Tell the receiver a pull is given up, and wait up to ``_GRACE_S`` for its answer:
        True if its READ had completed (the send succeeded after all)."""
        with contextlib.suppress(Exception):
            self._agent.send_notif(self.agent, _nixl.WITHDRAWN + self.tag.encode())
        end = time.perf_counter() + _GRACE_S
        while time.perf_counter() < end:
            st = self._heard(self.tag)
            if st == "DONE":
                self._finish(ok=True)
                return True
            if st != "PROC":
                break
            time.sleep(0.001)
        return False

    def _finish(self, ok: bool) -> None:
        if self._ended:
            return
        self._ended, handle, self._handle = True, self._handle, None
        keep, self._keep = self._keep, None
        with contextlib.suppress(Exception):  # still active, NIXL could not cancel: kept
            if handle is not None:
                handle.release()
                handle = None
        self._settle(self, ok, None if handle is None else (handle, keep))  # (with its kv)
        if ok:
            self.state = "DONE"
            self.result = Sent(self.req_id, self.xfer_id, self.bytes,
                               time.perf_counter() - self.t0, self.descriptors)


class KVSender:
    """The prefill side: a NIXL agent (``name``: default unique) that sends requests' KV into
    the pages of receivers' tickets.

    ``pull=False``: one NIXL WRITE per request, from the sender; ``desc_bytes``: its
    descriptors cut into pieces of at most this many bytes (default 3 MiB: on one H200 box
    UCX's pipeline moved a WRITE from VRAM at 26-30 GB/s in pieces up to its fragment size,
    ``UCX_RNDV_FRAG_SIZE``, 4 MiB for GPU memory by default, and at 2.7-3.8 GB/s in larger
    ones, ``benchmarks/bench_pd.py``); None: as the ticket gives them.
    ``ucx_params``: NIXL's UCX backend parameters for the sender's agent (e.g.
    ``{"num_workers": 4}``; default NIXL's).
    ``same_node``: GPU ``kv`` for a ticket whose pool is a shared ``HostKVPool`` on this node is
    stored into it (2-D ``cudaMemcpyAsync`` per run of pages, after the current stream's work,
    on a stream of the sender's) and the receiver
    notified once the copies are done (default True; :mod:`hisparse_cupy.pd`); False: NIXL.
    The pool stays attached until :meth:`close` (or a ticket names another pool of its name);
    a pool that cannot be attached (another mount namespace, its creator's PID namespace not
    visible) sends over NIXL (counted in ``stats["not_attached"]``; ``stats["copied"]``: the
    sends that took the same-node path).
    ``max_in_flight``: WRITEs posted at once to one receiver (default 1; None: no limit); later
    sends to it wait in order, posted as earlier ones end (one H200 box: 3 requests posted
    together 27.2 GB/s, one after another 29.6). Receivers do not wait for each
    other; a WRITE to a receiver that stopped answering holds that receiver's queue until its
    deadline.
    ``pull=True``: the sender registers ``kv`` and offers it (a NIXL notification to the
    receiver carrying its metadata and descriptors); the receiver's :meth:`KVReceiver.poll`
    posts one READ of it into the reserved pages and tells the sender when it completed. The
    receiver must be polling for a pull to progress (one thread may drive both sides: send with
    ``wait=False``)."""

    def __init__(self, *, name: str | None = None, desc_bytes: int | None = 3 << 20,
                 pull: bool = False, max_in_flight: int | None = 1,
                 ucx_params: dict | None = None, same_node: bool = True):
        self.desc_bytes = None if desc_bytes is None else \
            _checks.integer("desc_bytes", desc_bytes, 1)
        self.max_in_flight = None if max_in_flight is None else \
            _checks.integer("max_in_flight", max_in_flight, 1)
        self._flight: dict = collections.defaultdict(list)  # receiver -> WRITEs posted
        self._queue: dict = collections.defaultdict(collections.deque)  # -> WRITEs waiting
        for k, v in (("pull", pull), ("same_node", same_node)):
            if not isinstance(v, bool):
                raise TypeError(f"{k} must be a bool, got {type(v).__name__}")
        self.pull, self.same_node = pull, same_node
        self._pools: dict = {}  # shared pool name -> HostKVPool attached (the same-node path)
        self._streams: dict = {}  # device -> the stream of its copies
        self._unreachable: set = set()  # (name, *identity) of shared pools not attachable here
        self.name, self._agent = _nixl.agent(name, "tx", _nixl.ucx_params(ucx_params))
        self._remote: dict = {}  # receiver agent name -> the metadata loaded
        self._fixed: list = []  # (mem, dev, lo, hi, reg), from register()
        self._pins: dict = {}  # (mem, dev, lo, hi) -> [reg, users], registered for sends
        self._abandoned: list = []
        self._waiting: set = set()  # tags of the pulls in flight ("xfer_id/attempt")
        self._outcome: dict = {}  # tag -> "DONE" / "ERR ..." heard, not yet collected
        self._attempt = itertools.count()
        self.stats: dict = {"late": 0, "unknown": 0, "copied": 0, "not_attached": 0}

    def register(self, buf) -> None:
        """Register ``buf`` (a NumPy or GPU array: the engine's KV buffer) for the sender's
        lifetime: a ``kv`` inside it is then sent without registering it again."""
        self._open()
        if (where := _checks.memory_of(buf)) is None or not buf.nbytes:
            raise TypeError(f"buf must be a non-empty NumPy or GPU array, got {buf!r:.80}")
        lo, mem, dev = where
        reg = self._agent.register_memory([(lo, int(buf.nbytes), dev, "")], mem)
        self._fixed.append((mem, dev, lo, lo + int(buf.nbytes), reg))

    def _open(self) -> None:
        if self._agent is None:
            raise RuntimeError("KVSender is closed")

    def send(self, ticket: dict, kv, *, timeout_s: float | None = None, wait: bool = True):
        """Send ``kv`` (uint8 ``[n_layers, n_tokens, row_bytes]`` of the ticket) into the
        ticket's pages (a WRITE notified with its transfer id, the same-node path's copies, or
        a pull's offer): :class:`Sent` once done, or (``wait=False``) a :class:`PendingSend` to
        poll to the end, which holds ``kv`` until then (a temporary's memory is not reused
        while it is read); ``kv``'s bytes must be complete at the call (GPU memory: the work
        writing them synchronized, as NIXL reads without waiting for any stream) and stay
        unchanged until then. ``timeout_s``:
        default half the ticket's. Bad input raises before any transfer. After a pull timed
        out, the receiver may still be reading ``kv`` until its reservation ends (the ticket's
        ``timeout_s`` after it was made): keep ``kv`` until then."""
        self._open()
        t0 = time.perf_counter()
        t = _checks.pd_ticket(ticket, TICKET_VERSION)
        L, n, rb = t["n_layers"], t["n_tokens"], t["row_bytes"]
        ptr, stride, mem, dev = _checks.kv_source(kv, L, n, rb)
        limit = _nixl.seconds("timeout_s", timeout_s if timeout_s is not None else
                              float(t.get("timeout_s") or 60.0) / 2)
        if self.pull and t.get("pull") is not True:
            raise ValueError("ticket's receiver cannot pull (no ticket['pull']): send it with "
                             "KVSender(pull=False)")
        name = self._connect(t)
        local = (ptr + np.arange(L)[:, None] * stride + t["runs"][:, 0] * rb).ravel()
        local = np.stack([local.astype(np.uint64), t["descs"][:, 1]], -1)
        if not self.pull and mem == "VRAM" and (pool := self._local_pool(t)) is not None:
            p = self._copy(t, name, pool, dev, t0, limit, kv)
            return p.wait() if wait else p
        key = self._pin(mem, dev, ptr, ptr + (L - 1) * stride + n * rb)
        if self.pull:
            return self._offer(t, name, local, mem, dev, key, t0, limit, wait, kv)
        remote = t["descs"]
        if self.desc_bytes is not None:
            local, remote = _nixl.cut(local, self.desc_bytes), _nixl.cut(remote, self.desc_bytes)
        try:
            handle = self._agent.initialize_xfer(
                "WRITE", _nixl.xfer_descs(self._agent, local, dev, mem),
                _nixl.xfer_descs(self._agent, remote, t["dev"], "DRAM"), name,
                t["xfer_id"].encode())
        except Exception as e:
            self._unpin(key)
            raise ValueError(f"NIXL refused the WRITE to {name!r} ({e!r}): the ticket's "
                             f"descriptors are not in memory that agent registered (a stale "
                             f"or altered ticket)") from None
        p = PendingSend(self._agent, self._settle, handle, key, t, t0, t0 + limit,
                        progress=self._progress, keep=kv)
        self._queue[name].append(p)
        self._launch()
        return p.wait() if wait else p

    @property
    def in_flight(self) -> int:
        """WRITEs posted and not ended."""
        return sum(map(len, self._flight.values()))

    @property
    def queued(self) -> int:
        """WRITEs waiting for their turn."""
        return sum(not q.ended for d in self._queue.values() for q in d)

    def _launch(self) -> None:
        """Post each receiver's queued WRITEs, in order, while fewer than ``max_in_flight`` are
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
                with contextlib.suppress(RuntimeError):  # (kept in q: its own poll raises it)
                    q.start()
            if not queue:
                del self._queue[name]

    def _progress(self, caller) -> None:
        """Poll the WRITEs in flight but ``caller``, then post what the queue allows."""
        for p in [p for flight in self._flight.values() for p in flight]:
            if p is not caller:
                p.advance()
        self._launch()

    def _local_pool(self, t: dict):
        """The ticket's shared pool attached here, if it offers one on this node and
        ``same_node`` is on (attached once; None: send over NIXL)."""
        shm = t.get("shm")
        if not self.same_node or shm is None or shm["identity"][0] != host_shm.node_id():
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

    def _copy(self, t, name, pool, dev, t0, limit, kv) -> PendingSend:
        """The same-node path: ``kv`` stored into the ticket's rows of ``pool``
        (``host_rows.store_rows``: a 2-D copy of every layer per run of pages, the package's
        copy kernel where runs are short) on this sender's stream of ``dev``, after the
        current stream's work; the receiver notified once the copies are done."""
        L, rb, LB = t["n_layers"], t["row_bytes"], pool.layer_bytes
        off = (t["descs"][:, 0].astype(np.int64) - t["shm"]["base"]).reshape(L, -1)
        if (off[0] % rb).any() or (off - off[:1] != np.arange(L)[:, None] * LB).any():
            raise ValueError("ticket['shm']: its descriptors are not rows of the pool's layers "
                             "(a stale or altered ticket)")
        rows = np.concatenate([np.arange(r, r + c) for r, c in
                               zip(off[0] // rb, t["runs"][:, 1].astype(np.int64), strict=True)])
        with cupy.cuda.Device(dev):
            if dev not in self._streams:
                self._streams[dev] = cupy.cuda.Stream(non_blocking=True)
            s = self._streams[dev]
            s.wait_event(cupy.cuda.get_current_stream().record())
            store_rows(pool, rows, cupy.asarray(kv), s)
            done = s.record()
        xid = t["xfer_id"].encode()

        def copied() -> str:
            if not done.done:
                return "PROC"
            self._agent.send_notif(name, xid)  # (raises if the receiver is gone)
            return "DONE"

        self.stats["copied"] += 1
        return PendingSend(self._agent, self._settle, None, None, t, t0, t0 + limit,
                           copied=copied, keep=kv)

    def _sync(self) -> None:
        for s in self._streams.values():
            s.synchronize()

    def _offer(self, t, name, local, mem, dev, key, t0, limit, wait, kv):
        xid = t["xfer_id"]
        tag = f"{xid}/{next(self._attempt)}"  # a resend's answers are told from the last's
        offer = {"xfer_id": xid, "tag": tag, "agent": self.name, "mem": mem, "dev": dev,
                 "metadata": _nixl.metadata(self._agent), "descs": local.tolist()}
        try:
            if any(w.rsplit("/", 1)[0] == xid for w in self._waiting):
                raise ValueError(f"ticket {xid} is being sent already")
            self._agent.send_notif(name, _nixl.OFFER + json.dumps(offer).encode())
        except ValueError:
            self._unpin(key)
            raise
        except Exception as e:
            self._unpin(key)
            raise RuntimeError(f"the offer of {xid} to {name!r} did not leave ({e!r}): the "
                               f"receiver is gone, or its metadata is stale") from e
        self._waiting.add(tag)
        p = PendingSend(self._agent, self._settle, None, key, {**t, "tag": tag}, t0, t0 + limit,
                        self._heard, keep=kv)
        return p.wait() if wait else p

    def _heard(self, tag: str) -> str:
        """A pull's state: ``"PROC"``, ``"DONE"`` or ``"ERR ..."`` (the receiver's words)."""
        for _, msgs in self._agent.get_new_notifs().items():
            for msg in map(bytes, msgs):
                done = msg.startswith(_nixl.READ_DONE)
                if not done and not msg.startswith(_nixl.READ_FAILED):
                    self.stats["unknown"] += 1
                    continue
                body = msg[len(_nixl.READ_DONE if done else _nixl.READ_FAILED):].decode(
                    "utf-8", "replace")
                x, _, why = body.partition(" ")
                if x not in self._waiting:
                    self.stats["late"] += 1
                    continue
                self._outcome[x] = "DONE" if done else f"ERR (the receiver: {why})"
        return self._outcome.pop(tag, "PROC")

    def _connect(self, t: dict) -> str:
        """Load the ticket's receiver metadata (again when it changed)."""
        name = t["agent"]
        try:
            _nixl.load_peer(self._agent, self._remote, name, t["metadata"], "ticket['metadata']")
        except ValueError:
            self._forget(name)
            raise
        return name

    def _settle(self, p: PendingSend, ok: bool, stuck) -> None:
        """A send ended: unregister its kv (unless NIXL could not release its handle: both
        kept, the kv object too);
        a WRITE's end lets the next queued one go."""
        if p.pull:
            self._waiting.discard(p.tag)
            self._outcome.pop(p.tag, None)
        self._abandoned.append(stuck) if stuck is not None else self._unpin(p.pin_key)
        flight = self._flight.get(p.agent, ())
        if p in flight:
            flight.remove(p)  # (the list stays: _launch may be appending to it)
            if not ok:  # posted and failed: the receiver's metadata may be stale
                self._forget(p.agent)

    def _forget(self, name: str) -> None:
        """Drop a receiver's metadata (stale, or its transfer failed): the next ticket reloads."""
        if self._remote.pop(name, None) is not None and self._agent is not None:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(name)

    def _pin(self, mem: str, dev: int, lo: int, hi: int):
        if any(m == mem and d == dev and a <= lo and hi <= b for m, d, a, b, _ in self._fixed):
            return None
        key = (mem, dev, lo, hi)
        if key not in self._pins:
            self._pins[key] = [self._agent.register_memory([(lo, hi - lo, dev, "")], mem), 0]
        self._pins[key][1] += 1
        return key

    def _unpin(self, key) -> None:
        ent = self._pins.get(key)
        if ent is not None:
            ent[1] -= 1
            if ent[1] == 0:
                del self._pins[key]
                self._agent.deregister_memory(ent[0])

    def close(self) -> None:
        """Forget every receiver, deregister every buffer, drop the agent."""
        if self._agent is not None:
            for q in [q for d in self._queue.values() for q in d]:
                q.fail(RuntimeError("KVSender closed before this send's turn"))
            self._queue.clear()
            for name in list(self._remote):
                self._forget(name)
            for reg in [e[0] for e in self._pins.values()] + [f[-1] for f in self._fixed]:
                self._agent.deregister_memory(reg)
            self._pins, self._fixed, self._agent = {}, [], None
            self._sync()  # (a copy in flight writes into an attached pool)
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
