// hisparse_cupy: the kernel ABI. One parameter struct per kernel family, taken by value.
//
// hisparse_cupy/_abi.py mirrors every struct as a NumPy structured dtype and defines, for each
// compile, HS_ABI_<Struct>_SIZE and HS_ABI_<Struct>_FIELDS (name, size and kind of every field, in
// order): the checks below (HS_ABI_CHECK, abi_check.cuh) fail the compile (CPU CI runs it) if
// the two sides disagree. The constants and the shared-memory layouts (X-macros
// HS_SMEM_<KERNEL>) come from the same module.
//
// Shapes use B (batch rows), K (entries per step), S (steps), R (request slots), H (hot slots),
// P (extra-page slots), W = H + P, C (scratch rows), L (layers), D (device rows of a layer).
// A stride is in elements of the array it belongs to.
#pragma once

#include "abi_check.cuh"
#include "common.cuh"

#if !defined(HS_ST_RANGE) || !defined(HS_N_STATUS) || !defined(HS_MAX_HOT) ||               \
    !defined(HS_RESOLVE_BLOCK) || !defined(HS_RESOLVE_VAL_EMPTY) || !defined(HS_COPY_WARPS) ||  \
    !defined(HS_COMMIT_BLOCK) || !defined(HS_GATHER_BLOCK) || !defined(HS_INIT_BLOCK) ||        \
    !defined(HS_PREDICT_BLOCK) || !defined(HS_RESOLVE_MAX_CLUSTER) ||                           \
    !defined(HS_RESOLVE_CLUSTER_BLOCK) || !defined(HS_MS_C_COPY) || !defined(HS_MS_KEY_EMPTY)
#error "compile with the -D macros of hisparse_cupy._abi.defines()"
#endif

namespace hs {

// ---- constants (values from _abi.py)
constexpr int LC_ROWS = HS_LC_ROWS;
constexpr int LC_SELECTED = HS_LC_SELECTED;
constexpr int LC_MISSES = HS_LC_MISSES;
constexpr int LC_FLAGGED = HS_LC_FLAGGED;
constexpr int ST_RANGE = HS_ST_RANGE;
constexpr int ST_NOHOST = HS_ST_NOHOST;
constexpr int ST_BADROW = HS_ST_BADROW;
constexpr int BADROW_NOT_RESIDENT = HS_BADROW_NOT_RESIDENT;
constexpr int N_STATUS = HS_N_STATUS;
constexpr int MAX_HOT = HS_MAX_HOT;
constexpr int RESOLVE_BLOCK = HS_RESOLVE_BLOCK;
constexpr int RESOLVE_CLUSTER_BLOCK = HS_RESOLVE_CLUSTER_BLOCK;
constexpr int RESOLVE_MAX_CLUSTER = HS_RESOLVE_MAX_CLUSTER;
constexpr int COPY_WARPS = HS_COPY_WARPS;
constexpr int NEWEST_BLOCK = HS_NEWEST_BLOCK;
constexpr int NEWEST_LAYERS = HS_NEWEST_LAYERS;
// the resolve's shared hash: bucket values and the empty key
constexpr int RESOLVE_VAL_ENTRY = HS_RESOLVE_VAL_ENTRY;
constexpr int RESOLVE_VAL_CLAIMED = HS_RESOLVE_VAL_CLAIMED;
constexpr int RESOLVE_VAL_EMPTY = HS_RESOLVE_VAL_EMPTY;
constexpr int RESOLVE_KEY_EMPTY = HS_RESOLVE_KEY_EMPTY;
constexpr i64 PREDICT_KEY_EMPTY = HS_PREDICT_KEY_EMPTY;  // the stager's miss hash
constexpr int PREDICT_RULE_SELECTION = HS_PREDICT_RULE_SELECTION;  // PredictStageParams::rule
// multi-step: limits, dedup-table sentinels, workspace counters, statistics, eviction keys
constexpr int MS_MAX_TOKENS = HS_MS_MAX_TOKENS;
constexpr int MS_MAX_STEPS = HS_MS_MAX_STEPS;
constexpr int MS_META_INIT = HS_MS_META_INIT;
constexpr u64 MS_EMPTY = HS_MS_EMPTY;
constexpr u32 MS_NONE = HS_MS_NONE;
constexpr int MS_C_MISS = HS_MS_C_MISS;
constexpr int MS_C_RANGE = HS_MS_C_RANGE;
constexpr int MS_C_NOHOST = HS_MS_C_NOHOST;
constexpr int MS_C_PENDING = HS_MS_C_PENDING;
constexpr int MS_C_DONE = HS_MS_C_DONE;
constexpr int MS_C_COPY = HS_MS_C_COPY;
constexpr int MS_N_COUNTERS = HS_MS_N_COUNTERS;
constexpr int MS_X_MISS = HS_MS_X_MISS;
constexpr int MS_X_ADMIT = HS_MS_X_ADMIT;
constexpr int MS_X_EVICTABLE = HS_MS_X_EVICTABLE;
constexpr int MS_X_PARTIAL = HS_MS_X_PARTIAL;
constexpr int MS_N_STATS = HS_MS_N_STATS;
constexpr u32 MS_KEY_EMPTY = HS_MS_KEY_EMPTY;
constexpr u32 MS_KEY_NEVER = HS_MS_KEY_NEVER;
constexpr u32 MS_KEY_AGE_MAX = HS_MS_KEY_AGE_MAX;
constexpr int GATHER_BLOCK = HS_GATHER_BLOCK;
constexpr int COMMIT_BLOCK = HS_COMMIT_BLOCK;
constexpr int INIT_BLOCK = HS_INIT_BLOCK;
constexpr int PREDICT_BLOCK = HS_PREDICT_BLOCK;

// ---- single-step resolve (swap.cu). Grid: (B x C), cluster (C): C blocks per batch row (C = 1:
// RESOLVE_BLOCK threads; 1 < C <= RESOLVE_MAX_CLUSTER, sm_90+: RESOLVE_CLUSTER_BLOCK threads).
struct SwapResolveParams {
  const i32* topk;         // [B, K], row stride topk_stride: token positions, -1 = unused
  const void* req;         // [B] ReqT (int32/int64): batch row -> request slot
  const void* lens;        // [B] LenT, element b at b * lens_stride: length incl. the newest
  const i32* num_real;     // device scalar or null: rows >= *num_real are graph padding
  const i64* host_locs;    // [R, host_stride]: token -> host row, -1 = none
  i32* slot_tokens;        // [R, W], row stride slot_stride: token held by each slot
  const i32* slot_locs;    // [R, W], row stride slot_stride: device row of each slot
  i16* lru;                // [R, H], row stride lru_stride: recency order, 0 = least recent
  i32* out;                // [B, K], row stride out_stride: device row of each entry
  i64* plan_src;           // [>= B, plan_stride]: host row of miss m
  i32* plan_dst;           // [>= B, plan_stride]: device row it goes to
  i32* plan_count;         // [>= B]: misses of each row
  i32* status;             // [B, N_STATUS]
  i16* token_slot;         // [R, host_stride] token -> hot slot (swap_resolve<.., true>), or null
  u64* counters;           // [N_LAYER_COUNTERS] the layer's counters (count_row), or null
  const u8* resident;      // [R] nonzero: the request is resident (its rows through
                           // page_table; docs/design.md section 10), or null: none is
  const i32* page_table;   // [R, page_stride]: device page of each page_tokens tokens, -1 none
  i64 n_host_rows;         // host rows of the layer: rows outside [0, n_host_rows) are missing
  i32 topk_stride, K, B, R, host_stride, slot_stride, lru_stride, H;
  i32 hash_size;           // shared hash slots (power of two >= 64)
  i32 out_stride, plan_stride, lens_stride;
  i32 page_stride, page_tokens;
  i32 lean;                // a lean step (every request resident when it began): a sparse row
                           // is refused (status ST_BADROW = BADROW_NOT_RESIDENT), not planned
  i32 pad;
};

// ---- planned copy (plan.cu). Grid: any, block COPY_WARPS * 32.
//   For every layer l < n_layers, real row b < min(*num_real, B), entry m < count[b]: row
//   src_idx[b, m] of layer l of the source -> row dst_idx[b, m] of layer l of the destination
//   (entries whose row is outside its array are skipped).
struct PlannedCopyParams {
  const void* src_idx;     // [>= B, plan_stride] SrcT
  const void* dst_idx;     // [>= B, plan_stride] DstT
  const i32* count;        // [>= B], clamped to [0, plan_stride]
  const i32* num_real;     // device scalar or null
  const u8* src_base;      // row 0 of layer 0 of the source (device or mapped host address)
  u8* dst_base;            // row 0 of layer 0 of the destination
  // staged rows (prediction, n_layers == 1 only; stage_map null: none). A source row s of
  // batch row b is read from stage_base + j * row_bytes instead, where j = stage_map[s], if
  // b * stage_width <= j < b * stage_width + min(stage_count[b], stage_width) and
  // stage_src[j] == s (so stale map entries are harmless).
  const i32* stage_map;    // [n_src_rows] -> flat staged index, any value when not staged
  const i64* stage_src;    // [B * stage_width] source row of each staged row
  const i32* stage_count;  // [B]
  const u8* stage_base;    // staged row 0
  u64* stage_stats;        // [3] or null: [0] += rows copied, [1] += rows read from the stage
  i64 src_layer_bytes, n_src_rows, dst_layer_bytes, n_dst_rows;
  i32 plan_stride, B, row_bytes, n_layers;
  i32 stage_width;
  i32 pad;
};

// ---- the planned copy's measuring instance (planned_copy_probe, plan.cu; hisparse_cupy.testing.probe):
//   the copy's struct, then the probe's settings.
struct PlannedCopyProbeParams {
  PlannedCopyParams copy;
  i32* bad;                // device scalar or null: += entries whose row is outside its array
  i64 spin_cycles;         // > 0: delay each row by that many cycles (a slowed copy)
  i32 dry_run;             // 1: all the work, no bytes moved
  i32 pad;
};

// ---- prediction stager (predict.cu). Grid: (<= B), block PREDICT_BLOCK.
//   For batch row b: the tokens of topk[b] (a full layer F's top-k) that F's swap just missed
//   on (their host rows are in F's plan) and that the NEXT full layer's swap would miss on too,
//   judged by that layer's token -> slot table now: valid (0 <= tok < seq_len, not the newest
//   token, a host row in [0, n_host_rows)) and held by none of its LRU slots 0 .. H-1 (each
//   once, however often the top-k repeats it). Requests with
//   seq_len <= H (positional) and padding rows stage nothing. Up to stage_width of them get
//   staged indices j = b * stage_width + i: stage_src[j] = host row, stage_map[host row] = j;
//   stage_count[b] = how many.
struct PredictStageParams {
  const i32* topk;         // [>= B, topk_stride] int32
  const i64* plan_src;     // [>= B, plan_stride]: F's misses (host rows)
  const i32* plan_count;   // [>= B]
  const void* req;         // [B] ReqT
  const void* lens;        // [B] LenT, at b * lens_stride
  const i32* num_real;     // device scalar or null
  const i64* host_locs;    // [R, host_stride]
  const i32* slot_tokens;  // [R, slot_stride] of the next full layer
  const i16* token_slot;   // [R, host_stride] of the next full layer
  i32* stage_map;          // [n_host_rows]
  i64* stage_src;          // [B * stage_width]
  i32* stage_count;        // [B]
  u64* stage_stats;        // [3] or null: [2] += rows staged
  const u8* resident;      // [R] or null: a resident request stages nothing
  i64 n_host_rows;
  i32 topk_stride, K, B, R, host_stride, slot_stride, H, stage_width, lens_stride;
  i32 plan_stride, miss_hash_size, rule;  // rule: 0 F's misses, PREDICT_RULE_SELECTION F's top-k
};

// ---- newest rows (cache.cu). Grid: ceil(B / NEWEST_BLOCK), block NEWEST_BLOCK.
struct NewestRowsParams {
  const void* req;         // [B] ReqT
  const void* lens;        // [B] LenT, at b * lens_stride
  const i32* num_real;     // device scalar or null
  const i32* slot_locs;    // [R, W] of layer 0 (slot H's row is the same in every layer)
  i32* slot_tokens;        // [L, R, W], layer stride slot_layer_stride: slot H gets the token
  i64* host_locs;          // [R, host_stride]: the newest token's host row is recorded
  i32* rows_out;           // [B]: device row of the newest token, -1 for padding / invalid
  i32* plan_src;           // [>= B, 1]: one-entry device -> host plan per row
  i64* plan_dst;           // [>= B, 1]
  i32* plan_count;         // [>= B]
  const i32* host_pages;   // [R, pages_stride]: the request's host pages (-1: none taken yet)
  const i32* own_from;     // [R]: tokens below it are in pages other requests share (read only)
  const u8* resident;      // [R] or null: a resident request's newest row is its page row
  const i32* dev_pages;    // [R, dev_page_stride]: device pages of resident requests
  i32* written;            // [R] or null (record): a real row's request wrote seq_len tokens
  const i16* token_slot;   // [L, R, table_stride] or null: the token -> slot table (record: a
                           // hot slot still holding the newest token, an MTP draft admitted
                           // before its position got this token, is emptied)
  i64 slot_layer_stride;
  i64 n_host_rows;         // rows per layer of the host pool: a backup never writes past them
  i64 table_layer_stride;
  i32 B, R, max_len, slot_stride, H, host_stride, lens_stride, n_layers;
  i32 record;              // 1: record host_locs, slot tokens and the backup plan
  i32 page_tokens, pages_stride;  // token t's host row: page[t / page_tokens] * page_tokens + ...
  i32 dev_page_tokens, dev_page_stride;  // the same for a resident request's device row
  i32 table_stride;
};

// ---- multi-step gather + commit (multistep.cu); both kernels take this struct.
//   gather: grid (ceil(S K / GATHER_BLOCK), B), block GATHER_BLOCK.
//   commit: grid (B (1 + copy_blocks)), block COMMIT_BLOCK, launched with PDL after the gather.
struct MultiStepParams {
  const i32* topk;         // [B, S, K], row stride topk_stride, each row's [S, K] contiguous
  const void* req;         // [B] ReqT
  const void* lens;        // [B, S] LenT: element (b, s) at b * lens_stride + s * lens_step
  const i32* num_real;     // device scalar or null
  const i64* host_locs;    // [R, host_stride]
  i32* slot_tokens;        // [R, W], row stride slot_stride
  i32* slot_locs;          // [R, W], row stride slot_stride (rotated by admissions)
  i32* scratch_locs;       // [R, C], row stride scratch_stride (rotated by admissions)
  i16* token_slot;         // [R, host_stride]: token -> hot slot (the single-step resolve's)
  u32* ref;                // [R, H], row stride ref_stride: epoch of each slot's last use
  u32* clock;              // [R, 2]: (epoch, cursor)
  u64* table;              // [B, table_size]: per-call dedup table (workspace)
  i32* meta;               // [B, table_size]: smallest reverse rank of each claimed token
  i32* compact;            // [B, compact_stride]: table position of miss u
  i32* pending;            // [B, compact_stride]: occurrences holding a placeholder
  i64* miss_src;           // [B, compact_stride]: host row of scratch-resident miss u (< C)
  i32* miss_dst;           // [B, compact_stride]: its scratch row (before the commit's rotation)
  i32* counters;           // [B, MS_N_COUNTERS]
  i32* out;                // [B, S, K], row stride out_stride
  const u8* host_base;     // row 0 of the layer's host rows (mapped)
  u8* dev_base;            // row 0 of the layer's device rows
  i64* plan_src;           // [>= B, plan_stride] or null: host row of unique miss u
  i32* plan_dst;           // [>= B, plan_stride] or null: device row it was copied to
  i32* plan_count;         // [>= B] or null
  i32* status;             // [B, N_STATUS]
  i32* stats;              // [B, MS_N_STATS]
  u64* layer_counters;     // [N_LAYER_COUNTERS] the layer's counters (count_row), or null
  const u8* resident;      // [R] or null: as SwapResolveParams.resident
  const i32* page_table;   // [R, page_stride]: as SwapResolveParams.page_table
  i64 n_host_rows;
  i32 topk_stride, S, K, B, R, host_stride, slot_stride, H, P, scratch_stride, C;
  i32 ref_stride, table_size, compact_stride, out_stride, row_bytes, plan_stride;
  i32 lens_stride, lens_step;
  i32 copy_blocks;         // commit grid: B commit blocks, then copy_blocks copy blocks per row
  i32 page_stride, page_tokens;
};

// ---- multi-step state (re)initialisation (multistep.cu). Grid: (B, L), block INIT_BLOCK.
struct MultiStepInitParams {
  const i32* rows;         // [B] request slots to initialise (outside [0, R): skipped)
  const i32* num_real;     // device scalar or null: rows >= *num_real are skipped
  const i32* slot_tokens;  // [L, R, W], layer stride slot_layer_stride
  i16* token_slot;         // [L, R, table_stride], layer stride table_layer_stride
  u32* ref;                // [L, R, H], layer stride ref_layer_stride
  u32* clock;              // [L, R, 2], layer stride 2 R
  i64 slot_layer_stride, table_layer_stride, ref_layer_stride;
  i32 R, B, slot_stride, H, table_stride, ref_stride;
};

// ---- the checks against _abi.py (abi_check.cuh)
HS_ABI_CHECK(SwapResolveParams);
HS_ABI_CHECK(PlannedCopyParams);
HS_ABI_CHECK(PlannedCopyProbeParams);
HS_ABI_CHECK(PredictStageParams);
HS_ABI_CHECK(NewestRowsParams);
HS_ABI_CHECK(MultiStepParams);
HS_ABI_CHECK(MultiStepInitParams);

// ---- row views. The kernels reach a request's or a batch row's row of the arrays above through
// these (pointer and stride paired once, here; multistep.cuh adds the multi-step workspace's),
// not as base + row * stride at each use. P is any struct with the named fields (the swaps, the
// stager and the bookkeeping share the names). The planned copy indexes its flattened plan itself.
template <typename T>
__device__ __forceinline__ T* row_at(T* base, i64 row, i64 stride) {
  return base + row * stride;
}

// the request's row (request slot rid) of a per-request array
template <typename P>
__device__ __forceinline__ auto slot_tokens_row(const P& p, i64 rid) {
  return row_at(p.slot_tokens, rid, p.slot_stride);
}
template <typename P>
__device__ __forceinline__ auto slot_locs_row(const P& p, i64 rid) {
  return row_at(p.slot_locs, rid, p.slot_stride);
}
template <typename P>
__device__ __forceinline__ auto host_locs_row(const P& p, i64 rid) {
  return row_at(p.host_locs, rid, p.host_stride);
}
template <typename P>  // the token -> slot table is as wide as host_locs
__device__ __forceinline__ auto token_slot_row(const P& p, i64 rid) {
  return row_at(p.token_slot, rid, p.host_stride);
}
template <typename P>
__device__ __forceinline__ auto lru_row(const P& p, i64 rid) {
  return row_at(p.lru, rid, p.lru_stride);
}
template <typename P>
__device__ __forceinline__ auto ref_row(const P& p, i64 rid) {
  return row_at(p.ref, rid, p.ref_stride);
}
template <typename P>
__device__ __forceinline__ auto scratch_row(const P& p, i64 rid) {
  return row_at(p.scratch_locs, rid, p.scratch_stride);
}
template <typename P>  // (epoch, cursor)
__device__ __forceinline__ auto clock_row(const P& p, i64 rid) {
  return row_at(p.clock, rid, 2);
}
// ... of layer `layer` of a [L, R, ...] array (the cache-wide kernels)
template <typename P>
__device__ __forceinline__ auto slot_tokens_row(const P& p, i64 layer, i64 rid) {
  return row_at(p.slot_tokens + layer * p.slot_layer_stride, rid, p.slot_stride);
}
__device__ __forceinline__ i16* token_slot_row(const MultiStepInitParams& p, i64 layer, i64 rid) {
  return row_at(p.token_slot + layer * p.table_layer_stride, rid, p.table_stride);
}
__device__ __forceinline__ u32* ref_row(const MultiStepInitParams& p, i64 layer, i64 rid) {
  return row_at(p.ref + layer * p.ref_layer_stride, rid, p.ref_stride);
}
__device__ __forceinline__ u32* clock_row(const MultiStepInitParams& p, i64 layer, i64 rid) {
  return row_at(p.clock + layer * 2 * p.R, rid, 2);
}

// batch row b: its request slot and length, and its row of a per-batch-row array
template <typename ReqT, typename P>
__device__ __forceinline__ i64 request_of(const P& p, int b) {
  return static_cast<i64>(static_cast<const ReqT*>(p.req)[b]);
}
template <typename LenT, typename P>
__device__ __forceinline__ i64 length_of(const P& p, int b) {
  return static_cast<i64>(static_cast<const LenT*>(p.lens)[static_cast<i64>(b) * p.lens_stride]);
}
template <typename P>
__device__ __forceinline__ auto topk_row(const P& p, i64 b) {
  return row_at(p.topk, b, p.topk_stride);
}
template <typename P>
__device__ __forceinline__ auto out_row(const P& p, i64 b) {
  return row_at(p.out, b, p.out_stride);
}
template <typename P>
__device__ __forceinline__ auto plan_src_row(const P& p, i64 b) {
  return row_at(p.plan_src, b, p.plan_stride);
}
template <typename P>
__device__ __forceinline__ auto plan_dst_row(const P& p, i64 b) {
  return row_at(p.plan_dst, b, p.plan_stride);
}

template <typename P>
__device__ __forceinline__ auto status_row(const P& p, i64 b) {
  return row_at(p.status, b, N_STATUS);
}

// The one writer of the per-layer counters (c: the layer's, or null): a real batch row's swap
// adds the row, its selected entries, its unique misses and its flagged entries. One thread
// per row, after the row's status is final.
__device__ __forceinline__ void count_row(u64* c, int selected, int misses, int flagged) {
  if (c == nullptr) return;
  atomicAdd(c + LC_ROWS, 1ull);
  atomicAdd(c + LC_SELECTED, static_cast<u64>(selected));
  if (misses) atomicAdd(c + LC_MISSES, static_cast<u64>(misses));
  if (flagged) atomicAdd(c + LC_FLAGGED, static_cast<u64>(flagged));
}

// The one writer of a batch row's status (st: its status_row; columns ST_*).
__device__ __forceinline__ void write_status(i32* st, int range, int nohost, int badrow) {
  st[ST_RANGE] = range;
  st[ST_NOHOST] = nohost;
  st[ST_BADROW] = badrow;
}

// ---- the direct path (docs/design.md section 10): a row whose every token has a device row of
// its own needs no lookup, no eviction and no copy. The rows have two sources and one rule:
//   - a resident request: its device page table, token t in row pages[t / PT] * PT + t % PT
//     (the same in every layer; page_row);
//   - the positional layout of a request of seq <= H: token t in hot slot t, slot_locs[t].
// Entry i of a row: a -1 token, or i >= seq while seq <= H, is -1 with no status; a token
// outside [0, lim) is -1 and counts RANGE (lim: min(seq, the host map's width), the sparse
// swaps' limit; a positional row too, since H may exceed max_len); a token without a row (-1: a page the engine did not
// take, a slot without a row) is -1 and counts NOHOST, and so is a token that was never written
// (its host row -1; the newest token seq - 1 excepted: this step writes it), as the LRU path
// gives: a positional slot may still hold its previous request's row. Every valid entry counts
// as a hit.
// (32-bit arithmetic: a token is below max_len, an int32, and a 64-bit division is emulated)
__device__ __forceinline__ int page_row(const i32* pages, int stride, int PT, int t) {
  const int g = t / PT;
  const i32 pg = g < stride ? pages[g] : -1;
  return pg < 0 ? -1 : pg * PT + t % PT;
}
struct DirectRows {
  const i32* pages;  // the request's page table row (a resident request)
  const i32* sloc;   // its slot rows (the positional layout)
  const i64* hloc;   // its host rows (-1: a token never written)
  i32 page_stride, page_tokens;
  int cols;          // entries i >= cols are -1: seq while seq <= H, else no limit
  int lim;           // tokens >= lim are out of range
  int newest;        // seq - 1: the step's newest token (its row is written this step)
};
enum : int { DIRECT_SKIP = -1, DIRECT_RANGE = -2, DIRECT_NOROW = -3 };
// The direct rows of request slot rid at length seq, from a swap's parameters.
template <typename P>
__device__ __forceinline__ DirectRows direct_rows(const P& p, i64 rid, i64 seq, int H) {
  const int w = p.host_stride;  // seq <= H or the host map's width bounds both: int32
  const int lim = seq < w ? static_cast<int>(seq) : w;  // (H may exceed the width: max_len)
  return DirectRows{p.page_table ? row_at(p.page_table, rid, p.page_stride) : nullptr,
                    slot_locs_row(p, rid), host_locs_row(p, rid), p.page_stride,
                    p.page_tokens, seq <= H ? static_cast<int>(seq) : 0x7fffffff, lim,
                    static_cast<int>(seq <= w ? seq - 1 : -1)};
}
// Entry i (token tok): its row (>= 0), or DIRECT_SKIP / DIRECT_RANGE / DIRECT_NOROW. PAGED: the
// rows of a resident request (compiled apart, so neither source costs the other a branch). A
// token never written (no host row, not the newest) is NOROW in both, as the LRU path has it.
template <bool PAGED>
__device__ __forceinline__ int direct_entry(const DirectRows& d, int tok, int i) {
  if (tok == -1 || i >= d.cols) return DIRECT_SKIP;
  if (tok < 0 || tok >= d.lim) return DIRECT_RANGE;
  if (tok != d.newest && d.hloc[tok] < 0) return DIRECT_NOROW;
  const int r = PAGED ? page_row(d.pages, d.page_stride, d.page_tokens, tok) : d.sloc[tok];
  return r >= 0 ? r : DIRECT_NOROW;
}

// ---- shared memory: HS_SMEM_CARVE(KERNEL, var, base) declares `var`, a struct with one
// pointer per region of HS_SMEM_<KERNEL> (_abi.SMEM) plus `end`, carved from `base` with every
// region 16-byte aligned. The element counts are expressions of local variables in scope.
// With HS_DEBUG, a carve that overruns the launch's dynamic shared memory traps.
__device__ __forceinline__ u32 dynamic_smem_size() {
  u32 n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}
__device__ __forceinline__ unsigned char* smem_take(unsigned char*& p, unsigned long long bytes) {
  unsigned char* r = p;
  p += (bytes + 15) / 16 * 16;
  return r;
}
#define HS_SMEM_FIELD(T, name, n) T* name;
#define HS_SMEM_TAKE(T, name, n) var_.name = reinterpret_cast<T*>(smem_take(p_, sizeof(T) * (n)));
#ifdef HS_DEBUG
#define HS_SMEM_GUARD(var)                                                               \
  if (static_cast<u32>((var).end - smem_base_) > dynamic_smem_size()) __trap();
#else
#define HS_SMEM_GUARD(var)
#endif
#define HS_SMEM_CARVE(KERNEL, var, base)                                                 \
  struct {                                                                               \
    HS_SMEM_##KERNEL(HS_SMEM_FIELD) unsigned char* end;                                  \
  } var;                                                                                 \
  {                                                                                      \
    unsigned char* const smem_base_ = (base);                                            \
    unsigned char* p_ = smem_base_;                                                      \
    auto& var_ = var;                                                                    \
    HS_SMEM_##KERNEL(HS_SMEM_TAKE) var_.end = p_;                                        \
    HS_SMEM_GUARD(var)                                                                   \
  }

}  // namespace hs
