// GELU's forms on the device and its forward and backward as elementwise ops, shared by the
// elementwise kernels (elementwise.cu) and the FP8 casts that apply GELU or its backward to
// their input (fp8.cu), so both store the same values.
#pragma once
#include <type_traits>

#include "gelu_math.cuh"
#include "vitgrid/backend/backend.h"

namespace vitgrid {
namespace cuda {

constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluC = 0.044715f;

// GELU in fp32 math, in one of three forms fixed at compile time (a run-time choice would be
// if-converted: every form computed for every element, then one selected): the tanh
// approximation; exact with erff (fp32 activations: the build keeps full-precision
// erff/expf/tanhf); exact with the A&S erfc formula of gelu_math.cuh (16-bit activations,
// shared with the fused GEMM epilogues).
enum class GeluForm { Tanh, Erf, ErfFast };
template <GeluForm F>
using GeluFormTag = std::integral_constant<GeluForm, F>;

// f(GeluFormTag<...>{}) for activation type T and the deck's GELU.
template <class T, class Fn>
void with_gelu_form(Gelu g, Fn&& f) {
  if (g == Gelu::Tanh) {
    f(GeluFormTag<GeluForm::Tanh>{});
  } else if (sizeof(T) == 2) {
    f(GeluFormTag<GeluForm::ErfFast>{});
  } else {
    f(GeluFormTag<GeluForm::Erf>{});
  }
}

template <GeluForm F>
struct GeluFwdOp {
  __device__ float operator()(const float* v, size_t) const {
    const float x = v[0];
    if constexpr (F == GeluForm::Tanh) {
      const float u = kSqrt2OverPi * (x + kGeluC * x * x * x);
      return 0.5f * x * (1.0f + tanhf(u));
    } else if constexpr (F == GeluForm::ErfFast) {
      return gelu_exact_fast(x);
    } else {
      return 0.5f * x * (1.0f + erff(x * kSqrt1_2));
    }
  }
};

// GELU's backward as an elementwise op: dy * gelu'(x), in the form's fp32 math.
template <GeluForm F>
struct GeluBwdOp {  // v = {x, dy}
  __device__ float operator()(const float* v, size_t) const {
    const float x = v[0], dy = v[1];
    float d;
    if constexpr (F == GeluForm::Tanh) {
      const float u = kSqrt2OverPi * (x + kGeluC * x * x * x);
      const float t = tanhf(u);
      d = 0.5f * (1.0f + t) +
          0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluC * x * x);
    } else if constexpr (F == GeluForm::ErfFast) {
      d = gelu_exact_fast_grad(x);
    } else {
      d = 0.5f * (1.0f + erff(x * kSqrt1_2)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
    }
    return dy * d;
  }
};

}  // namespace cuda
}  // namespace vitgrid
