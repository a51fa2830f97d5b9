"""CPU: the package imports without a GPU, and without CuPy says which extra to install."""

from __future__ import annotations

import subprocess
import sys


def test_import_without_gpu_exposes_the_api():
    import hisparse_cupy as h

    for name in ("HostKVPool", "HotBufferCache", "MissPlan", "swap_in", "compile_check",
                 "reference"):
        assert hasattr(h, name), name


def test_import_without_cupy_names_the_extras():
    code = "import sys; sys.modules['cupy'] = None; import hisparse_cupy; hisparse_cupy.swap_in"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode != 0
    assert "hisparse_cupy[cuda12]" in p.stderr and "hisparse_cupy[cuda13]" in p.stderr


def test_oracle_and_abi_need_numpy_only():
    code = ("import sys; sys.modules['cupy'] = None; import hisparse_cupy.reference as r; "
            "from hisparse_cupy import _abi; print(r.N_STATUS, _abi.ST_NOHOST, "
            "r.ST_NOHOST is _abi.ST_NOHOST)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["3", "1", "True"]


def test_dir_lists_the_public_names_only():
    import hisparse_cupy as h

    assert dir(h) == sorted([*h.__all__, "__version__"])
    assert "annotations" not in dir(h) and "importlib" not in dir(h)
    h.swap_in  # noqa: B018 (a lazy name loaded stays out of dir's extras)
    assert dir(h) == sorted([*h.__all__, "__version__"])
