"""The decode loop's captured step on the GPU's timeline: where each layer's time goes.

Runs the demo's rig (``hisparse_cupy.demo._loop.Rig``) for a few graph-captured steps per mode
under ``torch.profiler`` (CUPTI's kernel records: every kernel of the process, CuPy's and
cuBLAS's included, with its start and end on the device) and splits each step by layer:

- **window**: from the end of the previous layer's last model kernel (attention, combine,
  matmul) to the start of this layer's attention: the top-k kernel and, offloaded, the
  swap on a full layer or the wait for the replay on a shared one;
- **compute**: from the attention's start to the end of the layer's last model kernel (side
  kernels running beside it show here as a slower layer);
- **indexer**: a full layer's lightning indexer (the demo's ``indexer`` kernel, part of that
  layer's window: it runs before the top-k and the swap), its busy time per step, and how much
  of the side kernels' busy time falls inside it (the IO the indexer's window, which moves
  nothing over PCIe, hides).

Printed per mode, averaged over the profiled steps after the first: the step, the windows of
the full and of the shared layers, the compute, the side kernels' busy time (replays,
prediction's stager and copies: kernels the step's path does not wait for in order), and the
swap kernels' own durations, and the swapped full layers' misses a step (how far the hot
buffers have filled since admission: a timeline of the first steps measures a fill, not the
steady state). gpu-only is the reference each mode is compared with.

    python tools/timeline_step.py --batch 1 [--modes gpu-only overlap predict] [--steps 4]
        [--warmup 20] [demo flags after --, e.g. -- --group-replay-batch 0] [--json out.json]

Needs torch (its profiler) beside CuPy; measuring only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

import numpy as np

# not the model's kernels: the library's, the demo's bookkeeping, CuPy's elementwise copies
# (matched within a kernel's name: the demo's kernels are demo::NAME<...>(demo::...Params))
_LIBRARY = ("swap_resolve", "planned_copy", "predict_stage", "newest_rows", "gather",
            "commit")
_BOOKKEEPING = ("topk_table", "topk_drift", "direct_locs", "kv_newest", "tally", "tick",
                "cupy_copy", "cupy_fill", "embed", "index_query")
_INDEXER = re.compile(r"(?:^|[^\w])indexer(?:$|[^\w])")  # the demo's indexer kernel, not index_*


def _kind(name: str) -> str:
    if _INDEXER.search(name):
        return "indexer"
    if any(k in name for k in _LIBRARY):
        return "library"
    if any(k in name for k in _BOOKKEEPING):
        return "bookkeeping"
    return "model"  # attention, combine, matmuls (cuBLAS's kernels included)


def kernels(trace_path: str) -> list[dict]:
    """The trace's kernel records, by start: name, start and end (us), stream, grid, kind."""
    with open(trace_path) as f:
        ev = json.load(f)["traceEvents"]
    out = []
    for e in ev:
        if e.get("cat") != "kernel":
            continue
        a = e.get("args", {})
        out.append(dict(name=e["name"], t0=float(e["ts"]), t1=float(e["ts"]) + float(e["dur"]),
                        stream=a.get("stream"), grid=tuple(a.get("grid", ())),
                        kind=_kind(e["name"])))
    out.sort(key=lambda k: k["t0"])
    return out


def split_steps(ks: list[dict]) -> list[list[dict]]:
    """Kernels grouped by step: each step ends with the demo's ``tick`` kernel."""
    steps, cur = [], []
    for k in ks:
        cur.append(k)
        if "tick" in k["name"]:
            steps.append(cur)
            cur = []
    return steps


def layer_split(step: list[dict], full: tuple[bool, ...]) -> dict:
    """One step's windows and compute per layer (see the module docstring)."""
    att = [k for k in step if "attn_partial" in k["name"]]
    if len(att) != len(full):
        raise RuntimeError(f"{len(att)} attention kernels in a step of {len(full)} layers")
    model = [k for k in step if k["kind"] == "model"]
    win = np.zeros(len(full))
    comp = np.zeros(len(full))
    for i, a in enumerate(att):
        before = [k["t1"] for k in model if k["t0"] < a["t0"]]
        win[i] = a["t0"] - max(before) if before else 0.0
        nxt = att[i + 1]["t0"] if i + 1 < len(att) else float("inf")
        ends = [k["t1"] for k in model if a["t0"] <= k["t0"] < nxt]
        comp[i] = max(ends) - a["t0"]
    side = [k for k in step if k.get("side")]
    lib = [k for k in step if k["kind"] == "library"]
    idx = [k for k in step if k["kind"] == "indexer"]
    return dict(step=step[-1]["t1"] - step[0]["t0"], win=win, comp=comp,
                side_busy=sum(k["t1"] - k["t0"] for k in side),
                indexer=sum(k["t1"] - k["t0"] for k in idx),
                side_in_indexer=sum(max(0.0, min(k["t1"], i["t1"]) - max(k["t0"], i["t0"]))
                                    for k in side for i in idx),
                library={n: sum(k["t1"] - k["t0"] for k in lib if n in k["name"])
                         for n in _LIBRARY})


def mark_side(step: list[dict], main_stream, replay_grid: int) -> None:
    """Side kernels: library kernels on another stream than the step's attention, or (where the
    trace puts a graph's kernels on one stream) the stager and copies of the replays' grid."""
    one = len({k["stream"] for k in step}) == 1
    for k in step:
        k["side"] = k["kind"] == "library" and (
            k["stream"] != main_stream if not one else
            "predict_stage" in k["name"] or ("planned_copy" in k["name"] and
                                             k["grid"][:1] == (replay_grid,)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["gpu-only", "overlap", "predict"])
    ap.add_argument("--steps", type=int, default=4, help="profiled steps per mode")
    ap.add_argument("--warmup", type=int, default=20,
                    help="steps before them (default 20: the hot buffers start cold at "
                         "admission and fill over the first steps)")
    ap.add_argument("--json", default=None)
    ap.add_argument("demo", nargs="*", help="demo flags (after --)")
    ns = ap.parse_args(argv)
    own = [f for f in ns.demo if f.split("=")[0] in ("--warmup", "--steps")]
    if own:  # the demo's parser would take the last one, and the tool would profile other steps
        ap.error(f"{own[0].split('=')[0]} is the tool's own: give it before --, not among the "
                 f"demo flags (the profiled steps come after --warmup steps from admission, "
                 f"while the hot buffers fill)")

    import cupy
    import torch  # noqa: F401  (its profiler records CuPy's kernels too: CUPTI is per process)
    from torch.profiler import ProfilerActivity, profile

    from hisparse_cupy.demo._args import from_args
    from hisparse_cupy.demo._loop import Rig

    # no device budget unless the demo flags give one: the sparse path's timeline
    cfg = from_args(["--batch", str(ns.batch), "--warmup", str(ns.warmup), "--steps", str(ns.steps),
                     "--quiet", "--device-budget", "0", *ns.demo])
    s = cupy.cuda.Stream(non_blocking=True)
    rig = Rig(cfg, s, lambda *_: None)
    full = rig.pattern.full
    results = {}
    try:
        for mode in ns.modes:
            rig.run(mode, "graph", None)  # kernels loaded, pools touched
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run = rig.run(mode, "graph", None)
            with tempfile.TemporaryDirectory() as tmp:  # nothing left behind in /tmp
                path = os.path.join(tmp, "trace.json")
                prof.export_chrome_trace(path)
                ks = kernels(path)
            steps = split_steps(ks)[cfg.warmup + 1:]  # captured replays only
            rows = []
            for st in steps:
                att = next(k for k in st if "attn_partial" in k["name"])
                mark_side(st, att["stream"], rig.pf.replay_grid if rig.pf else 0)
                rows.append(layer_split(st, full))
            t00 = steps[-1][0]["t0"]  # the last step's kernels, for reading by hand
            last = [(k["name"][:60], k["kind"], k["side"], k["stream"], list(k["grid"]),
                     round(k["t0"] - t00, 2), round(k["t1"] - k["t0"], 2)) for k in steps[-1]]
            fl = np.array(full)
            r = dict(
                steps=len(rows),
                step_us=float(np.mean([x["step"] for x in rows])),
                window_full_us=float(np.mean([x["win"][fl].sum() for x in rows])),
                window_shared_us=float(np.mean([x["win"][~fl].sum() for x in rows])),
                compute_us=float(np.mean([x["comp"].sum() for x in rows])),
                side_busy_us=float(np.mean([x["side_busy"] for x in rows])),
                indexer_us=float(np.mean([x["indexer"] for x in rows])),
                side_in_indexer_us=float(np.mean([x["side_in_indexer"] for x in rows])),
                library_us={n: float(np.mean([x["library"][n] for x in rows]))
                            for n in _LIBRARY},
                per_layer_window_us=np.mean([x["win"] for x in rows], axis=0).round(2).tolist(),
                per_layer_compute_us=np.mean([x["comp"] for x in rows], axis=0).round(2)
                .tolist(),
                streams=sorted({str(k["stream"]) for st in steps for k in st}),
                # the swapped full layers' misses a step, over the timed steps: how far the hot
                # buffers have filled since admission (0 for gpu-only)
                full_misses_per_step=float(np.mean(run.misses)) if len(run.misses) else 0.0,
                swapped_full_layers=int(np.asarray(rig.full[rig.R:], bool).sum()),
                last_step=last)
            results[mode] = r
            print(f"{mode:9s} step {r['step_us']:9.1f} us | windows: full "
                  f"{r['window_full_us']:8.1f} shared {r['window_shared_us']:8.1f} | compute "
                  f"{r['compute_us']:9.1f} | side "
                  f"busy {r['side_busy_us']:8.1f} (in the indexer {r['side_in_indexer_us']:.1f}) "
                  f"| indexer {r['indexer_us']:.1f} | " + ", ".join(
                      f"{n} {v:.1f}" for n, v in r["library_us"].items() if v) +
                  f" | full-layer misses {r['full_misses_per_step']:.0f} a step "
                  f"({r['full_misses_per_step'] / max(1, r['swapped_full_layers']):.0f} a layer)"
                  f" | {r['steps']} steps, streams {r['streams']}", flush=True)
    finally:
        rig.close()
    if "gpu-only" in results:
        ref = results["gpu-only"]
        for mode, r in results.items():
            if mode == "gpu-only":
                continue
            print(f"{mode} - gpu-only: step {r['step_us'] - ref['step_us']:+.1f} us = windows "
                  f"full {r['window_full_us'] - ref['window_full_us']:+.1f} + shared "
                  f"{r['window_shared_us'] - ref['window_shared_us']:+.1f} + compute "
                  f"{r['compute_us'] - ref['compute_us']:+.1f} (+ the rest of the step)")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(dict(config={k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
                           full=list(full), results=results), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
