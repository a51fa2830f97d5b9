"""hisparse_cupy.interop: zero-copy views to and from PyTorch and JAX, and the order across
their streams.

CPU: importing the module imports neither framework, a missing one names the extra, arguments
are named in errors. GPU: data pointers are unchanged both ways; work another library queued on
its stream is ordered before the swap that reads it, and the swap before the other library's
read, each checked against the oracle and the bytes; a ``torch.cuda.graph`` capture of a step
(torch tensors passed straight to the ops) equals the same steps run eagerly; both examples run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from hisparse_cupy.testing.twin import MAX_LEN, ROW, K, L, R, Twin, pattern

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


# ----------------------------------------------------------------------------- CPU
def test_importing_interop_imports_neither_torch_nor_jax():
    code = ("import sys, hisparse_cupy.interop; "
            "print([m for m in ('torch', 'jax', 'jaxlib') if m in sys.modules])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


@pytest.mark.parametrize("fn, module", [("to_torch", "torch"), ("torch_stream", "torch"),
                                        ("to_jax", "jax")])
def test_a_missing_framework_names_the_extra(monkeypatch, fn, module):
    from hisparse_cupy import interop

    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled package looks like
    if module == "jax":
        monkeypatch.setitem(sys.modules, "jax.dlpack", None)
    with pytest.raises(ImportError, match=rf"interop\.{fn} needs {module}, which is not "
                                          rf"installed: pip install 'hisparse_cupy\[interop\]'"):
        getattr(interop, fn)(None)


def test_errors_name_the_argument(monkeypatch, rng):
    from hisparse_cupy import interop

    host = rng.integers(0, 1000, (2, 8)).astype(np.int32)
    with pytest.raises(TypeError, match="top_k must be a GPU array, got a NumPy"):
        interop.as_cupy(host, name="top_k")
    with pytest.raises(TypeError, match=r"req must be a GPU array \(cupy, or DLPack-capable\)"):
        interop.as_cupy(host.tolist(), name="req")
    # a value traced by jax.jit is named as such (recognized without importing JAX)
    tracer = type("Tracer", (), {"__module__": "jax._src.core"})
    jit_tracer = type("JitTracer", (tracer,), {"__dlpack__": lambda self: None})
    with pytest.raises(TypeError, match="seq_lens is a traced JAX value: .* inside jax.jit"):
        interop.as_cupy(jit_tracer(), name="seq_lens")
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    with pytest.raises(TypeError, match="a must be a CuPy array .* got ndarray"):
        interop.to_torch(host)


def test_dense_layouts_are_what_jax_imports(rng):
    from hisparse_cupy.interop import _compact

    a = rng.integers(0, 256, (5, 7, 64)).astype(np.uint8)
    assert _compact(a) and _compact(a[1:]) and _compact(a.transpose(2, 0, 1))
    assert _compact(a[2:3].transpose(1, 0, 2)) and _compact(a[4, 6:])  # size 1: any stride
    for gaps in (a[:, :3], a[:, :1], a[:, 3], a[..., ::2], a[:, ::2]):
        assert not _compact(gaps), gaps.strides


# ----------------------------------------------------------------------------- GPU
def _torch():
    return pytest.importorskip("torch", reason="needs PyTorch (the interop extra)")


def _jax():
    jax = pytest.importorskip("jax", reason="needs JAX (the interop extra)")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip(f"JAX has no GPU backend (install jax[cuda12]); it sees {jax.devices()}")
    return jax


def _spin(cycles: int) -> None:
    """Keep CuPy's current stream busy for ``cycles`` GPU clock cycles (one thread)."""
    from hisparse_cupy.testing._spin import spin

    spin(cycles)


@pytest.mark.gpu
def test_torch_views_share_memory_both_ways(rng):
    torch = _torch()
    import cupy

    from hisparse_cupy.interop import as_cupy, cupy_stream, to_torch, torch_stream

    x = torch.from_numpy(rng.integers(-2**31, 2**31 - 1, (6, 40)).astype(np.int32)).cuda()
    c = as_cupy(x[:, 3:], name="top_k")  # a strided view: rows stay 160 bytes apart
    assert c.data.ptr == x[:, 3:].data_ptr() and c.strides == (160, 4)
    np.testing.assert_array_equal(cupy.asnumpy(c), x[:, 3:].cpu().numpy())
    assert as_cupy(c) is c
    a = cupy.asarray(rng.integers(0, 256, (5, 7, 64)).astype(np.uint8))
    t = to_torch(a[1:, ::2])
    assert t.data_ptr() == a[1:, ::2].data.ptr and t.dtype == torch.uint8
    assert t.stride() == (448, 128, 1)
    np.testing.assert_array_equal(t.cpu().numpy(), cupy.asnumpy(a[1:, ::2]))
    t[0, 0, :8] = torch.arange(8, dtype=torch.uint8, device="cuda") + 200  # one memory
    torch.cuda.current_stream().synchronize()
    assert cupy.asnumpy(a[1, 0, :8]).tolist() == list(range(200, 208))
    with pytest.raises(TypeError, match="seq_lens must be a GPU array; DLPack import failed"):
        as_cupy(torch.zeros(4, dtype=torch.int32), name="seq_lens")  # a CPU tensor
    # one stream, as each library names it
    s = cupy.cuda.Stream(non_blocking=True)
    ts = torch_stream(s)
    assert ts.cuda_stream == s.ptr and torch_stream(ts) is ts
    assert torch_stream(cupy.cuda.Stream.null).cuda_stream == \
        torch.cuda.default_stream().cuda_stream
    assert cupy_stream(ts).ptr == s.ptr and cupy_stream(s) is s


@pytest.mark.gpu
def test_jax_views_share_memory_both_ways(rng):
    jax = _jax()
    import cupy
    import jax.numpy as jnp

    from hisparse_cupy.interop import as_cupy, to_jax

    x = jnp.asarray(rng.integers(-2**31, 2**31 - 1, (6, 40)).astype(np.int32))
    c = as_cupy(x, name="top_k")
    assert c.data.ptr == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(cupy.asnumpy(c), np.asarray(x))
    a = cupy.asarray(rng.integers(0, 256, (5, 7, 64)).astype(np.uint8))
    for view in (a, a[1:], a.transpose(2, 0, 1)):
        j = to_jax(view)
        assert j.unsafe_buffer_pointer() == view.data.ptr and j.shape == view.shape
        np.testing.assert_array_equal(np.asarray(j), cupy.asnumpy(view))
    with pytest.raises(ValueError, match=r"a must have a dense layout for JAX"):
        to_jax(a[:, :3])
    with pytest.raises(TypeError, match="a must be a CuPy array"):
        to_jax(x)

    @jax.jit
    def inside(v):
        as_cupy(v, name="top_k")
        return v

    with pytest.raises(TypeError, match="top_k is a traced JAX value: .* inside jax.jit"):
        inside(x)


@pytest.mark.gpu
def test_torch_stream_order_both_ways_across_streams(rng):
    """The top-k is written on a torch stream after a long kernel; the swap runs on another
    (CuPy) stream and must read it (as_cupy orders it); torch reads the swap's output on a third
    stream while the swap is held back by a long kernel, and must see the result (to_torch
    orders it). Every kernel is compiled before, so no host delay hides a missing order."""
    torch = _torch()
    import cupy

    from hisparse_cupy.interop import as_cupy, to_torch

    t = Twin(rng)
    s = cupy.cuda.Stream(non_blocking=True)  # the cache's stream: neither of torch's
    producer, reader = torch.cuda.Stream(), torch.cuda.Stream()
    req = rng.permutation(R)[:4]
    topk = t.topk(req)
    with s:
        d_req = cupy.asarray(req.astype(np.int32))
        d_lens = cupy.asarray(t.lens[req])
        out = cupy.full((4, K), -7, cupy.int32)
        unused = np.full((4, K), -1, np.int32)  # compiles the swap, selects nothing
        t.c.begin_step(d_req, d_lens, stream=s).swap(0, cupy.asarray(unused))
        _spin(1000)
    s.synchronize()
    t.expect_single(0, unused, req)
    with torch.cuda.stream(producer):
        src = torch.from_numpy(topk).cuda()
        tk = torch.full((4, K), -1, dtype=torch.int32, device="cuda")
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the top-k lands long after the calls return
        tk.copy_(src)
        c_tk = as_cupy(tk, stream=s, name="top_k")  # s waits for the producer's work
    assert c_tk.data.ptr == tk.data_ptr()
    with s:
        _spin(50_000_000)  # then ~25 ms more on s (shorter: it must not cover the sleep)
    got = t.c.begin_step(d_req, d_lens, stream=s).swap(0, c_tk, out=out)
    with torch.cuda.stream(reader):
        seen = to_torch(got, stream=s).clone()  # the reader waits for s
    reader.synchronize()
    s.synchronize()
    producer.synchronize()
    exp = t.expect_single(0, topk, req)
    t.verify(0, topk, req, out, exp)  # outputs, state and bytes equal the oracle's
    np.testing.assert_array_equal(seen.cpu().numpy(), exp.device_locs)
    t.c.close()


@pytest.mark.gpu
def test_jax_stream_order_both_ways(rng):
    """A jitted JAX result read by CuPy right after dispatch, and a CuPy result read by JAX while
    CuPy's stream is held back: each reader sees the finished values (no host sync between).
    Two rounds on fresh values: the first compiles everything, so in the second no host delay
    hides a missing order."""
    jax = _jax()
    import cupy
    import jax.numpy as jnp

    from hisparse_cupy.interop import as_cupy, to_jax

    s = cupy.cuda.Stream(non_blocking=True)

    @jax.jit
    def slow(x, m):  # 100 float32 products by the identity, + 1 each: exact, ~0.2 s
        step = lambda i, v: jnp.matmul(v, m, precision="highest") + 1.0  # noqa: E731
        return jax.lax.fori_loop(0, 100, step, x)

    eye = jnp.eye(4096, dtype=jnp.float32)
    for _ in range(2):
        x0 = rng.integers(1, 1000, (4096, 4096)).astype(np.float32)
        x0_j = jnp.asarray(x0)
        x0_j.block_until_ready()
        y = slow(x0_j, eye)  # dispatched, running
        view = as_cupy(y, stream=s, name="y")  # s waits for JAX's computation, on the device
        with s:
            snap = view.copy()
        s.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(snap), x0 + 100)

        vals = rng.integers(-2**31 + 1, 2**31 - 1, 1 << 20).astype(np.int32)
        with s:
            src = cupy.asarray(vals)
            dst = cupy.zeros(vals.size, cupy.int32)
            _spin(200_000_000)  # ~0.1 s
            dst[...] = src
        j = to_jax(dst, stream=s)  # JAX waits for s before reading, on the device
        assert j.unsafe_buffer_pointer() == dst.data.ptr
        np.testing.assert_array_equal(np.asarray(jnp.negative(j)), -vals)
        s.synchronize()


@pytest.mark.gpu
def test_jax_top_k_through_a_swap_to_jax_rows(rng, stream):
    """A JAX top-k swapped in without a copy; JAX gathers the device rows through views."""
    _jax()
    import cupy
    import jax.numpy as jnp

    from hisparse_cupy.interop import as_cupy, to_jax

    t = Twin(rng)
    req = rng.permutation(R)[:5]
    topk = t.topk(req, miss=0.4)
    topk_j = jnp.asarray(topk)
    tk = as_cupy(topk_j, stream=stream, name="top_k")
    assert tk.data.ptr == topk_j.unsafe_buffer_pointer()
    step = t.c.begin_step(cupy.asarray(req.astype(np.int32)), cupy.asarray(t.lens[req]),
                          stream=stream)
    got = step.swap(1, tk)
    locs_j, rows_j = to_jax(got, stream=stream), to_jax(t.c.device_rows(1), stream=stream)
    assert locs_j.unsafe_buffer_pointer() == got.data.ptr
    assert rows_j.unsafe_buffer_pointer() == t.c.device_rows(1).data.ptr
    read = np.asarray(rows_j[jnp.maximum(locs_j, 0)])  # JAX's gather, [5, K, ROW]
    stream.synchronize()
    exp = t.expect_single(1, topk, req)
    t.verify(1, topk, req, got, exp)
    sel = exp.device_locs >= 0
    ids = req[:, None].astype(np.int64) * MAX_LEN + topk
    assert sel.sum() > K and (read[sel] == pattern(1, ids[sel], ROW)).all()
    t.c.close()


@pytest.mark.gpu
@pytest.mark.parametrize("cupy_current", [False, True], ids=["as-is", "cupy_stream"])
def test_torch_graph_of_a_step_equals_eager(rng, cupy_current):
    """A step over three layers, torch tensors passed straight to begin_step and swap (their
    DLPack imports land on the step's stream, so the capture holds) and a torch gather of the
    rows, captured with torch.cuda.graph and replayed on
    new inputs in its buffers, equals the same steps run eagerly on a twin cache, which equals
    the oracle."""
    torch = _torch()

    import contextlib

    import cupy

    from hisparse_cupy.interop import cupy_stream, to_torch

    seed = int(rng.integers(2**31))
    eager, graphed = Twin(np.random.default_rng(seed)), Twin(np.random.default_rng(seed))
    B = 4
    side, cap = torch.cuda.Stream(), torch.cuda.Stream()

    def buffers():
        return dict(req=torch.zeros(B, dtype=torch.int32, device="cuda"),
                    lens=torch.zeros(B, dtype=torch.int64, device="cuda"),
                    tk=torch.full((B, K), -1, dtype=torch.int32, device="cuda"),
                    locs=torch.zeros((L, B, K), dtype=torch.int32, device="cuda"),
                    rows=torch.zeros((L, B, K, ROW), dtype=torch.uint8, device="cuda"))

    def step(twin, io, s):
        wrap = cupy_stream(s) if cupy_current else contextlib.nullcontext()
        with torch.cuda.stream(s), wrap:
            st = twin.c.begin_step(io["req"], io["lens"], stream=s)
            dev = to_torch(twin.c.device, stream=s)
            for layer in range(L):
                locs = to_torch(st.swap(layer, io["tk"]), stream=s)
                io["locs"][layer] = locs
                io["rows"][layer] = dev[layer][locs.clamp(min=0).long()]

    with torch.cuda.stream(side):
        e_io, g_io = buffers(), buffers()
    cap.wait_stream(side)
    graph = None
    for it in range(6):
        req = rng.permutation(R)[:B]
        topk = eager.topk(req, miss=float(rng.choice([0.0, 0.2, 0.6])))  # every layer's
        with torch.cuda.stream(side):
            new = dict(req=torch.from_numpy(req.astype(np.int32)).cuda(),
                       lens=torch.from_numpy(eager.lens[req]).cuda(),
                       tk=torch.from_numpy(topk).cuda())
            for k, v in new.items():
                e_io[k].copy_(v)
        cap.wait_stream(side)
        with torch.cuda.stream(cap):
            for k, v in new.items():
                g_io[k].copy_(v)
        step(eager, e_io, side)
        if graph is None:  # the first step is eager on both: kernels compile and load
            step(graphed, g_io, cap)
            cap.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=cap):
                step(graphed, g_io, cap)
        else:
            with torch.cuda.stream(cap):
                graph.replay()
        side.synchronize()
        cap.synchronize()
        for layer in range(L):  # the eager run equals the oracle, layer by layer
            exp = eager.expect_single(layer, topk, req)
            eager.verify(layer, topk, req, e_io["locs"][layer].cpu().numpy(), exp)
        for k in ("locs", "rows"):
            assert torch.equal(e_io[k], g_io[k]), (it, k)
        assert (e_io["locs"] >= 0).sum() > L * K  # real rows were compared
    diffs = {}
    for name in ("slot_tokens", "slot_locs", "lru"):
        a, b = (cupy.asnumpy(getattr(x.c.tables, name)) for x in (eager, graphed))
        if not np.array_equal(a, b):
            at = np.argwhere(a != b)
            diffs[name] = (len(at), at[:6].tolist())
    assert not diffs, diffs
    # the rows of every filled slot hold the same bytes (rows of empty slots and scratch rows
    # were never written: cupy.empty memory, which differs between the twins)
    toks, locs = cupy.asnumpy(eager.c.tables.slot_tokens), cupy.asnumpy(eager.c.tables.slot_locs)
    dev_e, dev_g = cupy.asnumpy(eager.c.device), cupy.asnumpy(graphed.c.device)
    for layer in range(L):
        rows = locs[layer][toks[layer] >= 0]
        assert rows.size > R * K
        assert np.array_equal(dev_e[layer][rows], dev_g[layer][rows]), layer
    eager.c.close()
    graphed.c.close()


@pytest.mark.gpu
@pytest.mark.parametrize("example, needs, says", [
    ("torch_interop.py", "torch", "equal the eager side-stream steps bit for bit"),
    ("jax_interop.py", "jax", "every reduction equals NumPy's"),
])
def test_example_runs(example, needs, says):
    if needs == "jax":
        _jax()
    else:
        _torch()
    p = subprocess.run([sys.executable, str(EXAMPLES / example), "--steps", "6"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert says in p.stdout
