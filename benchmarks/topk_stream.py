"""The top-k stream a real model's indexer picks, beside the demo's generator at the same settings.

Runs a transformers GLM-5 or DeepSeek-V3.2 (``examples/transformers_decode.py``'s model: the
published MLA row and indexer shape, random weights) through its own greedy decode, records
every full layer's indexer picks at each decode step, and measures them as the demo measures its
generator (``hisparse_cupy.demo._topk_model.measure``): per full layer, the exact-LRU miss rate
of a hot buffer of H = K, 2K and 4K rows (from a cold buffer: the admission loads no warm
tokens), the overlap of each step's picks with the previous step's, and with the previous full
layer's in the same step. The demo's generator (``TopKStream``, its default shape: the HiSparse
paper's GLM-5.1 curve) draws the same number of steps at the same context and K, measured the
same way. Random weights say little about a trained model's picks: the table says which is
which.

    python benchmarks/topk_stream.py --model glm_moe_dsa --prompt 16384 --new 128 --json out.json
    python benchmarks/topk_stream.py --size tiny --prompt 96 --new 16      # CPU, a quick look
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location(
        "transformers_decode", ROOT / "examples" / "transformers_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_picks(model, ids, new: int) -> list[np.ndarray]:
    """The model's own greedy decode of ``new`` tokens after ``ids``: each decode step's picks,
    ``[n_full, B, K]`` (the layers that run an indexer, in order)."""
    import torch

    picks: list[list[np.ndarray]] = []
    full = [layer.self_attn.indexer for layer in model.model.layers
            if getattr(layer.self_attn, "indexer", None) is not None]

    def hook(j):
        def record(module, args, out):
            if out.shape[1] != 1:  # (the prefill's picks: not a decode step)
                return
            if j == 0:
                picks.append([])
            picks[-1].append(out[:, 0].cpu().numpy().astype(np.int64))
        return record

    handles = [m.register_forward_hook(hook(j)) for j, m in enumerate(full)]
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new, do_sample=False)
    finally:
        for h in handles:
            h.remove()
    return [np.stack(step) for step in picks]


def table(name: str, m: dict, hots) -> list[str]:
    rows = []
    for j in range(len(m["step_overlap"])):
        miss = " | ".join(f"{1 - m['miss'][H][j]:.3f}" for H in hots)
        lo = m["layer_overlap"][j]
        rows.append(f"| {name} | {j} | {miss} | {m['step_overlap'][j]:.3f} | "
                    f"{'-' if np.isnan(lo) else f'{lo:.3f}'} |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("glm_moe_dsa", "deepseek_v32"), default="glm_moe_dsa")
    ap.add_argument("--size", choices=("gpu", "tiny"), default="gpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    from hisparse_cupy.demo._topk_model import StreamShape, TopKStream, measure

    ex = _example()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = ex.build(a.model, a.size, a.layers, a.prompt + a.new + 1, device, seed=a.seed,
                     attn="sdpa" if a.size == "gpu" else "eager")
    K = model.config.index_topk
    hots = (K, 2 * K, 4 * K)
    g = torch.Generator().manual_seed(a.seed + 1)
    ids = torch.randint(2, model.config.vocab_size, (a.batch, a.prompt), generator=g)
    steps = model_picks(model, ids.to(device), a.new)
    n_full = steps[0].shape[0]
    cold = [[np.empty(0, np.int64) for _ in range(a.batch)] for _ in range(n_full)]
    ours = measure(steps, cold, hots)
    shape = StreamShape() if K > 64 else StreamShape(recent=max(1, K // 4))  # (tiny K)
    stream = TopKStream(shape, n_full=n_full, batch=a.batch, top_k=K,
                        context=a.prompt, rng=np.random.default_rng(a.seed))
    drawn = [stream.step(np.full(a.batch, a.prompt + t + 1)) for t in range(len(steps))]
    theirs = measure(drawn, stream.initial, hots)
    head = ("| stream | full layer | " + " | ".join(f"hit rate H={H}" for H in hots)
            + " | step overlap | layer overlap |")
    lines = [head, "|" + "---|" * (len(hots) + 4)] + table(
        f"{a.model} indexer (random weights)", ours, hots) + table(
        "demo generator (default shape)", theirs, hots)
    print(f"{a.model} ({a.size}): {a.layers} layers, {n_full} full, prompt {a.prompt} x "
          f"{a.batch}, {len(steps)} decode steps, K {K}; hit rates from a cold hot buffer")
    print("\n".join(lines))
    if a.json:
        def plain(m):
            return {k: ({str(h): v.tolist() for h, v in x.items()} if isinstance(x, dict)
                        else x.tolist()) for k, x in m.items()}
        with open(a.json, "w") as fh:
            json.dump({"model": a.model, "size": a.size, "layers": a.layers,
                       "prompt_tokens": a.prompt, "decode_tokens": a.new, "batch": a.batch,
                       "top_k": K, "hots": list(hots), "indexer": plain(ours),
                       "generator": plain(theirs)}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
