// The CUDA backend's tensor-parallel ops against the CPU reference backend (fp32), in fp32,
// bf16 and fp16: accumulate_f32 and the split LayerNorm (layernorm_split_*), op by op on the
// same inputs, then the whole chain over 2 column blocks (the ranks of a hidden axis,
// simulated in one process: the per-row partials are summed on the host between the ops).
// Inputs are random, of odd sizes, already representable in the act dtype; every output is
// poisoned with NaN first. Error measure: relative L2, ||gpu - cpu|| / ||cpu||.
// Tolerances (test_gpu_backend.cpp's): act outputs fp32 1e-5, bf16 1e-2, fp16 2e-3; fp32
// outputs computed from identical inputs (row partial sums, statistics, dgamma/dbeta) 1e-5;
// accumulate_f32 exact. N = 2500 rows spans several row chunks of the dgamma/dbeta reduction.
// Every test skips when no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/cpu/emulate16.h"
#include "vitgrid/backend/cuda/cuda_backend.h"
#include "gpu_test_util.h"

namespace vitgrid {
namespace {

using namespace gputest;  // NOLINT: test file, the harness is its vocabulary

class GpuTpOps : public GpuVsCpu {
 protected:
  GpuTpOps() : GpuVsCpu(4242) {}
};

TEST_P(GpuTpOps, AccumulateF32) {
  const size_t n = 100003;  // odd: the grid-stride tail
  Vec y0(n), x(n);
  std::normal_distribution<float> d;
  for (size_t i = 0; i < n; ++i) {
    y0[i] = d(rng);
    x[i] = d(rng) * 1e-3f;
  }
  float* gy = gpu->f32(y0);
  float* cy = cpu->f32(y0);
  gpu->be->accumulate_f32(gy, gpu->f32(x), n);
  cpu->be->accumulate_f32(cy, cpu->f32(x), n);
  EXPECT_EQ(gpu->get_f32(gy, n), cpu->get_f32(cy, n));  // one fp32 add each: exact, unrounded
}

// Each forward op on identical inputs, the reduced partials fed identically to both. Widths:
// odd (the kernels' element-by-element form) and multiples of a 16-byte pack (their vector
// form), up to the large ViT's 4096 over q = 2 ranks.
TEST_P(GpuTpOps, SplitLayerNormForwardOps) {
  for (int N : {1, 37, 2500}) {
    for (int C : {23, 48, 384, 2048}) {  // 23: element by element; else 16-byte packs
      SCOPED_TRACE("N " + std::to_string(N) + " C " + std::to_string(C));
      const int Ct = 3 * C;  // this block is a third of the row
      const float eps = 1e-6f;
      Vec x = rnd(size_t(N) * C, 1.5f, 2.0f), gamma = rnd(C, 0.5f, 1.0f), beta = rnd(C, 0.3f);
      // pass 1: row sums
      float* gs = gpu->f32(Vec(N, kNaN));
      float* cs = cpu->f32(Vec(N, kNaN));
      void* gx = gpu->act(x);
      float* cx = cpu->f32(x);
      gpu->be->layernorm_split_sums(gs, gx, N, C);
      cpu->be->layernorm_split_sums(cs, cx, N, C);
      const Vec sums = cpu->get_f32(cs, N);
      EXPECT_CLOSE(gpu->get_f32(gs, N), sums, 1e-5);
      // pass 2: the "reduced" sums (this block's times 3, a stand-in for the other ranks)
      Vec red(N);
      for (int r = 0; r < N; ++r) red[r] = 3.0f * sums[r];
      float* gm = gpu->f32(red);
      float* cm = cpu->f32(red);
      float* gq = gpu->f32(Vec(N, kNaN));
      float* cq = cpu->f32(Vec(N, kNaN));
      gpu->be->layernorm_split_centered(gq, gm, gx, N, C, Ct);
      cpu->be->layernorm_split_centered(cq, cm, cx, N, C, Ct);
      const Vec mean = cpu->get_f32(cm, N), sq = cpu->get_f32(cq, N);
      EXPECT_CLOSE(gpu->get_f32(gm, N), mean, 1e-6);
      EXPECT_CLOSE(gpu->get_f32(gq, N), sq, 1e-5);
      // apply, with the same reduced sums of squares
      Vec redq(N);
      for (int r = 0; r < N; ++r) redq[r] = 3.0f * sq[r];
      float* grs = gpu->f32(redq);
      float* crs = cpu->f32(redq);
      void* gy = gpu->act(Vec(size_t(N) * C, kNaN));
      float* cy = cpu->f32(Vec(size_t(N) * C, kNaN));
      gpu->be->layernorm_split_apply(gy, grs, gx, gm, gpu->act(gamma), gpu->act(beta), N, C, Ct,
                                     eps);
      cpu->be->layernorm_split_apply(cy, crs, cx, cm, cpu->f32(gamma), cpu->f32(beta), N, C, Ct,
                                     eps);
      EXPECT_CLOSE(gpu->get_f32(grs, N), cpu->get_f32(crs, N), 1e-6);
      EXPECT_CLOSE(gpu->get_act(gy, size_t(N) * C), cpu->get_f32(cy, size_t(N) * C), tol());
    }
  }
}

// Each backward op on identical inputs (statistics from the CPU forward).
TEST_P(GpuTpOps, SplitLayerNormBackwardOps) {
  for (int N : {1, 37, 2500}) {
    for (int C : {23, 48, 384, 2048}) {  // 23: element by element; else 16-byte packs
      SCOPED_TRACE("N " + std::to_string(N) + " C " + std::to_string(C));
      const int Ct = 2 * C;
      Vec x = rnd(size_t(N) * C, 1.0f, 0.5f), gamma = rnd(C, 0.5f, 1.0f), dy = rnd(size_t(N) * C);
      Vec mean(N), rstd(N);
      std::uniform_real_distribution<float> u(0.5f, 2.0f);
      for (int r = 0; r < N; ++r) {
        mean[r] = 0.5f + 0.1f * u(rng);
        rstd[r] = u(rng);
      }
      Vec dg0 = rnd(C, 0.1f), db0 = rnd(C, 0.1f), dx0 = rnd(size_t(N) * C, 0.1f);
      void *gx = gpu->act(x), *gg = gpu->act(gamma), *gdy = gpu->act(dy);
      float *cx = cpu->f32(x), *cg = cpu->f32(gamma), *cdy = cpu->f32(dy);
      float *gmean = gpu->f32(mean), *grstd = gpu->f32(rstd);
      float *cmean = cpu->f32(mean), *crstd = cpu->f32(rstd);
      float *gsum = gpu->f32(Vec(2 * size_t(N), kNaN)), *csum = cpu->f32(Vec(2 * size_t(N), kNaN));
      float *gdg = gpu->f32(dg0), *gdb = gpu->f32(db0), *cdg = cpu->f32(dg0), *cdb = cpu->f32(db0);
      gpu->be->layernorm_split_backward_sums(gsum, gdg, gdb, gdy, gx, gg, gmean, grstd, N, C);
      cpu->be->layernorm_split_backward_sums(csum, cdg, cdb, cdy, cx, cg, cmean, crstd, N, C);
      const Vec sums = cpu->get_f32(csum, 2 * size_t(N));
      EXPECT_CLOSE(gpu->get_f32(gsum, 2 * size_t(N)), sums, 1e-5);
      EXPECT_CLOSE(gpu->get_f32(gdg, C), cpu->get_f32(cdg, C), 1e-5);
      EXPECT_CLOSE(gpu->get_f32(gdb, C), cpu->get_f32(cdb, C), 1e-5);
      // dx from the same "reduced" sums
      Vec red(sums);
      for (auto& v : red) v *= 2.0f;
      float *gred = gpu->f32(red), *cred = cpu->f32(red);
      void* gdx = gpu->act(dx0);
      float* cdx = cpu->f32(dx0);
      gpu->be->layernorm_split_backward_dx(gdx, gdy, gx, gg, gmean, grstd, gred, N, C, Ct);
      cpu->be->layernorm_split_backward_dx(cdx, cdy, cx, cg, cmean, crstd, cred, N, C, Ct);
      EXPECT_CLOSE(gpu->get_act(gdx, size_t(N) * C), cpu->get_f32(cdx, size_t(N) * C), tol());
    }
  }
}

// The whole split LayerNorm over 2 column blocks, as a strategy with q = 2 runs it, against
// the CPU's same chain; and the 2 blocks together against the CPU's fused unsplit LayerNorm.
TEST_P(GpuTpOps, SplitLayerNormChainOverTwoBlocks) {
  const int N = 301, Ct = 96, C = Ct / 2;
  const float eps = 1e-6f;
  Vec x = rnd(size_t(N) * Ct, 1.0f, 3.0f), gamma = rnd(Ct, 0.5f, 1.0f), beta = rnd(Ct, 0.2f),
      dy = rnd(size_t(N) * Ct);
  auto blk = [&](const Vec& g, int rows, int p) {
    Vec out(size_t(rows) * C);
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < C; ++j) out[size_t(r) * C + j] = g[size_t(r) * Ct + p * C + j];
    return out;
  };
  auto chain = [&](Dev& d, bool act_io, Vec* y_out, Vec* dx_out, Vec* dg_out, Vec* db_out) {
    auto put = [&](const Vec& h) -> void* {
      return act_io ? d.act(h) : static_cast<void*>(d.f32(h));
    };
    auto get = [&](const void* p, size_t n) {
      return act_io ? d.get_act(p, n) : d.get_f32(static_cast<const float*>(p), n);
    };
    void *xb[2], *gb[2], *bb[2], *dyb[2], *yb[2], *dxb[2];
    float *mean[2], *rstd[2], *sums[2], *dg[2], *db[2];
    for (int p = 0; p < 2; ++p) {
      xb[p] = put(blk(x, N, p));
      gb[p] = put(blk(gamma, 1, p));
      bb[p] = put(blk(beta, 1, p));
      dyb[p] = put(blk(dy, N, p));
      yb[p] = put(Vec(size_t(N) * C, kNaN));
      dxb[p] = put(Vec(size_t(N) * C, 0.0f));
      mean[p] = d.f32(Vec(N, kNaN));
      rstd[p] = d.f32(Vec(N, kNaN));
      sums[p] = d.f32(Vec(2 * size_t(N), kNaN));
      dg[p] = d.f32(Vec(C, 0.0f));
      db[p] = d.f32(Vec(C, 0.0f));
    }
    // the allreduce over the 2 blocks, on the host
    auto reduce = [&](float* const* bufs, size_t n) {
      Vec a = d.get_f32(bufs[0], n), b = d.get_f32(bufs[1], n);
      for (size_t i = 0; i < n; ++i) a[i] += b[i];
      for (int p = 0; p < 2; ++p) d.be->copy_to_device(bufs[p], a.data(), n * 4);
    };
    for (int p = 0; p < 2; ++p) d.be->layernorm_split_sums(mean[p], xb[p], N, C);
    reduce(mean, N);
    for (int p = 0; p < 2; ++p) d.be->layernorm_split_centered(rstd[p], mean[p], xb[p], N, C, Ct);
    reduce(rstd, N);
    for (int p = 0; p < 2; ++p)
      d.be->layernorm_split_apply(yb[p], rstd[p], xb[p], mean[p], gb[p], bb[p], N, C, Ct, eps);
    for (int p = 0; p < 2; ++p)
      d.be->layernorm_split_backward_sums(sums[p], dg[p], db[p], dyb[p], xb[p], gb[p], mean[p],
                                          rstd[p], N, C);
    reduce(sums, 2 * size_t(N));
    for (int p = 0; p < 2; ++p)
      d.be->layernorm_split_backward_dx(dxb[p], dyb[p], xb[p], gb[p], mean[p], rstd[p], sums[p], N,
                                        C, Ct);
    // blocks side by side again
    y_out->assign(size_t(N) * Ct, 0.0f);
    dx_out->assign(size_t(N) * Ct, 0.0f);
    dg_out->assign(Ct, 0.0f);
    db_out->assign(Ct, 0.0f);
    for (int p = 0; p < 2; ++p) {
      const Vec y = get(yb[p], size_t(N) * C), dx = get(dxb[p], size_t(N) * C);
      const Vec g = d.get_f32(dg[p], C), b = d.get_f32(db[p], C);
      for (int r = 0; r < N; ++r)
        for (int j = 0; j < C; ++j) {
          (*y_out)[size_t(r) * Ct + p * C + j] = y[size_t(r) * C + j];
          (*dx_out)[size_t(r) * Ct + p * C + j] = dx[size_t(r) * C + j];
        }
      for (int j = 0; j < C; ++j) {
        (*dg_out)[p * C + j] = g[j];
        (*db_out)[p * C + j] = b[j];
      }
    }
  };
  Vec gy, gdx, gdg, gdb, cy, cdx, cdg, cdb;
  chain(*gpu, true, &gy, &gdx, &gdg, &gdb);
  chain(*cpu, false, &cy, &cdx, &cdg, &cdb);
  EXPECT_CLOSE(gy, cy, tol());
  EXPECT_CLOSE(gdx, cdx, tol());
  EXPECT_CLOSE(gdg, cdg, 1e-5);
  EXPECT_CLOSE(gdb, cdb, 1e-5);
  // the CPU's split chain is the unsplit LayerNorm up to summation order
  float* cx = cpu->f32(x);
  float* cres = cpu->f32(Vec(x.size(), kNaN));
  float* cyf = cpu->f32(Vec(x.size(), kNaN));
  float *cm = cpu->f32(Vec(N, kNaN)), *cr = cpu->f32(Vec(N, kNaN));
  float* cdxf = cpu->f32(Vec(x.size(), 0.0f));
  float *cdgf = cpu->f32(Vec(Ct, 0.0f)), *cdbf = cpu->f32(Vec(Ct, 0.0f));
  cpu->be->add_layernorm_forward(cres, cyf, cm, cr, cx, nullptr, cpu->f32(gamma), cpu->f32(beta), N,
                                 Ct, eps);
  cpu->be->layernorm_backward(cdxf, cdgf, cdbf, cpu->f32(dy), cres, cpu->f32(gamma), cm, cr, N, Ct);
  EXPECT_CLOSE(cy, cpu->get_f32(cyf, x.size()), 1e-5);
  EXPECT_CLOSE(cdx, cpu->get_f32(cdxf, x.size()), 1e-5);
  EXPECT_CLOSE(cdg, cpu->get_f32(cdgf, Ct), 1e-5);
  EXPECT_CLOSE(cdb, cpu->get_f32(cdbf, Ct), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuTpOps, ::testing::Values(DType::F32, DType::BF16, DType::F16),
                         [](const ::testing::TestParamInfo<DType>& i) {
                           return std::string(dtype_name(i.param));
                         });

}  // namespace
}  // namespace vitgrid
