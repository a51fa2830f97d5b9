"""A self-check of every kernel against the NumPy oracle on this GPU (``python -m hisparse_cupy
check``), over the cache twin of the GPU test harness (:class:`hisparse_cupy.testing.twin.Twin`).

The check drives one :class:`HotBufferCache` with single- and multi-step swaps on random top-k
(hits, misses, duplicates, -1 entries), the newest-token write and backup, and a plan replay,
and compares every output, status, state array and byte with :mod:`hisparse_cupy.reference`.
It takes a few seconds after the kernels are compiled (NVRTC, the first time only).
"""

from __future__ import annotations

import time

import numpy as np

from .twin import MAX_LEN, ROW, S_MAX, L, R, Twin, pattern

__all__ = ["alternate", "pattern", "run"]  # pattern: the byte pattern the tests and tools use


def alternate(t: Twin, rng, stream, steps: int) -> int:
    """``steps`` random decode steps over every layer of ``t``, each layer's call single- or
    multi-step at random, every call verified against the oracle; returns the calls made."""
    import cupy

    calls = 0
    for _ in range(steps):
        B = int(rng.integers(1, R + 1))
        req = rng.permutation(R)[:B]
        step = t.c.begin_step(cupy.asarray(req.astype(np.int32)),
                              cupy.asarray(t.lens[req].astype(np.int64)), stream=stream)
        for layer in range(L):
            if rng.random() < 0.5:
                S = int(rng.integers(2, S_MAX + 1))
                topk = t.topk(req, S, miss=float(rng.choice([0.05, 0.3, 1.0])))
                got = step.swap(layer, cupy.asarray(topk))
                exp = t.expect_multi(layer, topk, req)
            else:
                topk = t.topk(req, miss=float(rng.choice([0.0, 0.1, 0.5])))
                got = step.swap(layer, cupy.asarray(topk))
                exp = t.expect_single(layer, topk, req)
            t.verify(layer, topk, req, got, exp)
            calls += 1
    return calls


def _check_single_multi(rng, stream) -> str:
    t = Twin(rng)
    calls = alternate(t, rng, stream, 12)
    t.c.close()
    return f"{calls} calls, outputs, state, invariants and bytes equal the oracle"


def _check_newest_and_replay(rng, stream) -> str:
    import cupy

    from .._kernels.plan import replay_plan

    t = Twin(rng)
    c = t.c
    req = np.arange(R)
    lens = t.lens + 1  # one more token: the step's newest
    d_req, d_lens = cupy.asarray(req.astype(np.int32)), cupy.asarray(lens.astype(np.int64))
    step = c.begin_step(d_req, d_lens, stream=stream)
    rows = cupy.asnumpy(step.newest_rows())
    for layer in range(L):  # the model writes the step's KV
        ids = req.astype(np.int64) * MAX_LEN + lens - 1
        c.device_rows(layer)[cupy.asarray(rows)] = cupy.asarray(pattern(layer, ids, ROW))
    stream.synchronize()
    step.backup_newest()
    stream.synchronize()
    for layer in range(L):
        got = c.pool.numpy[layer][req * MAX_LEN + lens - 1]
        if not (got == pattern(layer, req * MAX_LEN + lens - 1, ROW)).all():
            raise AssertionError(f"layer {layer}: a backed-up row holds wrong bytes")
    # a plan recorded on layer 0 replays into a copy of layer 1's rows
    topk = t.topk(req, miss=0.5)
    step.swap(0, cupy.asarray(topk))
    copy = c.device_rows(1).copy()
    replay_plan(c.plan, R, device_rows=copy, pool=c.pool, layer=1, stream=stream)
    stream.synchronize()
    cnt, dst = cupy.asnumpy(c.plan.count[:R]), cupy.asnumpy(c.plan.dst[:R])
    src = cupy.asnumpy(c.plan.src[:R])
    d = np.concatenate([dst[b, : cnt[b]] for b in range(R)])
    s = np.concatenate([src[b, : cnt[b]] for b in range(R)])
    if not (cupy.asnumpy(copy[cupy.asarray(d)]) == pattern(1, s, ROW)).all():
        raise AssertionError("a replayed row holds wrong bytes")
    c.close()
    return f"{R} newest rows backed up, {d.size} rows replayed, bytes equal"


def run(seed: int = 0, out=print) -> bool:
    """Run every check; print one line each; True when all passed."""
    import cupy

    from .._kernels.launch import pdl_supported

    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    out(f"self-check on device {dev.id} ({name}, sm_{dev.compute_capability}, PDL "
        f"{'on' if pdl_supported() else 'off'})")
    stream = cupy.cuda.Stream(non_blocking=True)
    ok = True
    for label, fn in (("single- and multi-step swaps vs the oracle", _check_single_multi),
                      ("newest-row backup and plan replay", _check_newest_and_replay)):
        t0 = time.perf_counter()
        try:
            with stream:
                msg = fn(np.random.default_rng(seed), stream)
            out(f"  ok    {label}: {msg} ({time.perf_counter() - t0:.1f} s)")
        except Exception as e:  # a failed comparison or a CUDA error: report and go on
            ok = False
            out(f"  FAIL  {label}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    out("self-check: " + ("every kernel agrees with the oracle" if ok else "FAILED"))
    return ok
