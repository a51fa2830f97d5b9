"""The decode side of prefill on another node: :class:`KVReceiver` (reservations, tickets,
quarantine). The protocol, its guarantees and its trust boundary: the package docstring
(``hisparse_cupy/pd/__init__.py``)."""

from __future__ import annotations

import collections
import contextlib
import secrets
import time

import numpy as np

from .. import _checks
from .._kernels import sums as _sums
from ..host._pages import HostPages, consecutive_runs
from . import _nixl, _ticket
from ._nixl import Arrival, Polled
from ._send import TICKET_VERSION

__all__ = ["KVReceiver"]

_ENDED_KEEP = 1 << 16  # ended transfer ids remembered, to tell late from unknown notifications


class _Reservation:
    """A reservation's record: what it allows to land, and who is writing it (``writer``:
    ``(sender, tag)`` of the offer taken or the begin granted; ``how``: pull, write or copy)."""

    __slots__ = ("req_id", "xfer_id", "token", "pages", "n_tokens", "t0", "deadline", "descs",
                 "rows", "counts", "digest", "verify", "writer", "how", "handle", "sums")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))


class KVReceiver:
    """The decode side: ``pool`` (uint8 ``[n_layers, n_rows, row_bytes]``, C-contiguous:
    ``cache.pool.numpy``, or a ``HostKVPool``) registered with a NIXL agent (``name``: default
    unique) once, and pages of ``pages`` (its :class:`HostPages`, ``cache.pages``) reserved per
    request; ``timeout_s``: a reservation's default wait; ``clock``: monotonic seconds;
    ``fence``: called before a ticket leaves (``cache.host.wait_releases``: a taken page may be a
    released request's that queued device work still reads); ``ucx_params``: NIXL's UCX backend
    parameters for its agent (as :class:`KVSender`'s). ``push``: also take NIXL WRITEs from
    senders (tickets then carry the pool's remote keys: the module docstring's trust boundary);
    default False: pulls and the same-node path only. ``verify``: the default of
    :meth:`reserve`'s (a checksum per layer checked on arrival; rows of a multiple of 8 bytes)."""

    def __init__(self, pool, pages: HostPages, *, timeout_s: float = 60.0, name: str | None = None,
                 clock=time.monotonic, fence=None, ucx_params: dict | None = None,
                 push: bool = False, verify: bool = False):
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
        for k, v in (("push", push), ("verify", verify)):
            if not isinstance(v, bool):
                raise TypeError(f"{k} must be a bool, got {type(v).__name__}")
        self.pool, self.pages, self.page_tokens = arr, pages, pages.page_tokens
        self._sum_pool = pool  # (verify: a HostKVPool's rows are summed on its device)
        self.n_layers, _, self.row_bytes = arr.shape
        if verify:
            _sums.check_row_bytes(self.row_bytes)
        self.push, self.verify = push, verify
        self.timeout_s = _nixl.seconds("timeout_s", timeout_s)
        self._clock, self._fence = clock, fence
        self.instance = secrets.token_hex(16)
        self.name, self._agent = _nixl.agent(name, "rx", _nixl.ucx_params(ucx_params))
        self._reg = _nixl.register(self._agent, "pool", arr.ctypes.data, arr.nbytes, 0, "DRAM")
        self._md = _nixl.metadata(self._agent) if push else \
            _nixl.metadata(self._agent, keys=False)
        ident = getattr(pool, "identity", None)  # a shared HostKVPool: senders here write it
        self._shm = None if ident is None else {"name": pool.name, "identity": list(ident),
                                                "base": arr.ctypes.data, "bytes": arr.nbytes}
        self._live: dict = {}  # req_id -> _Reservation
        self._by_xfer: dict = {}  # xfer_id -> _Reservation, of the live ones
        self._quarantine: dict = {}  # xfer_id -> _Reservation, ended, its writer maybe active
        self._ended: collections.OrderedDict = collections.OrderedDict()  # -> (why, token)
        self._held: dict = {}  # xfer_id -> pages, of arrivals not yet admitted or released
        self.stats = collections.Counter()
        self._senders: dict = {}  # sender agent name -> its metadata loaded (pulls)

    def _open(self) -> None:
        if self._agent is None:
            raise RuntimeError("KVReceiver is closed")

    @property
    def in_flight(self) -> dict:  # req_id -> tokens, of the reservations waiting
        return {r.req_id: r.n_tokens for r in self._live.values()}

    @property
    def in_progress(self) -> dict:
        """``req_id -> "pull" / "write" / "copy"`` of the reservations whose transfer started
        (a READ posted, a grant given): a cancel of one quarantines its pages."""
        return {r.req_id: r.how for r in self._live.values() if r.writer is not None}

    @property
    def quarantined(self) -> dict:
        """``xfer_id -> (req_id, pages)`` of the ended reservations whose transfer may still
        write their pages (kept out of the free list until it can no longer)."""
        return {x: (r.req_id, len(r.pages)) for x, r in self._quarantine.items()}

    def reserve(self, req_id, n_tokens: int, *, timeout_s: float | None = None,
                verify: bool | None = None) -> dict:
        """Pages for request ``req_id``'s (an int or str) ``n_tokens`` tokens, held until its
        transfer arrives, times out or is cancelled; returns the ticket (module docstring).
        ``verify``: check a checksum per layer on arrival (default the receiver's).
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
        verify = self.verify if verify is None else verify
        if not isinstance(verify, bool):
            raise TypeError(f"verify must be a bool or None, got {type(verify).__name__}")
        if verify:
            _sums.check_row_bytes(self.row_bytes)
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
        descs = descs.astype(np.uint64)
        base = self._shm["base"] if self._shm else 0
        now = self._clock()
        r = _Reservation(req_id=req_id, xfer_id=secrets.token_hex(16),
                         token=secrets.token_hex(16), pages=pages, n_tokens=n, t0=now,
                         deadline=now + t, descs=descs, rows=pg[first] * P, counts=cnt,
                         digest=_nixl.digest(self.n_layers, n, rb, descs, base), verify=verify)
        self._live[req_id] = self._by_xfer[r.xfer_id] = r
        return {"version": TICKET_VERSION, "agent": self.name, "instance": self.instance,
                "metadata": self._md, "xfer_id": r.xfer_id, "token": r.token, "req_id": req_id,
                "n_tokens": n, "page_tokens": P, "n_layers": self.n_layers, "row_bytes": rb,
                "timeout_s": t, "mem": "DRAM", "dev": 0,
                "runs": np.stack([first * P, cnt], -1).tolist(), "descs": descs.tolist(),
                "mode": "push" if self.push else "pull", "verify": verify,
                **({"shm": self._shm} if self._shm else {})}

    def poll(self) -> Polled:
        """Read the senders' messages (offers: their READs posted; begins: granted or refused;
        dones: checked), progress the READs (in flight, and quarantined), then expire the
        reservations past their deadline. Returns the arrivals (to :meth:`admit`), the req_ids
        that timed out, and ``(req_id, why)`` of the transfers that failed."""
        self._open()
        done, failed = [], []
        for sender, kind, f in _nixl.messages(self._agent, _nixl.TO_RECEIVER, self.stats,
                                              "malformed"):
            self._on(sender, kind, f, done, failed)
        for r in [r for r in self._by_xfer.values() if r.handle is not None]:
            st = self._read_state(r)
            if st == "DONE":
                self._landed(r, done, failed)
            elif st != "PROC":
                self._fail(r, f"its READ failed ({st})", failed)
        for r in [r for r in self._quarantine.values() if r.handle is not None]:
            if self._read_state(r) != "PROC":
                self._unquarantine(r)
        now = self._clock()
        late = [r for r in list(self._live.values()) if now >= r.deadline]
        for r in late:
            self._end(r, "timed_out", tell="it timed out")
        return Polled(done, [r.req_id for r in late], failed)

    def _on(self, sender: str, kind: str, f: dict, done: list, failed: list) -> None:
        """One sender's message: checked against the reservation it names (its token first)."""
        xid, tag = f.get("xfer_id"), f.get("tag")
        r = self._by_xfer.get(xid) or self._quarantine.get(xid)
        if r is None:
            why, token = self._ended.get(xid, (None, None))
            self.stats["unknown" if why is None else "late"] += 1
            if kind in ("offer", "begin") and _nixl.same_secret(f.get("token"), token):
                self._late(sender, f, why)
            return
        if not _nixl.same_secret(f.get("token"), r.token):
            self.stats["forged"] += 1
            return
        mine = r.writer is not None and r.writer == (sender, tag)
        if xid in self._quarantine:  # ended: only its writer's end matters now
            if kind in ("done", "abort") and mine and r.how != "pull":
                self._unquarantine(r)
                return
            self.stats["late"] += 1
            if kind in ("offer", "begin"):
                self._late(sender, f, self._ended.get(xid, ("",))[0])
            return
        if kind == "withdraw":
            if r.writer is None or mine:  # else: an older attempt's
                self._fail(r, "its sender withdrew it", failed, sender, tag)
            else:
                self.stats["refused"] += 1
        elif kind in ("offer", "begin"):
            if r.writer is not None:
                self.stats["duplicate"] += 1
                self._tell(sender, "fail", tag, "the reservation is being sent already")
            elif kind == "offer":
                self._offer(r, sender, f, failed)
            else:
                self._begin(r, sender, f, failed)
        elif not mine or r.how == "pull":  # a done or abort from no writer of it: refused
            self.stats["refused"] += 1
        elif kind == "abort":
            r.writer = None  # it writes no more: the pages can go back
            self._fail(r, f"its sender aborted it ({str(f.get('why'))[:200]})", failed)
        elif f.get("digest") != r.digest:
            r.writer = None
            self._fail(r, "its done does not match the ticket (an altered ticket)", failed,
                       sender, tag)
        else:
            r.sums = f.get("sums")
            self._landed(r, done, failed)

    def _late(self, sender: str, f: dict, why: str) -> None:
        """Tell the holder of an ended reservation's token that its offer or begin came late
        (so it ends now, not at its own timeout)."""
        with contextlib.suppress(ValueError):
            _nixl.load_peer(self._agent, self._senders, sender, f.get("metadata"),
                            "the message's metadata")
        self._tell(sender, "fail", f.get("tag"), f"the reservation ended ({why})")

    def _offer(self, r: _Reservation, sender: str, o: dict, failed: list) -> None:
        """A pull's offer: checked against the reservation, then one READ into its pages."""
        tag = o.get("tag")
        try:
            _nixl.load_peer(self._agent, self._senders, sender, o.get("metadata"),
                            "the offer's metadata")  # first: a refusal is told to the sender
            remote, mem, dev = _ticket.offer(o, sender, r.descs)
            r.sums = self._sums_of(r, o)
            h = self._agent.initialize_xfer(
                "READ", _nixl.xfer_descs(self._agent, r.descs, 0, "DRAM"),
                _nixl.xfer_descs(self._agent, remote, dev, mem), sender, b"")
        except Exception as e:
            self._fail(r, f"its offer was refused ({e})", failed, sender, tag)
            return
        r.writer, r.how, r.handle = (sender, tag), "pull", h
        try:
            self._agent.transfer(h)
        except Exception:  # (its state, checked next, says whether it is in progress)
            self.stats["read_errors"] += 1

    def _begin(self, r: _Reservation, sender: str, b: dict, failed: list) -> None:
        """A write's begin: granted when the receiver takes that kind and the sender's digest
        of its ticket is the reservation's (else the reservation fails: nothing was written)."""
        tag, how = b.get("tag"), b.get("how")
        try:  # its connection details: the receiver's answers need them
            _nixl.load_peer(self._agent, self._senders, sender, b.get("metadata"),
                            "the begin's metadata")
        except ValueError as e:
            self._fail(r, f"its begin was refused ({e})", failed)
            return
        if how not in ("write", "copy") or (how == "write" and not self.push) or \
                (how == "copy" and self._shm is None):
            why = "this receiver takes pulls only (KVReceiver(push=True) takes WRITEs)" \
                if how == "write" else f"this receiver takes no {str(how)[:20]!r} writes"
            self._fail(r, why, failed, sender, tag)
        elif b.get("digest") != r.digest:
            self._fail(r, "its begin does not match the ticket (an altered ticket)", failed,
                       sender, tag)
        elif r.verify and b.get("verify") is not True:
            self._fail(r, "the ticket asks for verify and the sender will send no sums",
                       failed, sender, tag)
        else:
            r.writer, r.how = (sender, tag), how
            self._tell(sender, "grant", tag)

    def _sums_of(self, r: _Reservation, f: dict):
        """The sender's per-layer sums in ``f`` for a verified reservation (else None)."""
        if not r.verify:
            return None
        s = f.get("sums")
        if not (isinstance(s, list) and len(s) == self.n_layers and all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64 for v in s)):
            raise ValueError(f"the ticket asks for verify: the sender must send {self.n_layers} "
                             f"per-layer sums (uint64), got {str(s)[:80]}")
        return s

    def _landed(self, r: _Reservation, done: list, failed: list) -> None:
        """The bytes of ``r`` are in place (its READ complete, or its writer done): verified
        when asked, then an arrival."""
        sender, tag = r.writer
        r.writer, handle, r.handle = None, r.handle, None  # its writer is done: nothing lands
        if handle is not None:
            self._release(handle)
        if r.verify:
            try:
                want = self._sums_of(r, {"sums": r.sums})
            except ValueError as e:
                self._fail(r, str(e), failed, sender, tag)
                return
            got = _sums.run_sums(self._sum_pool, r.rows, r.counts)
            if got != want:
                bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
                self.stats["verify_failed"] += 1
                self._fail(r, f"the rows that landed do not match the sender's checksums "
                              f"(layers {bad[:8]})", failed, sender, tag)
                return
        self._end(r, "done")
        self._held[r.xfer_id] = r.pages
        self._tell(sender, "ok", tag)
        done.append(Arrival(r.req_id, list(r.pages), r.n_tokens, r.xfer_id, sender,
                            self._clock() - r.t0))

    def _read_state(self, r: _Reservation) -> str:
        try:
            return self._agent.check_xfer_state(r.handle)
        except Exception as e:
            return f"ERR ({e!r})"

    def _release(self, handle) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # (a handle no longer in progress: nothing left to stop)
            self.stats["release_errors"] += 1

    def _fail(self, r: _Reservation, why: str, failed: list, sender=None, tag=None) -> None:
        """End ``r`` as failed (reported in ``failed``), telling ``sender`` why."""
        self._end(r, "failed")
        failed.append((r.req_id, why))
        if sender is not None:
            self._tell(sender, "fail", tag, why)

    def _tell(self, sender: str, kind: str, tag, why: str | None = None) -> None:
        if not isinstance(tag, str):
            return
        try:
            self._agent.send_notif(sender, _nixl.message(
                kind, tag=tag, **({} if why is None else {"why": why})))
        except Exception:  # the sender is gone: its own timeout ends its side
            self.stats["untold"] += 1

    def cancel(self, req_id) -> None:
        """End ``req_id``'s reservation now: its pages go back at once if its transfer has not
        started, else once it can no longer write them (quarantined; a later message for it is
        ignored). ``KeyError`` if it has none in flight."""
        self._open()
        if req_id not in self._live:
            raise KeyError(f"req_id {req_id!r} has no reservation in flight (it arrived, timed "
                           f"out or was cancelled)")
        self._end(self._live[req_id], "cancelled", tell="the receiver cancelled it")

    def _end(self, r: _Reservation, why: str, tell: str | None = None) -> None:
        del self._live[r.req_id], self._by_xfer[r.xfer_id]
        self._ended[r.xfer_id] = (why, r.token)
        if len(self._ended) > _ENDED_KEEP:
            self._ended.popitem(last=False)
        self.stats[why] += 1
        if why == "done":
            return
        if r.writer is not None and tell is not None:
            self._tell(r.writer[0], "fail", r.writer[1], tell)
        if r.handle is not None and self._read_state(r) != "PROC":
            self._release(r.handle)
            r.handle, r.writer = None, None
        if r.writer is None:
            self.pages.put(r.pages)
        else:  # its READ in progress, or a write granted: kept until it can write no more
            self._quarantine[r.xfer_id] = r
            self.stats["quarantined"] += 1

    def _unquarantine(self, r: _Reservation) -> None:
        del self._quarantine[r.xfer_id]
        if r.handle is not None:
            self._release(r.handle)
        r.handle = r.writer = None
        self.pages.put(r.pages)

    def release_quarantined(self, xfer_id: str) -> None:
        """Give back the pages of quarantined transfer ``xfer_id`` (:attr:`quarantined`) now:
        for an engine that knows its sender can no longer write them (that process ended)."""
        self._open()
        r = self._quarantine.get(xfer_id)
        if r is None:
            raise KeyError(f"xfer_id {xfer_id!r} is not quarantined")
        self._unquarantine(r)

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
        """Cancel the reservations in flight, deregister the pool. Arrivals keep their pages;
        quarantined ones stay out of the free list (their READs released: NIXL cancels them)."""
        if self._agent is not None:
            for r in list(self._live.values()):
                self._end(r, "cancelled", tell="the receiver closed")
            for r in self._quarantine.values():
                if r.handle is not None:
                    with contextlib.suppress(Exception):
                        self._agent.release_xfer_handle(r.handle)
                    r.handle = None
            agent, self._agent = self._agent, None
            agent.deregister_memory(self._reg)
