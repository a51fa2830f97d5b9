// hisparse_cupy: the multi-step swap's helpers (cu/multistep.cu has the kernels and their
// semantics): its constants (from _abi.py), the batch row's workspace rows, the call's dedup
// table, the per-step lengths, the commit grid's copy blocks and the commit's bitmap ranks and
// radix select.
#pragma once

#include "abi.cuh"

namespace hs {
namespace ms {

using ull = u64;

// sentinels, workspace counters, statistics and eviction keys: _abi.py (cu/abi.cuh)
constexpr ull EMPTY = MS_EMPTY;  // free dedup-table entry
constexpr u32 NONE = MS_NONE;    // table value: not yet published / no row

__device__ __forceinline__ u32 mix32(u32 x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}
// h -> [0, n) by the high half of a 32x32 product
__device__ __forceinline__ int reduce(u32 h, int n) {
  return static_cast<int>((static_cast<u64>(h) * static_cast<u32>(n)) >> 32);
}
__device__ __forceinline__ ull pack(u32 hi, int lo) {
  return (static_cast<ull>(hi) << 32) | static_cast<u32>(lo);
}
__device__ __forceinline__ int lo32(ull e) { return static_cast<int>(static_cast<u32>(e)); }
__device__ __forceinline__ u32 hi32(ull e) { return static_cast<u32>(e >> 32); }
__device__ __forceinline__ ull load_volatile(const ull* p) {
  return *reinterpret_cast<const volatile ull*>(p);
}

// workspace counters (per batch row, MS_N_COUNTERS of them)
constexpr int C_MISS = MS_C_MISS, C_RANGE = MS_C_RANGE, C_NOHOST = MS_C_NOHOST,
              C_PENDING = MS_C_PENDING, C_DONE = MS_C_DONE, C_COPY = MS_C_COPY;
// per-row statistics of the last call (MS_N_STATS of them, named in _abi.MS_STATS)
constexpr int X_MISS = MS_X_MISS, X_ADMIT = MS_X_ADMIT, X_EVICTABLE = MS_X_EVICTABLE,
              X_PARTIAL = MS_X_PARTIAL;
// eviction priority of an unreferenced slot (0 = referenced this call, not evictable)
constexpr u32 KEY_EMPTY = MS_KEY_EMPTY, KEY_NEVER = MS_KEY_NEVER, KEY_AGE_MAX = MS_KEY_AGE_MAX;
static_assert(C_RANGE + 1 == C_NOHOST && C_COPY < MS_N_COUNTERS && C_DONE < C_COPY,
              "the gather adds counters C_RANGE..C_NOHOST from s_cnt, the commit clears those "
              "below C_DONE");

// the batch row's part of the per-call workspace and results
__device__ __forceinline__ ull* table_row(const MultiStepParams& p, i64 b) {
  return row_at(p.table, b, p.table_size);
}
__device__ __forceinline__ i32* meta_row(const MultiStepParams& p, i64 b) {
  return row_at(p.meta, b, p.table_size);
}
__device__ __forceinline__ i32* compact_row(const MultiStepParams& p, i64 b) {
  return row_at(p.compact, b, p.compact_stride);
}
__device__ __forceinline__ i32* pending_row(const MultiStepParams& p, i64 b) {
  return row_at(p.pending, b, p.compact_stride);
}
__device__ __forceinline__ i64* miss_src_row(const MultiStepParams& p, i64 b) {
  return row_at(p.miss_src, b, p.compact_stride);
}
__device__ __forceinline__ i32* miss_dst_row(const MultiStepParams& p, i64 b) {
  return row_at(p.miss_dst, b, p.compact_stride);
}
__device__ __forceinline__ i32* counters_row(const MultiStepParams& p, i64 b) {
  return row_at(p.counters, b, MS_N_COUNTERS);
}
__device__ __forceinline__ i32* stats_row(const MultiStepParams& p, i64 b) {
  return row_at(p.stats, b, MS_N_STATS);
}

// ---------------------------------------------------------------- call dedup table

// Find or claim `tok` in the row's dedup table (linear probing, ts a power of two >= 2 T, so a
// free entry always exists). Returns the position; `claimed` tells whether this thread inserted
// it, `val` the value seen (NONE while unpublished).
__device__ __forceinline__ int table_claim(ull* tbl, int ts, int tok, bool& claimed, u32& val) {
  const int mask = ts - 1;
  int h = reduce(mix32(static_cast<u32>(tok)), ts);
  const ull mine = pack(NONE, tok);
  for (int n = 0; n < ts; ++n) {
    ull cur = load_volatile(tbl + h);
    if (cur == EMPTY) {
      cur = atomicCAS(tbl + h, EMPTY, mine);
      if (cur == EMPTY) {
        claimed = true;
        val = NONE;
        return h;
      }
    }
    if (lo32(cur) == tok) {
      claimed = false;
      val = hi32(cur);
      return h;
    }
    h = (h + 1) & mask;
  }
  return -1;
}

// Element (b, s) of the per-step lengths.
template <typename LenT>
__device__ __forceinline__ i64 step_len(const MultiStepParams& p, int b, int s) {
  return static_cast<i64>(static_cast<const LenT*>(
      p.lens)[static_cast<i64>(b) * p.lens_stride + static_cast<i64>(s) * p.lens_step]);
}

// A request slot outside [0, R) or a negative length in any step makes the whole row bad. The
// S lengths are loaded together (no load waits for the previous one's test); `shortest` gets
// the row's smallest length.
template <typename LenT>
__device__ __forceinline__ bool row_is_bad(const MultiStepParams& p, i64 rid, int b,
                                           i64& shortest) {
  i64 len[MS_MAX_STEPS];
#pragma unroll
  for (int s = 0; s < MS_MAX_STEPS; ++s) len[s] = s < p.S ? step_len<LenT>(p, b, s) : 0;
  bool bad = rid < 0 || rid >= p.R;
  shortest = len[0];
#pragma unroll
  for (int s = 0; s < MS_MAX_STEPS; ++s) {
    bad |= len[s] < 0;
    if (s < p.S && len[s] < shortest) shortest = len[s];
  }
  return bad;
}
// The commit grid's copy blocks (blockIdx.x >= B): copy_blocks of them per batch row move the
// row's scratch-resident misses (miss_src / miss_dst [0, C_COPY)) while the row's commit block
// admits them. Each warp takes a run of up to OWNED_ROWS rows (spread over every warp of the
// row's blocks), all in flight together.
__device__ __forceinline__ void copy_misses(const MultiStepParams& p) {
  constexpr int NWARP = COMMIT_BLOCK / 32;
  const int G = p.copy_blocks;
  const int j = static_cast<int>(blockIdx.x) - p.B;
  const int b = j / G;
  const int n = counters_row(p, b)[C_COPY];
  const int lane = threadIdx.x & 31;
  const int warps = G * NWARP;
  const int w = (j - b * G) * NWARP + (threadIdx.x >> 5);
  int per = (n + warps - 1) / warps;
  per = per < 1 ? 1 : (per > OWNED_ROWS ? OWNED_ROWS : per);
  const i64* src = miss_src_row(p, b);
  const i32* dst = miss_dst_row(p, b);
  for (int u0 = w * per; u0 < n; u0 += warps * per) {
    u8* d[OWNED_ROWS];
    const u8* s[OWNED_ROWS];
#pragma unroll
    for (int r = 0; r < OWNED_ROWS; ++r) {
      const int u = u0 + r;
      const bool has = r < per && u < n;
      s[r] = has ? p.host_base + src[u] * p.row_bytes : nullptr;
      d[r] = has ? p.dev_base + static_cast<i64>(dst[u]) * p.row_bytes : nullptr;
    }
    copy_rows_warp<OWNED_ROWS, 2>(d, s, p.row_bytes, lane);
  }
}

// ------------------------------------------------------------------ commit helpers

// Exclusive popcount prefix of the bitmap words: pre[w] = set bits in words [0, w).
template <int BLOCK>
__device__ __forceinline__ void bitmap_prefix(const u32* bits, int* pre, int nw, int* s_scan) {
  int carry = 0;
  for (int base = 0; base < nw; base += BLOCK) {
    const int w = base + threadIdx.x;
    const int c = w < nw ? __popc(bits[w]) : 0;
    int tot;
    const int ex = block_exclusive_sum<BLOCK>(c, s_scan, tot);
    if (w < nw) pre[w] = carry + ex;
    carry += tot;
  }
  __syncthreads();
}

__device__ __forceinline__ int bitmap_rank(const u32* bits, const int* pre, int r) {
  return pre[r >> 5] + __popc(bits[r >> 5] & ((1u << (r & 31)) - 1u));
}

// The want-th largest non-zero key (MSB-first radix select, 8 bits a pass). Returns the key;
// `want` becomes how many keys equal to it must be taken (those larger are all taken).
// kor / kand: OR and AND of every non-zero key. The digits above the highest bit in which the
// keys differ are common to all of them, so the passes start at that bit's digit; equal keys
// need no pass at all.
template <int BLOCK>
__device__ u32 radix_select(const u32* keys, int n, int& want, u32 kor, u32 kand, int* s_hist,
                            int* s_digit, int* s_rest) {
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  if (kor == kand) return kand;  // every non-zero key is the same: take `want` of them
  const int top = (31 - __clz(kor ^ kand)) & ~7;  // the first digit in which keys differ
  u32 pmask = top == 24 ? 0u : ~((1u << (top + 8)) - 1u);
  u32 prefix = kand & pmask;
  for (int shift = top; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += BLOCK) s_hist[i] = 0;
    __syncthreads();
    for (int base = 0; base < n; base += BLOCK) {  // uniform trip count (warp collectives)
      const int j = base + tid;
      const u32 k = j < n ? keys[j] : 0u;
      const bool in = k != 0 && (k & pmask) == prefix;
      const int digit = in ? static_cast<int>((k >> shift) & 255u) : 256;
      // keys mostly share a digit: one atomic per digit per warp, not one per key
      const unsigned peers = __match_any_sync(FULL_MASK, digit);
      if (in && lane == __ffs(peers) - 1) atomicAdd(&s_hist[digit], __popc(peers));
    }
    __syncthreads();
    if (tid < 32) {  // lane l owns digits 255 - 8l down to 248 - 8l
      int c[8];
      int sum = 0;
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        c[q] = s_hist[255 - 8 * lane - q];
        sum += c[q];
      }
      int incl = sum;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(FULL_MASK, incl, d);
        if (lane >= d) incl += y;
      }
      const unsigned hit = __ballot_sync(FULL_MASK, incl >= want);
      const int L = hit ? __ffs(hit) - 1 : 31;
      if (lane == L) {
        int acc = incl - sum;
        int digit = 248 - 8 * lane, rest = want - acc;
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          if (acc + c[q] >= want) {
            digit = 255 - 8 * lane - q;
            rest = want - acc;
            break;
          }
          acc += c[q];
        }
        *s_digit = digit;
        *s_rest = rest;
      }
    }
    __syncthreads();
    prefix |= static_cast<u32>(*s_digit) << shift;
    pmask |= 0xffu << shift;
    want = *s_rest;
  }
  __syncthreads();
  return prefix;
}

}  // namespace ms
}  // namespace hs
