"""Argument validation shared by every op.

Each check raises ``TypeError`` (wrong kind, dtype or device) or ``ValueError`` (wrong shape,
layout or range) with a message that names the argument and what was expected. Arrays from
PyTorch, JAX or anything else that speaks DLPack are imported without a copy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

try:
    import cupy
except ImportError:  # the integer checks serve NumPy-only code too (layer patterns, the demo)
    cupy = None

from . import _abi
from ._device import Ptr

# What the public calls accept (for type checkers; the checks below say exactly what passes):
ArrayLike = Any  # a CuPy array, or a GPU array of another library (DLPack, CUDA array interface)
StreamLike = Any  # a CuPy, PyTorch or ``__cuda_stream__`` stream, or an int handle


def _dtype_names(dtypes) -> str:
    return " or ".join(np.dtype(d).name for d in dtypes)


@functools.lru_cache(maxsize=64)
def _dtype_set(dtypes) -> tuple[np.dtype, ...]:
    return tuple(np.dtype(d) for d in (dtypes if isinstance(dtypes, (list, tuple)) else
                                       [dtypes]))


def as_device_array(name: str, x) -> cupy.ndarray:
    """``x`` as a CuPy array on the current device (DLPack import, no copy)."""
    if isinstance(x, cupy.ndarray):
        arr = x
    elif isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a GPU array, got a NumPy (host) array")
    elif hasattr(x, "__dlpack__"):
        try:
            arr = cupy.from_dlpack(x)
        except Exception as e:  # a CPU tensor, an unsupported device
            raise TypeError(f"{name} must be a GPU array; DLPack import failed: {e}") from e
    else:
        raise TypeError(f"{name} must be a GPU array (cupy, or DLPack-capable), got {type(x)}")
    dev = cupy.cuda.runtime.getDevice()
    if arr.device.id != dev:
        raise ValueError(f"{name} is on device {arr.device.id}, expected device {dev}")
    return arr


_I32 = np.dtype(np.int32)


def token_rows(name: str, x, device_id: int) -> cupy.ndarray:
    """A per-call int32 top-k (any ndim >= 2): rows may be strided, each row contiguous.

    The per-layer fast path of :func:`array` for a CuPy array already on ``device_id``; anything
    else goes through :func:`array` (DLPack import, full messages).
    """
    if type(x) is cupy.ndarray and x.dtype == _I32 and x.data.device_id == device_id:
        st, sh = x.strides, x.shape
        n = len(sh)
        if n >= 2 and x.size:
            expected = 4
            ok = True
            for d in range(n - 1, 0, -1):
                if sh[d] > 1 and st[d] != expected:
                    ok = False
                    break
                expected *= sh[d]
            if ok and (sh[0] == 1 or (st[0] > 0 and st[0] % 4 == 0)):
                return x
    return array(name, x, np.int32, contiguous=False, inner_contiguous=True)


def array(
    name: str,
    x,
    dtypes,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    contiguous: bool = True,
    inner_contiguous: bool = False,
) -> cupy.ndarray:
    """Validate a device array.

    Parameters
    ----------
    dtypes : dtype or sequence of dtypes accepted
    shape : expected shape; ``None`` entries are free
    contiguous : require C-contiguity
    inner_contiguous : require only the last ``ndim - 1`` dimensions to be contiguous (rows may
        have any stride that is a whole number of elements)
    """
    arr = as_device_array(name, x)
    dts = _dtype_set(dtypes)
    if arr.dtype not in dts:
        raise TypeError(f"{name} must have dtype {_dtype_names(dts)}, got {arr.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(arr.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(arr.shape, shape, strict=True)):
            if want is not None and got != want:
                exp = "(" + ", ".join("*" if s is None else str(s) for s in shape) + \
                    ("," if len(shape) == 1 else "") + ")"
                raise ValueError(f"{name} must have shape {exp}, got {tuple(arr.shape)} (dim {i})")
    if contiguous and not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (strides {arr.strides})")
    if inner_contiguous and arr.ndim >= 2 and arr.size:  # (an empty array: sizes() names it)
        expected = arr.itemsize
        for d in range(arr.ndim - 1, 0, -1):
            if arr.shape[d] > 1 and arr.strides[d] != expected:
                raise ValueError(f"{name} must have contiguous rows (strides {arr.strides})")
            expected *= arr.shape[d]
        if arr.shape[0] > 1 and (arr.strides[0] <= 0 or arr.strides[0] % arr.itemsize):
            raise ValueError(f"{name} row stride {arr.strides[0]} must be a positive multiple "
                             f"of its item size")
    return arr


def kv_rows(name: str, kv, n_layers: int, row_bytes: int, stream):
    """KV rows, uint8 ``[n_layers, n, row_bytes]``: ``(array, on_host)``. A host array (NumPy,
    or a DLPack exporter on the CPU or in pinned memory) as NumPy; a GPU array imported on
    ``stream`` (a DLPack import orders there), its rows contiguous."""
    dev = getattr(kv, "__dlpack_device__", None)
    on_host = isinstance(kv, np.ndarray) or dev is None or dev()[0] in (1, 3)  # CPU, pinned
    if on_host:
        kv = np.asarray(kv)
        if kv.dtype != np.uint8:
            raise TypeError(f"{name} must have dtype uint8, got {kv.dtype}")
    else:
        with stream:
            kv = array(name, kv, np.uint8, ndim=3, contiguous=False, inner_contiguous=True)
    if kv.ndim != 3 or kv.shape[0] != n_layers or kv.shape[2] != row_bytes:
        raise ValueError(f"{name} must be uint8 [{n_layers}, n, {row_bytes}], got {kv.dtype} "
                         f"{tuple(kv.shape)}")
    return kv, on_host


def warm_tokens(warm_tokens, n: int, H: int) -> np.ndarray:
    """An admission's ``warm_tokens`` (int64; none: empty): at most ``H`` distinct tokens in
    ``[0, n - 1)``, for requests of ``n > H`` tokens only."""
    if warm_tokens is None:
        return np.zeros(0, np.int64)
    if n <= H:
        raise ValueError("warm_tokens applies only to requests longer than hot_size")
    warm = np.asarray(warm_tokens, dtype=np.int64).reshape(-1)
    if warm.size > H:
        raise ValueError(f"warm_tokens holds {warm.size} tokens, more than hot_size {H}")
    if warm.size and (warm.min() < 0 or warm.max() >= n - 1):
        raise ValueError(f"warm_tokens must lie in [0, n_tokens - 1 = {n - 1})")
    if np.unique(warm).size != warm.size:
        raise ValueError("warm_tokens must be distinct")
    return warm


def row_stride(arr: cupy.ndarray) -> np.int32:
    """Row stride of a 2-D (or more) array in elements, as the kernels take it."""
    s = arr.strides[0] // arr.itemsize if arr.ndim >= 2 else arr.shape[-1]
    return np.int32(s)


def integer(name: str, v, lo: int | None = None, hi: int | None = None) -> int:
    """An int in ``[lo, hi]`` (either bound optional)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    v = int(v)
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def fraction(name: str, v) -> float:
    """A real number in ``[0, 1]`` (an int or a float; not a bool, not NaN)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number in [0, 1], got {type(v).__name__}")
    v = float(v)
    if not 0.0 <= v <= 1.0:  # (NaN fails both)
        raise ValueError(f"{name} must be in [0, 1], got {v}")
    return v


def one_of(name: str, v, choices: tuple[int, ...]) -> int:
    """An int among ``choices``."""
    v = integer(name, v)
    if v not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {v}")
    return v


def row_bytes(name: str, v) -> int:
    """A row size: positive multiple of 16 (kernels copy 16-byte vectors)."""
    v = integer(name, v, 16)
    if v % 16:
        raise ValueError(f"{name} must be a multiple of 16 bytes, got {v}")
    return v


def device_scalar(name: str, x) -> cupy.ndarray:
    """A one-element int32 device array (graph-safe scalar such as ``num_real``)."""
    arr = array(name, x, np.int32)
    if arr.size != 1:
        raise ValueError(f"{name} must hold exactly one int32, got shape {tuple(arr.shape)}")
    return arr


def sizes(name: str, arr, names: str) -> None:
    """Reject an empty dimension with a message about sizes (``names``: one letter per dim)."""
    for n, letter in zip(arr.shape, names, strict=False):
        if n == 0:
            raise ValueError(f"{name} must have {letter} >= 1, got shape {tuple(arr.shape)} "
                             f"({names[0]}{''.join(', ' + c for c in names[1:])})")


def counter_addresses(x) -> tuple[int, ...]:
    """A stand-alone call's ``counters=``: ``()`` for None, else the address of a uint64
    ``[N_LAYER_COUNTERS]`` device array (what the kernel structs take, one per layer)."""
    if x is None:
        return ()
    return (array("counters", x, np.uint64, shape=(_abi.N_LAYER_COUNTERS,)).data.ptr,)


def index_vector(name: str, x, B: int | None = None) -> cupy.ndarray:
    """int32/int64 ``[B]`` device array (``B`` >= 1; checked against ``B`` when given)."""
    arr = array(name, x, (np.int32, np.int64), ndim=1)
    if arr.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one batch row, got shape {tuple(arr.shape)}")
    if B is not None and arr.shape[0] != B:
        raise ValueError(f"{name} must have shape ({B},) (one entry per batch row), got "
                         f"{tuple(arr.shape)}")
    return arr


def lengths(x, B: int, steps: int | None = None) -> tuple[cupy.ndarray, int, int]:
    """``seq_lens``: int32/int64 ``[B]`` or ``[B, S']`` (``S' >= steps`` when given).

    Returns ``(array, row stride, step stride)`` in elements; a ``[B]`` array serves every step
    of a multi-step call (step stride 0), a ``[B, S']`` one serves single-step calls with its
    column 0.
    """
    arr = array("seq_lens", x, (np.int32, np.int64), contiguous=False, inner_contiguous=True)
    if arr.ndim not in (1, 2) or arr.shape[0] != B:
        raise ValueError(f"seq_lens must have shape ({B},) or ({B}, S) (one row per batch row), "
                         f"got {tuple(arr.shape)}")
    if arr.ndim == 1:
        if not arr.flags.c_contiguous:
            raise ValueError(f"seq_lens must be contiguous (strides {arr.strides})")
        return arr, 1, 0
    if arr.shape[1] == 0:
        raise ValueError(f"seq_lens has 0 step columns (shape {tuple(arr.shape)}): give [B] or "
                         f"[B, S] with S >= 1")
    if steps is not None and arr.shape[1] < steps:
        raise ValueError(f"seq_lens has {arr.shape[1]} step column(s), the call has {steps} "
                         f"steps")
    return arr, int(arr.strides[0] // arr.itemsize), 1


def residency(resident, page_table, page_tokens, R: int, max_len: int) -> tuple:
    """``(resident, page_table, page_tokens)`` checked: uint8 ``[R]``, int32 ``[R, >= pages]``
    (rows contiguous), ``page_tokens >= 1``; all three or none (``(None, None, 0)``)."""
    given = [a is not None for a in (resident, page_table, page_tokens)]
    if not any(given):
        return None, None, 0
    if not all(given):
        raise ValueError("give resident, page_table and page_tokens together, or none")
    resident = array("resident", resident, np.uint8, shape=(R,))
    page_tokens = integer("page_tokens", page_tokens, 1)
    pages = -(-max_len // page_tokens)
    page_table = array("page_table", page_table, np.int32, ndim=2, contiguous=False,
                       inner_contiguous=True)
    if page_table.shape[0] != R or page_table.shape[1] < pages:
        raise ValueError(f"page_table must have shape ({R}, >= {pages}) (a page per "
                         f"{page_tokens} of max_len {max_len} tokens), got "
                         f"{tuple(page_table.shape)}")
    return resident, page_table, page_tokens


def unique_requests(req: cupy.ndarray, num_real: cupy.ndarray | None, R: int, stream) -> None:
    """Raise if a valid request slot (in ``[0, R)``) repeats among the real rows; read after
    the work queued on ``stream`` (the call's: it synchronizes).

    Invalid slots are not judged here: they get a defined per-row status (bad row).
    """
    r = cupy.asnumpy(req, stream=stream)
    n = r.size if num_real is None else int(cupy.asnumpy(num_real, stream=stream)[0])
    real = r[: max(0, min(n, r.size))]
    real = real[(real >= 0) & (real < R)]
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
    (stream or cupy.cuda.get_current_stream()).synchronize()
    st = cupy.asnumpy(status)
    bad = np.nonzero(st.any(axis=1))[0]
    if bad.size == 0:
        return
    tk = cupy.asnumpy(top_k_tokens)
    steps = tk.shape[1] if tk.ndim == 3 else 1
    tk = tk.reshape(tk.shape[0], steps, -1)
    lens = cupy.asnumpy(seq_lens).reshape(tk.shape[0], -1)
    lens = np.repeat(lens, steps, axis=1) if lens.shape[1] == 1 else lens[:, :steps]
    lines = []
    for b in bad[:8]:
        msg = []
        if st[b, _abi.ST_BADROW] == _abi.BADROW_NOT_RESIDENT:
            msg.append("its request is not resident, in a lean step (capture a lean graph "
                       "again after a demotion or a sparse admission)")
        elif st[b, _abi.ST_BADROW]:
            msg.append("request slot out of range, a negative seq_len, or (multi-step) no room")
        if st[b, _abi.ST_RANGE]:
            where = []
            for s in range(steps):
                lim = min(int(lens[b, s]), max_len)
                row = tk[b, s, : max(0, int(lens[b, s]))]
                idx = np.nonzero((row < -1) | (row >= lim))[0][:8]
                where += [(s, int(i)) if steps > 1 else int(i) for i in idx]
            msg.append(f"{st[b, _abi.ST_RANGE]} token(s) outside [0, min(seq_len, {max_len})) at "
                       f"{'(step, entry)' if steps > 1 else 'entries'} {where[:8]}")
        if st[b, _abi.ST_NOHOST]:
            msg.append(f"{st[b, _abi.ST_NOHOST]} miss(es) with no host row")
        lines.append(f"row {b} (seq_len {lens[b].tolist() if steps > 1 else int(lens[b, 0])}): "
                     + "; ".join(msg))
    more = f" (and {bad.size - 8} more rows)" if bad.size > 8 else ""
    raise ValueError(f"{what} found invalid input: " + " | ".join(lines) + more)


# ---------------------------------------------------------------- the stateless ops' calls
class OpArgs(NamedTuple):
    """A stateless op's arguments checked (:func:`op_args`)."""

    topk: cupy.ndarray
    req: cupy.ndarray
    lens: cupy.ndarray
    lens_stride: int
    lens_step: int
    dev: cupy.ndarray
    row_bytes: int
    n_host_rows: int
    num_real: cupy.ndarray | None
    out: cupy.ndarray
    status: cupy.ndarray
    counters: tuple[int, ...]


def op_args(top_k_tokens, req_indices, seq_lens, *, dims: str, sizes_ok, host_rows,
            n_host_rows, device_rows, plan, plan_cls: type, plan_required: bool, out, status,
            num_real, counters) -> OpArgs:
    """The one validation of ``swap_in`` (``dims="BK"``) and ``multistep_swap_in``
    (``"BSK"``), on CuPy's current stream (DLPack imports order there): the top-k (int32, rows
    may be strided), then ``sizes_ok(shape)`` (the op's own limits, raising by name), the
    request slots and lengths, the device rows, the host rows (a :class:`Ptr` and its row
    count), ``num_real``, ``out`` / ``status`` (allocated when None), the plan (a ``plan_cls``,
    the :class:`MissPlan`, with room for every entry of a row; None only where not
    ``plan_required``) and the counters."""
    topk = array("top_k_tokens", top_k_tokens, np.int32, ndim=len(dims), contiguous=False,
                 inner_contiguous=True)
    sizes("top_k_tokens", topk, dims)
    sizes_ok(topk.shape)
    B = topk.shape[0]
    req = index_vector("req_indices", req_indices, B)
    lens, lens_stride, lens_step = lengths(seq_lens, B, topk.shape[1] if dims == "BSK" else None)
    dev = array("device_rows", device_rows, np.uint8, ndim=2)
    rb = row_bytes("device_rows row size", dev.shape[1])
    n_host_rows = integer("n_host_rows", n_host_rows, 0)
    if not isinstance(host_rows, Ptr):
        raise TypeError("host_rows must be a Ptr (HostKVPool.device_ptr(layer))")
    if plan is not None or plan_required:
        if not isinstance(plan, plan_cls):
            raise TypeError(f"plan must be a MissPlan, got {type(plan).__name__}")
        plan.check_batch(B, math.prod(topk.shape[1:]))
    nr = None if num_real is None else device_scalar("num_real", num_real)
    if out is None:
        out = cupy.empty(topk.shape, cupy.int32)
    else:
        out = array("out", out, np.int32, shape=topk.shape, contiguous=False,
                    inner_contiguous=True)
    if status is None:
        status = cupy.empty((B, _abi.N_STATUS), cupy.int32)
    else:
        status = array("status", status, np.int32, shape=(B, _abi.N_STATUS))
    return OpArgs(topk, req, lens, lens_stride, lens_step, dev, rb, n_host_rows, nr, out,
                  status, counter_addresses(counters))
