"""transformers' GLM-5 or DeepSeek-V3.2 decoding through the cache, against its own decode.

A random-initialized model of the chosen kind (the published MLA row, 512 + 64 values, and the
DSA indexer's shape; fewer layers, heads and experts than the real one, so that it fits) decodes
a random prompt greedily twice: with ``model.generate`` as transformers runs it (dense K/V, the
top-k as a mask), and through :class:`hisparse_cupy.integrations.transformers.SparseMLA` (the
prompt's rows admitted into the host pool, each step's top-k swapped into a hot buffer smaller
than the context, attention over the selected rows only). It prints whether the tokens are
identical, the largest logit difference, the swaps' hit rate, the time a decode step takes each
way and what a request costs in host and GPU memory, and writes them as JSON (``--json``).
Exit status 1 if the tokens differ or the logits differ by more than ``--tolerance``.

    python examples/transformers_decode.py                        # GPU: GLM-5, 16k prompt
    python examples/transformers_decode.py --model deepseek_v32 --prompt 32768 --budget 600000
    python examples/transformers_decode.py --backend oracle      # CPU: tiny, the NumPy oracle

Needs torch and transformers (from the checkout: pip install -e '.[transformers]').
"""

from __future__ import annotations

import argparse
import json
import sys
import time

KINDS = ("glm_moe_dsa", "deepseek_v32")
NEEDS = ("examples/transformers_decode.py needs torch and transformers: from the checkout, "
         "pip install -e '.[transformers]', or pip install torch transformers")

# The published shapes' MLA row (512 + 64) and indexer keys (128 values, K 2048); the rest small,
# 4 indexer heads among them (the model's own prefill scores S x T a head: 32k tokens x 4 heads
# is 17 GB), and GLM-5's layers alternately full and shared.
SIZES = {
    "gpu": dict(vocab_size=2048, hidden_size=1024, intermediate_size=2048,
                moe_intermediate_size=256, num_attention_heads=8, q_lora_rank=512,
                kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                index_topk=2048, index_n_heads=4, index_head_dim=128, n_routed_experts=4),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                 moe_intermediate_size=32, num_attention_heads=4, q_lora_rank=48,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
                 index_topk=16, index_n_heads=4, index_head_dim=32, n_routed_experts=4),
}


def config(kind: str, size: str, layers: int, max_len: int) -> dict:
    """A transformers config dict of ``kind`` at ``size`` ("gpu" or "tiny") for sequences up
    to ``max_len`` tokens."""
    max_len = 4 * -(-max_len // 4)  # (YaRN's factor 4 exactly)
    c = dict(SIZES[size], num_hidden_layers=layers, num_key_value_heads=SIZES[size][
        "num_attention_heads"], n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, max_position_embeddings=max_len,
        initializer_range=0.02, bos_token_id=0, eos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False)
    if kind == "glm_moe_dsa":
        c.update(indexer_types=[("full", "shared")[i % 2] for i in range(layers)],
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:  # YaRN, so the softmax scale carries its mscale as DeepSeek's does
        c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": max_len // 4,
                                  "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                                  "beta_slow": 1})
    return c


def build(kind: str, size: str, layers: int, max_len: int, device: str, seed: int = 0,
          attn: str = "eager"):
    """The model, random weights from ``seed``, fp32 on ``device``; ``attn``: the attention
    transformers runs for it ("sdpa" holds long prompts: "eager" keeps S x T scores a head)."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(kind, **config(kind, size, layers, max_len))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model.float().eval().to(device)


def decode(model, ids, new: int, sparse=None):
    """Greedy tokens ``[B, new]``, logits ``[B, new, vocab]`` and seconds a decode step."""
    import torch

    steps = []

    class Clock:  # a generate logits processor: the time between steps (prefill excluded)
        def __call__(self, input_ids, scores):
            if input_ids.is_cuda:
                torch.cuda.synchronize()
            steps.append(time.perf_counter())
            return scores

    kw = dict(max_new_tokens=new, do_sample=False, output_logits=True,
              return_dict_in_generate=True, logits_processor=[Clock()])
    with torch.no_grad():
        out = model.generate(ids, **kw) if sparse is None else sparse.generate(ids, **kw)
    per_step = (steps[-1] - steps[0]) / max(len(steps) - 1, 1)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1), per_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", choices=KINDS, default="glm_moe_dsa")
    ap.add_argument("--backend", choices=("cuda", "oracle"), default=None,
                    help="default: cuda where a GPU is usable, else oracle (tiny sizes)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=None, help="default 16384 (oracle: 96)")
    ap.add_argument("--new", type=int, default=None, help="tokens decoded (default 128; "
                    "oracle: 16)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hot", type=int, default=None, help="hot rows a request (default "
                    "2 x index_topk: smaller than the context, so every step misses)")
    ap.add_argument("--budget", type=int, default=None, help="device rows a layer for "
                    "residency (cuda; default: every request sparse)")
    ap.add_argument("--form", choices=("absorbed", "expanded"), default="absorbed")
    ap.add_argument("--overlap", action="store_true", help="GLM-5's shared layers through a "
                    "Prefetcher (cuda)")
    ap.add_argument("--attn", choices=("eager", "sdpa"), default=None, help="the model's own "
                    "attention (default: sdpa on the GPU, eager on the CPU)")
    ap.add_argument("--tolerance", type=float, default=1e-3, help="largest logit difference "
                    "accepted (fp32)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    try:
        import torch

        from hisparse_cupy.integrations.transformers import SparseMLA
    except ImportError as e:
        raise SystemExit(f"{NEEDS} ({e})") from None
    backend = a.backend or ("cuda" if torch.cuda.is_available() else "oracle")
    size = "gpu" if backend == "cuda" else "tiny"
    n = a.prompt or (16384 if size == "gpu" else 96)
    new = a.new or (128 if size == "gpu" else 16)
    device = "cuda" if backend == "cuda" else "cpu"
    model = build(a.model, size, a.layers, n + new + 1, device,
                  attn=a.attn or ("sdpa" if size == "gpu" else "eager"))
    k = model.config.index_topk
    hot = a.hot or 2 * k
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, model.config.vocab_size, (a.batch, n), generator=g).to(device)
    print(f"{a.model}: {a.layers} layers, prompt {n} x {a.batch}, {new} new tokens, index_topk "
          f"{k}, hot {hot}, backend {backend}, {a.form}", flush=True)
    want, want_logits, t_own = decode(model, ids, new)
    sparse = SparseMLA(model, hot_size=hot, max_len=n + new + 1, max_requests=a.batch,
                       device_budget=a.budget, backend=backend, form=a.form,
                       overlap=a.overlap)
    try:
        got, logits, t_ours = decode(model, ids, new, sparse)
        counters = sparse.counters()
    finally:
        sparse.remove()
    same = bool(torch.equal(got, want))
    diff = float((logits - want_logits).abs().max())
    sel, miss = (float(sum(counters[x])) for x in ("selected", "misses"))
    attn, size_of = model.model.layers[0].self_attn, next(model.parameters()).element_size()
    row = (attn.kv_lora_rank + attn.qk_rope_head_dim) * size_of
    idx_bytes = model.config.index_head_dim * size_of * sum(
        t == "full" for t in (getattr(model.config, "indexer_types", None)
                              or ["full"] * a.layers))
    res = {"model": a.model, "backend": backend, "form": a.form, "layers": a.layers,
           "prompt_tokens": n, "decode_tokens": new, "batch": a.batch, "hot": hot,
           "index_topk": k, "device_budget": a.budget, "tokens_identical": same,
           "max_logit_diff": diff, "hit_rate": 1 - miss / max(sel, 1),
           "self_check": "passed" if same and diff <= a.tolerance else "FAILED",
           "step_s_model": t_own, "step_s_cache": t_ours,
           "host_bytes_per_request": a.layers * (n + new) * row,
           "gpu_bytes_per_request": a.layers * (hot + 64) * row + (n + new) * idx_bytes}
    host_mb, gpu_mb = res["host_bytes_per_request"] / 1e6, res["gpu_bytes_per_request"] / 1e6
    print(f"tokens identical: {same}; max |logit diff| {diff:.3g}; hit rate "
          f"{res['hit_rate']:.3f}; a decode step {1e3 * t_ours:.1f} ms through the cache, "
          f"{1e3 * t_own:.1f} ms the model's own; a request: {host_mb:.1f} MB host, "
          f"{gpu_mb:.1f} MB GPU (hot rows and indexer keys); self-check {res['self_check']}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0 if res["self_check"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
