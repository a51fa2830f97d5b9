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


@pytest.mark.gpu
def test_readme_api_snippet_runs():
    """The README's "API in a few lines" block runs as written, and returns device rows."""
    import re

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
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
