// Rounding of fp32 values to the precision and range of the 16-bit activation formats.
// The CPU backend stores activations in fp32 but, in bf16/fp16 mode, passes every act-dtype
// result through these so that loss scaling and overflow behave as they would on a GPU
// (a 70000 in fp16 becomes +inf, 1 + 2^-9 in bf16 becomes 1). Header-only so tests and
// other layers (data, optim) can use exactly the same rounding.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vitgrid/core/types.h"

namespace vitgrid {

inline uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// bf16: keep the top 16 bits of the fp32 pattern, rounding the dropped 16 bits to nearest,
// ties to even. bf16 shares fp32's exponent range, so overflow (to inf) and subnormals fall
// out of the same integer rounding; NaN stays NaN (the carry could otherwise turn it into inf).
inline float round_bf16(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return x;  // NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return f32_from_bits(u & 0xFFFF0000u);
}

// fp16 (IEEE binary16): 10 mantissa bits, largest finite 65504, smallest normal 2^-14,
// subnormal quantum 2^-24. Round to nearest, ties to even, as a hardware conversion does.
inline float round_f16(float x) {
  uint32_t u = f32_bits(x);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return x;  // inf or NaN unchanged
  // 65520 is the midpoint between 65504 and 2^16; ties-to-even sends it (and above) to inf.
  if (a >= 0x477FF000u) return std::copysign(std::numeric_limits<float>::infinity(), x);
  if (a < 0x38800000u) {  // below 2^-14: fp16 subnormal, a multiple of 2^-24
    // Scaling by a power of two is exact, and nearbyint rounds ties to even in the default
    // rounding mode, so this is the correctly rounded subnormal.
    const float q = std::nearbyint(std::fabs(x) * 16777216.0f);
    return std::copysign(q * (1.0f / 16777216.0f), x);
  }
  // Normal range: drop 13 of the 23 mantissa bits with round-to-nearest-even; a carry out of
  // the mantissa correctly bumps the exponent.
  u += 0x0FFFu + ((u >> 13) & 1u);
  return f32_from_bits(u & ~0x1FFFu);
}

// Rounds to the given activation dtype (identity for F32).
inline float round_to(DType t, float x) {
  return t == DType::BF16 ? round_bf16(x) : (t == DType::F16 ? round_f16(x) : x);
}

// In-place rounding of a buffer; no-op for F32.
inline void round_buffer(DType t, float* p, size_t n) {
  if (t == DType::BF16) {
    for (size_t i = 0; i < n; ++i) p[i] = round_bf16(p[i]);
  } else if (t == DType::F16) {
    for (size_t i = 0; i < n; ++i) p[i] = round_f16(p[i]);
  }
}

}  // namespace vitgrid
