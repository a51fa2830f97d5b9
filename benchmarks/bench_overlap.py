"""IndexCache shared-layer IO overlap: a synthetic decode step with and without the side stream.

A step runs L layers with GLM-5.2's IndexShare pattern (78 layers, freq 4, offset 3: 21 full,
57 shared), or the same rule over 24 layers for quick runs (8 full, 16 shared). Per layer: a
stand-in attention kernel that reads every selected 656-byte row of the batch, then a cuBLAS
fp16 matmul sized so that the no-offload layer costs about 0.2 ms (issued through PyTorch on
the same stream, because CuPy refuses cuBLAS calls during graph capture; see ``Compute``).
K 2048, H 4096 (+64), every request 6656 tokens long; each step an "indexer" kernel slides
every request's top-k window by M tokens (M = miss rate x K new tokens per request per step,
all misses; the window runs over a fixed random permutation of the request's tokens, so host
reads are scattered over its rows). Every full layer has its own top-k: a fixed share of the
window's positions (``common``, 1.0 in the main table: all full layers select alike) selects
the same token in every full layer, the others a layer's own permutation's, so neighbouring
full layers' top-k overlap by about ``common``; the prediction sweep (batch 64, 5 %) runs
``common`` = 0.5, 0.7, 0.9 and 0.95. Every configuration starts from cold hot buffers.

Modes (each timed eager, one Python-driven step per event pair, and as one captured graph):
- no offload: every row already on the GPU (attention reads a fixed page table, no swap);
- no overlap: the full swap-in (resolve + copy) on every layer on the main stream
  (``Prefetcher`` with prefetch off);
- overlap: full layers swap on the main stream, a side stream replays their plan for the shared
  layers, shared layers wait on their event (``Prefetcher``);
- overlap, skip IO: the same with replays that move no bytes (the overlap's floor);
- overlap, predict: overlap plus prediction mode (``Prefetcher.set_predict``): while a full
  layer computes, a second side stream stages the rows the next full layer will probably miss
  (what the current one just missed and the next one does not hold); the next full layer's
  swap reads those from the device. Its precision and recall are reported;
- compute + copies: the no-offload step while the side stream replays the shared layers' plans;
  its main-stream time (to an event recorded before the join) over the no-offload step is the
  compute slowdown the concurrent copies cause.

Reported: per-step time (median, p10-p90, over >= 20 steps after warm-up), the offload overhead
over no offload, the fraction of it the overlap hides next to its ceiling (the shared layers'
share of the IO: every layer moves the same rows), the compute slowdown, and the ceilings
measured in the same run: a cudaMemcpyAsync H2D of the step's missed bytes and the replays
alone on an idle GPU. Everything is queued on explicit non-blocking streams.

    python benchmarks/bench_overlap.py [--quick] [--out DIR] [--only L:B:RATE ... [--predict-sweep]]
        [--node-priority]
        [--gemm-sms N] [--matmul-m M] [--replay-grid G] [--replay-rows-per-warp R]
        [--green-side N]
    python benchmarks/bench_overlap.py --plot DIR/bench_overlap.json   # PNG from a JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_info, memcpy_h2d, summary, time_calls, write_json  # noqa: E402

from hisparse_cupy import (  # noqa: E402
    HotBufferCache,
    LayerPattern,
    Prefetcher,
    SMPartition,
    replay_plan,
)
from hisparse_cupy.demo.loop import coprime  # noqa: E402

K, H, P, ROW = 2048, 4096, 64, 656
MAX_LEN = 6656  # token window U = 6655 >= H + K: a token coming back was evicted long ago
U = MAX_LEN - 1
TARGET_LAYER_US = 200.0
MM_N = 4096
MM_MAX = 16384
WARMUP = 3
MODES = ("no_offload", "no_overlap", "overlap", "overlap_skip_io", "overlap_predict",
         "compute_copies")
COMMON = (0.5, 0.7, 0.9, 0.95)  # top-k overlap of neighbouring full layers: prediction sweep

_SRC = r"""
// step t, full layer j, request b, entry k: window position pos = (t*M + 7919*b + k) mod U
// (the window slides by M a step). A "common" position (a fixed share `common` of all
// positions, the same for every layer) selects perm(pos, 0), any other one the layer's own
// perm(pos, salt_j); perm(x, s) = (a*x + 131*b + s) mod U, gcd(a, U) = 1 (a bijection). So
// neighbouring full layers' top-k overlap by about `common`, and each layer brings M new
// tokens a step. common >= 1: every layer selects the same tokens. out: [n_full, B, K].
extern "C" __global__ void gen_topk(int* out, int K, int M, int U, long long a,
                                    const int* step, float common, int B) {
  const int b = blockIdx.y, j = blockIdx.z;
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= K) return;
  const long long pos = (static_cast<long long>(*step) * M + 7919LL * b + k) % U;
  const unsigned h = static_cast<unsigned>(pos) * 2654435761u;
  const bool shared = common >= 1.0f || (h >> 8) % 100000u < static_cast<unsigned>(common * 1e5f);
  const long long salt = shared ? 0 : (1000003LL * (j + 1)) % U;
  out[(static_cast<long long>(j) * B + b) * K + k] =
      static_cast<int>((pos * a + 131LL * b + salt) % U);
}

extern "C" __global__ void tick(int* step) { *step += 1; }

// Stand-in attention: reads every selected row (16-byte vectors, one warp per row) and
// folds it into a per-request checksum.
extern "C" __global__ void attn(const int* locs, int K, const unsigned char* rows,
                                int row_bytes, unsigned int* out) {
  const int b = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nvec = row_bytes >> 4;
  unsigned int acc = 0;
  for (int k = blockIdx.x * 8 + warp; k < K; k += gridDim.x * 8) {
    const int loc = locs[static_cast<long long>(b) * K + k];
    if (loc < 0) continue;
    const uint4* r = reinterpret_cast<const uint4*>(rows + static_cast<long long>(loc) * row_bytes);
    for (int v = lane; v < nvec; v += 32) {
      const uint4 x = r[v];
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
  }
  for (int o = 16; o; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) atomicXor(out + b, acc);
}

// Fallback compute (only if cuBLAS cannot be captured): FMAs on every SM.
extern "C" __global__ void fma_burn(float* x, int iters) {
  float a = x[threadIdx.x], c = 1.0f + 1e-7f * threadIdx.x;
  for (int i = 0; i < iters; ++i) a = a * c + 1e-7f;
  if (a == 12345.0f) x[threadIdx.x] = a;
}
"""


class Kernels:
    def __init__(self):
        mod = cupy.RawModule(code=_SRC, options=("-std=c++17",))
        self.gen = mod.get_function("gen_topk")
        self.tick = mod.get_function("tick")
        self.attn = mod.get_function("attn")
        self.fma = mod.get_function("fma_burn")


class Compute:
    """The per-layer compute: a cuBLAS fp16 matmul ``[m, 4096] x [4096, 4096]``.

    CuPy refuses cuBLAS calls while a stream is captured, so the matmul runs through PyTorch
    (which owns its cuBLAS handle and workspace and can be captured) on the same main stream.
    Without PyTorch, or if its matmul cannot be captured and replayed exactly, an FMA kernel on
    every SM stands in (``kind`` says which ran). ``gemm_sms`` (not None): a bf16 matmul through
    the package's own cuBLAS binding (``hisparse_cupy.demo.model.Gemm``) limited to that many
    SMs (``cublasSetSmCountTarget``; 0: every SM), so copies on other SMs need not delay it.
    """

    def __init__(self, kern: Kernels, main: cupy.cuda.Stream, gemm_sms: int | None = None):
        self.kern, self.main = kern, main
        self.burn = cupy.zeros(1024, cupy.float32)
        self.sms = device_info()["sms"]
        self.m = 2048
        self.iters = 1000
        self.kind = "fma"
        self.gemm = None
        self.fixed_m = False  # True: calibrate() keeps m (the same work in every run)
        if gemm_sms is not None:
            from hisparse_cupy.demo.model import Gemm

            self.gemm = Gemm(None)
            self.gemm.set_sm_target(gemm_sms)  # raises without cuBLAS
            rnd = cupy.random.default_rng(0)
            self.w = (rnd.standard_normal((MM_N, MM_N), dtype=cupy.float32) * 0.01).astype(
                cupy.float16).view(cupy.uint16)  # bf16 needs no conversion for timing
            self.x = rnd.standard_normal((MM_MAX, MM_N), dtype=cupy.float32).astype(
                cupy.float16).view(cupy.uint16)
            self.y = cupy.empty((MM_MAX, MM_N), cupy.uint16)
            self.kind = f"cublas bf16 (own binding, SM target {gemm_sms or 'all'})"
            return
        try:
            import torch

            self.torch = torch
            self.tstream = torch.cuda.ExternalStream(main.ptr)
            torch.cuda.set_stream(self.tstream)  # torch's work goes to the main stream too
            gen = torch.Generator(device="cuda")
            gen.manual_seed(0)
            opts = {"device": "cuda", "dtype": torch.float16, "generator": gen}
            self.w = torch.randn(MM_N, MM_N, **opts) * 0.01
            self.x = torch.randn(MM_MAX, MM_N, **opts)
            self.y = torch.empty(MM_MAX, MM_N, device="cuda", dtype=torch.float16)
            self.kind = "cublas (torch)"
            self._check_capture()
        except Exception as e:  # noqa: BLE001 - any failure means: use the fallback
            print(f"cuBLAS matmul through PyTorch unusable in a captured graph here "
                  f"({type(e).__name__}: {e}); using an FMA kernel as the layer's compute")
            self.kind = "fma"

    def _check_capture(self) -> None:
        s, t = self.main, self.torch
        self.m = 256
        self()
        s.synchronize()
        want = self.y[:256].clone()
        s.synchronize()
        self.y[:256].zero_()
        s.begin_capture()
        try:
            self()
        finally:
            g = s.end_capture()
        g.launch(s)
        s.synchronize()
        if not t.allclose(self.y[:256], want, rtol=1e-2, atol=1e-2):
            raise RuntimeError("the captured matmul replayed a different result")
        self.m = 2048

    def __call__(self) -> None:
        if self.kind == "fma":
            self.kern.fma((self.sms * 4,), (256,), (self.burn, np.int32(self.iters)),
                   stream=self.main)
        elif self.gemm is not None:
            self.gemm(self.x[: self.m], self.w, self.y[: self.m], self.main)
        else:
            self.torch.matmul(self.x[: self.m], self.w, out=self.y[: self.m])

    def calibrate(self, target_us: float) -> float:
        """Size the compute to take ``target_us`` (unless its size is pinned: ``fixed_m``);
        returns its measured time (us)."""
        for _ in range(0 if self.fixed_m else 2):
            t = statistics.median(time_calls(lambda i: self(), iters=9, stream=self.main))
            scale = max(target_us, 1.0) / t
            if self.kind == "fma":
                self.iters = max(10, int(self.iters * scale))
            else:
                self.m = int(min(MM_MAX, max(64, round(self.m * scale / 64) * 64)))
        return statistics.median(time_calls(lambda i: self(), iters=9, stream=self.main))


def record_external(ev: cupy.cuda.Event, s: cupy.cuda.Stream) -> None:
    """Record ``ev`` on ``s``; inside a capture as an event-record node that can be timed."""
    if not s.is_capturing():
        ev.record(s)
        return
    from cuda.bindings import driver as cu

    (err,) = cu.cuEventRecordWithFlags(cu.CUevent(ev.ptr), cu.CUstream(s.ptr),
                                       cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuEventRecordWithFlags: {err}")


class Rig:
    """One cache of ``n_layers`` layers for up to ``bmax`` requests, and the step functions."""

    def __init__(self, n_layers: int, bmax: int, kern: Kernels, compute: Compute,
                 main: cupy.cuda.Stream, partition: SMPartition | None = None):
        self.L, self.bmax, self.kern, self.compute, self.main = n_layers, bmax, kern, compute, main
        self.pattern = LayerPattern.from_freq(n_layers, 4, 3)
        t0 = time.perf_counter()
        self.cache = HotBufferCache(n_layers=n_layers, max_requests=bmax, max_len=MAX_LEN,
                                    row_bytes=ROW, hot_size=H, top_k=K, extra_page=P)
        self.rids = [self.cache.admit(MAX_LEN, stream=main) for _ in range(bmax)]
        self.req = cupy.asarray(np.array(self.rids, np.int32))
        self.lens = cupy.full(bmax, MAX_LEN, cupy.int32)
        self.full_index = {f: j for j, f in enumerate(self.pattern.full_layers)}
        self.layer_topk = [self.full_index[layer if self.pattern.full[layer] else
                                           self.pattern.anchor(layer)] for layer in range(n_layers)]
        self.topk = cupy.empty((len(self.full_index), bmax, K), cupy.int32)
        self.common = 1.0  # share of window positions every full layer selects alike
        self.static = cupy.empty((bmax, K), cupy.int32)
        self.step_ctr = cupy.zeros(1, cupy.int32)
        self.sums = cupy.zeros(bmax, cupy.uint32)
        self.pf = Prefetcher(self.cache, self.pattern, partition=partition)
        self.fork = cupy.cuda.Event(disable_timing=True)
        self.done = cupy.cuda.Event(disable_timing=True)
        self.cc_end = cupy.cuda.Event()  # main stream's compute done (compute + copies mode)
        self.cc_external = True  # cc_end can be recorded inside a captured graph
        self.a = np.int64(coprime(U))
        main.synchronize()
        self.setup_s = time.perf_counter() - t0
        self.B, self.M = bmax, 1
        self.last = None
        self.node_priority = False  # capture(): keep the nodes' stream priorities (--node-priority)

    def reset(self) -> None:
        """Release and re-admit every request: cold hot buffers, so that from the second step
        on each request misses exactly the M tokens its window brings in."""
        s = self.main
        self.pf.finish(s)
        for rid in self.rids:
            self.cache.release(rid, stream=s)
        self.rids = [self.cache.admit(MAX_LEN, stream=s) for _ in range(self.bmax)]
        self.req[...] = cupy.asarray(np.array(self.rids, np.int32))

    # -------------------------------------------------------------- pieces
    def gen(self) -> None:
        self.kern.gen((-(-K // 256), self.B, self.topk.shape[0]), (256,),
                      (self.topk, np.int32(K), np.int32(self.M), np.int32(U), self.a,
                       self.step_ctr, np.float32(self.common), np.int32(self.bmax)),
                      stream=self.main)

    def attention(self, locs, layer: int) -> None:
        self.kern.attn((K // 64, self.B), (256,),
                       (locs, np.int32(K), self.cache.device[layer], np.int32(ROW), self.sums),
                       stream=self.main)

    # -------------------------------------------------------------- steps
    def step_offload(self) -> None:
        """no overlap / overlap (whichever the prefetcher is set to)."""
        B, s = self.B, self.main
        self.gen()
        req, lens = self.req[:B], self.lens[:B]
        step = self.cache.begin_step(req, lens, stream=s, prefetcher=self.pf)
        for layer in range(self.L):
            locs = step.swap(layer, self.topk[self.layer_topk[layer], :B])
            self.attention(locs, layer)
            self.compute()
        self.pf.finish(s)
        self.kern.tick((1,), (1,), (self.step_ctr,), stream=s)
        self.last = locs

    def step_no_offload(self) -> None:
        locs = self.static[: self.B]
        for layer in range(self.L):
            self.attention(locs, layer)
            self.compute()

    def step_compute_copies(self) -> None:
        """The no-offload step with each group's replays on the side stream (plan: the last
        step's, so the copies have the steady-state size)."""
        s, side, B = self.main, self.pf.side, self.B
        locs = self.static[:B]
        queued = False
        for layer in range(self.L):
            group = self.pattern.groups.get(layer, ())
            if group:
                self.fork.record(s)
                side.wait_event(self.fork)
                for sl in group:
                    replay_plan(self.cache.plan, B, device_rows=self.cache.device[sl],
                                pool=self.cache.pool, layer=sl, grid=self.pf.replay_grid,
                                rows_per_warp=self.pf.replay_rows_per_warp,
                                thin=self.pf.replay_thin, stream=side)
                queued = True
            self.attention(locs, layer)
            self.compute()
        if self.cc_external or not s.is_capturing():
            record_external(self.cc_end, s)
        if queued:
            self.done.record(side)
            s.wait_event(self.done)

    def replays_alone(self, grid: int, rpw: int, thin: bool) -> None:
        """Every shared layer's replay of one step, back to back on the main stream."""
        for sl in self.pattern.shared_layers:
            replay_plan(self.cache.plan, self.B, device_rows=self.cache.device[sl],
                        pool=self.cache.pool, layer=sl, grid=grid, rows_per_warp=rpw,
                        thin=thin, stream=self.main)

    def capture(self, fn):
        s = self.main
        s.begin_capture()
        try:
            fn()
        finally:
            g = s.end_capture()
        return PriorityGraph(g) if self.node_priority else g

    def close(self) -> None:
        self.main.synchronize()
        self.pf.synchronize()
        self.cache.close()


class PriorityGraph:
    """A captured graph instantiated with ``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY``:
    each kernel node keeps the priority of the stream it was captured on (the side streams'
    high priority); a graph instantiated without it runs every node at the launch stream's."""

    def __init__(self, g):
        from cuda.bindings import driver as cu

        self.cu, self.g = cu, g  # g owns the graph
        flag = cu.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
        err, self.exec = cu.cuGraphInstantiate(cu.CUgraph(g.graph), int(flag))
        if err != cu.CUresult.CUDA_SUCCESS:  # NOT_SUPPORTED: seen with the own binding's
            # bf16 matmul [3840, 4096] x [4096, 4096] (--gemm-sms); PyTorch's instantiates
            raise RuntimeError(f"cuGraphInstantiate(USE_NODE_PRIORITY): {err}")

    def launch(self, s: cupy.cuda.Stream) -> None:
        (err,) = self.cu.cuGraphLaunch(self.exec, self.cu.CUstream(s.ptr))
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuGraphLaunch: {err}")

    def __del__(self):
        if getattr(self, "exec", None) is not None:
            self.cu.cuGraphExecDestroy(self.exec)


def _ms(d: dict) -> dict:
    return {"median_ms": d["median_us"] / 1e3, "p10_ms": d["p10_us"] / 1e3,
            "p90_ms": d["p90_us"] / 1e3, "n": d["n"]}


def time_main_part(enqueue, end_ev: cupy.cuda.Event, iters: int, s: cupy.cuda.Stream) -> dict:
    """Microseconds from the start of ``enqueue()``'s work on ``s`` to ``end_ev`` (recorded by
    that work), per call, warm-up excluded."""
    e0 = cupy.cuda.Event()
    out = []
    for i in range(WARMUP + iters):
        e0.record(s)
        enqueue()
        s.synchronize()
        if i >= WARMUP:
            out.append(cupy.cuda.get_elapsed_time(e0, end_ev) * 1000.0)
    return summary(out)


def capture_cc(rig: Rig):
    """The compute + copies step as a graph; without a timable end event if the driver refuses
    an external event record inside the capture."""
    try:
        return rig.capture(rig.step_compute_copies)
    except Exception as e:  # noqa: BLE001
        if not rig.cc_external:
            raise
        print(f"no event-record node in a captured graph ({type(e).__name__}: {e}); "
              f"graph compute slowdown not measured")
        rig.cc_external = False
        return rig.capture(rig.step_compute_copies)


def prepare_config(rig: Rig, B: int, rate: float) -> tuple[float, float, float]:
    """Cold caches warmed up in overlap mode, the layer compute calibrated to
    TARGET_LAYER_US; returns (misses per request, attention us, matmul us)."""
    s, pf = rig.main, rig.pf
    rig.B, rig.M = B, max(1, int(round(rate * K)))
    pf.set_enabled(True, s)
    pf.dry_run = False
    rig.reset()
    # warm-up: overlap mode (compiles everything; from the second step every request misses
    # exactly the M tokens its window brings in)
    for _ in range(4):
        rig.step_offload()
    rig.static[:B] = rig.last
    s.synchronize()
    misses = float(cupy.asnumpy(rig.cache.plan.count[:B]).mean())
    attn_us = statistics.median(time_calls(lambda i: rig.attention(rig.static[:B], 0), iters=9,
                                           stream=s))
    mm_us = rig.compute.calibrate(TARGET_LAYER_US - attn_us)
    # second pass on the whole layer (launch gaps, the attention next to the compute)
    g = rig.capture(rig.step_no_offload)
    t_step = statistics.median(time_calls(lambda i, g=g: g.launch(s), iters=5, stream=s))
    mm_us = rig.compute.calibrate(mm_us + TARGET_LAYER_US - t_step / rig.L)
    del g
    return misses, attn_us, mm_us


def run_config(rig: Rig, B: int, rate: float, iters: int, sweep: bool,
               predict_sweep: bool) -> dict:
    s, pf = rig.main, rig.pf
    misses, attn_us, mm_us = prepare_config(rig, B, rate)

    graphs = {}
    graphs["no_offload"] = rig.capture(rig.step_no_offload)
    graphs["overlap"] = rig.capture(rig.step_offload)
    pf.dry_run = True
    graphs["overlap_skip_io"] = rig.capture(rig.step_offload)
    pf.dry_run = False
    graphs["compute_copies"] = capture_cc(rig)
    pf.set_predict(True, s)
    graphs["overlap_predict"] = rig.capture(rig.step_offload)
    pf.set_predict(False, s)
    pf.set_enabled(False, s)
    graphs["no_overlap"] = rig.capture(rig.step_offload)
    pf.set_enabled(True, s)

    def prepare(mode):
        set_mode(pf, mode, s)

    eager_fn = {"no_offload": rig.step_no_offload, "no_overlap": rig.step_offload,
                "overlap": rig.step_offload, "overlap_skip_io": rig.step_offload,
                "overlap_predict": rig.step_offload, "compute_copies": rig.step_compute_copies}
    res = {"eager": {}, "graph": {}}
    cc_main = {}
    host = {}
    pred = {}
    for mode in MODES:
        prepare(mode)
        spent = []

        def eager(i, fn=eager_fn[mode], spent=spent):
            t = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - t)

        res["eager"][mode] = _ms(summary(time_calls(eager, iters=iters, warmup=WARMUP,
                                                    stream=s)))
        host[mode] = 1e3 * statistics.median(spent)
        g = graphs[mode]
        res["graph"][mode] = _ms(summary(time_calls(lambda i, g=g: g.launch(s), iters=iters,
                                                    warmup=WARMUP, stream=s)))
        if mode == "overlap_predict":  # eager and graph steps together
            pred = pf.predict_summary()
    # compute + copies: time of the main stream's compute alone (to its end event)
    cc_main["eager"] = _ms(time_main_part(rig.step_compute_copies, rig.cc_end, iters, s))
    if rig.cc_external:
        g = graphs["compute_copies"]
        cc_main["graph"] = _ms(time_main_part(lambda: g.launch(s), rig.cc_end, iters, s))
    prepare("overlap")
    s.synchronize()
    misses_end = float(cupy.asnumpy(rig.cache.plan.count[:B]).mean())

    # ceilings, same run: the step's missed bytes by cudaMemcpyAsync, and the replays alone
    bytes_layer = B * misses_end * ROW
    step_bytes = int(bytes_layer * rig.L)
    mc_single, mc_chain = memcpy_h2d(rig.cache.pool.numpy, step_bytes, iters=10, chain=2,
                                     stream=s)
    shared_bytes = bytes_layer * len(rig.pattern.shared_layers)
    alone = {}
    for name, grid, rpw, thin in (("replay_grid", pf.replay_grid, pf.replay_rows_per_warp,
                                   pf.replay_thin), ("full_grid", None, 1, False)):
        g = rig.capture(lambda grid=grid, rpw=rpw, thin=thin: rig.replays_alone(grid, rpw, thin))
        t = summary(time_calls(lambda i, g=g: g.launch(s), iters=10, stream=s))
        alone[name] = {"ms": t["median_us"] / 1e3,
                       "GBps": shared_bytes / t["median_us"] / 1e3}
    del graphs
    n_shared = len(rig.pattern.shared_layers)
    derived = {}
    for ex in ("eager", "graph"):
        m = {k: v["median_ms"] for k, v in res[ex].items()}
        o_sync = m["no_overlap"] - m["no_offload"]
        o_ovl = m["overlap"] - m["no_offload"]
        o_dry = m["overlap_skip_io"] - m["no_offload"]
        o_pred = m["overlap_predict"] - m["no_offload"]
        cc = cc_main.get(ex)
        derived[ex] = {
            "overhead_no_overlap_ms": o_sync, "overhead_overlap_ms": o_ovl,
            "overhead_predict_ms": o_pred,
            "hidden": 1.0 - o_ovl / o_sync if o_sync > 0 else float("nan"),
            "hidden_skip_io": 1.0 - o_dry / o_sync if o_sync > 0 else float("nan"),
            "hidden_predict": 1.0 - o_pred / o_sync if o_sync > 0 else float("nan"),
            "ceiling": n_shared / rig.L,
            "compute_slowdown": (cc["median_ms"] / m["no_offload"] - 1.0) if cc else None,
            "offload_GBps_no_overlap": step_bytes / (o_sync * 1e6) if o_sync > 0 else None,
        }
    out = {"layers": rig.L, "batch": B, "miss_rate": rate, "misses_per_request": misses,
           "misses_per_request_end": misses_end,
           "full_layers": len(rig.pattern.full_layers), "shared_layers": n_shared,
           "attn_us": attn_us, "compute_us": mm_us, "compute_kind": rig.compute.kind,
           "matmul_m": rig.compute.m, "replay_grid": pf.replay_grid,
           "replay_rows_per_warp": pf.replay_rows_per_warp, "replay_thin": pf.replay_thin,
           "step_io_bytes": step_bytes, "memcpy_step_io_ms": mc_single["median_us"] / 1e3,
           "memcpy_GBps": step_bytes / mc_single["median_us"] / 1e3,
           "memcpy_chain_GBps": step_bytes / mc_chain["median_us"] / 1e3,
           "replays_alone": alone, "host_enqueue_ms_eager": host,
           "modes": res, "compute_copies_main_ms": cc_main, "derived": derived,
           "common": rig.common, "predict": pred}
    if sweep:
        out["sweep"] = run_sweep(rig, res["graph"], iters)
    if predict_sweep:
        out["predict_sweep"] = run_predict_sweep(rig, res["graph"], iters)
    return out


def set_mode(pf: Prefetcher, mode: str, s: cupy.cuda.Stream) -> None:
    """Set the prefetcher up for one of the offload modes of MODES (prefetch, dry run,
    prediction; prediction's counters zeroed)."""
    pf.set_enabled(mode != "no_overlap", s)
    pf.dry_run = mode == "overlap_skip_io"
    pf.set_predict(mode == "overlap_predict", s)
    if pf.predict:
        pf.predict_stats.fill(0)


def run_predict_sweep(rig: Rig, base: dict, iters: int) -> list[dict]:
    """No overlap, overlap and prediction (graph) with neighbouring full layers' top-k
    overlapping by each of COMMON (cold caches, warmed up, for each)."""
    s, pf = rig.main, rig.pf
    t0 = base["no_offload"]["median_ms"]
    rows = []
    for common in COMMON:
        rig.common = common
        pf.set_predict(False, s)
        pf.set_enabled(True, s)
        rig.reset()
        for _ in range(4):
            rig.step_offload()
        t = {}
        for mode in ("no_overlap", "overlap", "overlap_predict"):
            set_mode(pf, mode, s)
            g = rig.capture(rig.step_offload)
            t[mode] = _ms(summary(time_calls(lambda i, g=g: g.launch(s), iters=iters,
                                             warmup=WARMUP, stream=s)))
            del g
        p = pf.predict_summary()
        o_sync = t["no_overlap"]["median_ms"] - t0
        rows.append({"common": common, **t, "predict": p,
                     "hidden": 1.0 - (t["overlap"]["median_ms"] - t0) / o_sync,
                     "hidden_predict": 1.0 - (t["overlap_predict"]["median_ms"] - t0) / o_sync})
    rig.common = 1.0
    pf.set_predict(False, s)
    pf.set_enabled(True, s)
    s.synchronize()
    return rows


def predict_table(results: list[dict]) -> str:
    lines = ["| layers | batch | miss % | top-k overlap | no overlap ms | overlap ms | predict ms "
             "| hidden overlap | hidden predict | precision | recall |", "|---" * 11 + "|"]
    for r in results:
        pts = [{"common": r.get("common", 1.0), "no_overlap": r["modes"]["graph"]["no_overlap"],
                "overlap": r["modes"]["graph"]["overlap"],
                "overlap_predict": r["modes"]["graph"].get("overlap_predict"),
                "hidden": r["derived"]["graph"]["hidden"],
                "hidden_predict": r["derived"]["graph"].get("hidden_predict"),
                "predict": r.get("predict") or {}}] + r.get("predict_sweep", [])
        for w in pts:
            if w["overlap_predict"] is None:
                continue
            p = w["predict"]
            lines.append(f"| {r['layers']} | {r['batch']} | {r['miss_rate'] * 100:g} | "
                         f"{w['common'] * 100:g}% | {w['no_overlap']['median_ms']:.2f} | "
                         f"{w['overlap']['median_ms']:.2f} | "
                         f"{w['overlap_predict']['median_ms']:.2f} | {w['hidden'] * 100:.1f}% | "
                         f"{w['hidden_predict'] * 100:.1f}% | {p.get('precision', 0):.3f} | "
                         f"{p.get('recall', 0):.3f} |")
    return "\n".join(lines)


# (replay grid, rows per warp, thin blocks, side priority) of the sweep; None: the
# prefetcher's default; the default's row comes first
SWEEP = [(None, None, None, "high"), (8, 4, False, "high"), (16, 2, False, "high"),
         (33, 1, False, "high"), (33, 2, False, "high"), (132, 1, False, "high"),
         (132, 1, True, "high"), (264, 1, True, "high"), (264, 2, True, "high"),
         (528, 1, True, "high"), (528, 2, True, "high"), (1056, 2, True, "high"),
         (528, 2, True, "default"), (None, None, None, "default")]


def run_sweep(rig: Rig, base: dict, iters: int) -> list[dict]:
    """Overlap and compute + copies (graph) for other replay grids, rows per warp and the side
    stream's priority (``None``: the prefetcher's default)."""
    s, pf = rig.main, rig.pf
    grid0, rpw0, thin0, side0 = pf.replay_grid, pf.replay_rows_per_warp, pf.replay_thin, pf.side
    low = cupy.cuda.Stream(non_blocking=True)  # default priority
    t0 = base["no_offload"]["median_ms"]
    o_sync = base["no_overlap"]["median_ms"] - t0
    rows = []
    for grid, rpw, thin, prio in SWEEP:
        grid, rpw, thin = grid or grid0, rpw or rpw0, thin0 if thin is None else thin
        pf.replay_grid, pf.replay_rows_per_warp, pf.replay_thin = grid, rpw, thin
        pf.side = side0 if prio == "high" else low
        g_ovl = rig.capture(rig.step_offload)
        g_cc = capture_cc(rig)
        t_ovl = _ms(summary(time_calls(lambda i, g=g_ovl: g.launch(s), iters=iters,
                                       warmup=WARMUP, stream=s)))
        t_cc = (_ms(time_main_part(lambda g=g_cc: g.launch(s), rig.cc_end, iters, s))
                if rig.cc_external else None)
        rows.append({"replay_grid": grid, "rows_per_warp": rpw, "thin": thin,
                     "side_priority": prio,
                     "overlap": t_ovl,
                     "hidden": 1.0 - (t_ovl["median_ms"] - t0) / o_sync,
                     "compute_main": t_cc,
                     "compute_slowdown": t_cc["median_ms"] / t0 - 1.0 if t_cc else None})
        del g_ovl, g_cc
    pf.replay_grid, pf.replay_rows_per_warp, pf.replay_thin, pf.side = grid0, rpw0, thin0, side0
    s.synchronize()
    low.synchronize()
    return rows


def _pct(v) -> str:
    return "n/a" if v is None else f"{v * 100:+.1f}%"


def sweep_table(results: list[dict]) -> str:
    lines = ["| layers | batch | miss % | replay grid | rows/warp | block | side priority | "
             "overlap ms | hidden | compute slowdown |", "|---" * 10 + "|"]
    for r in results:
        for w in r.get("sweep", ()):
            lines.append(f"| {r['layers']} | {r['batch']} | {r['miss_rate'] * 100:g} | "
                         f"{w['replay_grid']} | {w.get('rows_per_warp', 1)} | "
                         f"{'1 warp' if w.get('thin') else '8 warps'} | "
                         f"{w['side_priority']} | {_fmt(w['overlap'])} | "
                         f"{w['hidden'] * 100:.1f}% | {_pct(w['compute_slowdown'])} |")
    return "\n".join(lines)


def _fmt(d: dict) -> str:
    return f"{d['median_ms']:.2f} [{d['p10_ms']:.2f}-{d['p90_ms']:.2f}]"


HEADER = ("| layers | batch | miss % (per req, start/end) | exec | no offload ms | no overlap ms "
          "| overlap ms | skip-IO ms | overhead no-ovl / ovl ms | hidden | ceiling "
          "| hidden skip-IO | compute slowdown | step IO MB | memcpy ms |\n" + "|---" * 15 + "|")


def table(results: list[dict]) -> str:
    lines = [HEADER]
    for r in results:
        for ex in ("graph", "eager"):
            m, d = r["modes"][ex], r["derived"][ex]
            lines.append(
                f"| {r['layers']} | {r['batch']} | {r['miss_rate'] * 100:g} "
                f"({r['misses_per_request']:.0f}/{r['misses_per_request_end']:.0f}) | {ex} | "
                f"{_fmt(m['no_offload'])} | "
                f"{_fmt(m['no_overlap'])} | {_fmt(m['overlap'])} | "
                f"{m['overlap_skip_io']['median_ms']:.2f} | "
                f"{d['overhead_no_overlap_ms']:.2f} / {d['overhead_overlap_ms']:.2f} | "
                f"{d['hidden'] * 100:.1f}% | {d['ceiling'] * 100:.1f}% | "
                f"{d['hidden_skip_io'] * 100:.1f}% | {_pct(d['compute_slowdown'])} | "
                f"{r['step_io_bytes'] / 1e6:.1f} | {r['memcpy_step_io_ms']:.2f} |")
    return "\n".join(lines)


def plot(payload: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG (render it later with --plot JSON)")
        return False
    res = payload["results"]
    labels = [f"L{r['layers']} B{r['batch']}\n{r['miss_rate'] * 100:g}%" for r in res]
    x = np.arange(len(res))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(12, 2.8 * len(res)), 4.5))
    names = {"no_offload": "no offload", "no_overlap": "offload, no overlap",
             "overlap": "offload, overlap", "overlap_skip_io": "overlap, replays skip IO"}
    w = 0.8 / len(names)
    for j, (mode, lab) in enumerate(names.items()):
        med = np.array([r["modes"]["graph"][mode]["median_ms"] for r in res])
        lo = med - np.array([r["modes"]["graph"][mode]["p10_ms"] for r in res])
        hi = np.array([r["modes"]["graph"][mode]["p90_ms"] for r in res]) - med
        base = np.array([r["modes"]["graph"]["no_offload"]["median_ms"] for r in res])
        a1.bar(x + (j - 1.5) * w, med / base, w, yerr=[lo / base, hi / base], label=lab)
    a1.set_xticks(x, labels)
    a1.set_ylabel("step time / no-offload step (graph)")
    top = max(r["modes"]["graph"][m]["p90_ms"] / r["modes"]["graph"]["no_offload"]["median_ms"]
              for r in res for m in names)
    a1.set_ylim(0.9, 0.9 + (top - 0.9) * 1.35)
    a1.legend(fontsize=8, loc="upper center", ncol=2)
    a1.set_title("per-step time, CUDA graph")
    for j, ex in enumerate(("graph", "eager")):
        a2.bar(x + (j - 0.5) * 0.35, [100 * r["derived"][ex]["hidden"] for r in res], 0.35,
               label=f"hidden ({ex})")
    a2.scatter(x, [100 * r["derived"]["graph"]["ceiling"] for r in res], marker="_", s=600,
               color="k", label="ceiling (shared layers' IO share)", zorder=3)
    a2.axhline(55.6, color="gray", ls="--", lw=0.8, label="SGLang #28523: 55.6%")
    a2.set_xticks(x, labels)
    a2.set_ylabel("% of the offload overhead hidden")
    a2.set_title("fraction of the offload overhead hidden")
    a2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    dev = payload.get("device", {}).get("name", "")
    fig.suptitle(f"IndexCache shared-layer IO overlap, {dev}, K {K}, H {H}, rows {ROW} B")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def add_rig_args(ap: argparse.ArgumentParser) -> None:
    """The layer compute's and the replays' options (this script and ``overlap_waits``)."""
    ap.add_argument("--gemm-sms", type=int, default=None,
                    help="the layer matmul through the package's cuBLAS binding on at most this "
                         "many SMs (0: all); default: PyTorch's matmul")
    ap.add_argument("--matmul-m", type=int, default=None,
                    help="the layer matmul's rows, fixed (default: calibrated per run)")
    ap.add_argument("--replay-grid", type=int, default=None, help="the prefetcher's replay grid")
    ap.add_argument("--replay-rows-per-warp", type=int, default=None,
                    help="rows each replay warp keeps in flight")
    ap.add_argument("--green-side", type=int, default=None, metavar="N",
                    help="side streams on N SMs of their own and the step on the rest "
                         "(SMPartition, CUDA green contexts); the matmul's SM target defaults "
                         "to the rest")


def make_main_stream(a: argparse.Namespace):
    """The step's main stream, and the SM partition (--green-side) or None."""
    if not a.green_side:
        return cupy.cuda.Stream(non_blocking=True), None
    part = SMPartition(a.green_side)
    if a.gemm_sms is None:
        a.gemm_sms = part.main_sms
    print(f"SM partition: side streams on {part.side_sms} SMs, the step on {part.main_sms} "
          f"(matmul SM target {a.gemm_sms})", flush=True)
    return part.stream("main"), part


def make_compute(kern: Kernels, main_s: cupy.cuda.Stream, a: argparse.Namespace) -> Compute:
    compute = Compute(kern, main_s, a.gemm_sms)
    if a.matmul_m:
        if compute.kind == "fma":
            raise SystemExit("--matmul-m needs a cuBLAS matmul")
        compute.m, compute.fixed_m = a.matmul_m, True
    return compute


def shape_replays(pf: Prefetcher, a: argparse.Namespace) -> None:
    if a.replay_grid:
        pf.replay_grid = a.replay_grid
    if a.replay_rows_per_warp:
        pf.replay_rows_per_warp = a.replay_rows_per_warp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="24-layer pattern (plus the 78-layer target point), fewer configs")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--plot", metavar="JSON", help="only render the PNG of an existing JSON")
    ap.add_argument("--only", nargs="*", metavar="L:B:RATE",
                    help="run only these configurations (e.g. 78:64:0.05), without the sweeps "
                         "(--predict-sweep adds the prediction sweep)")
    ap.add_argument("--predict-sweep", action="store_true",
                    help="with --only: also the prediction sweep over top-k overlaps (batch 64, "
                         "5 %% rows only, as in the full run)")
    ap.add_argument("--node-priority", action="store_true",
                    help="instantiate the captured steps with each kernel's stream priority "
                         "(CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)")
    add_rig_args(ap)
    a = ap.parse_args()
    if a.node_priority and a.gemm_sms is not None:
        raise SystemExit("--node-priority with --gemm-sms: the driver refuses to keep node "
                         "priorities in a graph with the package's own cuBLAS matmul of this size "
                         "(CUDA_ERROR_NOT_SUPPORTED on the H200); use PyTorch's matmul")
    if a.predict_sweep and not a.only:
        raise SystemExit("--predict-sweep goes with --only (a full or --quick run has the sweep)")
    if a.plot:
        payload = json.loads(Path(a.plot).read_text())
        plot(payload, Path(a.plot).with_suffix(".png"))
        print(sweep_table(payload["results"]))
        print(table(payload["results"]))
        print(predict_table(payload["results"]))
        return
    if a.quick:
        plan = [(24, [(8, 0.05), (64, 0.01), (64, 0.05), (64, 0.20), (128, 0.05)]),
                (78, [(64, 0.05)])]
        iters = 20
    else:
        grid = [(b, r) for b in (8, 32, 64, 128) for r in (0.01, 0.05, 0.20)]
        plan = [(24, grid), (78, grid)]
        iters = 30
    sweeps = not a.only
    if a.only:
        try:
            picked = [tuple(float(v) for v in o.split(":")) for o in a.only]
            if any(len(p) != 3 or p[0] < 4 or p[1] < 1 for p in picked):
                raise ValueError
        except ValueError:
            raise SystemExit(f"--only takes LAYERS:BATCH:RATE, layers >= 4, batch >= 1 (e.g. "
                             f"78:64:0.05), got {a.only}") from None
        plan = [(n, [(int(b), r) for ln, b, r in picked if int(ln) == n])
                for n in sorted({int(p[0]) for p in picked})]
    main_s, part = make_main_stream(a)
    main_s.use()  # every CuPy op of this script runs on it, never on the legacy stream
    t0 = time.perf_counter()
    out = Path(a.out)
    kern = Kernels()
    compute = make_compute(kern, main_s, a)
    results = []
    payload = {"device": device_info(), "K": K, "H": H, "P": P, "row_bytes": ROW,
               "max_len": MAX_LEN, "iters": iters, "warmup": WARMUP,
               "target_layer_us": TARGET_LAYER_US, "setup_s": {}, "results": results,
               "gemm_sms": a.gemm_sms, "matmul_m": a.matmul_m, "replay_grid": a.replay_grid,
               "replay_rows_per_warp": a.replay_rows_per_warp, "node_priority": a.node_priority,
               "sm_partition": None if part is None else {"side": part.side_sms,
                                                          "main": part.main_sms}}
    for n_layers, configs in plan:
        bmax = max(b for b, _ in configs)
        rig = Rig(n_layers, bmax, kern, compute, main_s, part)
        rig.node_priority = a.node_priority
        shape_replays(rig.pf, a)
        payload["setup_s"][n_layers] = rig.setup_s
        print(f"{n_layers} layers, {bmax} requests: cache built in {rig.setup_s:.1f} s "
              f"(pattern {rig.pattern})", flush=True)
        for B, rate in configs:
            t1 = time.perf_counter()
            at = (B, rate) == (64, 0.05)
            r = run_config(rig, B, rate, iters, sweep=sweeps and at,
                           predict_sweep=(sweeps or a.predict_sweep) and at)
            results.append(r)
            payload["wall_s"] = time.perf_counter() - t0
            write_json(str(out), "bench_overlap.json", payload)  # partial results survive
            d = r["derived"]["graph"]
            print(f"L{n_layers} B{B} {rate * 100:g}%: graph no-offload "
                  f"{r['modes']['graph']['no_offload']['median_ms']:.2f} ms, no-overlap "
                  f"{r['modes']['graph']['no_overlap']['median_ms']:.2f}, overlap "
                  f"{r['modes']['graph']['overlap']['median_ms']:.2f}; hidden "
                  f"{d['hidden'] * 100:.1f}% of ceiling {d['ceiling'] * 100:.1f}% "
                  f"({time.perf_counter() - t1:.1f} s)", flush=True)
        rig.close()
        del rig
        cupy.get_default_memory_pool().free_all_blocks()
    if part is not None:
        part.close()
    plot(payload, out / "bench_overlap.png")
    for r in results:
        c = r["replays_alone"]
        print(f"ceilings L{r['layers']} B{r['batch']} {r['miss_rate'] * 100:g}%: memcpy H2D of "
              f"the step's {r['step_io_bytes'] / 1e6:.1f} MB {r['memcpy_step_io_ms']:.2f} ms "
              f"({r['memcpy_GBps']:.1f} GB/s); shared replays alone "
              f"{c['replay_grid']['ms']:.2f} ms ({c['replay_grid']['GBps']:.1f} GB/s, grid "
              f"{r['replay_grid']}) / {c['full_grid']['ms']:.2f} ms full grid; layer compute "
              f"{r['attn_us']:.0f} us attention + {r['compute_us']:.0f} us {r['compute_kind']}; "
              f"eager host enqueue {r['host_enqueue_ms_eager']['overlap']:.2f} ms/step")
    print(sweep_table(results))
    print(table(results))
    print(predict_table(results))


if __name__ == "__main__":
    main()
