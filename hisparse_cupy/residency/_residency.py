"""``cache.residency``: the one object through which a cache and an engine reach residency.

A :class:`~hisparse_cupy.HotBufferCache` owns one. Without a device budget it is a plain
:class:`Residency`: no request is ever resident, every move refuses (naming the missing
budget), and the cache's calls into it do nothing. With one it is a :class:`_Budgeted`, which
holds the :class:`~hisparse_cupy.residency._arena.DeviceArena` (the budget, the flags, the page
table, the written counts, the moves' device work) and the parts of the cache the moves touch,
handed over by :meth:`Residency.bind` once the cache made them: its tables, device rows, host
pool and map, and its order between streams (``cache.order``, public). Nothing here calls a
private method of the cache, and the cache never branches on whether a budget exists.

Two faces:

- **The engine's**: :attr:`~Residency.budget` (the :class:`DeviceBudget`, NumPy only: the
  scheduler's view), :meth:`~Residency.demote`, :meth:`~Residency.promote`,
  :meth:`~Residency.switch_promoted`, :meth:`~Residency.make_room`,
  :meth:`~Residency.promote_ready`, :meth:`~Residency.shed`, :meth:`~Residency.lean_step`,
  :meth:`~Residency.state`.
- **The cache's** (``on_*``): what admission, growth, host writes and release do to
  residency, and the kernels' arguments (:meth:`~Residency.fields`,
  :meth:`~Residency.newest_fields`). An engine never calls these: the cache does, in order.

No move takes a token count: each works from the request's count of written tokens that the
device keeps (its admission's length, then each step's newest token, recorded by
``Step.backup_newest``), so a count off by one cannot make a request serve a wrong row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import _checks
from .._checks import StreamLike
from ._budget import DeviceBudget

if TYPE_CHECKING:  # (CuPy's: imported where a budget needs them, so this module needs NumPy)
    from ._arena import DeviceArena

__all__ = ["Residency"]

_NO_BUDGET = "needs a device budget (HotBufferCache(device_budget=))"


class Residency:
    """A cache's residency without a device budget: every request sparse (a hot buffer over
    the host pool), no move possible. :class:`_Budgeted` is the one with a budget; both answer
    the same calls, so neither the cache nor an engine asks which it has (:attr:`enabled`
    says, for logs and schedulers)."""

    enabled = False
    budget: DeviceBudget | None = None

    n_rows: int | None = None  # device rows per layer under a budget

    def __init__(self, max_requests: int):
        self._R = max_requests
        self._order = None  # cache.order, from bind()

    @staticmethod
    def of(device_budget: int | None, device_page: int, *, max_requests: int, max_len: int,
           block_rows: int) -> Residency:
        """A cache's residency: with ``device_budget`` (rows per layer, checked) in pages of
        ``device_page`` rows, a :class:`_Budgeted` whose sparse requests hold blocks of
        ``block_rows`` rows; without one (None), a plain :class:`Residency`. The cache then
        hands it its parts (:meth:`bind`)."""
        if device_budget is None:
            return Residency(max_requests)
        from ._arena import DeviceArena

        return _Budgeted(DeviceArena(
            max_requests=max_requests, max_len=max_len,
            n_rows=_checks.integer("device_budget", device_budget, 1),
            page_tokens=_checks.integer("device_page", device_page, 1), block_rows=block_rows))

    def bind(self, *, tables, device, pool, host, order) -> None:
        """The parts of the cache the moves touch: its ``tables``, ``device`` rows, host
        ``pool`` and map (``host``), and ``order`` (``cache.order``); without a budget only
        ``order`` (:meth:`switch_promoted` still orders the stream it is given)."""
        self._order = order

    # ------------------------------------------------------------- the engine's face
    def state(self, rid: int) -> str:
        """``"resident"``, ``"sparse"`` or ``"promoting"`` for an admitted request slot
        (without a budget: ``"sparse"`` for any request slot)."""
        self._rid(rid)
        return "sparse"

    @property
    def promoting(self) -> list[int]:
        """Request slots whose promotion's fill is in flight (none without a budget)."""
        return []

    def demote(self, rid: int, *, stream: StreamLike | None = None) -> None:
        """Resident -> sparse at a step boundary on ``stream`` (:class:`_Budgeted`)."""
        raise ValueError(f"demote {_NO_BUDGET}")

    def promote(self, rid: int, *, stream: StreamLike | None = None) -> None:
        """Sparse -> resident from a later step boundary (:class:`_Budgeted`)."""
        raise ValueError(f"promote {_NO_BUDGET}")

    def switch_promoted(self, stream: StreamLike | None = None) -> list[int]:
        """The promotions that landed become resident: none without a budget. ``stream`` is
        ordered after every earlier call of the cache all the same (``cache.order``), as
        engines call it before a graph replay."""
        if self._order is not None:
            self._order(stream)
        return []

    def make_room(self, pages: int, *, keep=(), stream: StreamLike | None = None) -> list[int]:
        """The default policy's demotions (:class:`_Budgeted`)."""
        raise ValueError(f"make_room {_NO_BUDGET}")

    def promote_ready(self, *, keep_free: int = 0,
                      stream: StreamLike | None = None) -> list[int]:
        """The default policy's promotions (:class:`_Budgeted`)."""
        raise ValueError(f"promote_ready {_NO_BUDGET}")

    def shed(self, *, keep=(), stream: StreamLike | None = None) -> list[int]:
        """The default policy's demotions down to the high watermark (:class:`_Budgeted`)."""
        raise ValueError(f"shed {_NO_BUDGET}")

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
        b = self.budget
        if lean is None:
            return b is not None and b.all_resident()
        if not isinstance(lean, bool):
            raise TypeError(f"lean must be None, True or False, got {lean!r}")
        if lean and (b is None or not b.all_resident()):
            why = ("the cache has no device budget (HotBufferCache(device_budget=))"
                   if b is None else f"request slots {b.sparse()[:8]} are not resident")
            raise ValueError(f"lean=True needs every admitted request resident: {why}")
        return lean

    # ------------------------------------------------------------- the cache's face
    def fields(self) -> dict:
        """The residency arguments of a layer's swap states (none without a budget)."""
        return {}

    def newest_fields(self) -> dict:
        """The residency arguments of the newest-row kernel (none without a budget)."""
        return {}

    def on_admit(self, rid: int, n: int, resident: bool | None, stream) -> np.ndarray | None:
        """Admission's first step, before the host pool takes anything: the rows of a sparse
        request's block, or None (its hot slots are its own slot's rows, or it is resident:
        :meth:`is_resident`). Refuses ``resident=True`` without a budget."""
        if resident:  # (truthiness, as DeviceBudget.admit reads it)
            raise ValueError(f"resident={resident!r} {_NO_BUDGET}")
        return None

    def is_resident(self, rid: int) -> bool:
        return False

    def on_load(self, rid: int, n: int, host_rows: np.ndarray, kv, shared: int,
                stream) -> None:
        """A resident admission's rows into its pages (only a resident request has any)."""
        raise AssertionError("no request is resident without a device budget")

    def on_grow(self, rid: int, n: int, stream, *, check: bool = False) -> None:
        """Pages for a resident request's tokens up to ``n`` (``check``: raise what growing
        would, taking nothing): nothing without a budget."""

    def check_write(self, rid: int, start: int, stop: int) -> None:
        """Raise ``ValueError`` where a write of tokens ``[start, stop)`` reaches past what the
        budget counts for ``rid`` (before anything is written). Nothing without a budget."""

    def on_write(self, rid: int, start: int, rows: np.ndarray, stream) -> None:
        """Host rows ``rows`` of tokens ``start..`` just written: a resident request's pages
        get them too, a promoting one's at its switch. Nothing without a budget."""

    def on_release(self, rid: int, stream) -> None:
        """``rid``'s pages and block back to the budget (a no-op for a slot it never held)."""

    def on_step(self, stream) -> None:
        """A step begins on ``stream``: outside a graph capture, the promotions that landed
        switch (:meth:`switch_promoted`). Nothing without a budget (no capture query)."""

    def _rid(self, rid) -> int:
        return _checks.integer("rid", rid, 0, self._R - 1)


class _Budgeted(Residency):
    """A cache's residency under its device budget (``docs/design.md`` section 10)."""

    enabled = True

    def __init__(self, arena: DeviceArena):
        super().__init__(arena.resident.shape[0])
        self._arena = arena
        self.budget = arena.budget
        self.n_rows = arena.n_rows

    def bind(self, *, tables, device, pool, host, order) -> None:
        super().bind(tables=tables, device=device, pool=pool, host=host, order=order)
        self._tables, self._device, self._pool, self._host = tables, device, pool, host

    def state(self, rid: int) -> str:
        return self.budget.state(self._admitted(rid))

    @property
    def promoting(self) -> list[int]:
        return list(self._arena.promoting)

    def demote(self, rid: int, *, stream: StreamLike | None = None) -> None:
        """Resident -> sparse at a step boundary on ``stream``: its hot slots take what an
        admission of its written tokens would hold (the positional layout up to H tokens,
        else its newest H with the newest in slot H), its pages return carrying the event
        after their copy (``docs/design.md`` section 10); a promotion in flight is cancelled.
        ``ValueError`` / ``PoolExhausted``: nothing done."""
        rid = self._admitted(rid)
        self._arena.demote(rid, self._tables, self._device, self._order(stream))

    def promote(self, rid: int, *, stream: StreamLike | None = None) -> None:
        """Sparse -> resident: pages now, its written tokens' rows loaded from the host on a
        side stream after ``stream``'s work; resident from the next step boundary after that
        (:meth:`switch_promoted`), the tokens written meanwhile copied in then.
        ``ValueError`` / ``PoolExhausted``: nothing taken."""
        rid = self._admitted(rid)
        self._arena.promote(rid, self._pool, self._host.rows, self._device, self._order(stream))

    def switch_promoted(self, stream: StreamLike | None = None) -> list[int]:
        """Every promotion whose fill has landed becomes resident, on ``stream``, no wait (in
        ``begin_step`` outside a capture; between graph replays, the engine's call)."""
        s = self._order(stream)
        if not self._arena.promoting:
            return []
        return self._arena.switch(self._host.locs, self._pool, self._device, self._tables, s)

    def make_room(self, pages: int, *, keep=(), stream: StreamLike | None = None) -> list[int]:
        """The default policy's demotions, at a step boundary on ``stream``: the resident
        requests :meth:`DeviceBudget.room_for` names (longest idle first, then the largest,
        then the lowest request slot; never one of ``keep``) are demoted until ``pages`` more
        pages are free. Returns the demoted request slots (empty when the pages are free
        already). ``PoolExhausted`` (no set of demotions makes the room): nothing demoted."""
        victims = self.budget.room_for(pages, keep=keep)
        for r in victims:
            self.demote(r, stream=stream)
        return victims

    def promote_ready(self, *, keep_free: int = 0,
                      stream: StreamLike | None = None) -> list[int]:
        """The default policy's promotions: the sparse requests whose pages fit
        (:meth:`DeviceBudget.promotable`: most recently used first, then the lowest request
        slot), each only while ``keep_free`` pages stay free after it (e.g. the blocks an
        engine keeps for its next admissions and demotions). Returns the request slots whose
        fill began (resident from a step boundary after it lands: :meth:`switch_promoted`)."""
        b = self.budget
        keep_free = _checks.integer("keep_free", keep_free, 0)
        out = []
        for r in b.promotable():
            if b.free_pages - b.pages_for(b.tokens(r)) >= keep_free:
                self.promote(r, stream=stream)
                out.append(r)
        return out

    def shed(self, *, keep=(), stream: StreamLike | None = None) -> list[int]:
        """The default policy's demotions, at a step boundary on ``stream``: the resident
        requests :meth:`DeviceBudget.excess` names (the pages in use down to the high
        watermark, :attr:`DeviceBudget.watermarks`; longest idle first; never one of ``keep``
        nor one still cooling down from its promotion). Returns the demoted request slots
        (empty at or under the watermark). An engine calls it between steps, as it calls
        :meth:`promote_ready`; with the default watermarks it never demotes."""
        victims = self.budget.excess(keep=keep)
        for r in victims:
            self.demote(r, stream=stream)
        return victims

    # ------------------------------------------------------------- the cache's face
    def fields(self) -> dict:
        return self._arena.fields()

    def newest_fields(self) -> dict:
        a = self._arena
        return dict(resident=a.resident, dev_pages=a.page_table, dev_page_tokens=a.page_tokens,
                    written=a.written)

    def on_admit(self, rid: int, n: int, resident: bool | None, stream) -> np.ndarray | None:
        return self._arena.admit(rid, n, resident, stream)

    def is_resident(self, rid: int) -> bool:
        return self._arena.is_resident(rid)

    def on_load(self, rid: int, n: int, host_rows: np.ndarray, kv, shared: int,
                stream) -> None:
        self._arena.load(rid, n, host_rows, kv, shared, self._pool, self._device, stream)

    def on_grow(self, rid: int, n: int, stream, *, check: bool = False) -> None:
        if check:
            self._arena.check_grow(rid, n)
        else:
            self._arena.grow(rid, n, stream, host_locs=self._host.locs, pool=self._pool,
                             device=self._device)

    def check_write(self, rid: int, start: int, stop: int) -> None:
        # A resident request's pages cover its counted tokens only, and a promotion fills up to
        # the count: a token written past it would be served from a page nobody filled.
        have = self.budget.tokens(rid)
        if stop > have:
            raise ValueError(f"tokens {start}..{stop} of request slot {rid}: the device budget "
                             f"counts {have} (grow() it first)")

    def on_write(self, rid: int, start: int, rows: np.ndarray, stream) -> None:
        if rid in self._arena.promoting:  # its fill may have read the old rows
            self._arena.rewrote(rid, start)
        elif self._arena.is_resident(rid):
            from .._kernels.rows import load_rows

            load_rows(self._pool, rows, self._device,
                      self._arena.rows(rid, start, start + len(rows)), stream)

    def on_step(self, stream) -> None:
        # (``stream`` is ordered already: begin_step's; no second cache.order per step)
        if self._arena.promoting and not stream.is_capturing():
            self._arena.switch(self._host.locs, self._pool, self._device, self._tables, stream)

    def on_release(self, rid: int, stream) -> None:
        if rid in self.budget:
            self._arena.release(rid, stream)
            self._tables.place(rid, None, stream)

    def _admitted(self, rid) -> int:
        rid = self._rid(rid)
        if rid not in self.budget:  # every admitted request holds pages or a block
            raise ValueError(f"request slot {rid} is not admitted")
        return rid

