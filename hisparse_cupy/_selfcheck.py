"""A self-check of every kernel against the NumPy oracle on this GPU (``python -m hisparse_cupy
check``), and the twin state it uses, which the GPU tests share.

The check drives one :class:`HotBufferCache` with single- and multi-step swaps on random top-k
(hits, misses, duplicates, -1 entries), the newest-token write and backup, and a plan replay,
and compares every output, status, state array and byte with :mod:`hisparse_cupy.reference`.
It takes a few seconds after the kernels are compiled (NVRTC, the first time only).
"""

from __future__ import annotations

import time

import numpy as np

from . import reference as ref

L, R, H, P, K, S_MAX, ROW = 3, 6, 64, 8, 24, 4, 64
MAX_LEN = 600


def pattern(layer, rows, row_bytes: int, *, xp=np):
    """uint8 ``[len(rows), row_bytes]``: a pattern unique to (layer, row) in every 4-byte word.

    ``layer`` is one layer or one per row; ``xp``: NumPy, or CuPy for the pattern on the GPU."""
    rows = xp.asarray(rows, dtype=xp.uint64).reshape(-1, 1)
    lay = xp.asarray(layer, dtype=xp.uint64).reshape(-1, 1)
    words = xp.arange(row_bytes // 4, dtype=xp.uint64).reshape(1, -1)
    key = (lay * xp.uint64(1_000_003) + rows) * xp.uint64(2_654_435_761)
    w = (key + words * xp.uint64(0x9E3779B97F4A7C15)) >> xp.uint64(17)
    w = (w & xp.uint64(0xFFFFFFFF)).astype(xp.uint32)
    return w.view(xp.uint8).reshape(rows.shape[0], row_bytes)


class Twin:
    """A HotBufferCache (max_steps 4) and the NumPy state of each of its layers.

    Every host row holds :func:`pattern` of (layer, row); each request is admitted warm. The
    ``expect_*`` methods drive the oracle on the twin state; :meth:`verify` compares outputs,
    status, every state array, both policies' invariants and the bytes every output points to.
    """

    def __init__(self, rng, stream=None):
        import cupy

        from .cache import HotBufferCache

        self.rng = rng
        self.c = c = HotBufferCache(n_layers=L, max_requests=R, max_len=MAX_LEN, row_bytes=ROW,
                                    hot_size=H, top_k=K, extra_page=P, max_steps=S_MAX)
        for layer in range(L):
            c.pool.layer(layer)[:] = pattern(layer, np.arange(c.pool.n_rows), ROW)
        self.lens = rng.integers(H + 40, MAX_LEN - 1, size=R)
        for r in range(R):
            warm = rng.choice(int(self.lens[r]) - 1, size=int(H * 0.8), replace=False)
            got = c.admit(int(self.lens[r]), warm_tokens=warm, stream=stream)
            assert got == r
        cupy.cuda.Device().synchronize()
        self.np = [self.snapshot(layer) for layer in range(L)]
        self.host_locs = cupy.asnumpy(c.host_locs)

    def snapshot(self, layer):
        import cupy

        c = self.c
        return dict(slot_tokens=cupy.asnumpy(c.slot_tokens[layer]),
                    slot_locs=cupy.asnumpy(c.slot_locs[layer]),
                    scratch_locs=cupy.asnumpy(c.scratch_locs[layer]),
                    lru=cupy.asnumpy(c.lru[layer]), ref=cupy.asnumpy(c.ms_ref[layer]),
                    clock=cupy.asnumpy(c.ms_clock[layer]))

    def topk(self, req, S=None, miss=0.2):
        rows = []
        for r in req:
            n = int(self.lens[r]) - 1  # the newest token is not selected here
            held = self.np[0]["slot_tokens"][r, :H]
            held = held[(held >= 0) & (held < n)]
            one = []
            for _ in range(S or 1):
                k_miss = int(K * miss)
                row = np.concatenate([self.rng.choice(held, K - k_miss, replace=False),
                                      self.rng.integers(0, n, k_miss)])
                self.rng.shuffle(row)
                row[self.rng.random(K) < 0.05] = -1
                one.append(row)
            rows.append(one if S else one[0])
        return np.asarray(rows, np.int32)

    def expect_single(self, layer, topk, req, nr=None):
        st = self.np[layer]
        return ref.swap_in(topk, req, self.lens[req], host_locs=self.host_locs,
                           slot_tokens=st["slot_tokens"], slot_locs=st["slot_locs"],
                           lru=st["lru"], hot_size=H, n_host_rows=self.c.pool.n_rows,
                           num_real=nr)

    def expect_multi(self, layer, topk, req, nr=None):
        import cupy

        st, c = self.np[layer], self.c
        B = topk.shape[0]
        cnt, src = cupy.asnumpy(c.plan.count[:B]), cupy.asnumpy(c.plan.src[:B])
        order = [src[b, : cnt[b]] - int(req[b]) * MAX_LEN for b in range(B)]
        lens = np.repeat(self.lens[req][:, None], topk.shape[1], axis=1)
        return ref.multistep_swap_in(
            topk, req, lens, host_locs=self.host_locs,
            slot_tokens=st["slot_tokens"], slot_locs=st["slot_locs"],
            scratch_locs=st["scratch_locs"], ref=st["ref"], clock=st["clock"], hot_size=H,
            n_host_rows=c.pool.n_rows, num_real=nr, miss_order=order)

    def verify(self, layer, topk, req, got, exp):
        import cupy

        c = self.c
        got = cupy.asnumpy(got)
        np.testing.assert_array_equal(got, exp.device_locs, err_msg=f"layer {layer} outputs")
        np.testing.assert_array_equal(cupy.asnumpy(c.status[: len(req)]), exp.status)
        now = self.snapshot(layer)
        for k, v in self.np[layer].items():
            np.testing.assert_array_equal(now[k], v, err_msg=f"layer {layer} {k}")
        ref.check_invariants(now["slot_tokens"], now["slot_locs"], now["lru"], H)
        ms = c.multistep_state(layer).to_numpy()
        ref.check_multistep_invariants(ms["slot_tokens"], ms["slot_locs"], ms["scratch_locs"],
                                       ms["token_slot"], ms["ref"], ms["clock"], H,
                                       n_device_rows=c.device.shape[1])
        flat_t = topk.reshape(len(req), -1)
        flat_o = got.reshape(len(req), -1)
        bb, ii = np.nonzero(flat_o >= 0)
        ids = np.asarray(req)[bb].astype(np.int64) * MAX_LEN + flat_t[bb, ii]
        rows = cupy.asnumpy(c.device_rows(layer)[cupy.asarray(flat_o[bb, ii])])
        bad = np.nonzero((rows != pattern(layer, ids, ROW)).any(axis=1))[0]
        assert bad.size == 0, f"layer {layer}: {bad.size} rows hold wrong bytes"


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

    from .plan import replay_plan

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

    from ._launch import pdl_supported

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
