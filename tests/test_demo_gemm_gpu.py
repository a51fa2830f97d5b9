"""GPU: the decode loop's cuBLAS matmul keeps its result when limited to fewer SMs, and its
fallback kernel computes the product; its indexer scores what the NumPy formula does; its
attention reads FP8 and bf16 rows as the values their bytes hold; the newest row is the prompt
kernel's row in either format."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _bf16(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def test_gemm_sm_target(rng):
    import cupy

    from hisparse_cupy.demo._model import Gemm

    g = Gemm(None)
    if g._lib is None:
        pytest.skip(f"no cuBLAS on this machine: {g.kind}")
    try:
        M, Kd, N = 300, 512, 384
        a = _bf16(rng.standard_normal((M, Kd)))
        b = _bf16(rng.standard_normal((Kd, N)) * 0.05)
        want = _f32(a).astype(np.float64) @ _f32(b).astype(np.float64)
        s = cupy.cuda.Stream(non_blocking=True)
        da, db = cupy.asarray(a), cupy.asarray(b)
        for sms in (0, 8, 66, 0):
            c = cupy.full((M, N), 0x7FC0, cupy.uint16)  # bf16 NaN: every element must be written
            g.set_sm_target(sms)
            g(da, db, c, s)
            s.synchronize()
            np.testing.assert_allclose(_f32(cupy.asnumpy(c)), want, rtol=2e-2, atol=2e-2,
                                       err_msg=f"SM target {sms}")
        with pytest.raises(ValueError, match="sms must be >= 0"):
            g.set_sm_target(-1)
    finally:
        g.close()


def _to_bf16_rne(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounded to nearest even (model.cu's float_to_bf16; no NaN)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def test_the_fallback_matmul_kernel_is_the_product_in_k_order(rng):
    """Without cuBLAS the decode loop's matmuls run model.cu's gemm_bf16: C = A @ B with A a
    column slice (rows lda apart, as the output projection passes it), sizes that leave partial
    tiles, every element written: bit for bit float32 accumulation in k order (a bf16 product
    is exact in float32, so a fused multiply-add rounds as a multiply and an add do), then
    bf16 rounded to nearest even."""
    import cupy

    from hisparse_cupy.demo._model import Gemm, Kernels

    g = Gemm(Kernels())
    g.close()  # no cuBLAS handle: the fallback kernel runs
    assert not g.available
    M, Kd, N = 37, 200, 300
    full = _bf16(rng.standard_normal((M, 2 * Kd)))
    b = _bf16(rng.standard_normal((Kd, N)) * 0.05)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        da, db = cupy.asarray(full)[:, Kd:], cupy.asarray(b)  # rows 2 Kd apart
        c = cupy.full((M, N), 0x7FC0, cupy.uint16)  # bf16 NaN: every element must be written
    g(da, db, c, s)
    got = cupy.asnumpy(c, stream=s)
    s.synchronize()
    a32, b32 = _f32(full[:, Kd:]), _f32(b)
    acc = np.zeros((M, N), np.float32)
    for k in range(Kd):
        acc += np.outer(a32[:, k], b32[k])
    np.testing.assert_array_equal(got, _to_bf16_rne(acc))


def test_torch_gemm_matches_the_product_on_the_callers_stream(rng):
    """demo --matmul torch: TorchGemm's c = a @ b (a a column slice, as the model's output
    projection passes it) equals the product, on the stream given, every element written."""
    import cupy

    torch = pytest.importorskip("torch", reason="--matmul torch needs torch")
    from hisparse_cupy.demo._compute import TorchGemm

    g = TorchGemm()
    M, Kd, N = 300, 512, 384
    full = _bf16(rng.standard_normal((M, 2 * Kd)))
    b = _bf16(rng.standard_normal((Kd, N)) * 0.05)
    s = cupy.cuda.Stream(non_blocking=True)
    da, db = cupy.asarray(full)[:, Kd:], cupy.asarray(b)  # columns Kd.. : rows 2 Kd apart
    want = _f32(full[:, Kd:]).astype(np.float64) @ _f32(b).astype(np.float64)
    for _ in range(2):  # the second call reuses the tensors over the same buffers
        c = cupy.full((M, N), 0x7FC0, cupy.uint16)
        g(da, db, c, s)
        s.synchronize()
        np.testing.assert_allclose(_f32(cupy.asnumpy(c)), want, rtol=2e-2, atol=2e-2)
    assert torch.cuda.current_stream().cuda_stream != s.ptr  # torch's own stream untouched
    g.close()


def test_indexer_scores(rng):
    """demo._model.Indexer: query row b * S + s scores tokens [0, lens[b]) of request slot
    req[b]'s keys (int8 keys, a float scale a row) as scale * sum_h w_h relu(q_h . k),
    w_h = (1 + h % 8) / 8; nothing at or past the length is written (NaN poison stays)."""
    import cupy

    from hisparse_cupy.demo._model import Indexer, Kernels

    k, s = Kernels(), cupy.cuda.Stream(non_blocking=True)
    slots, max_len, B, S = 3, 1000, 2, 2
    ix = Indexer(k, n_full=2, slots=slots, max_len=max_len, queries=B * S, drafts=S, stream=s)
    span = -(-max_len // 64) * 64  # a slot's tokens: whole 64-token blocks
    keys = rng.integers(-128, 128, (slots * span, 128), dtype=np.int8)
    scale = rng.uniform(0.001, 0.004, slots * span).astype(np.float32)
    blocks = np.concatenate([keys.reshape(-1, 64 * 128),  # a block: its keys, then its scales
                             scale.view(np.int8).reshape(-1, 64 * 4)], axis=1)
    q = rng.integers(-128, 128, (B * S, 64 * 128), dtype=np.int8)
    # 514: a 2-token last block, where three of its four warps have no tile
    req, lens = np.array([2, 0], np.int32), np.array([514, 1000], np.int32)
    ix.keys[1].set(blocks.view(np.uint8).reshape(-1), stream=s)
    ix.q.set(q, stream=s)
    with s:  # (everything on the indexer's stream)
        ix.scores.fill(np.nan)
        d_req, d_lens = cupy.asarray(req), cupy.asarray(lens)
    ix.score(1, d_req, d_lens)
    got = cupy.asnumpy(ix.scores, stream=s)
    s.synchronize()
    w = (1 + np.arange(64) % 8) / 8
    for row in range(B * S):
        b = row // S
        lo = req[b] * span
        kk = keys[lo:lo + lens[b]].astype(np.int64)
        dots = q[row].reshape(64, 128).astype(np.int64) @ kk.T  # [heads, tokens]
        want = (w[:, None] * np.maximum(dots, 0)).sum(0) * scale[lo:lo + lens[b]]
        np.testing.assert_allclose(got[row, :lens[b]], want, rtol=1e-5, err_msg=f"row {row}")
        assert np.isnan(got[row, lens[b]:]).all()
    # the key cache the loop fills: every full layer's rows, scales in [1/512, 2/512)
    ix2 = Indexer(k, n_full=2, slots=1, max_len=64, queries=1, drafts=1, stream=s)
    blk = cupy.asnumpy(ix2.keys, stream=s).reshape(2, 64 * 132)  # one block a layer
    s.synchronize()
    sc = blk[:, 64 * 128:].copy().view(np.float32)
    assert sc.shape == (2, 64) and ((sc >= 1 / 512) & (sc < 2 / 512)).all()
    kv = blk[:, :64 * 128]
    assert not np.array_equal(kv[0], kv[1]) and np.unique(kv).size > 200


def _e4m3(b: np.ndarray) -> np.ndarray:
    """e4m3 bytes as float64 (sign, 4 exponent bits of bias 7, 3 mantissa bits)."""
    b = b.astype(np.int64)
    e, m = (b >> 3) & 15, b & 7
    v = np.where(e > 0, 2.0 ** (e - 7) * (1 + m / 8), m * 2.0 ** -9)
    return np.where(b & 0x80, -v, v)


@pytest.mark.parametrize("row", ["fp8", "bf16"])
def test_the_attention_reads_each_row_format_as_its_values(rng, row):
    """The decode loop's rows (``--row``) as ``model.cu`` writes them: FP8 rows are GLM-5.2's
    656 bytes (512 e4m3 latent values, never NaN; four power-of-two float32 scales, one per
    128; 64 bf16 RoPE values), bf16 rows 576 values; the attention (both parts) over rows of
    either format equals NumPy's softmax attention over the values those bytes hold (read
    here independently), selected rows and -1 entries alike."""
    import cupy

    from hisparse_cupy._kernels.launch import ptr
    from hisparse_cupy.demo._config import HEADS, ROW_FORMATS, V_VALUES
    from hisparse_cupy.demo._model import Kernels

    k, fp8, rb = Kernels(), row == "fp8", ROW_FORMATS[row]
    n, K, Q = 96, 64, 2
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        rows = cupy.full((n, rb), 0xAB, cupy.uint8)  # poisoned: every byte must be written
        reqs = cupy.asarray([3], cupy.int32)
    kv = k.kv_prefill[fp8]
    kv((-(-n * (rb // 16) // 256), 1, 1),
       kv.params(base=ptr(rows), layer_bytes=rows.nbytes, reqs=ptr(reqs), p0=0, p1=n, req_rows=0,
                 shared=0, first=5), s)
    s.synchronize()
    raw = cupy.asnumpy(rows)
    if fp8:
        lat, sc = raw[:, :512], raw[:, 512:528].copy().view(np.float32)
        assert not ((lat & 0x7F) == 0x7F).any()  # no NaN
        assert set(np.log2(sc).ravel().tolist()) <= {-9.0, -10.0, -11.0, -12.0}
        vals = np.concatenate([_e4m3(lat) * np.repeat(sc, 128, axis=1),
                               _f32(raw[:, 528:].copy().view(np.uint16))], axis=1)
    else:
        vals = _f32(raw.view(np.uint16)).astype(np.float64)
    assert vals.shape == (n, 576) and np.isfinite(vals).all() and np.abs(vals).max() > 0
    q = _bf16(rng.standard_normal((Q, HEADS * 576)))
    locs = rng.choice(n, (Q, K), replace=True).astype(np.int32)
    locs[:, ::7] = -1  # skipped entries
    chunk, nsplit, temp = 16, K // 16, np.float32(4.0)
    with s:
        dq, dl = cupy.asarray(q), cupy.asarray(locs)
        pm = cupy.empty(Q * nsplit * HEADS, cupy.float32)
        pl = cupy.empty_like(pm)
        pa = cupy.empty(Q * nsplit * HEADS * V_VALUES, cupy.float32)
        out = cupy.full((Q, HEADS * V_VALUES), 0x7FC0, cupy.uint16)
        digest = cupy.zeros(1, cupy.uint64)
        step = cupy.zeros(1, cupy.int32)
    att = k.attn_partial[fp8]
    att((nsplit, Q), att.params(qraw=ptr(dq), locs=ptr(dl), ld_b=K, ld_s=0, S=1, K=K,
                                chunk=chunk, rows=ptr(rows), temp=temp, part_m=ptr(pm),
                                part_l=ptr(pl), part_acc=ptr(pa)), s)
    k.attn_combine((Q, HEADS), k.attn_combine.params(
        part_m=ptr(pm), part_l=ptr(pl), part_acc=ptr(pa), nsplit=nsplit, out=ptr(out),
        digest=ptr(digest), step=ptr(step), n_layers=1, layer=0), s)
    s.synchronize()
    got = _f32(cupy.asnumpy(out)).reshape(Q, HEADS, V_VALUES)
    for b in range(Q):
        kv = vals[locs[b][locs[b] >= 0]]
        for h in range(HEADS):
            qh = _f32(q[b, h * 576:(h + 1) * 576]).astype(np.float64)
            qh = qh * temp / np.sqrt((qh * qh).sum() + 1e-20)
            sc = kv @ qh
            p = np.exp(sc - sc.max())
            want = (p / p.sum()) @ kv[:, :V_VALUES]
            np.testing.assert_allclose(got[b, h], want, rtol=2e-2, atol=2e-3,
                                       err_msg=f"{row} row {b} head {h}")


@pytest.mark.parametrize("row", ["fp8", "bf16"])
def test_the_newest_row_is_the_prompt_kernels_row(row):
    """kv_newest writes the newest token's row (position lens[b] - 1 of request slot req[b]) of
    every layer with the bytes kv_prefill writes for that token, in either format: into the
    slot layout's row (rows null: row req[b] * max_len + lens[b] - 1) and into given device
    rows (-1: skipped); no other byte is touched."""
    import cupy

    from hisparse_cupy._kernels.launch import ptr
    from hisparse_cupy.demo._config import ROW_FORMATS
    from hisparse_cupy.demo._model import Kernels

    k, fp8, rb = Kernels(), row == "fp8", ROW_FORMATS[row]
    L, R, max_len, first = 2, 3, 40, 3
    req, lens = [2, 0, 1], [5, 40, 17]
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        slots = cupy.arange(R, dtype=cupy.int32)
        want = cupy.full((L, R * max_len, rb), 0xAB, cupy.uint8)
        got = cupy.full_like(want, 0xAB)
        dev = cupy.full((L, 10, rb), 0xAB, cupy.uint8)
        d_req, d_lens = cupy.asarray(req, cupy.int32), cupy.asarray(lens, cupy.int32)
        d_rows = cupy.asarray([7, -1, 3], cupy.int32)
    kv = k.kv_prefill[fp8]  # every position of every slot, in the slot layout
    kv((-(-max_len * (rb // 16) // 256), R, L),
       kv.params(base=ptr(want), layer_bytes=want[0].nbytes, reqs=ptr(slots), p0=0, p1=max_len,
                 req_rows=max_len, shared=0, first=first), s)
    nw = k.kv_newest[fp8]
    p = nw.params(req=ptr(d_req), lens=ptr(d_lens), max_len=max_len, first=first)
    nw((len(req), L), p.set(base=ptr(got), layer_bytes=got[0].nbytes, rows=0), s)
    nw((len(req), L), p.set(base=ptr(dev), layer_bytes=dev[0].nbytes, rows=ptr(d_rows)), s)
    W, G, D = (cupy.asnumpy(x, stream=s) for x in (want, got, dev))
    s.synchronize()
    assert (W != 0xAB).any(axis=2).all()  # every row of every layer written
    newest = [r * max_len + n - 1 for r, n in zip(req, lens, strict=True)]
    for i in range(R * max_len):
        np.testing.assert_array_equal(G[:, i], W[:, i] if i in newest else 0xAB, err_msg=str(i))
    for i in range(10):
        src = {7: newest[0], 3: newest[2]}.get(i)
        np.testing.assert_array_equal(D[:, i], 0xAB if src is None else W[:, src],
                                      err_msg=str(i))
