"""GPU: the single-step swap kernel equals the NumPy oracle exactly, bytes included."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

POISON = 0x5A5A5A5A


class Harness:
    """Device state and its NumPy twin for one layer, host rows holding known patterns.

    Token t of request r has identity ``r * max_len + t``; its bytes are
    ``pattern(LAYER, identity)``. host_locs maps tokens to a shuffled host row (some -1, some
    beyond the pool); the host row holds the identity's pattern.
    """

    LAYER = 3

    def __init__(self, rng, *, R, K, H, P, row_bytes, max_len, adversarial=True, table=False):
        import cupy

        from hisparse_cupy import HostKVPool, MissPlan, SwapState

        from _util import lru_state, pattern

        self.rng, self.R, self.K, self.H, self.P = rng, R, K, H, P
        self.row_bytes, self.max_len = row_bytes, max_len
        n_ids = R * max_len
        perm = rng.permutation(n_ids)
        host_locs = perm.reshape(R, max_len).astype(np.int64)
        if adversarial:
            holes = rng.random((R, max_len)) < 0.01
            host_locs[holes] = -1
            far = rng.random((R, max_len)) < 0.003
            host_locs[far] = n_ids + 5  # outside the pool
        self.n_host_rows = n_ids
        self.pool = HostKVPool(1, n_ids, row_bytes)
        self.pool.layer(0)[perm] = pattern(self.LAYER, np.arange(n_ids), row_bytes)
        slot_tokens, slot_locs, lru = lru_state(R, H, P, rng, fill=0.8, max_token=max_len)
        # shuffle device rows so slot -> row is not the identity
        rows = rng.permutation(R * (H + P)).astype(np.int32).reshape(R, H + P)
        slot_locs[:] = rows
        self.np_state = dict(host_locs=host_locs, slot_tokens=slot_tokens, slot_locs=slot_locs,
                             lru=lru)
        # a token -> slot table starts as garbage: the first call must repair it
        token_slot = (cupy.asarray(rng.integers(-2**15, 2**15, size=host_locs.shape,
                                                dtype=np.int16)) if table else None)
        self.dev_state = SwapState.validated(*(cupy.asarray(self.np_state[k]) for k in
                                               ("host_locs", "slot_tokens", "slot_locs", "lru")),
                                             token_slot=token_slot)
        dev = np.full((R * (H + P), row_bytes), 0xEE, np.uint8)
        ids = (np.arange(R)[:, None] * max_len + slot_tokens[:, :H])
        held = slot_tokens[:, :H] >= 0
        dev[slot_locs[:, :H][held]] = pattern(self.LAYER, ids[held], row_bytes)
        self.device_rows = cupy.asarray(dev)
        self.plan = MissPlan(128, K)

    def write_newest(self, req, seq, nr):
        """What the model does each step: the newest token's KV into slot H's row."""
        import cupy

        from _util import pattern

        for b in range(nr):
            r, s = int(req[b]), int(seq[b])
            if 0 <= r < self.R and s > self.H:
                row = int(self.np_state["slot_locs"][r, self.H])
                self.device_rows[row] = cupy.asarray(
                    pattern(self.LAYER, [r * self.max_len + s - 1], self.row_bytes)[0])

    def random_step(self, B, nr, miss_rate):
        rng, R, K, H, max_len = self.rng, self.R, self.K, self.H, self.max_len
        req = rng.permutation(R)[:B].astype(np.int32)
        if B > nr:  # padding rows hold garbage, even out-of-range slots
            req[nr:] = rng.integers(-3, R + 3, size=B - nr)
        seq = rng.integers(H + 1, max_len + 1, size=B).astype(np.int64)
        short = rng.random(B) < 0.1
        seq[short] = rng.integers(1, H + 1, size=short.sum())
        topk = np.empty((B, K), np.int32)
        for b in range(B):
            r, s = int(req[b]) % R, int(seq[b])
            held = self.np_state["slot_tokens"][r, :H]
            held = held[(held >= 0) & (held < s - 1)]
            n_miss = int(round(K * miss_rate))
            hits = rng.choice(held, size=min(K - n_miss, held.size), replace=False)
            fresh = rng.integers(0, max(s - 1, 1), size=K - hits.size)
            row = np.concatenate([hits, fresh])
            rng.shuffle(row)
            u = rng.random(K)
            row[u < 0.03] = -1
            row[(u >= 0.03) & (u < 0.05)] = s - 1  # newest
            dup = (u >= 0.05) & (u < 0.08)
            row[dup] = row[rng.integers(0, K, size=dup.sum())]  # duplicates
            if rng.random() < 0.3:  # adversarial: out-of-range tokens
                bad = rng.random(K) < 0.01
                row[bad] = rng.choice([-7, s, s + 3, max_len + 10, 2**31 - 1], size=bad.sum())
            topk[b] = row
        return req, seq, topk

    def run(self, req, seq, topk, nr, *, stream=None, check_bytes=True):
        import cupy

        from hisparse_cupy import reference as ref
        from hisparse_cupy import swap_in

        from _util import pattern

        B, K = topk.shape
        self.write_newest(req, seq, nr)
        out = cupy.full((B, K), POISON, cupy.int32)
        status = cupy.full((B, 3), POISON, cupy.int32)
        self.plan.count[:] = POISON
        num_real = cupy.asarray([nr], dtype=cupy.int32)
        got = swap_in(cupy.asarray(topk), cupy.asarray(req), cupy.asarray(seq), self.dev_state,
                      host_rows=self.pool.device_ptr(0), n_host_rows=self.n_host_rows,
                      device_rows=self.device_rows, plan=self.plan, out=out, status=status,
                      num_real=num_real, stream=stream)
        exp = ref.swap_in(topk, req, seq, hot_size=self.H, n_host_rows=self.n_host_rows,
                          num_real=nr, **self.np_state)
        got_np = cupy.asnumpy(got)
        np.testing.assert_array_equal(got_np, exp.device_locs)
        np.testing.assert_array_equal(cupy.asnumpy(status), exp.status)
        cnt = cupy.asnumpy(self.plan.count[:B])
        np.testing.assert_array_equal(cnt, exp.plan_count)
        psrc, pdst = cupy.asnumpy(self.plan.src[:B]), cupy.asnumpy(self.plan.dst[:B])
        for b in range(B):
            c = cnt[b]
            np.testing.assert_array_equal(psrc[b, :c], exp.plan_src[b, :c])
            np.testing.assert_array_equal(pdst[b, :c], exp.plan_dst[b, :c])
        for k in ("slot_tokens", "lru"):
            np.testing.assert_array_equal(cupy.asnumpy(getattr(self.dev_state, k)),
                                          self.np_state[k], err_msg=k)
        ref.check_invariants(self.np_state["slot_tokens"], self.np_state["slot_locs"],
                             self.np_state["lru"], self.H)
        if check_bytes:  # every row an LRU-path output points to holds its token's bytes
            lru_rows = (np.arange(B) < nr) & (seq > self.H)
            sel = (got_np >= 0) & lru_rows[:, None]
            bb, ii = np.nonzero(sel)
            if bb.size:
                ids = req[bb].astype(np.int64) * self.max_len + topk[bb, ii]
                rows = cupy.asnumpy(self.device_rows[cupy.asarray(got_np[bb, ii])])
                want = pattern(self.LAYER, ids, self.row_bytes)
                bad = np.nonzero((rows != want).any(axis=1))[0]
                assert bad.size == 0, (f"{bad.size} rows hold wrong bytes, first entry "
                                       f"{bb[bad[0]], ii[bad[0]]}")
        return got_np


CONFIGS = [  # K, H, row_bytes, R, max batch, steps
    (64, 64, 656, 136, 128, 400),
    (64, 128, 576, 136, 128, 400),
    (64, 192, 1152, 72, 64, 400),
    (64, 128, 656, 8, 8, 400),
    (2048, 2048, 656, 10, 8, 160),
    (2048, 4096, 1152, 6, 4, 150),
    (2048, 6144, 576, 4, 3, 150),
]


@pytest.mark.parametrize("table", [False, True], ids=["hash", "table"])
@pytest.mark.parametrize("K,H,row_bytes,R,max_b,steps", CONFIGS)
def test_random_steps_equal_oracle(rng, K, H, row_bytes, R, max_b, steps, table):
    h = Harness(rng, R=R, K=K, H=H, P=4, row_bytes=row_bytes, max_len=3 * H + 17, table=table)
    for _ in range(steps):
        B = int(rng.integers(1, max_b + 1))
        nr = B if rng.random() < 0.7 else int(rng.integers(0, B + 1))
        rate = float(rng.choice([0.0, 0.005, 0.05, 0.2, 1.0]))
        req, seq, topk = h.random_step(B, min(nr, R), rate)
        h.run(req, seq, topk, min(nr, R))


@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
@pytest.mark.parametrize("K,H,R", [(2048, 4096, 12), (45, 70, 20), (3, 5, 10)])
def test_every_cluster_size_equals_oracle(rng, cluster, K, H, R):
    """The resolve split over 1-8 blocks per row (a thread-block cluster on sm_90+; uneven
    shares, blocks without entries or LRU positions) gives the oracle's result."""
    import cupy

    from hisparse_cupy import swap

    if cluster > 1 and int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("thread-block clusters need compute capability >= 9.0")
    h = Harness(rng, R=R, K=K, H=H, P=4, row_bytes=576, max_len=3 * H + 17)
    swap.set_resolve_cluster(cluster)
    try:
        for _ in range(40):
            B = int(rng.integers(1, R + 1))
            nr = B if rng.random() < 0.8 else int(rng.integers(0, B + 1))
            rate = float(rng.choice([0.0, 0.005, 0.05, 0.2, 1.0]))
            req, seq, topk = h.random_step(B, nr, rate)
            h.run(req, seq, topk, nr)
    finally:
        swap.set_resolve_cluster(None)


@pytest.mark.parametrize("K,H,R", [(2048, 4096, 6), (64, 128, 24)])
def test_token_table_survives_restores_and_foreign_writes(rng, K, H, R):
    """The token -> slot table is never trusted: after the tables are restored to an earlier
    state (as a benchmark does between calls), or slot_tokens is rewritten by someone else
    (here: the held tokens moved to other slots, their rows with them), the table-driven
    resolve still equals the oracle, bytes included."""
    import cupy

    from _util import pattern

    h = Harness(rng, R=R, K=K, H=H, P=4, row_bytes=656, max_len=3 * H + 17, table=True)
    snap_np = {k: v.copy() for k, v in h.np_state.items()}
    names = ("slot_tokens", "slot_locs", "lru")
    snap_dev = {k: getattr(h.dev_state, k).copy() for k in names}
    for step in range(30):
        if step % 3 == 0:  # restore the tables (the device rows keep any token's bytes)
            h.np_state = {k: v.copy() for k, v in snap_np.items()}
            for k in names:
                getattr(h.dev_state, k)[...] = snap_dev[k]
            dev = cupy.asnumpy(h.device_rows)
            ids = np.arange(R)[:, None] * h.max_len + snap_np["slot_tokens"][:, :H]
            held = snap_np["slot_tokens"][:, :H] >= 0
            dev[snap_np["slot_locs"][:, :H][held]] = pattern(h.LAYER, ids[held], h.row_bytes)
            h.device_rows[...] = cupy.asarray(dev)
        elif step % 3 == 1:  # a foreign writer swaps which slot holds which token (and row)
            r = int(rng.integers(0, R))
            perm = rng.permutation(H)
            for k in ("slot_tokens", "slot_locs"):
                h.np_state[k][r, :H] = h.np_state[k][r, perm]
            h.dev_state.slot_tokens[r, :H] = cupy.asarray(h.np_state["slot_tokens"][r, :H])
            h.dev_state.slot_locs[r, :H] = cupy.asarray(h.np_state["slot_locs"][r, :H])
        B = int(rng.integers(1, R + 1))
        req, seq, topk = h.random_step(B, B, float(rng.choice([0.0, 0.005, 0.05, 0.5])))
        h.run(req, seq, topk, B)


def test_all_miss_batch_one_2048_rows(rng):
    h = Harness(rng, R=2, K=2048, H=4096, P=4, row_bytes=656, max_len=40000,
                adversarial=False)
    req = np.array([1], np.int32)
    seq = np.array([40000])
    held = set(h.np_state["slot_tokens"][1].tolist())
    fresh = np.array([t for t in rng.permutation(39999)[:3000] if t not in held][:2048], np.int32)
    got = h.run(req, seq, fresh[None, :], 1)
    assert (got >= 0).all()
    assert int(h.plan.count[0]) == 2048


def test_graph_capture_replays_like_eager(rng):
    import copy

    import cupy

    from hisparse_cupy import swap_in

    K, H, B = 64, 128, 16
    eager = Harness(rng, R=20, K=K, H=H, P=4, row_bytes=656, max_len=600)
    graph = copy.copy(eager)  # same host pool; separate device state
    graph.np_state = {k: v.copy() for k, v in eager.np_state.items()}
    graph.dev_state = type(eager.dev_state)(*(v.copy() for v in
                                              (eager.dev_state.host_locs,
                                               eager.dev_state.slot_tokens,
                                               eager.dev_state.slot_locs, eager.dev_state.lru)))
    graph.device_rows = eager.device_rows.copy()
    from hisparse_cupy import MissPlan

    graph.plan = MissPlan(128, K)
    s = cupy.cuda.Stream(non_blocking=True)
    g_topk = cupy.zeros((B, K), cupy.int32)
    g_req = cupy.zeros(B, cupy.int32)
    g_seq = cupy.zeros(B, cupy.int64)
    g_nr = cupy.zeros(1, cupy.int32)
    g_out = cupy.zeros((B, K), cupy.int32)
    g_status = cupy.zeros((B, 3), cupy.int32)
    with s:
        swap_in(g_topk, g_req, g_seq, graph.dev_state, host_rows=graph.pool.device_ptr(0),
                n_host_rows=graph.n_host_rows, device_rows=graph.device_rows, plan=graph.plan,
                out=g_out, status=g_status, num_real=g_nr, stream=s)  # compile + warm up
        s.synchronize()
    # the warm-up's all-zero inputs take the fast path with nothing selected: no state change
    s.begin_capture()
    swap_in(g_topk, g_req, g_seq, graph.dev_state, host_rows=graph.pool.device_ptr(0),
            n_host_rows=graph.n_host_rows, device_rows=graph.device_rows, plan=graph.plan,
            out=g_out, status=g_status, num_real=g_nr, stream=s)
    g = s.end_capture()
    for step in range(60):
        nr = int(rng.integers(1, B + 1))
        req, seq, topk = eager.random_step(B, nr, float(rng.choice([0.05, 0.5])))
        want = eager.run(req, seq, topk, nr)
        with s:  # every write on the captured stream (the legacy stream is not ordered with it)
            graph.write_newest(req, seq, nr)
            g_topk.set(topk, stream=s)
            g_req.set(req, stream=s)
            g_seq.set(seq, stream=s)
            g_nr.set(np.array([nr], np.int32), stream=s)
            g.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(g_out), want, err_msg=f"step {step}")
        np.testing.assert_array_equal(cupy.asnumpy(graph.dev_state.lru),
                                      cupy.asnumpy(eager.dev_state.lru))
        np.testing.assert_array_equal(cupy.asnumpy(graph.device_rows),
                                      cupy.asnumpy(eager.device_rows))


def test_check_mode_raises_with_rows_and_entries(rng):
    import cupy

    from hisparse_cupy import swap_in

    h = Harness(rng, R=4, K=64, H=64, P=4, row_bytes=656, max_len=300, adversarial=False)
    topk = np.tile(np.arange(64, dtype=np.int32), (2, 1))
    topk[1, 5] = 999
    with pytest.raises(ValueError, match=r"row 1 \(seq_len 200\): 1 token\(s\) outside "
                                         r"\[0, min\(seq_len, 300\)\) at entries \[5\]"):
        swap_in(cupy.asarray(topk), cupy.asarray([0, 1], dtype=cupy.int32),
                cupy.asarray([200, 200], dtype=cupy.int32), h.dev_state,
                host_rows=h.pool.device_ptr(0), n_host_rows=h.n_host_rows,
                device_rows=h.device_rows, plan=h.plan, check=True)
    with pytest.raises(ValueError, match=r"req_indices repeats request slot\(s\) \[2\]"):
        swap_in(cupy.asarray(topk), cupy.asarray([2, 2], dtype=cupy.int32),
                cupy.asarray([200, 200], dtype=cupy.int32), h.dev_state,
                host_rows=h.pool.device_ptr(0), n_host_rows=h.n_host_rows,
                device_rows=h.device_rows, plan=h.plan, check=True)


def test_validation_on_device_arrays(rng):
    import cupy

    from hisparse_cupy import swap_in

    h = Harness(rng, R=4, K=64, H=64, P=4, row_bytes=656, max_len=300, adversarial=False)
    kw = dict(host_rows=h.pool.device_ptr(0), n_host_rows=h.n_host_rows,
              device_rows=h.device_rows, plan=h.plan)
    req = cupy.asarray([0], dtype=cupy.int32)
    seq = cupy.asarray([100], dtype=cupy.int32)
    with pytest.raises(TypeError, match="top_k_tokens must have dtype int32"):
        swap_in(cupy.zeros((1, 64), cupy.int64), req, seq, h.dev_state, **kw)
    with pytest.raises(ValueError, match="more than hot_size"):
        swap_in(cupy.zeros((1, 65), cupy.int32), req, seq, h.dev_state, **kw)
    with pytest.raises(ValueError, match=r"seq_lens must have shape \(1,\)"):
        swap_in(cupy.zeros((1, 64), cupy.int32), req, cupy.asarray([1, 2]), h.dev_state, **kw)
    with pytest.raises(TypeError, match="host_rows must be a Ptr"):
        swap_in(cupy.zeros((1, 64), cupy.int32), req, seq, h.dev_state,
                **{**kw, "host_rows": 1234})
    with pytest.raises(ValueError, match="plan holds 128 rows"):
        swap_in(cupy.zeros((129, 64), cupy.int32), cupy.zeros(129, cupy.int32),
                cupy.zeros(129, cupy.int32), h.dev_state, **kw)
