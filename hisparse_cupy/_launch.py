"""The one launch path of the package.

Every op launches through :func:`launch`. A plain launch is ``RawKernel.__call__``; a launch with
``pdl=True`` on a device of compute capability 9.0 or newer goes through
``cuda.bindings.driver.cuLaunchKernelEx`` with the programmatic-stream-serialization attribute,
so the kernel may start while the previous kernel on the stream finishes; such kernels must call
``hs::pdl_wait()`` before reading what the previous kernel wrote. Elsewhere, or with PDL
disabled (``HISPARSE_CUPY_PDL=0`` or :func:`set_pdl`), the same kernel is launched plainly and
its ``griddepcontrol.wait`` returns at once.

Kernel arguments are ``cupy.ndarray`` (passed as its data pointer), ``None`` (a null pointer),
:class:`Ptr` (a raw device pointer) or NumPy scalars (``np.int32``, ``np.int64``, ``np.uint64``)
whose width matches the kernel's parameter. Plain Python ints are refused: CuPy would pass them
as 64-bit values, silently misread by a 32-bit parameter.
"""

from __future__ import annotations

import functools
import os
import threading

import cupy
import numpy as np

_SMEM_DEFAULT_LIMIT = 48 * 1024
_pdl_enabled = os.environ.get("HISPARSE_CUPY_PDL", "1") not in ("0", "false", "off")


class Ptr(int):
    """A raw device (or device-mapped host) address passed to a kernel as a pointer."""


def set_pdl(enabled: bool) -> None:
    """Turn Programmatic Dependent Launch on or off for all later launches."""
    global _pdl_enabled
    _pdl_enabled = bool(enabled)


def pdl_enabled() -> bool:
    return _pdl_enabled


@functools.cache
def _compute_capability(device_id: int) -> int:
    return int(cupy.cuda.Device(device_id).compute_capability)


def pdl_supported(device_id: int | None = None) -> bool:
    """Whether PDL launches will be used on this device (sm_90+ and enabled)."""
    if device_id is None:
        device_id = cupy.cuda.runtime.getDevice()
    return _pdl_enabled and _compute_capability(device_id) >= 90


@functools.cache
def _max_optin_smem(device_id: int) -> int:
    attr = cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin
    return cupy.cuda.runtime.deviceGetAttribute(attr, device_id)


def max_shared_memory() -> int:
    """Dynamic shared memory one block may opt into on the current device (bytes)."""
    return _max_optin_smem(cupy.cuda.runtime.getDevice())


_smem_set: dict[tuple[int, int], int] = {}


def _opt_in_smem(kernel: cupy.RawKernel, shared_mem: int) -> None:
    dev = cupy.cuda.runtime.getDevice()
    key = (id(kernel), dev)
    if _smem_set.get(key, _SMEM_DEFAULT_LIMIT) >= shared_mem:
        return
    limit = _max_optin_smem(dev)
    if shared_mem > limit:
        raise ValueError(
            f"kernel {kernel.name} needs {shared_mem} bytes of shared memory; "
            f"this device allows {limit}"
        )
    kernel.max_dynamic_shared_size_bytes = shared_mem
    _smem_set[key] = shared_mem


def _plain_arg(a):
    if isinstance(a, cupy.ndarray):
        return a
    if a is None:
        return np.uint64(0)
    if isinstance(a, Ptr):
        return np.uint64(int(a))
    if isinstance(a, np.generic):
        return a
    raise TypeError(f"kernel argument {a!r}: pass a cupy.ndarray, None, Ptr or a NumPy scalar")


_MASK64 = (1 << 64) - 1


def _ex_word(a) -> int:
    """One kernel argument as the 64-bit word whose low bytes the driver reads."""
    t = type(a)
    if t is cupy.ndarray:
        return a.data.ptr
    if a is None:
        return 0
    if t is Ptr:
        return int(a)
    if isinstance(a, (np.int32, np.int64, np.uint32, np.uint64)):
        return int(a) & _MASK64  # little-endian: an int32 parameter reads the low 4 bytes
    if isinstance(a, cupy.ndarray):
        return a.data.ptr
    raise TypeError(f"kernel argument {a!r}: pass a cupy.ndarray, None, Ptr or an integer "
                    f"NumPy scalar")


class _PdlConfig:
    """A cached CUlaunchConfig with the PDL attribute, and a reusable argument block.

    Per launch only the grid, the stream and the argument words change: the words are written
    into one uint64 array whose element addresses form the ``void**`` the driver reads, so no
    per-argument Python objects are built. A lock keeps two threads from interleaving the
    fill and the launch.
    """

    def __init__(self, block: tuple[int, int, int], shared_mem: int):
        from cuda.bindings import driver as cu

        self.cu = cu
        cfg = cu.CUlaunchConfig()
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = shared_mem
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        self.cfg = cfg
        self.words = np.zeros(0, np.uint64)
        self.ptrs = np.zeros(0, np.uintp)
        self.funcs: dict[int, object] = {}
        self.lock = threading.Lock()

    def _buffers(self, n: int) -> None:
        if self.words.size != n:
            self.words = np.zeros(n, np.uint64)
            self.ptrs = self.words.ctypes.data + 8 * np.arange(n, dtype=np.uintp)

    def launch(self, func_ptr: int, grid, stream_ptr: int, args) -> None:
        cu = self.cu
        func = self.funcs.get(func_ptr)
        if func is None:
            func = self.funcs[func_ptr] = cu.CUfunction(func_ptr)
        words = [_ex_word(a) for a in args]
        with self.lock:
            self._buffers(len(words))
            self.words[:] = words
            cfg = self.cfg
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
            cfg.hStream = cu.CUstream(stream_ptr)
            (err,) = cu.cuLaunchKernelEx(cfg, func, self.ptrs.ctypes.data, 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernelEx failed: {cu.cuGetErrorName(err)[1]}")


_pdl_configs: dict[tuple, _PdlConfig] = {}
_func_ptrs: dict[int, int] = {}  # id(RawKernel) -> CUfunction; kernels are memoized by _build


def _dim3(x) -> tuple[int, int, int]:
    t = (x,) if isinstance(x, int) else tuple(x)
    return tuple(int(v) for v in t) + (1,) * (3 - len(t))


def launch(
    kernel: cupy.RawKernel,
    grid,
    block,
    args: tuple,
    *,
    shared_mem: int = 0,
    stream: cupy.cuda.Stream | None = None,
    pdl: bool = False,
) -> None:
    """Launch ``kernel`` on ``stream`` (default: CuPy's current stream).

    Parameters
    ----------
    grid, block : int or tuple of up to 3 ints
    args : tuple
        Kernel arguments (see the module docstring for the accepted kinds).
    shared_mem : int
        Dynamic shared memory in bytes; above 48 KB the kernel is opted in once.
    pdl : bool
        Launch with Programmatic Dependent Launch where supported (see :func:`pdl_supported`).
    """
    grid, block = _dim3(grid), _dim3(block)
    if min(grid) <= 0:
        return  # nothing to do; CUDA rejects empty grids
    if stream is None:
        stream = cupy.cuda.get_current_stream()
    if shared_mem > _SMEM_DEFAULT_LIMIT:
        _opt_in_smem(kernel, shared_mem)
    if pdl and pdl_supported():
        key = (block, shared_mem)
        cfg = _pdl_configs.get(key)
        if cfg is None:
            cfg = _pdl_configs[key] = _PdlConfig(block, shared_mem)
        fptr = _func_ptrs.get(id(kernel))
        if fptr is None:  # RawKernel.kernel resolves the module on every access: cache it
            fptr = _func_ptrs[id(kernel)] = kernel.kernel.ptr
        cfg.launch(fptr, grid, stream.ptr, args)
        return
    kernel(grid, block, tuple(_plain_arg(a) for a in args), shared_mem=shared_mem, stream=stream)
