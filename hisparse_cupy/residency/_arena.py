"""The device side of a cache's budget (``docs/design.md`` section 10): the
:class:`~hisparse_cupy.residency.DeviceBudget`, the residency flags and device page table that
every layer's kernels read (uint8 ``[R]``, int32 ``[R, ceil(max_len / P)]``), and each request's
count of written tokens on the device (int32 ``[R]``: its admission's length, then each step's
newest token, recorded by the step's backup). The same row indices serve every layer.

Demotion, promotion and the switch work from that device count, never from a count the host
passes (an engine's count can be off by one; the device's is what was written). Every page they
give back carries the fence of the last work on it, and every page they take waits for its
fences on the stream that writes it (``hisparse_cupy/_order.py``, rule 2).
"""

from __future__ import annotations

import cupy
import numpy as np

from .._kernels.plan import array_rows, copy_rows
from .._kernels.rows import load_rows
from .._order import StreamOrder
from ._budget import PROMOTING, RESIDENT, SPARSE, DeviceBudget

__all__ = ["DeviceArena"]


class DeviceArena:
    """A cache's device rows as a budget: ``n_rows`` rows per layer in pages of
    ``page_tokens``, a sparse request's block ``block_rows`` rows."""

    def __init__(self, *, max_requests: int, max_len: int, n_rows: int, page_tokens: int,
                 block_rows: int):
        self.budget = DeviceBudget(n_rows // page_tokens, page_tokens, block_rows)
        self.page_tokens = P = self.budget.page_tokens
        self.resident = cupy.zeros(max_requests, cupy.uint8)
        self.page_table = cupy.full((max_requests, -(-max_len // P)), -1, cupy.int32)
        self.written = cupy.zeros(max_requests, cupy.int32)
        # rid -> (the fill's end, the tokens it copies: int32 [1] on the device, the first
        # token the switch reloads at the latest: the tokens the fill had pages for, or the
        # first a rewrite reached meanwhile)
        self.promoting: dict[int, tuple[cupy.cuda.Event, cupy.ndarray, int]] = {}
        self._side: cupy.cuda.Stream | None = None  # the fills' stream

    @property
    def n_rows(self) -> int:
        return self.budget.n_rows

    def fields(self) -> dict:
        """The residency arguments of a layer's states (``SwapState.validated``,
        ``MultiStepState.set_residency``) and of the newest-row kernel."""
        return dict(resident=self.resident, page_table=self.page_table,
                    page_tokens=self.page_tokens)

    def admit(self, rid: int, n: int, resident: bool | None, stream) -> np.ndarray | None:
        """Admit ``rid`` (resident when its pages fit, or as asked): returns its block's rows
        (sparse) or None (resident: its page table row and flag written on ``stream``). Raises
        :class:`~hisparse_cupy.host.PoolExhausted` (``kind="device"``), nothing taken."""
        state = self.budget.admit(rid, n, resident=resident, wait=StreamOrder.waiter(stream))
        with stream:
            self.resident[rid] = 1 if state == RESIDENT else 0
            self.page_table[rid] = -1
            self.written[rid] = n
            if state == RESIDENT:
                self._write_pages(rid)
        return None if state == RESIDENT else self.budget.block(rid)

    def load(self, rid: int, n: int, host_rows: np.ndarray, kv, shared: int, pool, device,
             stream) -> None:
        """A resident admission's rows into its pages on ``stream``: a prompt ``kv`` on the GPU
        (its tokens ``shared..n``; None: none) device -> device, every other row from the host
        pool."""
        dst = self.budget.rows(rid)
        if kv is None:
            load_rows(pool, host_rows, device, dst[:n], stream)
            return
        if shared:  # a prefix: the parent's rows, from the host
            load_rows(pool, host_rows[:shared], device, dst[:shared], stream)
        with stream:
            src = cupy.arange(n - shared, dtype=cupy.int64).reshape(1, -1)
            to = cupy.asarray(dst[shared:n].astype(np.int32).reshape(1, -1))
            count = cupy.full(1, n - shared, cupy.int32)
        copy_rows(src, to, count, src=array_rows(kv), dst=array_rows(device),
                  row_bytes=device.shape[2], n_layers=device.shape[0], stream=stream)

    def check_grow(self, rid: int, n: int) -> None:
        """Raise what :meth:`grow` would (``PoolExhausted``), taking nothing."""
        if n > self.budget.tokens(rid):
            self.budget.check_grow(rid, n)

    def grow(self, rid: int, n: int, stream, *, host_locs=None, pool=None, device=None) -> None:
        """Pages for a resident (or promoting) request's tokens up to ``n``, nothing where it
        has them (``stream`` waits for the new pages' fences); a resident request's table
        entries written on ``stream`` (a promoting one's whole row is written at its switch),
        and, given ``host_locs`` (with ``pool`` and ``device``), the host rows that exist for
        the new pages' tokens loaded into them there (none where the engine grows before each
        step; a step run before its grow backed its token up to the host only)."""
        if n <= self.budget.tokens(rid):
            return
        new = self.budget.grow(rid, n, wait=StreamOrder.waiter(stream))
        if new and self.is_resident(rid):
            with stream:
                self._write_pages(rid)
            if host_locs is not None:  # (the new pages are the last ones)
                had = (len(self.budget.pages(rid)) - len(new)) * self.budget.page_tokens
                self._load_written(rid, had, host_locs, pool, device, stream, 0)

    def _load_written(self, rid: int, first: int, host_locs, pool, device, stream, lo) -> None:
        """On ``stream``: the host rows that exist (``host_locs`` set) of ``rid``'s tokens from
        ``first`` to the end of its pages, those at or past ``lo`` (an int or a device count),
        loaded into its pages (their rows read from its page table row, written before: no
        host -> device copy)."""
        P = self.budget.page_tokens
        end = min(len(self.budget.pages(rid)) * P, host_locs.shape[1])
        if end <= first:
            return
        with stream:
            t = cupy.arange(first, end, dtype=cupy.int64)
            dst = (self.page_table[rid, t // P].astype(cupy.int64) * P + t % P).astype(
                cupy.int32)
            hl = host_locs[rid, first:end]
            src = cupy.where((t >= lo) & (hl >= 0), hl, -1)
        load_rows(pool, src, device, dst, stream)

    def rewrote(self, rid: int, start: int) -> None:
        """A promoting request's tokens from ``start`` were rewritten on the host (the fill
        may have read their old rows): its switch reloads them."""
        ev, n0, lo = self.promoting[rid]
        self.promoting[rid] = (ev, n0, min(lo, start))

    def rows(self, rid: int, start: int, stop: int) -> np.ndarray:
        """Device rows of a resident request's tokens ``[start, stop)``."""
        return self.budget.rows(rid)[start:stop]

    def is_resident(self, rid: int) -> bool:
        return rid in self.budget and self.budget.state(rid) == RESIDENT

    def release(self, rid: int, stream) -> None:
        """``rid``'s pages and block back to the budget, carrying an event after the work
        queued on ``stream`` (a promotion's fill waited for there first: it reads the host
        rows the slot's next request writes); its flag, table row and count cleared there."""
        got = self.promoting.pop(rid, None)
        if got is not None:
            stream.wait_event(got[0])
        with StreamOrder.fence(stream) as ev:
            self.budget.release(rid, fence=ev)
            with stream:
                self.resident[rid] = 0
                self.page_table[rid] = -1
                self.written[rid] = 0

    def demote(self, rid: int, tables, device, stream) -> None:
        """Resident -> sparse on ``stream``, from the request's count of written tokens ``n``
        on the device (no host synchronization, no count from the host). Its block's hot slots
        take what an admission of ``n`` tokens would hold: while ``n <= H`` the positional
        layout (slot t holds token t: every token with a page, up to H, is copied: a later
        step writes the others into their slots), else its newest H tokens with the newest in
        slot H. They are copied from the pages device -> device in every layer, the tables
        built, the flag and table row cleared; the pages go back carrying the event after the
        copy. A promotion in flight is cancelled instead: its pages go back carrying its
        fill's event (nothing waits for it)."""
        if rid in self.budget and self.budget.state(rid) == PROMOTING:
            ev, *_ = self.promoting.pop(rid)
            self.budget.cancel_promotion(rid, fence=ev)
            return
        if not self.is_resident(rid):
            raise ValueError(f"request slot {rid} is not resident")
        H, P = tables.hot_size, self.page_tokens
        with StreamOrder.fence(stream) as ev:
            paged = self.budget.tokens(rid)  # tokens with a page (written or grown ahead)
            block, _ = self.budget.demote(rid, fence=ev, wait=StreamOrder.waiter(stream))
            tables.place(rid, block, stream)
            tables.reset(rid, stream)
            with stream:
                n = self.written[rid: rid + 1]  # (read before anything below changes it)
                pos = n <= H  # the positional layout
                j = cupy.arange(H + 1, dtype=cupy.int32)  # hot slots, then slot H
                tok = cupy.where(pos, j, n - 1 - H + j)  # each slot's token
                row = self.page_table[rid]
                page = row[cupy.minimum(tok // P, row.size - 1)]
                # a slot takes its token's bytes where the token has a page (positional: up
                # to H); past H a slot without them is left empty (-1: a miss, from the host)
                keep = (page >= 0) & (tok < paged) & ~(pos & (j >= H))
                held = cupy.where(pos | keep, tok, -1)
                tables.slot_tokens[:, rid, :H] = held[:H].reshape(1, H)
                tables.slot_tokens[:, rid, H] = cupy.where(pos, -1, held[H])
                src = cupy.where(keep, page.astype(cupy.int64) * P + tok % P, -1)
                dst = tables.slot_layout[rid, : H + 1]  # (placed above: the block's rows)
                count = cupy.full(1, H + 1, cupy.int32)
                self.resident[rid] = 0
                self.page_table[rid] = -1
            tables.init_multistep(rid, stream)
            copy_rows(src.reshape(1, -1), dst.reshape(1, -1), count, src=array_rows(device),
                      dst=array_rows(device), row_bytes=device.shape[2],
                      n_layers=device.shape[0], stream=stream)

    def promote(self, rid: int, pool, host_rows, device, stream) -> None:
        """Sparse -> promoting: pages for its tokens, its written tokens' host rows (the device
        count, read on ``stream`` after its work) loaded into them on a side stream after the
        work queued on ``stream`` (the side stream first waits for the pages' fences);
        :meth:`switch` makes it resident once that fill has landed. The side stream writes the
        pages' rows only: the page table row is written at the switch, on the step's stream,
        so no growth meanwhile races with it."""
        if rid not in self.budget or self.budget.state(rid) != SPARSE:
            raise ValueError(f"request slot {rid} is not sparse: only a sparse request is "
                             f"promoted")
        if self._side is None:
            self._side = cupy.cuda.Stream(non_blocking=True)
        side = self._side
        rows = self.budget.promote(rid, wait=StreamOrder.waiter(side))  # PoolExhausted: none
        with stream:
            count = self.written[rid: rid + 1].copy()  # what has been written by now
        side.wait_event(stream.record())
        with side:
            dst = cupy.asarray(rows.astype(np.int32))
        load_rows(pool, host_rows(rid, 0, len(rows)), device, dst, stream=side, count=count)
        self.promoting[rid] = (side.record(), count, len(rows))

    def switch(self, host_locs, pool, device, tables, stream) -> list[int]:
        """At a step boundary, on ``stream`` (no wait): every promoting request whose fill has
        landed gets the rows of the tokens the fill did not load, to the end of its pages
        (their host rows, which the backups keep current: ``host_locs`` entries set, from the
        fill's count, or from the tokens it had pages for where fewer: a step run before its
        grow, or from the first token rewritten meanwhile: :meth:`rewrote`), then its flag;
        its slot tables are emptied (no slot names a row of its block, which is its next
        owner's: a ``mirror_layer`` reads every slot) and its block returns to the budget,
        carrying the event after all that. Returns those request slots."""
        done = [r for r, (ev, *_) in self.promoting.items() if ev.done]
        if not done:
            return done
        with StreamOrder.fence(stream) as fence:
            for r in done:
                ev, n0, reload = self.promoting.pop(r)
                stream.wait_event(ev)
                with stream:  # the table written here only: a growth's entries are in it
                    self._write_pages(r)
                    lo = cupy.minimum(n0.astype(cupy.int64), reload)
                self._load_written(r, 0, host_locs, pool, device, stream, lo)
                with stream:
                    self.resident[r] = 1
                tables.place(r, None, stream)
                tables.reset(r, stream)
                tables.init_multistep(r, stream)
                self.budget.finish_promotion(r, fence=fence)
        return done

    def _write_pages(self, rid: int) -> None:
        """``rid``'s page table row from the budget (current stream)."""
        table = self.budget.page_table(rid, self.page_table.shape[1])
        self.page_table[rid] = cupy.asarray(table)
