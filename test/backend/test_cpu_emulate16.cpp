// 16-bit emulation of the CPU backend: the rounding helpers on known values and against
// independent conversions (GCC's _Float16 for fp16; nearest-neighbour search for bf16), the
// overflow of an fp16 Linear output to inf, and every act output of an emulating backend being
// exactly the rounded fp32 result. Also memory accounting and the backend factory.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "backend_test_util.h"
#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/backend/cpu/emulate16.h"
#include "vitgrid/core/error.h"

namespace {

using vgtest::randn;
using vitgrid::CpuBackend;
using vitgrid::DType;
using vitgrid::round_bf16;
using vitgrid::round_f16;

const float kInf = std::numeric_limits<float>::infinity();

TEST(Emulate16, Bf16KnownValues) {
  EXPECT_EQ(round_bf16(1.0f), 1.0f);
  EXPECT_EQ(round_bf16(1.0f + std::ldexp(1.0f, -9)), 1.0f);  // below half an ulp (2^-7)
  EXPECT_EQ(round_bf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);  // tie -> even mantissa
  EXPECT_EQ(round_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));  // tie -> even
  EXPECT_EQ(round_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)),
            1.0f + std::ldexp(1.0f, -7));  // just above the tie
  EXPECT_EQ(round_bf16(-3.14159265f), -3.140625f);
  EXPECT_EQ(round_bf16(70000.0f), 70144.0f);  // ulp 512 at 2^16
  EXPECT_EQ(round_bf16(std::numeric_limits<float>::max()), kInf);  // beyond bf16's max
  EXPECT_EQ(round_bf16(-kInf), -kInf);
  EXPECT_TRUE(std::isnan(round_bf16(std::numeric_limits<float>::quiet_NaN())));
  // Subnormals: bf16's quantum there is 2^-133 (7 stored mantissa bits below 2^-126).
  EXPECT_EQ(round_bf16(std::ldexp(3.0f, -133)), std::ldexp(3.0f, -133));
  EXPECT_EQ(round_bf16(std::numeric_limits<float>::denorm_min() * 3), 0.0f);
  EXPECT_EQ(round_bf16(std::ldexp(1.5f, -133)), std::ldexp(2.0f, -133));  // tie -> even
}

TEST(Emulate16, F16KnownValues) {
  EXPECT_EQ(round_f16(1.0f + std::ldexp(1.0f, -11)), 1.0f);  // tie -> even
  EXPECT_EQ(round_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 1.0f + std::ldexp(1.0f, -9));
  EXPECT_EQ(round_f16(1.0f + std::ldexp(1.0f, -10)), 1.0f + std::ldexp(1.0f, -10));
  EXPECT_EQ(round_f16(65504.0f), 65504.0f);  // largest finite
  EXPECT_EQ(round_f16(65519.0f), 65504.0f);
  EXPECT_EQ(round_f16(65520.0f), kInf);  // the tie above the max rounds to "even" = inf
  EXPECT_EQ(round_f16(70000.0f), kInf);
  EXPECT_EQ(round_f16(-70000.0f), -kInf);
  EXPECT_EQ(round_f16(std::ldexp(1.0f, -14)), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(round_f16(std::ldexp(1.0f, -24)), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(round_f16(std::ldexp(1.0f, -25)), 0.0f);                   // tie -> even (0)
  EXPECT_EQ(round_f16(3 * std::ldexp(1.0f, -25)), std::ldexp(1.0f, -23));  // tie -> even (2)
  EXPECT_EQ(round_f16(1e-8f), 0.0f);
  EXPECT_EQ(round_f16(-6e-8f), -std::ldexp(1.0f, -24));
  EXPECT_EQ(round_f16(0.1f), 0.0999755859375f);
  EXPECT_TRUE(std::isnan(round_f16(std::numeric_limits<float>::quiet_NaN())));
}

// Independent references over many random bit patterns (all exponents, both signs).
TEST(Emulate16, RandomBitPatternsMatchIndependentConversions) {
  std::mt19937 gen(7);
  for (int it = 0; it < 200000; ++it) {
    uint32_t u = gen();
    if (it % 4 == 0) u = (u & 0x80FFFFFFu) | ((100u + gen() % 40u) << 23);  // near fp16 range
    const float x = vitgrid::f32_from_bits(u);
    if (std::isnan(x)) continue;
    // bf16: the nearer of the two neighbours obtained by truncation, ties to the even one.
    const uint32_t lo_bits = u & 0xFFFF0000u;
    const float lo = vitgrid::f32_from_bits(lo_bits);
    if (lo_bits == u) {
      ASSERT_EQ(round_bf16(x), x);
    } else if (!std::isinf(x)) {
      const uint32_t hi_bits = lo_bits + 0x10000u;
      const float hi = vitgrid::f32_from_bits(hi_bits);
      const double hid = std::isinf(hi) ? std::copysign(std::ldexp(1.0, 128), x) : (double)hi;
      const double dl = std::fabs((double)x - lo), dh = std::fabs((double)x - hid);
      const float want = dl < dh ? lo : (dh < dl ? hi : (((lo_bits >> 16) & 1u) ? hi : lo));
      ASSERT_EQ(round_bf16(x), want) << std::hexfloat << x;
    }
#ifdef __FLT16_MAX__
    const float want16 = (float)(_Float16)x;  // libgcc's correctly rounded conversion
    ASSERT_EQ(round_f16(x), want16) << std::hexfloat << x;
#endif
  }
}

TEST(Emulate16, F16LinearOverflowsToInfWhereF32Gives70000) {
  const std::vector<float> x = {400.0f, 300.0f}, W = {100.0f, 100.0f};
  float y = 0.0f;
  CpuBackend f32(DType::F32), f16(DType::F16), bf16(DType::BF16);
  EXPECT_EQ(f16.act_size(), 4u);
  EXPECT_EQ(f16.act_dtype(), DType::F16);
  f32.linear_forward(&y, x.data(), W.data(), nullptr, 1, 2, 1);
  EXPECT_EQ(y, 70000.0f);
  f16.linear_forward(&y, x.data(), W.data(), nullptr, 1, 2, 1);
  EXPECT_EQ(y, kInf);
  EXPECT_FALSE(f16.all_finite(&y, 1));
  bf16.linear_forward(&y, x.data(), W.data(), nullptr, 1, 2, 1);
  EXPECT_EQ(y, 70144.0f);
}

// An emulating backend's act outputs are exactly round(fp32 result) for ops with one final
// rounding, computed from the same (representable) inputs by the fp32 backend.
TEST(Emulate16, EveryActOutputIsTheRoundedFp32Result) {
  for (DType t : {DType::BF16, DType::F16}) {
    CpuBackend ref(DType::F32), em(t);
    auto rounded = [&](std::vector<float> v) {
      vitgrid::round_buffer(t, v.data(), v.size());
      return v;
    };
    auto expect_rounded_eq = [&](const std::vector<float>& got, std::vector<float> want,
                                 const char* what) {
      vitgrid::round_buffer(t, want.data(), want.size());
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_EQ(got[i], want[i]) << what << " element " << i << " dtype " << (int)t;
    };
    const int N = 9, in = 17, out = 13;
    // cast_to_act rounds; cast_to_f32 copies.
    auto raw = randn((size_t)N * in, 1, 3.0f);
    std::vector<float> x(raw.size()), back(raw.size());
    em.cast_to_act(x.data(), raw.data(), raw.size());
    expect_rounded_eq(x, raw, "cast_to_act");
    em.cast_to_f32(back.data(), x.data(), x.size());
    EXPECT_EQ(back, x);

    auto W = rounded(randn((size_t)out * in, 2)), b = rounded(randn(out, 3));
    std::vector<float> y1((size_t)N * out), y2 = y1, g1 = y1, g2 = y1;
    ref.linear_forward(y1.data(), x.data(), W.data(), b.data(), N, in, out);
    em.linear_forward(y2.data(), x.data(), W.data(), b.data(), N, in, out, g2.data());
    expect_rounded_eq(y2, y1, "linear");
    ref.gelu_forward(g1.data(), y2.data(), y2.size(), vitgrid::Gelu::Exact);
    expect_rounded_eq(g2, g1, "gelu epilogue");

    auto dy = rounded(randn((size_t)N * out, 4));
    std::vector<float> dx1((size_t)N * in), dx2 = dx1, dW1((size_t)out * in, 0.f), dW2 = dW1;
    ref.linear_backward(dx1.data(), dW1.data(), nullptr, dy.data(), x.data(), W.data(), N, in, out);
    em.linear_backward(dx2.data(), dW2.data(), nullptr, dy.data(), x.data(), W.data(), N, in, out);
    expect_rounded_eq(dx2, dx1, "linear dx");
    EXPECT_EQ(dW2, dW1) << "weight gradients are fp32, not rounded";

    std::vector<float> s1(x.size()), s2(x.size());
    ref.softmax_forward(s1.data(), x.data(), N, in, 0.7f);
    em.softmax_forward(s2.data(), x.data(), N, in, 0.7f);
    expect_rounded_eq(s2, s1, "softmax");

    auto gamma = rounded(randn(in, 5)), beta = rounded(randn(in, 6));
    std::vector<float> r1(x.size()), r2 = r1, l1 = r1, l2 = r1, m1(N), m2(N), rs1(N), rs2(N);
    ref.add_layernorm_forward(r1.data(), l1.data(), m1.data(), rs1.data(), x.data(), nullptr,
                              gamma.data(), beta.data(), N, in, 1e-6f);
    em.add_layernorm_forward(r2.data(), l2.data(), m2.data(), rs2.data(), x.data(), nullptr,
                             gamma.data(), beta.data(), N, in, 1e-6f);
    expect_rounded_eq(l2, l1, "layernorm");
    EXPECT_EQ(m2, m1) << "statistics are fp32";
    EXPECT_EQ(rs2, rs1);

    const int B = 2, T = 5, H = 2, hd = 3, C = H * hd;
    auto qkv = rounded(randn((size_t)B * T * 3 * C, 7));
    std::vector<float> o1((size_t)B * T * C), o2 = o1;
    std::vector<float> sv(ref.attention_saved_bytes(B, T, H, hd) / 4);
    std::vector<float> ws(ref.attention_workspace_bytes(B, T, H, hd) / 4);
    std::vector<float> sv2 = sv;
    ref.attention_forward(o1.data(), sv.data(), qkv.data(), B, T, H, hd, ws.data());
    em.attention_forward(o2.data(), sv2.data(), qkv.data(), B, T, H, hd, ws.data());
    // The saved probabilities are act values; P V uses them, so out is close to (not exactly)
    // round(fp32 out): within a few units of the 16-bit format's precision.
    expect_rounded_eq(sv2, sv, "attention probabilities");
    const double u = t == DType::BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    for (size_t i = 0; i < o1.size(); ++i) {
      ASSERT_EQ(o2[i], vitgrid::round_to(t, o2[i])) << "attention out is an act value";
      ASSERT_NEAR(o2[i], o1[i], 8 * u * (1.0 + std::fabs(o1[i]))) << i;
    }

    std::vector<float> z = rounded(randn(3 * 5, 8)), loss1(3), loss2(3), dz1(15), dz2(15);
    const std::vector<int32_t> labels = {1, 4, 0};
    ref.cross_entropy(loss1.data(), dz1.data(), z.data(), labels.data(), nullptr, 3, 5, 0.1f,
                      1024.0f);
    em.cross_entropy(loss2.data(), dz2.data(), z.data(), labels.data(), nullptr, 3, 5, 0.1f,
                     1024.0f);
    EXPECT_EQ(loss2, loss1) << "losses are fp32";
    expect_rounded_eq(dz2, dz1, "dlogits");
  }
}

TEST(CpuMemory, AlignedAllocPeakAndCurrent) {
  CpuBackend be;
  EXPECT_EQ(be.peak_memory_bytes(), 0u);
  void* a = be.alloc(100);
  void* b = be.alloc(1000);
  void* z = be.alloc(0);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 64, 0u);
  EXPECT_EQ(be.current_memory_bytes(), 128u + 1024u + 64u);  // rounded to 64-byte multiples
  be.release(b);
  EXPECT_EQ(be.current_memory_bytes(), 128u + 64u);
  EXPECT_EQ(be.peak_memory_bytes(), 128u + 1024u + 64u);
  // Copies and zeroing.
  std::vector<float> h = randn(25, 9), back(25);
  be.copy_to_device(a, h.data(), 100);
  be.copy_to_host(back.data(), a, 100);
  EXPECT_EQ(back, h);
  be.zero(a, 100);
  be.copy_to_host(back.data(), a, 100);
  for (float v : back) EXPECT_EQ(v, 0.0f);
  be.release(a);
  be.release(z);
  be.release(nullptr);
  EXPECT_EQ(be.current_memory_bytes(), 0u);
}

TEST(BackendFactory, KindsAndErrors) {
  auto be = vitgrid::make_backend("cpu", 0, DType::BF16);
  ASSERT_NE(be, nullptr);
  EXPECT_EQ(be->name(), "cpu");
  EXPECT_EQ(be->act_dtype(), DType::BF16);
  EXPECT_EQ(be->act_size(), 4u);
  EXPECT_THROW(vitgrid::make_backend("tpu", 0, DType::F32), vitgrid::UserError);
#ifndef VITGRID_HAVE_CUDA
  EXPECT_FALSE(vitgrid::cuda_available());
  try {
    vitgrid::make_backend("cuda", 0, DType::F32);
    FAIL() << "expected UserError";
  } catch (const vitgrid::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("without CUDA"), std::string::npos);
  }
#endif
}

}  // namespace
