"""Host (Python) time of the eager calls an engine makes per layer and per step, and of one
launch through each launch path.

    python tools/host_overhead.py [--json PATH]

Per call, median over 5 rounds of 200 calls (time.perf_counter; the device is drained between
rounds): ``swap_in`` (the stateless op, validates everything), ``cache.begin_step`` (validates
the batch once), ``step.swap`` single-step and multi-step (checks only the top-k), and one
launch of the planned-copy kernel with PDL through this package's ``cuLaunchKernelEx`` path
and through ``cuda.core.launch`` with a ``LaunchConfig(programmatic_stream_serialization=True)``
(eager and while a CUDA graph is being captured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import cupy
import numpy as np

from hisparse_cupy import HotBufferCache, _abi, _build, swap_in
from hisparse_cupy._launch import launch
from hisparse_cupy.plan import copy_params

ROUNDS, N = 5, 200
K, H, P, MAX_LEN, ROW = 2048, 4096, 64, 8192, 656


def per_call_us(fn, stream) -> dict:
    fn()
    stream.synchronize()
    out = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(N):
            fn()
        out.append((time.perf_counter() - t0) / N * 1e6)
        stream.synchronize()
    return {"median_us": statistics.median(out), "min_us": min(out), "max_us": max(out)}


def launch_paths(stream, B: int) -> dict:
    """One planned-copy launch with PDL: ours vs cuda.core (same kernel, same struct)."""
    c = cupy.zeros((B, 1), cupy.int64)
    d = cupy.zeros((B, 1), cupy.int32)
    n = cupy.zeros(B, cupy.int32)  # counts 0: the kernel does nothing
    p = copy_params(c, d, n, B, None, src_base=0, src_layer_bytes=0, n_src_rows=1, dst_base=0,
                    dst_layer_bytes=0, n_dst_rows=1, row_bytes=16)
    k = _build.kernel(_build.COPY_H2D)
    smem = _abi.smem_bytes("PLANNED_COPY", B=B)
    res = {"ours_eager": per_call_us(
        lambda: launch(k, 64, 256, p, shared_mem=smem, stream=stream, pdl=True), stream)}
    try:
        from cuda.core import Device, Kernel, LaunchConfig
        from cuda.core import launch as core_launch

        Device().set_current()
        ck = Kernel.from_handle(k.kernel.ptr)
        cfg = LaunchConfig(grid=64, block=256, shmem_size=smem,
                           programmatic_stream_serialization=True)
        import ctypes

        blob = (ctypes.c_byte * p.arr.itemsize).from_buffer(p.arr)
        res["core_eager"] = per_call_us(lambda: core_launch(stream, cfg, ck, blob), stream)
    except Exception as e:  # the library could not launch our kernel / struct
        res["core_error"] = f"{type(e).__name__}: {e}"
    # inside capture
    for name, fn in (("ours_capture", lambda: launch(k, 64, 256, p, shared_mem=smem,
                                                     stream=stream, pdl=True)),):
        times = []
        for _ in range(ROUNDS):
            with stream:
                stream.begin_capture()
                t0 = time.perf_counter()
                for _ in range(N):
                    fn()
                times.append((time.perf_counter() - t0) / N * 1e6)
                stream.end_capture()
        res[name] = {"median_us": statistics.median(times)}
    if "core_eager" in res:
        times = []
        for _ in range(ROUNDS):
            with stream:
                stream.begin_capture()
                t0 = time.perf_counter()
                for _ in range(N):
                    core_launch(stream, cfg, ck, blob)
                times.append((time.perf_counter() - t0) / N * 1e6)
                stream.end_capture()
        res["core_capture"] = {"median_us": statistics.median(times)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="also print the cProfile of begin_step and step.swap at batch 64")
    args = ap.parse_args()
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    results = {f"batch_{B}": per_batch(B, stream, rng, args.profile and B == 64)
               for B in (8, 64)}
    results["launch_paths"] = launch_paths(stream, 64)
    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"host time per eager call ({dev}, K {K}, H {H}, rows {ROW} B; median of {ROUNDS} "
          f"rounds of {N})")
    for key, r in results.items():
        for name, v in r.items():
            if isinstance(v, dict):
                print(f"  {key:14s} {name:24s} {v['median_us']:8.1f} us")
            else:
                print(f"  {key:14s} {name:24s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "results": results}, f, indent=1)


def profile(fn, label: str) -> None:
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(N):
        fn()
    pr.disable()
    print(f"--- cProfile of {N} calls of {label}")
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)


def per_batch(B: int, stream, rng, prof: bool = False) -> dict:
    """Host time of each call at batch B (a two-layer cache, every request warm)."""
    cache = HotBufferCache(n_layers=2, max_requests=B, max_len=MAX_LEN, row_bytes=ROW,
                           hot_size=H, top_k=K, extra_page=P, max_steps=2)
    with stream:
        for _ in range(B):
            cache.admit(MAX_LEN - 1, warm_tokens=rng.choice(MAX_LEN - 2, H, replace=False))
        req = cupy.arange(B, dtype=cupy.int32)
        lens = cupy.full(B, MAX_LEN - 1, dtype=cupy.int32)
        topk = cupy.asarray(rng.integers(0, MAX_LEN - 2, (B, K)).astype(np.int32))
        topk2 = cupy.asarray(rng.integers(0, MAX_LEN - 2, (B, 2, K)).astype(np.int32))
    stream.synchronize()
    st = cache.state(0)
    r = {}
    r["swap_in"] = per_call_us(lambda: swap_in(
        topk, req, lens, st, host_rows=cache.pool.device_ptr(0),
        n_host_rows=cache.pool.n_rows, device_rows=cache.device[0], plan=cache.plan,
        out=cache.out[:B], status=cache.status[:B], stream=stream), stream)
    r["begin_step"] = per_call_us(
        lambda: cache.begin_step(req, lens, stream=stream), stream)
    step = cache.begin_step(req, lens, stream=stream)
    r["step_swap"] = per_call_us(lambda: step.swap(0, topk), stream)
    r["step_swap_multistep_S2"] = per_call_us(lambda: step.swap(1, topk2), stream)
    if prof:
        profile(lambda: cache.begin_step(req, lens, stream=stream), "begin_step")
        profile(lambda: step.swap(0, topk), "step.swap")
        stream.synchronize()
    stream.synchronize()
    cache.close()
    return r


if __name__ == "__main__":
    sys.exit(main())
