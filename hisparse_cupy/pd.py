"""Prefill on another node: a request's KV lands in the decode host's page pool over NIXL.

1. **reserve** (decode): :meth:`KVReceiver.reserve` takes the request's pages as engine-held
   pages (``HostPages.take``: no request's table names them, so no swap reads them as they
   fill) and returns a *ticket*, a JSON dict: the receiver's agent name, instance and NIXL
   metadata (base64), a transfer id unique to the reservation, the runs of consecutive pages
   (``[first token, tokens]``), the destination descriptors ``[addr, bytes]`` layer-major
   (layer 0's runs, then layer 1's...), ``n_tokens, page_tokens, n_layers, row_bytes, timeout_s``,
   and, when ``pool`` is a shared ``HostKVPool``, ``shm``: its name, identity (boot id, device,
   inode), base address and bytes here.
2. **ticket -> prefill** over the engines' own control plane (JSON; no other service).
3. **send** (prefill): :meth:`KVSender.send` checks ``kv`` (uint8 ``[L, n, row_bytes]``, rows
   contiguous per layer; host, or GPU by ``__cuda_array_interface__`` as VRAM) against the
   ticket, loads the receiver's metadata (once per instance), registers ``kv`` unless it is in
   a buffer given to :meth:`KVSender.register` (no staging copy either way), posts one NIXL
   WRITE of every run of every layer notified with the transfer id, and polls it to the end.
   A ticket with ``shm`` whose pool is on the sender's node (same boot id, same file) and GPU
   ``kv`` take the *same-node path* instead (``KVSender(same_node=True)``, the default): the
   sender attaches the pool once (``HostKVPool.attach``), stores ``kv`` into the ticket's rows
   as the cache's admission does (``host_rows.store_rows``: one 2-D ``cudaMemcpyAsync`` of
   every layer per run of pages, the copy engines at a D2H memcpy's rate; UCX's paths between
   two processes of one node reached 66-75 % of that), and, once the copies are complete,
   sends the transfer id as a NIXL notification: the receiver sees a WRITE's.
   With ``KVSender(pull=True)`` it sends an *offer* instead (a NIXL notification: its agent
   metadata, ``kv``'s descriptors per run and layer), and the receiver reads: its next
   :meth:`KVReceiver.poll` checks the offer against the reservation, posts one NIXL READ into
   the pages and, once the READ is complete, notifies the sender (which then unregisters
   ``kv``). On one node a READ of GPU memory is a copy by the receiver from the sender's
   memory (UCX's ``cuda_ipc``): 47.9 GB/s against 38.4 for a WRITE of the same 512 MiB,
   ``benchmarks/probe_pd_paths.py``.
4. **poll** (decode): :meth:`KVReceiver.poll` reads NIXL's notifications: a live reservation's
   id completes it (an :class:`Arrival`), as does a pull's READ found complete (one that
   failed, or an offer that does not match the reservation, puts the pages back and is
   reported in ``failed``); a reservation past its deadline (its READ cancelled) has its pages
   put back, once, and is reported timed out; a notification for an id that is done, timed out,
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

import collections
import itertools
import json
import time
import uuid

import numpy as np

from . import _checks, _nixl
from ._nixl import Arrival, Polled, Sent, nixl_api
from .host_pages import HostPages, consecutive_runs
from .pd_send import TICKET_VERSION, KVSender, PendingSend

__all__ = ["Arrival", "KVReceiver", "KVSender", "PendingSend", "Polled", "Sent", "nixl_api"]

_ENDED_KEEP = 1 << 16  # ended transfer ids remembered, to tell late from unknown notifications
_Reservation = collections.namedtuple("_Reservation",
                                      "req_id xfer_id pages n_tokens t0 deadline descs")


class KVReceiver:
    """The decode side: ``pool`` (uint8 ``[n_layers, n_rows, row_bytes]``, C-contiguous:
    ``cache.pool.numpy``, or a ``HostKVPool``) registered with a NIXL agent (``name``: default
    unique) once, and pages of ``pages`` (its :class:`HostPages`, ``cache.pages``) reserved per
    request; ``timeout_s``: a reservation's default wait; ``clock``: monotonic seconds;
    ``fence``: called before a ticket leaves (``cache.host.wait_releases``: a taken page may be a
    released request's that queued device work still reads); ``ucx_params``: NIXL's UCX backend
    parameters for its agent (as :class:`KVSender`'s)."""

    def __init__(self, pool, pages: HostPages, *, timeout_s: float = 60.0, name: str | None = None,
                 clock=time.monotonic, fence=None, ucx_params: dict | None = None):
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
        self.timeout_s = _nixl.seconds("timeout_s", timeout_s)
        self._clock, self._fence = clock, fence
        self.instance = uuid.uuid4().hex
        self.name, self._agent = _nixl.agent(name, "rx", _nixl.ucx_params(ucx_params))
        self._reg = self._agent.register_memory([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")
        self._md = _nixl.metadata(self._agent)
        ident = getattr(pool, "identity", None)  # a shared HostKVPool: senders here write it
        self._shm = None if ident is None else {"name": pool.name, "identity": list(ident),
                                                "base": arr.ctypes.data, "bytes": arr.nbytes}
        self._seq = itertools.count()
        self._live: dict = {}  # req_id -> _Reservation
        self._by_xfer: dict = {}  # xfer_id -> req_id, of the live ones
        self._ended: collections.OrderedDict = collections.OrderedDict()  # xfer_id -> why
        self._held: dict = {}  # xfer_id -> pages, of arrivals not yet admitted or released
        self.stats = collections.Counter()
        self._senders: dict = {}  # sender agent name -> its metadata loaded (pulls)
        self._reading: dict = {}  # xfer_id -> (READ handle, sender, tag), the pulls in flight

    def _open(self) -> None:
        if self._agent is None:
            raise RuntimeError("KVReceiver is closed")

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
        t = self.timeout_s if timeout_s is None else _nixl.seconds("timeout_s", timeout_s)
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
        self._live[req_id] = _Reservation(req_id, xfer_id, pages, n, now, now + t,
                                          descs.astype(np.uint64))
        self._by_xfer[xfer_id] = req_id
        return {"version": TICKET_VERSION, "agent": self.name, "instance": self.instance,
                "metadata": self._md, "xfer_id": xfer_id, "req_id": req_id, "n_tokens": n,
                "page_tokens": P, "n_layers": self.n_layers, "row_bytes": rb, "timeout_s": t,
                "mem": "DRAM", "dev": 0, "runs": np.stack([first * P, cnt], -1).tolist(),
                "descs": descs.tolist(), "pull": True,
                **({"shm": self._shm} if self._shm else {})}

    def poll(self) -> Polled:
        """Read NIXL's notifications (arrivals, and pulls' offers: their READs posted), progress
        the READs in flight, then expire the reservations past their deadline (pages put back).
        Returns the arrivals (to :meth:`admit`), the req_ids that timed out, and ``(req_id,
        why)`` of the pulls that failed."""
        self._open()
        done, failed = [], []
        for sender, msgs in self._agent.get_new_notifs().items():
            sender = sender.decode() if isinstance(sender, bytes) else str(sender)
            for msg in map(bytes, msgs):
                if msg.startswith(_nixl.OFFER) or msg.startswith(_nixl.WITHDRAWN):
                    self._pull(sender, msg, failed)
                    continue
                xid = msg.decode("ascii", "replace")
                rid = self._by_xfer.get(xid)
                if rid is None or xid in self._reading:
                    why = self._ended.get(xid)
                    self.stats["duplicate" if why == "done" or rid is not None else "late"
                               if why else "unknown"] += 1
                    continue
                done.append(self._arrive(self._live[rid], sender))
        for xid, (h, sender, tag) in list(self._reading.items()):
            try:
                st = self._agent.check_xfer_state(h)
            except Exception as e:
                st = f"ERR ({e!r})"
            if st == "DONE":
                self._stop(xid)
                self._tell(sender, _nixl.READ_DONE + tag.encode())
                done.append(self._arrive(self._live[self._by_xfer[xid]], sender))
            elif st != "PROC":
                self._fail(self._live[self._by_xfer[xid]], f"its READ failed ({st})", failed,
                           sender, tag)
        now = self._clock()
        late = [self._end(r, "timed_out") for r in list(self._live.values()) if now >= r.deadline]
        return Polled(done, [r.req_id for r in late], failed)

    def _arrive(self, r: _Reservation, sender: str) -> Arrival:
        self._end(r, "done")
        self._held[r.xfer_id] = r.pages
        return Arrival(r.req_id, list(r.pages), r.n_tokens, r.xfer_id, sender,
                       self._clock() - r.t0)

    def _pull(self, sender: str, msg: bytes, failed: list) -> None:
        """A pull's offer (post its READ) or its withdrawal (fail the reservation, cancel the
        READ of that offer). Answers name the offer's tag (``xfer_id/attempt``)."""
        offer = msg.startswith(_nixl.OFFER)
        body = msg[len(_nixl.OFFER if offer else _nixl.WITHDRAWN):]
        try:
            o = json.loads(body) if offer else {"tag": body.decode("ascii")}
            tag = str(o["tag"])
            xid = o["xfer_id"] if offer else tag.rsplit("/", 1)[0]
            r = self._live[self._by_xfer[xid]]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            self.stats["late" if isinstance(o, dict) and o.get("xfer_id") in self._ended or
                       not offer else "unknown"] += 1
            return
        reading = self._reading.get(xid)
        if not offer:
            if reading is None or reading[2] == tag:  # else: an older attempt's, ended
                self._fail(r, "its sender withdrew it", failed, sender, tag)
            return
        if reading is not None:
            self.stats["duplicate"] += 1
            return
        try:
            _nixl.load_peer(self._agent, self._senders, sender, o.get("metadata"),
                            "the offer's metadata")  # first: a refusal is told to the sender
            remote, mem, dev = _checks.pd_offer(o, sender, r.descs)
            h = self._agent.initialize_xfer(
                "READ", _nixl.xfer_descs(self._agent, r.descs, 0, "DRAM"),
                _nixl.xfer_descs(self._agent, remote, dev, mem), sender, b"")
            self._reading[xid] = (h, sender, tag)
            self._agent.transfer(h)
        except Exception as e:
            self._fail(r, f"its offer was refused ({e})", failed, sender, tag)

    def _fail(self, r: _Reservation, why: str, failed: list, sender: str, tag: str) -> None:
        self._end(r, "failed")
        failed.append((r.req_id, why))
        self._tell(sender, _nixl.READ_FAILED + f"{tag} {why}".encode())

    def _tell(self, sender: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(sender, msg)
        except Exception:  # the sender is gone: its own timeout ends its side
            self.stats["untold"] += 1

    def _stop(self, xid: str) -> bool:
        """Release a pull's READ handle (NIXL cancels an active one); False if NIXL could not:
        the READ may still write, so its pages are kept out of use."""
        h = self._reading.pop(xid, (None,))[0]
        if h is None:
            return True
        try:
            self._agent.release_xfer_handle(h)
            return True
        except Exception:
            self.stats["stuck"] += 1
            return False

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
        if why != "done" and self._stop(r.xfer_id):
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
