"""A cache's residency moves (``docs/design.md`` section 10), mixed into
:class:`~hisparse_cupy.HotBufferCache`: demotion, promotion, the switch of promoted requests at a
step boundary, the default policy applied (``make_room``, ``promote_ready``), and whether a step
may run lean. They use the cache's ``arena`` (a
:class:`~hisparse_cupy.residency._arena.DeviceArena`, or None without a device budget), its
tables, device rows, host pool and map.
"""

from __future__ import annotations

from collections.abc import Mapping

from .. import _checks
from .._checks import StreamLike
from .._kernels._launch import as_stream

__all__ = ["ResidencyMoves"]


class ResidencyMoves:
    """Demote, promote, switch, the default policy and the lean-step rule of a cache with a
    device budget."""

    def demote(self, rid: int, n_tokens: int, *, stream: StreamLike | None = None) -> None:
        """Resident -> sparse at a step boundary on ``stream`` (``n_tokens``: its length): its
        hot slots take its newest H tokens, its pages return (``docs/design.md`` section 10);
        a promotion in flight is cancelled. ``ValueError`` / ``PoolExhausted``: nothing done."""
        s = as_stream(stream)
        self._arena("demote").demote(self._admitted(rid), n_tokens, self.tables, self.device, s)
        self.host.record_release(s)

    def promote(self, rid: int, n_tokens: int, *, stream: StreamLike | None = None) -> None:
        """Sparse -> resident: pages now, its first ``n_tokens`` rows loaded from the host on a
        side stream after ``stream``'s work; resident from the next step boundary after that
        (:meth:`switch_promoted`). ``ValueError`` / ``PoolExhausted``: nothing taken."""
        self._arena("promote").promote(self._admitted(rid), n_tokens, self.pool,
                                       self.host.rows, self.device, as_stream(stream))

    def switch_promoted(self, stream: StreamLike | None = None) -> list[int]:
        """Every promotion whose fill has landed becomes resident, on ``stream``, no wait (in
        ``begin_step`` outside a capture; between graph replays, the engine's call)."""
        if self.arena is None or not self.arena.promoting:
            return []
        s = as_stream(stream)
        done = self.arena.switch(self.pool, self.host.rows, self.device, self.tables, s)
        if done:
            self.host.record_release(s)  # their blocks, after the switch
        return done

    def make_room(self, pages: int, written: Mapping[int, int], *, keep=(),
                  stream: StreamLike | None = None) -> list[int]:
        """The default policy's demotions, at a step boundary on ``stream``: the resident
        requests :meth:`DeviceBudget.room_for` names (longest idle first, then the largest;
        never one of ``keep``) are demoted until ``pages`` more pages are free. ``written``:
        request slot -> tokens it has written (each demotion's ``n_tokens``). Returns the
        demoted request slots (empty when the pages are free already). ``PoolExhausted``
        (no set of demotions makes the room) or ``ValueError`` (a count missing or out of
        range): nothing demoted."""
        budget = self._arena("make_room").budget
        victims = budget.room_for(pages, keep=keep)
        counts = []
        for r in victims:
            if r not in written:
                raise ValueError(f"written has no token count for request slot {r}, which "
                                 f"make_room would demote")
            counts.append(_checks.integer(f"written[{r}]", written[r], 1, budget.tokens(r)))
        for r, n in zip(victims, counts, strict=True):
            self.demote(r, n, stream=stream)
        return victims

    def promote_ready(self, written: Mapping[int, int], *, keep_free: int = 0,
                      stream: StreamLike | None = None) -> list[int]:
        """The default policy's promotions: the sparse requests whose pages fit
        (:meth:`DeviceBudget.promotable`: most recently used first), each only while
        ``keep_free`` pages stay free after it (e.g. the blocks an engine keeps for its next
        admissions and demotions), and only those ``written`` has a count for (tokens
        written: each promotion's ``n_tokens``). Returns the request slots whose fill began
        (resident from a step boundary after it lands: :meth:`switch_promoted`)."""
        budget = self._arena("promote_ready").budget
        keep_free = _checks.integer("keep_free", keep_free, 0)
        out = []
        for r in budget.promotable():
            if r in written and budget.free_pages - budget.pages_for(
                    budget.tokens(r)) >= keep_free:
                self.promote(r, written[r], stream=stream)
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
