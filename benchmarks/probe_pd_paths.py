"""Which NIXL path moves prefill KV into a decode pool at memcpy speed? Two processes, raw agents.

A "prefill" process (spawned) holds the bytes twice, in its GPU memory (VRAM) and in pinned host
memory (DRAM); the "decode" process holds a pinned ``HostKVPool`` (the target) and times, per
UCX configuration (a fresh pair of processes each) and per descriptor piece size:

- ``write-vram``: the prefill process WRITEs VRAM -> the pool (``hisparse_cupy.pd``'s path);
- ``read-vram``: the decode process READs the prefill VRAM into the pool (receiver-initiated,
  as vLLM's NixlConnector does; on one node UCX can use ``cuda_ipc`` for it);
- ``write-dram`` / ``read-dram``: the same from the prefill's pinned DRAM (host to host: the bound
  of any path that stages in host memory on the sender).

Every transfer lands on a poisoned pool and is checked byte for byte. The ceiling, in the decode
process of the same run: ``cudaMemcpyAsync`` D2H of the same bytes into the same pool (events,
median).

    python benchmarks/probe_pd_paths.py [--mib 512] [--reps 3] [--pieces 1048576 0]
        [--runs 78 --spread 3]
        [--modes write-vram read-vram ...] [--configs "" "UCX_MAX_RNDV_RAILS=1"] [--json FILE]

A configuration: space-separated ``VAR=value`` environment variables (UCX's) and
``ucx.NAME=V``, NIXL's UCX backend parameters of the prefill agent (e.g. ``ucx.num_workers=4``).

``--pieces``: descriptor sizes in bytes (0: one descriptor per run). ``--runs L --spread K``:
the bytes as L runs (a pool's layers: ``bench_pd.py`` sends 78), run l at ``l * K * run`` on
both sides (K = 1: back to back; buffers K times the bytes), each cut into the pieces. Without
NIXL it says so and exits 2.
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
MODES = ("write-vram", "read-vram", "write-dram", "read-dram")


def pattern(xp, nbytes: int):
    i = xp.arange(nbytes // 4, dtype=xp.uint32)
    return ((i * np.uint32(2654435761)) ^ (i >> 9)).view(xp.uint8)


def descs(addr: int, runs, piece: int, dev: int) -> np.ndarray:
    """``(offset, bytes)`` runs from ``addr``, each cut into pieces of ``piece`` bytes (0: uncut),
    by the sender's own cut."""
    from hisparse_cupy.pd._nixl import cut

    d = np.array([[addr + off, n, dev] for off, n in runs], np.uint64)
    return cut(d, piece) if piece else d


def layout(nbytes: int, runs: int, spread: int) -> list:
    run = nbytes // runs // 4096 * 4096  # (the pool's rows are 4 KiB)
    if run == 0 or spread < 1:
        raise SystemExit(f"probe_pd_paths: --runs {runs} --spread {spread} leave no 4 KiB run")
    return [(layer * spread * run, run) for layer in range(runs)]


def run_xfer(agent, op: str, local, remote, peer: str, timeout: float) -> tuple:
    """Seconds to the end, seconds in ``initialize_xfer``, seconds in ``transfer`` (the post)."""
    t0 = time.perf_counter()
    h = agent.initialize_xfer(op, local, remote, peer, b"probe")
    t1 = time.perf_counter()
    st = agent.transfer(h)
    t2 = time.perf_counter()
    while st == "PROC":
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"{op} did not complete in {timeout} s")
        st = agent.check_xfer_state(h)
    dt = time.perf_counter() - t0
    agent.release_xfer_handle(h)
    if st != "DONE":
        raise RuntimeError(f"{op} ended {st}")
    return dt, t1 - t0, t2 - t1


def prefill(cmds, answers, nbytes: int, runs: list, ucx: dict) -> None:
    import cupy

    from hisparse_cupy.pd import _nixl

    vram = pattern(cupy, nbytes)
    host = cupy.cuda.alloc_pinned_memory(nbytes)
    dram = np.frombuffer(host, np.uint8, nbytes)
    dram[:] = vram.get()
    agent = _nixl.agent("probe-prefill", "", _nixl.ucx_params(ucx))[1]
    agent.register_memory([(vram.data.ptr, nbytes, 0, "")], "VRAM")
    agent.register_memory([(dram.ctypes.data, nbytes, 0, "")], "DRAM")
    answers.put((agent.get_agent_metadata(), vram.data.ptr, dram.ctypes.data))
    md = cmds.get()
    agent.add_remote_agent(md)
    while (msg := cmds.get()) is not None:
        src, piece, pool_addr, timeout = msg
        mem, addr = ("VRAM", vram.data.ptr) if src == "vram" else ("DRAM", dram.ctypes.data)
        try:
            dt = run_xfer(agent, "WRITE", agent.get_xfer_descs(descs(addr, runs, piece, 0), mem),
                          agent.get_xfer_descs(descs(pool_addr, runs, piece, 0), "DRAM"),
                          "probe-decode", timeout)
            answers.put(dt)
        except Exception as e:  # reported, the probe goes on
            answers.put(repr(e))


def one(mib: int, reps: int, pieces: list, timeout: float, modes: list, n_runs: int = 1,
        spread: int = 1, ucx: dict | None = None) -> dict:
    import cupy
    from _timing import time_calls

    from hisparse_cupy.host._pool import HostKVPool
    from hisparse_cupy.pd import _nixl

    runs = layout(mib << 20, n_runs, spread)
    nbytes = runs[-1][0] + runs[-1][1]  # the buffers' size (the bytes moved: sum of the runs)
    moved = sum(n for _, n in runs)
    pool = HostKVPool(1, nbytes // 4096, 4096)
    dst = pool.numpy.reshape(-1)
    want_dev = pattern(cupy, nbytes)
    want = want_dev.get()
    agent = _nixl.agent("probe-decode", "")[1]
    agent.register_memory([(dst.ctypes.data, nbytes, 0, "")], "DRAM")
    ctx = mp.get_context("spawn")
    cmds, answers = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=prefill, args=(cmds, answers, nbytes, runs, ucx or {}), daemon=True)
    child.start()
    out = {"mib": mib, "runs": n_runs, "spread": spread, "bytes": moved, "paths": {}}
    try:
        md, p_vram, p_dram = answers.get(timeout=120)
        agent.add_remote_agent(md)
        cmds.put(agent.get_agent_metadata())
        for mode in modes:
            op, src = mode.split("-")
            for piece in pieces:
                rates, ms, err = [], [], None
                for _ in range(reps + 1):  # the first is a warm-up
                    dst[:] = 0xA5
                    if op == "write":
                        cmds.put((src, piece, dst.ctypes.data, timeout))
                        got = answers.get(timeout=timeout + 30)
                    else:
                        mem, addr = ("VRAM", p_vram) if src == "vram" else ("DRAM", p_dram)
                        try:
                            got = run_xfer(
                                agent, "READ",
                                agent.get_xfer_descs(descs(dst.ctypes.data, runs, piece, 0),
                                                     "DRAM"),
                                agent.get_xfer_descs(descs(addr, runs, piece, 0), mem),
                                "probe-prefill", timeout)
                        except Exception as e:
                            got = repr(e)
                    if isinstance(got, str):
                        err = got
                        break
                    if not all(np.array_equal(dst[o:o + n], want[o:o + n]) for o, n in runs) \
                            or any((dst[o + n:o2] != 0xA5).any() for (o, n), (o2, _) in
                                   zip(runs, runs[1:], strict=False)):
                        err = "received bytes differ (or landed between the runs)"
                        break
                    rates.append(moved / got[0] / 1e9)
                    ms.append((1e3 * got[1], 1e3 * got[2]))
                key = f"{mode} piece={piece or 'whole'}"
                init, post = np.median(ms[1:], axis=0) if not err else (0.0, 0.0)
                out["paths"][key] = {"error": err} if err else {
                    "median_gbps": float(np.median(rates[1:])), "all": rates[1:],
                    "init_ms": float(init), "post_ms": float(post)}
                print(f"  {key}: {err or f'{np.median(rates[1:]):.2f} GB/s'}"
                      + ("" if err else f" (initialize_xfer {init:.2f} ms, transfer() "
                                        f"{post:.2f} ms)"), flush=True)
        s = cupy.cuda.Stream(non_blocking=True)
        us = time_calls(lambda _i: cupy.cuda.runtime.memcpyAsync(
            dst.ctypes.data, want_dev.data.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToHost,
            s.ptr), iters=reps, warmup=1, stream=s)
        out["d2h_memcpy_gbps"] = float(nbytes / np.median(us) / 1e3)  # (the whole buffer)
    finally:
        cmds.put(None)
        child.join(timeout=60)
        pool.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pieces", type=int, nargs="*", default=[1 << 20, 0])
    ap.add_argument("--configs", nargs="*", default=[""])
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument("--runs", type=int, default=1, help="the bytes as this many runs")
    ap.add_argument("--spread", type=int, default=1, help="run l at l * SPREAD * run bytes")
    ap.add_argument("--json")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one is not None:
        print("@probe " + json.dumps(one(a.mib, a.reps, a.pieces, a.timeout, a.modes, a.runs,
                                         a.spread, json.loads(a.one))), flush=True)
        return 0
    try:
        from hisparse_cupy.pd import nixl_api

        nixl_api()
    except ImportError as e:
        print(f"probe_pd_paths: {e}", file=sys.stderr)
        return 2
    results = []
    for conf in a.configs:
        pairs = [kv.split("=", 1) for kv in conf.split()]
        env = {**os.environ, "UCX_RMA_PPLN_ENABLE": "y",
               **{k: v for k, v in pairs if not k.startswith("ucx.")}}
        ucx = {k[4:]: v for k, v in pairs if k.startswith("ucx.")}
        cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(ucx), "--mib",
               str(a.mib), "--reps", str(a.reps), "--timeout", str(a.timeout), "--pieces",
               *map(str, a.pieces),
               "--modes", *a.modes, "--runs", str(a.runs), "--spread", str(a.spread)]
        print(f"{conf or '(UCX_RMA_PPLN_ENABLE=y only)'}:", flush=True)
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=a.timeout * 4 * len(a.pieces) * (a.reps + 1) + 120)
            print("".join(x + "\n" for x in p.stdout.splitlines() if not x.startswith("@")),
                  end="", flush=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("@probe ")]
            res = json.loads(line[-1][7:]) if line else \
                {"error": f"rc {p.returncode}: {(p.stderr or p.stdout)[-800:]}"}
        except subprocess.TimeoutExpired:
            res = {"error": "timed out"}
        res["config"] = conf
        results.append(res)
        print(f"  memcpy D2H {res.get('d2h_memcpy_gbps', 0):.2f} GB/s"
              if "error" not in res else f"  {res['error']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
