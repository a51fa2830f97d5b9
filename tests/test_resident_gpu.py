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
