"""The decode loop's synthetic model on the GPU: its kernels (``model.cu``) and its weights and
buffers; the matmuls run on :class:`hisparse_cupy.demo._compute.Gemm` (its fallback kernel is
``model.cu``'s ``gemm_bf16``).

The kernels go the package's way (:class:`Kernels`): each takes one parameter struct by value
(``hisparse_cupy._abi.DEMO_STRUCTS``, checked against ``model.cu`` at every compile), the module
is built by the package's build path (``hisparse_cupy._kernels.build``: one RawModule of every
instance, the row format a template parameter, an instance picked by its name expression) and
every launch goes through the package's launcher (``cuLaunchKernelEx``, one pointer to the
struct; the driver copies it, so a struct may be rewritten right after a launch or a capture).
Per-step launches keep their structs and rewrite only the fields that change.

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

import cupy
import numpy as np

from .. import _abi
from .._kernels import build
from .._kernels.launch import Params, as_stream, launcher, ptr
from ._compute import Gemm, TorchGemm
from ._config import HEADS, INDEXER_QUERY, INDEXER_ROW, ROW_VALUES, V_VALUES, Config

TILE = 16  # rows per attention tile (TR in model.cu)
_QS = 580
ATT_THREADS = 256
ATT_SMEM = 4 * (2 * HEADS * _QS + TILE * HEADS + 2 * HEADS + TILE)


# Every kernel of model.cu: its struct (hisparse_cupy._abi.DEMO_STRUCTS), threads a block and
# dynamic shared memory. The name expressions are build.DEMO's, or build.DEMO_ROWS's (one per row
# format) for the kernels that read or write KV rows.
KERNELS = {
    "kv_prefill": ("KvPrefillParams", 256, 0),
    "kv_newest": ("KvNewestParams", 96, 0),
    "topk_drift": ("TopkDriftParams", 256, 0),
    "topk_table": ("TopkTableParams", 256, 0),
    "direct_locs": ("DirectLocsParams", 256, 0),
    "embed": ("EmbedParams", 256, 0),
    "weights": ("WeightsParams", 256, 0),
    "attn_partial": ("AttnPartialParams", ATT_THREADS, ATT_SMEM),  # opted in past 48 KB
    "attn_combine": ("AttnCombineParams", V_VALUES, 0),
    "tally": ("TallyParams", 128, 0),
    "tick": ("TickParams", 128, 0),
    "gemm_bf16": ("GemmBf16Params", 128, 0),
    "index_fill": ("IndexFillParams", 256, 0),
    "index_query": ("IndexQueryParams", 256, 0),
    "indexer": ("IndexerParams", 128, 0),
}


class Kernel:
    """One instance of ``model.cu`` on the current device, bound to its block and dynamic shared
    memory (the package's :func:`~hisparse_cupy._kernels.launch.launcher`): :meth:`params` makes
    its struct, ``kernel(grid, params, stream)`` queues it on a CuPy stream (an empty grid
    queues nothing)."""

    __slots__ = ("name", "dtype", "la")

    def __init__(self, name_expression: str, struct: str, block: int, shared_mem: int):
        self.name = name_expression
        self.dtype = _abi.DEMO_STRUCTS[struct]
        self.la = launcher(build.kernel(name_expression), block, shared_mem)

    def params(self, **fields) -> Params:
        """A fresh struct with ``fields`` set (the others zero: null pointers)."""
        return Params(self.dtype).set(**fields)

    def __call__(self, grid: tuple[int, ...], p: Params, stream: cupy.cuda.Stream) -> None:
        self.la((*grid, 1, 1)[:3], stream.ptr, p.addr)


class Kernels:
    """``model.cu``'s kernels on the current device: each a :class:`Kernel` attribute named as
    in ``model.cu``; ``kv_prefill``, ``kv_newest`` and ``attn_partial``, which read or write
    KV rows, a dict ``{fp8: Kernel}`` of their two instances (FP8 rows: True, bf16: False).
    Built through the package's build path (one RawModule of every instance, compiled once per
    process and device: NVRTC, or CuPy's disk cache)."""

    def __init__(self):
        for name, (struct, block, smem) in KERNELS.items():
            per = build.DEMO_ROWS.get(name)
            setattr(self, name, Kernel(build.DEMO[name], struct, block, smem) if per is None
                    else {fp8: Kernel(expr, struct, block, smem) for fp8, expr in per.items()})


def prompt_kv(k: Kernels, cfg: Config, base: int, layer_bytes: int, reqs, stream,
              p0: int = 0, req_rows: int = 0, layers: range | None = None) -> None:
    """The model's prompt KV of positions ``[p0, context)`` of requests ``reqs`` (int32 on the
    device, contiguous) for model ``layers`` (default all; a range of step 1), written from
    ``base`` (a device or mapped host address; layers ``layer_bytes`` apart) on ``stream`` (any
    stream the package's calls take; None: CuPy's current one): request ``reqs[i]``'s row of
    position ``p`` at row ``i * req_rows + p - p0`` of each layer, in ``cfg``'s row format.
    Raises ``TypeError`` / ``ValueError`` naming the argument that does not fit."""
    layers = range(cfg.layers) if layers is None else layers
    _check_prompt_args(cfg, reqs, p0, req_rows, layers)
    grid = (-(-(cfg.context - p0) * (cfg.row_bytes // 16) // 256), reqs.size, len(layers))
    kv = k.kv_prefill[bool(cfg.fp8)]
    kv(grid, kv.params(base=int(base), layer_bytes=int(layer_bytes), reqs=ptr(reqs), p0=p0,
                       p1=cfg.context, req_rows=int(req_rows), shared=cfg.shared_prefix,
                       first=layers.start), as_stream(stream))


def _check_prompt_args(cfg: Config, reqs, p0, req_rows, layers) -> None:
    if not isinstance(p0, (int, np.integer)) or not 0 <= p0 <= cfg.context:
        raise ValueError(f"p0 must be a position in [0, context={cfg.context}], got {p0!r}")
    if not isinstance(req_rows, (int, np.integer)) or req_rows < 0:
        raise ValueError(f"req_rows must be an int >= 0, got {req_rows!r}")
    if not isinstance(layers, range) or layers.step != 1 or not \
            0 <= layers.start <= layers.stop <= cfg.layers:
        raise ValueError(f"layers must be a range of step 1 within the model's {cfg.layers} "
                         f"layers, got {layers!r}")
    if not isinstance(reqs, cupy.ndarray) or reqs.dtype != cupy.int32 or reqs.ndim != 1 or \
            not reqs.flags.c_contiguous:
        what = (f"a {reqs.dtype} array of shape {reqs.shape}" if isinstance(reqs, cupy.ndarray)
                else type(reqs).__name__)
        raise TypeError(f"reqs must be a contiguous 1-D int32 CuPy array of request slots, got "
                        f"{what}")


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
        self.fp8 = bool(fp8)  # the rows' format (model.cu's instances)
        self.s = stream
        self.gemm = TorchGemm() if matmul == "torch" else Gemm(kernels)
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
        # the per-step launches' structs: the fixed fields now, a call's fields at the call
        self._attn = kernels.attn_partial[self.fp8]
        self._attn_p = self._attn.params(
            qraw=ptr(self.qraw), part_m=ptr(self.part_m), part_l=ptr(self.part_l),
            part_acc=ptr(self.part_acc), K=top_k, chunk=self.chunk, temp=temperature)
        self._comb_p = kernels.attn_combine.params(
            part_m=ptr(self.part_m), part_l=ptr(self.part_l), part_acc=ptr(self.part_acc),
            nsplit=self.nsplit, out=ptr(self.o), n_layers=n_layers)
        self._embed_p = kernels.embed.params(h=ptr(self.h), n=self.h.size)

    def _weights(self, shape, seed: int, scale: float) -> cupy.ndarray:
        w = cupy.empty(shape, cupy.uint16)
        n = w.size
        k = self.k.weights
        k((-(-n // 256),), k.params(w=ptr(w), n=n, seed=seed * 0x9E3779B9, scale=scale), self.s)
        return w

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.w_o, self.w_q, self.h, self.qraw, self.o,
                                      self.part_m, self.part_l, self.part_acc))

    def start(self, step_ctr: cupy.ndarray) -> None:
        """The step's input hidden state, then the first layer's query."""
        n = self.h.size
        self.k.embed((-(-n // 256),), self._embed_p.set(step=ptr(step_ctr)), self.s)
        self.gemm(self.h, self.w_q, self.qraw, self.s)

    def layer(self, locs: cupy.ndarray, rows: cupy.ndarray, layer: int, digest: cupy.ndarray,
              step_ctr: cupy.ndarray, last: bool) -> None:
        """Attention of every query row over its rows ``locs`` ([B, K] or [B, S, K]) of
        ``rows`` (uint8 [D, row bytes]: FP8 or bf16, as ``fp8`` said), its output folded into
        ``digest``; then the matmuls."""
        S = 1 if locs.ndim == 2 else locs.shape[1]
        ld_b = locs.strides[0] // 4
        ld_s = 0 if locs.ndim == 2 else locs.strides[1] // 4
        self._attn((self.nsplit, self.Q), self._attn_p.set(
            locs=locs.data.ptr, ld_b=ld_b, ld_s=ld_s, S=S, rows=rows.data.ptr), self.s)
        self.k.attn_combine((self.Q, HEADS), self._comb_p.set(
            digest=digest.data.ptr, step=step_ctr.data.ptr, layer=layer), self.s)
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
        fill = kernels.index_fill
        p = fill.params(n_rows=rows)
        for j in range(n_full):
            fill((-(-rows * (self.ROW // 4) // 256),), p.set(keys=ptr(self.keys[j]), layer=j),
                 stream)
        self._query_p = kernels.index_query.params(q=ptr(self.q), n_words=self.q.size // 4)
        self._score_p = kernels.indexer.params(q=ptr(self.q), S=drafts, max_len=max_len,
                                               scores=ptr(self.scores))

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.q.nbytes + self.scores.nbytes

    def query(self, step_ctr: cupy.ndarray) -> None:
        """The step's queries (a function of the step index on the device)."""
        n = self.q.size // 4
        self.k.index_query((-(-n // 256),), self._query_p.set(step=ptr(step_ctr)), self.s)

    def score(self, j: int, req: cupy.ndarray, lens: cupy.ndarray) -> None:
        """Full layer ``j``: query row ``b * S + s`` scores tokens ``[0, lens[b])`` of request
        slot ``req[b]``."""
        self.k.indexer((-(-self.max_len // self.TOKENS), self.q.shape[0]), self._score_p.set(
            keys=self.keys.data.ptr + j * self.keys.strides[0], req=ptr(req), lens=ptr(lens)),
            self.s)
