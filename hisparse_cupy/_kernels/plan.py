"""Miss plans and the planned copy.

A :class:`MissPlan` records the copies a swap made: for batch row ``b``, entries
``0 <= m < count[b]`` say "host row ``src[b, m]`` went to device row ``dst[b, m]``". Device rows
of a request are the same in every layer, so a full layer's plan can be replayed for other
layers (IndexCache shared layers) with :func:`replay_plan`.

The planned copy is the one kernel every bulk row move of the package goes through (swap misses,
replays, admission loads, backups), in stages: its two sides named as :class:`Rows`
(:func:`.rows.pool_rows`, :func:`array_rows`), a struct from :func:`copy_struct` (a per-layer
template, or a one-off), queued by :func:`launch_copy` (:func:`copy_rows` does both). This module
alone knows the copy's launch: its instances, block, shared memory and grid rule
(:func:`copy_launcher`, :func:`default_copy_grid`, :func:`full_grid`).

:func:`launch_copy` calls :data:`copy_queue`, the production :func:`queue_copy`, which consults
nothing; a measuring probe (:mod:`hisparse_cupy.testing.probe`) replaces it while it is active.
Copies queued straight through a :func:`copy_launcher` (the Step's swaps) are never probed.
"""

from __future__ import annotations

from typing import NamedTuple

import cupy
import numpy as np

from .. import _abi, _checks
from .._checks import ArrayLike, StreamLike
from .._device import Ptr
from . import build
from .launch import Launcher, Params, as_stream, launcher, ptr, resolve_pdl, sm_count

ROWS_PER_WARP = build.COPY_ROWS_PER_WARP  # the host -> device copy's choices
_COPY_BLOCK = _abi.COPY_WARPS * 32  # threads of a copy block
_COPY_BLOCKS_PER_SM = 2048 // _COPY_BLOCK


def full_grid() -> int:
    """Blocks of the copy kernel that fill every SM of the current device."""
    return sm_count() * _COPY_BLOCKS_PER_SM


def default_copy_grid(batch: int, width: int, n_layers: int = 1) -> int:
    """Enough copy blocks for every entry of ``batch`` rows of ``width``, at most a full GPU."""
    return max(1, min(full_grid(), -(-batch * width * n_layers // _abi.COPY_WARPS)))


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


class Rows(NamedTuple):
    """One side of a planned copy: ``base``, the address of layer 0's row 0 as the device sees
    it; ``layer_bytes`` between layers (0: one layer); ``n_rows`` per layer (indices outside
    ``[0, n_rows)`` are skipped)."""

    base: int
    layer_bytes: int
    n_rows: int


def array_rows(a: cupy.ndarray) -> Rows:
    """The rows of device array ``a``: uint8 ``[D, row_bytes]`` (one layer) or ``[L, D,
    row_bytes]`` (every layer, ``strides[0]`` apart)."""
    if a.ndim == 2:
        return Rows(a.data.ptr, 0, a.shape[0])
    return Rows(a.data.ptr, a.strides[0], a.shape[1])


def copy_struct(src_idx: cupy.ndarray, dst_idx: cupy.ndarray, count: cupy.ndarray, *,
                src: Rows, dst: Rows, row_bytes: int, batch: int | None = None,
                num_real: cupy.ndarray | None = None, n_layers: int = 1,
                into: Params | None = None) -> Params:
    """The ``planned_copy`` struct of a plan (arguments already validated by the caller): for
    each of ``batch`` rows (default ``count``'s), ``count[b]`` entries of ``src_idx`` /
    ``dst_idx`` (``[>= batch, stride]``, one row stride) from ``src``'s rows to ``dst``'s, in
    each of ``n_layers`` layers; ``into``: a struct to fill instead of a new one."""
    p = into or Params(_abi.PLANNED_COPY)
    return p.set(src_idx=ptr(src_idx), dst_idx=ptr(dst_idx), count=ptr(count),
                 num_real=ptr(num_real), src_base=int(src.base), dst_base=int(dst.base),
                 src_layer_bytes=src.layer_bytes, n_src_rows=src.n_rows,
                 dst_layer_bytes=dst.layer_bytes, n_dst_rows=dst.n_rows,
                 plan_stride=_checks.row_stride(src_idx),
                 B=count.shape[0] if batch is None else batch, row_bytes=row_bytes,
                 n_layers=n_layers)


def copy_rows(src_idx: cupy.ndarray, dst_idx: cupy.ndarray, count: cupy.ndarray, *, src: Rows,
              dst: Rows, row_bytes: int, stream, batch: int | None = None, num_real=None,
              n_layers: int = 1, to_host: bool = False, grid: int | None = None,
              pdl: bool = False, rows_per_warp: int = 1) -> None:
    """Queue the planned copy of :func:`copy_struct`'s arguments on CuPy stream ``stream``
    (``grid`` default: :func:`default_copy_grid` of the plan's rows; the rest as in
    :func:`copy_launcher`)."""
    p = copy_struct(src_idx, dst_idx, count, src=src, dst=dst, row_bytes=row_bytes,
                    batch=batch, num_real=num_real, n_layers=n_layers)
    if grid is None:
        grid = default_copy_grid(int(p["B"]), src_idx.shape[1], n_layers)
    launch_copy(p, to_host=to_host, grid=grid, stream=stream, pdl=pdl,
                rows_per_warp=rows_per_warp)


class CopyLaunch(NamedTuple):
    """A planned copy's launch: the :class:`~hisparse_cupy._kernels.launch.Launcher` and its
    grid (a 3-tuple)."""

    launcher: Launcher
    grid: tuple[int, int, int]


_launchers: dict[tuple, Launcher] = {}


def copy_launcher(batch: int, *, to_host: bool = False, rows_per_warp: int = 1,
                  pdl: bool = False) -> Launcher:
    """The cached :class:`~hisparse_cupy._kernels.launch.Launcher` of the planned copy of up to
    ``batch`` rows on the current device: ``la((grid, 1, 1), stream_ptr, params.addr)`` queues
    it with a struct from :func:`copy_struct` whose ``B`` is at most ``batch``.

    ``to_host``: device rows (int32) -> host rows (int64), else host -> device; ``rows_per_warp``:
    rows each warp of a host -> device copy keeps in flight (one of :data:`ROWS_PER_WARP`; more
    let fewer blocks keep the link busy); ``pdl``: already resolved
    (:func:`hisparse_cupy._kernels.launch.resolve_pdl`).
    """
    key = (batch, to_host, rows_per_warp, pdl, cupy.cuda.runtime.getDevice())
    la = _launchers.get(key)
    if la is None:
        la = _launchers[key] = copy_kernel_launcher(instance(to_host, rows_per_warp), batch, pdl)
    return la


def instance(to_host: bool, rows_per_warp: int, table: dict | None = None) -> str:
    """The copy instance's name: device -> host, or host -> device with ``rows_per_warp`` from
    ``table`` (default :data:`hisparse_cupy._kernels.build.COPY_H2D`)."""
    if to_host:
        if rows_per_warp != 1:
            raise ValueError("the device -> host copy moves one row per warp")
        return build.COPY_D2H
    table = build.COPY_H2D if table is None else table
    if rows_per_warp not in table:
        raise ValueError(f"rows_per_warp must be one of {ROWS_PER_WARP}, got {rows_per_warp}")
    return table[rows_per_warp]


def copy_kernel_launcher(name: str, batch: int, pdl: bool) -> Launcher:
    """A new launcher of copy instance ``name`` for up to ``batch`` rows: one block of
    COPY_WARPS warps; shared memory: the prefix of the batch's counts."""
    return launcher(build.kernel(name), _COPY_BLOCK, _abi.smem_bytes("PLANNED_COPY", B=batch),
                    pdl)


def queue_copy(params: Params, B: int, to_host: bool, grid: int, stream_ptr: int, pdl: bool,
               rows_per_warp: int) -> None:
    """The production queueing of a copy struct (see :data:`copy_queue`)."""
    copy_launcher(B, to_host=to_host, rows_per_warp=rows_per_warp, pdl=pdl)(
        (grid, 1, 1), stream_ptr, params.addr)


# What :func:`launch_copy` calls: :func:`queue_copy`, nothing consulted. A measuring probe
# (hisparse_cupy.testing.probe) puts its own function here while one is active, and puts this
# one back when the last ends.
copy_queue = queue_copy


def launch_copy(params: Params, *, to_host: bool = False, grid: int, stream,
                pdl: bool = False, rows_per_warp: int = 1) -> None:
    """Queue the planned copy of a struct from :func:`copy_struct` (``grid`` blocks, ``stream``
    a CuPy stream; the other arguments as in :func:`copy_launcher`). Nothing is queued for a
    struct with no rows or no layers."""
    B = int(params["B"])
    if B == 0 or params["n_layers"] == 0:
        return
    copy_queue(params, B, to_host, grid, stream.ptr, pdl, rows_per_warp)


def replay_plan(
    plan: MissPlan,
    batch: int,
    *,
    device_rows: ArrayLike,
    pool=None,
    layer: int | None = None,
    host_rows: Ptr | None = None,
    n_host_rows: int | None = None,
    num_real: ArrayLike | None = None,
    grid: int | None = None,
    rows_per_warp: int = 1,
    stream: StreamLike | None = None,
    pdl: bool | None = None,
) -> None:
    """Replay a recorded miss plan on one layer: host row ``src[b, m]`` -> device row ``dst[b, m]``.

    For every real batch row ``b < min(num_real, batch)`` and entry ``m < count[b]`` (counts are
    clamped to ``[0, plan.width]``), copies that row of the layer's host rows into the layer's
    device rows; an entry whose host or device row is outside its array is skipped. The work is
    spread over the flattened (request, miss) pairs, so any ``grid`` is balanced whatever the
    distribution of misses over requests. Queued on ``stream`` without host synchronization
    and without allocating: safe inside CUDA-graph capture. (Measuring a replay: dry runs,
    slowed rows and counted bad entries are :func:`hisparse_cupy.testing.probe.copy_probe`'s.)

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
        Blocks of the copy kernel (``_abi.COPY_WARPS`` warps each). Default: enough warps for
        every entry of the plan's rows, at most :func:`full_grid`. A small grid leaves SMs to
        the compute a side-stream replay overlaps.
    rows_per_warp : int
        Rows each warp keeps in flight (one of :data:`ROWS_PER_WARP`, default 1): with more,
        fewer blocks keep the link busy.
    stream : optional
        Any stream kind :func:`hisparse_cupy._kernels.launch.as_stream` accepts (CuPy, PyTorch,
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
    row_bytes = _checks.row_bytes("device_rows row size", dev.shape[1])
    if pool is not None:
        if host_rows is not None or n_host_rows is not None:
            raise ValueError("give either pool and layer, or host_rows and n_host_rows")
        if not all(hasattr(pool, a) for a in ("device_ptr", "n_rows", "row_bytes")):
            raise TypeError(f"pool must be a HostKVPool (its device_ptr, n_rows, row_bytes), "
                            f"got {type(pool).__name__}")
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
    rows_per_warp = _checks.one_of("rows_per_warp", rows_per_warp, ROWS_PER_WARP)
    copy_rows(plan.src, plan.dst, plan.count, src=Rows(int(host_rows), 0, n_host_rows),
              dst=array_rows(dev), row_bytes=row_bytes, batch=batch, num_real=nr, grid=grid,
              stream=s, pdl=resolve_pdl(pdl), rows_per_warp=rows_per_warp)
