"""A cache's device rows as a budget of pages: which requests are resident, which sparse.

The device rows of a cache (the same row indices in every layer) are cut into pages of
``page_tokens`` rows. Each admitted request is in one of three states:

- **resident**: it holds one page per ``page_tokens`` of its tokens, and its token ``t`` lives
  in row ``pages[t // P] * P + t % P``. Every token has a device row, so a swap maps each
  selected token to its row, with no lookup, no eviction and no host read.
- **sparse**: it holds a *block* of ``block_pages`` pages for its hot slots, its extra page and
  its scratch rows (``H + P + C`` rows, as in a cache without a budget). Misses come from the
  host pool.
- **promoting**: still sparse, and it also holds the pages of its tokens, which a side stream
  fills from the host pool. :meth:`DeviceBudget.finish_promotion` switches it to resident at a
  step boundary, and its block returns to the budget.

:meth:`DeviceBudget.demote` is the way back. The request takes a block, its hot slots take
tokens from its pages (copied device to device on the step's stream), and then its pages
return. Every call checks its arguments and the budget before changing anything. When there is
no room it raises :class:`~hisparse_cupy.host.PoolExhausted` with ``kind="device"``, and
nothing is taken.

Pages carry fences (``docs/design.md`` section 10, "Page reuse"; the allocator's rule,
:class:`~hisparse_cupy.host.HostPages`): every call that gives pages back takes ``fence=`` (the
event after the last work on them), every call that takes pages ``wait=`` (what waits for the
fences of the pages taken; default: the host). A cache passes both; a scheduler that runs this
class alone may ignore them.

The default policy is replaceable: an engine may call :meth:`~DeviceBudget.demote` and
:meth:`~DeviceBudget.promote` itself.

- :meth:`~DeviceBudget.admit` makes a request resident when its pages fit, else sparse.
- :meth:`~DeviceBudget.room_for` names the resident requests to demote so that some pages fit,
  longest idle first (steps since :meth:`~DeviceBudget.touch`), then the ones that hold the
  most pages, then the lowest request slot.
- :meth:`~DeviceBudget.promotable` names the sparse requests whose pages fit now, most recently
  used first, then the lowest request slot.
- :meth:`~DeviceBudget.excess` names the resident requests to demote so that the pages in use
  fall to the high watermark (:attr:`~DeviceBudget.watermarks`), in :meth:`room_for`'s order.

Two knobs keep requests from flapping between the states, as engines' residency controllers
expose them: :attr:`~DeviceBudget.watermarks`, a band over the share of pages in use
(promotions only below the low one, up to the high one; demotions by :meth:`excess` down to the
high one), and :attr:`~DeviceBudget.cooldown`, steps a moved request stays put for the policy.

A prefix shared on the host is resident in each child separately; the device pages are never
shared.

This module needs NumPy only, so an engine's scheduler can run it anywhere.
"""

from __future__ import annotations

import math

import numpy as np

from .. import _checks
from .._checks import ArrayLike
from ..host import HostPages, PoolExhausted

__all__ = ["DeviceBudget"]

RESIDENT, SPARSE, PROMOTING = "resident", "sparse", "promoting"


class _DevicePages(HostPages):
    """The page allocator over device pages: the host pool's allocator, whose errors say
    "device". A resident request's token pages are its request's pages; a block is pages the
    budget holds (:meth:`HostPages.take`)."""

    kind = "device"


class DeviceBudget:
    """The device pages of a cache's rows, and the residency of each request.

    Parameters
    ----------
    n_pages : int
        Pages in the budget (device rows per layer: ``n_pages * page_tokens``).
    page_tokens : int
        Rows per page (``P``): a resident request holds a page per ``P`` tokens.
    block_rows : int
        Rows a sparse request holds (hot slots, extra page and scratch rows: ``H + P + C``),
        rounded up to whole pages.

    Requests are keyed by any int (the cache's request slots). :meth:`check` verifies every
    invariant; the tests call it.
    """

    def __init__(self, n_pages: int, page_tokens: int, block_rows: int):
        self._pages = _DevicePages(n_pages, page_tokens)
        self.page_tokens = self._pages.page_tokens
        self.block_rows = _checks.integer("block_rows", block_rows, 1)
        self.block_pages = self._pages.pages_for(self.block_rows)
        if self.block_pages > self._pages.n_pages:
            raise ValueError(f"a budget of {n_pages} pages of {page_tokens} rows cannot hold "
                             f"one sparse request ({self.block_rows} rows)")
        self._state: dict[int, str] = {}
        self._block: dict[int, list[int]] = {}  # rid -> its block (sparse, promoting)
        self._tokens: dict[int, int] = {}  # rid -> tokens (all states)
        self._used: dict[int, int] = {}  # rid -> the clock at its last touch
        self._moved: dict[int, int] = {}  # rid -> the clock at its last demotion or promotion
        self._clock = 0
        self._cooldown = 0
        self._band = (1.0, 1.0)

    # ------------------------------------------------------------------ sizes
    @property
    def cooldown(self) -> int:
        """Steps (:meth:`touch` calls: an engine's steps, and each admission's) a move holds
        for the default policy, so that requests do not flap between resident and sparse:
        :meth:`promotable` leaves out a request demoted (or whose promotion was cancelled)
        fewer steps ago, and :meth:`room_for` names a request promoted fewer steps ago only
        after every other. Default 0: no cooldown. Moves an engine makes itself are never
        refused by it."""
        return self._cooldown

    @cooldown.setter
    def cooldown(self, steps: int) -> None:
        self._cooldown = _checks.integer("cooldown", steps, 0)

    @property
    def watermarks(self) -> tuple[float, float]:
        """``(low, high)``, shares of the budget's pages in use (``0 <= low <= high <= 1``):
        the default policy's band. :meth:`promotable` names no request while the pages in use
        are ``low * n_pages`` or more, and takes requests only while the pages in use after
        each stay at most ``high * n_pages``; :meth:`excess` names the demotions that bring
        the pages in use down to ``high * n_pages`` (rounded down to whole pages; ``low *
        n_pages`` is compared unrounded). Between
        the two a request neither moves up nor down, so growth and admissions have room
        before the policy demotes, and a demotion does not invite the next promotion.
        Pages in use count the sparse requests' blocks as well as the resident requests'
        pages, so a band is set above what the blocks alone take. Default ``(1.0, 1.0)``:
        promote whatever fits, never demote for the share in use. Moves an engine makes
        itself, and :meth:`room_for`, are never refused by it."""
        return self._band

    @watermarks.setter
    def watermarks(self, band) -> None:
        try:
            low, high = band
        except (TypeError, ValueError):
            raise TypeError(f"watermarks must be a pair (low, high), got {band!r}") from None
        low = _checks.fraction("watermarks' low", low)
        high = _checks.fraction("watermarks' high", high)
        if low > high:
            raise ValueError(f"watermarks' low ({low}) must be <= their high ({high})")
        self._band = (low, high)

    def _share_pages(self, share: float) -> int:
        """``share * n_pages`` rounded down to whole pages (a share of 1.0: every page)."""
        return int(math.floor(share * self.n_pages + 1e-9))

    def _cooling(self, rid: int) -> bool:
        """Whether ``rid`` moved fewer than :attr:`cooldown` steps ago."""
        t = self._moved.get(rid)
        return t is not None and self._clock - t < self._cooldown

    @property
    def n_pages(self) -> int:
        return self._pages.n_pages

    @property
    def n_rows(self) -> int:
        """Device rows per layer the budget covers."""
        return self._pages.n_rows

    @property
    def free_pages(self) -> int:
        return self._pages.free_pages

    def pages_for(self, n_tokens: int) -> int:
        """Pages a resident request of ``n_tokens`` tokens holds."""
        return self._pages.pages_for(n_tokens)

    @staticmethod
    def rows_needed(resident_lengths: ArrayLike = (), n_sparse: int = 0, *, page_tokens: int,
                    block_rows: int) -> int:
        """Device rows per layer a budget needs for resident requests of ``resident_lengths``
        tokens and ``n_sparse`` sparse requests of ``block_rows`` rows each, in pages of
        ``page_tokens`` (the twin of ``HotBufferCache.host_bytes_needed``; multiply by
        ``n_layers * row_bytes`` for bytes)."""
        P = _checks.integer("page_tokens", page_tokens, 1)
        n = np.asarray(resident_lengths, np.int64).reshape(-1)
        if (n < 1).any():
            raise ValueError("resident_lengths must be >= 1")
        block = -(-_checks.integer("block_rows", block_rows, 1) // P)
        pages = int((-(-n // P)).sum()) + _checks.integer("n_sparse", n_sparse, 0) * block
        return pages * P

    @staticmethod
    def max_resident(lengths: ArrayLike, n_rows: int, *, page_tokens: int,
                     block_rows: int) -> int:
        """How many requests of ``lengths`` tokens (in order) can be resident with every other
        one sparse in a budget of ``n_rows`` rows: the largest ``k`` with
        ``rows_needed(lengths[:k], len(lengths) - k) <= n_rows``, or -1 when not even all
        sparse fit. An engine admitting a batch at once uses it so that a greedy resident
        admission does not leave the last requests without a block."""
        P = _checks.integer("page_tokens", page_tokens, 1)
        n = np.asarray(lengths, np.int64).reshape(-1)
        if (n < 1).any():
            raise ValueError("lengths must be >= 1")
        rows = _checks.integer("n_rows", n_rows, 0)
        block = -(-_checks.integer("block_rows", block_rows, 1) // P)
        k = np.arange(n.size + 1)
        pages = np.concatenate([[0], np.cumsum(-(-n // P))]) + (n.size - k) * block
        fit = np.nonzero(pages * P <= rows)[0]
        return int(fit[-1]) if fit.size else -1

    # ------------------------------------------------------------------ queries
    def __contains__(self, rid) -> bool:
        return rid in self._state

    def state(self, rid: int) -> str:
        """``"resident"``, ``"sparse"`` or ``"promoting"``."""
        return self._state[self._live(rid)]

    def all_resident(self) -> bool:
        """Whether every admitted request is resident (none sparse or promoting): a step may
        then run lean (``HotBufferCache.begin_step(lean=)``)."""
        return all(st == RESIDENT for st in self._state.values())

    def sparse(self) -> list[int]:
        """The admitted requests that are not resident (sparse or promoting), in slot order."""
        return sorted(r for r, st in self._state.items() if st != RESIDENT)

    def tokens(self, rid: int) -> int:
        return self._tokens[self._live(rid)]

    def block(self, rid: int) -> np.ndarray:
        """int64 device rows of a sparse or promoting request's block (``block_rows`` of them:
        its hot slots, extra page and scratch rows, in that order)."""
        rid = self._live(rid)
        if rid not in self._block:
            raise ValueError(f"rid {rid} is resident: it has no block")
        pg = np.asarray(self._block[rid], np.int64)
        P = self.page_tokens
        return (pg[:, None] * P + np.arange(P)).reshape(-1)[: self.block_rows]

    def rows(self, rid: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """int64 device rows of a resident or promoting request's tokens ``[start, stop)``
        (default: every token), in token order."""
        rid = self._live(rid)
        if self._state[rid] == SPARSE:
            raise ValueError(f"rid {rid} is sparse: its tokens have no device pages")
        return self._pages.rows(rid, start, stop)

    def pages(self, rid: int) -> list[int]:
        """The device pages a resident or promoting request holds, in token order (none for a
        sparse one). The last may have rows past the request's count: where a token written
        before a grow counted it lies."""
        rid = self._live(rid)
        return [] if self._state[rid] == SPARSE else self._pages.pages(rid)

    def page_table(self, rid: int, width: int) -> np.ndarray:
        """int32 ``[width]``: a resident or promoting request's device pages, then -1 (the row
        of the device page table the kernels read)."""
        rid = self._live(rid)
        out = np.full(_checks.integer("width", width, 1), -1, np.int32)
        if self._state[rid] != SPARSE:
            pg = self._pages.pages(rid)
            if len(pg) > width:
                raise ValueError(f"width {width}: rid {rid} holds {len(pg)} pages")
            out[: len(pg)] = pg
        return out

    # ------------------------------------------------------------------ requests
    def admit(self, rid: int, n_tokens: int, *, resident: bool | None = None,
              wait=None) -> str:
        """Admit ``rid`` with ``n_tokens`` tokens: resident when its pages fit, else sparse
        (``resident=True`` / ``False`` asks for one state, and raises if it does not fit).
        Returns the state. Raises :class:`PoolExhausted` (``kind="device"``), nothing taken.
        ``wait``: the fences of the pages taken (module docstring)."""
        rid = int(rid)
        if rid in self._state:
            raise ValueError(f"rid {rid} is already admitted")
        n = _checks.integer("n_tokens", n_tokens, 1)
        fits = self.pages_for(n) <= self.free_pages
        if resident is None:
            resident = fits
        if resident:
            self._pages.admit(rid, n, wait=wait)  # raises PoolExhausted when it does not fit
            self._state[rid] = RESIDENT
        else:
            self._block[rid] = self._take_block(f"admit of rid {rid} (sparse)", wait)
            self._state[rid] = SPARSE
        self._tokens[rid] = n
        self.touch([rid])
        return self._state[rid]

    def check_grow(self, rid: int, n_tokens: int) -> None:
        """Raise what :meth:`grow` would raise, taking nothing (a cache checks its device
        budget before its host pool takes pages, so a refusal leaves both as they were)."""
        rid = self._live(rid)
        n = _checks.integer("n_tokens", n_tokens, self._tokens[rid])
        if self._state[rid] != SPARSE:
            need = self.pages_for(n) - len(self._pages.pages(rid))
            if need > self.free_pages:
                raise PoolExhausted(f"rid {rid} growing to {n} tokens", need, self.free_pages,
                                    "device")

    def grow(self, rid: int, n_tokens: int, *, wait=None) -> list[int]:
        """``rid``'s tokens up to ``n_tokens`` (at least its tokens now); a resident or
        promoting request takes the pages they need (returned; their fences to ``wait``).
        Raises :class:`PoolExhausted` with nothing taken: the engine makes room
        (:meth:`room_for`, :meth:`demote`) and grows again."""
        rid = self._live(rid)
        n = _checks.integer("n_tokens", n_tokens, self._tokens[rid])
        new = [] if self._state[rid] == SPARSE else self._pages.grow(rid, n, wait=wait)
        self._tokens[rid] = n
        return new

    def release(self, rid: int, *, fence=None) -> None:
        """Drop ``rid``: its pages and its block return to the budget, carrying ``fence``."""
        rid = self._live(rid)
        if self._state[rid] != SPARSE:
            self._pages.release(rid, fence=fence)
        if rid in self._block:
            self._pages.put(self._block.pop(rid), fence=fence)
        del self._state[rid], self._tokens[rid], self._used[rid]
        self._moved.pop(rid, None)

    def demote(self, rid: int, *, fence=None, wait=None) -> tuple[np.ndarray, list[int]]:
        """Resident -> sparse: ``rid`` takes a block (its fences to ``wait``), and returns
        ``(block rows, the pages it gives back)``, which carry ``fence``: the event after the
        caller's copy of the tokens its hot slots keep from the pages into the block. Raises
        :class:`PoolExhausted` (no room for the block, nothing changed) or ``ValueError``
        (``rid`` is not resident: a promoting request is demoted with
        :meth:`cancel_promotion`)."""
        rid = self._live(rid)
        if self._state[rid] != RESIDENT:
            raise ValueError(f"rid {rid} is {self._state[rid]}, not resident: only a resident "
                             f"request is demoted")
        self._block[rid] = self._take_block(f"demotion of rid {rid}", wait)
        freed = self._pages.pages(rid)
        self._pages.release(rid, fence=fence)
        self._state[rid] = SPARSE
        self._moved[rid] = self._clock
        return self.block(rid), freed

    def promote(self, rid: int, *, wait=None) -> np.ndarray:
        """Sparse -> promoting: ``rid`` takes the pages of its tokens (their fences to
        ``wait``) and returns their device rows (token order), which the caller fills from the
        host pool off the step's path; it stays sparse until :meth:`finish_promotion`. Raises
        :class:`PoolExhausted` (nothing taken) or ``ValueError`` (not sparse)."""
        rid = self._live(rid)
        if self._state[rid] != SPARSE:
            raise ValueError(f"rid {rid} is {self._state[rid]}, not sparse: only a sparse "
                             f"request is promoted")
        self._pages.admit(rid, self._tokens[rid], wait=wait)
        self._state[rid] = PROMOTING
        self._moved[rid] = self._clock
        return self._pages.rows(rid)

    def finish_promotion(self, rid: int, *, fence=None) -> list[int]:
        """Promoting -> resident (at a step boundary, after the fill has landed): its block
        returns to the budget carrying ``fence`` (the pages of the block are returned)."""
        rid = self._live(rid)
        if self._state[rid] != PROMOTING:
            raise ValueError(f"rid {rid} is {self._state[rid]}, not promoting")
        block = self._block.pop(rid)
        self._pages.put(block, fence=fence)
        self._state[rid] = RESIDENT
        return block

    def cancel_promotion(self, rid: int, *, fence=None) -> list[int]:
        """Promoting -> sparse: the pages it took return (returned) carrying ``fence`` (the
        fill's event: it may still be writing them); its block stays."""
        rid = self._live(rid)
        if self._state[rid] != PROMOTING:
            raise ValueError(f"rid {rid} is {self._state[rid]}, not promoting")
        freed = self._pages.pages(rid)
        self._pages.release(rid, fence=fence)
        self._state[rid] = SPARSE
        self._moved[rid] = self._clock
        return freed

    # ------------------------------------------------------------------ the default policy
    def touch(self, rids: ArrayLike) -> None:
        """Mark ``rids`` used by the step now (the policy's idleness is steps since)."""
        self._clock += 1
        for r in np.asarray(rids, np.int64).reshape(-1).tolist():
            self._used[self._live(r)] = self._clock

    def room_for(self, pages: int, *, keep: ArrayLike = ()) -> list[int]:
        """The resident requests to demote, in order, so that ``pages`` more pages are free
        afterwards: longest idle first, then those holding the most pages; never one of
        ``keep``; ties go to the lowest request slot; a request still cooling down from its
        promotion (:attr:`cooldown`) only after every other. Empty when they fit already. Raises
        :class:`PoolExhausted` when demoting every other resident request would not make the
        room, or when fewer pages are free than the block the first demotion takes (nothing
        is demoted here); its ``free`` is the pages free now, its message says how many the
        demotions could free."""
        need = _checks.integer("pages", pages, 0)
        free = self.free_pages
        if free < need and free < self.block_pages:  # a demotion takes its block first
            raise PoolExhausted(f"room for {need} pages (a demotion first takes a block of "
                                f"{self.block_pages})", need, free, "device")
        out, free = self._victims(need, self._demotion_order(keep, cooling=True))
        if free < need:
            raise PoolExhausted(f"room for {need} pages (demoting every resident request not "
                                f"kept would free {free - self.free_pages} more)", need,
                                self.free_pages, "device")
        return out

    def promotable(self) -> list[int]:
        """Sparse requests whose pages fit now, most recently used first (ties: the lowest
        request slot), taken greedily while the pages in use stay at or under the high
        watermark; none while the pages in use are at or above the low one
        (:attr:`watermarks`); not one still cooling down from its demotion
        (:attr:`cooldown`)."""
        low, high = self._band
        if self.n_pages - self.free_pages >= low * self.n_pages:
            return []
        free = self.free_pages - (self.n_pages - self._share_pages(high))  # promotions may take
        out = []
        for r in sorted((r for r, st in self._state.items()
                         if st == SPARSE and not self._cooling(r)),
                        key=lambda r: (-self._used[r], r)):
            need = self.pages_for(self._tokens[r])
            if need <= free:
                free -= need
                out.append(r)
        return out

    def excess(self, *, keep: ArrayLike = ()) -> list[int]:
        """The resident requests to demote, in order, so that the pages in use fall to the
        high watermark (:attr:`watermarks`): :meth:`room_for`'s order (longest idle first,
        then those holding the most pages, then the lowest request slot), never one of
        ``keep`` nor one still cooling down from its promotion (:attr:`cooldown`). Where no
        such set reaches the watermark, every one of them that frees pages. Empty when the
        pages in use are at or under it, or when fewer pages are free than the block a
        demotion first takes. Nothing is demoted here (the cache's ``residency.shed`` does)."""
        need = self.n_pages - self._share_pages(self._band[1])  # pages to be free
        return self._victims(need, self._demotion_order(keep, cooling=False))[0]

    # ------------------------------------------------------------------ internals
    def _live(self, rid) -> int:
        rid = int(rid)
        if rid not in self._state:
            raise KeyError(f"rid {rid} is not admitted (or was released)")
        return rid

    def _demotion_order(self, keep: ArrayLike, *, cooling: bool) -> list[int]:
        """The resident requests not in ``keep`` in the policy's demotion order: longest idle
        first, then those holding the most pages, then the lowest request slot; those still
        cooling down from a promotion last (``cooling``) or left out."""
        kept = {int(r) for r in np.asarray(keep, np.int64).reshape(-1).tolist()}
        live = [r for r, st in self._state.items() if st == RESIDENT and r not in kept and
                (cooling or not self._cooling(r))]
        return sorted(live, key=lambda r: (self._cooling(r), self._used[r],
                                           -len(self._pages.pages(r)), r))

    def _victims(self, need: int, order: list[int]) -> tuple[list[int], int]:
        """The requests of ``order`` to demote, one after another, until ``need`` pages are
        free (each takes a block first: none once fewer pages are free than a block; one
        shorter than a block frees nothing and is passed over), and the pages free after."""
        free, out = self.free_pages, []
        for r in order:
            if free >= need or free < self.block_pages:
                break
            gain = len(self._pages.pages(r)) - self.block_pages
            if gain > 0:
                free += gain
                out.append(r)
        return out, free

    def _take_block(self, what: str, wait) -> list[int]:
        if self.block_pages > self.free_pages:
            raise PoolExhausted(what, self.block_pages, self.free_pages, "device")
        return self._pages.take(self.block_pages, wait=wait)

    def check(self) -> None:
        """Raise ``AssertionError`` unless every invariant holds: the allocator's; a resident
        request holds the pages of its tokens and no block; a sparse one a block and no
        pages; a promoting one both; the blocks are exactly the pages the budget holds."""
        self._pages.check()
        held = []
        for rid, st in self._state.items():
            has_pages = rid in self._pages
            assert has_pages == (st != SPARSE), (rid, st)
            assert (rid in self._block) == (st != RESIDENT), (rid, st)
            if has_pages:
                assert self._pages.tokens(rid) == self._tokens[rid], rid
            if rid in self._block:
                assert len(self._block[rid]) == self.block_pages, rid
                held += self._block[rid]
        assert len(set(held)) == len(held)
        assert sorted(held) == sorted(np.flatnonzero(self._pages.held).tolist())
        assert set(self._used) == set(self._state)
        assert set(self._moved) <= set(self._state)
