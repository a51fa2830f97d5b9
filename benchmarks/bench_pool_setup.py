"""Host pool setup and teardown: cudaHostAlloc against mmap + parallel first touch + chunked
cudaHostRegister, measured in the same run.

A pool of ``--gb`` GB shaped like GLM's KV (78 layers of 656-byte rows), built by each path
in turn, each freed before the next (a 64 GB pool fits on a 128 GB host):

- ``cuda``: ``HostKVPool(alloc="cuda")``, one ``cudaHostAlloc``;
- ``mmap``: ``HostKVPool()`` (``alloc="mmap"``, the default): anonymous mmap, first touch
  from ``--threads`` threads, transparent huge pages asked, ``cudaHostRegister`` in chunks of
  at most ``_REGISTER_CHUNK``;
- ``mmap-4k``: the same without huge pages (what a kernel without THP gets);
- ``shared``: ``HostKVPool(shared_name=...)``: ``/dev/shm`` files, one segment per thread
  (``hisparse_cupy.host._shm``), the same first touch and registration, named once set up;
- ``shared-1``: the same in one file (``segments=1``, the path before segments);
- ``touch``: no pool, no CUDA: anonymous memory with huge pages asked, first-touched by the
  same threads and unmapped (run first on a freshly started machine, it tells the machine's
  first touch of its memory from the pool's own costs).

``--shm-dir`` puts the shared pools in another tmpfs (``HISPARSE_CUPY_SHM_DIR``), e.g. one
mounted ``huge=always``.

Per path: setup seconds and GB/s (first touch and registration apart), teardown seconds
(unregistration apart), the huge pages the process held after setup, and whether the GPU
reads the bytes written on the host through ``device_ptr`` (an elementwise kernel over rows
at the pool's ends and across every registration chunk's edge). Targets: setup
>= 10 GB/s and teardown <= 2 s for a 64 GB pool. A path that fails is reported and skipped.

    python benchmarks/bench_pool_setup.py [--gb 64] [--threads N] [--chunk-gib G]
        [--paths cuda,mmap,shared,mmap-4k,shared-1,touch] [--shm-dir DIR] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import platform
import sys
import time
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_info, write_json  # noqa: E402

from hisparse_cupy.host import _pool as hp  # noqa: E402
from hisparse_cupy.host import _shm as host_shm  # noqa: E402

LAYERS, ROW = 78, 656
PATHS = ("cuda", "mmap", "shared", "mmap-4k", "shared-1", "touch")


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "n/a"


def _huge_gb() -> float:
    """GB of this process's memory in huge pages (anonymous and shmem), from smaps_rollup."""
    kb = 0
    for line in _read("/proc/self/smaps_rollup").splitlines():
        if line.startswith(("AnonHugePages:", "ShmemPmdMapped:")):
            kb += int(line.split()[1])
    return kb * 1024 / 1e9


def _meminfo_gb(*keys: str) -> dict:
    """The given /proc/meminfo lines, in GB (node-wide)."""
    return {ln.split(":")[0]: int(ln.split()[1]) * 1024 / 1e9
            for ln in _read("/proc/meminfo").splitlines() if ln.split(":")[0] in keys}


def _machine() -> dict:
    d = host_shm.directory()
    shm = os.statvfs(d)
    return {"kernel": platform.release(), "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "mem_gb": _meminfo_gb("MemTotal", "MemAvailable"),
            "shm_dir": d, "shm_dir_gb": shm.f_blocks * shm.f_frsize / 1e9,
            "shm_mount": " ".join(host_shm.mount(d)[1:]) or "n/a",
            "thp": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "thp_shmem": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled")}


def _gpu_reads_right(pool) -> bool:
    """Rows at the pool's ends and on both sides of every registration chunk's edge, written
    on the host with random bytes, read by a kernel through the device address."""
    total = pool.n_layers * pool.n_rows
    host = pool.numpy.reshape(total, pool.row_bytes)
    base, nbytes = host.ctypes.data, total * pool.row_bytes
    edges = [p - base for p, _ in hp._chunks(base, nbytes)[1:]]
    rng = np.random.default_rng(0)
    starts = {0, total - 3} | {min(max(e // pool.row_bytes - 1, 0), total - 3) for e in edges} \
        | {int(r) for r in rng.integers(0, total - 3, 64)}  # in every segment, likely
    dev_id = cupy.cuda.Device().id
    ok = True
    for r in sorted(starts):
        host[r: r + 3] = rng.integers(0, 256, (3, pool.row_bytes), dtype=np.uint8)
        ptr = int(pool.device_ptr(0)) + r * pool.row_bytes
        mem = cupy.cuda.UnownedMemory(ptr, 3 * pool.row_bytes, pool, device_id=dev_id)
        win = cupy.ndarray((3, pool.row_bytes), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
        got = cupy.asnumpy(win.astype(cupy.uint16))  # a kernel's loads, not a DMA copy
        ok &= bool((got == host[r: r + 3]).all())
    return ok


def _touch_only(nbytes: int, threads: int) -> dict:
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        hp._advise(mm, "MADV_HUGEPAGE")
        t0 = time.perf_counter()
        hp._first_touch(np.frombuffer(mm, np.uint8, nbytes), threads)
        res = {"setup_s": time.perf_counter() - t0, "huge_gb": _huge_gb(), "bytes_ok": True}
    finally:
        t0 = time.perf_counter()
        mm.close()
    return {**res, "teardown_s": time.perf_counter() - t0}


def _one(path: str, n_rows: int, args) -> dict:
    if path == "touch":
        return {"path": path, **_touch_only(LAYERS * n_rows * ROW,
                                            args.threads or hp.default_threads())}
    shared = {"shared_name": f"hs-bench-setup-{os.getpid()}"}
    kw = {"cuda": {"alloc": "cuda"}, "mmap": {"alloc": "mmap"},
          "mmap-4k": {"alloc": "mmap", "huge_pages": False}, "shared": shared,
          "shared-1": {**shared, "segments": 1}}[path]
    if path != "cuda":
        kw["threads"] = args.threads
    pool = None
    res = {"path": path}
    try:
        t0 = time.perf_counter()
        pool = hp.HostKVPool(LAYERS, n_rows, ROW, **kw)
        res["setup_s"] = time.perf_counter() - t0
        res["huge_gb"] = _huge_gb()  # and the node's shmem in huge pages (mapped huge or not):
        res["shmem_huge_gb"] = _meminfo_gb("ShmemHugePages").get("ShmemHugePages", 0.0)
        res["bytes_ok"] = _gpu_reads_right(pool)
        t0 = time.perf_counter()
        pool.close()
        res["teardown_s"] = time.perf_counter() - t0
        res.update({f"pool_{k}": v for k, v in pool.timings.items()})
    except Exception as e:  # noqa: BLE001 - reported, the next path still runs
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        if pool is not None and not pool.closed:
            pool.close()
        if "shared_name" in kw:
            host_shm.unlink(host_shm.path(kw["shared_name"]))
        del pool
        gc.collect()
    return res


def _cell(r: dict, key: str, width: int) -> str:
    return f"{r[key]:>{width}.2f}" if key in r else f"{'-':>{width}}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=64.0, help="pool size in GB (1e9 bytes)")
    ap.add_argument("--threads", type=int, default=None,
                    help=f"first-touch threads (default {hp.default_threads()})")
    ap.add_argument("--chunk-gib", type=float, default=None,
                    help=f"registration chunk in GiB (default {hp._REGISTER_CHUNK >> 30})")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"some of {','.join(PATHS)}")
    ap.add_argument("--shm-dir", default=None,
                    help="the shared pools' directory (HISPARSE_CUPY_SHM_DIR; /dev/shm)")
    ap.add_argument("--quick", action="store_true", help="a 4 GB pool")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.gb = min(args.gb, 4.0)
    if args.shm_dir is not None:
        os.environ["HISPARSE_CUPY_SHM_DIR"] = args.shm_dir
    paths = [p for p in args.paths.split(",") if p]
    if not paths or any(p not in PATHS for p in paths):
        print(f"bench_pool_setup: --paths must name some of {PATHS}, got {args.paths!r}")
        return 2
    if args.chunk_gib is not None:
        hp._REGISTER_CHUNK = int(args.chunk_gib * 2**30) // hp._PAGE * hp._PAGE
    n_rows = int(args.gb * 1e9 / (LAYERS * ROW)) // 16 * 16
    gb = LAYERS * n_rows * ROW / 1e9
    machine = _machine()
    cupy.cuda.Device().synchronize()  # the context, before any timing
    for w in ("cuda", "mmap", "shared"):  # warm-up: first calls of each path, untimed
        _one(w, 64, args)
    print(f"host pool of {gb:.1f} GB ({LAYERS} layers x {n_rows} rows x {ROW} B), "
          f"{len(hp._chunks(0, int(gb * 1e9)))} registration chunk(s) of <= "
          f"{hp._REGISTER_CHUNK / 2**30:g} GiB, {args.threads or hp.default_threads()} "
          f"first-touch threads; THP {machine['thp']}, shmem THP {machine['thp_shmem']}; "
          f"shared pools in {machine['shm_dir']} ({machine['shm_mount']})")
    print(f"{'path':>8} {'setup s':>8} {'GB/s':>6} {'touch s':>8} {'register s':>10} "
          f"{'teardown s':>10} {'unregister s':>12} {'huge GB':>8} {'shm huge':>8} "
          f"{'GPU reads':>9}")
    payload = {"device": device_info(), "machine": machine, "args": vars(args), "pool_gb": gb,
               "n_rows": n_rows, "layers": LAYERS, "row_bytes": ROW,
               "register_chunk": hp._REGISTER_CHUNK, "results": []}
    for path in paths:
        r = _one(path, n_rows, args)
        r["setup_gbps"] = gb / r["setup_s"] if "setup_s" in r else None
        payload["results"].append(r)
        if "error" in r:
            print(f"{path:>8} failed: {r['error']}")
        else:
            print(f"{path:>8} {_cell(r, 'setup_s', 8)} {r['setup_gbps']:>6.1f} "
                  f"{_cell(r, 'pool_touch_s', 8)} {_cell(r, 'pool_register_s', 10)} "
                  f"{_cell(r, 'teardown_s', 10)} {_cell(r, 'pool_unregister_s', 12)} "
                  f"{r['huge_gb']:>8.1f} {r.get('shmem_huge_gb', 0):>8.1f} "
                  f"{'ok' if r['bytes_ok'] else 'WRONG':>9}", flush=True)
        if args.out:  # partial results survive a later path's crash
            write_json(args.out, "bench_pool_setup.json", payload)
    ok = [r for r in payload["results"] if "error" not in r]
    for r in ok:
        if r["path"] not in ("cuda", "touch"):
            meets = r["setup_gbps"] >= 10 and r["teardown_s"] <= 2
            print(f"{r['path']}: setup {r['setup_gbps']:.1f} GB/s (target >= 10), teardown "
                  f"{r['teardown_s']:.2f} s (target <= 2): {'met' if meets else 'NOT met'}")
    base = next((r for r in ok if r["path"] == "cuda"), None)
    if base is not None:
        for r in ok:
            if r["path"] not in ("cuda", "touch"):
                print(f"{r['path']} sets up {base['setup_s'] / r['setup_s']:.1f}x faster than "
                      f"cudaHostAlloc ({base['setup_s']:.1f} s)")
    if args.out:
        print(f"json: {Path(args.out) / 'bench_pool_setup.json'}")
    return 0 if len(ok) == len(paths) and all(r["bytes_ok"] for r in ok) else 1


if __name__ == "__main__":
    sys.exit(main())
