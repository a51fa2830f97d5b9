"""Where the multi-step swap copies its misses: the gather's warps or the commit grid's blocks.

``hisparse_cupy._kernels.multistep.copy_blocks(B, S)`` picks, per batch size and step count, how
many copy blocks per row the commit grid gets (0: the gather's warps copy). This probe times each
policy at each point so the switch can be checked: bench_spec's workload (``Case``: K 2048,
H 4096, a full hot buffer, step 0 with 2 % misses and 3 % new tokens per later step, every call
from the same state), 656 B rows, the marginal time of one call in a CUDA graph of 8 (median of
20). Each point first checks its miss counts and status (``Case.check``) under the policy being
timed. The policy is set by replacing ``multistep.copy_blocks`` for the probe's run (measuring
only). Ceiling, same run: a ``cudaMemcpyAsync`` of the point's unique missed bytes from the
same pinned pool, chained in a graph of 8 the same way (``memcpy us``).

    python benchmarks/probe_copy_blocks.py [--batches 1 8 16 24 32 64] [--blocks 0 4 8 16]
                                           [--steps 2 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_spec  # noqa: E402
from _timing import device_info, memcpy_h2d, time_graph_chain, write_json  # noqa: E402

from hisparse_cupy import HostKVPool
from hisparse_cupy._kernels import multistep  # noqa: E402
from hisparse_cupy.testing import knobs  # noqa: E402

ROW = 656


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 24, 32, 64])
    ap.add_argument("--blocks", type=int, nargs="+", default=[0, 4, 8, 16],
                    help="copy blocks per row (0: the gather copies)")
    ap.add_argument("--steps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(5)
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = HostKVPool(1, bench_spec.N_HOST, ROW)
    pool.numpy[...] = rng.integers(0, 256, size=pool.numpy.shape, dtype=np.uint8)
    rows = []
    print("| S | batch | unique misses | " + " | ".join(
        "gather copies us" if g == 0 else f"{g} copy blocks us" for g in args.blocks)
        + " | memcpy us | library's choice |", flush=True)
    print("|---" * (len(args.blocks) + 5) + "|", flush=True)
    if True:
        for S in args.steps:
            for B in args.batches:
                case = bench_spec.Case(rng, B, S, ROW, pool, stream)
                rec = {"steps": S, "batch": B, "unique_misses": B * bench_spec.unique_misses(S),
                       "chosen_blocks": multistep.copy_blocks(B, S), "us": {}}
                for g in args.blocks:
                    with knobs.copy_blocks(g):
                        case.check()
                        t = time_graph_chain(case.spec_call, case.restore_spec,
                                             n=bench_spec.CHAIN, iters=args.iters, stream=stream)
                    rec["us"][g] = t
                _, rec["memcpy"] = memcpy_h2d(pool.numpy, rec["unique_misses"] * ROW,
                                              iters=args.iters, chain=bench_spec.CHAIN,
                                              stream=stream)
                rows.append(rec)
                cells = " | ".join(f"{rec['us'][g]['median_us']:.1f}" for g in args.blocks)
                print(f"| {S} | {B} | {rec['unique_misses']} | {cells} | "
                      f"{rec['memcpy']['median_us']:.1f} | {rec['chosen_blocks']} |",
                      flush=True)
                del case
    if args.out:
        write_json(args.out, "probe_copy_blocks.json",
                   {"device": device_info(), "row_bytes": ROW, "iters": args.iters,
                    "results": rows})


if __name__ == "__main__":
    with knobs.pdl(True):  # the commit with PDL, whatever HISPARSE_CUPY_PDL says
        main()
