// hisparse_cupy: single-step swap-in, resolve half.
//
// swap_resolve<BLOCK, ReqT, LenT>: one block per batch row. Resolves the row's top-k against
// the request's hot buffer (hash of the top-k in shared memory, LRU scan), assigns victims to
// the misses, updates the slot table and the LRU order, writes the device row of every entry
// and the row's miss plan (host row -> device row). The bytes are moved afterwards by
// planned_copy over the flattened (request, miss) pairs of every row, so the copy is not
// limited to one block per request.
//
// Semantics (DESIGN §4):
//   - rows b >= num_real (graph padding): output -1, plan count 0, status 0, no state touched;
//   - a request slot outside [0, R) or seq_len < 0: output -1, status[2] = 1, no state touched;
//   - seq_len <= H (positional fast path): entry i < seq_len with 0 <= tok < seq_len gets
//     slot_locs[tok]; columns >= seq_len and -1 entries get -1; other tokens get -1 and count in
//     status[0]; no state change, plan count 0;
//   - seq_len > H (LRU path):
//       -1 -> -1 (unused, not a miss);
//       tok outside [0, seq_len) or >= host_locs width -> -1, status[0]++;
//       tok == seq_len - 1 (newest) -> slot_locs[H] (slot H holds it; outside the LRU);
//       a token selected twice: the first entry is canonical, later ones copy its result;
//       hit (token held by an LRU slot) -> that slot's device row;
//       miss with a host row in [0, n_host_rows) -> the m-th miss (top-k order) takes the m-th
//         least recently used slot that holds no selected token;
//       miss without a valid host row -> -1, status[1]++, never touches the cache.
//     New recency order: [untouched evictable slots][misses, in miss order][hits, old order].
//
// Phases (LRU path), with __syncthreads() between them:
//   0. clear the shared hash;
//   1. classify each entry, insert valid non-newest tokens into the hash (first index wins);
//   2. mark duplicates;
//   3. scan the LRU order: a slot whose token is in the hash is a hit (output written), others
//      are evictable; hits and evictables are compacted in LRU order (one packed block scan);
//   4. compact misses in top-k order, assign victims, write outputs, slot tokens and the plan;
//   5. (after a barrier) duplicates copy their canonical entry's output; LRU write-back;
//      counts and status.
//
// Shared memory (dynamic, bytes):
//   int s_key[HS], int s_val[HS]      hash of the top-k, HS = hash_size (power of two >= 2K)
//   int s_tok[K]                      tokens
//   int s_scan[BLOCK/32 + 1], s_cnt[4]
//   i16 s_evict[H], i16 s_hit[H]      evictable / hit slots in old LRU order
//   u8  s_kind[K]                     entry classification
#include "common.cuh"

namespace hs {

enum : u8 { K_UNUSED = 0, K_INVALID, K_NEWEST, K_CANON, K_DUP, K_HIT, K_MISS, K_NOHOST };

constexpr int ST_RANGE = 0;    // entries outside [0, seq_len)
constexpr int ST_NOHOST = 1;   // misses with no valid host row
constexpr int ST_BADROW = 2;   // request slot out of range or negative seq_len
constexpr int N_STATUS = 3;
constexpr int PREFETCH = 4;  // rounds of global loads issued together

__device__ __forceinline__ int hash_find(const int* s_key, const int* s_val, int mask, int tok) {
  u32 h = hash_u32(static_cast<u32>(tok)) & mask;
  while (true) {
    const int k = s_key[h];
    if (k == tok) return s_val[h];
    if (k == -1) return -1;
    h = (h + 1) & mask;
  }
}

template <int BLOCK, typename ReqT, typename LenT>
__global__ void __launch_bounds__(BLOCK, 1)
    swap_resolve(const i32* __restrict__ topk, int topk_stride, int K,
                 const ReqT* __restrict__ req_idx, const LenT* __restrict__ seq_lens,
                 const i32* __restrict__ num_real, int B, int R,
                 const i64* __restrict__ host_locs, int host_stride, i64 n_host_rows,
                 i32* __restrict__ slot_tokens, const i32* __restrict__ slot_locs,
                 int slot_stride, i16* __restrict__ lru, int lru_stride, int H, int hash_size,
                 i32* __restrict__ out, int out_stride, i64* __restrict__ plan_src,
                 i32* __restrict__ plan_dst, int plan_stride, i32* __restrict__ plan_count,
                 i32* __restrict__ status) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  int* s_key = reinterpret_cast<int*>(smem_raw);
  int* s_val = s_key + hash_size;
  int* s_tok = s_val + hash_size;
  int* s_scan = s_tok + K;
  int* s_cnt = s_scan + BLOCK / 32 + 1;
  i16* s_evict = reinterpret_cast<i16*>(s_cnt + 4);
  i16* s_hit = s_evict + H;
  u8* s_kind = reinterpret_cast<u8*>(s_hit + H);

  // Let the copy kernel that follows get scheduled; it waits for this grid to finish.
  pdl_launch_dependents();

  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  int nr = num_real ? *num_real : B;
  nr = nr < 0 ? 0 : (nr > B ? B : nr);
  const i32* tk = topk + static_cast<i64>(b) * topk_stride;
  i32* o = out + static_cast<i64>(b) * out_stride;
  i32* st = status + static_cast<i64>(b) * N_STATUS;

  const i64 rid = b < nr ? static_cast<i64>(req_idx[b]) : -1;
  const i64 seq = b < nr ? static_cast<i64>(seq_lens[b]) : -1;
  if (b >= nr || rid < 0 || rid >= R || seq < 0) {
    for (int i = tid; i < K; i += BLOCK) o[i] = -1;
    if (tid == 0) {
      plan_count[b] = 0;
      st[ST_RANGE] = 0;
      st[ST_NOHOST] = 0;
      st[ST_BADROW] = b < nr ? 1 : 0;
    }
    return;
  }
  i32* stok = slot_tokens + rid * slot_stride;
  const i32* sloc = slot_locs + rid * slot_stride;
  const i64* hloc = host_locs + rid * host_stride;
  i16* rlru = lru + rid * lru_stride;

  if (tid < 4) s_cnt[tid] = 0;

  if (seq <= H) {  // positional fast path: token p lives in slot p
    __syncthreads();
    for (int i = tid; i < K; i += BLOCK) {
      const int tok = tk[i];
      int r = -1;
      if (i < seq && tok != -1) {
        if (tok >= 0 && tok < seq) r = sloc[tok];
        else atomicAdd(&s_cnt[ST_RANGE], 1);
      }
      o[i] = r;
    }
    __syncthreads();
    if (tid == 0) {
      plan_count[b] = 0;
      st[ST_RANGE] = s_cnt[ST_RANGE];
      st[ST_NOHOST] = 0;
      st[ST_BADROW] = 0;
    }
    return;
  }

  // ---- phase 0: clear the hash
  const int mask = hash_size - 1;
  for (int h = tid; h < hash_size; h += BLOCK) {
    s_key[h] = -1;
    s_val[h] = 0x7fffffff;
  }
  __syncthreads();

  // ---- phase 1: classify, insert (all of a thread's top-k loads are issued first)
  const i64 lim = seq < host_stride ? seq : host_stride;
  for (int base = 0; base < K; base += PREFETCH * BLOCK) {
    int toks[PREFETCH];
#pragma unroll
    for (int u = 0; u < PREFETCH; ++u) {
      const int i = base + u * BLOCK + tid;
      toks[u] = i < K ? tk[i] : -1;
    }
#pragma unroll
    for (int u = 0; u < PREFETCH; ++u) {
      const int i = base + u * BLOCK + tid;
      if (i >= K) break;
      const int tok = toks[u];
      u8 kind;
      if (tok == -1) {
        kind = K_UNUSED;
        o[i] = -1;
      } else if (tok < 0 || tok >= lim) {
        kind = K_INVALID;
        o[i] = -1;
        atomicAdd(&s_cnt[ST_RANGE], 1);
      } else if (tok == seq - 1) {
        kind = K_NEWEST;
        o[i] = sloc[H];
      } else {
        kind = K_CANON;
        u32 h = hash_u32(static_cast<u32>(tok)) & mask;
        while (true) {
          const int prev = atomicCAS(&s_key[h], -1, tok);
          if (prev == -1 || prev == tok) {
            atomicMin(&s_val[h], i);
            break;
          }
          h = (h + 1) & mask;
        }
      }
      s_tok[i] = tok;
      s_kind[i] = kind;
    }
  }
  __syncthreads();

  // ---- phase 2: duplicates
  for (int i = tid; i < K; i += BLOCK) {
    if (s_kind[i] == K_CANON && hash_find(s_key, s_val, mask, s_tok[i]) != i) s_kind[i] = K_DUP;
  }
  __syncthreads();

  // ---- phase 3: LRU scan (hits / evictables in old LRU order). The LRU entries and slot
  // tokens of PREFETCH rounds are loaded before the first round's scan.
  int n_hit = 0, n_ev = 0;
  for (int base = 0; base < H; base += PREFETCH * BLOCK) {
    int slots[PREFETCH], held[PREFETCH];
#pragma unroll
    for (int u = 0; u < PREFETCH; ++u) {
      const int p = base + u * BLOCK + tid;
      slots[u] = p < H ? rlru[p] : 0;
    }
#pragma unroll
    for (int u = 0; u < PREFETCH; ++u) {
      const int p = base + u * BLOCK + tid;
      held[u] = p < H ? stok[slots[u]] : -1;
    }
#pragma unroll
    for (int u = 0; u < PREFETCH; ++u) {
      if (base + u * BLOCK >= H) break;  // uniform over the block
      const int p = base + u * BLOCK + tid;
      int hit = 0, ev = 0;
      if (p < H) {
        const int bt = held[u];
        const int j = bt >= 0 ? hash_find(s_key, s_val, mask, bt) : -1;
        if (j >= 0 && s_kind[j] == K_CANON) {
          hit = 1;
          s_kind[j] = K_HIT;
          o[j] = sloc[slots[u]];
        } else {
          ev = 1;
        }
      }
      int tot;
      const int ex = block_exclusive_sum<BLOCK>(hit | (ev << 16), s_scan, tot);
      if (hit) s_hit[n_hit + (ex & 0xffff)] = static_cast<i16>(slots[u]);
      if (ev) s_evict[n_ev + (ex >> 16)] = static_cast<i16>(slots[u]);
      n_hit += tot & 0xffff;
      n_ev += tot >> 16;
    }
  }
  // s_kind/out of hits are visible: they were written before the last scan's barriers; the
  // last round's s_hit/s_evict stores are read only after phase 4's first scan barrier.

  // ---- phase 4: misses in top-k order take the least recently used evictable slots
  int n_miss = 0;
  for (int base = 0; base < K; base += BLOCK) {
    const int i = base + tid;
    int miss = 0;
    i64 hl = -1;
    if (i < K && s_kind[i] == K_CANON) {
      hl = hloc[s_tok[i]];
      if (hl >= 0 && hl < n_host_rows) {
        miss = 1;
      } else {
        s_kind[i] = K_NOHOST;
        o[i] = -1;
        atomicAdd(&s_cnt[ST_NOHOST], 1);
      }
    }
    int tot;
    const int m = n_miss + block_exclusive_sum<BLOCK>(miss, s_scan, tot);
    if (miss) {
      const int victim = s_evict[m];
      const int loc = sloc[victim];
      o[i] = loc;
      stok[victim] = s_tok[i];
      plan_src[static_cast<i64>(b) * plan_stride + m] = hl;
      plan_dst[static_cast<i64>(b) * plan_stride + m] = loc;
      s_kind[i] = K_MISS;
    }
    n_miss += tot;
  }
  __syncthreads();  // misses' outputs and kinds, written after the last scan, are visible

  // ---- phase 5: duplicates, LRU write-back, counts
  for (int i = tid; i < K; i += BLOCK) {
    if (s_kind[i] == K_DUP) {
      const int c = hash_find(s_key, s_val, mask, s_tok[i]);
      o[i] = o[c];
      if (s_kind[c] == K_NOHOST) atomicAdd(&s_cnt[ST_NOHOST], 1);
    }
  }
  const int E = n_ev, M = n_miss;
  for (int p = tid; p < H; p += BLOCK) {
    i16 v;
    if (p < E - M) v = s_evict[M + p];
    else if (p < E) v = s_evict[p - (E - M)];
    else v = s_hit[p - E];
    rlru[p] = v;
  }
  __syncthreads();
  if (tid == 0) {
    plan_count[b] = M;
    st[ST_RANGE] = s_cnt[ST_RANGE];
    st[ST_NOHOST] = s_cnt[ST_NOHOST];
    st[ST_BADROW] = 0;
  }
}

}  // namespace hs
