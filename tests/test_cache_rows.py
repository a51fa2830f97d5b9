"""CPU: the copy engines' writes of admission KV into a pool registered in several chunks
(``_kernels/rows.py``'s ``_copy_to_pool``) never span an edge between two registrations (the
runtime rejects a cudaMemcpy that does: seen on an H200) and put every byte where it belongs.
The CUDA runtime is replaced by NumPy copies that record each copy's extent."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("cupy", reason="imports CuPy (installed in CI, no GPU needed)")


def test_copies_into_a_chunked_pool_split_at_registration_edges(monkeypatch):
    from hisparse_cupy._kernels import rows as movers

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
    monkeypatch.setattr(movers, "cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=rt)))
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
        movers._copy_to_pool(pool, r0 * row, src.ctypes.data, src.strides[0], n * row, stream)
        want = np.zeros_like(host)
        want[:, r0: r0 + n] = src[:, :n]
        np.testing.assert_array_equal(host, want)
        base = host.ctypes.data
        for a, b in extents:
            assert not any(a < base + e < b for e in edges), (edges, a - base, b - base)
        split += len(extents) > 1
    assert split > 50  # many cases needed more than one copy


def test_the_device_page_table_follows_the_host_pages(monkeypatch):
    """CacheRows' device tables (page table, own_from), written on the stream by admit, grow
    and release, equal its HostPages' state after every operation of a random run (forks,
    engine pages, growth of one page and of many, no-op growth, releases), and ``check``
    agrees; CuPy replaced by NumPy (the same writes, without a device)."""
    import contextlib

    from hisparse_cupy import _cache_rows as cache_rows
    from hisparse_cupy.host._pages import PoolExhausted

    shim = SimpleNamespace(asarray=np.asarray, zeros=np.zeros, full=np.full, int32=np.int32,
                           int64=np.int64,
                           asnumpy=np.asarray, cuda=SimpleNamespace(Event=object))
    monkeypatch.setattr(cache_rows, "cupy", shim)

    class NoFences:  # no events without a device: pages carry none, takers wait for none
        fence = staticmethod(contextlib.contextmanager(lambda stream: (yield None)))
        waiter = staticmethod(lambda stream: None)

    monkeypatch.setattr(cache_rows, "StreamOrder", NoFences)
    rng = np.random.default_rng(11)
    R, max_len, P = 6, 300, 8
    pool = SimpleNamespace(n_rows=40 * P)
    hr = cache_rows.CacheRows(R, max_len, pool, page_tokens=P)
    stream = contextlib.nullcontext()
    live: dict[int, int] = {}  # rid -> tokens its steps may have
    ops = 0
    for _ in range(3000):
        free = [r for r in range(R) if r not in live]
        op = rng.random()
        pages = None
        try:
            if free and op < 0.3:
                rid, n = free[0], int(rng.integers(1, 120))
                prefix = None
                if live and rng.random() < 0.4:
                    parent = int(rng.choice(list(live)))
                    p = int(rng.integers(1, hr._written[parent] + 1))
                    prefix, n = (parent, p), max(n, p)
                elif rng.random() < 0.2:
                    pages = hr.pages.take(int(rng.integers(0, n // P + 1)))
                assert hr.shared_tokens(n, prefix, pages) <= n
                hr.admit(rid, n, prefix, pages, stream)
                if pages:
                    hr.pages.put(pages)  # the engine drops its hold: the request keeps them
                live[rid] = n
            elif live and op < 0.4:
                rid = int(rng.choice(list(live)))
                hr.release(rid, stream)
                del live[rid]
            elif live:
                rid = int(rng.choice(list(live)))
                n = min(max_len, live[rid] + int(rng.choice([-3, 0, 1, 1, 1, 9, 40])))
                hr.grow(rid, max(1, n), stream)
                live[rid] = max(live[rid], n)
        except PoolExhausted:  # nothing taken by the admission: the engine drops its pages
            if pages and rid not in live:
                hr.pages.put(pages)
        ops += 1
        hr.pages.check()
        for r in range(R):
            if r in live:
                pg = hr.pages.pages(r)
                assert hr.table[r, :len(pg)].tolist() == pg
                assert (hr.table[r, len(pg):] == -1).all()
                assert hr.own_from[r] == hr.pages.own_from(r)
                assert hr.pages.tokens(r) >= live[r]
            else:
                assert (hr.table[r] == -1).all() and hr.own_from[r] == 0
        if live:
            hr.check(list(live), [live[r] for r in live])
    assert ops == 3000
    if not live:
        hr.admit(0, 10, None, None, stream)
        live[0] = 10
    rid = next(iter(live))
    hr.table[rid, 0] += 1  # a table that disagrees: check names the slot
    with pytest.raises(ValueError, match=f"request slot {rid}: the device page table"):
        hr.check([rid], [1])


def test_the_default_paged_pool_holds_every_slot_at_max_len():
    """A paged pool the cache makes holds every request slot at max_len tokens in whole pages
    (max_len 64 in pages of 3: 22 pages a slot, not 128 rows' 43 for two slots)."""
    from hisparse_cupy._cache_rows import default_pool_rows

    assert default_pool_rows(2, 64, 3) == 2 * 22 * 3 == 132
    assert default_pool_rows(2, 64, 16) == 128 and default_pool_rows(5, 1, 8) == 40
    rng = np.random.default_rng(3)
    for _ in range(200):
        R, n, P = (int(x) for x in rng.integers(1, [9, 300, 40]))
        rows = default_pool_rows(R, n, P)
        assert rows % P == 0 and rows // P == R * -(-n // P) and rows >= R * n
