// CPU backend elementwise and normalisation ops: GELU, dropout, add/accumulate/scale,
// fused residual LayerNorm, softmax. Forward against double references, backward against
// central finite differences of those references (tolerances as in test_cpu_gemm.cpp:
// fp32 kernels on O(1) data, atol 2e-5 / rtol 1e-4 unless stated).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend_test_util.h"
#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/core/rng.h"

namespace {

using vgtest::all_close;
using vgtest::fd_grad;
using vgtest::randn;
using vgtest::to_d;
using vitgrid::CpuBackend;
using vitgrid::DropoutKey;
using vitgrid::Gelu;

constexpr double kAtol = 2e-5, kRtol = 1e-4;

double ref_gelu(double x, Gelu g) {
  if (g == Gelu::Exact) return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

TEST(CpuElementwise, GeluForwardBackwardBothForms) {
  CpuBackend be;
  // Odd count spanning the tails and zero.
  std::vector<float> x = vgtest::randu(37, 1, -5.0f, 5.0f);
  x[0] = 0.0f;
  x[1] = -8.0f;
  x[2] = 8.0f;
  auto dy = randn(x.size(), 2);
  for (Gelu g : {Gelu::Exact, Gelu::Tanh}) {
    std::vector<float> y(x.size()), dx(x.size());
    be.gelu_forward(y.data(), x.data(), x.size(), g);
    std::vector<double> ref(x.size());
    for (size_t i = 0; i < x.size(); ++i) ref[i] = ref_gelu(x[i], g);
    EXPECT_TRUE(all_close(y, ref, kAtol, kRtol)) << "gelu " << (int)g;

    be.gelu_backward(dx.data(), x.data(), dy.data(), x.size(), g);
    for (size_t i = 0; i < x.size(); ++i) {
      const double h = 1e-5;
      const double fd = (ref_gelu(x[i] + h, g) - ref_gelu(x[i] - h, g)) / (2 * h);
      EXPECT_NEAR(dx[i], dy[i] * fd, kAtol + kRtol * std::fabs(dy[i] * fd)) << i;
    }
    // dx may alias dy.
    std::vector<float> inplace = dy;
    be.gelu_backward(inplace.data(), x.data(), inplace.data(), x.size(), g);
    EXPECT_EQ(inplace, dx);
  }
}

// gelu_backward_bias: the GELU backward of a [rows, cols] matrix, and the column sums of the
// result added into db; linear_backward's gelu_db is the same pass.
TEST(CpuElementwise, GeluBackwardBiasSumsTheColumnsOfDx) {
  CpuBackend be;
  const int rows = 9, cols = 7, in = 5;
  const auto x = randn(size_t(rows) * cols, 3), dy = randn(size_t(rows) * cols, 4);
  const auto db0 = randn(cols, 5);
  std::vector<float> dx(x.size()), ref(x.size()), db = db0;
  be.gelu_backward(ref.data(), x.data(), dy.data(), x.size(), Gelu::Exact);
  be.gelu_backward_bias(dx.data(), x.data(), dy.data(), rows, cols, db.data(), Gelu::Exact);
  EXPECT_EQ(dx, ref);
  for (int j = 0; j < cols; ++j) {
    double t = db0[j];
    for (int r = 0; r < rows; ++r) t += ref[size_t(r) * cols + j];
    EXPECT_NEAR(db[j], t, 1e-5) << j;
  }
  std::vector<float> none = dy;  // db null: the plain GELU backward, in place
  be.gelu_backward_bias(none.data(), x.data(), none.data(), rows, cols, nullptr, Gelu::Exact);
  EXPECT_EQ(none, ref);
  // linear_backward with gelu_pre = x: dx = (g W) * gelu'(x), gelu_db += its column sums
  const auto g = randn(size_t(rows) * in, 6), W = randn(size_t(in) * cols, 7);
  std::vector<float> ldx(x.size()), ldx2(x.size()), dW(W.size(), 0.0f), ldb = db0;
  be.linear_backward(ldx.data(), dW.data(), nullptr, g.data(), dy.data(), W.data(), rows, cols,
                     in, x.data(), Gelu::Exact, ldb.data());
  be.linear_backward(ldx2.data(), dW.data(), nullptr, g.data(), dy.data(), W.data(), rows, cols,
                     in, x.data(), Gelu::Exact);
  EXPECT_EQ(ldx, ldx2);
  for (int j = 0; j < cols; ++j) {
    double t = db0[j];
    for (int r = 0; r < rows; ++r) t += ldx[size_t(r) * cols + j];
    EXPECT_NEAR(ldb[j], t, 1e-5) << j;
  }
}

TEST(CpuElementwise, DropoutMaskStatisticsDeterminismAndLayoutIndependence) {
  CpuBackend be;
  const size_t n = 100003;
  const float p = 0.3f;
  const DropoutKey key{42, 7, 1000};
  auto x = vgtest::randu(n, 3, 0.5f, 2.0f);  // no zeros, so zeros in y are exactly the drops
  std::vector<float> y(n), y2(n);
  be.dropout_forward(y.data(), x.data(), n, p, key);
  be.dropout_forward(y2.data(), x.data(), n, p, key);
  EXPECT_EQ(y, y2) << "a pure function of (seed, key, counter)";

  size_t dropped = 0;
  const float s = 1.0f / (1.0f - p);
  for (size_t i = 0; i < n; ++i) {
    const bool keep = vitgrid::dropout_keep(vitgrid::rng_stream(key.seed, key.key),
                                            key.counter_base + i, vitgrid::dropout_threshold(p));
    ASSERT_EQ(y[i], keep ? x[i] * s : 0.0f) << i;
    dropped += !keep;
  }
  // Drop fraction within 5 standard deviations (sqrt(p(1-p)/n) = 0.00145) of p.
  EXPECT_NEAR((double)dropped / n, p, 5 * std::sqrt(p * (1 - p) / n));

  // Backward applies the same mask to the gradient (recomputed, not stored); in place too.
  auto dy = vgtest::randu(n, 4, 0.5f, 2.0f);
  std::vector<float> dx = dy;
  be.dropout_backward(dx.data(), dx.data(), n, p, key);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(dx[i] == 0.0f, y[i] == 0.0f) << i;
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(dx[i], y[i] == 0.0f ? 0.0f : dy[i] * s) << i;

  // A call whose element 0 has global index base + k equals elements k.. of the base call:
  // the mask depends on global indices only, so any sharding of a tensor gets the same mask.
  const size_t k = 777;
  std::vector<float> part(n - k);
  be.dropout_forward(part.data(), x.data() + k, n - k, p, DropoutKey{42, 7, 1000 + k});
  for (size_t i = 0; i < n - k; ++i) ASSERT_EQ(part[i], y[k + i]) << i;

  // Another stream key gives another mask.
  be.dropout_forward(y2.data(), x.data(), n, p, DropoutKey{42, 8, 1000});
  EXPECT_NE(y, y2);

  // p = 0 copies; p = 1 drops everything (no 0 * inf NaNs).
  be.dropout_forward(y2.data(), x.data(), n, 0.0f, key);
  EXPECT_EQ(y2, x);
  be.dropout_forward(y2.data(), x.data(), n, 1.0f, key);
  for (float v : y2) ASSERT_EQ(v, 0.0f);
}

TEST(CpuElementwise, AddAccumulateScale) {
  CpuBackend be;
  const size_t n = 101;
  auto a = randn(n, 5), b = randn(n, 6);
  std::vector<float> y(n);
  be.add(y.data(), a.data(), b.data(), n);
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(y[i], a[i] + b[i]);
  std::vector<float> acc = a;
  be.accumulate(acc.data(), b.data(), n);
  EXPECT_EQ(acc, y);
  be.add(a.data(), a.data(), b.data(), n);  // y aliases a
  EXPECT_EQ(a, y);
  be.scale_f32(y.data(), n, -0.25f);
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(y[i], acc[i] * -0.25f);
}

// ---- LayerNorm

struct LnRef {
  std::vector<double> res, y, mean, rstd;
};

LnRef ref_add_layernorm(const std::vector<double>& a, const std::vector<double>* b,
                        const std::vector<double>& gamma, const std::vector<double>& beta, int N,
                        int C, double eps) {
  LnRef r;
  r.res = a;
  if (b)
    for (size_t i = 0; i < a.size(); ++i) r.res[i] += (*b)[i];
  r.y.resize(a.size());
  for (int n = 0; n < N; ++n) {
    double m = 0.0, v = 0.0;
    for (int c = 0; c < C; ++c) m += r.res[(size_t)n * C + c];
    m /= C;
    for (int c = 0; c < C; ++c) v += std::pow(r.res[(size_t)n * C + c] - m, 2);
    v /= C;
    const double rs = 1.0 / std::sqrt(v + eps);
    r.mean.push_back(m);
    r.rstd.push_back(rs);
    for (int c = 0; c < C; ++c)
      r.y[(size_t)n * C + c] = (r.res[(size_t)n * C + c] - m) * rs * gamma[c] + beta[c];
  }
  return r;
}

TEST(CpuNorm, AddLayernormForwardFusedResidual) {
  const int N = 6, C = 19;
  const float eps = 1e-6f;
  CpuBackend be;
  auto a = randn((size_t)N * C, 7, 2.0f), b = randn((size_t)N * C, 8);
  for (auto& v : a) v += 3.0f;  // a residual stream with a mean: tests the centred variance
  auto gamma = randn(C, 9), beta = randn(C, 10);
  auto ad = to_d(a), bd = to_d(b), gd = to_d(gamma), btd = to_d(beta);
  std::vector<float> res((size_t)N * C), y((size_t)N * C), mean(N), rstd(N);

  be.add_layernorm_forward(res.data(), y.data(), mean.data(), rstd.data(), a.data(), b.data(),
                           gamma.data(), beta.data(), N, C, eps);
  LnRef r = ref_add_layernorm(ad, &bd, gd, btd, N, C, eps);
  EXPECT_TRUE(all_close(res, r.res, 1e-6, 1e-6));
  EXPECT_TRUE(all_close(y, r.y, kAtol, kRtol));
  EXPECT_TRUE(all_close(mean, r.mean, kAtol, kRtol));
  EXPECT_TRUE(all_close(rstd, r.rstd, kAtol, kRtol));

  // b null: res = a; and res aliasing a.
  std::vector<float> a2 = a, y2((size_t)N * C);
  be.add_layernorm_forward(a2.data(), y2.data(), mean.data(), rstd.data(), a2.data(), nullptr,
                           gamma.data(), beta.data(), N, C, eps);
  LnRef r2 = ref_add_layernorm(ad, nullptr, gd, btd, N, C, eps);
  EXPECT_EQ(a2, a);
  EXPECT_TRUE(all_close(y2, r2.y, kAtol, kRtol));
  // Fused in place: res aliases a with b given.
  a2 = a;
  be.add_layernorm_forward(a2.data(), y2.data(), mean.data(), rstd.data(), a2.data(), b.data(),
                           gamma.data(), beta.data(), N, C, eps);
  EXPECT_TRUE(all_close(a2, r.res, 1e-6, 1e-6));
  EXPECT_TRUE(all_close(y2, r.y, kAtol, kRtol));
}

TEST(CpuNorm, LayernormBackwardFiniteDifferencesAndAccumulation) {
  const int N = 5, C = 23;
  const float eps = 1e-5f;
  CpuBackend be;
  auto x = randn((size_t)N * C, 11, 1.5f), gamma = randn(C, 12), beta = randn(C, 13);
  auto dy = randn((size_t)N * C, 14);
  std::vector<float> res((size_t)N * C), y((size_t)N * C), mean(N), rstd(N);
  be.add_layernorm_forward(res.data(), y.data(), mean.data(), rstd.data(), x.data(), nullptr,
                           gamma.data(), beta.data(), N, C, eps);
  // Accumulators start non-zero: dx is the residual-stream gradient, dgamma/dbeta sum over
  // micro-batches.
  auto dx0 = randn((size_t)N * C, 15), dg0 = randn(C, 16), db0 = randn(C, 17);
  std::vector<float> dx = dx0, dg = dg0, db = db0;
  be.layernorm_backward(dx.data(), dg.data(), db.data(), dy.data(), res.data(), gamma.data(),
                        mean.data(), rstd.data(), N, C);

  const auto R = to_d(dy);
  auto xd = to_d(x), gd = to_d(gamma), bd = to_d(beta);
  auto L = [&](const std::vector<double>& xx, const std::vector<double>& gg,
               const std::vector<double>& bb) {
    return vgtest::dot(R, ref_add_layernorm(xx, nullptr, gg, bb, N, C, eps).y);
  };
  auto gx = fd_grad([&](const std::vector<double>& v) { return L(v, gd, bd); }, xd);
  auto gg = fd_grad([&](const std::vector<double>& v) { return L(xd, v, bd); }, gd);
  auto gb = fd_grad([&](const std::vector<double>& v) { return L(xd, gd, v); }, bd);
  EXPECT_TRUE(all_close(dx, vgtest::add(gx, dx0), 1e-4, 1e-4));
  EXPECT_TRUE(all_close(dg, vgtest::add(gg, dg0), 1e-4, 1e-4));
  EXPECT_TRUE(all_close(db, vgtest::add(gb, db0), 1e-4, 1e-4));

  // With dsum: the same dx, and dsum += its column sums (a Row Linear's bias gradient), here
  // against the finite-difference dx
  std::vector<float> dx2 = dx0, dg2 = dg0, db2 = db0, ds = randn(C, 18), ds0 = ds;
  be.layernorm_backward(dx2.data(), dg2.data(), db2.data(), dy.data(), res.data(), gamma.data(),
                        mean.data(), rstd.data(), N, C, ds.data());
  EXPECT_EQ(dx2, dx);
  EXPECT_EQ(dg2, dg);
  EXPECT_EQ(db2, db);
  const auto dx_ref = vgtest::add(gx, dx0);
  std::vector<double> ds_ref(ds0.begin(), ds0.end());
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) ds_ref[c] += dx_ref[(size_t)r * C + c];
  EXPECT_TRUE(all_close(ds, ds_ref, 1e-4, 1e-4));
}

// ---- softmax

std::vector<double> ref_softmax(const std::vector<double>& x, int rows, int cols, double scale) {
  std::vector<double> y(x.size());
  for (int r = 0; r < rows; ++r) {
    double mx = -1e300, s = 0.0;
    for (int c = 0; c < cols; ++c) mx = std::max(mx, scale * x[(size_t)r * cols + c]);
    for (int c = 0; c < cols; ++c) s += (y[(size_t)r * cols + c] = std::exp(scale * x[(size_t)r * cols + c] - mx));
    for (int c = 0; c < cols; ++c) y[(size_t)r * cols + c] /= s;
  }
  return y;
}

TEST(CpuNorm, SoftmaxForwardBackwardWithScale) {
  const int rows = 4, cols = 9;
  CpuBackend be;
  auto x = randn((size_t)rows * cols, 21, 3.0f), dy = randn((size_t)rows * cols, 22);
  x[0] = 80.0f;  // large logits must not overflow: the max is subtracted
  for (float scale : {0.37f, -0.5f, 1.0f}) {
    std::vector<float> y(x.size()), dx(x.size());
    be.softmax_forward(y.data(), x.data(), rows, cols, scale);
    EXPECT_TRUE(all_close(y, ref_softmax(to_d(x), rows, cols, scale), 1e-6, kRtol)) << scale;
    be.softmax_backward(dx.data(), y.data(), dy.data(), rows, cols, scale);
    const auto R = to_d(dy);
    auto g = fd_grad([&](const std::vector<double>& v) {
      return vgtest::dot(R, ref_softmax(v, rows, cols, scale));
    }, to_d(x));
    EXPECT_TRUE(all_close(dx, g, kAtol, kRtol)) << scale;
  }
}

}  // namespace

// Tensor parallelism: a rank holding columns [off, off + cols) of rows of global width W must
// draw exactly the mask elements of the 1-rank buffer at those positions.
TEST(CpuElementwise, DropoutColumnBlockMatchesGlobalBuffer) {
  vitgrid::CpuBackend be;
  const int R = 7, W = 13, cols = 5, off = 6;
  std::vector<float> ones(size_t(R) * W, 1.0f), full(size_t(R) * W), part(size_t(R) * cols);
  vitgrid::DropoutKey k;
  k.seed = 3;
  k.key = 99;
  k.counter_base = 1000;
  be.dropout_forward(full.data(), ones.data(), full.size(), 0.4f, k);
  k.cols = cols;
  k.global_cols = W;
  k.col_offset = off;
  be.dropout_forward(part.data(), ones.data(), part.size(), 0.4f, k);
  int dropped = 0;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) {
      ASSERT_EQ(part[r * cols + c], full[r * W + off + c]) << r << "," << c;
      dropped += part[r * cols + c] == 0.0f;
    }
  EXPECT_GT(dropped, 0);
  EXPECT_LT(dropped, R * cols);
}

// Drop path (stochastic depth): whole samples dropped at rate path_p, with the elements'
// dropout on top; kept values scale by 1/(1-p) * 1/(1-path_p); a sample's verdict depends on
// its global index only, so a column block of the rows (tensor parallelism) and a later part
// of the batch (another rank's samples) see the same verdicts.
TEST(CpuElementwise, DropPathDropsWholeSamples) {
  vitgrid::CpuBackend be;
  const int S = 400, T = 3, W = 8;  // samples of T rows of W
  const size_t per = size_t(T) * W, n = S * per;
  std::vector<float> ones(n, 1.0f), y(n);
  for (float p : {0.0f, 0.2f}) {
    vitgrid::DropoutKey k;
    k.seed = 11;
    k.key = 5;
    k.counter_base = 640;
    k.path_p = 0.25f;
    k.path_sample0 = 100;
    k.path_sample_elems = per;
    be.dropout_forward(y.data(), ones.data(), n, p, k);
    const float scale = vitgrid::dropout_scale(p, 0.25f);
    EXPECT_FLOAT_EQ(scale, 1.0f / (1.0f - p) / 0.75f);
    int dropped = 0;
    for (int s = 0; s < S; ++s) {
      const bool kept = vitgrid::drop_path_keep(k.seed, k.key, 100 + s,
                                                vitgrid::dropout_threshold(0.25f));
      dropped += !kept;
      for (size_t i = 0; i < per; ++i) {
        const float v = y[s * per + i];
        if (!kept) {
          ASSERT_EQ(v, 0.0f) << "sample " << s;
        } else if (p == 0.0f) {
          ASSERT_EQ(v, scale) << "sample " << s;
        } else {
          ASSERT_TRUE(v == 0.0f || v == scale) << "sample " << s;
        }
      }
    }
    // 25% of 400 samples, within 5 standard deviations (8.7 samples)
    EXPECT_NEAR(dropped, 100, 44) << "p = " << p;
    // samples 150.. of the same stream (path_sample0 250, their counters) in a call of their own
    vitgrid::DropoutKey later = k;
    later.path_sample0 = 250;
    later.counter_base = k.counter_base + 150 * per;
    std::vector<float> part((S - 150) * per);
    be.dropout_forward(part.data(), ones.data(), part.size(), p, later);
    for (size_t i = 0; i < part.size(); ++i) ASSERT_EQ(part[i], y[150 * per + i]) << i;
    // columns [2, 5) of every row: a column block, 3 local elements per row
    vitgrid::DropoutKey blk = k;
    blk.cols = 3;
    blk.global_cols = W;
    blk.col_offset = 2;
    blk.path_sample_elems = size_t(T) * 3;
    std::vector<float> cols(size_t(S) * T * 3);
    be.dropout_forward(cols.data(), ones.data(), cols.size(), p, blk);
    for (size_t r = 0; r < size_t(S) * T; ++r)
      for (int c = 0; c < 3; ++c) ASSERT_EQ(cols[r * 3 + c], y[r * W + 2 + c]) << r << "," << c;
  }
}

TEST(CpuNorm, LayernormRowFactorsAreTheDropPathPassFused) {
  // Drop path in the LayerNorms (RowFactors): the forward's residual add with the branch's
  // rows times their samples' factors, and the backward's branch gradient (with its column
  // sums), give what the separate drop-path pass does, bit for bit, in fp32 and emulated bf16.
  const int S = 24, T = 3, C = 16, N = S * T;
  const size_t n = size_t(N) * C;
  vitgrid::DropoutKey k;
  k.seed = 3;
  k.key = 77;
  k.path_p = 0.4f;
  k.path_sample0 = 9;
  k.path_sample_elems = size_t(T) * C;
  for (vitgrid::DType dt : {vitgrid::DType::F32, vitgrid::DType::BF16}) {
    SCOPED_TRACE(dt == vitgrid::DType::F32 ? "fp32" : "bf16");
    vitgrid::CpuBackend be(dt);
    std::vector<float> f(S);
    be.drop_path_factors(f.data(), S, k);
    int dropped = 0;
    for (int s = 0; s < S; ++s) {
      const bool kept =
          vitgrid::drop_path_keep(k.seed, k.key, 9 + s, vitgrid::dropout_threshold(0.4f));
      EXPECT_EQ(f[s], kept ? vitgrid::dropout_scale(0.0f, 0.4f) : 0.0f) << "sample " << s;
      dropped += !kept;
    }
    ASSERT_GT(dropped, 0);
    ASSERT_LT(dropped, S);
    auto rounded = [&](std::vector<float> v) {  // act tensors hold act values
      be.cast_to_act(v.data(), v.data(), v.size());
      return v;
    };
    const auto a = rounded(randn(n, 1)), b = rounded(randn(n, 2)), dy = rounded(randn(n, 3)),
               dx0 = rounded(randn(n, 4));
    const auto g = rounded(vgtest::randu(C, 5, 0.5f, 1.5f)), beta = rounded(randn(C, 6));
    // unfused: a pass over b, then the add; the backward, then a pass over dx and its sums
    std::vector<float> bd(n), r0(n), y0(n), m0(N), s0(N), dx_u = dx0, dg0(C, 0.f), dbt0(C, 0.f),
        br0(n), sum0(C, 0.f);
    be.dropout_forward(bd.data(), b.data(), n, 0.0f, k);
    be.add_layernorm_forward(r0.data(), y0.data(), m0.data(), s0.data(), a.data(), bd.data(),
                             g.data(), beta.data(), N, C, 1e-6f);
    be.layernorm_backward(dx_u.data(), dg0.data(), dbt0.data(), dy.data(), r0.data(), g.data(),
                          m0.data(), s0.data(), N, C);
    be.dropout_backward(br0.data(), dx_u.data(), n, 0.0f, k);
    for (int r = 0; r < N; ++r)  // (the backend's order: row by row)
      for (int c = 0; c < C; ++c) sum0[c] += br0[size_t(r) * C + c];
    // fused
    std::vector<float> r1(n), y1(n), m1(N), s1(N), dx_f = dx0, dg1(C, 0.f), dbt1(C, 0.f),
        br1(n), sum1(C, 0.f);
    const vitgrid::RowFactors rf{f.data(), T};
    be.add_layernorm_forward(r1.data(), y1.data(), m1.data(), s1.data(), a.data(), b.data(),
                             g.data(), beta.data(), N, C, 1e-6f, rf);
    be.layernorm_backward(dx_f.data(), dg1.data(), dbt1.data(), dy.data(), r1.data(), g.data(),
                          m1.data(), s1.data(), N, C, sum1.data(), br1.data(), rf);
    EXPECT_EQ(r1, r0);
    EXPECT_EQ(y1, y0);
    EXPECT_EQ(dx_f, dx_u);
    EXPECT_EQ(br1, br0);
    EXPECT_EQ(sum1, sum0);
    EXPECT_EQ(dg1, dg0);
    // dropped samples' rows: the residual alone, and a zero branch gradient
    for (int s = 0; s < S; ++s)
      if (f[s] == 0.0f)
        for (size_t i = size_t(s) * T * C; i < size_t(s + 1) * T * C; ++i) {
          ASSERT_EQ(r1[i], a[i]);
          ASSERT_EQ(br1[i], 0.0f);
        }
  }
}
