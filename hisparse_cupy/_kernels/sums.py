"""The per-layer checksum of a prefill -> decode transfer (``verify=True`` in
:mod:`hisparse_cupy.pd`): the sender sums its ``kv``, the receiver sums the rows that landed,
and an arrival whose sums differ is refused.

A layer's sum: its rows in token order read as little-endian 64-bit words ``w_0, w_1, ...``;
the sum mod 2^64 of ``mix(w_i + (i + 1) * G)`` (``mix``: the splitmix64 finalizer, ``G``: the
64-bit golden ratio). Each word counts through a full-avalanche mix of its value and position,
so a changed byte, a moved or missing row, or a row of the wrong request changes it (a
collision is a 2^-64 event for a fault, not proof against a sender that forges sums). Being a
sum of per-word terms, the receiver adds its pages' runs in any order and on many threads.
Needs rows of a multiple of 8 bytes. :func:`kv_sums` sums GPU ``kv`` with one kernel
(``cu/sums.cu``) and host ``kv`` with host threads; :func:`run_sums` sums the receiver's runs,
of a ``HostKVPool`` on its device through its mapping (the H200's host threads summed at
1.4 GB/s, below the link), of a NumPy pool on host threads."""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np

_G, _C1, _C2 = (np.uint64(v) for v in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                      0x94D049BB133111EB))
_CHUNK = 1 << 17  # words summed at a time by one thread (1 MiB: stays in its cache)
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_streams: dict = {}  # device -> the stream of this module's kernels


def _threads() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1),
                                                      thread_name_prefix="hisparse-sums")
    return _pool


def _terms(words: np.ndarray, first: int) -> int:
    """The sum of the terms of ``words`` (uint64, 1-D), the first at word index ``first``."""
    with np.errstate(over="ignore"):
        x = np.arange(first + 1, first + 1 + words.size, dtype=np.uint64)
        x *= _G
        x += words
        x ^= x >> np.uint64(30)
        x *= _C1
        x ^= x >> np.uint64(27)
        x *= _C2
        x ^= x >> np.uint64(31)
        return int(x.sum(dtype=np.uint64))


def check_row_bytes(row_bytes: int) -> None:
    if row_bytes % 8:
        raise ValueError(f"verify=True needs rows of a multiple of 8 bytes (its checksum reads "
                         f"64-bit words), got row_bytes={row_bytes}")


def _host_sums(pieces, n_layers: int) -> list[int]:
    """Sum ``pieces``: ``(layer, uint8 array of whole words, index of its first word)``, cut
    into chunks summed on host threads; the per-layer sums as ints."""
    jobs = []
    for layer, buf, first in pieces:
        words = buf.reshape(-1).view("<u8")
        for at in range(0, words.size, _CHUNK):
            jobs.append((layer, words[at: at + _CHUNK], first + at))
    out = [0] * n_layers
    if len(jobs) < 4:
        done = [_terms(w, f) for _, w, f in jobs]
    else:
        done = list(_threads().map(lambda j: _terms(j[1], j[2]), jobs))
    for (layer, _, _), s in zip(jobs, done, strict=True):
        out[layer] = (out[layer] + s) & 0xFFFFFFFFFFFFFFFF
    return out


def kv_sums(kv) -> list[int]:
    """The per-layer sums of ``kv`` (uint8 ``[L, n, row_bytes]``, rows contiguous per layer):
    a NumPy array on host threads, a GPU array (``__cuda_array_interface__``) with one kernel
    after the work CuPy's current stream has queued (on a stream of this module's)."""
    L, n, rb = kv.shape
    check_row_bytes(rb)
    if isinstance(kv, np.ndarray):
        return _host_sums([(layer, np.ascontiguousarray(kv[layer]), 0) for layer in range(L)], L)
    import cupy

    arr = cupy.asarray(kv)
    with arr.device:
        if arr.data.ptr % 8 or arr.strides[0] % 8 or arr.strides[1:] != (rb, 1):
            arr = arr.copy()  # (a new allocation: aligned, rows contiguous)
        return _gpu_sums(L, [(arr.data.ptr, arr.strides[0], n * rb // 8, 0)],
                         after=cupy.cuda.get_current_stream())


def _gpu_sums(L: int, runs, after=None) -> list[int]:
    """Sum ``runs`` (``(device address of layer 0's first word, layer stride in bytes, words,
    index of the first word)``) of ``L`` layers with the kernel, one launch a run, on a stream
    of this module's (after the work ``after``, a stream, had queued; the engine's streams are
    never synchronized), waited for."""
    import cupy

    from . import build

    dev = cupy.cuda.runtime.getDevice()
    s = _streams.get(dev)
    if s is None:
        s = _streams[dev] = cupy.cuda.Stream(non_blocking=True)
    if after is not None:
        s.wait_event(after.record())
    k = build.kernel(build.LAYER_SUMS)
    with s:
        out = cupy.zeros(L, cupy.uint64)
        for addr, stride, words, first in runs:
            if words:
                blocks = max(1, min(1024, -(-words // (256 * 8))))
                k((blocks, L), (256,), (np.uint64(addr), np.int64(stride // 8),
                                        np.int64(words), np.int64(first), out))
        got = out.get(stream=s)
    return [int(v) for v in got]


def run_sums(pool, rows: np.ndarray, counts: np.ndarray) -> list[int]:
    """The per-layer sums of a request's rows in host ``pool`` (uint8 ``[L, n_rows, rb]``, or a
    ``HostKVPool``): its runs of ``counts[j]`` rows from pool row ``rows[j]``, in token order.
    A ``HostKVPool`` is summed on its device through its mapping (zero-copy loads, a launch per
    run), a NumPy array on host threads."""
    arr = pool if isinstance(pool, np.ndarray) else pool.numpy
    L, _, rb = arr.shape
    check_row_bytes(rb)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]) * (rb // 8)
    runs = list(zip(rows.tolist(), counts.tolist(), first.tolist(), strict=True))
    if not isinstance(pool, np.ndarray) and hasattr(pool, "device_ptr"):
        base, stride = int(pool.device_ptr(0)), arr.strides[0]
        return _gpu_sums(L, [(base + r * rb, stride, c * rb // 8, f) for r, c, f in runs])
    return _host_sums([(layer, arr[layer, r: r + c], int(f)) for layer in range(L)
                       for r, c, f in runs], L)
