"""Whether this process can use a CUDA device, and if not, why: asked before any CUDA call.

One check for the library (:class:`HotBufferCache` and :class:`HostKVPool` call
:func:`require_gpu` first), the command line and its ``bench``, and the test suite. It asks the
driver itself (``libcuda`` through ctypes), so a machine without one hears "no NVIDIA driver"
rather than the CUDA runtime's "driver version is insufficient", and names a driver older
than CuPy's CUDA runtime as such.
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["GPUUnavailableError", "Ptr", "cupy_or_why", "driver_version", "require_gpu",
           "why_no_gpu"]

_NO_DEVICE = 100  # CUDA_ERROR_NO_DEVICE
_STUB_LIBRARY = 34  # CUDA_ERROR_STUB_LIBRARY: the toolkit's stub libcuda, no driver behind it
_INSUFFICIENT_DRIVER = 35  # CUDA_ERROR_INSUFFICIENT_DRIVER
_LIBCUDA = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


class Ptr(int):
    """A raw device (or device-mapped host) address."""


class GPUUnavailableError(RuntimeError):
    """No usable CUDA device; the message says why (no driver, no device, a driver too old)."""


def _libcuda():
    for name in _LIBCUDA:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


@functools.cache
def why_no_gpu() -> str | None:
    """None if a CUDA device can be used, else the reason, in one line (cached)."""
    lib = _libcuda()
    if lib is None:
        return "no NVIDIA driver found (libcuda.so.1 cannot be loaded)"
    rc = lib.cuInit(0)
    if rc == _NO_DEVICE:
        return "no CUDA device: the NVIDIA driver is loaded but sees no GPU"
    if rc == _STUB_LIBRARY:
        return "no NVIDIA driver found (only the CUDA toolkit's stub libcuda.so)"
    if rc == _INSUFFICIENT_DRIVER:
        return "the NVIDIA driver is too old for its own CUDA library (cuInit error 35)"
    if rc != 0:
        return f"the NVIDIA driver failed to initialise (cuInit error {rc})"
    n, drv = ctypes.c_int(0), ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value == 0:
        return "no CUDA device: the NVIDIA driver is loaded but sees no GPU"
    lib.cuDriverGetVersion(ctypes.byref(drv))
    try:
        import cupy
    except ImportError:
        from ._lazy import INSTALL_CUPY

        return f"CuPy is not installed: {INSTALL_CUPY}"
    except Exception as e:  # a broken CuPy install
        return f"CuPy failed to import: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    rt = cupy.cuda.runtime.runtimeGetVersion()  # the linked runtime's version; no driver call
    major = drv.value // 1000
    if major < rt // 1000:
        fix = (f"install the extra of the driver's CUDA (hisparse_cupy[cuda{major}]) or upgrade "
               f"the driver" if major >= 12 else "upgrade the driver (CUDA 12 or newer)")
        return (f"the NVIDIA driver supports CUDA {_cuda_version(drv.value)}, older than CuPy's "
                f"CUDA runtime {_cuda_version(rt)}: {fix}")
    return None


def driver_version() -> str | None:
    """The CUDA version the NVIDIA driver supports ("12.4"), or None without a driver."""
    lib, v = _libcuda(), ctypes.c_int(0)
    if lib is None or lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
        return None
    return _cuda_version(v.value)


def require_gpu() -> None:
    """Raise :class:`GPUUnavailableError` naming the reason unless a CUDA device is usable."""
    why = why_no_gpu()
    if why is not None:
        raise GPUUnavailableError(f"hisparse_cupy needs a CUDA device: {why}")


def cupy_or_why():
    """The ``cupy`` module if a CUDA device is usable, else the reason why not (a string)."""
    why = why_no_gpu()
    if why is not None:
        return why
    import cupy

    return cupy
