"""CPU: the copy engines' writes of admission KV into a pool registered in several chunks
(``host_rows._copy_to_pool``) never span an edge between two registrations (the runtime
rejects a cudaMemcpy that does: seen on an H200) and put every byte where it belongs. The CUDA
runtime is replaced by NumPy copies that record each copy's extent."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("cupy", reason="host_rows imports CuPy (installed in CI, no GPU needed)")


def test_copies_into_a_chunked_pool_split_at_registration_edges(monkeypatch):
    from hisparse_cupy import host_rows

    rng = np.random.default_rng(7)
    extents = []

    def memcpy_async(dst, src, n, kind, stream):
        extents.append((dst, dst + n))
        ctypes.memmove(dst, src, n)

    def memcpy_2d_async(dst, dpitch, src, spitch, width, height, kind, stream):
        extents.append((dst, dst + (height - 1) * dpitch + width))
        for h in range(height):
            ctypes.memmove(dst + h * dpitch, src + h * spitch, width)

    rt = SimpleNamespace(memcpyAsync=memcpy_async, memcpy2DAsync=memcpy_2d_async,
                         memcpyDeviceToHost=2)
    monkeypatch.setattr(host_rows, "cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=rt)))
    stream = SimpleNamespace(ptr=0)
    split = 0
    for _ in range(300):
        L, rows, row = int(rng.integers(1, 6)), int(rng.integers(4, 40)), 16
        LB = rows * row
        host = np.zeros((L, rows, row), np.uint8)
        edges = sorted({int(e) * 16 for e in rng.integers(1, L * LB // 16, rng.integers(0, 4))})
        pool = SimpleNamespace(numpy=host, layer_bytes=LB, n_layers=L, chunk_edges=tuple(edges))
        r0 = int(rng.integers(0, rows))
        n = int(rng.integers(1, rows - r0 + 1))
        src = rng.integers(0, 256, (L, n + int(rng.integers(0, 3)), row), dtype=np.uint8)
        extents.clear()
        host_rows._copy_to_pool(pool, r0 * row, src.ctypes.data, src.strides[0], n * row,
                                stream)
        want = np.zeros_like(host)
        want[:, r0: r0 + n] = src[:, :n]
        np.testing.assert_array_equal(host, want)
        base = host.ctypes.data
        for a, b in extents:
            assert not any(a < base + e < b for e in edges), (edges, a - base, b - base)
        split += len(extents) > 1
    assert split > 50  # many cases needed more than one copy
