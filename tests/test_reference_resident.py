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


WRITTEN = np.arange(R * MAX_LEN, dtype=np.int64).reshape(R, MAX_LEN)  # every token's host row


def _sparse_state():
    """One layer's sparse state with every token's host row present (nothing is NOHOST)."""
    W = H + 2
    return dict(host_locs=WRITTEN.copy(),
                slot_tokens=np.full((R, W), -1, np.int32),
                slot_locs=(np.arange(R)[:, None] * W + np.arange(W)).astype(np.int32),
                lru=np.tile(np.arange(H, dtype=np.int16), (R, 1)), hot_size=H,
                n_host_rows=R * MAX_LEN)


def _pages(rng):
    """A page table giving every request pages for all its tokens, in random order."""
    n = -(-MAX_LEN // P)
    return rng.permutation(R * n).reshape(R, n).astype(np.int32)


def _multistep(tk, req, lens, st, hot_size=H, marks=None):
    """The multi-step oracle over one layer's sparse state ``st`` (no scratch rows, a fresh
    clock; ``marks``: its reference epochs, zeros by default)."""
    R_ = st["host_locs"].shape[0]
    return ref.multistep_swap_in(
        tk, req, lens, host_locs=st["host_locs"], slot_tokens=st["slot_tokens"],
        slot_locs=st["slot_locs"], scratch_locs=np.full((R_, 4), -1, np.int32),
        ref=np.zeros((R_, hot_size), np.uint32) if marks is None else marks,
        clock=np.tile(np.uint32([1, 0]), (R_, 1)), hot_size=hot_size,
        n_host_rows=st["n_host_rows"])


def _positional_direct(tk, req, lens, st, hot_size=H, max_len=MAX_LEN):
    """The direct path over the positional layout: every request resident, its slot rows as
    one-token pages (what a sparse row of ``seq <= H`` must give)."""
    return ref.resident_swap(tk, req, lens, resident=np.ones(st["host_locs"].shape[0], bool),
                             page_table=st["slot_locs"][:, :hot_size], page_tokens=1,
                             hot_size=hot_size, max_len=max_len, host_locs=st["host_locs"])


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
                                page_tokens=P, hot_size=H, max_len=MAX_LEN, host_locs=WRITTEN)
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
                  max_len=MAX_LEN, host_locs=WRITTEN)
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
                            hot_size=H, max_len=MAX_LEN, host_locs=WRITTEN, num_real=4)
    assert res.served.tolist() == [True, True, False, False, False]
    assert (res.device_locs[2:] == -1).all() and (res.status[2:] == 0).all()
    assert res.device_locs[1, 1] == -1 and res.device_locs[1, 2] == -1  # pages missing
    assert res.status[1, ref.ST_NOHOST] == 2 and res.status[1, ref.ST_RANGE] == 1  # 45
    assert res.status[0, ref.ST_RANGE] == 1 and (res.device_locs[0] >= 0).sum() == 6
    assert res.device_locs[1, 4] == table[1, 4] * P + 3  # token 19: page 4, offset 3


def test_the_positional_layout_is_the_direct_path_through_its_slot_rows():
    """The fold (``docs/design.md`` section 10): a row of ``seq <= H`` in the sparse swaps
    gives what a resident row gives when its page table is its slot rows as one-token pages,
    in the single- and the multi-step oracle alike: outputs and status (a slot without a row
    is NOHOST), no plan, no state change but the multi-step reference marks of the slots read."""
    rng = np.random.default_rng(7)
    nohost = 0
    for _ in range(100):
        B, S, K = 3, int(rng.integers(1, 4)), 12
        req = rng.permutation(R)[:B]
        lens = rng.integers(1, H - S + 2, B)[:, None] + np.arange(S)[None]  # every step <= H
        tk = _topk(rng, B, S, K, lens)
        st = _sparse_state()
        locs = rng.permutation(st["slot_locs"].size).reshape(st["slot_locs"].shape)
        locs[rng.random(locs.shape) < 0.1] = -1  # slots without a row
        st["slot_locs"] = locs.astype(np.int32)
        before = {k: v.copy() for k, v in st.items() if isinstance(v, np.ndarray)}
        direct = _positional_direct(tk, req, lens, st)
        nohost += int(direct.status[:, ref.ST_NOHOST].sum())
        if S == 1:
            got = ref.swap_in(tk[:, 0], req, lens[:, 0], **st)
            np.testing.assert_array_equal(got.device_locs, direct.device_locs[:, 0])
        else:
            marks = np.zeros((R, H), np.uint32)
            got = _multistep(tk, req, lens, st, marks=marks)
            np.testing.assert_array_equal(got.device_locs, direct.device_locs)
            b, s, i = np.nonzero(direct.device_locs >= 0)
            want = np.zeros((R, H), np.uint32)
            want[req[b], tk[b, s, i]] = 1  # the epoch: each slot read is referenced
            np.testing.assert_array_equal(marks, want)
        assert (got.plan_count == 0).all()
        np.testing.assert_array_equal(got.status, direct.status)
        for k, v in before.items():
            np.testing.assert_array_equal(st[k], v, err_msg=k)
    assert nohost > 0


def test_a_token_never_written_is_nohost_as_in_the_sparse_swap():
    """Issue 60, case 4: a resident row's token whose host row is -1 (never written) is -1 and
    counts NOHOST, exactly where the sparse swap of the same call (rows past H, every token a
    miss) gives -1 and NOHOST; the newest token (``seq - 1``) is served though this step only
    writes it."""
    rng = np.random.default_rng(9)
    for _ in range(200):
        B, K = 3, 8
        req = rng.permutation(R)[:B]
        lens = rng.integers(H + 1, MAX_LEN + 1, B)
        tk = _topk(rng, B, 1, K, lens[:, None])[:, 0]
        st = _sparse_state()
        st["host_locs"][rng.random(st["host_locs"].shape) < 0.3] = -1
        st["host_locs"][req, lens - 1] = -1  # the newest: its backup has not run
        sparse = ref.swap_in(tk, req, lens, **st)
        table = _pages(rng)
        res = ref.resident_swap(tk, req, lens, resident=np.ones(R, bool), page_table=table,
                                page_tokens=P, hot_size=H, max_len=MAX_LEN,
                                host_locs=st["host_locs"])
        np.testing.assert_array_equal(res.device_locs >= 0, sparse.device_locs >= 0)
        np.testing.assert_array_equal(res.status, sparse.status)
        newest = tk == (lens - 1)[:, None]
        assert (res.device_locs[newest] >= 0).all()


def test_a_positional_rows_token_never_written_is_nohost():
    """A sparse request of ``seq <= H`` (the positional layout) whose engine stepped past its
    written tokens: a token without a host row (never written, not the newest) is -1 and
    counts NOHOST, as the LRU path past H and a resident row give, instead of its slot's old
    bytes with status 0 (the slot may hold the previous request's row). In the single- and
    the multi-step oracle alike; the newest token (``seq - 1``) is served."""
    rng = np.random.default_rng(11)
    hits = 0
    for _ in range(100):
        B, S, K = 3, int(rng.integers(1, 4)), 12
        req = rng.permutation(R)[:B]
        lens = rng.integers(2, H - S + 2, B)[:, None] + np.arange(S)[None]  # every step <= H
        tk = _topk(rng, B, S, K, lens)
        st = _sparse_state()
        st["host_locs"][rng.random(st["host_locs"].shape) < 0.3] = -1  # never written
        direct = _positional_direct(tk, req, lens, st)
        if S == 1:
            got = ref.swap_in(tk[:, 0], req, lens[:, 0], **st)
            locs = got.device_locs[:, None]
        else:
            got = _multistep(tk, req, lens, st)
            locs = got.device_locs
        np.testing.assert_array_equal(locs, direct.device_locs[:, :S])
        np.testing.assert_array_equal(got.status, direct.status)
        b, s, i = np.nonzero(tk >= 0)
        unwritten = (st["host_locs"][req[b], np.clip(tk[b, s, i], 0, MAX_LEN - 1)] < 0) & \
            (tk[b, s, i] != lens[b, s] - 1) & (tk[b, s, i] < lens[b, s])
        assert (locs[b[unwritten], s[unwritten], i[unwritten]] == -1).all()
        cols = np.arange(K)[None, None] < lens[:, :, None]  # entries i >= seq are -1 here
        newest = (tk == (lens - 1)[:, :, None]) & cols
        assert (locs[newest] >= 0).all()
        hits += int(unwritten.sum())
    assert hits > 0


def test_a_positional_rows_tokens_past_max_len_are_range_not_read():
    """``hot_size`` may exceed ``max_len`` (the defaults: 4096 slots, any shorter max_len), so a
    positional row (``seq <= H``) can be longer than its ``host_locs`` row when an engine passes
    ``seq > max_len``. Its tokens at or past ``max_len`` are -1 and count RANGE, as past H (the
    status contract, ``_checks.raise_on_status``: RANGE from ``min(seq, max_len)``); the
    never-written check must not read ``host_locs`` there (past the row, past the array for the
    last request slot). Single- and multi-step oracles and the direct path agree."""
    Hs, Ws, ML, Rs = 8, 10, 4, 2

    def state():
        return dict(host_locs=np.arange(Rs * ML, dtype=np.int64).reshape(Rs, ML),
                    slot_tokens=np.tile(np.arange(Ws, dtype=np.int32), (Rs, 1)),  # t in slot t
                    slot_locs=(np.arange(Rs)[:, None] * Ws + np.arange(Ws)).astype(np.int32),
                    n_host_rows=Rs * ML)

    tk = np.array([[[0, 3, 4, 5]]], np.int32)  # 4, 5 >= max_len, < seq
    req, lens = np.array([Rs - 1]), np.array([[6]])
    single = ref.swap_in(tk[:, 0], req, lens[:, 0], **state(), hot_size=Hs,
                         lru=np.tile(np.arange(Hs, dtype=np.int16), (Rs, 1)))
    multi = _multistep(tk, req, lens, state(), hot_size=Hs)
    direct = _positional_direct(tk, req, lens, state(), hot_size=Hs, max_len=ML)
    slot_locs = state()["slot_locs"]
    want = [slot_locs[Rs - 1, 0], slot_locs[Rs - 1, 3], -1, -1]
    for got in (single.device_locs[0], multi.device_locs[0, 0], direct.device_locs[0, 0]):
        assert got.tolist() == want
    for st in (single.status, multi.status, direct.status):
        assert st[0, ref.ST_RANGE] == 2 and st[0, ref.ST_NOHOST] == 0
