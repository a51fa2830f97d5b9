"""A stream held busy on the device: one thread spinning a number of clock cycles (tests that
need work queued behind a busy stream, benchmarks that time only the device's share of a call:
the host finishes queuing while the spin runs)."""

from __future__ import annotations

import cupy
import numpy as np

_KERNEL: dict = {}


def spin(cycles: int, stream=None) -> None:
    """Queue one thread spinning ``cycles`` clock cycles on ``stream`` (CuPy's current stream
    by default)."""
    k = _KERNEL.get("k")
    if k is None:
        k = _KERNEL["k"] = cupy.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) { }
}''', "spin")
    k((1,), (1,), (np.int64(cycles),), stream=stream)


def spin_ms(ms: float, stream=None) -> None:
    """Hold ``stream`` for about ``ms`` milliseconds (from the device's clock rate)."""
    khz = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["clockRate"]
    spin(int(ms * khz), stream)
