"""CPU: the shared host pool's life (create, attach, close, unlink) and its errors, with the
CUDA registration stubbed (the GPU test registers for real: test_host_pool_gpu.py)."""

from __future__ import annotations

import gc
import os
import re
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest

from hisparse_cupy.host import _pool as hp


@pytest.fixture
def no_cuda(monkeypatch):
    """Registration, device sync and the device check stubbed: device address = host address
    (UVA)."""
    monkeypatch.setattr(hp, "require_gpu", lambda: None)
    monkeypatch.setattr(hp, "_register", lambda ptr, nbytes: ptr)
    monkeypatch.setattr(hp, "_unregister", lambda ptr: None)
    monkeypatch.setattr(hp, "_synchronize", lambda: None)


def _shm() -> str:
    """The shared pools' directory (HISPARSE_CUPY_SHM_DIR, else /dev/shm): tests run in either."""
    return hp.host_shm.directory()


def _listing() -> set[str]:
    """The shared pools' directory's entries, less other test processes' pools (suites that run
    side by side on one machine share /dev/shm) and POSIX named semaphores (``sem.*``: other
    processes' multiprocessing locks come and go there; a pool makes none)."""
    mine = f"hs-test-{os.getpid()}-"
    return {e for e in os.listdir(_shm())
            if (e.startswith(mine) or not e.startswith("hs-test-")) and not e.startswith("sem.")}


@pytest.fixture
def name(request):
    n = f"hs-test-{os.getpid()}-{request.node.name}"[:200]
    yield n
    try:
        os.unlink(os.path.join(_shm(), n))
    except OSError:  # gone, or the test left HISPARSE_CUPY_SHM_DIR unusable
        pass


def test_create_attach_share_bytes_and_unlink(no_cuda, name):
    path = os.path.join(_shm(), name)
    a = hp.HostKVPool(2, 8, 32, shared_name=name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert a.owner and "creator" in repr(a)
    b = hp.HostKVPool.attach(name)
    assert (b.n_layers, b.n_rows, b.row_bytes) == (2, 8, 32) and not b.owner
    a.numpy[1, 3] = np.arange(32, dtype=np.uint8)  # one host copy: the attacher sees it
    assert (b.numpy[1, 3] == np.arange(32)).all()
    assert int(a.device_ptr(1)) - int(a.device_ptr(0)) == 8 * 32
    b.close()
    assert os.path.exists(path)  # an attacher never unlinks
    a.close()
    assert not os.path.exists(path)  # the creator does
    with pytest.raises(FileNotFoundError, match="no host pool named"):
        hp.HostKVPool.attach(name)


def test_a_pool_of_segments_is_one_range_one_name_and_attaches_from_another_process(
        no_cuda, name):
    """segments=5: five files mapped back to back (rows across their edges are contiguous),
    one name in /dev/shm (the header's segment); a child process attaches through the
    creator's descriptors and writes rows of every segment, which the creator reads; nothing
    is left once both closed."""
    before = _listing()
    L, R, RB = 3, 4096, 48  # 576 KiB: segments of ~29 pages
    a = hp.HostKVPool(L, R, RB, shared_name=name, segments=5)
    assert a.segments == 5 and _listing() - before == {name}
    rng = np.random.default_rng(0)
    a.numpy[:] = rng.integers(0, 256, a.numpy.shape, dtype=np.uint8)
    b = hp.HostKVPool.attach(name, L, R, RB)
    assert b.segments == 5 and (b.numpy == a.numpy).all()
    code = ("import numpy as np; from hisparse_cupy.host import _pool as hp; "
            "hp._register = lambda p, n: p; hp._unregister = lambda p: None; "
            "hp.require_gpu = lambda: None; hp._synchronize = lambda: None\n"
            f"p = hp.HostKVPool.attach({name!r})\n"
            "p.numpy[:, ::97] = np.arange(p.numpy[:, ::97].size, dtype=np.uint32)"
            ".astype(np.uint8).reshape(p.numpy[:, ::97].shape)\n"
            "p.close()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    want = np.arange(a.numpy[:, ::97].size, dtype=np.uint32).astype(np.uint8)
    assert (a.numpy[:, ::97].ravel() == want).all() and (b.numpy == a.numpy).all()
    b.close()
    a.close()
    gc.collect()
    assert _listing() == before
    with pytest.raises(ValueError, match="segments is a shared pool's"):
        hp.HostKVPool(1, 4, 16, segments=2)
    with pytest.raises(ValueError, match="segments must be"):
        hp.HostKVPool(1, 4, 16, shared_name=name, segments=0)


def test_errors_name_the_problem(no_cuda, name):
    with hp.HostKVPool(1, 4, 16, shared_name=name):
        with pytest.raises(FileExistsError, match="already exists"):
            hp.HostKVPool(1, 4, 16, shared_name=name)
        with pytest.raises(ValueError, match=r"holds \(n_layers, n_rows, row_bytes\) = "
                                             r"\(1, 4, 16\), not \(None, 5, None\)"):
            hp.HostKVPool.attach(name, n_rows=5)
        p = hp.HostKVPool.attach(name, 1, 4, 16)
        p.close()
    for bad in ("", "a/b", ".."):
        with pytest.raises(ValueError, match="shared_name must be a non-empty name"):
            hp.HostKVPool(1, 4, 16, shared_name=bad)
    with open(os.path.join(_shm(), name), "wb") as f:  # not a pool
        f.write(b"x" * 5000)
    with pytest.raises(ValueError, match="is not a hisparse_cupy host pool"):
        hp.HostKVPool.attach(name)


def test_an_attacher_that_crashes_leaks_nothing_and_its_writes_stay(no_cuda, name):
    pool = hp.HostKVPool(1, 4, 16, shared_name=name)
    before = _listing()
    code = ("import os, numpy as np; from hisparse_cupy.host import _pool as hp; "
            "hp._register = lambda p, n: p; hp.require_gpu = lambda: None; "
            f"p = hp.HostKVPool.attach({name!r}); p.numpy[0, 2] = 7; os._exit(3)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 3, r.stderr
    assert _listing() == before
    assert (pool.numpy[0, 2] == 7).all()
    pool.close()


def test_a_creator_that_exits_without_close_unlinks(name):
    code = ("from hisparse_cupy.host import _pool as hp; hp._register = lambda p, n: p; "
            "hp.require_gpu = lambda: None; "
            "hp._unregister = lambda p: None; "
            f"p = hp.HostKVPool(1, 4, 16, shared_name={name!r})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(os.path.join(_shm(), name))


def test_from_buffer_checks_the_array(no_cuda):
    with pytest.raises(TypeError, match="must be a NumPy array"):
        hp.HostKVPool.from_buffer([1, 2])
    with pytest.raises(ValueError, match=r"C-contiguous uint8 \[n_layers, n_rows, row_bytes\]"):
        hp.HostKVPool.from_buffer(np.zeros((2, 4, 16), np.int32))
    with pytest.raises(ValueError, match="row_bytes must be a multiple of 16"):
        hp.HostKVPool.from_buffer(np.zeros((2, 4, 24), np.uint8))
    buf = np.zeros((2, 4, 32), np.uint8)
    p = hp.HostKVPool.from_buffer(buf)
    assert p.numpy is buf and int(p.device_ptr(1)) == buf.ctypes.data + 4 * 32
    p.close()
    assert p.closed


# ------------------------------------------------------------------ setup at memory speed
PAGE = hp._PAGE


@pytest.fixture
def calls(no_cuda, monkeypatch):
    """The registration stub records (ptr, nbytes) per call and the unregistered pointers."""
    log = {"reg": [], "unreg": []}

    def register(ptr, nbytes):
        log["reg"].append((ptr, nbytes))
        return ptr

    monkeypatch.setattr(hp, "_register", register)
    monkeypatch.setattr(hp, "_unregister", lambda ptr: log["unreg"].append(ptr))
    return log


def _tiles(reg, base, nbytes, limit):
    assert reg[0][0] == base and sum(n for _, n in reg) == nbytes
    for (p, n), (q, _) in zip(reg[:-1], reg[1:], strict=True):
        assert p + n == q and q % PAGE == 0  # back to back, cut on page boundaries
    assert all(0 < n <= limit for _, n in reg)


def test_registration_in_chunks_tiles_the_pool_and_teardown_unregisters_each(calls, name,
                                                                             monkeypatch):
    monkeypatch.setattr(hp, "_REGISTER_CHUNK", 3 * PAGE)
    pool = hp.HostKVPool(2, 25 * PAGE // 1024, 256, alloc="mmap")  # 12.5 pages: 3 + 3 + 3 + 3 + 0.5
    base = pool.numpy.ctypes.data
    assert base % PAGE == 0 and int(pool.device_ptr(0)) == base
    _tiles(calls["reg"], base, 25 * PAGE // 2, 3 * PAGE)
    assert len(calls["reg"]) == 5
    pool.close()
    assert sorted(calls["unreg"]) == [p for p, _ in calls["reg"]]
    assert pool.timings["teardown_s"] >= pool.timings["unregister_s"] >= 0
    raw = np.zeros(8 * PAGE, np.uint8)
    off = (-raw.ctypes.data) % PAGE + 16  # 16 bytes into a page: the first chunk ends on one
    creator = None
    for what in ("shared", "attach", "buffer"):
        calls["reg"].clear(), calls["unreg"].clear()
        if what == "buffer":
            p = hp.HostKVPool.from_buffer(raw[off: off + 5 * PAGE].reshape(5, PAGE // 16, 16))
        elif what == "attach":
            p = hp.HostKVPool.attach(name)
        else:
            p = creator = hp.HostKVPool(1, 10 * PAGE // 64, 64, shared_name=name)
        _tiles(calls["reg"], p.numpy.ctypes.data, p.n_layers * p.layer_bytes, 3 * PAGE)
        assert len(calls["reg"]) == (2 if what == "buffer" else 4)
        if p is not creator:  # the creator stays open for the attach
            p.close()
            assert sorted(calls["unreg"]) == [q for q, _ in calls["reg"]]  # each once
    calls["unreg"].clear()
    creator.close()
    assert len(calls["unreg"]) == 4


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def test_a_failing_or_misplaced_chunk_leaves_nothing(calls, name, monkeypatch):
    monkeypatch.setattr(hp, "_REGISTER_CHUNK", 2 * PAGE)
    fds = len(os.listdir("/proc/self/fd"))

    def fail_third(ptr, nbytes):
        calls["reg"].append((ptr, nbytes))
        if len(calls["reg"]) == 3:
            raise RuntimeError("cudaErrorMemoryAllocation (stub)")
        return ptr

    monkeypatch.setattr(hp, "_register", fail_third)
    for shared in (None, name):
        calls["reg"].clear(), calls["unreg"].clear()
        with pytest.raises(RuntimeError, match="stub"):
            hp.HostKVPool(1, 10 * PAGE // 64, 64, shared_name=shared, alloc="mmap")
        assert calls["unreg"] == [p for p, _ in calls["reg"][:2]]  # the two before, not the third
        assert not _mapped(calls["reg"][0][0])  # unmapped
        assert not os.path.exists(os.path.join(_shm(), name))
        assert len(os.listdir("/proc/self/fd")) == fds
    calls["reg"].clear(), calls["unreg"].clear()
    monkeypatch.setattr(hp, "_register", lambda ptr, nbytes: calls["reg"].append(ptr) or
                        (ptr if len(calls["reg"]) == 1 else ptr + (1 << 40)))
    with pytest.raises(RuntimeError, match="chunk 1 .* not contiguous in the device's address"):
        hp.HostKVPool(1, 10 * PAGE // 64, 64, alloc="mmap")
    assert calls["unreg"] == calls["reg"] and len(calls["reg"]) == 2
    assert not _mapped(calls["reg"][0])


def test_first_touch_writes_every_page_from_several_threads(no_cuda, monkeypatch):
    monkeypatch.setattr(hp, "_TOUCH_SPAN", PAGE)
    workers = []

    class Recording(hp.ThreadPoolExecutor):
        def __init__(self, n, **kw):
            workers.append(n)
            super().__init__(n, **kw)

    monkeypatch.setattr(hp, "ThreadPoolExecutor", Recording)
    buf = np.full(16 * PAGE + 100, 0xFF, np.uint8)
    view = buf[(-buf.ctypes.data) % PAGE:][: 15 * PAGE + 7]  # starts on a page, ends inside one
    hp._first_touch(view, 4)
    assert workers == [4]
    starts = view[::PAGE]
    assert (starts == 0).all() and len(starts) == 16  # one write into every page
    assert view[-1] == 0 and int((view == 0).sum()) == 17  # and nothing else
    hp._first_touch(view[:PAGE], 8)  # one page: one thread, none started
    assert workers == [4]

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon"))

    before = rss()
    pool = hp.HostKVPool(4, 1 << 16, 64, alloc="mmap", threads=3,
                         huge_pages=False)  # 16 MiB, 4096 per span
    assert rss() - before >= 0.9 * (16 << 20)  # resident before registration pins it
    assert workers == [4, 3]
    assert not pool.numpy.any()
    assert set(pool.timings) >= {"setup_s", "touch_s", "register_s"}
    pool.close()


def test_a_creator_killed_during_setup_leaves_no_shared_memory(name):
    path = os.path.join(_shm(), name)
    code = ("import time; from hisparse_cupy.host import _pool as hp; "
            "hp._register = lambda p, n: p; hp._unregister = lambda p: None; "
            "hp.require_gpu = lambda: None; touch = hp._first_touch\n"
            "def slow(rows, threads):\n"
            "    touch(rows, threads); print('touched', flush=True); time.sleep(120)\n"
            "hp._first_touch = slow\n"
            f"hp.HostKVPool(4, 1 << 16, 256, shared_name={name!r}, segments=3)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "touched"  # 64 MiB touched, not yet named
        with open(f"/proc/{child.pid}/maps") as f:  # the unnamed segments, mapped
            assert sum(_shm() + "/" in line and "(deleted)" in line for line in f) == 3
        assert not os.path.exists(path)
        with pytest.raises(FileNotFoundError, match="no host pool named"):
            hp.HostKVPool.attach(name)
    finally:
        child.kill()  # SIGKILL: no finalizer, no atexit
        child.wait(timeout=30)
        child.stdout.close()
    assert child.returncode == -9
    assert not [e for e in os.listdir(_shm()) if name in e]


def test_the_name_is_checked_again_when_linked_and_without_o_tmpfile(calls, name, monkeypatch):
    path = os.path.join(_shm(), name)
    a = hp.HostKVPool(1, 64, 64, shared_name=name)
    with monkeypatch.context() as m:
        m.setattr(hp.os.path, "lexists", lambda p: False)  # another creator got there first
        with pytest.raises(FileExistsError, match="already exists"):
            hp.HostKVPool(1, 64, 64, shared_name=name)
    assert len(calls["unreg"]) == 1  # its registration undone
    gc.collect()  # the failed pool's finalizer must not unlink the name it did not get
    assert os.path.exists(path)
    a.close()
    assert not os.path.exists(path)
    with monkeypatch.context() as m:
        m.delattr(hp.os, "O_TMPFILE")  # named from the start, as before
        with hp.HostKVPool(1, 64, 64, shared_name=name) as b:
            assert os.path.exists(path) and hp.HostKVPool.attach(name).n_rows == 64
            assert b.owner
    assert not os.path.exists(path)


def test_bad_arguments_name_the_argument(no_cuda, monkeypatch):
    bad = "alloc must be 'mmap' or 'cuda' .a private pool., got "
    with pytest.raises(ValueError, match=bad + "'malloc'"):
        hp.HostKVPool(1, 4, 16, alloc="malloc")
    with pytest.raises(ValueError, match=bad + "'cuda'"):
        hp.HostKVPool(1, 4, 16, alloc="cuda", shared_name="x")
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        hp.HostKVPool(1, 4, 16, threads=0)
    with pytest.raises(TypeError, match="threads must be an int"):
        hp.HostKVPool(1, 4, 16, threads=2.0)
    with pytest.raises(TypeError, match="huge_pages must be True or False"):
        hp.HostKVPool(1, 4, 16, huge_pages="yes")
    monkeypatch.setattr(hp, "_REGISTER_CHUNK", PAGE + 1)
    with pytest.raises(ValueError, match="_REGISTER_CHUNK must be a positive multiple"):
        hp.HostKVPool(1, 4, 16, alloc="mmap")


def test_a_pool_the_machine_cannot_hold_is_refused_before_it_is_touched(no_cuda, name,
                                                                         monkeypatch):
    with pytest.raises(MemoryError, match=r"a host pool of 1099.5 GB is more than the .* GB of "
                                          r"memory available \(MemAvailable\)"):
        hp.HostKVPool(1, 1 << 36, 16, alloc="mmap")  # 1 TiB: refused before mmap

    class Full:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(hp.os, "statvfs", lambda path: Full)
    with pytest.raises(OSError, match=f"does not fit in {re.escape(_shm())} .*docker --shm-size"):
        hp.HostKVPool(1, 1024, 16, shared_name=name)
    assert not os.path.exists(os.path.join(_shm(), name))


def test_a_large_pool_says_its_setup_in_two_lines(no_cuda, monkeypatch, capsys):
    if hp.log.level != hp.logging.NOTSET or hp.log.handlers:
        pytest.skip("the package logger is configured (HISPARSE_CUPY_LOG)")
    monkeypatch.setattr(hp, "_SAY_BYTES", 4096)
    hp.HostKVPool(1, 256, 16, alloc="mmap", threads=2).close()
    hp.HostKVPool(1, 255, 16, alloc="mmap").close()  # below: silent
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("hisparse_cupy: host pool: 0.0 GB: touching its pages")
    assert "touched" in lines[1] and "registered" in lines[1] and "GB/s" in lines[1]


def test_a_pool_dropped_unclosed_is_released_at_a_safe_point_not_by_the_collector(
        no_cuda, monkeypatch):
    """A pool nobody closed makes no CUDA call from the collector (which may run while a stream
    captures a CUDA graph: a synchronization there breaks the capture); its release waits for
    ``release_collected``, which synchronizes first, then unregisters its chunks (once each)
    and unmaps: a registration left behind would collide with a later mapping at the same
    addresses."""
    import gc

    hp.HostKVPool.release_collected()  # (pools other tests left: stubbed)
    log = []
    monkeypatch.setattr(hp, "_REGISTER_CHUNK", 3 * PAGE)
    monkeypatch.setattr(hp, "_unregister", lambda ptr: log.append(ptr))
    monkeypatch.setattr(hp, "_synchronize", lambda: log.append("sync"))
    pool = hp.HostKVPool(1, 10 * PAGE // 64, 64, alloc="mmap")
    base, n = pool.numpy.ctypes.data, len(pool.chunk_edges) + 1
    del pool
    gc.collect()
    assert log == [] and _mapped(base)
    assert hp.HostKVPool.release_collected() == 1
    assert log == ["sync"] + [base + i * 3 * PAGE for i in range(n)] and n == 4
    assert not _mapped(base)
    assert hp.HostKVPool.release_collected() == 0 and len(log) == 5  # nothing left: no sync


@pytest.mark.parametrize("where", ["setup", "close"])
def test_a_collected_pool_is_released_by_the_next_pools_setup_or_close(no_cuda, monkeypatch,
                                                                        where):
    import gc

    hp.HostKVPool.release_collected()  # (pools other tests left: stubbed)
    log = []
    monkeypatch.setattr(hp, "_unregister", lambda ptr: log.append(ptr))
    monkeypatch.setattr(hp, "_synchronize", lambda: log.append("sync"))
    other = hp.HostKVPool(1, 64, 64) if where == "close" else None
    pool = hp.HostKVPool(1, 64, 64)
    base = pool.numpy.ctypes.data
    del pool
    gc.collect()
    assert base not in log
    if other is None:
        other = hp.HostKVPool(1, 64, 64)
        assert log == ["sync", base]  # (its mapping may be the new pool's now)
        other.close()
    else:
        other.close()  # its own release after a sync, then the collected one's after another
        assert log[-2:] == ["sync", base] and log.count("sync") == 2 and not _mapped(base)


def test_a_failing_collected_release_is_logged_and_the_others_still_run(no_cuda, monkeypatch,
                                                                         caplog):
    import gc

    hp.HostKVPool.release_collected()  # (pools other tests left: stubbed)
    done = []

    def unregister(ptr):
        if not done:
            done.append("failed")
            raise RuntimeError("unregister failed")
        done.append(ptr)

    monkeypatch.setattr(hp, "_unregister", unregister)
    pools = [hp.HostKVPool(1, 64, 64) for _ in range(2)]
    del pools
    gc.collect()
    with caplog.at_level("WARNING", logger="hisparse_cupy"):
        assert hp.HostKVPool.release_collected() == 2
    assert done[0] == "failed" and len(done) == 2 and "collected unclosed failed" in caplog.text


def test_a_failed_synchronization_keeps_the_collected_pools_queued(no_cuda, monkeypatch,
                                                                   caplog):
    """The synchronization before the queued releases can fail (a stream capturing, a sticky
    error): no release may run then, none may be dropped (its memory would be unmapped while
    still registered). ``release_collected`` raises and keeps them queued; a pool's setup logs
    it and goes on; the next synchronization that works releases them."""
    import gc

    hp.HostKVPool.release_collected()  # (pools other tests left: stubbed)
    unreg, fail = [], [True]

    def sync():
        if fail[0]:
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(hp, "_unregister", unreg.append)
    monkeypatch.setattr(hp, "_synchronize", sync)
    pool = hp.HostKVPool(1, 64, 64)
    base = pool.numpy.ctypes.data
    del pool
    gc.collect()
    with pytest.raises(RuntimeError, match="capturing"):
        hp.HostKVPool.release_collected()
    assert unreg == [] and _mapped(base)
    with caplog.at_level("WARNING", logger="hisparse_cupy"):
        other = hp.HostKVPool(1, 64, 64)  # a setup: logged, not raised
    assert unreg == [] and _mapped(base) and "stay registered" in caplog.text
    fail[0] = False
    assert hp.HostKVPool.release_collected() == 1
    assert unreg == [base] and not _mapped(base)
    other.close()


def test_a_pool_collected_unclosed_is_released_at_exit():
    code = _STUBS + ("import gc\np = hp.HostKVPool(1, 64, 64)\ndel p\ngc.collect()\n"
                     "hp._unregister = lambda p: print('unregistered', flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    assert r.stdout.split() == ["unregistered"]


# ------------------------------------------------------------------ segments: faults (review)
def test_large_segments_map_on_huge_page_boundaries_in_the_environments_directory(
        no_cuda, name, monkeypatch):
    """Segments of 2 MiB or more are 2 MiB multiples mapped from a 2 MiB-aligned start (a
    tmpfs mounted huge=always can then map them huge); HISPARSE_CUPY_SHM_DIR moves the pool
    to another directory, where attachers that see the same variable find it."""
    huge, page = 2 << 20, hp._PAGE
    assert hp.host_shm.sizes(8 << 20, page, 3) == [4 << 20, 4 << 20, page]
    assert hp.host_shm.sizes(64 * page, page, 4) == [17 * page] * 3 + [14 * page]  # small
    home = _shm()
    where = os.path.join(home, f"{name}-dir")
    os.mkdir(where)
    try:
        monkeypatch.setenv("HISPARSE_CUPY_SHM_DIR", where)
        a = hp.HostKVPool(2, 1 << 16, 64, shared_name=name, segments=3)
        assert a.segments == 3 and os.listdir(where) == [name]
        assert not os.path.exists(os.path.join(home, name))
        assert (a.numpy.ctypes.data - hp._HEADER) % huge == 0
        a.numpy[:] = np.random.default_rng(1).integers(0, 256, a.numpy.shape, dtype=np.uint8)
        code = _STUBS + (f"p = hp.HostKVPool.attach({name!r})\n"
                         "print(int(p.numpy.astype(np.int64).sum()), p.segments)\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-500:]
        assert r.stdout.split() == [str(int(a.numpy.astype(np.int64).sum())), "3"]
        env = {k: v for k, v in os.environ.items() if k != "HISPARSE_CUPY_SHM_DIR"}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env)
        assert r.returncode != 0 and "no host pool named" in r.stderr, r.stderr[-500:]
        a.close()
        gc.collect()
        assert os.listdir(where) == []
        monkeypatch.setenv("HISPARSE_CUPY_SHM_DIR", where + "/none")
        with pytest.raises(FileNotFoundError, match="HISPARSE_CUPY_SHM_DIR"):
            hp.HostKVPool(1, 4, 16, shared_name=name)
    finally:
        shutil.rmtree(where, ignore_errors=True)  # (a failed assert leaves files)


def test_the_shared_directory_must_be_a_tmpfs_and_info_says_what_pages_it_gives(
        no_cuda, name, monkeypatch, tmp_path):
    """host_shm.mount finds the mount holding a path (the longest mount point above it);
    a HISPARSE_CUPY_SHM_DIR on another file system is refused before anything is made (its
    files would be written back to disk); shared_pools() (python -m hisparse_cupy info) says
    where pools go and whether they get huge pages."""
    hs = hp.host_shm
    mounts = ("rootfs / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw,size=8g 0 0\n"
              "tmpfs /mnt/h\\040s tmpfs rw,huge=always 0 0\nbad line\n")
    assert hs.mount("/dev/shm/x/y", mounts) == ("/dev/shm", "tmpfs", "rw,size=8g")
    assert hs.mount("/mnt/h s/kv", mounts) == ("/mnt/h s", "tmpfs", "rw,huge=always")
    assert hs.mount("/dev/shmx", mounts)[1] == "ext4" and hs.mount("/x", "") == ("", "", "")
    assert hs.mount("/dev/shm")[1] == "tmpfs"  # this machine's (CI's) /proc/mounts
    assert "huge=" in hs.shared_pools() and _shm() in hs.shared_pools()
    assert hs.mount("/dev/shm/a\tb", "tmpfs /dev/shm/a\\011b tmpfs rw 0 0")[0] == "/dev/shm/a\tb"
    assert hs._fs_magic("/dev/shm") == hs._TMPFS_MAGIC  # statfs: what the check reads
    real = hs.mount
    monkeypatch.setattr(hs, "mount", lambda d, m=None: ("/mnt/h", "tmpfs", "rw,huge=always"))
    assert "huge=always: 2 MiB pages" in hs.shared_pools()
    monkeypatch.setattr(hs, "mount", lambda d, m=None: ("/", "ext4", "rw"))
    monkeypatch.setattr(hs, "_fs_magic", lambda d: 0xEF53)  # ext4's
    monkeypatch.setenv("HISPARSE_CUPY_SHM_DIR", str(tmp_path))
    with pytest.raises(OSError, match="HISPARSE_CUPY_SHM_DIR '.*' is on ext4, not tmpfs"):
        hp.HostKVPool(1, 4, 16, shared_name=name)
    assert os.listdir(tmp_path) == [] and "is on ext4, not tmpfs" in hs.shared_pools()
    monkeypatch.setattr(hs, "mount", real)
    monkeypatch.setenv("HISPARSE_CUPY_SHM_DIR", str(tmp_path / "none"))
    assert "is not a directory" in hs.shared_pools()
    monkeypatch.delenv("HISPARSE_CUPY_SHM_DIR")
    monkeypatch.chdir("/dev")  # a relative directory is made absolute (unlinked from anywhere)
    monkeypatch.setattr(hs, "_fs_magic", lambda d: hs._TMPFS_MAGIC)
    monkeypatch.setenv("HISPARSE_CUPY_SHM_DIR", "shm")
    assert hs.directory() == "/dev/shm" and hs.path("kv") == "/dev/shm/kv"


def test_a_reservation_is_trimmed_to_a_huge_page_aligned_span():
    """Segments' base: the reservation's first 2 MiB boundary (itself where aligned), and the
    slop before and after given back, nothing else."""
    huge, span = 2 << 20, 5 << 20
    for got in (7 * huge, 7 * huge + 4096, 8 * huge - 4096):
        base, slop = hp.host_shm.aligned(got, span, huge)
        assert base % huge == 0 and got <= base < got + huge
        assert sum(n for _, n in slop) == huge and all(n > 0 for _, n in slop)
        pieces = sorted(slop + [(base, span)])
        assert pieces[0][0] == got and pieces[-1][0] + pieces[-1][1] == got + span + huge
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:], strict=False))
    assert hp.host_shm.aligned(4096 * 3, 4096, 0) == (4096 * 3, [])  # small: no padding


_STUBS = ("import numpy as np, os, sys, threading; from hisparse_cupy.host import _pool as hp; "
          "hp._register = lambda p, n: p; hp._unregister = lambda p: None; "
          "hp.require_gpu = lambda: None; hp._synchronize = lambda: None\n")


def test_an_unclosed_pool_read_by_a_thread_at_exit_does_not_crash(name):
    """The interpreter's exit does not unmap a pool a daemon thread still reads (the kernel
    tears down after the last thread); nothing is left in /dev/shm."""
    code = _STUBS + (f"p = hp.HostKVPool(2, 1 << 14, 64, shared_name={name!r}, segments=8)\n"
                     "dst = np.empty_like(p.numpy[0]); go = threading.Event()\n"
                     "def read():\n"
                     "    while True:\n"
                     "        np.copyto(dst, p.numpy[0]); go.set()\n"
                     "threading.Thread(target=read, daemon=True).start(); go.wait()\n")
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode == 0, (r.returncode, r.stderr[-500:])
    assert not os.path.exists(os.path.join(_shm(), name))


def test_a_segment_that_cannot_be_opened_leaks_no_descriptor(name):
    """With the descriptors a creator may open limited, a pool of many segments fails with
    OSError and leaves no descriptor or name behind."""
    code = _STUBS + ("import resource\n"
                     "before = len(os.listdir('/proc/self/fd'))\n"
                     "resource.setrlimit(resource.RLIMIT_NOFILE, (before + 6, before + 6))\n"
                     "try:\n"
                     f"    hp.HostKVPool(2, 1 << 14, 64, shared_name={name!r}, segments=20)\n"
                     "except OSError as e:\n"
                     "    print('refused', e.errno)\n"
                     "print(len(os.listdir('/proc/self/fd')) - before)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    assert r.stdout.split()[0] == "refused" and r.stdout.split()[-1] == "0", r.stdout
    assert not os.path.exists(os.path.join(_shm(), name))


def test_a_header_with_sizes_no_pool_has_is_refused(no_cuda, name):
    pool = hp.HostKVPool(2, 1 << 12, 64, shared_name=name, segments=3)
    path = os.path.join(_shm(), name)
    good = open(path, "rb").read(hp._HEADER)
    try:
        with open(path, "r+b") as f:  # segment 1's size no page multiple
            f.seek(32 + 8 * (4 + 4 * 1 + 1))
            f.write(np.uint64(hp._PAGE + 8).tobytes())
        with pytest.raises(ValueError, match="segment sizes are not a pool's"):
            hp.HostKVPool.attach(name)
        with open(path, "r+b") as f:  # segment 2 named by another file's inode
            f.write(good)
            f.seek(32 + 8 * (4 + 4 * 2 + 3))
            f.write(np.uint64(1).tobytes())
        with pytest.raises(ValueError, match="is not the file its header names"):
            hp.HostKVPool.attach(name)
    finally:
        with open(path, "r+b") as f:
            f.write(good)
    hp.HostKVPool.attach(name).close()
    pool.close()


def test_a_failure_after_the_name_is_linked_unlinks_it(calls, name, monkeypatch):
    """An error once the name is linked (here: the second setup line) leaves no name and no
    registration behind."""
    monkeypatch.setattr(hp, "_SAY_BYTES", 1)
    said = []

    def say(msg):
        said.append(msg)
        if len(said) == 2:
            raise BrokenPipeError("stderr is gone")

    monkeypatch.setattr(hp, "_say", say)
    with pytest.raises(BrokenPipeError):
        hp.HostKVPool(2, 1 << 12, 64, shared_name=name, segments=3)
    gc.collect()
    assert not os.path.exists(os.path.join(_shm(), name))
    assert sorted(calls["unreg"]) == sorted(p for p, _ in calls["reg"])


def test_a_buffer_pool_collected_unclosed_keeps_its_buffer_until_unregistered(no_cuda,
                                                                              monkeypatch):
    """A ``from_buffer`` pool the engine drops without ``close()`` is released later (never
    from the collector): its registration must not outlive the mapping it names, or the
    engine's next buffer at those addresses would count as registered with the old pages.
    The release holds the array until it unregistered."""
    import gc
    import weakref

    log = []
    monkeypatch.setattr(hp, "_unregister", lambda ptr: log.append(ptr))

    class Buffer(np.ndarray):  # a NumPy array the test can watch die
        pass

    arr = np.zeros((2, 64, 256), np.uint8).view(Buffer)
    base = arr.ctypes.data
    alive = weakref.ref(arr)
    p = hp.HostKVPool.from_buffer(arr)
    del arr, p
    gc.collect()
    assert alive() is not None and log == []  # held: its release waits, still registered
    hp.HostKVPool.release_collected()
    assert log == [base]
    gc.collect()
    assert alive() is None  # let go once unregistered


def test_a_read_only_buffer_is_refused(no_cuda):
    """The cache writes the pool (admissions, backups): a read-only array (a view of bytes)
    is refused by name."""
    ro = np.frombuffer(bytes(2 * 64 * 256), np.uint8).reshape(2, 64, 256)
    with pytest.raises(ValueError, match="array must be writeable"):
        hp.HostKVPool.from_buffer(ro)


def test_a_creator_unlinks_only_its_own_name(no_cuda, name):
    """A shared pool's creator unlinks its name at close or exit, and only while the name is
    still its pool's: removed and taken by another pool meanwhile, the other pool's name
    stays."""
    p = hp.HostKVPool(1, 64, 64, shared_name=name, segments=1)
    path = hp.host_shm.path(name)
    os.unlink(path)  # removed behind its back (an operator, a crashed cleanup)
    q = hp.HostKVPool(1, 64, 64, shared_name=name, segments=1)  # the name taken again
    assert q.owner and q.identity != p.identity
    p.close()
    assert os.path.exists(path)  # q's
    hp.HostKVPool.attach(name, identity=q.identity).close()
    q.close()
    assert not os.path.exists(path)


_FORK = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from hisparse_cupy.host import _pool as hp
hp.require_gpu = lambda: None
hp._register = lambda ptr, nbytes: ptr
hp._unregister = lambda ptr: None
hp._synchronize = lambda: None
p = hp.HostKVPool(1, 64, 64, shared_name=sys.argv[2], segments=1)
path = hp.host_shm.path(sys.argv[2])
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a helper the engine forked, ending with a normal interpreter exit
os.waitpid(pid, 0)
print(os.path.exists(path))
p.close()
print(os.path.exists(path))
"""


def test_a_forked_child_leaves_its_parents_pool_name(name):
    """A child forked from a shared pool's creator inherits its exit handlers; at its exit it
    must not unlink the parent's live pool name (attaches would fail, another creator could
    take it)."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, "-c", _FORK, root, name], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "False"]


def test_attach_opens_only_this_users_regular_pool_file(no_cuda, name, tmp_path):
    """``attach`` maps what the name holds into the process and registers it: a symbolic link
    (to a file anywhere) or a file of another owner is refused by name, not mapped."""
    p = hp.HostKVPool(1, 64, 64, shared_name=name, segments=1)
    path = hp.host_shm.path(name)
    link = f"{name}-link"
    os.symlink(path, hp.host_shm.path(link))
    try:
        with pytest.raises(ValueError, match="is not a host pool file"):
            hp.HostKVPool.attach(link)
    finally:
        os.unlink(hp.host_shm.path(link))
    hp.HostKVPool.attach(name).close()
    if os.geteuid() == 0:  # root can give the file away: the owner check is then reachable
        os.chown(path, 12345, -1)
        with pytest.raises(ValueError, match="of this user"):
            hp.HostKVPool.attach(name)
    p.close()


def test_a_release_waits_for_every_device_in_use(monkeypatch):
    """A pool is registered for every device (portable): its release waits for each device
    with a context, not only the calling thread's current one (a thread starts on device 0
    while the pool's kernels may run on device 1)."""
    import types

    synced, current = [], [0]

    class Device:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            self.prev, current[0] = current[0], self.d

        def __exit__(self, *exc):
            current[0] = self.prev

    runtime = types.SimpleNamespace(deviceSynchronize=lambda: synced.append(current[0]),
                                    getDevice=lambda: current[0])
    monkeypatch.setattr(hp, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=Device, runtime=runtime)))
    monkeypatch.setattr(hp, "_devices_in_use", lambda: [1, 3])
    hp._synchronize()
    assert synced == [1, 3] and current[0] == 0


def test_a_registration_whose_address_query_fails_is_undone(monkeypatch):
    """``_register`` pins, then asks for the device address: a failure between the two leaves
    nothing registered (the chunk is not yet in the caller's list, which undoes the rest)."""
    import types

    log = []

    def attrs(ptr):
        raise RuntimeError("cudaErrorInvalidValue")

    runtime = types.SimpleNamespace(hostRegister=lambda p, n, f: log.append(("reg", p)),
                                    hostUnregister=lambda p: log.append(("unreg", p)),
                                    pointerGetAttributes=attrs)
    monkeypatch.setattr(hp, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=runtime)))
    with pytest.raises(RuntimeError, match="InvalidValue"):
        hp._register(0x1000, 4096)
    assert log == [("reg", 0x1000), ("unreg", 0x1000)]
