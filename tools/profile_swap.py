"""A few single-step swaps at the benchmark's shapes, for profilers (ncu, nsys).

    ncu --clock-control none -k regex:"swap_resolve|planned_copy" python tools/profile_swap.py
"""

from __future__ import annotations

import argparse

import cupy
import numpy as np

from hisparse_cupy import HostKVPool, MissPlan, SwapState, swap_in


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--miss", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--seq", type=int, default=16384, help="seq_len (<= H: the fast path)")
    a = ap.parse_args()
    B, K, H, P, max_len, row = a.batch, a.K, a.H, 64, 16384, 656
    rng = np.random.default_rng(0)
    pool = HostKVPool(1, B * max_len, row)
    pool.numpy[...] = 7
    resident = np.stack([rng.choice(max_len - 1, size=H, replace=False) for _ in range(B)])
    toks = np.full((B, H + P), -1, np.int32)
    toks[:, :H] = resident
    st = SwapState.validated(
        cupy.asarray((np.arange(B)[:, None] * max_len + np.arange(max_len)).astype(np.int64)),
        cupy.asarray(toks), cupy.arange(B * (H + P), dtype=cupy.int32).reshape(B, H + P),
        cupy.asarray(np.stack([rng.permutation(H) for _ in range(B)]).astype(np.int16)))
    dev = cupy.empty((B * (H + P), row), cupy.uint8)
    plan = MissPlan(B, K)
    req = cupy.arange(B, dtype=cupy.int32)
    seq = cupy.full(B, a.seq, dtype=cupy.int32)
    snap = (st.slot_tokens.copy(), st.lru.copy())
    for rate in a.miss:
        n_miss = int(round(K * rate))
        rows = []
        for b in range(B):
            free = np.setdiff1d(np.arange(max_len - 1), resident[b])
            row = np.concatenate([rng.choice(free, n_miss, replace=False),
                                  rng.choice(resident[b], K - n_miss, replace=False)])
            rows.append(row % a.seq)
        topk = cupy.asarray(np.stack(rows).astype(np.int32))
        for _ in range(3):
            st.slot_tokens[...] = snap[0]
            st.lru[...] = snap[1]
            swap_in(topk, req, seq, st, host_rows=pool.device_ptr(0), n_host_rows=pool.n_rows,
                    device_rows=dev, plan=plan)
        cupy.cuda.Device().synchronize()
        print(f"miss rate {rate}: {int(plan.count[:B].sum())} misses")
    pool.close()


if __name__ == "__main__":
    main()
