"""CPU: the load sweep's plan (``hisparse_cupy.demo._sweep``): which concurrencies fit which
GPU budget in each mode, and which the host memory holds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hisparse_cupy.demo import _sweep as sw

GB = 1e9


def test_128k_at_40_gb_by_hand():
    """128k-token requests (+64 steps) of the default shape (78 layers of 656 B rows, 21 full
    layers with 132 B of indexer keys a token): 7.07 GB each on the GPU, so 5 fit a 40 GB
    budget; 6.71 GB each in the host pool, so 16 fit 110 GB."""
    T = 131072 + 64
    per_gpu = T * (78 * 656 + 21 * 132)
    per_host = T * 78 * 656  # T is a whole number of 64-token pages
    assert sw.gpu_only_max(131072, 64, gpu_budget_gb=40) == int(40e9 // per_gpu) == 5
    assert sw.host_max(131072, 64, host_gb=110) == int(110e9 // per_host) == 16
    assert sw.concurrencies(131072, 64, host_gb=110, gpu_budget_gb=40) == [1, 2, 4, 5, 8, 16]
    rows = {r.concurrency: r for r in sw.plan(131072, 64, [5, 6, 16], gpu_budget_gb=40,
                                              host_gb=110)}
    assert rows[5].gpu_only_fits and not rows[6].gpu_only_fits
    assert rows[5].gpu_only_gb == pytest.approx(5 * per_gpu / GB)
    # 16 requests: the indexer's keys of all 16, then the most resident that leave a block
    # (4096 + 64 rows, 65 pages) for each of the others
    idx, row = T * 21 * 132, 78 * 656
    block = 65 * 64
    k = max(k for k in range(17) if 16 * idx + (k * T + (16 - k) * block) * row <= 40e9)
    assert rows[16].resident == k == 4
    assert rows[16].managed_gb == pytest.approx((16 * idx + (k * T + (16 - k) * block) * row)
                                                / GB)
    assert rows[16].sparse_fits and rows[16].host_fits


def test_invariants_over_random_shapes(rng):
    for _ in range(200):
        L = int(rng.integers(2, 100))
        shape = sw.Shape(layers=L, full_layers=int(rng.integers(0, L + 1)),
                         row_bytes=int(rng.choice([576, 656, 1152])),
                         resident_layers=int(rng.integers(0, min(L, 3))),
                         hot=int(rng.choice([512, 2048, 4096])), top_k=256,
                         extra_page=int(rng.choice([16, 64])), page_tokens=int(rng.choice([16,
                                                                                          64])))
        ctx, steps = int(rng.integers(1000, 200_000)), int(rng.integers(0, 300))
        budget, host = float(rng.uniform(1, 80)), float(rng.uniform(5, 200))
        T, P = ctx + steps, shape.page_tokens
        g = sw.gpu_only_max(ctx, steps, gpu_budget_gb=budget, shape=shape)
        h = sw.host_max(ctx, steps, host_gb=host, shape=shape)
        ns = sorted({1, 2, 3, g, g + 1, h, h + 1, int(rng.integers(1, 64))} - {0})
        row_layer = shape.cached_layers * shape.row_bytes
        fixed = T * (shape.full_layers * 132 + shape.resident_layers * shape.row_bytes)
        pages, block = -(-T // P), -(-shape.block_rows() // P)
        for r in sw.plan(ctx, steps, ns, gpu_budget_gb=budget, host_gb=host, shape=shape):
            n = r.concurrency
            assert r.gpu_only_fits == (n <= g) and r.host_fits == (n <= h)
            fits = [k for k in range(n + 1) if n * fixed + (k * pages + (n - k) * block) * P
                    * row_layer <= int(budget * GB)]
            assert r.resident == (max(fits) if fits else -1)
            assert r.sparse_fits == (0 in fits)
            if r.resident >= 0:
                assert r.managed_gb * GB <= int(budget * GB) + 1
            if r.gpu_only_fits and n * (fixed + pages * P * row_layer) <= int(budget * GB):
                assert r.resident == n  # what gpu-only fits, the managed mode keeps resident


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="context"):
        sw.plan(0, 10, [1], gpu_budget_gb=40, host_gb=100)
    with pytest.raises(ValueError, match="gpu_budget_gb"):
        sw.plan(1000, 10, [1], gpu_budget_gb=0, host_gb=100)
    with pytest.raises(ValueError, match="host_gb"):
        sw.host_max(1000, 10, host_gb=True)
    with pytest.raises(ValueError, match="concurrency"):
        sw.plan(1000, 10, [0], gpu_budget_gb=40, host_gb=100)
    with pytest.raises(ValueError, match="full_layers"):
        sw.Shape(layers=4, full_layers=5)
    with pytest.raises(ValueError, match="not even one request"):
        sw.concurrencies(131072, 0, host_gb=1, gpu_budget_gb=40)
    assert np.isfinite(sw.plan(1000, 0, [1], gpu_budget_gb=1, host_gb=1)[0].managed_gb)


def test_the_demos_own_shape_at_128k():
    """The decode loop as it runs (78 layers, 21 full, GLM-5.2's 656-byte FP8 rows, its two
    resident low layers): a 128k-token request needs 6.9 GB of GPU in gpu-only (KV and the
    indexer's keys) and 6.5 GB of host pool, so a 40 GB budget fits 5 and 110 GB of host 16
    (3.2x); the gpu-only self-check of those 16 needs 107 GB of KV on the GPU, which an H200
    holds. With --row bf16 (1152 bytes): 3 and 9, 106 GB for the check."""
    from hisparse_cupy.demo._args import from_args

    cfg = from_args(["--context", "131072", "--steps", "54", "--warmup", "10"])
    shape = sw.demo_shape(cfg)
    assert (shape.layers, shape.full_layers, shape.row_bytes) == (78, 21, cfg.row_bytes) == \
        (78, 21, 656)
    assert shape.resident_layers == cfg.resident_layers == 2
    T = 131072 + 64
    assert sw.gpu_only_max(131072, 64, gpu_budget_gb=40, shape=shape) == \
        int(40e9 // (T * (78 * 656 + 21 * 132))) == 5
    assert sw.host_max(131072, 64, host_gb=110, shape=shape) == int(110e9 // (T * 76 * 656)) \
        == 16
    assert 16 * T * 78 * 656 / GB == pytest.approx(107.4, abs=0.1)
    bf16 = sw.demo_shape(from_args(["--context", "131072", "--row", "bf16"]))
    assert bf16.row_bytes == 1152 and sw.Shape(resident_layers=2).row_bytes == 656
    assert sw.gpu_only_max(131072, 64, gpu_budget_gb=40, shape=bf16) == 3
    assert sw.host_max(131072, 64, host_gb=110, shape=bf16) == 9
    assert 9 * T * 78 * 1152 / GB == pytest.approx(106.1, abs=0.1)
    assert shape.indexer_bytes == 132
    assert sw.demo_shape(from_args(["--no-indexer"])).indexer_bytes == 0


class _Run:  # a run's per-step times, as demo._loop.RunResult carries them
    def __init__(self, ms):
        self.step_ms = np.asarray(ms, float)


def test_rows_hidden_share_json_and_table():
    """The sweep's rows: TPOT the mean step, p99, tokens/s = n / TPOT, resident and sparse
    counts; the sparse row's hidden share from the plain offload and gpu-only of the same n;
    the document carries the issue's fields."""
    from hisparse_cupy.demo import _sweep_run as run
    from hisparse_cupy.demo._args import from_args

    ms = np.linspace(10.0, 12.0, 101)
    r = run.row("sparse", 4, _Run(ms), fits=True, gpu_bytes=int(3.5e9), host_gb=20.0,
                resident=0)
    assert r == {"concurrency": 4, "mode": "sparse", "fits": True, "tpot_ms": 11.0,
                 "p99_ms": pytest.approx(11.98), "tokens_per_s": pytest.approx(363.64),
                 "resident": 0, "sparse": 4, "gpu_gb": 3.5, "host_gb": 20.0}
    rows = [run.row(m, 2, _Run([t]), fits=True, gpu_bytes=0, host_gb=1.0, resident=k)
            for m, t, k in (("gpu-only", 10.0, 2), ("sparse-no-overlap", 14.0, 0),
                            ("sparse", 11.0, 0), ("resident", 10.1, 2))]
    rows.append(run.row("sparse", 3, _Run([12.0]), fits=True, gpu_bytes=0, host_gb=1.0,
                        resident=0))  # no gpu-only of 3 here: no share
    run.hidden_share(rows)
    share = {(r["concurrency"], r["mode"]): r["hidden_share"] for r in rows}
    assert share == {(2, "gpu-only"): None, (2, "sparse-no-overlap"): None,
                     (2, "sparse"): 0.75, (2, "resident"): None, (3, "sparse"): None}
    cfg = from_args(["--context", "32768", "--steps", "30", "--warmup", "10"])
    plans = sw.plan(32768, 40, [2], gpu_budget_gb=40, host_gb=100, shape=sw.demo_shape(cfg))
    doc = run.document(cfg, rows, gpu_budget_gb=40.0, host_gb=100.0, plan_rows=plans,
                       errors=[], extra={"device": "x"})
    assert {"context", "gpu_budget_gb", "model", "self_check", "rows"} <= set(doc)
    assert (doc["context"], doc["gpu_budget_gb"], doc["self_check"]) == (32768, 40.0, "passed")
    assert doc["model"] == "glm52 (hidden 27136), indexer on"
    assert doc["gpu_only_max"] == sw.gpu_only_max(32768, 40, gpu_budget_gb=40,
                                                  shape=sw.demo_shape(cfg))
    assert doc["plan"][0]["concurrency"] == 2 and "sweep" not in doc["config"]
    json.dumps(doc)  # plain JSON
    assert run.document(cfg, rows, gpu_budget_gb=40.0, host_gb=100.0, plan_rows=plans,
                        errors=["n 2: differs"], extra={})["self_check"] == "failed"
    assert (doc["row_bytes"], doc["mtp"]) == (656, 1)
    text = run.table(doc).splitlines()
    assert len(text) == 1 + len(rows) and "75.0%" in text[3]
    run.against_gpu_only(rows)  # each row beside gpu-only's TPOT at its n
    vs = {(r["concurrency"], r["mode"]): (r["gpu_only_tpot_ms"], r["vs_gpu_only_pct"])
          for r in rows}
    assert vs == {(2, "gpu-only"): (10.0, 0.0), (2, "sparse-no-overlap"): (10.0, 40.0),
                  (2, "sparse"): (10.0, 10.0), (2, "resident"): (10.0, 1.0),
                  (3, "sparse"): (None, None)}
    text = run.table(doc).splitlines()
    assert text[0].endswith("vs g-o") and text[3].endswith("+10.0%") and text[1].endswith("-")


def test_sweep_flags():
    """--sweep's flags: defaults (40 GB, 80 % of the host), bad values named, its flags
    without it refused, --batch refused with it; the NumPy backend refuses it."""
    from hisparse_cupy.demo._args import cpu_config, from_args
    from hisparse_cupy.demo._config import host_memory_bytes

    c = from_args(["--sweep", "--context", "65536"])
    assert c.sweep["gpu_budget_gb"] == 40.0 and c.sweep["concurrencies"] is None
    assert c.sweep["host_gb"] == pytest.approx(0.8 * host_memory_bytes() / GB)
    c = from_args(["--sweep", "--concurrency", "4", "--concurrency", "1", "--host-gb", "50"])
    assert (c.sweep["concurrencies"], c.sweep["host_gb"]) == ([1, 4], 50.0)
    assert from_args([]).sweep is None
    c = from_args(["--sweep", "--mtp", "3"])  # MTP in the sweep: every mode, 3 draft steps
    assert c.mtp == 3 and c.sweep is not None and c.sweep["offload"] == "overlap"
    assert from_args(["--sweep", "--sweep-offload", "predict"]).sweep["offload"] == "predict"
    for argv, msg in ((["--gpu-budget", "20"], "--gpu-budget sets up --sweep"),
                      (["--sweep-offload", "predict"], "--sweep-offload sets up --sweep"),
                      (["--sweep", "--sweep-offload", "predict", "--mtp", "2"],
                       "not with --mtp 2-4"),
                      (["--concurrency", "2"], "--concurrency sets up --sweep"),
                      (["--sweep", "--batch", "4"], "--sweep runs its own concurrencies"),
                      (["--sweep", "--no-lean"], "leave out --no-lean"),
                      (["--sweep", "--device-budget", "0"], "leave out --device-budget"),
                      (["--sweep", "--mode", "overlap"], "leave out --mode"),
                      (["--sweep", "--side-sms", "8"], "leave out --side-sms"),
                      (["--sweep", "--gpu-budget", "0"], "--gpu-budget must be a number > 0"),
                      (["--sweep", "--host-gb", "-1"], "--host-gb must be a number > 0"),
                      (["--sweep", "--concurrency", "0"], "--concurrency")):
        with pytest.raises(SystemExit, match=msg):
            from_args(argv)
    with pytest.raises(SystemExit, match="--sweep needs the GPU decode loop"):
        cpu_config(["--sweep"])


def test_run_sweep_with_a_stand_in_rig(monkeypatch, tmp_path, capsys):
    """run_sweep's orchestration without a GPU (the Rig, the pool and CuPy's device queries
    stood in): per n the four runs in order, the managed run's budget for the plan's k and the
    sparse runs' none, the rows and JSON; a run whose outputs differ fails the self-check,
    named by its row; a concurrency the host pool cannot hold is refused before anything."""
    cupy = pytest.importorskip("cupy")
    from types import SimpleNamespace

    from hisparse_cupy import host
    from hisparse_cupy.demo import _loop
    from hisparse_cupy.demo import _sweep_run as run
    from hisparse_cupy.demo._args import from_args

    calls, bad = [], {}

    class Rig:
        def __init__(self, c, s, log, *, pool, paged):
            assert paged and pool.n_layers == c.layers - c.resident_layers
            self.c, self.cache, self.low, self.indexer = c, None, None, None
            self.topk_shape = {"n": c.batch}
            self.resident = SimpleNamespace(nbytes=c.batch * 10**9)

        def run(self, mode, exec_, progress):
            c = self.c
            k = c.resident_requests
            calls.append((c.batch, mode, k))
            if mode != "gpu-only" and self.cache is None:
                self.cache = SimpleNamespace(device=SimpleNamespace(nbytes=(k or 0) * 10**9))
            digest = np.ones((c.total_steps, c.layers), np.uint64)
            if bad.get((c.batch, mode, k)):
                digest[3, 5] = 7
            return _loop.RunResult(mode, exec_, np.full(c.steps, 10.0 + c.batch), digest,
                                   np.zeros(c.steps), np.zeros(c.steps), None,
                                   resident=None if mode == "gpu-only" or k is None else k)

        paged_rows = staticmethod(_loop.Rig.paged_rows)

        def free_cache(self):
            self.cache = None

        def close(self):
            pass

    pools = []

    class Pool:
        def __init__(self, n_layers, n_rows, row_bytes):
            self.n_layers, self.layer_bytes, self.closed = n_layers, n_rows * row_bytes, False
            pools.append(self)

        def close(self):
            self.closed = True

    monkeypatch.setattr(_loop, "Rig", Rig)
    monkeypatch.setattr(host, "HostKVPool", Pool)
    monkeypatch.setattr(cupy.cuda.runtime, "memGetInfo", lambda: (10**12, 10**12))
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", lambda d: {"name": b"stub"})
    monkeypatch.setattr(cupy.cuda, "Device", lambda: SimpleNamespace(id=0))
    monkeypatch.setattr(cupy.cuda, "Stream", lambda non_blocking: None)
    js = tmp_path / "s.json"
    cfg = from_args(["--context", "131072", "--warmup", "2", "--steps", "4", "--quiet",
                     "--json", str(js)])
    kw = dict(gpu_budget_gb=40.0, host_gb=110.0)
    plans = {p.concurrency: p for p in sw.plan(131072, 6, [1, 9], shape=sw.demo_shape(cfg), **kw)}
    assert run.run_sweep(cfg, concurrencies=[1, 9], **kw) == 0
    assert calls == [(n, m, k) for n in (1, 9) for m, k in
                     (("gpu-only", None), ("overlap", plans[n].resident), ("offload", None),
                      ("overlap", None))]
    assert pools[0].closed and len(pools) == 1
    doc = json.loads(js.read_text())
    assert doc["self_check"] == "passed" and "batch" not in doc["config"]
    rows = {(r["concurrency"], r["mode"]): r for r in doc["rows"]}
    assert rows[(9, "resident")]["resident"] == plans[9].resident == 5  # (FP8 rows)
    assert rows[(9, "gpu-only")]["fits"] is False and rows[(1, "gpu-only")]["fits"] is True
    assert rows[(9, "sparse")]["tpot_ms"] == 19.0 and rows[(9, "sparse")]["tokens_per_s"] == \
        pytest.approx(9e3 / 19, abs=0.01)
    calls.clear()
    bad[(9, "overlap", None)] = True  # the sparse run's outputs differ
    assert run.run_sweep(cfg, concurrencies=[9], **kw) == 1
    out = capsys.readouterr().out
    assert "SELF-CHECK FAILED" in out and "n 9: sparse graph: attention output of step 3, " \
        "layer 5 differs" in out
    assert run.run_sweep(cfg, concurrencies=[17], **kw) == 2  # 110 GB hold 16 (FP8 rows)
    assert "--concurrency 17 needs" in capsys.readouterr().out and len(pools) == 2
    calls.clear()  # the managed and sparse rows with prediction (--sweep-offload predict)
    bad.clear()
    assert run.run_sweep(cfg, concurrencies=[1], offload="predict", **kw) == 0
    assert calls == [(1, m, k) for m, k in (("gpu-only", None), ("predict", plans[1].resident),
                                             ("offload", None), ("predict", None))]
    doc = json.loads(js.read_text())
    assert doc["offload"] == "predict" and doc["self_check"] == "passed"
    assert {r["mode"] for r in doc["rows"]} == {"gpu-only", "resident", "sparse",
                                                "sparse-no-overlap"}
    with pytest.raises(ValueError, match="offload must be"):
        run.runs("bogus")
