"""Each kernel's own time in one captured decode step of ``bench_overlap`` (Nsight Compute).

Builds ``bench_overlap``'s workload (``_overlap_rig.py``, one configuration), warms the chosen
mode up, captures one step and replays it once inside a profiler range (``cudaProfilerStart`` /
``Stop``), so that

    ncu --profile-from-start off --clock-control none \\
        --metrics gpu__time_duration.sum,launch__grid_size --csv --page raw \\
        python benchmarks/ncu_overlap_step.py [--mode overlap_predict] [--layers 78] \\
        [--batch 64] [--rate 0.05] [rig options] > step.csv
    python benchmarks/ncu_overlap_step.py --summarize step.csv

lists every kernel of exactly one step. ncu runs the kernels one at a time, so the times are
each kernel alone on the GPU (no overlap, no launch gaps): set them against the step's graph
timeline (``overlap_waits.py --graph``) to see what the overlap itself costs.
"""

from __future__ import annotations

import argparse
import collections
import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def summarize(path: str) -> None:
    """Kernels of an ncu ``--csv --page raw`` report grouped by name and grid: count, median
    and total time (us)."""
    rows = list(csv.reader(Path(path).read_text().splitlines()))
    h = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    hdr = rows[h]
    name, dur = hdr.index("Kernel Name"), hdr.index("gpu__time_duration.sum")
    grid = hdr.index("launch__grid_size") if "launch__grid_size" in hdr else None
    scale = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[rows[h + 1][dur]]
    groups = collections.defaultdict(list)
    for r in rows[h + 2:]:
        if len(r) == len(hdr):
            key = (r[name].split("(")[0], "?" if grid is None else r[grid])
            groups[key].append(float(r[dur].replace(",", "")) * scale)
    print("| kernel | grid | launches | median us | total us |\n|---|---|---|---|---|")
    for (k, g), v in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {k} | {g} | {len(v)} | {statistics.median(v):.1f} | {sum(v):.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summarize", metavar="CSV", help="only summarize an ncu CSV report")
    ap.add_argument("--mode", default="overlap_predict",
                    choices=("no_overlap", "overlap", "overlap_predict"))
    ap.add_argument("--layers", type=int, default=78)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rate", type=float, default=0.05)
    import _overlap_rig as ov

    ov.add_rig_args(ap)
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize)
        return
    import cupy

    rig, part = ov.build(a, a.layers, a.batch)
    s = rig.main
    ov.prepare_config(rig, a.batch, a.rate)
    ov.set_mode(rig.pf, a.mode, s)
    rig.step_offload()
    g = rig.capture(rig.step_offload)
    for _ in range(3):
        g.launch(s)
    s.synchronize()
    cupy.cuda.profiler.start()
    g.launch(s)
    s.synchronize()
    cupy.cuda.profiler.stop()
    del g
    rig.close()
    if part is not None:
        part.close()


if __name__ == "__main__":
    main()
