"""GPU: the decode loop's cuBLAS matmul keeps its result when limited to fewer SMs."""

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
