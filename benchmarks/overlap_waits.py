"""Where the overlap's step time goes: how long the main stream stalls at each wait.

Runs ``bench_overlap``'s workload (one configuration, eager steps) and records an event pair
around every wait the :class:`~hisparse_cupy.Prefetcher` queues on the main stream: a shared
layer's wait on its replay, and (prediction mode) a full layer's wait on its staged rows. The
time between the two events of a pair is how long the main stream stood still there. Reported
per mode: step time, the stall per step at shared layers and at predicted full layers, and
the full layers' swaps (their own time on the main stream, waits included; medians over the
timed steps). Also the no-overlap mode's full-layer swaps, for scale, and the step without
offload (every row on the GPU already).

    python benchmarks/overlap_waits.py [--layers 78] [--batch 64] [--rate 0.05] [--common 1.0]
        [--gemm-sms N] [--matmul-m M] [--replay-grid G] [--replay-rows-per-warp R]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import cupy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overlap as bo  # noqa: E402
from _timing import device_info, write_json  # noqa: E402


def instrument(pf, log: list) -> None:
    """Wrap the prefetcher's two main-stream waits, and every full layer's swap, with event
    pairs appended to ``log``."""
    wait_position, take_stage, swap_step = pf._wait_position, pf._take_stage, pf.swap_step
    pool: list = []

    def pair():
        if len(pool) < 2:
            pool.extend(cupy.cuda.Event() for _ in range(64))
        return pool.pop(), pool.pop()

    def timed(kind, fn, s, *args):
        a, b = pair()
        a.record(s)
        r = fn(*args)
        b.record(s)
        log.append((kind, a, b, pool))
        return r

    pf._wait_position = lambda p, s: timed("shared", wait_position, s, p, s)
    pf._take_stage = lambda loc, tk, s, batch=0: timed("stage", take_stage, s, loc, tk, s, batch)

    def swap(step, layer, tk=None):
        if not pf.pattern.full[pf.pattern.local_index(layer)]:
            return swap_step(step, layer, tk)
        return timed("full_swap", swap_step, step.stream, step, layer, tk)

    pf.swap_step = swap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=78)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rate", type=float, default=0.05)
    ap.add_argument("--common", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    bo.add_rig_args(ap)
    a = ap.parse_args()
    main_s = cupy.cuda.Stream(non_blocking=True)
    main_s.use()
    kern = bo.Kernels()
    rig = bo.Rig(a.layers, a.batch, kern, bo.make_compute(kern, main_s, a), main_s)
    bo.shape_replays(rig.pf, a)
    rig.common = a.common
    bo.prepare_config(rig, a.batch, a.rate)
    pf = rig.pf
    log: list = []
    instrument(pf, log)
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    res = {}
    for mode in ("no_offload", "no_overlap", "overlap", "overlap_predict"):
        bo.set_mode(pf, "overlap" if mode == "no_offload" else mode, main_s)
        step = rig.step_no_offload if mode == "no_offload" else rig.step_offload
        steps = {"step_ms": [], "shared_ms": [], "stage_ms": [], "full_swap_ms": []}
        for i in range(bo.WARMUP + a.steps):
            log.clear()
            e0.record(main_s)
            step()
            e1.record(main_s)
            e1.synchronize()
            if i < bo.WARMUP:
                continue
            steps["step_ms"].append(cupy.cuda.get_elapsed_time(e0, e1))
            for kind in ("shared", "stage", "full_swap"):
                steps[f"{kind}_ms"].append(sum(cupy.cuda.get_elapsed_time(x, y)
                                               for k, x, y, _ in log if k == kind))
            for _, x, y, pool in log:
                pool.extend((x, y))
        res[mode] = {k: statistics.median(v) for k, v in steps.items()}
        if pf.predict:
            res[mode]["predict"] = pf.predict_summary()
        r = res[mode]
        stage = f"{r['stage_ms']:.2f} ms" if pf.predict else "-"
        print(f"{mode:16s} step {r['step_ms']:.2f} ms; main stream stalled {r['shared_ms']:.2f} "
              f"ms at shared layers, {stage} at predicted full layers; full layers' swaps "
              f"{r['full_swap_ms']:.2f} ms (medians of {a.steps} eager steps)", flush=True)
    pf.set_predict(False, main_s)
    rig.close()
    if a.out:
        write_json(a.out, "overlap_waits.json", {"device": device_info(), "args": vars(a),
                                                 "modes": res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
