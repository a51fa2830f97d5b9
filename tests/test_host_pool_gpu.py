"""GPU: a shared host pool registered by two processes (one host copy of the KV), and a pool
over host memory the caller owns; swaps through a cache over each return the right bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hisparse_cupy.host import _shm as host_shm

from _util import pattern

pytestmark = pytest.mark.gpu

L, R, MAX_LEN, ROW, H, K = 2, 2, 512, 656, 64, 32


def _swap_bytes_ok(cache, rid: int, n: int, rng) -> bool:
    """Admitted request ``rid`` (length n, host rows already written): a swap returns rows
    holding pattern(layer, rid * MAX_LEN + token)."""
    import cupy

    req = cupy.asarray([rid], dtype=cupy.int32)
    lens = cupy.asarray([n], dtype=cupy.int32)
    topk = rng.choice(n - 1, K, replace=False).astype(np.int32)[None]
    step = cache.begin_step(req, lens)
    ok = True
    for layer in range(L):
        got = cupy.asnumpy(step.swap(layer, cupy.asarray(topk)))
        rows = cupy.asnumpy(cache.device_rows(layer)[cupy.asarray(got[0])])
        ok &= bool((rows == pattern(layer, rid * MAX_LEN + topk[0], ROW)).all())
    return ok


def test_two_processes_share_one_pool(rng):
    from hisparse_cupy import HostKVPool, HotBufferCache

    name = f"hs-gpu-test-{os.getpid()}"
    with HostKVPool(L, R * MAX_LEN, ROW, shared_name=name) as pool:
        n = 400
        for layer in range(L):  # request slot 0's prefill, written once on the host
            pool.layer(layer)[:n] = pattern(layer, np.arange(n), ROW)
        cache = HotBufferCache(n_layers=L, max_requests=R, max_len=MAX_LEN, row_bytes=ROW,
                               hot_size=H, top_k=K, extra_page=4, pool=pool)
        assert cache.admit(n) == 0  # its host rows are already there
        assert _swap_bytes_ok(cache, 0, n, rng)
        # another process attaches (registers the same pages for its GPU context), swaps
        # request slot 0 from the rows written here, and writes request slot 1's prefill from
        # its GPU into the shared rows, which this process then swaps
        code = textwrap.dedent(f"""
            import sys, numpy as np, cupy
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            from hisparse_cupy import HostKVPool, HotBufferCache
            from test_host_pool_gpu import _swap_bytes_ok, L, MAX_LEN, ROW, H, K, R
            from _util import pattern
            pool = HostKVPool.attach({name!r}, {L}, {R * MAX_LEN}, {ROW})
            c = HotBufferCache(n_layers=L, max_requests=R, max_len=MAX_LEN, row_bytes=ROW,
                               hot_size=H, top_k=K, extra_page=4, pool=pool)
            assert c.admit({n}) == 0
            assert _swap_bytes_ok(c, 0, {n}, np.random.default_rng(1)), "process B, slot 0"
            kv = np.stack([pattern(l, MAX_LEN + np.arange(300), ROW) for l in range(L)])
            assert c.admit(300, kv=cupy.asarray(kv)) == 1  # device -> shared host rows
            cupy.cuda.Device().synchronize()
            c.close(); pool.close()
            print("B ok")
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0 and "B ok" in r.stdout, r.stdout + r.stderr
        assert cache.admit(300) == 1  # rows written by the other process's GPU
        assert _swap_bytes_ok(cache, 1, 300, rng)
        cache.close()
    assert not os.path.exists(host_shm.path(name))


def test_pool_over_caller_owned_memory(rng):
    from hisparse_cupy import HostKVPool, HotBufferCache

    buf = np.empty((L, R * MAX_LEN, ROW), np.uint8)
    n = 300
    for layer in range(L):
        buf[layer, :n] = pattern(layer, np.arange(n), ROW)
    pool = HostKVPool.from_buffer(buf)
    cache = HotBufferCache(n_layers=L, max_requests=R, max_len=MAX_LEN, row_bytes=ROW,
                           hot_size=H, top_k=K, extra_page=4, pool=pool)
    assert cache.admit(n) == 0
    assert _swap_bytes_ok(cache, 0, n, rng)
    cache.close()
    assert not pool.closed  # the cache does not close a pool it was given
    pool.close()
    small = np.empty((L, 100, ROW), np.uint8)
    with HostKVPool.from_buffer(small) as p:
        with pytest.raises(ValueError, match="the cache needs 2 layers of at least 1024 rows"):
            HotBufferCache(n_layers=L, max_requests=R, max_len=MAX_LEN, row_bytes=ROW,
                           hot_size=H, top_k=K, pool=p)


def test_a_pool_registered_in_chunks_reads_right_across_their_edges(rng, monkeypatch):
    """Chunks of 1 MiB: layer 1 straddles a chunk edge. Swaps through a cache and a kernel's
    loads across the edge return the host's bytes; with chunks of 256 KiB, an admission's 2-D
    copies (split at every edge: a cudaMemcpy spanning two registrations is refused) put every
    byte in place. For the private mmap pool, the shared pool and the cudaHostAlloc one (one
    allocation, nothing registered)."""
    import cupy

    from hisparse_cupy import HotBufferCache
    from hisparse_cupy.host import _pool as hp

    monkeypatch.setattr(hp, "_REGISTER_CHUNK", 1 << 20)  # the pool: 1.34 MB
    sizes, register = [], hp._register
    monkeypatch.setattr(hp, "_register", lambda p, n: sizes.append(n) or register(p, n))
    for kw in ({"alloc": "mmap"}, {"shared_name": f"hs-gpu-chunks-{os.getpid()}"},
               {"alloc": "cuda"}):
        sizes.clear()
        with hp.HostKVPool(L, R * MAX_LEN, ROW, **kw) as pool:
            assert len(sizes) == (0 if kw.get("alloc") == "cuda" else 2), (kw, sizes)
            n = 500
            for layer in range(L):  # every request slot's prefill, written on the host
                pool.layer(layer)[:] = pattern(layer, np.arange(R * MAX_LEN), ROW)
            cache = HotBufferCache(n_layers=L, max_requests=R, max_len=MAX_LEN, row_bytes=ROW,
                                   hot_size=H, top_k=K, extra_page=4, pool=pool)
            for rid in range(R):
                assert cache.admit(n) == rid
                assert _swap_bytes_ok(cache, rid, n, rng), (kw, rid)
            cache.close()
            edge = (1 << 20) - 4096  # a window of 8 KiB over the chunk edge
            host = pool.numpy.reshape(-1)[edge: edge + 8192]
            mem = cupy.cuda.UnownedMemory(int(pool.device_ptr(0)) + edge, 8192, pool,
                                          device_id=cupy.cuda.Device().id)
            win = cupy.ndarray((8192,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
            assert (cupy.asnumpy(win.astype(cupy.uint16)) == host).all(), kw  # kernel loads
            assert pool.chunk_edges == (() if kw.get("alloc") == "cuda" else (1 << 20,))
        # admission by the copy engines into a pool of six chunks: an edge falls inside each
        # layer's rows of the request, and the layers lie in different chunks
        monkeypatch.setattr(hp, "_REGISTER_CHUNK", 1 << 18)
        with hp.HostKVPool(L, R * MAX_LEN, ROW, **kw) as pool:
            cache = HotBufferCache(n_layers=L, max_requests=R, max_len=MAX_LEN, row_bytes=ROW,
                                   hot_size=H, top_k=K, extra_page=4, pool=pool,
                                   page_tokens=16)
            n = MAX_LEN - 16
            kv = np.stack([pattern(layer, 10**6 + np.arange(n), ROW) for layer in range(L)])
            rid = cache.admit(n, cupy.asarray(kv))
            cupy.cuda.Device().synchronize()
            rows = cache.host.rows(rid, 0, n)
            assert (pool.numpy[:, rows] == kv).all(), kw
            assert len(pool.chunk_edges) == (0 if kw.get("alloc") == "cuda" else 5), kw
            cache.close()
        monkeypatch.setattr(hp, "_REGISTER_CHUNK", 1 << 20)


@pytest.mark.parametrize("mode", ["relaxed", "global"])
@pytest.mark.parametrize("alloc", ["mmap", "cuda"])
def test_a_pool_collected_while_a_stream_captures_leaves_the_capture_whole(mode, alloc):
    """The collector may run inside an engine's graph capture (any stream, either capture
    mode): a pool collected unclosed there must make no CUDA call (a device synchronization
    invalidates the capture), and is released at the next safe point."""
    import gc

    import cupy

    from hisparse_cupy import HostKVPool

    rt = cupy.cuda.runtime
    HostKVPool.release_collected()  # (pools earlier tests dropped)
    pool = HostKVPool(1, 64, 64, alloc=alloc)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:  # every array filled on the stream the graph runs on
        x = cupy.arange(1, 9, dtype=cupy.int32)
        y = cupy.full(8, -1, cupy.int32)
        cupy.multiply(x, 2, out=y)  # (its kernel loaded before the capture)
        y.fill(-1)
    s.synchronize()
    s.begin_capture(rt.streamCaptureModeRelaxed if mode == "relaxed"
                    else rt.streamCaptureModeGlobal)
    with s:
        cupy.multiply(x, 2, out=y)
    del pool
    gc.collect()
    graph = s.end_capture()  # raised before: the capture was invalidated
    graph.launch(s)
    s.synchronize()
    assert (cupy.asnumpy(y) == 2 * np.arange(1, 9)).all()
    assert HostKVPool.release_collected() >= 1  # this one (and any the collector added)
