// CpuBackend ops for tensor parallelism: fp32 accumulation of reduced weight gradients and
// the LayerNorm of rows whose columns are split over ranks (forward and backward side by
// side). The arithmetic is cpu_norm.cpp's, cut where a row's sums must be reduced over the
// ranks: the per-row partials are fp32, the act results rounded to the act dtype.
#include <cmath>

#include "vitgrid/backend/cpu/cpu_backend.h"

namespace vitgrid {

namespace {
inline const float* cf(const void* p) { return static_cast<const float*>(p); }
inline float* f(void* p) { return static_cast<float*>(p); }
}  // namespace

void CpuBackend::accumulate_f32(float* __restrict y, const float* __restrict x, size_t n) {
  OpScope op_scope(*this, "accumulate_f32");
  for (size_t i = 0; i < n; ++i) y[i] += x[i];
}

void CpuBackend::layernorm_split_sums(float* sum, const void* x_, int N, int C) {
  OpScope op_scope(*this, "layernorm_split_sums");
  const float* x = cf(x_);
  for (int r = 0; r < N; ++r) {
    const float* xr = x + static_cast<size_t>(r) * C;
    float s = 0.0f;
    for (int j = 0; j < C; ++j) s += xr[j];
    sum[r] = s;
  }
}

void CpuBackend::layernorm_split_centered(float* sq, float* mean, const void* x_, int N, int C,
                                          int C_total) {
  OpScope op_scope(*this, "layernorm_split_centered");
  const float* x = cf(x_);
  for (int r = 0; r < N; ++r) {
    // divided as add_layernorm_forward does (s / C): one rank gives the same mean
    const float mu = mean[r] / static_cast<float>(C_total);
    mean[r] = mu;
    const float* xr = x + static_cast<size_t>(r) * C;
    float ss = 0.0f;
    for (int j = 0; j < C; ++j) {
      const float d = xr[j] - mu;
      ss += d * d;
    }
    sq[r] = ss;
  }
}

void CpuBackend::layernorm_split_apply(void* y_, float* rstd, const void* x_, const float* mean,
                                       const void* gamma_, const void* beta_, int N, int C,
                                       int C_total, float eps) {
  OpScope op_scope(*this, "layernorm_split_apply");
  const float* x = cf(x_);
  const float* gamma = cf(gamma_);
  const float* beta = cf(beta_);
  float* y = f(y_);
  for (int r = 0; r < N; ++r) {
    const float rs = 1.0f / std::sqrt(rstd[r] / static_cast<float>(C_total) + eps);
    rstd[r] = rs;
    const float mu = mean[r];
    const float* xr = x + static_cast<size_t>(r) * C;
    float* yr = y + static_cast<size_t>(r) * C;  // may alias x: each element read first
    for (int j = 0; j < C; ++j) yr[j] = (xr[j] - mu) * rs * gamma[j] + beta[j];
    round_act(yr, C);
  }
}

void CpuBackend::layernorm_split_backward_sums(float* sums, float* dgamma, float* dbeta,
                                               const void* dy_, const void* x_, const void* gamma_,
                                               const float* mean, const float* rstd, int N, int C) {
  OpScope op_scope(*this, "layernorm_split_backward_sums");
  const float* dy = cf(dy_);
  const float* x = cf(x_);
  const float* gamma = cf(gamma_);
  for (int r = 0; r < N; ++r) {
    const float* __restrict dyr = dy + static_cast<size_t>(r) * C;
    const float* __restrict xr = x + static_cast<size_t>(r) * C;
    const float mu = mean[r], rs = rstd[r];
    float sg = 0.0f, sgx = 0.0f;
    for (int j = 0; j < C; ++j) {
      const float xh = (xr[j] - mu) * rs;
      const float g = dyr[j] * gamma[j];
      sg += g;
      sgx += g * xh;
      dgamma[j] += dyr[j] * xh;
      dbeta[j] += dyr[j];
    }
    sums[2 * static_cast<size_t>(r)] = sg;
    sums[2 * static_cast<size_t>(r) + 1] = sgx;
  }
}

void CpuBackend::layernorm_split_backward_dx(void* dx_, const void* dy_, const void* x_,
                                             const void* gamma_, const float* mean,
                                             const float* rstd, const float* sums, int N, int C,
                                             int C_total) {
  OpScope op_scope(*this, "layernorm_split_backward_dx");
  const float* dy = cf(dy_);
  const float* x = cf(x_);
  const float* gamma = cf(gamma_);
  float* dx = f(dx_);
  const float invC = 1.0f / static_cast<float>(C_total);
  for (int r = 0; r < N; ++r) {
    const float* __restrict dyr = dy + static_cast<size_t>(r) * C;
    const float* __restrict xr = x + static_cast<size_t>(r) * C;
    float* __restrict dxr = dx + static_cast<size_t>(r) * C;
    const float mu = mean[r], rs = rstd[r];
    const float mg = sums[2 * static_cast<size_t>(r)] * invC;
    const float mgx = sums[2 * static_cast<size_t>(r) + 1] * invC;
    for (int j = 0; j < C; ++j) {
      const float xh = (xr[j] - mu) * rs;
      dxr[j] += rs * (dyr[j] * gamma[j] - mg - xh * mgx);
    }
    round_act(dxr, C);
  }
}

}  // namespace vitgrid
