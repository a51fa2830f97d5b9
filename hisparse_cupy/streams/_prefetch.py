"""IndexCache shared-layer IO overlap: replay the full layer's miss plan on a side stream.

Every layer of a request starts with the same slot layout
(``HotBufferCache.tables.slot_locs[layer]``
are equal after admission), so when the layers of a group receive the same copies into the same
device rows, the full layer's page table and miss plan are valid for each shared layer after it.
A multi-step call on the full layer rotates rows between its slots and scratch rows; its plan
records every unique miss with the row it landed in, so the shared layers, which keep using the
full layer's page table, still hold the same bytes at the same rows. Per decode step:

- **full layer** (main stream): the single- or multi-step swap-in of that layer, which records
  the miss plan. If the layer has a group, the side stream forks from the main stream right
  after the swap, replays the plan into each shared layer's device rows (one copy-only launch
  per shared layer, from that layer's host rows) and records one event per position in the
  group; at a batch of at most ``group_replay_batch`` rows, one launch replays the whole group
  (its layers follow each other in the pool and on the device) and records one event;
- **shared layer**: the main stream waits on the event of that layer's position (a whole-group
  replay: the first shared layer waits on its one event, the others on nothing) and gets the
  full layer's page table back. No hashing, no LRU, no host synchronization.

In a lean step (``HotBufferCache.begin_step(lean=)``: every request resident) a single-step full
layer forks nothing: each shared layer gets its page table back at once, prefetch on or off,
since a resident request's rows are the same in every layer.

With prefetch off (:meth:`Prefetcher.set_enabled`), every layer, shared ones included, runs
the full swap-in on the main stream with its full layer's top-k: the "no overlap" mode.

The hazards of the overlap and of prediction mode, and how each is closed, are numbered in
``docs/overlap_hazards.md`` in the source repository; the comments below cite them by number
("hazard 4").
"""

from __future__ import annotations

import cupy

from .. import _checks
from .._checks import ArrayLike, StreamLike
from .._kernels.launch import as_stream, sm_count
from .._kernels.multistep import dense_view
from .._kernels.plan import ROWS_PER_WARP, Rows, copy_struct, launch_copy
from ..cache import HotBufferCache
from ..step import LayerCall
from ._partition import SMPartition
from ._pattern import LayerPattern, layer_pattern
from ._predict import Predictor, stage_point

__all__ = ["DEFAULT_GROUP_REPLAY_BATCH", "DEFAULT_REPLAY_ROWS_PER_WARP",
           "PARTITION_REPLAY_ROWS_PER_WARP", "Prefetcher", "default_replay_grid"]

DEFAULT_GROUP_REPLAY_BATCH = 2  # batches up to this replay a group in one launch, one wait
DEFAULT_REPLAY_ROWS_PER_WARP = 4
PARTITION_REPLAY_ROWS_PER_WARP = 8  # on a few SMs of their own, replays keep more rows in flight


def default_replay_grid() -> int:
    """Copy blocks of a side-stream replay (and of the prediction stager): an eighth of the SMs'
    count, at least 8.

    8 warps per block, :data:`DEFAULT_REPLAY_ROWS_PER_WARP` rows in flight per warp: 512 host
    reads in flight on an H200 (132 SMs, grid 16), enough for the link, from blocks on 16 SMs
    at most, so the compute the replays run beside keeps the others. On the decode loop's
    published-shape streams this shape hid 64-71 % of the offload overhead at batch 8-64 where
    33 blocks of one row hid 61-71 %, and lifted prediction by 8-10 points at batch 8 and 32
    (``benchmarks/NOTES.md``, "The side streams' copy shape on published-shape streams").
    """
    return max(8, sm_count() // 8)


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
        ``step.swap`` takes model layer ids and converts them once, on entry; the stage's
        layer count must equal ``cache.n_layers``.
    enabled : bool
        Prefetch on (default) or off (every layer runs the full swap on the main stream).
    replay_grid : int, optional
        Copy blocks per side-stream replay (default :func:`default_replay_grid`; with a
        ``partition``, its ``side_sms``). When the model's matmuls leave N SMs idle, a grid of N
        with 8 rows per warp keeps the replays on those SMs (``benchmarks/NOTES.md``, "A
        matmul on fewer SMs").
    replay_rows_per_warp : int, optional
        Rows each warp of a replay keeps in flight (one of
        ``hisparse_cupy._kernels.plan.ROWS_PER_WARP``;
        default :data:`DEFAULT_REPLAY_ROWS_PER_WARP`, with a ``partition``
        :data:`PARTITION_REPLAY_ROWS_PER_WARP`).
    predict : bool
        Prediction mode (single-step swaps; :meth:`set_predict`): stage the rows the next full
        layer will probably miss. Default off. Its stager runs on ``min(batch, replay_grid)``
        blocks (H200 figures beside matmuls, with and without a ``partition``:
        ``benchmarks/NOTES.md``, "Prediction beside a matmul on 124 SMs").
    predict_width : int, optional
        Rows staged per request at most (default ``top_k // 4``).
    predict_rule : "selection" or "misses"
        What the stager stages of a full layer's top-k that the next full layer does not hold:
        all it selected (the default), or only the tokens it missed (``cu/predict.cu``). On the
        decode loop's streams selection staged at recall 0.68 against 0.43 at the same
        precision and hid more of the overhead at batch 1-32 (``benchmarks/NOTES.md``).
    predict_at : "swap" or "indexer"
        When prediction stages: right after the full layer's swap (the default), or when the
        engine calls :meth:`before_indexer` for the next full layer (``Step.before_indexer``),
        in the window of its indexer, which moves nothing over PCIe (see :meth:`set_predict`).
    group_replay_batch : int, optional
        Steps of at most this many batch rows replay a group's shared layers in one launch
        and the main stream waits once, at the group's first shared layer (default
        :data:`DEFAULT_GROUP_REPLAY_BATCH`); larger steps replay layer by layer, each shared
        layer waiting only for its own rows (``benchmarks/NOTES.md``, "One wait per group at
        small batch"). 0: layer by layer at every batch.
    copy_grid : int, optional
        Copy blocks of the full layers' own swap (default: enough to fill the GPU).
    side_priority : int or None
        Priority of the side stream (lower is higher); the default -1000 is clamped by CUDA to
        the device's highest priority, so pending replay blocks are scheduled before pending
        compute blocks. A captured step keeps it only in a graph instantiated with
        ``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY``. None: the default priority.
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
    predict_stats : cupy.ndarray or None
        Prediction mode's device counters (see :meth:`set_predict`); None until it is on.
    predict_side : cupy.cuda.Stream or None
        The prediction's side stream (once prediction mode was turned on).

    Notes
    -----
    A step driven by the Prefetcher (``cache.begin_step(..., prefetcher=pf)``) calls its hooks
    :meth:`before_layer` and :meth:`after_swap` for each layer (``hisparse_cupy/step.py``).
    The page table a shared layer's ``step.swap`` returns is a view of a buffer the next full
    layer's swap (or, with prefetch off, the next swap) rewrites on the main stream: consume it
    on the main stream before that. The hazards and how they are closed:
    ``docs/overlap_hazards.md``.
    """

    def __init__(self, cache: HotBufferCache, pattern, *,
                 layer_range: tuple[int, int] | None = None, enabled: bool = True,
                 replay_grid: int | None = None, copy_grid: int | None = None,
                 side_priority: int | None = -1000,
                 replay_rows_per_warp: int | None = None, predict: bool = False,
                 predict_width: int | None = None, partition: SMPartition | None = None,
                 predict_rule: str = "selection", group_replay_batch: int | None = None,
                 predict_at: str = "swap"):
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
        self.group_replay_batch = _checks.integer(
            "group_replay_batch", DEFAULT_GROUP_REPLAY_BATCH if group_replay_batch is None
            else group_replay_batch, 0, 2**31 - 1)
        self.copy_grid = (None if copy_grid is None
                          else _checks.integer("copy_grid", copy_grid, 1, 2**31 - 1))
        self._enabled = bool(enabled)
        self._side_priority = side_priority
        self.side = self._side_stream(side_priority)
        self._fork = cupy.cuda.Event(disable_timing=True)
        self.events = [cupy.cuda.Event(disable_timing=True)
                       for _ in range(stage.max_group_size)]
        self._out = cupy.empty((cache.max_batch, cache.top_k), cupy.int32)
        self._views: dict = {}  # (batch, top-k shape) -> view of _out / _ms_out
        self._replay: dict = {}  # (batch, num_real pointer) -> replay Params
        self._ms_out = None if cache.max_steps < 2 else cupy.empty(
            (cache.max_batch, cache.max_steps, cache.top_k), cupy.int32)
        # per layer: the replay's source and destination (validated once, here); layer i + 1
        # follows layer i at the same stride on both sides, so a group (consecutive layers)
        # replays in one launch
        self._host = [int(cache.pool.device_ptr(i)) for i in range(cache.n_layers)]
        self._dev_rows = [cache.device[i].data.ptr for i in range(cache.n_layers)]
        fl = stage.full_layers
        self._next_full = dict(zip(fl[:-1], fl[1:], strict=True))  # full layer -> next one
        self.predict_width = (max(1, cache.top_k // 4) if predict_width is None else
                              _checks.integer("predict_width", predict_width, 1,
                                              cache.top_k))
        if predict_rule not in ("misses", "selection"):  # _abi.PREDICT_RULES
            raise ValueError(f"predict_rule must be 'misses' or 'selection', got "
                             f"{predict_rule!r}")
        self.predict_rule = predict_rule
        self.predict_at = stage_point(predict_at)
        self._predict = False
        self._predictor: Predictor | None = None
        self.predict_side: cupy.cuda.Stream | None = None
        self.predict_stats = None
        self._reset_step()
        self.set_predict(predict)
        # Its buffers came from CuPy's pool on the current stream, whose queued work may still
        # write memory freed there; the steps write them on any stream: construction ends when
        # that work landed (as the cache's does).
        cupy.cuda.get_current_stream().synchronize()

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
        self._lean = False  # the anchor's swap ran lean
        self._queued = 0  # replays queued for the current group
        self._whole = False  # ... in one launch (one event, at its last position)
        self._joined = 0  # leading positions the main stream has waited on

    def replays_whole_groups(self, batch: int) -> bool:
        """Whether a step of ``batch`` rows replays each group's shared layers in one launch."""
        return batch <= self.group_replay_batch

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

    # ------------------------------------------------------------------ the Step's hooks
    def before_layer(self, step, layer: int, top_k_tokens: ArrayLike | None = None) -> LayerCall:
        """Called by ``step.swap(layer, top_k)`` (model ``layer``, in layer order, once per
        step): a shared layer with prefetch on waits for its replay and is served its full
        layer's page table; otherwise the swap to run (a shared layer with prefetch off runs
        its full layer's top-k), after the main stream joined what it must (hazards 4, 10)."""
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
            if self._lean:  # hazard 17: every row resident, the full layer's rows are its
                return LayerCall(loc, self._anchor_topk, served=True, out=self._anchor_out)
            if self._enabled:
                self._wait_position(self.pattern.position(loc), s)
                return LayerCall(loc, self._anchor_topk, served=True, out=self._anchor_out)
            top_k_tokens = self._anchor_topk
        self._join(s)  # hazard 4: the swap rewrites the plan
        shape = getattr(top_k_tokens, "shape", ())
        stage = None
        if full:
            stage = self._take_stage(s, loc, step.batch, len(shape) == 2)
            self._reset_step()
        return LayerCall(loc, top_k_tokens, out=self._out_view(step.batch, shape),
                         copy_grid=self.copy_grid, stage=stage)

    def after_swap(self, step, call: LayerCall, out: cupy.ndarray) -> None:
        """Called by the Step after the swap of ``call``: a full layer forks the side streams
        (its group's replays, the next full layer's staging)."""
        loc = call.layer
        if not self.pattern.full[loc]:
            return
        self._anchor, self._anchor_batch = loc, step.batch
        self._anchor_topk, self._anchor_out = call.top_k, out
        single = len(getattr(call.top_k, "shape", ())) == 2
        self._lean = step.lean and single  # hazard 17: its rows serve the group as they are
        if self._lean:
            return
        group = self.pattern.groups[loc] if self._enabled else ()
        nxt = self._next_full.get(loc) if self._enabled and self._predict and single else None
        if not group and nxt is None:
            return
        s = step.stream
        self._fork.record(s)  # hazards 2, 3 and 10: after the full layer's swap
        if group:
            self._queue_replays(group, step.batch, step.num_real)
        if nxt is not None:  # (checked by the swap; a foreign array imported on s)
            with s:
                topk = _checks.token_rows("top_k_tokens", call.top_k, step.device)
            self._predictor.queue(step, loc, nxt, topk, self._fork, grid=self.replay_grid,
                                  rows_per_warp=self.replay_rows_per_warp,
                                  defer=self.predict_at == "indexer")

    def before_indexer(self, layer: int, stream: StreamLike | None = None) -> None:
        """Full ``layer``'s indexer is queued next on ``stream``: with ``predict_at="indexer"``
        the staging for the layer launches here (hazard 18); else nothing."""
        loc = self.pattern.local_index(layer)
        if not self.pattern.full[loc]:
            raise ValueError(f"layer {layer} is a shared layer: it runs no indexer")
        if self._predictor is not None:
            self._predictor.launch(self._main_stream(stream), loc)

    def _out_view(self, B: int, shape) -> cupy.ndarray | None:
        """This object's output buffer for a top-k of ``shape``, sliced once per shape (None for
        a shape no swap takes: the swap then refuses the top-k)."""
        key = (B, shape)
        out = self._views.get(key)
        if out is None:
            if len(shape) == 3 and self._ms_out is not None:
                out = dense_view(self._ms_out, (B, shape[1], shape[2]))
            elif len(shape) == 2:
                out = self._out[:B, : shape[-1]]
            else:
                return None
            self._views[key] = out
        return out

    # ------------------------------------------------------------------ prediction
    def set_predict(self, on: bool, stream: StreamLike | None = None, *,
                    at: str | None = None) -> None:
        """Prediction mode on or off, and ``at`` (if given) the ``predict_at`` it stages at;
        between steps (queued on ``stream``, no host sync).

        On (with prefetch on; single-step swaps): after each full layer's swap a side stream
        copies into staging rows the host rows of the next full layer it will probably miss
        (the guess: ``streams/_predict.py``), right away or (``at="indexer"``) at
        :meth:`before_indexer`; that layer's swap reads every staged miss there. Misses, slots
        and bytes are those without prediction; a wrong guess costs bandwidth.
        ``predict_stats`` (uint64 ``[3]``, device): rows the predicted swaps copied, rows of them
        read from staging rows, rows staged (:meth:`predict_summary`). Needs the cache's token
        -> slot table (``HotBufferCache(token_table=True)``, the default).
        """
        on = bool(on)
        at = None if at is None else stage_point(at)
        if on and self.cache.tables.token_slot is None:
            raise ValueError("prediction needs the cache's token -> slot table: build the "
                             "HotBufferCache with token_table=True (the default)")
        if on and self._predictor is None:
            self.predict_side = self._side_stream(self._side_priority)
            self._predictor = Predictor(self.cache, self.predict_width, self.predict_side,
                                        self.predict_rule)
            self.predict_stats = self._predictor.stats
        if self._predictor is not None and self._predictor.pending is not None:
            self._take_stage(self._main_stream(stream))
        if at is not None:
            self.predict_at = at
        self._predict = on

    @property
    def predict(self) -> bool:
        """Whether prediction mode is on (:meth:`set_predict`)."""
        return self._predict

    def predict_summary(self) -> dict:
        """``predict_stats`` on the host (synchronizes the device): rows copied by predicted
        swaps, rows read from staging rows, rows staged, and precision (used / staged) and
        recall (used / copied)."""
        if self._predictor is None:
            raise RuntimeError("prediction was never turned on (set_predict(True))")
        return self._predictor.summary()

    def _take_stage(self, s, loc=None, batch: int = 0, single_step: bool = False):
        """Join a pending staging into the main stream; its stage fields if it was made for
        full layer ``loc`` of this step (hazard 10)."""
        if self._predictor is None:
            return None
        return self._predictor.take(s, layer=loc, anchor=self._anchor, batch=batch,
                                    single_step=single_step)

    def _queue_replays(self, group, batch: int, num_real) -> None:
        c = self.cache
        plan = c.plan
        self.side.wait_event(self._fork)
        key = (batch, 0 if num_real is None else num_real.data.ptr)
        prm = self._replay.get(key)
        if prm is None:
            prm = self._replay[key] = copy_struct(  # bases set per group below
                plan.src, plan.dst, plan.count, src=Rows(0, c.pool.layer_bytes, c.pool.n_rows),
                dst=Rows(0, c.device[0].nbytes, c.device.shape[1]), row_bytes=c.row_bytes,
                batch=batch, num_real=num_real)
        # a whole group at once (one event, at its last position), or one layer at a time
        self._whole = whole = self.replays_whole_groups(batch)  # (the waits follow it)
        for p, sl in ([(len(group) - 1, group[0])] if whole else enumerate(group)):
            prm.set(src_base=self._host[sl], dst_base=self._dev_rows[sl],
                    n_layers=len(group) if whole else 1)
            launch_copy(prm, grid=self.replay_grid, stream=self.side,
                        rows_per_warp=self.replay_rows_per_warp)
            self.events[p].record(self.side)
        self._queued = len(group)
        self._joined = 0

    def _wait_position(self, p: int, s: cupy.cuda.Stream) -> None:
        """Main stream waits for the replay at group position ``p`` (hazard 1): nothing if it
        waited on that position or a later one (recorded later on the side stream); a group
        replayed in one launch is waited on whole."""
        if self._joined > p:
            return
        if self._whole:
            self._join(s)
            return
        s.wait_event(self.events[p])
        self._joined = p + 1

    def finish(self, stream: StreamLike | None = None) -> None:
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
        self._take_stage(s)
        self._reset_step()

    def set_enabled(self, enabled: bool, stream: StreamLike | None = None) -> None:
        """Turn prefetch on or off between steps (queued on ``stream``, which must not be the
        legacy default stream; no host sync).

        Turning it off copies every full layer's tables (``slot_tokens``, ``slot_locs``,
        ``lru``, ``token_slot`` and any multi-step state) into its shared layers (their own
        tables went stale while prefetch was on; hazard 8). Turning it on makes every shared
        layer mirror its full layer, device rows included
        (:meth:`HotBufferCache.mirror_layer`): while prefetch was off each layer ran its own
        swaps, and multi-step swaps leave layers in different slot -> row layouts.

        A CUDA graph captured before keeps its mode: capture again after this call (a replay of
        a graph of the other mode serves wrong rows; ``docs/overlap_hazards.md``, hazard 9).
        """
        enabled = bool(enabled)
        if enabled == self._enabled:
            return
        s = self._main_stream(stream, explicit=True)  # either way, the mode on is involved
        self._join(s)
        self._take_stage(s)
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
        if self.predict_side is not None:
            self.predict_side.synchronize()
