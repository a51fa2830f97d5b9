// hisparse_cupy: single-step swap-in, resolve half.
//
// swap_resolve<ReqT, LenT, BLOCK>(SwapResolveParams): C blocks of BLOCK threads per batch row (a
// thread-block cluster, C = 1, 2, 4 or 8: hisparse_cupy._kernels.swap.resolve_cluster picks it;
// BLOCK is RESOLVE_BLOCK for C = 1, RESOLVE_CLUSTER_BLOCK otherwise).
// swap_resolve<ReqT, LenT, RESOLVE_BLOCK, true> (the token-table instance, one block per row):
// each entry's token is looked up in the request's token -> slot table (p.token_slot) and
// checked against slot_tokens; only tokens the table does not find go into the hash, and the
// slots are probed against it only when there are any (phase 2b, which repairs the table). A row
// whose tokens the table all finds has no misses and ends after the LRU pass. Same results.
// Resolves the row's top-k against the request's hot buffer (hash of the top-k in shared memory,
// LRU scan), assigns victims to the misses, updates the slot table and the LRU order, writes the
// device row of every entry and the row's miss plan (host row -> device row). The bytes are
// moved afterwards by planned_copy over the flattened (request, miss) pairs of every row, so the
// copy is not limited to one block per request.
//
// The cluster: block `rank` owns a contiguous 1/C of the row's entries and of its LRU positions
// (in rank order, so every order below is the same for any C) and the hash buckets of the tokens
// whose hash bits pick it (each block's hash has every bucket: an uneven split never runs out of
// room). Blocks insert into, probe and claim in each other's hash through distributed shared
// memory; the row-wide scans add the blocks' totals in rank order. The result does not depend on
// C (tests/test_swap_gpu.py runs every C against the oracle).
//
// Semantics (docs/design.md, section 6):
//   - rows b >= num_real (graph padding): output -1, plan count 0, status 0, no state touched;
//   - a request slot outside [0, R) or seq_len < 0: output -1, status[2] = 1, no state touched;
//   - a resident request, or seq_len <= H (the positional layout: token t in slot t): the
//     direct path (abi.cuh, direct_entry): every valid entry gets its own row (the page table's,
//     or slot_locs[tok]); columns >= seq_len of a row of seq_len <= H and -1 entries get -1;
//     other tokens get -1 and count in status[0] (a token without a row: status[1]); no state
//     change, plan count 0; in a lean step a row that is not resident is refused (-1, status
//     BADROW_NOT_RESIDENT);
//   - otherwise (seq_len > H, not resident), the LRU path:
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
// The token-table instance keeps the table current for every token it admits or finds by the
// slot scan: the multi-step swap reads the same table (cu/multistep.cu states the invariant),
// so a cache with multi-step state runs the single-step swap with the table.
//
// Phases (LRU path), with a barrier of the row's blocks (sync_row) between them:
//   0. clear the hash, stage slot_locs[0..H] in shared memory;
//   1. classify each entry, insert valid non-newest tokens into the hash (first index wins);
//   2. mark duplicates, and (same interval) 3. scan the LRU order: a slot whose token is in the
//      hash claims the token's first entry, a hit (output written); others are evictable;
//   3b. compact hits and evictables in LRU order; classify the rest as misses;
//   4. compact misses in top-k order, assign victims, write outputs, slot tokens and the plan;
//   5. duplicates copy their first entry's output; LRU write-back; outputs, counts, status.
// The compactions need one scan each: warp w owns a contiguous chunk of positions, counts its
// flags with ballots, the per-warp counts are scanned by one warp, the blocks' totals by one
// warp of each block, then each warp places its entries at its offset.
//
// Shared memory: _abi.SMEM["SWAP_RESOLVE"] (named regions; NW = BLOCK / 32, HS = hash
// slots, a power of two >= 4 K: load <= 1/4 keeps the longest probe of a warp short).
#include "abi.cuh"

namespace hs {

enum : u8 { K_UNUSED = 0, K_INVALID, K_NEWEST, K_CANON, K_DUP, K_HIT, K_MISS, K_NOHOST };

constexpr int PREFETCH = 4;  // groups of global loads a thread issues together

// Hash values: the first entry that selected the token (low bits, RESOLVE_VAL_ENTRY) and, once
// an LRU slot holding the token claimed that entry (phase 3), RESOLVE_VAL_CLAIMED. An empty
// bucket holds key RESOLVE_KEY_EMPTY and value RESOLVE_VAL_EMPTY (constants from _abi.py).
constexpr int VAL_ENTRY = RESOLVE_VAL_ENTRY;
constexpr int VAL_CLAIMED = RESOLVE_VAL_CLAIMED;
constexpr int VAL_EMPTY = RESOLVE_VAL_EMPTY;
constexpr int KEY_EMPTY = RESOLVE_KEY_EMPTY;
// s_pos: the token's bucket in its owner block's hash | owner << POS_OWNER_SHIFT
constexpr int POS_OWNER_SHIFT = 24;
constexpr int POS_SLOT_MASK = (1 << POS_OWNER_SHIFT) - 1;

// The direct path's entries i0, i0 + BLOCK, ... below ke (abi.cuh: direct_entry); the flagged
// ones counted in cnt (rank 0's status counters).
template <bool PAGED, int BLOCK>
__device__ __forceinline__ void direct_serve(const DirectRows& d, const i32* tk, i32* o, int i0,
                                             int ke, int* cnt) {
  for (int i = i0; i < ke; i += BLOCK) {
    const int r = direct_entry<PAGED>(d, tk[i], i);
    if (r == DIRECT_RANGE) atomicAdd(&cnt[ST_RANGE], 1);
    else if (r == DIRECT_NOROW) atomicAdd(&cnt[ST_NOHOST], 1);
    o[i] = r < 0 ? -1 : r;
  }
}

// The block of a row's cluster whose hash holds a token: the hash bits just below the bucket's
// (each block's hash has every bucket, so an uneven split costs load, never room).
__device__ __forceinline__ int hash_owner(u32 hv, int shift, int C) {
  return static_cast<int>((((hv << (32 - shift)) >> 24) * static_cast<u32>(C)) >> 8);
}

// `p` (this block's shared memory) in the shared memory of the row's block `q`.
template <typename T>
__device__ __forceinline__ T* row_smem(T* p, int q, int C) {
  return C > 1 ? cluster_map(p, q) : p;
}

// A row that touches no state: every output of the block's entries [kb, ke) -1, and rank 0
// writes plan count 0 and status `badrow` (0: graph padding; else why the row is refused).
template <int BLOCK>
__device__ __forceinline__ void refuse_row(i32* o, int kb, int ke, int tid, int rank,
                                           i32* plan_count, int b, i32* st, int badrow) {
  for (int i = kb + tid; i < ke; i += BLOCK) o[i] = -1;
  if (rank == 0 && tid == 0) {
    plan_count[b] = 0;
    write_status(st, 0, 0, badrow);
  }
}

// Phase 0: this block's hash emptied (16-byte stores); `loc` the slots' device rows staged
// (0..H), or, token-table instance, the slots' hit flags cleared (0..H-1).
template <int BLOCK, bool TABLE>
__device__ __forceinline__ void clear_hash(int* key, int* val, int hash_size, int* loc,
                                           const i32* sloc, int H, int tid) {
  const int4 empty_key = make_int4(KEY_EMPTY, KEY_EMPTY, KEY_EMPTY, KEY_EMPTY);
  const int4 empty_val = make_int4(VAL_EMPTY, VAL_EMPTY, VAL_EMPTY, VAL_EMPTY);
  int4* k4 = reinterpret_cast<int4*>(key);
  int4* v4 = reinterpret_cast<int4*>(val);
  for (int h = tid; h < (hash_size >> 2); h += BLOCK) {
    k4[h] = empty_key;
    v4[h] = empty_val;
  }
  if constexpr (TABLE) {
    for (int j = tid; j < H; j += BLOCK) loc[j] = 0;
  } else {
#pragma unroll 8
    for (int j = tid; j <= H; j += BLOCK) loc[j] = sloc[j];
  }
}

// Phase 5's LRU write-back of this block's share: the row's new order is [evictables M..E (not
// taken)][evictables 0..M (the misses' slots)][hits], this block's evictables `ev` (ne of them)
// from row position eb, its hits `hit` (nh) from hb.
template <int BLOCK>
__device__ __forceinline__ void write_lru(i16* lru, const i16* ev, int ne, int eb,
                                          const i16* hit, int nh, int hb, int E, int M,
                                          int tid) {
  for (int j = tid; j < ne; j += BLOCK) {
    const int e = eb + j;
    lru[e >= M ? e - M : E - M + e] = ev[j];
  }
  for (int j = tid; j < nh; j += BLOCK) lru[E + hb + j] = hit[j];
}

// Phase 1's insert: entry i's token into its owner block's hash (linear probing from its
// bucket; the first entry of a token keeps the smallest index), and where it went into pos[i]
// (the bucket | owner << POS_OWNER_SHIFT).
__device__ __forceinline__ void hash_insert(int* hkey, int* hval, int* pos, int tok, int i,
                                            int shift, int mask, int C) {
  const u32 hv = hash_u32(static_cast<u32>(tok));
  const int ow = hash_owner(hv, shift, C);
  int* key = row_smem(hkey, ow, C);
  int* val = row_smem(hval, ow, C);
  u32 h = hv >> shift;
  while (true) {
    const int prev = atomicCAS(&key[h], KEY_EMPTY, tok);
    if (prev == KEY_EMPTY || prev == tok) {
      atomicMin(&val[h], i);
      pos[i] = static_cast<int>(h) | (ow << POS_OWNER_SHIFT);
      return;
    }
    h = (h + 1) & mask;
  }
}

// A slot holding token `bt` claims the token's first entry if the hash holds `bt` and no other
// slot claimed it (the claim bit of its hash value: one slot per entry even if a state held a
// token twice): that entry, else -1.
__device__ __forceinline__ int hash_claim(const int* hkey, int* hval, int bt, int shift,
                                          int mask, int C) {
  const u32 hv = hash_u32(static_cast<u32>(bt));
  const int ow = hash_owner(hv, shift, C);
  const int* key = row_smem(hkey, ow, C);
  int* val = row_smem(hval, ow, C);
  u32 h = hv >> shift;
  int k;
  while ((k = key[h]) != bt && k != KEY_EMPTY) h = (h + 1) & mask;
  const int v = k == bt ? atomicOr(&val[h], VAL_CLAIMED) : VAL_CLAIMED;
  return v & VAL_CLAIMED ? -1 : v & VAL_ENTRY;
}

// Phase 2b (token-table instance): each slot 0..H-1 whose token the hash holds (the table missed
// it) claims the token's first entry j: res[j] the slot's device row (a hit for phase 4), the
// slot's hit flag in loc, and the table's entry repaired. Slots in slot order (coalesced).
template <int BLOCK>
__device__ __forceinline__ void repair_table(const int* hkey, int* hval, const i32* stok,
                                             const i32* sloc, i16* tsl, int* res, int* loc,
                                             int H, int shift, int mask, int tid) {
  for (int s0 = 0; s0 < H; s0 += BLOCK * PREFETCH) {
    int t[PREFETCH];
#pragma unroll
    for (int u = 0; u < PREFETCH; ++u) {
      const int sl = s0 + u * BLOCK + tid;
      t[u] = sl < H ? stok[sl] : -1;
    }
#pragma unroll
    for (int u = 0; u < PREFETCH; ++u) {
      const int sl = s0 + u * BLOCK + tid;
      const int j = t[u] >= 0 ? hash_claim(hkey, hval, t[u], shift, mask, 1) : -1;
      if (j >= 0) {
        res[j] = sloc[sl];  // a device row (>= 0): phase 4 makes entry j a hit
        loc[sl] = 1;
        tsl[t[u]] = static_cast<i16>(sl);
      }
    }
  }
}

// Phase 4's first pass, one warp's entries [i0, i1) (chunks of 32 up to i0 + c4): a canonical
// entry with an output (res) is a hit, one with a host row in [0, n_host_rows) a miss, else it
// has no host row (counted in cnt[ST_NOHOST]). Returns the warp's misses.
__device__ __forceinline__ int classify_misses(u8* kind, const i64* host_row, const int* res,
                                               int i0, int i1, int c4, int lane,
                                               i64 n_host_rows, int* cnt) {
  int nm = 0;
  for (int g = i0; g < i0 + c4; g += 32) {
    const int i = g + lane;
    int miss = 0;
    if (i < i1 && kind[i] == K_CANON) {
      const i64 hl = host_row[i];
      if (res[i] >= 0) {
        kind[i] = K_HIT;
      } else if (hl >= 0 && hl < n_host_rows) {
        miss = 1;
        kind[i] = K_MISS;
      } else {
        kind[i] = K_NOHOST;
        atomicAdd(&cnt[ST_NOHOST], 1);
      }
    }
    nm += __popc(__ballot_sync(FULL_MASK, miss));
  }
  return nm;
}

// Phase 5's duplicates among the block's entries [kb, ke): each takes its token's first entry's
// output (in whichever block owns it), counted as without a host row when that one is.
template <int BLOCK>
__device__ __forceinline__ void copy_duplicates(u8* kind, const int* pos, int* hval,
                                                int* res, int kb, int ke, int kc, int tid,
                                                int C, int* cnt) {
  for (int i = kb + tid; i < ke; i += BLOCK) {
    if (kind[i] == K_DUP) {
      const int ps = pos[i];
      const int c = row_smem(hval, ps >> POS_OWNER_SHIFT, C)[ps & POS_SLOT_MASK] & VAL_ENTRY;
      const int oc = c / kc;
      res[i] = row_smem(res, oc, C)[c];
      if (row_smem(kind, oc, C)[c] == K_NOHOST) atomicAdd(&cnt[ST_NOHOST], 1);
    }
  }
}

// Phase 4's second pass, one warp's entries [i0, i1): the row's m-th miss (top-k order; this
// warp's first is mo) takes the row's m-th evictable slot (in the block of the cluster that
// holds it: tot's evictables before each block), its output the slot's device row; the slot's
// token (and, token-table instance, the table's entry) and the plan written.
template <bool TABLE>
__device__ __forceinline__ void assign_victims(const SwapResolveParams& p, int b, const u8* kind,
                                               const int* tok, const i64* host_row, int* res,
                                               i16* evict, const int* tot, const int* loc,
                                               const i32* sloc, i32* stok, i16* tsl, int i0,
                                               int i1, int c4, int lane, unsigned below, int mo,
                                               int C) {
  for (int g = i0; g < i0 + c4; g += 32) {
    const int i = g + lane;
    const bool miss = i < i1 && kind[i] == K_MISS;
    const unsigned mm = __ballot_sync(FULL_MASK, miss);
    if (miss) {
      const int m = mo + __popc(mm & below);
      int q = 0;  // the block holding the row's m-th evictable slot
      while (q + 1 < C && tot[3 * (q + 1) + 1] <= m) ++q;
      const int victim = row_smem(evict, q, C)[C > 1 ? m - tot[3 * q + 1] : m];
      const int r = TABLE ? sloc[victim] : loc[victim];
      res[i] = r;
      if constexpr (TABLE) tsl[tok[i]] = static_cast<i16>(victim);
      stok[victim] = tok[i];
      plan_src_row(p, b)[m] = host_row[i];
      plan_dst_row(p, b)[m] = r;
    }
    mo += __popc(mm);
  }
}

// Phase 3, one warp's LRU positions [p0, p1) (groups of PREFETCH x 32 up to p0 + c3; the
// first group's slots and, hash instance, their tokens already in slots / held): each slot's
// hit bit into order[p] (token-table instance: its flag in loc; else the slot claims its
// token's first entry j, whose output res[j] becomes the slot's device row), the warp's hits
// and evictables counted into nh and ne.
template <bool TABLE>
__device__ __forceinline__ void scan_lru(int (&slots)[PREFETCH], int (&held)[PREFETCH],
                                         const i16* rlru, const i32* stok, const int* loc,
                                         int* res, u16* order, const int* hkey, int* hval,
                                         int p0, int p1, int c3, int lane, int kc, int C,
                                         int shift, int mask, int& nh, int& ne) {
  for (int g = p0; g < p0 + c3; g += 32 * PREFETCH) {
    if (g != p0) {  // uniform; H > PREFETCH * BLOCK only (the first groups are prefetched)
#pragma unroll
      for (int u = 0; u < PREFETCH; ++u) {
        const int p = g + u * 32 + lane;
        slots[u] = p < p1 ? rlru[p] : 0;
      }
      if constexpr (!TABLE) {
#pragma unroll
        for (int u = 0; u < PREFETCH; ++u) {
          const int p = g + u * 32 + lane;
          held[u] = p < p1 ? stok[slots[u]] : -1;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < PREFETCH; ++u) {
      if (g + u * 32 >= p0 + c3) break;  // uniform over the warp
      const int p = g + u * 32 + lane;
      const bool valid = p < p1;
      int hit = 0;
      if (valid) {
        if constexpr (TABLE) {
          hit = loc[slots[u]];
        } else if (held[u] >= 0) {
          const int j = hash_claim(hkey, hval, held[u], shift, mask, C);
          if (j >= 0) {
            hit = 1;  // entry j's output (a device row, >= 0) marks it a hit for phase 4
            row_smem(res, j / kc, C)[j] = loc[slots[u]];
          }
        }
        order[p] = static_cast<u16>(slots[u] | (hit << 15));
      }
      const unsigned hm = __ballot_sync(FULL_MASK, hit);
      const unsigned vm = __ballot_sync(FULL_MASK, valid);
      nh += __popc(hm);
      ne += __popc(vm & ~hm);
    }
  }
}

// A barrier of the row's blocks (the block itself when the row has one).
__device__ __forceinline__ void sync_row(int C) {
  if (C > 1) cluster_sync();
  else __syncthreads();
}

// The direct path of a row (abi.cuh: direct_entry; a resident request's page rows, or the
// positional layout's slot rows): the block's entries [kb, ke) served, counted in rank 0's
// counters cnt0 (this block's `cnt`); rank 0 writes plan count 0, the status and the counters.
template <int BLOCK>
__device__ __forceinline__ void serve_direct(const SwapResolveParams& p, i64 rid, i64 seq,
                                             int H, int K, bool resident, const i32* tk, i32* o,
                                             int kb, int ke, int tid, int rank, int C,
                                             int* cnt0, const int* cnt, i32* plan_count,
                                             i32* st, int b) {
  sync_row(C);  // rank 0's counters are zero before anyone adds
  const DirectRows d = direct_rows(p, rid, seq, H);
  if (resident) direct_serve<true, BLOCK>(d, tk, o, kb + tid, ke, cnt0);
  else direct_serve<false, BLOCK>(d, tk, o, kb + tid, ke, cnt0);
  sync_row(C);
  if (rank == 0 && tid == 0) {
    plan_count[b] = 0;
    write_status(st, cnt[ST_RANGE], cnt[ST_NOHOST], 0);
    count_row(p.counters, K, 0, cnt[ST_RANGE] + cnt[ST_NOHOST]);
  }
}

template <typename ReqT, typename LenT, int BLOCK, bool TABLE = false>
__global__ void __launch_bounds__(BLOCK, 1) swap_resolve(const SwapResolveParams p) {
  static_assert(BLOCK == RESOLVE_BLOCK || BLOCK == RESOLVE_CLUSTER_BLOCK, "a resolve block size");
  static_assert(RESOLVE_BLOCK != RESOLVE_CLUSTER_BLOCK,
                "the block size tells one block per row from a cluster (C below)");
  static_assert(!TABLE || BLOCK == RESOLVE_BLOCK, "the token table is read by one block per row");
  constexpr int NW = BLOCK / 32;
  const int K = p.K, B = p.B, R = p.R, H = p.H, HS = p.hash_size;
  const int hash_size = HS;
  const int host_stride = p.host_stride;
  const i64 n_host_rows = p.n_host_rows;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  HS_SMEM_CARVE(SWAP_RESOLVE, sm, smem_raw);
  // (the one alias kept: sm.hit written directly changes the token-table instance's register
  // allocation, nvdisasm of the sm_90 cubin; every other region is used by its name)
  i16* s_hit = sm.hit;

  HS_PHASE_START
  // Let the copy kernel that follows get scheduled; it waits for this grid to finish.
  pdl_launch_dependents();

  // C blocks (a cluster) per batch row: block `rank` owns a 1/C share of the row's entries and
  // LRU positions (contiguous, in rank order) and of its tokens' hash (by token).
  // (resolve_launch gives one block per row exactly the RESOLVE_BLOCK instance: there C is a
  // constant and every cluster step below compiles away)
  const int C = BLOCK == RESOLVE_BLOCK ? 1 : cluster_blocks();
  const int rank = C > 1 ? cluster_rank() : 0;
  const int b = blockIdx.x / C;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const unsigned below = (1u << lane) - 1u;
  const i32* tk = topk_row(p, b);
  i32* o = out_row(p, b);
  i32* st = status_row(p, b);
  i32* plan_count = p.plan_count;
  // rank 0's status counters (every block of the row adds to them)
  int* cnt0 = C > 1 ? cluster_map(sm.count, 0) : sm.count;

  // The block's entries [kb, ke) and LRU positions [pb, pe). Phases 1, 3 and 4 give warp w a
  // contiguous chunk of them: entries [i0, i1), positions [p0, p1); a lane handles entries
  // i0 + 32 u + lane.
  const int kc = (K + C - 1) / C, hc = (H + C - 1) / C;
  const int kb = min(K, rank * kc), ke = min(K, kb + kc);
  const int pb = min(H, rank * hc), pe = min(H, pb + hc);
  const int c4 = ((kc + BLOCK - 1) / BLOCK) * 32;
  const int i0 = kb + warp * c4;
  const int i1 = min(ke, i0 + c4);
  const int c3 = ((hc + BLOCK - 1) / BLOCK) * 32;
  const int p0 = pb + warp * c3;
  const int p1 = min(pe, p0 + c3);

  // ---- wave 1 of global loads (independent of each other): the row's request, length and the
  // first PREFETCH groups of its top-k. The latency chain of the LRU path is three waves.
  const int nr = clamp_real(p.num_real, B);
  const i64 rid_raw = request_of<ReqT>(p, b);
  const i64 seq_raw = length_of<LenT>(p, b);
  int toks[PREFETCH];
#pragma unroll
  for (int u = 0; u < PREFETCH; ++u) {
    const int i = i0 + u * 32 + lane;
    toks[u] = i < i1 ? tk[i] : -1;
  }
  const i64 rid = b < nr ? rid_raw : -1;
  const i64 seq = b < nr ? seq_raw : -1;
  if (b >= nr || rid < 0 || rid >= R || seq < 0) {  // uniform over the cluster: no sync needed
    refuse_row<BLOCK>(o, kb, ke, tid, rank, plan_count, b, st, b < nr ? 1 : 0);
    return;
  }
  i32* stok = slot_tokens_row(p, rid);
  const i32* sloc = slot_locs_row(p, rid);
  const i64* hloc = host_locs_row(p, rid);
  i16* rlru = lru_row(p, rid);
  i16* tsl = TABLE ? token_slot_row(p, rid) : nullptr;

  if (tid < 4) sm.count[tid] = 0;

  const bool resident = p.resident != nullptr && p.resident[rid];
  if (p.lean && !resident) {  // a lean step serves resident rows only: no copy follows, no
                              // replay (a graph captured lean, replayed after a demotion);
                              // refused, nothing touched
    refuse_row<BLOCK>(o, kb, ke, tid, rank, plan_count, b, st, BADROW_NOT_RESIDENT);
    return;
  }
  if (resident || seq <= H) {  // the direct path: every token has a row of its own
    serve_direct<BLOCK>(p, rid, seq, H, K, resident, tk, o, kb, ke, tid, rank, C, cnt0, sm.count,
                        plan_count, st, b);
    return;
  }

  // ---- wave 2: host rows of the prefetched tokens (speculatively: hits do not need them),
  // the first LRU entries, the slots' device rows; wave 3: the tokens those slots hold.
  // Token-table instance: wave 2 reads the table's slot for each prefetched token instead of
  // its host row, wave 3 checks it (an entry counts only while its slot holds its token, so
  // stale or garbage entries are harmless): ent[u] becomes the hit slot or -1, and hls[u] a
  // hit's device row. The tokens the LRU slots hold are not loaded (phase 2b).
  const i64 lim = seq < host_stride ? seq : host_stride;
  i64 hls[PREFETCH];
  int slots[PREFETCH], held[PREFETCH], ent[PREFETCH];
#pragma unroll
  for (int u = 0; u < PREFETCH; ++u) {
    const int t = toks[u];
    const bool look = t >= 0 && t < lim && t != seq - 1;
    if constexpr (TABLE) ent[u] = look ? tsl[t] : -1;
    else hls[u] = look ? hloc[t] : -1;
    const int p = p0 + u * 32 + lane;
    slots[u] = p < p1 ? rlru[p] : 0;
  }
#pragma unroll
  for (int u = 0; u < PREFETCH; ++u) {
    const int p = p0 + u * 32 + lane;
    if constexpr (!TABLE) {
      held[u] = p < p1 ? stok[slots[u]] : -1;
    } else {
      int loc = -1;
      ent[u] = table_slot(ent[u], toks[u], H, stok, sloc, loc);
      if (ent[u] >= 0) hls[u] = loc;
    }
  }
  const int newest_loc = TABLE ? sloc[H] : 0;

  // ---- phase 0: clear this block's hash (16-byte stores), stage the slots' device rows (the
  // token-table instance: clear the slots' hit flags instead)
  const int mask = hash_size - 1;
  const int shift = 32 - (__ffs(hash_size) - 1);  // hash_size is a power of two >= 64
  clear_hash<BLOCK, TABLE>(sm.hkey, sm.hval, hash_size, sm.loc, sloc, H, tid);
  sync_row(C);  // every block's hash is clear before any block inserts into it
  HS_PHASE(0);
  // token-table instance: the slot the table names for `tok` if it holds `tok` (its device row
  // in `loc`), else -1
  auto table_find = [&](int tok, int& loc) {
    return table_slot(tsl[tok], tok, H, stok, sloc, loc);
  };
  int cand = 0;  // token-table instance: this thread inserted a token into the hash

  // ---- phase 1: classify, insert each token into its owner block's hash
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
        atomicAdd(&cnt0[ST_RANGE], 1);
      } else if (tok == seq - 1) {
        kind = K_NEWEST;
        r = TABLE ? newest_loc : sm.loc[H];
      } else if (int e = -1, loc = -1; TABLE && (e = first ? ent[u] : table_find(tok, loc)) >= 0) {
        kind = K_HIT;  // the slot's hit flag for the LRU scan; no hash entry needed
        r = first ? static_cast<int>(hls[u]) : loc;
        sm.loc[e] = 1;
      } else {
        cand = 1;
        hl = first && !TABLE ? hls[u] : hloc[tok];
        hash_insert(sm.hkey, sm.hval, sm.hpos, tok, i, shift, mask, C);
      }
      sm.tok[i] = tok;
      sm.kind[i] = kind;
      sm.res[i] = r;
      sm.host_row[i] = hl;
    }
  }
  // every hash complete (token-table instance: and whether it holds any token)
  bool any_cand = true;
  if constexpr (TABLE) any_cand = __syncthreads_or(cand);
  else sync_row(C);

  HS_PHASE(1);
  // ---- phase 2: duplicates (an entry whose token's first entry is another)
  for (int i = kb + tid; i < ke; i += BLOCK) {
    if (sm.kind[i] == K_CANON) {
      const int pos = sm.hpos[i];
      const int* val = row_smem(sm.hval, pos >> POS_OWNER_SHIFT, C);
      if ((val[pos & POS_SLOT_MASK] & VAL_ENTRY) != i) sm.kind[i] = K_DUP;
    }
  }
  // ---- phase 2b (token-table instance, only when the hash holds tokens): the hash holds the
  // tokens the table did not find. A slot holding one (the table missed it: slot_tokens was
  // written by something else, restored, or left by the positional layout) claims it, which
  // makes the slot a hit, and repairs the table's entry. Slots in slot order (coalesced).
  if constexpr (TABLE) {  // (one block per row: C = 1)
    if (any_cand) {
      repair_table<BLOCK>(sm.hkey, sm.hval, stok, sloc, tsl, sm.res, sm.loc, H, shift, mask,
                          tid);
      __syncthreads();  // the claims' hit flags
    }
  }

  // ---- phase 3: LRU scan (hits / evictables in old LRU order). A warp loads the LRU entries
  // and slot tokens of PREFETCH groups before using the first. A slot whose token was selected
  // claims the token's first entry (the claim bit of its hash value: one slot per entry even if
  // a state held a token twice) and gives it the slot's device row, which makes it a hit;
  // phase 2 writes only the kinds of other entries, so the two phases share an interval.
  // Token-table instance: a slot that phase 1 or 2b flagged is a hit; no slot tokens, no probe.
  {
    int nh = 0, ne = 0;
    scan_lru<TABLE>(slots, held, rlru, stok, sm.loc, sm.res, sm.order, sm.hkey, sm.hval, p0, p1,
                    c3, lane, kc, C, shift, mask, nh, ne);
    if (lane == 0) {
      sm.warp_hits[warp] = nh;
      sm.warp_evict[warp] = ne;
    }
  }
  sync_row(C);  // every claim made (phase 4 reads the outputs), per-warp counts published
  if (warp == 0) scan_warp_totals<NW>(sm.warp_hits, lane);
  if (warp == 1 % NW) scan_warp_totals<NW>(sm.warp_evict, lane);  // NW == 1: the same warp
  __syncthreads();
  // Token-table instance with every selected token found by the table (no token in the hash):
  // no misses, so the new order is [evictables][hits], written here straight to global memory
  // (every LRU entry was read before the barriers above), and the call ends.
  const bool all_found = TABLE && !any_cand;
  {
    int ho = sm.warp_hits[warp], eo = sm.warp_evict[warp];
    const int E0 = sm.warp_evict[NW];
    for (int g = p0; g < p0 + c3; g += 32) {
      const int p = g + lane;
      const bool valid = p < p1;
      const int v = valid ? sm.order[p] : 0;
      const bool hit = valid && (v >> 15);
      const bool ev = valid && !hit;
      const unsigned hm = __ballot_sync(FULL_MASK, hit);
      const unsigned em = __ballot_sync(FULL_MASK, ev);
      i16* hdst = all_found ? rlru + E0 : s_hit;
      i16* edst = all_found ? rlru : sm.evict;
      if (hit) hdst[ho + __popc(hm & below)] = static_cast<i16>(v & 0x7fff);
      if (ev) edst[eo + __popc(em & below)] = static_cast<i16>(v & 0x7fff);
      ho += __popc(hm);
      eo += __popc(em);
    }
  }
  if (all_found) {  // uniform; outputs and counts were final at phase 1's barrier
    for (int i = kb + tid; i < ke; i += BLOCK) o[i] = sm.res[i];
    if (tid == 0) {
      plan_count[b] = 0;
      write_status(st, sm.count[ST_RANGE], 0, 0);
      if (rank == 0) count_row(p.counters, K, 0, sm.count[ST_RANGE]);
    }
    HS_PHASE(5);
    return;
  }

  HS_PHASE(3);
  // ---- phase 4: misses in top-k order take the least recently used evictable slots. Pass 1
  // needs only phase 3's kinds, published by the barrier above; host rows came with phase 1.
  {
    const int nm = classify_misses(sm.kind, sm.host_row, sm.res, i0, i1, c4, lane, n_host_rows,
                                   cnt0);
    if (lane == 0) sm.warp_miss[warp] = nm;
  }
  __syncthreads();  // also publishes the hits and evictables
  if (warp == 0) scan_warp_totals<NW>(sm.warp_miss, lane);
  sync_row(C);  // every block's totals (warp_hits / warp_evict / warp_miss [NW]), evictables
  // The row's totals by block: sm.cluster_tot[3 q + 0 / 1 / 2] = hits / evictables / misses of
  // blocks before q (q = 0..C; q = C: the row's totals).
  if (warp == 0 && C > 1) {
    int t[3] = {0, 0, 0};
    if (lane < C) {
      t[0] = row_smem(sm.warp_hits, lane, C)[NW];
      t[1] = row_smem(sm.warp_evict, lane, C)[NW];
      t[2] = row_smem(sm.warp_miss, lane, C)[NW];
    }
#pragma unroll
    for (int f = 0; f < 3; ++f) {
      int x = t[f];
#pragma unroll
      for (int d = 1; d < RESOLVE_MAX_CLUSTER; d <<= 1) {
        const int y = __shfl_up_sync(FULL_MASK, x, d);
        if (lane >= d) x += y;
      }
      if (lane < C) sm.cluster_tot[3 * (lane + 1) + f] = x;
      if (lane == 0) sm.cluster_tot[f] = 0;
    }
  }
  if (C > 1) __syncthreads();
  // the row's evictables and misses; this block's first hit, evictable and miss in row order
  const int E = C > 1 ? sm.cluster_tot[3 * C + 1] : sm.warp_evict[NW];
  const int M = C > 1 ? sm.cluster_tot[3 * C + 2] : sm.warp_miss[NW];
  const int hb = C > 1 ? sm.cluster_tot[3 * rank] : 0;
  const int eb = C > 1 ? sm.cluster_tot[3 * rank + 1] : 0;
  const int mb = C > 1 ? sm.cluster_tot[3 * rank + 2] : 0;
  assign_victims<TABLE>(p, b, sm.kind, sm.tok, sm.host_row, sm.res, sm.evict, sm.cluster_tot,
                        sm.loc, sloc, stok, tsl, i0, i1, c4, lane, below,
                        mb + sm.warp_miss[warp], C);
  sync_row(C);  // misses' outputs and slot tokens visible to every block
  HS_PHASE(4);

  // ---- phase 5: duplicates take their first entry's output; write-back
  copy_duplicates<BLOCK>(sm.kind, sm.hpos, sm.hval, sm.res, kb, ke, kc, tid, C, cnt0);
  write_lru<BLOCK>(rlru, sm.evict, sm.warp_evict[NW], eb, s_hit, sm.warp_hits[NW], hb, E, M,
                   tid);
  __syncthreads();
  for (int i = kb + tid; i < ke; i += BLOCK) o[i] = sm.res[i];
  // every access to another block's shared memory done, rank 0's counters final (one block:
  // the barrier above did it)
  if (C > 1) cluster_sync();
  if (rank == 0 && tid == 0) {
    plan_count[b] = M;
    write_status(st, sm.count[ST_RANGE], sm.count[ST_NOHOST], 0);
    count_row(p.counters, K, M, sm.count[ST_RANGE] + sm.count[ST_NOHOST]);
  }
  HS_PHASE(5);
}

}  // namespace hs
