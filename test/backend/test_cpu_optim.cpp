// CPU backend reductions and optimizers against hand-written double-precision loops of the
// PyTorch algorithms (torch/optim/adamw.py, sgd.py; LAMB as in the header), three steps with
// changing gradients and learning rates, weight decay on one slice only, a grad_scale, and a
// gap between the slices that must stay untouched.
//
// Tolerance: fp32 state over three steps against double: atol 1e-6, rtol 1e-5 on O(1) values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backend_test_util.h"
#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/core/error.h"

namespace {

using vgtest::all_close;
using vgtest::randn;
using vgtest::to_d;
using vitgrid::AdamParams;
using vitgrid::CpuBackend;
using vitgrid::ParamSlice;

constexpr double kAtol = 1e-6, kRtol = 1e-5;

// Two slices with a 3-element gap: [0, 13) decayed, [16, 23) not.
const std::vector<ParamSlice> kSlices = {{0, 13, 0.05f}, {16, 7, 0.0f}};
constexpr size_t kTotal = 26;  // three more trailing elements, untouched too
const float kLr[3] = {1e-2f, 8e-3f, 5e-3f};

bool in_slice(size_t i, const ParamSlice& s) { return i >= s.offset && i < s.offset + s.n; }
double wd_of(size_t i) {
  for (const auto& s : kSlices)
    if (in_slice(i, s)) return s.weight_decay;
  return -1.0;  // gap
}

TEST(CpuOptim, AdamWThreeStepsMatchesPyTorchSemantics) {
  CpuBackend be;
  const float b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, gs = 0.5f;
  auto p = randn(kTotal, 1);
  std::vector<float> m(kTotal, 0.0f), v(kTotal, 0.0f);
  auto pd = to_d(p);
  std::vector<double> md(kTotal, 0.0), vd(kTotal, 0.0);
  for (int t = 1; t <= 3; ++t) {
    auto g = randn(kTotal, 10 + t, 3.0f);
    be.adamw_update(p.data(), g.data(), m.data(), v.data(), kSlices,
                    AdamParams{kLr[t - 1], b1, b2, eps, t, gs});
    for (size_t i = 0; i < kTotal; ++i) {
      const double wd = wd_of(i);
      if (wd < 0) continue;
      const double gi = (double)g[i] * gs, lr = kLr[t - 1];
      md[i] = b1 * md[i] + (1 - (double)b1) * gi;
      vd[i] = b2 * vd[i] + (1 - (double)b2) * gi * gi;
      const double mhat = md[i] / (1 - std::pow((double)b1, t));
      const double vhat = vd[i] / (1 - std::pow((double)b2, t));
      pd[i] -= lr * (mhat / (std::sqrt(vhat) + eps) + wd * pd[i]);
    }
  }
  EXPECT_TRUE(all_close(p, pd, kAtol, kRtol));
  EXPECT_TRUE(all_close(m, md, kAtol, kRtol));
  EXPECT_TRUE(all_close(v, vd, kAtol, kRtol));
  EXPECT_THROW(be.adamw_update(p.data(), p.data(), m.data(), v.data(), kSlices,
                               AdamParams{1e-3f, b1, b2, eps, 0, 1.0f}),
               vitgrid::UserError);
}

TEST(CpuOptim, LambDirectionAndApplyThreeSteps) {
  CpuBackend be;
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-6f, gs = 0.25f;
  auto p = randn(kTotal, 2);
  std::vector<float> m(kTotal, 0.0f), v(kTotal, 0.0f), u(kTotal, 0.0f);
  auto pd = to_d(p);
  std::vector<double> md(kTotal, 0.0), vd(kTotal, 0.0), ud(kTotal, 0.0);
  for (int t = 1; t <= 3; ++t) {
    auto g = randn(kTotal, 20 + t, 2.0f);
    be.lamb_direction(u.data(), p.data(), g.data(), m.data(), v.data(), kSlices,
                      AdamParams{kLr[t - 1], b1, b2, eps, t, gs});
    for (size_t i = 0; i < kTotal; ++i) {
      const double wd = wd_of(i);
      if (wd < 0) continue;
      const double gi = (double)g[i] * gs;
      md[i] = b1 * md[i] + (1 - (double)b1) * gi;
      vd[i] = b2 * vd[i] + (1 - (double)b2) * gi * gi;
      const double mhat = md[i] / (1 - std::pow((double)b1, t));
      const double vhat = vd[i] / (1 - std::pow((double)b2, t));
      ud[i] = mhat / (std::sqrt(vhat) + eps) + wd * pd[i];
    }
    ASSERT_TRUE(all_close(u, ud, kAtol, kRtol)) << "step " << t;
    // The trust ratio ||p|| / ||u|| per slice is the caller's; computed here from the
    // backend's own sum_squares.
    std::vector<double> pn(kSlices.size()), un(kSlices.size());
    be.sum_squares(pn.data(), p.data(), kSlices);
    be.sum_squares(un.data(), u.data(), kSlices);
    std::vector<float> ratio(kSlices.size());
    for (size_t s = 0; s < kSlices.size(); ++s) ratio[s] = (float)std::sqrt(pn[s] / un[s]);
    be.lamb_apply(p.data(), u.data(), kSlices, ratio, kLr[t - 1]);
    for (size_t s = 0; s < kSlices.size(); ++s)
      for (size_t i = kSlices[s].offset; i < kSlices[s].offset + kSlices[s].n; ++i)
        pd[i] -= (double)kLr[t - 1] * ratio[s] * ud[i];
  }
  EXPECT_TRUE(all_close(p, pd, kAtol, kRtol));
}

TEST(CpuOptim, SgdMomentumAndNesterovThreeSteps) {
  CpuBackend be;
  const float mu = 0.9f, gs = 0.5f;
  for (bool nesterov : {false, true}) {
    auto p = randn(kTotal, 3);
    std::vector<float> buf(kTotal, 0.0f);  // zero-initialised, as the trainer plans it
    auto pd = to_d(p);
    std::vector<double> bd;  // PyTorch: no buffer until the first step clones d_p
    for (int t = 1; t <= 3; ++t) {
      auto g = randn(kTotal, 30 + t);
      be.sgd_update(p.data(), g.data(), buf.data(), kSlices, kLr[t - 1], mu, nesterov, gs);
      const bool first = bd.empty();
      if (first) bd.assign(kTotal, 0.0);
      for (size_t i = 0; i < kTotal; ++i) {
        const double wd = wd_of(i);
        if (wd < 0) continue;
        double d = (double)g[i] * gs + wd * pd[i];
        bd[i] = first ? d : mu * bd[i] + d;
        if (nesterov) d = d + mu * bd[i]; else d = bd[i];
        pd[i] -= kLr[t - 1] * d;
      }
    }
    EXPECT_TRUE(all_close(p, pd, kAtol, kRtol)) << "nesterov " << nesterov;
    EXPECT_TRUE(all_close(buf, bd, kAtol, kRtol)) << "nesterov " << nesterov;
  }
}

TEST(CpuReduce, SumSquaresPerSliceSumAndAllFinite) {
  CpuBackend be;
  auto x = randn(1001, 4, 10.0f);
  const std::vector<ParamSlice> slices = {{0, 1}, {1, 0}, {3, 997}, {500, 501}};
  std::vector<double> out(slices.size());
  be.sum_squares(out.data(), x.data(), slices);
  for (size_t s = 0; s < slices.size(); ++s) {
    double ref = 0.0;
    for (size_t i = slices[s].offset; i < slices[s].offset + slices[s].n; ++i)
      ref += (double)x[i] * x[i];
    EXPECT_NEAR(out[s], ref, 1e-12 * std::max(1.0, ref)) << s;
  }
  double ref = 0.0;
  for (float v : x) ref += v;
  EXPECT_NEAR(be.sum(x.data(), x.size()), ref, 1e-9);

  EXPECT_TRUE(be.all_finite(x.data(), x.size()));
  for (size_t pos : {size_t(0), size_t(517), size_t(1000)}) {
    for (float bad : {std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()}) {
      auto y = x;
      y[pos] = bad;
      EXPECT_FALSE(be.all_finite(y.data(), y.size())) << pos << " " << bad;
    }
  }
  // Large finite values are finite (x - x is 0 for them).
  std::vector<float> big(9, std::numeric_limits<float>::max());
  EXPECT_TRUE(be.all_finite(big.data(), big.size()));
}

// The device-scalar forms (host memory on the CPU): totals, accumulation, the clipping
// factor as torch.nn.utils.clip_grad_norm_ computes it, readback copies, and the optimizers
// with that factor passed by pointer giving the bits of the factor passed by value.
TEST(CpuReduce, DeviceScalarsClipFactorAndReadback) {
  CpuBackend be;
  auto x = randn(1001, 4, 10.0f);
  const std::vector<ParamSlice> slices = {{0, 1}, {3, 997}, {500, 501}};
  double total = 0.0, ref = 0.0;
  be.sum_squares_total(&total, x.data(), slices);
  for (const auto& s : slices)
    for (size_t i = s.offset; i < s.offset + s.n; ++i) ref += (double)x[i] * x[i];
  EXPECT_NEAR(total, ref, 1e-12 * ref);
  double acc = 1.5, sum = 0.0;
  be.sum_into(&acc, x.data(), 10);
  for (int i = 0; i < 10; ++i) sum += x[i];
  EXPECT_NEAR(acc, 1.5 + sum, 1e-12);
  // clipping: max_norm 2 against |g| = sqrt(total) / 4 (the loss scale undone)
  float f = 0.0f;
  be.clip_factor(&f, &total, 2.0, 0.25f);
  const double g = std::sqrt(total) * 0.25;
  ASSERT_GT(g, 2.0);
  EXPECT_EQ(f, static_cast<float>(2.0 / (g + 1e-6)) * 0.25f);
  be.clip_factor(&f, &total, 1e9, 0.25f);  // under the limit: only the unscale
  EXPECT_EQ(f, 0.25f);
  be.clip_factor(&f, &total, 0.0, 1.0f);  // 0 = no clipping
  EXPECT_EQ(f, 1.0f);
  const double vals[2] = {3.25, -1.0};
  be.readback_start(1, vals, sizeof vals);
  EXPECT_EQ(std::memcmp(be.readback_wait(1), vals, sizeof vals), 0);

  const float factor = 0.37f;
  AdamParams by_value{1e-2f, 0.9f, 0.999f, 1e-8f, 2, factor};
  AdamParams by_ptr = by_value;
  by_ptr.grad_scale = 1.0f;
  by_ptr.grad_scale_dev = &factor;
  std::vector<float> out[2];
  for (int k = 0; k < 2; ++k) {
    auto p = randn(kTotal, 1), gr = randn(kTotal, 2);
    std::vector<float> m(kTotal, 0.0f), v(kTotal, 0.0f), mom(kTotal, 0.0f), u(kTotal, 0.0f);
    be.adamw_update(p.data(), gr.data(), m.data(), v.data(), kSlices, k ? by_ptr : by_value);
    be.lamb_direction(u.data(), p.data(), gr.data(), m.data(), v.data(), kSlices,
                      k ? by_ptr : by_value);
    be.sgd_update(p.data(), gr.data(), mom.data(), kSlices, 0.1f, 0.9f, false,
                  k ? 1.0f : factor, k ? &factor : nullptr);
    out[k] = p;
    out[k].insert(out[k].end(), u.begin(), u.end());
  }
  EXPECT_EQ(out[1], out[0]);
}

}  // namespace
