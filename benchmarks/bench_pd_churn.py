"""What quarantine costs a decode pool under churn: reservations cancelled while their transfer
is in progress (an engine aborting requests, or timing out slow senders).

One process, a :class:`hisparse_cupy.pd.KVReceiver` over a host pool and a
:class:`hisparse_cupy.pd.KVSender`, UCX over TCP (``UCX_TLS=tcp,self,cuda_copy``: a transfer
stays in progress for a while, as across nodes; over shared memory UCX copies inside the call
that posts it). ``--inflight`` requests of 1-``--max-pages`` pages are kept reserved and sent
(pulls, or with ``--push`` granted WRITEs); each is cancelled, with probability ``--cancel``,
at a random moment once its transfer has started; a new request replaces every one that ends.
A reservation that finds the pool full waits for pages (counted, with the time it waited).
Per setting: the bytes that arrived per second, the share of the pool's pages quarantined
(mean over polls, and the most), how long a cancelled transfer's pages stayed quarantined
(median, p99), and the reservations that waited for pages held in quarantine. Every arrival is
checked byte for byte.

    python benchmarks/bench_pd_churn.py [--requests 200] [--cancel 0 0.1 0.3] [--push]
        [--pages 512] [--max-pages 48] [--inflight 6] [--json FILE | --out DIR] [--quick]

Without NIXL it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ["UCX_TLS"] = "tcp,self,cuda_copy"  # (NIXL wants cuda_copy where a GPU is present)

L, RB, P = 4, 4096, 16


def one(a, cancel: float, push: bool, seed: int = 0) -> dict:
    from hisparse_cupy.host._pages import HostPages, PoolExhausted
    from hisparse_cupy.pd import KVReceiver, KVSender

    rng = np.random.default_rng(seed)
    pool = np.zeros((L, a.pages * P, RB), np.uint8)
    pages = HostPages(a.pages, P)
    rx = KVReceiver(pool, pages, push=push, timeout_s=600)
    tx = KVSender(pull=False if push else None)
    src = rng.integers(0, 256, (L, a.max_pages * P, RB), dtype=np.uint8)
    tx.register(src)
    live, since, dwell = {}, {}, []  # req -> (send, ticket, cancel at), xfer -> quarantined at
    shares, waited, wait_s, nbytes, started, ended, req = [], 0, 0.0, 0, 0, 0, 0
    t0 = time.perf_counter()
    while ended < a.requests:
        while len(live) < a.inflight and started < a.requests:
            n = int(rng.integers(1, a.max_pages + 1)) * P - int(rng.integers(0, P))
            t_wait, full = time.perf_counter(), False
            while True:
                try:
                    t = rx.reserve(req, n)
                    break
                except PoolExhausted:  # pages held in quarantine (or by live requests)
                    if not rx.quarantined:
                        raise
                    full = True
                    rx.poll()
            if full:
                waited, wait_s = waited + 1, wait_s + time.perf_counter() - t_wait
            at = rng.random() if rng.random() < cancel else None
            live[req] = (tx.send(t, src[:, :n], wait=False), t, at)
            started, req = started + 1, req + 1
        polled = rx.poll()
        now = time.perf_counter()
        for x in list(since):
            if x not in rx.quarantined:
                dwell.append(now - since.pop(x))
        for arr in polled.done:
            p, t, _ = live.pop(arr.req_id)
            rows = (np.asarray(arr.pages)[:, None] * P + np.arange(P)).ravel()[:arr.n_tokens]
            if not np.array_equal(pool[:, rows], src[:, :arr.n_tokens]):
                raise RuntimeError(f"request {arr.req_id}: the bytes that arrived differ")
            nbytes += L * arr.n_tokens * RB
            rx.release(arr)
            ended += 1
        for r, (p, t, at) in list(live.items()):
            try:
                p.poll()
            except (RuntimeError, TimeoutError) as e:  # (a cancelled one is popped below)
                if r not in rx.in_flight and at is None:
                    raise RuntimeError(f"request {r} failed: {e}") from None
            if at is not None and r in rx.in_progress and rng.random() < 0.3 + at:
                rx.cancel(r)
                if t["xfer_id"] in rx.quarantined:
                    since[t["xfer_id"]] = time.perf_counter()
                live.pop(r)
                ended += 1
        shares.append(sum(c for _, c in rx.quarantined.values()) / a.pages)
    while rx.quarantined:  # the last cancelled transfers run out
        rx.poll()
        for x in list(since):
            if x not in rx.quarantined:
                dwell.append(time.perf_counter() - since.pop(x))
    wall = time.perf_counter() - t0
    out = {"cancel": cancel, "push": push, "requests": a.requests, "pages": a.pages,
           "pool_mib": pool.nbytes / 2**20, "gbps_arrived": nbytes / wall / 1e9,
           "cancelled": int(rx.stats["cancelled"]), "quarantined": int(rx.stats["quarantined"]),
           "quarantine_share_mean": float(np.mean(shares)),
           "quarantine_share_max": float(np.max(shares)),
           "dwell_ms_median": float(np.median(dwell) * 1e3) if dwell else 0.0,
           "dwell_ms_p99": float(np.percentile(dwell, 99) * 1e3) if dwell else 0.0,
           "reservations_waited": waited, "waited_s": wait_s, "wall_s": wall}
    tx.close()
    rx.close()
    pages.check()
    if pages.free_pages != a.pages:
        raise RuntimeError(f"{a.pages - pages.free_pages} pages not given back")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--cancel", type=float, nargs="*", default=[0.0, 0.1, 0.3])
    ap.add_argument("--push", action="store_true", help="granted WRITEs, not pulls")
    ap.add_argument("--pages", type=int, default=512, help="the pool's pages (16 tokens)")
    ap.add_argument("--max-pages", type=int, default=48)
    ap.add_argument("--inflight", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="60 requests, cancels of 0 and 30 %%")
    ap.add_argument("--json")
    ap.add_argument("--out", help="a directory: bench_pd_churn.json written there")
    a = ap.parse_args(argv)
    if a.quick:
        a.requests, a.cancel = 60, [0.0, 0.3]
    try:
        from hisparse_cupy.pd import nixl_api

        nixl_api()
    except ImportError as e:
        print(f"bench_pd_churn: {e}", file=sys.stderr)
        return 2
    results = []
    for c in a.cancel:
        r = one(a, c, a.push)
        results.append(r)
        print(f"{'push' if a.push else 'pull'}, cancel {c:.0%}: {r['gbps_arrived']:.2f} GB/s "
              f"arrived; {r['cancelled']} cancelled, {r['quarantined']} of them quarantined; "
              f"quarantine held {100 * r['quarantine_share_mean']:.1f} % of the pool's pages "
              f"on average, {100 * r['quarantine_share_max']:.1f} % at most, each transfer's "
              f"{r['dwell_ms_median']:.1f} ms (median, p99 {r['dwell_ms_p99']:.1f}); "
              f"{r['reservations_waited']} reservations waited {r['waited_s']:.2f} s for "
              f"pages; bytes checked", flush=True)
    path = a.json or (a.out and os.path.join(a.out, "bench_pd_churn.json"))
    if path:
        with open(path, "w") as f:
            json.dump({"results": results, "layers": L, "row_bytes": RB, "page_tokens": P,
                       "transport": os.environ["UCX_TLS"]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
