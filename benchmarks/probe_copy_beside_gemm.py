"""Copy kernels beside a cuBLAS GEMM: which shape of copy grid costs the compute least?

The overlap benchmark's layer compute is an fp16 ``[m, 4096] x [4096, 4096]`` matmul (PyTorch,
cuBLAS). Hopper's GEMM kernels are persistent (about one CTA per SM) and take most of an SM's
registers, so a copy block resident on an SM when a GEMM starts delays that SM's CTA until the
block exits. This probe times, on one GPU, for copy kernels of several shapes (threads per
block, register cap, rows in flight per warp, grid):

- ``copy alone``: GB/s of copying random ``--row-bytes`` rows from a mapped pinned pool;
- ``gemm alone``: the matmul loop's time;
- ``together``: the matmul loop (main stream) while the copy loops on a side stream (high or default
  priority) for longer than it: the matmul's slowdown, and the copy's GB/s meanwhile.

The copy is the package's row-copy primitive (``copy_rows_warp`` of ``cu/common.cuh``) over a
flat list of (host row, device row) pairs; ``regs`` is the kernel's register count.

    python benchmarks/probe_copy_beside_gemm.py [--m 2048] [--sm-carveout N] [--out DIR]

``--sm-carveout N`` asks cuBLAS, through PyTorch's experimental SM carveout, to leave N SMs
out of the matmul (a compute that leaves SMs free for the copy), times the matmul alone with it
(its own cost, against the uncapped matmul) and runs copy grids of N blocks beside it, launched
per copy (``each``) or once for the whole loop (``resident``: the copy kernel repeats the rows,
so its blocks hold their SMs throughout and the matmul's CTAs never wait for one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import device_info, write_json  # noqa: E402

from hisparse_cupy import HostKVPool
from hisparse_cupy._kernels import build  # noqa: E402

_SRC = r"""
#include "common.cuh"
using namespace hs;
extern "C" __global__ void PB_BOUNDS
probe_copy(const long long* __restrict__ src, const int* __restrict__ dst, int n,
           const u8* host, u8* dev, int row_bytes, int reps) {
  const int lane = threadIdx.x & 31;
  const long long gw = static_cast<long long>(blockIdx.x) * (PB_THREADS / 32) + threadIdx.x / 32;
  const long long nw = static_cast<long long>(gridDim.x) * (PB_THREADS / 32);
  for (int rep = 0; rep < reps; ++rep)
  for (long long g0 = gw * PB_R; g0 < n; g0 += nw * PB_R) {
    const u8* s[PB_R];
    u8* d[PB_R];
#pragma unroll
    for (int j = 0; j < PB_R; ++j) {
      const long long i = g0 + j;
      s[j] = i < n ? host + src[i] * row_bytes : nullptr;
      d[j] = i < n ? dev + static_cast<long long>(dst[i]) * row_bytes : nullptr;
    }
    copy_rows_warp<PB_R, PB_VPL>(d, s, row_bytes, lane);
  }
}
"""

# (threads per block, register cap (0: none), rows per warp, vectors per lane per row, grid,
# side stream priority: "high" or "default")
VARIANTS = [
    (256, 0, 1, 4, 33, "high"), (256, 0, 1, 4, 33, "default"),
    (32, 32, 1, 2, 528, "high"), (32, 32, 2, 2, 528, "high"),
    (32, 32, 1, 2, 132, "default"), (32, 32, 1, 2, 264, "default"),
    (32, 32, 1, 2, 528, "default"), (32, 32, 1, 2, 1056, "default"),
    (32, 32, 2, 2, 264, "default"), (32, 32, 2, 2, 528, "default"),
    (32, 32, 2, 2, 1056, "default"), (32, 0, 2, 2, 528, "default"),
]


def kernel(threads, maxreg, r, vpl, extra=()):
    """The probe copy kernel of that shape (``extra``: more NVRTC options, e.g. -D macros)."""
    opts = tuple(o for o in build.options()) + tuple(extra) + (
        f"-DPB_THREADS={threads}", f"-DPB_R={r}", f"-DPB_VPL={vpl}",
        # launch bounds override --maxrregcount: a capped variant has none
        *((f"--maxrregcount={maxreg}", "-DPB_BOUNDS=") if maxreg else
          (f"-DPB_BOUNDS=__launch_bounds__({threads})",)))
    mod = cupy.RawModule(code=_SRC, options=opts)
    return mod.get_function("probe_copy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=2048, help="matmul rows (the bench's layer size)")
    ap.add_argument("--row-bytes", type=int, default=656)
    ap.add_argument("--rows", type=int, default=6528, help="rows per copy launch")
    ap.add_argument("--gemms", type=int, default=60, help="matmuls per timed loop")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gemm-only", action="store_true", help="only the matmul loop (profiling)")
    ap.add_argument("--sm-carveout", type=int, default=0, metavar="N",
                    help="leave N SMs out of the matmul (PyTorch's experimental SM carveout)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    info = device_info()
    main_s = cupy.cuda.Stream(non_blocking=True)
    sides = {"high": cupy.cuda.Stream(non_blocking=True, priority=-1000),
             "default": cupy.cuda.Stream(non_blocking=True)}
    side = sides["high"]
    tmain = torch.cuda.ExternalStream(main_s.ptr)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    x = torch.randn(a.m, 4096, device="cuda", dtype=torch.float16, generator=gen)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.float16, generator=gen) * 0.01
    y = torch.empty(a.m, 4096, device="cuda", dtype=torch.float16)

    n_host = (2 << 30) // a.row_bytes
    pool = HostKVPool(1, n_host, a.row_bytes)
    pool.numpy[...] = 7
    rng = np.random.default_rng(0)
    src = cupy.asarray(rng.choice(n_host, a.rows, replace=False).astype(np.int64))
    dst = cupy.asarray(rng.permutation(a.rows).astype(np.int32))
    dev = cupy.zeros((a.rows, a.row_bytes), cupy.uint8)
    host = np.uint64(int(pool.device_ptr(0)))
    nbytes = a.rows * a.row_bytes

    def gemm_loop():
        with torch.cuda.stream(tmain):
            for _ in range(a.gemms):
                torch.matmul(x, w, out=y)

    def copy_loop(k, threads, grid, n_launch, resident=False):
        """n_launch copies of the rows: n_launch launches, or one launch that repeats them
        (``resident``: its blocks stay on their SMs for the whole loop)."""
        for _ in range(1 if resident else n_launch):
            k((grid,), (threads,), (src, dst, np.int32(a.rows), host, dev,
                                    np.int32(a.row_bytes), np.int32(n_launch if resident else 1)),
              stream=side)

    e = [cupy.cuda.Event() for _ in range(4)]

    def timed(fn_main=None, fn_side=None) -> tuple[float, float]:
        """(main ms, side ms), median over iters; both start after a join."""
        tm, ts = [], []
        for i in range(a.iters + 1):
            main_s.synchronize()
            side.synchronize()
            e[0].record(main_s)
            side.wait_event(e[0])
            e[2].record(side)
            if fn_side:
                fn_side()
            e[3].record(side)
            if fn_main:
                fn_main()
            e[1].record(main_s)
            e[1].synchronize()
            e[3].synchronize()
            if i:
                tm.append(cupy.cuda.get_elapsed_time(e[0], e[1]))
                ts.append(cupy.cuda.get_elapsed_time(e[2], e[3]))
        return statistics.median(tm), statistics.median(ts)

    gemm_ms, _ = timed(fn_main=gemm_loop)
    variants = VARIANTS
    gemm_full_ms = gemm_ms
    if a.sm_carveout:
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if setter is None or not 0 < a.sm_carveout < info["sms"]:
            raise SystemExit(f"--sm-carveout needs 0 < N < {info['sms']} and a PyTorch with "
                             "torch._C._set_sm_carveout_experimental (this is "
                             f"{torch.__version__})")
        setter(a.sm_carveout)
        gemm_ms, _ = timed(fn_main=gemm_loop)
        n = a.sm_carveout
        # N blocks: launched per copy, or resident (one launch for the whole loop, so its blocks
        # hold N SMs and the matmul, told to leave N SMs, never waits for an SM)
        variants = [(256, 0, 1, 4, 33, "high"), (256, 0, 1, 4, n, "high"),
                    (256, 0, 2, 4, n, "high"), (512, 0, 2, 4, n, "high"),
                    (256, 0, 1, 4, n, "high", True), (256, 0, 2, 4, n, "high", True),
                    (512, 0, 2, 4, n, "high", True)]
        print(f"SM carveout {n}: matmul loop {gemm_ms:.3f} ms against {gemm_full_ms:.3f} ms on "
              f"every SM ({100 * (gemm_ms / gemm_full_ms - 1):+.1f} %)")
    if a.gemm_only:  # (for a profiler's launch statistics of the matmul's kernel)
        return 0
    print(f"{info['name']}: matmul [{a.m}, 4096] x [4096, 4096] fp16, {a.gemms} per loop: "
          f"{gemm_ms:.3f} ms ({1e3 * gemm_ms / a.gemms:.1f} us each); copy {a.rows} rows of "
          f"{a.row_bytes} B per launch from a 2 GB mapped pool")
    print(f"{'threads':>7} {'maxreg':>6} {'R':>2} {'VPL':>3} {'grid':>5} {'prio':>7} {'regs':>4} "
          f"{'launch':>8} {'copy alone GB/s':>15} {'gemm slowdown':>13} {'copy GB/s beside':>16}")
    rows = []
    for threads, maxreg, r, vpl, g, prio, *res in variants:
        resident = bool(res and res[0])
        side = sides[prio]
        k = kernel(threads, maxreg, r, vpl)
        grid = g
        _, t_alone = timed(fn_side=lambda k=k, t=threads, g=grid: copy_loop(k, t, g, 10))
        alone = 10 * nbytes / t_alone / 1e6
        # side copies for ~1.5x the GEMM loop's time at the alone rate (it slows beside it)
        n_launch = max(2, int(1.5 * gemm_ms / (t_alone / 10)))
        t_main, t_side = timed(fn_main=gemm_loop,
                               fn_side=lambda k=k, t=threads, g=grid, n=n_launch,
                               rs=resident: copy_loop(k, t, g, n, rs))
        # copy rate while the GEMM ran: bytes done by the GEMM's end, estimated from the side
        # loop's time beyond the GEMM at the alone rate
        rest = max(0.0, t_side - t_main)
        beside = max(0.0, n_launch * nbytes - rest * 1e-3 * alone * 1e9) / (t_main * 1e-3) / 1e9
        slow = t_main / gemm_full_ms - 1.0  # against the matmul on every SM
        rows.append({"threads": threads, "maxreg": maxreg, "rows_per_warp": r, "vpl": vpl,
                     "grid": grid, "side_priority": prio, "regs": k.num_regs,
                     "resident": resident,
                     "copy_alone_GBps": alone,
                     "gemm_slowdown": slow, "copy_beside_GBps": beside,
                     "gemm_ms": t_main, "side_ms": t_side, "launches": n_launch})
        print(f"{threads:>7} {maxreg:>6} {r:>2} {vpl:>3} {grid:>5} {prio:>7} {k.num_regs:>4} "
              f"{'resident' if resident else 'each':>8} {alone:>15.1f} {slow * 100:>12.1f}% "
              f"{beside:>16.1f}", flush=True)
    ok = bool((cupy.asnumpy(dev) == 7).all())
    print(f"bytes: {'ok' if ok else 'WRONG'}")
    if a.out:
        name = f"probe_copy_beside_gemm{f'_carveout{a.sm_carveout}' if a.sm_carveout else ''}"
        write_json(a.out, f"{name}.json",
                   {"device": info, "args": vars(a), "gemm_alone_ms": gemm_ms,
                    "gemm_every_sm_ms": gemm_full_ms, "rows": rows,
                    "bytes_ok": ok})
    pool.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
