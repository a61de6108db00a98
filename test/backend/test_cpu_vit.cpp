// CPU backend ViT glue and loss: prepare_images against an explicit pad-crop-flip-normalise-mix
// computation, patchify against a direct convolution, token embedding and class-token pooling
// with their backward accumulation, cross entropy (hard, smoothed, soft) against double
// references and finite differences, and top-k with ties.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend_test_util.h"
#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"

namespace {

using vgtest::all_close;
using vgtest::fd_grad;
using vgtest::randn;
using vgtest::to_d;
using vitgrid::CpuBackend;
using vitgrid::SampleAug;

std::vector<uint8_t> random_images(int B, int S, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint8_t> v((size_t)B * S * S * 3);
  for (auto& x : v) x = (uint8_t)(gen() & 0xFF);
  return v;
}

// Materialises the zero-padded image, crops it, flips the crop, normalises: each step as its
// own array, independent of the backend's single index formula.
std::vector<double> ref_prepare_one(const uint8_t* img, const SampleAug& a, int S, int pad,
                                    const float* mean, const float* stdv) {
  const int Sp = S + 2 * pad;
  std::vector<double> padded((size_t)Sp * Sp * 3, 0.0);
  for (int y = 0; y < S; ++y)
    for (int x = 0; x < S; ++x)
      for (int c = 0; c < 3; ++c)
        padded[(((size_t)y + pad) * Sp + x + pad) * 3 + c] = img[((size_t)y * S + x) * 3 + c];
  std::vector<double> crop((size_t)S * S * 3);
  for (int y = 0; y < S; ++y)
    for (int x = 0; x < S; ++x)
      for (int c = 0; c < 3; ++c)
        crop[((size_t)y * S + x) * 3 + c] = padded[(((size_t)y + a.dy) * Sp + x + a.dx) * 3 + c];
  std::vector<double> out((size_t)3 * S * S);
  for (int c = 0; c < 3; ++c)
    for (int y = 0; y < S; ++y)
      for (int x = 0; x < S; ++x) {
        const int sx = a.flip ? S - 1 - x : x;
        out[((size_t)c * S + y) * S + x] =
            (crop[((size_t)y * S + sx) * 3 + c] / 255.0 - mean[c]) / stdv[c];
      }
  return out;
}

SampleAug make_aug(int dx, int dy, int flip, float lam = 1.0f, int partner = -1) {
  SampleAug a;
  a.dx = dx, a.dy = dy, a.flip = flip, a.lam = lam, a.partner = partner;
  return a;
}

TEST(CpuVit, PrepareImagesCropPadFlipNormaliseMixupCutmix) {
  const int B = 4, S = 7, pad = 2;
  const float mean[3] = {0.485f, 0.456f, 0.406f}, stdv[3] = {0.229f, 0.224f, 0.225f};
  CpuBackend be;
  auto img = random_images(B, S, 1);
  std::vector<SampleAug> aug = {make_aug(0, 4, 1), make_aug(3, 1, 0), make_aug(2, 2, 0),
                                make_aug(1, 0, 1)};
  std::vector<float> out((size_t)B * 3 * S * S);
  const size_t per = (size_t)3 * S * S;
  auto one = [&](int b) {
    return ref_prepare_one(img.data() + (size_t)b * S * S * 3, aug[b], S, pad, mean, stdv);
  };

  // Unmixed: lam is ignored without a partner.
  aug[0].lam = 0.3f;
  be.prepare_images(out.data(), img.data(), aug.data(), B, S, pad, mean, stdv);
  std::vector<double> ref;
  for (int b = 0; b < B; ++b) {
    auto r = one(b);
    ref.insert(ref.end(), r.begin(), r.end());
  }
  EXPECT_TRUE(all_close(out, ref, 1e-5, 1e-5));

  // Mixup of the pair (0, 1): each mixed with the other, prepared with the other's own crop
  // and flip. CutMix of the pair (2, 3): the partner's pixels inside the box only.
  aug[0].lam = 0.7f, aug[0].partner = 1;
  aug[1].lam = 0.2f, aug[1].partner = 0;
  for (int b : {2, 3}) {
    aug[b].partner = b ^ 1;
    aug[b].cut_x0 = 1, aug[b].cut_x1 = 5, aug[b].cut_y0 = 2, aug[b].cut_y1 = 4;
  }
  be.prepare_images(out.data(), img.data(), aug.data(), B, S, pad, mean, stdv);
  for (int b = 0; b < B; ++b) {
    auto r1 = one(b), r2 = one(b ^ 1);
    for (int c = 0; c < 3; ++c)
      for (int y = 0; y < S; ++y)
        for (int x = 0; x < S; ++x) {
          const size_t i = ((size_t)c * S + y) * S + x;
          const bool box = b >= 2 && x >= 1 && x < 5 && y >= 2 && y < 4;
          ref[b * per + i] = b >= 2 ? (box ? r2[i] : r1[i]) : aug[b].lam * r1[i] + (1.0 - aug[b].lam) * r2[i];
        }
  }
  EXPECT_TRUE(all_close(out, ref, 1e-5, 1e-5));

  // Crop offsets beyond the padding, and partners outside the batch, are refused.
  aug[1].dx = 2 * pad + 1;
  EXPECT_THROW(be.prepare_images(out.data(), img.data(), aug.data(), B, S, pad, mean, stdv),
               vitgrid::UserError);
  aug[1].dx = 0;
  aug[1].partner = B;
  EXPECT_THROW(be.prepare_images(out.data(), img.data(), aug.data(), B, S, pad, mean, stdv),
               vitgrid::UserError);
}

TEST(CpuVit, PatchifyThenGemmEqualsConvolution) {
  // The patch row order must be the conv weight's (channel, row, col) so that patches x W^T
  // is the strided convolution of timm's patch embedding.
  const int B = 2, S = 6, P = 3, G = S / P, Co = 4, D = 3 * P * P;
  CpuBackend be;
  auto img = randn((size_t)B * 3 * S * S, 3), W = randn((size_t)Co * D, 4);
  std::vector<float> patches((size_t)B * G * G * D), y((size_t)B * G * G * Co);
  be.patchify(patches.data(), img.data(), B, S, P);
  be.linear_forward(y.data(), patches.data(), W.data(), nullptr, B * G * G, D, Co);
  std::vector<double> conv(y.size());
  for (int b = 0; b < B; ++b)
    for (int gy = 0; gy < G; ++gy)
      for (int gx = 0; gx < G; ++gx)
        for (int o = 0; o < Co; ++o) {
          double s = 0.0;
          for (int c = 0; c < 3; ++c)
            for (int i = 0; i < P; ++i)
              for (int j = 0; j < P; ++j)
                s += (double)W[(((size_t)o * 3 + c) * P + i) * P + j] *
                     img[(((size_t)b * 3 + c) * S + gy * P + i) * S + gx * P + j];
          conv[(((size_t)b * G + gy) * G + gx) * Co + o] = s;
        }
  EXPECT_TRUE(all_close(y, conv, 2e-5, 1e-4));
  EXPECT_THROW(be.patchify(patches.data(), img.data(), B, S, 4), vitgrid::UserError);
}

TEST(CpuVit, EmbedTokensForwardBackward) {
  const int B = 3, T = 5, C = 7;
  CpuBackend be;
  auto pt = randn((size_t)B * (T - 1) * C, 5), cls = randn(C, 6), pos = randn((size_t)T * C, 7);
  std::vector<float> x((size_t)B * T * C);
  be.embed_tokens(x.data(), pt.data(), cls.data(), pos.data(), B, T, C);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) {
        const float tok = t == 0 ? cls[c] : pt[((size_t)b * (T - 1) + t - 1) * C + c];
        ASSERT_FLOAT_EQ(x[((size_t)b * T + t) * C + c], tok + pos[(size_t)t * C + c]);
      }

  auto dx = randn(x.size(), 8), dcls0 = randn(C, 9), dpos0 = randn((size_t)T * C, 10);
  std::vector<float> dpt(pt.size()), dcls = dcls0, dpos = dpos0;
  be.embed_tokens_backward(dpt.data(), dcls.data(), dpos.data(), dx.data(), B, T, C);
  // Adjoint check against the forward: <dx, embed(pt, cls, pos)> is linear in each input, so
  // its finite-difference gradients are exact up to rounding.
  auto L = [&](const std::vector<double>& p, const std::vector<double>& c,
               const std::vector<double>& ps) {
    double s = 0.0;
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t)
        for (int k = 0; k < C; ++k)
          s += dx[((size_t)b * T + t) * C + k] *
               ((t == 0 ? c[k] : p[((size_t)b * (T - 1) + t - 1) * C + k]) + ps[(size_t)t * C + k]);
    return s;
  };
  auto ptd = to_d(pt), cd = to_d(cls), pd = to_d(pos);
  EXPECT_TRUE(all_close(dpt, fd_grad([&](const std::vector<double>& v) { return L(v, cd, pd); }, ptd), 1e-5, 1e-5));
  EXPECT_TRUE(all_close(dcls, vgtest::add(fd_grad([&](const std::vector<double>& v) { return L(ptd, v, pd); }, cd), dcls0), 1e-5, 1e-5));
  EXPECT_TRUE(all_close(dpos, vgtest::add(fd_grad([&](const std::vector<double>& v) { return L(ptd, cd, v); }, pd), dpos0), 1e-5, 1e-5));
}

TEST(CpuVit, GatherClsAndScatterBackward) {
  const int B = 3, T = 4, C = 5;
  CpuBackend be;
  auto x = randn((size_t)B * T * C, 11), drows = randn((size_t)B * C, 12);
  std::vector<float> rows((size_t)B * C);
  be.gather_cls(rows.data(), x.data(), B, T, C);
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < C; ++c) EXPECT_EQ(rows[(size_t)b * C + c], x[(size_t)b * T * C + c]);
  std::vector<float> dx = x;  // stands for an existing gradient: token 0 accumulates, rest kept
  be.scatter_cls_backward(dx.data(), drows.data(), B, T, C);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) {
        const size_t i = ((size_t)b * T + t) * C + c;
        EXPECT_EQ(dx[i], t == 0 ? x[i] + drows[(size_t)b * C + c] : x[i]);
      }
}

// ---- cross entropy

// Reference: loss_r = -sum_k target_k log softmax(z_r)_k, in double.
std::vector<double> ref_ce(const std::vector<double>& z, const std::vector<int32_t>& labels,
                           const std::vector<float>* soft, int N, int K, double eps) {
  std::vector<double> loss(N);
  for (int r = 0; r < N; ++r) {
    double mx = -1e300, s = 0.0;
    for (int k = 0; k < K; ++k) mx = std::max(mx, z[(size_t)r * K + k]);
    for (int k = 0; k < K; ++k) s += std::exp(z[(size_t)r * K + k] - mx);
    double l = 0.0;
    for (int k = 0; k < K; ++k) {
      const double t = soft ? (*soft)[(size_t)r * K + k] : (labels[r] == k ? 1.0 : 0.0);
      const double target = (1 - eps) * t + eps / K;
      l -= target * (z[(size_t)r * K + k] - mx - std::log(s));
    }
    loss[r] = l;
  }
  return loss;
}

TEST(CpuLoss, CrossEntropyHardSmoothedSoftWithGradScale) {
  const int N = 5, K = 7;
  const float grad_scale = 0.25f;
  CpuBackend be;
  auto z = randn((size_t)N * K, 13, 2.0f);
  std::vector<int32_t> labels = {0, 6, 3, 3, 1};
  // Soft targets: positive rows summing to one (Mixup of two one-hots and noise).
  auto soft = vgtest::randu((size_t)N * K, 14, 0.0f, 1.0f);
  for (int r = 0; r < N; ++r) {
    float s = 0.0f;
    for (int k = 0; k < K; ++k) s += soft[(size_t)r * K + k];
    for (int k = 0; k < K; ++k) soft[(size_t)r * K + k] /= s;
  }
  struct Case { float eps; bool soft; };
  for (Case cs : {Case{0.0f, false}, Case{0.1f, false}, Case{0.0f, true}, Case{0.1f, true}}) {
    const std::vector<float>* st = cs.soft ? &soft : nullptr;
    std::vector<float> losses(N), dz(z.size());
    be.cross_entropy(losses.data(), dz.data(), z.data(), labels.data(),
                     cs.soft ? soft.data() : nullptr, N, K, cs.eps, grad_scale);
    EXPECT_TRUE(all_close(losses, ref_ce(to_d(z), labels, st, N, K, cs.eps), 1e-6, 1e-6))
        << "eps " << cs.eps << " soft " << cs.soft;
    auto g = fd_grad([&](const std::vector<double>& v) {
      auto l = ref_ce(v, labels, st, N, K, cs.eps);
      return std::accumulate(l.begin(), l.end(), 0.0);
    }, to_d(z));
    for (auto& v : g) v *= grad_scale;
    EXPECT_TRUE(all_close(dz, g, 1e-6, 1e-5)) << "eps " << cs.eps << " soft " << cs.soft;
    // Losses only, no gradient.
    std::vector<float> l2(N);
    be.cross_entropy(l2.data(), nullptr, z.data(), labels.data(),
                     cs.soft ? soft.data() : nullptr, N, K, cs.eps, grad_scale);
    EXPECT_EQ(l2, losses);
  }
  // A known value: uniform logits give log K whatever the target.
  std::vector<float> flat(K, 0.5f), l1(1), d1(K);
  be.cross_entropy(l1.data(), d1.data(), flat.data(), labels.data(), nullptr, 1, K, 0.1f, 1.0f);
  EXPECT_NEAR(l1[0], std::log((double)K), 1e-6);

  // A label outside [0, K) poisons its row with NaN (no throw on one rank), others unaffected.
  std::vector<int32_t> bad = {K, 2};
  std::vector<float> two(2 * K, 0.5f), lb(2), db(2 * K);
  be.cross_entropy(lb.data(), db.data(), two.data(), bad.data(), nullptr, 2, K, 0.f, 1.f);
  EXPECT_TRUE(std::isnan(lb[0]));
  for (int k = 0; k < K; ++k) EXPECT_TRUE(std::isnan(db[k]));
  EXPECT_NEAR(lb[1], std::log((double)K), 1e-6);
  EXPECT_TRUE(be.all_finite(db.data() + K, K));
}

TEST(CpuLoss, TopkCorrectWithTies) {
  const int K = 8;
  CpuBackend be;
  // Rows built to test the rule: rank = #strictly greater + #equal at a smaller index.
  std::vector<float> z = {
      5, 1, 5, 0, 0, 0, 0, 0,  // label 0: first of two maxima -> top-1
      5, 1, 5, 0, 0, 0, 0, 0,  // label 2: ties with earlier index 0 -> rank 1: top-5 only
      9, 8, 7, 6, 5, 4, 3, 2,  // label 5: rank 5 -> not top-5
      9, 8, 7, 6, 5, 4, 3, 2,  // label 4: rank 4 -> top-5
      1, 1, 1, 1, 1, 1, 1, 1,  // label 4: all equal -> rank 4 -> top-5, not top-1
      1, 1, 1, 1, 1, 1, 1, 1,  // label 5: all equal -> rank 5 -> neither
  };
  std::vector<int32_t> labels = {0, 2, 5, 4, 4, 5};
  const int N = (int)labels.size();
  std::vector<float> c1(N), c5(N);
  be.topk_correct(c1.data(), c5.data(), z.data(), labels.data(), N, K);
  EXPECT_EQ(c1, (std::vector<float>{1, 0, 0, 0, 0, 0}));
  EXPECT_EQ(c5, (std::vector<float>{1, 1, 0, 1, 1, 0}));

  // Random rows with ties against a stable sort by descending logit.
  const int N2 = 50, K2 = 11;
  std::mt19937 gen(15);
  std::vector<float> z2((size_t)N2 * K2);
  for (auto& v : z2) v = (float)(gen() % 6);  // many ties
  std::vector<int32_t> l2(N2);
  for (auto& v : l2) v = (int32_t)(gen() % K2);
  std::vector<float> a1(N2), a5(N2);
  be.topk_correct(a1.data(), a5.data(), z2.data(), l2.data(), N2, K2);
  for (int r = 0; r < N2; ++r) {
    std::vector<int> idx(K2);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) {
      return z2[(size_t)r * K2 + a] > z2[(size_t)r * K2 + b];
    });
    const int rank = (int)(std::find(idx.begin(), idx.end(), l2[r]) - idx.begin());
    EXPECT_EQ(a1[r], rank < 1 ? 1.0f : 0.0f) << r;
    EXPECT_EQ(a5[r], rank < 5 ? 1.0f : 0.0f) << r;
  }
}

}  // namespace
