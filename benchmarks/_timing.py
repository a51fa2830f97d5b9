"""Timing helpers shared by the benchmarks: CuPy events, warm-up, medians, ceilings."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import cupy
import numpy as np


def time_calls(fn: Callable[[int], None], *, iters: int, warmup: int = 3,
               setup: Callable[[int], None] | None = None,
               stream: cupy.cuda.Stream | None = None) -> list[float]:
    """Microseconds of ``fn(i)`` for each of ``iters`` calls, timed with events on ``stream``.

    ``setup(i)`` (not timed) runs before each call on the same stream, e.g. to restore state or
    pick the i-th of several rotated input sets. Warm-up calls are not recorded.
    """
    stream = stream or cupy.cuda.get_current_stream()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    out = []
    with stream:
        for i in range(warmup + iters):
            if setup is not None:
                setup(i)
            e0.record(stream)
            fn(i)
            e1.record(stream)
            e1.synchronize()
            if i >= warmup:
                out.append(cupy.cuda.get_elapsed_time(e0, e1) * 1000.0)
    return out


def time_graph_chain(enqueue: Callable[[int], None], base: Callable[[int], None] | None,
                     *, n: int, iters: int, stream: cupy.cuda.Stream) -> dict:
    """Marginal device time of ``enqueue`` when ``n`` calls run back to back in one CUDA graph.

    Captures ``base(i); enqueue(i)`` for i < n into one graph and ``base(i)`` alone into
    another (``base`` restores state or is None), times both graphs with events and returns
    ``summary`` of ``(t_chain - t_base) / n`` over ``iters`` replays: the per-call time inside
    a captured decode step, with launch latency overlapped as it is there.
    """
    def capture(with_call: bool):
        with stream:
            stream.begin_capture()
            for i in range(n):
                if base is not None:
                    base(i)
                if with_call:
                    enqueue(i)
            return stream.end_capture()

    g_all = capture(True)
    g_base = capture(False) if base is not None else None
    t_all = time_calls(lambda i: g_all.launch(stream), iters=iters, stream=stream)
    if g_base is None:
        return summary([t / n for t in t_all])
    t_base = time_calls(lambda i: g_base.launch(stream), iters=iters, stream=stream)
    tb = statistics.median(t_base)
    return summary([(t - tb) / n for t in t_all])


def summary(us: list[float]) -> dict:
    """Median and spread (p10, p90, min) of a list of microsecond timings."""
    a = np.asarray(us)
    return {"median_us": float(statistics.median(us)), "p10_us": float(np.percentile(a, 10)),
            "p90_us": float(np.percentile(a, 90)), "min_us": float(a.min()), "n": int(a.size)}


def memcpy_h2d(host_buf: np.ndarray, nbytes: int, *, iters: int = 20, chain: int = 8,
               stream: cupy.cuda.Stream | None = None) -> tuple[dict, dict]:
    """``cudaMemcpyAsync`` of ``nbytes`` from pinned ``host_buf`` to the device.

    Returns (one copy per event pair, marginal time of ``chain`` copies back to back in a
    graph), both ``summary`` dicts in microseconds. Source offsets rotate over the buffer.
    """
    stream = stream or cupy.cuda.get_current_stream()
    nbytes = max(int(nbytes), 1)
    dst = cupy.empty(nbytes, cupy.uint8)
    src = host_buf.reshape(-1).view(np.uint8)
    if src.nbytes < nbytes:
        raise ValueError("host buffer smaller than the copy")
    kind = cupy.cuda.runtime.memcpyHostToDevice
    offsets = [(k * 4096 * 1024) % max(src.nbytes - nbytes, 1) // 256 * 256 for k in range(7)]

    def fn(i):
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.ctypes.data + offsets[i % 7], nbytes,
                                      kind, stream.ptr)

    single = summary(time_calls(fn, iters=iters, stream=stream))
    return single, time_graph_chain(fn, None, n=chain, iters=iters, stream=stream)


_EMPTY = None


def empty_graph_floor(stream: cupy.cuda.Stream, *, iters: int = 50) -> dict:
    """Event-timed replay of a graph holding one empty kernel: the floor of any single call."""
    global _EMPTY
    if _EMPTY is None:
        _EMPTY = cupy.RawKernel('extern "C" __global__ void hs_empty() {}', "hs_empty")
    with stream:
        stream.begin_capture()
        _EMPTY((1,), (32,), (), stream=stream)
        g = stream.end_capture()
    return summary(time_calls(lambda i: g.launch(stream), iters=iters, stream=stream))


def write_json(out_dir: str, name: str, payload: dict) -> Path:
    p = Path(out_dir) / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=1))
    return p


def device_info() -> dict:
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    return {"name": props["name"].decode(), "cc": dev.compute_capability,
            "sms": props["multiProcessorCount"], "cupy": cupy.__version__,
            "driver": cupy.cuda.runtime.driverGetVersion()}
