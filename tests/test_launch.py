"""CPU: argument words of the PDL launch path (the driver call itself is stubbed)."""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from hisparse_cupy import _launch
from hisparse_cupy._launch import Ptr


def test_words_of_each_argument_kind():
    assert _launch._ex_word(None) == 0
    assert _launch._ex_word(Ptr(0x7F0012345670)) == 0x7F0012345670
    assert _launch._ex_word(np.int64(-2)) == (1 << 64) - 2
    w = _launch._ex_word(np.int32(-1))
    assert ctypes.c_int32(w & 0xFFFFFFFF).value == -1
    with pytest.raises(TypeError, match="pass a cupy.ndarray, None, Ptr"):
        _launch._ex_word(5)  # a Python int would be ambiguous in width
    with pytest.raises(TypeError, match="pass a cupy.ndarray, None, Ptr"):
        _launch._ex_word(np.float64(1.0))


def test_pdl_config_passes_a_void_pointer_array_the_driver_can_read(monkeypatch):
    cfg = _launch._PdlConfig((256, 1, 1), 1024)
    seen = {}

    def fake_launch(config, func, params, extra):
        ptrs = (ctypes.c_void_p * 4).from_address(params)
        seen["i32"] = ctypes.c_int32.from_address(ptrs[0]).value
        seen["ptr"] = ctypes.c_uint64.from_address(ptrs[1]).value
        seen["i64"] = ctypes.c_int64.from_address(ptrs[2]).value
        seen["null"] = ctypes.c_uint64.from_address(ptrs[3]).value
        seen["grid"] = (config.gridDimX, config.gridDimY, config.gridDimZ)
        seen["smem"] = config.sharedMemBytes
        return (cfg.cu.CUresult.CUDA_SUCCESS,)

    cfg.cu = types.SimpleNamespace(cuLaunchKernelEx=fake_launch, CUresult=cfg.cu.CUresult,
                                   CUstream=cfg.cu.CUstream, CUfunction=cfg.cu.CUfunction,
                                   cuGetErrorName=cfg.cu.cuGetErrorName)
    cfg.launch(0x1000, (7, 2, 1), 0, (np.int32(-3), Ptr(0xABCDEF0), np.int64(-(2**40)), None))
    assert seen == {"i32": -3, "ptr": 0xABCDEF0, "i64": -(2**40), "null": 0,
                    "grid": (7, 2, 1), "smem": 1024}
    # a second launch with other values reuses the block and sees the new words
    cfg.launch(0x1000, (1, 1, 1), 0, (np.int32(9), Ptr(1), np.int64(2), None))
    assert seen["i32"] == 9 and seen["i64"] == 2
