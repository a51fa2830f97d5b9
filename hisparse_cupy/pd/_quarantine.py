"""How a :class:`~hisparse_cupy.pd._receive.KVReceiver`'s reservations end: the record of one
(:class:`Reservation`), and the page rule and the quarantine (:class:`Quarantine`, mixed into the
receiver).

The page rule, in one place (:meth:`KVReceiver._end`, :meth:`KVReceiver._read_ended`): a
reservation's pages go back to the free list only once nothing can land in them any more: its
transfer never started (no READ posted, no grant given), its READ is confirmed complete (NIXL
reports ``"DONE"``), or its granted writer said ``done`` or ``abort``. A READ that NIXL reports
in progress (``"PROC"``) is waited for; one whose state NIXL cannot report (``"ERR"``, an
exception such as ``NIXL_ERR_NOT_FOUND``, a post that failed) is never taken as finished: its
pages stay quarantined, counted in ``stats["unconfirmed"]``, until the engine calls
:meth:`KVReceiver.release_quarantined` (knowing its sender's process is gone)."""

from __future__ import annotations

__all__ = ["Quarantine", "Reservation"]

_ENDED_KEEP = 1 << 16  # ended transfer ids remembered, to tell late from unknown notifications


class Reservation:
    """A reservation's record: what it allows to land, and who is writing it (``writer``:
    ``(sender, tag)`` of the offer taken or the begin granted; ``how``: pull, write or copy)."""

    __slots__ = ("req_id", "xfer_id", "token", "pages", "n_tokens", "t0", "deadline", "descs",
                 "rows", "counts", "digest", "verify", "writer", "how", "handle", "sums", "lost")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))


class Quarantine:
    """Ending a reservation, giving its pages back or quarantining them, and the quarantine's
    ways out, of a :class:`~hisparse_cupy.pd._receive.KVReceiver`. They use the receiver's
    reservations (``_live``, ``_by_xfer``, ``_quarantine``, ``_ended``), its ``pages``,
    ``stats`` and NIXL ``_agent``, its answers to senders (``_tell``) and its close
    (``_shut``)."""

    @property
    def quarantined(self) -> dict:
        """``xfer_id -> (req_id, number of pages)`` of the ended reservations whose transfer
        may still write their pages (kept out of the free list until it can no longer: the
        module docstring's page rule); still read after :meth:`close`."""
        return {x: (r.req_id, len(r.pages)) for x, r in self._quarantine.items()}

    def _read_ended(self, r: Reservation) -> bool:
        """True once ``r``'s READ is confirmed complete (``"DONE"``); False while it is in
        progress, or once its state cannot be read (then ``r.lost`` says what NIXL said, and
        the READ is never taken as finished: the module docstring's page rule)."""
        if r.lost is not None:
            return False
        st = self._read_state(r)
        if st == "DONE":
            return True
        if st != "PROC":
            r.lost = st
            self.stats["unconfirmed"] += 1
        return False

    def _read_state(self, r: Reservation) -> str:
        try:
            return self._agent.check_xfer_state(r.handle)
        except Exception as e:
            return f"ERR ({e!r})"

    def _release(self, handle) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # (a handle no longer in progress: nothing left to stop)
            self.stats["release_errors"] += 1

    def _check_quarantined(self, r: Reservation) -> None:
        if self._read_ended(r):
            self._unquarantine(r)

    def _end(self, r: Reservation, why: str, tell: str | None = None) -> None:
        """End live reservation ``r`` (``why``: done, failed, cancelled, timed_out): its pages
        go back now if nothing can land in them any more (no transfer started, or its READ
        confirmed complete), else it is quarantined (the module docstring's page rule)."""
        del self._live[r.req_id], self._by_xfer[r.xfer_id]
        self._ended[r.xfer_id] = (why, r.token)
        if len(self._ended) > _ENDED_KEEP:
            self._ended.popitem(last=False)
        self.stats[why] += 1
        if why == "done":
            return
        if r.writer is not None and tell is not None:
            self._tell(r.writer[0], "fail", r.writer[1], tell)
        if r.handle is not None and self._read_ended(r):
            self._release(r.handle)
            r.handle, r.writer = None, None
        if r.writer is None:
            self.pages.put(r.pages)
        else:  # a READ in progress or unconfirmed, or a write granted: kept out
            self._quarantine[r.xfer_id] = r
            self.stats["quarantined"] += 1

    def _unquarantine(self, r: Reservation) -> None:
        del self._quarantine[r.xfer_id]
        if r.handle is not None:
            self._release(r.handle)
        r.handle = r.writer = None
        self.pages.put(r.pages)

    def release_quarantined(self, xfer_id: str) -> None:
        """Give back the pages of quarantined transfer ``xfer_id`` (:attr:`quarantined`) now:
        for an engine that knows its sender can no longer write them (that process ended). The
        only way out for a READ whose state NIXL could not report (``stats["unconfirmed"]``).
        Also after :meth:`close`."""
        r = self._quarantine.get(xfer_id)
        if r is None:
            raise KeyError(f"xfer_id {xfer_id!r} is not quarantined")
        self._unquarantine(r)
        self._shut()
