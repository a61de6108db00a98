// CpuBackend's FP8 ops (backend.h Fp8Ops): the reference the CUDA backend's FP8 casts and
// cuBLASLt FP8 GEMMs are tested against. Codes are made and read by backend/fp8.h (the OCP
// formats, exactly); the GEMM sums the decoded values in fp32 (OpenBLAS), as the tensor cores
// sum the exact products of two FP8 values, and rounds once to the act dtype.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vitgrid/backend/cpu/cpu_backend.h"

namespace vitgrid {

bool CpuBackend::fp8_supported(std::string* why) const {
  (void)why;
  return true;  // emulated
}

void CpuBackend::fp8_cast(uint8_t* out, uint8_t* out_t, float* amax, const void* x_, int rows,
                          int cols, const float* scale, Fp8Format f, const Gelu* gelu_in) {
  OpScope op_scope(*this, "fp8_cast");
  check_fp8_cast_args(out, out_t, amax, rows, cols, scale);
  const float* x = static_cast<const float*>(x_);
  const size_t n = static_cast<size_t>(rows) * cols;
  std::vector<float> g;  // gelu_in: the values gelu_forward stores
  if (gelu_in) {
    g.resize(n);
    gelu_forward(g.data(), x, n, *gelu_in);
    x = g.data();
  }
  std::vector<uint8_t> codes;
  uint8_t* dst = out;
  if (!dst) {
    codes.resize(n);
    dst = codes.data();
  }
  const float m = fp8_quantize(x, n, scale[0], f, dst);
  // a NaN, this call's or an earlier one's, stays (as the CUDA kernel's maximum of the bits)
  if (!std::isnan(*amax) && (std::isnan(m) || m > *amax)) *amax = m;
  if (out_t) {
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c)
        out_t[static_cast<size_t>(c) * rows + r] = dst[static_cast<size_t>(r) * cols + c];
  }
}

void CpuBackend::add_layernorm_forward_fp8(void* res, uint8_t* out, uint8_t* out_t,
                                           float* amax, const float* scale, Fp8Format f,
                                           float* mean, float* rstd, const void* a,
                                           const void* b, const void* gamma, const void* beta,
                                           int N, int C, float eps, RowFactors bf) {
  OpScope op_scope(*this, "add_layernorm_forward_fp8");
  check_fp8_cast_args(out, out_t, amax, N, C, scale);
  std::vector<float> y(static_cast<size_t>(std::max(N, 0)) * std::max(C, 0));
  add_layernorm_forward(res, y.data(), mean, rstd, a, b, gamma, beta, N, C, eps, bf);
  fp8_cast(out, out_t, amax, y.data(), N, C, scale, f);
}

void CpuBackend::fp8_cast_grad(uint8_t* out, uint8_t* out_t, float* amax, const void* dy_,
                               int rows, int cols, const float* scale, Fp8Format f, float* db,
                               const void* gelu_pre, Gelu g) {
  OpScope op_scope(*this, "fp8_cast_grad");
  check_fp8_cast_args(out, out_t, amax, rows, cols, scale);
  const float* dy = static_cast<const float*>(dy_);
  std::vector<float> grad;  // gelu_pre: the values gelu_backward stores
  if (gelu_pre) {
    grad.resize(static_cast<size_t>(rows) * cols);
    gelu_backward(grad.data(), gelu_pre, dy, grad.size(), g);
    dy = grad.data();
  }
  fp8_cast(out, out_t, amax, dy, rows, cols, scale, f);
  if (db) add_column_sums(db, dy, rows, cols);
}

void CpuBackend::fp8_gemm(void* D, bool d_f32, float beta, const uint8_t* A, Fp8Format fa,
                          const float* a_scale_inv, const uint8_t* B, Fp8Format fb,
                          const float* b_scale_inv, int M, int N, int K, const void* bias) {
  OpScope op_scope(*this, "fp8_gemm");
  check_fp8_gemm_args(d_f32, beta, fa, a_scale_inv, fb, b_scale_inv, M, N, K, bias);
  if (M == 0 || N == 0) return;
  auto decode = [](const uint8_t* codes, size_t n, Fp8Format fmt) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = fp8_decode(codes[i], fmt);
    return v;
  };
  const std::vector<float> a = decode(A, static_cast<size_t>(M) * K, fa);
  const std::vector<float> b = decode(B, static_cast<size_t>(N) * K, fb);
  std::vector<float> acc(static_cast<size_t>(M) * N, 0.0f);
  if (K > 0)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, a.data(), K, b.data(),
                K, 0.0f, acc.data(), N);
  const float factor = a_scale_inv[0] * b_scale_inv[0];
  float* d = static_cast<float*>(D);
  const float* bs = static_cast<const float*>(bias);
  for (int r = 0; r < M; ++r) {
    for (int c = 0; c < N; ++c) {
      const size_t i = static_cast<size_t>(r) * N + c;
      float v = acc[i] * factor;
      if (bs) v += bs[c];
      d[i] = d_f32 && beta != 0.0f ? v + beta * d[i] : v;
    }
  }
  if (!d_f32) round_act(d, static_cast<size_t>(M) * N);
}

}  // namespace vitgrid
