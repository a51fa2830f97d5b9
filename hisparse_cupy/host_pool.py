"""Pinned, device-mapped host memory for the full KV cache.

Three ways to get a :class:`HostKVPool`:

- ``HostKVPool(n_layers, n_rows, row_bytes)``: this process allocates pinned mapped memory;
- ``HostKVPool(..., shared_name="kv0")`` and ``HostKVPool.attach("kv0")``: one POSIX
  shared-memory object (``/dev/shm/<name>``, mode 0600) that several processes on a host map,
  each registering it pinned and mapped for its GPUs, so tensor-parallel ranks holding the same
  (MLA) KV keep one host copy. The creator owns the name and unlinks it at :meth:`close` (or at
  its exit); an attacher that crashes leaves nothing behind (its mapping and registration die
  with it). A small header before the rows records the shape, so an attach with other sizes
  fails with both shapes in the message;
- ``HostKVPool.from_buffer(array)``: host memory the engine allocated (a NumPy view of it),
  registered pinned and mapped in place; :meth:`close` unregisters it and frees nothing.
"""

from __future__ import annotations

import mmap
import os
import weakref

import cupy
import numpy as np

from . import _checks
from ._device import require_gpu
from ._launch import Ptr

_REGISTER_PORTABLE, _REGISTER_MAPPED = 1, 2  # cudaHostRegisterPortable, cudaHostRegisterMapped
_HEADER = 4096  # bytes before the rows of a shared pool (page aligned rows)
_MAGIC = np.uint64(0x48535043504F4F4C)  # "HSPCPOOL"
_SHM_DIR = "/dev/shm"


def _shm_path(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ValueError(f"shared_name must be a non-empty name without '/', got {name!r}")
    return os.path.join(_SHM_DIR, name)


def _register(ptr: int, nbytes: int) -> int:
    """Pin and map ``nbytes`` at host address ``ptr`` for every device; its device address."""
    rt = cupy.cuda.runtime
    rt.hostRegister(ptr, nbytes, _REGISTER_PORTABLE | _REGISTER_MAPPED)
    return rt.pointerGetAttributes(ptr).devicePointer


def _unregister(ptr: int) -> None:
    cupy.cuda.runtime.hostUnregister(ptr)


def _synchronize() -> None:
    cupy.cuda.Device().synchronize()


class HostKVPool:
    """Host rows for ``n_layers`` layers, pinned and mapped into the GPU's address space.

    Layer ``l`` is one contiguous block of ``n_rows`` rows of ``row_bytes`` bytes; kernels read
    it through :meth:`device_ptr` (zero-copy loads over the link). Rows are 16-byte aligned
    (``row_bytes`` must be a multiple of 16; the block is page aligned).

    Parameters
    ----------
    n_layers, n_rows, row_bytes : int
    portable : bool
        Map the memory for every device (``cudaHostAllocPortable``), default True. A shared
        pool is always registered for every device.
    shared_name : str, optional
        Create the pool as the POSIX shared-memory object ``/dev/shm/<shared_name>`` (mode 0600)
        that other processes :meth:`attach`; ``FileExistsError`` if the name is taken.

    Use :meth:`close` (or ``with HostKVPool(...) as pool:``) to release the memory; closing
    while kernels may still read it is the caller's error, so ``close`` synchronizes the device
    first.
    """

    def __init__(self, n_layers: int, n_rows: int, row_bytes: int, *, portable: bool = True,
                 shared_name: str | None = None):
        self._shape(n_layers, n_rows, row_bytes)
        nbytes = self.n_layers * self.layer_bytes
        self.name = None
        self.owner = False
        if shared_name is None:
            rt = cupy.cuda.runtime
            flags = rt.hostAllocMapped | (rt.hostAllocPortable if portable else 0)
            self._mem = cupy.cuda.PinnedMemory(nbytes, flags)
            base = self._mem.ptr
            # Under UVA the device address equals the host address for cudaHostAlloc memory;
            # ask the driver anyway (it differs for write-combined or registered memory).
            self._dptr = rt.pointerGetAttributes(base).devicePointer
            self._release = None
            self._host = np.ndarray((self.n_layers, self.n_rows, self.row_bytes), np.uint8,
                                    buffer=cupy.cuda.PinnedMemoryPointer(self._mem, 0))
        else:
            path = _shm_path(shared_name)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                raise FileExistsError(f"a host pool named {shared_name!r} already exists "
                                      f"({path}); attach to it or pick another name") from None
            try:
                os.ftruncate(fd, _HEADER + nbytes)
                mm = mmap.mmap(fd, _HEADER + nbytes)
                head = np.frombuffer(mm, np.uint64, 4)
                head[1:] = (self.n_layers, self.n_rows, self.row_bytes)
                head[0] = _MAGIC  # last: an attacher seeing it sees the shape
                del head
            except BaseException:
                os.close(fd)
                os.unlink(path)
                raise
            self.name, self.owner = shared_name, True
            # the creator owns the name: unlink it at close, or at exit if never closed
            unlink = weakref.finalize(self, _unlink, path)
            self._map(fd, mm, nbytes, unlink)
        self._check_alignment()

    # ----------------------------------------------------------------- other constructors
    @classmethod
    def attach(cls, name: str, n_layers: int | None = None, n_rows: int | None = None,
               row_bytes: int | None = None) -> HostKVPool:
        """Map the shared pool ``name`` created by another process (or this one) and register
        it pinned and mapped for this process's devices. Sizes given must equal the creator's.
        ``FileNotFoundError`` if it is gone; closing an attached pool never unlinks it."""
        path = _shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"no host pool named {name!r} ({path}): its creator closed "
                                    f"it or never made it") from None
        self = cls.__new__(cls)
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER:
                raise ValueError(f"{path} is not a hisparse_cupy host pool ({size} bytes)")
            mm = mmap.mmap(fd, size)
            head = np.frombuffer(mm, np.uint64, 4)
            magic, shape = head[0], tuple(int(v) for v in head[1:])
            del head
            if magic != _MAGIC:
                mm.close()
                raise ValueError(f"{path} is not a hisparse_cupy host pool")
            want = (n_layers, n_rows, row_bytes)
            if any(w is not None and w != g for w, g in zip(want, shape, strict=True)):
                mm.close()
                raise ValueError(f"host pool {name!r} holds (n_layers, n_rows, row_bytes) = "
                                 f"{shape}, not {want}")
            self._shape(*shape)
            if size != _HEADER + self.n_layers * self.layer_bytes:
                mm.close()
                raise ValueError(f"host pool {name!r} is {size} bytes, its shape needs "
                                 f"{_HEADER + self.n_layers * self.layer_bytes}")
        except BaseException:
            os.close(fd)
            raise
        self.name, self.owner = name, False
        self._map(fd, mm, self.n_layers * self.layer_bytes, None)
        self._check_alignment()
        return self

    @classmethod
    def from_buffer(cls, array: np.ndarray) -> HostKVPool:
        """Register host memory the caller owns: a C-contiguous uint8 NumPy array
        ``[n_layers, n_rows, row_bytes]`` (16-byte aligned), pinned and mapped in place.
        The array must outlive the pool; :meth:`close` unregisters it."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"array must be a NumPy array over the host memory, got "
                            f"{type(array).__name__}")
        if array.dtype != np.uint8 or array.ndim != 3 or not array.flags.c_contiguous:
            raise ValueError(f"array must be a C-contiguous uint8 [n_layers, n_rows, row_bytes] "
                             f"array, got {array.dtype} {array.shape}")
        if array.ctypes.data % 16:
            raise ValueError("array must be 16-byte aligned")
        self = cls.__new__(cls)
        self._shape(*array.shape)
        self.name, self.owner = None, False
        ptr = array.ctypes.data
        self._dptr = _register(ptr, array.nbytes)
        self._mem = array
        self._release = lambda: _unregister(ptr)
        self._host = array
        self._check_alignment()
        return self

    # ----------------------------------------------------------------- internals
    def _shape(self, n_layers, n_rows, row_bytes) -> None:
        self.n_layers = _checks.integer("n_layers", n_layers, 1)
        self.n_rows = _checks.integer("n_rows", n_rows, 1)
        self.row_bytes = _checks.row_bytes("row_bytes", row_bytes)
        self.layer_bytes = self.n_rows * self.row_bytes
        require_gpu()  # before any CUDA call (or a shared-memory file)

    def _map(self, fd: int, mm: mmap.mmap, nbytes: int, unlink) -> None:
        """Register the rows of a shared mapping and set up its release."""
        rows = np.frombuffer(mm, np.uint8, nbytes, _HEADER)
        base = rows.ctypes.data
        try:
            self._dptr = _register(base, nbytes)
        except BaseException:
            del rows
            mm.close()
            os.close(fd)
            if unlink is not None:
                unlink()
            raise

        def release():
            _unregister(base)
            try:
                mm.close()
            except BufferError:  # the caller still holds a view: unmapped when it goes
                pass
            os.close(fd)
            if unlink is not None:
                unlink()

        self._mem = rows
        self._host = rows.reshape(self.n_layers, self.n_rows, self.row_bytes)
        self._release = release

    def _check_alignment(self) -> None:
        if self._dptr % 16:
            raise RuntimeError("pinned allocation is not 16-byte aligned")

    @property
    def closed(self) -> bool:
        return self._mem is None

    def _live(self):
        if self._mem is None:
            raise RuntimeError("HostKVPool is closed")

    @property
    def numpy(self) -> np.ndarray:
        """uint8 ``[n_layers, n_rows, row_bytes]`` host view (no copy)."""
        self._live()
        return self._host

    def layer(self, layer: int) -> np.ndarray:
        """uint8 ``[n_rows, row_bytes]`` host view of one layer (no copy)."""
        self._live()
        return self._host[_checks.integer("layer", layer, 0, self.n_layers - 1)]

    def device_ptr(self, layer: int = 0) -> Ptr:
        """Device address of row 0 of ``layer`` (layers follow each other, ``layer_bytes``)."""
        self._live()
        layer = _checks.integer("layer", layer, 0, self.n_layers - 1)
        return Ptr(self._dptr + layer * self.layer_bytes)

    def close(self) -> None:
        """Release the memory (after the device finished every queued read of it): free it,
        unregister it (shared or caller-owned memory) and, for a shared pool's creator, unlink
        its name."""
        if self._mem is not None:
            _synchronize()
            release, self._release = self._release, None
            self._host = None
            self._mem = None
            if release is not None:
                release()

    def __enter__(self) -> HostKVPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.n_layers * self.layer_bytes} bytes"
        kind = "" if self.name is None else \
            f", shared {self.name!r} ({'creator' if self.owner else 'attached'})"
        return (f"HostKVPool(n_layers={self.n_layers}, n_rows={self.n_rows}, "
                f"row_bytes={self.row_bytes}{kind}, {state})")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
