"""A captured decode step whose side-stream kernels keep their stream's priority.

Stream capture records each kernel's stream priority in its graph node, but a graph
instantiated the default way (CuPy's ``Graph.launch``, ``torch.cuda.CUDAGraph``) runs every
node at the priority of the stream it is launched into: inside such a graph the
:class:`~hisparse_cupy.Prefetcher`'s replays (captured on its high-priority side stream) queue
behind the compute's blocks like any other kernel. :class:`PriorityGraph` instantiates the
graph with ``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY``, so each node runs at the
priority it was captured with (``benchmarks/NOTES.md``, "Graph nodes keep their priority",
has what it changes on the H200).
"""

from __future__ import annotations

import ctypes

import cupy

from .._launch import as_stream, check, driver_fn

__all__ = ["PriorityGraph"]

_USE_NODE_PRIORITY = 8  # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY


class PriorityGraph:
    """An executable graph of a captured step, instantiated so that every kernel node runs at
    the priority of the stream it was captured on.

    Parameters
    ----------
    graph : cupy.cuda.Graph or int
        What ``stream.end_capture()`` returned, or a raw ``CUgraph`` handle (an int; the
        caller keeps that graph alive while this object exists). The graph itself is not
        changed; a CuPy graph's own ``launch`` still runs it the default way.

    Raises
    ------
    TypeError
        ``graph`` is neither.
    RuntimeError
        The driver refuses (``CUDA_ERROR_NOT_SUPPORTED`` for a graph with a kernel that cannot
        take a per-node priority; measured on the H200: a cuBLAS bf16 matmul ``[3840, 4096] x
        [4096, 4096]`` through ``cublasGemmEx``, while smaller ones, PyTorch's matmul of that
        size and every kernel of this package instantiate). Launch such a graph as captured.

    Launch with :meth:`launch`; :meth:`close` (or garbage collection) frees the executable.
    """

    def __init__(self, graph):
        if isinstance(graph, cupy.cuda.Graph):
            handle = graph.graph
            self._graph = graph  # keeps the CUgraph alive
        elif isinstance(graph, int) and not isinstance(graph, bool) and graph > 0:
            handle, self._graph = graph, None
        else:
            raise TypeError(f"graph must be a cupy.cuda.Graph (stream.end_capture()) or a "
                            f"CUgraph handle (int > 0), got {type(graph).__name__}")
        self._launch = driver_fn("cuGraphLaunch", 2)
        self._destroy = driver_fn("cuGraphExecDestroy", 1)
        exe = ctypes.c_void_p()
        check(driver_fn("cuGraphInstantiateWithFlags", 3)(
            ctypes.byref(exe), ctypes.c_void_p(handle), ctypes.c_void_p(_USE_NODE_PRIORITY)),
            "cuGraphInstantiateWithFlags(CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)")
        self._exec = exe.value

    def launch(self, stream=None) -> None:
        """Queue one run of the graph on ``stream`` (any stream :func:`as_stream` takes)."""
        if self._exec is None:
            raise RuntimeError("this PriorityGraph was closed")
        check(self._launch(ctypes.c_void_p(self._exec), ctypes.c_void_p(as_stream(stream).ptr)),
              "cuGraphLaunch")

    def close(self) -> None:
        """Free the executable graph (queued runs finish first: the driver defers it)."""
        exe, self._exec = getattr(self, "_exec", None), None
        if exe is not None:
            self._destroy(ctypes.c_void_p(exe))

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to free
            pass
