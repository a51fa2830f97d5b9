"""A few swaps at the benchmarks' shapes, one eager call per point, for profilers (ncu).

    HISPARSE_CUPY_LINEINFO=1 ncu --clock-control none \\
        -k regex:"swap_resolve|planned_copy|gather|commit" \\
        python tools/profile_kernels.py [--single B:RATE ...] [--multi B:S ...]
    python tools/profile_kernels.py --phases [--single ...] [--multi ...] [--table]

Every point is called twice from the same cache state (the first call compiles and warms); the
points print in launch order, so the profiler's kernels map onto them in turn (per single-step
call: swap_resolve, planned_copy; per multi-step call: gather, commit). Workloads: single-step
as ``benchmarks/bench_swap.py`` (full hot buffer, RATE of the top-k missing), multi-step as
``benchmarks/bench_spec.py`` (its ``Case``); K 2048, H 4096, 656-byte rows.

``--phases`` builds the kernels with ``HISPARSE_CUPY_PHASE_CLOCK=1`` and prints, for the second
call of every point, the SM time from each kernel's start to the end of each of its phases (the
most any block took; a barrier is added at every mark, so the total runs a little over the
uninstrumented kernel's). Single-step: resolve marks; multi-step: gather and commit marks.
``--table``: the single-step state has a token -> slot table (``SwapState.token_slot``; the
first call of each point fills it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_spec  # noqa: E402
import bench_swap  # noqa: E402

from hisparse_cupy import HostKVPool, MissPlan, swap_in
from hisparse_cupy._kernels import build  # noqa: E402

ROW = 656
# mark -> phase, per kernel (the HS_PHASE(i) marks in cu/swap.cu and cu/multistep.cu)
MARKS = {
    "resolve": ("swap.cu", {0: "clear+stage", 1: "classify+insert",
                            3: "duplicates+LRU scan+compact", 4: "victims+plan",
                            5: "write-back"}),
    "gather": ("multistep.cu", {0: "row checks", 1: "classify", 2: "claim+publish",
                                3: "copy or its list", 4: "counts"}),
    # the commit blocks only (the grid's copy blocks have no marks)
    "commit": ("multistep.cu", {16: "keys+E", 17: "miss bitmap", 18: "radix select",
                                19: "victim scan", 20: "miss ranks", 21: "admit+copy",
                                22: "placeholders", 23: "cleanup+state"}),
}
PHASES = False


def _mhz() -> float:
    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["clockRate"] / 1e3


def report_phases(kernels) -> None:
    """Print (and clear) the phase clock of ``kernels`` after the last call."""
    if not PHASES:
        return
    mhz = _mhz()
    for k in kernels:
        file, marks = MARKS[k]
        cyc = build.phase_cycles(file, reset=False)
        prev, parts = 0.0, []
        for i, name in marks.items():
            if cyc[i] == 0:  # no block reached the mark (e.g. rows that end early)
                parts.append(f"{name} -")
                continue
            t = cyc[i] / mhz
            parts.append(f"{name} {t - prev:.1f}")
            prev = max(prev, t)
        print(f"    {k}: {prev:.1f} us = " + ", ".join(parts), flush=True)
    for file in {MARKS[k][0] for k in kernels}:
        build.phase_cycles(file, reset=True)


def reset_phases(kernels) -> None:
    if PHASES:
        for file in {MARKS[k][0] for k in kernels}:
            build.phase_cycles(file, reset=True)


def _pair(text: str, kinds) -> tuple:
    a, b = text.split(":")
    return kinds[0](a), kinds[1](b)


def single(points, stream, table: bool = False) -> None:
    rng = np.random.default_rng(1)
    bmax = max(b for b, _ in points)
    pool = HostKVPool(1, bmax * bench_swap.MAX_LEN, ROW)
    pool.numpy[...] = rng.integers(0, 256, size=pool.numpy.shape[-1], dtype=np.uint8)
    device_rows = cupy.empty((bmax * (bench_swap.H + bench_swap.P), ROW), cupy.uint8)
    plan = MissPlan(bmax, bench_swap.K)
    for B, rate in points:
        st, snap, sets = bench_swap.build(rng, B, ROW, pool, table=table)
        if rate not in sets:
            raise SystemExit(f"--single rate {rate} is not one of {sorted(sets)}")
        n_miss, per = sets[rate]
        req = cupy.arange(B, dtype=cupy.int32)
        seq = cupy.full(B, bench_swap.MAX_LEN, dtype=cupy.int32)
        for i in range(2):
            stream.synchronize()
            if i:
                reset_phases(("resolve",))
            st.slot_tokens[...] = snap[0]
            st.lru[...] = snap[1]
            swap_in(per[0], req, seq, st, host_rows=pool.device_ptr(0), n_host_rows=pool.n_rows,
                    device_rows=device_rows[: B * (bench_swap.H + bench_swap.P)], plan=plan,
                    stream=stream)
        stream.synchronize()
        got = int(plan.count[:B].sum())
        assert got == B * n_miss, (got, B * n_miss)
        print(f"single batch {B} miss rate {rate}: {got} misses (2 calls)", flush=True)
        report_phases(("resolve",))
    pool.close()


def multi(points, stream) -> None:
    rng = np.random.default_rng(3)
    pool = HostKVPool(1, bench_spec.N_HOST, ROW)
    pool.numpy[...] = rng.integers(0, 256, size=pool.numpy.shape[-1], dtype=np.uint8)
    for B, S in points:
        case = bench_spec.Case(rng, B, S, ROW, pool, stream)
        with stream:
            for i in range(2):
                case.restore_spec()
                stream.synchronize()
                if i:
                    reset_phases(("gather",))
                case.spec_call(0)
        stream.synchronize()
        got = int(case.spec_plan.count[:B].sum())
        assert got == B * bench_spec.unique_misses(S), got
        print(f"multi batch {B} steps {S}: {got} unique misses (2 calls)", flush=True)
        report_phases(("gather", "commit"))
        del case
    pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--single", nargs="*", default=["1:0.0", "1:0.05", "64:0.0", "64:0.005",
                                                    "64:0.05"], metavar="B:RATE")
    ap.add_argument("--multi", nargs="*", default=["1:2", "1:4", "64:4"], metavar="B:S")
    ap.add_argument("--table", action="store_true",
                    help="single-step calls with a token -> slot table")
    ap.add_argument("--phases", action="store_true",
                    help="build with the phase clock and print each kernel's phases")
    a = ap.parse_args()
    if a.phases:
        global PHASES
        PHASES = True
        os.environ["HISPARSE_CUPY_PHASE_CLOCK"] = "1"
    stream = cupy.cuda.Stream(non_blocking=True)
    if a.single:
        single([_pair(p, (int, float)) for p in a.single], stream, a.table)
    if a.multi:
        multi([_pair(p, (int, int)) for p in a.multi], stream)


if __name__ == "__main__":
    main()
