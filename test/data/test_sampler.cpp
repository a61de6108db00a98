// The sampler: per-epoch permutations, augmentation ranges, Beta(alpha, alpha) Mixup weights.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "vitgrid/data/dataset.h"

using vitgrid::SampleAug;
using vitgrid::Sampler;

TEST(Sampler, EachEpochIsAPermutation) {
  const int64_t N = 37;
  Sampler s(99, N);
  std::vector<std::vector<int64_t>> epochs;
  for (int64_t e = 0; e < 4; ++e) {
    std::vector<int> seen(N, 0);
    std::vector<int64_t> order;
    for (int64_t i = 0; i < N; ++i) {
      int64_t pos = e * N + i;
      EXPECT_EQ(s.epoch_of(pos), e);
      int64_t k = s.index_at(pos);
      ASSERT_GE(k, 0);
      ASSERT_LT(k, N);
      seen[k]++;
      order.push_back(k);
    }
    for (int c : seen) EXPECT_EQ(c, 1);
    epochs.push_back(order);
  }
  for (int a = 0; a < 4; ++a)
    for (int b = a + 1; b < 4; ++b) EXPECT_NE(epochs[a], epochs[b]) << "epochs " << a << ", " << b;
  std::vector<int64_t> identity(N);
  for (int64_t i = 0; i < N; ++i) identity[i] = i;
  EXPECT_NE(epochs[0], identity);
}

TEST(Sampler, PureFunctionOfSeedAndPosition) {
  const int64_t N = 50;
  Sampler a(5, N), b(5, N), c(6, N);
  // jumping back and forth across epoch boundaries (cache refills) changes nothing
  std::vector<int64_t> pos = {3, 170, 49, 50, 51, 0, 149, 150, 99, 1000, 2, 171};
  std::vector<int64_t> fresh;
  for (int64_t p : pos) fresh.push_back(b.index_at(p));
  for (size_t i = 0; i < pos.size(); ++i) EXPECT_EQ(a.index_at(pos[i]), fresh[i]);
  int differ = 0;
  for (int64_t p = 0; p < N; ++p) differ += a.index_at(p) != c.index_at(p);
  EXPECT_GT(differ, N / 2);
  vitgrid::MixConfig mix;
  mix.mixup_alpha = 0.8;
  mix.cutmix_alpha = 1.0;
  for (int64_t p : pos) {
    SampleAug x = a.augment_at(p, 4, true), y = b.augment_at(p, 4, true);
    EXPECT_EQ(x.dx, y.dx);
    EXPECT_EQ(x.dy, y.dy);
    EXPECT_EQ(x.flip, y.flip);
    vitgrid::MixDraw u = a.mix_at(p, mix, 32), v = b.mix_at(p, mix, 32);
    EXPECT_EQ(u.lam, v.lam);
    EXPECT_EQ(u.cut, v.cut);
    EXPECT_EQ(u.x0, v.x0);
    EXPECT_EQ(u.y1, v.y1);
  }
}

TEST(Sampler, AugmentRanges) {
  Sampler s(1, 1000);
  const int pad = 3, n = 20000;
  std::vector<int> hx(2 * pad + 1, 0), hy(2 * pad + 1, 0);
  int flips = 0;
  for (int64_t p = 0; p < n; ++p) {
    SampleAug a = s.augment_at(p, pad, true);
    ASSERT_GE(a.dx, 0);
    ASSERT_LE(a.dx, 2 * pad);
    ASSERT_GE(a.dy, 0);
    ASSERT_LE(a.dy, 2 * pad);
    hx[a.dx]++;
    hy[a.dy]++;
    flips += a.flip;
    EXPECT_EQ(a.lam, 1.0f);
    SampleAug none = s.augment_at(p, 0, false);
    EXPECT_EQ(none.dx, 0);
    EXPECT_EQ(none.dy, 0);
    EXPECT_EQ(none.flip, 0);
  }
  const double expect = (double)n / (2 * pad + 1);  // 2857, std ~ 50
  for (int k = 0; k <= 2 * pad; ++k) {
    EXPECT_NEAR(hx[k], expect, 250);
    EXPECT_NEAR(hy[k], expect, 250);
  }
  EXPECT_NEAR(flips, n / 2, 400);  // std 71
  // dx and dy are not the same draw
  int same = 0;
  for (int64_t p = 0; p < 1000; ++p) {
    SampleAug a = s.augment_at(p, pad, true);
    same += a.dx == a.dy;
  }
  EXPECT_LT(same, 250);  // 1/7 expected
}

TEST(Sampler, MixupBetaMoments) {
  Sampler s(2024, 500);
  struct Case { double alpha, mean, var; };
  // Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1))
  for (Case c : {Case{1.0, 0.5, 1.0 / 12}, Case{0.2, 0.5, 1.0 / (4 * 1.4)}, Case{2.0, 0.5, 1.0 / 20}}) {
    const int n = 20000;
    double sum = 0, sq = 0;
    for (int64_t p = 0; p < n; ++p) {
      vitgrid::MixConfig mix;
      mix.mixup_alpha = c.alpha;
      float lam = s.mix_at(p, mix, 32).lam;
      ASSERT_GE(lam, 0.0f);
      ASSERT_LE(lam, 1.0f);
      sum += lam;
      sq += (double)lam * lam;
    }
    double mean = sum / n, var = sq / n - mean * mean;
    EXPECT_NEAR(mean, c.mean, 0.012) << "alpha " << c.alpha;
    EXPECT_NEAR(var, c.var, 0.006) << "alpha " << c.alpha;
  }
  // Beta(1,1) is uniform: each tenth of [0,1] gets ~10%
  std::vector<int> hist(10, 0);
  vitgrid::MixConfig one;
  one.mixup_alpha = 1.0;
  for (int64_t p = 0; p < 20000; ++p) hist[std::min(9, (int)(s.mix_at(p, one, 32).lam * 10))]++;
  for (int h : hist) EXPECT_NEAR(h, 2000, 200);
}

// timm's CutMix: with both alphas, CutMix is chosen with switch_prob; its box is the clipped
// square of side S * sqrt(1 - lam) around a uniform centre and the label share is corrected to
// the area outside the box; mixup_prob leaves the rest unmixed.
TEST(Sampler, CutmixBoxesAndSwitch) {
  Sampler s(11, 100);
  const int S = 32, n = 20000;
  vitgrid::MixConfig mix;
  mix.mixup_alpha = 0.8;
  mix.cutmix_alpha = 1.0;
  mix.switch_prob = 0.3;
  mix.prob = 0.9;
  int cut = 0, none = 0;
  double centre_x = 0;
  for (int64_t u = 0; u < n; ++u) {
    vitgrid::MixDraw d = s.mix_at(u, mix, S);
    if (d.lam == 1.0f && !d.cut) {
      ++none;
      continue;
    }
    if (!d.cut) continue;
    ++cut;
    ASSERT_GE(d.x0, 0);
    ASSERT_LE(d.x1, S);
    ASSERT_LE(d.x0, d.x1);
    ASSERT_LE(d.y0, d.y1);
    // the box is at most S * sqrt(1 - lam0) wide, so the corrected share is >= lam0 ... and
    // it is exactly the area outside the box
    EXPECT_FLOAT_EQ(d.lam, (float)(1.0 - double(d.x1 - d.x0) * (d.y1 - d.y0) / (S * S)));
    EXPECT_EQ(d.x1 - d.x0 <= S, true);
    centre_x += 0.5 * (d.x0 + d.x1);
  }
  EXPECT_NEAR(none, 0.1 * n, 4 * std::sqrt(0.09 * n));                 // 1 - prob
  EXPECT_NEAR(cut, 0.9 * 0.3 * n, 4 * std::sqrt(0.27 * 0.73 * n));     // prob * switch
  EXPECT_NEAR(centre_x / cut, S / 2.0, 1.0);  // clipped boxes around uniform centres
  // CutMix alone: every mixed unit is a box
  vitgrid::MixConfig only;
  only.cutmix_alpha = 1.0;
  for (int64_t u = 0; u < 1000; ++u) EXPECT_TRUE(s.mix_at(u, only, S).cut);
  EXPECT_THROW(Sampler(1, 0), std::invalid_argument);
}
