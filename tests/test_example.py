"""The README's main example (the decode loop) runs and checks itself: the NumPy reference
backend without a GPU, the kernels with one; a corrupted swap makes its self-check fail."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "decode_loop.py"
SMALL = ["--layers", "8", "--batch", "3", "--context", "2304", "--hot", "1024", "--top-k",
         "256", "--steps", "6", "--warmup", "3", "--device-budget", "0"]  # the sparse path


def _run(*args: str) -> str:
    p = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def _have_gpu() -> bool:
    from conftest import _device_count

    return _device_count()[0] > 0


def test_example_runs_on_the_reference_backend_without_a_gpu():
    if _have_gpu():
        pytest.skip("a GPU is present: the example runs the kernels (test_example_on_gpu_*)")
    out = _run("--steps", "5")
    first = out.splitlines()[0]
    assert "running the NumPy reference backend" in first
    assert out.count("attention outputs bit-identical to gpu-only") == 5
    assert "self-check passed" in out


def test_reference_backend_self_check_catches_a_dropped_copy(monkeypatch):
    """Negative control: one missed row not copied -> the self-check fails (exit, not warn)."""
    from hisparse_cupy.demo import _cpu as cpu

    real = cpu.ref.swap_in
    calls = []

    def lossy(*a, **kw):
        res = real(*a, **kw)
        calls.append(1)
        if len(calls) == 20 and res.plan_count[0] > 0:
            res.plan_count[0] -= 1  # the last miss of row 0 is never copied
        return res

    monkeypatch.setattr(cpu.ref, "swap_in", lossy)
    from hisparse_cupy.demo._args import cpu_config

    with pytest.raises(SystemExit, match="SELF-CHECK FAILED"):
        cpu.run(cpu_config(["--steps", "4"]))


def test_reference_backend_on_pages_shared_by_a_prefix(monkeypatch):
    """The NumPy backend's host pool is paged: requests 1.. fork request 0 at 1000 tokens (15
    whole pages shared, a partial page of 40 tokens copied), every output checked against the
    true KV; without the copy of the partial page the self-check fails."""
    from hisparse_cupy.demo import _cpu as cpu
    from hisparse_cupy.demo._args import cpu_config

    cfg = cpu_config(["--batch", "3", "--shared-prefix", "1000", "--steps", "4", "--quiet"])
    res = cpu.run(cfg)
    pages = -(-(cfg.context + cfg.steps) // cpu.PAGE_TOKENS)  # per request, unshared
    assert res["self_check"] == "passed" and res["host_pages_used"] == 3 * pages - 2 * 15
    assert cpu.run(cpu_config(["--batch", "3", "--steps", "4", "--quiet"]))[
        "host_pages_used"] == 3 * pages
    admit = cpu.HostPages.admit
    monkeypatch.setattr(cpu.HostPages, "admit", lambda self, *a, **kw: admit(self, *a, **kw)[:0])
    with pytest.raises(SystemExit, match="SELF-CHECK FAILED"):
        cpu.run(cfg)
    with pytest.raises(SystemExit, match="--shared-prefix must be in"):
        cpu_config(["--shared-prefix", "5000"])


def test_reference_backend_honours_or_refuses_every_flag(tmp_path):
    """On the NumPy backend every flag given is used or refused with a message; flags not
    given take its small values."""
    from hisparse_cupy.demo import _cpu as cpu
    from hisparse_cupy.demo._args import cpu_config
    from hisparse_cupy.demo._config import CPU_DEFAULTS, CPU_REFUSED

    cfg = cpu_config(["--batch", "3", "--context", "2048", "--warmup", "0", "--steps", "2",
                      "--json", str(tmp_path / "r.json"), "--quiet", "--pattern", "FSFFSSFS"])
    assert (cfg.batch, cfg.context, cfg.warmup, cfg.steps) == (3, 2048, 0, 2)
    assert (cfg.layers, cfg.hot, cfg.top_k) == (8, CPU_DEFAULTS["hot"], CPU_DEFAULTS["top_k"])
    res = cpu.run(cfg)
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["config"]["batch"] == 3 and got["self_check"] == "passed"
    assert len(got["steps"]) == 2 == len(res["steps"])
    assert got["steps"][0]["seq_len"] == 2049
    for flag in CPU_REFUSED:
        arg = [flag] + ({"--mtp": ["2"], "--mode": ["overlap"], "--png": ["x.png"],
                         "--hidden": ["512"], "--model": ["light"], "--side-sms": ["8"],
                         "--predict-rule": ["misses"], "--predict-at": ["indexer"],
                         "--matmul": ["torch"],
                         "--resident-layers": ["2"], "--replay-grid": ["8"],
                         "--replay-rows-per-warp": ["8"],
                         "--group-replay-batch": ["0"], "--device-budget": ["4"],
                         "--resident-requests": ["1"], "--row": ["bf16"]}.get(flag, []))
        with pytest.raises(SystemExit, match=f"{flag} needs the GPU decode loop"):
            cpu_config(arg)
    assert cpu_config(["--mtp", "1"]).mtp == 1  # off: nothing to refuse
    for off in (["--eager"], ["--no-predict"], ["--no-partition"], ["--side-sms", "0"],
                ["--predict-rule", "selection"], ["--predict-at", "swap"], ["--matmul", "cublas"],
                ["--no-lean"],
                ["--model", "glm52"], ["--no-indexer"]):
        cpu_config(off)  # what the NumPy backend runs anyway: accepted
    assert cpu_config(["--mode", "offload"]).modes == ("gpu-only", "offload")
    # one flag given: the small values of the others follow it
    assert cpu_config(["--pattern", "FSSSFSSSFS"]).layers == 10
    assert cpu_config(["--recent", "10"]).extra_page == 10
    c = cpu_config(["--top-k", "1024"])
    assert c.hot == 1024 and c.context > c.hot + c.top_k
    assert cpu_config(["--hot", "2048"]).context > 2048 + 128
    with pytest.raises(SystemExit, match="--pattern 'FS'"):
        cpu_config(["--pattern", "FS", "--layers", "8"])
    with pytest.raises(SystemExit, match="--pattern must not be empty"):
        cpu_config(["--pattern", ""])


def test_demo_without_cupy_and_its_help():
    """The NumPy backend imports NumPy only (CuPy blocked in the child); --help shows every
    default."""
    code = ("import sys; sys.modules['cupy'] = None; from hisparse_cupy.demo import main; "
            "sys.exit(main(['--steps', '1', '--layers', '4']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "self-check passed" in p.stdout and "4 layers" in p.stdout
    p = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0
    for want in ("(default: 78)", "(default: 2048)", "entries of each layer's top-k",
                 "flags not given take small values", "--batch 2"):
        assert want in " ".join(p.stdout.split()), want


@pytest.mark.parametrize("example, needs", [("torch_interop.py", "torch"),
                                            ("jax_interop.py", "jax"),
                                            ("tp_decode.py", "torch")])
def test_examples_name_the_missing_extra(example, needs):
    import importlib.util

    if importlib.util.find_spec(needs) is not None:
        pytest.skip(f"{needs} is installed")
    p = subprocess.run([sys.executable, str(ROOT / "examples" / example)], capture_output=True,
                       text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "pip install -e '.[interop]'" in out, out
    assert "hisparse_cupy[" not in out  # (not on PyPI: the extra installs from a checkout)
    extras = re.search(r"\[project.optional-dependencies\](.*?)\n\[", (ROOT / "pyproject.toml")
                       .read_text(), re.S).group(1)
    assert re.search(rf"^interop = \[.*\b{needs}\b", extras, re.M), extras  # the extra has it


_EXTRAS = ("torch", "jax", "nixl", "nixl_cu12", "nixl_cu13")  # each example's optional import


@pytest.mark.parametrize("blocked", [False, True], ids=["as installed", "extras blocked"])
@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_every_examples_help_works_with_or_without_its_extras(example, blocked):
    """``--help`` prints the usage whether or not torch, JAX, NIXL or a GPU is there (the
    missing extra is named when the example runs, not when it is asked for its options): as
    installed here, and with every optional import blocked in the child."""
    block = "".join(f"sys.modules[{m!r}] = None; " for m in _EXTRAS) if blocked else ""
    code = (f"import runpy, sys; {block}sys.argv = [{example!r}, '--help']; "
            f"runpy.run_path({str(ROOT / 'examples' / example)!r}, run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "usage:" in p.stdout and "Traceback" not in p.stderr


def test_pd_decode_help_shows_its_own_flags_then_the_loops():
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "pd_decode.py"), "--help"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    out = " ".join(p.stdout.split())
    for want in ("usage: pd_decode.py", "--push", "--shared-pool", "--cpu", "(default: 78)"):
        assert want in out, want
    assert out.index("--shared-pool") < out.index("(default: 78)")


def test_config_memory_and_errors():
    from hisparse_cupy.demo._args import from_args
    from hisparse_cupy.demo._config import Config

    c = Config()
    m = c.memory()
    # the defaults fit the budget: <= 32 GB pinned, <= 40 GB on the GPU in all
    assert m["host_pinned"] <= 32e9
    assert m["gpu_resident"] + m["gpu_hot"] + m["gpu_model"] + m["gpu_indexer"] <= 40e9
    assert c.row_bytes == 656 and from_args(["--row", "bf16"]).row_bytes == 1152  # (FP8 default)
    assert m["host_pinned"] == 78 * 32 * (8192 + 220) * 656
    # the indexer's key cache: 132 B a token of every full layer (21 of GLM-5.2's 78), every
    # request; its queries (64 x 128 int8) and scores (a float a token) per query row
    assert m["gpu_indexer"] == 21 * 32 * 8412 * 132 + 32 * (8192 + 4 * 8412)
    assert Config(indexer=False).memory()["gpu_indexer"] == 0
    assert (c.model, c.hidden) == ("glm52", 27136)
    assert (from_args(["--model", "light"]).hidden, from_args(["--hidden", "512"]).model) == \
        (4096, "custom")
    with pytest.raises(SystemExit, match="--hidden must be a multiple of 64"):
        from_args(["--hidden", "100"])
    with pytest.raises(SystemExit, match="give --model or --hidden"):
        from_args(["--model", "light", "--hidden", "512"])
    with pytest.raises(SystemExit, match="model 'light' has hidden 4096, got 27136"):
        Config(model="light").check()
    Config(model="light", hidden=4096).check()
    assert [from_args(a).predict_at for a in ([], ["--predict-at", "indexer"])] == \
        ["swap", "indexer"]
    Config(model="custom", hidden=512).check()
    c = from_args(["--mtp", "2", "--topk-model", "drift", "--mode", "overlap",
                   "--eager-and-graph"])
    assert c.modes == ("gpu-only", "overlap") and c.execs == ("eager", "graph")
    assert c.scratch() == 1024
    for bad, msg in ((["--mtp", "5"], "--mtp"),
                     (["--new-share", "0.01"], "--new-share shapes the drift model"),
                     (["--topk-model", "drift", "--new-share", "0"], "--new-share must be in"),
                     (["--topk-model", "drift", "--seed", "3"], "--seed draws the lru streams"),
                     (["--seed", "-1"], "--seed must be >= 0"),
                     (["--recent", "0"], "--recent"),
                     (["--resident-layers", "3"], "layer 3 is shared"),
                     (["--resident-layers", "78"], "--resident-layers must be in"),
                     (["--replay-grid", "0"], "--replay-grid must be >= 1"),
                     (["--group-replay-batch", "-1"], "--group-replay-batch must be >= 0")):
        with pytest.raises(SystemExit, match=msg):
            from_args(bad)
    from hisparse_cupy._kernels.build import COPY_ROWS_PER_WARP
    from hisparse_cupy.demo._config import REPLAY_ROWS_PER_WARP, Config

    with pytest.raises(SystemExit, match=r"--replay-rows-per-warp must be one of \(1, 2, 4, 8\)"):
        Config(replay_rows_per_warp=3).check()

    assert REPLAY_ROWS_PER_WARP == COPY_ROWS_PER_WARP  # the flag's choices are the kernel's


def test_resident_layers_default_memory_and_refusals():
    """--resident-layers: the lru default keeps the generator's low-overlap layers (GLM-5.2's
    0 and 1) on the GPU, drift none; the memory moves from the host pool to the GPU; a given
    pool or admission hook (every layer in the pool) and the NumPy backend refuse it."""
    from hisparse_cupy.demo._args import cpu_config, from_args
    from hisparse_cupy.demo._config import Config
    from hisparse_cupy.demo._loop import Rig

    c = from_args([])
    assert c.resident_layers == 2 and "layers 0-1 keep their KV" in c.describe_resident()
    assert from_args(["--topk-model", "drift"]).resident_layers == 0
    assert from_args(["--resident-layers", "0"]).resident_layers == 0
    assert from_args(["--pattern", "FSSFSSFFSS", "--layers", "10"]).resident_layers == 6
    layer = 32 * (8192 + 220) * 656
    m0, m2 = from_args(["--resident-layers", "0"]).memory(), c.memory()
    assert m0["host_pinned"] == 78 * layer and m2["host_pinned"] == 76 * layer
    assert m2["gpu_resident"] == m0["gpu_resident"] == 78 * layer
    assert m0["gpu_hot"] - m2["gpu_hot"] == 2 * 32 * (4096 + 64) * 656 - 2 * layer
    assert "with layers 0-1's 0.35 GB resident" in c.describe_memory()
    assert Config().resident_layers == 0
    for kw in ({"pool": object()}, {"admission": lambda rig: None}):
        with pytest.raises(SystemExit, match="--resident-layers needs a host pool of the cach"):
            Rig(c, None, print, **kw)
    assert cpu_config([]).resident_layers == 0
    assert cpu_config(["--resident-layers", "0"]).resident_layers == 0
    with pytest.raises(SystemExit, match="--resident-layers needs the GPU decode loop"):
        cpu_config(["--resident-layers", "2"])


@pytest.mark.gpu
def test_example_on_gpu_every_mode_eager_and_graph(tmp_path):
    js = tmp_path / "r.json"
    out = _run(*SMALL, "--topk-model", "drift", "--eager-and-graph", "--json", str(js))
    assert "self-check passed" in out
    doc = json.loads(js.read_text())
    assert doc["self_check"] == "passed"
    rows = {(r["mode"], r["exec"]): r for r in doc["summary"]}
    assert set(rows) == {(m, e) for m in ("gpu-only", "offload", "overlap", "predict")
                         for e in ("eager", "graph")}
    for (mode, _), r in rows.items():
        if mode != "gpu-only":
            # 5% of 256 = 13 new tokens per step and request, plus the previous newest token
            assert 0.9 < r["hit_rate"] < 0.97, r
            assert r["mb_per_step"] > 0
    runs = {(r["mode"], r["exec"]): r for r in doc["runs"]}
    moved = np.array(runs[("offload", "eager")]["rows_moved"])
    assert (moved == np.array(runs[("overlap", "graph")]["rows_moved"])).all()


@pytest.mark.gpu
def test_example_on_gpu_bf16_rows(tmp_path):
    """--row bf16: the model's bf16 instances (the prompt KV, the newest rows, the attention) in
    every mode, eager and captured in graphs, each offloaded run bit-identical to gpu-only."""
    js = tmp_path / "r.json"
    out = _run(*SMALL, "--row", "bf16", "--eager-and-graph", "--json", str(js))
    assert "self-check passed" in out and "bf16" in out
    doc = json.loads(js.read_text())
    assert doc["self_check"] == "passed" and doc["config"]["row"] == "bf16"
    assert {(r["mode"], r["exec"]) for r in doc["summary"]} == {
        (m, e) for m in ("gpu-only", "offload", "overlap", "predict") for e in ("eager", "graph")}


@pytest.mark.gpu
@pytest.mark.parametrize("partition", ["default", "side8"])
def test_example_on_gpu_default_configuration(tmp_path, partition):
    """The defaults: lru streams (their measured shape printed), graphs, the predict mode, no SM
    partition; with --side-sms 8 the step on the rest of the SMs (green contexts); each run
    self-checked against gpu-only (on the same SMs)."""
    js = tmp_path / "r.json"
    out = _run(*SMALL, "--json", str(js), *(["--side-sms", "8"] if partition == "side8" else []))
    assert "self-check passed" in out and "top-k streams as generated" in out
    doc = json.loads(js.read_text())
    assert doc["self_check"] == "passed"
    assert doc["partition"].startswith(
        "SM partition (green contexts, --side-sms 8): side streams on 8 SMs" if partition ==
        "side8" else "SM partition: off: the side streams share the step's SMs")
    shape = doc["topk_shape"]
    assert 0.0 <= shape["step_overlap"] <= 1.0 and shape["requests_measured"] == 3
    rows = {(r["mode"], r["exec"]): r for r in doc["summary"]}
    assert set(rows) == {(m, "graph") for m in ("gpu-only", "offload", "overlap", "predict")}
    p = rows[("predict", "graph")]["predict"]
    assert p["staged"] > 0 and 0.0 <= p["precision"] <= 1.0 and 0.0 <= p["recall"] <= 1.0
    assert "precision" in out
    moved = {m: rows[(m, "graph")]["mb_per_step"] for m in ("offload", "overlap")}
    assert moved["offload"] == moved["overlap"] > 0  # the same streams in every mode


@pytest.mark.gpu
def test_example_on_gpu_device_budgets(tmp_path):
    """The default budget (auto) holds every request resident: the steps run lean, nothing is
    copied; --resident-requests 1 forces a mix (one resident, two sparse: not lean, rows
    copied); --resident-requests 3 --no-lean runs every request resident as a mixed batch
    would. Every mode of every run bit-identical to gpu-only."""
    base = [a for a in SMALL if a not in ("--device-budget", "0")]
    want = {(): (3, True), ("--resident-requests", "1"): (1, False),
            ("--resident-requests", "3", "--no-lean"): (3, False)}
    for extra, (resident, lean) in want.items():
        js = tmp_path / f"r{len(extra)}.json"
        out = _run(*base, "--topk-model", "drift", "--graph", "--json", str(js), *extra)
        assert "self-check passed" in out, extra
        doc = json.loads(js.read_text())
        assert doc["self_check"] == "passed"
        for r in doc["summary"]:
            if r["mode"] == "gpu-only":
                continue
            assert (r["resident"], r["lean"]) == (resident, lean), (extra, r)
            if resident == 3:  # every token selected has its device row: no copy
                assert r["hit_rate"] == 1.0 and r["mb_per_step"] == 0, (extra, r)
            else:
                assert r["hit_rate"] < 1.0 and r["mb_per_step"] > 0, (extra, r)


@pytest.mark.gpu
def test_example_on_gpu_torch_matmuls_and_the_misses_rule(tmp_path):
    """--matmul torch (the layer matmuls are PyTorch ops on the step's stream) with graphs and
    eager steps, and prediction's other rule (misses only): every mode bit-identical to
    gpu-only."""
    pytest.importorskip("torch", reason="--matmul torch needs torch")
    js = tmp_path / "r.json"
    out = _run(*SMALL, "--matmul", "torch", "--predict-rule", "misses", "--eager-and-graph",
               "--json", str(js))
    assert "self-check passed" in out and "rule misses" in out
    doc = json.loads(js.read_text())
    assert doc["self_check"] == "passed" and doc["matmul"].startswith("PyTorch")
    p = {r["exec"]: r["predict"] for r in doc["summary"] if r["mode"] == "predict"}
    assert set(p) == {"eager", "graph"} and all(v["staged"] > 0 for v in p.values())


@pytest.mark.gpu
def test_example_on_gpu_resident_layers(tmp_path):
    """--resident-layers N: layers 0..N-1 attend over their GPU-resident KV in every mode, the
    cache (and its prefetcher's pattern) holds layers N.. only; eager and graphs, every mode
    bit-identical to gpu-only; the offloaded layers move fewer rows the more stay resident."""
    mb = {}
    for resident in ("0", "2", "6"):
        js = tmp_path / f"r{resident}.json"
        out = _run(*SMALL, "--resident-layers", resident, "--eager-and-graph", "--json",
                   str(js))
        assert "self-check passed" in out
        doc = json.loads(js.read_text())
        assert doc["self_check"] == "passed" and doc["resident_layers"] == int(resident)
        assert ("resident layers: none" in out) == (resident == "0")
        rows = {(r["mode"], r["exec"]): r for r in doc["summary"]}
        assert {m for m, _ in rows} == {"gpu-only", "offload", "overlap", "predict"}
        got = {r["mb_per_step"] for (m, _), r in rows.items() if m != "gpu-only"}
        assert len(got) == 1  # the same streams in every offloaded mode
        mb[resident] = got.pop()
    assert mb["0"] > mb["2"] > mb["6"] > 0, mb


@pytest.mark.gpu
def test_example_on_gpu_mtp_on_the_lru_streams(tmp_path):
    """--mtp 3 on the lru streams (a call's drafts: three consecutive draws of each full
    layer's stream), overlap on the shared layers, graphs and eager: bit-identical to gpu-only;
    the drafts' distinct share reported."""
    js = tmp_path / "r.json"
    out = _run(*SMALL, "--mtp", "3", "--eager-and-graph", "--json", str(js))
    assert "self-check passed" in out and "MTP 3: a call's draft steps select" in out
    doc = json.loads(js.read_text())
    assert doc["self_check"] == "passed"
    assert 1 / 3 < doc["topk_shape"]["draft_union"] < 1
    rows = {(r["mode"], r["exec"]): r for r in doc["summary"]}
    assert {m for m, _ in rows} == {"gpu-only", "offload", "overlap"}
    for (mode, _), r in rows.items():
        if mode != "gpu-only":
            assert 0 < r["hit_rate"] < 1 and r["mb_per_step"] > 0, r


@pytest.mark.gpu
def test_example_on_gpu_sweep(tmp_path):
    """demo --sweep at a small shape: a budget that gpu-only fits one request in, a host pool
    of three; every concurrency's rows (gpu-only, resident, sparse, sparse-no-overlap) in the
    JSON the design names, every offloaded run bit-identical to gpu-only of its requests."""
    from hisparse_cupy.demo import _sweep
    from hisparse_cupy.demo._args import from_args

    base = SMALL[:2] + SMALL[4:-2]  # without --batch and --device-budget
    assert "--batch" not in base and "--device-budget" not in base and len(base) == 12
    cfg = from_args(base)
    shape = _sweep.demo_shape(cfg)
    one, three = _sweep.plan(cfg.context, cfg.total_steps, [1, 3], gpu_budget_gb=100,
                             host_gb=100, shape=shape)
    # three sparse requests just fit (at this small shape a hot buffer is half a request)
    budget, host = 1.02 * three.sparse_gb, 3.5 * one.host_gb
    assert one.gpu_only_gb <= budget < 2 * one.gpu_only_gb
    js, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    out = _run(*base, "--sweep", "--gpu-budget", f"{budget:.6f}", "--host-gb", f"{host:.6f}",
               "--json", str(js), "--png", str(png))
    assert "self-check passed" in out, out
    doc = json.loads(js.read_text())
    assert (doc["context"], doc["self_check"], doc["gpu_only_max"]) == (2304, "passed", 1)
    assert doc["model"].startswith("glm52") and "indexer on" in doc["model"]
    rows = {(r["concurrency"], r["mode"]): r for r in doc["rows"]}
    modes = ("gpu-only", "resident", "sparse-no-overlap", "sparse")
    assert set(rows) == {(n, m) for n in (1, 2, 3) for m in modes}
    plan = {p.concurrency: p for p in _sweep.plan(cfg.context, cfg.total_steps, [1, 2, 3],
                                                  gpu_budget_gb=budget, host_gb=host,
                                                  shape=shape)}
    assert plan[1].resident == 1 and plan[3].resident < 3  # the budget forces a mix
    for (n, mode), r in rows.items():
        p = plan[n]
        assert r["tpot_ms"] > 0 and r["p99_ms"] >= r["tpot_ms"] * 0.5
        assert r["tokens_per_s"] == pytest.approx(1e3 * n / r["tpot_ms"], rel=1e-3)
        assert r["resident"] + r["sparse"] == n
        # the bytes on the GPU, measured, are the plan's
        want = {"gpu-only": p.gpu_only_gb, "resident": p.managed_gb}.get(mode, p.sparse_gb)
        assert r["gpu_gb"] == pytest.approx(want, rel=0.02, abs=2e-3), (r, p)
        if mode == "gpu-only":
            assert r["fits"] == (n == 1) and r["resident"] == n and r["host_gb"] == 0
        else:
            assert r["host_gb"] == pytest.approx(p.host_gb, abs=1e-3)
            assert r["resident"] == (max(p.resident, 0) if mode == "resident" else 0), r
            assert r["fits"] and r["gpu_gb"] <= budget + 1e-3, r
    assert png.exists() or "matplotlib is not installed" in out


@pytest.mark.gpu
def test_example_on_gpu_resident_layers_multistep():
    out = _run(*SMALL, "--mtp", "2", "--topk-model", "drift", "--resident-layers", "2",
               "--graph")
    assert "MTP 2 draft steps" in out and "layers 0-1 keep their KV" in out
    assert "self-check passed" in out


@pytest.mark.gpu
def test_example_on_gpu_forks_sharing_a_prefix(tmp_path):
    """Requests 1.. forked from request 0's first 100 tokens (host pages shared, a partial
    page copied): every mode bit-identical to gpu-only, whose KV has the same prefix."""
    out = _run(*SMALL, "--shared-prefix", "100", "--topk-model", "drift", "--eager")
    assert "sharing request 0's first 100 tokens" in out and "self-check passed" in out
    assert "host pages in" in out and "paged (64 tokens a page)" in out


@pytest.mark.gpu
def test_example_on_gpu_multistep(tmp_path):
    out = _run(*SMALL, "--mtp", "3", "--topk-model", "drift", "--graph")
    assert "MTP 3 draft steps" in out and "self-check passed" in out


@pytest.mark.gpu
def test_gpu_self_check_catches_a_missing_backup(monkeypatch, capsys):
    """Negative control: without the newest token's host write (its slot-H record kept), a
    later step misses on a host row that was never written; the self-check must fail."""
    from hisparse_cupy.demo import run_gpu
    from hisparse_cupy.demo._args import from_args
    from hisparse_cupy.step import Step

    keep = Step.backup_newest
    monkeypatch.setattr(Step, "backup_newest", lambda self: keep(self, write_host=False))
    cfg = from_args(SMALL + ["--mode", "offload", "--quiet"])
    assert run_gpu(cfg) == 1
    assert "SELF-CHECK FAILED" in capsys.readouterr().out


def test_the_guides_cpu_snippet_runs_without_cupy_and_prints_what_it_says():
    """docs/guide.md's "Without a GPU" block runs as written in a fresh process where CuPy
    cannot be imported: K misses copied, then none, at the same device rows, the oracle's
    invariants holding."""
    import re
    import subprocess
    import sys

    text = (ROOT / "docs" / "guide.md").read_text()
    block = re.search(r"## Without a GPU\n.*?```python\n(.*?)```", text, re.S).group(1)
    check = "\nassert res.plan_count[0] == 0 and (slot_tokens >= 0).sum() == K\n"
    p = subprocess.run([sys.executable, "-c", "import sys\nsys.modules['cupy'] = None\n"
                        + block + check], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert [line.split(";")[0] for line in out] == ["step 0: 16 rows to copy",
                                                    "step 1: 0 rows to copy"]
    assert out[0].split(";")[1] == out[1].split(";")[1]  # the same device rows


@pytest.mark.gpu
def test_readme_api_snippet_runs():
    """The README's "API in a few lines" block runs as written, and returns device rows."""
    import re

    text = (ROOT / "README.md").read_text()
    block = re.search(r"## API in a few lines\s+```python\n(.*?)```", text, re.S).group(1)
    ns: dict = {}
    exec(compile(block, "README.md", "exec"), ns)
    import cupy

    cupy.cuda.Device().synchronize()
    locs, cache = ns["locs"], ns["cache"]
    assert locs.shape == (1, 3, ns["K"])
    got = cupy.asnumpy(locs)
    assert ((got >= 0) & (got < cache.device.shape[1])).all()
    cache.close()


def test_the_numpy_loop_refuses_a_size_that_cannot_fit_before_allocating(capsys):
    """An oversized CPU run ends with a message naming the flags and the memory, before any
    allocation (not a NumPy traceback); a run that fits says what it sets up first."""
    from hisparse_cupy.demo._args import cpu_config
    from hisparse_cupy.demo._cpu import run

    with pytest.raises(SystemExit, match=r"--context 100000000.* needs [0-9.]+ GB of host "
                                         r"memory; [0-9.]+ GB is available"):
        run(cpu_config(["--context", "100000000"]))
    run(cpu_config(["--steps", "1", "--warmup", "0", "--layers", "2"]))
    out = capsys.readouterr().out
    assert out.index("setting up: 2 prompts") < out.index("set up in") < out.index("step   0")


def test_device_budget_flags_parse():
    """--device-budget: auto (the default), 0 (no budget) or GB > 0; anything else refused,
    naming the flag; --resident-requests sizes a budget itself and refuses a GB beside it."""
    from hisparse_cupy.demo._args import from_args

    assert from_args([]).device_budget == "auto"
    assert from_args(["--device-budget", "0"]).device_budget is None
    assert from_args(["--device-budget", "2.5"]).device_budget == 2.5
    assert from_args(["--resident-requests", "1"]).resident_requests == 1
    assert from_args(["--no-lean"]).lean is False and from_args([]).lean is True
    for bad in ("-1", "lots"):
        with pytest.raises(SystemExit):
            from_args(["--device-budget", bad])
    with pytest.raises(SystemExit, match="--resident-requests sizes the device budget itself"):
        from_args(["--resident-requests", "1", "--device-budget", "4"])
    with pytest.raises(SystemExit, match=r"--resident-requests must be in \[0, --batch\]"):
        from_args(["--batch", "2", "--resident-requests", "3"])



def test_device_budget_rows_by_flag():
    """The budget the offloaded modes build (rows per cached layer): K resident at their
    longest and a block each other; auto: everyone resident while the free memory holds it,
    else what it holds, never less than a block each; GB over the cached layers; none."""
    from hisparse_cupy.demo._args import from_args
    from hisparse_cupy.demo._config import AUTO_RESERVE, DEVICE_PAGE
    from hisparse_cupy.residency import DeviceBudget

    base = ["--batch", "4", "--context", "8192", "--steps", "10", "--warmup", "2"]
    cfg = from_args(base)
    block = DeviceBudget.rows_needed([], 1, page_tokens=DEVICE_PAGE,
                                     block_rows=4096 + cfg.extra_page)  # one block, in pages

    def rows(k):
        return DeviceBudget.rows_needed([cfg.max_len] * k, 4 - k, page_tokens=DEVICE_PAGE,
                                        block_rows=block)

    L, row = 76, 76 * cfg.row_bytes
    assert from_args(base + ["--resident-requests", "1"]).budget_rows(L, 0) == rows(1)
    assert cfg.budget_rows(L, 10**15) == rows(4)  # auto, plenty free: all resident
    assert cfg.budget_rows(L, AUTO_RESERVE + rows(2) * row) == rows(2)
    assert cfg.budget_rows(L, 0) == rows(0)  # nothing free: a block each, all sparse
    assert from_args(base + ["--device-budget", "3"]).budget_rows(L, 0) == int(3e9) // row
    assert from_args(base + ["--device-budget", "0"]).budget_rows(L, 10**15) is None
