"""`python -m hisparse_cupy`: info, check, demo and bench, with and without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hisparse_cupy", *args], capture_output=True,
                          text=True, timeout=timeout)


def _have_gpu() -> bool:
    from conftest import _device_count

    return _device_count()[0] > 0


def test_info_reports_versions_and_the_device_or_why_not():
    p = cli("info")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("hisparse_cupy 0.1.0")
    if _have_gpu():
        assert "PDL" in p.stdout and "zero-copy gather of random rows" in p.stdout
    else:
        assert "no NVIDIA driver found" in p.stdout or "CUDA device" in p.stdout


def test_check_needs_a_gpu_and_says_so():
    if _have_gpu():
        pytest.skip("a GPU is present: test_check_on_gpu runs the check")
    p = cli("check")
    assert p.returncode == 1 and "check needs a CUDA device" in p.stdout


@pytest.mark.gpu
def test_check_on_gpu():
    p = cli("check")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "every kernel agrees with the oracle" in p.stdout
    assert p.stdout.count("  ok    ") == 2


SMALL_DEMO = ("--layers", "4", "--batch", "2", "--context", "2048", "--hot", "1024",
              "--top-k", "256", "--steps", "4", "--warmup", "2")


def test_demo_and_bench_arguments():
    p = cli("demo", *SMALL_DEMO)
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("running the NumPy reference backend" in p.stdout) != _have_gpu()
    assert "self-check passed" in p.stdout
    p = cli("demo", "--context", "100")
    assert p.returncode != 0 and "--context (100) must exceed --hot + --top-k" in p.stderr
    p = cli("bench", "nope")
    assert p.returncode == 2 and "no benchmark named ['nope']" in p.stdout
    p = cli("info", "--bogus")
    assert p.returncode == 2 and "unrecognized arguments: --bogus" in p.stderr
