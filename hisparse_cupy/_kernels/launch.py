"""The one launch path of the package, and the caller's stream.

Every kernel takes one parameter struct by value (:mod:`hisparse_cupy._abi`): a
:class:`Structs` holds one or many (one per layer) as bytes, written through word views; a
:class:`Params` is one of them. :func:`launch` queues a kernel with it through the driver's
``cuLaunchKernelEx`` (through cuda-python's ``cuda.bindings.driver``; the driver copies the
struct at the launch, and into the graph node under capture), with Programmatic Dependent
Launch when ``pdl=True`` on a device of compute capability 9.0 or newer: the
programmatic-stream-serialization attribute lets the kernel start while the previous kernel on
the stream finishes, and the kernel calls ``hs::pdl_wait()`` before reading what that kernel
wrote. The launch configuration is cached per (block, shared memory, PDL, cluster size), so a
launch sets the grid and the stream only when they changed and passes one pointer (to the
struct's bytes) as the argument block.

:func:`as_stream` turns whatever the caller passed as ``stream=`` into a CuPy stream object:
``None`` (CuPy's current stream), a ``cupy.cuda.Stream`` or ``ExternalStream``, an object with
``__cuda_stream__`` (PyTorch >= 2.7, cuda.core), an object with an integer ``cuda_stream``
attribute (older PyTorch streams) or a raw integer handle. Foreign streams are wrapped once per
handle with ``cupy.cuda.Stream.from_external`` and cached, so the per-call cost is a dictionary
lookup. The wrapper does not own the stream: keep the original alive while work is queued.

:func:`resolve_pdl` turns a per-call ``pdl: bool | None`` into what the launch does (None: use
PDL where the device supports it and ``HISPARSE_CUPY_PDL=0`` does not turn it off; a
measurement may fix it for a while: :func:`hisparse_cupy.testing.knobs.pdl`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

import cupy
import numpy as np

from .._log import log

_SMEM_DEFAULT_LIMIT = 48 * 1024
# Measuring overrides, data only (hisparse_cupy.testing.knobs sets them, engines never do):
# "pdl", what a call's pdl=None means on a device that has PDL (from HISPARSE_CUPY_PDL).
FIXED: dict[str, bool] = {
    "pdl": os.environ.get("HISPARSE_CUPY_PDL", "1") not in ("0", "false", "off")}


def _address(raw: np.ndarray) -> int:
    """Address of a writable C-contiguous byte array (a third of ``ndarray.ctypes.data``'s cost)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(raw))


@functools.cache
def field_words(dtype: np.dtype) -> dict[str, tuple[int, int]]:
    """Field -> (width, index in a ``width``-byte-word view of one struct); every field of the
    package's structs is a 64-bit or a 32-bit word (pointers, sizes, counts; a float, the
    demo model's scales, is one too)."""
    out = {}
    for name in dtype.names:
        width, off = dtype[name].itemsize, dtype.fields[name][1]
        if width not in (4, 8) or off % width or dtype[name].kind not in "iuf":
            raise TypeError(f"field {name} of {dtype} is not an aligned 4- or 8-byte word")
        out[name] = (width, off // width)
    return out


@functools.cache
def float_fields(dtype: np.dtype) -> frozenset[str]:
    """The fields of ``dtype`` that hold a float (written through float views of the words)."""
    return frozenset(n for n in dtype.names if dtype[n].kind == "f")


def _float_views(raw: np.ndarray, floats: frozenset[str]) -> tuple:
    """The float64 and float32 views of a struct array's bytes, where it has a float field
    (none of the package's swaps has one: no views to make on their per-step copies)."""
    return (raw.view(np.float64), raw.view(np.float32)) if floats else (None, None)


class Structs:
    """``n`` kernel parameter structs of one dtype in one array (one per layer, or one).

    Every field is written through the array's 64-bit and 32-bit word views (a float field
    through their float views), the one way the package writes a field: :meth:`put` (one
    struct), :meth:`put_all` (every struct), or, on a per-call path, the ``(view, index)`` pairs
    of :meth:`word` kept by the kernel family's module. ``addr(i)`` is the address a launch
    passes.
    """

    __slots__ = ("raw", "dtype", "base", "itemsize", "w8", "w4", "index", "floats", "f8", "f4")

    def __init__(self, arr: np.ndarray, *, _raw: np.ndarray | None = None):
        self.raw = arr.view(np.uint8) if _raw is None else _raw  # C-contiguous bytes
        self.dtype = arr.dtype
        self.itemsize = arr.dtype.itemsize
        self.base = _address(self.raw)
        self.w8, self.w4 = self.raw.view(np.int64), self.raw.view(np.int32)
        self.index = field_words(arr.dtype)
        self.floats = float_fields(arr.dtype)
        self.f8, self.f4 = _float_views(self.raw, self.floats)

    @classmethod
    def zeros(cls, dtype: np.dtype, n: int = 1) -> Structs:
        return cls(np.zeros(n, dtype))

    def copy(self) -> Structs:
        """A copy of every struct (as bytes: a structured copy is ten times slower; the copy's
        views are made without a structured view, a microsecond each on a per-step path)."""
        new = Structs.__new__(Structs)
        raw = new.raw = self.raw.copy()
        new.dtype, new.itemsize, new.index = self.dtype, self.itemsize, self.index
        new.floats = self.floats
        new.base = _address(raw)
        new.w8, new.w4 = raw.view(np.int64), raw.view(np.int32)
        new.f8, new.f4 = _float_views(raw, self.floats)
        return new

    def _view(self, name: str, width: int) -> np.ndarray:
        if name in self.floats:
            return self.f8 if width == 8 else self.f4
        return self.w8 if width == 8 else self.w4

    def word(self, i: int, name: str) -> tuple[np.ndarray, int]:
        """The word view and index of field ``name`` of struct ``i``."""
        width, w = self.index[name]
        per = self.itemsize // width
        return self._view(name, width), i * per + w

    def put(self, i: int, **fields) -> None:
        for k, v in fields.items():
            view, w = self.word(i, k)
            view[w] = v

    def put_all(self, **fields) -> None:
        """The same value of each field in every struct."""
        for k, v in fields.items():
            width, w = self.index[k]
            self._view(k, width)[w::self.itemsize // width] = v

    def get(self, i: int, name: str) -> int | float:
        view, w = self.word(i, name)
        return float(view[w]) if name in self.floats else int(view[w])

    def addr(self, i: int) -> int:
        return self.base + i * self.itemsize

    def row(self, i: int) -> Params:
        """A :class:`Params` view of struct ``i`` (writing it writes this array)."""
        return Params(_structs=self, _i=i)


class CallWriter:
    """Base of a kernel family's per-call writer (``CallFields`` in swap.py, multistep.py): the
    word views of a :class:`Structs` and the words per struct, so that a call's fields of struct
    ``i`` are ``view[i * n + index]`` (field indexes from :func:`field_words`)."""

    __slots__ = ("i8", "i4", "n8", "n4")

    def __init__(self, st: Structs):
        self.i8, self.i4 = st.w8, st.w4
        self.n8, self.n4 = st.itemsize // 8, st.itemsize // 4


class Params:
    """One kernel parameter struct (a struct of a :class:`Structs`) and its address.

    ``Params(dtype)`` owns a fresh zeroed struct; ``Structs.row(i)`` is a view of one of many.
    """

    __slots__ = ("structs", "i", "addr")

    def __init__(self, dtype: np.dtype | None = None, *, _structs: Structs | None = None,
                 _i: int = 0):
        self.structs = Structs.zeros(dtype) if _structs is None else _structs
        self.i = _i
        self.addr = self.structs.addr(_i)

    def __getitem__(self, field: str) -> int | float:
        return self.structs.get(self.i, field)

    def set(self, **fields) -> Params:
        self.structs.put(self.i, **fields)
        return self


def ptr(x) -> int:
    """Device address of a CuPy array, or 0 for None."""
    return 0 if x is None else x.data.ptr


# ----------------------------------------------------------------------------- PDL switch
@functools.cache
def _compute_capability(device_id: int) -> int:
    return int(cupy.cuda.Device(device_id).compute_capability)


def compute_capability() -> int:
    """Compute capability of the current device as major * 10 + minor (90: Hopper)."""
    return _compute_capability(cupy.cuda.runtime.getDevice())


def pdl_supported(device_id: int | None = None) -> bool:
    """Whether PDL launches will be used on this device by default (sm_90+ and enabled)."""
    if device_id is None:
        device_id = cupy.cuda.runtime.getDevice()
    return FIXED["pdl"] and _compute_capability(device_id) >= 90


def resolve_pdl(pdl: bool | None) -> bool:
    """A call's ``pdl`` argument -> whether its dependent kernels launch with PDL.

    None: what :func:`pdl_supported` says. True: PDL where the device has it (sm_90+; below
    that the kernel's wait is a no-op and the launch is plain). False: plain launches.
    """
    if pdl is None:
        return pdl_supported()
    if pdl:
        return compute_capability() >= 90
    return False


# ----------------------------------------------------------------------------- streams
class StreamHandle:
    """A raw stream handle speaking the ``__cuda_stream__`` protocol."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


_foreign: dict[tuple[int, int], cupy.cuda.ExternalStream] = {}


def _wrap(handle: int):
    dev = cupy.cuda.runtime.getDevice()
    s = _foreign.get((dev, handle))
    if s is None:
        s = _foreign[(dev, handle)] = cupy.cuda.Stream.from_external(StreamHandle(handle))
        log.debug("wrapped foreign stream 0x%x on device %d", handle, dev)
    return s


def as_stream(stream=None):
    """The CuPy stream object for a call's ``stream=`` argument (see the module docstring)."""
    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        return stream
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
        return _wrap(int(stream))
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        got = proto() if callable(proto) else proto
        try:
            handle = int(got[1])
        except (TypeError, ValueError, IndexError):
            raise TypeError(f"stream.__cuda_stream__() must return (version, handle), got "
                            f"{got!r}") from None
        return _wrap(handle)
    handle = getattr(stream, "cuda_stream", None)
    if isinstance(handle, (int, np.integer)):
        return _wrap(int(handle))
    raise TypeError(f"stream must be a CuPy stream, an object with __cuda_stream__ or an integer "
                    f"cuda_stream attribute (PyTorch), or an int handle; got "
                    f"{type(stream).__name__}")


# ----------------------------------------------------------------------------- launches
@functools.cache
def _max_optin_smem(device_id: int) -> int:
    attr = cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin
    return cupy.cuda.runtime.deviceGetAttribute(attr, device_id)


def max_shared_memory() -> int:
    """Dynamic shared memory one block may opt into on the current device (bytes)."""
    return _max_optin_smem(cupy.cuda.runtime.getDevice())


@functools.cache
def _sm_count(device_id: int) -> int:
    attr = cupy.cuda.runtime.cudaDevAttrMultiProcessorCount
    return cupy.cuda.runtime.deviceGetAttribute(attr, device_id)


def sm_count() -> int:
    """Streaming multiprocessors of the current device."""
    return _sm_count(cupy.cuda.runtime.getDevice())


_smem_set: dict[tuple[int, int], int] = {}


def _opt_in_smem(kernel, shared_mem: int, dev: int) -> None:
    key = (id(kernel), dev)
    if _smem_set.get(key, _SMEM_DEFAULT_LIMIT) >= shared_mem:
        return
    limit = _max_optin_smem(dev)
    if shared_mem > limit:
        raise ValueError(f"kernel {kernel.name} needs {shared_mem} bytes of shared memory; "
                         f"this device allows {limit}")
    kernel.max_dynamic_shared_size_bytes = shared_mem
    _smem_set[key] = shared_mem


# The driver's launch through cuda-python (cuda.bindings.driver, which both CUDA extras
# install): its CUlaunchConfig and CUlaunchAttribute carry the block, the shared memory, the
# stream and the PDL / cluster attributes; cuLaunchKernelEx takes the kernel's argument block
# as one address (void *kernelParams[1]). tools/host_overhead.py measures the per-call cost.
@functools.cache
def _cu():
    """``cuda.bindings.driver``, imported on the first launch (a CPU install without
    cuda-bindings can still import the package)."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise ImportError("hisparse_cupy launches its kernels through cuda-python: install "
                          "cuda-bindings (the cuda12 / cuda13 extras bring it)") from e
    return driver


def _check(result, what: str) -> None:
    """Raise ``RuntimeError`` naming ``what`` and the driver's error for a failed call."""
    if int(result):  # CUresult.CUDA_SUCCESS is 0
        cu = _cu()
        _, name = cu.cuGetErrorName(result)
        raise RuntimeError(f"{what} failed: {int(result)} "
                           f"({(name or b'?').decode(errors='replace')})")


class _LaunchConfig:
    """A cached ``CUlaunchConfig`` (with the PDL attribute or without, with a cluster dimension
    or without) and its one-pointer argument block. A lock keeps two threads from interleaving
    the fill of the shared config and the launch."""

    def __init__(self, block: tuple[int, int, int], shared_mem: int, pdl: bool = True,
                 cluster: int = 1):
        cu = _cu()
        cfg = self.cfg = cu.CUlaunchConfig()
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = shared_mem
        ids = cu.CUlaunchAttributeID
        attrs = []
        if pdl:  # the kernel may start while the previous one drains (it waits in pdl_wait)
            a = cu.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        if cluster > 1:
            a = cu.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cluster, 1, 1
            attrs.append(a)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        self.grid = (0, 0, 0)
        self.stream = -1
        self.args = np.zeros(1, np.uintp)  # void* kernelParams[1]: the struct's address
        self.args_addr = int(self.args.ctypes.data)
        self.call = cu.cuLaunchKernelEx
        self.lock = threading.Lock()

    def launch(self, func, grid, stream_ptr: int, params_addr: int) -> None:
        with self.lock:
            cfg = self.cfg
            if grid != self.grid:
                cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid = grid
            if stream_ptr != self.stream:
                cfg.hStream = self.stream = stream_ptr
            self.args[0] = params_addr
            err, = self.call(cfg, func, self.args_addr, 0)
        _check(err, "cuLaunchKernelEx")


_configs: dict[tuple, _LaunchConfig] = {}
_launchers: dict[tuple, Launcher] = {}


class Launcher:
    """One kernel bound to a block size, dynamic shared memory, PDL choice and cluster size on
    the current device: ``launcher(grid3, stream_ptr, params_addr)`` is the whole per-launch
    cost. With ``cluster`` C > 1 the grid's x extent must be a multiple of C."""

    __slots__ = ("cfg", "func")

    def __init__(self, kernel, block: tuple[int, int, int], shared_mem: int, pdl: bool,
                 cluster: int = 1):
        dev = cupy.cuda.runtime.getDevice()
        if shared_mem > _SMEM_DEFAULT_LIMIT:
            _opt_in_smem(kernel, shared_mem, dev)
        key = (block, shared_mem, pdl, cluster)
        cfg = _configs.get(key)
        if cfg is None:
            cfg = _configs[key] = _LaunchConfig(block, shared_mem, pdl, cluster)
            log.debug("launch config: block %s, %d B shared memory, PDL %s, cluster %d", block,
                      shared_mem, pdl, cluster)
        self.cfg = cfg
        # RawKernel.kernel loads the module on this device (CuPy compiles it on first use)
        self.func = _cu().CUfunction(kernel.kernel.ptr)

    def __call__(self, grid: tuple[int, int, int], stream_ptr: int, params_addr: int) -> None:
        if grid[0] > 0 and grid[1] > 0 and grid[2] > 0:  # CUDA rejects empty grids
            self.cfg.launch(self.func, grid, stream_ptr, params_addr)


def launcher(kernel, block, shared_mem: int = 0, pdl: bool = False,
             cluster: int = 1) -> Launcher:
    """The cached :class:`Launcher` of ``kernel`` on the current device."""
    block = _dim3(block)
    key = (id(kernel), cupy.cuda.runtime.getDevice(), block, shared_mem, bool(pdl), cluster)
    la = _launchers.get(key)
    if la is None:
        la = _launchers[key] = Launcher(kernel, block, shared_mem, bool(pdl), cluster)
    return la


@functools.cache
def _max_active_clusters(kernel, device_id: int, block: tuple[int, int, int], shared_mem: int,
                         cluster: int) -> int:
    if shared_mem > _SMEM_DEFAULT_LIMIT:
        _opt_in_smem(kernel, shared_mem, device_id)
    cfg = _LaunchConfig(block, shared_mem, False, cluster)
    cfg.cfg.gridDimX, cfg.cfg.gridDimY, cfg.cfg.gridDimZ = cluster, 1, 1
    err, n = _cu().cuOccupancyMaxActiveClusters(_cu().CUfunction(kernel.kernel.ptr), cfg.cfg)
    _check(err, "cuOccupancyMaxActiveClusters")
    return int(n)


def max_active_clusters(kernel, block, shared_mem: int, cluster: int) -> int:
    """How many clusters of ``cluster`` blocks of ``kernel`` (``block`` threads, ``shared_mem``
    bytes of dynamic shared memory each) the current device runs at once (0: none fits)."""
    return _max_active_clusters(kernel, cupy.cuda.runtime.getDevice(), _dim3(block), shared_mem,
                                cluster)


def _dim3(x) -> tuple[int, int, int]:
    if isinstance(x, int):
        return (x, 1, 1)
    t = tuple(int(v) for v in x)
    return t + (1,) * (3 - len(t))


def launch(kernel, grid, block, params: Params, *, shared_mem: int = 0, stream=None,
           pdl: bool = False) -> None:
    """Queue ``kernel`` with its parameter struct on ``stream`` (a CuPy stream object; None:
    the current stream), through ``cuLaunchKernelEx``.

    ``grid`` / ``block``: int or tuple of up to 3 ints (an empty grid queues nothing).
    ``shared_mem``: dynamic shared memory in bytes; above 48 KB the kernel is opted in once.
    ``pdl``: already resolved (:func:`resolve_pdl`); True launches with the PDL attribute.
    CuPy's own ``RawKernel.__call__`` is not used: with one struct argument this path costs a
    fraction of its host time (``tools/host_overhead.py``).
    """
    if stream is None:
        stream = cupy.cuda.get_current_stream()
    launcher(kernel, block, shared_mem, pdl)(_dim3(grid), stream.ptr, params.addr)
