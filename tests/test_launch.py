"""CPU: the PDL launch's argument block (the driver call itself is stubbed) and the stream kinds
every call accepts."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from hisparse_cupy import _abi, _launch
from hisparse_cupy._launch import Params


def test_params_hold_the_struct_bytes():
    p = Params(_abi.PLANNED_COPY).set(B=7, src_base=0xABCDEF0, spin_cycles=-5)
    raw = bytes((ctypes.c_char * _abi.PLANNED_COPY.itemsize).from_address(p.addr))
    off = _abi.PLANNED_COPY.fields
    assert int.from_bytes(raw[off["B"][1]:off["B"][1] + 4], "little") == 7
    assert int.from_bytes(raw[off["src_base"][1]:off["src_base"][1] + 8], "little") == 0xABCDEF0
    assert int.from_bytes(raw[off["spin_cycles"][1]:][:8], "little", signed=True) == -5
    assert p["B"] == 7


def test_launch_config_passes_one_pointer_to_the_struct():
    cfg = _launch._LaunchConfig((256, 1, 1), 1024)
    seen = {}

    def fake_launch(config, func, params, extra):
        c = _launch._CUlaunchConfig.from_address(config)
        arg0 = ctypes.c_void_p.from_address(params).value
        seen["B"] = ctypes.c_int32.from_address(arg0 + _abi.PLANNED_COPY.fields["B"][1]).value
        seen["grid"] = (c.gridDimX, c.gridDimY, c.gridDimZ)
        seen["smem"], seen["stream"], seen["func"] = c.sharedMemBytes, c.hStream, func
        seen["pdl"] = (c.numAttrs, c.attrs[0].id, c.attrs[0].value[0])
        return 0

    cfg.call = fake_launch
    p = Params(_abi.PLANNED_COPY).set(B=3)
    cfg.launch(0xF00, (7, 2, 1), 0x5000, p.addr)
    assert seen == {"B": 3, "grid": (7, 2, 1), "smem": 1024, "stream": 0x5000, "func": 0xF00,
                    "pdl": (1, 6, 1)}
    p["B"] = 9  # a later launch with the same struct object sees the new values
    cfg.launch(0xF00, (1, 1, 1), 0x6000, p.addr)
    assert seen["B"] == 9 and seen["grid"] == (1, 1, 1) and seen["stream"] == 0x6000


def test_launch_structures_match_the_driver_abi():
    # cuda.h: CUlaunchAttribute is 72 bytes (id, pad, 64-byte value union); CUlaunchConfig puts
    # hStream at 32 and numAttrs at 48 (x86-64)
    assert ctypes.sizeof(_launch._CUlaunchAttribute) == 72
    assert _launch._CUlaunchConfig.hStream.offset == 32
    assert _launch._CUlaunchConfig.attrs.offset == 40
    assert _launch._CUlaunchConfig.numAttrs.offset == 48
    plain = _launch._LaunchConfig((32, 1, 1), 0, pdl=False)
    assert plain.cfg.numAttrs == 0


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
    _launch._foreign.clear()
    yield
    _launch._foreign.clear()


def test_every_stream_kind_maps_to_its_handle(no_gpu_streams):
    class TorchLikeOld:  # torch.cuda.Stream before __cuda_stream__
        cuda_stream = 0x1234

    class Protocol:
        def __cuda_stream__(self):
            return (0, 0x5678)

    assert _launch.as_stream(0x42).ptr == 0x42
    assert _launch.as_stream(np.int64(0x43)).ptr == 0x43
    assert _launch.as_stream(TorchLikeOld()).ptr == 0x1234
    assert _launch.as_stream(Protocol()).ptr == 0x5678
    assert _launch.as_stream(0x42) is _launch.as_stream(0x42)  # wrapped once per handle


def test_bad_stream_kinds_are_named(no_gpu_streams):
    class BadProto:
        def __cuda_stream__(self):
            return "nope"

    with pytest.raises(TypeError, match="stream must be a CuPy stream"):
        _launch.as_stream("stream")
    with pytest.raises(TypeError, match="stream must be a CuPy stream"):
        _launch.as_stream(True)
    with pytest.raises(TypeError, match=r"__cuda_stream__\(\) must return \(version, handle\)"):
        _launch.as_stream(BadProto())
