"""Argument validation shared by every op.

Each check raises ``TypeError`` (wrong kind, dtype or device) or ``ValueError`` (wrong shape,
layout or range) with a message that names the argument and what was expected. Arrays from
PyTorch, JAX or anything else that speaks DLPack are imported without a copy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import cupy
import numpy as np


def _dtype_names(dtypes) -> str:
    return " or ".join(np.dtype(d).name for d in dtypes)


@functools.lru_cache(maxsize=64)
def _dtype_set(dtypes) -> tuple[np.dtype, ...]:
    return tuple(np.dtype(d) for d in (dtypes if isinstance(dtypes, (list, tuple)) else
                                       [dtypes]))


def as_device_array(name: str, x) -> cupy.ndarray:
    """``x`` as a CuPy array on the current device (DLPack import, no copy)."""
    if isinstance(x, cupy.ndarray):
        arr = x
    elif isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a GPU array, got a NumPy (host) array")
    elif hasattr(x, "__dlpack__"):
        try:
            arr = cupy.from_dlpack(x)
        except Exception as e:  # a CPU tensor, an unsupported device
            raise TypeError(f"{name} must be a GPU array; DLPack import failed: {e}") from e
    else:
        raise TypeError(f"{name} must be a GPU array (cupy, or DLPack-capable), got {type(x)}")
    dev = cupy.cuda.runtime.getDevice()
    if arr.device.id != dev:
        raise ValueError(f"{name} is on device {arr.device.id}, expected device {dev}")
    return arr


def array(
    name: str,
    x,
    dtypes,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    contiguous: bool = True,
    inner_contiguous: bool = False,
) -> cupy.ndarray:
    """Validate a device array.

    Parameters
    ----------
    dtypes : dtype or sequence of dtypes accepted
    shape : expected shape; ``None`` entries are free
    contiguous : require C-contiguity
    inner_contiguous : require only the last ``ndim - 1`` dimensions to be contiguous (rows may
        have any stride that is a whole number of elements)
    """
    arr = as_device_array(name, x)
    dts = _dtype_set(dtypes)
    if arr.dtype not in dts:
        raise TypeError(f"{name} must have dtype {_dtype_names(dts)}, got {arr.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(arr.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(arr.shape, shape, strict=True)):
            if want is not None and got != want:
                exp = "(" + ", ".join("*" if s is None else str(s) for s in shape) + \
                    ("," if len(shape) == 1 else "") + ")"
                raise ValueError(f"{name} must have shape {exp}, got {tuple(arr.shape)} (dim {i})")
    if contiguous and not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (strides {arr.strides})")
    if inner_contiguous and arr.ndim >= 2:
        expected = arr.itemsize
        for d in range(arr.ndim - 1, 0, -1):
            if arr.shape[d] > 1 and arr.strides[d] != expected:
                raise ValueError(f"{name} must have contiguous rows (strides {arr.strides})")
            expected *= arr.shape[d]
        if arr.shape[0] > 1 and (arr.strides[0] <= 0 or arr.strides[0] % arr.itemsize):
            raise ValueError(f"{name} row stride {arr.strides[0]} must be a positive multiple "
                             f"of its item size")
    return arr


def row_stride(arr: cupy.ndarray) -> np.int32:
    """Row stride of a 2-D (or more) array in elements, as the kernels take it."""
    s = arr.strides[0] // arr.itemsize if arr.ndim >= 2 else arr.shape[-1]
    return np.int32(s)


def integer(name: str, v, lo: int | None = None, hi: int | None = None) -> int:
    """An int in ``[lo, hi]`` (either bound optional)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    v = int(v)
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def row_bytes(name: str, v) -> int:
    """A row size: positive multiple of 16 (kernels copy 16-byte vectors)."""
    v = integer(name, v, 16)
    if v % 16:
        raise ValueError(f"{name} must be a multiple of 16 bytes, got {v}")
    return v


def device_scalar(name: str, x) -> cupy.ndarray:
    """A one-element int32 device array (graph-safe scalar such as ``num_real``)."""
    arr = array(name, x, np.int32)
    if arr.size != 1:
        raise ValueError(f"{name} must hold exactly one int32, got shape {tuple(arr.shape)}")
    return arr
