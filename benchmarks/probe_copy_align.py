"""Zero-copy row gathers with and without line-aligned reads (``HS_COPY_ROTATE``).

The package's copy primitive (``copy_rows_warp``, ``cu/common.cuh``) reads each row from its
first 128-byte line boundary on, the vectors before it last, so that a warp's 512-byte load
covers 4 whole lines instead of straddling 5. This probe measures what that buys: for each row
size, GB/s of copying ``--rows`` random rows from a 1 GB mapped pinned pool into device rows, the
kernel built with ``-DHS_COPY_ROTATE=0`` (reads from each row's start) and ``=1``, in three
shapes (the planned copy's 8 warps x 1 row, 8 warps x 4 rows in flight, one warp x 2 rows);
the same bytes by ``cudaMemcpyAsync`` (one contiguous block) are the ceiling. Every copy's bytes
are checked against the pool.

    python benchmarks/probe_copy_align.py [--rows 65536] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import device_info, memcpy_h2d, summary, time_calls, write_json  # noqa: E402
from probe_copy_beside_gemm import kernel  # noqa: E402

from hisparse_cupy import HostKVPool  # noqa: E402

# (threads per block, rows per warp, vectors per lane per row, blocks per SM)
SHAPES = [(256, 1, 4, 1), (256, 4, 2, 1), (32, 2, 2, 4)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=65536, help="rows per copy")
    ap.add_argument("--row-bytes", type=int, nargs="*", default=[576, 656, 1152])
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    info = device_info()
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    results, ok = [], True
    print(f"{info['name']}: {a.rows} random rows per copy from a 1 GB mapped pool; GB/s, median "
          f"of {a.iters}")
    print(f"{'row B':>5} {'memcpy':>7} {'threads':>7} {'R':>2} {'VPL':>3} {'grid':>5} "
          f"{'from start':>10} {'line-aligned':>12} {'gain':>6}")
    for rb in a.row_bytes:
        n_host = (1 << 30) // rb
        pool = HostKVPool(1, n_host, rb)
        host = pool.layer(0)
        host.reshape(-1)[:] = np.frombuffer(rng.bytes(host.size), np.uint8)
        src_np = rng.choice(n_host, a.rows, replace=False).astype(np.int64)
        src = cupy.asarray(src_np)
        dst = cupy.asarray(rng.permutation(a.rows).astype(np.int32))
        dev = cupy.empty((a.rows, rb), cupy.uint8)
        want = host[src_np]
        nbytes = a.rows * rb
        mc, _ = memcpy_h2d(pool.numpy, nbytes, iters=a.iters, stream=stream)
        memcpy_gbps = nbytes / mc["median_us"] / 1e3
        base = np.uint64(int(pool.device_ptr(0)))
        for threads, r, vpl, per_sm in SHAPES:
            grid = info["sms"] * per_sm
            gbps = {}
            for rot in (0, 1):
                k = kernel(threads, 0, r, vpl, extra=(f"-DHS_COPY_ROTATE={rot}",))

                args = (src, dst, np.int32(a.rows), base, dev, np.int32(rb), np.int32(1))

                def call(i, k=k, threads=threads, grid=grid, args=args):
                    k((grid,), (threads,), args, stream=stream)

                dev.fill(0)
                t = summary(time_calls(call, iters=a.iters, stream=stream))
                stream.synchronize()
                good = bool((cupy.asnumpy(dev)[cupy.asnumpy(dst)] == want).all())
                ok &= good
                gbps[rot] = nbytes / t["median_us"] / 1e3
                results.append({"row_bytes": rb, "threads": threads, "rows_per_warp": r,
                                "vpl": vpl, "grid": grid, "rotate": rot, "copy": t,
                                "GBps": gbps[rot], "memcpy_GBps": memcpy_gbps,
                                "bytes_ok": good})
            print(f"{rb:>5} {memcpy_gbps:>7.1f} {threads:>7} {r:>2} {vpl:>3} {grid:>5} "
                  f"{gbps[0]:>10.1f} {gbps[1]:>12.1f} {100 * (gbps[1] / gbps[0] - 1):>+5.1f}%",
                  flush=True)
        pool.close()
    print(f"bytes: {'ok' if ok else 'WRONG'}")
    if a.out:
        write_json(a.out, "probe_copy_align.json", {"device": info, "args": vars(a),
                                                     "results": results, "bytes_ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
