"""The workload of ``bench_overlap.py`` (and ``overlap_waits.py``, ``ncu_overlap_step.py``): one
cache, its :class:`~hisparse_cupy.Prefetcher`, the synthetic decode step and its modes.

The step's own kernels (the "indexer" that slides each request's top-k window, the stand-in
attention) are here; the layer's matmul is :class:`hisparse_cupy.demo._compute.LayerCompute`.
Every offloaded step runs through the Prefetcher itself (``cache.begin_step(...,
prefetcher=pf).swap(layer, topk)`` per layer, ``pf.finish``). Two measurements the Prefetcher
does not expose time :func:`hisparse_cupy.replay_plan` calls with its public settings
(``replay_grid``, ``replay_rows_per_warp``, ``side``): the no-offload step beside the shared
layers' replays (compute + copies) and the replays alone (a ceiling).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import cupy
import numpy as np
from _timing import summary, time_calls

from hisparse_cupy import HotBufferCache, LayerPattern, Prefetcher, SMPartition, replay_plan
from hisparse_cupy.demo._compute import LayerCompute
from hisparse_cupy.demo._loop import coprime

K, H, P, ROW = 2048, 4096, 64, 656
MAX_LEN = 6656  # token window U = 6655 >= H + K: a token coming back was evicted long ago
U = MAX_LEN - 1
TARGET_LAYER_US = 200.0
MM_N = 4096
MM_MAX = 16384
WARMUP = 3

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
"""


class Kernels:
    """The step's own kernels (``_SRC``), compiled once."""

    def __init__(self):
        mod = cupy.RawModule(code=_SRC, options=("-std=c++17",))
        self.gen = mod.get_function("gen_topk")
        self.tick = mod.get_function("tick")
        self.attn = mod.get_function("attn")


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

    def __init__(self, n_layers: int, bmax: int, kern: Kernels, compute: LayerCompute,
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

    def swap(self, step, layer: int, top_k):
        """One layer's ``step.swap`` (``overlap_waits.py`` wraps this to time full swaps)."""
        return step.swap(layer, top_k)

    def replay_shared(self, layers, stream: cupy.cuda.Stream, grid: int | None,
                      rows_per_warp: int) -> None:
        """The last swap's plan replayed into each of ``layers`` (rows from their host rows),
        one ``replay_plan`` launch each on ``stream``."""
        c = self.cache
        for sl in layers:
            replay_plan(c.plan, self.B, device_rows=c.device[sl], pool=c.pool, layer=sl,
                        grid=grid, rows_per_warp=rows_per_warp, stream=stream)

    # -------------------------------------------------------------- steps
    def step_offload(self) -> None:
        """no overlap / overlap (whichever the prefetcher is set to): the step through the
        Prefetcher."""
        B, s = self.B, self.main
        self.gen()
        req, lens = self.req[:B], self.lens[:B]
        step = self.cache.begin_step(req, lens, stream=s, prefetcher=self.pf)
        for layer in range(self.L):
            locs = self.swap(step, layer, self.topk[self.layer_topk[layer], :B])
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
        """The no-offload step with each group's replays on the prefetcher's side stream, at
        its replay settings (plan: the last step's, so the copies have the steady-state
        size)."""
        s, pf = self.main, self.pf
        side = pf.side
        locs = self.static[: self.B]
        queued = False
        for layer in range(self.L):
            group = self.pattern.groups.get(layer, ())
            if group:
                self.fork.record(s)
                side.wait_event(self.fork)
                self.replay_shared(group, side, pf.replay_grid, pf.replay_rows_per_warp)
                queued = True
            self.attention(locs, layer)
            self.compute()
        if self.cc_external or not s.is_capturing():
            record_external(self.cc_end, s)
        if queued:
            self.done.record(side)
            s.wait_event(self.done)

    def replays_alone(self, grid: int | None, rpw: int) -> None:
        """Every shared layer's replay of one step, back to back on the main stream
        (``grid`` None: replay_plan's default, at most the full grid)."""
        self.replay_shared(self.pattern.shared_layers, self.main, grid, rpw)

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


# ------------------------------------------------------------------ modes and timing
def ms_summary(d: dict) -> dict:
    """A ``_timing.summary`` (microseconds) as the JSON's median / p10 / p90 in milliseconds."""
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


def skip_io(pf: Prefetcher):
    """Context: the prefetcher's side-stream replays do all their work but move no bytes (the
    overlap's floor; shared layers then read stale rows). Captures inside it keep the probe."""
    from hisparse_cupy.testing.probe import copy_probe

    return copy_probe(dry_run=True, streams=[pf.side])


def set_mode(pf: Prefetcher, mode: str, s: cupy.cuda.Stream):
    """Set the prefetcher up for one of the offload modes (prefetch, prediction; prediction's
    counters zeroed). Returns the context the mode's steps run in: :func:`skip_io` for
    ``overlap_skip_io``, else a null context."""
    pf.set_enabled(mode != "no_overlap", s)
    pf.set_predict(mode == "overlap_predict", s)
    if pf.predict:
        pf.predict_stats.fill(0)
    return skip_io(pf) if mode == "overlap_skip_io" else contextlib.nullcontext()


def calibrate(compute: LayerCompute, target_us: float, s: cupy.cuda.Stream) -> float:
    """Size the compute to take ``target_us`` (unless its size is pinned); returns its measured
    time (us)."""
    for _ in range(0 if compute.fixed_m else 2):
        t = statistics.median(time_calls(lambda i: compute(), iters=9, stream=s))
        compute.rescale(max(target_us, 1.0) / t)
    return statistics.median(time_calls(lambda i: compute(), iters=9, stream=s))


def prepare_config(rig: Rig, B: int, rate: float) -> tuple[float, float, float]:
    """Cold caches warmed up in overlap mode, the layer compute calibrated to
    TARGET_LAYER_US; returns (misses per request, attention us, matmul us)."""
    s, pf = rig.main, rig.pf
    rig.B, rig.M = B, max(1, int(round(rate * K)))
    pf.set_enabled(True, s)
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
    mm_us = calibrate(rig.compute, TARGET_LAYER_US - attn_us, s)
    # second pass on the whole layer (launch gaps, the attention next to the compute)
    g = rig.capture(rig.step_no_offload)
    t_step = statistics.median(time_calls(lambda i, g=g: g.launch(s), iters=5, stream=s))
    mm_us = calibrate(rig.compute, mm_us + TARGET_LAYER_US - t_step / rig.L, s)
    del g
    return misses, attn_us, mm_us


# ------------------------------------------------------------------ options
def add_rig_args(ap: argparse.ArgumentParser) -> None:
    """The layer compute's and the replays' options (``bench_overlap``, ``overlap_waits``,
    ``ncu_overlap_step``)."""
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


def make_compute(main_s: cupy.cuda.Stream, a: argparse.Namespace) -> LayerCompute:
    compute = LayerCompute(main_s, gemm_sms=a.gemm_sms, n=MM_N, max_m=MM_MAX)
    if a.matmul_m:
        if compute.kind == "fma":
            raise SystemExit("--matmul-m needs a cuBLAS matmul")
        compute.pin(a.matmul_m)
    return compute


def shape_replays(pf: Prefetcher, a: argparse.Namespace) -> None:
    if a.replay_grid:
        pf.replay_grid = a.replay_grid
    if a.replay_rows_per_warp:
        pf.replay_rows_per_warp = a.replay_rows_per_warp


def build(a: argparse.Namespace, n_layers: int, bmax: int):
    """Main stream (made current), partition, kernels, compute and a :class:`Rig` shaped by
    the options: ``(rig, partition or None)``."""
    main_s, part = make_main_stream(a)
    main_s.use()  # every CuPy op runs on it, never on the legacy stream
    kern = Kernels()
    rig = Rig(n_layers, bmax, kern, make_compute(main_s, a), main_s, part)
    shape_replays(rig.pf, a)
    return rig, part
