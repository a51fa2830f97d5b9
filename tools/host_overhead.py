"""Host (Python) time of the eager calls an engine makes per layer and per step, and of one
launch through each launch path.

    python tools/host_overhead.py [--json PATH]

Per call, median over 5 rounds of 200 calls (time.perf_counter; the device is drained between
rounds): ``swap_in`` (the stateless op, validates everything), ``cache.begin_step`` (validates
the batch once; the step's structs are filled by its first swap of each kind, so
``begin_step`` + its first ``step.swap`` is a step's fixed cost), ``step.swap`` single-step and
multi-step (checks only the top-k), with torch installed ``step.swap`` on torch tensors and
the ``hisparse::swap`` operator of :mod:`hisparse_cupy.torch`, and one PDL launch of a
one-argument kernel through this package's launcher and through ``cuda.core.launch`` with a
``LaunchConfig(programmatic_stream_serialization=True)`` (eager and while a CUDA graph is
being captured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import cupy
import numpy as np

from hisparse_cupy import HotBufferCache, _abi, swap_in
from hisparse_cupy._kernels.launch import launcher

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


_NOP = r"""extern "C" __global__ void nop(unsigned long long x) {
  if (x == 1) asm volatile("griddepcontrol.wait;" ::: "memory");
}"""


def _captured(fn, stream) -> dict:
    """Host time per call while ``stream`` is being captured into a graph."""
    times = []
    for _ in range(ROUNDS):
        with stream:
            stream.begin_capture()
            t0 = time.perf_counter()
            for _ in range(N):
                fn()
            times.append((time.perf_counter() - t0) / N * 1e6)
            stream.end_capture()
    return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times)}


def launch_paths(stream) -> dict:
    """One PDL launch of a one-argument kernel: this package's path vs ``cuda.core.launch``.

    Both launch the same CUfunction (CuPy-compiled) on the same stream with the
    programmatic-stream-serialization attribute, eager and under capture. Then: can cuda.core
    pass this package's parameter struct by value?
    """
    k = cupy.RawKernel(_NOP, "nop")
    arg = np.zeros(1, np.uint64)
    la = launcher(k, 32, 0, pdl=True)
    grid, sptr, addr = (1, 1, 1), stream.ptr, arg.ctypes.data
    res = {"ours_eager": per_call_us(lambda: la(grid, sptr, addr), stream),
           "ours_capture": _captured(lambda: la(grid, sptr, addr), stream)}
    try:
        from cuda.core import Device, Kernel, LaunchConfig, Stream
        from cuda.core import launch as core_launch

        Device().set_current()
        ck = Kernel.from_handle(k.kernel.ptr)
        cs = Stream.from_handle(stream.ptr)
        cfg = LaunchConfig(grid=1, block=32, programmatic_stream_serialization=True)
        x = np.uint64(0)
        res["core_eager"] = per_call_us(lambda: core_launch(cs, cfg, ck, x), stream)
        res["core_capture"] = _captured(lambda: core_launch(cs, cfg, ck, x), stream)
        try:  # the struct-by-value ABI: a SwapResolveParams as one argument
            p = np.zeros(1, _abi.SWAP_RESOLVE)
            core_launch(cs, cfg, ck, p[0])
            res["core_struct_arg"] = "accepted"
        except Exception as e:
            res["core_struct_arg"] = f"refused: {type(e).__name__}: {e}"
        stream.synchronize()
    except Exception as e:  # the library could not launch the kernel at all
        res["core_error"] = f"{type(e).__name__}: {e}"
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
    results["launch_paths"] = launch_paths(stream)
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
        out=cache.step_parts.out[:B], status=cache.status[:B], stream=stream), stream)
    r["begin_step"] = per_call_us(
        lambda: cache.begin_step(req, lens, stream=stream), stream)
    # a step's fixed cost: the batch's validation, and its structs filled by its first swap
    r["begin_step_first_swap"] = per_call_us(
        lambda: cache.begin_step(req, lens, stream=stream).swap(0, topk), stream)
    step = cache.begin_step(req, lens, stream=stream)
    r["step_swap"] = per_call_us(lambda: step.swap(0, topk), stream)
    r["step_swap_multistep_S2"] = per_call_us(lambda: step.swap(1, topk2), stream)
    r.update(torch_ops(cache, req, lens, topk))
    if prof:
        profile(lambda: cache.begin_step(req, lens, stream=stream), "begin_step")
        profile(lambda: step.swap(0, topk), "step.swap")
        stream.synchronize()
    stream.synchronize()
    cache.close()
    return r


def torch_ops(cache, req, lens, topk) -> dict:
    """With torch installed: ``step.swap`` on torch tensors (DLPack imports) and the
    ``hisparse::swap`` operator (``hisparse_cupy.torch``) called eagerly, on torch's stream."""
    try:
        import torch

        from hisparse_cupy.interop import cupy_stream
        from hisparse_cupy.torch import TorchCache
    except ImportError:
        return {}
    req_t, lens_t, topk_t = (torch.from_dlpack(x) for x in (req, lens, topk))
    ts = torch.cuda.current_stream()
    tc = TorchCache(cache)
    step = cache.begin_step(req_t, lens_t, stream=ts)
    s = cupy_stream(ts)
    return {"torch_step_swap": per_call_us(lambda: step.swap(0, topk_t), s),
            "torch_op_swap": per_call_us(lambda: tc.swap(0, topk_t, req_t, lens_t), s)}


if __name__ == "__main__":
    sys.exit(main())
