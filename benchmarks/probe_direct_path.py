"""The swaps' direct path: rows whose every token has a device row of its own.

A resident request (its device page table) and a request of ``seq <= H`` (the positional
layout, token t in hot slot t) take one branch of the single-step resolve and the multi-step
gather (``cu/abi.cuh``, ``direct_entry``; ``docs/design.md`` section 10). This probe times both
beside the LRU path on all hits, so a change to that branch can be checked against the code
before it: run it once per checkout (``PYTHONPATH`` picks the package) in the same call.

Workload: K 2048, H 4096, P 64, 8192-token requests (the positional ones at H), B rows of B
requests, a top-k of distinct held tokens with 3 % -1 entries. Time: the marginal device time
of one swap in a CUDA graph of 8 calls (median of ``--iters`` replays). Every call's first run
is checked against the oracle (outputs and status).

    PYTHONPATH=. python benchmarks/probe_direct_path.py [--batches 1 8 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_info, time_graph_chain, write_json  # noqa: E402

import hisparse_cupy  # noqa: E402
from hisparse_cupy._kernels.multistep import multistep_swap_in  # noqa: E402
from hisparse_cupy._kernels.swap import swap_in  # noqa: E402
from hisparse_cupy.testing._resident_twin import ResidentTwin  # noqa: E402

K, H, P, PAGE, MAX_LEN, S = 2048, 4096, 64, 64, 8192, 3
CASES = ("positional", "resident", "lru-hits")


def _topk(rng, h, req, seq, steps: int):
    """``[B, K]`` (``steps`` 1) or ``[B, steps, K]``: distinct tokens the row holds below its
    newest, 3 % -1."""
    rows = []
    for r, s in zip(req, seq, strict=True):
        held = h.np[0]["slot_tokens"][r, :H]
        held = held[(held >= 0) & (held < int(s) - 1)]
        one = [rng.choice(held, K, replace=False) for _ in range(steps)]
        rows.append(one if steps > 1 else one[0])
    t = np.asarray(rows, np.int32)
    t[rng.random(t.shape) < 0.03] = -1
    return t


def _case(rng, case: str, B: int, multi: bool):
    """The twin, request slots, lengths and top-k of one case."""
    share = 1.0 if case == "resident" else 0.0
    n = H if case == "positional" else MAX_LEN
    if multi:
        lens = np.full(B, n - S if case == "positional" else n, np.int64)
        h = ResidentTwin.multi_resident(rng, share=share, page_tokens=PAGE, R=B, H=H, P=P, K=K,
                                        S_max=S, lens=lens, row_bytes=64,
                                        positional=range(B) if case == "positional" else ())
        req = np.arange(B)
        seq = (lens[:, None] + np.arange(S)[None]).astype(np.int32)
        return h, req, seq, _topk(rng, h, req, seq[:, 0], S)
    h = ResidentTwin.single_resident(rng, share=share, page_tokens=PAGE, R=B, K=K, H=H, P=P,
                                     row_bytes=64, max_len=MAX_LEN, adversarial=False)
    req = np.arange(B, dtype=np.int32)
    if case == "positional":  # hot slot t holds token t, as admission leaves a short request
        h.np[0]["slot_tokens"][:, :H] = np.arange(H)
        h.state(0).slot_tokens[:, :H] = cupy.arange(H, dtype=cupy.int32)
    seq = np.full(B, n, np.int64)
    return h, req, seq, _topk(rng, h, req, seq, 1)


def time_case(rng, case: str, B: int, multi: bool, iters: int, stream) -> dict:
    h, req, seq, topk = _case(rng, case, B, multi)
    h.call(topk, req, seq)  # outputs, status (and the state) against the oracle
    with stream:
        d_topk = cupy.asarray(topk)
        d_req = cupy.asarray(req.astype(h.dtypes[0]))
        d_seq = cupy.asarray(seq.astype(h.dtypes[1]))
        out = cupy.empty(topk.shape, cupy.int32)
        status = cupy.empty((B, 3), cupy.int32)
    kw = dict(h.op_args(0), plan=h.plan, out=out, status=status, stream=stream)
    if multi:
        def call(i):
            multistep_swap_in(d_topk, d_req, d_seq, h.multistep_state(0), **kw)
    else:
        def call(i):
            swap_in(d_topk, d_req, d_seq, h.state(0), **kw)
    t = time_graph_chain(call, None, n=8, iters=iters, stream=stream)
    stream.synchronize()
    return {"case": case, "batch": B, "swap": "multi-step" if multi else "single-step",
            "us": t["median_us"], "timing": t}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--label", default="", help="names the checkout in the JSON")
    ap.add_argument("--out", default=None, help="directory for probe_direct_path.json")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(3)
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    print(f"package {Path(hisparse_cupy.__file__).parent} {a.label}")
    print(f"{'swap':<12} {'case':<11} {'batch':>5} {'us/call':>9}")
    for multi in (False, True):
        for B in a.batches:
            for case in CASES:
                r = time_case(rng, case, B, multi, a.iters, stream)
                rows.append(r)
                print(f"{r['swap']:<12} {case:<11} {B:>5} {r['us']:>9.2f}", flush=True)
    if a.out:
        write_json(a.out, f"probe_direct_path{a.label and '_' + a.label}.json",
                   {"config": {"K": K, "H": H, "P": P, "page_tokens": PAGE, "max_len": MAX_LEN,
                               "steps": S, "batches": a.batches, "iters": a.iters,
                               "label": a.label, "device": device_info()},
                    "summary": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
