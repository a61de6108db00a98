// CPU backend tensor-parallel ops: accumulate_f32 and the LayerNorm of rows split over ranks.
// The split is simulated in one process: the global rows [N, Ct] are cut into P column
// blocks (the "ranks"), each block runs the ops on its own contiguous [N, Ct/P] buffer, and
// the per-row partials are summed over the blocks between the ops (what the strategy's
// allreduce does). Results are compared with a double-precision LayerNorm forward and its
// analytic backward on the same (fp32) inputs, and with the fused unsplit ops.
// Tolerances: fp32 kernels on O(1) data, atol 2e-5 / rtol 1e-4 (test_cpu_elementwise.cpp's);
// the large-mean case (|mean| = 1000, std 1) holds rstd to 1e-4 relative, which a one-pass
// E[x^2] - E[x]^2 in fp32 misses by orders of magnitude.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend_test_util.h"
#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/backend/cpu/emulate16.h"

namespace {

using vgtest::all_close;
using vgtest::randn;
using vitgrid::CpuBackend;
using vitgrid::DType;

constexpr double kAtol = 2e-5, kRtol = 1e-4;

struct LnRef {
  std::vector<double> y, mean, rstd, dx, dgamma, dbeta;
};

// Double-precision LayerNorm of x[N,C] and its analytic backward for dy:
// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy gamma; dgamma = sum dy xhat; dbeta = sum dy.
LnRef ref_layernorm(const std::vector<float>& x, const std::vector<float>& gamma,
                    const std::vector<float>& beta, const std::vector<float>& dy, int N, int C,
                    double eps) {
  LnRef r;
  r.y.resize(size_t(N) * C);
  r.dx.resize(size_t(N) * C);
  r.mean.resize(N);
  r.rstd.resize(N);
  r.dgamma.assign(C, 0.0);
  r.dbeta.assign(C, 0.0);
  for (int i = 0; i < N; ++i) {
    const float* xr = &x[size_t(i) * C];
    const float* dyr = &dy[size_t(i) * C];
    double m = 0;
    for (int j = 0; j < C; ++j) m += xr[j];
    m /= C;
    double v = 0;
    for (int j = 0; j < C; ++j) v += (xr[j] - m) * (xr[j] - m);
    const double rs = 1.0 / std::sqrt(v / C + eps);
    r.mean[i] = m;
    r.rstd[i] = rs;
    double sg = 0, sgx = 0;
    for (int j = 0; j < C; ++j) {
      const double xh = (xr[j] - m) * rs;
      r.y[size_t(i) * C + j] = xh * gamma[j] + beta[j];
      const double g = double(dyr[j]) * gamma[j];
      sg += g;
      sgx += g * xh;
      r.dgamma[j] += double(dyr[j]) * xh;
      r.dbeta[j] += dyr[j];
    }
    for (int j = 0; j < C; ++j) {
      const double xh = (xr[j] - m) * rs;
      r.dx[size_t(i) * C + j] = rs * (double(dyr[j]) * gamma[j] - sg / C - xh * sgx / C);
    }
  }
  return r;
}

// Column block p of P of a row-major [N, C] matrix, as its own contiguous [N, C/P] buffer.
std::vector<float> block(const std::vector<float>& g, int N, int C, int P, int p) {
  const int Cl = C / P;
  std::vector<float> out(size_t(N) * Cl);
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < Cl; ++j) out[size_t(i) * Cl + j] = g[size_t(i) * C + p * Cl + j];
  return out;
}
// The inverse: the blocks side by side.
std::vector<float> unblock(const std::vector<std::vector<float>>& b, int N, int C) {
  const int P = static_cast<int>(b.size()), Cl = C / P;
  std::vector<float> g(size_t(N) * C);
  for (int p = 0; p < P; ++p)
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < Cl; ++j) g[size_t(i) * C + p * Cl + j] = b[p][size_t(i) * Cl + j];
  return g;
}

// Sums the per-row partials of every block (the allreduce over the hidden axis) into each.
void reduce(std::vector<std::vector<float>>& parts) {
  std::vector<float> s(parts[0].size(), 0.0f);
  for (const auto& v : parts)
    for (size_t i = 0; i < s.size(); ++i) s[i] += v[i];
  for (auto& v : parts) v = s;
}

struct SplitResult {
  std::vector<float> y, mean, rstd, dx, dgamma, dbeta;
};

// The split LayerNorm forward and backward over P column blocks, as a strategy runs it.
SplitResult run_split(CpuBackend& be, const std::vector<float>& x, const std::vector<float>& gamma,
                      const std::vector<float>& beta, const std::vector<float>& dy,
                      const std::vector<float>& dx0, int N, int C, int P, float eps) {
  const int Cl = C / P;
  std::vector<std::vector<float>> xb(P), gb(P), bb(P), dyb(P), dxb(P), yb(P), mean(P), rstd(P),
      sums(P), dg(P), dbt(P);
  for (int p = 0; p < P; ++p) {
    xb[p] = block(x, N, C, P, p);
    gb[p] = block(gamma, 1, C, P, p);
    bb[p] = block(beta, 1, C, P, p);
    dyb[p] = block(dy, N, C, P, p);
    dxb[p] = block(dx0, N, C, P, p);
    yb[p].assign(size_t(N) * Cl, NAN);
    mean[p].assign(N, NAN);
    rstd[p].assign(N, NAN);
    sums[p].assign(2 * size_t(N), NAN);
    dg[p].assign(Cl, 0.25f);  // accumulated into
    dbt[p].assign(Cl, -0.5f);
  }
  for (int p = 0; p < P; ++p) be.layernorm_split_sums(mean[p].data(), xb[p].data(), N, Cl);
  reduce(mean);
  for (int p = 0; p < P; ++p)
    be.layernorm_split_centered(rstd[p].data(), mean[p].data(), xb[p].data(), N, Cl, C);
  reduce(rstd);
  for (int p = 0; p < P; ++p)
    be.layernorm_split_apply(yb[p].data(), rstd[p].data(), xb[p].data(), mean[p].data(),
                             gb[p].data(), bb[p].data(), N, Cl, C, eps);
  for (int p = 0; p < P; ++p)
    be.layernorm_split_backward_sums(sums[p].data(), dg[p].data(), dbt[p].data(), dyb[p].data(),
                                     xb[p].data(), gb[p].data(), mean[p].data(), rstd[p].data(), N,
                                     Cl);
  reduce(sums);
  for (int p = 0; p < P; ++p)
    be.layernorm_split_backward_dx(dxb[p].data(), dyb[p].data(), xb[p].data(), gb[p].data(),
                                   mean[p].data(), rstd[p].data(), sums[p].data(), N, Cl, C);
  SplitResult r;
  r.y = unblock(yb, N, C);
  r.dx = unblock(dxb, N, C);
  r.dgamma = unblock(dg, 1, C);
  r.dbeta = unblock(dbt, 1, C);
  r.mean = mean[0];
  r.rstd = rstd[0];
  for (int p = 1; p < P; ++p) {  // every block holds the same statistics
    EXPECT_EQ(mean[p], mean[0]);
    EXPECT_EQ(rstd[p], rstd[0]);
  }
  return r;
}

TEST(CpuTpOps, AccumulateF32IsExactAndNeverRounded) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    CpuBackend be(dt);
    std::vector<float> y = {1.0f + 1.0f / 1024.0f, -3.0f, 1e-30f, 7.0f, 70000.0f};
    const std::vector<float> x = {1.0f / 4096.0f, 0.5f, 1e-30f, -7.0f, 1.0f};
    std::vector<float> want(y.size());
    for (size_t i = 0; i < y.size(); ++i) want[i] = y[i] + x[i];
    be.accumulate_f32(y.data(), x.data(), y.size());
    EXPECT_EQ(y, want) << "act dtype " << int(dt) << ": fp32 gradients are not rounded";
  }
}

TEST(CpuTpOps, SplitLayerNormMatchesDoubleReference) {
  CpuBackend be;
  const int N = 7, C = 24;
  const float eps = 1e-6f;
  auto x = randn(size_t(N) * C, 11);
  for (size_t i = 0; i < x.size(); ++i) x[i] += 3.0f * float(i % 5);  // row means differ
  auto gamma = randn(C, 12), beta = randn(C, 13), dy = randn(size_t(N) * C, 14);
  auto dx0 = randn(size_t(N) * C, 15, 0.1f);  // dx accumulates onto the residual gradient
  const LnRef ref = ref_layernorm(x, gamma, beta, dy, N, C, eps);
  for (int P : {1, 2, 3, 4}) {
    SCOPED_TRACE("blocks " + std::to_string(P));
    const SplitResult r = run_split(be, x, gamma, beta, dy, dx0, N, C, P, eps);
    EXPECT_TRUE(all_close(r.y, ref.y, kAtol, kRtol)) << "y";
    EXPECT_TRUE(all_close(r.mean, ref.mean, kAtol, kRtol)) << "mean";
    EXPECT_TRUE(all_close(r.rstd, ref.rstd, kAtol, kRtol)) << "rstd";
    EXPECT_TRUE(all_close(r.dx, vgtest::add(ref.dx, dx0), kAtol, kRtol)) << "dx";
    std::vector<double> dg(C), db(C);
    for (int j = 0; j < C; ++j) {
      dg[j] = ref.dgamma[j] + 0.25;
      db[j] = ref.dbeta[j] - 0.5;
    }
    EXPECT_TRUE(all_close(r.dgamma, dg, kAtol, kRtol)) << "dgamma";
    EXPECT_TRUE(all_close(r.dbeta, db, kAtol, kRtol)) << "dbeta";
  }
}

TEST(CpuTpOps, SplitLayerNormOnOneBlockEqualsFusedOps) {
  // One block is the unsplit LayerNorm: the same arithmetic as add_layernorm_forward /
  // layernorm_backward, so the results agree to the last bits (the backward's dgamma/dbeta
  // and dx sums run in the same order).
  CpuBackend be;
  const int N = 5, C = 33;
  const float eps = 1e-6f;
  auto x = randn(size_t(N) * C, 21);
  auto gamma = randn(C, 22), beta = randn(C, 23), dy = randn(size_t(N) * C, 24);
  auto dx0 = randn(size_t(N) * C, 25, 0.1f);
  std::vector<float> res(x.size()), y(x.size()), mean(N), rstd(N), dx = dx0, dg(C, 0.25f),
                                                                   dbt(C, -0.5f);
  be.add_layernorm_forward(res.data(), y.data(), mean.data(), rstd.data(), x.data(), nullptr,
                           gamma.data(), beta.data(), N, C, eps);
  be.layernorm_backward(dx.data(), dg.data(), dbt.data(), dy.data(), res.data(), gamma.data(),
                        mean.data(), rstd.data(), N, C);
  const SplitResult r = run_split(be, x, gamma, beta, dy, dx0, N, C, 1, eps);
  EXPECT_EQ(r.mean, mean);
  EXPECT_EQ(r.rstd, rstd);
  EXPECT_EQ(r.y, y);
  EXPECT_EQ(r.dx, dx);
  EXPECT_EQ(r.dgamma, dg);
  EXPECT_EQ(r.dbeta, dbt);
}

TEST(CpuTpOps, SplitLayerNormLargeMeanIsNumericallySound) {
  // Residual streams can carry a mean far above their spread: with |mean| = 1000 and std 1
  // the two-pass statistics keep rstd within 1e-4 relative (one pass would lose ~1e6 * 6e-8
  // of a variance of 1 to cancellation in fp32, several percent).
  CpuBackend be;
  const int N = 6, C = 64;
  const float eps = 1e-6f;
  auto x = randn(size_t(N) * C, 31);
  for (size_t i = 0; i < x.size(); ++i) x[i] += (i / C) % 2 ? 1000.0f : -1000.0f;
  auto gamma = randn(C, 32), beta = randn(C, 33), dy = randn(size_t(N) * C, 34);
  std::vector<float> dx0(x.size(), 0.0f);
  const LnRef ref = ref_layernorm(x, gamma, beta, dy, N, C, eps);
  for (int P : {2, 4}) {
    const SplitResult r = run_split(be, x, gamma, beta, dy, dx0, N, C, P, eps);
    EXPECT_TRUE(all_close(r.rstd, ref.rstd, 0.0, 1e-4)) << "rstd, blocks " << P;
    // y and dx inherit the fp32 representation error of x - mean (|x| ~ 1000: 6e-5 absolute)
    EXPECT_TRUE(all_close(r.y, ref.y, 1e-3, 1e-3)) << "y, blocks " << P;
    EXPECT_TRUE(all_close(r.dx, ref.dx, 1e-3, 1e-3)) << "dx, blocks " << P;
  }
}

TEST(CpuTpOps, SplitLayerNormEmulated16BitRoundsActResultsOnly) {
  // In bf16/fp16 mode y and dx (act dtype) are rounded to the format, the statistics and the
  // parameter gradients (fp32) are not; the values stay within the format's precision of
  // the double reference (bf16: 2^-8 relative per rounding, fp16: 2^-11).
  const int N = 4, C = 32;
  const float eps = 1e-6f;
  for (DType dt : {DType::BF16, DType::F16}) {
    CpuBackend be(dt);
    auto x = randn(size_t(N) * C, 41), gamma = randn(C, 42), beta = randn(C, 43),
         dy = randn(size_t(N) * C, 44);
    for (auto* v : {&x, &gamma, &beta, &dy})
      for (auto& e : *v) e = vitgrid::round_to(dt, e);  // act inputs are representable
    std::vector<float> dx0(x.size(), 0.0f);
    const LnRef ref = ref_layernorm(x, gamma, beta, dy, N, C, eps);
    const SplitResult r = run_split(be, x, gamma, beta, dy, dx0, N, C, 2, eps);
    for (float v : r.y) EXPECT_EQ(v, vitgrid::round_to(dt, v));
    for (float v : r.dx) EXPECT_EQ(v, vitgrid::round_to(dt, v));
    const double rt = dt == DType::BF16 ? 1e-2 : 2e-3;
    EXPECT_TRUE(all_close(r.y, ref.y, rt, rt)) << "y";
    EXPECT_TRUE(all_close(r.dx, ref.dx, rt, rt)) << "dx";
    EXPECT_TRUE(all_close(r.rstd, ref.rstd, kAtol, kRtol)) << "rstd (fp32)";
    EXPECT_TRUE(all_close(
        r.dgamma,
        [&] {
          std::vector<double> d(ref.dgamma);
          for (auto& e : d) e += 0.25;
          return d;
        }(),
        kAtol, kRtol))
        << "dgamma (fp32)";
  }
}

}  // namespace
