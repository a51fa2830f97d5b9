"""The README's main example runs (NumPy oracle without a GPU, the kernels with one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "decode_loop.py"


def _run(*args: str) -> str:
    p = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_example_runs_on_cpu_oracle():
    import cupy

    if cupy.cuda.is_available():
        pytest.skip("a GPU is present: the example runs the kernels (test_example_runs_on_gpu)")
    out = _run("--steps", "8", "--requests", "2")
    assert "NumPy oracle" in out and "invariants hold" in out


@pytest.mark.gpu
def test_example_runs_on_gpu():
    out = _run("--steps", "12", "--requests", "3")
    assert "every selected row held its token's KV" in out
