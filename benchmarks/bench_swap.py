"""Single-step swap-in: kernel time vs a cudaMemcpyAsync of the same missed bytes.

K 2048, H 4096, rows 656 / 1152 B, batch 1 / 8 / 64 / 128, miss rates 0 / 0.5 / 5 / 20 / 100 %.
Each call starts from the same cache state (restored before it), 4 input sets rotated, CuPy
events, warm-up excluded, median of >= 20 with p10/p90. The headline time ("swap us") is the
marginal time of one swap (resolve + copy kernels) inside a CUDA graph of 8 back-to-back
(restore, swap) pairs, restores subtracted: the time a swap adds to a captured decode step.
Also shown: the same with the layer counters on ("counted", beside a second uncounted run,
"again"), with the copy moving no bytes ("no-copy"), one swap per graph replay
("one-graph", includes the graph launch latency; the empty-graph floor is printed first) and
one eager Python call ("eager", includes validation and launch on the host). The ceiling is
cudaMemcpyAsync H2D of the same bytes from the same pinned pool, timed the same two ways.

    python benchmarks/bench_swap.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (  # noqa: E402
    device_info,
    empty_graph_floor,
    memcpy_h2d,
    summary,
    time_calls,
    time_graph_chain,
    write_json,
)

from hisparse_cupy import (
    HostKVPool,
    MissPlan,
    SwapState,
    _abi,  # noqa: E402
    swap_in,
)
from hisparse_cupy.testing.probe import copy_probe

K, H, P = 2048, 4096, 64
MAX_LEN = 16384
RATES = (0.0, 0.005, 0.05, 0.2, 1.0)
NSETS = 4
CHAIN = 8


def build(rng, B, row_bytes, pool, rates=RATES, table=True):
    """State for B requests with a full hot buffer, and NSETS top-k sets per miss rate.

    ``table``: the state has a token -> slot table (``SwapState.token_slot``), started empty
    (the first call fills it); restoring ``slot_tokens`` and ``lru`` between calls leaves it
    valid, as it only ever names the slot a token was admitted to."""
    resident = np.stack([rng.choice(MAX_LEN - 1, size=H, replace=False) for _ in range(B)])
    slot_tokens = np.full((B, H + P), -1, np.int32)
    slot_tokens[:, :H] = resident
    lru = np.stack([rng.permutation(H) for _ in range(B)]).astype(np.int16)
    host_locs = (np.arange(B)[:, None] * MAX_LEN + np.arange(MAX_LEN)).astype(np.int64)
    st = SwapState.validated(cupy.asarray(host_locs), cupy.asarray(slot_tokens),
                             cupy.arange(B * (H + P), dtype=cupy.int32).reshape(B, H + P),
                             cupy.asarray(lru),
                             token_slot=cupy.full(host_locs.shape, -1, cupy.int16) if table
                             else None)
    snap = (st.slot_tokens.copy(), st.lru.copy())
    sets = {}
    for rate in rates:
        n_miss = int(round(K * rate))
        per = []
        for _ in range(NSETS):
            rows = []
            for b in range(B):
                mask = np.ones(MAX_LEN - 1, bool)
                mask[resident[b]] = False
                misses = rng.choice(np.nonzero(mask)[0], size=n_miss, replace=False)
                hits = rng.choice(resident[b], size=K - n_miss, replace=False)
                row = np.concatenate([misses, hits])
                rng.shuffle(row)
                rows.append(row)
            per.append(cupy.asarray(np.stack(rows).astype(np.int32)))
        sets[rate] = (n_miss, per)
    return st, snap, sets


def _time_swap(st, snap, per, req, seq, pool, device_rows, plan, out, status, stream, iters):
    """Timings of one swap per call, every call starting from the same cache state.

    eager: one Python call per event pair; graph: one captured swap per event pair; chain:
    marginal time of CHAIN (restore, swap) pairs back to back in one graph (restores
    subtracted); dry: the same chain moving no bytes (resolve + copy-kernel bookkeeping).
    """

    def restore(i):  # every call starts from the same cache state (untimed)
        st.slot_tokens[...] = snap[0]
        st.lru[...] = snap[1]

    ctr = cupy.zeros(_abi.N_LAYER_COUNTERS, cupy.uint64)

    def call(i, counters=None):
        swap_in(per[i % NSETS], req, seq, st, host_rows=pool.device_ptr(0),
                n_host_rows=pool.n_rows, device_rows=device_rows, plan=plan, out=out,
                status=status, counters=counters, stream=stream)

    eager = summary(time_calls(call, iters=iters, setup=restore, stream=stream))
    graphs = []
    with stream:
        for i in range(NSETS):
            stream.begin_capture()
            call(i)
            graphs.append(stream.end_capture())
    graphed = summary(time_calls(lambda i: graphs[i % NSETS].launch(stream), iters=iters,
                                 setup=restore, stream=stream))
    chain = time_graph_chain(call, restore, n=CHAIN, iters=iters, stream=stream)
    with copy_probe(dry_run=True, streams=[stream]):  # the copy moves no bytes
        dry = time_graph_chain(call, restore, n=CHAIN, iters=iters, stream=stream)
    # the same chain with the layer counters on (what a HotBufferCache's swaps add), then
    # without again: the two uncounted chains bound the run-to-run spread
    counted = time_graph_chain(lambda i: call(i, counters=ctr), restore, n=CHAIN, iters=iters,
                               stream=stream)
    again = time_graph_chain(call, restore, n=CHAIN, iters=iters, stream=stream)
    return {"eager": eager, "graph": graphed, "chain": chain, "dry": dry, "counted": counted,
            "chain_again": again}


def run(quick: bool, out_dir: str) -> dict:
    rng = np.random.default_rng(1)
    rows_list = (656,) if quick else (656, 1152)
    batches = (1, 64) if quick else (1, 8, 64, 128)
    iters = 20 if quick else 30
    stream = cupy.cuda.Stream(non_blocking=True)
    floor = empty_graph_floor(stream)
    print(f"floor: a graph of one empty kernel takes {floor['median_us']:.1f} us per replay")
    results = []
    for row_bytes in rows_list:
        bmax = max(batches)
        pool = HostKVPool(1, bmax * MAX_LEN, row_bytes)
        block = rng.integers(0, 256, size=(1 << 20), dtype=np.uint8)
        flat = pool.numpy.reshape(-1)
        n_full = flat.size // block.size
        flat[: n_full * block.size].reshape(n_full, -1)[:] = block
        device_rows = cupy.empty((bmax * (H + P), row_bytes), cupy.uint8)
        plan = MissPlan(bmax, K)
        for B in batches:
            st, snap, sets = build(rng, B, row_bytes, pool)
            req = cupy.arange(B, dtype=cupy.int32)
            seq = cupy.full(B, MAX_LEN, dtype=cupy.int32)
            out = cupy.empty((B, K), cupy.int32)
            status = cupy.empty((B, 3), cupy.int32)
            for rate in RATES:
                n_miss, per = sets[rate]
                t = _time_swap(st, snap, per, req, seq, pool, device_rows[: B * (H + P)],
                               plan, out, status, stream, iters)
                stream.synchronize()
                got = int(cupy.asnumpy(plan.count[:B]).sum())
                assert got == B * n_miss, (got, B * n_miss)
                nbytes = B * n_miss * row_bytes
                rec = {"row_bytes": row_bytes, "batch": B, "miss_rate": rate,
                       "misses": B * n_miss, "bytes": nbytes, **t}
                if nbytes:
                    single, chained = memcpy_h2d(pool.numpy, nbytes, iters=iters, chain=CHAIN,
                                                 stream=stream)
                    rec["memcpy"], rec["memcpy_chain"] = single, chained
                    rec["swap_GBps"] = nbytes / t["chain"]["median_us"] / 1e3
                    rec["memcpy_GBps"] = nbytes / chained["median_us"] / 1e3
                    rec["ratio"] = t["chain"]["median_us"] / chained["median_us"]
                    rec["ratio_single"] = t["graph"]["median_us"] / single["median_us"]
                results.append(rec)
                print(_line(rec), flush=True)
        pool.close()
    payload = {"device": device_info(), "K": K, "H": H, "P": P, "max_len": MAX_LEN,
               "iters": iters, "chain": CHAIN, "empty_graph_floor": floor,
               "results": results, "targets": _targets(results)}
    write_json(out_dir, "bench_swap.json", payload)
    _plot(results, Path(out_dir) / "bench_swap.png")
    return payload


def _line(r) -> str:
    c, g = r["chain"], r["graph"]
    base = (f"| {r['row_bytes']} | {r['batch']} | {r['miss_rate'] * 100:g} | {r['misses']} | "
            f"{c['median_us']:.1f} ({c['p10_us']:.1f}-{c['p90_us']:.1f}) | "
            f"{r['counted']['median_us']:.1f} / {r['chain_again']['median_us']:.1f} | "
            f"{r['dry']['median_us']:.1f} | {g['median_us']:.1f} | {r['eager']['median_us']:.1f} |")
    if "memcpy" in r:
        return base + (f" {r['swap_GBps']:.1f} | {r['memcpy_chain']['median_us']:.1f} | "
                       f"{r['memcpy_GBps']:.1f} | {r['ratio']:.2f} | "
                       f"{r['memcpy']['median_us']:.1f} | {r['ratio_single']:.2f} |")
    return base + " - | - | - | - | - | - |"


HEADER = ("| row B | batch | miss % | misses | swap us (p10-p90) | counted / again us | "
          "no-copy us | one-graph us | eager us | swap GB/s | memcpy us | memcpy GB/s | ratio | "
          "one memcpy us | one-call ratio |\n" + "|---" * 15 + "|")


def _targets(results) -> list[dict]:
    def find(rb, b, rate):
        return next((r for r in results if r["row_bytes"] == rb and r["batch"] == b
                     and r["miss_rate"] == rate), None)

    out = []
    for rb in sorted({r["row_bytes"] for r in results}):
        r = find(rb, 64, 0.0)
        if r:
            v = r["chain"]["median_us"]
            out.append({"what": f"all-hit batch 64, {rb} B: <= 15 us", "value": v,
                        "met": v <= 15.0})
        r = find(rb, 64, 0.05)
        if r:
            out.append({"what": f"batch 64 at 5% misses, {rb} B: <= 1.3x memcpy",
                        "value": r["ratio"], "met": r["ratio"] <= 1.3})
        r = find(rb, 1, 1.0)
        if r:
            out.append({"what": f"batch 1 at 100% misses, {rb} B: <= 1.5x memcpy",
                        "value": r["ratio"], "met": r["ratio"] <= 1.5})
    return out


def _plot(results, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    rbs = sorted({r["row_bytes"] for r in results})
    fig, axes = plt.subplots(1, len(rbs), figsize=(6 * len(rbs), 4), squeeze=False)
    for ax, rb in zip(axes[0], rbs, strict=True):
        for B in sorted({r["batch"] for r in results}):
            pts = [(r["miss_rate"] * 100, r["ratio"]) for r in results
                   if r["row_bytes"] == rb and r["batch"] == B and "ratio" in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"batch {B}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("miss rate (%)")
        ax.set_ylabel("swap time / memcpy time of the missed bytes")
        ax.set_title(f"single-step swap, K {K}, H {H}, rows {rb} B")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="656-byte rows, batch 1 and 64 only")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    print(HEADER)
    payload = run(a.quick, a.out)
    for t in payload["targets"]:
        print(f"target {t['what']}: {'met' if t['met'] else 'MISSED'} ({t['value']:.2f})")


if __name__ == "__main__":
    main()
