"""The decode side of prefill on another node: :class:`KVReceiver` (reservations, tickets,
quarantine). The protocol: ``_protocol.py``; its guarantees and its trust boundary:
``docs/design.md``, "Prefill on another node". The page rule (when a reservation's pages go
back) and the quarantine: ``_quarantine.py``."""

from __future__ import annotations

import collections
import contextlib
import math
import secrets
import time

import numpy as np

from .. import _checks
from .._kernels import sums as _sums
from ..host import HostPages, consecutive_runs
from . import _nixl, _protocol
from ._nixl import Arrival, Polled
from ._quarantine import Quarantine, Reservation

__all__ = ["KVReceiver"]


class KVReceiver(Quarantine):
    """The decode side: ``pool`` (uint8 ``[n_layers, n_rows, row_bytes]``, C-contiguous:
    ``cache.pool.numpy``, or a ``HostKVPool``) registered with a NIXL agent (``name``: default
    unique) once, and pages of ``pages`` (its :class:`HostPages`, ``cache.pages``) reserved per
    request; ``timeout_s``: a reservation's default wait; ``clock``: monotonic seconds;
    ``fence``: called before a ticket leaves, after the pages were taken (a cache's pages need
    none: :meth:`HostPages.take` waits for the fences of the work that last touched them);
    ``ucx_params``: NIXL's UCX backend
    parameters for its agent (as :class:`KVSender`'s). ``push``: also take NIXL WRITEs from
    senders (tickets then carry the pool's remote keys: the module docstring's trust boundary);
    default False: pulls and the same-node path only. ``verify``: the default of
    :meth:`reserve`'s (a checksum per layer checked on arrival; rows of a multiple of 8 bytes).

    A sender's agent name is bound to the first connection the receiver loads for it (its
    first offer or begin): metadata under that name that does not load over that connection
    (a sender restarted under the same name, an impostor, junk) is refused, and the connection
    kept, until the engine calls :meth:`forget_sender`. ``stats`` counts what each poll found
    (``"errors"``: exceptions no input should raise, caught per message and per transfer, the
    last one's text in :attr:`last_error`; ``"unconfirmed"``: READs whose state NIXL could not
    report)."""

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
        self._live: dict = {}  # req_id -> Reservation
        self._by_xfer: dict = {}  # xfer_id -> Reservation, of the live ones
        self._quarantine: dict = {}  # xfer_id -> Reservation, ended, its writer maybe active
        self._ended: collections.OrderedDict = collections.OrderedDict()  # -> (why, token)
        self._held: dict = {}  # xfer_id -> pages, of arrivals not yet admitted or released
        self.stats = collections.Counter()
        self.last_error: str | None = None  # the text of the last exception caught in a poll
        self._senders = _nixl.Peers(self._agent, replace=False)
        self._closed = False

    def _open(self) -> None:
        if self._closed:
            raise RuntimeError("KVReceiver is closed")

    def _busy(self, sender: str) -> bool:
        """Whether a transfer with ``sender`` is in progress or quarantined."""
        return any(r.writer is not None and r.writer[0] == sender
                   for d in (self._live, self._quarantine) for r in d.values())

    @property
    def in_flight(self) -> dict:  # req_id -> tokens, of the reservations waiting
        return {r.req_id: r.n_tokens for r in self._live.values()}

    @property
    def in_progress(self) -> dict:
        """``req_id -> "pull" / "write" / "copy"`` of the reservations whose transfer started
        (a READ posted, a grant given): a cancel of one quarantines its pages."""
        return {r.req_id: r.how for r in self._live.values() if r.writer is not None}

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
            try:
                self._fence()
            except BaseException:  # nothing reserved: the pages go back
                self.pages.put(pages)
                raise
        P, rb = self.page_tokens, self.row_bytes
        pg = np.asarray(pages, np.int64)
        first, last = consecutive_runs(pg)  # runs of consecutive pages
        cnt = np.minimum(last * P, n) - first * P
        layer = self.pool.ctypes.data + np.arange(self.n_layers)[:, None] * self.pool.strides[0]
        addr = layer + pg[first] * (P * rb)
        descs = np.stack([addr, np.broadcast_to(cnt * rb, addr.shape)], -1).reshape(-1, 2)
        descs = descs.astype(np.uint64)
        now = self._clock()
        r = Reservation(req_id=req_id, xfer_id=secrets.token_hex(16),
                        token=secrets.token_hex(16), pages=pages, n_tokens=n, t0=now,
                        deadline=now + t, descs=descs, rows=pg[first] * P, counts=cnt,
                        digest=_protocol.digest(self.n_layers, n, rb, descs, self._shm),
                        verify=verify)
        self._live[req_id] = self._by_xfer[r.xfer_id] = r
        return _protocol.new_ticket(
            agent=self.name, instance=self.instance, metadata=self._md, xfer_id=r.xfer_id,
            token=r.token, req_id=req_id, n_tokens=n, page_tokens=P, n_layers=self.n_layers,
            row_bytes=rb, timeout_s=t, runs=np.stack([first * P, cnt], -1), descs=descs,
            push=self.push, verify=verify, shm=self._shm)

    def poll(self) -> Polled:
        """Read the senders' messages (offers: their READs posted; begins: granted or refused;
        dones: checked), progress the READs (in flight, and quarantined), then expire the
        reservations past their deadline. Returns the arrivals (to :meth:`admit`), the req_ids
        that timed out, and ``(req_id, why)`` of the transfers that failed.

        Never raises once open, whatever the senders send: each message, each READ's check and
        each expiry is handled on its own, and an exception in one (none is expected: each is
        counted in ``stats["errors"]``, its text in :attr:`last_error`) leaves the rest of the
        batch handled and every arrival already formed reported."""
        self._open()
        done, failed = [], []
        self._progress(done, failed)
        now = self._clock()
        late = [r for r in list(self._live.values()) if now >= r.deadline]
        for r in late:
            self._guard(self._end, r, "timed_out", "it timed out")
        return Polled(done, [r.req_id for r in late], failed)

    def _progress(self, done: list, failed: list) -> None:
        """One look: the new messages, then the READs in flight and the quarantined ones."""
        for sender, kind, f in _nixl.messages(self._agent, _protocol.TO_RECEIVER, self.stats,
                                              "malformed", self._batch_lost):
            self._guard(self._on, sender, kind, f, done, failed)
        for r in [r for r in self._by_xfer.values() if r.handle is not None]:
            self._guard(self._check_read, r, done, failed)
        for r in [r for r in self._quarantine.values() if r.handle is not None and
                  r.lost is None]:
            self._guard(self._check_quarantined, r)

    def _batch_lost(self, e: Exception) -> None:
        self.last_error = f"get_new_notifs: {e!r}"[:1000]

    def _guard(self, fn, *args) -> None:
        """``fn(*args)``; an exception is counted in ``stats["errors"]``, not raised."""
        try:
            fn(*args)
        except Exception as e:
            self.stats["errors"] += 1
            self.last_error = f"{fn.__name__}: {e!r}"[:1000]

    def _check_read(self, r: Reservation, done: list, failed: list) -> None:
        """A live reservation's READ: landed once complete; failed, its pages quarantined,
        when its state cannot be read."""
        if self._read_ended(r):
            self._landed(r, done, failed)
        elif r.lost is not None:
            self._fail(r, f"its READ failed ({r.lost}): its pages stay quarantined until "
                          f"release_quarantined", failed)

    def _on(self, sender: str, kind: str, f: dict, done: list, failed: list) -> None:
        """One sender's message: checked against the reservation it names (its token first)."""
        xid, tag = f.get("xfer_id"), f.get("tag")
        r = self._by_xfer.get(xid) or self._quarantine.get(xid)
        if r is None:
            why, token = self._ended.get(xid, (None, None))
            self.stats["unknown" if why is None else "late"] += 1
            if kind in ("offer", "begin") and _protocol.same_secret(f.get("token"), token):
                self._late(sender, f, why)
            return
        if not _protocol.same_secret(f.get("token"), r.token):
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
            self._fail(r, f"its sender aborted it ({_protocol.text(f.get('why'), 200)})", failed)
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
            self._senders.load(sender, f.get("metadata"), "the message's metadata")
        self._tell(sender, "fail", f.get("tag"), f"the reservation ended ({why})")

    def _offer(self, r: Reservation, sender: str, o: dict, failed: list) -> None:
        """A pull's offer: checked against the reservation, then one READ into its pages."""
        tag = o.get("tag")
        try:
            self._senders.load(sender, o.get("metadata"),
                               "the offer's metadata")  # first: a refusal is told to the sender
            remote, mem, dev = _protocol.check_offer(o, sender, r.descs)
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
        except Exception:  # (its state, checked next, says whether it is in progress: a post
            self.stats["read_errors"] += 1  # that failed may have started part of it)

    def _begin(self, r: Reservation, sender: str, b: dict, failed: list) -> None:
        """A write's begin: granted when the receiver takes that kind and the sender's digest
        of its ticket is the reservation's (else the reservation fails: nothing was written)."""
        tag, how = b.get("tag"), b.get("how")
        try:  # its connection details: the receiver's answers need them
            self._senders.load(sender, b.get("metadata"), "the begin's metadata")
        except ValueError as e:
            self._fail(r, f"its begin was refused ({e})", failed)
            return
        if how not in ("write", "copy") or (how == "write" and not self.push) or \
                (how == "copy" and self._shm is None):
            why = "this receiver takes pulls only (KVReceiver(push=True) takes WRITEs)" \
                if how == "write" else f"this receiver takes no {_protocol.text(how, 20)!r} writes"
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

    def _sums_of(self, r: Reservation, f: dict):
        """The sender's per-layer sums in ``f`` for a verified reservation (else None)."""
        if not r.verify:
            return None
        s = f.get("sums")
        if not (isinstance(s, list) and len(s) == self.n_layers and all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64 for v in s)):
            raise ValueError(f"the ticket asks for verify: the sender must send {self.n_layers} "
                             f"per-layer sums (uint64), got {_protocol.text(s, 80)}")
        return s

    def _landed(self, r: Reservation, done: list, failed: list) -> None:
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

    def _fail(self, r: Reservation, why: str, failed: list, sender=None, tag=None) -> None:
        """End ``r`` as failed (reported in ``failed``), telling ``sender`` why."""
        self._end(r, "failed")
        failed.append((r.req_id, why))
        if sender is not None:
            self._tell(sender, "fail", tag, why)

    def _tell(self, sender: str, kind: str, tag, why: str | None = None) -> None:
        if not isinstance(tag, str):
            return
        try:
            self._agent.send_notif(sender, _protocol.message(
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

    def forget_sender(self, name: str) -> None:
        """Drop sender agent ``name``'s connection, so that the next offer or begin under that
        name loads its metadata anew: for an engine that knows the process behind it ended
        and another one of that name will send (a receiver never replaces a connection on a
        sender's word: the class docstring). ``KeyError`` if the receiver has none;
        ``ValueError`` while a transfer with it is in progress or quarantined (end it, or
        :meth:`release_quarantined` it, first)."""
        self._open()
        if name not in self._senders:
            raise KeyError(f"the receiver has no connection to a sender named {name!r}")
        if not self._senders.forget(name, self._busy):
            held = [r.req_id for d in (self._live, self._quarantine) for r in d.values()
                    if r.writer is not None and r.writer[0] == name]
            raise ValueError(f"sender {name!r} has transfers in progress or quarantined (req_ids "
                             f"{held[:8]}): its connection is kept")

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

    def close(self, timeout_s: float = 5.0) -> dict:
        """Close the receiver: cancel the reservations in flight (their senders told), then
        wait up to ``timeout_s`` seconds (0: one look) for the quarantined transfers to end,
        reading messages and checking READs as :meth:`poll` does: each whose end is confirmed
        (a READ's ``"DONE"``, a writer's done or abort) gives its pages back, once. Returns
        :attr:`quarantined` as it is then: the transfers that may still land (a READ still in
        progress, a write whose writer never said it ended) or whose state NIXL could not
        report; their pages stay out of the free list, their READs are not released (NIXL
        would try to cancel them: never trusted to have stopped) and the agent and the pool's
        registration stay until the last of them is given back, by another ``close()`` (which
        waits again) or :meth:`release_quarantined`. Arrivals keep their pages (:meth:`admit`
        and :meth:`release` still work); every other call raises. The wait returns early once
        nothing left can end (only READs in an unknown state)."""
        if isinstance(timeout_s, bool) or not isinstance(
                timeout_s, (int, float, np.integer, np.floating)):
            raise TypeError(f"timeout_s must be a number of seconds, got "
                            f"{type(timeout_s).__name__}")
        if not 0 <= timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a finite number of seconds >= 0, got "
                             f"{timeout_s}")
        if self._agent is None:
            return {}
        if not self._closed:
            self._closed = True
            for r in list(self._live.values()):
                self._guard(self._end, r, "cancelled", "the receiver closed")
        end = time.monotonic() + float(timeout_s)
        while True:
            self._progress([], [])
            if not any(r.lost is None for r in self._quarantine.values()) or \
                    time.monotonic() >= end:
                break
            time.sleep(0.001)
        self._shut()
        return self.quarantined

    def _shut(self) -> None:
        """Once closed with nothing quarantined: deregister the pool, drop the agent."""
        if self._closed and not self._quarantine and self._agent is not None:
            agent, self._agent = self._agent, None
            self._senders.clear(remove=False)  # (the agent goes with the receiver's hold)
            with contextlib.suppress(Exception):
                agent.deregister_memory(self._reg)
