"""CPU: the demo model's kernels (``demo/model.cu``) on the package's kernel ABI: one struct per
kernel mirrored in ``_abi.DEMO_STRUCTS`` and checked at every compile, an instance per row
format picked by name expression, every kernel launched through the package's launcher."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hisparse_cupy import _abi
from hisparse_cupy._kernels import build
from hisparse_cupy._kernels.launch import field_words

MODEL_CU = build.source_path(build.DEMO_MODEL)


def test_the_demo_model_is_a_source_of_the_build():
    assert MODEL_CU == build.PKG_DIR / "demo" / "model.cu" and MODEL_CU.is_file()
    names = build.INSTANCES[build.DEMO_MODEL]
    assert len(names) == len(set(names)) == len(build.DEMO) + 2 * len(build.DEMO_ROWS)
    assert not set(build.DEMO) & set(build.DEMO_ROWS)
    for per in build.DEMO_ROWS.values():  # one instance per row format
        assert sorted(per) == [False, True]
        assert per[True].endswith("<true>") and per[False].endswith("<false>")
    # an edit of model.cu is a new compile_check key (its text is part of the sources read)
    assert MODEL_CU in build._source_files()


def test_every_struct_is_checked_where_it_is_declared():
    """Each struct of the ABI tables is checked (HS_ABI_CHECK) in the source that declares it:
    the package's in cu/abi.cuh, the demo's in model.cu; no struct is left unchecked."""
    for path, table in ((build.CU_DIR / "abi.cuh", _abi.STRUCTS), (MODEL_CU, _abi.DEMO_STRUCTS)):
        src = path.read_text()
        assert sorted(re.findall(r"^HS_ABI_CHECK\((\w+)\);", src, re.MULTILINE)) == \
            sorted(table), path.name
        assert sorted(re.findall(r"^struct (\w+Params) \{", src, re.MULTILINE)) == \
            sorted(table), path.name
    assert not set(_abi.STRUCTS) & set(_abi.DEMO_STRUCTS)


def test_every_demo_kernel_takes_its_struct_and_nothing_else():
    """model.cu's kernels are template or plain __global__ functions in namespace demo (none is
    extern "C"), each taking its struct by value, the struct the Python side fills for it; the
    row format is a template parameter of the kernels that read or write rows."""
    from hisparse_cupy.demo._model import KERNELS

    src = MODEL_CU.read_text()
    assert 'extern "C"' not in src and "int fp8" not in src
    assert set(KERNELS) == set(build.DEMO) | set(build.DEMO_ROWS)
    assert {struct for struct, _, _ in KERNELS.values()} == set(_abi.DEMO_STRUCTS)
    for name, (struct, block, smem) in KERNELS.items():
        decl = (rf"\n(template <[^>\n]*>\n)?__global__ void(?:\s+__launch_bounds__\([^)]*\))?"
                rf"\s+{name}\(([^)]*)\) \{{")
        assert re.findall(decl, src) == [
            ("template <bool FP8>\n" if name in build.DEMO_ROWS else "", f"const {struct} p")], name
        assert block > 0 and smem >= 0


def test_demo_structs_are_words_without_tail_padding():
    for name, dt in _abi.DEMO_STRUCTS.items():
        words = field_words(dt)  # every field an aligned 4- or 8-byte word
        assert set(words) == set(dt.names), name
        last = dt.names[-1]
        assert dt.fields[last][1] + dt[last].itemsize == dt.itemsize, name
        assert all(dt[f].kind in "iu" or f in ("temp", "scale") for f in dt.names), name
    opts = build.options()
    assert "-DHS_ABI_KvPrefillParams_SIZE=48" in opts
    assert any(o.startswith("-DHS_ABI_AttnPartialParams_FIELDS(X)=X(AttnPartialParams,qraw,8,0)")
               for o in opts)


def _reordered(dt: np.dtype, a: str, b: str) -> np.dtype:
    names = list(dt.names)
    i, j = names.index(a), names.index(b)
    names[i], names[j] = names[j], names[i]
    return np.dtype([(n, dt[n]) for n in names], align=True)


def _drifted(monkeypatch, struct: str, dt: np.dtype) -> None:
    monkeypatch.setattr(_abi, "DEMO_STRUCTS", {**_abi.DEMO_STRUCTS, struct: dt})


def test_a_demo_field_order_drift_fails_the_check(monkeypatch):
    # two pointers swapped on the Python side: same sizes, same total, every offset of the pair
    # wrong (the attention would read its rows from the query)
    _drifted(monkeypatch, "AttnPartialParams",
             _reordered(_abi.DEMO_STRUCTS["AttnPartialParams"], "qraw", "rows"))
    with pytest.raises(build.CompileError,
                       match=r"demo/model\.cu[\s\S]*HS_ABI_CHECK\(AttnPartialParams\)"):
        build.compile_check(archs=("sm_90",), files=(build.DEMO_MODEL,))


def test_a_demo_field_type_drift_fails_the_check(monkeypatch):
    dt = _abi.DEMO_STRUCTS["KvPrefillParams"]
    fields = [(n, "i4" if n == "req_rows" else dt[n]) for n in dt.names]
    fields.append(("pad", "i4"))  # (no tail padding)
    _drifted(monkeypatch, "KvPrefillParams", np.dtype(fields, align=True))
    with pytest.raises(build.CompileError, match="KvPrefillParams.req_rows: size differs"):
        build.compile_check(archs=("sm_90",), files=(build.DEMO_MODEL,))


def test_a_float_field_read_as_an_int_fails_the_check(monkeypatch):
    """The attention's temperature is a float32 word: the same 4 bytes written as an int32 would
    read as a denormal float, in every mode alike (no self-check would see it): the compile
    check refuses the drift."""
    dt = _abi.DEMO_STRUCTS["AttnPartialParams"]
    _drifted(monkeypatch, "AttnPartialParams",
             np.dtype([(n, "i4" if n == "temp" else dt[n]) for n in dt.names], align=True))
    with pytest.raises(build.CompileError, match="AttnPartialParams.temp: float on one side"):
        build.compile_check(archs=("sm_90",), files=(build.DEMO_MODEL,))


@pytest.mark.parametrize("kw, err, match", [
    (dict(p0=-1), ValueError, r"p0 must be a position in \[0, context=64\], got -1"),
    (dict(p0=65), ValueError, "p0 must be a position"),
    (dict(req_rows=-2), ValueError, "req_rows must be an int >= 0, got -2"),
    (dict(layers=range(0, 5)), ValueError, "layers must be a range of step 1 within the "
                                           "model's 4 layers, got range"),
    (dict(layers=range(0, 4, 2)), ValueError, "layers must be a range of step 1"),
    (dict(layers=[0, 1]), ValueError, "layers must be a range"),
    (dict(reqs=np.zeros(2, np.int32)), TypeError, "reqs must be a contiguous 1-D int32 CuPy "
                                                  "array of request slots, got ndarray"),
])
def test_prompt_kv_names_a_bad_argument(kw, err, match):
    """demo.prompt_kv (the examples' way to make prompt KV) refuses what does not fit before
    anything is launched, naming the argument."""
    from hisparse_cupy.demo import Config, prompt_kv

    cfg = Config(layers=4, context=64)
    args = dict(reqs=None, p0=0, req_rows=0, layers=None) | kw
    with pytest.raises(err, match=match):
        prompt_kv(None, cfg, 0, 0, args.pop("reqs"), None, **args)
