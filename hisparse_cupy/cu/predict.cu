// hisparse_cupy: prediction stager for the IndexCache overlap's prediction mode.
//
// predict_stage<ReqT, LenT>(PredictStageParams): blocks of PREDICT_BLOCK threads, each taking
// batch rows blockIdx.x, blockIdx.x + gridDim.x, ... one after another (the Prefetcher gives it
// the replay's grid, so it holds no more SMs than the replays do). While full layer F
// computes, the Prefetcher guesses which rows the next full layer F' will miss: the tokens
// that just entered F's selection (F's swap missed on them: neighbouring layers select largely
// the same tokens, so what is new to F is likely new to F') and that F' would miss on if it
// selected them now, i.e. that F''s token -> slot table does not place in one of its LRU slots
// (the same check its swap makes: an entry counts only while its slot holds the token). With
// p.rule == PREDICT_RULE_SELECTION every token of F's top-k that F' does not hold is staged:
// also the ones F hit on that F' misses (an exact-LRU model of the published-shape streams put
// their recall at 0.61-0.80 against 0.21-0.42, at nearly the same precision, for 1.6-2x the
// rows), and the ones F selects and F' never does, staged again every step for nothing.
// Their host rows of F' are then copied (planned_copy, side stream) into staging rows, and
// F''s own swap reads a miss from its staging row when the token was staged (PlannedCopyParams'
// stage_* fields) instead of from the host. A wrong guess costs bandwidth, never a byte: the
// swap's resolve decides the misses as always, and a staged row holds exactly the host row it
// was copied from (the staged row is only used when stage_src says so).
//
//   Phases (LRU path, seq_len > H), with __syncthreads() between them:
//     0. clear the miss hash and the counter;
//     1. insert F's misses (host rows of its plan; unique per row) into the miss hash (the
//        selection rule: nothing);
//     2. every valid top-k token (0 <= tok < seq_len, not the newest, host row in
//        [0, n_host_rows)) whose host row is one of F's misses claims that miss-hash entry
//        (atomicExch: a token repeated in the top-k is staged once; the selection rule: every
//        valid token inserts its host row, the thread that inserts it first claims it); the
//        claimant looks the token up in F''s table, and a token F' does not hold gets the next
//        staged index (< stage_width), writing stage_src and stage_map;
//     3. stage_count[b] (and the stats).
//
//   Shared memory: _abi.SMEM["PREDICT_STAGE"].
#include "abi.cuh"

namespace hs {

template <typename ReqT, typename LenT, typename Smem>
__device__ __forceinline__ void stage_row(const PredictStageParams& p, const Smem& sm, int b,
                                          int nr) {
  const int MS = p.miss_hash_size, K = p.K, H = p.H;
  const i64 rid = b < nr ? request_of<ReqT>(p, b) : -1;
  const i64 len = b < nr ? length_of<LenT>(p, b) : 0;
  if (rid < 0 || rid >= p.R || len <= H ||  // padding, bad slot, positional, resident:
      (p.resident != nullptr && p.resident[rid])) {  // nothing to stage
    if (threadIdx.x == 0) p.stage_count[b] = 0;
    return;  // (uniform over the block)
  }
  for (int i = threadIdx.x; i < MS; i += PREDICT_BLOCK) {
    sm.mkey[i] = PREDICT_KEY_EMPTY;
    sm.mclaim[i] = 0;
  }
  if (threadIdx.x == 0) sm.count[0] = 0;
  __syncthreads();

  const int mshift = 32 - (__ffs(MS) - 1);  // MS is a power of two >= 64
  const int mmask = MS - 1;
  const bool selection = p.rule == PREDICT_RULE_SELECTION;
  int nm = selection ? 0 : p.plan_count[b];  // (<= K single-step; clamped to the hash's half)
  const int nm_max = p.plan_stride < (MS >> 1) ? p.plan_stride : (MS >> 1);
  nm = nm < 0 ? 0 : (nm > nm_max ? nm_max : nm);
  const i64* miss = plan_src_row(p, b);
  constexpr u64 empty_key = static_cast<u64>(PREDICT_KEY_EMPTY);
  for (int i = threadIdx.x; i < nm; i += PREDICT_BLOCK) {
    const i64 hl = miss[i];
    if (hl < 0) continue;
    u32 h = hash_u32(static_cast<u32>(hl)) >> mshift;
    while (true) {
      const unsigned long long old = atomicCAS(
          reinterpret_cast<unsigned long long*>(&sm.mkey[h]), empty_key, static_cast<u64>(hl));
      if (old == empty_key || old == static_cast<u64>(hl)) break;
      h = (h + 1) & mmask;
    }
  }
  __syncthreads();

  const i32* topk = topk_row(p, b);
  const i64* hloc = host_locs_row(p, rid);
  const i16* tsl = token_slot_row(p, rid);
  const i32* stok = slot_tokens_row(p, rid);
  const i64 lim = len < p.host_stride ? len : p.host_stride;
  const i64 base = static_cast<i64>(b) * p.stage_width;
  for (int i = threadIdx.x; i < K; i += PREDICT_BLOCK) {
    const int tok = topk[i];
    if (tok < 0 || tok >= lim || tok == len - 1) continue;
    const i64 hl = hloc[tok];
    if (hl < 0 || hl >= p.n_host_rows) continue;
    if (selection) {  // the first to insert this host row claims it (K keys, half the hash)
      bool first = false;
      for (u32 h = hash_u32(static_cast<u32>(hl)) >> mshift;; h = (h + 1) & mmask) {
        const unsigned long long old = atomicCAS(
            reinterpret_cast<unsigned long long*>(&sm.mkey[h]), empty_key, static_cast<u64>(hl));
        if (old == empty_key || old == static_cast<u64>(hl)) {
          first = old == empty_key;
          break;
        }
      }
      if (!first) continue;  // a repeat of a token in the top-k
    } else {
      int m = -1;  // F's miss-hash entry of this host row
      for (u32 h = hash_u32(static_cast<u32>(hl)) >> mshift;; h = (h + 1) & mmask) {
        const i64 k = sm.mkey[h];
        if (k == PREDICT_KEY_EMPTY) break;
        if (k == hl) {
          m = static_cast<int>(h);
          break;
        }
      }
      if (m < 0 || atomicExch(&sm.mclaim[m], 1)) continue;  // not new to F, or claimed already
    }
    if (table_holds(tsl[tok], tok, H, stok)) continue;    // F' holds it: no miss there
    const int j = atomicAdd(&sm.count[0], 1);
    if (j < p.stage_width) {
      p.stage_src[base + j] = hl;
      p.stage_map[hl] = static_cast<i32>(base + j);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int n = sm.count[0] < p.stage_width ? sm.count[0] : p.stage_width;
    p.stage_count[b] = n;
    if (p.stage_stats) atomicAdd(p.stage_stats + 2, static_cast<u64>(n));
  }
}

template <typename ReqT, typename LenT>
__global__ void __launch_bounds__(PREDICT_BLOCK) predict_stage(const PredictStageParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int MS = p.miss_hash_size;
  HS_SMEM_CARVE(PREDICT_STAGE, sm, smem_raw);
  const int nr = clamp_real(p.num_real, p.B);
  for (int b = blockIdx.x; b < p.B; b += gridDim.x) {
    stage_row<ReqT, LenT>(p, sm, b, nr);
    __syncthreads();  // the next row clears the tables this one read
  }
}

}  // namespace hs
