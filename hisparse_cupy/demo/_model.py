"""The decode loop's synthetic model on the GPU: its kernels (``model.cu``) and its weights and
buffers; the matmuls run on :class:`hisparse_cupy.demo._compute.Gemm` (its fallback kernel is
``model.cu``'s ``gemm_bf16``).

Per layer the model does what a sparse-attention (MLA + DSA-like) decoder layer costs: a sparse
attention over the K selected KV rows of every query row (16 heads, 576-value rows: GLM-5.2's
FP8 row, its e4m3 latent values times their scales, or bf16; softmax of q.k, weighted sum of
the 512-value latents; split over the rows flash-decoding style), then
two bf16 matmuls on cuBLAS (the output projection into the hidden state, and the next layer's
query projection): the MLP stand-in, whose weights every step streams as a real step streams
its experts' (``--model``: their size). On every full layer the :class:`Indexer` first scores
the whole context (DSA's lightning indexer), in every mode alike.
"""

from __future__ import annotations

import math
from pathlib import Path

import cupy
import numpy as np

from ._compute import Gemm, TorchGemm
from ._config import HEADS, INDEXER_QUERY, INDEXER_ROW, ROW_VALUES, V_VALUES

TILE = 16  # rows per attention tile (TR in model.cu)
_QS = 580
ATT_THREADS = 256
ATT_SMEM = 4 * (2 * HEADS * _QS + TILE * HEADS + 2 * HEADS + TILE)


class Kernels:
    """``model.cu`` compiled once (per process and device)."""

    _NAMES = ("kv_prefill", "kv_newest", "topk_drift", "topk_table", "direct_locs", "embed",
              "weights", "attn_partial", "attn_combine", "tally", "tick", "gemm_bf16",
              "index_fill", "index_query", "indexer")

    def __init__(self):
        src = (Path(__file__).with_name("model.cu")).read_text(encoding="ascii")
        mod = cupy.RawModule(code=src, options=("-std=c++17",))
        for n in self._NAMES:
            setattr(self, n, mod.get_function(n))
        self.attn_partial.max_dynamic_shared_size_bytes = ATT_SMEM


class Model:
    """Weights and per-step buffers for ``Q`` query rows (batch x draft steps).

    Tensor parallel (``tp=(rank, size, all_reduce)``): every rank attends with all heads over
    the same (replicated, MLA) KV rows, multiplies its ``1 / size`` of the heads' outputs by
    its rows of the output projection and ``all_reduce(h)`` sums the partial hidden states in
    place on the step's stream (an NCCL all-reduce in ``examples/tp_decode.py``).

    ``sms``: the SMs the step's stream may use (an SM partition's main group; default every
    SM of the device): the attention is split for them and the matmuls' cuBLAS SM-count target
    set to them (the fallback matmul kernel has none). ``matmul``: ``"cublas"`` (:class:`Gemm`)
    or ``"torch"`` (:class:`~hisparse_cupy.demo._compute.TorchGemm`). ``fp8``: the rows are
    GLM-5.2's FP8 rows (656 bytes), else bf16 (1152 bytes).
    """

    def __init__(self, kernels: Kernels, *, queries: int, top_k: int, hidden: int,
                 n_layers: int, stream: cupy.cuda.Stream, temperature: float = 4.0, tp=None,
                 sms: int | None = None, matmul: str = "cublas", fp8: bool = True):
        self.k, self.Q, self.K, self.D, self.L = kernels, queries, top_k, hidden, n_layers
        self.fp8 = np.int32(bool(fp8))  # the rows' format (model.cu)
        self.s = stream
        self.gemm = TorchGemm() if matmul == "torch" else Gemm(kernels)
        self.temp = np.float32(temperature)
        if sms is None:
            sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        elif matmul == "cublas" and self.gemm.available:
            self.gemm.set_sm_target(sms)
        # splits of the K rows: about four blocks per SM, each a whole number of tiles
        want = max(1, min(top_k // TILE, math.ceil(4 * sms / queries)))
        self.chunk = TILE * math.ceil(top_k / want / TILE)
        self.nsplit = math.ceil(top_k / self.chunk)
        with stream:
            self.w_o = self._weights((HEADS * V_VALUES, hidden), 1, 2.0 ** -6)
            rank, size, self.all_reduce = tp or (0, 1, None)
            if HEADS % size:
                raise ValueError(f"{HEADS} heads do not split over {size} ranks")
            cols = HEADS * V_VALUES // size
            self.o_cols = slice(rank * cols, (rank + 1) * cols)
            self.w_o_rank = self.w_o[self.o_cols]  # this rank's rows (dense)
            self.w_q = self._weights((hidden, HEADS * ROW_VALUES), 2, 2.0 ** -5)
            self.h = cupy.empty((queries, hidden), cupy.uint16)
            self.qraw = cupy.empty((queries, HEADS * ROW_VALUES), cupy.uint16)
            self.o = cupy.empty((queries, HEADS * V_VALUES), cupy.uint16)
            n = queries * self.nsplit * HEADS
            self.part_m = cupy.empty(n, cupy.float32)
            self.part_l = cupy.empty(n, cupy.float32)
            self.part_acc = cupy.empty(n * V_VALUES, cupy.float32)

    def _weights(self, shape, seed: int, scale: float) -> cupy.ndarray:
        w = cupy.empty(shape, cupy.uint16)
        n = w.size
        self.k.weights((-(-n // 256),), (256,), (w, np.int64(n), np.uint64(seed * 0x9E3779B9),
                                                 np.float32(scale)), stream=self.s)
        return w

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.w_o, self.w_q, self.h, self.qraw, self.o,
                                      self.part_m, self.part_l, self.part_acc))

    def start(self, step_ctr: cupy.ndarray) -> None:
        """The step's input hidden state, then the first layer's query."""
        n = self.h.size
        self.k.embed((-(-n // 256),), (256,), (self.h, np.int32(n), np.int32(self.D), step_ctr),
                     stream=self.s)
        self.gemm(self.h, self.w_q, self.qraw, self.s)

    def layer(self, locs: cupy.ndarray, rows: cupy.ndarray, layer: int, digest: cupy.ndarray,
              step_ctr: cupy.ndarray, last: bool) -> None:
        """Attention of every query row over its rows ``locs`` ([B, K] or [B, S, K]) of
        ``rows`` (uint8 [D, row bytes]: FP8 or bf16, as ``fp8`` said), its output folded into
        ``digest``; then the matmuls."""
        S = 1 if locs.ndim == 2 else locs.shape[1]
        ld_b = locs.strides[0] // 4
        ld_s = 0 if locs.ndim == 2 else locs.strides[1] // 4
        self.k.attn_partial(
            (self.nsplit, self.Q), (ATT_THREADS,),
            (self.qraw, locs, np.int64(ld_b), np.int64(ld_s), np.int32(S), np.int32(self.K),
             np.int32(self.chunk), rows, self.temp, self.part_m, self.part_l, self.part_acc,
             self.fp8),
            shared_mem=ATT_SMEM, stream=self.s)
        self.k.attn_combine((self.Q, HEADS), (V_VALUES,),
                            (self.part_m, self.part_l, self.part_acc, np.int32(self.nsplit),
                             self.o, digest, step_ctr, np.int32(self.L), np.int32(layer)),
                            stream=self.s)
        self.gemm(self.o[:, self.o_cols], self.w_o_rank, self.h, self.s)
        if self.all_reduce is not None:
            self.all_reduce(self.h)
        if not last:
            self.gemm(self.h, self.w_q, self.qraw, self.s)

    def close(self) -> None:
        self.gemm.close()


class Indexer:
    """DSA's lightning indexer as a cost (``model.cu``'s ``indexer``): its key cache on the GPU,
    :data:`ROW` bytes a token (128 int8 keys standing in for FP8, a float scale) for every full
    layer and request slot, in blocks of :data:`BLOCK` tokens (their keys, then their scales, as
    vLLM lays out its indexer cache; a slot ``ceil(max_len / BLOCK)`` blocks, every position
    written up front), and per
    full layer a scoring of every token a request holds by 64 heads of 128 dims against the
    step's queries, on the tensor cores. The scores (:attr:`scores`, float32 ``[Q, max_len]``)
    are the kernel's output and nothing reads them: the stream generator's top-k stands in for
    what trained keys would select. Not modelled: the query projection (a small matmul) and
    writing the newest token's key each step."""

    # IDX_ROW, IDX_BLK, IDX_TOK in model.cu (IDX_H x IDX_D: INDEXER_QUERY)
    ROW, BLOCK, TOKENS = INDEXER_ROW, 64, 512

    def __init__(self, kernels: Kernels, *, n_full: int, slots: int, max_len: int,
                 queries: int, drafts: int, stream: cupy.cuda.Stream):
        self.k, self.s, self.max_len, self.S = kernels, stream, max_len, drafts
        rows = slots * -(-max_len // self.BLOCK) * self.BLOCK  # whole blocks a slot
        with stream:
            self.keys = cupy.empty((n_full, rows * self.ROW), cupy.uint8)
            self.q = cupy.empty((queries, INDEXER_QUERY), cupy.int8)
            self.scores = cupy.empty((queries, max_len), cupy.float32)
        for j in range(n_full):
            self.k.index_fill((-(-rows * (self.ROW // 4) // 256),), (256,),
                              (self.keys[j], np.int64(rows), np.int32(j)), stream=stream)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.q.nbytes + self.scores.nbytes

    def query(self, step_ctr: cupy.ndarray) -> None:
        """The step's queries (a function of the step index on the device)."""
        n = self.q.size // 4
        self.k.index_query((-(-n // 256),), (256,), (self.q, np.int32(n), step_ctr),
                           stream=self.s)

    def score(self, j: int, req: cupy.ndarray, lens: cupy.ndarray) -> None:
        """Full layer ``j``: query row ``b * S + s`` scores tokens ``[0, lens[b])`` of request
        slot ``req[b]``."""
        self.k.indexer((-(-self.max_len // self.TOKENS), self.q.shape[0]), (128,),
                       (self.keys[j], self.q, req, lens, np.int32(self.S),
                        np.int32(self.max_len), self.scores), stream=self.s)
