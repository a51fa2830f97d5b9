// hisparse_cupy: the per-layer checksum of a prefill -> decode transfer (hisparse_cupy._kernels.sums).
//
// layer_sums(base, layer_stride_words, words, first, out): blockIdx.y is the layer. Its `words`
// 64-bit words start at base + layer * layer_stride_words; the one at i is word first + i of the
// layer's stream and adds mix(w + (first + i + 1) * GOLDEN) to out[layer] (mod 2^64), mix the
// splitmix64 finalizer. A sum of per-word terms, so a receiver adds up its pages' runs (one
// launch each, `first` the run's offset; `base` may be host memory mapped for the device) in any
// order; the index in each term makes a moved row count. Each thread sums a grid-stride slice,
// the warp reduces it and its lane 0 adds it with one atomic. `out` is added to (zero it before
// the first launch). NumPy computes the same sum (_sums.py); the GPU test compares the two.
#include "abi.cuh"

namespace hs {

__device__ __forceinline__ unsigned long long sum_term(unsigned long long w, unsigned long long i) {
  unsigned long long x = w + (i + 1ull) * 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void layer_sums(const unsigned long long* __restrict__ base, long long layer_stride_words,
                           long long words, long long first, unsigned long long* __restrict__ out) {
  const unsigned long long* p = base + static_cast<long long>(blockIdx.y) * layer_stride_words;
  unsigned long long s = 0;
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += step) {
    s += sum_term(p[i], static_cast<unsigned long long>(first + i));
  }
  for (int d = 16; d > 0; d >>= 1) s += __shfl_down_sync(0xffffffffu, s, d);
  if ((threadIdx.x & 31) == 0 && s) atomicAdd(out + blockIdx.y, s);
}

}  // namespace hs
