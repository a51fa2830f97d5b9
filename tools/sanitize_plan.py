"""Small run of the planned copy and the IndexCache prefetcher for compute-sanitizer.

Covers replay_plan (several grids and rows per warp, padding via num_real, clamped and
out-of-range entries) in the production copy and, through hisparse_cupy.testing.probe.copy_probe, in
its measuring instance (dry run, spin, bad-row count), and a few decode steps of a Prefetcher over
"FSSFS" (full swaps on the main stream, replays on the side stream, event waits), with and
without prediction mode (the stager under both rules, staging copies, staged rows read by the
next full layer's copy), and with prediction on an SMPartition (side streams on SMs of their
own, the step on the rest); and the transfer checksum kernel (cu/sums.cu) on views, a
misaligned start and empty layers, against NumPy's. Exits non-zero on any wrong byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hisparse_cupy import HostKVPool, HotBufferCache, MissPlan, Prefetcher, SMPartition, replay_plan
from hisparse_cupy.testing.probe import copy_probe  # noqa: E402

from _util import pattern  # noqa: E402

ROW = 656
POISON = 0xEE


def check_replay(s, rng) -> int:
    n_host, n_dev, B, W = 512, 256, 5, 12
    pool = HostKVPool(2, n_host, ROW)
    for layer in range(2):
        pool.layer(layer)[:] = pattern(layer, np.arange(n_host), ROW)
    plan = MissPlan(8, W)
    counts = np.array([12, 0, 40, -1, 7], np.int32)  # 40 and -1 are clamped
    src = np.full((8, W), -1, np.int64)
    dst = np.full((8, W), -1, np.int32)
    free = rng.permutation(n_dev)
    k = 0
    for b in range(B):
        c = int(np.clip(counts[b], 0, W))
        src[b, :c] = rng.choice(n_host, c, replace=False)
        dst[b, :c] = free[k:k + c]
        k += c
    src[0, 5] = n_host + 3  # out of range: skipped and counted
    cnt = np.zeros(8, np.int32)
    cnt[:B] = counts
    errors = 0
    dev = cupy.empty((n_dev, ROW), cupy.uint8)
    plan.src[...] = cupy.asarray(src)
    plan.dst[...] = cupy.asarray(dst)
    plan.count[...] = cupy.asarray(cnt)
    nr = cupy.full(1, 4, cupy.int32)
    bad = cupy.zeros(1, cupy.int32)
    # (grid, probed, dry run, spin cycles, rows per warp); probed runs count the bad entry
    runs = ((1, False, False, 0, 1), (1, True, False, 0, 1), (3, True, False, 500, 1),
            (None, False, False, 0, 1), (None, True, False, 0, 1), (2, True, True, 0, 1),
            (2, False, False, 0, 4), (2, True, False, 0, 4), (5, False, False, 0, 8),
            (5, True, False, 300, 2))
    for grid, probed, dry, spin, rpw in runs:
        dev[...] = POISON
        if probed:
            with copy_probe(dry_run=dry, spin_cycles=spin, bad=bad, streams=[s]):
                replay_plan(plan, B, device_rows=dev, pool=pool, layer=1, num_real=nr,
                            grid=grid, rows_per_warp=rpw, stream=s)
        else:
            replay_plan(plan, B, device_rows=dev, pool=pool, layer=1, num_real=nr, grid=grid,
                        rows_per_warp=rpw, stream=s)
        got = cupy.asnumpy(dev)
        want = np.full((n_dev, ROW), POISON, np.uint8)
        if not dry:
            for b in range(4):
                c = int(np.clip(counts[b], 0, W))
                ok = src[b, :c] < n_host
                if ok.any():
                    want[dst[b, :c][ok]] = pattern(1, src[b, :c][ok], ROW)
        errors += int((got != want).any(axis=1).sum())
    n_probed = sum(1 for run in runs if run[1])
    if int(bad.get()[0]) != n_probed:
        print(f"bad counter {int(bad.get()[0])}, expected {n_probed}")
        errors += 1
    s.synchronize()
    pool.close()
    return errors


def check_prefetch(s, rng, predict: bool, partition=None, rule: str = "misses") -> int:
    pat = "FSSFS"
    L, R, H, K, max_len = len(pat), 2, 64, 32, 200
    cache = HotBufferCache(n_layers=L, max_requests=R, max_len=max_len, row_bytes=ROW,
                           hot_size=H, top_k=K, extra_page=8)
    cache.device[...] = POISON
    rids = [cache.admit(max_len, stream=s) for _ in range(R)]
    for rid in rids:
        rows = rid * max_len + np.arange(max_len)
        cache.write_host(rid, 0, np.stack([pattern(layer, rows, ROW) for layer in range(L)]))
    req = cupy.asarray(np.array(rids, np.int32))
    lens = cupy.full(R, max_len, cupy.int32)
    perm = rng.permutation(max_len - 1)
    pf = Prefetcher(cache, pat, replay_grid=2, predict=predict, predict_width=16,
                    partition=partition, predict_rule=rule)
    own = rng.permutation(max_len - 1)
    errors = 0
    for t in range(5):
        pos = (t * 6 + 53 * np.arange(R)[:, None] + np.arange(K)[None, :]) % (max_len - 1)
        # full layer 3 selects every other position like layer 0, the rest its own tokens
        toks = {0: perm[pos], 3: np.where(pos % 2 == 0, perm[pos], own[pos])}
        tks = {f: cupy.asarray(v.astype(np.int32)) for f, v in toks.items()}
        anchor = [0, 0, 0, 3, 3]
        step = cache.begin_step(req, lens, stream=s, prefetcher=pf)
        outs = [step.swap(layer, tks[anchor[layer]]).copy() for layer in range(L)]
        step.finish()
        s.synchronize()
        for layer in range(L):
            host = np.array(rids)[:, None] * max_len + toks[anchor[layer]]
            locs = cupy.asnumpy(outs[layer]).reshape(-1)
            got = cupy.asnumpy(cache.device_rows(layer))[locs]
            errors += int((got != pattern(layer, host.reshape(-1), ROW)).any(axis=1).sum())
    if predict and pf.predict_summary()["used"] == 0:
        print("prediction staged nothing that was used")
        errors += 1
    pf.synchronize()
    cache.close()
    return errors


def check_sums(rng) -> int:
    """The per-layer transfer checksum on the GPU against NumPy's: mismatching layers."""
    from hisparse_cupy._kernels import sums as _sums

    bad = 0
    for L, n, rb in [(1, 1, 8), (3, 100, 656), (4, 0, 64), (2, 3000, 1152)]:
        kv = rng.integers(0, 256, (L, n + 3, rb), dtype=np.uint8)
        want = _sums.kv_sums(np.ascontiguousarray(kv[:, 2: 2 + n]))
        got = _sums.kv_sums(cupy.asarray(kv)[:, 2: 2 + n])
        bad += sum(a != b for a, b in zip(got, want, strict=True))
    return bad


def main() -> int:
    rng = np.random.default_rng(11)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        e1 = check_replay(s, rng)
        e2 = check_prefetch(s, rng, False) + check_prefetch(s, rng, True) + \
            check_prefetch(s, rng, True, rule="selection")
    with SMPartition(8) as part:  # side streams on SMs of their own, the step on the rest
        ps = part.stream("main")
        with ps:
            e2 += check_prefetch(ps, rng, True, part)
        cupy.cuda.Device().synchronize()
    e3 = check_sums(rng)
    cupy.cuda.Device().synchronize()
    print(f"sanitize_plan: {e1} wrong rows in replays, {e2} in prefetcher steps, {e3} wrong "
          f"checksum layers")
    return 1 if e1 or e2 or e3 else 0


if __name__ == "__main__":
    sys.exit(main())
