"""GPU: the step API (plan once per step, run per layer) over one cache that serves single- and
multi-step calls, every stream kind a call accepts, and the adversarial probes of the validation.

The oracle state of each layer is driven alongside: single-step calls by
:func:`reference.swap_in` (slot tokens, LRU order), multi-step calls by
:func:`reference.multistep_swap_in` (slot tokens, rotated slot / scratch rows, epochs, clock),
both over the same slot tables; every output, every state array and every byte an output
points to must match, and both policies' invariants (the token -> slot table included, which
admissions of both write) must hold after every call.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from hisparse_cupy.testing.selfcheck import alternate
from hisparse_cupy.testing.twin import MAX_LEN, ROW, H, K, L, P, R, Twin, pattern

from _util import stream_kinds

pytestmark = pytest.mark.gpu


def test_single_and_multi_step_alternate_on_one_cache(rng, stream):
    """Both swaps read and write the one token -> slot table: every admission of either is
    seen by the next call of the other."""
    t = Twin(rng)
    assert alternate(t, rng, stream, 40) == 40 * L
    # release resets every table of the request, multi-step state and rotated rows included
    t.c.release(2, stream=stream)
    stream.synchronize()
    for layer in range(L):
        now = t.snapshot(layer)  # the cache's tables.named(), by the oracle's names
        assert (now["slot_tokens"][2] == -1).all()
        np.testing.assert_array_equal(now["slot_locs"][2], t.layout["slot_locs"][2])
        np.testing.assert_array_equal(now["scratch_locs"][2], t.layout["scratch_locs"][2])
        assert now["clock"][2].tolist() == [1, 0]
        assert (now["ref"][2] == 0).all()
    t.c.close()


def test_step_in_a_graph_equals_eager(rng, stream):
    """A whole step (single- and multi-step layers, padding rows) captured once and replayed
    with new inputs in the same buffers equals the same calls made eagerly on a twin cache."""
    import cupy

    seed = int(rng.integers(2**31))  # two twins of one state (lengths, admissions, tables)
    eager, graph = Twin(np.random.default_rng(seed)), Twin(np.random.default_rng(seed))
    with stream:
        B = R
        g_req = cupy.zeros(B, cupy.int32)
        g_len = cupy.zeros(B, cupy.int64)
        g_nr = cupy.zeros(1, cupy.int32)
        g_t1 = cupy.full((B, K), -1, cupy.int32)
        g_t3 = cupy.full((B, 3, K), -1, cupy.int32)
        step = graph.c.begin_step(g_req, g_len, g_nr, stream=stream)
        outs = [step.swap(0, g_t1, out=cupy.empty((B, K), cupy.int32)),
                step.swap(1, g_t3, out=cupy.empty((B, 3, K), cupy.int32))]
        stream.synchronize()  # warm-up compiled and loaded every kernel (nothing selected)
        stream.begin_capture()
        step.swap(0, g_t1, out=outs[0])
        step.swap(1, g_t3, out=outs[1])
        g = stream.end_capture()
    for it in range(12):
        nr = int(rng.integers(1, B + 1))
        req = rng.permutation(R)[:B]
        t1, t3 = eager.topk(req[:nr]), eager.topk(req[:nr], 3)
        e = eager.c.begin_step(cupy.asarray(req[:nr].astype(np.int32)),
                               cupy.asarray(eager.lens[req[:nr]]), stream=stream)
        w1 = cupy.asnumpy(e.swap(0, cupy.asarray(t1)))
        w3 = cupy.asnumpy(e.swap(1, cupy.asarray(t3)))
        pad1 = np.full((B, K), -1, np.int32)
        pad3 = np.full((B, 3, K), -1, np.int32)
        pad1[:nr], pad3[:nr] = t1, t3
        with stream:
            g_req.set(req.astype(np.int32), stream=stream)
            g_len.set(eager.lens[req].astype(np.int64), stream=stream)
            g_nr.set(np.array([nr], np.int32), stream=stream)
            g_t1.set(pad1, stream=stream)
            g_t3.set(pad3, stream=stream)
            g.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(outs[0])[:nr], w1, err_msg=f"it {it}")
        assert (cupy.asnumpy(outs[0])[nr:] == -1).all()
        got3 = cupy.asnumpy(outs[1])[:nr]
        # multi-step miss order may differ between runs: compare bytes through each cache
        for c, o in ((eager.c, w3), (graph.c, got3)):
            ids = req[:nr, None, None].astype(np.int64) * MAX_LEN + t3
            sel = o >= 0
            assert (sel == (t3 >= 0)).all()
            rows = cupy.asnumpy(c.device_rows(1)[cupy.asarray(o[sel])])
            assert (rows == pattern(1, ids[sel], ROW)).all()
        g0, e0 = graph.snapshot(0), eager.snapshot(0)
        for name in ("slot_tokens", "lru"):
            np.testing.assert_array_equal(g0[name], e0[name])
    eager.c.close()
    graph.c.close()


def test_every_stream_kind(rng):
    import cupy

    t = Twin(rng)
    for name, given, owner in stream_kinds(cupy):
        req = rng.permutation(R)[:4]
        topk = t.topk(req)
        step = t.c.begin_step(cupy.asarray(req.astype(np.int32)), cupy.asarray(t.lens[req]),
                              stream=given)
        assert step.stream.ptr == owner.ptr, name
        got = step.swap(0, cupy.asarray(topk))
        owner.synchronize()
        t.verify(0, topk, req, got, t.expect_single(0, topk, req))
        got = step.swap(1, cupy.asarray(t.topk(req, 2)))  # multi-step on the same stream
        owner.synchronize()
    t.c.close()


def test_torch_stream_orders_torch_work_before_the_swap(rng):
    torch = pytest.importorskip("torch")
    import cupy

    t = Twin(rng)
    ts = torch.cuda.Stream()
    req = rng.permutation(R)[:4]
    topk = t.topk(req)
    with torch.cuda.stream(ts):
        # torch writes the top-k on its stream, after a long kernel: the swap must see it
        torch.cuda._sleep(50_000_000)
        tk = torch.from_numpy(topk).cuda()
        rq = torch.from_numpy(req.astype(np.int32)).cuda()
        ln = torch.from_numpy(t.lens[req].astype(np.int64)).cuda()
    step = t.c.begin_step(rq, ln, stream=ts)
    got = step.swap(0, tk)
    assert cupy.from_dlpack(tk).data.ptr == tk.data_ptr()  # imported without a copy
    ts.synchronize()
    t.verify(0, topk, req, got, t.expect_single(0, topk, req))
    # the raw-handle spelling of the same stream
    step = t.c.begin_step(rq, ln, stream=ts.cuda_stream)
    assert step.stream.ptr == ts.cuda_stream
    t.c.close()


def test_prefetcher_on_an_external_stream(rng):
    import cupy

    from hisparse_cupy import Prefetcher

    t = Twin(rng)
    main = cupy.cuda.Stream(non_blocking=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ext = cupy.cuda.ExternalStream(main.ptr)
    pf = Prefetcher(t.c, "FSS")
    req = rng.permutation(R)[:5]
    for it in range(6):
        topk = t.topk(req, miss=0.3)
        step = t.c.begin_step(cupy.asarray(req.astype(np.int32)), cupy.asarray(t.lens[req]),
                              stream=ext, prefetcher=pf)
        outs = [step.swap(layer, cupy.asarray(topk) if layer == 0 else None)
                for layer in range(L)]
        step.finish()
        main.synchronize()
        exp = t.expect_single(0, topk, req)
        np.testing.assert_array_equal(cupy.asnumpy(outs[0]), exp.device_locs)
        for layer in range(L):  # shared layers: the full layer's rows hold their own bytes
            o = cupy.asnumpy(outs[layer])
            sel = o >= 0
            ids = req[:, None].astype(np.int64) * MAX_LEN + topk
            rows = cupy.asnumpy(t.c.device_rows(layer)[cupy.asarray(o[sel])])
            assert (rows == pattern(layer, ids[sel], ROW)).all(), (it, layer)
    pf.synchronize()
    t.c.close()


def test_probes_state_validation_and_sizes(rng, stream):
    import cupy

    from hisparse_cupy import swap_in

    t = Twin(rng)
    c = t.c
    st = c.state(0)
    req = cupy.asarray([0, 1], dtype=cupy.int32)
    lens = cupy.asarray(t.lens[[0, 1]])
    topk = cupy.asarray(t.topk([0, 1]))
    kw = dict(host_rows=c.pool.device_ptr(0), n_host_rows=c.pool.n_rows,
              device_rows=c.device[0], plan=c.plan)
    # slot_locs beyond device_rows: validate_state reports it and launches nothing
    before = cupy.asnumpy(c.tables.slot_tokens[0])
    c.tables.slot_locs[0, 1, 5] = c.device.shape[1] + 3
    with pytest.raises(ValueError, match=r"slot_locs\[1, 5\] = .* is outside the .* device rows"):
        swap_in(topk, req, lens, st, validate_state=True, **kw)
    np.testing.assert_array_equal(cupy.asnumpy(c.tables.slot_tokens[0]), before)
    c.tables.slot_locs[0, 1, 5] = int(t.np[0]["slot_locs"][1, 5])  # its value before
    c.tables.lru[0, 0, 3] = c.tables.lru[0, 0, 4]  # not a permutation any more
    with pytest.raises(ValueError, match=r"invalid state: lru\[0\] is not a permutation"):
        swap_in(topk, req, lens, st, validate_state=True, **kw)
    c.tables.lru[0, 0] = cupy.asarray(t.np[0]["lru"][0])
    # empty sizes are named as sizes
    with pytest.raises(ValueError, match=r"top_k_tokens must have K >= 1, got shape \(2, 0\)"):
        swap_in(cupy.zeros((2, 0), cupy.int32), req, lens, st, **kw)
    with pytest.raises(ValueError, match=r"top_k_tokens must have B >= 1, got shape \(0, 8\)"):
        swap_in(cupy.zeros((0, 8), cupy.int32), req[:0], lens[:0], st, **kw)
    with pytest.raises(ValueError, match="req_indices must hold at least one batch row"):
        c.begin_step(req[:0], lens[:0])
    # repeated invalid request slots are not "repeats": they get the bad-row status
    bad_req = cupy.asarray([-1, -1], dtype=cupy.int32)
    with pytest.raises(ValueError, match=r"row 0 .*request slot out of range"):
        swap_in(topk, bad_req, lens, st, check=True, **kw)
    with pytest.raises(ValueError, match=r"repeats request slot\(s\) \[1\]"):
        swap_in(topk, cupy.asarray([1, 1], dtype=cupy.int32), lens, st, check=True, **kw)
    # check=True raises after the call completed: the valid row was resolved and admitted
    tk = t.topk([0, 1], miss=0.5)
    tk[1, 0] = MAX_LEN + 5  # out of range in row 1
    with pytest.raises(ValueError, match=r"row 1 .*outside"):
        c.begin_step(req, lens, stream=stream).swap(0, cupy.asarray(tk), check=True)
    exp = t.expect_single(0, tk, np.array([0, 1]))
    np.testing.assert_array_equal(cupy.asnumpy(c.step_parts.out[:2]), exp.device_locs)
    np.testing.assert_array_equal(cupy.asnumpy(c.tables.slot_tokens[0]), t.np[0]["slot_tokens"])
    # the step's own checks
    with pytest.raises(ValueError, match=r"batch must be in \[1, max_batch=6\]"):
        c.begin_step(cupy.zeros(7, cupy.int32), cupy.zeros(7, cupy.int32))
    with pytest.raises(ValueError, match=r"seq_lens must have shape \(2,\) or \(2, S\)"):
        c.begin_step(req, cupy.zeros(3, cupy.int32))
    step = c.begin_step(req, lens)
    with pytest.raises(ValueError, match=r"top_k_tokens must have shape \(2, K\)"):
        step.swap(0, cupy.zeros((3, 8), cupy.int32))
    with pytest.raises(ValueError, match=r"1..24 entries per row"):
        step.swap(0, cupy.zeros((2, 25), cupy.int32))
    with pytest.raises(TypeError, match="stream must be a CuPy stream"):
        c.begin_step(req, lens, stream="main")
    c.close()


def test_admit_from_prefill_kv_on_the_gpu(rng, stream):
    """Prefill KV already on the GPU goes device -> host rows on the stream (no host sync);
    a NumPy one is written by the CPU; a torch tensor goes through DLPack. The swap then returns
    every request's bytes."""
    import cupy

    from hisparse_cupy import HotBufferCache

    R4, n = 4, 300
    c = HotBufferCache(n_layers=L, max_requests=R4, max_len=MAX_LEN, row_bytes=ROW, hot_size=H,
                       top_k=K, extra_page=P)

    def host(r):
        return np.stack([pattern(layer, r * MAX_LEN + np.arange(n), ROW) for layer in range(L)])

    assert c.admit(n, kv=cupy.asarray(host(0)), stream=stream) == 0  # CuPy, contiguous
    assert c.admit(n, kv=host(1), stream=stream) == 1  # NumPy: the CPU writes it
    big = cupy.zeros((L, n + 7, ROW), cupy.uint8)  # a strided layer dimension, rows contiguous
    big[:, :n] = cupy.asarray(host(2))
    assert c.admit(n, kv=big[:, :n], warm_tokens=None, stream=stream) == 2
    with pytest.raises(ValueError, match="kv must have contiguous rows"):
        c.write_host(2, 0, big[:, ::2][:, :10], stream=stream)  # every other row
    try:
        import torch

        kv3 = torch.from_numpy(host(3)).cuda()
    except ImportError:
        kv3 = cupy.asarray(host(3))
    assert c.admit(n, kv=kv3, stream=stream) == 3
    req = cupy.arange(R4, dtype=cupy.int32)
    lens = cupy.full(R4, n, dtype=cupy.int32)
    topk = np.stack([rng.choice(n - 1, K, replace=False) for _ in range(R4)]).astype(np.int32)
    step = c.begin_step(req, lens, stream=stream)
    for layer in range(L):
        got = cupy.asnumpy(step.swap(layer, cupy.asarray(topk)))
        stream.synchronize()
        for b in range(R4):
            rows = cupy.asnumpy(c.device_rows(layer)[cupy.asarray(got[b])])
            assert (rows == pattern(layer, b * MAX_LEN + topk[b], ROW)).all(), (layer, b)
    # a released slot's host rows are rewritten by the CPU only after the release's work
    c.release(1, stream=stream)
    assert c.admit(n, kv=host(1), stream=stream) == 1
    c.close()


# ---------------------------------------------------------------- issue 23's defects
def _repro():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import repro_step_api

    return repro_step_api


@pytest.mark.parametrize("P, S", [(1, 2), (2, 3), (3, 4), (4, 4)])
def test_newest_token_in_every_draft_step_gets_one_row(P, S, stream):
    assert _repro().case_a(P, S, stream)


def test_prefetch_reenabled_after_multistep_steps_mirrors_shared_rows(stream):
    assert _repro().case_b(stream, np.random.default_rng(23))


def test_construction_is_ordered_before_a_busy_streams_admission():
    assert _repro().case_c(np.random.default_rng(0))


def test_mirror_layer_equals_the_oracle(rng, stream):
    """HotBufferCache.mirror_layer against reference.mirror_layer, after multi-step calls left
    two layers in different layouts (every byte of every slot row compared)."""
    import cupy

    from hisparse_cupy import HotBufferCache
    from hisparse_cupy import reference as refm

    c = HotBufferCache(n_layers=2, max_requests=3, max_len=400, row_bytes=32, hot_size=64,
                       top_k=16, extra_page=4, max_steps=4)
    for layer in range(2):
        c.pool.layer(layer)[:] = pattern(layer, np.arange(c.pool.n_rows), 32)
    req = [c.admit(int(n), stream=stream) for n in (300, 40, 250)]
    d_req = cupy.asarray(np.asarray(req, np.int32))
    lens = np.array([300, 40, 250])
    for _ in range(5):
        for layer in range(2):
            tk = np.stack([np.stack([rng.integers(0, n - 1, 16) for _ in range(4)])
                           for n in lens]).astype(np.int32)
            c.begin_step(d_req, cupy.asarray(lens), stream=stream).swap(layer, cupy.asarray(tk))
    stream.synchronize()
    tabs = {k: cupy.asnumpy(v) for k, v in c.tables.named().items()}
    src = {k: v[0] for k, v in tabs.items()}
    dst = {k: v[1].copy() for k, v in tabs.items()}
    assert (src["slot_locs"] != dst["slot_locs"]).any()  # the layouts did diverge
    dev = cupy.asnumpy(c.device[1])
    refm.mirror_layer(src, dst, host_locs=cupy.asnumpy(c.host_locs), dst_device=dev,
                      dst_host=c.pool.numpy[1])
    c.mirror_layer(0, 1, stream=stream)
    stream.synchronize()
    for k, v in c.tables.named().items():
        np.testing.assert_array_equal(cupy.asnumpy(v[1]), dst[k], err_msg=k)
    held = src["slot_tokens"] >= 0
    rows = src["slot_locs"][held]
    np.testing.assert_array_equal(cupy.asnumpy(c.device[1])[rows], dev[rows])
    # every existing token's row holds layer 1's bytes of it (positional slots past a short
    # request's length hold no token yet)
    lens_of = np.zeros(3, np.int64)
    lens_of[req] = lens
    real = held & (src["slot_tokens"] < lens_of[:, None])
    ids = (np.nonzero(real)[0] * 400 + src["slot_tokens"][real]).astype(np.int64)
    np.testing.assert_array_equal(dev[src["slot_locs"][real]], pattern(1, ids, 32))
    c.close()


def test_a_prefetched_step_refuses_out_and_copy_grid_and_checks(stream):
    import cupy

    from hisparse_cupy import HotBufferCache
    from hisparse_cupy.streams import Prefetcher

    c = HotBufferCache(n_layers=2, max_requests=2, max_len=300, row_bytes=16, hot_size=32,
                       top_k=8, extra_page=4)
    pf = Prefetcher(c, "FS")
    rid = c.admit(200, stream=stream)
    step = c.begin_step(cupy.asarray([rid], cupy.int32), cupy.asarray([200]), stream=stream,
                        prefetcher=pf)
    tk = cupy.full((1, 8), 250, cupy.int32)  # every entry out of range
    for kw in (dict(out=cupy.empty((1, 8), cupy.int32)), dict(copy_grid=4)):
        with pytest.raises(ValueError, match="do not apply to a step driven by a prefetcher"):
            step.swap(0, tk, **kw)
    with pytest.raises(ValueError, match="8 token\\(s\\) outside"):
        step.swap(0, tk, check=True)
    with pytest.raises(ValueError, match="8 token\\(s\\) outside"):
        step.swap(1, None, check=True)  # the shared layer reports its full layer's status
    step.finish()
    with pytest.raises(ValueError, match="layer 2 is outside|layer must be <= 1"):
        c.begin_step(cupy.asarray([rid], cupy.int32), cupy.asarray([200]), stream=stream,
                     prefetcher=pf).swap(2, tk)
    with pytest.raises(ValueError, match="layer must be"):
        c.begin_step(cupy.asarray([rid], cupy.int32), cupy.asarray([200]),
                     stream=stream).swap(2, tk)
    c.close()
