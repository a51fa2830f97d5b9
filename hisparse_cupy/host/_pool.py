"""Pinned, device-mapped host memory for the full KV cache.

Three ways to get a :class:`HostKVPool`:

- ``HostKVPool(n_layers, n_rows, row_bytes)``: anonymous memory first touched from several
  threads (transparent huge pages where the kernel gives them), registered pinned and mapped
  in chunks of at most ``_REGISTER_CHUNK`` bytes (one ``cudaHostRegister`` of 512 GiB or more
  fails on the R580 drivers), 10 times faster at 64 GB than ``alloc="cuda"``, one
  ``cudaHostAlloc`` (``benchmarks/bench_pool_setup.py``);
- ``HostKVPool(..., shared_name="kv0")`` and ``HostKVPool.attach("kv0")``: POSIX shared
  memory (``/dev/shm/<name>`` or ``host_shm.directory()``, mode 0600, and unnamed segments;
  attaching needs the creator alive in the same PID namespace unless ``segments=1``), which
  processes on a host map, each registering it for its GPUs: tensor-parallel ranks holding
  the same (MLA) KV keep one host copy (and a same-node prefill copies into it). The
  creator sets it up unnamed (``O_TMPFILE``) and links the name once it is touched and
  registered: a creator killed on the way leaves nothing in ``/dev/shm``. It owns the name and
  unlinks it at :meth:`close` (or at its exit); a crashed attacher leaves nothing. A header
  before the rows records the shape: an attach with other sizes names both shapes;
- ``HostKVPool.from_buffer(array)``: host memory the engine allocated (a NumPy view of it),
  registered pinned and mapped in place; :meth:`close` unregisters it and frees nothing.

Large pools print a line before and after their setup (stderr, or the package's logger where
configured). A pool dropped without :meth:`close` is released later, never by the collector,
which may run while a stream captures a CUDA graph: at the next pool's setup or close (one
device synchronization then), :meth:`HostKVPool.release_collected`, or the exit. A release
synchronizes every device this process has a context on (a pool is registered for each): in
a process driving several GPUs, close pools between steps, not while another thread captures
a graph.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import mmap
import os
import stat
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import cupy
import numpy as np

from .. import _checks
from .._device import Ptr, require_gpu
from .._log import log
from . import _shm as host_shm

_REGISTER_PORTABLE, _REGISTER_MAPPED = 1, 2  # cudaHostRegisterPortable, cudaHostRegisterMapped
_HEADER = 4096  # bytes before the rows of a shared pool (page aligned rows)
_MAGIC = np.uint64(0x48535043504F4F4C)  # "HSPCPOOL"
_PAGE = mmap.PAGESIZE
_REGISTER_CHUNK = 64 << 30  # bytes per cudaHostRegister call at most (a page multiple)
_TOUCH_SPAN = 64 << 20  # bytes per first-touch thread at least (smaller pools use fewer threads)
_SAY_BYTES = 4 << 30  # pools this large say how long their setup took
_ALLOCS = ("mmap", "cuda")


def _register(ptr: int, nbytes: int, portable: bool = True) -> int:
    """Pin and map ``nbytes`` at ``ptr`` (for every device if ``portable``); its device address.
    With :func:`_unregister`, a registered pool's only CUDA calls (the CPU tests stub both)."""
    rt = cupy.cuda.runtime
    rt.hostRegister(ptr, nbytes, (_REGISTER_PORTABLE if portable else 0) | _REGISTER_MAPPED)
    try:
        return rt.pointerGetAttributes(ptr).devicePointer
    except BaseException:  # not in the caller's list of chunks yet: undone here
        rt.hostUnregister(ptr)
        raise


def _unregister(ptr: int) -> None:
    cupy.cuda.runtime.hostUnregister(ptr)


def _synchronize() -> None:
    """Wait for the work of every device this process has a context on: a pool is registered
    for each (portable), and the calling thread's current device need not be the one whose
    kernels read it."""
    for d in _devices_in_use():
        with cupy.cuda.Device(d):
            cupy.cuda.runtime.deviceSynchronize()


def _devices_in_use() -> list[int]:
    """The devices whose primary context is active (the current one where the driver cannot
    say): synchronizing another would create its context."""
    try:
        from cuda.bindings import driver

        out = []
        for d in range(cupy.cuda.runtime.getDeviceCount()):
            err, dev = driver.cuDeviceGet(d)
            err2, _, active = driver.cuDevicePrimaryCtxGetState(dev)
            if int(err) or int(err2):
                raise RuntimeError(f"device {d}: {err!r} {err2!r}")
            if active:
                out.append(d)
        return out or [cupy.cuda.runtime.getDevice()]
    except Exception:  # no bindings, or a driver that will not say: the current device
        return [cupy.cuda.runtime.getDevice()]


def default_threads() -> int:
    """First-touch threads by default: the CPUs this process may run on, at most 32."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, 32))


def _chunks(ptr: int, nbytes: int) -> list[tuple[int, int]]:
    """(address, bytes) pieces of at most ``_REGISTER_CHUNK`` bytes tiling ``[ptr, ptr +
    nbytes)``, cut on page boundaries (two registrations never share a page)."""
    limit = _REGISTER_CHUNK
    if limit < _PAGE or limit % _PAGE:
        raise ValueError(f"_REGISTER_CHUNK must be a positive multiple of the page size "
                         f"({_PAGE}), got {limit}")
    out, p, end = [], ptr, ptr + nbytes
    edge = ptr - ptr % _PAGE + limit
    while p < end:
        q = min(edge, end)
        out.append((p, q - p))
        p, edge = q, edge + limit
    return out


def _unregister_all(ptrs: list[int], quiet: bool = False) -> None:
    """Unregister every chunk, each once, all if one fails (the first error raised after)."""
    err = None
    for p in ptrs:
        try:
            _unregister(p)
        except Exception as e:  # noqa: BLE001 - the others still get unregistered
            err = err or e  # quiet: cleaning up after another error
    if err is not None and not quiet:
        raise err


def _register_all(ptr: int, nbytes: int, portable: bool = True) -> tuple[int, list[int]]:
    """Register ``[ptr, ptr + nbytes)`` in :func:`_chunks`: (device address of ``ptr``, the
    chunks' addresses). The chunks must follow each other in device addresses too (under UVA
    they equal the host's); a failing or misplaced chunk unregisters the earlier ones."""
    done, dptr = [], None
    try:
        for i, (p, n) in enumerate(_chunks(ptr, nbytes)):
            d = _register(p, n) if portable else _register(p, n, portable=False)
            done.append(p)
            if dptr is None:
                dptr = d
            elif d != dptr + (p - ptr):
                raise RuntimeError(
                    f"host pool registration chunk {i} (byte {p - ptr}) got device address "
                    f"{d:#x}, not {dptr + (p - ptr):#x}: the chunks are not contiguous in the "
                    f"device's address space (expected under UVA: registered at the host's)")
    except BaseException:
        _unregister_all(done, quiet=True)
        raise
    return dptr, done


def _first_touch(rows: np.ndarray, threads: int) -> None:
    """Write a zero into every OS page of ``rows`` (a uint8 view of a new mapping: its pages
    read as zeros) from up to ``threads`` threads of ``_TOUCH_SPAN`` bytes or more, so that the
    kernel allocates the pages in parallel, not in one thread inside ``cudaHostRegister``
    (NumPy's strided fill releases the GIL; no slower than one ``MADV_POPULATE_WRITE`` a thread
    on the H200 box: ``benchmarks/NOTES.md``). Module level: a test replaces it."""
    n = rows.size
    k = max(1, min(threads, -(-n // _TOUCH_SPAN)))
    per = -(-n // k)
    step = -(-per // _PAGE) * _PAGE  # whole pages per thread

    def touch(a: int) -> None:
        rows[a: a + step: _PAGE] = 0

    starts = range(0, n, step)
    if len(starts) == 1:
        touch(0)
    else:
        with ThreadPoolExecutor(len(starts), thread_name_prefix="hs-touch") as ex:
            for f in [ex.submit(touch, a) for a in starts]:
                f.result()
    rows[n - 1] = 0  # the last page, should rows not start on a page


def _advise(mm: mmap.mmap, what: str) -> bool:
    """``madvise`` the whole mapping; False where the kernel or Python lacks the advice."""
    try:
        mm.madvise(getattr(mmap, what))
        return True
    except (AttributeError, OSError, ValueError):
        return False


def _say(msg: str) -> None:
    """A line about a large pool: to the package's logger, or stderr if it is unconfigured."""
    if log.isEnabledFor(logging.INFO):
        log.info(msg)
    elif log.level == logging.NOTSET and not log.handlers:
        print(f"hisparse_cupy: {msg}", file=sys.stderr, flush=True)


# Releases of pools collected unclosed. The collector may run at any moment, on any thread,
# also while a stream captures a CUDA graph, where a device synchronization or an unregister
# would invalidate the capture (and, if it failed, leave the memory unregistered under queued
# reads). So a collected pool's release waits here: for the next pool's setup or close (which
# then synchronize the device once), HostKVPool.release_collected(), or the exit. A shared
# pool's name is unlinked by its own finalizer when collected (no CUDA call).
_collected: list = []
_exiting = False


def _finalizer(pool, release) -> weakref.finalize:
    """Set up ``release`` (not holding ``pool``): :meth:`HostKVPool.close` detaches it and runs
    it after a device synchronization; if ``pool`` is collected unclosed, it is queued in
    ``_collected`` (run there at exit). A registration must not outlive its mapping (a later
    one may get its addresses)."""
    return weakref.finalize(pool, _on_collect, release)


def _on_collect(release) -> None:
    _collected.append(release)  # (atomic: the collector needs no lock)
    if _exiting:
        _release_collected()


def _release_collected(quiet: bool = False) -> int:
    """Run the queued releases after one device synchronization (a pool collected after it
    waits for the next); returns how many ran. A failing release is logged and the others
    still run. If the synchronization fails (a stream capturing, a sticky error), every
    release taken goes back in the queue (its memory stays registered and mapped) and the
    error is raised, or with ``quiet`` logged (0 returned)."""
    taken = []
    while _collected:
        with contextlib.suppress(IndexError):  # (another thread took the last one)
            taken.append(_collected.pop())
    if not taken:
        return 0
    try:
        _synchronize()
    except BaseException as e:
        _collected.extend(taken)
        if not quiet or not isinstance(e, Exception):
            raise
        log.warning("%d host pool(s) collected unclosed stay registered: the device "
                    "synchronization before their release failed: %r", len(taken), e)
        return 0
    for i, release in enumerate(taken):
        try:
            release()
        except Exception as e:  # noqa: BLE001 - the rest must still be released
            log.warning("releasing a host pool collected unclosed failed: %r", e)
        except BaseException:
            _collected.extend(taken[i + 1:])
            raise
    return len(taken)


@atexit.register
def _at_exit() -> None:
    global _exiting
    _exiting = True  # finalizers that run after this release at once
    with contextlib.suppress(Exception):  # (the CUDA context may be gone already)
        _release_collected()


def _close_map(mm: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view is alive: unmapped when the last one goes
        mm.close()


class HostKVPool:
    """Host rows for ``n_layers`` layers, pinned and mapped into the GPU's address space.

    Layer ``l`` is one contiguous block of ``n_rows`` rows of ``row_bytes`` (a multiple of 16)
    bytes, page aligned; kernels read it through :meth:`device_ptr` (zero-copy loads).

    Parameters
    ----------
    n_layers, n_rows, row_bytes : int
    portable : bool
        Map the memory for every device, default True (a shared pool: always).
    shared_name : str, optional
        Create the pool as the shared-memory file ``<host_shm.directory()>/<shared_name>`` (0600)
        that other processes :meth:`attach`, named once set up; ``FileExistsError`` if taken.
    alloc : "mmap" (the default, the only kind of shared pool) or "cuda" (a private pool)
        Memory mapped, first touched in parallel and registered in chunks, or one
        ``cudaHostAlloc``.
    threads : int, optional
        First-touch threads (default :func:`default_threads`: the usable CPUs, at most 32).
    huge_pages : bool
        Ask for transparent huge pages (``MADV_HUGEPAGE``; default True; where offered).
    segments : int, optional
        A shared pool's files (default ``threads``; :mod:`hisparse_cupy.host._shm`): attaching
        needs its creator alive in the same PID namespace unless ``segments=1``.

    ``segments``, ``identity``: a shared pool's files, and its named file's ``(boot id, device,
    inode)`` (:func:`host_shm.identity`; :meth:`attach` may ask for it); None for a private pool.
    ``chunk_edges``: byte offsets from row 0 of layer 0 where another registration starts (a
    ``cudaMemcpy`` may not span two; kernels' loads and stores may).
    ``timings``: seconds of the setup (``setup_s``, and ``touch_s``, ``register_s``) and, after
    :meth:`close`, of the teardown (``teardown_s``, ``unregister_s``). :meth:`close` (or
    ``with``) releases the memory after synchronizing the device.
    """

    segments = identity = None

    def __init__(self, n_layers: int, n_rows: int, row_bytes: int, *, portable: bool = True,
                 shared_name: str | None = None, alloc: str | None = None,
                 threads: int | None = None, huge_pages: bool = True,
                 segments: int | None = None):
        t0 = time.perf_counter()
        alloc = "mmap" if alloc is None else alloc
        if alloc not in _ALLOCS or (alloc == "cuda" and shared_name is not None):
            raise ValueError(f"alloc must be 'mmap' or 'cuda' (a private pool), got {alloc!r}")
        threads = default_threads() if threads is None else _checks.integer("threads", threads, 1)
        if not isinstance(huge_pages, bool):
            raise TypeError(f"huge_pages must be True or False, got {huge_pages!r}")
        path = None if shared_name is None else host_shm.path(shared_name)
        if segments is not None and shared_name is None:
            raise ValueError(f"segments is a shared pool's (shared_name=...), got {segments!r}")
        segments = threads if segments is None else \
            _checks.integer("segments", segments, 1, host_shm.MAX_SEGMENTS)
        self._shape(n_layers, n_rows, row_bytes)
        nbytes = self.n_layers * self.layer_bytes
        self.name, self.owner, self.timings = None, False, {}
        with self._closed_on_error():
            if alloc == "cuda":
                rt = cupy.cuda.runtime
                flags = rt.hostAllocMapped | (rt.hostAllocPortable if portable else 0)
                self._mem = cupy.cuda.PinnedMemory(nbytes, flags)
                self._dptr = rt.pointerGetAttributes(self._mem.ptr).devicePointer
                held = [self._mem]  # freed (cudaFreeHost, which synchronizes) by the release
                self._release, self.chunk_edges = _finalizer(self, held.clear), ()
                self._host = np.ndarray((self.n_layers, self.n_rows, self.row_bytes), np.uint8,
                                        buffer=cupy.cuda.PinnedMemoryPointer(self._mem, 0))
            elif path is None:
                host_shm.check_room(nbytes)
                mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                # a fork would copy pinned private pages: a child does not see it (as cudaHostAlloc)
                _advise(mm, "MADV_DONTFORK")
                self._setup(lambda: np.frombuffer(mm, np.uint8, nbytes), lambda: _close_map(mm),
                            huge_pages and _advise(mm, "MADV_HUGEPAGE"), threads=threads,
                            portable=portable)
            else:
                self._create_shared(path, shared_name, nbytes, threads, huge_pages, segments)
            self.timings["setup_s"] = time.perf_counter() - t0
            self._check_alignment()

    def _create_shared(self, path: str, name: str, nbytes: int, threads: int,
                       huge: bool, segments: int) -> None:
        taken = (f"a host pool named {name!r} already exists ({path}); attach to it or pick "
                 f"another name")
        if os.path.lexists(path):  # before the setup; the link at its end is the real check
            raise FileExistsError(taken)
        where = os.path.dirname(path)
        host_shm.check_room(_HEADER + nbytes, where)
        try:  # unnamed until set up: a creator killed before that leaves no name behind
            fd, named = os.open(where, os.O_TMPFILE | os.O_RDWR, 0o600), False
        except (AttributeError, OSError):  # no O_TMPFILE: the name exists during the setup
            try:
                fd, named = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600), True
            except FileExistsError:
                raise FileExistsError(taken) from None

        published = []

        def publish() -> None:
            d = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
            try:  # linkat(AT_SYMLINK_FOLLOW) of the unnamed file, atomic: fails if taken
                os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=d, follow_symlinks=True)
                published.append(True)
            except FileExistsError:
                raise FileExistsError(taken) from None
            finally:
                os.close(d)

        # the creator owns the name: unlink it at close, or at exit if never closed (this
        # process only, and only while the name is still this pool's)
        ident = host_shm.identity(fd)
        unlink = weakref.finalize(self, host_shm.unlink_own, path, os.getpid(), ident)
        seg = None
        try:
            seg = host_shm.create(fd, where,
                                  host_shm.sizes(nbytes, _HEADER, 1 if named else segments))
            head = np.concatenate([np.array([self.n_layers, self.n_rows, self.row_bytes],
                                            np.uint64), host_shm.table(seg)])
            os.pwrite(fd, head.tobytes(), 8)
            os.pwrite(fd, _MAGIC.tobytes(), 0)  # last: an attacher seeing it sees the rest
            self._setup(lambda: seg.array(_HEADER, nbytes), seg.close,
                        huge and seg.advise(mmap.MADV_HUGEPAGE), threads=threads, portable=True,
                        publish=None if named else publish, on_close=unlink)
        except BaseException:
            unlink.detach()  # the name, if any, is someone else's (or ours, unlinked here)
            if named or published:
                host_shm.unlink(path)
            if seg is None:
                os.close(fd)
            else:
                seg.close()
            raise
        self.name, self.owner, self.segments = name, True, len(seg.sizes)
        self.identity = ident

    @classmethod
    def attach(cls, name: str, n_layers: int | None = None, n_rows: int | None = None,
               row_bytes: int | None = None, identity=None) -> HostKVPool:
        """Map the shared pool ``name`` created by another process (or this one) and register
        it pinned and mapped for this process's devices. Sizes given must equal the creator's.
        ``FileNotFoundError`` if it is gone, or if its segments cannot be opened (its creator
        gone, or in another PID namespace: create it with ``segments=1``); closing an
        attached pool never unlinks it. ``identity``: the pool's (its creator's
        :attr:`identity`): ``FileNotFoundError`` if the name is another pool's now."""
        t0 = time.perf_counter()
        path = host_shm.path(name)
        try:  # the name itself, not where a link would lead
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise FileNotFoundError(f"no host pool named {name!r} ({path}): its creator closed "
                                    f"it or never made it") from None
        except OSError as e:
            if e.errno != errno.ELOOP:  # (permissions, descriptors: as they are)
                raise
            raise ValueError(f"{path} is not a host pool file (a symbolic link)") from None
        self = cls.__new__(cls)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise ValueError(f"{path} is not a host pool file of this user (a regular file "
                                 f"owned by uid {os.geteuid()}; a creator makes it so)")
            self.identity = host_shm.identity(fd)
            if identity is not None and list(identity) != list(self.identity):
                raise FileNotFoundError(f"host pool {name!r} is another pool than the one asked "
                                        f"for (made anew under that name, or on another node)")
            head = np.frombuffer(os.pread(fd, _HEADER, 0).ljust(_HEADER, b"\0"), np.uint64)
            magic, shape = head[0], tuple(int(v) for v in head[1:4])
            if magic != _MAGIC:
                raise ValueError(f"{path} is not a hisparse_cupy host pool")
            want = (n_layers, n_rows, row_bytes)
            if any(w is not None and w != g for w, g in zip(want, shape, strict=True)):
                raise ValueError(f"host pool {name!r} holds (n_layers, n_rows, row_bytes) = "
                                 f"{shape}, not {want}")
            self._shape(*shape)
            nbytes = self.n_layers * self.layer_bytes
            seg = host_shm.attach(fd, head[4:], path)
        finally:
            os.close(fd)  # the mappings keep the files
        if seg.total < _HEADER + nbytes:
            seg.close()
            raise ValueError(f"host pool {name!r} is {seg.total} bytes, its shape needs "
                             f"{_HEADER + nbytes}")
        self.name, self.owner, self.timings = name, False, {}
        self.segments = len(seg.sizes)
        with self._closed_on_error():
            self._setup(lambda: seg.array(_HEADER, nbytes), seg.close, False, threads=0,
                        portable=True)
            self.timings["setup_s"] = time.perf_counter() - t0
            self._check_alignment()
        return self

    @classmethod
    def from_buffer(cls, array: np.ndarray) -> HostKVPool:
        """Register host memory the caller owns: a C-contiguous uint8 NumPy array
        ``[n_layers, n_rows, row_bytes]`` (16-byte aligned), pinned and mapped in place (in
        chunks, as a pool of this package). The array must outlive the pool; :meth:`close`
        unregisters it."""
        t0 = time.perf_counter()
        if not isinstance(array, np.ndarray):
            raise TypeError(f"array must be a NumPy array over the host memory, got "
                            f"{type(array).__name__}")
        if array.dtype != np.uint8 or array.ndim != 3 or not array.flags.c_contiguous:
            raise ValueError(f"array must be a C-contiguous uint8 [n_layers, n_rows, row_bytes] "
                             f"array, got {array.dtype} {array.shape}")
        if array.ctypes.data % 16:
            raise ValueError("array must be 16-byte aligned")
        if not array.flags.writeable:
            raise ValueError("array must be writeable (the cache writes the pool: admissions, "
                             "backups)")
        self = cls.__new__(cls)
        self._shape(*array.shape)
        self.name, self.owner, self.timings = None, False, {}
        with self._closed_on_error():
            self._dptr, chunks = _register_all(array.ctypes.data, array.nbytes)
            self.chunk_edges = tuple(c - chunks[0] for c in chunks[1:])
            self._mem = array
            self._host = array
            timings, held = self.timings, [array]  # the mapping outlives its registration

            def release() -> None:
                t = time.perf_counter()
                _unregister_all(chunks)
                held.clear()
                timings["unregister_s"] = time.perf_counter() - t

            self._release = _finalizer(self, release)
            self.timings["setup_s"] = self.timings["register_s"] = time.perf_counter() - t0
            self._check_alignment()
        return self

    # ----------------------------------------------------------------- internals
    # What the rest of the package asks of the host tier beside a pool (the face of host/):
    default_threads = staticmethod(default_threads)
    node_id = staticmethod(host_shm.node_id)  # this machine's boot id: a shared pool's node

    def _shape(self, n_layers, n_rows, row_bytes) -> None:
        self.n_layers = _checks.integer("n_layers", n_layers, 1)
        self.n_rows = _checks.integer("n_rows", n_rows, 1)
        self.row_bytes = _checks.row_bytes("row_bytes", row_bytes)
        self.layer_bytes = self.n_rows * self.row_bytes
        require_gpu()  # before any CUDA call (or a shared-memory file)
        _release_collected(quiet=True)  # pools collected unclosed: one sync, if any wait
        self._mem = self._release = None

    @contextlib.contextmanager
    def _closed_on_error(self):
        """A setup that fails once its release is set up runs it now (a setup is a place to
        synchronize), not when collected."""
        try:
            yield
        except BaseException:
            if self._release is not None:
                try:
                    self.close()
                except Exception as e:  # noqa: BLE001 - the setup's error is the one to raise
                    log.warning("releasing a host pool whose setup failed failed too: %r", e)
            raise

    def _setup(self, rows_of, unmap, huge: bool, *, threads: int, portable: bool,
               publish=None, on_close=None) -> None:
        """``rows_of()`` (uint8, a new mapping's; ``huge``: huge pages were granted) first
        touched by ``threads`` threads (none: 0), registered in chunks, then ``publish()``; on
        any error nothing is left registered, and ``unmap()`` (no view of it left here). Sets
        up the release: unregister, ``unmap()``, ``on_close()``."""
        rows = rows_of()
        nbytes = rows.size
        chunks, big, gb = [], nbytes >= _SAY_BYTES, nbytes / 1e9
        t0 = time.perf_counter()
        try:
            if big:
                what = (f"touching its pages ({threads} threads, huge pages "
                        f"{'asked' if huge else 'off'}) and " if threads else "")
                _say(f"host pool: {gb:.1f} GB: {what}registering it with CUDA in "
                     f"{len(_chunks(0, nbytes))} chunk(s)")
            if threads:
                _first_touch(rows, threads)
            t1 = time.perf_counter()
            self._dptr, chunks = _register_all(rows.ctypes.data, nbytes, portable)
            t2 = time.perf_counter()
            if publish is not None:
                publish()
        except BaseException:
            _unregister_all(chunks, quiet=True)
            del rows
            unmap()
            raise
        self.timings.update(touch_s=t1 - t0, register_s=t2 - t1)
        timings = self.timings

        def release() -> None:
            t = time.perf_counter()
            try:
                _unregister_all(chunks)
            finally:
                timings["unregister_s"] = time.perf_counter() - t
                unmap()
                if on_close is not None:
                    on_close()

        self._mem, self.chunk_edges = rows, tuple(c - chunks[0] for c in chunks[1:])
        self._host = rows.reshape(self.n_layers, self.n_rows, self.row_bytes)
        self._release = _finalizer(self, release)
        if big:  # (after the release is set up: nothing leaks if the line fails)
            _say(f"host pool: {gb:.1f} GB " + (f"touched {t1 - t0:.1f} s, " if threads else "") +
                 f"registered {t2 - t1:.1f} s ({gb / max(t2 - t0, 1e-9):.1f} GB/s)")

    def _check_alignment(self) -> None:
        if self._dptr % 16:
            raise RuntimeError("pinned allocation is not 16-byte aligned")

    @property
    def closed(self) -> bool:
        return self._mem is None

    def _live(self):
        if self._mem is None:
            raise RuntimeError("HostKVPool is closed")

    @property
    def numpy(self) -> np.ndarray:
        """uint8 ``[n_layers, n_rows, row_bytes]`` host view (no copy)."""
        self._live()
        return self._host

    def layer(self, layer: int) -> np.ndarray:
        """uint8 ``[n_rows, row_bytes]`` host view of one layer (no copy)."""
        self._live()
        return self._host[_checks.integer("layer", layer, 0, self.n_layers - 1)]

    def device_ptr(self, layer: int = 0) -> Ptr:
        """Device address of row 0 of ``layer`` (layers follow each other, ``layer_bytes``)."""
        self._live()
        layer = _checks.integer("layer", layer, 0, self.n_layers - 1)
        return Ptr(self._dptr + layer * self.layer_bytes)

    def close(self) -> None:
        """Release the memory after the device's queued work: unregister its chunks and unmap it
        (or free it; caller-owned memory is only unregistered); a shared creator unlinks."""
        if self._mem is not None:
            _synchronize()
            t0 = time.perf_counter()
            fin, self._release = self._release, None
            self._host = None
            self._mem = None
            try:
                got = fin.detach() if fin is not None else None  # (obj, func, args, kwargs)
                if got is not None:
                    _, _, (release,), _ = got
                    release()
            finally:
                self.timings["teardown_s"] = time.perf_counter() - t0
            _release_collected(quiet=True)

    @staticmethod
    def release_collected() -> int:
        """Release the pools collected without :meth:`close` (unregister, unmap or free their
        memory), after one device synchronization; returns how many. The collector may run
        while a stream captures a CUDA graph, where a synchronization would break the
        capture, so a collected pool waits for this call, the next pool's setup or
        :meth:`close` (which then synchronize the device once; a failing synchronization
        there is logged and the pools stay queued), or the process's exit. Never call it
        while any stream captures; a failing synchronization raises, the pools still
        queued."""
        return _release_collected()

    def __enter__(self) -> HostKVPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.n_layers * self.layer_bytes} bytes"
        kind = "" if self.name is None else \
            f", shared {self.name!r} ({'creator' if self.owner else 'attached'})"
        return (f"HostKVPool(n_layers={self.n_layers}, n_rows={self.n_rows}, "
                f"row_bytes={self.row_bytes}{kind}, {state})")

