"""What staging the first offloaded full layer's misses from the previous step could catch
(issue "The overlap users get", item 6), on the demo's top-k streams, CPU only.

Prediction stages a full layer's likely misses while the layer before it computes; the first
offloaded full layer of a step (the demo's layer 2, the low layers 0-1 resident) has no
full layer before it in the same step, so its swap is never predicted. The only earlier
selections are the previous step's. This models each source as an exact-LRU hot buffer of H
slots per request (the cache's own policy, the generator's stacks): at the end of step t-1,
stage the tokens a source selected that layer 2's buffer does not hold, and count how many of
layer 2's misses at step t they are.

Sources: the previous step's last full layer (what computes just before), every offloaded full
layer of the previous step, and the next full layer (layer 6) of the previous step.

    python benchmarks/model_first_layer_staging.py [--batch 4] [--steps 30] [--hot 4096]
        [--context 8192] [--layer-overlap 0.8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hisparse_cupy.demo._topk_model import TopKStream, shape_for  # noqa: E402


def model(batch: int, steps: int, hot: int, context: int, layer_overlap: float,
          top_k: int = 2048, n_full: int = 21, seed: int = 0) -> dict:
    shape = shape_for(None, layer_overlap, 8)
    st = TopKStream(shape, n_full=n_full, batch=batch, top_k=top_k, context=context,
                    rng=np.random.default_rng(seed))
    first = shape.low_layers  # the first offloaded full layer (the low layers are resident)
    sources = {"last full layer": lambda s: [s[-1]],
               "offloaded full layers": lambda s: list(s[first:]),
               "next full layer": lambda s: [s[first + 1]]}
    tot = {k: {"staged": 0, "caught": 0} for k in sources}
    misses, prev = 0, None
    for t in range(steps):
        lens = np.full(batch, context + t)
        before = [s.copy() for s in st.stacks[first]]  # layer 2's stacks before step t
        sel = st.step(lens)
        if prev is None:
            prev = sel
            continue
        for b in range(batch):
            held = before[b][:hot]  # what an exact-LRU buffer of H slots holds
            missed = np.setdiff1d(sel[first, b], held)
            misses += missed.size
            for k, pick in sources.items():
                staged = np.setdiff1d(np.unique(np.concatenate(
                    [layer[b] for layer in pick(prev)])), held)
                tot[k]["staged"] += staged.size
                tot[k]["caught"] += np.intersect1d(staged, missed).size
        prev = sel
    n = batch * (steps - 1)
    out = {"batch": batch, "steps": steps, "hot": hot, "context": context, "top_k": top_k,
           "layer_overlap": layer_overlap, "misses_per_request_step": misses / n, "sources": {}}
    for k, v in tot.items():
        out["sources"][k] = {"staged_per_request_step": v["staged"] / n,
                             "precision": v["caught"] / max(1, v["staged"]),
                             "recall": v["caught"] / max(1, misses)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hot", type=int, default=4096)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layer-overlap", type=float, default=0.8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    r = model(a.batch, a.steps, a.hot, a.context, a.layer_overlap)
    print(f"layer 2 (the first offloaded full layer), H {a.hot}, context {a.context}: "
          f"{r['misses_per_request_step']:.0f} misses per request and step")
    print(f"{'staged from step t-1':>22} {'rows':>6} {'precision':>9} {'recall':>6}")
    for k, v in r["sources"].items():
        print(f"{k:>22} {v['staged_per_request_step']:>6.0f} {v['precision']:>9.3f} "
              f"{v['recall']:>6.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
