"""Where the overlap's step time goes: how long the main stream stalls at each wait.

Runs ``bench_overlap``'s workload (one configuration) and records an event pair around every
wait the :class:`~hisparse_cupy.Prefetcher` queues on the main stream: a shared layer's wait on
its replay, and (prediction mode) a full layer's wait on its staged rows; and around every full
layer's swap. The time between the two events of a pair is how long the main stream stood
still there (a wait) or spent on the swap (waits included). Reported per mode: step time, the
stall per step at shared layers and at predicted full layers, and the full layers' swaps
(medians over the timed steps), the first full layer of the step apart (never predicted), and
each full layer's in the JSON. Also the step without offload (every row on the GPU already).

Eager steps (default) include the host's enqueue wherever the GPU waited for it. ``--graph``
captures each mode's step once, with the event pairs as event-record nodes
(``CU_EVENT_RECORD_EXTERNAL``), and times graph replays: the GPU's own timeline, as the
headline figures of ``bench_overlap`` are (those nodes add a little to each step, so take
step times from ``bench_overlap``).

    python benchmarks/overlap_waits.py [--layers 78] [--batch 64] [--rate 0.05] [--common 1.0]
        [--graph] [--gemm-sms N] [--matmul-m M] [--replay-grid G] [--replay-rows-per-warp R]
        [--green-side N]
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

KINDS = ("shared", "stage", "full_swap")


def instrument(pf, log: list) -> list:
    """Wrap the prefetcher's two main-stream waits, and every full layer's swap, with event
    pairs appended to ``log`` as (kind, model layer or -1, start, end). Returns the pool the
    events come from: give a pair back once nothing will record or read it again."""
    wait_position, take_stage, swap_step = pf._wait_position, pf._take_stage, pf.swap_step
    pool: list = []

    def timed(kind, layer, fn, s, *args):
        if len(pool) < 2:
            pool.extend(cupy.cuda.Event() for _ in range(64))
        a, b = pool.pop(), pool.pop()
        bo.record_external(a, s)  # an event-record node when captured
        r = fn(*args)
        bo.record_external(b, s)
        log.append((kind, layer, a, b))
        return r

    pf._wait_position = lambda p, s: timed("shared", -1, wait_position, s, p, s)
    pf._take_stage = lambda loc, tk, s, batch=0: timed("stage", -1, take_stage, s, loc, tk, s,
                                                       batch)

    def swap(step, layer, tk=None):
        if not pf.pattern.full[pf.pattern.local_index(layer)]:
            return swap_step(step, layer, tk)
        return timed("full_swap", layer, swap_step, step.stream, step, layer, tk)

    pf.swap_step = swap
    return pool


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=78)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rate", type=float, default=0.05)
    ap.add_argument("--common", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--graph", action="store_true",
                    help="time replays of each mode's captured step instead of eager steps")
    ap.add_argument("--out", default=None)
    bo.add_rig_args(ap)
    a = ap.parse_args()
    main_s, part = bo.make_main_stream(a)
    main_s.use()
    kern = bo.Kernels()
    rig = bo.Rig(a.layers, a.batch, kern, bo.make_compute(kern, main_s, a), main_s, part)
    bo.shape_replays(rig.pf, a)
    rig.common = a.common
    bo.prepare_config(rig, a.batch, a.rate)
    pf = rig.pf
    first_full = pf.pattern.full_layers[0] + pf.pattern.first_layer
    log: list = []
    pool = instrument(pf, log)
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    how = "graph replays" if a.graph else "eager steps"
    res = {}
    for mode in ("no_offload", "no_overlap", "overlap", "overlap_predict"):
        bo.set_mode(pf, "overlap" if mode == "no_offload" else mode, main_s)
        fn = rig.step_no_offload if mode == "no_offload" else rig.step_offload

        def step(fn=fn):
            bo.record_external(e0, main_s)
            fn()
            bo.record_external(e1, main_s)

        if a.graph:
            step()  # eagerly once: everything compiled, the mode's first step done
            main_s.synchronize()
            pool.extend(e for *_, x, y in log for e in (x, y))
            log.clear()
            g = rig.capture(step)
            pairs = list(log)
            run = lambda g=g: g.launch(main_s)  # noqa: E731
        else:
            run = step
        steps = {"step_ms": [], "shared_ms": [], "stage_ms": [], "full_swap_ms": [],
                 "first_full_swap_ms": []}
        per_layer: dict[int, list] = {}
        for i in range(bo.WARMUP + a.steps):
            if not a.graph:
                log.clear()
            run()
            e1.synchronize()
            if not a.graph:
                pairs = list(log)
            if i >= bo.WARMUP:
                steps["step_ms"].append(cupy.cuda.get_elapsed_time(e0, e1))
                t = {k: 0.0 for k in KINDS}
                first = 0.0
                for kind, layer, x, y in pairs:
                    ms = cupy.cuda.get_elapsed_time(x, y)
                    t[kind] += ms
                    if kind == "full_swap":
                        per_layer.setdefault(layer, []).append(ms)
                        first += ms if layer == first_full else 0.0
                for kind in KINDS:
                    steps[f"{kind}_ms"].append(t[kind])
                steps["first_full_swap_ms"].append(first)
            if not a.graph:  # this step's pairs serve the next one
                pool.extend(e for *_, x, y in pairs for e in (x, y))
        if a.graph:
            del g
            pool.extend(e for *_, x, y in pairs for e in (x, y))
        res[mode] = {k: statistics.median(v) for k, v in steps.items()}
        res[mode]["full_swap_ms_per_layer"] = {
            str(layer): statistics.median(v) for layer, v in sorted(per_layer.items())}
        if pf.predict:
            res[mode]["predict"] = pf.predict_summary()
        r = res[mode]
        stage = f"{r['stage_ms']:.3f} ms" if pf.predict else "-"
        print(f"{mode:16s} step {r['step_ms']:.2f} ms; main stream stalled {r['shared_ms']:.3f} "
              f"ms at shared layers, {stage} at predicted full layers; full layers' swaps "
              f"{r['full_swap_ms']:.3f} ms (first full layer {r['first_full_swap_ms']:.3f}) "
              f"(medians of {a.steps} {how})", flush=True)
    pf.set_predict(False, main_s)
    rig.close()
    if part is not None:
        part.close()
    if a.out:
        write_json(a.out, "overlap_waits.json", {"device": device_info(), "args": vars(a),
                                                 "modes": res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
