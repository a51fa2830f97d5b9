"""One decode step of a :class:`~hisparse_cupy.HotBufferCache`: the batch validated once, every
layer's swap a few word writes and two launches.

:meth:`HotBufferCache.begin_step` makes a :class:`Step` (FlashInfer's plan/run split): it checks
the batch; the step's first swap of each kind fills the batch's fields of every layer's structs
at once (each kernel family's ``for_batch``); every ``step.swap(layer, top_k)`` checks the
top-k, writes the call's fields (``CallFields``) and launches. A ``[B, K]`` top-k runs the
single-step swap, a ``[B, S, K]`` one the multi-step swap, over the same hot buffers.

A step may be driven by hooks (a :class:`~hisparse_cupy.Prefetcher`, IndexCache shared-layer
overlap): for each layer ``swap`` asks ``hooks.before_layer(step, layer, top_k)``, which returns
a :class:`LayerCall`: either ``served`` (a shared layer whose rows the hooks replayed: its page
table is returned as it is) or the swap to run (the local layer, the top-k, the hooks' output
buffer, the copy grid, staged rows for the copy); after that swap the Step calls
``hooks.after_swap(step, call, out)``. The Step reads nothing else of the hooks and the hooks
read only the Step's public attributes.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import cupy
import numpy as np

from . import _abi, _checks
from ._checks import ArrayLike, StreamLike
from ._kernels import multistep, newest, swap
from ._kernels.launch import Structs, as_stream, resolve_pdl
from ._kernels.newest import NewestBuffers
from ._kernels.plan import array_rows, copy_rows, copy_struct
from ._kernels.rows import pool_rows

__all__ = ["LayerCall", "Step", "StepParts"]


class StepParts(NamedTuple):
    """What a :class:`~hisparse_cupy.HotBufferCache` builds once for its steps
    (``cache.step_parts``): every layer's kernel structs with the fields that do not depend on
    the step (``resolve``, ``copy``, ``multistep``: each family's per-layer stage), the default
    outputs (``out`` int32 ``[max_batch, K]``, ``ms_out`` ``[max_batch, S, K]``) and the newest
    token's buffers (``newest``). A :class:`Step` copies the structs and fills its batch's
    fields."""

    resolve: Structs
    copy: Structs
    multistep: Structs | None
    out: cupy.ndarray
    ms_out: cupy.ndarray | None
    newest: NewestBuffers

    @classmethod
    def build(cls, c) -> StepParts:
        """Every layer's structs of cache ``c`` with the fields that do not depend on the step
        (each kernel family's per-layer stage; a :class:`Step` copies them and fills the
        batch's fields for all layers at once, so a swap only writes its top-k's), and the
        buffers every step uses."""
        L, n_host, B, K = c.n_layers, c.pool.n_rows, c.max_batch, c.top_k
        count = [c.counters.address(i) for i in range(L)] if c.counters else ()
        copy = Structs.zeros(_abi.PLANNED_COPY, L)
        for layer in range(L):
            copy_struct(c.plan.src, c.plan.dst, c.plan.count, src=pool_rows(c.pool, layer),
                        dst=array_rows(c.device[layer]), row_bytes=c.row_bytes, batch=0,
                        into=copy.row(layer))
        ms = c.max_steps >= 2
        return cls(
            swap.layer_structs([c.state(i) for i in range(L)], status=c.status, plan=c.plan,
                               n_host_rows=n_host, counters=count),
            copy,
            None if not ms else multistep.layer_structs(
                [c.multistep_state(i) for i in range(L)], status=c.status, plan=c.plan,
                host_rows=[c.pool.device_ptr(i) for i in range(L)], n_host_rows=n_host,
                device_rows=[c.device[i].data.ptr for i in range(L)],
                row_bytes=c.row_bytes, counters=count),
            cupy.empty((B, K), cupy.int32),
            None if not ms else cupy.empty((B, c.max_steps, K), cupy.int32),
            NewestBuffers(B))


class LayerCall(NamedTuple):
    """What hooks decide for one layer of a step (see the module docstring)."""

    layer: int  # local layer index
    top_k: object  # the top-k the swap runs (a shared layer: its full layer's)
    served: bool = False  # True: ``out`` is the layer's page table, no swap runs
    out: cupy.ndarray | None = None  # the hooks' output buffer for the swap (or the page table)
    copy_grid: int | None = None
    stage: dict | None = None  # fields of the copy struct: rows staged for this swap's copy


class Step:
    """One decode step of a :class:`HotBufferCache`: the batch, validated once.

    Made by :meth:`HotBufferCache.begin_step`. Every method queues work on the step's stream
    without host synchronization (``check=True`` excepted).

    Attributes
    ----------
    cache, stream, pdl, prefetcher
    req : the batch's request slots (int32 or int64 ``[B]``); ``batch`` = B.
    seq_lens : ``[B]`` or ``[B, S]`` lengths; ``lens_stride`` its row stride in elements,
        ``lens_step`` 1 if it has a column per step, else 0.
    num_real : int32 device scalar or None.
    lean : whether the step runs lean (``cache.residency.lean_step``): single-step swaps launch
        their resolve only and a prefetcher serves shared layers without replays.
    dtypes : ``(req dtype, seq_lens dtype)``: the kernel instances the step runs.
    device : the CUDA device id the step's arrays are on.
    """

    def __init__(self, cache, req_indices: ArrayLike, seq_lens: ArrayLike,
                 num_real: ArrayLike | None = None, *, stream: StreamLike | None = None,
                 pdl: bool | None = None, prefetcher=None, lean: bool = False):
        self.cache = c = cache
        self.lean = bool(lean)
        self.stream = as_stream(stream)
        with self.stream:  # DLPack imports order on the step's stream (and stay capturable)
            self.req = _checks.index_vector("req_indices", req_indices)
            self.batch = B = self.req.shape[0]
            if B > c.max_batch:
                raise ValueError(f"batch must be in [1, max_batch={c.max_batch}], got {B}")
            self.seq_lens, self.lens_stride, self.lens_step = _checks.lengths(seq_lens, B)
            self.num_real = None if num_real is None else _checks.device_scalar("num_real",
                                                                                num_real)
        self.pdl = resolve_pdl(pdl)
        self.prefetcher = prefetcher
        if prefetcher is not None and prefetcher.cache is not c:
            raise ValueError("prefetcher drives another cache")
        self.dtypes = (self.req.dtype, self.seq_lens.dtype)
        self.device = cupy.cuda.runtime.getDevice()
        # every layer's structs with the batch's fields, made by the step's first swap of each
        # kind (a step of single-step swaps never copies the multi-step structs)
        self._resolve = self._resolve_call = self._copy = None
        self._ms = self._ms_call = None
        self._launches: dict[tuple, tuple] = {}  # per top-k shape: launchers, grids, output

    def _single_structs(self) -> None:
        c, nr = self.cache, self.num_real
        self._resolve = swap.for_batch(c.step_parts.resolve, self.req, self.seq_lens,
                                       self.lens_stride, self.batch, nr, lean=self.lean)
        self._resolve_call = swap.CallFields(self._resolve)
        self._copy = c.step_parts.copy.copy()
        self._copy.put_all(B=self.batch, num_real=0 if nr is None else nr.data.ptr)

    def _multi_structs(self) -> None:
        self._ms = multistep.for_batch(self.cache.step_parts.multistep, self.req, self.seq_lens,
                                       self.lens_stride, self.lens_step, self.batch,
                                       self.num_real)
        self._ms_call = multistep.CallFields(self._ms)

    # ----------------------------------------------------------------- swaps
    def swap(self, layer: int, top_k_tokens: ArrayLike | None = None, *,
             out: ArrayLike | None = None, copy_grid: int | None = None,
             check: bool = False) -> cupy.ndarray:
        """Swap in ``layer``'s top-k: int32 ``[B, K]`` (single-step) or ``[B, S, K]``
        (multi-step, ``2 <= S <= max_steps``); returns the device rows (same shape) of
        ``cache.device_rows(layer)``, -1 for unused or invalid entries.

        Without ``out`` the result is a view of a buffer the next swap overwrites; the cache's
        :attr:`~HotBufferCache.plan` and :attr:`~HotBufferCache.status` hold this call's miss plan
        and per-row status until then. ``check``: see :func:`hisparse_cupy.swap_in` (it
        synchronizes). With a prefetcher, ``layer`` is a model layer id, shared layers return
        their full layer's rows (the prefetcher's buffer: ``out`` and ``copy_grid`` are
        refused, set ``Prefetcher(copy_grid=)``), a shared layer's ``top_k_tokens`` is ignored
        and its status is its full layer's.
        """
        hooks = self.prefetcher
        if hooks is None:
            return self._swap(self.cache.layer_index(layer), top_k_tokens, out, copy_grid,
                              None, check, False)
        if out is not None or copy_grid is not None:
            raise ValueError("out= and copy_grid= do not apply to a step driven by a "
                             "prefetcher: its layers return the prefetcher's page tables "
                             "(copy them to keep them) and its swaps use "
                             "Prefetcher(copy_grid=)")
        call = hooks.before_layer(self, layer, top_k_tokens)
        if call.served:
            if check:  # no swap ran since the full layer's: the status is still its
                self.raise_on_status(call.top_k)
            return call.out
        if check:
            self.check_requests()
        out = self._swap(call.layer, call.top_k, call.out, call.copy_grid, call.stage, False,
                         True)
        hooks.after_swap(self, call, out)
        if check:  # after the hooks' bookkeeping: the step goes on after a caught error
            self.raise_on_status(call.top_k)
        return out

    def before_indexer(self, layer: int) -> None:
        """Say that full ``layer``'s indexer (what computes its top-k) is queued next on the
        step's stream: a prefetcher with ``predict_at="indexer"`` launches the layer's
        prediction staging here, in a window that moves nothing over PCIe. Nothing without a
        prefetcher (``layer`` is still checked)."""
        if self.prefetcher is None:
            self.cache.layer_index(layer)
        else:
            self.prefetcher.before_indexer(layer, self.stream)

    def _swap(self, layer: int, top_k_tokens, out, copy_grid, stage, check: bool,
              hooks_out: bool):
        """One swap of local ``layer``; ``stage``: copy-struct fields of staged rows;
        ``hooks_out``: ``out`` (or None) is the hooks' own buffer for the top-k's shape."""
        if type(top_k_tokens) is cupy.ndarray:
            topk = _checks.token_rows("top_k_tokens", top_k_tokens, self.device)
        else:
            with self.stream:  # a DLPack import orders on the step's stream
                topk = _checks.token_rows("top_k_tokens", top_k_tokens, self.device)
        B = self.batch
        if topk.ndim == 3:
            return self._swap_multistep(layer, topk, out, check, hooks_out)
        if topk.ndim != 2 or topk.shape[0] != B:
            raise ValueError(f"top_k_tokens must have shape ({B}, K) or ({B}, S, K), got "
                             f"{tuple(topk.shape)}")
        K = topk.shape[1]
        got = self._launches.get(("single", K, copy_grid))
        if got is None:
            got = self._launches_single(K, copy_grid)
        go, default_out = got
        out = self._out_arg(out, default_out, (B, K), hooks_out)
        if check:
            self.check_requests()
        if self._resolve is None:
            self._single_structs()
        self._resolve_call.fill(layer, topk, out)
        if stage is None or self.lean:  # lean: every row resident, nothing to copy
            swap.run(self._resolve, layer, None if self.lean else self._copy, go,
                     self.stream.ptr)
        else:
            self._copy.put(layer, **stage)
            try:
                swap.run(self._resolve, layer, self._copy, go, self.stream.ptr)
            finally:
                self._copy.put(layer, stage_map=0)  # the struct's bytes were taken at the launch
        if check:
            self.raise_on_status(topk)
        return out

    def _launches_single(self, K: int, copy_grid: int | None):
        c, B = self.cache, self.batch
        if not 1 <= K <= c.top_k:
            raise ValueError(f"top_k_tokens must have 1..{c.top_k} entries per row (the cache's "
                             f"top_k), got {K}")
        grid = _checks.integer("copy_grid", copy_grid, 1, 2**31 - 1) if copy_grid else None
        got = self._launches[("single", K, copy_grid)] = (
            swap.launches(self.dtypes, B, K, c.hot_size, c.token_table, grid, self.pdl),
            c.step_parts.out[:B, :K])
        return got

    def _out_arg(self, out, default: cupy.ndarray, shape, hooks_out: bool) -> cupy.ndarray:
        """``out`` checked (a foreign array imported on the step's stream), or ``default``;
        the hooks' buffer (sliced from their own arrays) only needs the shape it was cut for."""
        if out is None:
            return default
        if hooks_out and out.shape == shape:
            return out
        with self.stream if type(out) is not cupy.ndarray else contextlib.nullcontext():
            return _checks.array("out", out, np.int32, shape=shape, contiguous=False,
                                 inner_contiguous=True)

    def _swap_multistep(self, layer: int, topk, out, check: bool, hooks_out: bool):
        c = self.cache
        B, S, K = topk.shape
        if c.max_steps < 2:
            raise ValueError("a [B, S, K] top-k needs a cache built with max_steps >= 2")
        if B != self.batch or not 2 <= S <= c.max_steps or not 1 <= K <= c.top_k:
            raise ValueError(f"top_k_tokens must have shape ({self.batch}, 2..{c.max_steps}, "
                             f"1..{c.top_k}), got {tuple(topk.shape)}")
        got = self._launches.get(("multi", S, K))
        if got is None:
            if self.lens_step and self.seq_lens.shape[1] < S:
                raise ValueError(f"seq_lens has {self.seq_lens.shape[1]} step column(s), the "
                                 f"call has {S} steps")
            got = self._launches[("multi", S, K)] = (
                multistep.launches(self.dtypes, B, S, K, c.hot_size, self.pdl),
                multistep.dense_view(c.step_parts.ms_out, (B, S, K)))
        go, default_out = got
        out = self._out_arg(out, default_out, (B, S, K), hooks_out)
        if check:
            self.check_requests()
        if self._ms is None:
            self._multi_structs()
        self._ms_call.fill(layer, topk, out, go.copy_blocks)
        multistep.run(self._ms, layer, go, self.stream.ptr)
        if check:
            self.raise_on_status(topk)
        return out

    # ----------------------------------------------------------------- check=True
    def check_requests(self) -> None:
        """``check=True``'s first half: raise ``ValueError`` if a valid request slot repeats
        among the real rows, or (a paged pool) an admitted request of a real row has no host
        pages for its tokens or its device page table disagrees with the host's
        (synchronizes; other rows get their per-row status)."""
        self.stream.synchronize()  # the reads below run on CuPy's current stream
        _checks.unique_requests(self.req, self.num_real, self.cache.max_requests, self.stream)
        if self.cache.host.paged:
            nr = self.batch if self.num_real is None else \
                min(self.batch, max(0, int(cupy.asnumpy(self.num_real)[0])))
            lens = cupy.asnumpy(self.seq_lens[:nr]).reshape(nr, -1)
            self.cache.host.check(cupy.asnumpy(self.req[:nr]), lens.max(axis=1, initial=0))

    def raise_on_status(self, top_k_tokens: ArrayLike) -> None:
        """``check=True``'s second half: synchronize the step's stream and raise ``ValueError``
        naming every row and entry the last swap flagged (``top_k_tokens``: that swap's)."""
        with self.stream:  # a foreign array imports on the step's stream
            topk = _checks.token_rows("top_k_tokens", top_k_tokens, self.device)
        _checks.raise_on_status(self.cache.status[:self.batch], topk, self.seq_lens,
                                max_len=self.cache.max_len,
                                what="multi-step swap" if topk.ndim == 3 else "swap",
                                stream=self.stream)

    # ----------------------------------------------------------------- newest token
    def _newest(self, record: bool) -> cupy.ndarray:
        c = self.cache
        return newest.newest_rows(
            c.step_parts.newest, req=self.req, lens=self.seq_lens, lens_stride=self.lens_stride,
            num_real=self.num_real, key=self.dtypes, slot_locs=c.tables.slot_locs[0],
            slot_tokens=c.tables.slot_tokens, host_locs=c.host_locs, host=c.host,
            hot_size=c.hot_size, record=record, stream=self.stream,
            token_slot=c.tables.token_slot, **c.residency.newest_fields())

    def newest_rows(self) -> cupy.ndarray:
        """Device row (in every layer) of each row's newest token ``seq_len - 1``: int32
        ``[B]`` (a view valid until the next call), -1 for padding or invalid rows. The model
        writes the step's KV there."""
        return self._newest(False)

    def backup_newest(self, *, write_host: bool = True) -> cupy.ndarray:
        """Record each row's newest token in slot H of every layer (where this step's swaps find
        it) and copy its device row, all layers, to its host row (one launch). Returns what
        :meth:`newest_rows` returns.

        Call once per decode step after the model wrote the step's KV, before any later swap
        that may select that token (queue order on the step's stream guarantees it).

        ``write_host=False``: record the token but leave its host row to another writer (a
        tensor-parallel rank over a host pool shared with ranks that hold the same KV). The
        caller must then order every later swap that may miss on the token after that writer's
        copy (e.g. an interprocess event, ``examples/tp_decode.py --newest-writer rank0``).
        """
        c, B = self.cache, self.batch
        rows = self._newest(True)
        if write_host:
            nb = c.step_parts.newest
            copy_rows(nb.src, nb.dst, nb.count, src=array_rows(c.device), dst=pool_rows(c.pool),
                      row_bytes=c.row_bytes, batch=B, num_real=self.num_real,
                      n_layers=c.n_layers, to_host=True, stream=self.stream, pdl=self.pdl)
        return rows

    def finish(self) -> None:
        """End the step: with a prefetcher, join its side streams into the step's stream."""
        if self.prefetcher is not None:
            self.prefetcher.finish(self.stream)
