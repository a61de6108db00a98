// Counter-based random streams: every random number is a pure function of
// (seed, stream key, counter), so a parameter's element, a dropout mask bit, a crop offset or a
// Mixup draw comes out the same whatever rank computes it (DESIGN.md: same model whatever the
// layout). Usable from host and device code.
#pragma once
#include <cstdint>
#include <cmath>

#if defined(__CUDACC__)
#define VG_HD __host__ __device__ __forceinline__
#else
#define VG_HD inline
#endif

namespace vitgrid {

// splitmix64 finaliser: a strong 64-bit mixer.
VG_HD uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The random 64-bit word number `counter` of stream (seed, key), in two parts for callers that
// draw many words of one stream: rng_u64(seed, key, c) == rng_word(rng_stream(seed, key), c).
VG_HD uint64_t rng_stream(uint64_t seed, uint64_t key) { return mix64(seed ^ mix64(key)); }
VG_HD uint64_t rng_word(uint64_t stream, uint64_t counter) {
  return mix64(stream + counter * 0xD1B54A32D192ED03ull);
}
VG_HD uint64_t rng_u64(uint64_t seed, uint64_t key, uint64_t counter) {
  return rng_word(rng_stream(seed, key), counter);
}

// Uniform in [0, 1) with 24 bits (exactly representable in fp32).
VG_HD float rng_uniform(uint64_t seed, uint64_t key, uint64_t counter) {
  return (float)(rng_u64(seed, key, counter) >> 40) * (1.0f / 16777216.0f);
}

// Standard normal via Box-Muller on two 32-bit halves of one word (uses one counter).
VG_HD float rng_normal(uint64_t seed, uint64_t key, uint64_t counter) {
  uint64_t w = rng_u64(seed, key, counter);
  float u1 = ((float)(w >> 40) + 1.0f) * (1.0f / 16777217.0f);  // (0, 1]
  float u2 = (float)((w >> 8) & 0xFFFFFFull) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cosf(6.283185307179586f * u2);
}

// Truncated normal in [-2 std, 2 std] by resampling on a sub-counter (timm's trunc_normal_).
VG_HD float rng_trunc_normal(uint64_t seed, uint64_t key, uint64_t counter, float std) {
  for (uint64_t k = 0; k < 64; ++k) {
    float z = rng_normal(seed, key, counter * 64 + k);
    if (z >= -2.0f && z <= 2.0f) return z * std;
  }
  return 0.0f;
}

// FNV-1a of a string: the stream key of a named parameter or purpose.
inline uint64_t key_of(const char* s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; ++s) h = (h ^ (uint8_t)*s) * 1099511628211ull;
  return h;
}

// Streams used across the code base (keys mixed with step / layer where needed).
enum RngStream : uint64_t {
  kStreamInit = 1,      // parameter init: key_of(name) ^ this
  kStreamShuffle = 2,   // epoch permutation of the dataset
  kStreamAugment = 3,   // crop / flip per (step, global sample)
  kStreamMixup = 4,     // lambda and partner per (step, global sample)
  kStreamDropout = 5,   // dropout masks per (step, micro, layer site, global element)
  kStreamSynthetic = 6, // the synthetic dataset's images
  kStreamCrop = 7,      // RandomResizedCrop draws per global sample
  kStreamCutmix = 8     // CutMix box and the Mixup/CutMix switch per global sample
};

}  // namespace vitgrid
