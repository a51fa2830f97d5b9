"""Prediction mode's stager (``cu/predict.cu``): copy the rows the next full layer will probably
miss into staging rows, on a side stream of its own, while the model computes.

The guess: the tokens the full layer's swap just missed on that the next full layer's LRU slots
do not hold either (its token -> slot table says so); neighbouring layers select largely the same
tokens, so what is new to one is likely new to the next. The next full layer's copy reads every
staged miss from its staging row (device memory) instead of the host; what the guess missed
comes from the host as always. Misses, slots and bytes are exactly those without prediction (the
resolve decides them); a wrong guess costs bandwidth.

When it stages (``PREDICT_AT``): ``"swap"``, right after the full layer's swap, beside the
compute of its shared layers, where the group's replays also move rows and the copies take SMs
from the model's kernels; or ``"indexer"``, when the engine says that the next full layer's
indexer starts (``Prefetcher.before_indexer``): an indexer reads HBM and moves nothing over
PCIe, so the staging fills a window the link would idle through. Where the engine does not say
so, the staging launches at that layer's swap (correct, and no faster than no prediction).

:class:`Predictor` is used by the :class:`~hisparse_cupy.Prefetcher`; the hazards it closes
are numbered in ``docs/overlap_hazards.md``.
"""

from __future__ import annotations

import cupy

from .. import _abi
from .._kernels import build
from .._kernels.launch import Params, launch, ptr
from .._kernels.plan import array_rows, copy_struct, launch_copy
from .._kernels.rows import pool_rows

PREDICT_AT = ("swap", "indexer")


def stage_point(value) -> str:
    """``value`` checked as a staging point (``PREDICT_AT``)."""
    if value not in PREDICT_AT:
        raise ValueError(f"predict_at must be 'swap' or 'indexer', got {value!r}")
    return value


class Predictor:
    """Staging rows, the stager's launches and its counters for one cache.

    ``width`` rows staged per request at most; ``stream`` the stager's side stream; ``rule``
    what it stages (``_abi.PREDICT_RULES``: the full layer's misses, or its selection); the
    stager and its copy run on ``grid`` blocks (the replays' grid: no more SMs held beside
    the compute) with ``rows_per_warp`` rows in flight per warp.

    ``stats`` (uint64 ``[3]``, device): rows the predicted layers' swaps copied, rows of them
    read from staging rows, rows staged.
    """

    def __init__(self, cache, width: int, stream: cupy.cuda.Stream, rule: str = "misses"):
        c = self.cache = cache
        self.rule = _abi.PREDICT_RULES[rule]
        self.width = W = width
        self.stream = stream
        self.rows = cupy.empty((c.max_batch * W, c.row_bytes), cupy.uint8)
        self.src = cupy.full((c.max_batch, W), -1, cupy.int64)
        self.dst = cupy.arange(c.max_batch * W, dtype=cupy.int32).reshape(c.max_batch, W)
        self.count = cupy.zeros(c.max_batch, cupy.int32)
        self.map = cupy.full(c.pool.n_rows, -1, cupy.int32)
        self.topk = cupy.empty((c.max_batch, c.top_k), cupy.int32)  # the stager's own copy
        self.stats = cupy.zeros(3, cupy.uint64)
        # those fills ran on CuPy's current stream: the side stream waits for them, and every
        # other reader of these arrays waits for the side stream (``done``)
        stream.wait_event(cupy.cuda.get_current_stream().record())
        self.done = cupy.cuda.Event(disable_timing=True)
        self._stagers: dict = {}  # (batch, K, next layer) -> stager Params
        self._copies: dict = {}  # (batch, num_real, next layer) -> copy Params
        # the copy struct's fields that make a swap's copy read staged rows
        self.stage_fields = {
            "stage_map": ptr(self.map), "stage_src": ptr(self.src),
            "stage_count": ptr(self.count), "stage_base": ptr(self.rows),
            "stage_stats": ptr(self.stats), "stage_width": W}
        # pending staging: (full layer it made, the next full layer, batch) or None; what a
        # staging not launched yet needs (queue(defer=True)); the indexer's window (launch)
        self.pending: tuple[int, int, int] | None = None
        self._deferred: tuple | None = None
        self.window = cupy.cuda.Event(disable_timing=True)
        self.windows = 0  # stagings launched in an indexer's window (host count: a graph's once)

    def queue(self, step, made_by: int, nxt: int, topk: cupy.ndarray, fork: cupy.cuda.Event, *,
              grid: int, rows_per_warp: int, defer: bool = False) -> None:
        """Stage, after ``fork`` (recorded on the main stream after full layer ``made_by``'s
        swap), the rows full layer ``nxt`` will probably miss: now, or with ``defer`` at
        :meth:`launch` (the top-k is copied now either way)."""
        side = self.stream
        side.wait_event(fork)
        B, K = topk.shape
        snap = self.topk[:B, :K]
        with side:  # the stager's own copy of the top-k, off the main stream (hazard 11)
            snap[...] = topk
        self.pending = (made_by, nxt, B)
        self._deferred = (step, nxt, snap, grid, rows_per_warp)
        if not defer:
            self.launch(None, nxt)

    def launch(self, s: cupy.cuda.Stream | None, layer: int) -> None:
        """Launch the staging deferred for full layer ``layer``, after the work queued so far
        on main stream ``s`` (None: at once); nothing if none is deferred for it."""
        if self._deferred is None or self._deferred[1] != layer:
            return
        (step, nxt, snap, grid, rows_per_warp), self._deferred = self._deferred, None
        side = self.stream
        if s is not None:  # hazard 18: the indexer's window
            self.window.record(s)
            side.wait_event(self.window)
            self.windows += 1
        try:
            self._stage(step, nxt, snap, grid, rows_per_warp)
        finally:  # (a launch that raised: the top-k's copy is still joined)
            self.done.record(side)

    def _stage(self, step, nxt: int, snap: cupy.ndarray, grid: int, rows_per_warp: int) -> None:
        """The stager and its staging copy on the side stream."""
        c, side = self.cache, self.stream
        B, K = snap.shape
        nr = step.num_real
        hash_slots = _abi.hash_size(K, spread=2)  # <= K misses, or K tokens, per row
        prm = self._stagers.get((B, K, nxt))
        if prm is None:
            prm = self._stagers[(B, K, nxt)] = Params(_abi.PREDICT_STAGE).set(
                topk=ptr(snap), plan_src=ptr(c.plan.src), plan_count=ptr(c.plan.count),
                host_locs=ptr(c.host_locs), slot_tokens=ptr(c.tables.slot_tokens[nxt]),
                token_slot=ptr(c.tables.token_slot[nxt]), stage_map=ptr(self.map),
                stage_src=ptr(self.src), stage_count=ptr(self.count),
                stage_stats=ptr(self.stats), n_host_rows=c.pool.n_rows,
                topk_stride=snap.strides[0] // 4, K=K, B=B, R=c.max_requests,
                host_stride=c.max_len, slot_stride=c.slots, H=c.hot_size,
                stage_width=self.width, plan_stride=c.plan.width, miss_hash_size=hash_slots,
                rule=self.rule, resident=ptr(c.residency.fields().get("resident")))
        prm.set(req=ptr(step.req), lens=ptr(step.seq_lens), num_real=ptr(nr),
                lens_stride=step.lens_stride)  # the step's batch (any buffers)
        launch(build.kernel(build.PREDICT[step.dtypes]), min(B, grid), _abi.PREDICT_BLOCK,
               prm, shared_mem=_abi.smem_bytes("PREDICT_STAGE", MS=hash_slots), stream=side)
        ck = (B, ptr(nr), nxt)
        cp = self._copies.get(ck)
        if cp is None:
            cp = self._copies[ck] = copy_struct(
                self.src, self.dst, self.count, src=pool_rows(c.pool, nxt),
                dst=array_rows(self.rows), row_bytes=c.row_bytes, batch=B, num_real=nr)
        launch_copy(cp, grid=grid, stream=side, rows_per_warp=rows_per_warp)

    def take(self, s: cupy.cuda.Stream, *, layer=None, anchor=None, batch: int = 0,
             single_step: bool = False):
        """Join a pending staging into main stream ``s`` (hazard 10). Returns the copy struct's
        stage fields if it was made for full ``layer`` of this step (made by the last full layer
        swapped, ``anchor``, for the same batch) and the call is single-step; else None."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        made_by, nxt, B = pending
        use = nxt == layer and made_by == anchor and B == batch and single_step
        if use:
            self.launch(None, nxt)  # deferred and not launched yet: now, before the swap
        elif self._deferred is not None:  # dropped: only the top-k's copy ran
            self._deferred = None
            self.done.record(self.stream)
        s.wait_event(self.done)
        return self.stage_fields if use else None

    def summary(self) -> dict:
        """``stats`` on the host (synchronizes the device), with precision (used / staged) and
        recall (used / copied)."""
        rows, used, staged = (int(v) for v in cupy.asnumpy(self.stats))
        return {"rows": rows, "used": used, "staged": staged,
                "precision": used / staged if staged else float("nan"),
                "recall": used / rows if rows else float("nan")}
