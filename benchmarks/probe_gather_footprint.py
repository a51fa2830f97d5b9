"""A zero-copy gather of random host rows against the host pool's size: is a full layer's own
copy bound by latency, or by the GPU's address translation of a large pinned pool?

On an H100 at 128k, n = 8, every request sparse (`tools/timeline_step.py`,
`benchmarks/results/fp8_h100_2026-12-07/sweep/timeline_128k_b8.json`), a full layer's own
planned copy of about 1,100 rows (8 requests x 137 misses of 656 B) took 70 us, about 10 GB/s.
The `info` ceiling, random rows out of a 43 MB pool, is 44.6 GB/s. There the rows lie spread
over a 52 GB pinned pool, so nearly every row may be a page the GPU has not translated yet.

This probe times the package's planned copy (one layer, one warp a row, the default grid) of N
rows out of pools of several sizes. The rows are drawn either uniformly over the pool or
clustered in a window of W MB. Each call in a graph of 8 reads its own row set, so no call
finds the translations or cache lines of the call before it, as in a decode step, where every
layer reads other rows. The first call of every point is checked byte for byte. The ceiling,
from the same pool in the same run, is a `cudaMemcpyAsync` of the same bytes, contiguous.

Where the pool's memory comes from (``--alloc``), should translation be the bound:
- ``mmap``: the package's default pool (anonymous memory, transparent huge pages asked,
  ``cudaHostRegister``); ``mmap4k``: the same without huge pages;
- ``cuda``: ``HostKVPool(..., alloc="cuda")``, one ``cudaHostAlloc``;
- ``vmm``: the driver's virtual memory API (``cuMemCreate`` on the GPU's host NUMA node, at its
  recommended granularity, mapped for the GPU and the CPU), which hands the GPU physically
  contiguous chunks of that granularity; not a package pool, a candidate for one.
The JSON records the host's NUMA nodes, the GPU's node and the huge-page settings beside.

    PYTHONPATH=. python benchmarks/probe_gather_footprint.py [--pool-gb 0.05 1 8 32]
        [--rows 256 1100 4096] [--window-mb 2 64] [--alloc mmap mmap4k cuda vmm] [--iters 20]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import sys
from pathlib import Path
from typing import NamedTuple

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_info, memcpy_h2d, time_graph_chain, write_json  # noqa: E402

from hisparse_cupy import HostKVPool  # noqa: E402
from hisparse_cupy._kernels.plan import Rows, array_rows, copy_rows  # noqa: E402

ROW = 656
CHAIN = 8


def _row_sets(rng, n_rows: int, n: int, window_rows: int | None) -> list[np.ndarray]:
    """CHAIN disjoint-ish sets of ``n`` distinct rows: uniform over the pool, or each inside
    its own window of ``window_rows`` rows at a random place."""
    out = []
    for _ in range(CHAIN):
        if window_rows is None:
            out.append(rng.choice(n_rows, n, replace=False))
        else:
            start = int(rng.integers(0, n_rows - window_rows + 1))
            out.append(start + rng.choice(window_rows, n, replace=False))
    return [np.sort(r).astype(np.int64) for r in out]


class Pool(NamedTuple):
    """A probe's host rows: ``host`` (uint8 ``[n_rows, ROW]``, the CPU's view), ``rows`` (the
    GPU's), ``close`` and what the allocation was."""

    host: np.ndarray
    rows: Rows
    close: object
    info: dict


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def host_info() -> dict:
    """The host's NUMA nodes, the GPU's, and the huge-page settings."""
    bus = cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.Device().id).lower()
    return {"numa_nodes": len(glob.glob("/sys/devices/system/node/node[0-9]*")),
            "gpu_numa_node": _read(f"/sys/bus/pci/devices/{bus}/numa_node"),
            "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "hugepages_total": _read("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")}


def _anon_huge_kb() -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def _ok(res):
    """A cuda-python driver call's value, or an error naming the call's result."""
    from cuda.bindings import driver
    err, *val = res if isinstance(res, tuple) else (res,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"driver call failed: {err!r}")
    return val[0] if len(val) == 1 else val


def vmm_pool(n_rows: int) -> Pool:
    """``n_rows`` rows of pinned host memory from ``cuMemCreate`` on the GPU's NUMA node (node 0
    where the GPU names none), mapped read-write for the GPU and the CPU."""
    from cuda.bindings import driver as d
    node = host_info()["gpu_numa_node"]
    node = int(node) if node.lstrip("-").isdigit() and int(node) >= 0 else 0
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    prop.location.id = node
    gran = int(_ok(d.cuMemGetAllocationGranularity(
        prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
    size = -(-n_rows * ROW // gran) * gran
    handle = _ok(d.cuMemCreate(size, prop, 0))
    ptr = None
    try:
        ptr = int(_ok(d.cuMemAddressReserve(size, gran, 0, 0)))
        _ok(d.cuMemMap(ptr, size, 0, handle, 0))
        descs = []
        for kind, ident in ((d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE,
                             cupy.cuda.Device().id),
                            (d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA, node)):
            a = d.CUmemAccessDesc()
            a.location.type, a.location.id = kind, ident
            a.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            descs.append(a)
        _ok(d.cuMemSetAccess(ptr, size, descs, len(descs)))
    except BaseException:
        if ptr is not None:
            d.cuMemUnmap(ptr, size)
            d.cuMemAddressFree(ptr, size)
        d.cuMemRelease(handle)
        raise
    host = np.ctypeslib.as_array((ctypes.c_uint8 * (n_rows * ROW)).from_address(ptr))

    def close() -> None:
        cupy.cuda.Device().synchronize()
        _ok(d.cuMemUnmap(ptr, size))
        _ok(d.cuMemAddressFree(ptr, size))
        _ok(d.cuMemRelease(handle))

    return Pool(host.reshape(n_rows, ROW), Rows(ptr, 0, n_rows), close,
                {"alloc": "vmm", "granularity": gran, "numa_node": node})


def make_pool(alloc: str, n_rows: int) -> Pool:
    if alloc == "vmm":
        return vmm_pool(n_rows)
    huge0 = _anon_huge_kb()
    p = HostKVPool(1, n_rows, ROW, alloc="mmap" if alloc == "mmap4k" else alloc,
                   huge_pages=alloc != "mmap4k")
    return Pool(p.numpy[0], Rows(int(p.device_ptr(0)), 0, p.n_rows), p.close,
                {"alloc": alloc, "anon_huge_pages_gained_gb": (_anon_huge_kb() - huge0) / 2**20})


def point(pool: Pool, n: int, window_mb: float | None, rng, iters: int,
          stream: cupy.cuda.Stream) -> dict:
    n_rows = pool.rows.n_rows
    window = None if window_mb is None else max(n, int(window_mb * 2**20) // ROW)
    if window is not None and window > n_rows:
        return {"skipped": f"window of {window} rows > the pool's {n_rows}"}
    sets = _row_sets(rng, n_rows, n, window)
    host = pool.host
    for rows in sets:  # bytes that name their row
        host[rows] = (rows[:, None] * 131 + np.arange(ROW)[None]).astype(np.uint8)
    with stream:
        src = [cupy.asarray(r[None]) for r in sets]
        dst_idx = cupy.arange(n, dtype=cupy.int32)[None]
        count = cupy.full(1, n, cupy.int32)
        out = cupy.full((n, ROW), 0xA5, cupy.uint8)
    src_rows, dst_rows = pool.rows, array_rows(out)

    def enqueue(i: int) -> None:
        copy_rows(src[i % CHAIN], dst_idx, count, src=src_rows, dst=dst_rows, row_bytes=ROW,
                  stream=stream, batch=1)

    enqueue(0)
    stream.synchronize()
    ok = bool((cupy.asnumpy(out) == host[sets[0]]).all())
    t = time_graph_chain(enqueue, None, n=CHAIN, iters=iters, stream=stream)
    nbytes = n * ROW
    return {"rows": n, "window_mb": window_mb, "bytes_ok": ok, "us": t,
            "GBps": nbytes / (t["median_us"] * 1e-6) / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool-gb", type=float, nargs="+", default=[0.05, 1, 8, 32])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 1100, 4096])
    ap.add_argument("--window-mb", type=float, nargs="+", default=[2, 64])
    ap.add_argument("--alloc", nargs="+", default=["mmap"],
                    choices=["mmap", "mmap4k", "cuda", "vmm"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="directory for probe_gather_footprint.json")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    res, bad = [], 0
    print("host:", host_info())
    print(f"{'alloc':>5} {'pool GB':>8} {'rows':>6} {'layout':>10} {'us':>8} {'GB/s':>6} "
          f"{'memcpy us':>10}")
    for gb in a.pool_gb:
        for alloc in a.alloc:
            n_rows = max(int(gb * 1e9) // ROW, max(a.rows))
            try:
                pool = make_pool(alloc, n_rows)
            except Exception as e:  # a kind this host or driver does not give: say so, go on
                print(f"{alloc:>5} {gb:8.2f}: no pool ({type(e).__name__}: {e})")
                res.append({"alloc": alloc, "pool_gb": gb, "skipped": f"{type(e).__name__}: {e}"})
                continue
            print(f"{alloc:>5} {gb:8.2f}: {pool.info}")
            try:
                for n in a.rows:
                    ceiling = memcpy_h2d(pool.host, n * ROW, stream=stream)[1]  # a graph of 8
                    for w in [None, *a.window_mb]:
                        r = point(pool, n, w, rng, a.iters, stream)
                        r.update(pool_gb=gb, memcpy=ceiling, **pool.info)
                        res.append(r)
                        if "skipped" in r:
                            continue
                        bad += not r["bytes_ok"]
                        layout = "uniform" if w is None else f"{w:g} MB"
                        print(f"{alloc:>5} {gb:8.2f} {n:6d} {layout:>10} "
                              f"{r['us']['median_us']:8.1f} {r['GBps']:6.1f} "
                              f"{ceiling['median_us']:10.1f}"
                              + ("" if r["bytes_ok"] else "  WRONG BYTES"))
            finally:
                pool.close()
    if a.out:
        print("json:", write_json(a.out, "probe_gather_footprint.json",
                                  {"device": device_info(), "host": host_info(),
                                   "row_bytes": ROW, "chain": CHAIN, "results": res}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
