"""A shared pool's memory: one address range over several shared-memory files.

Threads that first-touch pages of ONE tmpfs file contend on that file's locks (its page cache
and block accounting), and the file's pages are freed by one thread when it goes: on the H200
box a 64 GB pool in one ``/dev/shm`` file took 16.76 s to create with 16 threads (private
memory: 2.98 s) and 8.74 s to tear down; in 16 segments 5.33 s and 3.59 s
(``benchmarks/NOTES.md``, "Shared pools in segments"). So a shared pool is cut into
*segments*, each its own file, mapped one after another (``MAP_FIXED`` into one reserved range,
so the rows stay contiguous), touched by the first-touch threads and freed in parallel. Large
segments start on 2 MiB boundaries, so a tmpfs that gives huge pages maps them huge.

Segment 0 is the named file (``<directory()>/<name>``: a header page, then its rows; the
directory is ``/dev/shm`` unless ``HISPARSE_CUPY_SHM_DIR`` names another); the others are
unnamed (``O_TMPFILE``) files that only the creator's descriptors keep: a creator killed at any
point leaves nothing but what it had linked, and it links only segment 0, once set up. Another
process opens them through ``/proc/<creator pid>/fd/<fd>`` (the header lists each one's
descriptor, size, device and inode, checked before the open), so attaching needs the creator
alive and visible (the same PID namespace, the same user); ``segments=1`` makes a one-file pool
that any process sharing the directory can attach.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import re
import stat
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_PAGE, _HUGE = mmap.PAGESIZE, 2 << 20  # a huge page: segments start on one where they can
_PROT_RW, _MAP_FIXED = mmap.PROT_READ | mmap.PROT_WRITE, 0x10  # MAP_FIXED: Linux's
_MAP_SHARED, _MAP_PRIVATE, _MAP_ANON = mmap.MAP_SHARED, mmap.MAP_PRIVATE, mmap.MAP_ANONYMOUS
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
MAX_SEGMENTS = 64
_OCTAL = re.compile(r"\\([0-7]{3})")  # /proc/mounts' escapes
_libc = None


def _c():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = lib
    return _libc


def _check(ok: bool, what: str) -> None:
    if not ok:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _munmap(addr: int, nbytes: int) -> None:
    _check(_c().munmap(addr, nbytes) == 0, "munmap")


def directory() -> str:
    """Where shared pools live: ``HISPARSE_CUPY_SHM_DIR``, else ``/dev/shm``. Any tmpfs of the
    node will do; one mounted ``huge=always`` (or ``within_size``) gives the pools 2 MiB pages
    (512 times fewer pages to fault, pin and free than ``/dev/shm``'s 4 KiB ones).
    Every process of a pool must see the same one: creators and attachers look names up here.
    A directory on another file system is refused (its files would be written back to disk)."""
    env = os.environ.get("HISPARSE_CUPY_SHM_DIR")
    d = os.path.abspath(env) if env else "/dev/shm"  # absolute: unlinked from anywhere later
    what = f"HISPARSE_CUPY_SHM_DIR {env!r}" if env else "/dev/shm (HISPARSE_CUPY_SHM_DIR unset)"
    if not os.path.isdir(d):
        raise FileNotFoundError(f"{what} is not a directory")
    if _fs_magic(d) not in (None, _TMPFS_MAGIC):
        raise OSError(errno.EINVAL, f"{what} is on {mount(d)[1] or 'a file system'}, not "
                      f"tmpfs: a shared pool's files there would be written back to disk; "
                      f"set HISPARSE_CUPY_SHM_DIR to a directory of a tmpfs (e.g. one mounted "
                      f"huge=always)")
    return d


_TMPFS_MAGIC = 0x01021994


def _fs_magic(d: str) -> int | None:
    """statfs(2)'s ``f_type`` of ``d`` (the file system the path is really on, mounts over
    mounts included); None where it cannot be read."""
    fn = getattr(_c(), "statfs", None)  # None: not in this libc
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type first (a long), < 128 B
    if fn(os.fsencode(d), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def mount(where: str, mounts: str | None = None) -> tuple[str, str, str]:
    """``(mount point, file system, options)`` of the mount holding ``where`` (the longest
    mount point above it in ``/proc/mounts``, or the ``mounts`` text given); ``("", "", "")``
    where Linux does not say. Options only: the tmpfs check reads statfs, not this."""
    if mounts is None:
        try:
            with open("/proc/mounts") as f:
                mounts = f.read()
        except OSError:
            return "", "", ""
        where = os.path.realpath(where)
    best = ("", "", "")
    for line in mounts.splitlines():
        part = line.split()
        if len(part) < 4:
            continue
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), part[1])  # \040: a space
        if (where == point or where.startswith(point.rstrip("/") + "/")) and \
                len(point) >= len(best[0]):
            best = (point, part[2], part[3])
    return best


def shared_pools() -> str:
    """One line on where shared pools go and what pages they get there (``info`` prints it)."""
    try:
        d = directory()
    except OSError as e:  # no such directory, not a tmpfs
        return f"shared pools: {e.strerror if e.strerror else e}"
    point, fs, opts = mount(d)
    st = os.statvfs(d)
    huge = next((o.split("=", 1)[1] for o in opts.split(",") if o.startswith("huge=")),
                "never" if fs == "tmpfs" else "unknown")
    try:  # the node's override: deny or force every tmpfs
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            node = next((w[1:-1] for w in f.read().split() if w.startswith("[")), "")
    except OSError:
        node = ""
    # advise: the pool asks for huge pages (MADV_HUGEPAGE) and gets them
    big = node == "force" or (node != "deny" and huge in ("always", "within_size", "advise"))
    pages = "2 MiB pages" if big else "page size unknown" if huge == "unknown" else \
        "4 KiB pages; a tmpfs mounted huge=always, named by HISPARSE_CUPY_SHM_DIR, gives 2 MiB"
    if node in ("deny", "force"):
        huge = f"{huge}, shmem_enabled {node}"
    return (f"shared pools in {d} ({fs or 'unknown file system'} at {point or '?'}, "
            f"{st.f_bavail * st.f_frsize / 1e9:.1f} GB free, huge={huge}: {pages})")


def path(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ValueError(f"shared_name must be a non-empty name without '/', got {name!r}")
    return os.path.join(directory(), name)


def node_id() -> str:
    """This running kernel's boot id ("" where Linux does not give one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def identity(fd: int) -> tuple[str, int, int]:
    """``(node_id(), st_dev, st_ino)`` of an open file: equal only for the same file under the
    same running kernel (a pool's, told from another of its name, here or on another node)."""
    st = os.fstat(fd)
    return node_id(), int(st.st_dev), int(st.st_ino)


def unlink(p: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(p)


def unlink_own(p: str, pid: int, ident: tuple) -> None:
    """Unlink name ``p`` if it still names the pool ``ident`` (:func:`identity`) and this is
    the process that linked it (``pid``): a child forked from the creator that exits, or a
    creator whose name was removed and taken by another pool, leaves the name alone."""
    if os.getpid() != pid:
        return
    try:
        st = os.stat(p, follow_symlinks=False)
    except FileNotFoundError:
        return
    if (int(st.st_dev), int(st.st_ino)) == tuple(ident[1:]):
        unlink(p)


def check_room(nbytes: int, where: str | None = None) -> None:
    """Refuse a pool the machine cannot hold before touching it: a touch past the memory
    wakes the OOM killer, past the end of a shared pool's tmpfs (``where``) it is a SIGBUS."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(v.split()[1]) << 10 for v in f if v.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):  # not Linux: mmap or the touch will tell
        avail = nbytes
    if nbytes > avail:
        raise MemoryError(f"a host pool of {nbytes / 1e9:.1f} GB is more than the "
                          f"{avail / 1e9:.1f} GB of memory available (MemAvailable)")
    st = None if where is None else os.statvfs(where)  # a shared pool's directory
    if st is not None and nbytes > st.f_bavail * st.f_frsize:
        raise OSError(errno.ENOSPC, f"a shared host pool of {nbytes / 1e9:.1f} GB does not fit "
                      f"in {where} ({st.f_bavail * st.f_frsize / 1e9:.1f} GB free): enlarge "
                      f"it (e.g. docker --shm-size) or use a private pool")


def _round(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


class _Rows:
    """``__array_interface__`` of the mapped range: the base of every NumPy view of it, so
    the range is unmapped only once the mapping is closed and no view is left."""

    def __init__(self, addr: int, nbytes: int):
        self.__array_interface__ = {"data": (addr, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}


def sizes(nbytes: int, header: int, n: int) -> list[int]:
    """File sizes of at most ``n`` segments holding ``header`` bytes (segment 0) and ``nbytes``
    of rows; every segment but the last a page multiple, so the next one maps right after it,
    and a huge-page multiple where segments are that large (each then maps huge-page aligned)."""
    n = max(1, min(n, MAX_SEGMENTS, -(-nbytes // _PAGE)))
    per = -(-(header + nbytes) // n)
    unit = _HUGE if per >= _HUGE else _PAGE
    per = -(-per // unit) * unit
    out, left = [], header + nbytes
    while left > 0:
        out.append(min(per, left))
        left -= out[-1]
    return out


def aligned(got: int, span: int, pad: int) -> tuple[int, list[tuple[int, int]]]:
    """In a reservation of ``span + pad`` bytes at ``got``: the ``span`` bytes' start (on a
    huge page where ``pad`` is one) and the ``(address, bytes)`` left before and after it."""
    base = -(-got // _HUGE) * _HUGE if pad else got
    return base, [(a, n) for a, n in ((got, base - got), (base + span, got + pad - base)) if n]


class Segments:
    """Files mapped one after another from :attr:`addr` (``total`` bytes): :meth:`array` views
    them. Once :meth:`close` was called and no view is left, the range is unmapped and the
    descriptors held are closed (the last reference to an unnamed segment frees its pages):
    in up to 32 threads when that happens inside :meth:`close`, in the collecting thread
    otherwise (a collection may run anywhere: no threads started there); never at the
    interpreter's exit (the kernel tears down, and a thread still reading a view reads)."""

    def __init__(self, fds: list[int], sizes: list[int], keep_fds: bool):
        self.sizes, self.total = list(sizes), sum(sizes)
        self.fds = list(fds) if keep_fds else []
        span = sum(_round(n) for n in sizes)
        pad = _HUGE if span >= _HUGE else 0  # a huge-page aligned start: tmpfs maps it huge
        got = _c().mmap(None, span + pad, 0, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE, -1, 0)
        _check(got not in (None, ctypes.c_void_p(-1).value), "mmap (reserve)")
        base, slop = aligned(got, span, pad)
        try:
            for a, n in slop:
                _munmap(a, n)
        except BaseException:  # (munmap can fail splitting a mapping: vm.max_map_count)
            _munmap(got, span + pad)  # the whole reservation: no split, what is left of it
            raise
        self.addr, done, off = base, [], 0
        try:
            for fd, n in zip(fds, sizes, strict=True):
                got = _c().mmap(base + off, _round(n), _PROT_RW, _MAP_SHARED | _MAP_FIXED, fd, 0)
                _check(got == base + off, "mmap (segment)")
                done.append((got, _round(n)))
                off += _round(n)
        except BaseException:
            _munmap(base, span)
            raise
        self._rows = _Rows(base, self.total)
        self._state = {"closing": False}
        self._gone = weakref.finalize(self._rows, _unmap_all, done, self.fds, self._state)
        self._gone.atexit = False

    def array(self, offset: int, nbytes: int) -> np.ndarray:
        return np.asarray(self._rows)[offset: offset + nbytes]

    def advise(self, advice: int) -> bool:
        return _c().madvise(self.addr, sum(_round(n) for n in self.sizes), advice) == 0

    def close(self) -> None:
        """Drop this object's reference: the range goes now if no view of it is left."""
        self._state["closing"] = True
        try:
            self._rows = None
        finally:
            self._state["closing"] = False


def _unmap_all(parts: list, fds: list[int], state: dict) -> None:
    done = [False] * len(parts)

    def one(i: int) -> None:
        if done[i]:
            return
        done[i] = True
        try:
            _munmap(*parts[i])
        finally:
            if i < len(fds):
                os.close(fds[i])

    if state["closing"] and len(parts) > 1:  # inside close(): a known place to start threads
        try:
            with ThreadPoolExecutor(min(len(parts), 32), thread_name_prefix="hs-unmap") as ex:
                for f in [ex.submit(one, i) for i in range(len(parts))]:
                    f.result()
        except RuntimeError:  # no new threads: the rest below
            pass
    for i in range(len(parts)):
        with contextlib.suppress(OSError):
            one(i)


def create(first_fd: int, directory: str, sizes_: list[int]) -> Segments:
    """Segments over ``first_fd`` (segment 0, sized here) and new unnamed files in
    ``directory``; the creator keeps every descriptor (another process opens them)."""
    fds = [first_fd]
    try:
        for _ in sizes_[1:]:
            fds.append(os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600))
        for fd, n in zip(fds, sizes_, strict=True):
            os.ftruncate(fd, _round(n))
        return Segments(fds, sizes_, keep_fds=True)
    except BaseException:
        for fd in fds[1:]:
            os.close(fd)
        raise


def table(seg: Segments) -> np.ndarray:
    """The header's words from byte 32: segments, creator pid, two reserved zeros, then per
    segment ``(fd, bytes, st_dev, st_ino)``, uint64."""
    rows = [(fd, n, os.fstat(fd).st_dev, os.fstat(fd).st_ino)
            for fd, n in zip(seg.fds, seg.sizes, strict=True)]
    return np.array([len(rows), os.getpid(), 0, 0] + [v for r in rows for v in r], np.uint64)


def attach(first_fd: int, head: np.ndarray, path: str) -> Segments:
    """The segments a header (``head``: uint64 words from byte 32, :func:`table`'s) lists,
    segment 0 from ``first_fd``, the others opened through the creator's descriptors, each
    checked (a regular file of the header's device, inode and size) before it is opened."""
    n, pid = int(head[0]), int(head[1])
    size0 = os.fstat(first_fd).st_size
    if n <= 1:
        return Segments([first_fd], [size0], keep_fds=False)
    if n > MAX_SEGMENTS:
        raise ValueError(f"{path}: its header lists {n} segments (at most {MAX_SEGMENTS})")
    ent = head[4: 4 + 4 * n].reshape(n, 4).astype(np.int64)
    if (ent[:, 1] <= 0).any() or (ent[:-1, 1] % _PAGE).any() or size0 < ent[0, 1]:
        raise ValueError(f"{path}: its header's segment sizes are not a pool's")
    fds = [first_fd]
    try:
        for k in range(1, n):
            src = f"/proc/{pid}/fd/{ent[k, 0]}"
            why = None
            try:
                st = os.stat(src)  # (follows the link: the file, not opened yet)
                ok = stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == \
                    (ent[k, 2], ent[k, 3]) and st.st_size >= ent[k, 1]
                if ok:
                    fds.append(os.open(src, os.O_RDWR | os.O_NOCTTY))
                    st = os.fstat(fds[-1])
                    ok = (st.st_dev, st.st_ino) == (ent[k, 2], ent[k, 3])
            except OSError as e:
                why = e.strerror
            if why is not None:
                raise FileNotFoundError(
                    f"{path} is a pool of {n} segments; segment {k} ({src}) cannot be opened "
                    f"({why}): its creator (pid {pid}) must be alive and visible to this "
                    f"process (same PID namespace and user), or create it with segments=1")
            if not ok:
                raise ValueError(f"{path}: segment {k} ({src}) is not the file its header "
                                 f"names (its creator gone and the pid reused?)")
        return Segments(fds, [int(v) for v in ent[:, 1]], keep_fds=False)
    finally:
        for fd in fds[1:]:
            os.close(fd)  # the mappings keep the files
