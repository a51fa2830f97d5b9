"""The per-layer checksum of a prefill -> decode transfer (``hisparse_cupy._kernels.sums``): it
sees a
changed byte and a moved row, a receiver's sum over any split of the rows into runs equals the
sender's, and the GPU kernel (``cu/sums.cu``) equals NumPy's on random shapes, strided views
and a misaligned start."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_cupy._kernels import sums as _sums


def test_checksums_see_a_changed_byte_a_moved_row_and_any_split():
    rng = np.random.default_rng(5)
    kv = rng.integers(0, 256, (3, 301, 64), dtype=np.uint8)
    want = _sums.kv_sums(kv)
    pool = np.zeros((3, 1000, 64), np.uint8)
    cuts = np.sort(rng.choice(np.arange(1, 301), 6, replace=False))
    rows, counts, at, row = [], [], 0, 0
    for c in np.diff(np.concatenate([[0], cuts, [301]])):  # runs in pool order, gaps between
        row += int(rng.integers(1, 60))
        rows.append(row)
        counts.append(int(c))
        pool[:, row: row + c] = kv[:, at: at + c]
        at, row = at + c, row + c
    assert _sums.run_sums(pool, np.asarray(rows), np.asarray(counts)) == want
    k2 = kv.copy()
    k2[1, 100, 5] ^= 1
    assert _sums.kv_sums(k2)[1] != want[1] and _sums.kv_sums(k2)[0] == want[0]
    k3 = kv.copy()
    k3[2, [10, 11]] = k3[2, [11, 10]]
    assert _sums.kv_sums(k3)[2] != want[2]
    with pytest.raises(ValueError, match="multiple of 8"):
        _sums.kv_sums(np.zeros((1, 2, 12), np.uint8))


@pytest.mark.gpu
def test_the_gpu_sum_equals_numpys(rng):
    import cupy

    for L, n, rb in [(1, 1, 8), (3, 1, 64), (5, 777, 656), (2, 4096, 1152), (78, 40, 1152)]:
        kv = rng.integers(0, 256, (L, n, rb), dtype=np.uint8)
        want = _sums.kv_sums(kv)
        assert _sums.kv_sums(cupy.asarray(kv)) == want, (L, n, rb)
        big = cupy.asarray(rng.integers(0, 256, (L, n + 9, rb), dtype=np.uint8))
        view = big[:, 5: 5 + n]  # layers n + 9 rows apart (a registered buffer's view)
        assert _sums.kv_sums(view) == _sums.kv_sums(cupy.asnumpy(view))
        raw = cupy.zeros(L * n * rb + 3, cupy.uint8)
        odd = raw[3:].reshape(L, n, rb)  # not 8-byte aligned: summed from a copy
        odd[:] = cupy.asarray(kv)
        assert _sums.kv_sums(odd) == want
    empty = cupy.zeros((2, 0, 64), cupy.uint8)
    assert _sums.kv_sums(empty) == [0, 0] == _sums.kv_sums(cupy.asnumpy(empty))


@pytest.mark.gpu
def test_a_mapped_pools_runs_are_summed_on_the_gpu_as_on_the_host(rng):
    """A ``HostKVPool``'s runs, summed by the kernel through the pool's device mapping (a
    launch per run, at its word offset), equal the host threads' sums of the same rows."""
    from hisparse_cupy.host._pool import HostKVPool

    with HostKVPool(4, 3000, 1152) as pool:
        pool.numpy[:] = rng.integers(0, 256, pool.numpy.shape, dtype=np.uint8)
        for _ in range(5):
            k = int(rng.integers(1, 9))
            starts = np.sort(rng.choice(np.arange(0, 2900, 300), k, replace=False))
            counts = rng.integers(1, 300, k)
            got = _sums.run_sums(pool, starts, counts)
            assert got == _sums.run_sums(pool.numpy, starts, counts)
            kv = np.concatenate([pool.numpy[:, r: r + c]
                                 for r, c in zip(starts, counts, strict=True)], 1)
            assert got == _sums.kv_sums(kv)
