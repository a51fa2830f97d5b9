// hisparse_cupy: multi-step (MTP) swap-in: gather + commit, and the state initialiser.
// Both kernels take one MultiStepParams (cu/abi.cuh), which holds every pointer and size below;
// their helpers (constants, workspace rows, dedup table, copy blocks, selection): multistep.cuh.
//
// A call resolves the top-k of S draft steps ([B, S, K] tokens) of every batch row as one
// working set. The gather kernel resolves every occurrence (step, entry) and gives each unique
// miss one of the request's scratch device rows. The commit kernel runs after the whole gather
// grid (the kernel boundary is the grid-wide barrier; on sm_90+ it is launched with
// Programmatic Dependent Launch and waits with griddepcontrol.wait). Its first B blocks pick
// victims with a CLOCK-style policy over epoch-tagged references, admit misses by swapping the
// scratch row with the victim's row (no second copy) and record each admitted token in the
// token -> slot table. The misses' bytes are copied from the host into their scratch rows by
// the gather's warps (copy_blocks = 0) or, at small batch, by copy_blocks more blocks per row
// of the commit grid, beside the admission (which moves pointers only, so it need not wait for
// the bytes).
//
// Per-layer state (request slot r, see multistep.py):
//   slot_tokens[r, H + P], slot_locs[r, H + P]  token / device row of each slot; slots [0, H) are
//                                              the hot cache, [H, H + P) the extra page
//   scratch_locs[r, C]                         spare device rows (misses land there first)
//   token_slot[r, max_len]                     token -> hot slot (int16), the same table the
//                                              single-step resolve reads and writes. Invariant:
//                                              every hot token t (slot_tokens[s] = t, s < H)
//                                              has token_slot[t] = s; other entries are
//                                              anything (a lookup checks slot_tokens), so
//                                              nothing is ever erased.
//   ref[r, H]                                  epoch of each slot's last reference (0 = never)
//   clock[r] = (epoch, cursor)                 this call's epoch (never 0), ring cursor
// Per-batch-row workspace (shareable by layers that run one after another on one stream; each
// call leaves its row ready for the next: table EMPTY, meta META_INIT, counters 0 but C_COPY,
// which the next gather rewrites before anyone reads it):
//   table[b, TS]    open-addressing dedup table of the call's misses, entry (value << 32 | token):
//                   value = NONE while the claimer publishes, then the miss ordinal u; the commit
//                   turns it into the device row of the token
//   meta[b, TS]     smallest "reverse rank" (S - 1 - step) * K + entry over the token's
//                   occurrences: orders misses (latest step first, then entry), deterministically
//   compact[b, T]   table position of miss u
//   pending[b, T]   occurrences whose output is a placeholder (-2 - table position)
//   miss_src[b, T], miss_dst[b, T]  host row and scratch row of miss u < C (the copy's list)
//   counters[b, 8]  misses, entries out of range, host-less misses, placeholders written,
//                   gather blocks done, rows to copy (min(misses, C): set by the row's last
//                   gather block, read by the copy blocks). The commit clears the first four,
//                   the row's last gather block C_DONE.
//
// Semantics of an occurrence (b, s, i) with token t, seq = seq_lens[b, s]:
//   - padding row (b >= num_real), request slot outside [0, R), or a negative seq_len in any
//     step: every output -1, no state touched (status BADROW for the latter two);
//   - a resident request (every step), or seq <= H (the positional layout): the direct path
//     (abi.cuh, direct_entry): i >= seq (while seq <= H) or t == -1 -> -1; t out of range -> -1
//     and RANGE; a token without a row -> -1 and NOHOST; else its own row: the page table's, or
//     slot_locs[t] (slot t is marked referenced);
//   - otherwise (seq > H, not resident): t == -1 -> -1; t outside [0, seq) or beyond
//     host_locs' width -> -1, RANGE; t >= min_s(seq_s) - P (the row's shortest step) and held
//     by an extra-page slot j (first such j, slot_locs >= 0) -> that row, never read from the
//     host; held by a hot slot -> its row (slot marked referenced);
//     otherwise a miss: no valid host row -> -1, NOHOST (per occurrence); else every occurrence
//     of t gets the same row holding t's bytes, copied once per call.
//
// Commit policy (per request; E = hot slots not referenced this call, M = unique misses):
//   - victims: V = min(M, E) unreferenced slots, preferring empty slots, then never-referenced
//     ones, then the largest age (epoch - ref); ties by ring order from the cursor. The
//     victims, listed in ring order, are paired with the admitted misses in miss order. The
//     cursor moves past the last victim; the epoch advances.
//   - M <= E (the union of this call's hits and misses fits the hot buffer): every miss is
//     admitted, no slot referenced this call is evicted. Exact.
//   - M > E (partial admission): every unreferenced slot is replaced. Misses without a scratch
//     row (u >= C, copied straight into their victim) are admitted first, then scratch-resident
//     misses in miss order (latest step first) until the slots run out; the others are served
//     from scratch rows for this call only. Which misses lack a scratch row depends on the order
//     of claims, so partial admission is not deterministic when M > C.
//   - a row whose shortest step has seq <= H (positional layout, which later calls of the
//     request still read) admits nothing (E = 0): its misses, tokens >= H of its longer steps,
//     are served from scratch rows for this call.
//   Outputs are exact in every case: C >= S*K - H (checked in Python) guarantees a victim for
//   every miss without a scratch row, and C >= S - 1 a scratch row for each of the at most
//   S - 1 misses of a positional row whose steps are L, L + 1, ... (longer steps leave the
//   misses past C at -1 with status BADROW).
#include "multistep.cuh"

namespace hs {
namespace ms {

// =====================================================================================
// gather<ReqT, LenT>
//   grid (ceil(S*K / GATHER_BLOCK), B), one thread per occurrence (coalesced top-k reads).
//   Phases
//     0. padding / bad rows write -1 and leave.
//     1. classify the occurrence (see the semantics above): the extra page, then the token ->
//        slot table (entry checked against slot_tokens); hot hits mark ref = epoch.
//     2. misses: find-or-claim the token in the dedup table; record its reverse rank (atomicMin).
//        Claimers of a warp take consecutive miss ordinals u (one atomicAdd per warp) and
//        publish u. A claimer with u < C owns the copy into scratch_locs[u]; the others
//        (claimers with u >= C, duplicates whose claimer has not published a u < C yet) write
//        the placeholder -2 - position and list the occurrence in `pending` (one atomicAdd per
//        warp); the commit resolves the listed ones. An owner writes the plan entry u.
//     3. copy_blocks = 0: the warp copies its owners' rows, OWNED_ROWS in flight at a time
//        (copy_owned_rows_warp). Else an owner lists its copy (miss_src / miss_dst u) for the
//        commit grid's copy blocks.
//     4. per-block counts -> the row's counters (one atomicAdd each); with copy blocks, the
//        row's last block to finish (C_DONE) publishes the rows to copy, min(misses, C), in
//        C_COPY.
//   Shared memory: 4 static ints (block counts).
// =====================================================================================
template <typename ReqT, typename LenT>
__global__ void __launch_bounds__(GATHER_BLOCK) gather(const MultiStepParams p) {
  constexpr int BLOCK = GATHER_BLOCK;
  const int S = p.S, K = p.K, B = p.B, R = p.R, H = p.H, P = p.P, C = p.C;
  const int ts = p.table_size;
  const i64 n_host_rows = p.n_host_rows;
  const int host_stride = p.host_stride;
  const int row_bytes = p.row_bytes;
  const bool plan = p.plan_src != nullptr;
  __shared__ int s_cnt[4];  // C_RANGE, C_NOHOST (indices 0 and 3 unused)

  HS_PHASE_START
  // No early trigger (pdl_launch_dependents): measured, letting the commit blocks become
  // resident while the gather runs made the pair slower. The commit's launch still overlaps
  // the end of this grid, and it waits (griddepcontrol.wait) before reading anything.

  const int b = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int T = S * K;
  const int occ = blockIdx.x * BLOCK + tid;
  const bool active = occ < T;
  i32* orow = out_row(p, b);

  // First wave of loads, independent of each other: the occurrence's token, the row's request
  // slot and lengths. The second wave (table entry, host row) needs both, the third (the
  // entry's slot token and row) the entry.
  int tok = -1;
  int step = 0, pos = 0;
  if (active) {
    tok = topk_row(p, b)[occ];
    step = occ / K;
    pos = occ - step * K;
  }
  const int nr = clamp_real(p.num_real, B);
  i64 rid = -1, shortest = 0;
  bool skip = b >= nr;
  if (!skip) {
    rid = request_of<ReqT>(p, b);
    skip = row_is_bad<LenT>(p, rid, b, shortest);
  }
  if (skip) {  // uniform over the block
    if (active) orow[occ] = -1;
    if (blockIdx.x == 0 && tid == 0) counters_row(p, b)[C_COPY] = 0;
    return;
  }

  if (tid < 4) s_cnt[tid] = 0;
  __syncthreads();
  HS_PHASE(0);

  const i32* stok = slot_tokens_row(p, rid);
  const i32* sloc = slot_locs_row(p, rid);
  const i32* scr = scratch_row(p, rid);
  const i64* hloc = host_locs_row(p, rid);
  const i16* tsl = token_slot_row(p, rid);
  u32* ref = ref_row(p, rid);
  const u32 epoch = clock_row(p, rid)[0];
  ull* tbl = table_row(p, b);
  i32* mt = meta_row(p, b);
  i32* cmp = compact_row(p, b);
  i32* cnt = counters_row(p, b);
  i64* psrc = plan_src_row(p, b);  // (written only with a plan)
  i32* pdst = plan_dst_row(p, b);

  // ---- phase 1: classify
  int o = -1;
  bool miss = false;
  i64 hl = -1;
  const bool resident = p.resident != nullptr && p.resident[rid];  // uniform over the block
  if (active && tok != -1) {
    const i64 seq = step_len<LenT>(p, b, step);
    if (resident || seq <= H) {  // the direct path (abi.cuh): every token has a row of its own
      const DirectRows d = direct_rows(p, rid, seq, H);
      const int r = resident ? direct_entry<true>(d, tok, pos) : direct_entry<false>(d, tok, pos);
      if (r >= 0) {
        o = r;
        if (!resident) ref[tok] = epoch;  // the positional layout: slot tok is referenced
      } else if (r == DIRECT_RANGE) {
        atomicAdd(&s_cnt[C_RANGE], 1);
      } else if (r == DIRECT_NOROW) {
        atomicAdd(&s_cnt[C_NOHOST], 1);
      }
    } else if (tok < 0 || tok >= seq || tok >= host_stride) {
      atomicAdd(&s_cnt[C_RANGE], 1);
    } else {
      // the table entry and the host row are loaded before the extra page is looked at (a hit
      // does not need the host row; a miss does not wait a round trip more for it)
      const int e = tsl[tok];
      const i64 hl_spec = hloc[tok];
      bool found = false;
      // newest / draft tokens live in the extra page; the row's shortest length decides, so
      // every occurrence of a token in the row is looked up alike (one row per token)
      if (tok >= shortest - P) {
        constexpr int G = 8;  // extra-page slots whose tokens are loaded together
        for (int j0 = 0; j0 < P && !found; j0 += G) {
          int t[G];
#pragma unroll
          for (int q = 0; q < G; ++q) t[q] = j0 + q < P ? stok[H + j0 + q] : -1;
#pragma unroll
          for (int q = 0; q < G; ++q) {
            if (!found && t[q] == tok) {
              const int l = sloc[H + j0 + q];
              if (l >= 0) {
                o = l;
                found = true;
              }
            }
          }
        }
      }
      if (!found && table_slot(e, tok, H, stok, sloc, o) >= 0) {
        ref[e] = epoch;
        found = true;
      }
      if (!found) {
        hl = hl_spec;
        if (hl >= 0 && hl < n_host_rows) {
          miss = true;
        } else {
          atomicAdd(&s_cnt[C_NOHOST], 1);
        }
      }
    }
  }

  HS_PHASE(1);
  // ---- phase 2: dedup of misses over all steps
  int h = -1;
  bool claimed = false;
  u32 val = NONE;
  if (miss) {
    h = table_claim(tbl, ts, tok, claimed, val);
    if (h >= 0) atomicMin(mt + h, (S - 1 - step) * K + pos);
    else miss = false;  // unreachable: the table has room for every token
  }
  const unsigned cm = __ballot_sync(FULL_MASK, claimed);
  int u = -1;
  if (cm) {
    const int leader = __ffs(cm) - 1;
    int base = 0;
    if (lane == leader) base = atomicAdd(cnt + C_MISS, __popc(cm));
    base = __shfl_sync(FULL_MASK, base, leader);
    if (claimed) u = base + __popc(cm & ((1u << lane) - 1u));
  }
  bool owner = false;
  if (claimed) {
    cmp[u] = h;
    atomicExch(tbl + h, pack(static_cast<u32>(u), tok));
    if (u < C) {
      o = scr[u];
      owner = true;
    }
  } else if (miss && val != NONE && val < static_cast<u32>(C)) {
    o = scr[val];
  }
  const bool pend = miss && o == -1;
  if (pend) o = -2 - h;
  const unsigned pm = __ballot_sync(FULL_MASK, pend);
  if (pm) {  // list the placeholders: (table position << 16 | occurrence), both < 2^15
    const int leader = __ffs(pm) - 1;
    int base = 0;
    if (lane == leader) base = atomicAdd(cnt + C_PENDING, __popc(pm));
    base = __shfl_sync(FULL_MASK, base, leader);
    if (pend) pending_row(p, b)[base + __popc(pm & ((1u << lane) - 1u))] = (h << 16) | occ;
  }
  if (active) orow[occ] = o;
  if (owner && plan) {
    psrc[u] = hl;
    pdst[u] = o;
  }

  HS_PHASE(2);
  // ---- phase 3: the copy, or its list
  const bool listed = p.copy_blocks > 0;  // uniform
  if (!listed) {
    copy_owned_rows_warp(owner, hl, o, p.dev_base, p.host_base, row_bytes, lane);
  } else if (owner) {
    miss_src_row(p, b)[u] = hl;
    miss_dst_row(p, b)[u] = o;
  }
  HS_PHASE(3);

  // ---- phase 4: counts; with copy blocks, the row's last block publishes the rows to copy
  if (listed) __threadfence();  // this block's claims (C_MISS) land before its arrival below
  __syncthreads();
  if (tid >= C_RANGE && tid <= C_NOHOST && s_cnt[tid]) atomicAdd(cnt + tid, s_cnt[tid]);
  if (listed && tid == 0 && atomicAdd(cnt + C_DONE, 1) == static_cast<int>(gridDim.x) - 1) {
    __threadfence();
    const int m = atomicAdd(cnt + C_MISS, 0);  // every block's claims are in
    cnt[C_COPY] = m < C ? m : C;
    cnt[C_DONE] = 0;
  }
  HS_PHASE(4);
}

// =====================================================================================
// commit<ReqT, LenT>
//   grid B (1 + copy_blocks): block b < B commits batch row b; the others are copy blocks
//   (copy_misses). Launched with PDL after the gather.
//   Phases
//     0. griddepcontrol.wait; padding / bad rows: status, plan count, stats; leave.
//     1. eviction keys of the H slots in ring order from the cursor (s_key); E = evictable;
//        bitmap of the misses' reverse ranks.
//     2. V = min(M, E) victims: radix select of the V-th largest key (warp-aggregated 256-bin
//        histograms), then one packed block scan over per-thread runs of ring positions (keys
//        above the threshold, and the first ties) -> s_vic[0..V) in ring order.
//     3. miss order: rank of each miss among the admitted ones via bitmap popcount prefixes
//        (partial admission first picks the admitted set, see the file header).
//     4. per miss u: its device row (scratch_locs[u] before rotation, or its victim's row when
//        u >= C) is written into its table entry; admitted misses take their victim: slot
//        token, ref, rotation of slot_locs[v] <-> scratch_locs[u] (u < C) or a direct copy
//        into the victim's row (u >= C, one warp per row), token_slot[token] = victim.
//     5. the listed placeholders (pending) -> the row in their table entry.
//     6. table entries and meta cleared.
//     7. status, plan count, stats, clock (epoch + 1, never 0: on wrap every ref is cleared;
//        cursor past the last victim), counters cleared.
//   Shared memory: _abi.SMEM["MULTISTEP_COMMIT"] (named regions; NW = ceil(S*K / 32)).
// =====================================================================================
template <typename ReqT, typename LenT>
__global__ void __launch_bounds__(COMMIT_BLOCK) commit(const MultiStepParams p) {
  constexpr int BLOCK = COMMIT_BLOCK;
  const int S = p.S, K = p.K, B = p.B, H = p.H, C = p.C;
  const int row_bytes = p.row_bytes;
  const bool plan = p.plan_src != nullptr;
  i32* __restrict__ plan_count = p.plan_count;
  // Wait for the gather grid: its outputs, table, counters and copy list.
  pdl_wait();
  if (static_cast<int>(blockIdx.x) >= p.B) {
    copy_misses(p);
    return;
  }
  HS_PHASE_START

  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int T = S * K;
  const int NW = (T + 31) >> 5;

  constexpr int NS = BLOCK / 32 + 1;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  HS_SMEM_CARVE(MULTISTEP_COMMIT, sm, smem_raw);

  i32* st = status_row(p, b);
  i32* xs = stats_row(p, b);
  const int nr = clamp_real(p.num_real, B);
  i64 rid = -1, shortest = 0;
  const bool pad = b >= nr;
  bool bad = false;
  if (!pad) {
    rid = request_of<ReqT>(p, b);
    bad = row_is_bad<LenT>(p, rid, b, shortest);
  }
  if (pad || bad) {
    if (tid == 0) {
      write_status(st, 0, 0, bad ? 1 : 0);
      if (plan_count) plan_count[b] = 0;
      for (int i = 0; i < MS_N_STATS; ++i) xs[i] = 0;
    }
    return;
  }

  i32* stok = slot_tokens_row(p, rid);
  i32* sloc = slot_locs_row(p, rid);
  i32* scr = scratch_row(p, rid);
  const i64* hloc = host_locs_row(p, rid);
  i16* tsl = token_slot_row(p, rid);
  u32* ref = ref_row(p, rid);
  u32* clock = clock_row(p, rid);  // (epoch, cursor)
  ull* tbl = table_row(p, b);
  i32* mt = meta_row(p, b);
  const i32* cmp = compact_row(p, b);
  i32* cnt = counters_row(p, b);
  i32* orow = out_row(p, b);

  const int M = cnt[C_MISS];
  const int n_range = cnt[C_RANGE];
  const int n_nohost = cnt[C_NOHOST];
  const int n_pending = cnt[C_PENDING];
  if (p.resident != nullptr && p.resident[rid]) {  // the gather wrote every output: no miss,
    if (tid == 0) {                                // no admission, the state untouched
      write_status(st, n_range, n_nohost, 0);
      count_row(p.layer_counters, S * K, 0, n_range + n_nohost);
      if (plan_count) plan_count[b] = 0;
      for (int i = 0; i < MS_N_STATS; ++i) xs[i] = 0;
      for (int i = 0; i < C_DONE; ++i) cnt[i] = 0;
    }
    return;
  }
  const u32 epoch = clock[0];
  const int cursor = static_cast<int>(clock[1] % static_cast<u32>(H));

  if (tid == 0) {
    *sm.last_victim = -1;
    *sm.no_room = 0;
  }

  // ---- phase 1: keys in ring order; miss bitmap
  // A row whose shortest step is in positional layout (seq <= H) admits nothing: later calls
  // of the request read token t from slot t (and the newest token's KV is written there), so
  // its slots and their rows must stay put; its misses (tokens >= H of its longer steps) are
  // served from scratch rows for this call.
  const bool positional = shortest <= H;
  int ev = 0;
  u32 kor = 0u, kand = ~0u;  // OR / AND of the non-zero keys (radix_select's first digit)
  constexpr int UNR = 8;  // loads of UNR ring positions in flight per thread (H 4096: one round)
  for (int base = tid; base < H; base += BLOCK * UNR) {
    u32 r[UNR];
    int t[UNR];
#pragma unroll
    for (int q = 0; q < UNR; ++q) {
      const int j = base + q * BLOCK;
      int slot = cursor + j;
      if (slot >= H) slot -= H;
      r[q] = j < H ? ref[slot] : 0u;
      t[q] = j < H ? stok[slot] : -1;
    }
#pragma unroll
    for (int q = 0; q < UNR; ++q) {
      const int j = base + q * BLOCK;
      if (j >= H) break;
      u32 key;
      if (positional || r[q] == epoch) key = 0;
      else if (t[q] < 0) key = KEY_EMPTY;
      else if (r[q] == 0) key = KEY_NEVER;
      else {
        const u32 age = epoch - r[q];
        key = age > KEY_AGE_MAX ? KEY_AGE_MAX : age;
      }
      sm.key[j] = key;
      ev += key != 0;
      if (key != 0) {
        kor |= key;
        kand &= key;
      }
    }
  }
  kor = __reduce_or_sync(FULL_MASK, kor);
  kand = __reduce_and_sync(FULL_MASK, kand);
  constexpr int n_warps = BLOCK / 32;
  static_assert(2 * n_warps <= 256, "the key OR / AND per warp go in sm.hist");
  if (lane == 0) {  // published by the barriers of the block scan below
    sm.hist[tid >> 5] = static_cast<int>(kor);
    sm.hist[n_warps + (tid >> 5)] = static_cast<int>(kand);
  }
  for (int w = tid; w < NW; w += BLOCK) {
    sm.bits[w] = 0;
    sm.admit[w] = 0;
  }
  int E;
  block_exclusive_sum<BLOCK>(ev, sm.scan, E);  // (barriers inside)
#pragma unroll
  for (int w = 0; w < n_warps; ++w) {
    kor |= static_cast<u32>(sm.hist[w]);
    kand &= static_cast<u32>(sm.hist[n_warps + w]);
  }
  __syncthreads();  // sm.hist is cleared by radix_select
  HS_PHASE(16);

  const int V = M < E ? M : E;
  const bool partial = M > E;
  for (int u = tid; u < M; u += BLOCK) {
    if (!partial || u < C) {
      const int r = mt[cmp[u]];
      atomicOr(&sm.bits[r >> 5], 1u << (r & 31));
    }
  }

  HS_PHASE(17);
  // ---- phase 2: victims
  u32 theta;
  int need = 0;
  if (V == 0) {
    theta = KEY_EMPTY;  // nothing above it, and no tie is taken
  } else if (V == E) {
    theta = 0;  // every evictable slot
  } else {
    need = V;
    theta = radix_select<BLOCK>(sm.key, H, need, kor, kand, sm.hist, sm.radix_digit,
                                sm.radix_rest);
  }
  HS_PHASE(18);
  {
    // Each thread owns a contiguous run of ring positions; one block scan of the packed
    // (above, tie) counts gives every run its first ordinal (counts <= H < 2^15 per half).
    const int per = (H + BLOCK - 1) / BLOCK;
    const int j0 = tid * per < H ? tid * per : H;
    const int j1 = j0 + per < H ? j0 + per : H;
    int na = 0, nt = 0;
    for (int j = j0; j < j1; ++j) {
      const u32 k = sm.key[j];
      na += k != 0 && k > theta;
      nt += k != 0 && k == theta;
    }
    int tot;
    const int ex = block_exclusive_sum<BLOCK>(na | (nt << 16), sm.scan, tot);
    int ta = ex & 0xffff, tt = ex >> 16, last = -1;
    for (int j = j0; j < j1; ++j) {
      const u32 k = sm.key[j];
      const int ab = k != 0 && k > theta;
      const int ti = k != 0 && k == theta;
      if (ab || (ti && tt < need)) {
        int slot = cursor + j;
        if (slot >= H) slot -= H;
        sm.victim[ta + (tt < need ? tt : need)] = static_cast<i16>(slot);
        last = j;
      }
      ta += ab;
      tt += ti;
    }
    if (last >= 0) atomicMax(sm.last_victim, last);
  }

  HS_PHASE(19);
  // ---- phase 3: ranks of the admitted misses
  bitmap_prefix<BLOCK>(sm.bits, sm.prefix, NW, sm.scan);
  if (partial) {
    const int n_over = M > C ? M - C : 0;
    const int budget = V > n_over ? V - n_over : 0;
    for (int u = tid; u < M; u += BLOCK) {
      const bool adm = u >= C || bitmap_rank(sm.bits, sm.prefix, mt[cmp[u]]) < budget;
      if (adm) atomicOr(&sm.admit[u >> 5], 1u << (u & 31));
    }
    __syncthreads();
    for (int w = tid; w < NW; w += BLOCK) sm.bits[w] = 0;
    __syncthreads();
    for (int u = tid; u < M; u += BLOCK) {
      if ((sm.admit[u >> 5] >> (u & 31)) & 1u) {
        const int r = mt[cmp[u]];
        atomicOr(&sm.bits[r >> 5], 1u << (r & 31));
      }
    }
    __syncthreads();
    bitmap_prefix<BLOCK>(sm.bits, sm.prefix, NW, sm.scan);
  }

  HS_PHASE(20);
  // ---- phase 4: rows, admissions, direct copies
  for (int base = 0; base < M; base += BLOCK) {
    const int u = base + tid;
    bool owner = false;
    i64 src = -1;
    int dst = -1;
    if (u < M) {
      const int q = cmp[u];
      const int tok = lo32(tbl[q]);
      const bool adm = !partial || ((sm.admit[u >> 5] >> (u & 31)) & 1u);
      int v = -1;
      if (adm) {
        const int a = bitmap_rank(sm.bits, sm.prefix, mt[q]);
        if (a < V) v = sm.victim[a];
      }
      int loc = -1;
      if (u < C) loc = scr[u];
      else if (v >= 0) loc = sloc[v];
      tbl[q] = pack(static_cast<u32>(loc), tok);
      if (v >= 0) {
        const int old_loc = sloc[v];
        stok[v] = tok;
        ref[v] = epoch;
        tsl[tok] = static_cast<i16>(v);
        if (u < C) {
          sloc[v] = loc;
          scr[u] = old_loc;
        } else {
          owner = true;
          src = hloc[tok];
          dst = old_loc;
        }
      } else if (u >= C) {
        atomicExch(sm.no_room, 1);  // unreachable while C >= S*K - H
      }
      if (u >= C && plan) {
        plan_src_row(p, b)[u] = owner ? src : -1;
        plan_dst_row(p, b)[u] = owner ? dst : -1;
      }
    }
    copy_owned_rows_warp(owner, src, dst, p.dev_base, p.host_base, row_bytes, lane);
  }
  __syncthreads();

  HS_PHASE(21);
  // ---- phase 5: placeholders
  const i32* pnd = pending_row(p, b);
  for (int i = tid; i < n_pending; i += BLOCK) {
    const int e = pnd[i];
    orow[e & 0xffff] = static_cast<int>(hi32(tbl[e >> 16]));
  }
  __syncthreads();

  HS_PHASE(22);
  // ---- phase 6: workspace cleanup
  for (int u = tid; u < M; u += BLOCK) {
    const int q = cmp[u];
    tbl[q] = EMPTY;
    mt[q] = MS_META_INIT;
  }
  if (epoch == 0xffffffffu) {  // the epoch wraps: forget every reference (once in 2^32 calls)
    __syncthreads();
    for (int j = tid; j < H; j += BLOCK) ref[j] = 0;
  }
  __syncthreads();

  // ---- phase 7: per-row results and state
  if (tid == 0) {
    write_status(st, n_range, n_nohost, *sm.no_room);
    count_row(p.layer_counters, S * K, M, n_range + n_nohost);
    if (plan_count) plan_count[b] = M;
    xs[X_MISS] = M;
    xs[X_ADMIT] = V;
    xs[X_EVICTABLE] = E;
    xs[X_PARTIAL] = partial ? 1 : 0;
    const u32 next = epoch + 1u == 0u ? 1u : epoch + 1u;
    clock[0] = next;
    const int last = *sm.last_victim;
    clock[1] = static_cast<u32>(last >= 0 ? (cursor + last + 1) % H : cursor);
    for (int i = 0; i < C_DONE; ++i) cnt[i] = 0;  // C_DONE is reset by the gather, C_COPY read
                                                 // by the copy blocks
  }
  HS_PHASE(23);
}

// =====================================================================================
// init: (re)initialise the listed request slots of every layer from their slot tables.
//   grid (B, L): block (b, l) handles request slot rows[b] of layer l (rows outside [0, R) and
//   rows b >= *num_real are skipped). Clears the ref epochs, sets clock = (1, 0) and records
//   every hot slot's token (0 <= token < the table's width) in the token -> slot table.
// =====================================================================================
__global__ void __launch_bounds__(INIT_BLOCK) init(const MultiStepInitParams p) {
  constexpr int BLOCK = INIT_BLOCK;
  const int tid = threadIdx.x;
  const int b = blockIdx.x;
  const i64 layer = blockIdx.y;
  if (b >= clamp_real(p.num_real, p.B)) return;
  const i64 rid = p.rows[b];
  if (rid < 0 || rid >= p.R) return;
  const int H = p.H, width = p.table_stride;
  const i32* stok = slot_tokens_row(p, layer, rid);
  i16* tsl = token_slot_row(p, layer, rid);
  u32* ref = ref_row(p, layer, rid);
  u32* clock = clock_row(p, layer, rid);
  for (int s = tid; s < H; s += BLOCK) {
    const int tok = stok[s];
    if (tok >= 0 && tok < width) tsl[tok] = static_cast<i16>(s);
    ref[s] = 0;
  }
  if (tid == 0) {
    clock[0] = 1u;
    clock[1] = 0u;
  }
}

}  // namespace ms
}  // namespace hs
