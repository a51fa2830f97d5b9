// hisparse_cupy: planned copy (miss-plan replay).
//
// planned_copy<SrcT, DstT, R>(PlannedCopyParams)
//   For every layer l < n_layers, real request b < min(num_real, B) and plan entry
//   m < clamp(count[b], 0, plan_stride): copy row src_idx[b, m] of layer l of the source pool to
//   row dst_idx[b, m] of layer l of the destination pool. The swap kernels write such plans; the
//   same kernel moves their misses, replays them for IndexCache shared layers, loads admitted
//   requests and backs rows up to the host (SrcT/DstT select which side holds 64-bit rows).
//
//   Phases
//     1. pdl_wait(): the plan may come from the kernel launched just before (PDL).
//     2. Every block builds the exclusive prefix of the clamped counts in shared memory.
//     3. Warps stride over the flattened (layer, request, entry) space, R consecutive entries
//        per warp at a time: lane j < R finds entry j's request by binary search in the prefix
//        and its rows, then the warp copies the R rows with every load in flight before the
//        stores (R rows per host round trip). Few misses over many requests and many misses in
//        one request both spread over the whole grid, whose size the caller picks (a small grid
//        with R > 1 keeps the link busy from few SMs, leaving the rest to the compute a replay
//        overlaps).
//   Rows whose source or destination index is outside its pool are skipped. With stage_map set
//   (single layer), a row that the prediction stager staged is read from its staging row
//   (device memory) instead of the source (cu/abi.cuh, PlannedCopyParams).
//
// planned_copy_body<..., PROBE = true> is the measuring instance's body (cu/plan_probe.cu, a
//   RawModule of its own that only hisparse_cupy.testing.probe loads).
//
//   Shared memory: _abi.SMEM["PLANNED_COPY"].
#include "abi.cuh"

namespace hs {

// The probe's settings (PROBE instances only; the production body has none of them).
struct CopyProbe {
  i32* bad;
  i64 spin_cycles;
  bool dry_run;
};

template <typename SrcT, typename DstT, int R, bool PROBE>
__device__ __forceinline__ void planned_copy_body(const PlannedCopyParams& p,
                                                  const CopyProbe& probe) {
  static_assert(R >= 1 && R <= 32, "rows per warp");
  constexpr int WARPS = COPY_WARPS;
  constexpr int VPL = R == 1 ? HS_COPY_VPL : 2;  // vectors per lane, row and pass
  constexpr int BLOCK = WARPS * 32;
  const int B = p.B, plan_stride = p.plan_stride, row_bytes = p.row_bytes;
  const SrcT* __restrict__ src_idx = static_cast<const SrcT*>(p.src_idx);
  const DstT* __restrict__ dst_idx = static_cast<const DstT*>(p.dst_idx);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  HS_SMEM_CARVE(PLANNED_COPY, sm, smem_raw);

  pdl_wait();

  const int nr = clamp_real(p.num_real, B);

  int carry = 0;
  for (int base = 0; base < nr; base += BLOCK) {
    const int b = base + threadIdx.x;
    int c = 0;
    if (b < nr) {
      c = p.count[b];
      c = c < 0 ? 0 : (c > plan_stride ? plan_stride : c);
    }
    int chunk_total;
    const int ex = block_exclusive_sum<BLOCK>(c, sm.scan, chunk_total);
    if (b < nr) sm.prefix[b] = carry + ex;
    carry += chunk_total;
  }
  if (threadIdx.x == 0) {
    sm.prefix[nr] = carry;
    sm.stats[0] = sm.stats[1] = 0;
  }
  __syncthreads();

  const i64 pairs = carry;
  const i64 total = pairs * p.n_layers;
  const int lane = threadIdx.x & 31;
  const i64 gw = static_cast<i64>(blockIdx.x) * WARPS + (threadIdx.x >> 5);
  const i64 nwarps = static_cast<i64>(gridDim.x) * WARPS;
  u32 n_rows = 0, n_staged = 0;  // prediction's counters (lanes < R), summed per block at the end

  for (i64 g0 = gw * R; g0 < total; g0 += nwarps * R) {
    // lane j < R: entry g0 + j -> its source and destination row (null: none)
    const u8* my_src = nullptr;
    u8* my_dst = nullptr;
    if (lane < R && g0 + lane < total) {
      const i64 g = g0 + lane;
      const int layer = static_cast<int>(g / pairs);
      const int r = static_cast<int>(g - static_cast<i64>(layer) * pairs);
      int lo = 0, hi = nr - 1;  // largest b with sm.prefix[b] <= r
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (sm.prefix[mid] <= r) lo = mid; else hi = mid - 1;
      }
      const int b = lo;
      const i64 e = static_cast<i64>(b) * plan_stride + (r - sm.prefix[b]);
      const i64 s = static_cast<i64>(src_idx[e]);
      const i64 d = static_cast<i64>(dst_idx[e]);
      if (s < 0 || s >= p.n_src_rows || d < 0 || d >= p.n_dst_rows) {
        if constexpr (PROBE) {
          if (probe.bad) atomicAdd(probe.bad, 1);
        }
      } else {
        my_src = p.src_base + layer * p.src_layer_bytes + s * row_bytes;
        my_dst = p.dst_base + layer * p.dst_layer_bytes + d * row_bytes;
        if (p.stage_map != nullptr) {  // a staged copy of the row: read it there
          const i64 j0 = static_cast<i64>(b) * p.stage_width;
          const int c = p.stage_count[b];
          const i64 j = p.stage_map[s];
          const bool staged = j >= j0 && j < j0 + (c < p.stage_width ? c : p.stage_width) &&
                              p.stage_src[j] == s;
          if (staged) my_src = p.stage_base + j * row_bytes;
          ++n_rows;
          n_staged += staged;
        }
      }
    }
    const u8* srcs[R];
    u8* dsts[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      srcs[j] = reinterpret_cast<const u8*>(
          __shfl_sync(FULL_MASK, reinterpret_cast<unsigned long long>(my_src), j));
      dsts[j] = reinterpret_cast<u8*>(
          __shfl_sync(FULL_MASK, reinterpret_cast<unsigned long long>(my_dst), j));
    }
    if constexpr (PROBE) {
      int rows = 0;
#pragma unroll
      for (int j = 0; j < R; ++j) rows += srcs[j] != nullptr;
      if (probe.spin_cycles > 0 && rows > 0) {
        const long long t0 = clock64();
        while (clock64() - t0 < probe.spin_cycles * rows) {
        }
      }
      if (probe.dry_run) continue;
    }
    copy_rows_warp<R, VPL>(dsts, srcs, row_bytes, lane);
  }
  if (p.stage_stats != nullptr) {  // (uniform) one atomic pair per block: per row, thousands of
    // atomics on two addresses serialized in L2 and slowed the copy
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      n_rows += __shfl_xor_sync(FULL_MASK, n_rows, o);
      n_staged += __shfl_xor_sync(FULL_MASK, n_staged, o);
    }
    if (lane == 0 && n_rows > 0) {
      atomicAdd(&sm.stats[0], n_rows);
      atomicAdd(&sm.stats[1], n_staged);
    }
    __syncthreads();
    if (threadIdx.x == 0 && sm.stats[0] > 0) {
      atomicAdd(p.stage_stats, static_cast<u64>(sm.stats[0]));
      atomicAdd(p.stage_stats + 1, static_cast<u64>(sm.stats[1]));
    }
  }
}

template <typename SrcT, typename DstT, int R>
__global__ void __launch_bounds__(COPY_WARPS * 32) planned_copy(const PlannedCopyParams p) {
  planned_copy_body<SrcT, DstT, R, false>(p, CopyProbe{nullptr, 0, false});
}

}  // namespace hs
