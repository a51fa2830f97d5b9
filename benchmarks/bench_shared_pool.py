"""One host pool for every GPU of a host: what N GPUs reading ONE shared pinned pool at once get.

The parent creates a host pool in POSIX shared memory (``HostKVPool(shared_name=...)``) and
fills it; one process per GPU attaches it (each registers the same pages, mapped for its own
GPU), which is what tensor-parallel ranks do. Each process times, on its GPU:

- ``memcpy``: ``cudaMemcpyAsync`` host -> device of the same number of bytes from the pool's
  pages (contiguous): the link's ceiling for this GPU;
- ``gather``: the swap's copy kernel (``replay_plan``, zero-copy loads) of ``--rows`` random
  rows of the pool into device rows, bytes checked against the pool afterwards;

first alone (the GPUs one after another), then all GPUs at once (started together behind a
barrier). Reported: per GPU GB/s alone and together, the aggregate (all bytes over the longest
GPU's time), and the host memory pinned: one pool for the host, against one per GPU without
sharing. Every figure is a median of ``--iters`` timed calls after a warm-up.

    python benchmarks/bench_shared_pool.py [--gpus N] [--pool-gb 4] [--row-bytes 1152] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _fill(pool) -> None:
    """Every row of the pool: the self-check's pattern of its index (checked after gathers)."""
    from hisparse_cupy.testing.selfcheck import pattern

    rows = pool.numpy.reshape(-1, pool.row_bytes)
    step = 1 << 16
    for i in range(0, rows.shape[0], step):
        ids = np.arange(i, min(i + step, rows.shape[0]))
        rows[i: i + len(ids)] = pattern(0, ids, pool.row_bytes)


def _worker(gpu: int, name: str, args, barrier, out) -> None:
    try:
        import cupy

        from hisparse_cupy import HostKVPool, MissPlan, replay_plan

        cupy.cuda.Device(gpu).use()
        t0 = time.perf_counter()
        pool = HostKVPool.attach(name)
        t_attach = time.perf_counter() - t0
        s = cupy.cuda.Stream(non_blocking=True)
        n = args.rows
        nbytes = n * pool.row_bytes
        rng = np.random.default_rng(gpu)
        with s:
            dev = cupy.empty((n, pool.row_bytes), cupy.uint8)
            plan = MissPlan(1, n)
            src = rng.choice(pool.n_rows, n, replace=False).astype(np.int64)
            plan.src[0] = cupy.asarray(src)
            plan.dst[0] = cupy.arange(n, dtype=cupy.int32)
            plan.count[0] = n
        host = pool.numpy[0]
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()

        def gather():
            replay_plan(plan, 1, device_rows=dev, pool=pool, layer=0, stream=s)

        def memcpy():
            cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice, s.ptr)

        def timed(fn) -> float:
            """Median GB/s of ``args.iters`` calls, one event pair each."""
            for _ in range(3):
                fn()
            ms = []
            for _ in range(args.iters):
                e0.record(s)
                fn()
                e1.record(s)
                e1.synchronize()
                ms.append(cupy.cuda.get_elapsed_time(e0, e1))
            return nbytes / (statistics.median(ms) * 1e-3) / 1e9

        def timed_block(fn) -> tuple[float, float]:
            """(GB/s, seconds) of ``args.iters`` calls back to back."""
            e0.record(s)
            for _ in range(args.iters):
                fn()
            e1.record(s)
            e1.synchronize()
            sec = cupy.cuda.get_elapsed_time(e0, e1) * 1e-3
            return args.iters * nbytes / sec / 1e9, sec

        res = {"gpu": gpu, "attach_s": t_attach}
        for i in range(args.gpus):  # alone: one GPU after another
            barrier.wait()
            if i == gpu:
                res["memcpy_alone"] = timed(memcpy)
                res["gather_alone"] = timed(gather)
        gather()
        s.synchronize()
        got = cupy.asnumpy(dev)
        res["bytes_ok"] = bool((got == host[src]).all())
        for kind, fn in (("memcpy", memcpy), ("gather", gather)):  # together
            fn()
            s.synchronize()
            barrier.wait()
            res[f"{kind}_together"], res[f"{kind}_together_s"] = timed_block(fn)
        barrier.wait()
        pool.close()
        out.put(res)
    except Exception as e:  # noqa: BLE001 - reported by the parent
        out.put({"gpu": gpu, "error": f"{type(e).__name__}: {e}"})
        barrier.abort()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=None, help="GPUs (default: all)")
    ap.add_argument("--pool-gb", type=float, default=4.0)
    ap.add_argument("--row-bytes", type=int, default=1152)
    ap.add_argument("--rows", type=int, default=65536, help="rows per gather call")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="(the default sizes are quick)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy

    from hisparse_cupy import HostKVPool

    n_gpu = cupy.cuda.runtime.getDeviceCount()
    args.gpus = args.gpus or n_gpu
    if args.gpus > n_gpu:
        print(f"bench_shared_pool: {args.gpus} GPUs asked, {n_gpu} present")
        return 2
    n_rows = int(args.pool_gb * 1e9) // args.row_bytes
    name = f"hs-bench-{os.getpid()}"
    t0 = time.perf_counter()
    with HostKVPool(1, n_rows, args.row_bytes, shared_name=name) as pool:
        t_create = time.perf_counter() - t0
        _fill(pool)
        ctx = mp.get_context("spawn")
        barrier, out = ctx.Barrier(args.gpus), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(g, name, args, barrier, out))
                 for g in range(args.gpus)]
        for p in procs:
            p.start()
        res = sorted((out.get(timeout=600) for _ in procs), key=lambda r: r["gpu"])
        for p in procs:
            p.join()
    bad = [r for r in res if "error" in r]
    if bad:
        print(f"bench_shared_pool: {bad}")
        return 1
    gb = n_rows * args.row_bytes / 1e9
    agg = {k: args.gpus * args.iters * args.rows * args.row_bytes / 1e9 /
           max(r[f"{k}_together_s"] for r in res) for k in ("memcpy", "gather")}
    print(f"one host pool of {gb:.1f} GB in POSIX shared memory (created and registered in "
          f"{t_create:.1f} s), {args.gpus} GPU(s), {args.rows} random rows of "
          f"{args.row_bytes} B per gather call, median of {args.iters}")
    print(f"{'gpu':>3} {'attach s':>9} {'memcpy alone':>13} {'gather alone':>13} "
          f"{'memcpy together':>16} {'gather together':>16} {'bytes':>6}")
    for r in res:
        print(f"{r['gpu']:>3} {r['attach_s']:>9.2f} {r['memcpy_alone']:>9.1f} GB/s "
              f"{r['gather_alone']:>8.1f} GB/s {r['memcpy_together']:>11.1f} GB/s "
              f"{r['gather_together']:>11.1f} GB/s {'ok' if r['bytes_ok'] else 'WRONG':>6}")
    print(f"aggregate, all GPUs at once: memcpy {agg['memcpy']:.1f} GB/s, gather "
          f"{agg['gather']:.1f} GB/s; host memory pinned: {gb:.1f} GB (one pool), a pool per "
          f"GPU would pin {args.gpus * gb:.1f} GB")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"bench_shared_pool_{args.gpus}gpu.json"
        path.write_text(json.dumps({"args": vars(args), "pool_gb": gb, "create_s": t_create,
                                    "per_gpu": res, "aggregate_gbps": agg,
                                    "host_gb_pinned": gb,
                                    "host_gb_pinned_without_sharing": args.gpus * gb},
                                   indent=1))
        print(f"json: {path}")
    return 0 if all(r["bytes_ok"] for r in res) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
