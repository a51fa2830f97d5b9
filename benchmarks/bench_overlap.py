"""IndexCache shared-layer IO overlap: a synthetic decode step with and without the side stream.

A step runs L layers with GLM-5.2's IndexShare pattern (78 layers, freq 4, offset 3: 21 full,
57 shared), or the same rule over 24 layers for quick runs (8 full, 16 shared). Per layer: a
stand-in attention kernel that reads every selected 656-byte row of the batch, then a cuBLAS
fp16 matmul sized so that the no-offload layer costs about 0.2 ms (issued through PyTorch on
the same stream, because CuPy refuses cuBLAS calls during graph capture; see
``hisparse_cupy.demo._compute``).
K 2048, H 4096 (+64), every request 6656 tokens long; each step an "indexer" kernel slides
every request's top-k window by M tokens (M = miss rate x K new tokens per request per step,
all misses; the window runs over a fixed random permutation of the request's tokens, so host
reads are scattered over its rows). Every full layer has its own top-k: a fixed share of the
window's positions (``common``, 1.0 in the main table: all full layers select alike) selects
the same token in every full layer, the others a layer's own permutation's, so neighbouring
full layers' top-k overlap by about ``common``; the prediction sweep (batch 64, 5 %) runs
``common`` = 0.5, 0.7, 0.9 and 0.95. Every configuration starts from cold hot buffers.

Modes (each timed eager, one Python-driven step per event pair, and as one captured graph):
- no offload: every row already on the GPU (attention reads a fixed page table, no swap);
- no overlap: the full swap-in (resolve + copy) on every layer on the main stream
  (``Prefetcher`` with prefetch off);
- overlap: full layers swap on the main stream, a side stream replays their plan for the shared
  layers, shared layers wait on their event (``Prefetcher``);
- overlap, skip IO: the same with replays that move no bytes (the overlap's floor;
  ``hisparse_cupy.testing.probe.copy_probe(dry_run=True)`` on the side stream);
- overlap, predict: overlap plus prediction mode (``Prefetcher.set_predict``): while a full
  layer computes, a second side stream stages the rows the next full layer will probably miss
  (what the current one just missed and the next one does not hold); the next full layer's
  swap reads those from the device. Its precision and recall are reported;
- compute + copies: the no-offload step while the side stream replays the shared layers' plans;
  its main-stream time (to an event recorded before the join) over the no-offload step is the
  compute slowdown the concurrent copies cause.

Reported: per-step time (median, p10-p90, over >= 20 steps after warm-up), the offload overhead
over no offload, the fraction of it the overlap hides next to its ceiling (the shared layers'
share of the IO: every layer moves the same rows), the compute slowdown, and the ceilings
measured in the same run: a cudaMemcpyAsync H2D of the step's missed bytes and the replays
alone on an idle GPU. Everything is queued on explicit non-blocking streams.

The matmul's rows are calibrated per run (unless ``--matmul-m`` pins them), and the share hidden
moves with them: at 78:64:0.05 the calibration picked 2688-3456 rows in four runs and the share
hidden 49.6-51.4 %, against 58.0-60.1 % at 3840 rows. Pin ``--matmul-m`` to compare two trees
(``benchmarks/NOTES.md``, "One house"); each configuration's line prints the rows it ran.

Every offloaded step runs through the ``Prefetcher`` itself; the workload (its kernels, the
cache, the steps) is ``_overlap_rig.py``, the tables and the plot ``_overlap_report.py``, the
layer's matmul ``hisparse_cupy.demo._compute.LayerCompute`` (the decode loop's backends).

    python benchmarks/bench_overlap.py [--quick] [--out DIR] [--only L:B:RATE ... [--predict-sweep]]
        [--node-priority]
        [--gemm-sms N] [--matmul-m M] [--replay-grid G] [--replay-rows-per-warp R]
        [--green-side N]
    python benchmarks/bench_overlap.py --plot DIR/bench_overlap.json   # PNG from a JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import cupy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _overlap_report as report  # noqa: E402
from _overlap_rig import (  # noqa: E402
    MAX_LEN,
    ROW,
    TARGET_LAYER_US,
    WARMUP,
    H,
    K,
    Kernels,
    P,
    Rig,
    add_rig_args,
    capture_cc,
    make_compute,
    make_main_stream,
    ms_summary,
    prepare_config,
    set_mode,
    shape_replays,
    skip_io,
    time_main_part,
)
from _timing import device_info, memcpy_h2d, summary, time_calls, write_json  # noqa: E402

MODES = ("no_offload", "no_overlap", "overlap", "overlap_skip_io", "overlap_predict",
         "compute_copies")
COMMON = (0.5, 0.7, 0.9, 0.95)  # top-k overlap of neighbouring full layers: prediction sweep


def run_config(rig: Rig, B: int, rate: float, iters: int, sweep: bool,
               predict_sweep: bool) -> dict:
    s, pf = rig.main, rig.pf
    misses, attn_us, mm_us = prepare_config(rig, B, rate)

    graphs = {}
    graphs["no_offload"] = rig.capture(rig.step_no_offload)
    graphs["overlap"] = rig.capture(rig.step_offload)
    with skip_io(pf):  # the captured replays are the probe's dry runs
        graphs["overlap_skip_io"] = rig.capture(rig.step_offload)
    graphs["compute_copies"] = capture_cc(rig)
    pf.set_predict(True, s)
    graphs["overlap_predict"] = rig.capture(rig.step_offload)
    pf.set_predict(False, s)
    pf.set_enabled(False, s)
    graphs["no_overlap"] = rig.capture(rig.step_offload)
    pf.set_enabled(True, s)

    eager_fn = {"no_offload": rig.step_no_offload, "no_overlap": rig.step_offload,
                "overlap": rig.step_offload, "overlap_skip_io": rig.step_offload,
                "overlap_predict": rig.step_offload, "compute_copies": rig.step_compute_copies}
    res = {"eager": {}, "graph": {}}
    cc_main = {}
    host = {}
    pred = {}
    for mode in MODES:
        spent = []

        def eager(i, fn=eager_fn[mode], spent=spent):
            t = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - t)

        with set_mode(pf, mode, s):  # skip IO: the eager steps' replays are dry runs
            res["eager"][mode] = ms_summary(summary(time_calls(eager, iters=iters,
                                                               warmup=WARMUP, stream=s)))
            host[mode] = 1e3 * statistics.median(spent)
            g = graphs[mode]
            res["graph"][mode] = ms_summary(summary(time_calls(
                lambda i, g=g: g.launch(s), iters=iters, warmup=WARMUP, stream=s)))
        if mode == "overlap_predict":  # eager and graph steps together
            pred = pf.predict_summary()
    # compute + copies: time of the main stream's compute alone (to its end event)
    cc_main["eager"] = ms_summary(time_main_part(rig.step_compute_copies, rig.cc_end, iters, s))
    if rig.cc_external:
        g = graphs["compute_copies"]
        cc_main["graph"] = ms_summary(time_main_part(lambda: g.launch(s), rig.cc_end, iters, s))
    set_mode(pf, "overlap", s)
    s.synchronize()
    misses_end = float(cupy.asnumpy(rig.cache.plan.count[:B]).mean())

    # ceilings, same run: the step's missed bytes by cudaMemcpyAsync, and the replays alone
    bytes_layer = B * misses_end * ROW
    step_bytes = int(bytes_layer * rig.L)
    mc_single, mc_chain = memcpy_h2d(rig.cache.pool.numpy, step_bytes, iters=10, chain=2,
                                     stream=s)
    shared_bytes = bytes_layer * len(rig.pattern.shared_layers)
    alone = {}
    for name, grid, rpw in (("replay_grid", pf.replay_grid, pf.replay_rows_per_warp),
                            ("full_grid", None, 1)):
        g = rig.capture(lambda grid=grid, rpw=rpw: rig.replays_alone(grid, rpw))
        t = summary(time_calls(lambda i, g=g: g.launch(s), iters=10, stream=s))
        alone[name] = {"ms": t["median_us"] / 1e3,
                       "GBps": shared_bytes / t["median_us"] / 1e3}
    del graphs
    n_shared = len(rig.pattern.shared_layers)
    derived = {}
    for ex in ("eager", "graph"):
        m = {k: v["median_ms"] for k, v in res[ex].items()}
        o_sync = m["no_overlap"] - m["no_offload"]
        o_ovl = m["overlap"] - m["no_offload"]
        o_dry = m["overlap_skip_io"] - m["no_offload"]
        o_pred = m["overlap_predict"] - m["no_offload"]
        cc = cc_main.get(ex)
        derived[ex] = {
            "overhead_no_overlap_ms": o_sync, "overhead_overlap_ms": o_ovl,
            "overhead_predict_ms": o_pred,
            "hidden": 1.0 - o_ovl / o_sync if o_sync > 0 else float("nan"),
            "hidden_skip_io": 1.0 - o_dry / o_sync if o_sync > 0 else float("nan"),
            "hidden_predict": 1.0 - o_pred / o_sync if o_sync > 0 else float("nan"),
            "ceiling": n_shared / rig.L,
            "compute_slowdown": (cc["median_ms"] / m["no_offload"] - 1.0) if cc else None,
            "offload_GBps_no_overlap": step_bytes / (o_sync * 1e6) if o_sync > 0 else None,
        }
    out = {"layers": rig.L, "batch": B, "miss_rate": rate, "misses_per_request": misses,
           "misses_per_request_end": misses_end,
           "full_layers": len(rig.pattern.full_layers), "shared_layers": n_shared,
           "attn_us": attn_us, "compute_us": mm_us, "compute_kind": rig.compute.kind,
           "matmul_m": rig.compute.m, "replay_grid": pf.replay_grid,
           "replay_rows_per_warp": pf.replay_rows_per_warp,
           "replay_thin": False,  # thin replays are gone; the key stays for old readers
           "step_io_bytes": step_bytes, "memcpy_step_io_ms": mc_single["median_us"] / 1e3,
           "memcpy_GBps": step_bytes / mc_single["median_us"] / 1e3,
           "memcpy_chain_GBps": step_bytes / mc_chain["median_us"] / 1e3,
           "replays_alone": alone, "host_enqueue_ms_eager": host,
           "modes": res, "compute_copies_main_ms": cc_main, "derived": derived,
           "common": rig.common, "predict": pred}
    if sweep:
        out["sweep"] = run_sweep(rig, res["graph"], iters)
    if predict_sweep:
        out["predict_sweep"] = run_predict_sweep(rig, res["graph"], iters)
    return out


# (replay grid, rows per warp, side priority) of the sweep; None: the prefetcher's default; the
# default's row comes first. (The one-warp "thin" replays of earlier runs are gone: measured
# worse, benchmarks/NOTES.md.)
SWEEP = [(None, None, "high"), (8, 4, "high"), (16, 2, "high"), (16, 4, "high"), (33, 1, "high"),
         (33, 2, "high"), (132, 1, "high"), (None, None, "default")]


def run_sweep(rig: Rig, base: dict, iters: int) -> list[dict]:
    """Overlap and compute + copies (graph) for other replay grids, rows per warp and the side
    stream's priority (``None``: the prefetcher's default)."""
    s, pf = rig.main, rig.pf
    grid0, rpw0, side0 = pf.replay_grid, pf.replay_rows_per_warp, pf.side
    low = cupy.cuda.Stream(non_blocking=True)  # default priority
    t0 = base["no_offload"]["median_ms"]
    o_sync = base["no_overlap"]["median_ms"] - t0
    rows = []
    for grid, rpw, prio in SWEEP:
        grid, rpw = grid or grid0, rpw or rpw0
        pf.replay_grid, pf.replay_rows_per_warp = grid, rpw
        pf.side = side0 if prio == "high" else low
        g_ovl = rig.capture(rig.step_offload)
        g_cc = capture_cc(rig)
        t_ovl = ms_summary(summary(time_calls(lambda i, g=g_ovl: g.launch(s), iters=iters,
                                              warmup=WARMUP, stream=s)))
        t_cc = (ms_summary(time_main_part(lambda g=g_cc: g.launch(s), rig.cc_end, iters, s))
                if rig.cc_external else None)
        rows.append({"replay_grid": grid, "rows_per_warp": rpw, "thin": False,
                     "side_priority": prio,
                     "overlap": t_ovl,
                     "hidden": 1.0 - (t_ovl["median_ms"] - t0) / o_sync,
                     "compute_main": t_cc,
                     "compute_slowdown": t_cc["median_ms"] / t0 - 1.0 if t_cc else None})
        del g_ovl, g_cc
    pf.replay_grid, pf.replay_rows_per_warp, pf.side = grid0, rpw0, side0
    s.synchronize()
    low.synchronize()
    return rows


def run_predict_sweep(rig: Rig, base: dict, iters: int) -> list[dict]:
    """No overlap, overlap and prediction (graph) with neighbouring full layers' top-k
    overlapping by each of COMMON (cold caches, warmed up, for each)."""
    s, pf = rig.main, rig.pf
    t0 = base["no_offload"]["median_ms"]
    rows = []
    for common in COMMON:
        rig.common = common
        pf.set_predict(False, s)
        pf.set_enabled(True, s)
        rig.reset()
        for _ in range(4):
            rig.step_offload()
        t = {}
        for mode in ("no_overlap", "overlap", "overlap_predict"):
            set_mode(pf, mode, s)
            g = rig.capture(rig.step_offload)
            t[mode] = ms_summary(summary(time_calls(lambda i, g=g: g.launch(s), iters=iters,
                                                    warmup=WARMUP, stream=s)))
            del g
        p = pf.predict_summary()
        o_sync = t["no_overlap"]["median_ms"] - t0
        rows.append({"common": common, **t, "predict": p,
                     "hidden": 1.0 - (t["overlap"]["median_ms"] - t0) / o_sync,
                     "hidden_predict": 1.0 - (t["overlap_predict"]["median_ms"] - t0) / o_sync})
    rig.common = 1.0
    pf.set_predict(False, s)
    pf.set_enabled(True, s)
    s.synchronize()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="24-layer pattern (plus the 78-layer target point), fewer configs")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--plot", metavar="JSON", help="only render the PNG of an existing JSON")
    ap.add_argument("--only", nargs="*", metavar="L:B:RATE",
                    help="run only these configurations (e.g. 78:64:0.05), without the sweeps "
                         "(--predict-sweep adds the prediction sweep)")
    ap.add_argument("--predict-sweep", action="store_true",
                    help="with --only: also the prediction sweep over top-k overlaps (batch 64, "
                         "5 %% rows only, as in the full run)")
    ap.add_argument("--node-priority", action="store_true",
                    help="instantiate the captured steps with each kernel's stream priority "
                         "(CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)")
    add_rig_args(ap)
    a = ap.parse_args()
    if a.node_priority and a.gemm_sms is not None:
        raise SystemExit("--node-priority with --gemm-sms: the driver refuses to keep node "
                         "priorities in a graph with the package's own cuBLAS matmul of this size "
                         "(CUDA_ERROR_NOT_SUPPORTED on the H200); use PyTorch's matmul")
    if a.predict_sweep and not a.only:
        raise SystemExit("--predict-sweep goes with --only (a full or --quick run has the sweep)")
    if a.plot:
        payload = json.loads(Path(a.plot).read_text())
        report.plot(payload, Path(a.plot).with_suffix(".png"))
        report.print_tables(payload["results"])
        return
    if a.quick:
        plan = [(24, [(8, 0.05), (64, 0.01), (64, 0.05), (64, 0.20), (128, 0.05)]),
                (78, [(64, 0.05)])]
        iters = 20
    else:
        grid = [(b, r) for b in (8, 32, 64, 128) for r in (0.01, 0.05, 0.20)]
        plan = [(24, grid), (78, grid)]
        iters = 30
    sweeps = not a.only
    if a.only:
        try:
            picked = [tuple(float(v) for v in o.split(":")) for o in a.only]
            if any(len(p) != 3 or p[0] < 4 or p[1] < 1 for p in picked):
                raise ValueError
        except ValueError:
            raise SystemExit(f"--only takes LAYERS:BATCH:RATE, layers >= 4, batch >= 1 (e.g. "
                             f"78:64:0.05), got {a.only}") from None
        plan = [(n, [(int(b), r) for ln, b, r in picked if int(ln) == n])
                for n in sorted({int(p[0]) for p in picked})]
    main_s, part = make_main_stream(a)
    main_s.use()  # every CuPy op of this script runs on it, never on the legacy stream
    t0 = time.perf_counter()
    out = Path(a.out)
    kern = Kernels()
    compute = make_compute(main_s, a)
    results = []
    payload = {"device": device_info(), "K": K, "H": H, "P": P, "row_bytes": ROW,
               "max_len": MAX_LEN, "iters": iters, "warmup": WARMUP,
               "target_layer_us": TARGET_LAYER_US, "setup_s": {}, "results": results,
               "gemm_sms": a.gemm_sms, "matmul_m": a.matmul_m, "replay_grid": a.replay_grid,
               "replay_rows_per_warp": a.replay_rows_per_warp, "node_priority": a.node_priority,
               "sm_partition": None if part is None else {"side": part.side_sms,
                                                          "main": part.main_sms}}
    for n_layers, configs in plan:
        bmax = max(b for b, _ in configs)
        rig = Rig(n_layers, bmax, kern, compute, main_s, part)
        rig.node_priority = a.node_priority
        shape_replays(rig.pf, a)
        payload["setup_s"][n_layers] = rig.setup_s
        print(f"{n_layers} layers, {bmax} requests: cache built in {rig.setup_s:.1f} s "
              f"(pattern {rig.pattern})", flush=True)
        for B, rate in configs:
            t1 = time.perf_counter()
            at = (B, rate) == (64, 0.05)
            r = run_config(rig, B, rate, iters, sweep=sweeps and at,
                           predict_sweep=(sweeps or a.predict_sweep) and at)
            results.append(r)
            payload["wall_s"] = time.perf_counter() - t0
            write_json(str(out), "bench_overlap.json", payload)  # partial results survive
            d = r["derived"]["graph"]
            print(f"L{n_layers} B{B} {rate * 100:g}% (matmul M {rig.compute.m}): graph no-offload "
                  f"{r['modes']['graph']['no_offload']['median_ms']:.2f} ms, no-overlap "
                  f"{r['modes']['graph']['no_overlap']['median_ms']:.2f}, overlap "
                  f"{r['modes']['graph']['overlap']['median_ms']:.2f}; hidden "
                  f"{d['hidden'] * 100:.1f}% of ceiling {d['ceiling'] * 100:.1f}% "
                  f"({time.perf_counter() - t1:.1f} s)", flush=True)
        rig.close()
        del rig
        cupy.get_default_memory_pool().free_all_blocks()
    if part is not None:
        part.close()
    report.plot(payload, out / "bench_overlap.png")
    for r in results:
        c = r["replays_alone"]
        print(f"ceilings L{r['layers']} B{r['batch']} {r['miss_rate'] * 100:g}%: memcpy H2D of "
              f"the step's {r['step_io_bytes'] / 1e6:.1f} MB {r['memcpy_step_io_ms']:.2f} ms "
              f"({r['memcpy_GBps']:.1f} GB/s); shared replays alone "
              f"{c['replay_grid']['ms']:.2f} ms ({c['replay_grid']['GBps']:.1f} GB/s, grid "
              f"{r['replay_grid']}) / {c['full_grid']['ms']:.2f} ms full grid; layer compute "
              f"{r['attn_us']:.0f} us attention + {r['compute_us']:.0f} us {r['compute_kind']}; "
              f"eager host enqueue {r['host_enqueue_ms_eager']['overlap']:.2f} ms/step")
    report.print_tables(results)


if __name__ == "__main__":
    main()
