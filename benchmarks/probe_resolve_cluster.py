"""The single-step swap with the resolve on C = 1, 2, 4 or 8 blocks per batch row.

The resolve (``cu/swap.cu``) runs one 1024-thread block per row, or a thread-block cluster of C
512-thread blocks sharing the row's hash through distributed shared memory;
``hisparse_cupy._kernels.swap.resolve_cluster`` picks 8 or 4 when that many clusters run at once
on the
device, else 1. This probe times every C at every batch so the rule can be checked: bench_swap's
workload (K 2048, H 4096, a full hot buffer, 656 B rows, each call from the same state), the
marginal time of one swap in a CUDA graph of 8 (median of 20), at 0, 0.5 and 5 % misses; it
also prints the device's cluster occupancy (clusters of each size that run at once) and what
``resolve_cluster`` chooses. Every call's miss count is checked. The last column is the
one-block resolve that looks tokens up in a token -> slot table (``SwapState.token_slot``,
started empty: the warm-up fills it; restoring slot_tokens and lru between calls leaves it
valid).

    python benchmarks/probe_resolve_cluster.py [--batches 1 8 16 32 64 128] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_swap  # noqa: E402
from _timing import device_info, time_graph_chain, write_json  # noqa: E402

from hisparse_cupy import HostKVPool, MissPlan, _abi, swap_in
from hisparse_cupy._kernels import build, swap  # noqa: E402
from hisparse_cupy._kernels.launch import max_active_clusters  # noqa: E402
from hisparse_cupy.testing import knobs  # noqa: E402

RATES = (0.0, 0.005, 0.05)
CLUSTERS = (1, 2, 4, 8)
ROW = 656


def time_batch(rng, B, pool, dev, plan, key, stream, iters) -> list[dict]:
    """Every C at every rate for a batch of B rows; prints and returns one row per rate."""
    K, H, P, max_len = bench_swap.K, bench_swap.H, bench_swap.P, bench_swap.MAX_LEN
    st_table, snap, sets = bench_swap.build(rng, B, ROW, pool, RATES)
    st = dataclasses.replace(st_table, token_slot=None)
    req = cupy.arange(B, dtype=cupy.int32)
    seq = cupy.full(B, max_len, dtype=cupy.int32)
    out = cupy.empty((B, K), cupy.int32)
    status = cupy.empty((B, 3), cupy.int32)
    rows = dev[: B * (H + P)]
    cupy.cuda.Device().synchronize()
    chosen = swap.resolve_cluster(key, B, K, H)

    def restore(i):
        st.slot_tokens[...] = snap[0]
        st.lru[...] = snap[1]

    results = []
    for rate in RATES:
        n_miss, per = sets[rate]

        row = {"batch": B, "miss_rate": rate, "chosen": chosen, "us": {}}
        for c in (*CLUSTERS, "table"):
            state = st_table if c == "table" else st

            def call(i, per=per, state=state):
                swap_in(per[i % len(per)], req, seq, state, host_rows=pool.device_ptr(0),
                        n_host_rows=pool.n_rows, device_rows=rows, plan=plan, out=out,
                        status=status, stream=stream)

            with knobs.resolve_cluster(None if c == "table" else c):
                t = time_graph_chain(call, restore, n=bench_swap.CHAIN, iters=iters,
                                     stream=stream)
            stream.synchronize()
            got = int(cupy.asnumpy(plan.count[:B]).sum())
            assert got == B * n_miss, (B, rate, c, got, B * n_miss)
            row["us"][c] = t["median_us"]
        results.append(row)
        print(f"| {B} | {rate * 100:g} | " + " | ".join(f"{row['us'][c]:.1f}" for c in CLUSTERS)
              + f" | {chosen} | {row['us']['table']:.1f} |", flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 16, 32, 64, 128])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    K, H, P, max_len = bench_swap.K, bench_swap.H, bench_swap.P, bench_swap.MAX_LEN
    rng = np.random.default_rng(1)
    stream = cupy.cuda.Stream(non_blocking=True)
    bmax = max(a.batches)
    pool = HostKVPool(1, bmax * max_len, ROW)
    pool.numpy[...] = 7
    dev = cupy.empty((bmax * (H + P), ROW), cupy.uint8)
    plan = MissPlan(bmax, K)
    key = (np.dtype(np.int32), np.dtype(np.int32))
    cb = _abi.RESOLVE_CLUSTER_BLOCK
    fits = {c: max_active_clusters(build.kernel(build.RESOLVE[cb][key]), cb,
                                   swap.resolve_smem_bytes(K, H, cb), c) for c in CLUSTERS[1:]}
    print(f"clusters of {cb}-thread resolve blocks that run at once: {fits}", flush=True)
    print("| batch | miss % | " + " | ".join(f"C {c} us" for c in CLUSTERS)
          + " | chosen C | table us |")
    print("|---" * (4 + len(CLUSTERS)) + "|")
    results = []
    for B in a.batches:
        results += time_batch(rng, B, pool, dev, plan, key, stream, a.iters)
    pool.close()
    if a.out:
        write_json(a.out, "probe_resolve_cluster.json",
                   {"device": device_info(), "K": K, "H": H, "row_bytes": ROW,
                    "max_active_clusters": fits, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
