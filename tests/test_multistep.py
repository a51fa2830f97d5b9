"""Multi-step (MTP) swap: sizing and validation, the NumPy oracle, and the GPU kernels against it.

GPU calls are compared with :func:`hisparse_cupy.reference.multistep_swap_in` given the
kernel's miss order (read back from the recorded miss plan): outputs, status, plan, statistics
and every state array must match exactly; the token -> slot table is checked with
``check_multistep_invariants``; and the bytes of
every output row and of every resident hot slot are checked against the host pattern.
"""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_cupy import reference as ref
from hisparse_cupy._abi import default_scratch
from hisparse_cupy._kernels.multistep import MultiStepConfig, commit_smem_bytes, table_size
from hisparse_cupy.testing.twin import Twin

# ============================================================================ CPU: sizing


def test_config_defaults_and_sizes():
    cfg = MultiStepConfig(64, 4096, 64, 2048)
    assert cfg.max_steps == 4 and cfg.max_tokens == 8192
    assert cfg.scratch == 4096 == default_scratch(4096, 2048, 4)
    assert cfg.max_batch == 64
    assert cfg.slots == 4160 and cfg.rows_per_request == 4160 + 4096
    assert cfg.table_size == table_size(8192) == 16384
    assert cfg.commit_smem == commit_smem_bytes(4096, 8192) < 48 * 1024
    assert MultiStepConfig(8, 4096, 64, 2048, max_steps=2).scratch == 1024
    assert MultiStepConfig(8, 100, 8, 30, max_steps=4).scratch == 120  # min(T, 1024) > T - H
    assert cfg.state_bytes(10000) - cfg.state_bytes(9000) == 64 * 2 * 1000  # the token table
    assert cfg.workspace_bytes() > 0


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(max_steps=1), "max_steps must be >= 2"),
        (dict(max_steps=5), "max_steps must be <= 4"),
        (dict(top_k=4097), "top_k must be <= 4096"),
        (dict(hot_size=1, top_k=1), "hot_size must be >= 2"),
        (dict(hot_size=40000), "hot_size must be <= 32767"),
        (dict(hot_size=8192, top_k=4096, max_steps=3), "max_steps \\* top_k must be <= 8192"),
        (dict(scratch=4095), "scratch must be >= 4096"),
        (dict(scratch=0, hot_size=8000, top_k=1000, max_steps=2), "scratch must be >= 1"),
        (dict(scratch=2, hot_size=64, top_k=1, max_steps=4), "scratch must be >= 3"),
        (dict(n_requests=0), "n_requests must be >= 1"),
        (dict(extra_page=0), "extra_page must be >= 1"),
        (dict(max_batch=0), "max_batch must be >= 1"),
    ],
)
def test_config_rejects(kw, msg):
    args = dict(n_requests=4, hot_size=4096, extra_page=64, top_k=2048)
    args.update(kw)
    n, h, p, k = (args.pop(x) for x in ("n_requests", "hot_size", "extra_page", "top_k"))
    with pytest.raises(ValueError, match=msg):
        MultiStepConfig(n, h, p, k, **args)


def test_config_rejects_types():
    with pytest.raises(TypeError, match="top_k must be an int"):
        MultiStepConfig(4, 64, 8, 16.0)


def test_layout_and_table_checks():
    cfg = MultiStepConfig(3, 16, 4, 8, max_steps=2)
    slot_locs, scratch_locs, D = cfg.layout(base=5)
    assert D == 5 + 3 * cfg.rows_per_request
    rows = np.concatenate([slot_locs.ravel(), scratch_locs.ravel()])
    assert np.unique(rows).size == rows.size and rows.min() == 5 and rows.max() == D - 1
    tokens = np.full((3, 20), -1, np.int32)
    tokens[:, :16] = np.arange(16)
    cfg.check_tables(tokens, slot_locs, scratch_locs, D)
    bad = tokens.copy()
    bad[1, 3] = 7
    with pytest.raises(ValueError, match="holds a token twice"):
        cfg.check_tables(bad, slot_locs, scratch_locs, D)
    bad = tokens.copy()
    bad[0, 0] = -3
    with pytest.raises(ValueError, match="below -1"):
        cfg.check_tables(bad, slot_locs, scratch_locs, D)
    sl = slot_locs.copy()
    sl[2, 1] = scratch_locs[0, 0]
    with pytest.raises(ValueError, match="must not share device rows"):
        cfg.check_tables(tokens, sl, scratch_locs, D)
    sl = slot_locs.copy()
    sl[0, 3] = -1
    with pytest.raises(ValueError, match="every hot slot owns a row"):
        cfg.check_tables(tokens, sl, scratch_locs, D)
    with pytest.raises(ValueError, match="n_device_rows"):
        cfg.check_tables(tokens, slot_locs, scratch_locs, D - 1)
    with pytest.raises(ValueError, match="scratch_locs must have shape"):
        cfg.check_tables(tokens, slot_locs, scratch_locs[:, :-1], D)


def test_the_instance_table_lists_the_multistep_kernels():
    """(Their compiles: tests/test_build.py's compile check covers every instance.)"""
    from hisparse_cupy._kernels import build

    names = build.INSTANCES["multistep.cu"]
    assert any("gather" in n for n in names) and any("commit" in n for n in names)
    assert any("init" in n for n in names) and len(names) == 9


# ============================================================================ CPU: oracle


def _np_state(R, H, P, C, tokens_by_req, *, extra=None):
    """Slot tables with the given hot tokens in slots 0.., layout rows, zero refs, clock (1, 0)."""
    cfg = MultiStepConfig(R, H, P, 1, max_steps=2, scratch=C)
    slot_locs, scratch_locs, D = cfg.layout()
    st = np.full((R, H + P), -1, np.int32)
    for r, toks in enumerate(tokens_by_req):
        st[r, : len(toks)] = toks
    if extra:
        for (r, j), t in extra.items():
            st[r, H + j] = t
    return dict(slot_tokens=st, slot_locs=slot_locs, scratch_locs=scratch_locs,
                ref=np.zeros((R, H), np.uint32), clock=np.tile(np.uint32([1, 0]), (R, 1))), D


def _run(topk, req, seqs, state, *, H, max_len=1000, n_host_rows=None, host_locs=None, **kw):
    R = state["slot_tokens"].shape[0]
    if host_locs is None:
        host_locs = (np.arange(R).reshape(-1, 1) * max_len + np.arange(max_len)).astype(np.int64)
    return ref.multistep_swap_in(np.asarray(topk, np.int32), np.asarray(req), np.asarray(seqs),
                            host_locs=host_locs, hot_size=H,
                            n_host_rows=n_host_rows or host_locs.size, **state, **kw)


def test_oracle_dedups_across_steps_and_resolves_hits():
    H, P, C = 8, 4, 8
    st, _ = _np_state(1, H, P, C, [[10, 11, 12, 13]])
    topk = [[[10, 50, 51, 11], [51, 50, 12, 50]]]  # 50 and 51 missed in both steps
    res = _run(topk, [0], [[100, 101]], st, H=H)
    assert res.plan_count[0] == 2 and res.stats[0].tolist() == [2, 2, 5, 0]
    out = res.device_locs[0]
    assert out[0, 0] == st["slot_locs"][0, 0] and out[0, 3] == st["slot_locs"][0, 1]
    assert out[0, 1] == out[1, 1] == out[1, 3] and out[0, 2] == out[1, 0]
    assert out[0, 1] != out[0, 2]
    # misses ordered by reverse rank: step 1 entry 0 (token 51) comes first
    assert res.misses[0] == [50, 51]
    assert sorted(res.plan_src[0, :2].tolist()) == [50, 51]
    # admitted into the empty slots 4, 5 (ring order from cursor 0), 51 first
    assert st["slot_tokens"][0, 4] == 51 and st["slot_tokens"][0, 5] == 50
    assert st["clock"][0].tolist() == [2, 6]
    assert (st["ref"][0, [0, 1, 2, 4, 5]] == 1).all() and st["ref"][0, 3] == 0
    # rotation: the admitted rows are the scratch rows the outputs point to
    assert st["slot_locs"][0, 5] == out[0, 1] and st["slot_locs"][0, 4] == out[0, 2]
    assert res.status.sum() == 0


def test_oracle_invalid_entries_and_extra_page():
    H, P, C = 8, 4, 8
    st, _ = _np_state(1, H, P, C, [[1, 2]], extra={(0, 0): 99, (0, 2): 100})
    host = (np.arange(200)).astype(np.int64).reshape(1, -1)
    host[0, 7] = -1  # token 7 has no host row
    topk = [[[-1, -5, 101, 99, 7, 7, 1, 100], [100, 99, 1, 2, 200, 7, 300, -1]]]
    res = _run(topk, [0], [[100, 101]], st, H=H, host_locs=host)
    k = [ref.MULTISTEP_KINDS[i] for i in res.kind[0].ravel()]
    assert k[:8] == ["unused", "range", "range", "extra", "nohost", "nohost", "hit", "range"]
    assert k[8:] == ["extra", "extra", "hit", "hit", "range", "nohost", "range", "unused"]
    assert res.status[0].tolist() == [5, 3, 0]
    assert res.device_locs[0, 0, 3] == st["slot_locs"][0, H] and res.plan_count[0] == 0
    assert res.device_locs[0, 1, 0] == st["slot_locs"][0, H + 2]
    assert st["clock"][0].tolist() == [2, 0]  # no victim: the cursor stays


def test_oracle_positional_path():
    H, P, C = 8, 4, 8
    st, _ = _np_state(1, H, P, C, [list(range(8))])
    topk = [[[3, 0, 2, 5], [4, 9, 1, 1]]]
    res = _run(topk, [0], [[3, 4]], st, H=H)
    # step 0 (seq 3): token 3 is out of range, column 3 is padding (no status)
    assert res.device_locs[0, 0].tolist() == [-1, st["slot_locs"][0, 0],
                                              st["slot_locs"][0, 2], -1]
    assert res.device_locs[0, 1, :2].tolist() == [-1, -1] and res.status[0].tolist() == [3, 0, 0]
    assert (st["ref"][0, [0, 1, 2]] == 1).all() and (st["ref"][0, 3:] == 0).all()
    assert res.device_locs[0, 1, 2] == res.device_locs[0, 1, 3] == st["slot_locs"][0, 1]


def test_oracle_token_in_every_step_gets_one_row():
    """Steps L, L + 1, ... with an extra page shorter than the steps: the newest token (in
    slot H) selected in every step is found there in every step (the row's shortest length
    decides, not the occurrence's), never loaded a second time."""
    H, P, C = 8, 1, 8
    for S in (2, 3, 4):
        st, _ = _np_state(1, H, P, C, [[3, 4]], extra={(0, 0): 20})
        res = _run([[[20]] * S], [0], [[21 + s for s in range(S)]], st, H=H)
        assert res.device_locs[0, :, 0].tolist() == [st["slot_locs"][0, H]] * S
        assert res.plan_count[0] == 0 and (st["slot_tokens"][0, :H] != 20).all()


def test_oracle_positional_row_admits_nothing():
    """A row whose shortest step is positional (seq <= H) keeps every slot: its misses (the
    draft tokens >= H of its longer steps) come from scratch rows for this call only."""
    H, P, C = 8, 2, 3
    st, _ = _np_state(1, H, P, C, [list(range(8))])
    locs, scr = st["slot_locs"].copy(), st["scratch_locs"].copy()
    topk = [[[0, 5, -1], [7, 8, 0], [8, 9, 6]]]
    res = _run(topk, [0], [[8, 9, 10]], st, H=H)
    out = res.device_locs[0]
    assert out[0].tolist() == [locs[0, 0], locs[0, 5], -1]
    assert out[1, 0] == locs[0, 7] and out[1, 2] == locs[0, 0] and out[2, 2] == locs[0, 6]
    assert out[1, 1] == out[2, 0] and {out[1, 1], out[2, 1]} <= set(scr[0].tolist())
    assert res.stats[0].tolist() == [2, 0, 0, 1] and res.status.sum() == 0
    np.testing.assert_array_equal(st["slot_tokens"][0, :H], np.arange(H))
    np.testing.assert_array_equal(st["slot_locs"], locs)
    np.testing.assert_array_equal(st["scratch_locs"], scr)


def test_oracle_mirror_layer():
    """Layer dst takes src's layout: each of src's rows gets dst's own bytes of its token,
    from where dst held it, else from dst's host row."""
    rng = np.random.default_rng(5)
    R, W, max_len, row = 2, 6, 40, 4
    host_locs = (np.arange(R)[:, None] * max_len + np.arange(max_len)).astype(np.int64)
    host = rng.integers(0, 255, (R * max_len, row), dtype=np.uint8)  # dst's host rows
    src = dict(slot_tokens=np.array([[3, 5, -1, 7, 9, 30], [1, 2, 4, -1, -1, 6]], np.int32),
               slot_locs=np.array([[5, 4, 3, 2, 1, 0], [6, 7, 8, 9, 10, 11]], np.int32),
               lru=np.arange(12, dtype=np.int16).reshape(R, W))
    dst = dict(slot_tokens=np.array([[5, 3, 9, 8, -1, 30], [6, 2, 1, 4, -1, -1]], np.int32),
               slot_locs=np.arange(12, dtype=np.int32).reshape(R, W),
               lru=np.zeros((R, W), np.int16))
    dev = rng.integers(0, 255, (12, row), dtype=np.uint8)
    want = {}  # row -> bytes
    for r in range(R):
        where = dict(zip(dst["slot_tokens"][r].tolist(), dst["slot_locs"][r].tolist(),
                         strict=True))
        for t, to in zip(src["slot_tokens"][r], src["slot_locs"][r], strict=True):
            if t >= 0:
                want[int(to)] = (dev[where[t]] if t in where else host[host_locs[r, t]]).copy()
    ref.mirror_layer(src, dst, host_locs=host_locs, dst_device=dev, dst_host=host)
    for to, b in want.items():
        np.testing.assert_array_equal(dev[to], b, err_msg=f"row {to}")
    for k in src:
        np.testing.assert_array_equal(dst[k], src[k])
    np.testing.assert_array_equal(dev[2], host[7])  # token 7, which dst did not hold


def test_oracle_victim_order_and_partial_admission():
    H, P, C = 6, 2, 6
    st, _ = _np_state(1, H, P, C, [[10, 11, 12, 13, -1, 15]])
    st["ref"][0] = [3, 0, 1, 3, 0, 2]
    st["clock"][0] = [4, 2]  # epoch 4, cursor 2
    # ring from 2: slots 2,3,4,5,0,1 ; keys: age 3, age 1, empty, age 2, age 1, never
    topk = [[[60, 61], [62, 60]]]
    res = _run(topk, [0], [[500, 501]], st, H=H)
    # 3 misses, 6 evictable: take empty (slot 4), never (slot 1), age 3 (slot 2)
    assert res.stats[0].tolist() == [3, 3, 6, 0]
    assert sorted(st["slot_tokens"][0, [1, 2, 4]].tolist()) == [60, 61, 62]
    # victims in ring order 2, 4, 1 paired with misses by reverse rank: 62, 60, 61
    assert st["slot_tokens"][0, [2, 4, 1]].tolist() == [62, 60, 61]
    assert st["clock"][0].tolist() == [5, (2 + 5 + 1) % 6]
    # partial: 8 misses in steps of 4, 6 slots
    st2, _ = _np_state(1, H, P, C, [[10, 11]])
    topk = [[[70, 71, 72, 10], [73, 74, 75, 76]]]
    res = _run(topk, [0], [[500, 501]], st2, H=H)
    assert res.stats[0].tolist() == [7, 5, 5, 1]
    # the last step's misses first: 73..76, then 70 (step 0, entry 0)
    assert sorted(st2["slot_tokens"][0].tolist()[:H]) == [10, 70, 73, 74, 75, 76]
    assert len(set(res.device_locs[0].ravel().tolist())) == 8  # every output distinct


def test_oracle_overflow_goes_straight_to_victims():
    H, P, C = 4, 2, 2
    st, _ = _np_state(1, H, P, C, [[]])
    topk = [[[1, 2, 3], [4, 5, 1]]]
    res = _run(topk, [0], [[100, 101]], st, H=H, miss_order=[[5, 4, 1, 2, 3]])
    assert res.stats[0].tolist() == [5, 4, 4, 1] and res.status.sum() == 0
    # u >= 2 (tokens 1, 2, 3) have no scratch row: admitted first; then 1 of {5, 4} by rank
    # (4 is step 1 entry 0 -> rank 0), so 5 stays in scratch
    assert sorted(st["slot_tokens"][0, :H].tolist()) == [1, 2, 3, 4]
    locs = res.device_locs[0].ravel()
    assert len(set(locs.tolist())) == 5 and (locs >= 0).all()
    assert res.plan_src[0, :5].tolist() == [5, 4, 1, 2, 3]
    with pytest.raises(ValueError, match="miss_order"):
        _run(topk, [0], [[100, 101]], _np_state(1, H, P, C, [[]])[0], H=H,
             miss_order=[[5, 4, 1, 2]])


def test_oracle_padding_bad_rows_and_epoch_wrap():
    H, P, C = 4, 2, 8
    st, _ = _np_state(3, H, P, C, [[1], [2], [3]])
    st["clock"][0] = [0xFFFFFFFF, 0]
    st["ref"][0] = [5, 0, 0, 0]
    topk = np.full((4, 2, 2), 1, np.int32)
    res = _run(topk, [0, 7, 1, 2], [[10, 11], [10, 11], [-1, 10], [10, 11]], st, H=H,
               num_real=3)
    assert res.status[:, ref.ST_BADROW].tolist() == [0, 1, 1, 0]
    assert (res.device_locs[1:] == -1).all()
    assert st["clock"][0].tolist() == [1, 0] and (st["ref"][0] == 0).all()
    assert st["clock"][1].tolist() == [1, 0] and st["clock"][2].tolist() == [1, 0]


def test_invariants_detect_damage():
    H, P, C = 8, 2, 8
    st, D = _np_state(2, H, P, C, [[5, 6, 7], [1]])
    table = np.random.default_rng(0).integers(-1, H, size=(2, 16), dtype=np.int16)
    for r in range(2):
        for s in range(H):
            t = int(st["slot_tokens"][r, s])
            if 0 <= t < 16:
                table[r, t] = s
    args = (st["slot_tokens"], st["slot_locs"], st["scratch_locs"], table, st["ref"],
            st["clock"], H)
    ref.check_multistep_invariants(*args, n_device_rows=D)
    st["slot_tokens"][0, 0] = 9  # a hot token the table does not name
    with pytest.raises(ref.InvariantError, match="maps hot token 9"):
        ref.check_multistep_invariants(*args)
    table[0, 9] = 0
    st["slot_tokens"][0, 1] = 99  # beyond the table's width: never looked up
    ref.check_multistep_invariants(*args)
    st["slot_tokens"][1, 3] = 1
    with pytest.raises(ref.InvariantError, match="twice"):
        ref.check_multistep_invariants(*args)
    st["slot_tokens"][1, 3] = -1
    st["scratch_locs"][1, 0] = st["slot_locs"][0, 2]
    with pytest.raises(ref.InvariantError, match="owned twice"):
        ref.check_multistep_invariants(*args)
    st["scratch_locs"][1, 0] = D + 100
    st["clock"][1] = [0, 0]
    with pytest.raises(ref.InvariantError, match="clock"):
        ref.check_multistep_invariants(*args)


# ============================================================================ GPU helpers
# The GPU tests run on the multi-step twin of the test harness
# (hisparse_cupy.testing.twin.Twin.multi):
# one layer's state over a pinned host pool whose row r * max_len + t holds token t of request
# r (pattern bytes), and its NumPy twin driven by the oracle.


def random_tokens(env, rng, rid, S, K):
    """[S, K] top-k: mostly shared between steps, with hits, misses, extra-page tokens,
    duplicates and invalid entries."""
    H = env.H
    Lr = int(env.lens[rid])
    st = env.np[0]["slot_tokens"][rid, :H]
    resident = st[(st >= 0) & (st < Lr - 1)]
    pool = env.pools[rid]

    def sample(n, heavy=False):
        # heavy: mostly tokens nobody asked for yet (unions beyond the hot buffer, overflow)
        p = [0.1, 0.15, 0.65, 0.02, 0.03, 0.03, 0.02] if heavy else \
            [0.45, 0.3, 0.08, 0.05, 0.04, 0.04, 0.04]
        kind = rng.choice(7, size=n, p=p)
        out = rng.choice(pool, size=n)
        m = kind == 0
        if resident.size:
            out[m] = rng.choice(resident, size=int(m.sum()))
        m = kind == 2
        out[m] = rng.integers(0, Lr - 1, size=int(m.sum()))
        m = kind == 3
        out[m] = Lr - 1 + rng.integers(0, S, size=int(m.sum()))
        out[kind == 4] = -1
        m = kind == 5
        bad = np.array([-7, -2, Lr + S + 5, 2**31 - 1, Lr + S, env.max_len + 3])
        out[m] = rng.choice(bad, size=int(m.sum()))
        m = kind == 6
        if env.nohost[rid].size:
            out[m] = rng.choice(env.nohost[rid], size=int(m.sum()))
        return out

    steps = [sample(K, heavy=rng.random() < 0.3)]
    for _ in range(1, S):
        cur = steps[-1].copy()
        if rng.random() < 0.6:
            n_new = int(rng.integers(0, K // 4 + 1))
            cur[rng.choice(K, n_new, replace=False)] = sample(n_new)
        else:  # a step that differs a lot
            n_new = int(rng.integers(K // 2, K + 1))
            cur[rng.choice(K, n_new, replace=False)] = sample(n_new, heavy=True)
        if rng.random() < 0.5:
            cur = rng.permutation(cur)
        steps.append(cur)
    topk = np.stack(steps)
    if rng.random() < 0.3:  # duplicates inside a step
        s = int(rng.integers(S))
        n = int(rng.integers(1, 4))
        topk[s, rng.choice(K, n, replace=False)] = topk[s, rng.choice(K, n, replace=False)]
    return topk.astype(np.int32)


def random_calls(env, rng, n_calls, B):
    R, K, C = env.R, env.K, env.multistep_state(0).config.scratch
    env.pools = []
    for r in range(R):
        Lr = int(env.lens[r])
        allowed = np.setdiff1d(np.arange(Lr - 1), env.nohost[r])
        env.pools.append(rng.choice(allowed, size=min(3 * env.H, allowed.size),
                                    replace=False))
    partial = overflow = misses = 0
    for c in range(n_calls):
        S = int(rng.integers(2, env.S + 1))
        req = rng.permutation(R)[:B].astype(np.int64)
        seqs = (env.lens[req].reshape(-1, 1) + np.arange(S)).astype(np.int64)
        topk = np.stack([random_tokens(env, rng, int(r), S, K) for r in req])
        if rng.random() < 0.05:  # a bad row: request slot out of range or negative length
            b = int(rng.integers(B))
            if rng.random() < 0.5:
                req[b] = [R, -1, R + 7][int(rng.integers(3))]
            else:
                seqs[b, int(rng.integers(S))] = -1
        num_real = None if rng.random() < 0.7 else int(rng.integers(0, B + 1))
        _, res = env.call(topk, req, seqs, num_real=num_real)
        partial += int(res.stats[:, 3].sum())
        overflow += int((res.stats[:, 0] > C).sum())
        misses += int(res.stats[:, 0].sum())
        if c % 97 == 96:
            env.readmit(int(rng.integers(R)))
    return partial, overflow, misses


@pytest.fixture
def pdl_mode(request):
    from hisparse_cupy.testing import knobs

    with knobs.pdl(request.param):
        yield request.param


# ============================================================================ GPU tests

pdl_params = [pytest.param(False, marks=pytest.mark.gpu, id="pdl_off"),
              pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.hopper], id="pdl_on")]


@pytest.mark.gpu
@pytest.mark.parametrize("pdl_mode", pdl_params, indirect=True)
@pytest.mark.parametrize("shape", [(64, 32, None), (60, 24, "min")], ids=["H64", "H60_minC"])
def test_random_calls_against_oracle(rng, pdl_mode, shape):
    """>= 1,000 random calls per PDL mode (2 shapes x 520), each checked exactly."""
    from hisparse_cupy import pdl_supported

    H, K, C = shape
    S_max = 4
    if C == "min":
        C = S_max * K - H
    R = 6
    lens = rng.integers(H + 10, 8 * H, size=R)
    lens[0] = H - 1  # positional layout, its last steps cross H
    lens[1] = H // 2  # short: positional steps only
    env = Twin.multi(rng, R=R, H=H, P=8, K=K, S_max=S_max, C=C, lens=lens, nohost=6, max_batch=4)
    assert pdl_supported() == pdl_mode or not pdl_mode
    partial, overflow, misses = random_calls(env, rng, 520, 4)
    # the runs exercised partial admission and misses beyond the scratch rows
    assert misses > 2000 and partial + overflow >= 3
    if C == S_max * K - H:
        assert overflow >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("B", [16, 17, 24])
def test_batches_either_side_of_the_copy_switch(rng, B):
    """Up to COPY_IN_COMMIT_MAX_ROWS batch rows x steps the commit grid's copy blocks move the
    bytes, above it the gather's warps (these batches with 2-4 steps give both): both checked
    exactly (outputs, state, plan, bytes), partial admission
    included (misses beyond the scratch rows are copied by the commit blocks in either case:
    test_random_calls_against_oracle covers them)."""
    from hisparse_cupy._kernels.multistep import COPY_IN_COMMIT_MAX_ROWS, copy_blocks

    for S in (2, 3, 4):
        assert (copy_blocks(B, S) > 0) == (B * S <= COPY_IN_COMMIT_MAX_ROWS)
    R, H, K, S_max = 24, 64, 32, 4
    lens = rng.integers(H + 10, 8 * H, size=R)
    env = Twin.multi(rng, R=R, H=H, P=8, K=K, S_max=S_max, C=S_max * K - H, lens=lens, nohost=6)
    partial, overflow, misses = random_calls(env, rng, 30, B)
    assert misses > 1000 and partial >= 1


@pytest.mark.gpu
def test_cross_step_duplicate_misses_copied_once(rng):
    H, K, S = 4096, 2048, 4
    env = Twin.multi(rng, R=2, H=H, P=64, K=K, S_max=S, row_bytes=576, fill=1.0,
              lens=[20000, 30000])
    topk = np.empty((2, S, K), np.int32)
    for b in range(2):
        res_tok = env.np[0]["slot_tokens"][b, :H]
        hits = rng.choice(res_tok[res_tok < env.lens[b] - 1], 1852, replace=False)
        resident = set(res_tok.tolist())
        fresh = np.array([t for t in rng.choice(int(env.lens[b]) - 1, 600, replace=False)
                          if t not in resident][:196])
        for s in range(S):
            topk[b, s] = rng.permutation(np.concatenate([hits, fresh]))
    got, res = env.call(topk, [0, 1], np.array([[20000 + s for s in range(S)],
                                                [30000 + s for s in range(S)]]))
    assert res.plan_count.tolist() == [196, 196]
    assert res.stats[:, 3].tolist() == [0, 0]  # the union fits: exact admission
    for b in range(2):
        src = env.plan.src[b, :196].get()
        assert np.unique(src).size == 196  # each unique miss copied once
        miss = res.kind[b] == ref.MULTISTEP_KINDS.index("miss")
        by_tok = {}
        for s, i in zip(*np.nonzero(miss), strict=True):
            by_tok.setdefault(int(topk[b, s, i]), set()).add(int(got[b, s, i]))
        assert len(by_tok) == 196 and all(len(v) == 1 for v in by_tok.values())
        assert set(fresh_t for fresh_t in by_tok) <= set(env.np[0]["slot_tokens"][b, :H].tolist())


@pytest.mark.gpu
def test_hundreds_of_unique_misses_across_steps(rng):
    H, K, S = 4096, 2048, 4
    L = 40000
    env = Twin.multi(rng, R=1, H=H, P=64, K=K, S_max=S, row_bytes=576, fill=1.0, lens=[L])
    res_tok = env.np[0]["slot_tokens"][0, :H]
    resident = set(res_tok.tolist())
    fresh = np.array([t for t in rng.permutation(L - 1) if t not in resident][:800])
    misses = [fresh[0:196], fresh[196:392],
              np.concatenate([fresh[[0]], fresh[392:587]]),
              np.concatenate([fresh[[196]], fresh[587:782]])]
    topk = np.empty((1, S, K), np.int32)
    for s in range(S):
        hits = np.roll(res_tok, 137 * s)[: K - len(misses[s])]
        topk[0, s] = rng.permutation(np.concatenate([hits, misses[s]]))
    _, res = env.call(topk, [0], [[L + s for s in range(S)]])
    assert res.plan_count[0] == 782 and res.stats[0, 3] == 0 and res.stats[0, 1] == 782
    # a second identical call hits everything
    _, res = env.call(topk, [0], [[L + s for s in range(S)]])
    assert res.plan_count[0] == 0


@pytest.mark.gpu
def test_full_overflow_union_far_beyond_hot_buffer(rng):
    H, K, S = 4096, 2048, 4
    L = 60000
    env = Twin.multi(rng, R=1, H=H, P=64, K=K, S_max=S, C=S * K - H, row_bytes=576, fill=1.0,
              lens=[L])
    resident = set(env.np[0]["slot_tokens"][0, :H].tolist())
    fresh = np.array([t for t in rng.permutation(L - 1) if t not in resident][: S * K])
    topk = fresh.reshape(1, S, K).astype(np.int32)
    got, res = env.call(topk, [0], [[L + s for s in range(S)]])
    assert res.plan_count[0] == S * K and res.stats[0].tolist() == [S * K, H, H, 1]
    assert res.status.sum() == 0 and (got >= 0).all()
    assert np.unique(got).size == S * K
    assert (env.plan.src[0, : S * K].get() >= 0).all()
    assert (env.plan.dst[0, : S * K].get() >= 0).all()
    # again with duplicates of half the tokens across steps (still far beyond H)
    topk2 = topk.copy()
    topk2[0, 2:] = topk[0, :2]
    _, res = env.call(topk2, [0], [[L + s for s in range(S)]])
    assert res.status.sum() == 0 and res.plan_count[0] > 0


@pytest.mark.gpu
def test_tokens_beyond_one_million(rng):
    H, K, S = 4096, 2048, 4
    L = 1_048_648
    env = Twin.multi(rng, R=1, H=H, P=64, K=K, S_max=S, row_bytes=64, fill=0.5, lens=[L])
    st = env.np[0]["slot_tokens"]
    st_gpu = env.multistep_state(0).slot_tokens
    st[0, H:] = -1  # no extra page: the newest token must come from the host
    st_gpu[0, H:] = -1
    resident = st[0, :H][st[0, :H] >= 0]
    topk = np.empty((1, S, K), np.int32)
    cand = [L - 1, L - 2, 2**20 + 5, 2**20 + 60, 2**20 + 61, L - 3, L - 4, L - 5]
    far = np.array([t for t in cand if t not in set(resident.tolist())][:4], np.int32)
    for s in range(S):
        topk[0, s] = np.concatenate([rng.choice(resident, K - 4, replace=False), far])
    seqs = [[L] * S]
    assert far.size == 4 and far.max() < L
    _, res = env.call(topk, [0], seqs)
    assert res.plan_count[0] == 4
    _, res = env.call(topk, [0], seqs)  # resident now: hits, no misses
    assert res.plan_count[0] == 0 and res.status.sum() == 0
    assert (res.kind[0, :, -4:] == ref.MULTISTEP_KINDS.index("hit")).all()


@pytest.mark.gpu
def test_extra_page_hits_never_read_host(rng):
    H, K, S, P = 4096, 2048, 4, 64
    L = 70000
    env = Twin.multi(rng, R=1, H=H, P=P, K=K, S_max=S, row_bytes=576, fill=0.6, lens=[L])
    import cupy

    st = env.np[0]["slot_tokens"]
    drafts = {0: L - 1, 7: L, 31: L + 1, 63: L + 2}
    st[0, H:] = -1
    for j, t in drafts.items():
        st[0, H + j] = t
        env.host_locs[0, t] = -1  # any host read of a draft token would fail
    rows = env.np[0]["slot_locs"][0, [H + j for j in drafts]]
    env.device_rows(0)[cupy.asarray(rows)] = cupy.asarray(env.bytes_of(0, 0, list(drafts.values())))
    ms = env.multistep_state(0)
    ms.slot_tokens[0] = cupy.asarray(st[0])
    ms.host_locs[0] = cupy.asarray(env.host_locs[0])
    resident = st[0, :H][st[0, :H] >= 0]
    topk = np.empty((1, S, K), np.int32)
    for s in range(S):
        d = [L - 1 + k for k in range(s + 1)]
        topk[0, s] = np.concatenate([rng.choice(resident, K - len(d), replace=False), d])
    got, res = env.call(topk, [0], [[L + s for s in range(S)]])
    assert res.plan_count[0] == 0 and res.status.sum() == 0
    for s in range(S):
        for k in range(s + 1):
            j = [j for j, t in drafts.items() if t == L - 1 + k][0]
            assert got[0, s, K - s - 1 + k] == env.np[0]["slot_locs"][0, H + j]


@pytest.mark.gpu
def test_token_in_every_step_gets_one_row(rng):
    """Per-step lengths L, L + 1, ... and an extra page shorter than the steps: the newest
    token (slot H) selected in every step gets slot H's row in every step (equal to the
    oracle)."""
    H, K, S = 64, 8, 4
    env = Twin.multi(rng, R=2, H=H, P=1, K=K, S_max=S, lens=[200, 300])
    for _ in range(4):
        seqs = env.lens[:, None] + np.arange(S)
        topk = np.stack([np.stack([np.concatenate([[int(env.lens[r]) - 1],
                                                   rng.integers(0, env.lens[r], K - 1)])
                                   for _ in range(S)]) for r in range(2)]).astype(np.int32)
        got, res = env.call(topk, [0, 1], seqs)
        got = got.get() if hasattr(got, "get") else got
        for r in range(2):
            assert (got[r, :, 0] == env.np[0]["slot_locs"][r, H]).all()


@pytest.mark.gpu
def test_positional_rows_straddling_h_admit_nothing(rng):
    """A row whose shortest step is positional keeps its slots, whatever its longer steps
    select (equal to the oracle; nothing admitted, slot tables unchanged)."""
    H, K, S = 64, 16, 4
    env = Twin.multi(rng, R=3, H=H, P=2, K=K, S_max=S, lens=[H - 1, H - 3, H], positional=(0, 1, 2))
    locs = env.np[0]["slot_locs"].copy()
    for _ in range(6):
        seqs = env.lens[:, None] + np.arange(S)
        topk = np.stack([np.stack([rng.integers(-1, seqs[r, s], K) for s in range(S)])
                         for r in range(3)]).astype(np.int32)
        got, res = env.call(topk, [0, 1, 2], seqs)
        assert (res.stats[:, 1] == 0).all() and res.status.sum() == 0
        np.testing.assert_array_equal(env.np[0]["slot_tokens"][:, :H],
                                      np.tile(np.arange(H), (3, 1)))
        np.testing.assert_array_equal(env.np[0]["slot_locs"], locs)


@pytest.mark.gpu
def test_padding_rows(rng):
    import cupy

    env = Twin.multi(rng, R=4, H=64, P=8, K=32, S_max=3)
    S, K = 3, 32
    env.pools = [np.arange(int(env.lens[r]) - 1) for r in range(4)]
    topk = np.stack([random_tokens(env, rng, r, S, K) for r in (2, 0, 1)])
    seqs = (env.lens[[2, 0, 1]].reshape(-1, 1) + np.arange(S))
    before = env.multistep_state(0).to_numpy()
    out = cupy.full((3, S, K), 4242, cupy.int32)
    got, res = env.call(topk, [2, 0, 1], seqs, num_real=1, out=out)
    assert (got[1:] == -1).all() and res.plan_count[1:].tolist() == [0, 0]
    after = env.multistep_state(0).to_numpy()
    for k in ("slot_tokens", "slot_locs", "scratch_locs", "token_slot", "ref", "clock"):
        np.testing.assert_array_equal(after[k][[0, 1, 3]], before[k][[0, 1, 3]])
    got, res = env.call(topk, [2, 0, 1], seqs, num_real=0)
    assert (got == -1).all() and res.status.sum() == 0


@pytest.mark.gpu
def test_adversarial_rows_and_strided_arrays(rng):
    import cupy

    from hisparse_cupy import multistep_swap_in

    env = Twin.multi(rng, R=4, H=64, P=8, K=16, S_max=4, nohost=5)
    S, K = 4, 16
    L0 = int(env.lens[0])
    nh = int(env.nohost[0][0])
    resident = env.np[0]["slot_tokens"][0, :64]
    hit = int(resident[resident >= 0][0])
    row0 = np.array([[-1, -2, L0, L0 + 50, 2**31 - 1, nh, nh, 5, 5, hit, hit, -(2**31), 7, 7,
                      L0 - 1, L0 + 3]] * S, np.int32)
    row0[1, :4] = [5, 7, 5, nh]  # duplicates across steps, again
    topk = np.stack([row0, row0, row0])
    req = [0, 9, 1]  # row 1: no such request slot
    seqs = np.array([[L0 + s for s in range(S)], [10, 11, 12, 13], [-1, 5, 5, 5]])
    before = env.multistep_state(0).to_numpy()
    # strided top-k and output rows (each row's [S, K] contiguous)
    big = cupy.zeros((3, S + 1, K), cupy.int32)
    big[:, :S] = cupy.asarray(topk)
    obig = cupy.full((3, S + 2, K), 99, cupy.int32)
    _, res = env.call(big[:, :S], req, seqs, out=obig[:, :S])
    assert res.status[0].tolist()[2] == 0 and res.status[0, 0] > 0 and res.status[0, 1] > 0
    assert res.status[1:, 2].tolist() == [1, 1]
    assert (obig[:, S:].get() == 99).all()
    after = env.multistep_state(0).to_numpy()
    for k in ("slot_tokens", "slot_locs", "scratch_locs", "token_slot", "ref", "clock"):
        np.testing.assert_array_equal(after[k][[1, 2, 3]], before[k][[1, 2, 3]])
    with pytest.raises(ValueError, match="multi-step swap found invalid input: row 0"):
        multistep_swap_in(big[:, :S], cupy.asarray([0, 1, 2]), cupy.asarray(seqs[[0, 0, 0]]),
                          env.multistep_state(0), **env.op_args(0), check=True)
    with pytest.raises(ValueError, match="repeats request slot"):
        multistep_swap_in(big[:, :S], cupy.asarray([0, 0, 2]), cupy.asarray(seqs[[0, 0, 0]]),
                          env.multistep_state(0), **env.op_args(0), check=True)


@pytest.mark.gpu
def test_call_validation(rng):
    import cupy

    from hisparse_cupy import MissPlan, Ptr, multistep_swap_in

    env = Twin.multi(rng, R=2, H=64, P=8, K=16, S_max=3, max_batch=2)
    kw = env.op_args(0)
    tk = cupy.zeros((2, 3, 16), cupy.int32)
    req = cupy.arange(2, dtype=cupy.int32)
    lens = cupy.full((2, 3), 500, cupy.int32)
    cases = [
        ((tk.astype(cupy.int64), req, lens), {}, TypeError, "top_k_tokens must have dtype"),
        ((tk[:, :1], req, lens[:, :1]), {}, ValueError, "2-3 steps"),
        ((cupy.zeros((2, 3, 17), cupy.int32), req, lens), {}, ValueError, "1..16 entries"),
        ((cupy.zeros((3, 3, 16), cupy.int32), cupy.arange(3), cupy.full((3, 3), 9)), {},
         ValueError, "workspace rows"),
        ((tk, req, lens[:, :2]), {}, ValueError, "seq_lens has 2 step column"),
        ((tk, req.astype(cupy.int16), lens), {}, TypeError, "req_indices must have dtype"),
        ((tk, req, lens), dict(device_rows=env.device_rows(0)[:-1]), ValueError, "device_rows has"),
        ((tk, req, lens), dict(host_rows=int(env.pool.device_ptr(0))), TypeError, "Ptr"),
        ((tk, req, lens), dict(plan=MissPlan(2, 47)), ValueError, "needs 48"),
        ((tk, req, lens), dict(out=cupy.zeros((2, 3, 15), cupy.int32)), ValueError,
         "out must have shape"),
        ((np.zeros((2, 3, 16), np.int32), req, lens), {}, TypeError, "NumPy"),
    ]
    for args, extra, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            multistep_swap_in(*args, env.multistep_state(0), **{**kw, **extra})
    assert isinstance(kw["host_rows"], Ptr)


@pytest.mark.gpu
def test_token_table_entries_of_tokens_not_held_are_never_trusted(rng):
    """Every entry but the hot tokens' own is garbage (slots in range included): the calls
    still equal the oracle, and every admission writes its token's entry."""
    import cupy

    env = Twin.multi(rng, R=2, H=64, P=8, K=32, S_max=4, max_batch=2)
    st = env.np[0]["slot_tokens"][:, :64]
    ms = env.multistep_state(0)
    table = rng.integers(-3, 80, size=ms.token_slot.shape, dtype=np.int16)
    r, s = np.nonzero(st >= 0)
    table[r, st[r, s]] = s
    ms.token_slot[...] = cupy.asarray(table)
    env.pools = [np.arange(int(env.lens[r]) - 1) for r in range(2)]
    for _ in range(20):
        topk = np.stack([random_tokens(env, rng, r, 4, 32) for r in (0, 1)])
        seqs = env.lens.reshape(-1, 1) + np.arange(4)
        env.call(topk, [0, 1], seqs)  # verify: oracle equality, invariants, bytes


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [True, False], ids=["swap_state", "own_table"])
def test_single_step_admissions_reach_the_multistep_table(rng, shared):
    """A single-step state from MultiStepState.swap_state records its admissions in the
    multi-step table (the invariant holds after it); negative control: a single-step state over
    the same slot tables with a table of its own leaves the multi-step table without them."""
    import cupy

    from hisparse_cupy import MissPlan, swap_in

    env = Twin.multi(rng, R=2, H=64, P=8, K=32, S_max=4, max_batch=2)
    lru = cupy.asarray(np.stack([rng.permutation(64) for _ in range(2)]).astype(np.int16))
    st = env.multistep_state(0)
    if shared:
        single = st.swap_state(lru)
        assert single.token_slot is st.token_slot and single.slot_tokens is st.slot_tokens
    else:
        from hisparse_cupy import SwapState

        single = SwapState.validated(st.host_locs, st.slot_tokens, st.slot_locs, lru,
                                     token_slot=cupy.full_like(st.token_slot, -1))
    held = set(env.np[0]["slot_tokens"][0, :64].tolist())
    fresh = [t for t in range(int(env.lens[0]) - 1) if t not in held and
             t not in set(env.nohost[0].tolist())][:32]
    topk = cupy.asarray(np.array([fresh, fresh], np.int32))
    swap_in(topk, cupy.asarray([0, 1], cupy.int32), cupy.asarray(env.lens[:2], cupy.int64),
            single, **env.op_args(0), plan=MissPlan(2, 32))
    gs = st.to_numpy()
    assert set(fresh) <= set(gs["slot_tokens"][0, :64].tolist())  # admitted
    args = (gs["slot_tokens"], gs["slot_locs"], gs["scratch_locs"], gs["token_slot"], gs["ref"],
            gs["clock"], 64)
    if shared:
        ref.check_multistep_invariants(*args)
    else:
        with pytest.raises(ref.InvariantError, match="maps hot token"):
            ref.check_multistep_invariants(*args)


@pytest.mark.gpu
def test_shared_workspace_and_plan_replay(rng):
    """Two layers share one workspace; a recorded plan replays through planned_copy."""
    import cupy

    from hisparse_cupy import replay_plan
    from hisparse_cupy._kernels.multistep import MultiStepWorkspace

    ws = MultiStepWorkspace(3, 4 * 32)
    envs = [Twin.multi(rng, R=3, H=64, P=8, K=32, S_max=4, workspace=ws) for _ in range(2)]
    for e in envs:
        e.pools = [np.arange(int(e.lens[r]) - 1) for r in range(3)]
    for it in range(30):
        e = envs[it % 2]
        S = 2 + it % 3
        req = rng.permutation(3)
        topk = np.stack([random_tokens(e, rng, int(r), S, 32) for r in req])
        seqs = e.lens[req].reshape(-1, 1) + np.arange(S)
        got, res = e.call(topk, req, seqs)
    # replay the last plan into a poisoned copy of the device rows
    replay = cupy.zeros_like(e.device_rows(0))
    B = 3
    replay_plan(e.plan, B, device_rows=replay, host_rows=e.pool.device_ptr(0),
                n_host_rows=e.pool.n_rows)
    cnt = e.plan.count[:B].get()
    dst = e.plan.dst[:B].get()
    rows = np.concatenate([dst[b, : cnt[b]] for b in range(B)])
    assert rows.size == cnt.sum() > 0
    np.testing.assert_array_equal(replay.get()[rows], e.device_rows(0).get()[rows])


@pytest.mark.gpu
@pytest.mark.parametrize("pdl_mode", pdl_params, indirect=True)
def test_graph_capture_and_replay(rng, pdl_mode):
    import cupy

    from hisparse_cupy import multistep_swap_in

    B, S, K = 3, 4, 32
    env = Twin.multi(rng, R=4, H=64, P=8, K=K, S_max=S, max_batch=B, nohost=3)
    env.pools = [np.arange(int(env.lens[r]) - 1) for r in range(4)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        d_topk = cupy.zeros((B, S, K), cupy.int32)
        d_req = cupy.zeros(B, cupy.int32)
        d_lens = cupy.zeros((B, S), cupy.int64)
        d_nr = cupy.full(1, B, cupy.int32)
        out = cupy.zeros((B, S, K), cupy.int32)
        status = cupy.zeros((B, 3), cupy.int32)

    def inputs():
        req = rng.permutation(4)[:B]
        topk = np.stack([random_tokens(env, rng, int(r), S, K) for r in req])
        seqs = env.lens[req].reshape(-1, 1) + np.arange(S)
        nr = int(rng.integers(1, B + 1))
        with stream:
            d_topk.set(topk, stream=stream)
            d_req.set(req.astype(np.int32), stream=stream)
            d_lens.set(seqs.astype(np.int64), stream=stream)
            d_nr.set(np.array([nr], np.int32), stream=stream)
        return topk, req, seqs, nr

    def op():
        multistep_swap_in(d_topk, d_req, d_lens, env.multistep_state(0), **env.op_args(0),
                          plan=env.plan, out=out, status=status, num_real=d_nr, stream=stream)

    cupy.cuda.Device().synchronize()
    args = inputs()
    op()  # eager: compiles and loads before capture
    stream.synchronize()
    env.check_call(*args, out, status)
    stream.begin_capture()
    op()
    graph = stream.end_capture()
    for _ in range(12):
        args = inputs()
        graph.launch(stream)
        stream.synchronize()
        env.check_call(*args, out, status)


@pytest.mark.gpu
def test_a_new_state_is_ready_for_a_call_on_any_stream(rng):
    """``MultiStepWorkspace`` and ``MultiStepState.create`` with another stream current, held
    busy, its pool's free blocks garbage: read on a non-blocking stream right after
    construction, the workspace and the token -> slot table, epochs and clock hold their
    initial values. (The state's own reset uploads its request rows from pageable memory,
    which already waits for the current stream; a workspace built alone has no such wait.)"""
    import cupy

    from hisparse_cupy import _abi
    from hisparse_cupy._kernels.multistep import MultiStepState, MultiStepWorkspace

    from _util import spin, stale_pool

    R, H, P, C, max_len = 3, 16, 2, 16, 64
    W = H + P
    base = (np.arange(R) * (W + C))[:, None]
    busy = cupy.cuda.Stream(non_blocking=True)
    s = cupy.cuda.Stream(non_blocking=True)
    with busy:
        host_locs = cupy.full((R, max_len), -1, cupy.int64)
        slot_tokens = cupy.full((R, W), -1, cupy.int32)
        slot_locs = cupy.asarray((base + np.arange(W)).astype(np.int32))
        scratch = cupy.asarray((base + W + np.arange(C)).astype(np.int32))

        def build():
            ws = MultiStepWorkspace(R, 2 * 8)
            return ws, MultiStepState.create(host_locs, slot_tokens, slot_locs, scratch,
                                             hot_size=H, top_k=8, n_device_rows=R * (W + C),
                                             max_steps=2, workspace=ws, validate=False)

        build()  # kernels built
        busy.synchronize()
        stale_pool(cupy)
        spin(cupy, 4_000_000_000)  # ~2 s
        ws = MultiStepWorkspace(R, 2 * 8)
        with s:
            got = {k: getattr(ws, k).copy() for k in ("table", "meta", "counters")}
        ws, st = build()
        with s:
            got.update({k: getattr(st, k).copy() for k in ("token_slot", "ref", "clock")})
    cupy.cuda.Device().synchronize()
    want = {"token_slot": -1, "ref": 0, "table": np.uint64(_abi.MS_EMPTY),
            "meta": _abi.MS_META_INIT, "counters": 0}
    for k, v in want.items():
        assert (cupy.asnumpy(got[k]) == v).all(), f"{k} not initialised before the call"
    assert cupy.asnumpy(got["clock"]).tolist() == [[1, 0]] * R
