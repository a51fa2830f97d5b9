"""The per-layer swap counters (``hisparse_cupy.counters``) against what each call recorded.

Every call's plan counts and status are the oracle-checked outputs of the other GPU tests;
here the counters must equal their running sums, layer by layer, through single- and
multi-step calls alternating, graph padding, a prefetcher, a snapshot that never waits, and
the stand-alone ops.
"""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_cupy import _abi
from hisparse_cupy._twin import K, L, R, Twin, twin_tables

pytestmark = pytest.mark.gpu


def _expect(exp, layer, c, nr, width):
    import cupy

    cnt = cupy.asnumpy(c.plan.count[:nr]).astype(np.int64)
    st = cupy.asnumpy(c.status[:nr]).astype(np.int64)
    exp[layer] += [nr, nr * width, cnt.sum(), st[:, _abi.ST_RANGE].sum() + st[:, _abi.ST_NOHOST]
                   .sum()]


def _as_array(d) -> np.ndarray:
    return np.stack([d[name] for name in _abi.LAYER_COUNTERS], axis=1)


def test_counters_are_the_sums_of_every_call(rng, stream):
    import cupy

    t = Twin(rng)
    c = t.c
    exp = np.zeros((L, _abi.N_LAYER_COUNTERS), np.int64)
    B = 5
    for it in range(12):
        req = rng.permutation(R)[:B]
        S = int(rng.choice([1, 1, 2, 4]))
        nr = int(rng.integers(1, B + 1))  # rows >= nr are graph padding: not counted
        topk = t.topk(req, S=None if S == 1 else S, miss=float(rng.choice([0.0, 0.3, 1.0])))
        topk[0, ..., 0] = t.max_len + 7  # one entry out of range: flagged
        step = c.begin_step(cupy.asarray(req.astype(np.int32)), cupy.asarray(t.lens[req]),
                            cupy.asarray(np.int32(nr)), stream=stream)
        for layer in range(L):
            step.swap(layer, cupy.asarray(topk))
            stream.synchronize()
            _expect(exp, layer, c, nr, K * S)
        if it % 3 == 2:  # a snapshot that never waits, then one read on demand
            queued = c.counters.snapshot(stream)
            assert queued
            stream.synchronize()
            np.testing.assert_array_equal(_as_array(c.counters.latest()), exp)
        got = c.counters.read(stream)
        np.testing.assert_array_equal(_as_array(got), exp, err_msg=str(it))
        t.np = [twin_tables(t.snapshot(layer)) for layer in range(L)]  # for the next draws
    assert exp[:, 2].sum() > 0 and exp[:, 3].sum() > 0  # misses and flags were counted
    got = c.counters.latest()
    sel = exp[:, 1]
    np.testing.assert_allclose(got["hit_rate"], 1 - exp[:, 2] / sel)
    np.testing.assert_array_equal(got["bytes"], exp[:, 2] * c.row_bytes)
    c.counters.reset(stream)
    assert (_as_array(c.counters.read(stream)) == 0).all()
    c.close()


def test_shared_layers_count_only_their_own_swaps(rng, stream):
    import cupy

    from hisparse_cupy import Prefetcher

    t = Twin(rng)
    pf = Prefetcher(t.c, "FSS")
    req = rng.permutation(R)[:4]
    for on in (True, False):
        pf.set_enabled(on, stream)
        t.c.counters.reset(stream)
        step = t.c.begin_step(cupy.asarray(req.astype(np.int32)), cupy.asarray(t.lens[req]),
                              stream=stream, prefetcher=pf)
        topk = cupy.asarray(t.topk(req, miss=0.3))
        for layer in range(L):
            step.swap(layer, topk)
        step.finish()
        rows = t.c.counters.read(stream)["rows"]
        np.testing.assert_array_equal(rows, [4, 0, 0] if on else [4, 4, 4])
    pf.synchronize()
    t.c.close()


def test_stand_alone_ops_count_into_the_array_given(rng, stream):
    import cupy

    from hisparse_cupy import swap_in

    t = Twin.single(rng, R=4, K=32, H=64, P=8, row_bytes=64, max_len=300)
    st = t.state()
    kw = dict(host_rows=t.pool.device_ptr(0), n_host_rows=t.pool.n_rows,
              device_rows=t.device_rows(), plan=t.plan, stream=stream)
    req = np.array([0, 2], np.int32)
    lens = np.array([200, 250], np.int64)
    topk = rng.integers(0, 200, (2, 32)).astype(np.int32)
    ctr = cupy.zeros(_abi.N_LAYER_COUNTERS, cupy.uint64)
    swap_in(cupy.asarray(topk), cupy.asarray(req), cupy.asarray(lens), st, counters=ctr, **kw)
    got = cupy.asnumpy(ctr)
    assert got[_abi.LC_ROWS] == 2 and got[_abi.LC_SELECTED] == 64
    assert got[_abi.LC_MISSES] == int(cupy.asnumpy(t.plan.count[:2]).sum())
    with pytest.raises(TypeError, match="counters"):
        swap_in(cupy.asarray(topk), cupy.asarray(req), cupy.asarray(lens), st,
                counters=cupy.zeros(_abi.N_LAYER_COUNTERS, cupy.int64), **kw)


def test_a_cache_without_counters_counts_nothing(rng, stream):
    import cupy

    from hisparse_cupy import HotBufferCache

    c = HotBufferCache(n_layers=2, max_requests=2, max_len=300, row_bytes=64, hot_size=64,
                       top_k=32, extra_page=8, counters=False)
    assert c.counters is None
    rid = c.admit(200, stream=stream)
    topk = cupy.asarray(rng.integers(0, 199, (1, 32)).astype(np.int32))
    c.begin_step(cupy.asarray([rid], cupy.int32), cupy.asarray([200], cupy.int32),
                 stream=stream).swap(0, topk, check=True)
    stream.synchronize()
    c.close()
