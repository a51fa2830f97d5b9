"""Host time of the package's launch call against a no-op CUDA driver (no GPU needed).

The launch path (``hisparse_cupy/_kernels/launch.py``) reaches the driver's ``cuLaunchKernelEx``
through cuda-python's ``cuda.bindings.driver``. On a GPU machine ``tools/host_overhead.py``
times whole calls, where the driver's own work and the machine's noise (0.5 to 2 us between runs
on one H100) hide a wrapper's cost. Here a stand-in ``libcuda.so.1`` whose every entry point
returns success at once (built with ``cc``, loaded before cuda-python looks for the driver)
leaves only the Python side: the cached ``CUlaunchConfig``'s grid and stream fields set when
they change, the argument block's address written, the binding's call and its result checked.

Printed, per launch (median of ``--reps`` runs of ``--calls`` launches): the package's
``_LaunchConfig.launch`` on one stream and on two streams alternating (every call sets the
stream), and the floor, a bare ``ctypes`` call of the same no-op entry point with a prebuilt
struct. To compare two trees, run this once per checkout (``PYTHONPATH`` picks the package):
the launch before (its own ctypes structs) against the bindings, cuda-bindings 13.3.1, on
this project's 2-core CPU machine, medians of six alternating runs: 0.837 against 0.929 us on
one stream, 0.958 against 1.082 us alternating (``benchmarks/results/launch_stub_2026-12-08/``).

    python tools/launch_overhead_stub.py [--calls 200000] [--reps 7] [--json FILE]

Never run it in a process that uses a real GPU: the stand-in takes the driver's name.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_STUB = r"""
#include <string.h>
typedef int CUresult;
typedef struct { int id; int pad; unsigned value[16]; } Attr;  /* CUlaunchAttribute */
typedef struct {  /* CUlaunchConfig (cuda.h, CUDA 12.0+) */
  unsigned grid[3], block[3], smem; void* stream; Attr* attrs; unsigned n_attrs;
} Config;
/* what the last cuLaunchKernelEx got: grid x y z, block x, shared memory, stream, attribute
   count, first attribute's id and first value word, function, kernelParams[0], extra */
long long hs_last[12];
static CUresult ok(void) { return 0; }
CUresult cuLaunchKernelEx(const Config* c, void* f, void** a, void** e);
CUresult cuGetErrorName(int e, const char** s);
CUresult cuOccupancyMaxActiveClusters(int* n, void* f, const void* c);
/* the bindings look every entry point up here: this file's own, or one that succeeds at once */
static void* lookup(const char* s) {
  if (strcmp(s, "cuLaunchKernelEx") == 0) return (void*)cuLaunchKernelEx;
  if (strcmp(s, "cuGetErrorName") == 0) return (void*)cuGetErrorName;
  if (strcmp(s, "cuOccupancyMaxActiveClusters") == 0) return (void*)cuOccupancyMaxActiveClusters;
  return (void*)ok; }
CUresult cuGetProcAddress_v2(const char* s, void** p, int v, unsigned long long f, int* st) {
  (void)v; (void)f; *p = lookup(s); if (st) *st = 0; return 0; }  /* 0: found */
CUresult cuGetProcAddress(const char* s, void** p, int v, unsigned long long f) {
  (void)v; (void)f; *p = lookup(s); return 0; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
CUresult cuInit(unsigned f) { (void)f; return 0; }
CUresult cuLaunchKernelEx(const Config* c, void* f, void** a, void** e) {
  hs_last[0] = c->grid[0]; hs_last[1] = c->grid[1]; hs_last[2] = c->grid[2];
  hs_last[3] = c->block[0]; hs_last[4] = c->smem; hs_last[5] = (long long)c->stream;
  hs_last[6] = c->n_attrs; hs_last[7] = c->n_attrs ? c->attrs[0].id : -1;
  hs_last[8] = c->n_attrs ? c->attrs[0].value[0] : -1; hs_last[9] = (long long)f;
  hs_last[10] = a ? (long long)a[0] : 0; hs_last[11] = (long long)e;
  return 0; }
CUresult cuGetErrorName(int e, const char** s) { (void)e; *s = "stub"; return 0; }
CUresult cuOccupancyMaxActiveClusters(int* n, void* f, const void* c) {
  (void)f; (void)c; *n = 1; return 0; }
"""


def stub_driver(where: Path) -> ctypes.CDLL:
    """Build the stand-in driver in ``where`` and load it under the driver's soname, so the
    bindings' ``dlopen("libcuda.so.1")`` finds it loaded. Its ``hs_last`` (int64 ``[12]``)
    holds what the last ``cuLaunchKernelEx`` got (``tests/test_launch.py`` reads it)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise SystemExit("launch_overhead_stub: needs a C compiler (cc, or CC=...)")
    src, lib = where / "stub.c", where / "libcuda.so.1"
    src.write_text(_STUB)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib),
                    str(src)], check=True)
    return ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def _per_call(fn, calls: int, reps: int) -> float:
    """Median over ``reps`` of the mean ns per call of ``fn(i)`` over ``calls`` calls."""
    fn(0)
    out = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        out.append((time.perf_counter_ns() - t) / calls)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        stub = stub_driver(Path(d))
        from cuda.bindings import driver as cu

        from hisparse_cupy._kernels import launch

        cfg = launch._LaunchConfig((1024, 1, 1), 4096, True)
        # the kernel handle as the tree's Launcher holds it (0.1.0's ctypes path: an int)
        func = cu.CUfunction(0x1234) if hasattr(launch, "_cu") else 0x1234
        grid = (64, 1, 1)
        raw = stub.cuLaunchKernelEx
        raw.argtypes, raw.restype = [ctypes.c_void_p] * 4, ctypes.c_int
        struct = ctypes.create_string_buffer(64)
        args = (ctypes.c_void_p * 1)(0x1000)
        res = {
            "one stream": _per_call(lambda i: cfg.launch(func, grid, 7, 0x1000),
                                    a.calls, a.reps),
            "two streams alternating": _per_call(
                lambda i: cfg.launch(func, grid, 7 + 2 * (i & 1), 0x1000), a.calls, a.reps),
            "floor (bare ctypes call)": _per_call(
                lambda i: raw(struct, 0x1234, args, None), a.calls, a.reps),
        }
    import cuda.bindings

    print(f"launch host time against a no-op driver (cuda-bindings "
          f"{getattr(cuda.bindings, '__version__', '?')}, Python {sys.version.split()[0]}), "
          f"median of {a.reps} x {a.calls} calls:")
    for k, v in res.items():
        print(f"  {k:26s} {v / 1000:.3f} us")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({k: v / 1000 for k, v in res.items()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
