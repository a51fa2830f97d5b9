"""Every per-layer table of a :class:`~hisparse_cupy.HotBufferCache`'s request slots, in one
owner: allocated, named, reset per request slot, and copied (mirrored) from layer to layer.

For ``L`` layers, ``R`` request slots of ``W = H + P`` slots and ``C`` scratch rows each:

- ``slot_tokens`` int32 ``[L, R, W]``: the token each slot holds (-1: none);
- ``slot_locs`` int32 ``[L, R, W]``: each slot's device row (request slot ``r`` owns rows
  ``r * (W + C) + [0, W + C)``; multi-step swaps rotate them with the scratch rows);
- ``lru`` int16 ``[L, R, H]``: the hot slots, least recently used first;
- ``token_slot`` int16 ``[L, R, max_len]`` (``token_table=True``): token -> hot slot;
- multi-step state (``max_steps >= 2``): ``scratch_locs`` int32 ``[L, R, C]``, reference epochs
  ``ms_ref`` uint32 ``[L, R, H]`` and the clock ``ms_clock`` uint32 ``[L, R, 2]``.

The cache's token -> host row map (``host_locs``) is shared by all layers and lives with the
host pool's map (:class:`~hisparse_cupy._cache_rows.CacheRows`).
"""

from __future__ import annotations

import functools

import cupy
import numpy as np

from ._kernels.multistep import MultiStepConfig, init_states
from ._kernels.plan import array_rows, copy_rows
from ._kernels.rows import pool_rows


def rows_needed(*, max_requests: int, hot_size: int = 4096, top_k: int = 2048,
                extra_page: int = 64, max_steps: int = 1, scratch: int | None = None) -> int:
    """Device rows per layer a cache of these sizes uses (for ``device_rows=``):
    ``max_requests * (hot_size + extra_page + scratch rows)`` (``HotBufferCache.rows_needed``;
    with a device budget, the budget's rows)."""
    C = 0
    if max_steps >= 2:
        C = MultiStepConfig(max_requests, hot_size, extra_page, top_k, max_steps=max_steps,
                            scratch=scratch).scratch
    return max_requests * (hot_size + extra_page + C)


@functools.cache
def _drop_tokens() -> cupy.ElementwiseKernel:
    """One launch over a request slot's ``[L, H]`` hot slots (a strided view, read and written
    in place): a slot ``p`` holding a token in ``[start, stop)`` other than ``p`` is emptied
    (:meth:`LayerTables.drop_tokens`; the CuPy expression it replaces took nine launches)."""
    return cupy.ElementwiseKernel(
        "int32 start, int32 stop, int32 H", "int32 t",
        "if (t >= start && t < stop && t != (int)(i % H)) t = -1;", "hs_drop_tokens")


class LayerTables:
    """The tables above, filled on CuPy's current stream (see the module docstring)."""

    def __init__(self, *, n_layers: int, max_requests: int, hot_size: int, extra_page: int,
                 scratch: int, max_len: int, token_table: bool, multistep: bool,
                 placed: bool = False):
        """``placed``: the request slots' rows are placed at admission (:meth:`place`, a
        device budget's blocks); until then every slot's row is -1. Else request slot ``r``
        owns rows ``r * (W + C) + [0, W + C)``."""
        L, R, H, W, C = n_layers, max_requests, hot_size, hot_size + extra_page, scratch
        self.hot_size, self.max_len, self.slots, self.placed = H, max_len, W, placed
        base = (np.arange(R, dtype=np.int64) * (W + C)).reshape(R, 1)
        self.slot_layout = cupy.asarray((base + np.arange(W)).astype(np.int32))  # [R, W]
        if placed:
            self.slot_layout[...] = -1
        self.slot_locs = cupy.empty((L, R, W), cupy.int32)
        self.slot_locs[...] = self.slot_layout
        self.slot_tokens = cupy.full((L, R, W), -1, cupy.int32)
        self.lru = cupy.empty((L, R, H), cupy.int16)
        self.lru[...] = cupy.arange(H, dtype=cupy.int16)
        self.token_slot = cupy.full((L, R, max_len), -1, cupy.int16) if token_table else None
        self.scratch_layout = self.scratch_locs = self.ms_ref = self.ms_clock = None
        if multistep:
            self.scratch_layout = cupy.asarray((base + W + np.arange(C)).astype(np.int32))
            if placed:
                self.scratch_layout[...] = -1
            self.scratch_locs = cupy.empty((L, R, C), cupy.int32)
            self.scratch_locs[...] = self.scratch_layout
            self.ms_ref = cupy.zeros((L, R, H), cupy.uint32)
            self.ms_clock = cupy.zeros((L, R, 2), cupy.uint32)
            self.ms_clock[..., 0] = 1

    @property
    def multistep(self) -> bool:
        return self.ms_ref is not None

    def named(self) -> dict[str, cupy.ndarray]:
        """Every table, ``name -> [n_layers, ...]`` array: a layer's whole state beside its
        device rows."""
        t = {"slot_tokens": self.slot_tokens, "slot_locs": self.slot_locs, "lru": self.lru}
        if self.token_slot is not None:
            t["token_slot"] = self.token_slot
        if self.multistep:
            t.update(scratch_locs=self.scratch_locs, ms_ref=self.ms_ref, ms_clock=self.ms_clock)
        return t

    def place(self, rid: int, rows, stream) -> None:
        """Request slot ``rid``'s rows (a device budget's block: its ``W`` slot rows, then its
        scratch rows), or None (a resident request: no slot rows, -1), written on ``stream``;
        :meth:`reset` then puts them in its tables. Nothing without ``placed``."""
        if not self.placed:
            return
        with stream:
            if rows is None:
                self.slot_layout[rid] = -1
                if self.scratch_layout is not None:
                    self.scratch_layout[rid] = -1
                return
            rows = cupy.asarray(np.asarray(rows, np.int32))
            self.slot_layout[rid] = rows[: self.slots]
            if self.scratch_layout is not None:
                self.scratch_layout[rid] = rows[self.slots: self.slots +
                                                self.scratch_layout.shape[1]]

    def fill_admitted(self, rid: int, n: int, warm: np.ndarray, stream):
        """The slot tables of a request admitted with ``n`` tokens (after :meth:`reset`):
        positional while ``n <= H`` (slot p holds token p), else the ``warm`` tokens in slots
        ``0..w-1`` (least recent last) and the newest in slot H. Returns ``(slots, tokens)``:
        the slots whose rows the admission loads, and their tokens."""
        H = self.hot_size
        with stream:
            if n <= H:
                self.slot_tokens[:, rid, :H] = cupy.arange(H, dtype=cupy.int32)
                return np.arange(n), np.arange(n)
            w = warm.size
            self.slot_tokens[:, rid, :w] = cupy.asarray(warm, dtype=cupy.int32)
            self.slot_tokens[:, rid, H] = n - 1
            order = np.concatenate([np.arange(w, H), np.arange(w)]).astype(np.int16)
            self.lru[:, rid] = cupy.asarray(order)
        return np.concatenate([np.arange(w), [H]]), np.concatenate([warm, [n - 1]])

    def drop_tokens(self, rid: int, start: int, stop: int, stream) -> None:
        """Request slot ``rid``'s hot slots (``0 .. H-1``) holding tokens ``[start, stop)``
        emptied in every layer, on ``stream``: their KV was rewritten (an MTP draft rejected,
        its position given a new token), so the rows those slots hold are stale. The next swap
        that selects such a token misses and loads its new row. The token -> slot entries need
        no change (never trusted without the slot table); an emptied slot is an LRU or CLOCK
        victim like any empty one. Left as they are: slot ``p`` holding token ``p`` (below H:
        the positional layout reads token p in slot p's row, which the engine writes with the
        new KV, as it writes every token a request below H holds), and the extra page (slot
        H: the newest token, which the model writes in place each step)."""
        with stream:
            _drop_tokens()(start, stop, self.hot_size, self.slot_tokens[:, rid, : self.hot_size])

    def reset(self, rid: int, stream) -> None:
        """Request slot ``rid``'s tables back to empty on ``stream`` (token -> slot entries,
        never trusted without the slot table, stay); :meth:`init_multistep` after the slots
        are filled."""
        with stream:
            self.slot_tokens[:, rid] = -1
            self.lru[:, rid] = cupy.arange(self.hot_size, dtype=cupy.int16)
            self.slot_locs[:, rid] = self.slot_layout[rid]  # undo multi-step rotations
            if self.multistep:
                self.scratch_locs[:, rid] = self.scratch_layout[rid]

    def init_multistep(self, rid: int, stream) -> None:
        """The multi-step state of ``rid`` (reference epochs, clock, token -> slot entries)
        made to agree with its slots, on ``stream`` (nothing without multi-step state)."""
        if self.multistep:
            with stream:  # the kernel on ``stream`` reads it: made there, not on CuPy's current
                rows = cupy.full(1, rid, cupy.int32)
            init_states(rows, None, self.slot_tokens, self.token_slot, self.ms_ref,
                        self.ms_clock, hot_size=self.hot_size, stream=stream)

    def mirror(self, src: int, dst: int, *, rows, host_locs, pool, stream) -> None:
        """Layer ``dst`` takes layer ``src``'s state on ``stream``: with ``rows`` (``dst``'s
        device rows, uint8 ``[D, row_bytes]``) first rearranged into ``src``'s layout
        (:meth:`_rearrange`), then every table of :meth:`named` copied."""
        with stream:
            if rows is not None and src != dst:
                self._rearrange(src, dst, rows, host_locs, pool, stream)
            for t in self.named().values():
                t[dst][...] = t[src]

    def _rearrange(self, src: int, dst: int, dev, host_locs, pool, s) -> None:
        """The row where ``src`` holds token t gets ``dst``'s own bytes of t, from the row where
        ``dst`` held it (its first such slot) or else from ``dst``'s host row: one layer's rows
        of scratch memory, no host synchronization, on ``s``."""
        with s:
            R, W = self.slot_tokens.shape[1:]
            n = self.max_len
            span = max(n, W) + 1  # above every token a slot can name (positional ones < H)
            base = cupy.arange(R, dtype=cupy.int64).reshape(R, 1) * span
            tok_s, loc_s = self.slot_tokens[src], self.slot_locs[src]
            tok_d, loc_d = self.slot_tokens[dst], self.slot_locs[dst]
            # where dst holds each (request, token): its keys sorted, src's keys searched
            key_d = cupy.where(tok_d >= 0, base + tok_d, -1).reshape(-1)
            order = cupy.argsort(key_d)  # stable: a token held twice matches its first slot
            key_s = (base + tok_s).reshape(-1)
            at = cupy.minimum(cupy.searchsorted(key_d[order], key_s), key_s.size - 1)
            wanted = tok_s.reshape(-1) >= 0
            held = wanted & (key_d[order[at]] == key_s)
            # gathered first, then scattered; slots without a row (-1: a request slot not
            # admitted, or resident) are skipped (the copy skips -1 sources)
            to = loc_s.reshape(-1)
            moved = dev[cupy.where(held, loc_d.reshape(-1)[order[at]], cupy.maximum(to, 0))]
            pick = cupy.where(to >= 0, cupy.arange(to.size, dtype=cupy.int64), -1)
            count = cupy.full(R, W, cupy.int32)
            copy_rows(pick.reshape(R, W), loc_s, count, src=array_rows(moved),
                      dst=array_rows(dev), row_bytes=dev.shape[1], stream=s)
            # the tokens dst did not hold: its host rows
            tok = cupy.clip(tok_s, 0, n - 1)
            hl = host_locs[cupy.arange(R).reshape(R, 1), tok]
            hl = cupy.where((wanted & ~held).reshape(R, W) & (tok_s < n), hl, -1)
            copy_rows(hl, loc_s, count, src=pool_rows(pool, dst),
                      dst=array_rows(dev), row_bytes=pool.row_bytes, stream=s)
