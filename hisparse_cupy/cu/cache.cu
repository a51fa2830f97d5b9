// hisparse_cupy: per-step bookkeeping of HotBufferCache.
//
// newest_rows<ReqT, LenT>(NewestRowsParams): one thread per batch row. For a real row whose
// request slot and length are valid, the newest token t = seq_len - 1 lives in slot min(t, H)
// (positional layout while seq_len <= H, the newest-token slot H after; slot H's device row is
// the same in every layer, since admissions rotate hot slots only). Writes its device row to
// rows_out[b]. With `record`, also writes a one-entry D2H plan (device row -> host row
// rid * max_len + t) that planned_copy runs for every layer, records the host row in host_locs
// (the token becomes loadable once the copy, queued right after on the same stream, has landed)
// and, past H, marks slot H of every layer as holding t (the multi-step swap finds the newest
// token there). Padding or invalid rows: -1, count 0.
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
  const int row = slot_locs_row(p, rid)[slot];
  p.rows_out[b] = row;
  if (p.record) {
    const i64 host = rid * p.max_len + t;
    host_locs_row(p, rid)[t] = host;
    if (slot == p.H && p.slot_tokens) {
      for (int l = 0; l < p.n_layers; ++l) slot_tokens_row(p, l, rid)[slot] = static_cast<i32>(t);
    }
    p.plan_src[b] = row;
    p.plan_dst[b] = host;
    p.plan_count[b] = 1;
  }
}

}  // namespace hs
