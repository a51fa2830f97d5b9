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
from hisparse_cupy.testing.twin import K, L, R, Twin, twin_tables

pytestmark = pytest.mark.gpu


def _expect(exp, layer, c, nr, width, counted):
    """Add a call's expected counts: ``counted`` real rows (bad rows count nowhere), and the
    plan counts and flags of the first ``nr`` rows (padding and bad rows have none)."""
    import cupy

    cnt = cupy.asnumpy(c.plan.count[:nr]).astype(np.int64)
    st = cupy.asnumpy(c.status[:nr]).astype(np.int64)
    assert (st[:, _abi.ST_BADROW] > 0).sum() == nr - counted  # the bad rows are the ones meant
    exp[layer] += [counted, counted * width, cnt.sum(),
                   st[:, _abi.ST_RANGE].sum() + st[:, _abi.ST_NOHOST].sum()]


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
        lens = t.lens[req].copy()
        bad = 0
        if it % 4 == 1 and nr >= 2:  # a positional row (length <= H: the swap changes nothing)
            lens[1] = t.H // 2  # and a bad request slot (counts nowhere)
            req = req.copy()
            req[0], bad = R + 3, 1
        step = c.begin_step(cupy.asarray(req.astype(np.int32)), cupy.asarray(lens),
                            cupy.asarray(np.int32(nr)), stream=stream)
        for layer in range(L):
            step.swap(layer, cupy.asarray(topk))
            stream.synchronize()
            _expect(exp, layer, c, nr, K * S, nr - bad)
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
    # the hash resolve (no token table: a cluster of blocks per row at small batch), one row
    # positional (length <= H) with an entry out of range
    req = np.array([0, 2, 3], np.int32)
    lens = np.array([200, 250, 40], np.int64)
    topk = rng.integers(0, 200, (3, 32)).astype(np.int32)
    topk[2] = rng.integers(0, 40, 32)
    topk[2, 5] = 45
    ctr = cupy.zeros(_abi.N_LAYER_COUNTERS, cupy.uint64)
    status = cupy.empty((3, _abi.N_STATUS), cupy.int32)
    swap_in(cupy.asarray(topk), cupy.asarray(req), cupy.asarray(lens), st, counters=ctr,
            status=status, **kw)
    got, sts = cupy.asnumpy(ctr), cupy.asnumpy(status)
    assert got[_abi.LC_ROWS] == 3 and got[_abi.LC_SELECTED] == 96
    assert got[_abi.LC_MISSES] == int(cupy.asnumpy(t.plan.count[:3]).sum()) > 0
    flagged = int(sts[:, _abi.ST_RANGE].sum() + sts[:, _abi.ST_NOHOST].sum())
    assert got[_abi.LC_FLAGGED] == flagged >= 1
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
