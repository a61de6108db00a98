// The CPU backend's FP8 ops (backend.h Fp8Ops), the reference of the CUDA ones: fp8_cast
// against fp8_encode element by element (codes, transpose, the amax kept across calls, a NaN
// kept), and fp8_gemm against sums of the decoded values in double precision, in fp32 and in
// bf16 emulation (one rounding of the fp32 result).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/backend/cpu/emulate16.h"
#include "vitgrid/backend/fp8.h"

namespace {

using vitgrid::CpuBackend;
using vitgrid::DType;
using vitgrid::Fp8Format;

TEST(CpuFp8Ops, CastCodesTransposeAndAmax) {
  CpuBackend be(DType::BF16);
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.0f, 40.0f);
  const int rows = 13, cols = 21;
  std::vector<float> x(rows * cols);
  for (float& v : x) v = vitgrid::round_bf16(d(rng));
  x[17] = 1e6f;  // saturates
  std::vector<uint8_t> out(x.size()), out_t(x.size());
  float amax = 0.0f;
  const float scale = 3.0f;
  be.fp8_cast(out.data(), out_t.data(), &amax, x.data(), rows, cols, &scale, Fp8Format::E4M3);
  float m = 0.0f;
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const float v = x[r * cols + c];
      m = std::max(m, std::fabs(v));
      const uint8_t want = vitgrid::fp8_encode(v * scale, Fp8Format::E4M3);
      ASSERT_EQ(out[r * cols + c], want) << r << "," << c;
      ASSERT_EQ(out_t[c * rows + r], want) << r << "," << c;
    }
  }
  EXPECT_EQ(amax, m);
  EXPECT_EQ(vitgrid::fp8_decode(out[17], Fp8Format::E4M3), 448.0f);
  // a later, smaller tensor keeps the amax; a NaN makes it NaN and a later finite one keeps it
  std::vector<float> small = {1.0f, -2.0f};
  be.fp8_cast(out.data(), nullptr, &amax, small.data(), 1, 2, &scale, Fp8Format::E5M2);
  EXPECT_EQ(amax, m);
  small[1] = std::numeric_limits<float>::quiet_NaN();
  be.fp8_cast(nullptr, out_t.data(), &amax, small.data(), 2, 1, &scale, Fp8Format::E5M2);
  EXPECT_TRUE(std::isnan(amax));
  small[1] = 5.0f;
  be.fp8_cast(out.data(), nullptr, &amax, small.data(), 1, 2, &scale, Fp8Format::E5M2);
  EXPECT_TRUE(std::isnan(amax));
}

TEST(CpuFp8Ops, CastWithGeluInIsGeluThenTheCast) {
  // the codes, transpose and amax of gelu(x) as gelu_forward stores it (bf16-rounded), for both
  // GELU forms; and they differ from the plain cast's
  CpuBackend be(DType::BF16);
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 2.0f);
  const int rows = 16, cols = 24;
  std::vector<float> x(rows * cols), g(x.size());
  for (float& v : x) v = vitgrid::round_bf16(d(rng));
  alignas(16) const float scale = 100.0f;
  for (vitgrid::Gelu form : {vitgrid::Gelu::Exact, vitgrid::Gelu::Tanh}) {
    be.gelu_forward(g.data(), x.data(), x.size(), form);
    std::vector<uint8_t> a(x.size()), at(x.size()), b(x.size()), bt(x.size()), p(x.size());
    float ma = 0.0f, mb = 0.0f, mp = 0.0f;
    be.fp8_cast(a.data(), at.data(), &ma, x.data(), rows, cols, &scale, Fp8Format::E4M3, &form);
    be.fp8_cast(b.data(), bt.data(), &mb, g.data(), rows, cols, &scale, Fp8Format::E4M3);
    be.fp8_cast(p.data(), nullptr, &mp, x.data(), rows, cols, &scale, Fp8Format::E4M3);
    EXPECT_EQ(a, b);
    EXPECT_EQ(at, bt);
    EXPECT_EQ(ma, mb);
    EXPECT_NE(a, p);
  }
}

TEST(CpuFp8Ops, LayerNormFp8IsTheLayerNormThenTheCast) {
  // add_layernorm_forward_fp8: res, statistics, codes, transpose and amax as
  // add_layernorm_forward then fp8_cast of its y (with and without the branch and its row
  // factors; out or out_t alone)
  CpuBackend be(DType::BF16);
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 1.5f);
  const int N = 12, C = 40;
  auto vec = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = vitgrid::round_bf16(d(rng));
    return v;
  };
  const std::vector<float> a = vec(N * C), b = vec(N * C), gamma = vec(C), beta = vec(C);
  const std::vector<float> factors = {0.0f, 2.0f, 1.25f, 4.0f};  // per 3 rows
  alignas(16) const float scale = 37.0f;
  for (int variant = 0; variant < 4; ++variant) {
    const bool with_b = variant != 0;
    const vitgrid::RowFactors bf = variant == 2 ? vitgrid::RowFactors{factors.data(), 3}
                                                : vitgrid::RowFactors{};
    std::vector<float> res(N * C), rres(N * C), y(N * C), mean(N), rstd(N), rmean(N), rstd2(N);
    std::vector<uint8_t> out(N * C, 1), out_t(N * C, 2), rout(N * C, 3), rout_t(N * C, 4);
    float amax = 0.5f, ramax = 0.5f;
    uint8_t* o = variant == 3 ? nullptr : out.data();
    be.add_layernorm_forward_fp8(res.data(), o, out_t.data(), &amax, &scale, Fp8Format::E4M3,
                                 mean.data(), rstd.data(), a.data(), with_b ? b.data() : nullptr,
                                 gamma.data(), beta.data(), N, C, 1e-6f, bf);
    be.add_layernorm_forward(rres.data(), y.data(), rmean.data(), rstd2.data(), a.data(),
                             with_b ? b.data() : nullptr, gamma.data(), beta.data(), N, C, 1e-6f,
                             bf);
    be.fp8_cast(rout.data(), rout_t.data(), &ramax, y.data(), N, C, &scale, Fp8Format::E4M3);
    EXPECT_EQ(res, rres) << variant;
    EXPECT_EQ(mean, rmean) << variant;
    EXPECT_EQ(rstd, rstd2) << variant;
    if (o) {
      EXPECT_EQ(out, rout) << variant;
    }
    EXPECT_EQ(out_t, rout_t) << variant;
    EXPECT_EQ(amax, ramax) << variant;
    EXPECT_GT(amax, 0.5f) << variant;
  }
}

// D = (A B^T) sa sb (+ bias) + beta D0 in double from the decoded codes.
std::vector<double> reference(const std::vector<uint8_t>& A, Fp8Format fa,
                              const std::vector<uint8_t>& B, Fp8Format fb, int M, int N, int K,
                              double s, const std::vector<float>& bias, double beta,
                              const std::vector<float>& D0) {
  std::vector<double> D(size_t(M) * N);
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      double acc = 0;
      for (int k = 0; k < K; ++k)
        acc += double(vitgrid::fp8_decode(A[i * K + k], fa)) * vitgrid::fp8_decode(B[j * K + k], fb);
      double v = acc * s + (bias.empty() ? 0.0 : bias[j]);
      if (beta != 0) v += beta * D0[i * N + j];
      D[i * N + j] = v;
    }
  }
  return D;
}

TEST(CpuFp8Ops, GemmAgainstDoubleSums) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> code(0, 255);
  const int M = 9, N = 7, K = 48;
  auto codes = [&](size_t n, Fp8Format f) {
    std::vector<uint8_t> v(n);
    for (auto& c : v) {
      do c = static_cast<uint8_t>(code(rng));
      while (!std::isfinite(vitgrid::fp8_decode(c, f)));
    }
    return v;
  };
  const auto A = codes(size_t(M) * K, Fp8Format::E5M2), B = codes(size_t(N) * K, Fp8Format::E4M3);
  alignas(16) const float sa = 1.0f / 1024;  // (the contract: 16-byte aligned scale_invs)
  alignas(16) const float sb = 1.0f / 64;
  // fp32 output accumulated (a weight gradient): fp32 sums of exact products
  {
    CpuBackend be(DType::F32);
    std::vector<float> D0(size_t(M) * N);
    for (size_t i = 0; i < D0.size(); ++i) D0[i] = float(i % 13) - 6.0f;
    std::vector<float> D = D0;
    be.fp8_gemm(D.data(), true, 1.0f, A.data(), Fp8Format::E5M2, &sa, B.data(), Fp8Format::E4M3,
                &sb, M, N, K, nullptr);
    const auto want = reference(A, Fp8Format::E5M2, B, Fp8Format::E4M3, M, N, K, double(sa) * sb,
                                {}, 1.0, D0);
    double scale = 0;
    for (double v : want) scale = std::max(scale, std::fabs(v));
    for (size_t i = 0; i < D.size(); ++i)
      EXPECT_NEAR(D[i], want[i], 1e-5 * scale) << i;
  }
  // bf16 output with a bias: the fp32 result rounded once
  {
    CpuBackend be(DType::BF16);
    std::vector<float> bias(N);
    for (int j = 0; j < N; ++j) bias[j] = vitgrid::round_bf16(0.37f * j - 1.0f);
    std::vector<float> D(size_t(M) * N, std::numeric_limits<float>::quiet_NaN());
    be.fp8_gemm(D.data(), false, 0.0f, A.data(), Fp8Format::E5M2, &sa, B.data(), Fp8Format::E4M3,
                &sb, M, N, K, bias.data());
    const auto want = reference(A, Fp8Format::E5M2, B, Fp8Format::E4M3, M, N, K, double(sa) * sb,
                                bias, 0.0, {});
    for (size_t i = 0; i < D.size(); ++i) {
      EXPECT_EQ(D[i], vitgrid::round_bf16(D[i])) << i;  // stored rounded
      // one rounding to 8 significant bits (plus fp32 sums, far below it)
      EXPECT_LE(std::fabs(D[i] - want[i]), std::ldexp(std::fabs(want[i]), -8) + 1e-6) << i;
    }
  }
}

TEST(CpuFp8Ops, GemmRefusesScalePointersOffSixteenBytes) {
  // what cuBLASLt refuses (CUBLAS_STATUS_NOT_SUPPORTED on an H100), every backend refuses
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  CpuBackend be(DType::F32);
  alignas(16) float s[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  std::vector<uint8_t> A(16 * 16, 0x38), B(16 * 16, 0x38);
  std::vector<float> D(16 * 16);
  be.fp8_gemm(D.data(), true, 0.0f, A.data(), Fp8Format::E4M3, s, B.data(), Fp8Format::E4M3, s,
              16, 16, 16, nullptr);
  EXPECT_EQ(D[0], 16.0f);  // 16 products of 1 x 1 (0x38 is 1.0 in E4M3)
  EXPECT_DEATH(be.fp8_gemm(D.data(), true, 0.0f, A.data(), Fp8Format::E4M3, s + 1, B.data(),
                           Fp8Format::E4M3, s, 16, 16, 16, nullptr),
               "scale_inv pointers must be 16-byte aligned");
}

}  // namespace
