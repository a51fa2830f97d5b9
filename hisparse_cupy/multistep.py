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

import cupy
import numpy as np

from . import _abi, _build, _checks
from ._launch import Params, Ptr, as_stream, launch, ptr, resolve_pdl
from .plan import MissPlan
from .swap import SwapState

MAX_HOT = _abi.MAX_HOT
GATHER_BLOCK = _abi.GATHER_BLOCK
COMMIT_BLOCK = _abi.COMMIT_BLOCK
INIT_BLOCK = _abi.INIT_BLOCK
MIN_STEPS, MAX_STEPS = _abi.MS_MIN_STEPS, _abi.MS_MAX_STEPS
MAX_TOKENS = _abi.MS_MAX_TOKENS  # S * K per row
STATS = _abi.MS_STATS


default_scratch = _abi.default_scratch


def table_size(max_tokens: int) -> int:
    """Entries of the per-row dedup table (a power of two >= 2 S*K)."""
    return max(64, 1 << (2 * max_tokens - 1).bit_length())


COPY_IN_COMMIT_MAX_ROWS = 64  # batch rows x steps


def copy_blocks(batch: int, steps: int) -> int:
    """Copy blocks per batch row in the commit grid: 8 while ``batch * steps <= 64`` (128 warps
    for one row's misses), so the copy runs beside the admission; 0 above it: the gather's warps
    copy, beside the other gather blocks' lookups. Measured on the H200
    (``benchmarks/probe_copy_blocks.py``, benchmarks/NOTES.md): the copy blocks win up to
    batch x steps 64 and lose 1-8 % above it, where the commit blocks slowed by the copy blocks
    beside them cost more than the overlap gains."""
    return 8 if batch * steps <= COPY_IN_COMMIT_MAX_ROWS else 0


def commit_smem_bytes(hot_size: int, tokens: int) -> int:
    """Dynamic shared memory of the commit for H hot slots and S*K occurrences per row."""
    return _abi.smem_bytes("MULTISTEP_COMMIT", H=hot_size, NW=-(-tokens // 32),
                           NS=COMMIT_BLOCK // 32 + 1)


class MultiStepConfig:
    """Sizes of the multi-step state, checked without a GPU.

    Parameters
    ----------
    n_requests : R, request slots.
    hot_size : H, hot slots per request, 2 .. 32767.
    extra_page : P >= 1, slots after the hot slots (slot H and on: newest and draft tokens).
    top_k : K, entries per step, 1 .. H.
    max_steps : the most draft steps a call may have, 2 .. 4; ``max_steps * top_k <= 8192``.
    scratch : C, scratch rows per request, ``>= max(1, max_steps - 1, max_steps * top_k - H)``
        (default :func:`default_scratch`). Every miss beyond the scratch rows is copied straight
        into an unreferenced victim; ``S*K - H`` guarantees one exists. A row still in
        positional layout admits nothing, and ``S - 1`` rows hold the draft tokens past H of
        its steps ``L, L + 1, ...``.
    max_batch : rows of the workspace (default ``n_requests``).
    """

    def __init__(self, n_requests: int, hot_size: int, extra_page: int, top_k: int, *,
                 max_steps: int = MAX_STEPS, scratch: int | None = None,
                 max_batch: int | None = None):
        self.n_requests = _checks.integer("n_requests", n_requests, 1)
        self.hot_size = H = _checks.integer("hot_size", hot_size, 2, MAX_HOT)
        self.extra_page = _checks.integer("extra_page", extra_page, 1)
        self.top_k = K = _checks.integer("top_k", top_k, 1, H)
        self.max_steps = S = _checks.integer("max_steps", max_steps, MIN_STEPS, MAX_STEPS)
        if S * K > MAX_TOKENS:
            raise ValueError(f"max_steps * top_k must be <= {MAX_TOKENS}, got {S} * {K} = {S * K}")
        if scratch is None:
            scratch = default_scratch(H, K, S)
        self.scratch = _checks.integer("scratch", scratch, max(1, S - 1, S * K - H))
        self.max_batch = _checks.integer(
            "max_batch", self.n_requests if max_batch is None else max_batch, 1)

    @property
    def max_tokens(self) -> int:
        return self.max_steps * self.top_k

    @property
    def slots(self) -> int:
        """H + P: width of the slot tables."""
        return self.hot_size + self.extra_page

    @property
    def rows_per_request(self) -> int:
        """Device rows a request owns: H + P slots plus C scratch rows."""
        return self.slots + self.scratch

    @property
    def table_size(self) -> int:
        return table_size(self.max_tokens)

    @property
    def commit_smem(self) -> int:
        return commit_smem_bytes(self.hot_size, self.max_tokens)

    def state_bytes(self, max_len: int) -> int:
        """Device bytes of one layer's state besides the caller's slot tables and host_locs,
        for tokens below ``max_len`` (the token -> slot table: 2 bytes per token)."""
        R, H = self.n_requests, self.hot_size
        max_len = _checks.integer("max_len", max_len, 1)
        return R * (2 * max_len + 4 * H + 8 + 4 * self.scratch)

    def workspace_bytes(self) -> int:
        return self.max_batch * (12 * self.table_size + 20 * self.max_tokens
                                 + 4 * (_abi.MS_N_COUNTERS + _abi.MS_N_STATS))

    def layout(self, base: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
        """A fresh row layout: request r owns device rows ``base + r * (H + P + C) + [0, H+P+C)``.

        Returns ``(slot_locs int32 [R, H+P], scratch_locs int32 [R, C], n_device_rows)``.
        """
        R, W, C = self.n_requests, self.slots, self.scratch
        per = self.rows_per_request
        start = base + per * np.arange(R, dtype=np.int64).reshape(R, 1)
        slot_locs = (start + np.arange(W)).astype(np.int32)
        scratch_locs = (start + W + np.arange(C)).astype(np.int32)
        return slot_locs, scratch_locs, base + per * R

    def check_tables(self, slot_tokens: np.ndarray, slot_locs: np.ndarray,
                     scratch_locs: np.ndarray, n_device_rows: int) -> None:
        """Validate host copies of the slot tables (raises ValueError naming the problem).

        Hot tokens are -1 or >= 0 and distinct per request; hot slots' rows are >= 0; every row
        >= 0 in ``slot_locs`` and ``scratch_locs`` is below ``n_device_rows`` and owned once.
        """
        R, H, W, C = self.n_requests, self.hot_size, self.slots, self.scratch
        for name, a, shape in (("slot_tokens", slot_tokens, (R, W)),
                               ("slot_locs", slot_locs, (R, W)),
                               ("scratch_locs", scratch_locs, (R, C))):
            if tuple(a.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(a.shape)}")
        hot = slot_tokens[:, :H]
        if (slot_tokens < -1).any():
            raise ValueError("slot_tokens holds a value below -1")
        for r in range(R):
            held = hot[r][hot[r] >= 0]
            if np.unique(held).size != held.size:
                raise ValueError(f"slot_tokens[{r}, :H] holds a token twice")
        if (slot_locs[:, :H] < 0).any():
            raise ValueError("slot_locs[:, :hot_size] must be >= 0 (every hot slot owns a row)")
        if (scratch_locs < 0).any():
            raise ValueError("scratch_locs must be >= 0")
        rows = np.concatenate([slot_locs.reshape(-1), scratch_locs.reshape(-1)]).astype(np.int64)
        rows = rows[rows >= 0]
        if rows.size and rows.max() >= n_device_rows:
            raise ValueError(f"a device row ({rows.max()}) is >= n_device_rows ({n_device_rows})")
        if np.unique(rows).size != rows.size:
            raise ValueError("slot_locs and scratch_locs must not share device rows")

    def __repr__(self) -> str:
        return (f"MultiStepConfig(R={self.n_requests}, H={self.hot_size}, P={self.extra_page}, "
                f"K={self.top_k}, S<={self.max_steps}, C={self.scratch}, "
                f"max_batch={self.max_batch})")


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
        self.max_tokens = _checks.integer("max_tokens", max_tokens, 1, MAX_TOKENS)
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

    def reset(self, stream=None) -> None:
        """Clear every row (only needed if a call was abandoned half-way); queued on ``stream``
        (any kind :func:`hisparse_cupy._launch.as_stream` accepts)."""
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

    def __init__(self, config: MultiStepConfig, host_locs, slot_tokens, slot_locs, scratch_locs,
                 *,
                 n_device_rows: int, workspace: MultiStepWorkspace | None = None,
                 validate: bool = True, storage: dict | None = None):
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
        if validate:
            cfg.check_tables(cupy.asnumpy(self.slot_tokens), cupy.asnumpy(self.slot_locs),
                             cupy.asnumpy(self.scratch_locs), self.n_device_rows)
        if storage is not None:  # views of a HotBufferCache's arrays, initialised by it
            self.token_slot, self.ref = storage["token_slot"], storage["ref"]
            self.clock = storage["clock"]
            return
        self.token_slot = cupy.full(self.host_locs.shape, -1, cupy.int16)
        self.ref = cupy.zeros((R, H), cupy.uint32)
        self.clock = cupy.zeros((R, 2), cupy.uint32)
        self.reset()

    @classmethod
    def create(cls, host_locs, slot_tokens, slot_locs, scratch_locs, *, hot_size: int,
               top_k: int, n_device_rows: int, max_steps: int = MAX_STEPS,
               max_batch: int | None = None, workspace: MultiStepWorkspace | None = None,
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

    def reset(self, requests=None, *, stream=None) -> None:
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
            P=cfg.extra_page, C=cfg.scratch)

    def swap_state(self, lru) -> SwapState:
        """The single-step state over this state's slot tables and token -> slot table (``lru``:
        int16 ``[R, H]``, the single-step recency order): its calls run the table resolve,
        which records every admission in the table, so single- and multi-step calls can
        alternate. (A single-step state over these slot tables without this table would admit
        tokens the multi-step lookups do not see.)"""
        return SwapState.validated(self.host_locs, self.slot_tokens, self.slot_locs, lru,
                                   token_slot=self.token_slot)

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
    launch(_build.kernel(_build.MS_INIT), (B, L), INIT_BLOCK, p, stream=stream)


def multistep_swap_in(
    top_k_tokens,
    req_indices,
    seq_lens,
    state: MultiStepState,
    *,
    host_rows: Ptr,
    n_host_rows: int,
    device_rows,
    plan: MissPlan | None = None,
    out=None,
    status=None,
    num_real=None,
    check: bool = False,
    stream=None,
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
    s = as_stream(stream)
    with s:  # DLPack imports order on the stream the kernels run on
        topk = _checks.array("top_k_tokens", top_k_tokens, np.int32, ndim=3, contiguous=False,
                             inner_contiguous=True)
        _checks.sizes("top_k_tokens", topk, "BSK")
        B, S, K = topk.shape
        if not MIN_STEPS <= S <= cfg.max_steps:
            raise ValueError(f"top_k_tokens must have {MIN_STEPS}-{cfg.max_steps} steps (dim 1), "
                             f"got {S}")
        if K > cfg.top_k:
            raise ValueError(f"top_k_tokens must have 1..{cfg.top_k} entries per step (dim 2), "
                             f"got {K}")
        ws = state.workspace
        if B > ws.max_batch:
            raise ValueError(f"batch must be in [1, {ws.max_batch}] (workspace rows), got {B}")
        req = _checks.index_vector("req_indices", req_indices, B)
        lens, lens_stride, lens_step = _checks.lengths(seq_lens, B, S)
        dev = _checks.array("device_rows", device_rows, np.uint8, ndim=2)
        row_bytes = _checks.row_bytes("device_rows row size", dev.shape[1])
        if dev.shape[0] < state.n_device_rows:
            raise ValueError(f"device_rows has {dev.shape[0]} rows, the state indexes "
                             f"{state.n_device_rows}")
        n_host_rows = _checks.integer("n_host_rows", n_host_rows, 0)
        if not isinstance(host_rows, Ptr):
            raise TypeError("host_rows must be a Ptr (HostKVPool.device_ptr(layer))")
        nr = None if num_real is None else _checks.device_scalar("num_real", num_real)
        if out is None:
            out = cupy.empty((B, S, K), cupy.int32)
        else:
            out = _checks.array("out", out, np.int32, shape=(B, S, K), contiguous=False,
                                inner_contiguous=True)
        if status is None:
            status = cupy.empty((B, _abi.N_STATUS), cupy.int32)
        else:
            status = _checks.array("status", status, np.int32, shape=(B, _abi.N_STATUS))
        if plan is not None:
            if not isinstance(plan, MissPlan):
                raise TypeError("plan must be a MissPlan")
            plan.check_batch(B, S * K)
    if check:
        _checks.unique_requests(req, nr, cfg.n_requests)
    p = state.params()
    set_call(p, topk, req, lens, lens_stride, lens_step, nr, out, status, plan,
             host_rows=int(host_rows), n_host_rows=n_host_rows, device_rows=dev,
             row_bytes=row_bytes)
    run(p, (req.dtype, lens.dtype), B=B, T=S * K, H=cfg.hot_size, stream=s,
        pdl=resolve_pdl(pdl))
    if check:
        _checks.raise_on_status(status, topk, lens, max_len=state.host_locs.shape[1],
                                what="multi-step swap", stream=s)
    return out


def set_topk(p: Params, topk, out) -> None:
    """The call's top-k and output fields of a multi-step struct."""
    a = p.arr
    a["topk"], a["topk_stride"], a["S"], a["K"] = (
        topk.data.ptr, _checks.row_stride(topk), topk.shape[1], topk.shape[2])
    a["out"], a["out_stride"] = out.data.ptr, _checks.row_stride(out)


def set_call(p: Params, topk, req, lens, lens_stride: int, lens_step: int, num_real, out, status,
             plan: MissPlan | None, *, host_rows: int, n_host_rows: int, device_rows,
             row_bytes: int) -> None:
    """The batch's and the call's fields of a multi-step struct (the stateless op)."""
    set_topk(p, topk, out)
    p.set(B=topk.shape[0], copy_blocks=copy_blocks(topk.shape[0], topk.shape[1]), req=ptr(req),
          lens=ptr(lens), lens_stride=lens_stride, lens_step=lens_step, num_real=ptr(num_real),
          status=ptr(status), host_base=host_rows, n_host_rows=n_host_rows,
          dev_base=device_rows.data.ptr, row_bytes=row_bytes)
    if plan is None:
        p.set(plan_src=0, plan_dst=0, plan_count=0, plan_stride=0)
    else:
        p.set(plan_src=ptr(plan.src), plan_dst=ptr(plan.dst), plan_count=ptr(plan.count),
              plan_stride=_checks.row_stride(plan.src))


def run(p: Params, key, *, B: int, T: int, H: int, stream, pdl: bool) -> None:
    """Queue the gather and the commit (PDL) on ``stream``."""
    launch(_build.kernel(_build.GATHER[key]), (math.ceil(T / GATHER_BLOCK), B), GATHER_BLOCK, p,
           stream=stream)
    launch(_build.kernel(_build.COMMIT[key]), B * (1 + int(p["copy_blocks"])), COMMIT_BLOCK, p,
           shared_mem=commit_smem_bytes(H, T), stream=stream, pdl=pdl)


# The name the first releases used; the peer benchmark and older callers import it.
spec_swap_in = multistep_swap_in
