"""Prefill KV from GPU memory into a decode pool, two processes, against a D2H memcpy.

The decode process holds a pinned ``HostKVPool`` (78 layers of 1152-byte rows, pages of 64
tokens) and a :class:`hisparse_cupy.pd.KVReceiver` over it; a prefill process (spawned) holds
every request's KV in its GPU memory (one registered CuPy buffer) and sends each ticket's with
:class:`hisparse_cupy.pd.KVSender` (one NIXL READ per request, posted by the decode process,
VRAM -> DRAM; with ``push=1`` one NIXL WRITE per request, granted by the decode process; with
``shm=1`` copies into the shared pool, granted likewise).
Per configuration (each a fresh pair of processes with those environment variables), per rep
(after one untimed): the requests sent one after another (the prefill process's ``send``
seconds), then all posted at once and waited (``wait=False``); every received byte is checked
against the KV both processes compute. The ceiling, in the decode process of the same run:
``cudaMemcpyAsync`` of the same bytes from its own GPU memory into the same pool rows (CUDA
events, median).

    python benchmarks/bench_pd.py [--mib 1024 | --tokens N] [--requests 8] [--reps 3]
        [--json FILE | --out DIR] [--quick]
        [--configs "" "UCX_RMA_PPLN_ENABLE=n" "desc=0" "desc=4194304" ...]

A configuration is a space-separated list of ``VAR=value`` environment variables (UCX's) and
the sender's ``desc=BYTES`` (``KVSender(desc_bytes=)`` of a WRITE, 0: the ticket's descriptors
uncut), ``max=K`` (``KVSender(max_in_flight=)``, 0: no limit), ``push=1``
(``KVReceiver(push=True)`` and ``KVSender(pull=False)``: the prefill process WRITEs),
``verify=1`` (``KVReceiver(verify=True)``: a checksum per layer, summed by the sender on its GPU
and by the receiver over the landed rows on host threads, inside the timed sends) and
``ucx.NAME=V`` (``KVSender(ucx_params={NAME: V})``, NIXL's UCX
backend parameters of the sender's agent, e.g. ``ucx.num_workers=4``), ``node=0``
(``KVSender(same_node=False)``) and ``shm=1`` (the decode pool a shared ``HostKVPool``: the
sender, on this node, copies into it, ``KVSender``'s same-node path, unless ``node=0``) and
``scatter=1`` (every round's pages in random order: up to a descriptor per page and layer,
where the default rounds get each request's pages as one run);
``""`` runs the defaults. Without NIXL it says so and exits 2 (``--quick``: 128 MiB, 2 reps, the
defaults, ``push=1``, ``shm=1`` and ``verify=1``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

L, RB, P = 78, 1152, 64
CONFIGS = ["", "push=1", "push=1 desc=0", "verify=1", "push=1 verify=1"]
QUICK = ["", "push=1", "shm=1", "verify=1"]
# the configurations' sender options: name -> (KVSender's keyword, its value from the text)
SENDER = {"desc": ("desc_bytes", lambda v: int(v) or None),
          "push": ("pull", lambda v: False if v == "1" else None),
          "max": ("max_in_flight", lambda v: int(v) or None),
          "node": ("same_node", lambda v: v == "1")}
RECEIVER = ("push", "verify", "shm", "scatter")  # the decode process's (push: both)


def kv_bytes(cupy, n_tokens: int):
    """The requests' KV, ``[L, n_tokens, RB]`` uint8, the same in both processes."""
    i = cupy.arange(L * n_tokens * RB // 4, dtype=cupy.uint32)
    return ((i * np.uint32(2654435761)) ^ (i >> 7)).view(cupy.uint8).reshape(L, n_tokens, RB)


def sender(tickets, answers, n_total: int, opts: dict) -> None:
    import cupy

    from hisparse_cupy.pd import KVSender

    kv = kv_bytes(cupy, n_total)
    cupy.cuda.Device().synchronize()
    tx = KVSender(**opts)
    tx.register(kv)
    answers.put("ready")
    try:
        while (msg := tickets.get()) is not None:
            kind, ts = msg
            views = [kv[:, t["first"]: t["first"] + t["n_tokens"]] for t in ts]
            t0 = time.perf_counter()
            posts, secs = [], []  # per send: the call until posted, the call until done
            if kind == "serial":
                for t, v in zip(ts, views, strict=True):
                    t1 = time.perf_counter()
                    p = tx.send(t, v, wait=False)
                    posts.append(time.perf_counter() - t1)
                    secs.append(p.wait().seconds)
            else:
                pend = []
                for t, v in zip(ts, views, strict=True):
                    t1 = time.perf_counter()
                    pend.append(tx.send(t, v, wait=False))
                    posts.append(time.perf_counter() - t1)
                secs = [p.wait().seconds for p in pend]
            answers.put({"wall": time.perf_counter() - t0, "secs": secs, "posts": posts,
                         "copied": tx.stats["copied"], "descs": [len(t["descs"]) for t in ts]})
    finally:
        tx.close()


def one(mib: int, n_req: int, reps: int, tokens: int | None, opts: dict,
        shm: bool = False, scatter: bool = False, push: bool = False,
        verify: bool = False) -> dict:
    import cupy
    from _timing import time_calls

    from hisparse_cupy.host._pages import HostPages
    from hisparse_cupy.host._pool import HostKVPool
    from hisparse_cupy.pd import KVReceiver

    n_tok = tokens or max(P, (mib << 20) // (L * RB * n_req) // P * P)
    n_total = n_tok * n_req
    nbytes = L * n_total * RB
    pool = HostKVPool(L, n_total, RB, **({"shared_name": f"bench_pd_{os.getpid()}"} if shm
                                         else {}))
    pages = HostPages(n_total // P, P)
    rx = KVReceiver(pool, pages, timeout_s=300, push=push, verify=verify)
    ctx = mp.get_context("spawn")
    tickets, answers = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=sender, args=(tickets, answers, n_total, opts),
                        daemon=True)
    child.start()
    out = {"mib": nbytes / 2**20, "requests": n_req, "tokens": n_tok, "bytes": nbytes,
           "shared_pool": shm, "scattered_pages": scatter, "push": push, "verify": verify}
    rng = np.random.default_rng(0)
    try:
        assert answers.get(timeout=120) == "ready"
        want = kv_bytes(cupy, n_total)
        rates = {"serial": [], "posted": []}
        post_ms = []  # serial sends: the call until the WRITE was posted
        posted = []  # posted together: per rep, each send's (post ms, seconds to done)
        for rep in range(reps + 1):  # rep 0: a warm-up (connections, a shared pool attached)
            for kind in ("serial", "posted"):
                pool.numpy[:] = 0xA5  # poison
                if scatter:
                    pages.put(list(rng.permutation(pages.take(pages.free_pages))))
                ts = []
                for r in range(n_req):
                    t = rx.reserve(r, n_tok)
                    t["first"] = r * n_tok  # this request's tokens in the sender's buffer
                    ts.append(t)
                tickets.put((kind, ts))
                got = {}
                while len(got) < n_req:
                    polled = rx.poll()
                    if polled.timed_out:
                        raise RuntimeError(f"timed out: {polled.timed_out}")
                    got.update((a.req_id, a) for a in polled.done)
                ans = answers.get(timeout=300)
                ok = True
                for r, a in got.items():
                    rows = (np.asarray(a.pages)[:, None] * P + np.arange(P)).ravel()[:n_tok]
                    dev = cupy.asarray(pool.numpy[:, rows])
                    ok &= bool((dev == want[:, r * n_tok:(r + 1) * n_tok]).all())
                    rx.release(a)
                if not ok:
                    raise RuntimeError(f"rep {rep} {kind}: received bytes differ")
                out["copied"] = ans["copied"]  # sends that took the same-node path, so far
                out["descriptors"] = ans["descs"]  # per request, the last round's
                if rep and kind == "posted":
                    posted.append([(1e3 * x, y) for x, y in zip(ans["posts"], ans["secs"],
                                                                strict=True)])
                elif rep:
                    post_ms += [1e3 * x for x in ans["posts"]]
                if rep:
                    dt = sum(ans["secs"]) if kind == "serial" else ans["wall"]
                    rates[kind].append(nbytes / dt / 1e9)
        # the ceiling: the same bytes, D2H into the same pool rows, one copy per layer
        s = cupy.cuda.Stream(non_blocking=True)

        def d2h_copy(_i: int) -> None:
            for layer in range(L):
                cupy.cuda.runtime.memcpyAsync(pool.numpy[layer].ctypes.data,
                                              want[layer].data.ptr, n_total * RB,
                                              cupy.cuda.runtime.memcpyDeviceToHost, s.ptr)

        us = time_calls(d2h_copy, iters=reps, warmup=1, stream=s)
        d2h = nbytes / np.median(us) / 1e3
        out.update({k: {"median_gbps": float(np.median(v)), "best_gbps": float(max(v)),
                        "all": v} for k, v in rates.items()})
        out["post_ms_median"] = float(np.median(post_ms))
        out["posted_sends"] = posted
        out["d2h_memcpy_gbps"] = float(d2h)
        out["share_of_memcpy"] = float(max(np.median(v) for v in rates.values()) / d2h)
        out["bytes_ok"] = True
    finally:
        tickets.put(None)
        child.join(timeout=60)
        rx.close()
        pool.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="MiB per rep (all requests)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per request (for --mib)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", nargs="*", default=CONFIGS, help="see the module docstring")
    ap.add_argument("--quick", action="store_true", help="128 MiB, 2 reps, the defaults and shm=1")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per configuration")
    ap.add_argument("--json")
    ap.add_argument("--out", help="a directory: bench_pd.json written there")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one is not None:
        given = json.loads(a.one)
        opts = {SENDER[k][0]: SENDER[k][1](v) for k, v in given.items() if k in SENDER}
        flags = {k: given.get(k, "0") == "1" for k in RECEIVER}
        if ucx := {k[4:]: v for k, v in given.items() if k.startswith("ucx.")}:
            opts["ucx_params"] = ucx
        print("@bench " + json.dumps(one(a.mib, a.requests, a.reps, a.tokens, opts, **flags)),
              flush=True)
        return 0
    try:
        from hisparse_cupy.pd import nixl_api

        nixl_api()
    except ImportError as e:
        print(f"bench_pd: {e}", file=sys.stderr)
        return 2
    if a.quick:
        a.mib, a.reps, a.configs = 128, 2, QUICK
    results = []
    for conf in a.configs:
        pairs = [kv.split("=", 1) for kv in conf.split()]
        ours = [(k, v) for k, v in pairs if k in SENDER or k in RECEIVER or
                k.startswith("ucx.")]
        env = {**os.environ, **{k: v for k, v in pairs if (k, v) not in ours}}
        opts = dict(ours)
        cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(opts), "--mib",
               str(a.mib), "--requests", str(a.requests), "--reps", str(a.reps)] + \
            (["--tokens", str(a.tokens)] if a.tokens else [])
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
            line = [x for x in p.stdout.splitlines() if x.startswith("@bench ")]
            res = json.loads(line[-1][7:]) if line else \
                {"error": f"rc {p.returncode}: {(p.stderr or p.stdout)[-600:]}"}
        except subprocess.TimeoutExpired:
            res = {"error": f"timed out after {a.timeout:.0f} s"}
        res.update(config=conf or "(defaults)", wall_s=time.perf_counter() - t0)
        results.append(res)
        if "error" in res:
            print(f"{res['config']}: {res['error']}", flush=True)
        else:
            print(f"{res['config']}: {res['mib']:.0f} MiB in {res['requests']} requests "
                  f"({max(res['descriptors'])} descriptors at most), VRAM -> "
                  f"DRAM ({'copied into a shared pool' if res['copied'] else 'over NIXL'}"
                  f"{', verified' if res['verify'] else ''}): "
                  f"one after another {res['serial']['median_gbps']:.2f} GB/s, "
                  f"posted together {res['posted']['median_gbps']:.2f} GB/s (medians; "
                  f"a send's post {res['post_ms_median']:.2f} ms); "
                  f"cudaMemcpyAsync of the same bytes {res['d2h_memcpy_gbps']:.2f} GB/s: "
                  f"{100 * res['share_of_memcpy']:.1f} %; bytes checked", flush=True)
    path = a.json or (a.out and os.path.join(a.out, "bench_pd.json"))
    if path:
        with open(path, "w") as f:
            json.dump({"results": results, "layers": L, "row_bytes": RB, "page_tokens": P}, f,
                      indent=1)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
