"""Tensor-parallel ranks over one shared host pool (two GPUs; skipped, with the reason, on one):
examples/tp_decode.py (NCCL all-reduce, each rank's attention bit for bit against its gpu-only
run, prompt rows written by rank 0 and swapped by rank 1) and benchmarks/bench_shared_pool.py
(every GPU's gathers from the one pool return the right bytes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--layers", "8", "--batch", "4", "--context", "2304", "--hot", "1024", "--top-k", "256",
         "--steps", "6", "--warmup", "3"]


def _two_gpus() -> None:
    from conftest import _device_count

    n, why = _device_count()
    if n < 2:
        pytest.skip(f"needs two GPUs of one host (nvidia-h200-x2), found {n} {why}".strip())


def test_tp_decode_help_without_a_gpu():
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "tp_decode.py"), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "ONE host pool" in p.stdout and "--new-share" in p.stdout


@pytest.mark.gpu
def test_tp_decode_two_ranks_one_pool(tmp_path):
    _two_gpus()
    pytest.importorskip("torch", reason="the example's all-reduce runs through torch.distributed")
    js = tmp_path / "tp.json"
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "tp_decode.py"), "--nproc", "2",
                        *SMALL, "--json", str(js)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "=== rank 0" in p.stdout and "=== rank 1" in p.stdout
    assert p.stdout.count("self-check passed") == 2
    assert "a pool per rank would pin" in p.stdout
    for rank in (0, 1):
        doc = json.loads((tmp_path / f"tp.rank{rank}.json").read_text())
        assert doc["self_check"] == "passed" and doc["rank"] == rank
        rows = {(r["mode"], r["exec"]): r for r in doc["summary"]}
        assert rows[("offload", "eager")]["mb_per_step"] > 0


@pytest.mark.gpu
def test_shared_pool_bench_two_gpus(tmp_path):
    _two_gpus()
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_shared_pool.py"),
                        "--gpus", "2", "--pool-gb", "1", "--rows", "16384", "--iters", "5",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((tmp_path / "bench_shared_pool_2gpu.json").read_text())
    assert [r["gpu"] for r in doc["per_gpu"]] == [0, 1]
    assert all(r["bytes_ok"] for r in doc["per_gpu"])
    assert doc["host_gb_pinned_without_sharing"] == 2 * doc["host_gb_pinned"]
