"""Multi-step (MTP) swap-in: one gather + one commit kernel for the top-k of 2-4 draft steps.

With speculative decoding each request needs the top-k of S draft steps at once. Resolving the
steps one after another repeats lookups and launches, and copies a miss that several steps share
several times. :func:`multistep_swap_in` treats the union of the steps as one working set:

- ``gather`` (grid ``(ceil(S*K / 128), B)``) resolves every (step, entry) against the extra
  page and the hot cache, and gives each unique miss one of the request's scratch rows;
- ``commit`` (launched with Programmatic Dependent Launch on sm_90+): one block per row chooses
  victims with a CLOCK-style policy, admits misses by swapping the scratch row with the
  victim's row and records the admitted tokens in the token -> slot table. Each unique miss is
  copied once from the host into its scratch row: at small batch by :func:`copy_blocks` more
  blocks per row of the commit grid, beside the admission (which moves pointers only), else by
  the gather's warps.

The exact semantics, the state layout and the admission policy are in ``cu/multistep.cu``;
:func:`hisparse_cupy.reference.multistep_swap_in` is the same algorithm in NumPy.

State. :class:`MultiStepState` is per layer: admission rotates device rows between hot slots and
scratch rows, so ``slot_locs`` and ``scratch_locs`` are mutated and must not be shared by layers.
Its token -> hot slot table (``token_slot``, int16 ``[R, max_len]``) is the one the single-step
resolve's table instance reads and writes (:class:`hisparse_cupy.SwapState`), so both swaps can
run on the same hot buffers.
:class:`MultiStepWorkspace` (the per-call dedup tables, per batch row) may be shared by layers
whose calls run one after another on one stream. :class:`MultiStepConfig` checks the sizes
(without a GPU).

Outputs index the layer's device rows and stay valid until the next call on the same layer:
the next call reuses scratch rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import cupy
import numpy as np

from .. import _abi, _checks
from .._checks import ArrayLike, StreamLike
from .._device import Ptr
from . import build
from .launch import (
    CallWriter,
    Launcher,
    Params,
    Structs,
    as_stream,
    field_words,
    launch,
    launcher,
    ptr,
    resolve_pdl,
)
from .multistep_config import MultiStepConfig, commit_smem_bytes, table_size
from .plan import MissPlan
from .swap import SwapState, residency_fields

default_scratch = _abi.default_scratch  # the sizing rule is shared with the struct checks


COPY_IN_COMMIT_MAX_ROWS = 64  # batch rows x steps


# Measuring overrides, data only (hisparse_cupy.testing.knobs sets them, engines never do):
# "copy_blocks", the commit's copy blocks per batch row (None: copy_blocks() chooses).
FIXED: dict[str, int | None] = {"copy_blocks": None}


def copy_blocks(batch: int, steps: int) -> int:
    """Copy blocks per batch row in the commit grid: 8 while ``batch * steps <= 64`` (128 warps
    for one row's misses), so the copy runs beside the admission; 0 above it: the gather's warps
    copy, beside the other gather blocks' lookups. Measured on the H200
    (``benchmarks/probe_copy_blocks.py``, benchmarks/NOTES.md): the copy blocks win up to
    batch x steps 64 (3-26 %), tie at 96 and lose 2-8 % at 128 and above, where the commit
    blocks slowed by the copy blocks beside them cost more than the overlap gains."""
    if FIXED["copy_blocks"] is not None:
        return FIXED["copy_blocks"]
    return 8 if batch * steps <= COPY_IN_COMMIT_MAX_ROWS else 0


class MultiStepWorkspace:
    """Per-call scratch metadata for up to ``max_batch`` rows of up to ``max_tokens`` occurrences.

    Every call leaves its rows ready for the next (the commit clears the dedup table and the
    counters the gather adds to; the gather rewrites the rest), so layers whose calls run one
    after another on one stream may share a workspace (never two calls in flight at once).

    Attributes
    ----------
    stats : int32 ``[max_batch, 4]``: per row of the last call: unique misses, misses admitted
        into the hot cache, evictable (unreferenced) hot slots, partial admission (0/1).
    """

    def __init__(self, max_batch: int, max_tokens: int):
        self.max_batch = _checks.integer("max_batch", max_batch, 1)
        self.max_tokens = _checks.integer("max_tokens", max_tokens, 1, _abi.MS_MAX_TOKENS)
        self.table_size = table_size(self.max_tokens)
        B, TS = self.max_batch, self.table_size
        self.table = cupy.empty((B, TS), cupy.uint64)
        self.meta = cupy.empty((B, TS), cupy.int32)
        self.compact = cupy.zeros((B, self.max_tokens), cupy.int32)
        self.pending = cupy.zeros((B, self.max_tokens), cupy.int32)
        self.miss_src = cupy.zeros((B, self.max_tokens), cupy.int64)
        self.miss_dst = cupy.zeros((B, self.max_tokens), cupy.int32)
        self.counters = cupy.empty((B, _abi.MS_N_COUNTERS), cupy.int32)
        self.stats = cupy.zeros((B, _abi.MS_N_STATS), cupy.int32)
        self.reset()
        cupy.cuda.get_current_stream().synchronize()  # ready for a call on any stream

    def reset(self, stream: StreamLike | None = None) -> None:
        """Clear every row (only needed if a call was abandoned half-way); queued on ``stream``
        (any kind :func:`hisparse_cupy._kernels.launch.as_stream` accepts)."""
        with as_stream(stream):
            self.table.fill(np.uint64(_abi.MS_EMPTY))
            self.meta.fill(_abi.MS_META_INIT)
            self.counters.fill(0)


class MultiStepState:
    """One layer's multi-step state over a given slot table.

    The slot tables are used in place and mutated by every call: ``slot_tokens`` and
    ``slot_locs`` (int32 ``[R, H + P]``, one row stride) and ``scratch_locs`` (int32 ``[R, C]``).
    The state allocates the token -> hot slot table ``token_slot`` (int16 ``[R, max_len]``,
    ``max_len`` = ``host_locs``' width; every hot token's entry names its slot, other entries
    are never trusted), the reference epochs ``ref`` (uint32 ``[R, H]``) and ``clock`` (uint32
    ``[R, 2]``: epoch, cursor), and initialises them from the slot tables (:meth:`reset`).

    Use :meth:`create` to build one; call :meth:`reset` for the request slots whose slot tables
    the caller rewrote (admission, release, a restored snapshot): a hot token the table does not
    name would be taken for a miss and admitted twice.
    """

    def __init__(self, config: MultiStepConfig, host_locs: ArrayLike, slot_tokens: ArrayLike,
                 slot_locs: ArrayLike, scratch_locs: ArrayLike, *, n_device_rows: int,
                 workspace: MultiStepWorkspace | None = None, validate: bool = True,
                 token_slot: ArrayLike | None = None, ref: ArrayLike | None = None,
                 clock: ArrayLike | None = None):
        cfg = self.config = config
        R, H, W, C = cfg.n_requests, cfg.hot_size, cfg.slots, cfg.scratch
        self.host_locs = _checks.array("host_locs", host_locs, np.int64, ndim=2)
        if self.host_locs.shape[0] != R:
            raise ValueError(f"host_locs must have {R} rows (one per request slot), got "
                             f"{self.host_locs.shape[0]}")
        self.slot_tokens = _checks.array("slot_tokens", slot_tokens, np.int32, shape=(R, W),
                                         contiguous=False, inner_contiguous=True)
        self.slot_locs = _checks.array("slot_locs", slot_locs, np.int32, shape=(R, W),
                                       contiguous=False, inner_contiguous=True)
        if self.slot_tokens.strides != self.slot_locs.strides:
            raise ValueError("slot_tokens and slot_locs must share one row stride, got "
                             f"{self.slot_tokens.strides} and {self.slot_locs.strides}")
        self.scratch_locs = _checks.array("scratch_locs", scratch_locs, np.int32, shape=(R, C),
                                          contiguous=False, inner_contiguous=True)
        self.n_device_rows = _checks.integer("n_device_rows", n_device_rows, 1)
        if workspace is None:
            workspace = MultiStepWorkspace(cfg.max_batch, cfg.max_tokens)
        elif not isinstance(workspace, MultiStepWorkspace):
            raise TypeError("workspace must be a MultiStepWorkspace")
        elif workspace.max_tokens < cfg.max_tokens:
            raise ValueError(f"workspace holds {workspace.max_tokens} occurrences per row, the "
                             f"config needs {cfg.max_tokens}")
        self.workspace = workspace
        self.resident = self.page_table = None  # set_residency: no request is resident
        self.page_tokens = 0
        if validate:
            cfg.check_tables(cupy.asnumpy(self.slot_tokens), cupy.asnumpy(self.slot_locs),
                             cupy.asnumpy(self.scratch_locs), self.n_device_rows)
        given = [a is not None for a in (token_slot, ref, clock)]
        if any(given):  # the caller's arrays (a HotBufferCache's views), initialised by it
            if not all(given):
                raise ValueError("give token_slot, ref and clock together, or none of them")
            self.token_slot = _checks.array("token_slot", token_slot, np.int16,
                                            shape=self.host_locs.shape)
            self.ref = _checks.array("ref", ref, np.uint32, shape=(R, H))
            self.clock = _checks.array("clock", clock, np.uint32, shape=(R, 2))
            return
        self.token_slot = cupy.full(self.host_locs.shape, -1, cupy.int16)
        self.ref = cupy.zeros((R, H), cupy.uint32)
        self.clock = cupy.zeros((R, 2), cupy.uint32)
        self.reset()
        cupy.cuda.get_current_stream().synchronize()  # ready for a call on any stream

    @classmethod
    def create(cls, host_locs: ArrayLike, slot_tokens: ArrayLike, slot_locs: ArrayLike,
               scratch_locs: ArrayLike, *, hot_size: int, top_k: int, n_device_rows: int,
               max_steps: int = _abi.MS_MAX_STEPS, max_batch: int | None = None,
               workspace: MultiStepWorkspace | None = None,
               validate: bool = True) -> MultiStepState:
        """Build the state of one layer from its slot tables (sizes taken from the arrays).

        Parameters
        ----------
        host_locs : int64 ``[R, max_len]``, token -> host row (-1 = none); read only. Its width
            sizes the token -> slot table (2 bytes per token and request).
        slot_tokens, slot_locs : int32 ``[R, H + P]`` (mutated in place).
        scratch_locs : int32 ``[R, C]`` spare device rows, disjoint from ``slot_locs`` (mutated).
        hot_size : H.  top_k : the largest K a call will use.
        n_device_rows : rows of the layer's device array (every row index is checked against it).
        max_steps : the most steps a call will use (2-4).
        max_batch : workspace rows (default R); ignored when ``workspace`` is given.
        validate : check the slot tables on the host first (one device -> host copy).
        """
        W = slot_tokens.shape[1]
        cfg = MultiStepConfig(slot_tokens.shape[0], hot_size, W - hot_size, top_k,
                         max_steps=max_steps, scratch=scratch_locs.shape[1],
                         max_batch=workspace.max_batch if workspace is not None else max_batch)
        return cls(cfg, host_locs, slot_tokens, slot_locs, scratch_locs,
                   n_device_rows=n_device_rows, workspace=workspace, validate=validate)

    @property
    def hot_size(self) -> int:
        return self.config.hot_size

    def reset(self, requests: ArrayLike | None = None, *, stream: StreamLike | None = None) -> None:
        """(Re)initialise the token -> slot table, epochs and cursor of ``requests`` (default:
        all) from their current slot tables. Queued on ``stream``; no host synchronisation."""
        R = self.config.n_requests
        if requests is None:
            rows = np.arange(R, dtype=np.int32)
        else:
            rows = np.unique(np.asarray(requests, dtype=np.int64).reshape(-1))
            if rows.size and (rows.min() < 0 or rows.max() >= R):
                raise ValueError(f"requests must lie in [0, {R}), got {rows.tolist()[:8]}")
            rows = rows.astype(np.int32)
        if rows.size == 0:
            return
        s = as_stream(stream)
        with s:
            d_rows = cupy.asarray(rows)
        init_states(d_rows, None, self.slot_tokens[None], self.token_slot[None], self.ref[None],
                    self.clock[None], hot_size=self.hot_size, stream=s)

    def params(self, p: Params | None = None) -> Params:
        """The layer's fields of the multi-step struct (the call's come later)."""
        cfg, ws = self.config, self.workspace
        p = p or Params(_abi.MULTISTEP)
        return p.set(
            host_locs=ptr(self.host_locs), host_stride=_checks.row_stride(self.host_locs),
            slot_tokens=ptr(self.slot_tokens), slot_locs=ptr(self.slot_locs),
            slot_stride=_checks.row_stride(self.slot_locs), scratch_locs=ptr(self.scratch_locs),
            scratch_stride=_checks.row_stride(self.scratch_locs),
            token_slot=ptr(self.token_slot), ref=ptr(self.ref),
            ref_stride=_checks.row_stride(self.ref), clock=ptr(self.clock), table=ptr(ws.table),
            meta=ptr(ws.meta), table_size=ws.table_size, compact=ptr(ws.compact),
            pending=ptr(ws.pending), miss_src=ptr(ws.miss_src), miss_dst=ptr(ws.miss_dst),
            compact_stride=_checks.row_stride(ws.compact),
            counters=ptr(ws.counters), stats=ptr(ws.stats), R=cfg.n_requests, H=cfg.hot_size,
            P=cfg.extra_page, C=cfg.scratch, **residency_fields(self))

    def set_residency(self, resident: ArrayLike | None, page_table: ArrayLike | None,
                      page_tokens: int | None) -> None:
        """Which requests are resident (docs/design.md section 10): uint8 ``[R]``, their device
        page table int32 ``[R, >= ceil(max_len / page_tokens)]``; all None: none is. Calls
        made after it read them (the arrays are read on the device at each call)."""
        self.resident, self.page_table, self.page_tokens = _checks.residency(
            resident, page_table, page_tokens, self.config.n_requests, self.host_locs.shape[1])

    def swap_state(self, lru: ArrayLike) -> SwapState:
        """The single-step state over this state's slot tables and token -> slot table (``lru``:
        int16 ``[R, H]``, the single-step recency order): its calls run the table resolve,
        which records every admission in the table, so single- and multi-step calls can
        alternate. (A single-step state over these slot tables without this table would admit
        tokens the multi-step lookups do not see.)"""
        return SwapState.validated(self.host_locs, self.slot_tokens, self.slot_locs, lru,
                                   token_slot=self.token_slot, resident=self.resident,
                                   page_table=self.page_table,
                                   page_tokens=self.page_tokens or None)

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Host copies of every state array (for tests and debugging; synchronises)."""
        names = ("slot_tokens", "slot_locs", "scratch_locs", "token_slot", "ref", "clock")
        return {n: cupy.asnumpy(getattr(self, n)) for n in names}


def init_states(rows: cupy.ndarray, num_real: cupy.ndarray | None, slot_tokens: cupy.ndarray,
                token_slot: cupy.ndarray, ref: cupy.ndarray, clock: cupy.ndarray, *,
                hot_size: int, stream) -> None:
    """(Re)initialise request slots ``rows`` (int32 ``[B]``) of every layer from their slot tables.

    Arrays are per layer: slot_tokens int32 ``[L, R, W]``, token_slot int16 ``[L, R, max_len]``
    (rows contiguous), ref uint32 ``[L, R, H]`` and clock uint32 ``[L, R, 2]`` (contiguous).
    Rows outside ``[0, R)`` or at or beyond ``num_real`` are skipped.
    """
    L, R = slot_tokens.shape[:2]
    B = rows.shape[0]
    p = Params(_abi.MULTISTEP_INIT).set(
        rows=ptr(rows), num_real=ptr(num_real), slot_tokens=ptr(slot_tokens),
        token_slot=ptr(token_slot), ref=ptr(ref), clock=ptr(clock),
        slot_layer_stride=slot_tokens.strides[0] // 4,
        table_layer_stride=token_slot.strides[0] // 2, ref_layer_stride=ref.strides[0] // 4,
        R=R, B=B, slot_stride=slot_tokens.strides[1] // 4, H=hot_size,
        table_stride=token_slot.strides[1] // 2, ref_stride=ref.strides[1] // 4)
    launch(build.kernel(build.MS_INIT), (B, L), _abi.INIT_BLOCK, p, stream=stream)


def multistep_swap_in(
    top_k_tokens: ArrayLike,
    req_indices: ArrayLike,
    seq_lens: ArrayLike,
    state: MultiStepState,
    *,
    host_rows: Ptr,
    n_host_rows: int,
    device_rows: ArrayLike,
    plan: MissPlan | None = None,
    out: ArrayLike | None = None,
    status: ArrayLike | None = None,
    num_real: ArrayLike | None = None,
    check: bool = False,
    counters: ArrayLike | None = None,
    stream: StreamLike | None = None,
    pdl: bool | None = None,
) -> cupy.ndarray:
    """Resolve the top-k of S draft steps for a batch, copying each unique miss once.

    Parameters
    ----------
    top_k_tokens : int32 ``[B, S, K]`` device array (rows may be strided, each row's ``[S, K]``
        contiguous), token positions, -1 = unused. ``2 <= S <= state.config.max_steps``,
        ``K <= state.config.top_k``.
    req_indices : int32 or int64 ``[B]``, batch row -> request slot (unique among real rows).
    seq_lens : int32 or int64 ``[B, S']`` (``S' >= S``), each step's length (the step's tokens
        lie in ``[0, seq_len)``), or ``[B]``: one length for every step.
    state : the layer's :class:`MultiStepState`.
    host_rows : device address of the layer's host rows (``HostKVPool.device_ptr(layer)``).
    n_host_rows : rows in that layer (host rows outside ``[0, n_host_rows)`` count as missing).
    device_rows : uint8 ``[D, row_bytes]`` device array, the layer's rows
        (``D >= state.n_device_rows``).
    plan : optional :class:`MissPlan` (``>= B`` rows of ``>= S*K`` entries): entry u of row b is
        the u-th unique miss (host row -> device row it was copied to), ``count[b]`` the number
        of unique misses. Entry order follows the kernel's claims (not deterministic).
    out : int32 ``[B, S, K]`` for the result (allocated when None).
    status : int32 ``[B, 3]`` (allocated when None): per row, occurrences out of range, miss
        occurrences with no host row, bad request slot / negative length.
    num_real : int32 device scalar; rows ``>= num_real`` are CUDA-graph padding (output -1).
    check : reject repeated valid request slots first (synchronizes), then run the call, then
        synchronize and raise ``ValueError`` if any status is set. When it raises, the call has
        completed: valid occurrences were resolved, the state updated and their bytes copied.
    counters : uint64 ``[N_LAYER_COUNTERS]`` device array the call adds to
        (:mod:`hisparse_cupy.counters`), or None.
    stream : CuPy, PyTorch or ``__cuda_stream__`` stream, or an int handle (default: CuPy's
        current stream).
    pdl : launch the commit with Programmatic Dependent Launch (default: where supported).

    Returns
    -------
    cupy.ndarray
        ``out``: int32 ``[B, S, K]``, the device row of each occurrence, -1 for unused or invalid.
        Valid until the next call on this layer. ``state.workspace.stats[:B]`` holds per-row
        statistics of the call.
    """
    cfg = state.config

    def sizes_ok(shape) -> None:
        B, S, K = shape
        if not _abi.MS_MIN_STEPS <= S <= cfg.max_steps:
            raise ValueError(f"top_k_tokens must have {_abi.MS_MIN_STEPS}-{cfg.max_steps} steps "
                             f"(dim 1), got {S}")
        if K > cfg.top_k:
            raise ValueError(f"top_k_tokens must have 1..{cfg.top_k} entries per step (dim 2), "
                             f"got {K}")
        if B > state.workspace.max_batch:
            raise ValueError(f"batch must be in [1, {state.workspace.max_batch}] (workspace "
                             f"rows), got {B}")

    s = as_stream(stream)
    with s:  # DLPack imports order on the stream the kernels run on
        a = _checks.op_args(top_k_tokens, req_indices, seq_lens, dims="BSK", sizes_ok=sizes_ok,
                            host_rows=host_rows, n_host_rows=n_host_rows,
                            device_rows=device_rows, plan=plan, plan_cls=MissPlan,
                            plan_required=False, out=out, status=status, num_real=num_real,
                            counters=counters)
    topk, req, lens, dev, nr, out, status = a.topk, a.req, a.lens, a.dev, a.num_real, a.out, \
        a.status
    B, S, K = topk.shape
    if dev.shape[0] < state.n_device_rows:
        raise ValueError(f"device_rows has {dev.shape[0]} rows, the state indexes "
                         f"{state.n_device_rows}")
    if check:
        _checks.unique_requests(req, nr, cfg.n_requests, s)
    st = for_batch(layer_structs([state], status=status, plan=plan, host_rows=[int(host_rows)],
                                 n_host_rows=a.n_host_rows, device_rows=[dev.data.ptr],
                                 row_bytes=a.row_bytes, counters=a.counters),
                   req, lens, a.lens_stride, a.lens_step, B, nr)
    go = launches((req.dtype, lens.dtype), B, S, K, cfg.hot_size, resolve_pdl(pdl))
    CallFields(st).fill(0, topk, out, go.copy_blocks)
    run(st, 0, go, s.ptr)
    if check:
        _checks.raise_on_status(status, topk, lens, max_len=state.host_locs.shape[1],
                                what="multi-step swap", stream=s)
    return out


# ------------------------------------------------------------------ the struct, in stages
# As the resolve's (swap.py): per layer (tables, workspace, host and device rows, outputs: when
# a cache is built), per batch (all layers at once, at begin_step), per call (the top-k, the
# output, S, K and the copy blocks: a few word writes).

def layer_structs(states, *, status: cupy.ndarray, plan: MissPlan | None, host_rows,
                  n_host_rows: int, device_rows, row_bytes: int, counters=()) -> Structs:
    """One multi-step struct per layer (``states``: each layer's :class:`MultiStepState`,
    ``host_rows`` / ``device_rows``: each layer's base address), every field that does not
    depend on the batch or the call; ``plan`` None: no plan recorded; ``counters``: each
    layer's counters address (none: not counted)."""
    st = Structs.zeros(_abi.MULTISTEP, len(states))
    for i, (state, h, d) in enumerate(zip(states, host_rows, device_rows, strict=True)):
        state.params(st.row(i)).set(host_base=int(h), dev_base=int(d))
    for i, c in enumerate(counters):
        st.put(i, layer_counters=c)
    st.put_all(status=ptr(status), n_host_rows=n_host_rows, row_bytes=row_bytes)
    if plan is not None:
        st.put_all(plan_src=ptr(plan.src), plan_dst=ptr(plan.dst), plan_count=ptr(plan.count),
                   plan_stride=_checks.row_stride(plan.src))
    return st


def for_batch(layers: Structs, req, lens, lens_stride: int, lens_step: int, B: int,
              num_real) -> Structs:
    """A copy of the per-layer structs with the batch's fields in every layer."""
    st = layers.copy()
    st.put_all(req=ptr(req), lens=ptr(lens), lens_stride=lens_stride, lens_step=lens_step, B=B,
               num_real=ptr(num_real))
    return st


_MW = field_words(_abi.MULTISTEP)


class CallFields(CallWriter):
    """Writes a call's fields into struct ``layer`` of a :class:`Structs` of multi-step structs."""

    __slots__ = ()
    TOPK, OUT, TOPK_STRIDE = _MW["topk"][1], _MW["out"][1], _MW["topk_stride"][1]
    OUT_STRIDE, S, K, G = (_MW["out_stride"][1], _MW["S"][1], _MW["K"][1],
                           _MW["copy_blocks"][1])

    def fill(self, layer: int, topk, out, blocks: int) -> None:
        i8, i4 = self.i8, self.i4
        b8, b4 = layer * self.n8, layer * self.n4
        i8[b8 + self.TOPK] = topk.data.ptr
        i8[b8 + self.OUT] = out.data.ptr
        i4[b4 + self.TOPK_STRIDE] = topk.strides[0] // 4
        i4[b4 + self.OUT_STRIDE] = out.strides[0] // 4
        i4[b4 + self.S] = topk.shape[1]
        i4[b4 + self.K] = topk.shape[2]
        i4[b4 + self.G] = blocks


class MultiStepLaunch(NamedTuple):
    """A multi-step call's launches: the commit's copy blocks per row, the gather's launcher
    and grid, the commit's launcher and grid."""

    copy_blocks: int
    gather: Launcher
    gather_grid: tuple[int, int, int]
    commit: Launcher
    commit_grid: tuple[int, int, int]


_calls: dict[tuple, MultiStepLaunch] = {}


def launches(key, B: int, S: int, K: int, H: int, pdl: bool) -> MultiStepLaunch:
    """The launches of a call of B rows of S steps of K entries (cached per shape, device and
    copy blocks)."""
    G = copy_blocks(B, S)
    ck = (key, B, S, K, H, pdl, cupy.cuda.runtime.getDevice(), G)
    got = _calls.get(ck)
    if got is None:
        T = S * K
        got = _calls[ck] = MultiStepLaunch(
            G, launcher(build.kernel(build.GATHER[key]), _abi.GATHER_BLOCK),
            (math.ceil(T / _abi.GATHER_BLOCK), B, 1),
            launcher(build.kernel(build.COMMIT[key]), _abi.COMMIT_BLOCK,
                     commit_smem_bytes(H, T), pdl),
            (B * (1 + G), 1, 1))
    return got


def run(st: Structs, layer: int, launch: MultiStepLaunch, stream_ptr: int) -> None:
    """Queue the gather and the commit (PDL) of struct ``layer`` on a stream."""
    addr = st.addr(layer)
    launch.gather(launch.gather_grid, stream_ptr, addr)
    launch.commit(launch.commit_grid, stream_ptr, addr)


def dense_view(buf: cupy.ndarray, shape: tuple[int, ...]) -> cupy.ndarray:
    """A C-contiguous ``shape`` view of the first elements of ``buf`` (the kernels write each
    row's ``[S, K]`` block densely: a ``[:B, :S, :K]`` slice of a larger buffer would not be)."""
    return buf.reshape(-1)[: int(np.prod(shape))].reshape(shape)
