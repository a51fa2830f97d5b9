"""Does cuBLAS honour an SM-count target? Time of one bf16 matmul per target.

The decode loop's matmul (``hisparse_cupy.demo._model.Gemm``: ``cublasGemmEx`` through ctypes,
its own handle) with ``cublasSetSmCountTarget`` = 0 (every SM), 124, 100, 66 and 0 again:
``[2880, 4096] x [4096, 4096]``, 10 warm-up calls, then the median over 5 event pairs of the
mean of 50 back-to-back calls. A target that is honoured shows as time growing like
SMs / target. (PyTorch's SM carveout is not applied to its Hopper matmul: benchmarks/NOTES.md,
"A GEMM that leaves SMs to the copy".)

    python benchmarks/probe_gemm_sm_target.py
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hisparse_cupy.demo._model import Gemm  # noqa: E402


def main() -> int:
    g = Gemm(None)
    print(g.kind)
    if g._lib is None:
        return 1
    lib, h = g._lib, g._h
    m, n = 2880, 4096
    a = cupy.random.random((m, n), dtype=cupy.float32).astype(cupy.float16).view(cupy.uint16)
    b = cupy.random.random((n, n), dtype=cupy.float32).astype(cupy.float16).view(cupy.uint16)
    c = cupy.empty((m, n), cupy.uint16)
    s = cupy.cuda.Stream(non_blocking=True)
    got = ctypes.c_int()
    for tgt in (0, 124, 100, 66, 0):
        g.set_sm_target(tgt)
        lib.cublasGetSmCountTarget(h, ctypes.byref(got))
        for _ in range(10):
            g(a, b, c, s)
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        ts = []
        for _ in range(5):
            e0.record(s)
            for _ in range(50):
                g(a, b, c, s)
            e1.record(s)
            e1.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(e0, e1) / 50)
        print(f"sm target {tgt} (get {got.value}): {np.median(ts) * 1e3:.1f} us per gemm")
    g.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
