// The CUDA backend's FP8 ops (backend.h Fp8Ops) against the CPU backend's exact emulation
// (backend/fp8.h codes, fp32 sums):
//  - fp8_cast: the same codes bit for bit (both convert the same fp32 product x * scale with
//    nearest-even saturating rounding), the same transpose, the same amax; a NaN input gives
//    NaN codes and a NaN amax on both. The shapes reach both of the kernel's paths: whole
//    64 x 128 tiles of aligned rows (vectors) and edge tiles or odd widths (element-wise).
//  - fp8_gemm: each product of two FP8 values is exact, and the CPU sums them in fp32; the
//    tensor cores sum them in a narrower accumulator between cuBLASLt's promotions to fp32
//    (~14 bits, as DeepSeek-V3's report measured on Hopper): an act-dtype output may differ by
//    one ulp of its format plus 2^-10 of the sum of the products' magnitudes (2^-12 seen on an
//    H100); an fp32 output (accumulated over micro-batches) within 1e-5 relative (L2). Every
//    pairing a Linear layer uses: E4M3 x E4M3 (forward), E5M2 x E4M3 (data gradient), E5M2 x
//    E4M3 into fp32 with beta 1 (weight gradient).
//  - fp8_cast_grad (a gradient's cast with GELU's backward and the bias sums in its pass)
//    against gelu_backward then fp8_cast on the GPU itself, the sums against double sums; the
//    same for attention_backward_fp8 (the attention backward casting qkv's gradient) and
//    layernorm_backward_fp8 (the LayerNorm backward casting the Row Linear's gradient).
//  - the FP8 Linear layer composed from them, against the CPU's composition.
// Skips without a GPU, and the FP8 cases on a GPU without FP8 tensor cores (where
// fp8_supported must say so).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/cuda/cuda_backend.h"
#include "vitgrid/backend/fp8.h"
#include "vitgrid/backend/fp8_linear.h"

namespace vitgrid {
namespace {

using namespace gputest;  // NOLINT: test file, the harness is its vocabulary

class GpuFp8 : public GpuVsCpu {
 protected:
  GpuFp8() : GpuVsCpu(2026) {}
  void SetUp() override {
    GpuVsCpu::SetUp();
    if (IsSkipped()) return;
    std::string why;
    if (!gpu->be->fp8_supported(&why)) {
      EXPECT_FALSE(why.empty()) << "fp8_supported false without a reason";
      GTEST_SKIP() << why;
    }
  }
  std::vector<uint8_t> codes(Dev& d, const uint8_t* p, size_t n) {
    std::vector<uint8_t> h(n);
    d.be->copy_to_host(h.data(), p, n);
    return h;
  }
  uint8_t* bytes(Dev& d, const std::vector<uint8_t>& h) {
    uint8_t* p = static_cast<uint8_t*>(d.raw(std::max<size_t>(1, h.size())));
    d.be->copy_to_device(p, h.data(), h.size());
    return p;
  }
  // Random codes of format f whose values are finite and within +-limit.
  std::vector<uint8_t> random_codes(size_t n, Fp8Format f, float limit) {
    std::vector<uint8_t> ok;
    for (int c = 0; c < 256; ++c) {
      const float v = fp8_decode(static_cast<uint8_t>(c), f);
      if (std::isfinite(v) && std::fabs(v) <= limit) ok.push_back(static_cast<uint8_t>(c));
    }
    std::uniform_int_distribution<size_t> pick(0, ok.size() - 1);
    std::vector<uint8_t> out(n);
    for (auto& c : out) c = ok[pick(rng)];
    return out;
  }
};

// One ulp of v in the act dtype (bf16: 8 significant bits, fp16: 11, fp32: 24), at v's binade.
double ulp(DType dt, double v) {
  const int bits = dt == DType::BF16 ? 8 : (dt == DType::F16 ? 11 : 24);
  const double a = std::fabs(v);
  if (a == 0) return 0;
  return std::ldexp(1.0, std::ilogb(a) - (bits - 1));
}

TEST_P(GpuFp8, CastCodesTransposeAndAmax) {
  struct Shape {
    int rows, cols;
  };
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    for (Shape s :
         {Shape{37, 101}, Shape{70, 130}, Shape{256, 768}, Shape{200, 392}, Shape{1, 5}}) {
      for (float scale : {1.0f, 37.5f, 0.0625f}) {
        SCOPED_TRACE(std::string(fp8_format_name(f)) + " " + std::to_string(s.rows) + "x" +
                     std::to_string(s.cols) + " scale " + std::to_string(scale));
        const size_t n = size_t(s.rows) * s.cols;
        Vec x = rnd(n, 3.0f);
        // beyond the range after scaling: both saturate to the largest finite code
        x[n / 2] = round_to(dt, 2.0f * fp8_max(f) / scale);
        x[n / 3] = round_to(dt, -3.0f * fp8_max(f) / scale);
        std::vector<uint8_t> out[2], out_t[2];
        float amax[2];
        Dev* devs[2] = {cpu.get(), gpu.get()};
        for (int k = 0; k < 2; ++k) {
          Dev& d = *devs[k];
          uint8_t* o = bytes(d, std::vector<uint8_t>(n, 0xAA));
          uint8_t* ot = bytes(d, std::vector<uint8_t>(n, 0xAA));
          float* am = d.f32(Vec{0.5f});  // a smaller amax from an earlier cast of this step
          d.be->fp8_cast(o, ot, am, d.act(x), s.rows, s.cols, d.f32(Vec{scale}), f);
          out[k] = codes(d, o, n);
          out_t[k] = codes(d, ot, n);
          amax[k] = d.get_f32(am, 1)[0];
        }
        EXPECT_EQ(out[1], out[0]);
        EXPECT_EQ(out_t[1], out_t[0]);
        EXPECT_EQ(amax[1], amax[0]);
        // independent of both: the transpose, the saturation and the amax
        float m = 0.5f;
        for (float v : x) m = std::max(m, std::fabs(v));
        EXPECT_EQ(amax[0], m);
        EXPECT_EQ(fp8_decode(out[1][n / 2], f), fp8_max(f));
        EXPECT_EQ(fp8_decode(out[1][n / 3], f), -fp8_max(f));
        for (int r = 0; r < s.rows; r += 7)
          for (int c = 0; c < s.cols; c += 5)
            ASSERT_EQ(out_t[1][size_t(c) * s.rows + r], out[1][size_t(r) * s.cols + c]);
      }
    }
  }
}

// gelu_in: on the GPU, the codes, transpose and amax of gelu_forward's output cast, bit for bit,
// in one pass (whole tiles and edge tiles; both GELU forms)
TEST_P(GpuFp8, CastWithGeluInIsGeluThenTheCast) {
  Dev& d = *gpu;
  for (Gelu form : {Gelu::Exact, Gelu::Tanh})
    for (int rows : {256, 70}) {
      const int cols = rows == 256 ? 768 : 130;
      SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) +
                   (form == Gelu::Tanh ? " tanh" : " exact"));
      const size_t n = size_t(rows) * cols;
      void* x = d.act(rnd(n, 2.0f));
      void* g = d.nan_act(n);
      d.be->gelu_forward(g, x, n, form);
      float* scale = d.f32(Vec{100.0f});
      const std::vector<uint8_t> fill(n, 0xAA);
      uint8_t *a = bytes(d, fill), *at = bytes(d, fill), *b = bytes(d, fill), *bt = bytes(d, fill);
      float *ma = d.f32(Vec{0.0f}), *mb = d.f32(Vec{0.0f});
      d.be->fp8_cast(a, at, ma, x, rows, cols, scale, Fp8Format::E4M3, &form);
      d.be->fp8_cast(b, bt, mb, g, rows, cols, scale, Fp8Format::E4M3);
      EXPECT_EQ(codes(d, a, n), codes(d, b, n));
      EXPECT_EQ(codes(d, at, n), codes(d, bt, n));
      EXPECT_EQ(d.get_f32(ma, 1)[0], d.get_f32(mb, 1)[0]);
      EXPECT_GT(d.get_f32(ma, 1)[0], 0.0f);
    }
}

// fp8_cast_grad: the codes, transpose and amax of gelu_backward's output cast (or of dy's
// without gelu_pre), bit for bit, and the bias gradient: db + the column sums of those stored
// values within fp32 rounding of a double sum, the same bits on a second run. Shapes: one
// block of four whole row tiles, a block whose last tile is short (200 rows: vector tiles then
// the element path), several block rows, an odd width (edge tiles only).
TEST_P(GpuFp8, GradCastIsGeluBackwardThenTheCastWithTheBiasSums) {
  Dev& d = *gpu;
  const std::pair<int, int> shapes[] = {{256, 768}, {200, 256}, {1000, 384}, {70, 130}};
  for (bool gelu : {false, true})
    for (const auto& rc : shapes) {
      const int rows = rc.first, cols = rc.second;
      SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + (gelu ? " gelu" : ""));
      const size_t n = size_t(rows) * cols;
      void* dy = d.act(rnd(n, 0.5f));
      void* pre = d.act(rnd(n, 2.0f));
      void* g = dy;
      if (gelu) {
        g = d.nan_act(n);
        d.be->gelu_backward(g, pre, dy, n, Gelu::Exact);
      }
      float* scale = d.f32(Vec{1000.0f});
      const std::vector<uint8_t> fill(n, 0xAA);
      uint8_t *a = bytes(d, fill), *at = bytes(d, fill), *b = bytes(d, fill), *bt = bytes(d, fill);
      float *ma = d.f32(Vec{0.0f}), *mb = d.f32(Vec{0.0f});
      float *db = d.f32(Vec(cols, 0.5f)), *db2 = d.f32(Vec(cols, 0.5f));
      d.be->fp8_cast_grad(a, at, ma, dy, rows, cols, scale, Fp8Format::E5M2, db,
                          gelu ? pre : nullptr, Gelu::Exact);
      d.be->fp8_cast(b, bt, mb, g, rows, cols, scale, Fp8Format::E5M2);
      EXPECT_EQ(codes(d, a, n), codes(d, b, n));
      EXPECT_EQ(codes(d, at, n), codes(d, bt, n));
      EXPECT_EQ(d.get_f32(ma, 1)[0], d.get_f32(mb, 1)[0]);
      const Vec gh = d.get_act(g, n), got = d.get_f32(db, cols);
      for (int c = 0; c < cols; ++c) {
        double want = 0.5, mag = 0.5;
        for (int r = 0; r < rows; ++r) {
          want += gh[size_t(r) * cols + c];
          mag += std::fabs(gh[size_t(r) * cols + c]);
        }
        ASSERT_NEAR(got[c], want, 1e-6 * mag) << "column " << c;
      }
      d.be->fp8_cast_grad(a, nullptr, ma, dy, rows, cols, scale, Fp8Format::E5M2, db2,
                          gelu ? pre : nullptr, Gelu::Exact);
      const Vec again = d.get_f32(db2, cols);
      EXPECT_EQ(0, std::memcmp(got.data(), again.data(), cols * sizeof(float)))
          << "the bias gradient differs run to run";
    }
}

// add_layernorm_forward_fp8 (the LayerNorm writing the next FP8 Linear's input) against
// add_layernorm_forward then fp8_cast on the GPU itself, bit for bit: res, mean, rstd, codes,
// transpose, amax. Shapes: whole 32-row blocks with 8-row transposed stores (256 x 768, 96 x
// 384, 64 x 1024), a short last block and rows not a multiple of 8 (77 x 768, 33 x 80: the
// element-wise transpose), a width past the fused kernel (40 x 2048: LayerNorm, then the
// cast); variants: no branch, a branch, a branch with row factors, no row-major codes.
TEST_P(GpuFp8, LayerNormFp8IsTheLayerNormThenTheCast) {
  Dev& d = *gpu;
  const std::pair<int, int> shapes[] = {{256, 768}, {96, 384}, {64, 1024},
                                        {77, 768},  {33, 80},  {40, 2048}};
  for (const auto& nc : shapes)
    for (int variant = 0; variant < 4; ++variant) {
      const int N = nc.first, C = nc.second;
      SCOPED_TRACE(std::to_string(N) + "x" + std::to_string(C) + " variant " +
                   std::to_string(variant));
      const size_t n = size_t(N) * C;
      void* a = d.act(rnd(n, 2.0f));
      void* b = variant == 0 ? nullptr : d.act(rnd(n, 1.0f));
      void* gamma = d.act(rnd(C, 1.0f));
      void* beta = d.act(rnd(C, 0.5f));
      Vec fh(N);
      for (int i = 0; i < N; ++i) fh[i] = i % 5 == 0 ? 0.0f : 1.0f / (1.0f - 0.1f * (i % 3));
      const RowFactors bf = variant == 2 ? RowFactors{d.f32(fh), 1} : RowFactors{};
      float* scale = d.f32(Vec{55.0f});
      const std::vector<uint8_t> fill(n, 0xAA);
      uint8_t *o = variant == 3 ? nullptr : bytes(d, fill), *ot = bytes(d, fill);
      uint8_t *ro = bytes(d, fill), *rot = bytes(d, fill);
      void *res = d.nan_act(n), *rres = d.nan_act(n), *y = d.nan_act(n);
      float *mean = d.f32(Vec(N, kNaN)), *rstd = d.f32(Vec(N, kNaN));
      float *rmean = d.f32(Vec(N, kNaN)), *rrstd = d.f32(Vec(N, kNaN));
      float *am = d.f32(Vec{0.25f}), *ram = d.f32(Vec{0.25f});
      d.be->add_layernorm_forward_fp8(res, o, ot, am, scale, Fp8Format::E4M3, mean, rstd, a, b,
                                      gamma, beta, N, C, 1e-6f, bf);
      d.be->add_layernorm_forward(rres, y, rmean, rrstd, a, b, gamma, beta, N, C, 1e-6f, bf);
      d.be->fp8_cast(ro, rot, ram, y, N, C, scale, Fp8Format::E4M3);
      const Vec r1 = d.get_act(res, n), r2 = d.get_act(rres, n);
      EXPECT_EQ(0, std::memcmp(r1.data(), r2.data(), n * sizeof(float))) << "res";
      const Vec m1 = d.get_f32(mean, N), m2 = d.get_f32(rmean, N);
      const Vec s1 = d.get_f32(rstd, N), s2 = d.get_f32(rrstd, N);
      EXPECT_EQ(0, std::memcmp(m1.data(), m2.data(), N * sizeof(float))) << "mean";
      EXPECT_EQ(0, std::memcmp(s1.data(), s2.data(), N * sizeof(float))) << "rstd";
      if (o) {
        EXPECT_EQ(codes(d, o, n), codes(d, ro, n));
      }
      EXPECT_EQ(codes(d, ot, n), codes(d, rot, n));
      EXPECT_EQ(d.get_f32(am, 1)[0], d.get_f32(ram, 1)[0]);
      EXPECT_GT(d.get_f32(am, 1)[0], 0.25f);
    }
}

// layernorm_backward_fp8 (the LayerNorm backward writing the FP8 output gradient of the Row
// Linear before it) against layernorm_backward then fp8_cast of the stored gradient on the GPU
// itself: dx and dbranch, the codes, transpose and amax bit for bit (every code written: the
// outputs start as 0xAA), dgamma, dbeta and the bias sums within fp32 rounding of the
// unfused kernel's (another order of the same terms), the same bits twice. Shapes: ViT-B/16's
// width on more 32-row groups than the grid has blocks (each block then takes several, the
// last one short), widths of 1, 2 and 4 packs per lane, rows not a multiple of 8 and widths
// not of 32 (the transpose byte by byte), a width past the kernel (the two ops); variants
// without the bias sums, with them, with drop path's row factors, without the row-major
// codes, in E4M3.
TEST_P(GpuFp8, LayerNormBackwardFp8IsTheBackwardThenTheCast) {
  Dev& d = *gpu;
  const std::pair<int, int> shapes[] = {{9000, 768}, {512, 768}, {96, 384}, {64, 1024},
                                        {40, 256},   {77, 768},  {33, 80},  {40, 2048}};
  for (const auto& nc : shapes)
    for (int variant = 0; variant < 5; ++variant) {
      const int N = nc.first, C = nc.second;
      SCOPED_TRACE(std::to_string(N) + "x" + std::to_string(C) + " variant " +
                   std::to_string(variant));
      const size_t n = size_t(N) * C;
      const Fp8Format f = variant == 4 ? Fp8Format::E4M3 : Fp8Format::E5M2;
      const bool sums = variant != 0, factors = variant == 2;
      const Vec xh = rnd(n, 2.0f, 0.3f), dyh = rnd(n, 1.0f), dx0 = rnd(n, 0.5f);
      void* x = d.act(xh);
      void* dy = d.act(dyh);
      void* gamma = d.act(rnd(C, 1.0f, 1.0f));
      void* beta = d.act(rnd(C, 0.5f));
      float *mean = d.nan_f32(N), *rstd = d.nan_f32(N);
      d.be->add_layernorm_forward(d.nan_act(n), d.nan_act(n), mean, rstd, x, nullptr, gamma,
                                  beta, N, C, 1e-6f);
      Vec fh(N);
      for (int i = 0; i < N; ++i) fh[i] = i % 5 == 0 ? 0.0f : 1.0f / (1.0f - 0.1f * (i % 3));
      const RowFactors bf = factors ? RowFactors{d.f32(fh), 1} : RowFactors{};
      float* scale = d.f32(Vec{f == Fp8Format::E4M3 ? 40.0f : 2000.0f});
      const std::vector<uint8_t> fill(n, 0xAA);
      struct Out {
        void *dx, *dbr;
        float *dg, *db, *dsum, *am;
        uint8_t *o, *ot;
      };
      auto outs = [&](bool row_major) {
        Out r;
        r.dx = d.act(dx0);
        r.dbr = factors ? d.nan_act(n) : nullptr;
        r.dg = d.f32(Vec(C, 0.5f));
        r.db = d.f32(Vec(C, -0.5f));
        r.dsum = sums ? d.f32(Vec(C, 0.25f)) : nullptr;
        r.am = d.f32(Vec{0.125f});
        r.o = row_major ? bytes(d, fill) : nullptr;
        r.ot = bytes(d, fill);
        return r;
      };
      Out a = outs(variant != 3), a2 = outs(variant != 3), r = outs(true);
      for (Out* o : {&a, &a2})
        d.be->layernorm_backward_fp8(o->dx, o->dg, o->db, dy, x, gamma, mean, rstd, N, C,
                                     o->dsum, o->dbr, bf, o->o, o->ot, o->am, scale, f);
      d.be->layernorm_backward(r.dx, r.dg, r.db, dy, x, gamma, mean, rstd, N, C, r.dsum, r.dbr,
                               bf);
      d.be->fp8_cast(r.o, r.ot, r.am, factors ? r.dbr : r.dx, N, C, scale, f);
      const Vec dxa = d.get_act(a.dx, n), dxr = d.get_act(r.dx, n);
      EXPECT_EQ(0, std::memcmp(dxa.data(), dxr.data(), n * sizeof(float))) << "dx";
      if (factors) {
        const Vec ba = d.get_act(a.dbr, n), br = d.get_act(r.dbr, n);
        EXPECT_EQ(0, std::memcmp(ba.data(), br.data(), n * sizeof(float))) << "dbranch";
      }
      if (a.o) {
        EXPECT_EQ(codes(d, a.o, n), codes(d, r.o, n));
      }
      EXPECT_EQ(codes(d, a.ot, n), codes(d, r.ot, n));
      EXPECT_EQ(d.get_f32(a.am, 1)[0], d.get_f32(r.am, 1)[0]);
      EXPECT_GT(d.get_f32(a.am, 1)[0], 0.125f);
      // the column sums: within 2^-20 of the sum of their terms' magnitudes (fp32 sums of at
      // most 9000 terms in another order), bit for bit run to run
      const Vec mh = d.get_f32(mean, N), sh = d.get_f32(rstd, N);
      const Vec gh = factors ? d.get_act(r.dbr, n) : dxr;
      Vec mag_g(C, 0.0f), mag_b(C, 0.0f), mag_d(C, 0.0f);
      for (int i = 0; i < N; ++i)
        for (int c = 0; c < C; ++c) {
          const size_t k = size_t(i) * C + c;
          mag_g[c] += std::fabs(dyh[k] * (round_to(dt, xh[k]) - mh[i]) * sh[i]);
          mag_b[c] += std::fabs(dyh[k]);
          mag_d[c] += std::fabs(gh[k]);
        }
      auto near = [&](const float* pa, const float* pa2, const float* pr, const Vec& mag,
                      const char* what) {
        const Vec va = d.get_f32(pa, C), va2 = d.get_f32(pa2, C), vr = d.get_f32(pr, C);
        for (int c = 0; c < C; ++c)
          ASSERT_NEAR(va[c], vr[c], std::ldexp(mag[c] + 1.0, -20)) << what << " column " << c;
        EXPECT_EQ(0, std::memcmp(va.data(), va2.data(), C * sizeof(float)))
            << what << " differs run to run";
      };
      near(a.dg, a2.dg, r.dg, mag_g, "dgamma");
      near(a.db, a2.db, r.db, mag_b, "dbeta");
      if (sums) near(a.dsum, a2.dsum, r.dsum, mag_d, "dsum");
    }
}

// attention_backward_fp8 (the attention backward writing qkv's FP8 output gradient) against
// attention_backward then fp8_cast_grad on the GPU itself: the same codes, transpose and amax
// bit for bit (every code written: the outputs start as 0xAA), the bias gradient within fp32
// rounding of a double sum of the stored gradient, the same bits twice. Shapes where the
// whole-head kernels run the backward (head dim 64: T = 197, 224, 50, 13 and 1; several images
// and heads) and where the tiled ones do (T = 257, head dim 32); E5M2 (a gradient's) and E4M3;
// without the row-major codes, without the bias gradient.
TEST_P(GpuFp8, AttentionBackwardFp8IsTheBackwardThenTheCast) {
  Dev& d = *gpu;
  struct Shape {
    int B, T, H, hd;
  };
  const Shape shapes[] = {{3, 197, 2, 64}, {1, 224, 1, 64}, {4, 50, 3, 64}, {2, 13, 2, 64},
                          {3, 1, 2, 64},   {2, 257, 1, 64}, {2, 50, 2, 32}};
  for (const Shape& sh : shapes)
    for (int variant = 0; variant < 3; ++variant) {
      const int B = sh.B, T = sh.T, H = sh.H, hd = sh.hd, C = H * hd, rows = B * T, cols = 3 * C;
      const Fp8Format f = variant == 1 ? Fp8Format::E4M3 : Fp8Format::E5M2;
      SCOPED_TRACE("B " + std::to_string(B) + " T " + std::to_string(T) + " H " +
                   std::to_string(H) + " hd " + std::to_string(hd) + " variant " +
                   std::to_string(variant) + " (" + cuda_attention_path(*d.be, B, T, H, hd) + ")");
      const size_t nq = size_t(rows) * cols, no = size_t(rows) * C;
      void* qkv = d.act(rnd(nq, 1.0f));
      void* att = d.nan_act(no);
      void* saved = d.raw(d.be->attention_saved_bytes(B, T, H, hd));
      const size_t wsb = d.be->attention_workspace_bytes(B, T, H, hd);
      void* ws = wsb ? d.raw(wsb) : nullptr;
      d.be->attention_forward(att, saved, qkv, B, T, H, hd, ws);
      void* dout = d.act(rnd(no, 1.0f));
      void* g = d.nan_act(nq);
      d.be->attention_backward(g, dout, qkv, att, saved, B, T, H, hd, ws);
      float* scale = d.f32(Vec{variant == 1 ? 300.0f : 3000.0f});
      const std::vector<uint8_t> fill(nq, 0xAA);
      uint8_t *a = variant == 2 ? nullptr : bytes(d, fill), *at = bytes(d, fill);
      uint8_t *r = bytes(d, fill), *rt = bytes(d, fill);
      float *ma = d.f32(Vec{0.125f}), *mr = d.f32(Vec{0.125f});
      const bool bias = variant != 2;
      float* db = bias ? d.f32(Vec(cols, 0.5f)) : nullptr;
      float* rdb = d.f32(Vec(cols, 0.5f));
      void* scratch = d.nan_act(nq);  // the act-dtype gradient, where the two run apart
      d.be->attention_backward_fp8(scratch, a, at, ma, scale, f, db, dout, qkv, att, saved, B, T,
                                   H, hd, ws);
      d.be->fp8_cast_grad(r, rt, mr, g, rows, cols, scale, f, rdb, nullptr, Gelu::Exact);
      if (a) {
        EXPECT_EQ(codes(d, a, nq), codes(d, r, nq));
      }
      EXPECT_EQ(codes(d, at, nq), codes(d, rt, nq));
      EXPECT_EQ(d.get_f32(ma, 1)[0], d.get_f32(mr, 1)[0]);
      EXPECT_GT(d.get_f32(ma, 1)[0], 0.125f);
      if (!bias) continue;
      const Vec gh = d.get_act(g, nq), got = d.get_f32(db, cols);
      for (int c = 0; c < cols; ++c) {
        double want = 0.5, mag = 0.5;
        for (int i = 0; i < rows; ++i) {
          want += gh[size_t(i) * cols + c];
          mag += std::fabs(gh[size_t(i) * cols + c]);
        }
        ASSERT_NEAR(got[c], want, 1e-6 * mag) << "column " << c;
      }
      float* db2 = d.f32(Vec(cols, 0.5f));
      d.be->attention_backward_fp8(scratch, a, at, ma, scale, f, db2, dout, qkv, att, saved, B, T,
                                   H, hd, ws);
      const Vec again = d.get_f32(db2, cols);
      EXPECT_EQ(0, std::memcmp(got.data(), again.data(), cols * sizeof(float)))
          << "the bias gradient differs run to run";
    }
}

// A width past the fused kernel (ViT-H's 1280) goes through the backend's scratch (the
// LayerNorm, then the cast): with the trainer's plan (WorkspacePlan::fp8_layernorm_cols) the
// call allocates nothing.
TEST_P(GpuFp8, LayerNormFp8PastTheKernelIsPlanned) {
  Dev& d = *gpu;
  const int N = 96, C = 1280;
  Backend::WorkspacePlan plan;
  plan.max_rows = N;
  plan.max_cols = C;
  plan.fp8_layernorm_cols = C;
  d.be->plan_workspace(plan);
  const size_t n = size_t(N) * C;
  void* a = d.act(rnd(n, 2.0f));
  void* gamma = d.act(rnd(C, 1.0f));
  void* beta = d.act(rnd(C, 0.5f));
  void* res = d.nan_act(n);
  float *mean = d.f32(Vec(N, kNaN)), *rstd = d.f32(Vec(N, kNaN)), *am = d.f32(Vec{0.0f});
  float* scale = d.f32(Vec{10.0f});
  const std::vector<uint8_t> fill(n, 0xAA);
  uint8_t *o = bytes(d, fill), *ot = bytes(d, fill);
  const int64_t before = d.be->device_allocations();
  d.be->add_layernorm_forward_fp8(res, o, ot, am, scale, Fp8Format::E4M3, mean, rstd, a, nullptr,
                                  gamma, beta, N, C, 1e-6f);
  d.be->synchronize();
  EXPECT_EQ(d.be->device_allocations(), before);
  EXPECT_GT(d.get_f32(am, 1)[0], 0.0f);
}

TEST_P(GpuFp8, CastOnlyTheTransposeAndNaN) {
  const int rows = 128, cols = 256;  // whole tiles: the vector path
  const size_t n = size_t(rows) * cols;
  Vec x = rnd(n);
  x[100] = kNaN;
  Dev& d = *gpu;
  uint8_t* ot = bytes(d, std::vector<uint8_t>(n, 0xAA));
  float* am = d.f32(Vec{0.0f});
  d.be->fp8_cast(nullptr, ot, am, d.act(x), rows, cols, d.f32(Vec{1.0f}), Fp8Format::E4M3);
  const std::vector<uint8_t> t = codes(d, ot, n);
  EXPECT_TRUE(std::isnan(d.get_f32(am, 1)[0])) << "a NaN input must make the amax NaN";
  const int r = 100 / cols, c = 100 % cols;
  EXPECT_TRUE(std::isnan(fp8_decode(t[size_t(c) * rows + r], Fp8Format::E4M3)));
  for (size_t i = 0; i < n; ++i) {
    if (i == size_t(c) * rows + r) continue;
    ASSERT_EQ(t[i], fp8_encode(x[(i % rows) * cols + i / rows], Fp8Format::E4M3)) << i;
  }
}

TEST_P(GpuFp8, GemmActOutputWithinTheAccumulatorsBound) {
  struct Case {
    int M, N, K;
    Fp8Format fa, fb;
    bool bias;
  };
  for (const Case& c : {Case{67, 48, 96, Fp8Format::E4M3, Fp8Format::E4M3, true},
                        Case{200, 136, 784, Fp8Format::E4M3, Fp8Format::E4M3, false},
                        Case{131, 64, 160, Fp8Format::E5M2, Fp8Format::E4M3, false},
                        Case{64, 96, 48, Fp8Format::E4M3, Fp8Format::E5M2, true}}) {
    SCOPED_TRACE(std::to_string(c.M) + "x" + std::to_string(c.N) + "x" + std::to_string(c.K) + " " +
                 fp8_format_name(c.fa) + " x " + fp8_format_name(c.fb));
    const std::vector<uint8_t> A = random_codes(size_t(c.M) * c.K, c.fa, 64.0f);
    const std::vector<uint8_t> B = random_codes(size_t(c.N) * c.K, c.fb, 64.0f);
    const Vec bias = rnd(c.N, 50.0f);
    const float sa = 1.0f / 224.0f, sb = 1.0f / 8.0f;
    Vec D[4];
    Dev cpu_dt(make_backend("cpu", 0, dt));  // the reference rounds to the GPU's act dtype
    BackendOptions fast, fast_dgrad;
    fast.fp8_fast_accum = true;
    fast_dgrad.fp8_fast_accum_dgrad = true;
    Dev gpu_fast(make_cuda_backend(0, dt, fast));
    Dev gpu_fast_dgrad(make_cuda_backend(0, dt, fast_dgrad));
    Dev* devs[4] = {&cpu_dt, gpu.get(), &gpu_fast, &gpu_fast_dgrad};
    for (int k = 0; k < 4; ++k) {
      Dev& e = *devs[k];
      void* out = e.nan_act(size_t(c.M) * c.N);
      e.be->fp8_gemm(out, false, 0.0f, bytes(e, A), c.fa, e.f32(Vec{sa}), bytes(e, B), c.fb,
                     e.f32(Vec{sb}), c.M, c.N, c.K, c.bias ? e.act(bias) : nullptr);
      D[k] = e.get_act(out, size_t(c.M) * c.N);
    }
    // fp8_fast_accum applies to E4M3 x E4M3 only (the forward's GEMMs), fp8_fast_accum_dgrad
    // to the others (an E5M2 operand: the data gradients): each leaves the other kind the same
    // bits as without it
    const bool forward = c.fa == Fp8Format::E4M3 && c.fb == Fp8Format::E4M3;
    const int fast_g = forward ? 2 : 3, other_g = forward ? 3 : 2;
    EXPECT_EQ(0, std::memcmp(D[1].data(), D[other_g].data(), D[1].size() * 4))
        << (forward ? "fp8_fast_accum_dgrad changed a forward GEMM"
                    : "fp8_fast_accum changed a gradient's GEMM");
    // the bound of each element: one ulp of the output format, plus the tensor cores' FP8
    // accumulation, 2^-10 of the sum of |products| (their accumulator keeps ~14 bits between
    // cuBLASLt's promotions to fp32; beyond the ulp, 2^-12 was the largest seen on an H100);
    // with fast accumulation (no promotion over all of K <= 1024) 2^-7 (DeepSeek-V3 reports
    // ~2% at K = 4096 for the ~14-bit accumulator alone: ~2^-8 at K = 784)
    for (int g : {1, fast_g}) {  // the GPU without, then with fast accumulation
      const double bound = g == fast_g ? -7 : -10;
      size_t worst = 0;
      double worst_ratio = 0, worst_acc = 0;
      for (int i = 0; i < c.M; ++i) {
        for (int j = 0; j < c.N; ++j) {
          double abs_sum = 0;
          for (int k = 0; k < c.K; ++k)
            abs_sum += std::fabs(double(fp8_decode(A[size_t(i) * c.K + k], c.fa)) *
                                 fp8_decode(B[size_t(j) * c.K + k], c.fb));
          abs_sum *= double(sa) * sb;
          const size_t e = size_t(i) * c.N + j;
          const double diff = std::fabs(double(D[g][e]) - double(D[0][e]));
          const double u = ulp(dt, std::max(std::fabs(D[0][e]), std::fabs(D[g][e])));
          const double ratio = diff / (u + std::ldexp(abs_sum, bound));
          if (!(ratio <= worst_ratio)) worst_ratio = ratio, worst = e;
          if (abs_sum > 0) worst_acc = std::max(worst_acc, std::max(0.0, diff - u) / abs_sum);
        }
      }
      EXPECT_LE(worst_ratio, 1.0) << (g == fast_g ? "fast accumulation, " : "") << "element "
                                  << worst
                                  << ": gpu " << D[g][worst] << " cpu " << D[0][worst];
      std::printf(
          "  %dx%dx%d %s x %s%s: largest difference beyond one ulp: 2^%.1f of the sum of "
          "|products|\n",
          c.M, c.N, c.K, fp8_format_name(c.fa), fp8_format_name(c.fb),
          g == fast_g ? ", fast accumulation" : "",
          worst_acc > 0 ? std::log2(worst_acc) : -INFINITY);
    }
  }
}

TEST_P(GpuFp8, GemmWeightGradientAccumulatesInFp32) {
  const int M = 96, N = 80, K = 1024;  // dW[out, in] += dy^T x over K tokens
  const std::vector<uint8_t> A = random_codes(size_t(M) * K, Fp8Format::E5M2, 1024.0f);
  const std::vector<uint8_t> B = random_codes(size_t(N) * K, Fp8Format::E4M3, 448.0f);
  const Vec D0 = rnd(size_t(M) * N, 1000.0f);
  Vec D[3];
  BackendOptions fast;  // never applies to a weight gradient (fp32 D, K = tokens)
  fast.fp8_fast_accum = fast.fp8_fast_accum_dgrad = true;
  Dev gpu_fast(make_cuda_backend(0, dt, fast));
  Dev* devs[3] = {cpu.get(), gpu.get(), &gpu_fast};
  for (int k = 0; k < 3; ++k) {
    Dev& d = *devs[k];
    float* out = d.f32(D0);
    for (int rep = 0; rep < 2; ++rep)  // two micro-batches
      d.be->fp8_gemm(out, true, 1.0f, bytes(d, A), Fp8Format::E5M2, d.f32(Vec{1.0f / 4096}),
                     bytes(d, B), Fp8Format::E4M3, d.f32(Vec{1.0f / 16}), M, N, K, nullptr);
    D[k] = d.get_f32(out, size_t(M) * N);
  }
  EXPECT_CLOSE(D[1], D[0], 1e-5);
  EXPECT_EQ(0, std::memcmp(D[1].data(), D[2].data(), D[1].size() * 4))
      << "fast accumulation changed a weight gradient's GEMM";
  // and it did accumulate: far from the initial values
  EXPECT_GT(rel_l2(D[0], D0), 1e-2);
}

// The FP8 Linear layer (backend/fp8_linear.h) composed on each backend: the same casts, hence
// the same amaxes exactly; outputs within the FP8 GEMM bound above (relative L2 here: the
// composition, not the GEMM, is under test); the GELU variants and the bias gradient included.
TEST_P(GpuFp8, LinearLayerMatchesTheCpuComposition) {
  const int N = 64, in = 96, out = 160;
  const Vec x = rnd(size_t(N) * in, 2.0f), W = rnd(size_t(out) * in, 0.1f), b = rnd(out);
  const Vec dy = rnd(size_t(N) * out, 1e-3f), pre = rnd(size_t(N) * in, 1.5f);
  // each tensor's values 16 bytes apart (Fp8LinearMeta::kAligned), as the model lays them out
  const Vec scale = {50.0f, 0, 0, 0, 900.0f, 0, 0, 0, 4.0e6f, 0, 0, 0};
  const Vec scale_inv = {1 / 50.0f, 0, 0, 0, 1 / 900.0f, 0, 0, 0, 1 / 4.0e6f, 0, 0, 0};
  Dev cpu_dt(make_backend("cpu", 0, dt));
  Dev* devs[2] = {&cpu_dt, gpu.get()};
  Vec y[2], g[2], dx[2], dW[2], db[2], gdb[2], amax[2];
  for (int k = 0; k < 2; ++k) {
    Dev& d = *devs[k];
    Fp8LinearMeta m{d.f32(scale), d.f32(scale_inv), d.f32(Vec(12, 0.0f)), Fp8LinearMeta::kAligned};
    auto* scratch = static_cast<uint8_t*>(d.raw(fp8_linear_scratch_bytes(N, in, out)));
    void* yk = d.nan_act(size_t(N) * out);
    void* gk = d.nan_act(size_t(N) * out);
    fp8_linear_forward(*d.be, m, scratch, yk, d.act(x), d.act(W), d.act(b), N, in, out, gk,
                       Gelu::Exact);
    void* dxk = d.nan_act(size_t(N) * in);
    float* dWk = d.f32(Vec(size_t(out) * in, 0.5f));
    float* dbk = d.f32(Vec(out, 0.0f));
    float* gdbk = d.f32(Vec(in, 0.0f));
    fp8_linear_backward(*d.be, m, scratch, dxk, dWk, dbk, d.act(dy), d.act(x), d.act(W), N, in, out,
                        d.act(pre), Gelu::Exact, gdbk);
    y[k] = d.get_act(yk, size_t(N) * out);
    g[k] = d.get_act(gk, size_t(N) * out);
    dx[k] = d.get_act(dxk, size_t(N) * in);
    dW[k] = d.get_f32(dWk, size_t(out) * in);
    db[k] = d.get_f32(dbk, out);
    gdb[k] = d.get_f32(gdbk, in);
    amax[k] = d.get_f32(m.amax, 12);
  }
  EXPECT_EQ(amax[1], amax[0]);
  EXPECT_CLOSE(y[1], y[0], 1e-2);
  EXPECT_CLOSE(g[1], g[0], 1e-2);
  EXPECT_CLOSE(dx[1], dx[0], 1e-2);
  EXPECT_CLOSE(dW[1], dW[0], 1e-4);
  EXPECT_CLOSE(db[1], db[0], 1e-5);
  EXPECT_CLOSE(gdb[1], gdb[0], 2e-2);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuFp8, ::testing::Values(DType::BF16, DType::F16),
                         [](const ::testing::TestParamInfo<DType>& i) {
                           return std::string(dtype_name(i.param));
                         });

TEST(GpuFp8Support, MatchesTheComputeCapability) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto be = make_cuda_backend(0, DType::BF16);
  std::string why;
  const bool ok = be->fp8_supported(&why);
  int major = 0, minor = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
  EXPECT_EQ(ok, major * 10 + minor >= 89) << why;
  if (!ok) {
    EXPECT_NE(why.find("FP8"), std::string::npos) << why;
  }
}

}  // namespace
}  // namespace vitgrid
