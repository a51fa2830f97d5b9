"""Small run of the single-step kernels for compute-sanitizer (exits non-zero on wrong bytes).

Covers swap_resolve (fast path and LRU path, misses, duplicates, -1, out-of-range tokens),
planned_copy in both directions (swap misses, admission loads, the newest-token backup) and
newest_rows, through HotBufferCache; the resolve with the device's choice of blocks per row
(a thread-block cluster on sm_90+), with one block per row, and with the token -> slot table
(which the first LRU call of each request repairs, as the positional layout wrote no entries).
"""

from __future__ import annotations

import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hisparse_cupy import HotBufferCache
from hisparse_cupy.testing import knobs  # noqa: E402

from _util import pattern  # noqa: E402

L, R, H, K, MAXLEN, ROW = 2, 3, 128, 64, 600, 656


def run(cluster, table=False) -> int:
    with knobs.resolve_cluster(cluster):
        return _run(cluster, table)


def _run(cluster, table) -> int:
    rng = np.random.default_rng(7)
    cache = HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=ROW,
                           hot_size=H, top_k=K, extra_page=4, token_table=table)

    def kv(rid, start, n):
        ids = rid * MAXLEN + np.arange(start, start + n)
        return np.stack([pattern(layer, ids, ROW) for layer in range(L)])

    lens = [100, 400, 500]
    for r, n in enumerate(lens):
        assert cache.admit(n, kv=kv(r, 0, n)) == r
    req = cupy.arange(R, dtype=cupy.int32)
    errors = 0
    for step in range(6):
        seq = cupy.asarray(lens, dtype=cupy.int32)
        if step:
            rows = cupy.asnumpy(cache.begin_step(req, seq).newest_rows())
            for layer in range(L):
                for r in range(R):
                    cache.device_rows(layer)[int(rows[r])] = cupy.asarray(
                        kv(r, lens[r] - 1, 1)[layer, 0])
            cache.begin_step(req, seq).backup_newest()
        topk = np.stack([rng.integers(0, n, size=K) for n in lens]).astype(np.int32)
        topk[:, 0] = -1
        topk[1, 1] = 10**6  # out of range: -1 and a status count
        for layer in range(L):
            out = cupy.asnumpy(cache.begin_step(req, seq).swap(layer, cupy.asarray(topk)))
            for r in range(R):
                ok = (topk[r] >= 0) & (topk[r] < lens[r])
                got = cupy.asnumpy(cache.device_rows(layer)[cupy.asarray(out[r][ok])])
                want = pattern(layer, r * MAXLEN + topk[r][ok], ROW)
                errors += int((got != want).any(axis=1).sum())
                errors += int((out[r][~ok] != -1).sum())
        lens = [n + 1 for n in lens]
    cupy.cuda.Device().synchronize()
    cache.close()
    what = "token table" if table else f"resolve cluster {cluster or 'auto'}"
    print(f"sanitize_swap ({what}): {errors} wrong entries")
    return errors


def main() -> int:
    return 1 if run(None) + run(1) + run(None, table=True) else 0


if __name__ == "__main__":
    sys.exit(main())
