"""CPU: the shared host pool's life (create, attach, close, unlink) and its errors, with the
CUDA registration stubbed (the GPU test registers for real: test_host_pool_gpu.py)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from hisparse_cupy import host_pool as hp


@pytest.fixture
def no_cuda(monkeypatch):
    """Registration, device sync and the device check stubbed: device address = host address
    (UVA)."""
    monkeypatch.setattr(hp, "require_gpu", lambda: None)
    monkeypatch.setattr(hp, "_register", lambda ptr, nbytes: ptr)
    monkeypatch.setattr(hp, "_unregister", lambda ptr: None)
    monkeypatch.setattr(hp, "_synchronize", lambda: None)


@pytest.fixture
def name(request):
    n = f"hs-test-{os.getpid()}-{request.node.name}"[:200]
    yield n
    try:
        os.unlink(os.path.join("/dev/shm", n))
    except FileNotFoundError:
        pass


def test_create_attach_share_bytes_and_unlink(no_cuda, name):
    path = os.path.join("/dev/shm", name)
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
    with open(os.path.join("/dev/shm", name), "wb") as f:  # not a pool
        f.write(b"x" * 5000)
    with pytest.raises(ValueError, match="is not a hisparse_cupy host pool"):
        hp.HostKVPool.attach(name)


def test_an_attacher_that_crashes_leaks_nothing_and_its_writes_stay(no_cuda, name):
    pool = hp.HostKVPool(1, 4, 16, shared_name=name)
    before = set(os.listdir("/dev/shm"))
    code = ("import os, numpy as np; from hisparse_cupy import host_pool as hp; "
            "hp._register = lambda p, n: p; hp.require_gpu = lambda: None; "
            f"p = hp.HostKVPool.attach({name!r}); p.numpy[0, 2] = 7; os._exit(3)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 3, r.stderr
    assert set(os.listdir("/dev/shm")) == before
    assert (pool.numpy[0, 2] == 7).all()
    pool.close()


def test_a_creator_that_exits_without_close_unlinks(name):
    code = ("from hisparse_cupy import host_pool as hp; hp._register = lambda p, n: p; "
            "hp.require_gpu = lambda: None; "
            "hp._unregister = lambda p: None; "
            f"p = hp.HostKVPool(1, 4, 16, shared_name={name!r})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(os.path.join("/dev/shm", name))


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
