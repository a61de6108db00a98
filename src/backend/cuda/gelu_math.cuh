// Exact (erf) GELU device math shared by the elementwise GELU kernels (elementwise.cu) and the
// fused GEMM epilogues (gemm_gelu.cu), so that both give bit-identical results on the same
// input. fp32 math; the *_fast forms are the 16-bit activations' path.
#pragma once
#include <cuda_runtime.h>

namespace vitgrid {
namespace cuda {

constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

// The normal CDF from Abramowitz & Stegun 7.1.26 for erfc with the hardware exponential:
// absolute error <= 2.2e-7 on GELU, relative <= 1.3e-5 where |GELU| > 0.01, far below one
// bf16 / fp16 rounding (2^-9 / 2^-12), at a third of erff's instructions. e = exp(-x^2/2) is
// returned for the derivative, which shares it. (erfc directly, so no 1 + erf cancellation
// for negative x.) Constants folded: 1 + p z with z = |x| / sqrt(2) is one FMA in |x|, the
// exponential's log2(e) and -1/2 one product with x^2, and erfc's 1/2 sits in the polynomial's
// coefficients (a power of two: exact).
__device__ __forceinline__ float ex2_approx(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}
__device__ __forceinline__ float normal_cdf_fast(float x, float& e) {
  constexpr float kP = 0.3275911f * kSqrt1_2, kHalfLog2e = -0.5f * 1.44269504088896340736f;
  const float t = __fdividef(1.0f, fmaf(fabsf(x), kP, 1.0f));
  e = ex2_approx(x * x * kHalfLog2e);  // exp(-x^2 / 2)
  const float half_poly =
      t * (0.5f * 0.254829592f +
           t * (0.5f * -0.284496736f +
                t * (0.5f * 1.421413741f + t * (0.5f * -1.453152027f + t * (0.5f * 1.061405429f)))));
  const float half_erfc = half_poly * e;
  return x >= 0.0f ? 1.0f - half_erfc : half_erfc;
}

// GELU(x) = x * Phi(x).
__device__ __forceinline__ float gelu_exact_fast(float x) {
  float e;
  return x * normal_cdf_fast(x, e);
}

// GELU'(x) = Phi(x) + x * phi(x).
__device__ __forceinline__ float gelu_exact_fast_grad(float x) {
  float e;
  const float cdf = normal_cdf_fast(x, e);
  return cdf + x * kInvSqrt2Pi * e;
}

}  // namespace cuda
}  // namespace vitgrid
