"""CPU: argument validation messages (a NumPy-backed stand-in plays the device array)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from hisparse_cupy import _checks


class FakeDeviceArray:
    """Just enough of cupy.ndarray for the checks: dtype, shape, strides, flags, device."""

    def __init__(self, a, device=0):
        self._a = a
        self.dtype, self.shape, self.strides = a.dtype, a.shape, a.strides
        self.ndim, self.itemsize, self.size = a.ndim, a.itemsize, a.size
        self.flags = types.SimpleNamespace(c_contiguous=a.flags.c_contiguous)
        self.device = types.SimpleNamespace(id=device)

    def __getitem__(self, k):
        return FakeDeviceArray(self._a[k], self.device.id)


@pytest.fixture
def fake_cupy(monkeypatch):
    ns = types.SimpleNamespace(
        ndarray=FakeDeviceArray,
        from_dlpack=lambda x: (_ for _ in ()).throw(TypeError("CPU arrays cannot be imported")),
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0)),
    )
    monkeypatch.setattr(_checks, "cupy", ns)
    return ns


def A(*shape, dtype=np.int32, device=0):
    return FakeDeviceArray(np.zeros(shape, dtype), device)


def test_dtype_error_names_argument(fake_cupy):
    with pytest.raises(TypeError, match=r"top_k_tokens must have dtype int32, got int64"):
        _checks.array("top_k_tokens", A(2, 4, dtype=np.int64), np.int32)
    with pytest.raises(TypeError, match=r"req_indices must have dtype int32 or int64"):
        _checks.array("req_indices", A(3, dtype=np.float32), (np.int32, np.int64))


def test_shape_and_ndim_errors(fake_cupy):
    with pytest.raises(ValueError, match=r"seq_lens must have shape \(4,\), got \(3,\)"):
        _checks.array("seq_lens", A(3), np.int32, shape=(4,))
    with pytest.raises(ValueError, match=r"lru must be 2-D"):
        _checks.array("lru", A(3), np.int32, ndim=2)
    with pytest.raises(ValueError, match=r"plan must have shape \(\*, 8\)"):
        _checks.array("plan", A(3, 7), np.int32, shape=(None, 8))


def test_layout_errors(fake_cupy):
    base = np.zeros((4, 8), np.int32)
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        _checks.array("out", FakeDeviceArray(base[:, ::2]), np.int32)
    with pytest.raises(ValueError, match="must have contiguous rows"):
        _checks.array("top_k_tokens", FakeDeviceArray(base[:, ::2]), np.int32, contiguous=False,
                      inner_contiguous=True)
    # strided rows with contiguous inner dimension are fine
    a = _checks.array("top_k_tokens", FakeDeviceArray(base[::2]), np.int32, contiguous=False,
                      inner_contiguous=True)
    assert _checks.row_stride(a) == 16


def test_device_and_kind_errors(fake_cupy):
    with pytest.raises(ValueError, match="x is on device 1, expected device 0"):
        _checks.array("x", A(3, device=1), np.int32)
    with pytest.raises(TypeError, match="x must be a GPU array, got a NumPy"):
        _checks.array("x", np.zeros(3, np.int32), np.int32)
    with pytest.raises(TypeError, match="x must be a GPU array"):
        _checks.array("x", [1, 2, 3], np.int32)


def test_scalars(fake_cupy):
    assert _checks.integer("n", np.int64(5), 1, 9) == 5
    with pytest.raises(ValueError, match="hot_size must be <= 32767, got 40000"):
        _checks.integer("hot_size", 40000, 1, 32767)
    with pytest.raises(TypeError, match="n must be an int, got float"):
        _checks.integer("n", 2.0)
    with pytest.raises(TypeError, match="n must be an int, got bool"):
        _checks.integer("n", True)
    with pytest.raises(ValueError, match="row_bytes must be a multiple of 16 bytes, got 650"):
        _checks.row_bytes("row_bytes", 650)
    with pytest.raises(ValueError, match="num_real must hold exactly one int32"):
        _checks.device_scalar("num_real", A(2))


def test_seq_lens_without_a_step_column_is_refused(fake_cupy):
    """``seq_lens`` ``[B, 0]`` holds no length: a single-step call read column 0 of it anyway
    (the kernel's ``lens[b * stride]``: a null pointer, or a neighbour's value for a slice)."""
    for lens in (A(4, 0), FakeDeviceArray(np.zeros((4, 3), np.int32))[:, :0]):
        for steps in (None, 2):
            with pytest.raises(ValueError, match=r"seq_lens has 0 step columns"):
                _checks.lengths(lens, 4, steps)
    arr, row, step = _checks.lengths(A(4, 3), 4)
    assert (row, step) == (3, 1)
