"""The device side of a cache's budget (``docs/design.md`` section 10): the
:class:`~hisparse_cupy.residency.DeviceBudget`, and the residency flags and device page table
that every layer's kernels read (uint8 ``[R]``, int32 ``[R, ceil(max_len / P)]``). The same row
indices serve every layer.
"""

from __future__ import annotations

import cupy
import numpy as np

from .. import _checks
from .._cache_rows import load_rows
from .._kernels.plan import array_rows, copy_rows
from ._budget import PROMOTING, RESIDENT, DeviceBudget

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
        self.promoting: dict[int, tuple[cupy.cuda.Event, int]] = {}  # rid -> (fill, tokens)
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
        state = self.budget.admit(rid, n, resident=resident)
        with stream:
            self.resident[rid] = 1 if state == RESIDENT else 0
            self.page_table[rid] = -1
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

    def grow(self, rid: int, n: int, stream) -> None:
        """Pages for a resident (or promoting) request's tokens up to ``n``, nothing where it
        has them; a resident request's table entries written on ``stream`` (a promoting one's
        whole row is written at its switch)."""
        if n > self.budget.tokens(rid) and self.budget.grow(rid, n) and self.is_resident(rid):
            with stream:
                self._write_pages(rid)

    def rows(self, rid: int, start: int, stop: int) -> np.ndarray:
        """Device rows of a resident request's tokens ``[start, stop)``."""
        return self.budget.rows(rid)[start:stop]

    def is_resident(self, rid: int) -> bool:
        return rid in self.budget and self.budget.state(rid) == RESIDENT

    def release(self, rid: int, stream) -> None:
        """``rid``'s pages and block back to the budget; its flag and table row cleared on
        ``stream`` (after a promotion's fill; the caller records the event later users of the
        rows wait for)."""
        self._drop_fill(rid, stream)
        self.budget.release(rid)
        with stream:
            self.resident[rid] = 0
            self.page_table[rid] = -1

    def demote(self, rid: int, n: int, tables, device, stream) -> None:
        """Resident -> sparse on ``stream``. The block's hot slots take the newest H tokens (the
        newest in slot H; positional while ``n <= H``): the same for every layer, and no record
        is needed on the resident path. They are copied from the pages device -> device in
        every layer, the tables are built, and the flag and table row are cleared. The caller
        records the event after which the pages may be written again."""
        if rid in self.budget and self.budget.state(rid) == PROMOTING:  # cancelled: the
            self._drop_fill(rid, stream)                                # fill's pages back
            self.budget.cancel_promotion(rid)
            return
        if not self.is_resident(rid):
            raise ValueError(f"request slot {rid} is not resident")
        n = _checks.integer("n_tokens", n, 1, self.budget.tokens(rid))
        H = tables.hot_size
        warm = np.arange(max(0, n - 1 - H), n - 1) if n > H else np.zeros(0, np.int64)
        lo = n - 1 - H if n > H else 0  # the kept tokens are lo .. n - 1
        pages = self.budget.rows(rid, lo, n)  # their rows, read before the pages go back
        block, _ = self.budget.demote(rid)  # raises PoolExhausted with nothing changed
        tables.place(rid, block, stream)
        tables.reset(rid, stream)
        slots, tokens = tables.fill_admitted(rid, n, warm, stream)
        tables.init_multistep(rid, stream)
        with stream:
            src = cupy.asarray(pages[tokens - lo].astype(np.int64).reshape(1, -1))
            dst = cupy.asarray(block[slots].astype(np.int32).reshape(1, -1))
            count = cupy.full(1, len(tokens), cupy.int32)
            self.resident[rid] = 0
            self.page_table[rid] = -1
        copy_rows(src, dst, count, src=array_rows(device), dst=array_rows(device),
                  row_bytes=device.shape[2], n_layers=device.shape[0], stream=stream)

    def promote(self, rid: int, n: int, pool, host_rows, device, stream) -> None:
        """Sparse -> promoting: pages for its tokens, its first ``n`` (written) tokens' host
        rows loaded into them on a side stream after the work queued on ``stream``;
        :meth:`switch` makes it resident once that fill has landed. The side stream writes
        the pages' rows only: the page table row is written at the switch, on the step's
        stream, so no growth meanwhile races with it."""
        if rid not in self.budget or self.budget.state(rid) != "sparse":
            raise ValueError(f"request slot {rid} is not sparse: only a sparse request is "
                             f"promoted")
        n = _checks.integer("n_tokens", n, 1, self.budget.tokens(rid))
        rows = self.budget.promote(rid)  # raises PoolExhausted, nothing taken
        if self._side is None:
            self._side = cupy.cuda.Stream(non_blocking=True)
        side = self._side
        side.wait_event(stream.record())
        load_rows(pool, host_rows(rid, 0, n), device, rows[:n], side)
        self.promoting[rid] = (side.record(), n)

    def switch(self, pool, host_rows, device, tables, stream) -> list[int]:
        """At a step boundary, on ``stream`` (no wait): every promoting request whose fill has
        landed gets the rows of the tokens written since it began (from the host copy the
        backups keep current), then its flag; its slot tables are emptied (no slot names a
        row of its block, which is its next owner's: a ``mirror_layer`` reads every slot) and
        its block returns to the budget (the caller records the release event). Returns those
        request slots."""
        done = [r for r, (ev, _) in self.promoting.items() if ev.done]
        for r in done:
            ev, n0 = self.promoting.pop(r)
            stream.wait_event(ev)
            n = self.budget.tokens(r)
            if n > n0:
                load_rows(pool, host_rows(r, n0, n), device, self.budget.rows(r)[n0:n], stream)
            with stream:  # the table written here only: a growth's entries are in it
                self._write_pages(r)
                self.resident[r] = 1
            tables.place(r, None, stream)
            tables.reset(r, stream)
            tables.init_multistep(r, stream)
            self.budget.finish_promotion(r)
        return done

    def _drop_fill(self, rid: int, stream) -> None:
        """A promotion's fill that will not be switched: ``stream`` waits for it, so the pages
        it writes return only after it."""
        got = self.promoting.pop(rid, None)
        if got is not None:
            stream.wait_event(got[0])

    def _write_pages(self, rid: int) -> None:
        """``rid``'s page table row from the budget (current stream)."""
        table = self.budget.page_table(rid, self.page_table.shape[1])
        self.page_table[rid] = cupy.asarray(table)
