"""Multi-step (MTP) swap: one gather + commit call vs S sequential single-step swaps.

K 2048, H 4096, P 64, rows 656 / 576 B, steps 2 / 4, batch 1 / 8 / 32 / 64. Each request starts
with a full hot buffer; its step-0 top-k has 2 % misses and every later step replaces 3 % of the
previous step's entries with new tokens (entries reordered per step), so the union has
``41 + 61 (S - 1)`` unique misses per request, the same for both methods. Every call starts from
the same cache state (restored before it, untimed); 3 input sets rotated; CuPy events; warm-up
excluded; median of >= 20 with p10-p90.

Timed per method, under CUDA graphs: "chain" = marginal time of one call inside a graph of 8
back-to-back (restore, call) pairs, restores subtracted (the time a call adds to a captured decode
step); "one-graph" = one call per graph replay (includes the graph launch, floor printed first).
Methods: ``multistep_swap_in`` (gather + commit, commit launched with PDL or plainly) and S calls of
``swap_in`` on the same top-k (resolve + planned copy each, PDL on or off). Ceiling: one
``cudaMemcpyAsync`` H2D of the unique missed bytes from the same pinned pool, timed the same ways.

    python benchmarks/bench_spec.py [--quick] [--out DIR]

(The file keeps its first name, and ``Case`` its attribute names, because the peer benchmark
that runs SGLang's kernels beside ours imports them.)
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
    MultiStepConfig,
    MultiStepState,
    SwapState,
    multistep_swap_in,
    swap_in,
)
from hisparse_cupy.testing import knobs  # noqa: E402

K, H, P = 2048, 4096, 64
SEQ = 40000  # every step's length (no token is the newest)
RESIDENT = 16384  # hot tokens are drawn below this, new tokens above
N_HOST = 262144  # host rows per layer (172 MB at 656 B): token t of request r -> row below it
MISS0, NEW = 0.02, 0.03
NSETS = 3
CHAIN = 8


def unique_misses(S: int) -> int:
    return round(K * MISS0) + (S - 1) * round(K * NEW)


def build_sets(rng, B, S, resident):
    m0, nn = round(K * MISS0), round(K * NEW)
    sets = []
    for _ in range(NSETS):
        rows = np.empty((B, S, K), np.int32)
        for b in range(B):
            fresh = rng.choice(np.arange(RESIDENT, SEQ - 1), size=m0 + (S - 1) * nn,
                               replace=False)
            cur = np.concatenate([rng.choice(resident[b], K - m0, replace=False), fresh[:m0]])
            rows[b, 0] = rng.permutation(cur)
            for s in range(1, S):
                cur = rows[b, s - 1].copy()
                cur[rng.choice(K, nn, replace=False)] = fresh[m0 + (s - 1) * nn: m0 + s * nn]
                rows[b, s] = rng.permutation(cur)
        sets.append(cupy.asarray(rows))
    return sets


class Case:
    """Both methods' state for one (rows, S, batch) point, with restore snapshots."""

    def __init__(self, rng, B, S, row_bytes, pool, stream):
        self.B, self.S, self.rb, self.pool, self.stream = B, S, row_bytes, pool, stream
        resident = np.stack([rng.choice(RESIDENT, size=H, replace=False) for _ in range(B)])
        with stream:
            self.sets = build_sets(rng, B, S, resident)
            host_locs = ((cupy.arange(B, dtype=cupy.int64)[:, None] * 7919
                          + cupy.arange(SEQ, dtype=cupy.int64)) % N_HOST)
            tokens = np.full((B, H + P), -1, np.int32)
            tokens[:, :H] = resident
            self.req = cupy.arange(B, dtype=cupy.int32)
            # multi-step
            cfg = MultiStepConfig(B, H, P, K, max_steps=S, max_batch=B)
            slot_locs, scratch_locs, D = cfg.layout()
            self.spec = MultiStepState(cfg, host_locs, cupy.asarray(tokens),
                                       cupy.asarray(slot_locs), cupy.asarray(scratch_locs),
                                       n_device_rows=D)
            self.spec_rows = cupy.empty((D, row_bytes), cupy.uint8)
            self.spec_lens = cupy.full((B, S), SEQ, cupy.int32)
            self.spec_out = cupy.empty((B, S, K), cupy.int32)
            self.spec_status = cupy.empty((B, 3), cupy.int32)
            self.spec_plan = MissPlan(B, S * K)
            # the token -> slot table needs no snapshot: one call from a restored state admits
            # only tokens no slot held and evicts only held ones, so every entry a restored
            # slot table relies on is still there
            names = ("slot_tokens", "slot_locs", "scratch_locs", "ref", "clock")
            self.spec_snap = [(getattr(self.spec, n), getattr(self.spec, n).copy())
                              for n in names]
            # single-step
            lru = np.stack([rng.permutation(H) for _ in range(B)]).astype(np.int16)
            self.swap = SwapState.validated(
                host_locs, cupy.asarray(tokens),
                cupy.arange(B * (H + P), dtype=cupy.int32).reshape(B, H + P), cupy.asarray(lru))
            self.swap_rows = cupy.empty((B * (H + P), row_bytes), cupy.uint8)
            self.swap_lens = cupy.full(B, SEQ, cupy.int32)
            self.swap_out = [cupy.empty((B, K), cupy.int32) for _ in range(S)]
            self.swap_status = [cupy.empty((B, 3), cupy.int32) for _ in range(S)]
            self.swap_plan = MissPlan(B, K)
            self.swap_snap = [(a, a.copy()) for a in (self.swap.slot_tokens, self.swap.lru)]

    def restore_spec(self, i=0):
        for a, s in self.spec_snap:
            a[...] = s

    def restore_swap(self, i=0):
        for a, s in self.swap_snap:
            a[...] = s

    def spec_call(self, i):
        multistep_swap_in(self.sets[i % NSETS], self.req, self.spec_lens, self.spec,
                     host_rows=self.pool.device_ptr(0), n_host_rows=N_HOST,
                     device_rows=self.spec_rows, plan=self.spec_plan, out=self.spec_out,
                     status=self.spec_status, stream=self.stream)

    def swap_step(self, i, s):
        swap_in(self.sets[i % NSETS][:, s, :], self.req, self.swap_lens, self.swap,
                host_rows=self.pool.device_ptr(0), n_host_rows=N_HOST,
                device_rows=self.swap_rows, plan=self.swap_plan, out=self.swap_out[s],
                status=self.swap_status[s], stream=self.stream)

    def swap_call(self, i):
        for s in range(self.S):
            self.swap_step(i, s)

    def check(self) -> None:
        """One eager call of each method from the snapshot: miss counts and status."""
        want = unique_misses(self.S)
        st = self.stream
        with st:
            for i in range(NSETS):
                self.restore_spec()
                self.spec_call(i)
                st.synchronize()
                got = cupy.asnumpy(self.spec_plan.count[: self.B])
                assert (got == want).all(), ("spec misses", got[:4], want)
                assert not cupy.asnumpy(self.spec_status).any()
                assert not cupy.asnumpy(self.spec.workspace.stats[: self.B, 3]).any()
                self.restore_swap()
                total = np.zeros(self.B, np.int64)
                for s in range(self.S):
                    self.swap_step(i, s)
                    st.synchronize()
                    total += cupy.asnumpy(self.swap_plan.count[: self.B])
                    assert not cupy.asnumpy(self.swap_status[s]).any()
                assert (total == want).all(), ("sequential misses", total[:4], want)
            self.restore_spec()
            self.restore_swap()
        st.synchronize()


def measure(call, restore, stream, iters) -> dict:
    graphs = []
    with stream:
        for i in range(NSETS):
            restore()
            stream.begin_capture()
            call(i)
            graphs.append(stream.end_capture())
    one = summary(time_calls(lambda i: graphs[i % NSETS].launch(stream), iters=iters,
                             setup=restore, stream=stream))
    chain = time_graph_chain(call, restore, n=CHAIN, iters=iters, stream=stream)
    return {"graph": one, "chain": chain}


def run(quick: bool, out_dir: str) -> dict:
    rng = np.random.default_rng(3)
    iters = 20 if quick else 40
    stream = cupy.cuda.Stream(non_blocking=True)
    floor = empty_graph_floor(stream)
    print(f"floor: a graph of one empty kernel takes {floor['median_us']:.1f} us per replay",
          flush=True)
    results = []
    for row_bytes in (656, 576):
        pool = HostKVPool(1, N_HOST, row_bytes)
        block = rng.integers(0, 256, size=(1 << 20), dtype=np.uint8)
        flat = pool.numpy.reshape(-1)
        n_full = flat.size // block.size
        flat[: n_full * block.size].reshape(n_full, -1)[:] = block
        for S in (2, 4):
            for B in (1, 8, 32, 64):
                case = Case(rng, B, S, row_bytes, pool, stream)
                case.check()
                rec = {"row_bytes": row_bytes, "steps": S, "batch": B,
                       "unique_misses": B * unique_misses(S)}
                rec["bytes"] = nbytes = rec["unique_misses"] * row_bytes
                for pdl in (True, False):
                    tag = "pdl" if pdl else "nopdl"
                    with knobs.pdl(pdl):
                        rec[f"spec_{tag}"] = measure(case.spec_call, case.restore_spec, stream,
                                                     iters)
                        rec[f"seq_{tag}"] = measure(case.swap_call, case.restore_swap, stream,
                                                    iters)
                single, chained = memcpy_h2d(pool.numpy, nbytes, iters=iters, chain=CHAIN,
                                             stream=stream)
                rec["memcpy"], rec["memcpy_chain"] = single, chained
                sp = rec["spec_pdl"]["chain"]["median_us"]
                sq = rec["seq_pdl"]["chain"]["median_us"]
                rec["reduction_pct"] = 100.0 * (1.0 - sp / sq)
                rec["reduction_nopdl_pct"] = 100.0 * (
                    1.0 - rec["spec_nopdl"]["chain"]["median_us"]
                    / rec["seq_nopdl"]["chain"]["median_us"])
                rec["reduction_one_graph_pct"] = 100.0 * (
                    1.0 - rec["spec_pdl"]["graph"]["median_us"]
                    / rec["seq_pdl"]["graph"]["median_us"])
                rec["spec_vs_memcpy"] = sp / chained["median_us"]
                rec["spec_GBps"] = nbytes / sp / 1e3
                rec["memcpy_GBps"] = nbytes / chained["median_us"] / 1e3
                results.append(rec)
                print(_line(rec), flush=True)
                del case
                cupy.get_default_memory_pool().free_all_blocks()
        pool.close()
    payload = {"device": device_info(), "K": K, "H": H, "P": P, "seq_len": SEQ,
               "miss_step0": MISS0, "new_per_step": NEW, "iters": iters, "chain": CHAIN,
               "input_sets": NSETS, "empty_graph_floor": floor, "results": results,
               "targets": _targets(results)}
    write_json(out_dir, "bench_spec.json", payload)
    plot(results, Path(out_dir) / "bench_spec.png")
    return payload


def _us(d) -> str:
    return f"{d['median_us']:.1f} ({d['p10_us']:.1f}-{d['p90_us']:.1f})"


def _line(r) -> str:
    return (f"| {r['row_bytes']} | {r['steps']} | {r['batch']} | {r['unique_misses']} | "
            f"{_us(r['seq_pdl']['chain'])} | {_us(r['spec_pdl']['chain'])} | "
            f"{r['reduction_pct']:.1f} | {r['seq_nopdl']['chain']['median_us']:.1f} | "
            f"{r['spec_nopdl']['chain']['median_us']:.1f} | {r['reduction_nopdl_pct']:.1f} | "
            f"{r['seq_pdl']['graph']['median_us']:.1f} | "
            f"{r['spec_pdl']['graph']['median_us']:.1f} | "
            f"{r['memcpy_chain']['median_us']:.1f} | {r['spec_vs_memcpy']:.2f} | "
            f"{r['spec_GBps']:.1f} | {r['memcpy_GBps']:.1f} |")


HEADER = ("| row B | S | batch | unique misses | sequential us (p10-p90) | spec us (p10-p90) | "
          "reduction % | seq no-PDL us | spec no-PDL us | reduction no-PDL % | one-graph seq us "
          "| one-graph spec us | memcpy us | spec / memcpy | spec GB/s | memcpy GB/s |\n"
          + "|---" * 16 + "|")


def _targets(results) -> list[dict]:
    out = []
    for r in results:
        if r["batch"] == 64 and r["steps"] == 4:
            out.append({"what": f"batch 64, S 4, {r['row_bytes']} B: >= 55% lower latency than "
                                f"4 sequential swaps", "value": r["reduction_pct"],
                        "met": r["reduction_pct"] >= 55.0})
    return out


def plot(results, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (python benchmarks/bench_spec.py --plot JSON)")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for rb in sorted({r["row_bytes"] for r in results}):
        for S in sorted({r["steps"] for r in results}):
            pts = sorted((r["batch"], r["reduction_pct"], r["spec_vs_memcpy"]) for r in results
                         if r["row_bytes"] == rb and r["steps"] == S)
            if not pts:
                continue
            b, red, ratio = zip(*pts, strict=True)
            axes[0].plot(b, red, marker="o", label=f"{rb} B, S {S}")
            axes[1].plot(b, ratio, marker="o", label=f"{rb} B, S {S}")
    axes[0].axhline(55, color="gray", lw=0.8, ls="--")
    axes[0].set_ylabel("latency reduction vs S sequential swaps (%)")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_ylabel("spec call / memcpy of the unique missed bytes")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.legend()
    fig.suptitle(f"multi-step swap under CUDA graphs, K {K}, H {H}, step 0: {MISS0:.0%} misses, "
                 f"+{NEW:.0%} new per step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20 timed calls per point")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG from a results file")
    a = ap.parse_args()
    if a.plot:
        import json

        res = json.loads(Path(a.plot).read_text())["results"]
        plot(res, Path(a.plot).with_suffix(".png"))
        return
    payload = run(a.quick, a.out)
    for t in payload["targets"]:
        print(f"target {t['what']}: {'met' if t['met'] else 'MISSED'} ({t['value']:.1f})")
    print()
    print(HEADER)
    for r in payload["results"]:
        print(_line(r))


if __name__ == "__main__":
    main()
