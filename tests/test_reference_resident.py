"""The resident path's oracle (``reference.resident_swap``): every valid entry of a resident row
maps to its page row, and an entry is -1 (with the same status) exactly where the sparse swap of
the same call gives -1."""

from __future__ import annotations

import numpy as np

from hisparse_cupy import reference as ref

H, P, MAX_LEN, R = 16, 4, 96, 3


def _topk(rng, B, S, K, lens):
    """Entries of every kind: tokens held, -1, out of range, duplicates, the newest."""
    t = np.empty((B, S, K), np.int64)
    for b in range(B):
        for s in range(S):
            seq = int(lens[b, s])
            row = rng.integers(0, max(seq, 1), K)
            kind = rng.random(K)
            row[kind < 0.1] = -1
            row[(kind >= 0.1) & (kind < 0.18)] = rng.choice([-5, seq, seq + 7, MAX_LEN + 3])
            row[(kind >= 0.18) & (kind < 0.25)] = seq - 1
            t[b, s] = row
    return t.astype(np.int32)


def _sparse_state():
    """One layer's sparse state with every token's host row present (nothing is NOHOST)."""
    W = H + 2
    return dict(host_locs=np.arange(R * MAX_LEN, dtype=np.int64).reshape(R, MAX_LEN),
                slot_tokens=np.full((R, W), -1, np.int32),
                slot_locs=(np.arange(R)[:, None] * W + np.arange(W)).astype(np.int32),
                lru=np.tile(np.arange(H, dtype=np.int16), (R, 1)), hot_size=H,
                n_host_rows=R * MAX_LEN)


def _pages(rng):
    """A page table giving every request pages for all its tokens, in random order."""
    n = -(-MAX_LEN // P)
    return rng.permutation(R * n).reshape(R, n).astype(np.int32)


def test_minus_one_and_status_match_the_sparse_swap():
    rng = np.random.default_rng(1)
    for _ in range(200):
        B, K = 3, 8
        req = rng.permutation(R)[:B]
        lens = rng.integers(1, MAX_LEN + 1, B)
        lens[0] = int(rng.integers(1, H + 1))  # a positional row
        tk = _topk(rng, B, 1, K, lens[:, None])[:, 0]
        sparse = ref.swap_in(tk, req, lens, **_sparse_state())
        table = _pages(rng)
        res = ref.resident_swap(tk, req, lens, resident=np.ones(R, bool), page_table=table,
                                page_tokens=P, hot_size=H, max_len=MAX_LEN)
        assert res.served.all()
        np.testing.assert_array_equal(res.device_locs >= 0, sparse.device_locs >= 0)
        np.testing.assert_array_equal(res.status, sparse.status)
        b, i = np.nonzero(res.device_locs >= 0)
        t = tk[b, i].astype(np.int64)
        np.testing.assert_array_equal(res.device_locs[b, i],
                                      table[req[b], t // P] * P + t % P)


def test_multistep_is_each_step_on_its_own():
    rng = np.random.default_rng(2)
    table = _pages(rng)
    for _ in range(100):
        B, S, K = 3, 3, 8
        req = rng.permutation(R)[:B]
        base = rng.integers(1, MAX_LEN - S, B)
        lens = base[:, None] + np.arange(S)[None]  # L, L + 1, ... (draft tokens)
        tk = _topk(rng, B, S, K, lens)
        kw = dict(resident=np.ones(R, bool), page_table=table, page_tokens=P, hot_size=H,
                  max_len=MAX_LEN)
        res = ref.resident_swap(tk, req, lens, **kw)
        assert res.device_locs.shape == (B, S, K)
        status = np.zeros_like(res.status)
        for s in range(S):
            one = ref.resident_swap(tk[:, s], req, lens[:, s], **kw)
            np.testing.assert_array_equal(res.device_locs[:, s], one.device_locs)
            status += one.status
        np.testing.assert_array_equal(res.status, status)
        same = ref.resident_swap(tk, req, lens[:, 0], **kw)  # [B] lengths: every step alike
        one = ref.resident_swap(tk[:, 1], req, lens[:, 0], **kw)
        np.testing.assert_array_equal(same.device_locs[:, 1], one.device_locs)


def test_rows_it_leaves_to_the_sparse_swaps_and_missing_pages():
    rng = np.random.default_rng(3)
    table = _pages(rng)
    table[1, 5:] = -1  # request 1 has pages for its first 20 tokens only
    resident = np.array([True, True, False])
    req = np.array([0, 1, 2, 7, 0])
    lens = np.array([40, 30, 40, 40, -1])
    tk = np.tile(np.array([3, 25, 29, -1, 19, 3, 45, 0], np.int32), (5, 1))
    res = ref.resident_swap(tk, req, lens, resident=resident, page_table=table, page_tokens=P,
                            hot_size=H, max_len=MAX_LEN, num_real=4)
    assert res.served.tolist() == [True, True, False, False, False]
    assert (res.device_locs[2:] == -1).all() and (res.status[2:] == 0).all()
    assert res.device_locs[1, 1] == -1 and res.device_locs[1, 2] == -1  # pages missing
    assert res.status[1, ref.ST_NOHOST] == 2 and res.status[1, ref.ST_RANGE] == 1  # 45
    assert res.status[0, ref.ST_RANGE] == 1 and (res.device_locs[0] >= 0).sum() == 6
    assert res.device_locs[1, 4] == table[1, 4] * P + 3  # token 19: page 4, offset 3
