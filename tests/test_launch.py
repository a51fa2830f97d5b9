"""CPU: the PDL launch's argument block (the driver call itself is stubbed) and the stream kinds
every call accepts."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from hisparse_cupy import _abi
from hisparse_cupy._kernels import launch
from hisparse_cupy._kernels.launch import Params


def test_params_hold_the_struct_bytes():
    p = Params(_abi.PLANNED_COPY).set(B=7, src_base=0xABCDEF0, n_src_rows=-5)
    raw = bytes((ctypes.c_char * _abi.PLANNED_COPY.itemsize).from_address(p.addr))
    off = _abi.PLANNED_COPY.fields
    assert int.from_bytes(raw[off["B"][1]:off["B"][1] + 4], "little") == 7
    assert int.from_bytes(raw[off["src_base"][1]:off["src_base"][1] + 8], "little") == 0xABCDEF0
    assert int.from_bytes(raw[off["n_src_rows"][1]:][:8], "little", signed=True) == -5
    assert p["B"] == 7


def test_a_float_field_holds_its_float_bits():
    """A float field (the demo model's scales) is written as the float's bits, through put,
    put_all and a copy's views alike; the integer fields beside it keep theirs."""
    dt = np.dtype([("ptr", "u8"), ("x", "f4"), ("n", "i4")], align=True)
    assert launch.float_fields(dt) == {"x"} and launch.float_fields(_abi.PLANNED_COPY) == set()
    p = Params(dt).set(ptr=0x1234, x=0.375, n=-3)
    raw = bytes((ctypes.c_char * dt.itemsize).from_address(p.addr))
    assert raw[8:12] == np.float32(0.375).tobytes() and raw[12:16] == np.int32(-3).tobytes()
    assert p["x"] == 0.375 and p["n"] == -3 and p["ptr"] == 0x1234
    st = launch.Structs.zeros(dt, 3)
    st.put_all(x=2.5, n=7)
    cp = st.copy()
    cp.put(1, x=-1.25)
    assert [cp.get(i, "x") for i in range(3)] == [2.5, -1.25, 2.5]
    assert [st.get(i, "x") for i in range(3)] == [2.5] * 3
    assert np.frombuffer(cp.raw, dt)["n"].tolist() == [7, 7, 7]
    with pytest.raises(TypeError, match="field c of .* is not an aligned 4- or 8-byte word"):
        launch.field_words(np.dtype([("c", "S4")]))


def test_launch_config_passes_one_pointer_to_the_struct():
    pytest.importorskip("cuda.bindings", reason="the launch goes through cuda-python")
    cfg = launch._LaunchConfig((256, 1, 1), 1024)
    seen = {}

    def fake_launch(config, func, params, extra):
        arg0 = ctypes.c_void_p.from_address(params).value
        seen["B"] = ctypes.c_int32.from_address(arg0 + _abi.PLANNED_COPY.fields["B"][1]).value
        seen["grid"] = (config.gridDimX, config.gridDimY, config.gridDimZ)
        seen["smem"], seen["stream"] = config.sharedMemBytes, int(config.hStream)
        seen["func"], seen["extra"] = func, extra
        a = config.attrs[0]
        seen["pdl"] = (config.numAttrs, int(a.id), a.value.programmaticStreamSerializationAllowed)
        return (0,)

    cfg.call = fake_launch
    p = Params(_abi.PLANNED_COPY).set(B=3)
    cfg.launch(0xF00, (7, 2, 1), 0x5000, p.addr)
    assert seen == {"B": 3, "grid": (7, 2, 1), "smem": 1024, "stream": 0x5000, "func": 0xF00,
                    "extra": 0, "pdl": (1, 6, 1)}
    p.set(B=9)  # a later launch with the same struct object sees the new values
    cfg.launch(0xF00, (1, 1, 1), 0x6000, p.addr)
    assert seen["B"] == 9 and seen["grid"] == (1, 1, 1) and seen["stream"] == 0x6000


def test_a_failed_launch_names_the_call_and_the_drivers_error(monkeypatch):
    pytest.importorskip("cuda.bindings", reason="the launch goes through cuda-python")
    from types import SimpleNamespace

    cfg = launch._LaunchConfig((32, 1, 1), 0, pdl=False)
    bad = launch._cu().CUresult.CUDA_ERROR_INVALID_VALUE
    cfg.call = lambda *a: (bad,)
    names = {int(bad): b"CUDA_ERROR_INVALID_VALUE"}  # (the driver's answer, without a driver)
    monkeypatch.setattr(launch, "_cu", lambda: SimpleNamespace(
        cuGetErrorName=lambda r: (0, names[int(r)])))
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx failed: 1 \(CUDA_ERROR_INVALID_"
                                           r"VALUE\)"):
        cfg.launch(0xF00, (1, 1, 1), 0, Params(_abi.PLANNED_COPY).addr)
    assert cfg.cfg.numAttrs == 0


_STUB_LAUNCH = r"""
import ctypes, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import launch_overhead_stub as t
stub = t.stub_driver(Path(tempfile.mkdtemp()))
from cuda.bindings import driver as cu
from hisparse_cupy import _abi
from hisparse_cupy._kernels import launch
p = launch.Params(_abi.PLANNED_COPY).set(B=3)
launch._LaunchConfig((256, 1, 1), 1024, True).launch(cu.CUfunction(0xF00), (7, 2, 1), 0x5000,
                                                    p.addr)
last = (ctypes.c_longlong * 12).in_dll(stub, "hs_last")
arg0 = last[10]
print(*last[:10], last[11], arg0 == p.addr)
"""


def test_a_launch_reaches_the_driver_with_its_config_through_cuda_python(tmp_path):
    """The real binding (not a fake call) against a no-op driver that records what
    cuLaunchKernelEx got: the grid, block, shared memory, stream, the PDL attribute, the kernel
    and one pointer to the struct (run in its own process: the stand-in takes the driver's
    name)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("cuda.bindings", reason="the launch goes through cuda-python")
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the stand-in driver")
    tools = Path(__file__).resolve().parents[1] / "tools"
    r = subprocess.run([sys.executable, "-c", _STUB_LAUNCH, str(tools)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = r.stdout.split()
    # grid 7 2 1, block 256, 1024 B, stream 0x5000, 1 attribute: PDL (6) allowed (1), kernel
    # 0xF00, extra NULL, kernelParams[0] the struct's address
    assert got == ["7", "2", "1", "256", "1024", str(0x5000), "1", "6", "1", str(0xF00), "0",
                   "True"], got


@pytest.mark.parametrize("pdl", [False, True])
def test_cluster_dimension_attribute(pdl):
    # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (4): CUlaunchAttributeValue.clusterDim = {x, y, z};
    # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6)
    pytest.importorskip("cuda.bindings", reason="the launch goes through cuda-python")
    cfg = launch._LaunchConfig((1024, 1, 1), 0, pdl=pdl, cluster=4)
    attrs = {int(a.id): a.value for a in cfg.cfg.attrs[:cfg.cfg.numAttrs]}
    assert cfg.cfg.numAttrs == 1 + pdl
    d = attrs[4].clusterDim
    assert (d.x, d.y, d.z) == (4, 1, 1)
    assert (6 in attrs) == pdl and (not pdl or attrs[6].programmaticStreamSerializationAllowed)
    assert launch._LaunchConfig((1024, 1, 1), 0, pdl=False, cluster=1).cfg.numAttrs == 0


def test_resolve_cluster_knob(monkeypatch):
    from hisparse_cupy._kernels import swap
    from hisparse_cupy.testing import knobs

    for bad in (3, 16, 0, -1, "two"):
        with pytest.raises(ValueError, match="resolve cluster must be 1, 2, 4 or 8"):
            knobs.resolve_cluster(bad)
    assert swap.FIXED["cluster"] is None
    monkeypatch.setattr(swap, "compute_capability", lambda: 90)
    monkeypatch.setitem(swap.FIXED, "cluster", None)
    monkeypatch.setattr(swap.build, "kernel", lambda name: name)
    fits = {8: 15, 4: 31}  # clusters the device runs at once, per size
    seen = set()

    def fake_fits(kernel, block, smem, c):
        seen.add((kernel, block, smem))
        return fits[c]

    monkeypatch.setattr(swap, "max_active_clusters", fake_fits)
    key = (np.dtype(np.int32), np.dtype(np.int64))
    got = [swap.resolve_cluster(key, b, 2048, 4096) for b in (1, 8, 15, 16, 31, 32, 64, 128)]
    assert got == [8, 8, 8, 4, 4, 1, 1, 1]
    # the cluster instance (512-thread blocks) and its shared memory were asked about
    assert seen == {("hs::swap_resolve<int, long long, 512>", 512,
                     swap.resolve_smem_bytes(2048, 4096, 512))}
    # the launch: C blocks of 512 threads per row in a cluster, or one block of 1024
    monkeypatch.setattr(swap, "launcher", lambda k, blk, smem, pdl, c: (k, blk, smem, pdl, c))
    monkeypatch.setattr(swap, "_launches", {})
    monkeypatch.setattr(swap.cupy.cuda.runtime, "getDevice", lambda: 0)
    assert swap.resolve_launch(key, 4, 2048, 4096) == (
        ("hs::swap_resolve<int, long long, 512>", 512, swap.resolve_smem_bytes(2048, 4096, 512),
         False, 8), (32, 1, 1))
    assert swap.resolve_launch(key, 64, 2048, 4096) == (
        ("hs::swap_resolve<int, long long, 1024>", 1024, swap.resolve_smem_bytes(2048, 4096),
         False, 1), (64, 1, 1))
    # a state with a token -> slot table: the table instance, one 1024-thread block per row,
    # whatever the batch (a fixed cluster size does not apply to it)
    for batch in (1, 64):
        assert swap.resolve_launch(key, batch, 2048, 4096, table=True) == (
            ("hs::swap_resolve<int, long long, 1024, true>", 1024,
             swap.resolve_smem_bytes(2048, 4096), False, 1), (batch, 1, 1))
    with knobs.resolve_cluster(2):
        assert swap.resolve_launch(key, 1, 2048, 4096, table=True)[1] == (1, 1, 1)
        assert swap.resolve_cluster(key, 1, 2048, 4096) == 2
    assert swap.FIXED["cluster"] is None and swap.resolve_cluster(key, 1, 2048, 4096) == 8
    monkeypatch.setattr(swap, "compute_capability", lambda: 80)  # no clusters before Hopper
    assert swap.resolve_cluster(key, 1, 2048, 4096) == 1


class _FakeStream:
    """Stands in for cupy's from_external wrapper (no GPU here)."""

    def __init__(self, obj):
        self.ptr = obj.__cuda_stream__()[1]


@pytest.fixture
def no_gpu_streams(monkeypatch):
    import cupy

    monkeypatch.setattr(cupy.cuda.Stream, "from_external",
                        staticmethod(lambda obj: _FakeStream(obj)))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    launch._foreign.clear()
    yield
    launch._foreign.clear()


def test_every_stream_kind_maps_to_its_handle(no_gpu_streams):
    class TorchLikeOld:  # torch.cuda.Stream before __cuda_stream__
        cuda_stream = 0x1234

    class Protocol:
        def __cuda_stream__(self):
            return (0, 0x5678)

    assert launch.as_stream(0x42).ptr == 0x42
    assert launch.as_stream(np.int64(0x43)).ptr == 0x43
    assert launch.as_stream(TorchLikeOld()).ptr == 0x1234
    assert launch.as_stream(Protocol()).ptr == 0x5678
    assert launch.as_stream(0x42) is launch.as_stream(0x42)  # wrapped once per handle


def test_bad_stream_kinds_are_named(no_gpu_streams):
    class BadProto:
        def __cuda_stream__(self):
            return "nope"

    with pytest.raises(TypeError, match="stream must be a CuPy stream"):
        launch.as_stream("stream")
    with pytest.raises(TypeError, match="stream must be a CuPy stream"):
        launch.as_stream(True)
    with pytest.raises(TypeError, match=r"__cuda_stream__\(\) must return \(version, handle\)"):
        launch.as_stream(BadProto())


class _Fake:
    """A stream stand-in with a handle (launch_copy reads ``.ptr`` only)."""

    def __init__(self, ptr):
        self.ptr = ptr


@pytest.fixture
def copy_launches(monkeypatch, no_gpu_streams):
    """plan.launch_copy with the kernels and the driver stubbed: every launch is recorded as
    (instance, block, shared memory, pdl, grid, stream, the struct's bytes at the launch)."""
    from hisparse_cupy._kernels import plan

    seen = []

    def fake_launcher(kernel, block, smem, pdl):
        def la(grid, stream_ptr, addr):
            size = (_abi.PLANNED_COPY_PROBE if "probe" in kernel else _abi.PLANNED_COPY).itemsize
            seen.append((kernel, block, smem, pdl, grid, stream_ptr, ctypes.string_at(addr, size)))
        return la

    monkeypatch.setattr(plan.build, "kernel", lambda name: name)
    monkeypatch.setattr(plan, "launcher", fake_launcher)
    monkeypatch.setattr(plan, "_launchers", {})
    return seen


def _copy_struct(B=3, n_layers=1):
    return Params(_abi.PLANNED_COPY).set(B=B, n_layers=n_layers, src_base=0x1000, row_bytes=656,
                                         plan_stride=8)


def test_launch_copy_picks_the_copy_instance_block_and_shared_memory(copy_launches):
    from hisparse_cupy._kernels import build, plan

    p = _copy_struct(B=3)
    plan.launch_copy(p, grid=5, stream=_Fake(0x10), pdl=True, rows_per_warp=4)
    plan.launch_copy(p, to_host=True, grid=2, stream=_Fake(0x11))
    smem = _abi.smem_bytes("PLANNED_COPY", B=3)
    block = _abi.COPY_WARPS * 32
    raw = ctypes.string_at(p.addr, _abi.PLANNED_COPY.itemsize)
    assert copy_launches == [
        (build.COPY_H2D[4], block, smem, True, (5, 1, 1), 0x10, raw),
        (build.COPY_D2H, block, smem, False, (2, 1, 1), 0x11, raw)]
    plan.launch_copy(_copy_struct(B=0), grid=5, stream=_Fake(0x10))  # nothing to copy
    plan.launch_copy(_copy_struct(n_layers=0), grid=5, stream=_Fake(0x10))
    assert len(copy_launches) == 2
    assert plan.copy_launcher(3, rows_per_warp=4, pdl=True) is \
        plan.copy_launcher(3, rows_per_warp=4, pdl=True)  # cached
    with pytest.raises(ValueError, match="rows_per_warp must be one of"):
        plan.copy_launcher(3, rows_per_warp=3)
    with pytest.raises(ValueError, match="one row per warp"):
        plan.copy_launcher(3, to_host=True, rows_per_warp=2)


def test_copy_probe_runs_the_probe_instance_on_its_streams_only(copy_launches):
    from hisparse_cupy._kernels import build, plan
    from hisparse_cupy.testing.probe import active_copy_probes, copy_probe

    p = _copy_struct(B=3)
    raw = ctypes.string_at(p.addr, _abi.PLANNED_COPY.itemsize)

    def probe_struct(launch):
        st = np.frombuffer(launch[6], _abi.PLANNED_COPY_PROBE)[0]
        return st["copy"].tobytes(), int(st["bad"]), int(st["spin_cycles"]), int(st["dry_run"])

    assert plan.copy_queue is plan.queue_copy  # production: nothing consulted per copy
    with copy_probe(dry_run=True, spin_cycles=7, streams=[0x10]) as probe:
        assert active_copy_probes == [probe] and plan.copy_queue is not plan.queue_copy
        plan.launch_copy(p, grid=5, stream=_Fake(0x10), rows_per_warp=2)
        plan.launch_copy(p, grid=5, stream=_Fake(0x20), rows_per_warp=2)  # not its stream
        plan.launch_copy(p, to_host=True, grid=5, stream=_Fake(0x10))  # backups: never
        with copy_probe(spin_cycles=9):  # every stream; the innermost probe wins
            plan.launch_copy(p, grid=5, stream=_Fake(0x10))
            plan.launch_copy(p, grid=5, stream=_Fake(0x20))
        plan.launch_copy(p, grid=5, stream=_Fake(0x10))
    assert active_copy_probes == [] and plan.copy_queue is plan.queue_copy  # put back
    plan.launch_copy(p, grid=5, stream=_Fake(0x10))
    names = [launch[0] for launch in copy_launches]
    assert names == [build.COPY_H2D_PROBE[2], build.COPY_H2D[2], build.COPY_D2H,
                     build.COPY_H2D_PROBE[1], build.COPY_H2D_PROBE[1],
                     build.COPY_H2D_PROBE[1], build.COPY_H2D[1]]
    probed = [probe_struct(la) for la in copy_launches if "probe" in la[0]]
    assert probed == [(raw, 0, 7, 1), (raw, 0, 9, 0), (raw, 0, 9, 0), (raw, 0, 7, 1)]
    smem = _abi.smem_bytes("PLANNED_COPY", B=3)
    assert {(la[1], la[2], la[4]) for la in copy_launches} == {
        (_abi.COPY_WARPS * 32, smem, (5, 1, 1))}


def test_copy_probe_checks_its_arguments(no_gpu_streams):
    from hisparse_cupy.testing.probe import active_copy_probes, copy_probe

    with pytest.raises(ValueError, match="spin_cycles must be >= 0"):
        copy_probe(spin_cycles=-1)
    with pytest.raises(TypeError, match="dry_run must be a bool"):
        copy_probe(dry_run=1)
    with pytest.raises(TypeError, match="streams must be an iterable of streams"):
        copy_probe(streams=0x10)
    with pytest.raises(TypeError, match="bad must"):
        copy_probe(bad=np.zeros(1, np.int64))
    probe = copy_probe(streams=[0x10, 0x11])
    assert probe.covers(0x11) and not probe.covers(0x12)
    assert copy_probe().covers(0x12)
    assert active_copy_probes == []  # made, not entered
