"""Single-step swap-in: resolve (hash + LRU, one block per request) then the planned copy.

See ``cu/swap.cu`` for the exact semantics; :func:`hisparse_cupy.reference.swap_in` is the
same algorithm in NumPy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cupy
import numpy as np

from . import _build, _checks
from ._launch import Ptr, launch, max_shared_memory
from .plan import MissPlan, copy_rows
from .reference import N_STATUS, ST_BADROW, ST_NOHOST, ST_RANGE

_FILE = "swap.cu"
RESOLVE_BLOCK = 1024
_NAMES = _build.index_instances(f"hs::swap_resolve<{RESOLVE_BLOCK}, {{req}}, {{len}}>")
_build.register(_FILE, *_NAMES.values())

MAX_HOT = 32767  # LRU entries are int16


def hash_size(top_k: int) -> int:
    """Shared hash slots for a top-k of ``top_k`` entries (power of two, load <= 1/4).

    A warp waits for its longest probe sequence; at load 1/2 that tail made the lookups
    dominate the resolve, at 1/4 it is a few probes (benchmarks/NOTES.md).
    """
    return max(64, 1 << (4 * top_k - 1).bit_length())


def resolve_smem_bytes(top_k: int, hot_size: int) -> int:
    """Dynamic shared memory of the resolve kernel (see the layout in ``cu/swap.cu``)."""
    nw = RESOLVE_BLOCK // 32
    return (8 * top_k + 8 * hash_size(top_k) + 12 * top_k + 4 * (hot_size + 1)
            + 12 * (nw + 1) + 16 + 6 * hot_size + top_k)


def check_sizes(top_k: int, hot_size: int) -> None:
    """Raise ``ValueError`` if the resolve kernel cannot run K = top_k, H = hot_size here."""
    _check_sizes(top_k, hot_size, cupy.cuda.runtime.getDevice())


@functools.lru_cache(maxsize=256)
def _check_sizes(top_k: int, hot_size: int, device_id: int) -> None:
    if top_k > hot_size:
        raise ValueError(f"top_k={top_k} must not exceed hot_size={hot_size}")
    if not 1 <= hot_size <= MAX_HOT:
        raise ValueError(f"hot_size must be in [1, {MAX_HOT}], got {hot_size}")
    need, limit = resolve_smem_bytes(top_k, hot_size), max_shared_memory()
    if need > limit:
        raise ValueError(f"top_k={top_k} with hot_size={hot_size} needs {need} bytes of shared "
                         f"memory per block; this device allows {limit}: lower top_k or hot_size")


@dataclass
class SwapState:
    """The device tables of one layer's hot buffers (validated views, see DESIGN §3).

    host_locs : int64 ``[R, max_len]``; slot_tokens, slot_locs : int32 ``[R, H + P]`` (one row
    stride); lru : int16 ``[R, H]``.
    """

    host_locs: cupy.ndarray
    slot_tokens: cupy.ndarray
    slot_locs: cupy.ndarray
    lru: cupy.ndarray

    @property
    def hot_size(self) -> int:
        return self.lru.shape[1]

    @classmethod
    def validated(cls, host_locs, slot_tokens, slot_locs, lru) -> SwapState:
        host_locs = _checks.array("host_locs", host_locs, np.int64, ndim=2)
        lru = _checks.array("lru", lru, np.int16, ndim=2, contiguous=False, inner_contiguous=True)
        R, H = lru.shape
        if not 1 <= H <= MAX_HOT:
            raise ValueError(f"lru width (hot_size) must be in [1, {MAX_HOT}], got {H}")
        if host_locs.shape[0] != R:
            raise ValueError(f"host_locs must have {R} rows (one per request slot, like lru), "
                             f"got {host_locs.shape[0]}")
        slot_tokens = _checks.array("slot_tokens", slot_tokens, np.int32, ndim=2,
                                    contiguous=False, inner_contiguous=True)
        slot_locs = _checks.array("slot_locs", slot_locs, np.int32, ndim=2, contiguous=False,
                                  inner_contiguous=True)
        for name, a in (("slot_tokens", slot_tokens), ("slot_locs", slot_locs)):
            if a.shape[0] != R or a.shape[1] < H + 1:
                raise ValueError(f"{name} must have shape ({R}, >= {H + 1}) (hot slots plus the "
                                 f"newest-token slot), got {tuple(a.shape)}")
        if slot_tokens.strides != slot_locs.strides:
            raise ValueError("slot_tokens and slot_locs must share one row stride, got "
                             f"{slot_tokens.strides} and {slot_locs.strides}")
        return cls(host_locs, slot_tokens, slot_locs, lru)


def swap_in(
    top_k_tokens,
    req_indices,
    seq_lens,
    state: SwapState,
    *,
    host_rows: Ptr,
    n_host_rows: int,
    device_rows: cupy.ndarray,
    plan: MissPlan,
    out=None,
    status=None,
    num_real=None,
    copy_grid: int | None = None,
    check: bool = False,
    dry_run: bool = False,
    stream: cupy.cuda.Stream | None = None,
) -> cupy.ndarray:
    """Resolve one step's top-k for a batch and move the misses into the hot buffer.

    Parameters
    ----------
    top_k_tokens : int32 ``[B, K]`` device array (rows may be strided), token positions, -1 =
        unused.
    req_indices : int32 or int64 ``[B]``, batch row -> request slot (unique among real rows).
    seq_lens : int32 or int64 ``[B]``, the request's length including the newest token.
    state : :class:`SwapState` of the layer.
    host_rows : device address of the layer's host rows (``HostKVPool.device_ptr(layer)``).
    n_host_rows : rows in that layer (host rows outside ``[0, n_host_rows)`` count as missing).
    device_rows : uint8 ``[D, row_bytes]`` device array, the layer's hot-buffer storage.
    plan : :class:`MissPlan` with ``>= B`` rows of ``>= K`` entries; receives this step's plan
        (the copy reads it, and IndexCache replays it for shared layers).
    out : int32 ``[B, K]`` device array for the result (allocated when None).
    status : int32 ``[B, 3]`` device array: per row, entries out of range, misses without a
        host row, bad request slot / length (allocated when None).
    num_real : int32 device scalar; rows ``>= num_real`` are CUDA-graph padding.
    copy_grid : blocks of the copy kernel (default: enough to fill the GPU).
    check : synchronize and raise ``ValueError`` naming rows and entries if any status is set.
    dry_run : resolve and update the state but move no bytes (for measuring the copy's share).

    Returns
    -------
    cupy.ndarray
        ``out``: int32 ``[B, K]``, the device row of each entry, -1 for unused or invalid.
    """
    topk = _checks.array("top_k_tokens", top_k_tokens, np.int32, ndim=2, contiguous=False,
                         inner_contiguous=True)
    B, K = topk.shape
    H = state.hot_size
    R = state.lru.shape[0]
    if K > H:
        raise ValueError(f"top_k_tokens has K={K} entries per row, more than hot_size H={H}")
    if K == 0 or B == 0:
        raise ValueError(f"top_k_tokens must be non-empty, got shape {tuple(topk.shape)}")
    check_sizes(K, H)
    req = _checks.array("req_indices", req_indices, (np.int32, np.int64), shape=(B,))
    lens = _checks.array("seq_lens", seq_lens, (np.int32, np.int64), shape=(B,))
    dev = _checks.array("device_rows", device_rows, np.uint8, ndim=2)
    row_bytes = _checks.row_bytes("device_rows row size", dev.shape[1])
    n_host_rows = _checks.integer("n_host_rows", n_host_rows, 0)
    if not isinstance(host_rows, Ptr):
        raise TypeError("host_rows must be a Ptr (HostKVPool.device_ptr(layer))")
    plan.check_batch(B, K)
    nr = None if num_real is None else _checks.device_scalar("num_real", num_real)
    if out is None:
        out = cupy.empty((B, K), cupy.int32)
    else:
        out = _checks.array("out", out, np.int32, shape=(B, K), contiguous=False,
                            inner_contiguous=True)
    if status is None:
        status = cupy.empty((B, N_STATUS), cupy.int32)
    else:
        status = _checks.array("status", status, np.int32, shape=(B, N_STATUS))
    if check:
        _precheck(req, nr, R)

    hsize = hash_size(K)
    args = (
        topk, _checks.row_stride(topk), np.int32(K), req, lens, nr, np.int32(B), np.int32(R),
        state.host_locs, _checks.row_stride(state.host_locs), np.int64(n_host_rows),
        state.slot_tokens, state.slot_locs, _checks.row_stride(state.slot_locs),
        state.lru, _checks.row_stride(state.lru), np.int32(H), np.int32(hsize),
        out, _checks.row_stride(out), plan.src, plan.dst, _checks.row_stride(plan.src),
        plan.count, status,
    )
    name = _NAMES[(req.dtype, lens.dtype)]
    launch(_build.kernel(_FILE, name), B, RESOLVE_BLOCK, args,
           shared_mem=resolve_smem_bytes(K, H), stream=stream)
    copy_rows(plan.src, plan.dst, plan.count, B, nr, src_base=host_rows,
              src_layer_bytes=0, n_src_rows=n_host_rows, dst_base=Ptr(dev.data.ptr),
              dst_layer_bytes=0, n_dst_rows=dev.shape[0], row_bytes=row_bytes,
              grid=copy_grid, dry_run=dry_run, pdl=True, stream=stream)
    if check:
        raise_on_status(status, topk, lens, max_len=state.host_locs.shape[1], stream=stream)
    return out


def _precheck(req: cupy.ndarray, nr: cupy.ndarray | None, R: int) -> None:
    r = cupy.asnumpy(req)
    n = r.size if nr is None else int(cupy.asnumpy(nr)[0])
    real = r[: max(0, min(n, r.size))]
    vals, cnt = np.unique(real, return_counts=True)
    if (cnt > 1).any():
        raise ValueError(f"req_indices repeats request slot(s) {vals[cnt > 1].tolist()} among "
                         f"real rows; each request may appear once per call")


def raise_on_status(status, top_k_tokens, seq_lens, *, max_len: int, what: str = "swap",
                    stream=None) -> None:
    """Synchronize and raise ``ValueError`` describing every row whose status is non-zero.

    Works for single-step calls (``top_k_tokens`` ``[B, K]``, ``seq_lens`` ``[B]``) and
    multi-step calls (``[B, S, K]`` and ``[B, S]``: entries are named as (step, entry)).
    ``max_len`` is the width of ``host_locs``: tokens at or beyond it are out of range too.
    """
    if stream is not None:
        stream.synchronize()
    st = cupy.asnumpy(status)
    bad = np.nonzero(st.any(axis=1))[0]
    if bad.size == 0:
        return
    tk = cupy.asnumpy(top_k_tokens)
    steps = tk.shape[1] if tk.ndim == 3 else 1
    tk = tk.reshape(tk.shape[0], steps, -1)
    lens = cupy.asnumpy(seq_lens).reshape(tk.shape[0], steps)
    lines = []
    for b in bad[:8]:
        msg = []
        if st[b, ST_BADROW]:
            msg.append("request slot out of range or a negative seq_len")
        if st[b, ST_RANGE]:
            where = []
            for s in range(steps):
                lim = min(int(lens[b, s]), max_len)
                row = tk[b, s, : max(0, int(lens[b, s]))]
                idx = np.nonzero((row < -1) | (row >= lim))[0][:8]
                where += [(s, int(i)) if steps > 1 else int(i) for i in idx]
            msg.append(f"{st[b, ST_RANGE]} token(s) outside [0, min(seq_len, {max_len})) at "
                       f"{'(step, entry)' if steps > 1 else 'entries'} {where[:8]}")
        if st[b, ST_NOHOST]:
            msg.append(f"{st[b, ST_NOHOST]} miss(es) with no host row")
        lines.append(f"row {b} (seq_len {lens[b].tolist() if steps > 1 else int(lens[b, 0])}): "
                     + "; ".join(msg))
    more = f" (and {bad.size - 8} more rows)" if bad.size > 8 else ""
    raise ValueError(f"{what} found invalid input: " + " | ".join(lines) + more)
