"""Prefill admission at link speed: a request's KV from a GPU array into the host pool.

``--requests`` requests of ``--tokens`` tokens (``--layers`` layers of ``--row-bytes``
rows) admitted back to back on one stream, timed with CuPy events around them all:

- ``memcpy``: ``cudaMemcpyAsync`` device -> host of the same bytes into the same pinned pool
  (one contiguous copy per request): the link's ceiling, in the same run;
- ``admit paged``: ``HotBufferCache(page_tokens=64).admit(n, kv=gpu_array)`` (pages taken,
  the KV copied into them, tables written), into a new pool's consecutive pages and into
  pages taken in random order (each page a run of its own), by 2-D copies of 64 rows x
  layers and by the package's copy kernel (one launch: the package's choice for such runs);
- ``admit slot layout``: the same into the slot layout (``r * max_len + t`` rows).

Every admitted request's host rows are checked against its KV (three layers) afterwards.

    python benchmarks/bench_admit.py [--tokens 8192] [--requests 8] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_info, write_json  # noqa: E402


def _admissions(cache, kvs, s) -> float:
    """Seconds of admitting every KV of ``kvs`` back to back (events around them all: the
    host queues each while the device copies the previous), after one untimed warm-up."""
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    cache.release(cache.admit(kvs[0].shape[1], kvs[0], stream=s), stream=s)
    s.synchronize()
    e0.record(s)
    for kv in kvs:
        cache.admit(kv.shape[1], kv, stream=s)
    e1.record(s)
    e1.synchronize()
    return cupy.cuda.get_elapsed_time(e0, e1) / 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=78)
    ap.add_argument("--row-bytes", type=int, default=656)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="4 requests of 4096 tokens")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.requests = 4096, 4
    from hisparse_cupy import HotBufferCache

    L, n, R, row = a.layers, a.tokens, a.requests, a.row_bytes
    s = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    with s:
        kvs = [cupy.asarray(rng.integers(0, 256, (L, n, row), dtype=np.uint8)) for _ in range(R)]
    s.synchronize()
    nbytes = L * n * row
    res = {}
    from hisparse_cupy._kernels import rows as movers

    runs = movers.MIN_RUN_BYTES
    for name, kw in (("admit paged", {"page_tokens": 64}),
                     ("admit paged, shuffled, 2-D copies", {"page_tokens": 64}),
                     ("admit paged, shuffled, copy kernel", {"page_tokens": 64}),
                     ("admit slot layout", {})):
        cache = HotBufferCache(n_layers=L, max_requests=R + 1, max_len=n, row_bytes=row,
                               hot_size=2048, top_k=2048, **kw)
        movers.MIN_RUN_BYTES = 1 << 62 if "kernel" in name else 0 if "2-D" in name else runs
        try:
            if "shuffled" in name:  # free pages in random order: every page a run of its own
                pages = cache.pages.take(cache.pages.free_pages)
                cache.pages.put(rng.permutation(pages))
            res[name] = _admissions(cache, kvs, s)
            for rid, kv in zip(sorted(cache.active), kvs, strict=True):
                rows = cache.host.rows(rid, 0, n)
                for layer in (0, L // 2, L - 1):
                    if not (cache.pool.numpy[layer, rows] == cupy.asnumpy(kv[layer])).all():
                        raise SystemExit(f"bench_admit: {name}: request {rid} layer {layer}: "
                                         f"wrong bytes")
            if name == "admit paged":  # the ceiling: the same bytes into the same pinned pool
                dst = cache.pool.numpy.ctypes.data
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                e0.record(s)
                for i, kv in enumerate(kvs):
                    cupy.cuda.runtime.memcpyAsync(dst + i * nbytes, kv.data.ptr, nbytes,
                                                  cupy.cuda.runtime.memcpyDeviceToHost, s.ptr)
                e1.record(s)
                e1.synchronize()
                res["memcpy"] = cupy.cuda.get_elapsed_time(e0, e1) / 1e3
        finally:
            movers.MIN_RUN_BYTES = runs
            s.synchronize()
            cache.close()
    rows = {k: {"seconds": v, "gb_s": R * nbytes / v / 1e9} for k, v in res.items()}
    ceil = rows["memcpy"]["gb_s"]
    print(f"admission of {R} requests x {n} tokens x {L} layers x {row} B "
          f"({nbytes / 1e9:.2f} GB each) back to back, device -> pinned host:")
    for k, r in rows.items():
        print(f"  {k:36s} {r['seconds'] * 1e3:8.2f} ms  {r['gb_s']:6.1f} GB/s  "
              f"{100 * r['gb_s'] / ceil:5.1f} % of memcpy")
    if a.out:
        write_json(a.out, "admit.json", {"device": device_info(), "layers": L, "tokens": n,
                                    "requests": R, "row_bytes": row, "bytes_per_request": nbytes,
                                    "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
