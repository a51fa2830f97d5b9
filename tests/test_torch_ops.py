"""``hisparse_cupy.torch``: the step as torch.library operators.

CPU: without torch the import names the extra. GPU (torch installed): a model step that calls
the operators, compiled with ``torch.compile(fullgraph=True)``, gives the bytes of its eager
twin and of the oracle, also captured in a ``torch.cuda.CUDAGraph`` and replayed on new inputs,
with and without a Prefetcher, single- and multi-step calls alternating; a copy of the cache's
rows handed to an operator is refused. The operators keep their program order (ordered
effects) in the compiled graph.
"""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

from hisparse_cupy.testing.twin import MAX_LEN, ROW, K, L, R, Twin, pattern, twin_tables


def test_without_torch_the_import_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    monkeypatch.delitem(sys.modules, "hisparse_cupy.torch", raising=False)
    with pytest.raises(ImportError, match=r"needs PyTorch.*hisparse_cupy\[interop\]"):
        import hisparse_cupy.torch  # noqa: F401


def _torch():
    return pytest.importorskip("torch", reason="needs PyTorch (the interop extra)")


def _inputs(torch, t: Twin, req, S, miss):
    topk = t.topk(req, S=S, miss=miss)
    dev = dict(req=torch.from_numpy(req.astype(np.int32)).cuda(),
               lens=torch.from_numpy(t.lens[req]).cuda(),
               tk=torch.from_numpy(topk).cuda())
    return topk, dev


def _model(torch, tc, prefetch: bool):
    """A step over every layer: swap, gather the selected rows, the newest rows; shared layers
    (prefetch) get their full layer's top-k (ignored by the operator); each full layer's
    ``before_indexer`` first (without a prefetcher, layer 0's: a checked no-op)."""
    full = tc.prefetcher.pattern.full if tc.prefetcher is not None else (True,) + (False,) * (L - 1)

    def step(req, lens, tk):
        locs, rows = [], []
        tk = tk + 0  # an intermediate (its memory may be reused once the full layer's op ran)
        for layer in range(L):
            if full[layer]:
                tc.before_indexer(layer)
            loc = tc.swap(layer, tk, req, lens)
            locs.append(loc)
            kv = tc.device_rows[layer][loc.clamp(min=0).long()]
            rows.append(kv * (loc >= 0).unsqueeze(-1).to(kv.dtype))  # zero for -1 entries
        newest = tc.newest_rows(req, lens)
        tc.finish()
        return torch.stack(locs), torch.stack(rows), newest

    return step


def _check_bytes(t: Twin, req, topk, locs, rows) -> None:
    """Every valid entry's row holds its layer's bytes of its token; -1 exactly where the top-k
    is -1 (the twin's tokens all have host rows)."""
    ids = req.astype(np.int64)[:, None] * MAX_LEN + topk.reshape(len(req), -1)
    for layer in range(L):
        o = locs[layer].reshape(len(req), -1)
        np.testing.assert_array_equal(o < 0, topk.reshape(len(req), -1) < 0)
        sel = o >= 0
        got = rows[layer].reshape(len(req), -1, ROW)[sel]
        assert (got == pattern(layer, ids[sel], ROW)).all(), layer


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [None, "FSS", "FSF"],
                         ids=["plain", "prefetcher", "prediction-at-the-indexer"])
def test_compiled_and_graphed_steps_equal_eager_and_the_oracle(rng, prefetch):
    torch = _torch()
    pytest.importorskip("triton", reason="torch.compile's default backend (Inductor) needs Triton")

    from hisparse_cupy import Prefetcher
    from hisparse_cupy.torch import TorchCache

    seed = int(rng.integers(2**31))
    twins = [Twin(np.random.default_rng(seed)) for _ in range(2)]  # eager, compiled
    caches = [TorchCache(t.c, Prefetcher(t.c, prefetch, predict=prefetch == "FSF",
                                         predict_at="indexer") if prefetch else None)
              for t in twins]
    eager = _model(torch, caches[0], prefetch)
    graphed = torch.compile(_model(torch, caches[1], prefetch), fullgraph=True)
    B = 4
    static = graph = None
    diverged = stageable = False
    cap = torch.cuda.Stream()
    main = torch.cuda.Stream()  # a prefetcher needs a stream other than the legacy one
    with torch.cuda.stream(main):
        for it in range(10):
            req = rng.permutation(R)[:B]
            S = int(rng.choice([1, 1, 2]))  # single- and multi-step calls alternating
            miss = float(rng.choice([0.0, 0.2, 0.6]))
            topk, dev = _inputs(torch, twins[0], req, None if S == 1 else S, miss)
            stageable |= S == 1 and miss > 0  # prediction has misses to stage
            outs = [eager(**dev)]
            # the compiled step: single-step calls through a CUDA graph of it, captured on the
            # first (after a run of the compiled step to compile it) and replayed on its buffers
            # with new inputs; multi-step calls run the compiled step as it is
            if S == 1:
                if graph is None:
                    static = {k: v.clone() for k, v in dev.items()}
                    cap.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(cap):
                        g_out = graphed(**static)  # compiles; runs the step once
                    cap.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=cap):
                        g_static = graphed(**static)
                    # the capture ran nothing: the twin's next step is the first replay
                    outs.append(g_out)
                else:
                    for k, v in dev.items():
                        static[k].copy_(v)
                    graph.replay()
                    outs.append(tuple(x.clone() for x in g_static))
            else:
                outs.append(graphed(**dev))
            torch.cuda.synchronize()
            for o in outs:  # every run: its layers' bytes of the selected tokens
                _check_bytes(twins[0], req, topk, o[0].cpu().numpy(), o[1].cpu().numpy())
                assert torch.equal(outs[0][1], o[1]), (it, S)
                assert bool((o[2] >= 0).all()), (it, S)  # a row for every newest token
            locs = outs[0][0].cpu().numpy()
            assert (locs >= 0).sum() > L * B * K // 2  # real rows were compared
            # multi-step misses take scratch rows in the order the gather's threads claim them:
            # from such a call on, the caches' row layouts may differ (not their bytes)
            diverged |= S > 1
            if not diverged:  # the same row layout: the same page tables and newest rows
                for o in outs[1:]:
                    assert torch.equal(outs[0][0], o[0]) and torch.equal(outs[0][2], o[2]), it
            if S == 1 and not diverged and not prefetch:  # the eager twin against the oracle
                for layer in range(L):
                    exp = twins[0].expect_single(layer, topk, req)
                    np.testing.assert_array_equal(locs[layer], exp.device_locs)
            else:  # the oracle's tables follow the cache's (the top-k draws read them)
                twins[0].np = [twin_tables(twins[0].snapshot(layer)) for layer in range(L)]
    assert graph is not None
    for c in caches:
        if c.prefetcher is not None:
            c.prefetcher.synchronize()
            if c.prefetcher.predict and stageable:  # the operator launched stagings, used
                assert c.prefetcher.predict_summary()["used"] > 0
    for t in twins:
        t.c.close()


@pytest.mark.gpu
def test_a_copy_of_the_rows_or_a_dead_cache_is_refused(rng):
    torch = _torch()

    from hisparse_cupy.torch import TorchCache

    t = Twin(rng)
    tc = TorchCache(t.c)
    req = np.arange(2)
    _, dev = _inputs(torch, t, req, None, 0.2)
    before = t.c.tables.slot_tokens.get()
    with pytest.raises(RuntimeError, match=r"copy of TorchCache.device_rows"):
        torch.ops.hisparse.swap(tc.id, 0, dev["tk"], dev["req"], dev["lens"], None,
                                tc.device_rows.clone())
    np.testing.assert_array_equal(t.c.tables.slot_tokens.get(), before)  # nothing ran
    gone = TorchCache(t.c)
    gone_id = gone.id
    del gone
    gc.collect()
    with pytest.raises(ValueError, match=rf"no live TorchCache with id {gone_id}"):
        torch.ops.hisparse.swap(gone_id, 0, dev["tk"], dev["req"], dev["lens"], None,
                                tc.device_rows)
    # a prefetched shared layer returns its full layer's page table: its top-k must have that
    # shape (the compiled graph's fake result has the top-k's)
    from hisparse_cupy import Prefetcher

    pc = TorchCache(t.c, Prefetcher(t.c, "FSS"))
    main = torch.cuda.Stream()
    with torch.cuda.stream(main):
        pc.swap(0, dev["tk"], dev["req"], dev["lens"])
        with pytest.raises(ValueError, match="layer 1 is a shared layer"):
            pc.swap(1, dev["tk"][:, :8].contiguous(), dev["req"], dev["lens"])
        pc.finish()
    main.synchronize()
    pc.prefetcher.synchronize()
    with pytest.raises(TypeError, match="cache must be a HotBufferCache"):
        TorchCache(object())
    t.c.close()


@pytest.mark.gpu
def test_a_compiled_kv_write_and_backup_reach_the_cache_and_the_host(rng):
    """The engine's end of a step, compiled: the newest rows, the model's KV written into the
    cache's rows in place, the backup to the host rows; then a graph of it, replayed."""
    torch = _torch()
    pytest.importorskip("triton", reason="torch.compile's default backend (Inductor) needs Triton")

    from hisparse_cupy.torch import TorchCache

    t = Twin(rng)
    tc = TorchCache(t.c)

    @torch.compile(fullgraph=True)
    def end_of_step(req, lens, kv):
        newest = tc.newest_rows(req, lens)
        tc.device_rows[:, newest.long()] = kv  # [L, B, ROW] into every layer's row
        return tc.backup_newest(req, lens)

    B = 3
    static = graph = None
    for it in range(4):
        req = rng.permutation(R)[:B]
        t.lens[req] = np.minimum(t.lens[req] + 1, MAX_LEN)  # the step's new token
        dev = dict(req=torch.from_numpy(req.astype(np.int32)).cuda(),
                   lens=torch.from_numpy(t.lens[req]).cuda(),
                   kv=torch.from_numpy(rng.integers(0, 256, (L, B, ROW), dtype=np.uint8)).cuda())
        if it < 2:
            rows = end_of_step(**dev)
        else:
            if graph is None:
                static = {k: v.clone() for k, v in dev.items()}
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    g_rows = end_of_step(**static)
            for k, v in dev.items():
                static[k].copy_(v)
            graph.replay()
            rows = g_rows
        torch.cuda.synchronize()
        kv = dev["kv"].cpu().numpy()
        r = rows.cpu().numpy()
        assert (r >= 0).all(), it
        dev_rows = tc.device_rows.cpu().numpy()
        for layer in range(L):
            np.testing.assert_array_equal(dev_rows[layer][r], kv[layer], err_msg=f"{it} {layer}")
            host = req * MAX_LEN + t.lens[req] - 1  # the newest token's host row
            np.testing.assert_array_equal(t.c.pool.layer(layer)[host], kv[layer],
                                          err_msg=f"host {it} {layer}")
    t.c.close()


@pytest.mark.gpu
def test_a_reused_step_follows_a_cache_call_on_another_busy_stream():
    """The TorchCache reuses its Step while the buffers and the stream stay the same; a cache
    call between two steps on another stream (a rewritten token's ``write_host`` on a copy
    stream still busy) must come before the next step's swap, as ``begin_step`` orders it:
    the rewritten token is served its new bytes, not its old hot copy."""
    torch = _torch()
    import cupy

    from hisparse_cupy import HotBufferCache
    from hisparse_cupy.torch import TorchCache

    n_layers, row = 2, 16

    def kv(a, n, v=0):
        t = ((np.arange(a, a + n) * 3 + v) % 256).astype(np.uint8)
        return np.broadcast_to(t[None, :, None], (n_layers, n, row)).copy()

    spin = cupy.RawKernel(r'extern "C" __global__ void spin(long long n) {'
                          r' long long t = clock64(); while (clock64() - t < n); }', "spin")
    c = HotBufferCache(n_layers=n_layers, max_requests=2, max_len=256, row_bytes=row,
                       hot_size=16, top_k=4, extra_page=4)
    try:
        tc = TorchCache(c)
        S, X = torch.cuda.Stream(), cupy.cuda.Stream(non_blocking=True)
        rid = c.admit(40, kv(0, 40))
        cupy.cuda.Device().synchronize()
        d = dict(dtype=torch.int32, device="cuda")
        with torch.cuda.stream(S):
            req, lens = torch.tensor([rid], **d), torch.tensor([41], **d)
            tk = torch.tensor([[30, 31, 32, 40]], **d)

        def step(seq):
            with torch.cuda.stream(S):
                lens.fill_(seq)
                r = tc.newest_rows(req, lens).long()
                for layer in range(n_layers):
                    tc.device_rows[layer][r] = torch.as_tensor(kv(seq - 1, 1)[layer],
                                                               device="cuda")
                tc.backup_newest(req, lens)
                o = tc.swap(0, tk, req, lens)
                tc.finish()
            S.synchronize()
            o = o.cpu().numpy()[0]
            return cupy.asnumpy(c.device_rows(0)[cupy.asarray(o)])[:, 0]

        assert step(41)[1] == kv(31, 1)[0, 0, 0]  # token 31 now in a hot slot
        with X:
            spin((1,), (1,), (np.int64(1_000_000_000),))  # the copy stream is busy
        c.write_host(rid, 31, cupy.asarray(kv(31, 1, 100)), stream=X)  # rewritten
        assert step(42)[1] == kv(31, 1, 100)[0, 0, 0]
    finally:
        cupy.cuda.Device().synchronize()
        c.close()
