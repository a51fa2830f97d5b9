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


def test_demo_and_bench_arguments():
    p = cli("demo", "--steps", "4", "--requests", "2")
    assert p.returncode == 0, p.stderr
    assert ("NumPy oracle" in p.stdout) != _have_gpu()
    p = cli("bench", "nope")
    assert p.returncode == 2 and "no benchmark named ['nope']" in p.stdout
    p = cli("info", "--bogus")
    assert p.returncode == 2 and "unrecognized arguments: --bogus" in p.stderr
