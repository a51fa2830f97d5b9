// hisparse_cupy: per-step bookkeeping of HotBufferCache.
//
// newest_rows<ReqT, LenT>(NewestRowsParams): one thread per batch row. For a real row whose
// request slot and length are valid, the newest token t = seq_len - 1 lives in slot min(t, H)
// (positional layout while seq_len <= H, the newest-token slot H after; slot H's device row is
// the same in every layer, since admissions rotate hot slots only). Writes its device row to
// rows_out[b]. With `record`, past H, marks slot H of every layer as holding t (the multi-step
// swap finds the newest token there; a hot slot the token -> slot table names as still holding t,
// a multi-step swap's copy of a draft at t that the verify step rejected, is emptied: its row
// holds the draft's KV, not this token's) and, if t has a host row of the request's own, writes a
// one-entry D2H plan (device row -> that host row) that planned_copy runs for every layer and
// records the row in host_locs (the token becomes loadable once the copy, queued right after on
// the same stream, has landed). Token t's host row is page * page_tokens + t % page_tokens, page
// = host_pages[rid][t / page_tokens] (the slot layout: one page of max_len rows per request).
// No backup (count 0) where t is below own_from (a shared page: never written, it holds t
// already), where no page was taken for t (host_locs keeps -1: a swap that misses t flags it)
// or where the row lies outside the pool. Padding or invalid rows: -1, count 0. A resident
// request (resident[rid], docs/design.md section 10): its newest row is its device page's row,
// slot H is not marked, and the backup is the same. With `record` and `written` (a cache with a
// device budget), written[rid] = seq_len: the count of tokens written that residency's moves
// work from.
#include "abi.cuh"

namespace hs {

template <typename ReqT, typename LenT>
__global__ void __launch_bounds__(NEWEST_BLOCK) newest_rows(const NewestRowsParams p) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= p.B) return;
  const int nr = clamp_real(p.num_real, p.B);
  const i64 rid = b < nr ? request_of<ReqT>(p, b) : -1;
  const i64 seq = b < nr ? length_of<LenT>(p, b) : 0;
  if (rid < 0 || rid >= p.R || seq < 1 || seq > p.max_len) {
    p.rows_out[b] = -1;
    if (p.record) p.plan_count[b] = 0;
    return;
  }
  const i64 t = seq - 1;
  const int slot = t < p.H ? static_cast<int>(t) : p.H;
  const bool resident = p.resident != nullptr && p.resident[rid];
  // a resident request's row is its page's (-1: no page taken for t, nothing written or backed up)
  const int row = resident ? page_row(row_at(p.dev_pages, rid, p.dev_page_stride),
                                      p.dev_page_stride, p.dev_page_tokens,
                                      static_cast<int>(t))
                           : slot_locs_row(p, rid)[slot];
  p.rows_out[b] = row;
  if (p.record) {
    if (p.written) p.written[rid] = static_cast<i32>(seq);
    if (!resident && slot == p.H && p.slot_tokens) {
      const bool table = p.token_slot != nullptr && t < p.table_stride;
      // NEWEST_LAYERS layers at a time, each pass's loads issued before their uses: a stale hot
      // copy of t (a rejected draft's) is the slot the table names, if it still holds t
      for (int l0 = 0; l0 < p.n_layers; l0 += NEWEST_LAYERS) {
        int e[NEWEST_LAYERS];
        i32 held[NEWEST_LAYERS];
#pragma unroll
        for (int u = 0; u < NEWEST_LAYERS; ++u) {
          const int l = l0 + u;
          e[u] = table && l < p.n_layers
                     ? p.token_slot[l * p.table_layer_stride + rid * p.table_stride + t]
                     : -1;
        }
#pragma unroll
        for (int u = 0; u < NEWEST_LAYERS; ++u) {
          const int l = l0 + u;
          held[u] = e[u] >= 0 && e[u] < p.H && l < p.n_layers ? slot_tokens_row(p, l, rid)[e[u]]
                                                               : -1;
        }
#pragma unroll
        for (int u = 0; u < NEWEST_LAYERS; ++u) {
          const int l = l0 + u;
          if (l >= p.n_layers) break;
          i32* st = slot_tokens_row(p, l, rid);
          st[slot] = static_cast<i32>(t);
          if (held[u] == static_cast<i32>(t)) st[e[u]] = -1;
        }
      }
    }
    const i64 g = t / p.page_tokens;
    const i32 page = g < p.pages_stride ? row_at(p.host_pages, rid, p.pages_stride)[g] : -1;
    const i64 host = page < 0 ? -1 : static_cast<i64>(page) * p.page_tokens + t % p.page_tokens;
    const bool backup = row >= 0 && host >= 0 && host < p.n_host_rows && t >= p.own_from[rid];
    if (backup) {
      host_locs_row(p, rid)[t] = host;
      p.plan_src[b] = row;
      p.plan_dst[b] = host;
    }
    p.plan_count[b] = backup ? 1 : 0;
  }
}

}  // namespace hs
