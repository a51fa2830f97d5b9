"""Residency moves of one long request: a demotion's cost to its step, a promotion's fill rate.

One :class:`hisparse_cupy.HotBufferCache` with a device budget (``docs/design.md`` section 10)
holds one request of ``--tokens`` tokens (``--layers`` layers of ``--row-bytes`` rows; its
prompt made on the GPU and admitted resident: host pool and device pages). Per rep:

- **demote** on the step's stream: the device time of the work it queues (CUDA events around
  the call, the stream held busy by a 20 ms spin before them, so the host has queued it all
  before the device starts: tables built, the newest H tokens copied from its pages into its
  block in every layer) and the host time of the call;
- **promote**: its pages taken and every written token's rows loaded from the host pool on the
  cache's side stream; the fill's time from an event recorded just before the call to the
  fill's own event, against ``cudaMemcpyAsync`` host -> device of the same bytes from the same
  pinned pool (the link's ceiling, in the same run); then ``switch_promoted`` makes it resident.

After each move the bytes are checked (three layers): the hot slots' rows after a demotion,
every page row after a promotion.

    python benchmarks/bench_residency.py [--tokens 131072] [--layers 78] [--reps 3]
        [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import device_info, write_json  # noqa: E402

from hisparse_cupy import HotBufferCache  # noqa: E402
from hisparse_cupy.residency import DeviceBudget  # noqa: E402
from hisparse_cupy.testing._spin import spin_ms  # noqa: E402
from hisparse_cupy.testing.selfcheck import pattern  # noqa: E402

PAGE = 64


def _check(cache, n_layers, tokens, rows, row_bytes) -> None:
    """Rows ``rows`` of three layers hold tokens ``tokens``' bytes (request 0's pattern)."""
    for layer in sorted({0, n_layers // 2, n_layers - 1}):
        got = cache.device_rows(layer)[cupy.asarray(np.asarray(rows, np.int64))]
        want = pattern(layer, cupy.asarray(np.asarray(tokens, np.int64)), row_bytes, xp=cupy)
        bad = int((got != want).any(axis=1).sum())
        if bad:
            raise AssertionError(f"layer {layer}: {bad} of {len(rows)} rows hold wrong bytes")


def run(tokens: int, n_layers: int, row_bytes: int, reps: int) -> dict:
    s = cupy.cuda.Stream(non_blocking=True)
    block = HotBufferCache.rows_needed(max_requests=1)
    budget = DeviceBudget.rows_needed([tokens], 1, page_tokens=PAGE, block_rows=block)
    cache = HotBufferCache(n_layers=n_layers, max_requests=1, max_len=tokens,
                           row_bytes=row_bytes, device_budget=budget, device_page=PAGE)
    ids = cupy.arange(tokens, dtype=cupy.int64)
    with s:
        kv = cupy.stack([pattern(layer, ids, row_bytes, xp=cupy) for layer in range(n_layers)])
    rid = cache.admit(tokens, kv=kv, resident=True, stream=s)
    s.synchronize()
    del kv
    cupy.get_default_memory_pool().free_all_blocks()
    arena, H = cache.residency._arena, cache.hot_size  # (the fill's event: internal)
    nbytes = tokens * row_bytes * n_layers
    host = cache.pool.numpy  # [L, rows, row_bytes], pinned: the ceiling's source
    dst = cupy.empty(nbytes, cupy.uint8)
    demote_gpu, demote_host, fill, ceiling = [], [], [], []
    for _ in range(reps + 1):  # the first rep is a warm-up
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        spin_ms(20, s)  # the device starts the demotion's work after the host queued it all
        e0.record(s)
        t0 = time.perf_counter()
        cache.residency.demote(rid, stream=s)
        demote_host.append((time.perf_counter() - t0) * 1e3)
        e1.record(s)
        e1.synchronize()
        demote_gpu.append(cupy.cuda.get_elapsed_time(e0, e1))
        t = cupy.asnumpy(cache.tables.slot_tokens[0, rid, : H + 1])
        r = cupy.asnumpy(cache.tables.slot_locs[0, rid, : H + 1])
        assert sorted(t.tolist()) == list(range(tokens - 1 - H, tokens)), "hot slots"
        _check(cache, n_layers, t, r, row_bytes)
        e0 = cupy.cuda.Event()
        e0.record(s)
        cache.residency.promote(rid, stream=s)
        ev = arena.promoting[rid][0]
        ev.synchronize()
        fill.append(cupy.cuda.get_elapsed_time(e0, ev))
        assert cache.residency.switch_promoted(stream=s) == [rid]
        s.synchronize()
        _check(cache, n_layers, np.arange(tokens), arena.rows(rid, 0, tokens), row_bytes)
        # the ceiling: one memcpy of the same bytes from the same pinned pool
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(s)
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, host.ctypes.data, nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, s.ptr)
        e1.record(s)
        e1.synchronize()
        ceiling.append(cupy.cuda.get_elapsed_time(e0, e1))
    del host
    cache.close()
    med = {k: statistics.median(v[1:]) for k, v in
           dict(demote_gpu=demote_gpu, demote_host=demote_host, fill=fill,
                ceiling=ceiling).items()}
    gbs = nbytes / 1e6 / med["fill"]
    ceil_gbs = nbytes / 1e6 / med["ceiling"]
    return {"config": dict(tokens=tokens, n_layers=n_layers, row_bytes=row_bytes, reps=reps,
                           hot_size=H, device_page=PAGE, bytes=nbytes),
            "summary": {"demote_gpu_ms": med["demote_gpu"], "demote_host_ms": med["demote_host"],
                        "promote_fill_ms": med["fill"], "promote_gb_s": gbs,
                        "memcpy_h2d_ms": med["ceiling"], "memcpy_h2d_gb_s": ceil_gbs,
                        "promote_share_of_memcpy": gbs / ceil_gbs},
            "raw_ms": dict(demote_gpu=demote_gpu, demote_host=demote_host, fill=fill,
                           memcpy=ceiling),
            "self_check": "passed", "device": device_info()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=78)
    ap.add_argument("--row-bytes", type=int, default=656)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 reps")
    ap.add_argument("--out", default=None, help="write bench_residency.json here")
    ns = ap.parse_args(argv)
    res = run(ns.tokens, ns.layers, ns.row_bytes, 2 if ns.quick else ns.reps)
    m = res["summary"]
    print(f"one request of {ns.tokens} tokens x {ns.layers} layers x {ns.row_bytes} B "
          f"({res['config']['bytes'] / 1e9:.2f} GB), medians of {len(res['raw_ms']['fill']) - 1}")
    print(f"  demote: {m['demote_gpu_ms']:.3f} ms of device work on the step's stream, "
          f"{m['demote_host_ms']:.3f} ms on the host")
    print(f"  promote: fill {m['promote_fill_ms']:.1f} ms = {m['promote_gb_s']:.1f} GB/s; "
          f"memcpy H2D of the same bytes {m['memcpy_h2d_ms']:.1f} ms = "
          f"{m['memcpy_h2d_gb_s']:.1f} GB/s ({100 * m['promote_share_of_memcpy']:.1f} %)")
    print("  self-check passed (hot slots after each demotion, every page after each promotion)")
    if ns.out:
        write_json(ns.out, "bench_residency.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
