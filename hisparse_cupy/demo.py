"""A decode loop over a hierarchical sparse KV cache.

Each step, per request: an "indexer" picks the top-k past tokens (a recent window plus a slowly
drifting set of older ones), the model writes the new token's KV into the newest row of every
layer, the cache backs that row up to host memory, and every layer swaps its top-k in; a
stand-in attention then checks that every selected row holds its token's bytes.

With a CUDA device this runs the kernels (HotBufferCache); without one it runs the same
algorithm with the NumPy oracle (hisparse_cupy.reference) and says so.

    python -m hisparse_cupy demo [--steps N] [--requests R]
    python examples/decode_loop.py [--steps N] [--requests R]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

L, H, K, P, ROW = 4, 1024, 256, 8, 656
PROMPT = 6000


def kv_bytes(layer: int, ids: np.ndarray) -> np.ndarray:
    """The KV row of token identity ``ids`` in ``layer``: a pattern the check can recompute."""
    ids = np.asarray(ids, np.uint64).reshape(-1, 1)
    words = np.arange(ROW // 8, dtype=np.uint64).reshape(1, -1)
    v = (ids * np.uint64(0x9E3779B97F4A7C15) + np.uint64(layer) * np.uint64(1 << 40)) ^ words
    return v.view(np.uint8).reshape(len(ids), ROW)


def indexer(rng, seq: int, prev: np.ndarray | None) -> np.ndarray:
    """Top-k: the newest 64 tokens plus older ones, 95 % of them kept from the last step."""
    recent = np.arange(seq - 64, seq)
    old_n = K - recent.size
    if prev is None:
        old = rng.choice(seq - 64, size=old_n, replace=False)
    else:
        old = prev[prev < seq - 64][:old_n]
        keep = old[rng.random(old.size) < 0.95]
        pool = np.setdiff1d(rng.integers(0, seq - 64, size=4 * old_n), keep)
        old = np.concatenate([keep, rng.permutation(pool)[: old_n - keep.size]])
    return np.concatenate([old, recent]).astype(np.int32)


def run_gpu(steps: int, R: int, rng) -> None:
    import cupy

    from hisparse_cupy import HotBufferCache

    max_len = PROMPT + steps + 1
    cache = HotBufferCache(n_layers=L, max_requests=R, max_len=max_len, row_bytes=ROW,
                           hot_size=H, top_k=K, extra_page=P)
    rids = [cache.admit(PROMPT, kv=np.stack([kv_bytes(layer, r * max_len + np.arange(PROMPT))
                                             for layer in range(L)])) for r in range(R)]
    req = cupy.asarray(rids, dtype=cupy.int32)
    seq = PROMPT
    prev = [None] * R
    t0 = time.perf_counter()
    for step in range(steps):
        seq += 1
        lens = cupy.full(R, seq, dtype=cupy.int32)
        step_ = cache.begin_step(req, lens)  # the batch is validated once per step
        rows = step_.newest_rows()  # the model writes this step's KV here
        for layer in range(L):
            new = np.concatenate([kv_bytes(layer, [r * max_len + seq - 1]) for r in rids])
            cache.device_rows(layer)[rows] = cupy.asarray(new)
        step_.backup_newest()
        topk = np.stack([indexer(rng, seq, prev[b]) for b in range(R)])
        prev = list(topk)
        d_topk = cupy.asarray(topk)
        misses = 0
        for layer in range(L):
            locs = cupy.asnumpy(step_.swap(layer, d_topk, check=True))
            misses += int(cupy.asnumpy(cache.plan.count[:R]).sum())
            got = cupy.asnumpy(cache.device_rows(layer)[cupy.asarray(locs.reshape(-1))])
            ids = (np.asarray(rids)[:, None] * max_len + topk).reshape(-1)
            if not np.array_equal(got, kv_bytes(layer, ids)):
                raise SystemExit(f"step {step} layer {layer}: attention read wrong bytes")
        if step % max(1, steps // 8) == 0 or step == steps - 1:
            print(f"step {step:4d}  seq_len {seq}  misses/layer/request "
                  f"{misses / (L * R):6.1f} of {K}  bytes verified")
    dt = time.perf_counter() - t0
    print(f"{steps} steps x {L} layers x {R} requests on the GPU in {dt:.2f} s "
          f"(eager Python loop with byte checks); every selected row held its token's KV")
    cache.close()


def run_cpu(steps: int, R: int, rng) -> None:
    from hisparse_cupy import reference as ref

    max_len = PROMPT + steps + 1
    host_locs = (np.arange(R)[:, None] * max_len + np.arange(max_len)).astype(np.int64)
    slot_locs = np.arange(R * (H + P), dtype=np.int32).reshape(R, H + P)
    tokens = np.full((L, R, H + P), -1, np.int32)
    lru = np.tile(np.arange(H, dtype=np.int16), (L, R, 1))
    seq = PROMPT
    prev = [None] * R
    for step in range(steps):
        seq += 1
        topk = np.stack([indexer(rng, seq, prev[b]) for b in range(R)])
        prev = list(topk)
        misses = 0
        for layer in range(L):
            res = ref.swap_in(topk, np.arange(R), np.full(R, seq), host_locs=host_locs,
                              slot_tokens=tokens[layer], slot_locs=slot_locs, lru=lru[layer],
                              hot_size=H, n_host_rows=R * max_len)
            misses += int(res.plan_count.sum())
            assert (res.device_locs >= 0).all() and not res.status.any()
            ref.check_invariants(tokens[layer], slot_locs, lru[layer], H)
        if step % max(1, steps // 8) == 0 or step == steps - 1:
            print(f"step {step:4d}  seq_len {seq}  misses/layer/request "
                  f"{misses / (L * R):6.1f} of {K}  invariants hold")
    print(f"{steps} steps x {L} layers x {R} requests with the NumPy oracle")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="decode loop over a hierarchical sparse KV cache")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--requests", type=int, default=4)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    try:
        import cupy

        gpu = cupy.cuda.is_available()
    except ImportError:
        gpu = False
        print("CuPy is not installed: ", end="")
    if gpu:
        run_gpu(a.steps, a.requests, rng)
    else:
        print("no CUDA device: running the same algorithm with the NumPy oracle "
              "(hisparse_cupy.reference)")
        run_cpu(max(1, a.steps // 4), a.requests, rng)


if __name__ == "__main__":
    main()
