// hisparse_cupy demo: the synthetic model's kernels (the demo's own, not the library's interface).
//
// Built and launched as the package's kernels are: every kernel takes one parameter struct by
// value, declared here and mirrored in hisparse_cupy/_abi.py (DEMO_STRUCTS), whose -D macros
// every compile passes and HS_ABI_CHECK (cu/abi_check.cuh) checks each struct against (size,
// field sizes and kinds, field order). hisparse_cupy/_kernels/build.py compiles this file into one
// RawModule holding the name expressions of its DEMO and DEMO_ROWS tables, with the package's
// options (compile_check() covers it), and hisparse_cupy.demo._model launches them through the
// package's launcher (cuLaunchKernelEx with one pointer to the struct). Kernels live in
// namespace demo; a struct is its kernel's name in CamelCase + Params.
//
// KV rows are MLA-like: D_ROW = 576 values, the first D_V = 512 of which are the value (the
// latent), all 576 the key, in one of two formats, a template parameter of every kernel that
// reads or writes rows (FP8: one instance per format):
//   - FP8 (FP8 = true, the default): GLM-5.2's cached row, 656 bytes = 41 chunks of 16: the 512
//     latent values as e4m3 (chunks 0-31), their 4 float32 scales, one per 128 values (chunk
//     32), the 64 RoPE values as bf16 (chunks 33-40). A value is its e4m3 value times its
//     block's scale (a power of two: exact in float);
//   - bf16 (FP8 = false): 576 bf16 values, 1152 bytes = 72 chunks.
// A token's row in layer l of request slot r at position p is a pure function of (l, r, p):
// every mode (GPU-only, offload, overlap) and the host pool hold the same bytes, so the
// attention outputs must agree bit for bit.
//
// Every kernel that changes from step to step reads the step index and the sequence lengths
// from device memory, so one captured decode step replays for every step.
// ASCII only (NVRTC reads the source as bytes).

#include "abi_check.cuh"

#define D_ROW 576
#define D_V 512
#define FP8_CHUNKS 41    // 16-byte chunks of an FP8 row (656 bytes)
#define FP8_SCALES 32    // its chunk of scales; chunks before: latent bytes, after: RoPE
#define BF16_CHUNKS 72   // of a bf16 row (1152 bytes)
#define NH 16            // query heads
#define TR 16            // rows per attention tile
#define QS 580           // padded row stride (floats) of the query and tile buffers
#define ATT_THREADS 256
#define INFINITY __int_as_float(0x7f800000)

namespace demo {

typedef unsigned long long u64;

__device__ __forceinline__ u64 mix64(u64 x) {
  x ^= x >> 30; x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27; x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// a value in [-1, 1) as bf16 bits (exact: 8 significant bits)
__device__ __forceinline__ unsigned short hash_bf16(u64 h) {
  const float u = static_cast<float>(static_cast<int>(h >> 40) - (1 << 23)) * (1.0f / (1 << 23));
  return static_cast<unsigned short>(__float_as_uint(u) >> 16);
}

__device__ __forceinline__ float bf16_to_float(unsigned short b) {
  return __uint_as_float(static_cast<unsigned int>(b) << 16);
}

__device__ __forceinline__ unsigned short float_to_bf16(float x) {  // round to nearest even
  unsigned int u = __float_as_uint(x);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<unsigned short>(u >> 16);
}

// An e4m3 byte's value (sign, 4 exponent bits of bias 7, 3 mantissa bits; no NaN is made).
__device__ __forceinline__ float e4m3_to_float(unsigned int b) {
  const unsigned int e = (b >> 3) & 0xFu, m = b & 7u;
  const float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20))
                    : static_cast<float>(m) * 0.001953125f;  // subnormal: m * 2^-9
  return (b & 0x80u) ? -v : v;
}

// Chunk c (16 bytes) of token (r, p)'s row in layer l: bf16, eight bf16 values (c < 72); FP8,
// sixteen e4m3 bytes (c < 32; never the NaN pattern S.1111.111), the four scales (c = 32:
// 2^-9 .. 2^-12) or eight bf16 RoPE values (c = 33..40).
template <bool FP8>
__device__ __forceinline__ uint4 kv_chunk(int l, int r, long long p, int c) {
  const u64 key = mix64((static_cast<u64>(l) << 56) ^ (static_cast<u64>(r) << 40) ^
                        static_cast<u64>(p)) + static_cast<u64>(c) * 0x9E3779B97F4A7C15ULL;
  unsigned int w[4];
  for (int i = 0; i < 4; ++i) {
    if (FP8 && c < FP8_SCALES) {
      unsigned int x = static_cast<unsigned int>(mix64(key + i) >> 32), y = 0;
      for (int j = 0; j < 4; ++j) {
        unsigned int byte = (x >> (8 * j)) & 0xFFu;
        if ((byte & 0x7Fu) == 0x7Fu) byte ^= 1u;  // NaN -> the largest finite value
        y |= byte << (8 * j);
      }
      w[i] = y;
    } else if (FP8 && c == FP8_SCALES) {
      w[i] = (127u - 9u - static_cast<unsigned int>(mix64(key + i) & 3u)) << 23;
    } else {
      const unsigned short a = hash_bf16(mix64(key + 2 * i));
      const unsigned short b = hash_bf16(mix64(key + 2 * i + 1));
      w[i] = static_cast<unsigned int>(a) | (static_cast<unsigned int>(b) << 16);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Prefill: rows of positions [p0, p1) of request slots reqs[0..n_req) into row
// blockIdx.y * req_rows + p - p0 of base + l * layer_bytes, model layer first + l (base: device
// or mapped host; req_rows = max_len with reqs = 0..B-1: row r * max_len + p, the slot layout;
// req_rows = 0: one request's rows from 0, an admission's KV). Positions below `shared` carry
// request 0's bytes (requests forked from its first `shared` tokens).
// grid (ceil((p1 - p0) * chunks / 256), n_req, layers), chunks: FP8_CHUNKS or BF16_CHUNKS
struct KvPrefillParams {
  unsigned char* base;    // row 0 of layer 0 (device or mapped host)
  const int* reqs;        // [n_req] request slots
  long long layer_bytes;  // from a layer's rows to the next layer's
  long long req_rows;     // rows from one request's first row to the next's (0: one request)
  int p0, p1;             // positions [p0, p1)
  int shared;             // positions below it carry request 0's bytes
  int first;              // the model layer of the rows at base
};
HS_ABI_CHECK(KvPrefillParams);

template <bool FP8>
__global__ void kv_prefill(const KvPrefillParams p) {
  constexpr int NC = FP8 ? FP8_CHUNKS : BF16_CHUNKS;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<long long>(p.p1 - p.p0) * NC) return;
  const int l = blockIdx.z;
  const long long pos = p.p0 + i / NC;
  const int r = pos < p.shared ? 0 : p.reqs[blockIdx.y];
  const int c = static_cast<int>(i % NC);
  uint4* dst = reinterpret_cast<uint4*>(p.base + l * p.layer_bytes +
                                        (blockIdx.y * p.req_rows + pos - p.p0) * (16 * NC));
  dst[c] = kv_chunk<FP8>(p.first + l, r, pos, c);
}

// The newest token (position lens[b] - 1) of every batch row, every layer: into device row
// rows[b] (the cache's newest_rows(); -1 skips) or, with rows == nullptr, row
// req[b] * max_len + lens[b] - 1 (resident KV). Model layers first .. first + gridDim.y - 1,
// the first at base. grid (B, layers), 96 threads.
struct KvNewestParams {
  unsigned char* base;    // row 0 of the first layer's rows
  const int* req;         // [B] request slots
  const int* lens;        // [B] lengths (the newest token's included)
  const int* rows;        // [B] device rows, or null: the slot layout's rows
  long long layer_bytes;  // from a layer's rows to the next layer's
  int max_len;            // rows per request slot in the slot layout
  int first;              // the model layer of the rows at base
};
HS_ABI_CHECK(KvNewestParams);

template <bool FP8>
__global__ void kv_newest(const KvNewestParams p) {
  constexpr int NC = FP8 ? FP8_CHUNKS : BF16_CHUNKS;
  const int b = blockIdx.x, l = blockIdx.y, c = threadIdx.x;
  if (c >= NC) return;
  const int r = p.req[b];
  const long long pos = p.lens[b] - 1;
  const long long row = p.rows ? static_cast<long long>(p.rows[b])
                               : static_cast<long long>(r) * p.max_len + pos;
  if (row < 0) return;
  uint4* dst = reinterpret_cast<uint4*>(p.base + l * p.layer_bytes + row * (16 * NC));
  dst[c] = kv_chunk<FP8>(p.first + l, r, pos, c);
}

// Drifting top-k of one full layer, int32 [B, S, K]: entry k < K - nrec of draft step s is
// token perm(pos), pos = (t * M + s * Md + 7919 b + salt + k) mod U, perm(x) = (a x + 131 b +
// salt) mod U (a bijection: gcd(a, U) = 1), so each step M tokens of the window are new; the
// last nrec = min(recent, t + 1) entries are the newest tokens lens[b] - nrec .. lens[b] - 1.
// grid (ceil(K / 256), B * S)
struct TopkDriftParams {
  int* topk;              // [B, S, K]
  const int* step;        // the step index t (device scalar)
  const int* lens;        // [B]
  long long a, salt;      // the bijection's multiplier and the layer's salt
  int S, K, M, Md, U, recent;
};
HS_ABI_CHECK(TopkDriftParams);

__global__ void topk_drift(const TopkDriftParams p) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= p.K) return;
  const int bs = blockIdx.y, b = bs / p.S, s = bs % p.S;
  const int t = *p.step;
  const int nrec = min(p.recent, t + 1);
  int tok;
  if (k >= p.K - nrec) {
    tok = p.lens[b] - (p.K - k);
  } else {
    const long long pos = (static_cast<long long>(t) * p.M + static_cast<long long>(s) * p.Md +
                           7919LL * b + p.salt + k) % p.U;
    tok = static_cast<int>((pos * p.a + 131LL * b + p.salt) % p.U);
  }
  p.topk[static_cast<long long>(bs) * p.K + k] = tok;
}

// --topk-model lru: full layer j's top-k of this step from the pre-generated streams, table
// int32 [steps * S, n_full, BK] (BK = B * K): topk [B, S, K], draft s of decode step t from the
// table's step t * S + s (S = 1: [B, K], step t). The step index is read on the device (graphs).
// grid (ceil(BK * S / 256)), 256 threads.
struct TopkTableParams {
  const int* table;       // [steps * S, n_full, BK]
  const int* step;        // the decode step t (device scalar)
  int* topk;              // [B, S, K]
  int n_full, j;          // full layers, and this one's rank among them
  int BK, K, S;
  int pad;
};
HS_ABI_CHECK(TopkTableParams);

__global__ void topk_table(const TopkTableParams p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.BK * p.S) return;
  const int k = i % p.K, s = (i / p.K) % p.S, b = i / (p.K * p.S);
  p.topk[i] = p.table[((static_cast<long long>(*p.step) * p.S + s) * p.n_full + p.j) * p.BK +
                      b * p.K + k];
}

// GPU-only page table: locs = req[b] * max_len + token (-1 for a negative token). n = B * S * K.
// grid (ceil(n / 256)), 256 threads.
struct DirectLocsParams {
  const int* topk;        // [B, S, K]
  const int* req;         // [B]
  int* locs;              // [B, S, K]
  int SK, max_len, n;
  int pad;
};
HS_ABI_CHECK(DirectLocsParams);

__global__ void direct_locs(const DirectLocsParams p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  const int t = p.topk[i];
  p.locs[i] = t < 0 ? -1 : p.req[i / p.SK] * p.max_len + t;
}

// The step's input hidden state, bf16 [Q, D] (n = Q * D values): a function of (step, index).
// grid (ceil(n / 256)), 256 threads.
struct EmbedParams {
  unsigned short* h;
  const int* step;        // device scalar
  int n;
  int pad;
};
HS_ABI_CHECK(EmbedParams);

__global__ void embed(const EmbedParams p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  p.h[i] = hash_bf16(mix64((static_cast<u64>(*p.step) << 40) ^ static_cast<u64>(i) ^
                           0x5851F42D4C957F2DULL));
}

// Weights, bf16 [n]: uniform in [-scale, scale) (scale a power of two keeps them exact).
// grid (ceil(n / 256)), 256 threads.
struct WeightsParams {
  unsigned short* w;
  long long n;
  u64 seed;
  float scale;
  int pad;
};
HS_ABI_CHECK(WeightsParams);

__global__ void weights(const WeightsParams p) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  p.w[i] = float_to_bf16(bf16_to_float(hash_bf16(mix64(p.seed ^ static_cast<u64>(i)))) *
                         p.scale);
}

// Sparse MLA-style attention, split over the K selected rows (flash-decoding), part 1.
// Query row q (= b * S + s) has NH heads of D_ROW values (bf16, normalised here per head and
// scaled by temp); its selected rows are locs[b * ld_b + s * ld_s + k], k < K (-1: skipped).
// Block (split, q): rows [split * chunk, min(K, (split + 1) * chunk)). Per head: running max m,
// sum l, and acc[D_V] = sum_j exp(score_j - m) * value_j. Fixed order: deterministic. Rows in
// the format FP8 says, read as their 576 float values (FP8: e4m3 times the block's scale).
// grid (n_split, Q), ATT_THREADS threads, dynamic smem ATT_SMEM (hisparse_cupy.demo._model).
struct AttnPartialParams {
  const unsigned short* qraw;  // [Q, NH * D_ROW] bf16
  const int* locs;             // row b * ld_b + s * ld_s: query row b * S + s's K rows
  const unsigned char* rows;   // [D, row bytes]
  float* part_m;               // [Q, n_split, NH]
  float* part_l;               // [Q, n_split, NH]
  float* part_acc;             // [Q, n_split, NH, D_V]
  long long ld_b, ld_s;
  int S, K, chunk;             // chunk: rows of a split (a multiple of TR)
  float temp;                  // the query's scale after normalisation
};
HS_ABI_CHECK(AttnPartialParams);

template <bool FP8>
__global__ void __launch_bounds__(ATT_THREADS) attn_partial(const AttnPartialParams p) {
  extern __shared__ float4 smem4[];
  float* q_s = reinterpret_cast<float*>(smem4);  // [NH][QS]
  float* kv_s = q_s + NH * QS;                     // [TR][QS]
  float* p_s = kv_s + TR * QS;                     // [TR][NH] scores, then weights
  float* c_s = p_s + TR * NH;                      // [NH] rescale of this tile
  float* nrm_s = c_s + NH;                         // [NH]
  int* ok_s = reinterpret_cast<int*>(nrm_s + NH);  // [TR]
  const int split = blockIdx.x, q = blockIdx.y, nsplit = gridDim.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = q / p.S, s = q % p.S;
  const int* lrow = p.locs + b * p.ld_b + s * p.ld_s;

  // query: load, then normalise each head (warp w: heads w and w + 8)
  const unsigned short* qr = p.qraw + static_cast<long long>(q) * NH * D_ROW;
  for (int i = tid; i < NH * D_ROW; i += ATT_THREADS)
    q_s[(i / D_ROW) * QS + i % D_ROW] = bf16_to_float(qr[i]);
  __syncthreads();
  for (int h = warp; h < NH; h += ATT_THREADS / 32) {
    float ss = 0.0f;
    for (int d = lane; d < D_ROW; d += 32) ss += q_s[h * QS + d] * q_s[h * QS + d];
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) nrm_s[h] = p.temp * rsqrtf(ss + 1e-20f);
  }
  __syncthreads();
  for (int i = tid; i < NH * D_ROW; i += ATT_THREADS) {
    const int h = i / D_ROW;
    q_s[h * QS + i % D_ROW] *= nrm_s[h];
  }

  float m = -INFINITY, l = 0.0f;  // thread h < NH: head h's running max and sum
  float acc[NH][2];
#pragma unroll
  for (int h = 0; h < NH; ++h) acc[h][0] = acc[h][1] = 0.0f;
  const int k0 = split * p.chunk, k1 = min(p.K, k0 + p.chunk);
  for (int kt = k0; kt < k1; kt += TR) {
    __syncthreads();  // the previous tile is consumed (and the query is ready)
    if (tid < TR) {
      const int k = kt + tid;
      ok_s[tid] = (k < k1 && lrow[k] >= 0) ? lrow[k] : -1;
    }
    __syncthreads();
    constexpr int NC = FP8 ? FP8_CHUNKS : BF16_CHUNKS;
    for (int i = tid; i < TR * NC; i += ATT_THREADS) {
      const int r = i / NC, c = i % NC;
      const int loc = ok_s[r];
      const unsigned char* row = p.rows + static_cast<long long>(loc) * (16 * NC);
      if (FP8 && c < FP8_SCALES) {  // 16 latent values: e4m3 times their block's scale
        float* dst = kv_s + r * QS + c * 16;
        if (loc < 0) {
          for (int j = 0; j < 16; ++j) dst[j] = 0.0f;
        } else {
          const uint4 v = reinterpret_cast<const uint4*>(row)[c];
          const float sc = reinterpret_cast<const float*>(row + D_V)[c / 8];
          const unsigned int w[4] = {v.x, v.y, v.z, v.w};
          for (int j = 0; j < 16; ++j)
            dst[j] = e4m3_to_float((w[j / 4] >> (8 * (j % 4))) & 0xFFu) * sc;
        }
        continue;
      }
      if (FP8 && c == FP8_SCALES) continue;  // (read with the latent values)
      // eight bf16 values: a bf16 row's chunk c, or an FP8 row's RoPE values
      float* dst = kv_s + r * QS + (FP8 ? D_V + (c - FP8_SCALES - 1) * 8 : c * 8);
      if (loc < 0) {
        for (int j = 0; j < 8; ++j) dst[j] = 0.0f;
      } else {
        const uint4 v = reinterpret_cast<const uint4*>(row)[c];
        const unsigned int w[4] = {v.x, v.y, v.z, v.w};
        for (int j = 0; j < 4; ++j) {
          dst[2 * j] = __uint_as_float(w[j] << 16);
          dst[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
        }
      }
    }
    __syncthreads();
    {  // scores: thread (r, h)
      const int r = tid / NH, h = tid % NH;
      const float4* qa = reinterpret_cast<const float4*>(q_s + h * QS);
      const float4* ka = reinterpret_cast<const float4*>(kv_s + r * QS);
      float sc = 0.0f;
      for (int d = 0; d < D_ROW / 4; ++d) {
        const float4 x = qa[d], y = ka[d];
        sc += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
      }
      p_s[r * NH + h] = ok_s[r] >= 0 ? sc : -INFINITY;
    }
    __syncthreads();
    if (tid < NH) {  // online softmax of head tid over the tile's rows, in row order
      float mt = m;
      for (int r = 0; r < TR; ++r) mt = fmaxf(mt, p_s[r * NH + tid]);
      if (mt == -INFINITY) {
        c_s[tid] = 1.0f;
        for (int r = 0; r < TR; ++r) p_s[r * NH + tid] = 0.0f;
      } else {
        const float c = __expf(m - mt);
        float sum = 0.0f;
        for (int r = 0; r < TR; ++r) {
          const float e = __expf(p_s[r * NH + tid] - mt);
          p_s[r * NH + tid] = e;
          sum += e;
        }
        c_s[tid] = c;
        l = l * c + sum;
        m = mt;
      }
    }
    __syncthreads();
    {  // values: thread owns dims 2 tid, 2 tid + 1 of every head
      const int d = 2 * tid;
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        float a0 = acc[h][0] * c_s[h], a1 = acc[h][1] * c_s[h];
        for (int r = 0; r < TR; ++r) {
          const float w = p_s[r * NH + h];
          const float2 v = *reinterpret_cast<const float2*>(kv_s + r * QS + d);
          a0 += w * v.x;
          a1 += w * v.y;
        }
        acc[h][0] = a0;
        acc[h][1] = a1;
      }
    }
  }
  const long long base = (static_cast<long long>(q) * nsplit + split) * NH;
  if (tid < NH) {
    p.part_m[base + tid] = m;
    p.part_l[base + tid] = l;
  }
#pragma unroll
  for (int h = 0; h < NH; ++h)
    *reinterpret_cast<float2*>(p.part_acc + (base + h) * D_V + 2 * tid) =
        make_float2(acc[h][0], acc[h][1]);
}

// Part 2: combine the splits in split order, bf16 out [Q, NH * D_V], and fold the output into
// digest[step * n_layers + layer] (a wrapping sum of hashed (index, value) pairs: independent of
// the summation order, so it is deterministic, and any changed bit changes it).
// grid (Q, NH): one block per query row and head, D_V threads.
struct AttnCombineParams {
  const float* part_m;    // attn_partial's outputs
  const float* part_l;
  const float* part_acc;
  unsigned short* out;    // [Q, NH * D_V] bf16
  u64* digest;            // [steps, n_layers]
  const int* step;        // device scalar
  int nsplit, n_layers, layer;
  int pad;
};
HS_ABI_CHECK(AttnCombineParams);

__global__ void attn_combine(const AttnCombineParams p) {
  const int q = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  const long long base = static_cast<long long>(q) * p.nsplit * NH + h;
  float mx = -INFINITY;
  for (int sp = 0; sp < p.nsplit; ++sp) mx = fmaxf(mx, p.part_m[base + sp * NH]);
  float num = 0.0f, den = 0.0f;
  if (mx != -INFINITY) {
    for (int sp = 0; sp < p.nsplit; ++sp) {
      const float ms = p.part_m[base + sp * NH];
      if (ms == -INFINITY) continue;
      const float w = __expf(ms - mx);
      den += p.part_l[base + sp * NH] * w;
      num += p.part_acc[(base + sp * NH) * D_V + d] * w;
    }
  }
  const unsigned short o = float_to_bf16(den > 0.0f ? num / den : 0.0f);
  const long long idx = (static_cast<long long>(q) * NH + h) * D_V + d;
  p.out[idx] = o;
  u64 dig = mix64((static_cast<u64>(idx) << 16) | o);
  for (int o2 = 16; o2; o2 >>= 1) dig += __shfl_xor_sync(0xffffffffu, dig, o2);
  if ((d & 31) == 0)
    atomicAdd(p.digest + static_cast<long long>(*p.step) * p.n_layers + p.layer, dig);
}

// The lightning indexer's cost (DSA): on every full layer each query row scores every token of
// its request's indexer key cache, IDX_ROW = 132 bytes a token (IDX_D = 128 int8 key values,
// standing in for FP8, then a float scale), with IDX_H = 64 heads of 128 dims:
//   score[q][t] = scale_t * sum_h w_h * relu(q_h . k_t),  w_h = (1 + h % 8) / 8,
// on the tensor cores (mma.sync m16n8k32 s8, sm_80+; a plain loop before). The scores land in
// a scratch buffer that nothing reads: the top-k comes from the stream generator, which stands
// in for what trained keys would select. The key cache is laid out as vLLM's indexer cache:
// blocks of IDX_BLK tokens, each the block's 128-byte keys and then their 4-byte scales, a
// request slot ceil(max_len / IDX_BLK) blocks (slot r's token p: block r * that + p / IDX_BLK),
// so a lane reads its token's keys in 16-byte loads.
#define IDX_H 64
#define IDX_D 128
#define IDX_ROW 132
#define IDX_BLK 64
#define IDX_WARPS 4
#define IDX_TOK 512  // tokens a block scores: IDX_WARPS warps x 16 tiles of 8 tokens

__device__ __forceinline__ float idx_weight(int h) {
  return 0.125f * static_cast<float>(1 + (h & 7));
}

// Token t's key block (t's block of the request's keys at base).
__device__ __forceinline__ const unsigned char* idx_block(const unsigned char* base, int t) {
  return base + static_cast<long long>(t / IDX_BLK) * (IDX_BLK * IDX_ROW);
}

__device__ __forceinline__ float idx_scale(const unsigned char* base, int t) {
  return *reinterpret_cast<const float*>(idx_block(base, t) + IDX_BLK * IDX_D +
                                         (t % IDX_BLK) * 4);
}

// A word of a head's 128 dims (32 words) that mma k-step ks's fragment register r of lane tig
// holds: the products sum over the dims, so A and B only need the same order, and this one lets
// a lane load its token's words 4 * tig .. + 3 and 16 + 4 * tig .. + 3 as two 16-byte loads.
__device__ __forceinline__ int idx_word(int tig, int ks, int r) {
  const int i = 2 * ks + r;
  return i < 4 ? tig * 4 + i : 16 + tig * 4 + i - 4;
}

// A tile of 8 tokens from t (a multiple of 8, so in one key block; rows past the length read
// the last one): lane (g, tig)'s B fragment words of token t + g (kb[2 ks + r]: idx_word(tig,
// ks, r)), and lanes g = 0 the scales of tokens t + tig * 2 (+ 1).
__device__ __forceinline__ void idx_load(const unsigned char* base, int t, int len, int g,
                                         int tig, unsigned int kb[8], float sc[2]) {
  const unsigned char* blk = idx_block(base, t);
  const uint4* kr = reinterpret_cast<const uint4*>(
      blk + (t % IDX_BLK + min(g, len - 1 - t)) * IDX_D);
  const uint4 lo = kr[tig], hi = kr[tig + 4];
  kb[0] = lo.x; kb[1] = lo.y; kb[2] = lo.z; kb[3] = lo.w;
  kb[4] = hi.x; kb[5] = hi.y; kb[6] = hi.z; kb[7] = hi.w;
  const int ta = t + tig * 2;
  float2 v = make_float2(0.0f, 0.0f);  // (the block holds IDX_BLK scales: ta + 1 is in it)
  if (g == 0 && ta < len)
    v = *reinterpret_cast<const float2*>(blk + IDX_BLK * IDX_D + (ta % IDX_BLK) * 4);
  sc[0] = v.x;
  sc[1] = ta + 1 < len ? v.y : 0.0f;
}

// The key cache of one full layer: n_rows tokens (whole key blocks) of int8 values and a scale
// in [1/512, 2/512), a function of (layer, word). grid (ceil(n_rows * 33 / 256)), 256 threads.
struct IndexFillParams {
  unsigned int* keys;     // [n_rows * IDX_ROW / 4] words
  long long n_rows;
  int layer;
  int pad;
};
HS_ABI_CHECK(IndexFillParams);

__global__ void index_fill(const IndexFillParams p) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.n_rows * (IDX_ROW / 4)) return;
  const u64 h = mix64((static_cast<u64>(p.layer) << 48) ^ static_cast<u64>(i) ^
                      0xA24BAED4963EE407ULL);
  p.keys[i] = (i % (IDX_BLK * IDX_ROW / 4) >= IDX_BLK * IDX_D / 4)
                  ? __float_as_uint((1.0f + static_cast<float>(h >> 41) * (1.0f / (1 << 23))) /
                                    512.0f)
                  : static_cast<unsigned int>(h);
}

// The step's indexer queries, int8 [Q, IDX_H, IDX_D]: a function of (step, index).
// grid (ceil(n_words / 256)), 256 threads.
struct IndexQueryParams {
  unsigned int* q;        // [n_words]
  const int* step;        // device scalar
  int n_words;
  int pad;
};
HS_ABI_CHECK(IndexQueryParams);

__global__ void index_query(const IndexQueryParams p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.n_words) return;
  p.q[i] = static_cast<unsigned int>(mix64((static_cast<u64>(*p.step) << 36) ^
                                           static_cast<u64>(i) ^ 0x3C6EF372FE94F82BULL));
}

// Query row q = b * S + s scores tokens [0, lens[b]) of request req[b]'s keys into
// scores[q * max_len + t]. grid (ceil(max_len / IDX_TOK), Q), IDX_WARPS * 32 threads; blocks
// past the length return (the grid is fixed, so a captured step replays at any length).
struct IndexerParams {
  const unsigned char* keys;  // the layer's key cache (Indexer.keys[j])
  const signed char* q;       // [Q, IDX_H * IDX_D]
  const int* req;             // [B]
  const int* lens;            // [B]
  float* scores;              // [Q, max_len]
  int S, max_len;
};
HS_ABI_CHECK(IndexerParams);

__global__ void __launch_bounds__(IDX_WARPS * 32) indexer(const IndexerParams p) {
  const signed char* const q = p.q;
  const int qrow = blockIdx.y, b = qrow / p.S, len = p.lens[b];
  const int t0 = blockIdx.x * IDX_TOK;
  if (t0 >= len) return;
  const long long slot_blocks = (p.max_len + IDX_BLK - 1) / IDX_BLK;
  const unsigned char* base = p.keys + p.req[b] * slot_blocks * (IDX_BLK * IDX_ROW);
  float* out = p.scores + static_cast<long long>(qrow) * p.max_len;
#if __CUDA_ARCH__ >= 800
  // the query row (8 KB) into shared memory in 16-byte loads, once per block; the warps build
  // their A fragments from there
  __shared__ uint4 s_q[IDX_H * IDX_D / 16];
  const uint4* qg =
      reinterpret_cast<const uint4*>(q + static_cast<long long>(qrow) * IDX_H * IDX_D);
  for (int i = threadIdx.x; i < IDX_H * IDX_D / 16; i += blockDim.x) s_q[i] = qg[i];
  __syncthreads();
  const unsigned int* qw = reinterpret_cast<const unsigned int*>(s_q);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  // A fragments (m16n8k32, row): head mt * 16 + g (+ 8), the words idx_word(tig, ks, 0) and
  // (tig, ks, 1), in the keys' order
  unsigned int a[4][4][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const int h0 = (mt * 16 + g) * (IDX_D / 4), h1 = h0 + 8 * (IDX_D / 4);
      const int w0 = idx_word(tig, ks, 0), w1 = idx_word(tig, ks, 1);
      a[mt][ks][0] = qw[h0 + w0];
      a[mt][ks][1] = qw[h1 + w0];
      a[mt][ks][2] = qw[h0 + w1];
      a[mt][ks][3] = qw[h1 + w1];
    }
  // a warp's tiles of 8 tokens, IDX_WARPS apart; the next tile's keys and scales are loaded
  // before this one's products (two tiles' loads in flight per warp)
  int t = t0 + warp * 8;
  if (t >= len) return;
  unsigned int kb[8], nb[8];
  float sc[2], nsc[2];
  idx_load(base, t, len, g, tig, kb, sc);
  for (int tile = warp;; tile += IDX_WARPS) {
    const int tn = t + IDX_WARPS * 8;
    const bool more = tile + IDX_WARPS < IDX_TOK / 8 && tn < len;
    if (more) idx_load(base, tn, len, g, tig, nb, nsc);
    int c[4][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) c[mt][0] = c[mt][1] = c[mt][2] = c[mt][3] = 0;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+r"(c[mt][0]), "+r"(c[mt][1]), "+r"(c[mt][2]), "+r"(c[mt][3])
            : "r"(a[mt][ks][0]), "r"(a[mt][ks][1]), "r"(a[mt][ks][2]), "r"(a[mt][ks][3]),
              "r"(kb[2 * ks]), "r"(kb[2 * ks + 1]));
    }
    // C: head mt * 16 + g (c0, c1) and + 8 (c2, c3); tokens t + tig * 2 (+ 1). Those heads
    // share the weight idx_weight(g): their relus sum as integers (< 2^24, exact in a float)
    int i0 = 0, i1 = 0;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      i0 += max(c[mt][0], 0) + max(c[mt][2], 0);
      i1 += max(c[mt][1], 0) + max(c[mt][3], 0);
    }
    float s0 = idx_weight(g) * static_cast<float>(i0), s1 = idx_weight(g) * static_cast<float>(i1);
    for (int o = 4; o < 32; o <<= 1) {
      s0 += __shfl_xor_sync(0xffffffffu, s0, o);
      s1 += __shfl_xor_sync(0xffffffffu, s1, o);
    }
    const int ta = t + tig * 2;
    if (g == 0 && ta < len) out[ta] = s0 * sc[0];
    if (g == 0 && ta + 1 < len) out[ta + 1] = s1 * sc[1];
    if (!more) break;
#pragma unroll
    for (int i = 0; i < 8; ++i) kb[i] = nb[i];
    sc[0] = nsc[0];
    sc[1] = nsc[1];
    t = tn;
  }
#else
  for (int i = threadIdx.x; i < IDX_TOK; i += blockDim.x) {
    const int t = t0 + i;
    if (t >= len) break;
    const unsigned char* kr = idx_block(base, t) + (t % IDX_BLK) * IDX_D;
    float s = 0.0f;
    for (int h = 0; h < IDX_H; ++h) {
      int dot = 0;
      const signed char* qh = q + static_cast<long long>(qrow) * IDX_H * IDX_D + h * IDX_D;
      const signed char* kt = reinterpret_cast<const signed char*>(kr);
      for (int d = 0; d < IDX_D; ++d) dot += static_cast<int>(qh[d]) * static_cast<int>(kt[d]);
      s += idx_weight(h) * static_cast<float>(max(dot, 0));
    }
    out[t] = s * idx_scale(base, t);
  }
#endif
}

// End of an offloaded step, after its last swap: the cache's device counters summed over its
// layers, so far (the counters were reset before step 0; the host takes differences of
// consecutive steps). acc[2 step] = sum_l weight[l] * misses_l (rows moved host -> device: a
// full layer's misses again for every shared layer its replays serve), acc[2 step + 1] =
// sum_l full[l] * misses_l. counters: uint64 [n_layers, stride], misses in column col. One
// block. Once per step (not per swap), so the tally stays off the layers' path.
struct TallyParams {
  const u64* counters;    // [n_layers, stride]
  const int* weight;      // [n_layers]
  const int* full;        // [n_layers]
  u64* acc;               // [steps, 2]
  const int* step;        // device scalar
  int n_layers, stride, col;
  int pad;
};
HS_ABI_CHECK(TallyParams);

__global__ void tally(const TallyParams p) {
  __shared__ u64 s_moved, s_full;
  if (threadIdx.x == 0) s_moved = s_full = 0;
  __syncthreads();
  u64 moved = 0, in_full = 0;
  for (int l = threadIdx.x; l < p.n_layers; l += blockDim.x) {
    const u64 m = p.counters[static_cast<long long>(l) * p.stride + p.col];
    moved += m * static_cast<u64>(p.weight[l]);
    in_full += p.full[l] ? m : 0;
  }
  atomicAdd(&s_moved, moved);
  atomicAdd(&s_full, in_full);
  __syncthreads();
  if (threadIdx.x == 0) {
    p.acc[2 * (*p.step)] = s_moved;
    p.acc[2 * (*p.step) + 1] = s_full;
  }
}

// End of a step: step += 1, every length += 1. One block.
struct TickParams {
  int* step;              // device scalar
  int* lens;              // [B]
  int B;
  int pad;
};
HS_ABI_CHECK(TickParams);

__global__ void tick(const TickParams p) {
  for (int b = threadIdx.x; b < p.B; b += blockDim.x) p.lens[b] += 1;
  if (threadIdx.x == 0) *p.step += 1;
}

// Fallback matmul when cuBLAS cannot be loaded: C[M, N] = A[M, Kd] x B[Kd, N], bf16 in and
// out, fp32 accumulation in k order; A's rows lda elements apart (B and C dense).
// grid (ceil(N / 128), ceil(M / 16)), 128 threads.
struct GemmBf16Params {
  const unsigned short* A;  // [M, Kd], rows lda apart
  const unsigned short* B;  // [Kd, N]
  unsigned short* C;        // [M, N]
  long long lda;
  int M, N, Kd;
  int pad;
};
HS_ABI_CHECK(GemmBf16Params);

__global__ void gemm_bf16(const GemmBf16Params p) {
  const unsigned short* const A = p.A;
  const unsigned short* const B = p.B;
  unsigned short* const C = p.C;
  const int M = p.M, N = p.N, Kd = p.Kd;
  const long long lda = p.lda;
  __shared__ float a_s[16][64];
  const int n = blockIdx.x * 128 + threadIdx.x, m0 = blockIdx.y * 16;
  float acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = 0.0f;
  for (int k0 = 0; k0 < Kd; k0 += 64) {
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * 64; i += 128) {
      const int mi = i / 64, kk = i % 64;
      a_s[mi][kk] = (m0 + mi < M && k0 + kk < Kd)
                        ? bf16_to_float(A[static_cast<long long>(m0 + mi) * lda + k0 + kk]) : 0.0f;
    }
    __syncthreads();
    if (n < N) {
      const int kn = min(64, Kd - k0);
      for (int kk = 0; kk < kn; ++kk) {
        const float bv = bf16_to_float(B[static_cast<long long>(k0 + kk) * N + n]);
        for (int mi = 0; mi < 16; ++mi) acc[mi] += a_s[mi][kk] * bv;
      }
    }
  }
  if (n < N)
    for (int mi = 0; mi < 16 && m0 + mi < M; ++mi)
      C[static_cast<long long>(m0 + mi) * N + n] = float_to_bf16(acc[mi]);
}

}  // namespace demo
