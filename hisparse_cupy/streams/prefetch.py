"""IndexCache shared-layer IO overlap: replay the full layer's miss plan on a side stream.

Every layer of a request starts with the same slot layout (``HotBufferCache.slot_locs[layer]``
are equal after admission), so when the layers of a group receive the same copies into the same
device rows, the full layer's page table and miss plan are valid for each shared layer after it.
A multi-step call on the full layer rotates rows between its slots and scratch rows; its plan
records every unique miss with the row it landed in, so the shared layers, which keep using the
full layer's page table, still hold the same bytes at the same rows. Per decode step:

- **full layer** (main stream): the single- or multi-step swap-in of that layer, which records
  the miss plan. If the layer has a group, the side stream forks from the main stream right
  after the swap, replays the plan into each shared layer's device rows (one copy-only launch
  per shared layer, from that layer's host rows) and records one event per position in the
  group;
- **shared layer**: the main stream waits on the event of that layer's position and gets the
  full layer's page table back. No hashing, no LRU, no host synchronization.

With prefetch off (:meth:`Prefetcher.set_enabled`), every layer, shared ones included, runs
the full swap-in on the main stream with its full layer's top-k: the "no overlap" mode.

The hazards of the overlap and of prediction mode, and how each is closed, are numbered in
``docs/overlap_hazards.md`` in the source repository; the comments below cite them by number
("hazard 4").
"""

from __future__ import annotations

import cupy

from .. import _abi, _build, _checks
from .._launch import Params, as_stream, launch, ptr
from ..cache import HotBufferCache, _dense_view
from ..plan import ROWS_PER_WARP, copy_params, full_grid, launch_copy
from .partition import SMPartition
from .pattern import LayerPattern, layer_pattern

__all__ = ["DEFAULT_REPLAY_ROWS_PER_WARP", "PARTITION_REPLAY_ROWS_PER_WARP", "Prefetcher",
           "default_replay_grid"]

DEFAULT_REPLAY_ROWS_PER_WARP = 1
PARTITION_REPLAY_ROWS_PER_WARP = 8  # on a few SMs of their own, replays keep more rows in flight


def default_replay_grid() -> int:
    """Copy blocks of a side-stream replay: a quarter of the SMs' count, at least 8.

    8 warps per block, one row in flight per warp: enough host reads in flight for the link
    while leaving most SMs to the compute the replay overlaps. On the H200 (132 SMs, grid 33)
    this was the best of 8 .. 264 blocks measured (``benchmarks/NOTES.md``).
    """
    return max(8, full_grid() // 32)


class Prefetcher:
    """Drives a :class:`HotBufferCache` layer by layer with IndexCache shared-layer prefetch.

    Parameters
    ----------
    cache : HotBufferCache
        The cache whose layers are this (pipeline stage's) layers, in order.
    pattern : LayerPattern, str, tuple or list
        The **model's** full/shared pattern (anything :func:`layer_pattern` accepts).
    layer_range : (int, int), optional
        Model layers ``start .. end - 1`` held by this pipeline stage (default: all layers).
        :meth:`swap` takes model layer ids and converts them once, on entry; the stage's
        layer count must equal ``cache.n_layers``.
    enabled : bool
        Prefetch on (default) or off (every layer runs the full swap on the main stream).
    replay_grid : int, optional
        Copy blocks per side-stream replay (default :func:`default_replay_grid`; with a
        ``partition``, its ``side_sms``). When the model's matmuls leave N SMs idle (e.g.
        cuBLAS's SM-count target), a grid of N with 8 rows per warp keeps the replays on those
        SMs: measured at N = 8 on an H200, 69-71 % of the overhead hidden instead of 60 %
        (``benchmarks/NOTES.md``, "A matmul on fewer SMs").
    replay_rows_per_warp : int, optional
        Rows each warp of a replay keeps in flight (one of ``hisparse_cupy.plan.ROWS_PER_WARP``;
        default :data:`DEFAULT_REPLAY_ROWS_PER_WARP`, with a ``partition``
        :data:`PARTITION_REPLAY_ROWS_PER_WARP`).
    replay_thin : bool
        Replays in one-warp blocks with capped registers (``hisparse_cupy.plan.launch_copy``);
        give ``replay_grid`` a few blocks per SM. Measured worse than the default in the
        decode benchmark (``benchmarks/NOTES.md``).
    predict : bool
        Prediction mode (single-step swaps): while a full layer computes, stage the rows the
        next full layer will probably miss (see :meth:`set_predict`). Default off. Its stager
        runs on ``min(batch, replay_grid)`` blocks; beside matmuls on 124 of an H200's SMs with
        ``replay_grid=8, replay_rows_per_warp=8`` it measured 82-88 % of the overhead hidden at
        78 layers, batch 32-64, 5 % misses, and 89-95 % with the side streams on those 8 SMs
        only (``partition``), but cost at 20 % misses and gained little at batch 128, where
        those SMs are full (``benchmarks/NOTES.md``, "Prediction beside a matmul on 124 SMs",
        "Side streams on SMs of their own"). Needs the cache's token table
        (``token_table=True``, the default).
    predict_width : int, optional
        Rows staged per request at most (default ``top_k // 4``).
    copy_grid : int, optional
        Copy blocks of the full layers' own swap (default: enough to fill the GPU).
    side_priority : int or None
        Priority of the side stream (lower is higher); the default -1000 is clamped by CUDA to
        the device's highest priority, so pending replay blocks are scheduled before pending
        compute blocks (measured on the H200: within a few points of the default priority).
        A captured step keeps it only in a graph instantiated with
        ``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY`` (a default instantiation runs every
        node at the launch stream's priority). None: the default priority.
    partition : SMPartition, optional
        Put the side streams (replays, prediction) on the partition's side SMs only
        (:class:`hisparse_cupy.streams.SMPartition`, CUDA green contexts): they then never hold
        an SM the compute wants, if the caller queues the step on ``partition.stream("main")``
        and sizes its GEMMs to ``partition.main_sms`` (``benchmarks/NOTES.md``, "Side streams
        on SMs of their own"). The partition must outlive the Prefetcher (its
        :meth:`~SMPartition.close` destroys the side streams). Default: side streams on any SM.

    Attributes
    ----------
    pattern : LayerPattern
        The stage's pattern (local indices; ``pattern.first_layer`` = ``start``).
    side : cupy.cuda.Stream
        The non-blocking side stream.
    partition : SMPartition or None
    events : list of cupy.cuda.Event
        One per position in a group (``pattern.max_group_size``).
    dry_run : bool
        Measuring knob: replays do all their work but move no bytes (page tables of shared
        layers then point at stale rows).
    spin_cycles : int
        Testing knob: every replayed (and staged) row is delayed by this many clock cycles.
    predict_stats : cupy.ndarray or None
        Prediction mode's device counters (see :meth:`set_predict`); None until it is on.
    pside : cupy.cuda.Stream
        The prediction's side stream (once prediction mode was turned on).

    Notes
    -----
    The page table returned by :meth:`swap` is a view of a buffer the next full layer's swap
    (or, with prefetch off, the next swap) rewrites on the main stream: consume it on the main
    stream before that. The hazards and how they are closed: ``docs/overlap_hazards.md``.
    """

    def __init__(self, cache: HotBufferCache, pattern, *,
                 layer_range: tuple[int, int] | None = None, enabled: bool = True,
                 replay_grid: int | None = None, copy_grid: int | None = None,
                 side_priority: int | None = -1000,
                 replay_rows_per_warp: int | None = None,
                 replay_thin: bool = False, predict: bool = False,
                 predict_width: int | None = None, partition: SMPartition | None = None):
        if not isinstance(cache, HotBufferCache):
            raise TypeError(f"cache must be a HotBufferCache, got {type(cache).__name__}")
        model = layer_pattern(pattern)
        if layer_range is None:
            stage = model
        else:
            if not isinstance(layer_range, (tuple, list)) or len(layer_range) != 2:
                raise TypeError(f"layer_range must be (start, end), got {layer_range!r}")
            stage = model.stage(*layer_range)
        what = "the cache" if layer_range is None else (
            f"the cache (stage layers {stage.first_layer} .. "
            f"{stage.first_layer + stage.n_layers - 1} of the pattern's {model.n_layers})")
        stage.check_length(cache.n_layers, what)
        if partition is not None and not isinstance(partition, SMPartition):
            raise TypeError(f"partition must be an SMPartition, got {type(partition).__name__}")
        self.cache = cache
        self.pattern: LayerPattern = stage
        self.partition = partition
        if replay_grid is None:  # one block per SM of the side group, if there is one
            replay_grid = default_replay_grid() if partition is None else partition.side_sms
        self.replay_grid = _checks.integer("replay_grid", replay_grid, 1, 2**31 - 1)
        if replay_rows_per_warp is None:
            replay_rows_per_warp = (DEFAULT_REPLAY_ROWS_PER_WARP if partition is None
                                    else PARTITION_REPLAY_ROWS_PER_WARP)
        self.replay_rows_per_warp = replay_rows_per_warp
        self.replay_thin = bool(replay_thin)
        self.copy_grid = (None if copy_grid is None
                          else _checks.integer("copy_grid", copy_grid, 1, 2**31 - 1))
        self.dry_run = False
        self.spin_cycles = 0
        self._enabled = bool(enabled)
        self._side_priority = side_priority
        self.side = self._side_stream(side_priority)
        self._fork = cupy.cuda.Event(disable_timing=True)
        self.events = [cupy.cuda.Event(disable_timing=True)
                       for _ in range(stage.max_group_size)]
        self._out = cupy.empty((cache.max_batch, cache.top_k), cupy.int32)
        self._views: dict = {}  # (batch, top-k shape) -> view of _out / _ms_out
        self._replay: dict = {}  # (batch, num_real pointer, knobs) -> replay Params
        self._ms_out = None if cache.max_steps < 2 else cupy.empty(
            (cache.max_batch, cache.max_steps, cache.top_k), cupy.int32)
        # per layer: the replay's source and destination (validated once, here)
        self._host = [int(cache.pool.device_ptr(i)) for i in range(cache.n_layers)]
        self._dev = [cache.device[i].data.ptr for i in range(cache.n_layers)]
        fl = stage.full_layers
        self._next_full = dict(zip(fl[:-1], fl[1:], strict=True))  # full layer -> next one
        self.predict_width = (max(1, cache.top_k // 4) if predict_width is None else
                              _checks.integer("predict_width", predict_width, 1,
                                              cache.top_k))
        self._predict = False
        # pending prediction: (full layer it made, the next full layer, batch) or None
        self._pending: tuple[int, int, int] | None = None
        self.predict_stats = None
        self._reset_step()
        self.set_predict(predict)

    # ------------------------------------------------------------------ state
    def _side_stream(self, priority: int | None) -> cupy.cuda.Stream:
        """A non-blocking side stream (on the partition's side SMs, if one was given)."""
        if self.partition is not None:
            return self.partition.stream("side", priority=priority or 0)
        try:
            return cupy.cuda.Stream(non_blocking=True, priority=priority)
        except cupy.cuda.runtime.CUDARuntimeError:  # a priority the device refuses
            return cupy.cuda.Stream(non_blocking=True)

    def _reset_step(self) -> None:
        self._anchor: int | None = None  # local full layer last swapped in this step
        self._anchor_batch = 0
        self._anchor_topk = None
        self._anchor_out = None
        self._queued = 0  # replays queued for the current group
        self._joined = 0  # leading positions the main stream has waited on

    @property
    def replay_rows_per_warp(self) -> int:
        """Rows each warp of a replay keeps in flight (settable between steps)."""
        return self._rpw

    @replay_rows_per_warp.setter
    def replay_rows_per_warp(self, value) -> None:
        self._rpw = _checks.one_of("replay_rows_per_warp", value, ROWS_PER_WARP)

    @property
    def enabled(self) -> bool:
        """Whether shared layers are prefetched (False: full swap on every layer)."""
        return self._enabled

    def _main_stream(self, stream, explicit: bool | None = None):
        """The step's stream; while prefetch is on (or ``explicit``), never the legacy one."""
        s = as_stream(stream)
        if (self._enabled if explicit is None else explicit) and s.ptr == 0:
            raise ValueError(
                "the prefetcher needs an explicit main stream: the legacy default stream is not "
                "ordered with the non-blocking side stream and cannot be captured. Queue the "
                "step on cupy.cuda.Stream(non_blocking=True) (pass stream= or use `with s:`)")
        return s

    def _join(self, s: cupy.cuda.Stream) -> None:
        """Main stream waits for every replay of the current group not yet waited on."""
        if self._joined < self._queued:
            s.wait_event(self.events[self._queued - 1])
            self._joined = self._queued

    # ------------------------------------------------------------------ per layer
    def swap(self, layer: int, req_indices, seq_lens, top_k_tokens=None, *, num_real=None,
             stream=None) -> cupy.ndarray:
        """What the decode loop calls for every layer, in layer order, once per step.

        Equivalent to ``self.cache.begin_step(req_indices, seq_lens, num_real, stream=stream,
        prefetcher=self).swap(layer, top_k_tokens)``; with a step object, validate the batch
        once per step instead (:meth:`HotBufferCache.begin_step` with ``prefetcher=``).

        Parameters
        ----------
        layer : int
            **Model** layer id (converted to this stage's local index here, once).
        req_indices : int32 or int64 ``[B]``
            Batch row -> request slot (as for :meth:`HotBufferCache.swap`).
        seq_lens : int32 or int64 ``[B]`` (or ``[B, S]`` for multi-step calls)
        top_k_tokens : int32 ``[B, K]`` or ``[B, S, K]``
            Required for a full layer. A shared layer reuses its full layer's top-k; a value
            given for it is ignored (IndexCache semantics).
        num_real : int32 device scalar, optional
            Rows ``>= num_real`` are CUDA-graph padding (the full layer's value is used by its
            replays).
        stream : optional
            The main stream, any kind :meth:`HotBufferCache.begin_step` accepts (default: the
            current stream; must not be the legacy default stream while prefetch is on).

        Returns
        -------
        cupy.ndarray
            int32 ``[B, K]`` (or ``[B, S, K]``): device row of every entry in this layer's rows
            (``cache.device_rows(layer)``), -1 for unused or invalid entries. For a shared layer
            with prefetch on, its full layer's page table, safe to read on the main stream
            after this call.
        """
        step = self.cache.begin_step(req_indices, seq_lens, num_real, stream=stream)
        return self.swap_step(step, layer, top_k_tokens)

    def swap_step(self, step, layer: int, top_k_tokens=None, *,
                  check: bool = False) -> cupy.ndarray:
        """:meth:`swap` for a :class:`hisparse_cupy.cache.Step` (its batch already validated).

        A multi-step (``[B, S, K]``) full layer records the plan of its unique misses, which
        its shared layers replay the same way: the shared layers mirror the full layer's device
        rows byte for byte and use its page table. ``check`` (synchronizes): as for
        :meth:`Step.swap`, for the swap this call runs; a shared layer with prefetch on runs
        none, and raises on its full layer's status.
        """
        loc = self.pattern.local_index(layer)
        s = self._main_stream(step.stream)
        full = self.pattern.full[loc]
        if full:
            if top_k_tokens is None:
                raise ValueError(f"layer {layer} is a full layer: it needs top_k_tokens")
        else:
            anchor = self.pattern.anchor(loc)
            if self._anchor != anchor:
                raise RuntimeError(
                    f"shared layer {layer} reuses full layer {anchor + self.pattern.first_layer}"
                    f", which has not been swapped in this step: call the layers in order, "
                    f"each step starting at a full layer")
            if step.batch != self._anchor_batch:
                raise ValueError(f"shared layer {layer} has batch {step.batch}, its full layer "
                                 f"had {self._anchor_batch}")
            if self._enabled:
                p = self.pattern.position(loc)
                self._wait_position(p, s)
                if check:  # no swap ran since the full layer's: the status is still its
                    step.raise_on_status(self._anchor_topk)
                return self._anchor_out
            top_k_tokens = self._anchor_topk

        # a swap: full layer, or any layer with prefetch off
        if check:
            step.check_requests()
        self._join(s)  # hazard 4: the swap below rewrites the plan
        stage = None
        if full:
            stage = self._take_stage(loc, top_k_tokens, s, step.batch)
            self._reset_step()
        B = step.batch
        shape = getattr(top_k_tokens, "shape", ())
        out = self._views.get((B, shape))  # this object's output buffer, sliced once per shape
        if out is None:
            if len(shape) == 3 and self._ms_out is not None:
                out = _dense_view(self._ms_out, (B, shape[1], shape[2]))
            elif len(shape) >= 2:
                out = self._out[:B, : shape[-1]]
            if out is not None:
                self._views[(B, shape)] = out
        # the swap checks top_k_tokens against the batch and the cache: a shape it refuses
        # leaves no view used
        out = step._swap(loc, top_k_tokens, out=out, copy_grid=self.copy_grid,
                         out_checked=out is not None, stage=stage)
        if full:
            self._anchor = loc
            self._anchor_batch = B
            self._anchor_topk = top_k_tokens
            self._anchor_out = out
            group = self.pattern.groups[loc] if self._enabled else ()
            nxt = (self._next_full.get(loc) if self._enabled and self._predict and len(shape) == 2
                   and not self.dry_run else None)
            if nxt is not None:  # (checked by the swap; a foreign array imported on s)
                with s:
                    topk = _checks.token_rows("top_k_tokens", top_k_tokens, step._dev)
            if group or nxt is not None:
                self._fork.record(s)  # hazards 2, 3 and 10: after the full layer's swap
            if group:
                self._queue_replays(group, B, step.num_real)
            if nxt is not None:
                self._queue_predict(step, loc, nxt, topk)
        if check:  # after the bookkeeping: the step goes on after a caught error
            step.raise_on_status(top_k_tokens)
        return out

    # ------------------------------------------------------------------ prediction
    def set_predict(self, on: bool, stream=None) -> None:
        """Prediction mode on or off (between steps; queued on ``stream``, no host sync).

        On (with prefetch on; single-step swaps): after each full layer's swap a side stream
        guesses the rows the next full layer of the stage will miss (the tokens this layer's
        swap just missed on that the next layer's LRU slots do not hold either; neighbouring
        layers select largely the same tokens, so what is new to one is likely new to the
        next), copies those host rows of the next layer into staging rows, and
        records an event. The next full layer's swap waits on it and reads every miss that
        was staged from its staging row (device memory) instead of the host; what the guess
        missed comes from the host as always. Misses, slots and bytes are exactly those
        without prediction (the swap's resolve decides them); a wrong guess costs bandwidth.
        ``predict_stats`` (uint64 ``[3]``, device): rows the predicted layers' swaps copied,
        rows of them read from staging rows, rows staged; :meth:`predict_summary` reads them.
        The guess reads the next layer's token -> slot table: the cache needs one
        (``HotBufferCache(token_table=True)``, the default).
        """
        on = bool(on)
        if on and self.cache.token_slot is None:
            raise ValueError("prediction needs the cache's token -> slot table: build the "
                             "HotBufferCache with token_table=True (the default)")
        if on and self.predict_stats is None:
            c, W = self.cache, self.predict_width
            self._stage_rows = cupy.empty((c.max_batch * W, c.row_bytes), cupy.uint8)
            self._stage_src = cupy.full((c.max_batch, W), -1, cupy.int64)
            self._stage_dst = cupy.arange(c.max_batch * W, dtype=cupy.int32).reshape(
                c.max_batch, W)
            self._stage_count = cupy.zeros(c.max_batch, cupy.int32)
            self._stage_map = cupy.full(c.pool.n_rows, -1, cupy.int32)
            self._ptopk = cupy.empty((c.max_batch, c.top_k), cupy.int32)
            self.predict_stats = cupy.zeros(3, cupy.uint64)
            self._pstage: dict = {}  # (batch, K, next layer) -> stager Params
            self._pcopy: dict = {}  # (batch, num_real, next layer, knobs) -> copy Params
            self._stage_fields = {
                "stage_map": ptr(self._stage_map), "stage_src": ptr(self._stage_src),
                "stage_count": ptr(self._stage_count), "stage_base": ptr(self._stage_rows),
                "stage_stats": ptr(self.predict_stats), "stage_width": W}
            self.pside = self._side_stream(self._side_priority)
            self._pdone = cupy.cuda.Event(disable_timing=True)
        if self._pending is not None:
            self._take_stage(None, None, self._main_stream(stream))
        self._predict = on

    @property
    def predict(self) -> bool:
        """Whether prediction mode is on (:meth:`set_predict`)."""
        return self._predict

    def predict_summary(self) -> dict:
        """``predict_stats`` on the host (synchronizes the device): rows copied by predicted
        swaps, rows read from staging rows, rows staged, and precision (used / staged) and
        recall (used / copied)."""
        if self.predict_stats is None:
            raise RuntimeError("prediction was never turned on (set_predict(True))")
        rows, used, staged = (int(v) for v in cupy.asnumpy(self.predict_stats))
        return {"rows": rows, "used": used, "staged": staged,
                "precision": used / staged if staged else float("nan"),
                "recall": used / rows if rows else float("nan")}

    def _take_stage(self, loc, top_k_tokens, s: cupy.cuda.Stream, batch: int = 0):
        """Join a pending prediction into the main stream (hazard 10); its stage fields if it
        was made for full layer ``loc`` of this step (the last full layer swapped made it, and
        the batch is the same) and this is a single-step call, else None."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        s.wait_event(self._pdone)
        made_by, nxt, B = pending
        if (nxt != loc or made_by != self._anchor or B != batch
                or len(getattr(top_k_tokens, "shape", ())) != 2):
            return None
        return self._stage_fields

    def _queue_predict(self, step, made_by: int, nxt: int, topk: cupy.ndarray) -> None:
        c, side = self.cache, self.pside
        side.wait_event(self._fork)
        B, K = topk.shape
        snap = self._ptopk[:B, :K]
        with side:  # the stager's own copy of the top-k, off the main stream (hazard 11)
            snap[...] = topk
        nr = step.num_real
        ms = _abi.hash_size(K, spread=2)  # a single-step plan row holds at most K misses
        key = (B, K, nxt)
        prm = self._pstage.get(key)
        if prm is None:
            prm = self._pstage[key] = Params(_abi.PREDICT_STAGE).set(
                topk=ptr(snap), plan_src=ptr(c.plan.src), plan_count=ptr(c.plan.count),
                host_locs=ptr(c.host_locs), slot_tokens=ptr(c.slot_tokens[nxt]),
                token_slot=ptr(c.token_slot[nxt]),
                stage_map=ptr(self._stage_map), stage_src=ptr(self._stage_src),
                stage_count=ptr(self._stage_count), stage_stats=ptr(self.predict_stats),
                n_host_rows=c.pool.n_rows, topk_stride=snap.strides[0] // 4, K=K, B=B,
                R=c.max_requests, host_stride=c.max_len, slot_stride=c.slots, H=c.hot_size,
                stage_width=self.predict_width, plan_stride=c.plan.width, miss_hash_size=ms)
        prm.set(req=ptr(step.req), lens=ptr(step.seq_lens), num_real=ptr(nr),
                lens_stride=step._lens_stride)  # the step's batch (any buffers)
        # as many blocks as the replays (no more SMs held beside the compute), each taking
        # requests in turn
        grid = min(B, self.replay_grid)
        launch(_build.kernel(_build.PREDICT[step._key]), grid, _abi.PREDICT_BLOCK, prm,
               shared_mem=_abi.smem_bytes("PREDICT_STAGE", MS=ms), stream=side)
        ckey = (B, ptr(nr), nxt, self.dry_run, int(self.spin_cycles))
        cp = self._pcopy.get(ckey)
        if cp is None:
            cp = self._pcopy[ckey] = copy_params(
                self._stage_src, self._stage_dst, self._stage_count, B, nr,
                src_base=self._host[nxt], src_layer_bytes=0, n_src_rows=c.pool.n_rows,
                dst_base=self._stage_rows.data.ptr, dst_layer_bytes=0,
                n_dst_rows=self._stage_rows.shape[0], row_bytes=c.row_bytes,
                dry_run=self.dry_run, spin_cycles=int(self.spin_cycles))
        launch_copy(cp, grid=self.replay_grid, stream=side,
                    rows_per_warp=self.replay_rows_per_warp, thin=self.replay_thin)
        self._pdone.record(side)
        self._pending = (made_by, nxt, B)

    def _queue_replays(self, group, batch: int, num_real) -> None:
        c = self.cache
        plan = c.plan
        self.side.wait_event(self._fork)
        key = (batch, 0 if num_real is None else num_real.data.ptr, self.dry_run,
               int(self.spin_cycles))
        prm = self._replay.get(key)
        if prm is None:
            prm = self._replay[key] = copy_params(
                plan.src, plan.dst, plan.count, batch, num_real, src_base=0, src_layer_bytes=0,
                n_src_rows=c.pool.n_rows, dst_base=0, dst_layer_bytes=0,
                n_dst_rows=c.device.shape[1], row_bytes=c.row_bytes, dry_run=self.dry_run,
                spin_cycles=int(self.spin_cycles))
        for p, sl in enumerate(group):
            prm.set(src_base=self._host[sl], dst_base=self._dev[sl])
            launch_copy(prm, grid=self.replay_grid, stream=self.side,
                        rows_per_warp=self.replay_rows_per_warp, thin=self.replay_thin)
            self.events[p].record(self.side)
        self._queued = len(group)
        self._joined = 0

    def _wait_position(self, p: int, s: cupy.cuda.Stream) -> None:
        """Main stream waits for the replay at group position ``p`` (hazard 1)."""
        s.wait_event(self.events[p])
        self._joined = max(self._joined, p + 1)

    def finish(self, stream=None) -> None:
        """End a decode step: join any replay no shared layer waited on (and a prediction no
        full layer used) into the main stream.

        Costs nothing when every layer was called. With prediction on, a step that does not
        call every layer of the stage must end with it: rows staged in one step are never
        used in the next (host rows may change between steps). Call it at the end of a
        captured step (every side branch must rejoin before ``end_capture``) and before
        changing ``num_real`` or the plan's inputs from outside the step.
        """
        s = self._main_stream(stream)
        self._join(s)
        self._take_stage(None, None, s)
        self._reset_step()

    def set_enabled(self, enabled: bool, stream=None) -> None:
        """Turn prefetch on or off between steps (queued on ``stream``, which must not be the
        legacy default stream; no host sync).

        Turning it off copies every full layer's tables (``slot_tokens``, ``slot_locs``,
        ``lru``, ``token_slot`` and any multi-step state) into its shared layers (their own
        tables went stale while prefetch was on; hazard 8). Turning it on makes every shared
        layer mirror its full layer, device rows included
        (:meth:`HotBufferCache.mirror_layer`): while prefetch was off each layer ran its own
        swaps, and multi-step swaps leave layers in different slot -> row layouts.
        """
        enabled = bool(enabled)
        if enabled == self._enabled:
            return
        s = self._main_stream(stream, explicit=True)  # either way, the mode on is involved
        self._join(s)
        self._take_stage(None, None, s)
        self._reset_step()
        # off: the shared layers' tables went stale while prefetch was on, their rows did not;
        # on: each layer ran its own swaps, and multi-step swaps leave layers in different
        # layouts (the page table a shared layer gets must be valid for its rows)
        for a, group in self.pattern.groups.items():
            for sl in group:
                self.cache.mirror_layer(a, sl, rows=enabled, stream=s)
        self._enabled = enabled

    def synchronize(self) -> None:
        """Block the host until the side streams are idle (e.g. before freeing the cache)."""
        self.side.synchronize()
        if self.predict_stats is not None:
            self.pside.synchronize()
