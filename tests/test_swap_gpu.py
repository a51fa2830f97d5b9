"""GPU: the single-step swap kernel equals the NumPy oracle exactly, bytes included (over the
single-step twin of the test harness, :meth:`hisparse_cupy.testing.twin.Twin.single`)."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_cupy.testing.twin import Twin

pytestmark = pytest.mark.gpu


def random_step(h, B, nr, miss_rate):
    """One step's (req, seq, top-k) for the single-step twin ``h``: padding rows of garbage
    slots, 10 % short rows, hits, fresh tokens, -1, the newest token, duplicates, out-of-range
    tokens."""
    rng, R, K, H, max_len = h.rng, h.R, h.K, h.H, h.max_len
    req = rng.permutation(R)[:B].astype(np.int32)
    if B > nr:  # padding rows hold garbage, even out-of-range slots
        req[nr:] = rng.integers(-3, R + 3, size=B - nr)
    seq = rng.integers(H + 1, max_len + 1, size=B).astype(np.int64)
    short = rng.random(B) < 0.1
    seq[short] = rng.integers(1, H + 1, size=short.sum())
    topk = np.empty((B, K), np.int32)
    for b in range(B):
        r, s = int(req[b]) % R, int(seq[b])
        held = h.np[0]["slot_tokens"][r, :H]
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
    h = Twin.single(rng, R=R, K=K, H=H, P=4, row_bytes=row_bytes, max_len=3 * H + 17,
                    table=table)
    for _ in range(steps):
        B = int(rng.integers(1, max_b + 1))
        nr = B if rng.random() < 0.7 else int(rng.integers(0, B + 1))
        rate = float(rng.choice([0.0, 0.005, 0.05, 0.2, 1.0]))
        req, seq, topk = random_step(h, B, min(nr, R), rate)
        h.call(topk, req, seq, num_real=min(nr, R), newest=True)


@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
@pytest.mark.parametrize("K,H,R", [(2048, 4096, 12), (45, 70, 20), (3, 5, 10)])
def test_every_cluster_size_equals_oracle(rng, cluster, K, H, R):
    """The resolve split over 1-8 blocks per row (a thread-block cluster on sm_90+; uneven
    shares, blocks without entries or LRU positions) gives the oracle's result."""
    import cupy

    from hisparse_cupy.testing import knobs

    if cluster > 1 and int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("thread-block clusters need compute capability >= 9.0")
    h = Twin.single(rng, R=R, K=K, H=H, P=4, row_bytes=576, max_len=3 * H + 17)
    with knobs.resolve_cluster(cluster):
        for _ in range(40):
            B = int(rng.integers(1, R + 1))
            nr = B if rng.random() < 0.8 else int(rng.integers(0, B + 1))
            rate = float(rng.choice([0.0, 0.005, 0.05, 0.2, 1.0]))
            req, seq, topk = random_step(h, B, nr, rate)
            h.call(topk, req, seq, num_real=nr, newest=True)


@pytest.mark.parametrize("K,H,R", [(2048, 4096, 6), (64, 128, 24)])
def test_token_table_survives_restores_and_foreign_writes(rng, K, H, R):
    """The token -> slot table is never trusted: after the tables are restored to an earlier
    state (as a benchmark does between calls), or slot_tokens is rewritten by someone else
    (here: the held tokens moved to other slots, their rows with them), the table-driven
    resolve still equals the oracle, bytes included."""
    import cupy

    h = Twin.single(rng, R=R, K=K, H=H, P=4, row_bytes=656, max_len=3 * H + 17, table=True)
    st = h.state(0)
    snap_np = {k: v.copy() for k, v in h.np[0].items()}
    names = ("slot_tokens", "slot_locs", "lru")
    snap_dev = {k: getattr(st, k).copy() for k in names}
    for step in range(30):
        if step % 3 == 0:  # restore the tables (the device rows keep any token's bytes)
            h.np[0] = {k: v.copy() for k, v in snap_np.items()}
            for k in names:
                getattr(st, k)[...] = snap_dev[k]
            dev = cupy.asnumpy(h.device_rows(0))
            toks = snap_np["slot_tokens"][:, :H]
            held = toks >= 0
            dev[snap_np["slot_locs"][:, :H][held]] = h.bytes_of(0, np.nonzero(held)[0], toks[held])
            h.device_rows(0)[...] = cupy.asarray(dev)
        elif step % 3 == 1:  # a foreign writer swaps which slot holds which token (and row)
            r = int(rng.integers(0, R))
            perm = rng.permutation(H)
            for k in ("slot_tokens", "slot_locs"):
                h.np[0][k][r, :H] = h.np[0][k][r, perm]
            st.slot_tokens[r, :H] = cupy.asarray(h.np[0]["slot_tokens"][r, :H])
            st.slot_locs[r, :H] = cupy.asarray(h.np[0]["slot_locs"][r, :H])
        B = int(rng.integers(1, R + 1))
        req, seq, topk = random_step(h, B, B, float(rng.choice([0.0, 0.005, 0.05, 0.5])))
        h.call(topk, req, seq, num_real=B, newest=True)


def test_all_miss_batch_one_2048_rows(rng):
    h = Twin.single(rng, R=2, K=2048, H=4096, P=4, row_bytes=656, max_len=40000,
                    adversarial=False)
    req = np.array([1], np.int32)
    seq = np.array([40000])
    held = set(h.np[0]["slot_tokens"][1].tolist())
    fresh = np.array([t for t in rng.permutation(39999)[:3000] if t not in held][:2048], np.int32)
    got, _ = h.call(fresh[None, :], req, seq, num_real=1, newest=True)
    assert (got >= 0).all()
    assert int(h.plan.count[0]) == 2048


def test_graph_capture_replays_like_eager(rng):
    import cupy

    from hisparse_cupy import swap_in

    K, H, B = 64, 128, 16
    seed = int(rng.integers(2**31))  # two twins of one state: host rows, tables, device rows
    eager, graph = (Twin.single(np.random.default_rng(seed), R=20, K=K, H=H, P=4,
                                row_bytes=656, max_len=600) for _ in range(2))
    s = cupy.cuda.Stream(non_blocking=True)
    g_topk = cupy.zeros((B, K), cupy.int32)
    g_req = cupy.zeros(B, cupy.int32)
    g_seq = cupy.zeros(B, cupy.int64)
    g_nr = cupy.zeros(1, cupy.int32)
    g_out = cupy.zeros((B, K), cupy.int32)
    g_status = cupy.zeros((B, 3), cupy.int32)
    kw = dict(graph.op_args(0), plan=graph.plan, out=g_out, status=g_status, num_real=g_nr,
              stream=s)
    with s:
        swap_in(g_topk, g_req, g_seq, graph.state(0), **kw)  # compile + warm up
        s.synchronize()
    # the warm-up's all-zero inputs take the fast path with nothing selected: no state change
    s.begin_capture()
    swap_in(g_topk, g_req, g_seq, graph.state(0), **kw)
    g = s.end_capture()
    for step in range(60):
        nr = int(rng.integers(1, B + 1))
        req, seq, topk = random_step(eager, B, nr, float(rng.choice([0.05, 0.5])))
        want, _ = eager.call(topk, req, seq, num_real=nr, newest=True)
        with s:  # every write on the captured stream (the legacy stream is not ordered with it)
            graph.write_newest(req, seq, nr)
            g_topk.set(topk, stream=s)
            g_req.set(req, stream=s)
            g_seq.set(seq, stream=s)
            g_nr.set(np.array([nr], np.int32), stream=s)
            g.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(g_out), want, err_msg=f"step {step}")
        np.testing.assert_array_equal(cupy.asnumpy(graph.state(0).lru),
                                      cupy.asnumpy(eager.state(0).lru))
        np.testing.assert_array_equal(cupy.asnumpy(graph.device_rows(0)),
                                      cupy.asnumpy(eager.device_rows(0)))


def test_check_mode_raises_with_rows_and_entries(rng):
    import cupy

    from hisparse_cupy import swap_in

    h = Twin.single(rng, R=4, K=64, H=64, P=4, row_bytes=656, max_len=300, adversarial=False)
    kw = dict(h.op_args(0), plan=h.plan, check=True)
    topk = np.tile(np.arange(64, dtype=np.int32), (2, 1))
    topk[1, 5] = 999
    with pytest.raises(ValueError, match=r"row 1 \(seq_len 200\): 1 token\(s\) outside "
                                         r"\[0, min\(seq_len, 300\)\) at entries \[5\]"):
        swap_in(cupy.asarray(topk), cupy.asarray([0, 1], dtype=cupy.int32),
                cupy.asarray([200, 200], dtype=cupy.int32), h.state(0), **kw)
    with pytest.raises(ValueError, match=r"req_indices repeats request slot\(s\) \[2\]"):
        swap_in(cupy.asarray(topk), cupy.asarray([2, 2], dtype=cupy.int32),
                cupy.asarray([200, 200], dtype=cupy.int32), h.state(0), **kw)


def test_validation_on_device_arrays(rng):
    import cupy

    from hisparse_cupy import swap_in

    h = Twin.single(rng, R=4, K=64, H=64, P=4, row_bytes=656, max_len=300, adversarial=False)
    st = h.state(0)
    kw = dict(h.op_args(0), plan=h.plan)
    req = cupy.asarray([0], dtype=cupy.int32)
    seq = cupy.asarray([100], dtype=cupy.int32)
    with pytest.raises(TypeError, match="top_k_tokens must have dtype int32"):
        swap_in(cupy.zeros((1, 64), cupy.int64), req, seq, st, **kw)
    with pytest.raises(ValueError, match="more than hot_size"):
        swap_in(cupy.zeros((1, 65), cupy.int32), req, seq, st, **kw)
    with pytest.raises(ValueError, match=r"seq_lens must have shape \(1,\)"):
        swap_in(cupy.zeros((1, 64), cupy.int32), req, cupy.asarray([1, 2]), st, **kw)
    with pytest.raises(TypeError, match="host_rows must be a Ptr"):
        swap_in(cupy.zeros((1, 64), cupy.int32), req, seq, st, **{**kw, "host_rows": 1234})
    with pytest.raises(ValueError, match="plan holds 128 rows"):
        swap_in(cupy.zeros((129, 64), cupy.int32), cupy.zeros(129, cupy.int32),
                cupy.zeros(129, cupy.int32), st, **kw)
