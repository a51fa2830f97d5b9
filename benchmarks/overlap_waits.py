"""Where the overlap's step time goes: how long the main stream stalls at each wait.

Runs ``bench_overlap``'s workload (``_overlap_rig.py``, one configuration) and records an event
pair around every wait the :class:`~hisparse_cupy.Prefetcher` queues on the main stream (its
public hook ``before_layer``, which the step calls for every layer): a shared layer's wait on
its replay (a call it served), and (prediction mode) a full layer's wait on its staged rows (a
call with a stage); and around every full layer's ``step.swap``. The time between the two
events of a pair is how long the main stream stood still there (a wait) or spent on the swap
(waits included). Reported per mode: step time, the stall per step at shared layers and at
predicted full layers, and the full layers' swaps (medians over the timed steps), the first
full layer of the step apart (never predicted), and each full layer's in the JSON. Also the
step without offload (every row on the GPU already).

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
import _overlap_rig as ov  # noqa: E402
from _timing import device_info, write_json  # noqa: E402

KINDS = ("shared", "stage", "full_swap")


def instrument(rig: ov.Rig, log: list) -> list:
    """Wrap the prefetcher's public hook ``before_layer`` (where it queues a shared layer's wait
    on its replay, or a predicted full layer's wait on its staged rows) and every full layer's
    swap (``rig.swap``, the whole ``step.swap``) with event pairs on the main stream, appended to
    ``log`` as (kind, model layer or -1, start, end): kind "shared" for a call the prefetcher
    served (``LayerCall.served``), "stage" for one with staged rows (``LayerCall.stage``),
    "full_swap", or None (no wait there: the pair is only given back). Returns the pool the
    events come from: give a pair back once nothing will record or read it again."""
    pf, s = rig.pf, rig.main
    before_layer, swap = pf.before_layer, rig.swap
    pool: list = []

    def pair():
        if len(pool) < 2:
            pool.extend(cupy.cuda.Event() for _ in range(64))
        return pool.pop(), pool.pop()

    def is_full(layer) -> bool:
        return bool(pf.pattern.full[pf.pattern.local_index(layer)])

    def timed_before(step, layer, *args, **kw):
        if not pf.enabled or (is_full(layer) and not pf.predict):  # it queues no wait there
            return before_layer(step, layer, *args, **kw)
        a, b = pair()
        ov.record_external(a, s)  # an event-record node when captured
        call = before_layer(step, layer, *args, **kw)
        ov.record_external(b, s)
        kind = "shared" if call.served else "stage" if call.stage is not None else None
        log.append((kind, -1, a, b))
        return call

    def timed_swap(step, layer, top_k):
        if not is_full(layer):
            return swap(step, layer, top_k)
        a, b = pair()
        ov.record_external(a, s)
        out = swap(step, layer, top_k)
        ov.record_external(b, s)
        log.append(("full_swap", layer, a, b))
        return out

    pf.before_layer = timed_before
    rig.swap = timed_swap
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
    ov.add_rig_args(ap)
    a = ap.parse_args()
    rig, part = ov.build(a, a.layers, a.batch)
    main_s = rig.main
    rig.common = a.common
    ov.prepare_config(rig, a.batch, a.rate)
    pf = rig.pf
    first_full = pf.pattern.full_layers[0] + pf.pattern.first_layer
    log: list = []
    pool = instrument(rig, log)
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    how = "graph replays" if a.graph else "eager steps"
    res = {}
    for mode in ("no_offload", "no_overlap", "overlap", "overlap_predict"):
        ov.set_mode(pf, "overlap" if mode == "no_offload" else mode, main_s)
        fn = rig.step_no_offload if mode == "no_offload" else rig.step_offload

        def step(fn=fn):
            ov.record_external(e0, main_s)
            fn()
            ov.record_external(e1, main_s)

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
        for i in range(ov.WARMUP + a.steps):
            if not a.graph:
                log.clear()
            run()
            e1.synchronize()
            if not a.graph:
                pairs = list(log)
            if i >= ov.WARMUP:
                steps["step_ms"].append(cupy.cuda.get_elapsed_time(e0, e1))
                t = {k: 0.0 for k in KINDS}
                first = 0.0
                for kind, layer, x, y in pairs:
                    if kind is None:
                        continue
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
