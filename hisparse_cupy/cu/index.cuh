// hisparse_cupy: the multi-step token -> hot-slot index of a request (one layer).
//
// NB buckets of MS_BUCKET entries (64 bytes); an entry is (slot << 32 | token), EMPTY = ~0. A
// token lives in bucket_a(token) or bucket_b(token) (two hash functions). slot_tokens is
// authoritative: an entry counts only while its slot still holds its token, and a stale entry
// is free for an insert. The multi-step kernels read and maintain it; the single-step resolve
// maintains it too when the cache holds multi-step state, so both policies share one hot buffer.
#pragma once

#include "abi.cuh"

namespace hs {

constexpr u64 EMPTY = ~0ull;

__device__ __forceinline__ u32 mix32(u32 x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}
// h -> [0, n) by the high half of a 32x32 product (any n, not only powers of two)
__device__ __forceinline__ int reduce(u32 h, int n) {
  return static_cast<int>((static_cast<u64>(h) * static_cast<u32>(n)) >> 32);
}
__device__ __forceinline__ int bucket_a(int tok, int nb) {
  return reduce(hash_u32(static_cast<u32>(tok)), nb);
}
__device__ __forceinline__ int bucket_b(int tok, int nb) {
  return reduce(mix32(static_cast<u32>(tok)), nb);
}
__device__ __forceinline__ u64 pack(u32 hi, int lo) {
  return (static_cast<u64>(hi) << 32) | static_cast<u32>(lo);
}
__device__ __forceinline__ int lo32(u64 e) { return static_cast<int>(static_cast<u32>(e)); }
__device__ __forceinline__ u32 hi32(u64 e) { return static_cast<u32>(e >> 32); }
__device__ __forceinline__ u64 load_volatile(const u64* p) {
  return *reinterpret_cast<const volatile u64*>(p);
}

// ---------------------------------------------------------------- token -> hot slot index

// The hot slot holding `tok`, or -1. slot_tokens is authoritative: an index entry counts only
// if its slot still holds its token.
__device__ __forceinline__ int hot_find(const u64* idx, int nb, const i32* stok, int H, int tok,
                                        bool degraded) {
  if (tok < H && stok[tok] == tok) return tok;  // positional layout
  const ulonglong2* pa = reinterpret_cast<const ulonglong2*>(idx + static_cast<i64>(bucket_a(tok, nb)) * MS_BUCKET);
  const ulonglong2* pb = reinterpret_cast<const ulonglong2*>(idx + static_cast<i64>(bucket_b(tok, nb)) * MS_BUCKET);
  ulonglong2 v[MS_BUCKET];
#pragma unroll
  for (int j = 0; j < MS_BUCKET / 2; ++j) {
    v[j] = pa[j];
    v[MS_BUCKET / 2 + j] = pb[j];
  }
#pragma unroll
  for (int j = 0; j < MS_BUCKET; ++j) {
    if (lo32(v[j].x) == tok) {
      const u32 s = hi32(v[j].x);
      if (s < static_cast<u32>(H) && stok[s] == tok) return static_cast<int>(s);
    }
    if (lo32(v[j].y) == tok) {
      const u32 s = hi32(v[j].y);
      if (s < static_cast<u32>(H) && stok[s] == tok) return static_cast<int>(s);
    }
  }
  if (degraded) {
    for (int s = 0; s < H; ++s)
      if (stok[s] == tok) return s;
  }
  return -1;
}

// An entry is free when empty or stale (its slot no longer holds its token).
__device__ __forceinline__ bool entry_free(u64 e, const i32* stok, int H) {
  if (e == EMPTY) return true;
  const u32 s = hi32(e);
  return s >= static_cast<u32>(H) || stok[s] != lo32(e);
}

__device__ __forceinline__ int count_free(const u64* bk, const i32* stok, int H) {
  int n = 0;
#pragma unroll
  for (int j = 0; j < MS_BUCKET; ++j) n += entry_free(load_volatile(bk + j), stok, H);
  return n;
}

// Insert (tok -> slot) into the emptier of the token's two buckets. Concurrent inserts are safe
// (CAS); false when both buckets stay fu64 (the caller marks the request degraded).
__device__ bool hot_insert(u64* idx, int nb, const i32* stok, int H, int tok, int slot) {
  const u64 want = pack(static_cast<u32>(slot), tok);
  u64* ba = idx + static_cast<i64>(bucket_a(tok, nb)) * MS_BUCKET;
  u64* bb = idx + static_cast<i64>(bucket_b(tok, nb)) * MS_BUCKET;
  for (int attempt = 0; attempt < 4; ++attempt) {
    const int fa = count_free(ba, stok, H);
    const int fb = bb == ba ? 0 : count_free(bb, stok, H);
    if (fa + fb == 0) return false;
    u64* bk = fb > fa ? bb : ba;
    for (int j = 0; j < MS_BUCKET; ++j) {
      const u64 cur = load_volatile(bk + j);
      if (entry_free(cur, stok, H) && atomicCAS(bk + j, cur, want) == cur) return true;
    }
  }
  return false;
}

__device__ __forceinline__ void hot_erase(u64* idx, int nb, int tok, int slot) {
  const u64 key = pack(static_cast<u32>(slot), tok);
  u64* bks[2] = {idx + static_cast<i64>(bucket_a(tok, nb)) * MS_BUCKET,
                 idx + static_cast<i64>(bucket_b(tok, nb)) * MS_BUCKET};
#pragma unroll
  for (int k = 0; k < 2; ++k)
    for (int j = 0; j < MS_BUCKET; ++j)
      if (load_volatile(bks[k] + j) == key) atomicCAS(bks[k] + j, key, EMPTY);
}

}  // namespace hs
