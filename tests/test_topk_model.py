"""The top-k stream generator (``hisparse_cupy.demo._topk_model``): the shape it promises,
measured on what it generated (exact-LRU miss rate per hot size, step and layer overlap)."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_cupy.demo._topk_model import DEFAULT_CURVE, StreamShape, TopKStream, measure

K, B, N_FULL, STEPS = 256, 2, 5, 40
CONTEXT = 16 * K
TOL = 0.01  # absolute, on shares of entries


def _run(shape: StreamShape, seed: int = 0):
    st = TopKStream(shape, n_full=N_FULL, batch=B, top_k=K, context=CONTEXT,
                    rng=np.random.default_rng(seed))
    lens = [np.full(B, CONTEXT + t) for t in range(STEPS)]
    steps = [st.step(n) for n in lens]
    return st, steps, lens


def test_rows_are_distinct_valid_tokens_with_the_newest_in():
    shape = StreamShape()
    _, steps, lens = _run(shape)
    for s, n in zip(steps, lens, strict=True):
        assert s.shape == (N_FULL, B, K) and s.dtype == np.int32
        for j in range(N_FULL):
            for b in range(B):
                row = s[j, b]
                assert np.unique(row).size == K
                assert row.min() >= 0 and row.max() < n[b]
                assert np.isin(n[b] - 1 - np.arange(shape.recent), row).all()


def test_the_default_shape_is_what_it_promises():
    shape = StreamShape()
    st, steps, _ = _run(shape, seed=1)
    m = measure(steps, st.initial, tuple(int(r * K) for r, _ in DEFAULT_CURVE))
    normal = slice(shape.low_layers, N_FULL)
    for (_, miss), H in zip(DEFAULT_CURVE, m["miss"], strict=True):
        assert np.abs(m["miss"][H][normal] - miss).max() < TOL, (H, m["miss"][H])
    assert np.abs(m["step_overlap"][normal] - 0.70).max() < TOL, m["step_overlap"]
    # layers after the first normal one follow it at layer_overlap, in their misses too
    follow = slice(shape.low_layers + 1, N_FULL)
    assert np.abs(m["layer_overlap"][follow] - 0.8).max() < TOL, m
    for H, v in m["miss_followed"].items():
        assert np.abs(v[follow] - 0.8).max() < 0.05, (H, v)  # within 5 points
    assert np.isnan(m["miss_followed"][K][0]) and np.isnan(m["miss_predictable"][K][0])
    for H, v in m["miss_predictable"].items():  # missed by both: a part of the followed ones
        assert (v[1:] <= m["miss_followed"][H][1:] + 1e-12).all() and (v[1:] > 0).all(), H
    # low layers: nearly nothing from the previous step but the recent tokens
    low = m["step_overlap"][:shape.low_layers]  # the recent tokens are a floor at K 256
    assert (low < max(shape.low_overlap, (shape.recent - 1) / K) + TOL).all(), low
    assert (m["miss"][K][:shape.low_layers] > 0.9).all()


def test_a_step_overlap_sets_the_curve_first_point():
    shape = StreamShape.from_overlap(0.44)
    assert shape.curve[0] == (1.0, pytest.approx(0.56)) and shape.step_overlap == \
        pytest.approx(0.44)
    st, steps, _ = _run(shape, seed=2)
    m = measure(steps, st.initial, (K, 2 * K))
    normal = slice(shape.low_layers, N_FULL)
    assert np.abs(m["step_overlap"][normal] - 0.44).max() < TOL, m["step_overlap"]
    assert np.abs(m["miss"][2 * K][normal] - 0.134).max() < TOL


@pytest.mark.parametrize("kw, match", [
    (dict(curve=((1.0, 0.1), (2.0, 0.3))), "not increase"),
    (dict(curve=((2.0, 0.3), (1.0, 0.1))), "increasing"),
    (dict(curve=()), "curve"),
    (dict(layer_overlap=1.5), "layer_overlap"),
    (dict(low_overlap=-0.1), "low_overlap"),
    (dict(recent=-1), "recent"),
    (dict(low_layers=1.5), "low_layers"),
])
def test_bad_shapes_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        StreamShape(**kw)


def test_bad_sizes_name_the_argument():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="top_k"):
        TopKStream(StreamShape(), n_full=1, batch=1, top_k=16, context=100, rng=rng)
    with pytest.raises(ValueError, match="context"):
        TopKStream(StreamShape(), n_full=1, batch=1, top_k=64, context=64, rng=rng)
    st = TopKStream(StreamShape(), n_full=1, batch=2, top_k=64, context=200, rng=rng)
    with pytest.raises(ValueError, match="lens"):
        st.step(np.array([201]))
    with pytest.raises(ValueError, match="step_overlap"):
        StreamShape.from_overlap(1.2)


@pytest.mark.slow
def test_the_numpy_demo_runs_on_the_streams_and_reports_their_shape(capsys):
    from hisparse_cupy.demo._args import cpu_config
    from hisparse_cupy.demo._cpu import run

    cfg = cpu_config(["--topk-model", "lru", "--layers", "12", "--steps", "8",
                      "--step-overlap", "0.6", "--quiet"])
    rep = run(cfg)["topk_shape"]  # the run's own self-check passed (it raises otherwise)
    assert abs(rep["step_overlap"] - 0.6) < 0.03 and abs(rep["layer_overlap"] - 0.8) < 0.03
    assert abs(rep["exact_lru_miss"][2 * cfg.top_k] - 0.134) < 0.03
    assert "top-k streams as generated" in capsys.readouterr().out


def test_the_demo_flags_of_the_streams_are_checked():
    from hisparse_cupy.demo._args import from_args

    assert from_args([]).topk_model == "lru"  # the default, on the GPU loop too
    with pytest.raises(SystemExit, match="--step-overlap must be in"):
        from_args(["--step-overlap", "2"])
    with pytest.raises(SystemExit, match="shape --topk-model lru's streams"):
        from_args(["--topk-model", "drift", "--step-overlap", "0.5"])
    c = from_args(["--mtp", "3"])  # the lru streams, three draft steps a call
    assert (c.topk_model, c.mtp) == ("lru", 3) and "predict" not in c.modes
    c = from_args(["--mtp", "2", "--topk-model", "drift"])
    assert "predict" not in c.modes  # prediction is single-step: the default modes drop it
    with pytest.raises(SystemExit, match="--mode predict is single-step"):
        from_args(["--mtp", "2", "--topk-model", "drift", "--mode", "predict"])


def test_generate_in_parallel_equals_the_stream_step_by_step():
    from hisparse_cupy.demo._topk_model import generate

    shape = StreamShape()
    lens = np.stack([np.array([CONTEXT + t, CONTEXT + 3 + t, CONTEXT + 7 + t])
                     for t in range(6)])
    st = TopKStream(shape, n_full=N_FULL, batch=3, top_k=K, context=CONTEXT,
                    rng=np.random.default_rng(5))
    stepped = np.stack([st.step(n) for n in lens])
    for workers in (1, 2):
        got, initial = generate(shape, n_full=N_FULL, top_k=K, context=CONTEXT, lens=lens,
                                rng=np.random.default_rng(5), workers=workers)
        np.testing.assert_array_equal(got, stepped)
        for j in range(N_FULL):
            for b in range(3):
                np.testing.assert_array_equal(initial[j][b], st.initial[j][b])
    with pytest.raises(ValueError, match="lens must be"):
        generate(shape, n_full=1, top_k=K, context=CONTEXT, lens=[CONTEXT],
                 rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="rng must be"):
        TopKStream(shape, n_full=1, batch=2, top_k=K, context=CONTEXT,
                   rng=[np.random.default_rng(0)])


def test_mtp_draft_steps_are_consecutive_draws_within_the_tokens():
    """--mtp S on the lru streams: decode step t draws S consecutive selections of each full
    layer at its length (no draft token selected before its KV exists); a call's drafts
    overlap as consecutive steps do, so the distinct share of its S x K entries follows from
    the measured step overlap, between 1 / S and 1."""
    from hisparse_cupy.demo._topk_model import (
        StreamShape,
        draft_lens,
        draft_union,
        generate,
        measure,
    )

    K, ctx, steps, B, S = 64, 1024, 6, 2, 3
    lens = draft_lens(ctx, steps, S, B)
    assert lens.shape == (steps * S, B)
    assert (lens[:, 0] == ctx + np.repeat(np.arange(steps), S)).all()
    tab, initial = generate(StreamShape(recent=4), n_full=4, top_k=K, context=ctx, lens=lens,
                            rng=np.random.default_rng(5), workers=1)
    assert tab.shape == (steps * S, 4, B, K)
    assert (tab < lens[:, None, :, None]).all() and (tab >= 0).all()
    u = draft_union(tab, S)
    assert 1 / S < u < 1
    # by hand: the distinct tokens of each call, layer and request
    calls = [len(np.unique(tab[t * S:(t + 1) * S, j, b])) for t in range(steps)
             for j in range(4) for b in range(B)]
    assert u == pytest.approx(np.mean(calls) / (S * K))
    # consecutive drafts overlap as the stream's steps do: with overlap o between
    # neighbours, S drafts hold at least K (1 + (S - 1)(1 - o)) - overlaps of non-neighbours
    o = float(np.mean(measure(list(tab), initial, (K,))["step_overlap"][2:]))
    assert 0.3 < o < 0.95
    # (the low layers share almost nothing from step to step: their drafts are all distinct)
    assert draft_union(tab[:, :2], S) > 0.9  # (the recent tokens repeat in every draw)
    assert draft_union(tab[:, 2:], S) == pytest.approx((1 + (S - 1) * (1 - o)) / S, abs=0.06)
    assert draft_union(tab[:, :, :, :], 1) == 1.0  # one draw: K distinct tokens
    with pytest.raises(ValueError, match="not a multiple of drafts"):
        draft_union(tab[:-1], S)


def test_measure_from_a_cold_buffer_counts_every_first_pick_a_miss():
    """Empty starting stacks (a hot buffer that starts cold, as a real model's admission with
    no warm tokens): every token of the first step misses at every H; a second step that picks
    the same tokens hits at H = K."""
    K, B = 4, 2
    first = np.array([[[0, 1, 2, 3], [4, 5, 6, 7]]])  # [n_full 1, B, K]
    cold = [[np.empty(0, np.int64) for _ in range(B)]]
    m = measure([first], cold, (K,))
    assert m["miss"][K].tolist() == [1.0]
    m = measure([first, first], cold, (K,))
    assert m["miss"][K].tolist() == [0.5] and m["step_overlap"].tolist() == [1.0]
