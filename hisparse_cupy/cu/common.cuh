// hisparse_cupy: helpers shared by every kernel.
//
// - the one row-copy primitive (copy_rows_warp): a warp moves R rows of 16-byte vectors,
//   issuing every load of a pass before its first store, so R rows cost one host round trip
//   (copy_owned_rows_warp feeds it the rows a warp's lanes own);
// - block-wide exclusive scan (bounded to the block's warps);
// - Programmatic Dependent Launch helpers as inline PTX (NVRTC has no
//   cudaGridDependencySynchronize), no-ops below sm_90;
// - a 32-bit multiplicative hash;
// - thread-block cluster helpers (rank, size, barrier, distributed shared memory);
// - the graph-padding clamp of num_real.
#pragma once

#ifndef HS_SRC_DIGEST
#define HS_SRC_DIGEST 0ull
#endif

// Phase clock (measuring only; HISPARSE_CUPY_PHASE_CLOCK=1 adds -DHS_PHASE_CLOCK). HS_PHASE_START
// reads the SM clock at a kernel's start; HS_PHASE(i) (at a point every thread of the block
// reaches) adds a barrier and keeps the most cycles any block took to reach mark i in
// hs_phase_clock[i] (hisparse_cupy._kernels.build.phase_cycles reads it). Without the macro both are empty.
#ifdef HS_PHASE_CLOCK
extern "C" {
__device__ unsigned long long hs_phase_clock[HS_PHASE_SLOTS];
}
#define HS_PHASE_START const long long hs_phase_t0_ = clock64();
#define HS_PHASE(i)                                                                       \
  do {                                                                                    \
    __syncthreads();                                                                      \
    if (threadIdx.x == 0)                                                                 \
      atomicMax(&hs_phase_clock[i], static_cast<unsigned long long>(clock64() - hs_phase_t0_)); \
  } while (0)
#else
#define HS_PHASE_START
#define HS_PHASE(i) \
  do {              \
  } while (0)
#endif

namespace hs {

// Fixed-width integers without any header (NVRTC's builtin types: the kernels include nothing
// outside cu/, so compile_check needs no CUDA or CCCL headers).
using i16 = short;
using i32 = int;
using i64 = long long;
using u8 = unsigned char;
using u16 = unsigned short;
using u32 = unsigned int;
using u64 = unsigned long long;
static_assert(sizeof(i16) == 2 && sizeof(i32) == 4 && sizeof(i64) == 8, "integer widths");

constexpr unsigned FULL_MASK = 0xffffffffu;

// Vectors each lane holds per pass: one pass moves rows up to 32 * 4 * 16 = 2048 bytes.
#ifndef HS_COPY_VPL
#define HS_COPY_VPL 4
#endif

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Read-only 16-byte load (non-coherent path; the source is not written during the kernel).
__device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16-byte store cached in L2 only: a swapped-in row is read once by attention.
__device__ __forceinline__ void st_cg_v4(void* p, uint4 v) {
  asm volatile("st.global.cg.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// THE copy primitive. One warp copies R rows of `row_bytes` each (a multiple of 16; src and dst
// 16-byte aligned) from src[r] to dst[r]; a null src[r] is no row. Every lane holds VPL vectors
// of each row per pass, and all loads of a pass (every row's) are issued before the pass's
// stores: R rows in flight per warp, so a few warps keep the link's latency covered. A lane reads
// and writes vectors base + j * 32 + lane of each row, from the row's start on.
template <int R, int VPL>
__device__ __forceinline__ void copy_rows_warp(u8* const (&dst)[R], const u8* const (&src)[R],
                                               int row_bytes, int lane) {
  const int nvec = row_bytes >> 4;
  for (int base = 0; base < nvec; base += 32 * VPL) {
    uint4 v[R][VPL];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        const int k = base + j * 32 + lane;
        if (src[r] != nullptr && k < nvec) v[r][j] = ld_nc_v4(src[r] + (static_cast<i64>(k) << 4));
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        const int k = base + j * 32 + lane;
        if (src[r] != nullptr && k < nvec) st_cg_v4(dst[r] + (static_cast<i64>(k) << 4), v[r][j]);
      }
    }
  }
}

// Every lane whose `owner` is set has its row (src -> dst, row indices) copied by the whole warp,
// OWNED_ROWS rows in flight at a time. Every lane of the warp must call it (warp collectives).
constexpr int OWNED_ROWS = 4;
__device__ __forceinline__ void copy_owned_rows_warp(bool owner, i64 src, i64 dst, u8* dst_base,
                                                     const u8* src_base, int row_bytes,
                                                     int lane) {
  unsigned om = __ballot_sync(FULL_MASK, owner);  // warp-uniform: the branches below are too
  while (om) {
    u8* d[OWNED_ROWS];
    const u8* s[OWNED_ROWS];
#pragma unroll
    for (int r = 0; r < OWNED_ROWS; ++r) {
      d[r] = nullptr;
      s[r] = nullptr;
      if (om) {
        const int l = __ffs(om) - 1;
        om &= om - 1;
        s[r] = src_base + __shfl_sync(FULL_MASK, src, l) * row_bytes;
        d[r] = dst_base + __shfl_sync(FULL_MASK, dst, l) * row_bytes;
      }
    }
    copy_rows_warp<OWNED_ROWS, 2>(d, s, row_bytes, lane);
  }
}

// Exclusive prefix sum, in place, of the NW <= 32 per-warp values s_w[0..NW); the total goes to
// s_w[NW]. Executed by the calling warp only (all 32 lanes): publish s_w with a barrier before,
// and put a barrier after it before other warps read the result.
template <int NW>
__device__ __forceinline__ void scan_warp_totals(int* s_w, int lane) {
  static_assert(NW >= 1 && NW <= 32, "at most 32 warps");
  const int w = lane < NW ? s_w[lane] : 0;
  int s = w;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(FULL_MASK, s, o);
    if (lane >= o) s += y;
  }
  if (lane < NW) s_w[lane] = s - w;
  if (lane == NW - 1) s_w[NW] = s;
}

// Block-wide exclusive prefix sum of `v` over BLOCK threads (BLOCK a multiple of 32, <= 1024).
// `s_warp` holds BLOCK/32 + 1 ints of shared memory. Returns the exclusive prefix and writes
// the block total to `total`. Contains __syncthreads(): every thread of the block must call it.
template <int BLOCK>
__device__ __forceinline__ int block_exclusive_sum(int v, int* s_warp, int& total) {
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "BLOCK must be a multiple of 32, <= 1024");
  constexpr int NW = BLOCK / 32;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(FULL_MASK, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) scan_warp_totals<NW>(s_warp, lane);
  __syncthreads();
  const int r = s_warp[warp] + x - v;
  total = s_warp[NW];
  __syncthreads();  // s_warp may be reused by the next call
  return r;
}

__device__ __forceinline__ u32 hash_u32(u32 x) { return x * 2654435761u; }

// The token -> slot table (both swaps, the prediction stager): entry e of token tok counts only
// while it names a hot slot (0 <= e < H) that holds tok, so stale or garbage entries are
// harmless. table_holds: whether it does. table_slot: e, and that slot's device row in loc (its
// load issued beside the token's); else -1 (loc untouched).
__device__ __forceinline__ bool table_holds(int e, int tok, int H, const i32* stok) {
  return e >= 0 && e < H && stok[e] == tok;
}
__device__ __forceinline__ int table_slot(int e, int tok, int H, const i32* stok, const i32* sloc,
                                          int& loc) {
  if (e < 0 || e >= H) return -1;
  const int l = sloc[e];
  if (!table_holds(e, tok, H, stok)) return -1;
  loc = l;
  return e;
}

// ---- thread-block clusters (sm_90+; below that, and in a launch without a cluster dimension,
// every block is a cluster of one). cluster_blocks() / cluster_rank(): the size of the block's
// cluster (cuLaunchKernelEx's cluster attribute) and the block's rank in it. cluster_sync(): a
// barrier of every thread of every block of the cluster, ordering their shared- and global-
// memory accesses (release / acquire at cluster scope); every thread of each block must call it.
// cluster_map(p, r): the address of what `p` points to in this block's shared memory, in block
// r's shared memory (distributed shared memory: plain loads, stores and atomics work on it).
// A block must not exit while another may still access its shared memory: end with a sync.
__device__ __forceinline__ int cluster_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  u32 n;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return static_cast<int>(n);
#else
  return 1;
#endif
}

__device__ __forceinline__ int cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  u32 r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return static_cast<int>(r);
#else
  return 0;
#endif
}

__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
#else
  __syncthreads();
#endif
}

template <typename T>
__device__ __forceinline__ T* cluster_map(T* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  u64 r;
  asm("mapa.u64 %0, %1, %2;" : "=l"(r) : "l"(p), "r"(rank));
  return reinterpret_cast<T*>(r);
#else
  return p;
#endif
}

// Real rows of a call: *num_real clamped to [0, B] (B when num_real is null). Rows at or beyond
// it are CUDA-graph padding.
__device__ __forceinline__ int clamp_real(const i32* num_real, int B) {
  const int nr = num_real ? *num_real : B;
  return nr < 0 ? 0 : (nr > B ? B : nr);
}

}  // namespace hs
