"""MissPlan replay (the planned copy) on the GPU: exact bytes, padding, grids, graphs, and the
copy's measuring instance (hisparse_cupy.testing.probe: dry run, slowed rows, counted bad rows)."""

from __future__ import annotations

import numpy as np
import pytest

from _util import pattern

ROW = 656
N_HOST = 4096
N_DEV = 2048
POISON = 0xEE


@pytest.fixture
def s(stream):
    """The conftest's non-blocking stream, current for the whole test."""
    return stream


def _setup(stream, n_layers=2):
    import cupy as cp

    from hisparse_cupy import HostKVPool

    pool = HostKVPool(n_layers, N_HOST, ROW)
    for layer in range(n_layers):
        pool.layer(layer)[:] = pattern(layer, np.arange(N_HOST), ROW)
    with stream:
        dev = cp.full((N_DEV, ROW), POISON, cp.uint8)
    return pool, dev


def _random_plan(plan, batch, rng, *, max_count=None, counts=None):
    """Fill the first ``batch`` rows of ``plan``; destinations are unique over the whole plan."""
    import cupy as cp

    W = plan.width
    if counts is None:
        counts = rng.integers(0, (max_count or W) + 1, batch)
    counts = np.asarray(counts, np.int32)
    src = np.full((plan.max_batch, W), -1, np.int64)
    dst = np.full((plan.max_batch, W), -1, np.int32)
    n = int(np.clip(counts, 0, W).sum())
    free = rng.permutation(N_DEV)[:n]
    k = 0
    for b in range(batch):
        c = int(np.clip(counts[b], 0, W))
        src[b, :c] = rng.choice(N_HOST, c, replace=False)
        dst[b, :c] = free[k:k + c]
        k += c
    cnt = np.zeros(plan.max_batch, np.int32)
    cnt[:batch] = counts
    plan.src[...] = cp.asarray(src)
    plan.dst[...] = cp.asarray(dst)
    plan.count[...] = cp.asarray(cnt)
    return src, dst, cnt


def _expected(layer, src, dst, cnt, rows):
    """Device rows after replaying rows ``rows`` of the plan onto a poisoned array."""
    want = np.full((N_DEV, ROW), POISON, np.uint8)
    for b in rows:
        c = int(np.clip(cnt[b], 0, src.shape[1]))
        ok = (src[b, :c] >= 0) & (src[b, :c] < N_HOST) & (dst[b, :c] >= 0) & (dst[b, :c] < N_DEV)
        if ok.any():  # (_util.pattern needs at least one row)
            want[dst[b, :c][ok]] = pattern(layer, src[b, :c][ok], ROW)
    return want


@pytest.mark.gpu
@pytest.mark.parametrize("grid", [1, 3, None])
def test_replay_exact_rows_with_padding(grid, rng, s):
    import cupy as cp

    from hisparse_cupy import MissPlan, replay_plan

    pool, dev = _setup(s)
    plan = MissPlan(12, 40)
    B = 9
    counts = rng.integers(0, 41, B)
    counts[2], counts[5], counts[7] = 0, 55, -3  # clamped to [0, width]
    src, dst, cnt = _random_plan(plan, B, rng, counts=counts)
    with s:
        nr = cp.full(1, 6, cp.int32)  # rows 6.. are padding
        replay_plan(plan, B, device_rows=dev, pool=pool, layer=1, num_real=nr, grid=grid,
                    stream=s)
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(dev), _expected(1, src, dst, cnt, range(6)))
    # the same through a raw address, without num_real (every row of the batch is real)
    with s:
        dev[...] = POISON
        replay_plan(plan, B, device_rows=dev, host_rows=pool.device_ptr(0),
                    n_host_rows=N_HOST, grid=grid, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(dev), _expected(0, src, dst, cnt, range(B)))
    pool.close()


@pytest.mark.gpu
def test_replay_shapes_of_work(rng, s):
    """One miss in each of many requests, and many misses in one request, both land exactly."""
    import cupy as cp

    from hisparse_cupy import MissPlan, replay_plan

    pool, dev = _setup(s)
    for max_batch, width, B in ((256, 1, 256), (1, 1500, 1), (64, 24, 64)):
        plan = MissPlan(max_batch, width)
        src, dst, cnt = _random_plan(plan, B, rng, counts=np.full(B, width))
        for grid in (1, 2, None):
            with s:
                dev[...] = POISON
                replay_plan(plan, B, device_rows=dev, pool=pool, layer=0, grid=grid, stream=s)
            s.synchronize()
            np.testing.assert_array_equal(cp.asnumpy(dev), _expected(0, src, dst, cnt, range(B)),
                                          err_msg=f"batch {B} width {width} grid {grid}")
    pool.close()


@pytest.mark.gpu
@pytest.mark.parametrize("rpw", [1, 2, 4, 8])
@pytest.mark.parametrize("row", [656, 1152, 2064])
def test_replay_rows_per_warp_exact(rpw, row, rng, s):
    """Every rows-per-warp choice, in the production instance and in the probe instance, rows
    of one pass and of several (1152 and 2064 B take more than one pass of two vectors per
    lane), several grids, bad entries inside a warp's group skipped (and counted by the
    probe), padding rows untouched."""
    import cupy as cp

    from hisparse_cupy import HostKVPool, MissPlan, replay_plan
    from hisparse_cupy.testing.probe import copy_probe

    n_host, n_dev, B, W = 1500, 900, 7, 60
    pool = HostKVPool(1, n_host, row)
    pool.layer(0)[:] = pattern(3, np.arange(n_host), row)
    plan = MissPlan(B, W)
    counts = rng.integers(0, W + 1, B)
    counts[1] = W
    src = np.full((B, W), -1, np.int64)
    dst = np.full((B, W), -1, np.int32)
    free = rng.permutation(n_dev)
    used = 0
    for b in range(B):
        src[b, : counts[b]] = rng.choice(n_host, counts[b], replace=False)
        dst[b, : counts[b]] = free[used: used + counts[b]]
        used += counts[b]
    src[1, 5], dst[1, 6], src[1, 7] = n_host, n_dev, -4  # skipped, counted
    nreal = 6
    want = np.full((n_dev, row), POISON, np.uint8)
    n_bad = 0
    for b in range(nreal):
        c = counts[b]
        ok = (src[b, :c] >= 0) & (src[b, :c] < n_host) & (dst[b, :c] >= 0) & (dst[b, :c] < n_dev)
        n_bad += int((~ok).sum())
        want[dst[b, :c][ok]] = pattern(3, src[b, :c][ok], row)
    with s:
        plan.src[...] = cp.asarray(src)
        plan.dst[...] = cp.asarray(dst)
        plan.count[...] = cp.asarray(counts.astype(np.int32))
        nr = cp.full(1, nreal, cp.int32)
        bad = cp.zeros(1, cp.int32)
        dev = cp.empty((n_dev, row), cp.uint8)
    for grid in (1, 5, None):
        with s:
            dev[...] = POISON
            replay_plan(plan, B, device_rows=dev, pool=pool, layer=0, num_real=nr, grid=grid,
                        rows_per_warp=rpw, stream=s)
        s.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(dev), want, err_msg=f"grid {grid}")
        with s, copy_probe(bad=bad, streams=[s]):  # the probe instance: same bytes, counted
            dev[...] = POISON
            bad[...] = 0
            replay_plan(plan, B, device_rows=dev, pool=pool, layer=0, num_real=nr, grid=grid,
                        rows_per_warp=rpw, stream=s)
        s.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(dev), want, err_msg=f"probe, grid {grid}")
        assert int(bad.get()[0]) == n_bad == 3
    with pytest.raises(ValueError, match="rows_per_warp must be one of"):
        replay_plan(plan, B, device_rows=dev, pool=pool, layer=0, rows_per_warp=3, stream=s)
    pool.close()


@pytest.mark.gpu
def test_replay_dry_run_spin_and_bad_rows(rng, s):
    """Through copy_probe: a dry run moves no bytes, a slowed replay with bad rows copies the
    others and counts the bad ones, and only the probe's streams are probed."""
    import cupy as cp

    from hisparse_cupy import MissPlan, replay_plan
    from hisparse_cupy.testing.probe import active_copy_probes, copy_probe

    pool, dev = _setup(s)
    plan = MissPlan(4, 16)
    src, dst, cnt = _random_plan(plan, 4, rng, counts=[16, 3, 0, 9])
    with s:
        bad = cp.zeros(1, cp.int32)
        with copy_probe(dry_run=True, bad=bad, streams=[s]):
            replay_plan(plan, 4, device_rows=dev, pool=pool, layer=1, stream=s)
    s.synchronize()
    assert (cp.asnumpy(dev) == POISON).all(), "a dry run moved bytes"
    assert int(bad.get()[0]) == 0
    assert active_copy_probes == []
    # out-of-range rows are skipped and counted, the others copied (slowly)
    src[0, 3], dst[1, 1], src[3, 0], dst[3, 8] = N_HOST, N_DEV + 5, -2, -1
    with s:
        plan.src[...] = cp.asarray(src)
        plan.dst[...] = cp.asarray(dst)
        with copy_probe(bad=bad, spin_cycles=2000):  # every stream
            replay_plan(plan, 4, device_rows=dev, pool=pool, layer=1, grid=1, stream=s)
    s.synchronize()
    assert int(bad.get()[0]) == 4
    want = _expected(1, src, dst, cnt, range(4))
    np.testing.assert_array_equal(cp.asnumpy(dev), want)
    # a probe of another stream leaves this one's copies alone: bytes moved, nothing counted
    other = cp.cuda.Stream(non_blocking=True)
    with s:
        dev[...] = POISON
        bad[...] = 0
        with copy_probe(dry_run=True, bad=bad, streams=[other]):
            replay_plan(plan, 4, device_rows=dev, pool=pool, layer=1, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(dev), want)
    assert int(bad.get()[0]) == 0
    pool.close()


@pytest.mark.gpu
def test_a_slowed_replay_is_still_running_when_queued_work_after_it_reads(rng, s):
    """spin_cycles really delays the rows: the copy is still running long after the host
    queued it (an event recorded after it has not completed), and it lands complete."""
    import cupy as cp

    from hisparse_cupy import MissPlan, replay_plan
    from hisparse_cupy.testing.probe import copy_probe

    pool, dev = _setup(s)
    plan = MissPlan(2, 8)
    src, dst, cnt = _random_plan(plan, 2, rng, counts=[8, 8])
    with s:
        with copy_probe(spin_cycles=50_000_000, streams=[s]):  # ~30 ms per row group
            replay_plan(plan, 2, device_rows=dev, pool=pool, layer=0, grid=1, stream=s)
        done = cp.cuda.Event()
        done.record(s)
    assert not done.done, "the slowed replay finished at once"
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(dev), _expected(0, src, dst, cnt, range(2)))
    pool.close()


@pytest.mark.gpu
def test_replay_in_graph_with_changing_plan_and_padding(rng, s):
    """Captured once, replayed with new plans and num_real each time (buffers never move)."""
    import cupy as cp

    from hisparse_cupy import MissPlan, replay_plan

    pool, dev = _setup(s)
    plan = MissPlan(16, 32)
    B = 16
    with s:
        nr = cp.full(1, B, cp.int32)
        _random_plan(plan, B, rng)
        replay_plan(plan, B, device_rows=dev, pool=pool, layer=1, num_real=nr, grid=4, stream=s)
        s.synchronize()
        s.begin_capture()
        replay_plan(plan, B, device_rows=dev, pool=pool, layer=1, num_real=nr, grid=4, stream=s)
        graph = s.end_capture()
        for it in range(12):
            n = int(rng.integers(0, B + 1))
            src, dst, cnt = _random_plan(plan, B, rng)
            dev[...] = POISON
            nr.fill(n)
            graph.launch(s)
            s.synchronize()
            np.testing.assert_array_equal(cp.asnumpy(dev), _expected(1, src, dst, cnt, range(n)),
                                          err_msg=f"graph launch {it}, num_real {n}")
    pool.close()


@pytest.mark.gpu
def test_replay_reproduces_the_swap_rows(rng, s):
    """The plan a full layer's swap recorded, replayed on another layer, gives that layer's
    bytes at every row the swap's page table points to."""
    import cupy as cp

    from hisparse_cupy import HotBufferCache, replay_plan

    H, K, max_len, R = 64, 32, 300, 3
    with s:
        cache = HotBufferCache(n_layers=2, max_requests=R, max_len=max_len, row_bytes=ROW,
                               hot_size=H, top_k=K, extra_page=8)
        cache.device[...] = POISON
        rids = [cache.admit(max_len, stream=s) for _ in range(R)]
        for rid in rids:
            rows = rid * max_len + np.arange(max_len)
            cache.write_host(rid, 0, np.stack([pattern(layer, rows, ROW) for layer in (0, 1)]))
        req = cp.asarray(np.array(rids, np.int32))
        lens = cp.full(R, max_len, cp.int32)
        perm = rng.permutation(max_len - 1)
        for t in range(12):
            pos = (t * 5 + 31 * np.arange(R)[:, None] + np.arange(K)[None, :]) % (max_len - 1)
            tk = cp.asarray(perm[pos].astype(np.int32))
            out = cache.begin_step(req, lens, stream=s).swap(0, tk)
            replay_plan(cache.plan, R, device_rows=cache.device_rows(1), pool=cache.pool,
                        layer=1, stream=s)
            s.synchronize()
            locs, toks = cp.asnumpy(out), perm[pos]
            host = np.array(rids)[:, None] * max_len + toks
            for layer in (0, 1):
                got = cp.asnumpy(cache.device_rows(layer))[locs.reshape(-1)]
                np.testing.assert_array_equal(got, pattern(layer, host.reshape(-1), ROW),
                                              err_msg=f"step {t} layer {layer}")
    cache.close()


@pytest.mark.gpu
def test_replay_validation(s):
    import cupy as cp

    from hisparse_cupy import MissPlan, Ptr, replay_plan

    pool, dev = _setup(s)
    plan = MissPlan(4, 8)
    with pytest.raises(TypeError, match="plan must be a MissPlan"):
        replay_plan(None, 1, device_rows=dev, pool=pool, layer=0)
    with pytest.raises(ValueError, match="batch must be <= 4"):
        replay_plan(plan, 5, device_rows=dev, pool=pool, layer=0)
    with pytest.raises(TypeError, match="device_rows must have dtype uint8"):
        replay_plan(plan, 1, device_rows=dev.view(cp.int8), pool=pool, layer=0)
    with pytest.raises(ValueError, match="device_rows rows hold 640 bytes"):
        replay_plan(plan, 1, device_rows=cp.zeros((8, 640), cp.uint8), pool=pool, layer=0)
    with pytest.raises(ValueError, match="either pool and layer, or host_rows"):
        replay_plan(plan, 1, device_rows=dev, pool=pool, layer=0, host_rows=pool.device_ptr(0))
    with pytest.raises(ValueError, match="pool needs layer"):
        replay_plan(plan, 1, device_rows=dev, pool=pool)
    with pytest.raises(TypeError, match="host_rows as a Ptr"):
        replay_plan(plan, 1, device_rows=dev, host_rows=123, n_host_rows=10)
    with pytest.raises(ValueError, match="needs n_host_rows"):
        replay_plan(plan, 1, device_rows=dev, host_rows=Ptr(pool.device_ptr(0)))
    with pytest.raises(ValueError, match="grid must be >= 1"):
        replay_plan(plan, 1, device_rows=dev, pool=pool, layer=0, grid=0)
    with pytest.raises(TypeError, match="num_real must have dtype int32"):
        replay_plan(plan, 1, device_rows=dev, pool=pool, layer=0,
                    num_real=cp.zeros(1, cp.int64))
    with pytest.raises(ValueError, match="layer must be <= 1"):
        replay_plan(plan, 1, device_rows=dev, pool=pool, layer=2)
    replay_plan(plan, 0, device_rows=dev, pool=pool, layer=0, stream=s)  # nothing to do
    pool.close()
