// hisparse_cupy: per-step bookkeeping of HotBufferCache.
//
// newest_rows<ReqT, LenT>: one thread per batch row. For a real row whose request slot and
// length are valid, the newest token t = seq_len - 1 lives in slot min(t, H) (positional layout
// while seq_len <= H, the newest-token slot H after). Writes its device row to rows_out[b] and
// a one-entry D2H plan (device row -> host row rid * max_len + t) that planned_copy runs for
// every layer, and records the host row in host_locs (the token becomes loadable once the copy,
// queued right after on the same stream, has landed). Padding or invalid rows: -1, count 0.
#include "common.cuh"

namespace hs {

template <typename ReqT, typename LenT>
__global__ void newest_rows(const ReqT* __restrict__ req_idx, const LenT* __restrict__ seq_lens,
                            const i32* __restrict__ num_real, int B, int R, int max_len,
                            const i32* __restrict__ slot_locs, int slot_stride, int H,
                            i64* __restrict__ host_locs, int host_stride,
                            i32* __restrict__ rows_out, i32* __restrict__ plan_src,
                            i64* __restrict__ plan_dst, i32* __restrict__ plan_count,
                            int record) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  int nr = num_real ? *num_real : B;
  nr = nr < 0 ? 0 : (nr > B ? B : nr);
  const i64 rid = b < nr ? static_cast<i64>(req_idx[b]) : -1;
  const i64 seq = b < nr ? static_cast<i64>(seq_lens[b]) : 0;
  if (rid < 0 || rid >= R || seq < 1 || seq > max_len) {
    rows_out[b] = -1;
    if (record) plan_count[b] = 0;
    return;
  }
  const i64 t = seq - 1;
  const int row = slot_locs[rid * slot_stride + (t < H ? t : H)];
  rows_out[b] = row;
  if (record) {
    const i64 host = rid * max_len + t;
    host_locs[rid * host_stride + t] = host;
    plan_src[b] = row;
    plan_dst[b] = host;
    plan_count[b] = 1;
  }
}

}  // namespace hs
