"""A zero-copy gather of random host rows against the host pool's size: is a full layer's own
copy bound by latency, or by the GPU's address translation of a large pinned pool?

On an H100 at 128k, n = 8, every request sparse (`tools/timeline_step.py`,
`benchmarks/results/fp8_h100_2026-12-07/sweep/timeline_128k_b8.json`), a full layer's own
planned copy of about 1,100 rows (8 requests x 137 misses of 656 B) took 70 us, about 10 GB/s.
The `info` ceiling, random rows out of a 43 MB pool, is 44.6 GB/s. There the rows lie spread
over a 52 GB pinned pool, so nearly every row may be a page the GPU has not translated yet.

This probe times the package's planned copy (one layer, one warp a row, the default grid) of N
rows out of pools of several sizes. The rows are drawn either uniformly over the pool or
clustered in a window of W MB. Each call in a graph of 8 reads its own row set, so no call
finds the translations or cache lines of the call before it, as in a decode step, where every
layer reads other rows. The first call of every point is checked byte for byte. The ceiling,
from the same pool in the same run, is a `cudaMemcpyAsync` of the same bytes, contiguous.

    PYTHONPATH=. python benchmarks/probe_gather_footprint.py [--pool-gb 0.05 1 8 32]
        [--rows 256 1100 4096] [--window-mb 2 64] [--iters 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_info, memcpy_h2d, time_graph_chain, write_json  # noqa: E402

from hisparse_cupy import HostKVPool  # noqa: E402
from hisparse_cupy._kernels.plan import array_rows, copy_rows  # noqa: E402
from hisparse_cupy._kernels.rows import pool_rows  # noqa: E402

ROW = 656
CHAIN = 8


def _row_sets(rng, n_rows: int, n: int, window_rows: int | None) -> list[np.ndarray]:
    """CHAIN disjoint-ish sets of ``n`` distinct rows: uniform over the pool, or each inside
    its own window of ``window_rows`` rows at a random place."""
    out = []
    for _ in range(CHAIN):
        if window_rows is None:
            out.append(rng.choice(n_rows, n, replace=False))
        else:
            start = int(rng.integers(0, n_rows - window_rows + 1))
            out.append(start + rng.choice(window_rows, n, replace=False))
    return [np.sort(r).astype(np.int64) for r in out]


def point(pool: HostKVPool, n: int, window_mb: float | None, rng, iters: int,
          stream: cupy.cuda.Stream) -> dict:
    n_rows = pool.n_rows
    window = None if window_mb is None else max(n, int(window_mb * 2**20) // ROW)
    if window is not None and window > n_rows:
        return {"skipped": f"window of {window} rows > the pool's {n_rows}"}
    sets = _row_sets(rng, n_rows, n, window)
    host = pool.numpy[0]
    for rows in sets:  # bytes that name their row
        host[rows] = (rows[:, None] * 131 + np.arange(ROW)[None]).astype(np.uint8)
    with stream:
        src = [cupy.asarray(r[None]) for r in sets]
        dst_idx = cupy.arange(n, dtype=cupy.int32)[None]
        count = cupy.full(1, n, cupy.int32)
        out = cupy.full((n, ROW), 0xA5, cupy.uint8)
    src_rows, dst_rows = pool_rows(pool, 0), array_rows(out)

    def enqueue(i: int) -> None:
        copy_rows(src[i % CHAIN], dst_idx, count, src=src_rows, dst=dst_rows, row_bytes=ROW,
                  stream=stream, batch=1)

    enqueue(0)
    stream.synchronize()
    ok = bool((cupy.asnumpy(out) == host[sets[0]]).all())
    t = time_graph_chain(enqueue, None, n=CHAIN, iters=iters, stream=stream)
    nbytes = n * ROW
    return {"rows": n, "window_mb": window_mb, "bytes_ok": ok, "us": t,
            "GBps": nbytes / (t["median_us"] * 1e-6) / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool-gb", type=float, nargs="+", default=[0.05, 1, 8, 32])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 1100, 4096])
    ap.add_argument("--window-mb", type=float, nargs="+", default=[2, 64])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="directory for probe_gather_footprint.json")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    res, bad = [], 0
    print(f"{'pool GB':>8} {'rows':>6} {'layout':>10} {'us':>8} {'GB/s':>6} {'memcpy us':>10}")
    for gb in a.pool_gb:
        pool = HostKVPool(1, max(int(gb * 1e9) // ROW, max(a.rows)), ROW)
        try:
            for n in a.rows:
                ceiling = memcpy_h2d(pool.numpy, n * ROW, stream=stream)[1]  # in a graph of 8
                for w in [None, *a.window_mb]:
                    r = point(pool, n, w, rng, a.iters, stream)
                    r.update(pool_gb=gb, memcpy=ceiling)
                    res.append(r)
                    if "skipped" in r:
                        continue
                    bad += not r["bytes_ok"]
                    layout = "uniform" if w is None else f"{w:g} MB"
                    print(f"{gb:8.2f} {n:6d} {layout:>10} {r['us']['median_us']:8.1f} "
                          f"{r['GBps']:6.1f} {ceiling['median_us']:10.1f}"
                          + ("" if r["bytes_ok"] else "  WRONG BYTES"))
        finally:
            pool.close()
    if a.out:
        print("json:", write_json(a.out, "probe_gather_footprint.json",
                                  {"device": device_info(), "row_bytes": ROW, "chain": CHAIN,
                                   "results": res}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
