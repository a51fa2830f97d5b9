"""Helpers shared by the tests: byte patterns and state builders."""

from __future__ import annotations

# one copy of each, in the package's test harness (shared with the self-check)
from hisparse_cupy.testing.twin import lru_state, pattern  # noqa: F401


def stream_kinds(cupy, *, every: bool = False):
    """(name, what a call is given, the CuPy stream it is) for each stream kind a call takes:
    a CuPy stream, an ExternalStream, an int handle, a ``__cuda_stream__`` object; with
    ``every``, also a blocking CuPy stream, a torch stream (if torch sees the GPU) and the
    legacy default stream (``None``: CuPy's current stream)."""
    import warnings

    def ext(ptr):
        with warnings.catch_warnings():  # deprecated in CuPy 14, still what engines pass
            warnings.simplefilter("ignore", DeprecationWarning)
            return cupy.cuda.ExternalStream(ptr)

    class Proto:
        def __init__(self, st):
            self.st = st

        def __cuda_stream__(self):
            return (0, self.st.ptr)

    new = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
    kinds = [("cupy.Stream", new[0], new[0]), ("cupy.ExternalStream", ext(new[1].ptr), new[1]),
             ("int handle", new[2].ptr, new[2]), ("__cuda_stream__", Proto(new[3]), new[3])]
    if every:
        s = cupy.cuda.Stream()
        kinds.append(("cupy blocking", s, s))
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and torch.cuda.is_available():
            ts = torch.cuda.Stream()
            kinds.append(("torch", ts, ext(ts.cuda_stream)))
        kinds.append(("legacy default", None, cupy.cuda.Stream.null))
    return kinds


def stale_pool(cupy) -> None:
    """Fill CuPy's memory pool with garbage for CuPy's current stream: every unused block
    freed, then blocks of 512 B .. 4 MiB (four of each size) filled with 0xF9 bytes (-7 as
    int8, a negative int32) and freed. The next allocations on that stream get them back, so
    an array read on another stream before its fill there has run reads garbage, not zeros."""
    cupy.get_default_memory_pool().free_all_blocks()
    junk = [cupy.full(1 << e, -7, cupy.int8) for e in range(9, 23) for _ in range(4)]
    cupy.cuda.get_current_stream().synchronize()
    del junk


def spin(cupy, cycles: int) -> None:
    """Queue one thread spinning ``cycles`` clock cycles on CuPy's current stream (a stream
    held busy, so that work queued after it visibly waits)."""
    from hisparse_cupy.testing._spin import spin as queue

    queue(cycles)
