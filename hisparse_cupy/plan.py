"""Miss plans and the planned copy.

A :class:`MissPlan` records the copies a swap made: for batch row ``b``, entries
``0 <= m < count[b]`` say "host row ``src[b, m]`` went to device row ``dst[b, m]``". Device rows
of a request are the same in every layer, so a full layer's plan can be replayed for other
layers (IndexCache shared layers) with :func:`replay_plan`.

:func:`copy_params` + :func:`launch_copy` are the one launcher of the ``planned_copy`` kernel,
which every bulk row move of the package goes through (swap misses, replays, admission loads,
backups).
"""

from __future__ import annotations

import cupy
import numpy as np

from . import _abi, _build, _checks
from ._launch import Params, Ptr, as_stream, launch, ptr, resolve_pdl, sm_count
from .host_pool import HostKVPool

COPY_WARPS = _abi.COPY_WARPS
ROWS_PER_WARP = _build.COPY_ROWS_PER_WARP  # the host -> device copy's choices
_COPY_BLOCKS_PER_SM = 2048 // (COPY_WARPS * 32)


def full_grid() -> int:
    """Blocks of the copy kernel that fill every SM of the current device."""
    return sm_count() * _COPY_BLOCKS_PER_SM


class MissPlan:
    """Plan buffers for up to ``max_batch`` rows of up to ``width`` misses each.

    Allocated once (graph-safe: the pointers never change); calls use the first ``B`` rows.

    Attributes
    ----------
    src : cupy.ndarray, int64 ``[max_batch, width]``, host row of each miss
    dst : cupy.ndarray, int32 ``[max_batch, width]``, device row it was written to
    count : cupy.ndarray, int32 ``[max_batch]``, valid entries per row
    """

    def __init__(self, max_batch: int, width: int):
        self.max_batch = _checks.integer("max_batch", max_batch, 1)
        self.width = _checks.integer("width", width, 1)
        self.src = cupy.full((self.max_batch, self.width), -1, dtype=cupy.int64)
        self.dst = cupy.full((self.max_batch, self.width), -1, dtype=cupy.int32)
        self.count = cupy.zeros(self.max_batch, dtype=cupy.int32)

    def check_batch(self, batch: int, need_width: int) -> None:
        if batch > self.max_batch:
            raise ValueError(f"plan holds {self.max_batch} rows, the call has batch {batch}")
        if need_width > self.width:
            raise ValueError(f"plan rows hold {self.width} entries, the call needs {need_width}")

    def to_numpy(self, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """``[(src[:count], dst[:count]) for each of the first batch rows]`` on the host."""
        cnt = cupy.asnumpy(self.count[:batch])
        src, dst = cupy.asnumpy(self.src[:batch]), cupy.asnumpy(self.dst[:batch])
        return [(src[b, : cnt[b]], dst[b, : cnt[b]]) for b in range(batch)]


def copy_params(
    src_idx: cupy.ndarray,
    dst_idx: cupy.ndarray,
    count: cupy.ndarray,
    batch: int,
    num_real: cupy.ndarray | None,
    *,
    src_base: int,
    src_layer_bytes: int,
    n_src_rows: int,
    dst_base: int,
    dst_layer_bytes: int,
    n_dst_rows: int,
    row_bytes: int,
    n_layers: int = 1,
    dry_run: bool = False,
    spin_cycles: int = 0,
    bad: cupy.ndarray | None = None,
    params: Params | None = None,
) -> Params:
    """The ``planned_copy`` struct for a plan (arguments already validated by the caller).

    ``src_idx``/``dst_idx`` are ``[>= batch, stride]`` with one shared row stride.
    """
    p = params or Params(_abi.PLANNED_COPY)
    return p.set(src_idx=ptr(src_idx), dst_idx=ptr(dst_idx), count=ptr(count),
                 num_real=ptr(num_real), src_base=int(src_base), dst_base=int(dst_base),
                 bad=ptr(bad), src_layer_bytes=src_layer_bytes, n_src_rows=n_src_rows,
                 dst_layer_bytes=dst_layer_bytes, n_dst_rows=n_dst_rows,
                 spin_cycles=spin_cycles, plan_stride=_checks.row_stride(src_idx), B=batch,
                 row_bytes=row_bytes, n_layers=n_layers,
                 flags=_abi.COPY_DRY_RUN if dry_run else 0)


def default_copy_grid(batch: int, width: int, n_layers: int = 1) -> int:
    """Enough copy blocks for every entry of ``batch`` rows of ``width``, at most a full GPU."""
    return max(1, min(full_grid(), -(-batch * width * n_layers // COPY_WARPS)))


def launch_copy(params: Params, *, to_host: bool = False, grid: int, stream,
                pdl: bool = False, rows_per_warp: int = 1, thin: bool = False) -> None:
    """Queue ``planned_copy`` with a struct from :func:`copy_params` (stream: a CuPy stream).

    Host -> device only (checked by the caller): ``rows_per_warp``, rows each warp keeps in
    flight (one of :data:`ROWS_PER_WARP`); ``thin``, one-warp blocks of at most
    ``_abi.THIN_COPY_REGS`` registers a thread, short-lived and small, for a side-stream replay
    beside the model's matmuls (measured against the default in ``benchmarks/NOTES.md``,
    "Copies beside compute": better beside a steady matmul loop, worse in the decode step)."""
    B = int(params["B"])
    if B == 0 or params["n_layers"] == 0:
        return
    smem = _abi.smem_bytes("PLANNED_COPY", B=B)
    warps = 1 if thin else COPY_WARPS
    name = _build.COPY_D2H if to_host else _build.COPY_H2D[(rows_per_warp, warps)]
    launch(_build.kernel(name), grid, warps * 32, params, shared_mem=smem, stream=stream,
           pdl=pdl)


def replay_plan(
    plan: MissPlan,
    batch: int,
    *,
    device_rows,
    pool: HostKVPool | None = None,
    layer: int | None = None,
    host_rows: Ptr | None = None,
    n_host_rows: int | None = None,
    num_real=None,
    grid: int | None = None,
    rows_per_warp: int = 1,
    thin: bool = False,
    dry_run: bool = False,
    spin_cycles: int = 0,
    bad=None,
    stream=None,
    pdl: bool | None = None,
) -> None:
    """Replay a recorded miss plan on one layer: host row ``src[b, m]`` -> device row ``dst[b, m]``.

    For every real batch row ``b < min(num_real, batch)`` and entry ``m < count[b]`` (counts are
    clamped to ``[0, plan.width]``), copies that row of the layer's host rows into the layer's
    device rows. The work is spread over the flattened (request, miss) pairs, so any ``grid``
    is balanced whatever the distribution of misses over requests. Queued on ``stream``
    without host synchronization and without allocating: safe inside CUDA-graph capture.

    Parameters
    ----------
    plan : MissPlan
        Written by a swap (``plan.src`` int64 ``[max_batch, width]`` host rows, ``plan.dst``
        int32 device rows, ``plan.count`` int32 ``[max_batch]``); the first ``batch`` rows are
        replayed.
    batch : int
        Batch rows to replay, ``0 <= batch <= plan.max_batch`` (0: nothing is queued).
    device_rows : uint8 ``[D, row_bytes]`` device array (C-contiguous)
        The layer's hot-buffer rows, e.g. ``HotBufferCache.device_rows(layer)``.
    pool, layer : HostKVPool and int
        The source: host rows of ``layer`` in ``pool``. Or give ``host_rows`` (the device
        address of the layer's row 0, a :class:`Ptr`) and ``n_host_rows`` instead.
    num_real : int32 device scalar, optional
        Rows ``>= num_real`` are CUDA-graph padding and copy nothing.
    grid : int, optional
        Blocks of the copy kernel (``COPY_WARPS`` warps each). Default: enough warps for every
        entry of the plan's rows, at most :func:`full_grid`. A small grid leaves SMs to the
        compute a side-stream replay overlaps.
    rows_per_warp : int
        Rows each warp keeps in flight (one of :data:`ROWS_PER_WARP`, default 1): with more,
        fewer blocks keep the link busy.
    thin : bool
        One-warp blocks with capped registers (see :func:`launch_copy`); give a grid of a few
        blocks per SM.
    dry_run : bool
        Do all the work (plan reads, prefix, indexing) but move no bytes; for measuring.
    spin_cycles : int
        Delay each row by this many clock cycles (tests' artificially slowed replay).
    bad : int32 device scalar, optional
        Incremented once per entry whose host or device row is outside its array.
    stream : optional
        Any stream kind :func:`hisparse_cupy._launch.as_stream` accepts (CuPy, PyTorch,
        ``__cuda_stream__``, int handle). Default: CuPy's current stream.
    pdl : bool or None
        Launch with Programmatic Dependent Launch (default: where the device supports it): the
        replay may start while the previous kernel on the stream drains, and waits for it
        before reading the plan.
    """
    if not isinstance(plan, MissPlan):
        raise TypeError(f"plan must be a MissPlan, got {type(plan).__name__}")
    batch = _checks.integer("batch", batch, 0, plan.max_batch)
    s = as_stream(stream)
    with s:  # DLPack imports order on the stream the kernels run on
        dev = _checks.array("device_rows", device_rows, np.uint8, ndim=2)
        nr = None if num_real is None else _checks.device_scalar("num_real", num_real)
        if bad is not None:
            bad = _checks.device_scalar("bad", bad)
    row_bytes = _checks.row_bytes("device_rows row size", dev.shape[1])
    if pool is not None:
        if host_rows is not None or n_host_rows is not None:
            raise ValueError("give either pool and layer, or host_rows and n_host_rows")
        if not isinstance(pool, HostKVPool):
            raise TypeError(f"pool must be a HostKVPool, got {type(pool).__name__}")
        if layer is None:
            raise ValueError("pool needs layer (the layer whose host rows are replayed)")
        host_rows = pool.device_ptr(layer)
        n_host_rows = pool.n_rows
        if pool.row_bytes != row_bytes:
            raise ValueError(f"device_rows rows hold {row_bytes} bytes, the pool's rows "
                             f"{pool.row_bytes}")
    else:
        if layer is not None:
            raise ValueError("layer selects a layer of pool; with host_rows give the layer's "
                             "own address")
        if not isinstance(host_rows, Ptr):
            raise TypeError("give pool and layer, or host_rows as a Ptr (HostKVPool.device_ptr)")
        if n_host_rows is None:
            raise ValueError("host_rows needs n_host_rows (rows at that address)")
        n_host_rows = _checks.integer("n_host_rows", n_host_rows, 0)
    if grid is None:
        grid = default_copy_grid(batch, plan.width)
    else:
        grid = _checks.integer("grid", grid, 1, 2**31 - 1)
    spin_cycles = _checks.integer("spin_cycles", spin_cycles, 0)
    rows_per_warp = _checks.one_of("rows_per_warp", rows_per_warp, ROWS_PER_WARP)
    p = copy_params(plan.src, plan.dst, plan.count, batch, nr, src_base=host_rows,
                    src_layer_bytes=0, n_src_rows=n_host_rows, dst_base=dev.data.ptr,
                    dst_layer_bytes=0, n_dst_rows=dev.shape[0], row_bytes=row_bytes,
                    dry_run=bool(dry_run), spin_cycles=spin_cycles, bad=bad)
    launch_copy(p, grid=grid, stream=s, pdl=resolve_pdl(pdl),
                rows_per_warp=rows_per_warp, thin=bool(thin))
