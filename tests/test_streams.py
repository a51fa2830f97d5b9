"""IndexCache overlap: layer patterns (CPU) and the side-stream Prefetcher (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_cupy.streams import LayerPattern, layer_pattern

from _util import pattern as byte_pattern

# ---------------------------------------------------------------------------- patterns (CPU)

GLM52_FULL = (0, 1, 2) + tuple(range(6, 75, 4))


def test_glm52_pattern():
    p = LayerPattern.from_freq(78, 4, 3)
    assert p.n_layers == 78
    assert p.full_layers == GLM52_FULL
    assert len(p.full_layers) == 21 and len(p.shared_layers) == 57
    assert p.shared_fraction == pytest.approx(57 / 78)
    assert p.max_group_size == 3
    g = p.groups
    assert g[0] == () and g[1] == ()
    assert g[2] == (3, 4, 5) and g[74] == (75, 76, 77)
    assert all(g[a] == (a + 1, a + 2, a + 3) for a in range(6, 75, 4))
    assert set(g) == set(GLM52_FULL)
    for a, group in g.items():
        assert p.anchor(a) == a and p.position(a) == -1 and p.is_full(a)
        for i, s in enumerate(group):
            assert p.anchor(s) == a and p.position(s) == i and not p.is_full(s)
    assert str(p) == "FFF" + "SSSF" * 18 + "SSS"


def test_freq_rule_without_offset_and_freq_one():
    p = LayerPattern.from_freq(78, 4)
    assert p.full_layers == (0, 1) + tuple(range(5, 78, 4))
    assert p.groups[77] == ()
    assert p.groups[1] == (2, 3, 4)
    one = LayerPattern.from_freq(10, 1)
    assert one.full_layers == tuple(range(10)) and one.max_group_size == 0
    assert LayerPattern.from_freq(24, 4, 3).groups[22] == (23,)


def test_forms_agree():
    s = "FFSSFS"
    by_str = LayerPattern.from_string(s)
    assert by_str == LayerPattern.from_string(s.lower())
    assert by_str == LayerPattern.from_list([True, True, False, False, True, False])
    assert by_str == LayerPattern.from_list(["full", "F", "shared", "S", "Full", "SHARED"])
    assert by_str == LayerPattern.from_list(np.array([1, 1, 0, 0, 1, 0], dtype=bool))
    assert layer_pattern(s) == by_str
    assert layer_pattern([True, True, False, False, True, False]) == by_str
    assert layer_pattern(by_str) is by_str
    assert layer_pattern((78, 4, 3)) == LayerPattern.from_freq(78, 4, 3)
    assert layer_pattern((78, 4)) == LayerPattern.from_freq(78, 4)
    assert layer_pattern((78, 4, 3), n_layers=78).n_layers == 78
    assert by_str.groups == {0: (), 1: (2, 3), 4: (5,)}
    assert repr(by_str) == "LayerPattern('FFSSFS')"


def test_pattern_errors():
    with pytest.raises(ValueError, match="layer 0 is shared but no full layer precedes it"):
        LayerPattern.from_string("SFFS")
    with pytest.raises(ValueError, match="every layer is shared"):
        LayerPattern.from_string("SSS")
    with pytest.raises(ValueError, match="layer 0 is shared"):
        LayerPattern.from_freq(8, 4, 0)  # offset 0 makes layer 0 shared
    with pytest.raises(ValueError, match="character 2 is 'x'"):
        LayerPattern.from_string("FFxS")
    with pytest.raises(ValueError, match="entry 1 is 2"):
        LayerPattern.from_list([True, 2])
    with pytest.raises(ValueError, match="at least one layer"):
        LayerPattern.from_string("")
    with pytest.raises(ValueError, match="freq must be >= 1"):
        LayerPattern.from_freq(8, 0)
    with pytest.raises(ValueError, match="has 78 layers but the model has 61"):
        layer_pattern((78, 4, 3), n_layers=61)
    with pytest.raises(TypeError, match="cannot build a layer pattern"):
        layer_pattern(3.5)
    p = LayerPattern.from_string("FSSF")
    for bad in (4, -1, 100):
        with pytest.raises(ValueError, match="outside the pattern's 4 layers"):
            p.anchor(bad)
    with pytest.raises(ValueError):
        p.is_full(4)


def test_stage_local_layers():
    model = LayerPattern.from_freq(78, 4, 3)
    st = model.stage(38, 78)  # a second pipeline stage: layers 38 .. 77
    assert st.first_layer == 38 and st.n_layers == 40
    assert st.local_index(38) == 0 and st.local_index(77) == 39
    assert st.is_full(0) and st.groups[0] == (1, 2, 3)  # model layers 38 -> 39, 40, 41
    assert tuple(a + 38 for a in st.full_layers) == tuple(x for x in GLM52_FULL if x >= 38)
    for bad in (37, 78, 0):
        with pytest.raises(ValueError, match="outside this pattern's layers 38 .. 77"):
            st.local_index(bad)
    first = model.stage(0, 38)
    assert first.local_index(37) == 37
    with pytest.raises(ValueError):
        first.local_index(38)
    # a stage starting at a shared layer has no full layer to reuse
    with pytest.raises(ValueError, match="layer 39 is shared but no full layer precedes it"):
        model.stage(39, 78)
    with pytest.raises(ValueError, match="exceed the model's 78 layers"):
        model.stage(40, 79)
    with pytest.raises(ValueError, match="already a stage"):
        st.stage(0, 4)
    assert LayerPattern.from_freq(78, 4, 3).local_index(77) == 77


# ---------------------------------------------------------------------------- GPU helpers


@pytest.fixture
def main(stream):
    """The conftest's non-blocking stream, current for the whole test."""
    return stream


def test_default_replay_shape(monkeypatch):
    """The side-stream replays' default: an eighth of the SMs (16 on an H200's 132), at least
    8 blocks, 4 rows in flight per warp (benchmarks/NOTES.md, "The side streams' copy
    shape"), each a choice of the copy kernel (CPU: the SM count stubbed)."""
    from hisparse_cupy._kernels.plan import ROWS_PER_WARP
    from hisparse_cupy.streams import _prefetch as prefetch

    for sms, grid in ((132, 16), (108, 13), (40, 8), (1, 8)):
        monkeypatch.setattr(prefetch, "sm_count", lambda n=sms: n)
        assert prefetch.default_replay_grid() == grid
    assert prefetch.DEFAULT_REPLAY_ROWS_PER_WARP == 4
    assert {prefetch.DEFAULT_REPLAY_ROWS_PER_WARP,
            prefetch.PARTITION_REPLAY_ROWS_PER_WARP} <= set(ROWS_PER_WARP)


ROW = 656
H, K, P = 64, 32, 16
MAX_LEN = 256  # token universe U = MAX_LEN - 1 = 255 >= H + K, so every step has misses


def _gpu():
    import cupy

    return cupy


def _make_cache(n_layers, R, *, stream):
    """A cache with R requests of length MAX_LEN admitted, byte patterns in the host pool.

    Host rows are written first (admit, write, release, admit again), so even the newest-token
    rows that admission loads hold defined bytes. Everything is queued on ``stream``.
    """
    cp = _gpu()
    from hisparse_cupy import HotBufferCache

    with stream:
        cache = HotBufferCache(n_layers=n_layers, max_requests=R, max_len=MAX_LEN,
                               row_bytes=ROW, hot_size=H, top_k=K, extra_page=P)
        cache.device[...] = 0xEE  # poison: never test on zeros
        first = [cache.admit(MAX_LEN, stream=stream) for _ in range(R)]
        for rid in first:
            rows = rid * MAX_LEN + np.arange(MAX_LEN)
            kv = np.stack([byte_pattern(layer, rows, ROW) for layer in range(n_layers)])
            cache.write_host(rid, 0, kv)  # synchronizes the device
        for rid in first:
            cache.release(rid, stream=stream)
        rids = [cache.admit(MAX_LEN, stream=stream) for _ in range(R)]
        req = cp.asarray(np.array(rids, np.int32))
    stream.synchronize()
    return cache, req


def _swap(pf, layer, req, lens, tk, *, num_real=None, stream=None):
    """One layer of a step driven by ``pf`` (a step per call: the tests vary the batch)."""
    step = pf.cache.begin_step(req, lens, num_real, stream=stream, prefetcher=pf)
    return step.swap(layer, tk)


class _TopK:
    """Sliding-window top-k: step t keeps K - M of step t-1's tokens and brings M new ones."""

    def __init__(self, B, M, seed):
        rng = np.random.default_rng(seed)
        self.B, self.M = B, M
        self.U = MAX_LEN - 1
        self.perm = rng.permutation(self.U).astype(np.int32)

    def host(self, t):
        b = np.arange(self.B)[:, None]
        pos = (t * self.M + 37 * b + np.arange(K)[None, :]) % self.U
        tk = self.perm[pos].copy()
        tk[:, (t * 7) % K] = -1  # one unused entry per row
        return tk


_READER_SRC = r"""
extern "C" __global__ void check_rows(const int* locs, const int* topk, const int* req, int B,
                                      int K, const int* num_real, const unsigned char* dev,
                                      long long n_dev_rows, const unsigned char* host,
                                      long long max_len, int row_bytes, int* errors) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= B * K) return;
  const int b = i / K;
  const int nr = num_real ? *num_real : B;
  if (b >= nr) return;
  const int tok = topk[i];
  if (tok < 0) return;
  const long long loc = locs[i];
  if (loc < 0 || loc >= n_dev_rows) { atomicAdd(errors, 1); return; }
  const unsigned* d = reinterpret_cast<const unsigned*>(dev + loc * row_bytes);
  const unsigned* h = reinterpret_cast<const unsigned*>(
      host + (static_cast<long long>(req[b]) * max_len + tok) * row_bytes);
  for (int w = 0; w < row_bytes / 4; ++w) {
    if (d[w] != h[w]) { atomicAdd(errors, 1); return; }
  }
}
"""


def _reader():
    cp = _gpu()
    return cp.RawKernel(_READER_SRC, "check_rows")


def _check(reader, cache, layer, locs, topk, req, errors, stream, num_real=None):
    """Queue the reader on ``stream``: counts entries whose device row lacks the token's bytes."""
    B = locs.shape[0]
    nr = np.uint64(0) if num_real is None else num_real
    reader((-(-B * K // 128),), (128,),
           (locs, topk, req, np.int32(B), np.int32(K), nr, cache.device[layer],
            np.int64(cache.device.shape[1]), np.uint64(int(cache.pool.device_ptr(layer))),
            np.int64(MAX_LEN), np.int32(ROW), errors[layer:layer + 1]), stream=stream)


def _host_check(cache, layer, locs, topk, req):
    """Synchronously compare, on the host, every row ``locs`` points to with its host bytes."""
    cp = _gpu()
    dev = cp.asnumpy(cache.device[layer])
    locs, topk, req = cp.asnumpy(locs), cp.asnumpy(topk), cp.asnumpy(req)
    b, k = np.nonzero(topk >= 0)
    assert (locs[b, k] >= 0).all()
    want = byte_pattern(layer, req[b].astype(np.int64) * MAX_LEN + topk[b, k], ROW)
    np.testing.assert_array_equal(dev[locs[b, k]], want)


# ---------------------------------------------------------------------------- GPU tests


@pytest.mark.gpu
@pytest.mark.parametrize("rpw, group", [(1, 0), (2, 0), (4, 0), (1, 5), (4, 5)])
def test_shared_layer_bytes_after_wait(main, rpw, group):
    """Every shared layer's rows after its wait, layer by layer (group 0) or a group's replays
    in one launch (group_replay_batch 5 = the batch)."""
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher

    pat = "FSSFSFSS"
    L, R, B = len(pat), 5, 5
    cache, req = _make_cache(L, R, stream=main)
    lens = cp.full(B, MAX_LEN, cp.int32)
    pf = Prefetcher(cache, pat, replay_grid=2, replay_rows_per_warp=rpw,
                    group_replay_batch=group)
    gen = _TopK(B, 6, 1)
    reader = _reader()
    errors = cp.zeros(L, cp.int32)
    misses = 0
    with main:
        for t in range(40):
            tk = cp.asarray(gen.host(t))
            for layer in range(L):
                out = _swap(pf, layer, req, lens, tk, stream=main)
                _check(reader, cache, layer, out, tk, req, errors, main)
                if t % 13 == 5 and layer in (2, 7):  # after the wait, on the host
                    main.synchronize()
                    _host_check(cache, layer, out, tk, req)
                if layer == 5 and t > 0:
                    misses += int(cp.asnumpy(cache.plan.count[:B]).sum())
            pf.finish(main)
        main.synchronize()
    assert cp.asnumpy(errors).tolist() == [0] * L
    assert misses >= 39 * B * 5  # the window brings ~6 new tokens per row per step


def _run_steps(pf, cache, req, lens, gen, steps, main, *, toggles=None, record=None):
    cp = _gpu()
    outs = []
    with main:
        for t in range(steps):
            if toggles and t in toggles:
                pf.set_enabled(toggles[t], stream=main)
            tk = cp.asarray(gen.host(t))
            step = []
            for layer in range(cache.n_layers):
                out = _swap(pf, layer, req, lens, tk, stream=main)
                step.append(out.copy())
            pf.finish(main)
            main.synchronize()
            outs.append([cp.asnumpy(o) for o in step])
            if record is not None:
                record(t)
    return outs


@pytest.mark.gpu
def test_replay_equals_full_swap_rows(main):
    """Prefetch on (replays) and off (full swap per layer) give the same tables and bytes."""
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher

    pat = "FSSSFSFF"
    L, R, B = len(pat), 4, 4
    on, req = _make_cache(L, R, stream=main)
    off, _ = _make_cache(L, R, stream=main)
    lens = cp.full(B, MAX_LEN, cp.int32)
    pf_on = Prefetcher(on, pat)
    pf_off = Prefetcher(off, pat, enabled=False)
    gen = _TopK(B, 5, 2)
    snaps = {}

    def snap_on(t):
        snaps[t] = (cp.asnumpy(on.device), cp.asnumpy(on.tables.slot_tokens),
                    cp.asnumpy(on.tables.lru))

    # on for 12 steps, off for 6 (switch copies the full layers' tables), on again for 6
    a = _run_steps(pf_on, on, req, lens, gen, 24, main, toggles={12: False, 18: True},
                   record=snap_on)
    b_dev = {}

    def snap_off(t):
        b_dev[t] = (cp.asnumpy(off.device), cp.asnumpy(off.tables.slot_tokens),
                    cp.asnumpy(off.tables.lru))

    b = _run_steps(pf_off, off, req, lens, gen, 24, main, record=snap_off)
    p = pf_on.pattern
    for t in range(24):
        for layer in range(L):
            np.testing.assert_array_equal(a[t][layer], b[t][layer], err_msg=f"step {t} l {layer}")
        dev_a, tok_a, lru_a = snaps[t]
        dev_b, tok_b, lru_b = b_dev[t]
        np.testing.assert_array_equal(dev_a, dev_b, err_msg=f"device rows differ at step {t}")
        for layer in range(L):
            anc = p.anchor(layer)
            # the off cache keeps every layer in lock step with its full layer
            np.testing.assert_array_equal(tok_b[layer], tok_b[anc])
            np.testing.assert_array_equal(lru_b[layer], lru_b[anc])
            if p.is_full(layer) or 12 <= t < 18:
                np.testing.assert_array_equal(tok_a[layer], tok_b[layer])
                np.testing.assert_array_equal(lru_a[layer], lru_b[layer])
    # and the bytes are the right ones
    with main:
        tk = cp.asarray(gen.host(23))
    for layer in range(L):
        _host_check(on, layer, cp.asarray(a[23][layer]), tk, req)


@pytest.mark.gpu
def test_group_replay_follows_the_batch(main):
    """Random batches of random requests, so that steps switch between whole-group replays
    (batch <= 3) and replays layer by layer, with prediction toggled at random: page tables and
    every device row equal a prefetch-off cache's after each step, every row checked."""
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher

    pat = "FSSSFSSFSF"  # groups of 3, 2, 1 and 0 shared layers
    L, R = len(pat), 6
    on, req_on = _make_cache(L, R, stream=main)
    off, req_off = _make_cache(L, R, stream=main)
    np.testing.assert_array_equal(cp.asnumpy(req_on), cp.asnumpy(req_off))
    pf_on = Prefetcher(on, pat, replay_grid=2, group_replay_batch=3)
    pf_off = Prefetcher(off, pat, enabled=False)
    gen = _TopK(R, 5, 9)
    rng = np.random.default_rng(11)
    reader = _reader()
    errors = cp.zeros(L, cp.int32)
    seen = set()
    with main:
        for t in range(40):
            B = int(rng.integers(1, R + 1))
            pick = np.sort(rng.permutation(R)[:B])
            seen.add(B <= 3)
            if rng.random() < 0.3:
                pf_on.set_predict(not pf_on.predict, stream=main)
            req = req_on[cp.asarray(pick)]
            tk = cp.asarray(gen.host(t)[pick])
            lens = cp.full(B, MAX_LEN, cp.int32)
            outs = []
            for pf in (pf_on, pf_off):
                step = pf.cache.begin_step(req, lens, stream=main, prefetcher=pf)
                outs.append([step.swap(layer, tk).copy() for layer in range(L)])
                step.finish()
            for layer in range(L):
                _check(reader, on, layer, outs[0][layer], tk, req, errors, main)
            main.synchronize()
            for layer in range(L):
                np.testing.assert_array_equal(cp.asnumpy(outs[0][layer]),
                                              cp.asnumpy(outs[1][layer]),
                                              err_msg=f"step {t} (batch {B}) layer {layer}")
            np.testing.assert_array_equal(cp.asnumpy(on.device), cp.asnumpy(off.device),
                                          err_msg=f"device rows differ at step {t} (batch {B})")
    assert seen == {True, False}
    assert cp.asnumpy(errors).tolist() == [0] * L


@pytest.mark.gpu
@pytest.mark.parametrize("group", [0, 6])
def test_graph_replay_equals_eager_with_padding(main, group):
    """A captured step replayed with new top-k and num_real equals the same step run eagerly
    layer by layer; the graph's Prefetcher replays layer by layer (group 0) or each group in
    one launch (group_replay_batch 6 = the batch)."""
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher

    pat = "FSSFSSSF"
    L, R, B = len(pat), 6, 6
    steps = 30
    caches, pfs, bufs = [], [], []
    gen = _TopK(B, 4, 3)
    rng = np.random.default_rng(7)
    num_reals = [B, B] + rng.integers(1, B + 1, steps).tolist()
    reader = _reader()
    for _ in range(2):
        cache, req = _make_cache(L, R, stream=main)
        caches.append(cache)
        pfs.append(Prefetcher(cache, pat, replay_grid=3,
                              group_replay_batch=group if pfs else 0))
        with main:
            bufs.append(dict(tk=cp.empty((B, K), cp.int32), nr=cp.empty(1, cp.int32),
                             res=cp.empty((L, B, K), cp.int32), err=cp.zeros(L, cp.int32)))
    lens = cp.full(B, MAX_LEN, cp.int32)

    def step(i):
        pf, cache, buf = pfs[i], caches[i], bufs[i]
        for layer in range(L):
            out = _swap(pf, layer, req, lens, buf["tk"], num_real=buf["nr"], stream=main)
            buf["res"][layer][...] = out
            _check(reader, cache, layer, out, buf["tk"], req, buf["err"], main,
                   num_real=buf["nr"])
        pf.finish(main)

    def feed(i, t):
        bufs[i]["tk"][...] = cp.asarray(gen.host(t))
        bufs[i]["nr"].fill(num_reals[t])

    with main:
        for i in range(2):  # eager warm-up step (compiles and loads every kernel)
            feed(i, 0)
            step(i)
        main.begin_capture()
        step(1)
        graph = main.end_capture()
        for t in range(1, steps):
            feed(0, t)
            step(0)
            feed(1, t)
            graph.launch(main)
            main.synchronize()
            r0, r1 = cp.asnumpy(bufs[0]["res"]), cp.asnumpy(bufs[1]["res"])
            np.testing.assert_array_equal(r0, r1, err_msg=f"page tables differ at step {t}")
            assert (r0[:, num_reals[t]:] == -1).all()  # padding rows
            np.testing.assert_array_equal(cp.asnumpy(caches[0].device),
                                          cp.asnumpy(caches[1].device),
                                          err_msg=f"device rows differ at step {t}")
            np.testing.assert_array_equal(cp.asnumpy(caches[0].tables.slot_tokens),
                                          cp.asnumpy(caches[1].tables.slot_tokens))
    for i in range(2):
        assert cp.asnumpy(bufs[i]["err"]).tolist() == [0] * L, f"reader errors ({i})"


class _NoWait:
    """Negative control: the shared layer's wait is removed (the next full layer still joins)."""

    def _wait_position(self, p, s):
        pass


@pytest.mark.gpu
@pytest.mark.parametrize("group", [0, 4])
def test_negative_control_slowed_replay(main, group):
    """With a spin-slowed replay, a reader sees stale rows without the wait, none with it
    (replays layer by layer, or a group in one launch: group_replay_batch 4 = the batch)."""
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher
    from hisparse_cupy.testing.probe import copy_probe

    class NoWaitPrefetcher(_NoWait, Prefetcher):
        pass

    pat = "FSSS"
    L, R, B = 4, 4, 4
    reader = _reader()
    lens = cp.full(B, MAX_LEN, cp.int32)
    results = {}
    for name, cls, steps in (("no_wait", NoWaitPrefetcher, 30), ("wait", Prefetcher, 1000)):
        cache, req = _make_cache(L, R, stream=main)
        pf = cls(cache, pat, replay_grid=1, group_replay_batch=group)
        # ~0.1 ms per row: a replay takes far longer than the reader
        slow = copy_probe(spin_cycles=200_000, streams=[pf.side])
        gen = _TopK(B, 4, 4)
        with main, slow:
            table = cp.asarray(np.stack([gen.host(t) for t in range(steps)]))
            errors = cp.zeros(L, cp.int32)
            for t in range(steps):
                tk = table[t]
                for layer in range(L):
                    out = _swap(pf, layer, req, lens, tk, stream=main)
                    _check(reader, cache, layer, out, tk, req, errors, main)
                pf.finish(main)
            main.synchronize()
        results[name] = cp.asnumpy(errors)
    assert results["no_wait"][0] == 0  # the full layer's own rows are always there
    assert results["no_wait"][1:].sum() > 0, "the reader never saw a stale row without the wait"
    assert results["wait"].tolist() == [0] * L


@pytest.mark.gpu
def test_pipeline_stage_and_errors(main):
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher

    model = "FFSSFSSF"  # the stage holds model layers 4 .. 7: "FSSF"
    cache, req = _make_cache(4, 3, stream=main)
    B = 3
    lens = cp.full(B, MAX_LEN, cp.int32)
    with pytest.raises(ValueError, match="layer pattern has 8 layers but the cache"):
        Prefetcher(cache, model)
    with pytest.raises(ValueError, match="layer 5 is shared but no full layer precedes it"):
        Prefetcher(cache, model, layer_range=(5, 8))
    with pytest.raises(ValueError, match="replay_rows_per_warp must be one of"):
        Prefetcher(cache, model, layer_range=(4, 8), replay_rows_per_warp=3)
    with pytest.raises(ValueError, match="group_replay_batch must be >= 0, got -1"):
        Prefetcher(cache, model, layer_range=(4, 8), group_replay_batch=-1)
    pf = Prefetcher(cache, model, layer_range=(4, 8))
    assert str(pf.pattern) == "FSSF" and pf.pattern.first_layer == 4
    with pytest.raises(TypeError, match="replay_rows_per_warp must be an int"):
        pf.replay_rows_per_warp = 2.0
    gen = _TopK(B, 5, 5)
    reader = _reader()
    errors = cp.zeros(4, cp.int32)
    with main:
        tk = cp.asarray(gen.host(0))
        with pytest.raises(RuntimeError, match="shared layer 5 reuses full layer 4"):
            _swap(pf, 5, req, lens, tk, stream=main)
        for bad in (3, 8):
            with pytest.raises(ValueError, match="outside this pattern's layers 4 .. 7"):
                _swap(pf, bad, req, lens, tk, stream=main)
        with pytest.raises(ValueError, match="needs top_k_tokens"):
            _swap(pf, 4, req, lens, None, stream=main)
        with pytest.raises(ValueError, match="legacy default stream"):
            _swap(pf, 4, req, lens, tk, stream=cp.cuda.Stream.null)
        for t in range(10):
            tk = cp.asarray(gen.host(t))
            for layer in range(4, 8):
                out = _swap(pf, layer, req, lens, tk, stream=main)
                _check(reader, cache, layer - 4, out, tk, req, errors, main)
            pf.finish(main)
        with pytest.raises(ValueError, match="has batch 2, its full layer had 3"):
            _swap(pf, 4, req, lens, tk, stream=main)
            _swap(pf, 5, req[:2], lens[:2], None, stream=main)
        pf.finish(main)
        main.synchronize()
    assert cp.asnumpy(errors).tolist() == [0] * 4


# ---------------------------------------------------------------------------- prediction mode


class _LayerTopK:
    """Per-full-layer top-k with a tunable overlap: every full layer slides a window over the
    same positions; a position shared by all layers (a fixed share ``overlap`` of them) selects
    the common permutation's token, any other position layer j's own permutation's."""

    def __init__(self, B, M, seed, n_full, overlap=0.7):
        self.base = _TopK(B, M, seed)
        self.own = [_TopK(B, M, seed + 100 + j) for j in range(n_full)]
        self.common = ((7 * np.arange(self.base.U) + 3) % 10) < 10 * overlap

    def host(self, t, j):
        b = np.arange(self.base.B)[:, None]
        pos = (t * self.base.M + 37 * b + np.arange(K)[None, :]) % self.base.U
        tk = np.where(self.common[pos], self.base.perm[pos], self.own[j].perm[pos])
        tk[:, (t * 7) % K] = -1  # one unused entry per row
        return tk.astype(np.int32)


def _run_predict_steps(pf, cache, req, lens, gen, steps, main, *, graph=False,
                       indexer=False):
    """Steps of every layer through ``pf`` (full layers with their own top-k; with
    ``indexer``, each full layer's ``step.before_indexer`` first and a kernel standing in for
    its indexer), eager or one captured step replayed; returns per-step page tables, device
    rows and slot tables, and the reader's error count per layer."""
    cp = _gpu()
    from _util import spin

    pat = pf.pattern
    full = pat.full_layers
    B = req.shape[0]
    reader = _reader()
    with main:
        tks = cp.empty((len(full), B, K), cp.int32)
        res = cp.empty((cache.n_layers, B, K), cp.int32)
        errors = cp.zeros(cache.n_layers, cp.int32)

    def feed(t):
        tks[...] = cp.asarray(np.stack([gen.host(t, j) for j in range(len(full))]))

    def step():
        for layer in range(cache.n_layers):
            j = full.index(pat.anchor(layer)) if not pat.full[layer] else full.index(layer)
            if indexer and pat.full[layer]:
                st = cache.begin_step(req, lens, stream=main, prefetcher=pf)
                st.before_indexer(layer)
                spin(cp, 200_000)  # the indexer's window
            out = _swap(pf, layer, req, lens, tks[j] if pat.full[layer] else None, stream=main)
            res[layer][...] = out
            _check(reader, cache, layer, out, tks[j], req, errors, main)
        pf.finish(main)

    snaps = []
    with main:
        g = None
        for t in range(steps):
            feed(t)
            if g is not None:
                g.launch(main)
            else:
                step()
                if graph:
                    main.synchronize()
                    main.begin_capture()
                    step()  # (captured: runs at the next launch)
                    g = main.end_capture()
                    continue
            main.synchronize()
            snaps.append((cp.asnumpy(res), cp.asnumpy(cache.device),
                          cp.asnumpy(cache.tables.slot_tokens)))
    return snaps, cp.asnumpy(errors)


@pytest.mark.gpu
def test_prediction_never_changes_a_byte(main):
    """Prediction on (eager, captured in a graph, and in a graph with the side streams on SMs of
    their own and the step on the rest: SMPartition) against off: the same page tables, device
    rows and slot tables at every step, every row's bytes right, and the prediction used."""
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher

    pat = "FSSFSFFS"
    L, R, B = len(pat), 4, 4
    lens = cp.full(B, MAX_LEN, cp.int32)
    runs = {}
    from hisparse_cupy.streams import SMPartition

    part = SMPartition(8)
    try:
        for name, predict, graph, partition in (
                ("off", False, False, None), ("on", True, False, None),
                ("on_graph", True, True, None), ("on_partition_graph", True, True, part),
                ("on_selection_graph", True, True, None), ("on_indexer", True, False, None),
                ("on_indexer_graph", True, True, None), ("on_indexer_uncalled", True, False, None)):
            s = main if partition is None else partition.stream("main")
            cache, req = _make_cache(L, R, stream=s)
            pf = Prefetcher(cache, pat, replay_grid=2, predict=predict, predict_width=12,
                            partition=partition,
                            predict_rule="selection" if "selection" in name else "misses",
                            predict_at="indexer" if "indexer" in name else "swap")
            gen = _LayerTopK(B, 5, 11, len(pf.pattern.full_layers))
            with s:
                snaps, errors = _run_predict_steps(
                    pf, cache, req, lens, gen, 24, s, graph=graph,
                    indexer="indexer" in name and "uncalled" not in name)
            if partition is not None:  # both side streams are the partition's
                assert {pf.side.ptr, pf.predict_side.ptr} <= set(partition._streams)
            assert errors.tolist() == [0] * L, f"{name}: rows with wrong bytes"
            runs[name] = (snaps, pf)
            pf.synchronize()
    finally:
        cp.cuda.Device().synchronize()
        part.close()
    off = runs["off"][0]
    for name in (n for n in runs if n != "off"):
        snaps, pf = runs[name]
        # the graph run's first captured step ran at the second launch: align by step
        shift = len(off) - len(snaps)
        for t, (a, b) in enumerate(zip(off[shift:], snaps, strict=True)):
            for what, x, y in zip(("page tables", "device rows", "slot tables"), a, b,
                                  strict=True):
                np.testing.assert_array_equal(x, y, err_msg=f"{name}: {what} differ, step {t}")
        s = pf.predict_summary()
        assert 0 < s["used"] <= min(s["rows"], s["staged"]), (name, s)
        assert 0.0 < s["precision"] <= 1.0 and 0.0 < s["recall"] <= 1.0


@pytest.mark.gpu
def test_staging_at_the_indexer_waits_for_its_window(main):
    """``predict_at="indexer"`` on a pipeline stage (model layers 2-5 of "FSFFFF"): a full
    layer's swap defers the next one's staging; ``before_indexer`` of that layer (a model
    layer id) launches it after the work queued before the call, so with the main stream
    held busy there the staging has not run when the call returns, and it ran once the main
    stream is idle; every row's bytes right, the staging used."""
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher

    from _util import spin

    L, R, B = 4, 4, 4
    cache, req = _make_cache(L, R, stream=main)
    with main:
        lens = cp.full(B, MAX_LEN, cp.int32)
    pf = Prefetcher(cache, "FSFFFF", layer_range=(2, 6), replay_grid=2, predict=True,
                    predict_at="indexer")
    st_ = pf._predictor
    gen = _LayerTopK(B, 5, 17, L, overlap=0.9)
    reader = _reader()
    with main:
        errors = cp.zeros(L, cp.int32)
    for t in range(3):  # step 0 compiles every kernel; steps 1-2 hold the window busy
        with main:
            tks = [cp.asarray(gen.host(t, j)) for j in range(L)]
        step = cache.begin_step(req, lens, stream=main, prefetcher=pf)
        for j in range(L):
            layer = 2 + j
            if j:
                assert st_._deferred is not None and st_._deferred[1] == j
                if t:
                    with main:
                        spin(cp, 1_000_000_000)  # ~0.5 s: the indexer's window
                windows = st_.windows
                step.before_indexer(layer)
                assert st_._deferred is None and st_.windows == windows + 1
                if t:
                    assert not st_.done.done, "the staging ran before its window"
            out = step.swap(layer, tks[j])
            _check(reader, cache, j, out, tks[j], req, errors, main)
        step.finish()
        main.synchronize()
        assert st_.done.done
    assert cp.asnumpy(errors).tolist() == [0] * L, "rows with wrong bytes"
    s = pf.predict_summary()
    assert 0 < s["used"] <= min(s["rows"], s["staged"]), s


@pytest.mark.gpu
def test_prediction_negative_control_no_wait(main):
    """With the staging copy slowed and the next full layer's wait on it removed, its swap
    reads staging rows before they land (wrong bytes); with the wait, none."""
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher
    from hisparse_cupy.testing.probe import copy_probe

    class NoStageWait(Prefetcher):  # negative control: the staging is used without its wait
        def _take_stage(self, s, loc=None, batch=0, single_step=False):
            st = self._predictor
            pending, st.pending = st.pending, None
            return st.stage_fields if pending is not None and pending[1] == loc else None

    pat = "FFFF"  # full layers back to back: the next swap follows at once
    L, R, B = 4, 4, 4
    lens = cp.full(B, MAX_LEN, cp.int32)
    errs = {}
    for name, cls in (("no_wait", NoStageWait), ("wait", Prefetcher)):
        cache, req = _make_cache(L, R, stream=main)
        pf = cls(cache, pat, replay_grid=1, predict=True)
        gen = _LayerTopK(B, 5, 12, L, overlap=0.9)
        with copy_probe(spin_cycles=200_000, streams=[pf.predict_side]):  # ~0.1 ms a row
            _, errors = _run_predict_steps(pf, cache, req, lens, gen, 12, main)
        errs[name] = errors
        assert pf.predict_summary()["used"] > 0
    assert errs["no_wait"][0] == 0  # the first full layer is never predicted
    assert errs["no_wait"][1:].sum() > 0, "no stale staging row seen without the wait"
    assert errs["wait"].tolist() == [0] * L


@pytest.mark.gpu
def test_prediction_switched_on_while_cupys_current_stream_is_busy(main):
    """``set_predict(True, stream=main)`` called with another stream current, that stream held
    busy and its pool's free blocks garbage: the stager's index arrays and counters are ready
    before its side stream reads them (every row's bytes right, the staging used, its
    counters consistent)."""
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher

    from _util import spin, stale_pool

    pat = "FFFF"  # full layers back to back: the next swap follows at once
    L, R, B = 4, 4, 4
    cache, req = _make_cache(L, R, stream=main)
    with main:
        lens = cp.full(B, MAX_LEN, cp.int32)
    warm_cache, _ = _make_cache(L, R, stream=main)  # every kernel built before the spin
    warm = Prefetcher(warm_cache, pat, replay_grid=1, predict=True)
    _run_predict_steps(warm, warm_cache, req, lens, _LayerTopK(B, 5, 14, L), 2, main)
    pf = Prefetcher(cache, pat, replay_grid=1)
    gen = _LayerTopK(B, 5, 13, L, overlap=0.9)
    cp.cuda.Device().synchronize()
    busy = cp.cuda.Stream(non_blocking=True)
    with busy:
        stale_pool(cp)
        spin(cp, 4_000_000_000)  # ~2 s
        pf.set_predict(True, stream=main)
    _, errors = _run_predict_steps(pf, cache, req, lens, gen, 12, main)
    cp.cuda.Device().synchronize()
    assert errors.tolist() == [0] * L, "rows with wrong bytes"
    s = pf.predict_summary()
    assert 0 < s["used"] <= min(s["rows"], s["staged"]), s


@pytest.mark.gpu
def test_prediction_errors(main):
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher

    cache, req = _make_cache(4, 2, stream=main)
    with pytest.raises(ValueError, match="predict_width must be <= 32"):
        Prefetcher(cache, "FSFS", predict_width=K + 1)
    with pytest.raises(ValueError, match="predict_rule must be 'misses' or 'selection'"):
        Prefetcher(cache, "FSFS", predict_rule="all")
    with pytest.raises(ValueError, match="predict_at must be 'swap' or 'indexer', got 'late'"):
        Prefetcher(cache, "FSFS", predict_at="late")
    pf = Prefetcher(cache, "FSFS")
    with pytest.raises(RuntimeError, match="prediction was never turned on"):
        pf.predict_summary()
    pf.set_predict(True, stream=main)
    assert pf.predict and pf.predict_summary()["rows"] == 0
    with pytest.raises(ValueError, match="predict_at must be 'swap' or 'indexer'"):
        pf.set_predict(True, stream=main, at="early")
    assert pf.predict_at == "swap"
    pf.set_predict(True, stream=main, at="indexer")
    assert pf.predict_at == "indexer"
    with main:
        lens = cp.full(2, MAX_LEN, cp.int32)
    st = cache.begin_step(req, lens, stream=main, prefetcher=pf)
    with pytest.raises(ValueError, match="layer 1 is a shared layer: it runs no indexer"):
        st.before_indexer(1)
    with pytest.raises(ValueError, match="layer 4 is outside this pattern's layers 0 .. 3"):
        st.before_indexer(4)
    st.before_indexer(2)  # nothing was staged for it: nothing happens
    assert pf._predictor.pending is None and pf._predictor.windows == 0
    plain_step = cache.begin_step(req, lens, stream=main)
    plain_step.before_indexer(1)  # no prefetcher: only the layer is checked
    with pytest.raises(ValueError, match="layer must be"):
        plain_step.before_indexer(4)
    cp.cuda.Device().synchronize()

    from hisparse_cupy import HotBufferCache

    with main:
        plain = HotBufferCache(n_layers=2, max_requests=2, max_len=MAX_LEN, row_bytes=ROW,
                               hot_size=H, top_k=K, extra_page=P, token_table=False)
    with pytest.raises(ValueError, match="token_table=True"):
        Prefetcher(plain, "FF", predict=True)
    pf = Prefetcher(plain, "FF")  # without prediction it needs no table
    with pytest.raises(ValueError, match="token_table=True"):
        pf.set_predict(True, stream=main)
    assert not pf.predict


@pytest.mark.gpu
@pytest.mark.parametrize("width", [K, 2])
@pytest.mark.parametrize("rule", ["misses", "selection"])
def test_stager_stages_what_the_next_layer_misses(main, width, rule):
    """The stager's rows for one full layer against a model on the host: the host rows of the
    top-k tokens that layer's swap missed on (``rule="selection"``: of all its top-k tokens)
    and the next full layer's slots do not hold, each once (the top-k repeats some), at most
    ``width`` per row. The next layer's token-table entries of tokens it does not hold are
    garbage (random slots) and must not matter."""
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher

    L, R, B = 2, 4, 4
    cache, req = _make_cache(L, R, stream=main)
    lens = cp.full(B, MAX_LEN, cp.int32)
    pf = Prefetcher(cache, "FF", replay_grid=2, predict=True, predict_width=width,
                    predict_rule=rule)
    gen = _LayerTopK(B, 5, 21, L, overlap=0.6)
    rng = np.random.default_rng(3)
    with main:
        for t in range(6):  # the two layers' hot buffers drift apart
            for layer in range(L):
                _swap(pf, layer, req, lens, cp.asarray(gen.host(t, layer)), stream=main)
            pf.finish(main)
        tk = gen.host(6, 0)
        tk[:, 1] = tk[:, 2]  # repeated tokens
        tk[:, 5] = tk[:, 9]
        held = cp.asnumpy(cache.tables.slot_tokens[1])[:, :H]
        table = cp.asnumpy(cache.tables.token_slot[1])
        for r in range(R):
            loose = np.setdiff1d(np.arange(MAX_LEN), held[r])
            table[r, loose] = rng.integers(0, H, loose.size)
        cache.tables.token_slot[1][...] = cp.asarray(table)
        _swap(pf, 0, req, lens, cp.asarray(tk), stream=main)
        main.synchronize()
        pf.predict_side.synchronize()
        plan_src, plan_count = cp.asnumpy(cache.plan.src), cp.asnumpy(cache.plan.count)
        st = pf._predictor  # the stager's buffers (white-box)
        src, count = cp.asnumpy(st.src), cp.asnumpy(st.count)
        smap, hloc, rq = (cp.asnumpy(a) for a in (st.map, cache.host_locs, req))
        pf.finish(main)
    total = 0
    for b in range(B):
        r = int(rq[b])
        missed = set(plan_src[b, : plan_count[b]].tolist())
        want = {int(hloc[r, t]) for t in tk[b] if 0 <= t < MAX_LEN - 1
                and (rule == "selection" or int(hloc[r, t]) in missed) and t not in held[r]}
        got = src[b, : count[b]].tolist()
        assert count[b] == min(len(want), width), (b, count[b], len(want))
        assert len(set(got)) == len(got), f"row {b}: a row staged twice"
        assert set(got) <= want, f"row {b}: staged {set(got) - want} not predicted misses"
        if len(want) <= width:
            assert set(got) == want
        assert [int(smap[h]) for h in got] == [b * width + j for j in range(len(got))]
        total += len(want)
    assert total > 0, "the step brought no new tokens to predict"


def test_sm_partition_argument_errors():
    from hisparse_cupy.streams import SMPartition

    for bad in (0, -8, 2.5, "8"):
        with pytest.raises((ValueError, TypeError), match="side_sms"):
            SMPartition(bad)


@pytest.mark.gpu
def test_sm_partition_streams_keep_to_their_sms(main):
    """Kernels on a side stream run on side_sms SMs, on a main stream on the others, the two
    sets disjoint; an event fork / join across the groups captures and replays in a graph."""
    cp = _gpu()
    from hisparse_cupy.streams import Prefetcher, SMPartition

    smid = cp.RawKernel(r"""extern "C" __global__ void smid(int* out, long long spin) {
      unsigned s; asm("mov.u32 %0, %%smid;" : "=r"(s));
      const long long t0 = clock64(); while (clock64() - t0 < spin) {}
      if (threadIdx.x == 0) out[blockIdx.x] = s; }""", "smid")
    n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    with SMPartition(8) as part:
        assert part.side_sms >= 8 and part.side_sms + part.main_sms == n_sm
        side, other = part.stream("side"), part.stream("main", priority=-1)
        seen = {}
        for name, s in (("side", side), ("main", other)):
            with s:  # the fill ordered before the kernel (made on the current stream, it
                out = cp.full(4 * n_sm, -1, cp.int32)  # could land after: -1 read back)
            smid((out.size,), (128,), (out, np.int64(20000)), stream=s)
            s.synchronize()
            seen[name] = set(cp.asnumpy(out).tolist())
        assert -1 not in seen["side"] and -1 not in seen["main"]
        assert len(seen["side"]) <= part.side_sms
        assert len(seen["main"]) <= part.main_sms
        assert seen["side"].isdisjoint(seen["main"])
        # fork / join across the groups in a captured graph
        with other:  # (the graph runs on it: the fill lands first)
            x = cp.full(4, -1, cp.int32)
        fork, join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
        other.begin_capture()
        fork.record(other)
        side.wait_event(fork)
        smid((4,), (32,), (x, np.int64(0)), stream=side)
        join.record(side)
        other.wait_event(join)
        g = other.end_capture()
        g.launch(other)
        other.synchronize()
        del g
        assert set(cp.asnumpy(x).tolist()) <= seen["side"]
        for bad in ("left", None, ["side"]):
            with pytest.raises(ValueError, match="group must be"):
                part.stream(bad)
        cache, _ = _make_cache(4, 2, stream=main)
        with pytest.raises(TypeError, match="partition must be an SMPartition"):
            Prefetcher(cache, "FSFS", partition=8)
    with pytest.raises(RuntimeError, match="closed"):
        part.stream("side")
    with pytest.raises(ValueError, match="side_sms must be <"):
        SMPartition(n_sm)
