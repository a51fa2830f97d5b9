"""CPU: every kernel instance compiles through NVRTC for sm_80 and sm_90 (no GPU), with the ABI
macros of _abi.py; a drift between a C++ parameter struct and its Python mirror fails."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_cupy import _abi
from hisparse_cupy._kernels import build


@pytest.mark.slow
def test_compile_check_covers_every_instance():
    sizes = build.compile_check()
    assert set(build.INSTANCES) == {"swap.cu", "plan.cu", "plan_probe.cu", "newest.cu",
                                     "multistep.cu", "predict.cu", "sums.cu", "demo/model.cu"}
    # the measuring instances are compiled in a module of their own, never the production one
    probe = set(build.COPY_H2D_PROBE.values())
    assert probe == set(build.INSTANCES["plan_probe.cu"])
    assert not probe & {n for f, names in build.INSTANCES.items() if f != "plan_probe.cu"
                        for n in names}
    for f in build.INSTANCES:
        for arch in ("sm_80", "sm_90"):
            assert sizes[(f, arch)] > 1000, (f, arch)


def _copy_sources(tmp_path, monkeypatch):
    d = tmp_path / "cu"
    d.mkdir()
    for p in build.CU_DIR.glob("*.cu*"):
        (d / p.name).write_text(p.read_text())
    monkeypatch.setattr(build, "CU_DIR", d)
    build.source_digest.cache_clear()
    return d


@pytest.fixture
def sources(tmp_path, monkeypatch):
    d = _copy_sources(tmp_path, monkeypatch)
    yield d
    build.source_digest.cache_clear()


def test_a_broken_kernel_fails_the_check(sources):
    src = (sources / "plan.cu").read_text().replace("pdl_wait();", "pdl_wait(); oops = 1;")
    (sources / "plan.cu").write_text(src)
    with pytest.raises(build.CompileError, match="oops"):
        build.compile_check(archs=("sm_90",), files=("plan.cu",))
    with pytest.raises(ValueError, match=r"files names \['nope.cu'\]"):
        build.compile_check(files=("nope.cu",))


def _reordered(dt: np.dtype, a: str, b: str) -> np.dtype:
    names = list(dt.names)
    i, j = names.index(a), names.index(b)
    names[i], names[j] = names[j], names[i]
    return np.dtype([(n, dt[n]) for n in names], align=True)


def test_abi_field_order_drift_fails_the_check(sources, monkeypatch):
    # Python lists two pointer fields of the resolve struct in the other order: same sizes,
    # same total, every offset of the pair wrong.
    bad = dict(_abi.STRUCTS)
    bad["SwapResolveParams"] = _reordered(_abi.SWAP_RESOLVE, "req", "lens")
    monkeypatch.setattr(_abi, "STRUCTS", bad)
    with pytest.raises(build.CompileError, match="swap.cu"):
        build.compile_check(archs=("sm_90",))


def test_abi_field_type_drift_fails_the_check(sources, monkeypatch):
    fields = [(n, "i4" if n == "n_src_rows" else _abi.PLANNED_COPY[n]) for n in
              _abi.PLANNED_COPY.names]
    fields = [(n, t) for n, t in fields if n != "pad"]  # keep the struct free of tail padding
    bad = dict(_abi.STRUCTS)
    bad["PlannedCopyParams"] = np.dtype(fields, align=True)
    monkeypatch.setattr(_abi, "STRUCTS", bad)
    with pytest.raises(build.CompileError, match="PlannedCopyParams.n_src_rows: size differs"):
        build.compile_check(archs=("sm_90",))


def test_a_field_only_cpp_has_fails_the_check(sources):
    src = (sources / "abi.cuh").read_text().replace(
        "  i32 record;              // 1: record", "  i32 extra_a, extra_b;\n  i32 record;  // 1:")
    (sources / "abi.cuh").write_text(src)
    with pytest.raises(build.CompileError, match="NewestRowsParams"):
        build.compile_check(archs=("sm_90",))


def test_python_structs_have_no_tail_padding():
    for name, dt in _abi.STRUCTS.items():
        last = dt.names[-1]
        assert dt.fields[last][1] + dt[last].itemsize == dt.itemsize, name


def test_smem_tables_size_the_launch():
    # the resolve at K 2048, H 4096 (the standard shape) and its regions' 16-byte alignment
    sizes = _abi.resolve_sizes(2048, 4096)
    n = _abi.smem_bytes("SWAP_RESOLVE", **sizes)
    by_hand = sum(-(-b // 16) * 16 for b in (
        8 * 2048, 4 * 8192, 4 * 8192, 4 * 2048, 4 * 2048, 4 * 2048, 4 * 4097, 4 * 33, 4 * 33,
        4 * 33, 16, 4 * 27, 2 * 4096, 2 * 4096, 2 * 4096, 2048))
    assert n == by_hand
    # a cluster's 512-thread blocks: 17 per-warp counts instead of 33
    assert _abi.smem_bytes("SWAP_RESOLVE", **_abi.resolve_sizes(2048, 4096, 512)) == \
        by_hand - 3 * (-(-4 * 33 // 16) * 16 - -(-4 * 17 // 16) * 16)
    assert _abi.smem_bytes("PLANNED_COPY", B=7) == 32 + 48 + 16  # prefix, scan, stats


def test_digest_covers_headers(sources):
    before = build.source_digest()
    (sources / "common.cuh").write_text((sources / "common.cuh").read_text() + "\n// edited\n")
    build.source_digest.cache_clear()
    after = build.source_digest()
    assert before != after
    assert any(after[:16] in o for o in build.options())


def test_options_carry_the_abi_and_no_include_outside_cu():
    opts = build.options()
    assert "-DHS_ST_NOHOST=1" in opts
    assert any(o.startswith("-DHS_ABI_SwapResolveParams_FIELDS(X)=X(SwapResolveParams,topk,8,0)")
               for o in opts)
    for p in build.CU_DIR.glob("*.cu*"):
        for line in p.read_text().splitlines():
            if line.startswith("#include"):
                assert '"' in line, f"{p.name}: {line} (compile_check passes no include path)"


def test_unknown_instance_is_an_error():
    with pytest.raises(KeyError, match="not an instance"):
        build.kernel("hs::swap_resolve<short, int>")


def test_constants_reach_the_kernels_only_through_the_abi():
    """Every HS_<NAME> constant a kernel source reads is one of _abi.CONSTANTS (passed by
    defines()), and no kernel source defines a sentinel or counter index of its own: the only
    literal namespace-scope constants are these tuning / bit-layout ones."""
    import re

    tuning = {"FULL_MASK", "OWNED_ROWS", "PREFETCH", "POS_OWNER_SHIFT"}
    not_constants = ("HS_ABI_", "HS_SMEM_", "HS_PHASE", "HS_DEBUG", "HS_SRC_DIGEST",
                     "HS_COPY_VPL")
    for p in build.CU_DIR.glob("*.cu*"):
        text = p.read_text()
        for name in set(re.findall(r"\bHS_([A-Z][A-Z0-9_]*)\b", text)):
            if not f"HS_{name}".startswith(not_constants):
                assert name in _abi.CONSTANTS, f"{p.name}: HS_{name} is not in _abi.CONSTANTS"
        literal = re.findall(r"^constexpr [\w ]+? (\w+) = -?(?:0x)?[0-9a-fA-F]+[uUlL]*;", text,
                             re.MULTILINE)
        assert set(literal) <= tuning, f"{p.name}: {set(literal) - tuning} defined in C++ only"
    assert "-DHS_MS_EMPTY=0xffffffffffffffff" in build.options()  # a u64 literal, not decimal
    assert "-DHS_MS_C_COPY=5" in build.options()


def test_the_production_copy_has_no_measuring_fields():
    """The dry run, the slowed copy and the bad-row counter are the probe instance's alone."""
    probe_fields = {"bad", "spin_cycles", "dry_run", "flags"}
    assert not probe_fields & set(_abi.PLANNED_COPY.names)
    assert _abi.PLANNED_COPY_PROBE.names[0] == "copy"
    assert _abi.PLANNED_COPY_PROBE["copy"] == _abi.PLANNED_COPY
    assert {"bad", "spin_cycles", "dry_run"} <= set(_abi.PLANNED_COPY_PROBE.names)
    names = build.INSTANCES["plan.cu"]
    assert sorted(build.COPY_H2D) == sorted(build.COPY_H2D_PROBE) == list(
        build.COPY_ROWS_PER_WARP)
    assert set(build.COPY_H2D_PROBE.values()) == set(build.INSTANCES["plan_probe.cu"])
    assert not set(build.COPY_H2D_PROBE.values()) & set(names)
    assert "planned_copy_probe" not in (build.CU_DIR / "plan.cu").read_text()
    assert not any("thin" in n for n in names)
    src = (build.CU_DIR / "plan.cu").read_text()
    assert "__global__ void __launch_bounds__(COPY_WARPS * 32) planned_copy(const " \
        "PlannedCopyParams p)" in src
    assert "planned_copy_body<SrcT, DstT, R, false>" in src
    assert "HS_COPY_ROTATE" not in (build.CU_DIR / "common.cuh").read_text()


def test_a_probe_struct_drift_fails_the_check(sources, monkeypatch):
    # the probe's settings reordered on the Python side: same sizes, same total
    bad = dict(_abi.STRUCTS)
    bad["PlannedCopyProbeParams"] = _reordered(_abi.PLANNED_COPY_PROBE, "dry_run", "pad")
    monkeypatch.setattr(_abi, "STRUCTS", bad)
    with pytest.raises(build.CompileError, match="PlannedCopyProbeParams"):
        build.compile_check(archs=("sm_90",))


@pytest.mark.slow
def test_the_demo_model_compiles():
    """The decode loop's model kernels (``demo/model.cu``) are a source of the package's build:
    every instance (both row formats of the kernels that read or write rows) compiles through
    NVRTC with the runtime's options, ABI checks included, for sm_80 and sm_90 (compile_check)
    and sm_75 (the indexer's plain path, before the int8 tensor-core mma); no GPU needed."""
    sizes = build.compile_check(files=(build.DEMO_MODEL,))
    assert sorted(sizes) == [(build.DEMO_MODEL, "sm_80"), (build.DEMO_MODEL, "sm_90")]
    assert min(sizes.values()) > 1000
    assert build._nvrtc_compile(build.DEMO_MODEL, build.INSTANCES[build.DEMO_MODEL],
                                "sm_75") > 1000


def test_what_compiled_is_kept_across_processes_and_a_failure_never(tmp_path, monkeypatch):
    """compile_check's cache (``compile_cache_dir``): a compile that succeeded is read back by
    a later process (the per-process memo cleared stands for one) instead of compiled again,
    keyed by the sources, options, instances, arch and NVRTC's version; a failed compile is
    not recorded; ``HISPARSE_CUPY_COMPILE_CACHE=0`` keeps nothing."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC's version is part of the key")
    calls = []

    def fake(file, names, arch):
        calls.append((file, arch))
        if file == "sums.cu" and arch == "sm_80":
            raise build.CompileError("sums.cu (sm_80) does not compile: stand-in")
        return 1000 + len(calls)

    monkeypatch.setattr(build, "_nvrtc_compile", fake)
    monkeypatch.setattr(build, "_COMPILED", {})
    monkeypatch.setenv("HISPARSE_CUPY_COMPILE_CACHE", str(tmp_path / "c"))
    assert build.compile_cache_dir() == tmp_path / "c"
    first = build.compile_check(archs=("sm_90",), files=("plan.cu", "sums.cu"))
    assert sorted(calls) == [("plan.cu", "sm_90"), ("sums.cu", "sm_90")]
    monkeypatch.setattr(build, "_COMPILED", {})  # another process
    assert build.compile_check(archs=("sm_90",), files=("plan.cu", "sums.cu")) == first
    assert len(calls) == 2  # read back, not compiled
    assert len(list((tmp_path / "c").glob("*.size"))) == 2
    for _ in range(2):  # a failure: raised each time, never recorded
        with pytest.raises(build.CompileError, match="stand-in"):
            build.compile_check(archs=("sm_80",), files=("sums.cu",))
    assert calls[2:] == [("sums.cu", "sm_80")] * 2
    monkeypatch.setattr(build, "_COMPILED", {})
    build.compile_check(archs=("sm_90",), files=("plan.cu",))
    assert len(calls) == 4  # the same key: still read back
    monkeypatch.setenv("HISPARSE_CUPY_COMPILE_CACHE", "0")
    monkeypatch.setattr(build, "_COMPILED", {})
    assert build.compile_cache_dir() is None
    build.compile_check(archs=("sm_90",), files=("plan.cu",))
    assert calls[-1] == ("plan.cu", "sm_90") and len(calls) == 5
