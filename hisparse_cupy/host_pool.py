"""Pinned, device-mapped host memory for the full KV cache."""

from __future__ import annotations

import cupy
import numpy as np

from . import _checks
from ._launch import Ptr


class HostKVPool:
    """Host rows for ``n_layers`` layers, pinned and mapped into the GPU's address space.

    Layer ``l`` is one contiguous block of ``n_rows`` rows of ``row_bytes`` bytes; kernels read
    it through :meth:`device_ptr` (zero-copy loads over the link). Rows are 16-byte aligned
    (``row_bytes`` must be a multiple of 16; the block is page aligned).

    Parameters
    ----------
    n_layers, n_rows, row_bytes : int
    portable : bool
        Map the memory for every device (``cudaHostAllocPortable``), default True.

    Use :meth:`close` (or ``with HostKVPool(...) as pool:``) to free the memory; closing while
    kernels may still read it is the caller's error, so ``close`` synchronizes the device first.
    """

    def __init__(self, n_layers: int, n_rows: int, row_bytes: int, *, portable: bool = True):
        self.n_layers = _checks.integer("n_layers", n_layers, 1)
        self.n_rows = _checks.integer("n_rows", n_rows, 1)
        self.row_bytes = _checks.row_bytes("row_bytes", row_bytes)
        self.layer_bytes = self.n_rows * self.row_bytes
        nbytes = self.n_layers * self.layer_bytes
        rt = cupy.cuda.runtime
        flags = rt.hostAllocMapped | (rt.hostAllocPortable if portable else 0)
        self._mem = cupy.cuda.PinnedMemory(nbytes, flags)
        self._host = np.ndarray(
            (self.n_layers, self.n_rows, self.row_bytes),
            np.uint8,
            buffer=cupy.cuda.PinnedMemoryPointer(self._mem, 0),
        )
        # Under UVA the device address equals the host address for cudaHostAlloc memory; ask
        # the driver anyway (it differs for write-combined or registered memory).
        self._dptr = rt.pointerGetAttributes(self._mem.ptr).devicePointer
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
        """Free the pinned memory (after the device finished every queued read of it)."""
        if self._mem is not None:
            cupy.cuda.Device().synchronize()
            self._host = None
            self._mem = None

    def __enter__(self) -> HostKVPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.n_layers * self.layer_bytes} bytes"
        return (f"HostKVPool(n_layers={self.n_layers}, n_rows={self.n_rows}, "
                f"row_bytes={self.row_bytes}, {state})")
