"""GPU: host pool and HotBufferCache through a request's whole life, bytes checked."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

L, R, H, K, P, MAXLEN, ROW = 3, 4, 64, 32, 4, 512, 656


def kv_for(rid, start, n):
    from _util import pattern

    ids = rid * MAXLEN + np.arange(start, start + n)
    return np.stack([pattern(layer, ids, ROW) for layer in range(L)])


def check_rows(cache, layer, rid, tokens, locs):
    import cupy

    from _util import pattern

    locs = np.asarray(locs)
    assert (locs >= 0).all()
    got = cupy.asnumpy(cache.device_rows(layer)[cupy.asarray(locs)])
    want = pattern(layer, rid * MAXLEN + np.asarray(tokens), ROW)
    bad = np.nonzero((got != want).any(axis=1))[0]
    assert bad.size == 0, f"layer {layer}: tokens {np.asarray(tokens)[bad][:5]} hold wrong bytes"


def test_host_pool_views_pointer_and_close():
    from hisparse_cupy import HostKVPool

    with HostKVPool(2, 10, 656) as pool:
        assert pool.numpy.shape == (2, 10, 656)
        assert pool.layer(1).shape == (10, 656)
        assert int(pool.device_ptr(0)) % 16 == 0
        assert int(pool.device_ptr(1)) - int(pool.device_ptr(0)) == 10 * 656
        pool.layer(1)[3] = 7
        assert pool.numpy[1, 3, 0] == 7
        with pytest.raises(ValueError, match="layer must be <= 1"):
            pool.layer(2)
    assert pool.closed
    with pytest.raises(RuntimeError, match="closed"):
        pool.layer(0)
    with pytest.raises(ValueError, match="row_bytes must be a multiple of 16"):
        HostKVPool(1, 10, 650)


def test_request_lifecycle_through_crossing_h(rng):
    import cupy

    from hisparse_cupy import HotBufferCache
    from hisparse_cupy import reference as ref

    cache = HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=ROW,
                           hot_size=H, top_k=K, extra_page=P, max_batch=R)
    n0 = 40
    rid = cache.admit(n0, kv=kv_for(0, 0, n0))
    rid2 = cache.admit(300, kv=kv_for(1, 0, 300), warm_tokens=[5, 17, 200])
    assert (rid, rid2) == (0, 1)
    req = cupy.asarray([rid, rid2], dtype=cupy.int32)
    seq = n0
    seq2 = 300
    for step in range(130):  # crosses H = 64 for request 0
        lens = cupy.asarray([seq, seq2], dtype=cupy.int32)
        if step:  # the model writes this step's token into the newest row of every layer
            rows = cupy.asnumpy(cache.begin_step(req, lens).newest_rows())
            for layer in range(L):
                cache.device_rows(layer)[int(rows[0])] = cupy.asarray(
                    kv_for(0, seq - 1, 1)[layer, 0])
                cache.device_rows(layer)[int(rows[1])] = cupy.asarray(
                    kv_for(1, seq2 - 1, 1)[layer, 0])
            cache.begin_step(req, lens).backup_newest()
        topk = np.stack([
            rng.choice(seq, size=min(K, seq), replace=False).astype(np.int32).tolist()
            + [-1] * (K - min(K, seq)),
            rng.choice(seq2, size=K, replace=False).astype(np.int32),
        ]).astype(np.int32)
        topk[0, 0] = seq - 1  # always select the newest token
        for layer in range(L):
            out = cupy.asnumpy(cache.begin_step(req, lens).swap(layer, cupy.asarray(topk),
                                                                check=True))
            for b, r in enumerate((rid, rid2)):
                sel = topk[b] >= 0
                check_rows(cache, layer, r, topk[b][sel], out[b][sel])
            st = cache.state(layer)
            ref.check_invariants(cupy.asnumpy(st.slot_tokens), cupy.asnumpy(st.slot_locs),
                                 cupy.asnumpy(st.lru), H, requests=[rid, rid2])
        seq += 1
        seq2 += 1
    assert seq > H + 60
    cache.release(rid)
    assert cache.active == {rid2: 300}
    assert (cupy.asnumpy(cache.tables.slot_tokens[:, rid]) == -1).all()
    assert (cupy.asnumpy(cache.host_locs[rid]) == -1).all()
    assert cache.admit(10, kv=kv_for(0, 0, 10)) == rid  # the slot is reused, reset
    cache.close()


def test_cache_errors():
    from hisparse_cupy import HotBufferCache

    with pytest.raises(ValueError, match="top_k must be <= 64"):  # K <= H
        HotBufferCache(n_layers=1, max_requests=1, max_len=100, row_bytes=656, hot_size=64,
                       top_k=65)
    with pytest.raises(ValueError, match="needs .* bytes of shared memory per block"):
        HotBufferCache(n_layers=1, max_requests=1, max_len=100, row_bytes=656, hot_size=16384,
                       top_k=8192)
    with pytest.raises(ValueError, match="max_steps >= 2 needs token_table=True"):
        HotBufferCache(n_layers=1, max_requests=1, max_len=100, row_bytes=656, hot_size=64,
                       top_k=32, max_steps=2, token_table=False)
    cache = HotBufferCache(n_layers=1, max_requests=1, max_len=100, row_bytes=656, hot_size=64,
                           top_k=32, extra_page=4)
    with pytest.raises(ValueError, match="n_tokens must be <= 100"):
        cache.admit(101)
    with pytest.raises(ValueError, match="warm_tokens must lie in"):
        cache.admit(90, warm_tokens=[89])
    with pytest.raises(ValueError, match="warm_tokens applies only"):
        cache.admit(10, warm_tokens=[1])
    with pytest.raises(ValueError, match=r"kv must be uint8 \[1, n, 656\]"):
        cache.admit(10, kv=np.zeros((1, 10, 640), np.uint8))
    with pytest.raises(ValueError, match=r"kv must hold the 10 rows being admitted"):
        cache.admit(10, kv=np.zeros((1, 9, 656), np.uint8))  # would leave a row unwritten
    rid = cache.admit(10)
    from hisparse_cupy import PoolExhausted, SlotsExhausted

    with pytest.raises(SlotsExhausted, match="all 1 request slots are in use") as e:
        cache.admit(10)
    assert e.value.max_requests == 1 and not isinstance(e.value, PoolExhausted)
    cache.release(rid)
    with pytest.raises(ValueError, match="is not admitted"):
        cache.release(rid)
    cache.close()


def test_engine_owned_device_rows_and_pool(rng):
    """Device rows the engine allocated (any DLPack exporter; more rows than needed) and a host
    pool it registered: used in place, no copy; swaps return the right bytes."""
    import cupy

    from hisparse_cupy import HostKVPool, HotBufferCache

    D = HotBufferCache.rows_needed(max_requests=R, hot_size=H, top_k=K, extra_page=P)
    assert D == R * (H + P)
    rows = cupy.full((L, D + 7, ROW), 0xA5, cupy.uint8)  # poisoned, with spare rows

    class Exporter:  # a foreign framework's tensor: DLPack only
        def __dlpack__(self, **kw):
            return rows.__dlpack__(**kw)

        def __dlpack_device__(self):
            return rows.__dlpack_device__()

    host = np.empty((L, R * MAXLEN, ROW), np.uint8)
    with HostKVPool.from_buffer(host) as pool:
        cache = HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=ROW,
                               hot_size=H, top_k=K, extra_page=P, pool=pool,
                               device_rows=Exporter())
        assert cache.device.data.ptr == rows.data.ptr and cache.pool is pool
        n = 200
        rid = cache.admit(n, kv=kv_for(2, 0, n))
        req = cupy.asarray([rid], dtype=cupy.int32)
        lens = cupy.asarray([n], dtype=cupy.int32)
        for _ in range(3):
            topk = rng.choice(n, size=K, replace=False).astype(np.int32)
            for layer in range(L):
                locs = cupy.asnumpy(cache.begin_step(req, lens).swap(layer,
                                                                     cupy.asarray(topk[None])))[0]
                assert (locs >= 0).all() and (locs < D).all()
                got = cupy.asnumpy(rows[layer][cupy.asarray(locs)])  # the engine's own array
                assert (got == kv_for(2, 0, n)[layer][topk]).all()
        assert (cupy.asnumpy(rows[:, D:]) == 0xA5).all()  # the spare rows are untouched
        cache.release(rid)
        cupy.cuda.get_current_stream().synchronize()
    with pytest.raises(ValueError, match="device_rows holds 10 rows per layer"):
        HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=ROW, hot_size=H,
                       top_k=K, extra_page=P, device_rows=cupy.empty((L, 10, ROW), cupy.uint8))
    with pytest.raises(ValueError, match=r"device_rows must have shape \(3, \*, 656\)"):
        HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=ROW, hot_size=H,
                       top_k=K, extra_page=P, device_rows=cupy.empty((L, D, 640), cupy.uint8))
    with pytest.raises(TypeError, match="device_rows must have dtype uint8"):
        HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=ROW, hot_size=H,
                       top_k=K, extra_page=P, device_rows=cupy.empty((L, D, ROW // 4), cupy.int32))


@pytest.mark.parametrize("prefetch", [False, True])
def test_multistep_with_fewer_entries_than_top_k(rng, prefetch):
    """A [B, S, K] call with K < the cache's top_k (through a step, and through a Prefetcher):
    the output is dense per row and every entry points at its token's bytes."""
    import cupy

    from hisparse_cupy import HotBufferCache, Prefetcher

    cache = HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=ROW,
                           hot_size=H, top_k=K, extra_page=P, max_steps=2)
    n = 300
    rid = cache.admit(n, kv=kv_for(0, 0, n))
    s = cupy.cuda.Stream(non_blocking=True)
    pf = Prefetcher(cache, "FSS") if prefetch else None
    req = cupy.asarray([rid], dtype=cupy.int32)
    lens = cupy.asarray([n], dtype=cupy.int32)
    k = K // 2
    for _ in range(3):
        topk = np.stack([rng.choice(n - 1, k, replace=False) for _ in range(2)]).astype(np.int32)
        with s:  # the top-k upload and the reads of the outputs are ordered on the step's stream
            step = cache.begin_step(req, lens, stream=s, prefetcher=pf)
            for layer in range(L):
                out = step.swap(layer, cupy.asarray(topk[None]))
                assert out.shape == (1, 2, k) and out.flags.c_contiguous
                locs = cupy.asnumpy(out)[0]
                for st in range(2):
                    check_rows(cache, layer, 0, topk[st], locs[st])
            step.finish()
        s.synchronize()
    cache.close()


def test_layer_tables_are_every_table_and_release_resets_them(rng):
    """``tables.named()`` is the one list of per-layer tables: it names every ``[L, R, ...]``
    array of the cache and of its tables, and a slot released after single- and multi-step swaps
    holds in every
    one of them what a slot released unused holds (token -> slot entries excepted: they are
    never trusted without the slot table)."""
    import cupy

    from hisparse_cupy import HotBufferCache

    def build():
        return HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=ROW,
                              hot_size=H, top_k=K, extra_page=P, max_steps=2)

    used, unused = build(), build()
    n = 300
    per_layer = {k for obj in (used, used.tables) for k, v in vars(obj).items()
                 if isinstance(v, cupy.ndarray) and v.ndim >= 2 and v.shape[:2] == (L, R)}
    assert per_layer == set(used.tables.named()), "a per-layer table missing from named()"
    for c in (used, unused):
        assert c.admit(n, kv=kv_for(0, 0, n)) == 0
    req = cupy.asarray([0], cupy.int32)
    lens = cupy.asarray([n], cupy.int32)
    for t in range(6):
        for layer in range(L):
            step = used.begin_step(req, lens)
            if t % 2:
                tk = rng.choice(n - 1, size=(1, 2, K), replace=False).astype(np.int32)
            else:
                tk = rng.choice(n - 1, size=(1, K), replace=False).astype(np.int32)
            out = cupy.asnumpy(step.swap(layer, cupy.asarray(tk), check=True)).reshape(-1)
            check_rows(used, layer, 0, tk.reshape(-1), out)
    cupy.cuda.Device().synchronize()
    moved = {k: cupy.asnumpy(v[:, 0]) for k, v in used.tables.named().items()}
    for c in (used, unused):
        c.release(0)
    cupy.cuda.Device().synchronize()
    assert any((moved[k] != cupy.asnumpy(unused.tables.named()[k][:, 0])).any()
               for k in moved if k != "token_slot"), "the swaps changed no table"
    for k, v in used.tables.named().items():
        if k != "token_slot":
            np.testing.assert_array_equal(cupy.asnumpy(v[:, 0]),
                                          cupy.asnumpy(unused.tables.named()[k][:, 0]), k)
    used.close()
    unused.close()


def test_calls_on_a_stream_ignore_cupys_current_stream(rng):
    """A cache call given a non-blocking stream queues everything it needs there. With CuPy's
    current stream held busy and the memory pool's free blocks holding garbage, an admission
    (positional, and warm) sets up the multi-step token -> slot table, and a multi-step swap
    whose shortest step is positional finds every token below H in its slot in every step.
    (Seed 131 of the 100k step fuzz: the admission's request-slot array was made on the
    current stream, so the table's initialisation read a stale pool block.)"""
    import cupy

    from hisparse_cupy import HotBufferCache
    from hisparse_cupy.reference import check_multistep_invariants

    from _util import spin, stale_pool

    cache = HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=ROW,
                           hot_size=H, top_k=K, extra_page=P, max_steps=2)
    s = cupy.cuda.Stream(non_blocking=True)
    cache.release(cache.admit(H, kv=kv_for(0, 0, H), stream=s), stream=s)  # kernels built
    keep = cache.admit(2 * H, kv=kv_for(1, 0, 2 * H), stream=s)  # slot 0 stays taken
    cupy.cuda.Device().synchronize()
    stale_pool(cupy)
    spin(cupy, 4_000_000_000)  # the current stream (the legacy default) busy for ~2 s
    pos = cache.admit(H, kv=kv_for(2, 0, H), stream=s)
    n = 3 * H
    warm = rng.choice(n - 1, H // 2, replace=False)
    lru = cache.admit(n, kv=kv_for(3, 0, n), warm_tokens=warm, stream=s)
    assert len({keep, pos, lru}) == 3
    cache.write_host(pos, H, kv_for(2, H, 1), stream=s)  # the draft token's host row
    with s:  # the step's inputs are the engine's: made on the step's stream
        req = cupy.asarray([pos], cupy.int32)
        lens = cupy.asarray([[H, H + 1]], cupy.int32)
    topk = np.stack([rng.choice(H, K, replace=False) for _ in range(2)])[None].astype(np.int32)
    step = cache.begin_step(req, lens, stream=s)
    outs = []
    for layer in range(L):
        with s:
            outs.append(step.swap(layer, cupy.asarray(topk)).copy())
    step.finish()
    s.synchronize()
    t = {k: cupy.asnumpy(v) for k, v in cache.tables.named().items()}
    for layer in range(L):
        check_multistep_invariants(
            t["slot_tokens"][layer], t["slot_locs"][layer], t["scratch_locs"][layer],
            t["token_slot"][layer], t["ms_ref"][layer], t["ms_clock"][layer], H,
            requests=[pos, lru])
        out = cupy.asnumpy(outs[layer])[0]
        want = t["slot_locs"][layer, pos][topk[0]]
        assert (out == want).all(), (f"layer {layer}: tokens below H not read from their "
                                     f"slots in every step: {out.tolist()} vs {want.tolist()}")
        for st in range(2):
            check_rows(cache, layer, 2, topk[0, st], out[st])
    cache.close()
