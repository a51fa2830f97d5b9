"""CPU: every registered kernel instance compiles through NVRTC for sm_80 and sm_90, no GPU."""

from __future__ import annotations

import pytest

from hisparse_cupy import _build


def test_compile_check_covers_every_instance():
    sizes = _build.compile_check()
    files = set(_build.instances())
    assert {"swap.cu", "planned_copy.cu", "cache.cu"} <= files
    for f in files:
        for arch in ("sm_80", "sm_90"):
            assert sizes[(f, arch)] > 1000, (f, arch)


def test_a_broken_kernel_fails_the_check(monkeypatch, tmp_path):
    from cuda.core import Program  # noqa: F401  (the check's compiler)

    bad = tmp_path / "cu"
    bad.mkdir()
    for p in _build.CU_DIR.glob("*.cu*"):
        (bad / p.name).write_text(p.read_text())
    src = (bad / "planned_copy.cu").read_text().replace("pdl_wait();", "pdl_wait(); oops = 1;")
    (bad / "planned_copy.cu").write_text(src)
    monkeypatch.setattr(_build, "CU_DIR", bad)
    _build.source_digest.cache_clear()
    try:
        with pytest.raises(Exception, match="oops"):
            _build.compile_check(archs=("sm_90",))
    finally:
        _build.source_digest.cache_clear()


def test_digest_covers_headers(monkeypatch, tmp_path):
    d = tmp_path / "cu"
    d.mkdir()
    for p in _build.CU_DIR.glob("*.cu*"):
        (d / p.name).write_text(p.read_text())
    monkeypatch.setattr(_build, "CU_DIR", d)
    _build.source_digest.cache_clear()
    before = _build.source_digest()
    (d / "common.cuh").write_text((d / "common.cuh").read_text() + "\n// edited\n")
    _build.source_digest.cache_clear()
    after = _build.source_digest()
    _build.source_digest.cache_clear()
    assert before != after
    assert any(after[:16] in o for o in _build._options())


def test_unregistered_instance_and_missing_file_are_errors():
    with pytest.raises(KeyError, match="not a registered instance"):
        _build.kernel("swap.cu", "hs::swap_resolve<7, int, int>")
    with pytest.raises(FileNotFoundError):
        _build.register("nope.cu", "k")
