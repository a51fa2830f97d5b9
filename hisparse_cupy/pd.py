"""Prefill on another node: a request's KV lands in the decode host's page pool over NIXL.

1. **reserve** (decode): :meth:`KVReceiver.reserve` takes the request's pages as engine-held
   pages (``HostPages.take``: no request's table names them, so no swap reads them as they
   fill) and returns a *ticket*, a JSON dict: the receiver's agent name, instance and NIXL
   metadata (base64), a transfer id unique to the reservation, the runs of consecutive pages
   (``[first token, tokens]``), the destination descriptors ``[addr, bytes]`` layer-major
   (layer 0's runs, then layer 1's...), ``n_tokens, page_tokens, n_layers, row_bytes, timeout_s``.
2. **ticket -> prefill** over the engines' own control plane (JSON; no other service).
3. **send** (prefill): :meth:`KVSender.send` checks ``kv`` (uint8 ``[L, n, row_bytes]``, rows
   contiguous per layer; host, or GPU by ``__cuda_array_interface__`` as VRAM) against the
   ticket, loads the receiver's metadata (once per instance), registers ``kv`` unless it is in
   a buffer given to :meth:`KVSender.register` (no staging copy either way), posts one NIXL
   WRITE of every run of every layer notified with the transfer id, and polls it to the end.
4. **poll** (decode): :meth:`KVReceiver.poll` reads NIXL's notifications: a live reservation's
   id completes it (an :class:`Arrival`); a reservation past its deadline has its pages put
   back, once, and is reported timed out; a notification for an id that is done, timed out,
   cancelled or unknown changes nothing (counted in :attr:`KVReceiver.stats`).
5. **admit**: :meth:`KVReceiver.admit` calls ``cache.admit(n, pages=<whole pages>, kv=<a copy
   of the partial last page's rows>)`` (``HostPages.admit`` shares whole engine pages only: the
   at most ``P - 1`` rows per layer of a partial page are copied into a page of the request's)
   and drops the engine's hold; :meth:`KVReceiver.admit_args` gives those arguments instead.

Ordering: NIXL's UCX backend (``nixlUcxEngine::postXfer`` / ``checkXfer``,
``src/plugins/ucx/ucx_backend.cpp``) posts the writes, then a flush of each endpoint, and sends
the notification (an active message) only once writes and flushes completed, and a UCX flush
completes once the writes are complete at the target (the Python docs: ``notif_msg`` is "sent
after transfer completion"): when the id arrives, the bytes are in the pool. The status check
that finds the transfer done sends it: a sender that stops polling (or dies) first never
notifies (seen here), which ends as the receiver's timeout.

Limits: the pool is registered whole, so an agent with the metadata can write all of it (no
per-reservation rights in NIXL): senders are trusted. A timeout frees pages that a slow sender
may still write: keep ``timeout_s`` well above the worst transfer (a sender gives up at half
the ticket's and releases its handle: NIXL tries to cancel). One thread drives each object.
NIXL logs INFO lines to stdout (``NIXL_LOG_LEVEL=WARN`` silences them). UCX_RMA_PPLN_ENABLE is
``y`` unless set: UCX would emulate a WRITE from GPU memory to another process over TCP."""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import importlib
import itertools
import os
import time
import uuid

import numpy as np

from . import _checks
from .host_pages import HostPages, consecutive_runs

__all__ = ["Arrival", "KVReceiver", "KVSender", "PendingSend", "Polled", "Sent", "nixl_api"]

TICKET_VERSION = 1
_NEEDS_NIXL = ("hisparse_cupy.pd needs NIXL's Python API: pip install nixl-cu12 (CUDA 12) or "
               "nixl-cu13 (CUDA 13); for host (DRAM) transfers `pip install --no-deps "
               "nixl-cu12` plus NumPy is enough (its torch dependency is not needed)")
_ENDED_KEEP = 1 << 16  # ended transfer ids remembered, to tell late from unknown notifications


def nixl_api():
    """NIXL's Python API (the ``nixl`` package, else the wheels' ``nixl_cu13`` / ``nixl_cu12``),
    imported on first use; ``ImportError`` naming what to install."""
    why = []
    for name in ("nixl", "nixl_cu13", "nixl_cu12"):
        for mod in (name, name + "._api"):
            try:
                m = importlib.import_module(mod)
            except ImportError as e:
                why.append(f"{mod}: {e}")
                break
            if hasattr(m, "nixl_agent"):
                return m
    raise ImportError(f"{_NEEDS_NIXL} ({'; '.join(why)})")


def _seconds(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of seconds, got {type(v).__name__}")
    if not v > 0:
        raise ValueError(f"{name} must be > 0, got {v}")
    return float(v)


def _agent(name, side: str):
    """``(name, a NIXL agent of that name with the UCX backend)``; default name: unique."""
    name = f"hisparse-{side}-{os.getpid()}-{uuid.uuid4().hex[:8]}" if name is None else name
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    api = nixl_api()
    os.environ.setdefault("UCX_RMA_PPLN_ENABLE", "y")  # module docstring
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RuntimeError(f"NIXL's UCX backend did not start ({agent.get_plugin_list()})")
    return name, agent


Arrival = collections.namedtuple("Arrival", "req_id pages n_tokens xfer_id sender seconds")
Arrival.__doc__ = """A completed reservation: ``pages`` (engine-held, token order) hold its
``n_tokens`` tokens; ``sender`` notified, ``seconds`` after the reservation."""
Polled = collections.namedtuple("Polled", "done timed_out")
Sent = collections.namedtuple("Sent", "req_id xfer_id bytes seconds descriptors")
Sent.__doc__ = "A completed send: ``bytes`` in ``seconds`` (the call), the ticket's descriptors"
_Reservation = collections.namedtuple("_Reservation", "req_id xfer_id pages n_tokens t0 deadline")


class _Agent:
    _agent = None

    def _open(self) -> None:
        if self._agent is None:
            raise RuntimeError(f"{type(self).__name__} is closed")


class KVReceiver(_Agent):
    """The decode side: ``pool`` (uint8 ``[n_layers, n_rows, row_bytes]``, C-contiguous:
    ``cache.pool.numpy``, or a ``HostKVPool``) registered with a NIXL agent (``name``: default
    unique) once, and pages of ``pages`` (its :class:`HostPages`, ``cache.pages``) reserved per
    request; ``timeout_s``: a reservation's default wait; ``clock``: monotonic seconds;
    ``fence``: called before a ticket leaves (``cache.host.wait_releases``: a taken page may be a
    released request's that queued device work still reads)."""

    def __init__(self, pool, pages: HostPages, *, timeout_s: float = 60.0, name: str | None = None,
                 clock=time.monotonic, fence=None):
        arr = pool if isinstance(pool, np.ndarray) else getattr(pool, "numpy", None)
        if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 3 or \
                not arr.flags.c_contiguous:
            raise TypeError(f"pool must be a C-contiguous uint8 [n_layers, n_rows, row_bytes] "
                            f"NumPy array (cache.pool.numpy) or a HostKVPool, got {pool!r:.80}")
        if not isinstance(pages, HostPages):
            raise TypeError(f"pages must be a HostPages (cache.pages), got {type(pages).__name__}")
        if pages.n_rows > arr.shape[1]:
            raise ValueError(f"pages covers {pages.n_rows} rows per layer; pool holds "
                             f"{arr.shape[1]}")
        self.pool, self.pages, self.page_tokens = arr, pages, pages.page_tokens
        self.n_layers, _, self.row_bytes = arr.shape
        self.timeout_s = _seconds("timeout_s", timeout_s)
        self._clock, self._fence = clock, fence
        self.instance = uuid.uuid4().hex
        self.name, self._agent = _agent(name, "rx")
        self._reg = self._agent.register_memory([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")
        self._md = base64.b64encode(self._agent.get_agent_metadata()).decode("ascii")
        self._seq = itertools.count()
        self._live: dict = {}  # req_id -> _Reservation
        self._by_xfer: dict = {}  # xfer_id -> req_id, of the live ones
        self._ended: collections.OrderedDict = collections.OrderedDict()  # xfer_id -> why
        self._held: dict = {}  # xfer_id -> pages, of arrivals not yet admitted or released
        self.stats = collections.Counter()

    @property
    def in_flight(self) -> dict:  # req_id -> tokens, of the reservations waiting
        return {r.req_id: r.n_tokens for r in self._live.values()}

    def reserve(self, req_id, n_tokens: int, *, timeout_s: float | None = None) -> dict:
        """Pages for request ``req_id``'s (an int or str) ``n_tokens`` tokens, held until its
        transfer arrives, times out or is cancelled; returns the ticket (module docstring).
        Raises ``PoolExhausted`` (nothing taken), or ``ValueError`` / ``TypeError`` naming it."""
        self._open()
        if isinstance(req_id, bool) or not isinstance(req_id, (int, np.integer, str)):
            raise TypeError(f"req_id must be an int or a str (it goes into a JSON ticket), got "
                            f"{type(req_id).__name__}")
        req_id = int(req_id) if isinstance(req_id, np.integer) else req_id
        if req_id in self._live:
            raise ValueError(f"req_id {req_id!r} already has a reservation in flight")
        n = _checks.integer("n_tokens", n_tokens, 1, self.pages.n_rows)
        t = self.timeout_s if timeout_s is None else _seconds("timeout_s", timeout_s)
        pages = self.pages.take(self.pages.pages_for(n))
        if self._fence is not None:
            self._fence()
        P, rb = self.page_tokens, self.row_bytes
        pg = np.asarray(pages, np.int64)
        first, last = consecutive_runs(pg)  # runs of consecutive pages
        cnt = np.minimum(last * P, n) - first * P
        layer = self.pool.ctypes.data + np.arange(self.n_layers)[:, None] * self.pool.strides[0]
        addr = layer + pg[first] * (P * rb)
        descs = np.stack([addr, np.broadcast_to(cnt * rb, addr.shape)], -1).reshape(-1, 2)
        xfer_id = f"{self.instance}.{next(self._seq)}"
        now = self._clock()
        self._live[req_id] = _Reservation(req_id, xfer_id, pages, n, now, now + t)
        self._by_xfer[xfer_id] = req_id
        return {"version": TICKET_VERSION, "agent": self.name, "instance": self.instance,
                "metadata": self._md, "xfer_id": xfer_id, "req_id": req_id, "n_tokens": n,
                "page_tokens": P, "n_layers": self.n_layers, "row_bytes": rb, "timeout_s": t,
                "mem": "DRAM", "dev": 0, "runs": np.stack([first * P, cnt], -1).tolist(),
                "descs": descs.tolist()}

    def poll(self) -> Polled:
        """Read NIXL's notifications, then expire the reservations past their deadline (pages
        put back). Returns the arrivals (to :meth:`admit`) and the req_ids that timed out."""
        self._open()
        done = []
        for sender, msgs in self._agent.get_new_notifs().items():
            for msg in msgs:
                xid = bytes(msg).decode("ascii", "replace")
                rid = self._by_xfer.get(xid)
                if rid is None:
                    why = self._ended.get(xid)
                    self.stats["duplicate" if why == "done" else "late" if why else
                               "unknown"] += 1
                    continue
                r = self._end(self._live[rid], "done")
                self._held[xid] = r.pages
                done.append(Arrival(rid, list(r.pages), r.n_tokens, xid, sender,
                                    self._clock() - r.t0))
        now = self._clock()
        late = [self._end(r, "timed_out") for r in list(self._live.values()) if now >= r.deadline]
        return Polled(done, [r.req_id for r in late])

    def cancel(self, req_id) -> None:
        """Free ``req_id``'s reservation now (pages put back; its notification, if one comes,
        is ignored). ``KeyError`` if it has none in flight."""
        self._open()
        if req_id not in self._live:
            raise KeyError(f"req_id {req_id!r} has no reservation in flight (it arrived, timed "
                           f"out or was cancelled)")
        self._end(self._live[req_id], "cancelled")

    def _end(self, r: _Reservation, why: str) -> _Reservation:
        del self._live[r.req_id], self._by_xfer[r.xfer_id]
        self._ended[r.xfer_id] = why
        if len(self._ended) > _ENDED_KEEP:
            self._ended.popitem(last=False)
        self.stats[why] += 1
        if why != "done":
            self.pages.put(r.pages)
        return r

    def _arrived(self, arrival: Arrival) -> list:
        if not isinstance(arrival, Arrival) or arrival.xfer_id not in self._held:
            raise ValueError(f"arrival {arrival!r:.60} is not one of this receiver's arrivals "
                             f"still held (already admitted or released?)")
        return self._held[arrival.xfer_id]

    def admit_args(self, arrival: Arrival):
        """``(n_tokens, whole pages or None, kv or None)`` for ``cache.admit(n_tokens,
        pages=..., kv=...)``: ``kv`` is a copy of the partial last page's rows, uint8
        ``[L, n_tokens % page_tokens, row_bytes]`` (None when the pages are full)."""
        pages = self._arrived(arrival)
        whole, rest = divmod(arrival.n_tokens, self.page_tokens)
        row = pages[-1] * self.page_tokens
        kv = self.pool[:, row: row + rest].copy() if rest else None
        return arrival.n_tokens, (pages[:whole] or None), kv

    def admit(self, cache, arrival: Arrival, **kwargs) -> int:
        """Admit ``arrival`` into paged ``cache`` (``kwargs`` to ``cache.admit``), drop the hold;
        the request slot. If ``cache.admit`` raises the pages stay held: retry, or release."""
        if getattr(cache, "pages", None) is not self.pages:
            raise ValueError("cache's pages are not this receiver's pages (cache.pages)")
        n, whole, kv = self.admit_args(arrival)
        rid = cache.admit(n, kv=kv, pages=whole, **kwargs)
        self.release(arrival)
        return rid

    def release(self, arrival: Arrival) -> None:
        """Drop the engine's hold on ``arrival``'s pages, once (the request's stay after admit)."""
        self._arrived(arrival)
        self.pages.put(self._held.pop(arrival.xfer_id))

    def close(self) -> None:
        """Cancel the reservations in flight, deregister the pool (arrivals keep their pages)."""
        if self._agent is not None:
            for r in list(self._live.values()):
                self._end(r, "cancelled")
            agent, self._agent = self._agent, None
            agent.deregister_memory(self._reg)


def _cut(descs: np.ndarray, piece: int) -> np.ndarray:
    """``[addr, bytes, dev]`` descriptors cut into pieces of at most ``piece`` bytes."""
    n = descs[:, 1].astype(np.int64)
    k = np.maximum(1, -(-n // piece))
    idx = np.repeat(np.arange(n.size), k)
    off = (np.arange(idx.size) - np.repeat(np.cumsum(k) - k, k)) * piece
    out = descs[idx].copy()
    out[:, 0] += off.astype(np.uint64)
    out[:, 1] = np.minimum(piece, n[idx] - off).astype(np.uint64)
    return out


class PendingSend:
    """A posted WRITE: :meth:`wait` (or :meth:`poll` until True) drives it to the end, which is
    when NIXL sends the receiver the notification. :attr:`state`: ``"PROC"`` or ``"DONE"``."""

    def __init__(self, agent, settle, handle, key, t: dict, t0: float, deadline: float):
        self._agent, self._settle, self._handle, self._key = agent, settle, handle, key
        self.req_id, self.xfer_id, self.agent = t.get("req_id"), t["xfer_id"], t["agent"]
        self.bytes = t["n_layers"] * t["n_tokens"] * t["row_bytes"]
        self.descriptors, self.t0, self.deadline = len(t["descs"]), t0, deadline
        self.result, self.state = None, "PROC"
        self._step(lambda: agent.transfer(handle))

    def _step(self, call) -> None:
        try:
            st = call()
        except Exception as e:
            self._finish(ok=False)
            raise RuntimeError(f"NIXL transfer {self.xfer_id} to {self.agent!r} failed ({e!r}): "
                               f"the receiver is gone, or its metadata is stale") from e
        if st not in ("PROC", "DONE"):
            self._finish(ok=False)
            raise RuntimeError(f"NIXL transfer {self.xfer_id} to {self.agent!r} failed ({st})")
        if st == "DONE":
            self._finish(ok=True)

    def poll(self) -> bool:
        """Progress the transfer; True once done (``RuntimeError`` if it failed)."""
        if self.result is None:
            self._step(lambda: self._agent.check_xfer_state(self._handle))
        return self.result is not None

    def wait(self, timeout_s: float | None = None) -> Sent:
        """Poll to the end: :class:`Sent`; ``TimeoutError`` past the deadline (the handle is
        released: NIXL tries to cancel; the receiver's reservation times out)."""
        end = self.deadline if timeout_s is None else \
            time.perf_counter() + _seconds("timeout_s", timeout_s)
        while not self.poll():
            if time.perf_counter() > end:
                self._finish(ok=False)
                raise TimeoutError(f"NIXL transfer {self.xfer_id} to {self.agent!r} did not "
                                   f"complete in time")
            time.sleep(0)
        return self.result

    def _finish(self, ok: bool) -> None:
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        try:
            handle.release()
            handle = None
        except Exception:  # still active and NIXL could not cancel it: kv stays registered
            pass
        self._settle(self._key, self.agent, ok, handle)
        if ok:
            self.result = Sent(self.req_id, self.xfer_id, self.bytes,
                               time.perf_counter() - self.t0, self.descriptors)
            self.state = "DONE"


class KVSender(_Agent):
    """The prefill side: a NIXL agent (``name``: default unique) that writes requests' KV into
    the pages of receivers' tickets. ``desc_bytes``: descriptors cut into pieces of at most this
    many bytes (default 1 MiB: a request of 736 MB went from VRAM at 3.4 GB/s in 78 descriptors,
    at 27.4 GB/s in 1 MiB pieces, ``benchmarks/bench_pd.py``); None: as the ticket gives them."""

    def __init__(self, *, name: str | None = None, desc_bytes: int | None = 1 << 20):
        self.desc_bytes = None if desc_bytes is None else \
            _checks.integer("desc_bytes", desc_bytes, 1)
        self.name, self._agent = _agent(name, "tx")
        self._remote: dict = {}  # receiver agent name -> its instance
        self._fixed: list = []  # (mem, dev, lo, hi, reg), from register()
        self._pins: dict = {}  # (mem, dev, lo, hi) -> [reg, users], registered for sends
        self._abandoned: list = []

    def register(self, buf) -> None:
        """Register ``buf`` (a NumPy or GPU array: the engine's KV buffer) for the sender's
        lifetime: a ``kv`` inside it is then sent without registering it again."""
        self._open()
        if (where := _checks.memory_of(buf)) is None or not buf.nbytes:
            raise TypeError(f"buf must be a non-empty NumPy or GPU array, got {buf!r:.80}")
        lo, mem, dev = where
        reg = self._agent.register_memory([(lo, int(buf.nbytes), dev, "")], mem)
        self._fixed.append((mem, dev, lo, lo + int(buf.nbytes), reg))

    def send(self, ticket: dict, kv, *, timeout_s: float | None = None, wait: bool = True):
        """Write ``kv`` (uint8 ``[n_layers, n_tokens, row_bytes]`` of the ticket) into the
        ticket's pages, one NIXL WRITE notified with its transfer id: :class:`Sent` once done,
        or (``wait=False``) a :class:`PendingSend` to poll to the end (the notification leaves
        then). ``timeout_s``: default half the ticket's. Bad input raises before any transfer."""
        self._open()
        t0 = time.perf_counter()
        t = _checks.pd_ticket(ticket, TICKET_VERSION)
        L, n, rb = t["n_layers"], t["n_tokens"], t["row_bytes"]
        ptr, stride, mem, dev = _checks.kv_source(kv, L, n, rb)
        limit = _seconds("timeout_s", timeout_s if timeout_s is not None else
                         float(t.get("timeout_s") or 60.0) / 2)
        name = self._connect(t)
        local = np.empty((t["descs"].shape[0], 3), np.uint64)
        local[:, 0] = (ptr + np.arange(L)[:, None] * stride + t["runs"][:, 0] * rb).ravel()
        local[:, 1], local[:, 2] = t["descs"][:, 1], dev
        remote = np.empty_like(local)
        remote[:, :2], remote[:, 2] = t["descs"], t["dev"]
        if self.desc_bytes is not None:
            local, remote = _cut(local, self.desc_bytes), _cut(remote, self.desc_bytes)
        key = self._pin(mem, dev, ptr, ptr + (L - 1) * stride + n * rb)
        try:
            handle = self._agent.initialize_xfer(
                "WRITE", self._agent.get_xfer_descs(local, mem),
                self._agent.get_xfer_descs(remote, "DRAM"), name, t["xfer_id"].encode())
        except Exception as e:
            self._unpin(key)
            raise ValueError(f"NIXL refused the WRITE to {name!r} ({e!r}): the ticket's "
                             f"descriptors are not in memory that agent registered (a stale "
                             f"or altered ticket)") from None
        p = PendingSend(self._agent, self._settle, handle, key, t, t0, t0 + limit)
        return p.wait() if wait else p

    def _connect(self, t: dict) -> str:
        """Load the ticket's receiver metadata (cached per agent name and instance)."""
        name = t["agent"]
        if self._remote.get(name) == t["instance"]:
            return name
        self._forget(name)
        try:
            md = base64.b64decode(t["metadata"], validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"ticket['metadata'] is not base64 ({e})") from None
        try:
            got = self._agent.add_remote_agent(md)
        except Exception as e:
            raise ValueError(f"ticket['metadata'] did not load ({e!r}): not NIXL agent "
                             f"metadata, or its agent is gone (a stale ticket)") from None
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != name:
            self._remote[got] = "?"  # whatever was cached for it is replaced: drop it
            self._forget(got)
            raise ValueError(f"ticket['metadata'] belongs to agent {got!r}, not {name!r}")
        self._remote[name] = t["instance"]
        return name

    def _settle(self, key, agent: str, ok: bool, stuck) -> None:
        """A send ended: unregister its kv (unless NIXL could not release its handle: kept)."""
        self._abandoned.append(stuck) if stuck is not None else self._unpin(key)
        if not ok:
            self._forget(agent)

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
            for name in list(self._remote):
                self._forget(name)
            for reg in [e[0] for e in self._pins.values()] + [f[-1] for f in self._fixed]:
                self._agent.deregister_memory(reg)
            self._pins, self._fixed, self._agent = {}, [], None

