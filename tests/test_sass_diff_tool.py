"""tools/sass_diff.py: its reading of nvdisasm's output (CPU, synthetic), its refusals, and,
where an nvdisasm is at hand, a real comparison: the working tree against itself is the same
kernel for kernel, and a changed instruction is found."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import sass_diff as sd  # noqa: E402

_SASS = """\
        .section        .text._Z1fv,"ax",@progbits
        .sectioninfo    @"SHI_REGISTERS=8"
.text._Z1fv:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_12:
        /*0010*/                   BRA `(.L_x_12) ;
        .section        .text._Z1gv,"ax",@progbits
.text._Z1gv:
        /*0000*/                   EXIT ;
"""


def test_kernels_are_split_and_normalised():
    k = sd.kernels(_SASS)
    assert set(k) == {"_Z1fv", "_Z1gv"}
    assert "MOV R1, c[0x0][0x28] ;" in k["_Z1fv"] and "BRA `(.L) ;" in k["_Z1fv"]
    assert ".L:" in k["_Z1fv"] and not any("/*" in x for x in k["_Z1fv"])
    renumbered = _SASS.replace(".L_x_12", ".L_x_97").replace("/*0010*/", "/*0020*/")
    assert sd.kernels(renumbered) == k  # addresses and label numbers do not count
    assert sd.kernels(_SASS.replace("MOV R1", "MOV R2")) != k


def test_refusals_name_what_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(sd, "find_nvdisasm", lambda given: None)
    assert sd.main([]) == 2 and "no nvdisasm" in capsys.readouterr().err
    monkeypatch.setattr(sd, "find_nvdisasm", lambda given: "/bin/true")

    def no_git(*a, **k):  # the arguments are refused before the tree is compared with git
        raise AssertionError("git was asked before the arguments were checked")

    monkeypatch.setattr(sd.subprocess, "run", no_git)
    assert sd.main(["nope.cu"]) == 2 and "not kernel sources" in capsys.readouterr().err


@pytest.mark.slow  # (two NVRTC compiles and two disassemblies: 2 s)
def test_a_real_comparison_where_nvdisasm_is_at_hand(tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC compiles the sources")
    nvd = sd.find_nvdisasm(None)
    if nvd is None:
        pytest.skip("no nvdisasm here (pip install nvidia-cuda-nvdisasm)")
    from hisparse_cupy._kernels import build

    opts = build.check_options("sm_90")
    src = build.CU_DIR / "sums.cu"
    names = build.INSTANCES["sums.cu"]
    a = sd.disassemble(nvd, build.nvrtc_cubin(src, names, opts, "sums"), tmp_path)
    b = sd.disassemble(nvd, build.nvrtc_cubin(src, names, opts, "sums"), tmp_path)
    assert a == b and a and all(len(v) > 10 for v in a.values())
    changed = tmp_path / "sums.cu"
    text = src.read_text()
    assert "+=" in text
    changed.write_text(text.replace("+=", "^=", 1))
    c = sd.disassemble(nvd, build.nvrtc_cubin(changed, names, opts, "sums changed"), tmp_path)
    assert c != a
