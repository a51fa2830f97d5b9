"""The compute backends of the decode loop and of ``benchmarks/bench_overlap.py``: matmuls that
can be captured in a CUDA graph, and a stand-in for when no cuBLAS can.

- :class:`Gemm`: bf16 ``C = A @ B`` through cuBLAS's ``cublasGemmEx`` (ctypes, its own handle
  and workspace), optionally on fewer SMs (``cublasSetSmCountTarget``); the decode loop's
  matmuls (:class:`hisparse_cupy.demo._model.Model`).
- :class:`TorchGemm`: the same interface as :class:`Gemm` through ``torch.matmul`` on the
  caller's stream (``demo --matmul torch``: an engine whose layer matmuls are PyTorch ops).
- :class:`TorchMatmul`: fp16 ``y = x @ w`` through PyTorch's cuBLAS on a given stream.
- :class:`FmaBurn`: FMAs on every SM (no library needed).
- :class:`LayerCompute`: one layer's stand-in compute of the overlap benchmark, a
  ``[m, n] x [n, n]`` matmul on one of the three above, resizable to a target time.

CuPy's own cuBLAS wrappers refuse to run while a stream is captured, hence these.
"""

from __future__ import annotations

import ctypes

import cupy
import numpy as np

__all__ = ["FmaBurn", "Gemm", "LayerCompute", "TorchGemm", "TorchMatmul"]


class Gemm:
    """``C = A @ B`` for row-major bf16 matrices (uint16 storage), fp32 accumulation.

    cuBLAS's ``cublasGemmEx`` called through ctypes with its own handle and a fixed workspace,
    so that it can be captured in a CUDA graph (CuPy's cuBLAS wrappers refuse to run while a
    stream is captured). Without a loadable cuBLAS a simple kernel stands in (``kernels``: the
    decode loop's :class:`hisparse_cupy.demo._model.Kernels`, whose ``gemm_bf16`` it launches;
    None: no stand-in); :attr:`kind` says which runs, :attr:`available` whether cuBLAS does.
    """

    _OP_N, _R_16BF, _COMPUTE_32F, _ALGO_DEFAULT = 0, 14, 68, -1
    WORKSPACE = 32 << 20

    def __init__(self, kernels):
        self.k = kernels
        self._lib = None
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib

            lib = ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)
            h = ctypes.c_void_p()
            self._ok(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
            self._ws = cupy.empty(self.WORKSPACE, cupy.uint8)
            self._ok(lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(self._ws.data.ptr),
                                               ctypes.c_size_t(self.WORKSPACE)),
                     "cublasSetWorkspace")
            lib.cublasGemmEx.argtypes = [
                ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            self._lib, self._h = lib, h
            self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
            self.kind = "cuBLAS (cublasGemmEx, bf16, fp32 compute)"
        except Exception as e:  # noqa: BLE001 - any failure: the fallback kernel
            self.kind = f"fallback matmul kernel (cuBLAS unavailable: {type(e).__name__}: {e})"

    @property
    def available(self) -> bool:
        """Whether cuBLAS runs the matmuls (False: the fallback kernel, or none)."""
        return self._lib is not None

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def set_sm_target(self, sms: int) -> None:
        """Run later matmuls on at most ``sms`` SMs (``cublasSetSmCountTarget``; 0: every SM),
        leaving the others to kernels on other streams (the side stream's copies)."""
        if self._lib is None:
            raise RuntimeError(f"no SM target without cuBLAS ({self.kind})")
        if sms < 0:
            raise ValueError(f"sms must be >= 0, got {sms}")
        self._ok(self._lib.cublasSetSmCountTarget(self._h, int(sms)), "cublasSetSmCountTarget")

    def __call__(self, a: cupy.ndarray, b: cupy.ndarray, c: cupy.ndarray,
                 stream: cupy.cuda.Stream) -> None:
        """``c = a @ b``; ``a`` may be a column slice (rows ``a.strides[0]`` bytes apart),
        ``b`` and ``c`` are dense."""
        M, Kd = a.shape
        N = b.shape[1]
        lda = a.strides[0] // 2
        if self._lib is None:
            k = self.k.gemm_bf16
            k((-(-N // 128), -(-M // 16)), k.params(A=a.data.ptr, B=b.data.ptr, C=c.data.ptr,
                                                    M=M, N=N, Kd=Kd, lda=lda), stream)
            return
        lib = self._lib
        self._ok(lib.cublasSetStream_v2(self._h, ctypes.c_void_p(stream.ptr)), "cublasSetStream")
        # row-major C = A B is column-major C^T = B^T A^T
        self._ok(lib.cublasGemmEx(
            self._h, self._OP_N, self._OP_N, N, M, Kd, ctypes.byref(self._one), b.data.ptr,
            self._R_16BF, N, a.data.ptr, self._R_16BF, lda, ctypes.byref(self._zero), c.data.ptr,
            self._R_16BF, N, self._COMPUTE_32F, self._ALGO_DEFAULT), "cublasGemmEx")

    def close(self) -> None:
        if self._lib is not None:
            self._lib.cublasDestroy_v2(self._h)
            self._lib = None


class TorchGemm:
    """:class:`Gemm`'s ``c = a @ b`` (bf16 in uint16 storage, ``a`` maybe a column slice) by
    ``torch.matmul`` into ``c``, on the given stream (a ``torch.cuda.ExternalStream`` of it):
    the matmuls of an engine written in PyTorch. The arrays are viewed as tensors without a
    copy (DLPack), once per buffer. No SM target: PyTorch's only one is a private carveout
    that ``benchmarks/NOTES.md`` found not applied to its Hopper matmuls; on an SM partition
    the matmuls run on the main group's SMs, with the plan PyTorch picks."""

    def __init__(self):
        import torch

        self.torch = torch
        self.kind = f"PyTorch {torch.__version__} (torch.matmul, bf16)"
        self._views: dict = {}  # (pointer, shape, strides) -> bf16 tensor over it
        self._streams: dict = {}  # CuPy stream pointer -> torch ExternalStream

    available = True

    def _t(self, x: cupy.ndarray):
        key = (x.data.ptr, x.shape, x.strides)
        t = self._views.get(key)
        if t is None:
            t = self._views[key] = self.torch.from_dlpack(x.view(cupy.int16)).view(
                self.torch.bfloat16)
        return t

    def __call__(self, a: cupy.ndarray, b: cupy.ndarray, c: cupy.ndarray,
                 stream: cupy.cuda.Stream) -> None:
        ts = self._streams.get(stream.ptr)
        if ts is None:
            ts = self._streams[stream.ptr] = self.torch.cuda.ExternalStream(stream.ptr)
        with self.torch.cuda.stream(ts):
            self.torch.matmul(self._t(a), self._t(b), out=self._t(c))

    def close(self) -> None:
        self._views.clear()


class TorchMatmul:
    """fp16 ``y[:m] = x[:m] @ w`` (``x`` ``[max_m, n]``, ``w`` ``[n, n]``, seeded random)
    through PyTorch's matmul, which owns its cuBLAS handle and workspace and can be captured.

    Makes ``stream`` PyTorch's current stream (``torch.cuda.set_stream``), so that every
    PyTorch op of the process, this matmul's included, is queued there. Raises if PyTorch is
    missing; :meth:`check_capture` raises if a captured matmul does not replay exactly.
    """

    def __init__(self, stream: cupy.cuda.Stream, n: int, max_m: int):
        import torch

        self.torch, self.s = torch, stream
        self.tstream = torch.cuda.ExternalStream(stream.ptr)
        torch.cuda.set_stream(self.tstream)  # torch's work goes to the given stream too
        gen = torch.Generator(device="cuda")
        gen.manual_seed(0)
        opts = {"device": "cuda", "dtype": torch.float16, "generator": gen}
        self.w = torch.randn(n, n, **opts) * 0.01
        self.x = torch.randn(max_m, n, **opts)
        self.y = torch.empty(max_m, n, device="cuda", dtype=torch.float16)

    def __call__(self, m: int) -> None:
        self.torch.matmul(self.x[:m], self.w, out=self.y[:m])

    def check_capture(self, m: int = 256) -> None:
        """Capture an ``m``-row matmul on the stream, replay it, compare with an eager one."""
        s = self.s
        self(m)
        s.synchronize()
        want = self.y[:m].clone()
        s.synchronize()
        self.y[:m].zero_()
        s.begin_capture()
        try:
            self(m)
        finally:
            g = s.end_capture()
        g.launch(s)
        s.synchronize()
        if not self.torch.allclose(self.y[:m], want, rtol=1e-2, atol=1e-2):
            raise RuntimeError("the captured matmul replayed a different result")


_FMA_SRC = r"""
// Stand-in compute (only if no cuBLAS matmul can be captured): FMAs on every SM.
extern "C" __global__ void fma_burn(float* x, int iters) {
  float a = x[threadIdx.x], c = 1.0f + 1e-7f * threadIdx.x;
  for (int i = 0; i < iters; ++i) a = a * c + 1e-7f;
  if (a == 12345.0f) x[threadIdx.x] = a;
}
"""


class FmaBurn:
    """``iters`` FMAs per thread in 4 blocks of 256 threads per SM, on ``stream``."""

    def __init__(self, stream: cupy.cuda.Stream):
        self.s = stream
        with stream:
            self.x = cupy.zeros(1024, cupy.float32)
        self.blocks = 4 * cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._k = cupy.RawKernel(_FMA_SRC, "fma_burn", options=("-std=c++17",))

    def __call__(self, iters: int) -> None:
        self._k((self.blocks,), (256,), (self.x, np.int32(iters)), stream=self.s)


class LayerCompute:
    """One layer's compute on ``stream``: a matmul ``[m, n] x [n, n]`` (``m <= max_m``).

    By default PyTorch's fp16 matmul (:class:`TorchMatmul`; it becomes PyTorch's current
    stream); without PyTorch, or if its matmul cannot be captured and replayed exactly, an FMA
    kernel on every SM (:class:`FmaBurn`, ``iters`` FMAs a thread) stands in. ``gemm_sms`` (not
    None): a bf16 matmul through :class:`Gemm` limited to that many SMs (0: every SM), so that
    copies on other SMs need not delay it; raises without cuBLAS. :attr:`kind` says which runs.
    :meth:`rescale` resizes the work (``m``, or ``iters``) unless :meth:`pin` fixed ``m``.
    """

    def __init__(self, stream: cupy.cuda.Stream, *, gemm_sms: int | None = None,
                 n: int = 4096, max_m: int = 16384, log=print):
        self.s, self.n, self.max_m = stream, n, max_m
        self.m = 2048
        self.iters = 1000
        self.fixed_m = False  # True: rescale() keeps m (the same work in every run)
        self.fma = FmaBurn(stream)
        self.gemm = self.torch = None
        self.kind = "fma"
        if gemm_sms is not None:
            self.gemm = Gemm(None)
            self.gemm.set_sm_target(gemm_sms)  # raises without cuBLAS
            with stream:
                rnd = cupy.random.default_rng(0)
                self.w = (rnd.standard_normal((n, n), dtype=cupy.float32) * 0.01).astype(
                    cupy.float16).view(cupy.uint16)  # bf16 needs no conversion for timing
                self.x = rnd.standard_normal((max_m, n), dtype=cupy.float32).astype(
                    cupy.float16).view(cupy.uint16)
                self.y = cupy.empty((max_m, n), cupy.uint16)
            self.kind = f"cublas bf16 (own binding, SM target {gemm_sms or 'all'})"
            return
        try:
            self.torch = TorchMatmul(stream, n, max_m)
            self.kind = "cublas (torch)"
            self.torch.check_capture(256)
        except Exception as e:  # noqa: BLE001 - any failure means: use the fallback
            log(f"cuBLAS matmul through PyTorch unusable in a captured graph here "
                f"({type(e).__name__}: {e}); using an FMA kernel as the layer's compute")
            self.torch = None
            self.kind = "fma"

    def __call__(self) -> None:
        if self.kind == "fma":
            self.fma(self.iters)
        elif self.gemm is not None:
            self.gemm(self.x[: self.m], self.w, self.y[: self.m], self.s)
        else:
            self.torch(self.m)

    def pin(self, m: int) -> None:
        """Fix the matmul's rows at ``m`` (:meth:`rescale` then keeps them)."""
        if self.kind == "fma":
            raise ValueError("a fixed matmul size needs a cuBLAS matmul")
        self.m, self.fixed_m = int(m), True

    def rescale(self, factor: float) -> None:
        """Scale the work by about ``factor`` (``m`` in steps of 64 rows, 64 .. ``max_m``)."""
        if self.kind == "fma":
            self.iters = max(10, int(self.iters * factor))
        elif not self.fixed_m:
            self.m = int(min(self.max_m, max(64, round(self.m * factor / 64) * 64)))

    def close(self) -> None:
        if self.gemm is not None:
            self.gemm.close()
