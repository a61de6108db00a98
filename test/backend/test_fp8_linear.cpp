// The FP8 Linear layer (backend/fp8_linear.h) on the CPU backend in bf16 emulation, against
// references built here from fp8_encode/fp8_decode and double sums: the forward, the data and
// weight gradients with each operand in its format and scale, the bias and its gradient, the
// GELU variants as the bf16 layer's passes give them, the amaxes recorded, the scratch size, the
// shapes refused; and the layer against the bf16 Linear, as far as E4M3's 3 mantissa bits allow.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/backend/cpu/emulate16.h"
#include "vitgrid/backend/fp8.h"
#include "vitgrid/backend/fp8_linear.h"

namespace {

using vitgrid::CpuBackend;
using vitgrid::DType;
using vitgrid::Fp8Format;
using vitgrid::Fp8LinearMeta;
using Vec = std::vector<float>;

constexpr int N = 32, kIn = 48, kOut = 64;

Vec rnd(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  Vec v(n);
  for (float& x : v) x = vitgrid::round_bf16(d(rng));
  return v;
}

Vec quantized(const Vec& v, float scale, Fp8Format f) {
  Vec q(v.size());
  for (size_t i = 0; i < v.size(); ++i) q[i] = vitgrid::fp8_decode(vitgrid::fp8_encode(v[i] * scale, f), f);
  return q;
}

float amax_of(const Vec& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

// |got - want| within one bf16 ulp of want (plus fp32 noise)
void expect_bf16_close(const Vec& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = std::ldexp(std::fabs(want[i]), -8) + 1e-6;
    ASSERT_LE(std::fabs(got[i] - want[i]), tol) << what << " element " << i;
  }
}

struct Layer {
  std::mt19937 rng{42};
  CpuBackend be{DType::BF16};
  Vec x = rnd(rng, size_t(N) * kIn, 2.0f), W = rnd(rng, size_t(kOut) * kIn, 0.1f);
  Vec b = rnd(rng, kOut, 1.0f), dy = rnd(rng, size_t(N) * kOut, 1e-3f);
  // scales as the recipe would set them (fp8_max / amax), deliberately not powers of two
  Vec scale = {448.0f / amax_of(x) * 0.9f, 448.0f / amax_of(W) * 0.7f, 57344.0f / amax_of(dy) * 0.8f};
  Vec scale_inv = {1.0f / scale[0], 1.0f / scale[1], 1.0f / scale[2]};
  std::vector<uint8_t> scratch = std::vector<uint8_t>(vitgrid::fp8_linear_scratch_bytes(N, kIn, kOut));
  // the layer's view: each tensor's values 16 bytes apart (the GEMMs' scale_inv contract)
  alignas(16) float s4[12] = {}, si4[12] = {}, a4[12] = {};
  Fp8LinearMeta meta() {
    for (int k = 0; k < 3; ++k) {
      s4[4 * k] = scale[k];
      si4[4 * k] = scale_inv[k];
    }
    return {s4, si4, a4, Fp8LinearMeta::kAligned};
  }
  float amax(int k) const { return a4[4 * k]; }  // what the casts recorded
};

TEST(Fp8Linear, ScratchCoversBothPasses) {
  // forward x + W, backward dy + dy^T + W^T + x^T
  EXPECT_EQ(vitgrid::fp8_linear_scratch_bytes(32, 48, 64), size_t(2 * 32 * 64 + 48 * 64 + 32 * 48));
  EXPECT_EQ(vitgrid::fp8_linear_scratch_bytes(16, 4096, 16), size_t(2 * 16 * 16 + 4096 * 16 + 16 * 4096));
}

TEST(Fp8Linear, ForwardIsTheQuantizedProduct) {
  Layer L;
  Vec y(size_t(N) * kOut), g(size_t(N) * kOut);
  vitgrid::fp8_linear_forward(L.be, L.meta(), L.scratch.data(), y.data(), L.x.data(), L.W.data(),
                              L.b.data(), N, kIn, kOut, g.data(), vitgrid::Gelu::Exact);
  const Vec xq = quantized(L.x, L.scale[0], Fp8Format::E4M3);
  const Vec wq = quantized(L.W, L.scale[1], Fp8Format::E4M3);
  std::vector<double> want(size_t(N) * kOut);
  for (int i = 0; i < N; ++i)
    for (int o = 0; o < kOut; ++o) {
      double acc = 0;
      for (int k = 0; k < kIn; ++k) acc += double(xq[i * kIn + k]) * wq[o * kIn + k];
      want[i * kOut + o] = acc * (double(L.scale_inv[0]) * L.scale_inv[1]) + L.b[o];
    }
  expect_bf16_close(y, want, "y");
  Vec g_ref(y.size());
  L.be.gelu_forward(g_ref.data(), y.data(), y.size(), vitgrid::Gelu::Exact);
  EXPECT_EQ(g, g_ref) << "the GELU output is gelu(y), as the bf16 layer's unfused pass";
  EXPECT_EQ(L.amax(0), amax_of(L.x));
  EXPECT_EQ(L.amax(1), amax_of(L.W));
  EXPECT_EQ(L.amax(2), 0.0f) << "the forward casts no gradient";
}

TEST(Fp8Linear, BackwardIsTheQuantizedProducts) {
  Layer L;
  Vec dx(size_t(N) * kIn), dW(size_t(kOut) * kIn, 0.25f), db(kOut, -1.0f);
  const Vec dW0 = dW, db0 = db;
  vitgrid::fp8_linear_backward(L.be, L.meta(), L.scratch.data(), dx.data(), dW.data(), db.data(),
                               L.dy.data(), L.x.data(), L.W.data(), N, kIn, kOut);
  const Vec xq = quantized(L.x, L.scale[0], Fp8Format::E4M3);
  const Vec wq = quantized(L.W, L.scale[1], Fp8Format::E4M3);
  const Vec dyq = quantized(L.dy, L.scale[2], Fp8Format::E5M2);
  std::vector<double> want_dx(dx.size());
  for (int i = 0; i < N; ++i)
    for (int k = 0; k < kIn; ++k) {
      double acc = 0;
      for (int o = 0; o < kOut; ++o) acc += double(dyq[i * kOut + o]) * wq[o * kIn + k];
      want_dx[i * kIn + k] = acc * (double(L.scale_inv[2]) * L.scale_inv[1]);
    }
  expect_bf16_close(dx, want_dx, "dx");
  for (int o = 0; o < kOut; ++o)
    for (int k = 0; k < kIn; ++k) {
      double acc = 0;
      for (int i = 0; i < N; ++i) acc += double(dyq[i * kOut + o]) * xq[i * kIn + k];
      const double want = dW0[o * kIn + k] + acc * (double(L.scale_inv[2]) * L.scale_inv[0]);
      ASSERT_NEAR(dW[o * kIn + k], want, 1e-5 * std::fabs(want) + 1e-9) << "dW " << o << "," << k;
    }
  for (int o = 0; o < kOut; ++o) {
    double acc = db0[o];
    for (int i = 0; i < N; ++i) acc += L.dy[i * kOut + o];  // from dy itself, not its FP8 copy
    ASSERT_NEAR(db[o], acc, 1e-6) << "db " << o;
  }
  EXPECT_EQ(L.amax(0), amax_of(L.x));
  EXPECT_EQ(L.amax(1), amax_of(L.W));
  EXPECT_EQ(L.amax(2), amax_of(L.dy));
}

TEST(Fp8Linear, GeluBackwardVariantsAreTheBf16Passes) {
  // dx through the GELU of the previous Linear: the FP8 data gradient, then the same
  // gelu_backward(_bias) pass the bf16 layer runs on its own dx
  Layer L;
  std::mt19937 rng(5);
  const Vec pre = rnd(rng, size_t(N) * kIn, 1.5f);
  Vec plain(size_t(N) * kIn), fused(plain.size()), fused_db(plain.size());
  Vec gdb(kIn, 0.0f), gdb_ref(kIn, 0.0f);
  vitgrid::fp8_linear_backward(L.be, L.meta(), L.scratch.data(), plain.data(), nullptr, nullptr,
                               L.dy.data(), nullptr, L.W.data(), N, kIn, kOut);
  vitgrid::fp8_linear_backward(L.be, L.meta(), L.scratch.data(), fused.data(), nullptr, nullptr,
                               L.dy.data(), nullptr, L.W.data(), N, kIn, kOut, pre.data(),
                               vitgrid::Gelu::Exact);
  vitgrid::fp8_linear_backward(L.be, L.meta(), L.scratch.data(), fused_db.data(), nullptr, nullptr,
                               L.dy.data(), nullptr, L.W.data(), N, kIn, kOut, pre.data(),
                               vitgrid::Gelu::Exact, gdb.data());
  Vec want(plain.size());
  L.be.gelu_backward(want.data(), pre.data(), plain.data(), want.size(), vitgrid::Gelu::Exact);
  EXPECT_EQ(fused, want);
  Vec want_db(plain.size());
  L.be.gelu_backward_bias(want_db.data(), pre.data(), plain.data(), N, kIn, gdb_ref.data(),
                          vitgrid::Gelu::Exact);
  EXPECT_EQ(fused_db, want_db);
  EXPECT_EQ(gdb, gdb_ref);
  EXPECT_EQ(L.amax(0), 0.0f) << "no weight gradient: x is not cast";
}

TEST(Fp8Linear, DyGeluIsGeluBackwardThenTheLayer) {
  // dy_gelu (fc1): the cast of dy takes GELU's backward and the bias gradient in its pass; the
  // same dx, dW, db and dy amax, bit for bit, as gelu_backward's stored values fed to the plain
  // layer (what fc2's backward followed by fc1's did)
  Layer L, R;
  std::mt19937 rng(9);
  const Vec pre = rnd(rng, size_t(N) * kOut, 1.5f);
  Vec dx(size_t(N) * kIn), dW(size_t(kOut) * kIn, 0.25f), db(kOut, -1.0f);
  Vec rdx = dx, rdW = dW, rdb = db;
  vitgrid::Fp8LinearMeta m = L.meta();
  m.dy_gelu = true;
  vitgrid::fp8_linear_backward(L.be, m, L.scratch.data(), dx.data(), dW.data(), db.data(),
                               L.dy.data(), L.x.data(), L.W.data(), N, kIn, kOut, pre.data(),
                               vitgrid::Gelu::Exact);
  Vec g(pre.size());
  R.be.gelu_backward(g.data(), pre.data(), R.dy.data(), g.size(), vitgrid::Gelu::Exact);
  vitgrid::fp8_linear_backward(R.be, R.meta(), R.scratch.data(), rdx.data(), rdW.data(),
                               rdb.data(), g.data(), R.x.data(), R.W.data(), N, kIn, kOut);
  EXPECT_EQ(dx, rdx);
  EXPECT_EQ(dW, rdW);
  EXPECT_EQ(db, rdb);
  EXPECT_EQ(L.amax(2), amax_of(g));
  EXPECT_NE(L.amax(2), amax_of(L.dy)) << "the amax is the GELU gradient's, not dy's";
  EXPECT_NE(dx, [&] {  // and it is not the layer on dy itself
    Layer P;
    Vec pdx(dx.size());
    vitgrid::fp8_linear_backward(P.be, P.meta(), P.scratch.data(), pdx.data(), nullptr, nullptr,
                                 P.dy.data(), nullptr, P.W.data(), N, kIn, kOut);
    return pdx;
  }());
}

TEST(Fp8Linear, KeptTransposeIsTheBackwardsCast) {
  // x_t: the forward's cast of x writes its transpose, the weight gradient takes it without
  // reading x (null here): the same dW, dx and amaxes, bit for bit, as casting x again
  Layer L, R;
  std::vector<uint8_t> xt(size_t(N) * kIn, 0xAA);
  vitgrid::Fp8LinearMeta m = L.meta();
  m.x_t = xt.data();
  Vec y(size_t(N) * kOut), ry(y.size());
  vitgrid::fp8_linear_forward(L.be, m, L.scratch.data(), y.data(), L.x.data(), L.W.data(),
                              L.b.data(), N, kIn, kOut);
  vitgrid::fp8_linear_forward(R.be, R.meta(), R.scratch.data(), ry.data(), R.x.data(), R.W.data(),
                              R.b.data(), N, kIn, kOut);
  EXPECT_EQ(y, ry);
  const Vec xq = quantized(L.x, L.scale[0], Fp8Format::E4M3);
  for (int i = 0; i < N; ++i)
    for (int k = 0; k < kIn; ++k)
      ASSERT_EQ(vitgrid::fp8_decode(xt[size_t(k) * N + i], Fp8Format::E4M3),
                xq[size_t(i) * kIn + k])
          << i << "," << k;
  Vec dx(size_t(N) * kIn), dW(size_t(kOut) * kIn, 0.25f), rdx = dx, rdW = dW;
  vitgrid::fp8_linear_backward(L.be, m, L.scratch.data(), dx.data(), dW.data(), nullptr,
                               L.dy.data(), nullptr, L.W.data(), N, kIn, kOut);
  vitgrid::fp8_linear_backward(R.be, R.meta(), R.scratch.data(), rdx.data(), rdW.data(), nullptr,
                               R.dy.data(), R.x.data(), R.W.data(), N, kIn, kOut);
  EXPECT_EQ(dx, rdx);
  EXPECT_EQ(dW, rdW);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(L.amax(k), R.amax(k)) << k;
}

TEST(Fp8Linear, KeptWeightTransposeIsTheBackwardsCast) {
  // w_t: the forward's cast of W writes W's transpose beside its codes, the data gradient takes
  // it without casting W (W null in the backward): the codes are W's, transposed, and dx, dW
  // and the amaxes the same bits as the layer casting W again
  Layer L, R;
  std::vector<uint8_t> wt(size_t(kOut) * kIn, 0xAA);
  Fp8LinearMeta m = L.meta();
  m.w_t = wt.data();
  Vec y(size_t(N) * kOut), ry(y.size());
  vitgrid::fp8_linear_forward(L.be, m, L.scratch.data(), y.data(), L.x.data(), L.W.data(),
                              L.b.data(), N, kIn, kOut);
  vitgrid::fp8_linear_forward(R.be, R.meta(), R.scratch.data(), ry.data(), R.x.data(), R.W.data(),
                              R.b.data(), N, kIn, kOut);
  EXPECT_EQ(y, ry);
  const Vec wq = quantized(L.W, L.scale[1], Fp8Format::E4M3);
  for (int o = 0; o < kOut; ++o)
    for (int k = 0; k < kIn; ++k)
      ASSERT_EQ(vitgrid::fp8_decode(wt[size_t(k) * kOut + o], Fp8Format::E4M3),
                wq[size_t(o) * kIn + k])
          << o << "," << k;
  const float w_amax = L.amax(1);
  EXPECT_EQ(w_amax, amax_of(L.W));
  Vec dx(size_t(N) * kIn), dW(size_t(kOut) * kIn, 0.25f), rdx = dx, rdW = dW;
  vitgrid::fp8_linear_backward(L.be, m, L.scratch.data(), dx.data(), dW.data(), nullptr,
                               L.dy.data(), L.x.data(), nullptr, N, kIn, kOut);
  vitgrid::fp8_linear_backward(R.be, R.meta(), R.scratch.data(), rdx.data(), rdW.data(), nullptr,
                               R.dy.data(), R.x.data(), R.W.data(), N, kIn, kOut);
  EXPECT_EQ(dx, rdx);
  EXPECT_EQ(dW, rdW);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(L.amax(k), R.amax(k)) << k;
  // a transpose that is not W's would show in dx: the backward does read w_t
  std::fill(wt.begin(), wt.end(), uint8_t{0});
  Vec zdx(dx.size(), 1.0f);
  vitgrid::fp8_linear_backward(L.be, m, L.scratch.data(), zdx.data(), nullptr, nullptr,
                               L.dy.data(), nullptr, nullptr, N, kIn, kOut);
  EXPECT_EQ(zdx, Vec(dx.size(), 0.0f));
}

TEST(Fp8Linear, CastInputIsTakenFromTheScratch) {
  // x_cast: x's codes at the scratch's start (and its transpose in x_t), written by whoever
  // produced x with the layer's x scale and amax (the LayerNorm before it); the forward casts
  // no x, reads none (null) and leaves x's amax alone: the same y as the layer casting x
  Layer L, R;
  std::vector<uint8_t> xt(size_t(N) * kIn, 0xAA), rxt(xt.size(), 0x55);
  Fp8LinearMeta m = L.meta(), rm = R.meta();
  m.x_t = xt.data();
  m.x_cast = true;
  rm.x_t = rxt.data();
  L.be.fp8_cast(L.scratch.data(), xt.data(), m.amax_of(Fp8LinearMeta::kX), L.x.data(), N, kIn,
                m.scale_of(Fp8LinearMeta::kX), Fp8Format::E4M3);
  const float x_amax = L.amax(0);
  std::fill(L.scratch.begin() + size_t(N) * kIn, L.scratch.end(), 0x7F);  // the rest: garbage
  Vec y(size_t(N) * kOut), ry(y.size());
  vitgrid::fp8_linear_forward(L.be, m, L.scratch.data(), y.data(), nullptr, L.W.data(),
                              L.b.data(), N, kIn, kOut);
  vitgrid::fp8_linear_forward(R.be, rm, R.scratch.data(), ry.data(), R.x.data(), R.W.data(),
                              R.b.data(), N, kIn, kOut);
  EXPECT_EQ(y, ry);
  EXPECT_EQ(xt, rxt);
  EXPECT_EQ(L.amax(0), x_amax);
  EXPECT_EQ(L.amax(0), R.amax(0));
  EXPECT_EQ(L.amax(1), R.amax(1));
  // a cast input with a GELU still to apply: a programming error, the process ends naming it
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const vitgrid::Gelu gelu = vitgrid::Gelu::Exact;
  m.x_gelu = &gelu;
  EXPECT_DEATH(vitgrid::fp8_linear_forward(L.be, m, L.scratch.data(), y.data(), nullptr,
                                           L.W.data(), L.b.data(), N, kIn, kOut),
               "an input cast already and a GELU to apply");
}

TEST(Fp8Linear, CloseToTheBf16Layer) {
  // E4M3 keeps 3 mantissa bits: each operand is within 2^-4 relative of its bf16 value, so the
  // output is a few percent off the bf16 layer's (rel L2), and not equal to it
  Layer L;
  Vec y8(size_t(N) * kOut), y16(y8.size());
  vitgrid::fp8_linear_forward(L.be, L.meta(), L.scratch.data(), y8.data(), L.x.data(), L.W.data(),
                              nullptr, N, kIn, kOut);
  L.be.linear_forward(y16.data(), L.x.data(), L.W.data(), nullptr, N, kIn, kOut);
  double num = 0, den = 0;
  for (size_t i = 0; i < y8.size(); ++i) {
    num += (double(y8[i]) - y16[i]) * (double(y8[i]) - y16[i]);
    den += double(y16[i]) * y16[i];
  }
  const double rel = std::sqrt(num / den);
  EXPECT_LT(rel, 0.06);
  EXPECT_GT(rel, 0.002);
}

TEST(Fp8Linear, ForwardAndDataGradientTakeAnyRows) {
  // only the weight gradient has the rows as its K: 30 rows run, and are the first 30 of 32
  Layer L;
  const int n = N - 2;
  Vec y(size_t(N) * kOut), y30(size_t(n) * kOut), dx(size_t(N) * kIn), dx30(size_t(n) * kIn);
  vitgrid::fp8_linear_forward(L.be, L.meta(), L.scratch.data(), y.data(), L.x.data(), L.W.data(),
                              L.b.data(), N, kIn, kOut);
  vitgrid::fp8_linear_forward(L.be, L.meta(), L.scratch.data(), y30.data(), L.x.data(),
                              L.W.data(), L.b.data(), n, kIn, kOut);
  vitgrid::fp8_linear_backward(L.be, L.meta(), L.scratch.data(), dx.data(), nullptr, nullptr,
                               L.dy.data(), nullptr, L.W.data(), N, kIn, kOut);
  vitgrid::fp8_linear_backward(L.be, L.meta(), L.scratch.data(), dx30.data(), nullptr, nullptr,
                               L.dy.data(), nullptr, L.W.data(), n, kIn, kOut);
  for (size_t i = 0; i < y30.size(); ++i) ASSERT_EQ(y30[i], y[i]) << i;
  for (size_t i = 0; i < dx30.size(); ++i) ASSERT_EQ(dx30[i], dx[i]) << i;
}

TEST(Fp8Linear, RefusesShapesTheFp8GemmsCannotTake) {
  // a programming error (the deck's checks come first): the process ends naming it
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Layer L;
  Vec y(size_t(N) * kOut), dW(size_t(kOut) * kIn);
  EXPECT_DEATH(vitgrid::fp8_linear_backward(L.be, L.meta(), L.scratch.data(), nullptr, dW.data(),
                                            nullptr, L.dy.data(), L.x.data(), L.W.data(), N - 2,
                                            kIn, kOut),
               "rows that are a multiple of 16 \\(rows 30, in 48, out 64\\)");
  EXPECT_DEATH(vitgrid::fp8_linear_backward(L.be, L.meta(), L.scratch.data(), y.data(), nullptr,
                                            nullptr, L.dy.data(), nullptr, L.W.data(), N,
                                            kIn - 8, kOut),
               "multiples of 16 \\(rows 32, in 40, out 64\\)");
}

}  // namespace
