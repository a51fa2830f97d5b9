"""CPU: the single-step oracle on hand-built states with hand-computed results."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_cupy import reference as ref

H, P = 8, 2
SEQ = 51  # > H: LRU path; token 50 is the newest


def state():
    slot_tokens = np.array([[10, 11, 12, 13, -1, -1, -1, -1, 50, -1]], np.int32)
    slot_locs = np.arange(100, 110, dtype=np.int32).reshape(1, H + P)
    lru = np.array([[3, 1, 0, 2, 4, 5, 6, 7]], np.int16)
    host_locs = np.full((1, 64), -1, np.int64)
    host_locs[0, :SEQ] = 1000 + np.arange(SEQ)
    return dict(host_locs=host_locs, slot_tokens=slot_tokens, slot_locs=slot_locs, lru=lru)


def run(topk, seq=SEQ, st=None, num_real=None, req=0, n_host_rows=2000):
    st = st or state()
    topk = np.array([topk], np.int32)
    res = ref.swap_in(topk, np.array([req]), np.array([seq]), hot_size=H,
                      n_host_rows=n_host_rows, num_real=num_real, **st)
    return res, st


def test_all_hits_move_to_mru_end_in_old_order():
    res, st = run([12, 10, -1, 11])
    assert res.device_locs.tolist() == [[102, 100, -1, 101]]
    assert st["lru"].tolist() == [[3, 4, 5, 6, 7, 1, 0, 2]]
    assert res.plan_count.tolist() == [0]
    assert res.status.tolist() == [[0, 0, 0]]
    ref.check_invariants(st["slot_tokens"], st["slot_locs"], st["lru"], H)


def test_mixed_misses_take_least_recent_evictables_in_topk_order():
    res, st = run([20, 10, 50, 21])
    # evictables in old order: slots 3, 1, 2, 4..7; hit: slot 0; newest: slot H
    assert res.device_locs.tolist() == [[103, 100, 108, 101]]
    assert st["slot_tokens"][0, [3, 1]].tolist() == [20, 21]
    assert st["lru"].tolist() == [[2, 4, 5, 6, 7, 3, 1, 0]]
    assert res.plan_count.tolist() == [2]
    assert res.plan_src[0, :2].tolist() == [1020, 1021]
    assert res.plan_dst[0, :2].tolist() == [103, 101]
    ref.check_invariants(st["slot_tokens"], st["slot_locs"], st["lru"], H)


def test_all_misses():
    res, st = run([30, 31, 32, 33])
    assert res.device_locs.tolist() == [[103, 101, 100, 102]]
    assert st["lru"].tolist() == [[4, 5, 6, 7, 3, 1, 0, 2]]
    assert res.plan_count.tolist() == [4]
    assert st["slot_tokens"][0, :4].tolist() == [32, 31, 33, 30]


def test_newest_token_is_served_from_slot_h_and_never_enters_lru():
    res, st = run([50, 50, -1, -1])
    assert res.device_locs.tolist() == [[108, 108, -1, -1]]
    assert res.plan_count.tolist() == [0]
    assert st["lru"].tolist() == [[3, 1, 0, 2, 4, 5, 6, 7]]


def test_duplicates_load_once_and_share_the_row():
    res, st = run([20, 20, 10, 20])
    assert res.device_locs.tolist() == [[103, 103, 100, 103]]
    assert res.plan_count.tolist() == [1]
    assert (st["slot_tokens"][0, :H] == 20).sum() == 1
    ref.check_invariants(st["slot_tokens"], st["slot_locs"], st["lru"], H)


def test_out_of_range_tokens_give_minus_one_and_status_without_touching_state():
    before = state()
    res, st = run([-5, 51, 60, 10])
    assert res.device_locs.tolist() == [[-1, -1, -1, 100]]
    assert res.status.tolist() == [[3, 0, 0]]
    assert np.array_equal(st["slot_tokens"], before["slot_tokens"])


def test_missing_host_row_is_reported_and_not_cached():
    st = state()
    st["host_locs"][0, 20] = -1
    st["host_locs"][0, 22] = 5000  # beyond the pool (n_host_rows = 2000)
    res, st = run([20, 21, 20, 22], st=st)
    assert res.device_locs.tolist() == [[-1, 103, -1, -1]]
    assert res.status.tolist() == [[0, 3, 0]]
    assert res.plan_count.tolist() == [1]
    assert 20 not in st["slot_tokens"][0].tolist()


def test_fast_path_positional_and_padding_columns():
    res, st = run([1, -1, 0, 0], seq=2)
    assert res.device_locs.tolist() == [[101, -1, -1, -1]]
    res, st = run([4, 2, -1, 7], seq=5)
    assert res.device_locs.tolist() == [[104, 102, -1, -1]]
    assert res.status.tolist() == [[1, 0, 0]]
    assert st["lru"].tolist() == state()["lru"].tolist()


def test_padding_rows_touch_nothing():
    before = state()
    res, st = run([20, 21, 22, 23], num_real=0)
    assert res.device_locs.tolist() == [[-1] * 4]
    assert res.plan_count.tolist() == [0]
    assert res.status.tolist() == [[0, 0, 0]]
    for k in before:
        assert np.array_equal(st[k], before[k])


def test_bad_request_slot_and_negative_length():
    res, _ = run([20, 21, 22, 23], req=3)
    assert res.status.tolist() == [[0, 0, 1]] and (res.device_locs == -1).all()
    res, _ = run([20, 21, 22, 23], seq=-1)
    assert res.status.tolist() == [[0, 0, 1]]


def test_invariant_checker_catches_damage():
    st = state()
    st["slot_tokens"][0, 4] = 10  # token 10 twice
    with pytest.raises(ref.InvariantError, match="twice"):
        ref.check_invariants(st["slot_tokens"], st["slot_locs"], st["lru"], H)
    st = state()
    st["lru"][0, 0] = 1
    with pytest.raises(ref.InvariantError, match="permutation"):
        ref.check_invariants(st["slot_tokens"], st["slot_locs"], st["lru"], H)


def test_random_steps_keep_invariants(rng):
    from _util import lru_state

    R, Hh, K = 4, 96, 48
    slot_tokens, slot_locs, lru = lru_state(R, Hh, 4, rng, max_token=500)
    host_locs = np.arange(R * 600, dtype=np.int64).reshape(R, 600)
    for _ in range(200):
        B = int(rng.integers(1, R + 1))
        req = rng.permutation(R)[:B]
        seq = rng.integers(Hh - 10, 600, size=B)
        topk = rng.integers(-3, 620, size=(B, K)).astype(np.int32)
        res = ref.swap_in(topk, req, seq, host_locs=host_locs, slot_tokens=slot_tokens,
                          slot_locs=slot_locs, lru=lru, hot_size=Hh, n_host_rows=R * 600)
        ref.check_invariants(slot_tokens, slot_locs, lru, Hh)
        for b in range(B):
            if seq[b] <= Hh:
                continue
            valid = (topk[b] >= 0) & (topk[b] < seq[b])
            assert (res.device_locs[b][valid] >= 0).all()
            assert (res.device_locs[b][~valid] == -1).all()
            # every resolved entry points at a slot holding its token (or slot H for the newest)
            r = req[b]
            for i in np.nonzero(valid)[0]:
                slot = int(res.device_locs[b, i]) - int(slot_locs[r, 0])
                tok = topk[b, i]
                assert slot == Hh if tok == seq[b] - 1 else slot_tokens[r, slot] == tok
