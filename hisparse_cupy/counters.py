"""Per-layer swap counters: accumulated on the device by the swap kernels, read by the host
without a synchronize on the step's stream.

The last kernel of every swap (the single-step resolve, the multi-step commit) adds, for each
real batch row it resolved, one thread's atomics to the layer's row of :attr:`LayerCounters.device`
(``_abi.LAYER_COUNTERS``): the row, the entries it selected (K, or S * K for a multi-step call;
-1 entries included), its unique misses (the miss plan's entries) and its flagged entries
(out of range, no host row). A row with a bad request slot or length counts nowhere (its status
says so). A miss served from prediction's staging rows counts as a miss. A shared layer served
by a :class:`~hisparse_cupy.Prefetcher`'s replay runs no swap and counts nothing: its replay
moves its full layer's misses again, so the bytes a step moves are each full layer's ``bytes``
times (1 + its shared layers). Prediction's staged and used rows are the Predictor's
``predict_stats`` (all layers). ``hit_rate`` is 1 - misses / selected, and selected counts every
entry (-1 entries, duplicates and the newest token included).

An engine reads them every N steps: :meth:`LayerCounters.snapshot` queues a copy into pinned
host memory on the step's stream, after the work queued there, and returns at once;
:meth:`LayerCounters.latest` returns the last snapshot that has landed (it never waits).
:meth:`LayerCounters.read` waits for a fresh one (on demand, e.g. at shutdown).
"""

from __future__ import annotations

import cupy
import cupyx
import numpy as np

from . import _abi
from ._checks import StreamLike
from ._kernels.launch import as_stream

__all__ = ["LayerCounters"]


class LayerCounters:
    """The counters of ``n_layers`` layers (``HotBufferCache.counters``; rows of ``row_bytes``).

    Attributes
    ----------
    device : uint64 ``[n_layers, N_LAYER_COUNTERS]`` device array, what the kernels add to.
    """

    def __init__(self, n_layers: int, row_bytes: int):
        self.row_bytes = row_bytes
        self.device = cupy.zeros((n_layers, _abi.N_LAYER_COUNTERS), cupy.uint64)
        self._host = cupyx.zeros_pinned(self.device.shape, np.uint64)
        self._event: cupy.cuda.Event | None = None  # the snapshot in flight
        self._last: dict | None = None

    def address(self, layer: int) -> int:
        """Device address of ``layer``'s counters (the kernel structs' field)."""
        return self.device.data.ptr + layer * self.device.strides[0]

    def snapshot(self, stream: StreamLike | None = None) -> bool:
        """Queue a copy of the counters into pinned host memory on ``stream`` (any stream kind;
        default: CuPy's current), after the work queued there; no wait. Returns False, queuing
        nothing, while the previous snapshot is still in flight. Not inside a graph capture."""
        s = as_stream(stream)
        if s.is_capturing():
            raise RuntimeError("LayerCounters.snapshot inside a CUDA graph capture: take it "
                               "between replays, on the stream the graph is launched on")
        if self._event is not None:
            if not self._event.done:
                return False
            self._take()
        rt = cupy.cuda.runtime
        rt.memcpyAsync(self._host.ctypes.data, self.device.data.ptr, self.device.nbytes,
                       rt.memcpyDeviceToHost, s.ptr)
        self._event = cupy.cuda.Event(disable_timing=True)
        self._event.record(s)
        return True

    def latest(self) -> dict | None:
        """The last snapshot that has landed (None before the first), never waiting:
        ``{name: int64 [n_layers]}`` for ``_abi.LAYER_COUNTERS``, plus ``hit_rate`` (1 - misses
        / selected, NaN where nothing was selected) and ``bytes`` (misses x row bytes)."""
        if self._event is not None and self._event.done:
            self._take()
        return self._last

    def read(self, stream: StreamLike | None = None) -> dict:
        """A snapshot taken now on ``stream``, waited for (synchronizes that copy only)."""
        if self._event is not None:
            self._event.synchronize()
            self._take()
        self.snapshot(stream)
        self._event.synchronize()
        self._take()
        return self._last

    def reset(self, stream: StreamLike | None = None) -> None:
        """Zero every counter, queued on ``stream``; a snapshot in flight is waited for and
        dropped, so :meth:`latest` returns nothing from before the reset."""
        if self._event is not None:
            self._event.synchronize()
        self._event = self._last = None
        with as_stream(stream):
            self.device.fill(0)

    def _take(self) -> None:
        v = self._host.astype(np.int64)
        out = {name: v[:, i].copy() for i, name in enumerate(_abi.LAYER_COUNTERS)}
        sel = out["selected"]
        with np.errstate(invalid="ignore", divide="ignore"):
            out["hit_rate"] = np.where(sel > 0, 1.0 - out["misses"] / np.maximum(sel, 1), np.nan)
        out["bytes"] = out["misses"] * self.row_bytes
        self._last, self._event = out, None
