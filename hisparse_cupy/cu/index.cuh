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

// The hot slot holding `tok`, or -1; `loc` gets that slot's device row (slot_locs). slot_tokens
// is authoritative: an index entry counts only if its slot still holds its token. The loads go
// in two waves: the positional slot and both buckets, then a candidate's token and row together.
__device__ __forceinline__ int hot_find(const u64* idx, int nb, const i32* stok, const i32* sloc,
                                        int H, int tok, bool degraded, int& loc) {
  const int held_pos = tok < H ? stok[tok] : -1;
  const ulonglong2* pa = reinterpret_cast<const ulonglong2*>(idx + static_cast<i64>(bucket_a(tok, nb)) * MS_BUCKET);
  const ulonglong2* pb = reinterpret_cast<const ulonglong2*>(idx + static_cast<i64>(bucket_b(tok, nb)) * MS_BUCKET);
  ulonglong2 v[MS_BUCKET];
#pragma unroll
  for (int j = 0; j < MS_BUCKET / 2; ++j) {
    v[j] = pa[j];
    v[MS_BUCKET / 2 + j] = pb[j];
  }
  if (held_pos == tok) {  // positional layout
    loc = sloc[tok];
    return tok;
  }
#pragma unroll
  for (int j = 0; j < 2 * MS_BUCKET; ++j) {
    const u64 e = (j & 1) ? v[j >> 1].y : v[j >> 1].x;
    if (lo32(e) == tok && hi32(e) < static_cast<u32>(H)) {
      const int s = static_cast<int>(hi32(e));
      const int held = stok[s];
      const int l = sloc[s];
      if (held == tok) {
        loc = l;
        return s;
      }
    }
  }
  if (degraded) {
    for (int s = 0; s < H; ++s)
      if (stok[s] == tok) {
        loc = sloc[s];
        return s;
      }
  }
  return -1;
}

// Both buckets of a token (entries [0, MS_BUCKET) of `a`, then of `b`), read at L2 (other threads
// change them with atomics) with every load in flight together.
__device__ __forceinline__ void load_buckets(const u64* a, const u64* b, u64 (&e)[2 * MS_BUCKET]) {
#pragma unroll
  for (int j = 0; j < MS_BUCKET; j += 2) {
    asm volatile("ld.global.cg.v2.u64 {%0, %1}, [%2];" : "=l"(e[j]), "=l"(e[j + 1]) : "l"(a + j));
    asm volatile("ld.global.cg.v2.u64 {%0, %1}, [%2];"
                 : "=l"(e[MS_BUCKET + j]), "=l"(e[MS_BUCKET + j + 1])
                 : "l"(b + j));
  }
}

// Insert (tok -> slot) into the emptier of the token's two buckets (the first free entry in
// bucket order); an entry is free when empty or stale (its slot no longer holds its token).
// Concurrent inserts are safe (CAS; a lost race re-reads); false when both buckets stay full
// (the caller marks the request degraded). Loads: both buckets, then the slots they name.
__device__ bool hot_insert(u64* idx, int nb, const i32* stok, int H, int tok, int slot) {
  const u64 want = pack(static_cast<u32>(slot), tok);
  u64* ba = idx + static_cast<i64>(bucket_a(tok, nb)) * MS_BUCKET;
  u64* bb = idx + static_cast<i64>(bucket_b(tok, nb)) * MS_BUCKET;
  for (int attempt = 0; attempt < 4; ++attempt) {
    u64 e[2 * MS_BUCKET];
    load_buckets(ba, bb, e);
    int held[2 * MS_BUCKET];
#pragma unroll
    for (int j = 0; j < 2 * MS_BUCKET; ++j)
      held[j] = (e[j] != EMPTY && hi32(e[j]) < static_cast<u32>(H)) ? stok[hi32(e[j])] : -1;
    unsigned free_mask = 0;
#pragma unroll
    for (int j = 0; j < 2 * MS_BUCKET; ++j) {
      const bool f = e[j] == EMPTY || hi32(e[j]) >= static_cast<u32>(H) || held[j] != lo32(e[j]);
      free_mask |= static_cast<unsigned>(f) << j;
    }
    const unsigned lo_mask = (1u << MS_BUCKET) - 1u;
    const int fa = __popc(free_mask & lo_mask);
    const int fb = bb == ba ? 0 : __popc(free_mask >> MS_BUCKET);
    if (fa + fb == 0) return false;
    const int off = fb > fa ? MS_BUCKET : 0;
    u64* bk = fb > fa ? bb : ba;
    for (int j = 0; j < MS_BUCKET; ++j) {
      if (!((free_mask >> (off + j)) & 1u)) continue;
      const u64 cur = e[off + j];
      if (atomicCAS(bk + j, cur, want) == cur) return true;
    }
  }
  return false;
}

__device__ __forceinline__ void hot_erase(u64* idx, int nb, int tok, int slot) {
  const u64 key = pack(static_cast<u32>(slot), tok);
  u64* ba = idx + static_cast<i64>(bucket_a(tok, nb)) * MS_BUCKET;
  u64* bb = idx + static_cast<i64>(bucket_b(tok, nb)) * MS_BUCKET;
  u64 e[2 * MS_BUCKET];
  load_buckets(ba, bb, e);
#pragma unroll
  for (int j = 0; j < 2 * MS_BUCKET; ++j)
    if (e[j] == key) atomicCAS((j < MS_BUCKET ? ba : bb) + (j % MS_BUCKET), key, EMPTY);
}

}  // namespace hs
