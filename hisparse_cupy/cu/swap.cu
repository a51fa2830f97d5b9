// hisparse_cupy: single-step swap-in, resolve half.
//
// swap_resolve<ReqT, LenT>(SwapResolveParams): one block of RESOLVE_BLOCK threads per batch row. Resolves the row's top-k against
// the request's hot buffer (hash of the top-k in shared memory, LRU scan), assigns victims to
// the misses, updates the slot table and the LRU order, writes the device row of every entry
// and the row's miss plan (host row -> device row). The bytes are moved afterwards by
// planned_copy over the flattened (request, miss) pairs of every row, so the copy is not
// limited to one block per request.
//
// Semantics (docs/design.md, section 6):
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
// When the cache also holds multi-step state (p.index not null), every admission keeps the
// multi-step token -> slot index current: the victim's old token is erased, the new one
// inserted (an insert that finds both buckets full marks the request MS_F_DEGRADED), so a
// multi-step call that follows sees exactly the slots this call left.
//
// Phases (LRU path), with __syncthreads() between them:
//   0. clear the shared hash, stage slot_locs[0..H] in shared memory;
//   1. classify each entry, insert valid non-newest tokens into the hash (first index wins);
//   2. mark duplicates;
//   3. scan the LRU order: a slot whose token is in the hash is a hit (output written), others
//      are evictable; hits and evictables are compacted in LRU order;
//   4. compact misses in top-k order, assign victims, write outputs, slot tokens and the plan;
//   5. duplicates copy their canonical entry's output; LRU write-back; outputs, counts, status.
// Phases 3 and 4 need one block-level scan each: warp w owns a contiguous chunk of positions,
// counts its flags with ballots, the per-warp counts are scanned by one warp, then each warp
// places its entries at its offset.
//
// Shared memory: _abi.SMEM["SWAP_RESOLVE"] (named regions; NW = RESOLVE_BLOCK / 32, HS = hash
// slots, a power of two >= 4 K: load <= 1/4 keeps the longest probe of a warp short).
#include "index.cuh"

namespace hs {

enum : u8 { K_UNUSED = 0, K_INVALID, K_NEWEST, K_CANON, K_DUP, K_HIT, K_MISS, K_NOHOST };

constexpr int PREFETCH = 4;  // groups of global loads a thread issues together

// Home slot of a token: the high bits of the multiplicative hash (its low bits would only
// permute the token's low bits).
__device__ __forceinline__ u32 hash_home(int tok, int shift) {
  return hash_u32(static_cast<u32>(tok)) >> shift;
}

__device__ __forceinline__ int hash_find(const int* s_key, const int* s_val, int mask, int shift,
                                         int tok) {
  u32 h = hash_home(tok, shift);
  while (true) {
    const int k = s_key[h];
    if (k == tok) return s_val[h];
    if (k == -1) return -1;
    h = (h + 1) & mask;
  }
}

template <typename ReqT, typename LenT>
__global__ void __launch_bounds__(RESOLVE_BLOCK, 1) swap_resolve(const SwapResolveParams p) {
  constexpr int BLOCK = RESOLVE_BLOCK;
  constexpr int NW = BLOCK / 32;
  const int K = p.K, B = p.B, R = p.R, H = p.H, HS = p.hash_size;
  const int hash_size = HS;
  const int host_stride = p.host_stride;
  const i64 n_host_rows = p.n_host_rows;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  HS_SMEM_CARVE(SWAP_RESOLVE, sm, smem_raw);
  i64* s_hl = sm.host_row;
  int* s_key = sm.hkey;
  int* s_val = sm.hval;
  int* s_tok = sm.tok;
  int* s_out = sm.res;
  int* s_pos = sm.hpos;
  int* s_loc = sm.loc;
  int* s_wh = sm.warp_hits;
  int* s_we = sm.warp_evict;
  int* s_wm = sm.warp_miss;
  int* s_cnt = sm.count;
  i16* s_evict = sm.evict;
  i16* s_hit = sm.hit;
  u16* s_tmp = sm.order;
  u8* s_kind = sm.kind;

  HS_PHASE_START
  // Let the copy kernel that follows get scheduled; it waits for this grid to finish.
  pdl_launch_dependents();

  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const unsigned below = (1u << lane) - 1u;
  const i32* tk = p.topk + static_cast<i64>(b) * p.topk_stride;
  i32* o = p.out + static_cast<i64>(b) * p.out_stride;
  i32* st = p.status + static_cast<i64>(b) * N_STATUS;
  i32* plan_count = p.plan_count;

  // Phases 1, 3 and 4 give warp w a contiguous chunk: top-k entries [i0, i1), LRU positions
  // [p0, p1); a lane handles entries i0 + 32 u + lane.
  const int c4 = ((K + BLOCK - 1) / BLOCK) * 32;
  const int i0 = warp * c4;
  const int i1 = min(K, i0 + c4);
  const int c3 = ((H + BLOCK - 1) / BLOCK) * 32;
  const int p0 = warp * c3;
  const int p1 = min(H, p0 + c3);

  // ---- wave 1 of global loads (independent of each other): the row's request, length and the
  // first PREFETCH groups of its top-k. The latency chain of the LRU path is three waves.
  const int nr = clamp_real(p.num_real, B);
  const i64 rid_raw = static_cast<i64>(static_cast<const ReqT*>(p.req)[b]);
  const i64 seq_raw =
      static_cast<i64>(static_cast<const LenT*>(p.lens)[static_cast<i64>(b) * p.lens_stride]);
  int toks[PREFETCH];
#pragma unroll
  for (int u = 0; u < PREFETCH; ++u) {
    const int i = i0 + u * 32 + lane;
    toks[u] = i < i1 ? tk[i] : -1;
  }
  const i64 rid = b < nr ? rid_raw : -1;
  const i64 seq = b < nr ? seq_raw : -1;
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
  i32* stok = p.slot_tokens + rid * p.slot_stride;
  const i32* sloc = p.slot_locs + rid * p.slot_stride;
  const i64* hloc = p.host_locs + rid * host_stride;
  i16* rlru = p.lru + rid * p.lru_stride;
  const int nb = p.n_buckets;
  u64* idx = p.index ? p.index + rid * static_cast<i64>(nb) * MS_BUCKET : nullptr;

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

  // ---- wave 2: host rows of the prefetched tokens (speculatively: hits do not need them),
  // the first LRU entries, the slots' device rows; wave 3: the tokens those slots hold.
  const i64 lim = seq < host_stride ? seq : host_stride;
  i64 hls[PREFETCH];
  int slots[PREFETCH], held[PREFETCH];
#pragma unroll
  for (int u = 0; u < PREFETCH; ++u) {
    const int t = toks[u];
    hls[u] = (t >= 0 && t < lim && t != seq - 1) ? hloc[t] : -1;
    const int p = p0 + u * 32 + lane;
    slots[u] = p < p1 ? rlru[p] : 0;
  }
#pragma unroll
  for (int u = 0; u < PREFETCH; ++u) {
    const int p = p0 + u * 32 + lane;
    held[u] = p < p1 ? stok[slots[u]] : -1;
  }

  // ---- phase 0: clear the hash, stage the slots' device rows
  const int mask = hash_size - 1;
  const int shift = 32 - (__ffs(hash_size) - 1);  // hash_size is a power of two >= 64
  for (int h = tid; h < hash_size; h += BLOCK) {
    s_key[h] = -1;
    s_val[h] = 0x7fffffff;
  }
#pragma unroll 8
  for (int j = tid; j <= H; j += BLOCK) s_loc[j] = sloc[j];
  __syncthreads();
  HS_PHASE(0);

  // ---- phase 1: classify, insert
  for (int g = i0; g < i0 + c4; g += 32 * PREFETCH) {
    const bool first = g == i0;  // uniform; later groups (K > PREFETCH * BLOCK) load here
#pragma unroll
    for (int u = 0; u < PREFETCH; ++u) {
      if (g + u * 32 >= i0 + c4) break;  // uniform over the warp
      const int i = g + u * 32 + lane;
      if (i >= i1) continue;
      const int tok = first ? toks[u] : tk[i];
      u8 kind = K_CANON;
      int r = -1;
      i64 hl = -1;
      if (tok == -1) {
        kind = K_UNUSED;
      } else if (tok < 0 || tok >= lim) {
        kind = K_INVALID;
        atomicAdd(&s_cnt[ST_RANGE], 1);
      } else if (tok == seq - 1) {
        kind = K_NEWEST;
        r = s_loc[H];
      } else {
        hl = first ? hls[u] : hloc[tok];
        u32 h = hash_home(tok, shift);
        while (true) {
          const int prev = atomicCAS(&s_key[h], -1, tok);
          if (prev == -1 || prev == tok) {
            atomicMin(&s_val[h], i);
            s_pos[i] = static_cast<int>(h);
            break;
          }
          h = (h + 1) & mask;
        }
      }
      s_tok[i] = tok;
      s_kind[i] = kind;
      s_out[i] = r;
      s_hl[i] = hl;
    }
  }
  __syncthreads();

  HS_PHASE(1);
  // ---- phase 2: duplicates
  for (int i = tid; i < K; i += BLOCK) {
    if (s_kind[i] == K_CANON && s_val[s_pos[i]] != i) {
      s_kind[i] = K_DUP;
    }
  }
  __syncthreads();

  HS_PHASE(2);
  // Phases 3 and 4 compact in order with one block-level scan each: each warp counts its
  // chunk's flags with ballots (pass 1), one warp scans the per-warp counts, then each warp
  // places its entries at its offset (pass 2).

  // ---- phase 3: LRU scan (hits / evictables in old LRU order). A warp loads the LRU entries
  // and slot tokens of PREFETCH groups before using the first.
  {
    int nh = 0, ne = 0;
    for (int g = p0; g < p0 + c3; g += 32 * PREFETCH) {
      if (g != p0) {  // uniform; H > PREFETCH * BLOCK only (the first groups are prefetched)
#pragma unroll
        for (int u = 0; u < PREFETCH; ++u) {
          const int p = g + u * 32 + lane;
          slots[u] = p < p1 ? rlru[p] : 0;
        }
#pragma unroll
        for (int u = 0; u < PREFETCH; ++u) {
          const int p = g + u * 32 + lane;
          held[u] = p < p1 ? stok[slots[u]] : -1;
        }
      }
#pragma unroll
      for (int u = 0; u < PREFETCH; ++u) {
        if (g + u * 32 >= p0 + c3) break;  // uniform over the warp
        const int p = g + u * 32 + lane;
        const bool valid = p < p1;
        int hit = 0;
        if (valid) {
          const int bt = held[u];
          const int j = bt >= 0 ? hash_find(s_key, s_val, mask, shift, bt) : -1;
          if (j >= 0 && s_kind[j] == K_CANON) {
            hit = 1;
            s_kind[j] = K_HIT;
            s_out[j] = s_loc[slots[u]];
          }
          s_tmp[p] = static_cast<u16>(slots[u] | (hit << 15));
        }
        const unsigned hm = __ballot_sync(FULL_MASK, hit);
        const unsigned vm = __ballot_sync(FULL_MASK, valid);
        nh += __popc(hm);
        ne += __popc(vm & ~hm);
      }
    }
    if (lane == 0) {
      s_wh[warp] = nh;
      s_we[warp] = ne;
    }
  }
  __syncthreads();
  if (warp == 0) scan_warp_totals<NW>(s_wh, lane);
  if (warp == 1 % NW) scan_warp_totals<NW>(s_we, lane);  // NW == 1: the same warp, in turn
  __syncthreads();
  const int E = s_we[NW];
  {
    int ho = s_wh[warp], eo = s_we[warp];
    for (int g = p0; g < p0 + c3; g += 32) {
      const int p = g + lane;
      const bool valid = p < p1;
      const int v = valid ? s_tmp[p] : 0;
      const bool hit = valid && (v >> 15);
      const bool ev = valid && !hit;
      const unsigned hm = __ballot_sync(FULL_MASK, hit);
      const unsigned em = __ballot_sync(FULL_MASK, ev);
      if (hit) s_hit[ho + __popc(hm & below)] = static_cast<i16>(v & 0x7fff);
      if (ev) s_evict[eo + __popc(em & below)] = static_cast<i16>(v & 0x7fff);
      ho += __popc(hm);
      eo += __popc(em);
    }
  }

  HS_PHASE(3);
  // ---- phase 4: misses in top-k order take the least recently used evictable slots. Pass 1
  // needs only phase 3's kinds, published by the barrier above; host rows came with phase 1.
  {
    int nm = 0;
    for (int g = i0; g < i0 + c4; g += 32) {
      const int i = g + lane;
      int miss = 0;
      if (i < i1 && s_kind[i] == K_CANON) {
        const i64 hl = s_hl[i];
        if (hl >= 0 && hl < n_host_rows) {
          miss = 1;
          s_kind[i] = K_MISS;
        } else {
          s_kind[i] = K_NOHOST;
          atomicAdd(&s_cnt[ST_NOHOST], 1);
        }
      }
      nm += __popc(__ballot_sync(FULL_MASK, miss));
    }
    if (lane == 0) s_wm[warp] = nm;
  }
  __syncthreads();  // also publishes s_hit / s_evict
  if (warp == 0) scan_warp_totals<NW>(s_wm, lane);
  __syncthreads();
  const int M = s_wm[NW];
  {
    int mo = s_wm[warp];
    for (int g = i0; g < i0 + c4; g += 32) {
      const int i = g + lane;
      const bool miss = i < i1 && s_kind[i] == K_MISS;
      const unsigned mm = __ballot_sync(FULL_MASK, miss);
      if (miss) {
        const int m = mo + __popc(mm & below);
        const int victim = s_evict[m];
        const int loc = s_loc[victim];
        s_out[i] = loc;
        if (idx) {
          const int old = stok[victim];
          if (old >= 0) hot_erase(idx, nb, old, victim);
          s_pos[i] = victim;  // the hash slot is not needed any more: phase 5 inserts
        }
        stok[victim] = s_tok[i];
        p.plan_src[static_cast<i64>(b) * p.plan_stride + m] = s_hl[i];
        p.plan_dst[static_cast<i64>(b) * p.plan_stride + m] = loc;
      }
      mo += __popc(mm);
    }
  }
  __syncthreads();  // misses' outputs are visible
  HS_PHASE(4);

  // ---- phase 5: duplicates take their canonical entry's output; write-back; index inserts
  for (int i = tid; i < K; i += BLOCK) {
    if (s_kind[i] == K_DUP) {
      const int c = s_val[s_pos[i]];
      s_out[i] = s_out[c];
      if (s_kind[c] == K_NOHOST) atomicAdd(&s_cnt[ST_NOHOST], 1);
    } else if (idx && s_kind[i] == K_MISS) {
      if (!hot_insert(idx, nb, stok, H, s_tok[i], s_pos[i])) atomicOr(p.flags + rid, MS_F_DEGRADED);
    }
  }
  for (int p = tid; p < H; p += BLOCK) {
    i16 v;
    if (p < E - M) v = s_evict[M + p];
    else if (p < E) v = s_evict[p - (E - M)];
    else v = s_hit[p - E];  // the H - E hits
    rlru[p] = v;
  }
  __syncthreads();
  for (int i = tid; i < K; i += BLOCK) o[i] = s_out[i];
  if (tid == 0) {
    plan_count[b] = M;
    st[ST_RANGE] = s_cnt[ST_RANGE];
    st[ST_NOHOST] = s_cnt[ST_NOHOST];
    st[ST_BADROW] = 0;
  }
  HS_PHASE(5);
}

}  // namespace hs
