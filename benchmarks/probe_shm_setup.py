"""Probe: the fastest way to set up (and tear down) a POSIX shared-memory host pool that is ONE
contiguous virtual range, populated (every page allocated) and registered with CUDA.

Today ``HostKVPool(shared_name=...)`` makes one ``O_TMPFILE`` file in /dev/shm, ftruncates it,
maps it ``MAP_SHARED``, has up to 16 threads write a zero into every 4 KiB page of their share
(``rows[a:a + step:4096] = 0``: NumPy's strided fill releases the GIL), then
``cudaHostRegister``s it (portable | mapped, at most 64 GiB a call). On the H200 box (16 cores,
kernel 6.18, THP for shmem never, for anon madvise) a 64 GB pool's touch took 14.3 s
(4.5 GB/s), the same touch of private 4 KiB anonymous memory 2.97 s, and the teardown
(unregister, munmap, unlink) 6.3 s. Suspected: per-inode locks (the page cache's xarray lock,
shmem's info->lock) serialize the threads' page faults on one tmpfs file, and the pages of one
inode are freed by one thread at its last unmap/close. Variants, each building the same G GB:

- ``one-file-touch``: today's path;
- ``one-file-populate``: one file, each thread ``madvise(MADV_POPULATE_WRITE)`` on its share;
- ``one-file-fallocate``: one file, ``posix_fallocate`` of all of it (one thread), then touch;
- ``segments-touch``: S files (one per thread, S = ``--threads``), each ftruncated to its share
  and mapped ``MAP_SHARED | MAP_FIXED`` over its part of one ``PROT_NONE`` reservation (still
  one contiguous range), each thread touching its own; the teardown munmaps and closes them
  from S threads. On a GPU it also registers the range as min(S, 8) chunks from one thread,
  then from one thread per chunk, to see whether the driver's pinning scales;
- ``segments-populate``: the same with ``MADV_POPULATE_WRITE``, one thread per segment;
- ``private-4k``, ``private-thp``: baselines, anonymous ``MAP_PRIVATE`` memory touched by the
  threads, without and with ``MADV_HUGEPAGE``.

Per variant: create+populate s, register s (GPU only), teardown s (unregister, munmap, close:
a file's pages are freed at its last close; O_TMPFILE files have no name to unlink) and the
setup's GB/s (create+populate+register). Checks: the range's Rss in /proc/self/smaps (and the
files' allocated blocks) after populate, and distinct bytes written at offsets spread over the
range (and on both sides of every share's edge) read back through the mapping, the files
(pread) and, on a GPU, a kernel's loads through the device pointer. Each variant is torn down
fully (then 1 s waited) before the next; G GB plus 10 % must fit in MemAvailable and /dev/shm
free space. Without a GPU (or CuPy) the CUDA steps are skipped with a note.

    python benchmarks/probe_shm_setup.py [--gb 16] [--threads S] [--variants a,b,...]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import platform
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")
HUGE = 2 << 20  # shares are cut on 2 MiB edges (whole huge pages for private-thp)
REG_CHUNK = 64 << 30  # bytes per cudaHostRegister call at most
REG_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
SHM = "/dev/shm"
PROT_NONE, PROT_RW = 0, 1 | 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANON, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
VARIANTS = {  # name: (layout, fill, MADV_HUGEPAGE)
    "one-file-touch": ("one", "touch", False),
    "one-file-populate": ("one", "populate", False),
    "one-file-fallocate": ("one", "fallocate", False),
    "segments-touch": ("seg", "touch", False),
    "segments-populate": ("seg", "populate", False),
    "private-4k": ("private", "touch", False),
    "private-thp": ("private", "touch", True),
}

libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL around each call
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.mmap.restype = ctypes.c_void_p
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.munmap.restype = ctypes.c_int
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.madvise.restype = ctypes.c_int
MAP_FAILED = ctypes.c_void_p(-1).value
cp = None  # cupy, where a GPU is present
now = time.perf_counter


def _errno_error(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


def mmap_(addr: int | None, n: int, prot: int, flags: int, fd: int = -1) -> int:
    p = libc.mmap(addr, n, prot, flags, fd, 0)
    if p is None or p == MAP_FAILED:
        raise _errno_error("mmap")
    if flags & MAP_FIXED and p != addr:
        raise OSError(f"mmap MAP_FIXED at {addr:#x} returned {p:#x}")
    return p


def munmap_(addr: int, n: int) -> None:
    if libc.munmap(addr, n):
        raise _errno_error("munmap")


def madvise_(addr: int, n: int, advice: int) -> None:
    while libc.madvise(addr, n, advice):
        e = ctypes.get_errno()
        if e not in (errno.EINTR, errno.EAGAIN):
            raise OSError(e, f"madvise({advice}): {os.strerror(e)}")


def view(addr: int, n: int) -> np.ndarray:
    """A writable uint8 NumPy view of n bytes at addr (no ownership: drop it before munmap)."""
    return np.frombuffer((ctypes.c_ubyte * n).from_address(addr), np.uint8)


def each(fn, items, threads: bool = True) -> list:
    """fn(item) for every item, one thread each (or in this thread); results in order, with
    the exception in place of a failed item's result (all items run either way)."""
    def run(item):
        try:
            return fn(item)
        except Exception as e:  # noqa: BLE001 - handed back, the others still run
            return e
    if not threads or len(items) < 2:
        return [run(it) for it in items]
    with ThreadPoolExecutor(len(items)) as ex:
        return list(ex.map(run, items))


def raise_first(results: list) -> list:
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def shares(n: int, k: int) -> list[tuple[int, int]]:
    """(offset, bytes) of up to k shares of n bytes on 2 MiB edges, the last taking the rest."""
    per = -(-n // k // HUGE) * HUGE
    return [(off, min(per, n - off)) for off in range(0, n, per)]


def reg_chunks(pieces) -> list[tuple[int, int]]:
    """Each (address, bytes) piece cut into registrations of at most REG_CHUNK bytes."""
    return [(p + o, min(REG_CHUNK, s - o)) for p, s in pieces for o in range(0, s, REG_CHUNK)]


def meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        return {ln.split(":")[0]: int(ln.split()[1]) << 10 for ln in f}


def smaps(lo: int, hi: int) -> dict[str, int]:
    """kB of Rss, AnonHugePages, ShmemPmdMapped summed over the VMAs meeting [lo, hi)."""
    out, cur = {"vmas": 0, "Rss": 0, "AnonHugePages": 0, "ShmemPmdMapped": 0}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if not head.endswith(":"):  # "start-end perms ..." opens a VMA
                a, b = (int(x, 16) for x in head.split("-"))
                cur = a < hi and b > lo
                out["vmas"] += cur
            elif cur and head[:-1] in out:
                out[head[:-1]] += int(line.split()[1])
    return out


def tmpfile(size: int) -> int:
    fd = os.open(SHM, os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Pool:
    """n bytes at base, one contiguous range; maps, fds and regs: what is left to free."""

    def __init__(self, layout: str, n: int, parts: list[tuple[int, int]]):
        self.layout, self.n, self.parts = layout, n, parts
        self.base, self.fds, self.maps, self.regs = 0, [], [], []

    def create(self, huge: bool) -> None:
        n = self.n
        if self.layout == "private":
            self.base = mmap_(None, n, PROT_RW, MAP_PRIVATE | MAP_ANON)
            self.maps = [(self.base, n)]
            if huge:
                madvise_(self.base, n, MADV_HUGEPAGE)
        elif self.layout == "one":
            self.fds = [tmpfile(n)]
            self.base = mmap_(None, n, PROT_RW, MAP_SHARED, self.fds[0])
            self.maps = [(self.base, n)]
        else:  # one reservation, each piece of it later a segment's mapping (or still reserved)
            self.base = mmap_(None, n, PROT_NONE, MAP_PRIVATE | MAP_ANON | MAP_NORESERVE)
            self.maps = [(self.base + off, size) for off, size in self.parts]
            for off, size in self.parts:
                self.fds.append(tmpfile(size))
                mmap_(self.base + off, size, PROT_RW, MAP_SHARED | MAP_FIXED, self.fds[-1])

    def file_at(self, off: int) -> tuple[int, int]:
        """(fd, offset in that file) of byte off of the range."""
        if self.layout == "one":
            return self.fds[0], off
        i = next(i for i, (o, s) in enumerate(self.parts) if o <= off < o + s)
        return self.fds[i], off - self.parts[i][0]

    def unregister(self, threads: bool = False) -> None:
        regs, self.regs = self.regs, []

        def unreg(p):
            if threads:
                cp.cuda.Device(0).use()
            cp.cuda.runtime.hostUnregister(p)
        raise_first(each(unreg, regs, threads))

    def unmap(self, threads: bool) -> None:
        maps, self.maps = self.maps, []
        raise_first(each(lambda m: munmap_(*m), maps, threads))

    def close(self, threads: bool) -> None:
        fds, self.fds = self.fds, []
        raise_first(each(os.close, fds, threads))

    def free(self) -> None:
        """What is left, after a failure: never raises (a failure is printed)."""
        for step in (self.unregister, lambda: self.unmap(False), lambda: self.close(False)):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the other steps still run
                print(f"  cleanup: {type(e).__name__}: {e}", file=sys.stderr)


def populate(pool: Pool, how: str, notes: list[str]) -> list[float]:
    """Every page of every share from its own thread; each thread's seconds."""
    v, fell_back = view(pool.base, pool.n), []

    def work(part):
        off, size = part
        t = now()
        if how == "populate":
            try:
                madvise_(pool.base + off, size, MADV_POPULATE_WRITE)
                return now() - t
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                fell_back.append(off)
        v[off:off + size:PAGE] = 0
        return now() - t
    times = raise_first(each(work, pool.parts))
    if fell_back:
        notes.append("MADV_POPULATE_WRITE: EINVAL (kernel < 5.14?), touched instead")
    return times


def probes(n: int, parts) -> tuple[np.ndarray, np.ndarray]:
    """Offsets over the range and either side of every share's edge, and a byte for each."""
    offs = {0, n - 1} | {(n - 1) * i // 9 for i in range(1, 9)}
    offs |= {o + d for o, _ in parts[1:] for d in (-1, 0)}
    offs = np.array(sorted(offs), np.int64)
    return offs, ((np.arange(offs.size) * 37 + 11) % 251 + 1).astype(np.uint8)


def verify_host(pool: Pool, offs, vals) -> dict:
    v = view(pool.base, pool.n)
    v[offs] = vals
    out = {"mapping": bool(np.array_equal(v[offs], vals))}
    if pool.fds:  # the same bytes in the files: the mappings are the files' pages
        got = [os.pread(fd, 1, at)[0] for fd, at in (pool.file_at(int(o)) for o in offs)]
        out["file"] = got == vals.tolist()
    return out


def register(pool: Pool, r: dict) -> None:
    """Register the range in chunks of <= 64 GiB from this thread (segments: per segment if
    one registration across them fails); check the device addresses and a kernel's reads."""
    rt = cp.cuda.runtime
    tries = [[(pool.base, pool.n)]]
    if pool.layout == "seg":
        tries.append([(pool.base + o, s) for o, s in pool.parts])
    for i, pieces in enumerate(tries):
        chunks = reg_chunks(pieces)
        t = now()
        try:
            for p, s in chunks:
                rt.hostRegister(p, s, REG_FLAGS)
                pool.regs.append(p)
            r["register_s"] = now() - t
            r["register_chunks"] = len(chunks)
            break
        except Exception as e:
            pool.unregister()
            if i + 1 == len(tries):
                raise
            r["notes"].append(f"one registration across the segments failed "
                              f"({type(e).__name__}: {e}); registering per segment")
    dptr = rt.pointerGetAttributes(pool.base).devicePointer
    r["uva"] = dptr == pool.base
    r["device_contiguous"] = all(rt.pointerGetAttributes(p).devicePointer == dptr + p - pool.base
                                 for p in pool.regs)


def verify_gpu(pool: Pool, offs, vals) -> bool:
    dptr = cp.cuda.runtime.pointerGetAttributes(pool.base).devicePointer
    mem = cp.cuda.UnownedMemory(dptr, pool.n, pool, 0)
    dev = cp.ndarray((pool.n,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
    got = dev[cp.asarray(offs)].get()  # a gather kernel's loads through the mapping
    return bool(np.array_equal(got, vals))


def register_threads(pool: Pool, k: int) -> dict:
    """The range as k chunks (<= 64 GiB each), registered from one thread one after another,
    then from one thread per chunk; both unregistered again (the second also in parallel)."""
    rt = cp.cuda.runtime
    chunks = reg_chunks([(pool.base + o, s) for o, s in shares(pool.n, k)])
    out = {"chunks": len(chunks)}
    try:
        t = now()
        for p, s in chunks:
            rt.hostRegister(p, s, REG_FLAGS)
            pool.regs.append(p)
        out["seq_register_s"] = now() - t
        t = now()
        pool.unregister()
        out["seq_unregister_s"] = now() - t

        def reg(c):
            cp.cuda.Device(0).use()
            t = now()
            rt.hostRegister(c[0], c[1], REG_FLAGS)
            return now() - t
        t = now()
        res = each(reg, chunks)
        out["par_register_s"] = now() - t
        pool.regs += [c[0] for c, x in zip(chunks, res, strict=True)
                      if not isinstance(x, Exception)]
        out["par_thread_s"] = [None if isinstance(x, Exception) else x for x in res]
        errs = [f"chunk {i}: {type(x).__name__}: {x}" for i, x in enumerate(res)
                if isinstance(x, Exception)]
        if errs:
            out["par_errors"] = errs
        t = now()
        pool.unregister(threads=True)
        out["par_unregister_s"] = now() - t
        out["par_faster"] = not errs and out["par_register_s"] < out["seq_register_s"]
    except Exception as e:  # noqa: BLE001 - reported; the variant's teardown still runs
        out["error"] = f"{type(e).__name__}: {e}"
        try:
            pool.unregister()
        except Exception as e2:  # noqa: BLE001
            out["error"] += f"; unregister: {type(e2).__name__}: {e2}"
    return out


def check_room(n: int, shm: bool) -> str:
    """Why G GB (+10 %) does not fit now, or ''."""
    need, avail, msgs = n * 1.1, meminfo()["MemAvailable"], []
    if need > avail:
        msgs.append(f"{need / 1e9:.1f} GB (with 10 % margin) > MemAvailable {avail / 1e9:.1f} GB")
    if shm:
        st = os.statvfs(SHM)
        free = st.f_bavail * st.f_frsize
        if need > free:
            msgs.append(f"{need / 1e9:.1f} GB (with 10 % margin) > {SHM} free {free / 1e9:.1f} GB")
    return "; ".join(msgs)


def run_variant(name: str, n: int, threads: int, gpu: bool) -> dict:
    layout, fill, huge = VARIANTS[name]
    parts = shares(n, threads)
    r = {"variant": name, "gb": n / 1e9, "threads": len(parts), "notes": []}
    room = check_room(n, layout != "private")
    if room:
        r["error"] = f"no room (previous variant not freed?): {room}"
        return r
    shmem0 = meminfo()["Shmem"]
    pool = Pool(layout, n, parts)
    try:
        t0 = now()
        pool.create(huge)
        r["create_s"] = now() - t0
        t = now()
        if fill == "fallocate":
            os.posix_fallocate(pool.fds[0], 0, n)
            r["fallocate_s"] = now() - t
        r["thread_s"] = populate(pool, "populate" if fill == "populate" else "touch", r["notes"])
        r["populate_s"] = now() - t
        r["host_s"] = now() - t0
        s = smaps(pool.base, pool.base + n)
        r.update(rss_gb=s["Rss"] * 1024 / 1e9, anon_huge_gb=s["AnonHugePages"] * 1024 / 1e9,
                 shmem_pmd_gb=s["ShmemPmdMapped"] * 1024 / 1e9, vmas=s["vmas"],
                 resident=s["Rss"] * 1024 >= n, base_2m_aligned=pool.base % HUGE == 0)
        if pool.fds:
            r["file_gb"] = sum(os.fstat(fd).st_blocks for fd in pool.fds) * 512 / 1e9
        offs, vals = probes(n, parts)
        r["verify"] = verify_host(pool, offs, vals)
        if gpu:
            register(pool, r)
            r["verify"]["gpu"] = verify_gpu(pool, offs, vals)
            t = now()
            pool.unregister()
            r["unregister_s"] = now() - t
            if name == "segments-touch":
                r["register_threads"] = register_threads(pool, min(len(parts), 8))
        par = layout == "seg"
        t = now()
        pool.unmap(par)
        r["unmap_s"] = now() - t
        t = now()
        pool.close(par)
        r["close_s"] = now() - t
        r["teardown_s"] = r.get("unregister_s", 0.0) + r["unmap_s"] + r["close_s"]
        r["setup_gbps"] = n / 1e9 / (r["host_s"] + r.get("register_s", 0.0))
    except Exception as e:  # noqa: BLE001 - reported, the next variant still runs
        r["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        pool.free()  # nothing left after a full teardown
    r["shmem_left_gb"] = (meminfo()["Shmem"] - shmem0) / 1e9
    return r


def summary(r: dict) -> str:
    def sec(k):
        return f"{r[k]:6.2f} s" if r.get(k) is not None else "   n/a  "
    if "teardown_s" not in r:
        return f"{r['variant']:<19} FAILED: {r.get('error')}"
    checks = dict(r["verify"], resident=r["resident"])
    if "device_contiguous" in r:
        checks["device_contiguous"] = r["device_contiguous"]
    bad = [k for k, ok in checks.items() if not ok]
    return (f"{r['variant']:<19} create+populate {sec('host_s')}  register {sec('register_s')}  "
            f"teardown {sec('teardown_s')} (unreg {sec('unregister_s').strip()}, unmap "
            f"{r['unmap_s']:.2f} s, close {r['close_s']:.2f} s)  setup {r['setup_gbps']:5.2f} "
            f"GB/s  rss {r['rss_gb']:.2f}/{r['gb']:.2f} GB  "
            f"{'checks ok' if not bad else 'FAILED ' + ','.join(bad)}")


def init_gpu() -> str:
    """Import CuPy and warm the context and the registration path; '' or why not."""
    global cp
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
        cupy.cuda.Device(0).use()
        cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1 << 20))
        p = mmap_(None, HUGE, PROT_RW, MAP_PRIVATE | MAP_ANON)
        try:
            view(p, HUGE)[::PAGE] = 0
            cupy.cuda.runtime.hostRegister(p, HUGE, REG_FLAGS)
            cupy.cuda.runtime.hostUnregister(p)
        finally:
            munmap_(p, HUGE)
    except Exception as e:  # noqa: BLE001 - no CUDA here: the host parts still run
        return f"{type(e).__name__}: {e}"
    cp = cupy
    return ""


def facts() -> dict:
    def read(path):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None
    mem, st = meminfo(), os.statvfs(SHM)
    out = {"kernel": platform.release(), "machine": platform.machine(),
           "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
           "mem_total_gb": mem["MemTotal"] / 1e9, "mem_available_gb": mem["MemAvailable"] / 1e9,
           "dev_shm_gb": st.f_blocks * st.f_frsize / 1e9,
           "dev_shm_free_gb": st.f_bavail * st.f_frsize / 1e9,
           "python": platform.python_version(), "numpy": np.__version__}
    for k in ("enabled", "defrag", "shmem_enabled"):
        out[f"thp_{k}"] = read(f"/sys/kernel/mm/transparent_hugepage/{k}")
    if cp is not None:
        rt = cp.cuda.runtime
        out.update(cupy=cp.__version__, gpu=rt.getDeviceProperties(0)["name"].decode(),
                   driver=rt.driverGetVersion(), cuda_runtime=rt.runtimeGetVersion())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=16.0, help="pool size in GB (1e9 bytes)")
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1),
                    help="threads and segments S (default min(16, cpus))")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: "
                    + ", ".join(VARIANTS))
    ap.add_argument("--json", default=None, help="write all results and machine facts here")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    if not names or any(v not in VARIANTS for v in names):
        ap.error(f"--variants: some of {','.join(VARIANTS)}, got {args.variants!r}")
    if args.gb <= 0 or args.threads < 1:
        ap.error("--gb and --threads must be positive")
    n = -(-int(args.gb * 1e9) // HUGE) * HUGE
    room = check_room(n, any(VARIANTS[v][0] != "private" for v in names))
    if room:
        print(f"probe_shm_setup: refusing: {room}", file=sys.stderr)
        return 2
    why = init_gpu()
    if why:
        print(f"note: no GPU ({why}): CUDA registration and device checks skipped")
    info = facts()
    print(f"{n / 1e9:.2f} GB ({n} B), {args.threads} threads; kernel {info['kernel']}, "
          f"{info['cpus']} cpus, THP {info['thp_enabled']}, shmem THP "
          f"{info['thp_shmem_enabled']}" + (f"; {info['gpu']}" if cp is not None else ""))
    shm0, results = set(os.listdir(SHM)), []
    for i, name in enumerate(names):
        if i:
            time.sleep(1)
        r = run_variant(name, n, args.threads, cp is not None)
        results.append(r)
        print(summary(r), flush=True)
        for note in r["notes"]:
            print(f"  note: {note}")
        if "register_threads" in r:
            rt = r["register_threads"]
            if "error" in rt or "par_register_s" not in rt:
                print(f"  threaded registration: error {rt.get('error')}")
            else:
                print(f"  {rt['chunks']} chunks registered: one thread {rt['seq_register_s']:.2f}"
                      f" s, {rt['chunks']} threads {rt['par_register_s']:.2f} s "
                      f"({'faster' if rt['par_faster'] else 'not faster'}); unregistered "
                      f"{rt['seq_unregister_s']:.2f} s / {rt['par_unregister_s']:.2f} s"
                      + (f"; errors {rt['par_errors']}" if "par_errors" in rt else ""))
        if abs(r["shmem_left_gb"]) > 0.01 * r["gb"]:
            print(f"  warning: Shmem changed by {r['shmem_left_gb']:.2f} GB over the variant")
        if args.json:  # after each variant: partial results survive a crash
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "bytes": n, "facts": info, "no_gpu": why or None,
                           "results": results}, f, indent=1, default=str)
    left = sorted(set(os.listdir(SHM)) - shm0)
    if left:
        print(f"warning: new entries in {SHM}: {left}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
