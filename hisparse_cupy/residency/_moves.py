"""A cache's residency moves (``docs/design.md`` section 10), mixed into
:class:`~hisparse_cupy.HotBufferCache`: demotion, promotion, the switch of promoted requests at a
step boundary, the default policy applied (``make_room``, ``promote_ready``), and whether a step
may run lean. They use the cache's ``arena`` (a
:class:`~hisparse_cupy.residency._arena.DeviceArena`, or None without a device budget), its
tables, device rows, host pool and map, and its order between streams (``order``).

No move takes a token count: each works from the request's count of written tokens that the
device keeps (its admission's length, then each step's newest token, recorded by
``Step.backup_newest``), so a count off by one cannot make a request serve a wrong row.
"""

from __future__ import annotations

from .. import _checks
from .._checks import StreamLike

__all__ = ["ResidencyMoves"]

_NO_COUNT = object()


def _no_count(what: str, got) -> None:
    """A count or map of counts passed where 0.1.x took one: refused, naming it."""
    if got is not _NO_COUNT:
        raise TypeError(f"{what} takes no token count: the cache counts each request's written "
                        f"tokens on the device (its admission's length, then each step's "
                        f"newest token) and moves it from that (docs/design.md section 10)")


class ResidencyMoves:
    """Demote, promote, switch, the default policy and the lean-step rule of a cache with a
    device budget."""

    def demote(self, rid: int, _count=_NO_COUNT, *, stream: StreamLike | None = None) -> None:
        """Resident -> sparse at a step boundary on ``stream``: its hot slots take what an
        admission of its written tokens would hold (the positional layout up to H tokens,
        else its newest H with the newest in slot H), its pages return carrying the event
        after their copy (``docs/design.md`` section 10); a promotion in flight is cancelled.
        ``ValueError`` / ``PoolExhausted``: nothing done."""
        _no_count("demote", _count)
        s = self.order(stream)
        self._arena("demote").demote(self._admitted(rid), self.tables, self.device, s)

    def promote(self, rid: int, _count=_NO_COUNT, *, stream: StreamLike | None = None) -> None:
        """Sparse -> resident: pages now, its written tokens' rows loaded from the host on a
        side stream after ``stream``'s work; resident from the next step boundary after that
        (:meth:`switch_promoted`), the tokens written meanwhile copied in then.
        ``ValueError`` / ``PoolExhausted``: nothing taken."""
        _no_count("promote", _count)
        s = self.order(stream)
        self._arena("promote").promote(self._admitted(rid), self.pool, self.host.rows,
                                       self.device, s)

    def switch_promoted(self, stream: StreamLike | None = None) -> list[int]:
        """Every promotion whose fill has landed becomes resident, on ``stream``, no wait (in
        ``begin_step`` outside a capture; between graph replays, the engine's call)."""
        s = self.order(stream)
        if self.arena is None or not self.arena.promoting:
            return []
        return self.arena.switch(self.host_locs, self.pool, self.device, self.tables, s)

    def make_room(self, pages: int, _written=_NO_COUNT, *, keep=(),
                  stream: StreamLike | None = None) -> list[int]:
        """The default policy's demotions, at a step boundary on ``stream``: the resident
        requests :meth:`DeviceBudget.room_for` names (longest idle first, then the largest,
        then the lowest request slot; never one of ``keep``) are demoted until ``pages`` more
        pages are free. Returns the demoted request slots (empty when the pages are free
        already). ``PoolExhausted`` (no set of demotions makes the room): nothing demoted."""
        _no_count("make_room", _written)
        victims = self._arena("make_room").budget.room_for(pages, keep=keep)
        for r in victims:
            self.demote(r, stream=stream)
        return victims

    def promote_ready(self, _written=_NO_COUNT, *, keep_free: int = 0,
                      stream: StreamLike | None = None) -> list[int]:
        """The default policy's promotions: the sparse requests whose pages fit
        (:meth:`DeviceBudget.promotable`: most recently used first, then the lowest request
        slot), each only while ``keep_free`` pages stay free after it (e.g. the blocks an
        engine keeps for its next admissions and demotions). Returns the request slots whose
        fill began (resident from a step boundary after it lands: :meth:`switch_promoted`)."""
        _no_count("promote_ready", _written)
        budget = self._arena("promote_ready").budget
        keep_free = _checks.integer("keep_free", keep_free, 0)
        out = []
        for r in budget.promotable():
            if budget.free_pages - budget.pages_for(budget.tokens(r)) >= keep_free:
                self.promote(r, stream=stream)
                out.append(r)
        return out

    def lean_step(self, lean: bool | None = None) -> bool:
        """Whether a step begun now runs lean (``begin_step(lean=)``): ``None`` (the default)
        when the cache has a device budget and every admitted request is resident; ``True``
        demands it (``ValueError`` naming the sparse or promoting requests otherwise);
        ``False`` never.

        A lean step's single-step swaps run their resolve only (no copy launch: a resident row
        plans nothing) and, with a :class:`~hisparse_cupy.Prefetcher`, its shared layers are
        served their full layer's rows with no replay, no wait and no staging. A row whose
        request is not resident is refused (-1 entries, status ``ST_BADROW``), never served
        stale rows: a graph captured lean must be captured again once a request is sparse."""
        if lean is None:
            return self.arena is not None and self.arena.budget.all_resident()
        if not isinstance(lean, bool):
            raise TypeError(f"lean must be None, True or False, got {lean!r}")
        if lean and (self.arena is None or not self.arena.budget.all_resident()):
            why = ("the cache has no device budget (HotBufferCache(device_budget=))"
                   if self.arena is None else
                   f"request slots {self.arena.budget.sparse()[:8]} are not resident")
            raise ValueError(f"lean=True needs every admitted request resident: {why}")
        return lean
