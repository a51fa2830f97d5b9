"""Experiment (kept with its output, gaps_experiment_at_c2d9135.txt; run from the repository
root as PYTHONPATH=. python benchmarks/results/residency_lean_2026-12-04/gaps_experiment.py 8):
which part of an all-resident offloaded step at batch 8 widens the kernel gaps."""
import sys

import cupy
import numpy as np

from hisparse_cupy.cache import HotBufferCache
from hisparse_cupy.demo._args import from_args
from hisparse_cupy.demo._loop import Rig

B = int(sys.argv[1]) if len(sys.argv) > 1 else 8
orig_grow = HotBufferCache.grow


def run(name, backup=None, pregrow=False, extra=()):
    cfg = from_args(["--batch", str(B), "--warmup", "20", "--steps", "100", "--quiet",
                     "--resident-requests", str(B), *extra])
    if pregrow:
        def grow(self, rid, n, stream=None):  # every page a request will need, at once
            orig_grow(self, rid, cfg.max_len, stream=stream)

        HotBufferCache.grow = grow
    s = cupy.cuda.Stream(non_blocking=True)
    rig = Rig(cfg, s, lambda *_: None, backup=backup)
    try:
        out = {}
        for mode in ("gpu-only", "offload", "gpu-only", "offload"):
            r = rig.run(mode, "graph", None)
            out.setdefault(mode, []).append(float(np.mean(r.step_ms)))
    finally:
        rig.close()
        HotBufferCache.grow = orig_grow
    g, o = min(out["gpu-only"]), min(out["offload"])
    print(f"{name:28s} gpu-only {g:.3f} offload {o:.3f} ms: {100 * (o - g) / g:+.2f} %",
          flush=True)


if __name__ == "__main__":
    run("default")
    run("backup write_host=False", backup=lambda st: st.backup_newest(write_host=False))
    run("pregrown to max_len", pregrow=True)
    run("no backup, pregrown", backup=lambda st: None, pregrow=True)
