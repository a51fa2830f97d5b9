"""GPU: the resident path of the single-step swap (issue 47, ``docs/design.md`` section 10)
equals its oracle in mixed batches: resident rows through the device page table, the others
through the hot buffers, over every resolve (hash, token table, clusters of 1-8 blocks)."""

from __future__ import annotations

import pytest
from test_swap_gpu import random_step

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("table", [False, True], ids=["hash", "table"])
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_mixed_batches_equal_the_oracles(rng, table, share):
    from hisparse_cupy.testing._resident_twin import ResidentTwin

    R, H = 12, 64
    h = ResidentTwin.single_resident(rng, share=share, page_tokens=16, R=R, K=32, H=H, P=4,
                                     row_bytes=64, max_len=3 * H + 17, table=table)
    if share in (0.0, 1.0):
        assert (h.flags == (share == 1.0)).all()
    else:
        assert 0 < h.flags.sum() < R
    for _ in range(60):  # h.call checks outputs, status, plans, tables and bytes
        B = int(rng.integers(1, R + 1))
        nr = B if rng.random() < 0.8 else int(rng.integers(0, B + 1))
        req, seq, topk = random_step(h, B, nr, float(rng.choice([0.0, 0.05, 0.5])))
        h.call(topk, req, seq, num_real=nr, newest=True)


@pytest.mark.parametrize("cluster", [2, 8])
def test_every_cluster_size_serves_resident_rows(rng, cluster):
    import cupy

    from hisparse_cupy.testing import knobs
    from hisparse_cupy.testing._resident_twin import ResidentTwin

    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("thread-block clusters need compute capability >= 9.0")
    h = ResidentTwin.single_resident(rng, R=10, K=45, H=70, P=4, row_bytes=576,
                                     max_len=3 * 70 + 17)
    with knobs.resolve_cluster(cluster):
        for _ in range(30):
            B = int(rng.integers(1, 11))
            req, seq, topk = random_step(h, B, B, 0.2)
            h.call(topk, req, seq, newest=True)


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_multistep_mixed_batches_equal_the_oracles(rng, share):
    """Multi-step calls of 2-4 steps (lengths L, L + 1, ... or equal), tokens repeated across
    steps, -1, out of range, the newest and draft tokens: resident rows through the page
    table, the others through the hot buffers and scratch rows, state and bytes checked."""
    import numpy as np

    from hisparse_cupy.testing._resident_twin import ResidentTwin

    R, H, K = 6, 64, 32
    h = ResidentTwin.multi_resident(rng, share=share, page_tokens=16, R=R, H=H, P=8, K=K,
                                    S_max=4)
    for _ in range(40):
        B, S = int(rng.integers(1, R + 1)), int(rng.integers(2, 5))
        req = rng.permutation(R)[:B]
        steps = np.arange(S) if rng.random() < 0.5 else np.zeros(S, np.int64)
        seqs = h.lens[req][:, None] + steps[None]  # [B, S]
        base = np.stack([rng.integers(0, s0, K) for s0 in seqs[:, 0]])
        topk = np.repeat(base[:, None], S, axis=1)
        fresh = rng.random(topk.shape) < 0.3
        topk[fresh] = rng.integers(0, seqs.min(), fresh.sum())
        u = rng.random(topk.shape)
        topk[u < 0.05] = -1
        topk[(u >= 0.05) & (u < 0.08)] = seqs.max() + 5  # out of range
        newest = (u >= 0.08) & (u < 0.12)  # each step's newest token (the draft tokens)
        topk[newest] = np.broadcast_to(seqs[:, :, None] - 1, topk.shape)[newest]
        h.call(topk.astype(np.int32), req, seqs.astype(np.int32))


@pytest.mark.parametrize("table", [False, True], ids=["hash", "table"])
def test_positional_rows_take_the_direct_path(rng, table):
    """Rows of seq <= H (the positional layout) through the direct path: token t's row is slot
    t's, a slot without a row (-1) gives -1 and NOHOST, entries past seq are -1; no plan, no
    state change (the oracle; resident rows share the branch and are tested above)."""
    import cupy
    import numpy as np

    from hisparse_cupy.testing.twin import Twin

    R, H, K = 8, 64, 32
    h = Twin.single(rng, R=R, K=K, H=H, P=4, row_bytes=64, max_len=3 * H, table=table)
    locs = h.np[0]["slot_locs"]
    locs[:, :H][rng.random((R, H)) < 0.1] = -1
    h.state(0).slot_locs[...] = cupy.asarray(locs)
    nohost = 0
    for _ in range(20):
        B = int(rng.integers(1, R + 1))
        req = rng.permutation(R)[:B].astype(np.int32)
        seq = rng.integers(1, H + 1, B).astype(np.int64)
        topk = rng.integers(-2, H + 3, (B, K)).astype(np.int32)
        _, exp = h.call(topk, req, seq)
        assert (exp.plan_count == 0).all()
        nohost += int(exp.status[:, 1].sum())
    assert nohost > 0


def test_bad_residency_arguments():
    import cupy

    from hisparse_cupy._kernels.swap import SwapState

    R, H, W, n = 3, 8, 10, 40
    args = (cupy.full((R, n), -1, cupy.int64), cupy.full((R, W), -1, cupy.int32),
            cupy.zeros((R, W), cupy.int32), cupy.zeros((R, H), cupy.int16))
    ok = dict(resident=cupy.zeros(R, cupy.uint8), page_table=cupy.full((R, 5), -1, cupy.int32),
              page_tokens=8)
    SwapState.validated(*args, **ok)
    with pytest.raises(ValueError, match="together"):
        SwapState.validated(*args, resident=ok["resident"])
    with pytest.raises(ValueError, match=r"page_table must have shape \(3, >= 5\)"):
        SwapState.validated(*args, **dict(ok, page_table=cupy.zeros((R, 4), cupy.int32)))
    with pytest.raises(ValueError, match="page_tokens"):
        SwapState.validated(*args, **dict(ok, page_tokens=0))
    with pytest.raises((TypeError, ValueError), match="resident"):
        SwapState.validated(*args, **dict(ok, resident=cupy.zeros(R, cupy.int32)))


def test_newest_rows_of_resident_requests(rng):
    """The newest-row kernel: a resident request's newest token is its device page's row (-1
    and no backup without a page), its slot H is not marked; a sparse request's is as before
    (slot min(t, H), slot H marked past H); every backup names the token's host row."""
    from types import SimpleNamespace

    import cupy
    import numpy as np

    from hisparse_cupy._kernels.newest import NewestBuffers, newest_rows

    L, R, H, W, max_len, HP, DP = 2, 6, 8, 10, 64, 4, 16
    slot_locs = cupy.asarray(rng.permutation(R * W).reshape(R, W).astype(np.int32))
    slot_tokens = cupy.full((L, R, W), -1, cupy.int32)
    host_locs = cupy.full((R, max_len), -1, cupy.int64)
    host_pages = rng.permutation(R * (max_len // HP)).reshape(R, -1).astype(np.int32)
    host = SimpleNamespace(table=cupy.asarray(host_pages), own_from=cupy.zeros(R, cupy.int32),
                           n_rows=R * max_len, page_tokens=HP)
    dev_pages = (rng.permutation(R * (max_len // DP)).reshape(R, -1) + 50).astype(np.int32)
    dev_pages[1, 2] = -1  # request 1 has no page for tokens 32..47
    resident = np.array([1, 1, 0, 0, 1, 0], np.uint8)
    req = np.array([0, 1, 2, 3, 4, 5], np.int32)
    lens = np.array([40, 40, 40, 5, 3, 0], np.int32)  # the last: invalid (no token)
    out = NewestBuffers(R)
    rows = newest_rows(out, req=cupy.asarray(req), lens=cupy.asarray(lens), lens_stride=1,
                       num_real=None, key=(np.dtype(np.int32), np.dtype(np.int32)),
                       slot_locs=slot_locs, slot_tokens=slot_tokens, host_locs=host_locs,
                       host=host, hot_size=H, record=True, stream=cupy.cuda.Stream.null,
                       resident=cupy.asarray(resident), dev_pages=cupy.asarray(dev_pages),
                       dev_page_tokens=DP)
    got, cnt = cupy.asnumpy(rows), cupy.asnumpy(out.count)
    sl = cupy.asnumpy(slot_locs)
    t = lens - 1
    assert got[0] == dev_pages[0, 39 // DP] * DP + 39 % DP
    assert got[1] == -1 and cnt[1] == 0  # no page: nothing written, nothing backed up
    assert got[2] == sl[2, H] and got[3] == sl[3, 4]
    assert got[4] == dev_pages[4, 0] * DP + 2
    assert got[5] == -1 and cnt[5] == 0
    marks = cupy.asnumpy(slot_tokens[:, :, H])
    assert (marks[:, 2] == 39).all() and (marks[:, [0, 1, 3, 4]] == -1).all()
    hl = cupy.asnumpy(host_locs)
    src, dst = cupy.asnumpy(out.src[:, 0]), cupy.asnumpy(out.dst[:, 0])
    for b in (0, 2, 3, 4):
        want = host_pages[b, t[b] // HP] * HP + t[b] % HP
        assert cnt[b] == 1 and dst[b] == want and src[b] == got[b] and hl[b, t[b]] == want
