"""Host (Python) time of one eager swap_in call, split into validation and the two launches.

    python tools/host_overhead.py
"""

from __future__ import annotations

import time

import cupy
import numpy as np

import hisparse_cupy.plan as plan_mod
import hisparse_cupy.swap as swap_mod
from hisparse_cupy import HostKVPool, MissPlan, SwapState, swap_in


def per_call_us(fn, n=300) -> float:
    fn()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    cupy.cuda.Device().synchronize()
    return t


def main() -> None:
    B, K, H, P, max_len, row = 8, 2048, 4096, 64, 8192, 656
    rng = np.random.default_rng(0)
    pool = HostKVPool(1, B * max_len, row)
    toks = np.full((B, H + P), -1, np.int32)
    toks[:, :H] = np.stack([rng.choice(max_len - 1, H, replace=False) for _ in range(B)])
    st = SwapState.validated(
        cupy.asarray((np.arange(B)[:, None] * max_len + np.arange(max_len)).astype(np.int64)),
        cupy.asarray(toks), cupy.arange(B * (H + P), dtype=cupy.int32).reshape(B, H + P),
        cupy.asarray(np.tile(np.arange(H, dtype=np.int16), (B, 1))))
    dev = cupy.empty((B * (H + P), row), cupy.uint8)
    plan = MissPlan(B, K)
    topk = cupy.asarray(toks[:, :K])
    req = cupy.arange(B, dtype=cupy.int32)
    seq = cupy.full(B, max_len, dtype=cupy.int32)
    out = cupy.empty((B, K), cupy.int32)
    status = cupy.empty((B, 3), cupy.int32)

    def call():
        swap_in(topk, req, seq, st, host_rows=pool.device_ptr(0), n_host_rows=pool.n_rows,
                device_rows=dev, plan=plan, out=out, status=status)

    full = per_call_us(call)
    real_launch_swap, real_launch_plan = swap_mod.launch, plan_mod.launch
    swap_mod.launch = plan_mod.launch = lambda *a, **k: None
    checks = per_call_us(call)
    swap_mod.launch = real_launch_swap
    resolve_only = per_call_us(call)
    swap_mod.launch, plan_mod.launch = real_launch_swap, real_launch_plan
    print(f"host time per eager swap_in call (batch {B}, K {K}, H {H}): {full:.1f} us")
    print(f"  validation and argument building (launches stubbed): {checks:.1f} us")
    print(f"  resolve launch (RawKernel call): {resolve_only - checks:.1f} us")
    print(f"  copy launch (cuLaunchKernelEx with PDL, or RawKernel): {full - resolve_only:.1f} us")
    pool.close()


if __name__ == "__main__":
    main()
