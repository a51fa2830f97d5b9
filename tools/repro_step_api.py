"""The three step-API defects of issue 23, reproduced as the issue states them (GPU).

A: a token selected in every step of a multi-step call with per-step lengths [L, L+1, ...] and
   an extra page shorter than the steps got a second row. B: re-enabling the prefetcher after
   multi-step steps gave shared layers their full layer's page table over rows that held other
   tokens. C: a fresh cache's first admission on a non-blocking stream lost its host rows when
   the construction stream was still busy.

Prints one line per case and ends with ``repro: all fixed`` or ``repro: N case(s) wrong``
(exit 1). Runs against any tree of the package (``PYTHONPATH=<tree> python tools/...``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hisparse_cupy import HotBufferCache  # noqa: E402
from hisparse_cupy.streams import Prefetcher  # noqa: E402
from hisparse_cupy.testing.selfcheck import pattern  # noqa: E402

from _util import spin  # noqa: E402


def fill_pool(c):
    for layer in range(c.n_layers):
        c.pool.layer(layer)[:] = pattern(layer, np.arange(c.pool.n_rows), c.row_bytes)


def case_a(P: int, S: int, s) -> bool:
    c = HotBufferCache(n_layers=1, max_requests=1, max_len=64, row_bytes=16, hot_size=8,
                       top_k=1, extra_page=P, max_steps=S)
    fill_pool(c)
    rid = c.admit(20, stream=s)
    lens = cupy.asarray([[21 + i for i in range(S)]], cupy.int64)
    step = c.begin_step(cupy.asarray([rid], cupy.int32), lens, stream=s)
    newest = step.newest_rows()
    with s:  # the model writes token 20's KV, then backs it up
        c.device_rows(0)[newest] = cupy.asarray(pattern(0, [rid * 64 + 20], 16))
    step.backup_newest()
    rows = cupy.asnumpy(step.swap(0, cupy.full((1, S, 1), 20, cupy.int32))).reshape(-1)
    s.synchronize()
    ok = np.unique(rows).size == 1
    print(f"A  P {P} S {S}: token 20 in every step -> rows {rows.tolist()} (newest row "
          f"{int(cupy.asnumpy(newest)[0])}): {'one row' if ok else 'WRONG: several rows'}")
    c.close()
    return ok


def case_b(s, rng) -> bool:
    c = HotBufferCache(n_layers=2, max_requests=1, max_len=8192, row_bytes=64, hot_size=1024,
                       top_k=512, max_steps=4)
    fill_pool(c)
    pf = Prefetcher(c, "FS")
    rid = c.admit(3000, stream=s)
    req = cupy.asarray([rid], cupy.int32)
    lens = cupy.asarray([3000], cupy.int64)
    pf.set_enabled(False, stream=s)
    for _ in range(3):
        step = c.begin_step(req, lens, stream=s, prefetcher=pf)
        tk = np.stack([rng.choice(2999, 512, replace=False) for _ in range(4)])[None]
        step.swap(0, cupy.asarray(tk.astype(np.int32)))
        step.swap(1, None)
        step.finish()
    s.synchronize()
    t0, t1 = (cupy.asnumpy(c.tables.slot_tokens[i, rid]) for i in range(2))
    l0, l1 = (cupy.asnumpy(c.tables.slot_locs[i, rid]) for i in range(2))
    same = (t0 == t1) & (t0 >= 0)
    print(f"B  prefetch off, 3 multi-step steps: the layers hold the same token in "
          f"{int(same.sum())} of 1024 slots, {int((same & (l0 != l1)).sum())} of them on "
          f"different rows")
    pf.set_enabled(True, stream=s)
    held = cupy.asnumpy(c.tables.slot_tokens[0, rid, :1024])
    tk = rng.choice(held[(held >= 0) & (held < 2999)], 512, replace=False).astype(np.int32)
    step = c.begin_step(req, lens, stream=s, prefetcher=pf)
    outs = [step.swap(0, cupy.asarray(tk[None])), step.swap(1, None)]
    step.finish()
    s.synchronize()
    good = []
    for layer, out in enumerate(outs):
        rows = cupy.asnumpy(c.device_rows(layer)[out[0]])
        good.append(int((rows == pattern(layer, rid * 8192 + tk, 64)).all(axis=1).sum()))
    print(f"B  prefetch on again, one single-step call of 512 held tokens: rows right, full "
          f"layer {good[0]}/512, shared layer {good[1]}/512")
    c.close()
    return good == [512, 512]


def case_c(rng) -> bool:
    busy = cupy.cuda.Stream(non_blocking=True)
    other = cupy.cuda.Stream(non_blocking=True)
    with busy:
        spin(cupy, 2_000_000_000)  # ~1 s of the construction stream
        c = HotBufferCache(n_layers=1, max_requests=2, max_len=256, row_bytes=16, hot_size=64,
                           top_k=8)
    fill_pool(c)
    rid = c.admit(200, stream=other)
    other.synchronize()
    busy.synchronize()
    hl = cupy.asnumpy(c.host_locs[rid, :200])
    bad = int((hl != rid * 256 + np.arange(200)).sum())
    print(f"C  construction stream busy, admit on another non-blocking stream: {bad} of 200 "
          f"host rows lost")
    c.close()
    return bad == 0


def main() -> int:
    rng = np.random.default_rng(23)
    s = cupy.cuda.Stream(non_blocking=True)
    results = [case_a(1, 2, s), case_a(2, 3, s), case_a(3, 4, s), case_a(4, 4, s),
               case_b(s, rng), case_c(rng)]
    wrong = results.count(False)
    print("repro: all fixed" if not wrong else f"repro: {wrong} case(s) wrong")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
