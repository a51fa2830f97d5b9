"""The randomized step-level test (``_stepfuzz.py``): the step API driven as an engine drives
it, every output byte checked. The CPU part runs the driver on the NumPy model of the cache
(``_stepmodel.py``); the GPU part on the real cache (``tools/gpu_check.sh`` runs it for
100k steps over several processes)."""

from __future__ import annotations

import numpy as np
import pytest
from _stepfuzz import CHECKS, Fuzz

from hisparse_cupy.testing.selfcheck import pattern


def test_pattern_takes_one_layer_per_row():
    """The byte pattern the checks use: a layer per row equals the same layer given once."""
    ids = np.arange(0, 5000, 37)
    layers = np.arange(ids.size) % 3
    got = pattern(layers, ids, 64)
    for layer in range(3):
        np.testing.assert_array_equal(got[layers == layer], pattern(layer, ids[layers == layer],
                                                                    64))
    assert len({bytes(r) for r in got}) == ids.size  # every (layer, id) distinct


@pytest.mark.parametrize("seed", [*range(6), *(pytest.param(s, marks=pytest.mark.slow)
                                               for s in range(6, 30))])
def test_step_fuzz_cpu_model(seed):
    r = Fuzz(False, seed).run(300)
    assert r["errors"] == dict.fromkeys(CHECKS, 0)
    assert r["calls"] >= 300 * r["config"]["n_layers"]


def test_the_fuzz_checks_catch_a_wrong_row():
    """Negative control: a row pointing at another token's bytes is counted."""
    f = Fuzz(False, 3)
    f.run(5)
    real = f.c._swap

    def corrupt(layer, topk, req, lens, nr):
        out, plan = real(layer, topk, req, lens, nr)
        out = out.copy()
        sel = np.argwhere(out >= 0)
        if len(sel):
            i = tuple(sel[0])
            out[i] = (out[i] + 1) % f.c.device.shape[1]
        return out, plan

    f.c._swap = corrupt
    with pytest.raises(AssertionError, match="wrong bytes|two rows"):
        f.run(20)


def test_the_fuzz_describes_a_token_given_two_rows():
    """Negative control of ``detail``: a call that gives a repeated token a second row is
    counted as "two rows for one token" and described (the call, the row, the token, both
    rows), so a failing GPU seed can be read without a debugger."""
    f = Fuzz(False, 5, detail=True)
    f.run(5)
    real = f.c._swap

    def split(layer, topk, req, lens, nr):
        out, plan = real(layer, topk, req, lens, nr)
        flat_t, out = np.asarray(topk).reshape(len(out), -1), out.copy()
        flat_o = out.reshape(len(out), -1)
        for b in range(min(int(nr), len(out))):
            seen = {}
            for j, t in enumerate(flat_t[b]):
                if t >= 0 and flat_o[b, j] >= 0:
                    if t in seen and flat_o[b, seen[t]] == flat_o[b, j]:
                        flat_o[b, j] = (flat_o[b, j] + 1) % f.c.device.shape[1]
                        return out, plan
                    seen.setdefault(t, j)
        return out, plan

    f.c._swap = split
    with pytest.raises(AssertionError, match="two rows for one token.*first offending entry"):
        f.run(60)
    assert f.summary()["errors"]["two rows for one token"] > 0
    d = f.details[0]
    assert d["rows"][0] != d["rows"][1] and d["token"] >= 0 and d["kind"] == "eager"
    assert set(d) >= {"step", "layer", "row", "request", "lens", "S", "at", "first_at",
                      "slots_holding"}


@pytest.mark.slow
def test_the_fuzz_forks_and_checks_a_forks_shared_tokens(monkeypatch):
    """Paged configurations fork requests (``admit(prefix=...)``), and a fork's tokens below
    its fork point are checked against the bytes of the instance that wrote them. Negative
    control: a driver that forgets what a fork shares expects the fork's own bytes there and
    fails."""
    runs = [Fuzz(False, seed) for seed in range(12)]
    got = [f.run(300) for f in runs]
    assert sum(r["forks"] for r in got) > 0
    assert sum(r["refused_forks"] for r in got) > 0  # past the written tokens: refused
    assert sum(r["rewrites"] for r in got) > 0  # rejected drafts drawn (their bytes checked)
    assert all(r["errors"] == dict.fromkeys(CHECKS, 0) for r in got)
    monkeypatch.setattr(Fuzz, "_fork_origin", lambda self, parent, p: [])
    failed = 0
    for seed in range(12):
        f = Fuzz(False, seed)
        try:
            f.run(300)
        except AssertionError as e:
            failed += 1
            assert "wrong bytes" in str(e)
    assert failed > 0


@pytest.mark.slow
def test_the_fuzz_catches_a_fork_past_the_written_tokens(monkeypatch):
    """Negative control of the refused forks: a model that forgets the written bound (it takes
    every grown token as written) lets such a fork through, and the fuzz says so."""
    import _stepmodel

    real = _stepmodel.ModelCache.admit

    def lax(self, *args, prefix=None, **kw):
        if prefix is not None:
            locs = self.host_locs[prefix[0], : prefix[1]]
            locs[locs < 0] = 0
        return real(self, *args, prefix=prefix, **kw)

    monkeypatch.setattr(_stepmodel.ModelCache, "admit", lax)
    taken = 0
    for seed in range(12):
        try:
            Fuzz(False, seed).run(300)
        except AssertionError as e:
            taken += "was taken" in str(e)
    assert taken > 0


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_step_fuzz_gpu(seed):
    r = Fuzz(True, 1000 + seed).run(300)
    assert r["errors"] == dict.fromkeys(CHECKS, 0)


@pytest.mark.gpu
def test_the_gpu_fuzz_draws_captures_in_global_mode_and_pools_collected_inside_them():
    """The states only the GPU fuzz reaches are drawn, bytes checked: steps captured in torch's
    global mode, host pools collected unclosed inside a capture, rejected drafts."""
    got = [Fuzz(True, 2000 + seed).run(300) for seed in range(6)]
    assert all(r["errors"] == dict.fromkeys(CHECKS, 0) for r in got)
    for key in ("global_captures", "orphans", "rewrites", "graph_steps"):
        assert sum(r[key] for r in got) > 0, key


@pytest.mark.gpu
def test_the_budget_fuzz_draws_its_moves_and_refusals():
    """Under a device budget in every seed, bytes checked: residency moves, token counts and
    writes past the budget's count refused (an engine that did not grow first)."""
    got = [Fuzz(True, 3000 + seed, budget=True).run(150) for seed in range(8)]
    assert all(r["errors"] == dict.fromkeys(CHECKS, 0) for r in got)
    for key in ("moves", "refused_counts", "refused_writes"):
        assert sum(r[key] for r in got) > 0, key


def test_a_seed_whose_call_raises_is_a_failure_with_its_traceback(monkeypatch):
    """A call that raises (here PoolExhausted, as a GPU seed's grow did) fails its seed with
    the exception and where it came from; it does not end the run (a worker pool could not
    even unpickle it before)."""
    import _stepfuzz

    from hisparse_cupy import PoolExhausted

    def boom(self):
        raise PoolExhausted("rid 0 growing to 64 tokens", 3, 2)

    monkeypatch.setattr(Fuzz, "_step", boom)
    r = _stepfuzz._one((False, 5, 3, False, None, False))
    assert r["seed"] == 5 and r["errors"] == {}
    assert "raised PoolExhausted: rid 0 growing to 64 tokens needs 3 free host pages" in \
        r["failure"] and "in boom" in r["failure"]


@pytest.mark.slow
def test_the_fuzz_says_where_the_indexers_start_and_a_shared_layers_call_is_refused(monkeypatch):
    """Steps call ``before_indexer`` before most full layers (with and without a prefetcher),
    at times for another full layer, and the call for a shared layer is refused. Negative
    control: a prefetcher that accepts a shared layer's call fails the seed."""
    got = [Fuzz(False, seed).run(200) for seed in range(8)]
    assert sum(r["indexer_calls"] for r in got) > 0
    assert all(r["errors"] == dict.fromkeys(CHECKS, 0) for r in got)
    from _stepmodel import ModelPrefetcher

    monkeypatch.setattr(ModelPrefetcher, "before_indexer", lambda self, layer, stream=None: None)
    failed = 0
    for seed in range(8):
        f = Fuzz(False, seed)
        if f.pf is None or all(f.full):
            continue
        with pytest.raises(AssertionError, match="of a shared layer was accepted"):
            f.run(200)
        failed += 1
    assert failed > 0
