"""Every bulk move of KV rows between the host pool and GPU memory outside a step's swaps: a
pool's rows as a copy side (:func:`pool_rows`), admission's loads (:func:`load_rows`), a
prefix's partial page (:func:`copy_pool_rows`), and the writes of prompt KV into the pool
(:func:`store_rows` from the GPU, :func:`write_rows_from_host` from host memory). The cache,
residency and PD call these. They read a pool through its rows (``device_ptr(layer)``,
``layer_bytes``, ``n_rows``, ``row_bytes``, ``n_layers``, ``numpy``, ``chunk_edges``: a
:class:`~hisparse_cupy.host.HostKVPool` or anything shaped like one) and never import the pool
class.

Two engines move the bytes: the planned copy (``cu/plan.cu``, :func:`.plan.copy_rows`) for
scattered rows, and the copy engines (``cudaMemcpy2DAsync``) for long runs of consecutive rows
written to the pool (:data:`MIN_RUN_BYTES`).
"""

from __future__ import annotations

import cupy
import numpy as np

from ..host import consecutive_runs
from .plan import Rows, array_rows, copy_rows

__all__ = ["MIN_RUN_BYTES", "copy_pool_rows", "load_rows", "pool_rows", "store_rows",
           "write_rows_from_host"]


def pool_rows(pool, layer: int | None = None) -> Rows:
    """The rows of ``pool`` through its device mapping: every layer, or ``layer``'s."""
    if layer is None:
        return Rows(int(pool.device_ptr(0)), pool.layer_bytes, pool.n_rows)
    return Rows(int(pool.device_ptr(layer)), 0, pool.n_rows)


def copy_pool_rows(pool, copies, stream) -> None:
    """Queue the host -> host copies ``(src_row, dst_row, count)`` of every layer of ``pool``
    (a prefix's partial page) on ``stream``, through the device."""
    for src, dst, cnt in copies:
        with stream:
            s = cupy.arange(src, src + cnt, dtype=cupy.int64).reshape(1, cnt)
            d = cupy.arange(dst, dst + cnt, dtype=cupy.int32).reshape(1, cnt)
            c = cupy.full(1, cnt, cupy.int32)
        copy_rows(s, d, c, src=pool_rows(pool), dst=pool_rows(pool), row_bytes=pool.row_bytes,
                  n_layers=pool.n_layers, stream=stream)


def load_rows(pool, rows, device, dev_rows, stream, count=None) -> None:
    """Queue the copy of host rows ``rows`` into device rows ``dev_rows`` of ``device``
    (uint8 ``[L, D, row_bytes]``), every layer, on ``stream``: host arrays, or device arrays
    (int64 and int32 ``[n]``) made on ``stream``; a -1 source is skipped. ``count``: an int32
    ``[1]`` device array, the first rows copied (read when the copy runs; default all)."""
    n = len(rows)
    with stream:
        src = cupy.asarray(rows, dtype=cupy.int64).reshape(1, n)
        dst = cupy.asarray(dev_rows, dtype=cupy.int32).reshape(1, n)
        cnt = cupy.full(1, n, dtype=cupy.int32) if count is None else count
    copy_rows(src, dst, cnt, src=pool_rows(pool), dst=array_rows(device),
              row_bytes=pool.row_bytes, n_layers=pool.n_layers, stream=stream)


# KV written in runs of consecutive rows of at least this many bytes (per layer, on average)
# goes by the copy engines; shorter runs by the copy kernel (on an H200, 8 requests of 8192
# tokens x 78 layers x 656 B: 2-D copies of whole requests 53.4 GB/s, of 64-row pages 46.0,
# the kernel over the same pages 48.2; cudaMemcpyAsync 55.1: benchmarks/bench_admit.py)
MIN_RUN_BYTES = 64 << 10


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """``[a, b)`` index ranges of ``rows`` over which the rows are consecutive."""
    return list(zip(*(x.tolist() for x in consecutive_runs(rows)), strict=True))


def _copy_to_pool(pool, off: int, src: int, pitch: int, width: int, stream) -> None:
    """Device -> host copies of ``width`` bytes a layer (layer ``l``'s at ``src + l * pitch``)
    to bytes ``[off, off + width)`` of every layer of ``pool``: one 2-D copy per group of
    layers inside one registration of the pool, a layer's bytes cut where edges between
    registrations (``pool.chunk_edges``) fall in them (no cudaMemcpy spans two)."""
    rt, base, LB, L = cupy.cuda.runtime, pool.numpy.ctypes.data, pool.layer_bytes, pool.n_layers
    D2H, s, edges = rt.memcpyDeviceToHost, stream.ptr, pool.chunk_edges
    layer = 0
    while layer < L:
        at = layer * LB + off
        cuts = [e for e in edges if at < e < at + width]
        if cuts:  # this layer's bytes straddle edges: a copy per piece
            cuts = [at, *cuts, at + width]
            for x, y in zip(cuts, cuts[1:], strict=False):
                rt.memcpyAsync(base + x, src + layer * pitch + x - at, y - x, D2H, s)
            layer += 1
            continue
        edge = next((e for e in edges if e > at), None)  # at or past this layer's bytes' end
        stop = L if edge is None else min(L, (edge - off - width) // LB + 1)
        rt.memcpy2DAsync(base + at, LB, src + layer * pitch, pitch, width, stop - layer, D2H, s)
        layer = stop


def store_rows(pool, rows: np.ndarray, kv: cupy.ndarray, stream) -> None:
    """Queue the copy of GPU array ``kv`` (uint8 ``[L, n, row_bytes]``, rows contiguous) into
    host rows ``rows`` of every layer on ``stream``, without synchronizing: one 2-D
    ``cudaMemcpyAsync`` (all layers) per run of consecutive rows where the runs are long
    (:data:`MIN_RUN_BYTES`), else one launch of the package's device -> host copy."""
    n, row = kv.shape[1], pool.row_bytes
    runs = _runs(rows)
    if n * row >= len(runs) * MIN_RUN_BYTES and kv.strides[0] >= n * row:  # 2-D: pitch >= width
        for a, b in runs:
            _copy_to_pool(pool, int(rows[a]) * row, kv.data.ptr + a * row, kv.strides[0],
                          (b - a) * row, stream)
        return
    with stream:
        src = cupy.arange(n, dtype=cupy.int32).reshape(1, n)
        dst = cupy.asarray(np.asarray(rows, np.int64).reshape(1, n))
        cnt = cupy.full(1, n, dtype=cupy.int32)
    copy_rows(src, dst, cnt, src=array_rows(kv), dst=pool_rows(pool), row_bytes=pool.row_bytes,
              n_layers=pool.n_layers, to_host=True, stream=stream)


def write_rows_from_host(pool, rows: np.ndarray, kv: np.ndarray) -> None:
    """The CPU writes host array ``kv`` (``[L, n, row_bytes]``) into host ``rows``, a
    contiguous run of rows at a time (the caller ordered it after the device's reads)."""
    for a, b in _runs(rows):
        r = int(rows[a])
        pool.numpy[:, r: r + (b - a)] = kv[:, a:b]
