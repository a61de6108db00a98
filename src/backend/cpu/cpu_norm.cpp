// CpuBackend normalisation: fused residual-add + LayerNorm and row softmax, forward and
// backward side by side.
#include <algorithm>
#include <cmath>

#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/backend/cpu/emulate16.h"

namespace vitgrid {

namespace {
inline const float* cf(const void* p) { return static_cast<const float*>(p); }
inline float* f(void* p) { return static_cast<float*>(p); }
}  // namespace

void CpuBackend::add_layernorm_forward(void* res_, void* y_, float* mean, float* rstd,
                                       const void* a_, const void* b_, const void* gamma_,
                                       const void* beta_, int N, int C, float eps,
                                       RowFactors bf) {
  OpScope op_scope(*this, "add_layernorm_forward");
  const float* a = cf(a_);
  const float* b = cf(b_);
  const float* gamma = cf(gamma_);
  const float* beta = cf(beta_);
  float* res = f(res_);
  float* y = f(y_);
  for (int r = 0; r < N; ++r) {
    float* xr = res + (size_t)r * C;  // may alias a's row: each element read before written
    const float* ar = a + (size_t)r * C;
    if (b) {
      const float* br = b + (size_t)r * C;
      if (bf.f) {  // the branch as a dropout pass leaves it: the product rounded, +0 if dropped
        const float fr = bf.f[r / bf.rows_per];
        for (int j = 0; j < C; ++j)
          xr[j] = ar[j] + (fr != 0.0f ? round_to(act_, br[j] * fr) : 0.0f);
      } else {
        for (int j = 0; j < C; ++j) xr[j] = ar[j] + br[j];
      }
      // The residual stream is an act tensor: round before the statistics see it, so the
      // statistics match the stored input the backward will read.
      round_act(xr, C);
    } else if (xr != ar) {
      for (int j = 0; j < C; ++j) xr[j] = ar[j];
    }
    // Two passes (mean, then centred squares) avoid the cancellation of E[x^2] - E[x]^2 on
    // residual streams with a large mean.
    float s = 0.0f;
    for (int j = 0; j < C; ++j) s += xr[j];
    const float mu = s / (float)C;
    float ss = 0.0f;
    for (int j = 0; j < C; ++j) {
      const float d = xr[j] - mu;
      ss += d * d;
    }
    const float rs = 1.0f / std::sqrt(ss / (float)C + eps);
    mean[r] = mu;
    rstd[r] = rs;
    float* __restrict yr = y + (size_t)r * C;
    for (int j = 0; j < C; ++j) yr[j] = (xr[j] - mu) * rs * gamma[j] + beta[j];
    round_act(yr, C);
  }
}

void CpuBackend::layernorm_backward(void* dx_, float* dgamma, float* dbeta, const void* dy_,
                                    const void* x_, const void* gamma_, const float* mean,
                                    const float* rstd, int N, int C, float* dsum,
                                    void* dbranch_, RowFactors bf) {
  OpScope op_scope(*this, "layernorm_backward");
  const float* dy = cf(dy_);
  const float* x = cf(x_);
  const float* gamma = cf(gamma_);
  float* dx = f(dx_);
  const float invC = 1.0f / (float)C;
  for (int r = 0; r < N; ++r) {
    const float* __restrict dyr = dy + (size_t)r * C;
    const float* __restrict xr = x + (size_t)r * C;
    const float mu = mean[r], rs = rstd[r];
    // With xhat = (x - mu) rstd and g = dy gamma:
    //   dx = rstd (g - mean(g) - xhat mean(g xhat)).
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int j = 0; j < C; ++j) {
      const float xh = (xr[j] - mu) * rs;
      const float g = dyr[j] * gamma[j];
      sum_g += g;
      sum_gx += g * xh;
      dgamma[j] += dyr[j] * xh;
      dbeta[j] += dyr[j];
    }
    const float mg = sum_g * invC, mgx = sum_gx * invC;
    float* __restrict dxr = dx + (size_t)r * C;
    for (int j = 0; j < C; ++j) {
      const float xh = (xr[j] - mu) * rs;
      dxr[j] += rs * (dyr[j] * gamma[j] - mg - xh * mgx);
    }
    round_act(dxr, C);
  }
  if (!bf.f) {
    if (dsum) add_column_sums(dsum, dx, N, C);
    return;
  }
  float* db = f(dbranch_);
  for (int r = 0; r < N; ++r) {
    const float fr = bf.f[r / bf.rows_per];
    for (int j = 0; j < C; ++j) {
      const size_t i = (size_t)r * C + j;
      db[i] = fr != 0.0f ? dx[i] * fr : 0.0f;
    }
    round_act(db + (size_t)r * C, C);
  }
  if (dsum) add_column_sums(dsum, db, N, C);
}

void CpuBackend::softmax_forward(void* y_, const void* x_, int rows, int cols, float scale) {
  OpScope op_scope(*this, "softmax_forward");
  const float* x = cf(x_);
  float* y = f(y_);
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + (size_t)r * cols;
    float* yr = y + (size_t)r * cols;  // may alias x
    // The max of scale*x is scale*max(x) for scale >= 0 and scale*min(x) otherwise.
    float mx = -INFINITY;
    for (int j = 0; j < cols; ++j) mx = std::max(mx, scale * xr[j]);
    float s = 0.0f;
    for (int j = 0; j < cols; ++j) {
      yr[j] = std::exp(scale * xr[j] - mx);
      s += yr[j];
    }
    const float inv = 1.0f / s;
    for (int j = 0; j < cols; ++j) yr[j] *= inv;
    round_act(yr, cols);
  }
}

void CpuBackend::softmax_backward(void* dx_, const void* y_, const void* dy_, int rows, int cols,
                                  float scale) {
  OpScope op_scope(*this, "softmax_backward");
  const float* y = cf(y_);
  const float* dy = cf(dy_);
  float* dx = f(dx_);
  for (int r = 0; r < rows; ++r) {
    const float* yr = y + (size_t)r * cols;
    const float* dyr = dy + (size_t)r * cols;
    float* dxr = dx + (size_t)r * cols;  // may alias dy: the dot is taken first
    float dot = 0.0f;
    for (int j = 0; j < cols; ++j) dot += dyr[j] * yr[j];
    for (int j = 0; j < cols; ++j) dxr[j] = yr[j] * (dyr[j] - dot) * scale;
    round_act(dxr, cols);
  }
}

}  // namespace vitgrid
