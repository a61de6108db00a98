// The OCP 8-bit floating point formats of FP8 training, emulated exactly on the host: the value
// of every code, the conversion from fp32 and the per-tensor scaled cast. With these the CPU
// backend can emulate FP8 GEMMs with the GPU's rounding, saturation and amaxes (so CI tests the
// scaling recipe), and GPU tests have a reference for cuBLASLt's FP8 results (issue 38).
//
//   E4M3 (OCP "E4M3FN", CUDA's __nv_fp8_e4m3): bias 7, no infinities, NaN only S.1111.111,
//        largest finite 448 = S.1111.110, smallest subnormal 2^-9.
//   E5M2 (CUDA's __nv_fp8_e5m2): bias 15, IEEE-like, inf S.11111.00, NaN S.11111.{01,10,11},
//        largest finite 57344, smallest subnormal 2^-16.
//
// The conversion rounds to nearest, ties to even, like cvt.rn on sm_89+ and CUDA's host
// __nv_cvt_float_to_fp8. An fp32 NaN becomes 0x7F in both formats, as there. Header-only so
// that tests and layers above the backend use exactly the same rounding.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "vitgrid/backend/cpu/emulate16.h"

namespace vitgrid {

enum class Fp8Format : uint8_t { E4M3, E5M2 };

inline const char* fp8_format_name(Fp8Format f) { return f == Fp8Format::E4M3 ? "e4m3" : "e5m2"; }

// Largest finite value.
constexpr float fp8_max(Fp8Format f) { return f == Fp8Format::E4M3 ? 448.0f : 57344.0f; }

namespace fp8_detail {

constexpr int mantissa_bits(Fp8Format f) { return f == Fp8Format::E4M3 ? 3 : 2; }
constexpr int exponent_bias(Fp8Format f) { return f == Fp8Format::E4M3 ? 7 : 15; }
// Code of the largest finite value (sign bit clear).
constexpr uint32_t max_code(Fp8Format f) { return f == Fp8Format::E4M3 ? 0x7Eu : 0x7Bu; }
constexpr uint8_t kNanCode = 0x7F;  // a NaN in both formats; CUDA's canonical NaN

// v / 2^s rounded to nearest, ties to even (1 <= s <= 24, v < 2^31): adding half an ulp less
// one, plus the kept lsb, carries exactly when the dropped part is above half or a tie on odd.
inline uint32_t shift_right_rne(uint32_t v, int s) {
  return (v + (1u << (s - 1)) - 1u + ((v >> s) & 1u)) >> s;
}

}  // namespace fp8_detail

// The exact value of a code: NaN codes give a quiet NaN, E5M2's inf codes +-inf.
inline float fp8_decode(uint8_t code, Fp8Format f) {
  using namespace fp8_detail;
  const int m = mantissa_bits(f);
  const uint32_t magnitude = code & 0x7Fu;
  const uint32_t exponent = magnitude >> m;
  const uint32_t mantissa = magnitude & ((1u << m) - 1u);
  const bool negative = (code & 0x80u) != 0;
  if (f == Fp8Format::E4M3 ? magnitude == 0x7Fu : exponent == 31u) {
    if (f == Fp8Format::E5M2 && mantissa == 0) {
      const float inf = std::numeric_limits<float>::infinity();
      return negative ? -inf : inf;
    }
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (exponent == 0) {  // subnormal (or zero): mantissa quanta of 2^(1 - bias - m), exact in fp32
    const float quantum = f == Fp8Format::E4M3 ? 1.0f / 512 : 1.0f / 65536;
    const float v = static_cast<float>(mantissa) * quantum;
    return negative ? -v : v;
  }
  // Normal: rebias the exponent to fp32's and place the mantissa at the top of fp32's.
  const uint32_t bits = (uint32_t{negative} << 31) |
                        ((exponent + 127u - static_cast<uint32_t>(exponent_bias(f))) << 23) |
                        (mantissa << (23 - m));
  return f32_from_bits(bits);
}

// fp32 -> FP8, round to nearest, ties to even, by integer arithmetic on the fp32 pattern.
// saturate = true is cuBLASLt's and Transformer Engine's cast (__NV_SATFINITE): finite values
// beyond the range and +-inf become +-max. saturate = false is OCP's non-saturating mode:
// what rounds beyond max (|x| > 464 in E4M3, |x| >= 61440 in E5M2, as CUDA's thresholds) and
// +-inf become NaN in E4M3, which has no infinity, and +-inf in E5M2. -0 stays -0.
inline uint8_t fp8_encode(float x, Fp8Format f, bool saturate = true) {
  using namespace fp8_detail;
  const uint32_t u = f32_bits(x);
  const uint32_t abs_bits = u & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return kNanCode;
  const uint32_t sign = (u >> 24) & 0x80u;
  const int m = mantissa_bits(f);
  const int bias = exponent_bias(f);
  const int fp32_exponent = static_cast<int>(abs_bits >> 23);
  uint32_t magnitude;  // the code without its sign, possibly past max_code (overflow)
  if (abs_bits == 0x7F800000u) {
    magnitude = max_code(f) + 1;
  } else if (fp32_exponent > 127 - bias) {
    // FP8 normal range: rebias the exponent in place and drop 23 - m mantissa bits; a carry out
    // of the mantissa bumps the exponent, as it should.
    const uint32_t rebias = static_cast<uint32_t>(127 - bias) << 23;
    magnitude = shift_right_rne(abs_bits - rebias, 23 - m);
  } else {
    // FP8 subnormal range: the significand (implicit bit included, 24 bits) counted in the
    // subnormal quantum 2^(1 - bias - m) is sig * 2^(e - 150 - (1 - bias - m)). Rounding up to
    // 2^m quanta gives the smallest normal's code, which is that same integer.
    const int shift = 150 + 1 - bias - m - fp32_exponent;
    // From 25 on, x is below half a quantum (fp32 subnormals included): it rounds to 0.
    magnitude = shift > 24 ? 0u : shift_right_rne((abs_bits & 0x7FFFFFu) | 0x800000u, shift);
  }
  if (magnitude > max_code(f)) {
    if (saturate) {
      magnitude = max_code(f);
    } else {
      return static_cast<uint8_t>(sign | (f == Fp8Format::E4M3 ? uint32_t{kNanCode} : 0x7Cu));
    }
  }
  return static_cast<uint8_t>(sign | magnitude);
}

inline float round_fp8(float x, Fp8Format f, bool saturate = true) {
  return fp8_decode(fp8_encode(x, f, saturate), f);
}

// The scaled cast of a tensor, as an FP8-producing kernel does it: out[i] = encode(x[i] * scale)
// (saturating). Returns the amax that the kernel reports for the delayed-scaling history:
// max |x[i]| of the unscaled input; an inf makes it inf and a NaN makes it NaN (as the CUDA
// cast's integer maximum of the bits does), so that the history sees the overflow upstream
// and keeps the scale (model/fp8_scaling.h) instead of scaling by the finite rest.
inline float fp8_quantize(const float* x, size_t n, float scale, Fp8Format f, uint8_t* out) {
  float amax = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (!(a <= amax) && !std::isnan(amax)) amax = a;  // a NaN is taken, then kept
    out[i] = fp8_encode(x[i] * scale, f);
  }
  return amax;
}

}  // namespace vitgrid
