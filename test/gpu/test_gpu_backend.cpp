// The CUDA backend against the CPU reference backend (fp32), op by op, in fp32, bf16 and fp16.
// Inputs are random, of odd sizes, and already representable in the act dtype (rounded on the
// host), so a 16-bit run differs from the reference only by the rounding of its own results.
// Every output is poisoned with NaN before the GPU op, so an element the kernel forgets to
// write fails the comparison. Error measure: relative L2, ||gpu - cpu|| / ||cpu||.
// Tolerances (rel L2), stated per dtype in tol():
//   fp32 1e-5 (different summation orders only), bf16 1e-2 (8-bit mantissa: one rounding is
//   <= 2^-9 relative), fp16 2e-3 (11-bit mantissa, <= 2^-12 per rounding, a few roundings).
//   Chains of several act-dtype roundings with cancellation (attention backward) get 2x
//   (bf16 attention backward 2.5x).
//   fp32 outputs computed from identical inputs (losses, statistics, parameter gradients of
//   fp32 GEMMs, optimizers) are held to 1e-5 / 1e-6; dropout masks and top-k to exact equality.
// Every test skips when no GPU is visible (CI compiles with nvcc on machines without one).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "flash_attention.h"
#include "gpu_test_util.h"
#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/cpu/emulate16.h"
#include "vitgrid/backend/cuda/cuda_backend.h"
#include "vitgrid/core/error.h"
#include "vitgrid/core/rng.h"
#include "vitgrid/model/workspace_plan.h"

namespace vitgrid {

namespace {

using namespace gputest;  // NOLINT: test file, the harness is its vocabulary

class GpuBackend : public GpuVsCpu {
 protected:
  GpuBackend() : GpuVsCpu(12345) {}
};

// The kernels the CUDA backend runs for a LayerNorm of width C (layernorm.cu's dispatch;
// buffers from alloc() are aligned): forward 'v' the warp-per-row vector kernel, 'w' the
// block-per-row one, 'g' the generic one; backward 'b' the fused warp-per-row kernel, 'w' the
// block-per-row one, 'g' the general path. With ds the backward also sums dx's columns, with
// pf it applies row factors (the fused kernel's variants reach 5, 4 packs per lane instead
// of 6).
struct LnPaths {
  char fwd, bwd;
};
LnPaths ln_paths(int C, DType dt, bool ds, bool pf = false) {
  const int V = 16 / static_cast<int>(dtype_size(dt));
  if (C % V != 0) return {'g', 'g'};
  const int packs = C / V, K = (packs + 31) / 32;
  const char fwd = packs <= 4096 && C > 1024 ? 'w' : K <= 16 ? 'v' : 'g';
  const bool wide_ok = packs <= 1024;
  const int limit = pf ? 4 : ds ? 5 : 6;
  const char bwd = wide_ok && K > limit ? 'w' : K <= limit ? 'b' : 'g';
  return {fwd, bwd};
}

TEST_P(GpuBackend, LinearForward) {
  for (int out : {24, 29}) {          // 24: GELU epilogue eligible (out % 8 == 0); 29: not
    for (int mode = 0; mode < 4; ++mode) {  // 0 bias, 1 no bias, 2 gelu exact, 3 gelu tanh
      const int N = 37, in = 53;
      Vec x = rnd(size_t(N) * in), W = rnd(size_t(out) * in, 0.2f), b = rnd(out);
      const bool has_b = mode != 1, gel = mode >= 2;
      const Gelu g = mode == 3 ? Gelu::Tanh : Gelu::Exact;
      Vec yc, gc, yg, gg;
      for (Dev* d : {cpu.get(), gpu.get()}) {
        void* y = d->nan_act(size_t(N) * out);
        void* go = gel ? d->nan_act(size_t(N) * out) : nullptr;
        d->be->linear_forward(y, d->act(x), d->act(W), has_b ? d->act(b) : nullptr, N, in, out,
                              go, g);
        (d == cpu.get() ? yc : yg) = d->get_act(y, size_t(N) * out);
        if (gel) (d == cpu.get() ? gc : gg) = d->get_act(go, size_t(N) * out);
      }
      SCOPED_TRACE("out " + std::to_string(out) + " mode " + std::to_string(mode));
      EXPECT_CLOSE(yg, yc, tol());
      if (gel) {
        EXPECT_CLOSE(gg, gc, tol());
      }
    }
  }
}

TEST_P(GpuBackend, LinearForwardTf32) {
  if (dt != DType::F32) GTEST_SKIP() << "tf32 applies to fp32 only";
  BackendOptions o;
  o.allow_tf32 = true;
  Dev tf(make_cuda_backend(0, DType::F32, o));
  const int N = 67, in = 96, out = 40;
  Vec x = rnd(size_t(N) * in), W = rnd(size_t(out) * in, 0.2f), b = rnd(out);
  void* yc = cpu->nan_act(size_t(N) * out);
  cpu->be->linear_forward(yc, cpu->act(x), cpu->act(W), cpu->act(b), N, in, out);
  void* yg = tf.nan_act(size_t(N) * out);
  tf.be->linear_forward(yg, tf.act(x), tf.act(W), tf.act(b), N, in, out);
  // TF32 keeps 10 mantissa bits of each input: ~1e-3 relative.
  EXPECT_CLOSE(tf.get_act(yg, size_t(N) * out), cpu->get_act(yc, size_t(N) * out), 2e-3);
}

TEST_P(GpuBackend, LinearBackward) {
  // odd shapes (the column sums' scalar path) and aligned ViT-like ones (its 16-byte loads;
  // N = 1000: several row chunks)
  for (auto [N, in, out] : {std::tuple<int, int, int>{41, 35, 27},
                            std::tuple<int, int, int>{394, 64, 192},
                            std::tuple<int, int, int>{1000, 128, 256}}) {
  SCOPED_TRACE("N=" + std::to_string(N) + " in=" + std::to_string(in) +
               " out=" + std::to_string(out));
  Vec dy = rnd(size_t(N) * out), x = rnd(size_t(N) * in), W = rnd(size_t(out) * in, 0.2f);
  Vec dW0 = rnd(size_t(out) * in), db0 = rnd(out);  // += semantics: start from non-zero
  Vec r[2][3];
  for (int k = 0; k < 2; ++k) {
    Dev* d = k ? gpu.get() : cpu.get();
    void* dx = d->nan_act(size_t(N) * in);
    float* dW = d->f32(dW0);
    float* db = d->f32(db0);
    d->be->linear_backward(dx, dW, db, d->act(dy), d->act(x), d->act(W), N, in, out);
    r[k][0] = d->get_act(dx, size_t(N) * in);
    r[k][1] = d->get_f32(dW, size_t(out) * in);
    r[k][2] = d->get_f32(db, out);
  }
  EXPECT_CLOSE(r[1][0], r[0][0], tol());
  // dW and db are fp32 sums of products of identical (act-representable) inputs.
  EXPECT_CLOSE(r[1][1], r[0][1], 1e-5);
  EXPECT_CLOSE(r[1][2], r[0][2], 1e-5);
  // dx == null skips dx; dW still accumulates.
  float* dW = gpu->f32(dW0);
  gpu->be->linear_backward(nullptr, dW, nullptr, gpu->act(dy), gpu->act(x), gpu->act(W), N, in,
                           out);
  EXPECT_CLOSE(gpu->get_f32(dW, size_t(out) * in), r[0][1], 1e-5);
  }
}

// The GELU backward that also forms the bias gradient of the Linear before it (one kernel,
// the column sums finished by the last block of each column group), through
// gelu_backward_bias and through linear_backward's gelu_db: dx bit-identical to the plain GELU
// backward, db the column sums of that dx. Odd shapes take the scalar path, aligned ones the
// 16-byte one; N > 256 rows gives several chunks per column; the second call checks that the
// completion counters were reset.
TEST_P(GpuBackend, GeluBackwardBias) {
  for (auto [N, C] : {std::pair<int, int>{41, 35}, std::pair<int, int>{1000, 256},
                      std::pair<int, int>{777, 3072}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    const size_t n = size_t(N) * C;
    Vec h = rnd(n, 4.0f), dy = rnd(n), db0 = rnd(C);
    void* dx = gpu->act(dy);  // dx aliases dy, as the interface allows
    float* db = gpu->f32(db0);
    gpu->be->gelu_backward_bias(dx, gpu->act(h), dx, N, C, db, Gelu::Exact);
    const Vec got = gpu->get_act(dx, n);
    void* ref = gpu->act(dy);
    gpu->be->gelu_backward(ref, gpu->act(h), ref, n, Gelu::Exact);
    EXPECT_EQ(got, gpu->get_act(ref, n));
    Vec want(C);
    for (int j = 0; j < C; ++j) {
      double t = db0[j];
      for (int r = 0; r < N; ++r) t += got[size_t(r) * C + j];
      want[j] = static_cast<float>(t);
    }
    EXPECT_CLOSE(gpu->get_f32(db, C), want, 1e-5);
    void* dx2 = gpu->act(dy);
    gpu->be->gelu_backward_bias(dx2, gpu->act(h), dx2, N, C, db, Gelu::Exact);
    for (int j = 0; j < C; ++j) want[j] += want[j] - db0[j];
    EXPECT_CLOSE(gpu->get_f32(db, C), want, 1e-5);
    // linear_backward(gelu_pre, gelu_db) against the CPU backend's
    const int out = 64;
    Vec g = rnd(size_t(N) * out), a = rnd(size_t(N) * C), W = rnd(size_t(out) * C, 0.2f);
    Vec r[2][2];
    for (int k = 0; k < 2; ++k) {
      Dev* d = k ? gpu.get() : cpu.get();
      void* ldx = d->nan_act(n);
      float* ldb = d->f32(db0);
      float* ldW = d->f32(Vec(size_t(out) * C, 0.0f));
      d->be->linear_backward(ldx, ldW, nullptr, d->act(g), d->act(a), d->act(W), N, C, out,
                             d->act(h), Gelu::Exact, ldb);
      r[k][0] = d->get_act(ldx, n);
      r[k][1] = d->get_f32(ldb, C);
    }
    EXPECT_CLOSE(r[1][0], r[0][0], tol());
    EXPECT_CLOSE(r[1][1], r[0][1], 50 * tol());
  }
}

TEST_P(GpuBackend, GemmBatched) {
  const int M = 13, N = 21, K = 17, batch = 3;
  for (int t = 0; t < 4; ++t) {
    const bool tA = t & 1, tB = t & 2;
    Vec A = rnd(size_t(batch) * M * K), B = rnd(size_t(batch) * K * N), C0 = rnd(size_t(batch) * M * N);
    Vec res[2];
    for (int k = 0; k < 2; ++k) {
      Dev* d = k ? gpu.get() : cpu.get();
      void* C = d->act(C0);
      d->be->gemm_batched(tA, tB, M, N, K, 0.75f, d->act(A), int64_t(M) * K, d->act(B),
                          int64_t(K) * N, 0.5f, C, int64_t(M) * N, batch);
      res[k] = d->get_act(C, C0.size());
    }
    SCOPED_TRACE("transA " + std::to_string(tA) + " transB " + std::to_string(tB));
    EXPECT_CLOSE(res[1], res[0], tol());
  }
}

TEST_P(GpuBackend, Elementwise) {
  // odd: exercises the scalar tail after the 16-byte vector path (two packs per iteration);
  // inputs out to |x| = 8 reach GELU's tails, where 16-bit types use the fast normal CDF
  const size_t n = 100007;
  Vec x = rnd(n, 8.0f), y = rnd(n), dy = rnd(n);
  for (float& v : x)
    if (v == 0.0f) v = 0.5f;  // no zeros: a zero output then means a dropped element
  for (Gelu g : {Gelu::Exact, Gelu::Tanh}) {
    Vec f[2], b[2];
    for (int k = 0; k < 2; ++k) {
      Dev* d = k ? gpu.get() : cpu.get();
      void* o = d->nan_act(n);
      d->be->gelu_forward(o, d->act(x), n, g);
      f[k] = d->get_act(o, n);
      void* dx = d->act(dy);  // dx aliases dy, as the interface allows
      d->be->gelu_backward(dx, d->act(x), dx, n, g);
      b[k] = d->get_act(dx, n);
    }
    EXPECT_CLOSE(f[1], f[0], tol());
    EXPECT_CLOSE(b[1], b[0], tol());
  }
  // Dropout: masks identical bit for bit (same counter RNG), values within rounding; also the
  // tensor-parallel column-block numbering (cols > 0), the step and stream position read
  // from each backend's memory as the call runs (position: what CUDA graphs replay), and drop
  // path (whole samples of 40 elements, vector path; of 19, scalar path).
  const int64_t position[2] = {12, 345};
  const int64_t* pos[2];
  for (int k = 0; k < 2; ++k) {
    Dev* d = k ? gpu.get() : cpu.get();
    void* p = d->raw(sizeof(position));
    d->be->copy_to_device(p, position, sizeof(position));
    pos[k] = static_cast<const int64_t*>(p);
  }
  for (int form = 0; form < 5; ++form)
  for (float p : {0.0f, 0.1f, 0.5f}) {
    DropoutKey key{77, 0x1234abcdULL, 5000, form == 1 ? 7 : 0, 19, 5};
    if (form >= 2) {
      key.step_tag = 0x55aaULL;
      key.sample_elems = 11;
    }
    if (form >= 3) {
      key.path_p = 0.3f;
      key.path_sample0 = 9;
      key.path_sample_elems = form == 3 ? 40 : 19;
    }
    Vec f[2], b[2];
    for (int k = 0; k < 2; ++k) {
      Dev* d = k ? gpu.get() : cpu.get();
      if (form >= 2) key.position = pos[k];
      void* o = d->nan_act(n);
      d->be->dropout_forward(o, d->act(x), n, p, key);
      f[k] = d->get_act(o, n);
      void* g = d->act(x);
      d->be->dropout_backward(g, g, n, p, key);  // in place
      b[k] = d->get_act(g, n);
    }
    // the mask the key names, worked out here: form 2 from the host copy of the position
    uint64_t stream = key.key, base = key.counter_base;
    if (form >= 2) {
      stream ^= vitgrid::mix64(key.step_tag ^ vitgrid::mix64(uint64_t(position[0])));
      base += uint64_t(position[1]) * key.sample_elems;
    }
    size_t samples_dropped = 0;
    size_t mism = 0, dropped = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t c = key.cols > 0 ? base + (i / key.cols) * key.global_cols +
                                            key.col_offset + i % key.cols
                                      : base + i;
      bool keep = vitgrid::dropout_keep(vitgrid::rng_stream(key.seed, stream), c,
                                        vitgrid::dropout_threshold(p));
      if (form >= 3) {
        const uint64_t sample =
            key.path_sample0 + uint64_t(position[1]) + i / key.path_sample_elems;
        const bool kept = vitgrid::drop_path_keep(key.seed, stream, sample,
                                                  vitgrid::dropout_threshold(key.path_p));
        samples_dropped += !kept && i % key.path_sample_elems == 0;
        keep = keep && kept;
      }
      dropped += !keep;
      mism += (f[1][i] == 0.0f) != !keep;
      mism += (f[0][i] == 0.0f) != !keep;
      mism += (b[1][i] == 0.0f) != !keep;
    }
    EXPECT_EQ(mism, 0u) << "dropout masks differ, p = " << p << ", key form " << form;
    if (p > 0) {
      EXPECT_GT(dropped, 0u);
    }
    if (form >= 3) {
      EXPECT_GT(samples_dropped, 0u);
    }
    EXPECT_CLOSE(f[1], f[0], tol());
    EXPECT_CLOSE(b[1], b[0], tol());
  }
  // add, accumulate, scale_f32, casts
  Vec a[2], c[2], s[2], cast[2];
  for (int k = 0; k < 2; ++k) {
    Dev* d = k ? gpu.get() : cpu.get();
    void* o = d->nan_act(n);
    d->be->add(o, d->act(x), d->act(y), n);
    a[k] = d->get_act(o, n);
    void* acc = d->act(x);
    d->be->accumulate(acc, d->act(y), n);
    c[k] = d->get_act(acc, n);
    float* f = d->f32(x);
    d->be->scale_f32(f, n, -0.37f);
    s[k] = d->get_f32(f, n);
    void* ca = d->nan_act(n);
    d->be->cast_to_act(ca, d->f32(y), n);
    cast[k] = d->get_act(ca, n);
  }
  EXPECT_CLOSE(a[1], a[0], tol());
  EXPECT_CLOSE(c[1], c[0], tol());
  EXPECT_CLOSE(s[1], s[0], 1e-6);
  EXPECT_CLOSE(cast[1], cast[0], 1e-7);  // y is representable: the cast is exact
}

// LayerNorm forward and backward against the CPU reference, on each kernel the width picks
// (ln_paths): the fused warp-per-row backward, the block-per-row kernels and the general path.
TEST_P(GpuBackend, LayerNorm) {
  // odd width (generic kernels) and 16-byte-divisible widths (register-resident vector
  // forward with 1..4 packs per lane, fused vector backwards: ViT-Lite 256, ViT-S 384, ViT-B
  // 768, ViT-L 1024; block-per-row kernels: ViT-H 1280, 2048, the large ViT's 4096, 8192 (in
  // 16-bit types 2 packs per thread in the backward; in fp32 past its reach: the general
  // path)); odd row counts (not a multiple of the warps per block), three of them past one
  // sweep of the second fused kernel's grid (a row per warp: 4224, 3168, 2640 rows at C = 256,
  // 384, 768 in 16-bit types), so that warps take several rows and the last sweep is partial,
  // and 2211 rows of 2048 (the block-per-row backward's 264 blocks take 8-9 rows each); 1536
  // (6 packs per lane: the second kernel without dx's column sums, the block-per-row one with)
  for (auto [N, C] : {std::pair<int, int>{45, 77}, std::pair<int, int>{301, 256},
                      std::pair<int, int>{67, 1024}, std::pair<int, int>{197, 768},
                      std::pair<int, int>{33, 384}, std::pair<int, int>{91, 1280},
                      std::pair<int, int>{19, 4096}, std::pair<int, int>{4391, 256},
                      std::pair<int, int>{3301, 384}, std::pair<int, int>{4999, 768},
                      std::pair<int, int>{53, 1536}, std::pair<int, int>{2211, 2048},
                      std::pair<int, int>{37, 8192}}) {
  SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
  const float eps = 1e-6f;
  Vec a = rnd(size_t(N) * C, 1.0f, 0.3f), b = rnd(size_t(N) * C), g = rnd(C, 0.2f, 1.0f),
      be = rnd(C, 0.1f), dy = rnd(size_t(N) * C), dx0 = rnd(size_t(N) * C),
      dg0 = rnd(C), db0 = rnd(C), ds0 = rnd(C);
  // with the residual, the backward also sums dx's columns into dsum (output 7)
  for (int with_b = 0; with_b < 2; ++with_b) {
    const bool ds = with_b;
    Vec r[2][8];  // [0] CPU, [1] CUDA
    for (int k = 0; k < 2; ++k) {
      Dev* d = k ? gpu.get() : cpu.get();
      void* res = d->nan_act(size_t(N) * C);
      void* y = d->nan_act(size_t(N) * C);
      float* mean = d->nan_f32(N);
      float* rstd = d->nan_f32(N);
      void* gam = d->act(g);
      d->be->add_layernorm_forward(res, y, mean, rstd, d->act(a), with_b ? d->act(b) : nullptr,
                                   gam, d->act(be), N, C, eps);
      r[k][0] = d->get_act(res, size_t(N) * C);
      r[k][1] = d->get_act(y, size_t(N) * C);
      r[k][2] = d->get_f32(mean, N);
      r[k][3] = d->get_f32(rstd, N);
      void* dx = d->act(dx0);
      float* dgam = d->f32(dg0);
      float* dbet = d->f32(db0);
      float* dsum = ds ? d->f32(ds0) : nullptr;
      d->be->layernorm_backward(dx, dgam, dbet, d->act(dy), res, gam, mean, rstd, N, C, dsum);
      r[k][4] = d->get_act(dx, size_t(N) * C);
      r[k][5] = d->get_f32(dgam, C);
      r[k][6] = d->get_f32(dbet, C);
      if (ds) r[k][7] = d->get_f32(dsum, C);
    }
    if (ds) {  // the reference: the CPU's dx, rounded as stored, summed by columns in fp64
      // (bound: fp32 rounding of the CPU's running sum, relative to the sum of magnitudes,
      // as the column sums cancel; one row missing or twice would be ~1 / N of it, 20x more)
      ASSERT_EQ(r[0][7].size(), size_t(C));
      for (int c = 0; c < C; ++c) {
        double s = ds0[c], mag = std::fabs(ds0[c]);
        for (int i = 0; i < N; ++i) {
          s += r[0][4][size_t(i) * C + c];
          mag += std::fabs(r[0][4][size_t(i) * C + c]);
        }
        EXPECT_NEAR(r[0][7][c], s, 1e-5 * mag) << "CPU dsum, column " << c;
      }
    }
    SCOPED_TRACE(with_b ? "with residual" : "without residual");
    for (int j = 0; j < (ds ? 8 : 7); ++j) {
      // mean/rstd/dgamma/dbeta are fp32 but depend on res, which is rounded identically
      // only when a + b is exact; use the act tolerance for all but rstd-free fp32 sums.
      SCOPED_TRACE("output " + std::to_string(j));
      EXPECT_CLOSE(r[1][j], r[0][j], tol());
    }
  }
  // In place: res aliases a.
  Vec rr[2];
  for (int k = 0; k < 2; ++k) {
    Dev* d = k ? gpu.get() : cpu.get();
    void* aa = d->act(a);
    d->be->add_layernorm_forward(aa, d->nan_act(size_t(N) * C), d->nan_f32(N), d->nan_f32(N), aa,
                                 d->act(b), d->act(g), d->act(be), N, C, eps);
    rr[k] = d->get_act(aa, size_t(N) * C);
  }
  EXPECT_CLOSE(rr[1], rr[0], tol());
  }
}

// Drop path in the LayerNorms (RowFactors): the fused forward and backward give what the drop-path pass around the unfused ones
// gives, bit for bit (res, y, dx and the branch gradient; dx and the branch gradient only close
// where the backward with factors runs another kernel than the one without: 1280 in 16-bit
// types and 768 in fp32 under the defaults); the branch gradient's column sums
// match an fp64 sum of it; the factors and every output match the CPU backend. Widths: the
// second kernel's factor variant (1, 2, 3, 4 packs per lane in 16-bit types), the
// block-per-row kernel's (1280: 5 packs; 4096) and the passes of their own (77: the general
// path).
TEST_P(GpuBackend, LayerNormRowFactors) {
  const int T = 7;
  for (auto [N, C] : {std::pair<int, int>{4998, 768}, std::pair<int, int>{301, 256},
                      std::pair<int, int>{63, 1024}, std::pair<int, int>{147, 512},
                      std::pair<int, int>{91, 1280}, std::pair<int, int>{42, 77},
                      std::pair<int, int>{2107, 4096}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    const int S = N / T;
    const size_t n = size_t(N) * C;
    DropoutKey k;
    k.seed = 21;
    k.key = 5;
    k.path_p = 0.3f;
    k.path_sample0 = 40;
    k.path_sample_elems = size_t(T) * C;
    Vec a = rnd(n, 1.0f, 0.3f), b = rnd(n), g = rnd(C, 0.2f, 1.0f), be = rnd(C, 0.1f),
        dy = rnd(n), dx0 = rnd(n), ds0 = rnd(C);
    Vec ref[6];  // the CPU's fused outputs: res, y, dx, dbranch, dsum, factors
    for (int d_i = 0; d_i < 2; ++d_i) {
      Dev* d = d_i ? gpu.get() : cpu.get();
      SCOPED_TRACE(d_i ? "CUDA" : "CPU");
      float* f = d->nan_f32(S);
      d->be->drop_path_factors(f, S, k);
      const RowFactors rf{f, T};
      void* gam = d->act(g);
      Vec out[2][5];  // [fused?]: res, y, dx, dbranch, dsum
      for (int fused = 0; fused < 2; ++fused) {
        void* res = d->nan_act(n);
        void* y = d->nan_act(n);
        float* mean = d->nan_f32(N);
        float* rstd = d->nan_f32(N);
        void* dx = d->act(dx0);
        void* dbr = d->nan_act(n);
        float* dgam = d->f32(Vec(C, 0.0f));
        float* dbet = d->f32(Vec(C, 0.0f));
        float* dsum = d->f32(ds0);
        if (fused) {
          d->be->add_layernorm_forward(res, y, mean, rstd, d->act(a), d->act(b), gam, d->act(be),
                                       N, C, 1e-6f, rf);
          d->be->layernorm_backward(dx, dgam, dbet, d->act(dy), res, gam, mean, rstd, N, C,
                                    dsum, dbr, rf);
          out[1][4] = d->get_f32(dsum, C);
        } else {
          void* bd = d->act(b);
          d->be->dropout_forward(bd, bd, n, 0.0f, k);
          d->be->add_layernorm_forward(res, y, mean, rstd, d->act(a), bd, gam, d->act(be), N, C,
                                       1e-6f);
          d->be->layernorm_backward(dx, dgam, dbet, d->act(dy), res, gam, mean, rstd, N, C);
          d->be->dropout_backward(dbr, dx, n, 0.0f, k);
        }
        out[fused][0] = d->get_act(res, n);
        out[fused][1] = d->get_act(y, n);
        out[fused][2] = d->get_act(dx, n);
        out[fused][3] = d->get_act(dbr, n);
      }
      // bit for bit where the fused call's backward runs the same kernel as the unfused one
      // (the CPU; on the GPU a variant may reach further than another, then only close)
      const bool same = d_i == 0 || ln_paths(C, dt, false).bwd == ln_paths(C, dt, true, true).bwd;
      for (int j = 0; j < 4; ++j) {
        SCOPED_TRACE("output " + std::to_string(j));
        if (j >= 2 && !same) {
          EXPECT_CLOSE(out[1][j], out[0][j], tol());
          continue;
        }
        size_t diff = 0;
        for (size_t i = 0; i < n; ++i)
          diff += std::memcmp(&out[0][j][i], &out[1][j][i], sizeof(float)) != 0;
        EXPECT_EQ(diff, 0u) << "elements whose bits differ from the unfused pass";
      }
      for (int c = 0; c < C; ++c) {  // dsum: ds0 + the column sums of the branch gradient
        double s = ds0[c], mag = std::fabs(ds0[c]);
        for (int i = 0; i < N; ++i) {
          s += out[1][3][size_t(i) * C + c];
          mag += std::fabs(out[1][3][size_t(i) * C + c]);
        }
        ASSERT_NEAR(out[1][4][c], s, 1e-5 * mag) << "dsum, column " << c;
      }
      Vec fac = d->get_f32(f, S);
      if (d_i == 0) {
        for (int j = 0; j < 5; ++j) ref[j] = out[1][j];
        ref[5] = fac;
        int dropped = 0;
        for (float v : fac) dropped += v == 0.0f;
        ASSERT_GT(dropped, 0);
        ASSERT_LT(dropped, S);
        continue;
      }
      EXPECT_EQ(fac, ref[5]) << "the factors";
      for (int j = 0; j < 4; ++j) {
        SCOPED_TRACE("against the CPU, output " + std::to_string(j));
        EXPECT_CLOSE(out[1][j], ref[j], tol());
      }
    }
  }
}

TEST_P(GpuBackend, Softmax) {
  const int rows = 29, cols = 197;
  Vec x = rnd(size_t(rows) * cols, 3.0f), dy = rnd(size_t(rows) * cols);
  Vec f[2], b[2];
  for (int k = 0; k < 2; ++k) {
    Dev* d = k ? gpu.get() : cpu.get();
    void* y = d->nan_act(x.size());
    d->be->softmax_forward(y, d->act(x), rows, cols, 0.125f);
    f[k] = d->get_act(y, x.size());
    void* dx = d->nan_act(x.size());
    // backward from the reference probabilities so both sides see the same y
    d->be->softmax_backward(dx, d->act(f[0]), d->act(dy), rows, cols, 0.125f);
    b[k] = d->get_act(dx, x.size());
  }
  EXPECT_CLOSE(f[1], f[0], tol());
  EXPECT_CLOSE(b[1], b[0], 2 * tol());
}

// Attention: the CPU reference against every CUDA path: cuDNN's fused SDPA (bf16/fp16, head
// dim 64/80/128, builds with cudnn_frontend; a shape cuDNN rejects runs the flash kernels),
// the own flash kernels (bf16/fp16, head dim 32/64/80/128) and the cuBLASLt + softmax
// fallback (fp32 and other head dims always take it). One backend per BackendOptions::attention
// value (device.attention): the default (auto: the whole-head flash kernels at head dim 64 and
// T <= 224), cudnn, flash, fallback and cudnn_forward (cuDNN's forward with auto's backward,
// which reads the log-sum-exp cuDNN saved); each prints
// the path it took. Shapes cover ragged tiles (T = 17, 50, 65, 197 against 64-row tiles; 128:
// a multiple of cuDNN's 128-key tiles), several heads and batches, and hd = 32, 64, 80, 128
// (16 and 8: fallback only).
// Tolerances (rel L2): forward 2x the dtype's (bf16 2e-2, fp16 4e-3, fp32 2e-5); backward
// bf16 2.5e-2 (P and dS are rounded to bf16 before their GEMMs, dS = P (dP - D) cancels),
// fp16 4e-3, fp32 2e-5. The fused backwards (flash, and cuDNN's deterministic algorithm) must
// also be bitwise reproducible; cuDNN with device.deterministic = false (atomics) only close.
TEST_P(GpuBackend, Attention) {
  struct Shape { int B, T, H, hd; };
  // Extra CUDA backends, one per forced path (BackendOptions::attention, device.attention).
  auto make_with = [&](AttentionMode mode, const char* name, bool deterministic = true) {
    std::unique_ptr<Dev> d;
    try {
      BackendOptions o;
      o.deterministic = deterministic;
      o.attention = mode;
      d = std::make_unique<Dev>(make_cuda_backend(0, dt, o));
    } catch (const UserError& e) {
      std::printf("[attention %s] device.attention = %s: %s\n", dtype_name(dt), name, e.what());
    }
    return d;
  };
  std::unique_ptr<Dev> fb = make_with(AttentionMode::Fallback, "fallback"),
                       fl = make_with(AttentionMode::Flash, "flash"),
                       cd = make_with(AttentionMode::Cudnn, "cudnn"),
                       ca = make_with(AttentionMode::Cudnn, "cudnn", false),
                       cf = make_with(AttentionMode::CudnnForward, "cudnn_forward");
  ASSERT_TRUE(fb && fl);
#if defined(VITGRID_HAVE_CUDNN_FRONTEND) && VITGRID_HAVE_CUDNN_FRONTEND
  ASSERT_TRUE(cd) << "built with cudnn_frontend, yet device.attention = cudnn was refused";
  ASSERT_TRUE(cf) << "built with cudnn_frontend, yet device.attention = cudnn_forward was refused";
#else
  EXPECT_FALSE(cd) << "device.attention = cudnn accepted by a build without cudnn_frontend";
  EXPECT_FALSE(cf) << "device.attention = cudnn_forward accepted without cudnn_frontend";
#endif
  const double tol_f = dt == DType::F32 ? 2e-5 : 2 * tol();
  const double tol_b = dt == DType::F32 ? 2e-5 : (dt == DType::BF16 ? 2.5e-2 : 2 * tol());
  // 0 CPU reference, then the CUDA backends: 1 default (auto), 2 fallback, 3 flash, 4 cudnn,
  // 5 cudnn with atomics allowed, 6 cudnn_forward (cuDNN's forward, auto's backward: the
  // whole-head kernels reading cuDNN's log-sum-exp at T <= 224)
  constexpr int K = 7;
  const char* names[K] = {"cpu",   "default",      "fallback",     "flash",
                          "cudnn", "cudnn-atomic", "cudnn_forward"};
  Dev* devs[K] = {cpu.get(), gpu.get(), fb.get(), fl.get(), cd.get(), ca.get(), cf.get()};
  for (Shape s : {Shape{3, 17, 2, 64}, Shape{2, 197, 3, 64}, Shape{2, 128, 2, 64},
                  Shape{2, 65, 4, 80}, Shape{1, 50, 2, 128}, Shape{2, 33, 3, 32},
                  Shape{3, 17, 2, 16}, Shape{5, 9, 7, 8}}) {
    const size_t C = size_t(s.H) * s.hd, nqkv = size_t(s.B) * s.T * 3 * C,
                 nout = size_t(s.B) * s.T * C;
    Vec qkv = rnd(nqkv), dout = rnd(nout);
    Vec o[K], g[K], g2[K];
    size_t saved_bytes[K] = {};
    std::string path[K];
    for (int k = 0; k < K; ++k) {
      Dev* d = devs[k];
      if (d == nullptr) continue;
      path[k] = k == 0 ? "cpu" : cuda_attention_path(*d->be, s.B, s.T, s.H, s.hd);
      void* q = d->act(qkv);
      void* out = d->nan_act(nout);
      saved_bytes[k] = d->be->attention_saved_bytes(s.B, s.T, s.H, s.hd);
      void* saved = d->raw(saved_bytes[k]);
      const size_t wsb = d->be->attention_workspace_bytes(s.B, s.T, s.H, s.hd);
      void* ws = wsb ? d->raw(wsb) : nullptr;
      d->be->attention_forward(out, saved, q, s.B, s.T, s.H, s.hd, ws);
      o[k] = d->get_act(out, nout);
      void* dO = d->act(dout);
      void* dq = d->nan_act(nqkv);
      d->be->attention_backward(dq, dO, q, out, saved, s.B, s.T, s.H, s.hd, ws);
      g[k] = d->get_act(dq, nqkv);
      if (k > 0) {  // run the backward again into a fresh NaN buffer (bitwise check below)
        void* dq2 = d->nan_act(nqkv);
        d->be->attention_backward(dq2, dO, q, out, saved, s.B, s.T, s.H, s.hd, ws);
        g2[k] = d->get_act(dq2, nqkv);
        // the path asked after the runs is the one asked before (and the one they took)
        EXPECT_EQ(path[k], cuda_attention_path(*d->be, s.B, s.T, s.H, s.hd));
      }
    }
    const bool fused = dt != DType::F32 && (s.hd == 32 || s.hd == 64 || s.hd == 80 ||
                                            s.hd == 128);
    const bool cudnn_eligible = fused && s.hd != 32;
    std::string tag = "B T H hd = " + std::to_string(s.B) + " " + std::to_string(s.T) + " " +
                      std::to_string(s.H) + " " + std::to_string(s.hd) + " (paths:";
    for (int k = 1; k < K; ++k) {
      if (devs[k]) tag += std::string(" ") + names[k] + "=" + path[k];
    }
    tag += ")";
    SCOPED_TRACE(tag);
    std::printf("[attention %s] %s\n", dtype_name(dt), tag.c_str());
    for (int k = 1; k < K; ++k) {
      if (!devs[k]) continue;
      std::printf("[attention %s]   %-8s (%-8s): fwd rel L2 %.3g vs-fallback %.3g; bwd %.3g "
                  "vs-fallback %.3g\n",
                  dtype_name(dt), names[k], path[k].c_str(), rel_l2(o[k], o[0]),
                  rel_l2(o[k], o[2]), rel_l2(g[k], g[0]), rel_l2(g[k], g[2]));
      SCOPED_TRACE(std::string("device.attention ") + names[k] + ", path " + path[k]);
      EXPECT_CLOSE(o[k], o[0], tol_f);
      EXPECT_CLOSE(g[k], g[0], tol_b);
      if (k != 2) {
        EXPECT_CLOSE(o[k], o[2], tol_f);
        EXPECT_CLOSE(g[k], g[2], tol_b);
      }
      // the path each mode may take
      if (k == 2 || !fused) {
        EXPECT_EQ(path[k], "fallback");
      } else if (k == 3 || !cudnn_eligible || !cd) {
        EXPECT_EQ(path[k], "flash");
      } else if (k == 6) {  // the forward's path: cudnn's
        EXPECT_EQ(path[k], path[4]);
      } else {  // default and cudnn: cuDNN, or flash for a shape cuDNN rejects
        EXPECT_TRUE(path[k] == "cudnn" || path[k] == "flash") << path[k];
      }
      if (path[k] != "fallback") {  // bitwise reproducible; only the log-sum-exp is saved
        if (k != 5) {
          EXPECT_EQ(0, std::memcmp(g[k].data(), g2[k].data(), g2[k].size() * sizeof(float)))
              << names[k] << " (" << path[k] << ") attention backward is not bitwise reproducible";
        }
        EXPECT_EQ(saved_bytes[k], size_t(s.B) * s.H * s.T * sizeof(float));
      } else {
        EXPECT_EQ(saved_bytes[k], saved_bytes[2]);
      }
    }
    // auto takes the whole-head flash kernels where they apply, else what cudnn takes
    if (cuda::flash_head_applies(dt, s.hd, s.T)) {
      EXPECT_EQ(path[1], "flash");
    } else if (cd) {
      EXPECT_EQ(path[1], path[4]);
    }
    if (cd) {
      EXPECT_EQ(path[5], path[4]);  // cudnn with atomics takes what cudnn takes
    }
  }
}

TEST_P(GpuBackend, VitGlue) {
  {
  const int B = 3, S = 12, pad = 2;
  std::uniform_int_distribution<int> px(0, 255);
  std::vector<uint8_t> img(size_t(B) * S * S * 3);
  for (auto& v : img) v = uint8_t(px(rng));
  // data::SampleAug layout: dx, dy, flip, lam, partner, CutMix box, target share
  struct Aug { int32_t dx, dy, flip; float lam; int32_t partner; int16_t x0, y0, x1, y1; float t; };
  static_assert(sizeof(Aug) == 32, "SampleAug layout");
  for (int mix = 0; mix < 2; ++mix) {
    // mix: sample 0 Mixup with 2, sample 2 CutMix with 0, sample 1 alone
    std::vector<Aug> aug = {{0, 4, 1, 0.7f, mix ? 2 : -1, 0, 0, 0, 0, 0.7f},
                            {3, 1, 0, 1.0f, -1, 0, 0, 0, 0, 1.0f},
                            {4, 0, 1, 1.0f, mix ? 0 : -1, 2, 3, 9, 7, 0.6f}};
    const float mean3[3] = {0.485f, 0.456f, 0.406f}, std3[3] = {0.229f, 0.224f, 0.225f};
    Vec r[2];
    for (int k = 0; k < 2; ++k) {
      Dev* d = k ? gpu.get() : cpu.get();
      auto* di = static_cast<uint8_t*>(d->raw(img.size()));
      void* da = d->raw(aug.size() * sizeof(Aug));
      d->be->copy_to_device(di, img.data(), img.size());
      d->be->copy_to_device(da, aug.data(), aug.size() * sizeof(Aug));
      void* out = d->nan_act(size_t(B) * 3 * S * S);
      d->be->prepare_images(out, di, da, B, S, pad, mean3, std3);
      r[k] = d->get_act(out, size_t(B) * 3 * S * S);
    }
    SCOPED_TRACE(mix ? "mixup and cutmix" : "no mixing");
    EXPECT_CLOSE(r[1], r[0], dt == DType::F32 ? 1e-6 : tol());
  }
  }
  // patchify, token embedding and their backward: odd shapes (the scalar kernels) and shapes
  // whose rows are whole 16-byte packs in every act type (the vector kernels; B = 11: the
  // batch loop's 8-row groups and a partial one)
  for (auto [B, S, P, C] : {std::tuple<int, int, int, int>{3, 12, 4, 19},
                            std::tuple<int, int, int, int>{11, 32, 8, 64}}) {
  SCOPED_TRACE("S=" + std::to_string(S) + " P=" + std::to_string(P) + " C=" + std::to_string(C));
  const int T = (S / P) * (S / P) + 1;
  Vec im = rnd(size_t(B) * 3 * S * S), tok = rnd(size_t(B) * (T - 1) * C), cls = rnd(C),
      pos = rnd(size_t(T) * C), dx = rnd(size_t(B) * T * C), dcls0 = rnd(C),
      dpos0 = rnd(size_t(T) * C), drows = rnd(size_t(B) * C), dxs0 = rnd(size_t(B) * T * C);
  Vec r[2][7];
  for (int k = 0; k < 2; ++k) {
    Dev* d = k ? gpu.get() : cpu.get();
    void* patches = d->nan_act(size_t(B) * S * S * 3);
    d->be->patchify(patches, d->act(im), B, S, P);
    r[k][0] = d->get_act(patches, size_t(B) * S * S * 3);
    void* x = d->nan_act(size_t(B) * T * C);
    d->be->embed_tokens(x, d->act(tok), d->act(cls), d->act(pos), B, T, C);
    r[k][1] = d->get_act(x, size_t(B) * T * C);
    void* dtok = d->nan_act(size_t(B) * (T - 1) * C);
    float* dcls = d->f32(dcls0);
    float* dpos = d->f32(dpos0);
    d->be->embed_tokens_backward(dtok, dcls, dpos, d->act(dx), B, T, C);
    r[k][2] = d->get_act(dtok, size_t(B) * (T - 1) * C);
    r[k][3] = d->get_f32(dcls, C);
    r[k][4] = d->get_f32(dpos, size_t(T) * C);
    void* rows = d->nan_act(size_t(B) * C);
    d->be->gather_cls(rows, d->act(dx), B, T, C);
    r[k][5] = d->get_act(rows, size_t(B) * C);
    void* dxs = d->act(dxs0);
    d->be->scatter_cls_backward(dxs, d->act(drows), B, T, C);
    r[k][6] = d->get_act(dxs, size_t(B) * T * C);
  }
  EXPECT_CLOSE(r[1][0], r[0][0], 1e-7);  // pure data movement
  EXPECT_CLOSE(r[1][1], r[0][1], tol());
  EXPECT_CLOSE(r[1][2], r[0][2], 1e-7);
  EXPECT_CLOSE(r[1][3], r[0][3], 1e-5);
  EXPECT_CLOSE(r[1][4], r[0][4], 1e-5);
  EXPECT_CLOSE(r[1][5], r[0][5], 1e-7);
  EXPECT_CLOSE(r[1][6], r[0][6], tol());
  }
}

TEST_P(GpuBackend, LossAndMetrics) {
  const int N = 33, K = 1000;
  Vec logits = rnd(size_t(N) * K, 2.0f);
  std::vector<int32_t> labels(N);
  std::uniform_int_distribution<int> lab(0, K - 1);
  for (auto& l : labels) l = lab(rng);
  // Ties for top-k: row 0 has its label tied with an earlier maximum (not top-1), row 1 has
  // its label as the first of tied maxima (top-1).
  for (int j = 0; j < K; ++j) logits[j] = logits[K + j] = -1.0f;
  labels[0] = 10;
  logits[5] = logits[10] = 4.0f;
  labels[1] = 3;
  logits[K + 3] = logits[K + 900] = 4.0f;
  Vec soft(size_t(N) * K);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int i = 0; i < N; ++i) {
    float s = 0;
    for (int j = 0; j < K; ++j) s += (soft[size_t(i) * K + j] = u(rng) < 0.01f ? u(rng) : 0.0f);
    for (int j = 0; j < K && s > 0; ++j) soft[size_t(i) * K + j] /= s;
  }
  for (int soft_mode = 0; soft_mode < 2; ++soft_mode) {
    Vec r[2][2];
    for (int k = 0; k < 2; ++k) {
      Dev* d = k ? gpu.get() : cpu.get();
      auto* dl = static_cast<int32_t*>(d->raw(N * 4));
      d->be->copy_to_device(dl, labels.data(), N * 4);
      float* losses = d->nan_f32(N);
      void* dlog = d->nan_act(size_t(N) * K);
      d->be->cross_entropy(losses, dlog, d->act(logits), dl, soft_mode ? d->f32(soft) : nullptr,
                           N, K, 0.1f, 1.0f / 64);
      r[k][0] = d->get_f32(losses, N);
      r[k][1] = d->get_act(dlog, size_t(N) * K);
    }
    SCOPED_TRACE(soft_mode ? "soft targets" : "hard labels");
    EXPECT_CLOSE(r[1][0], r[0][0], 1e-5);  // fp32 losses of identical logits
    EXPECT_CLOSE(r[1][1], r[0][1], tol());
  }
  Vec c[2][2];
  for (int k = 0; k < 2; ++k) {
    Dev* d = k ? gpu.get() : cpu.get();
    auto* dl = static_cast<int32_t*>(d->raw(N * 4));
    d->be->copy_to_device(dl, labels.data(), N * 4);
    float* c1 = d->nan_f32(N);
    float* c5 = d->nan_f32(N);
    d->be->topk_correct(c1, c5, d->act(logits), dl, N, K);
    c[k][0] = d->get_f32(c1, N);
    c[k][1] = d->get_f32(c5, N);
  }
  EXPECT_EQ(c[1][0], c[0][0]);  // exact
  EXPECT_EQ(c[1][1], c[0][1]);
  EXPECT_EQ(c[1][0][0], 0.0f);
  EXPECT_EQ(c[1][1][0], 1.0f);
  EXPECT_EQ(c[1][0][1], 1.0f);
}

TEST_P(GpuBackend, ReductionsAndOptimizers) {
  // fp32 state: the act dtype does not matter, but every backend instance must get it right.
  const size_t n = 70001;
  std::vector<ParamSlice> slices = {{0, 5, 0.0f}, {5, 40000, 0.05f}, {40005, 1, 0.0f},
                                    {40100, 29901, 0.1f}};  // gap 40006..40099 untouched
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto r = [&](float sc) { Vec v(n); for (auto& x : v) x = sc * nd(rng); return v; };
  Vec p0 = r(1.0f), g0 = r(0.1f), m0 = r(0.01f), v0(n), u0 = r(1.0f);
  for (auto& x : v0) x = 0.001f * std::fabs(nd(rng));
  // sum_squares, sum, all_finite
  std::vector<double> ssc(slices.size()), ssg(slices.size());
  cpu->be->sum_squares(ssc.data(), cpu->f32(p0), slices);
  float* gp = gpu->f32(p0);
  gpu->be->sum_squares(ssg.data(), gp, slices);
  for (size_t i = 0; i < slices.size(); ++i) EXPECT_NEAR(ssg[i], ssc[i], 1e-9 * ssc[i] + 1e-12);
  EXPECT_NEAR(gpu->be->sum(gp, n), cpu->be->sum(cpu->f32(p0), n), 1e-6 * n);
  EXPECT_TRUE(gpu->be->all_finite(gp, n));
  for (float bad : {kNaN, std::numeric_limits<float>::infinity()}) {
    Vec q = p0;
    q[n - 3] = bad;
    EXPECT_FALSE(gpu->be->all_finite(gpu->f32(q), n));
  }
  const AdamParams ap{1e-3f, 0.9f, 0.999f, 1e-8f, 3, 0.5f};
  Vec res[2][5];
  for (int k = 0; k < 2; ++k) {
    Dev* d = k ? gpu.get() : cpu.get();
    float *p = d->f32(p0), *g = d->f32(g0), *m = d->f32(m0), *v = d->f32(v0);
    for (int it = 0; it < 3; ++it) d->be->adamw_update(p, g, m, v, slices, ap);
    res[k][0] = d->get_f32(p, n);
    res[k][1] = d->get_f32(m, n);
    res[k][2] = d->get_f32(v, n);
    float *p2 = d->f32(p0), *u = d->f32(u0), *m2 = d->f32(m0), *v2 = d->f32(v0);
    d->be->lamb_direction(u, p2, g, m2, v2, slices, ap);
    res[k][3] = d->get_f32(u, n);
    d->be->lamb_apply(p2, u, slices, {0.5f, 1.5f, 2.0f, 0.25f}, 0.01f);
    float* mom = d->f32(m0);
    d->be->sgd_update(p2, g, mom, slices, 0.1f, 0.9f, false, 0.5f);
    d->be->sgd_update(p2, g, mom, slices, 0.1f, 0.9f, true, 0.5f);
    res[k][4] = d->get_f32(p2, n);
  }
  for (int j = 0; j < 5; ++j) {
    SCOPED_TRACE("optimizer output " + std::to_string(j));
    EXPECT_CLOSE(res[1][j], res[0][j], 1e-6);
  }
  // Elements outside every slice are untouched.
  for (size_t i = 40006; i < 40100; ++i) ASSERT_EQ(res[1][0][i], p0[i]);
}

// The device-scalar reductions of the training step (sum_into, sum_squares_total,
// clip_factor, readback) against the CPU backend, the optimizer's device gradient factor
// against the same factor by value (identical bits), and a CUDA graph of that tail replayed
// twice against the same ops run eagerly twice (identical bits).
TEST_P(GpuBackend, DeviceScalarsAndGraphs) {
  const size_t n = 50001;
  const std::vector<ParamSlice> slices = {{0, 7, 0.0f}, {7, 30000, 0.05f}, {30100, 19901, 0.0f}};
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Vec p0(n), g0(n), l0(300);
  for (auto& x : p0) x = nd(rng);
  for (auto& x : g0) x = 0.3f * nd(rng);
  for (auto& x : l0) x = std::fabs(nd(rng));
  struct Scalars {
    double loss, sq;
    float factor, pad;
  };
  Scalars got[2];
  for (int k = 0; k < 2; ++k) {
    Dev* d = k ? gpu.get() : cpu.get();
    auto* sc = static_cast<Scalars*>(d->be->alloc(sizeof(Scalars)));
    d->be->zero(sc, sizeof(Scalars));
    float* l = d->f32(l0);
    d->be->sum_into(&sc->loss, l, 300);
    d->be->sum_into(&sc->loss, l, 100);  // accumulates
    d->be->sum_squares_total(&sc->sq, d->f32(g0), slices);
    d->be->clip_factor(&sc->factor, &sc->sq, 1.0, 0.25f);  // |g| * 0.25 > 1: clipped
    d->be->readback_start(1, sc, sizeof(Scalars));
    std::memcpy(&got[k], d->be->readback_wait(1), sizeof(Scalars));
  }
  EXPECT_NEAR(got[1].loss, got[0].loss, 1e-9 * got[0].loss);
  EXPECT_NEAR(got[1].sq, got[0].sq, 1e-9 * got[0].sq);
  EXPECT_NEAR(got[1].factor, got[0].factor, 1e-6 * got[0].factor);
  const double g = std::sqrt(got[0].sq) * 0.25;
  ASSERT_GT(g, 1.0);
  EXPECT_FLOAT_EQ(got[0].factor, static_cast<float>(1.0 / (g + 1e-6)) * 0.25f);

  // AdamW / SGD with the factor on the device give the bits of the factor by value
  Dev& G = *gpu;
  float* factor = G.f32(Vec{got[1].factor});
  AdamParams by_value{1e-3f, 0.9f, 0.999f, 1e-8f, 2, got[1].factor};
  AdamParams on_device = by_value;
  on_device.grad_scale = 1.0f;
  on_device.grad_scale_dev = factor;
  Vec z(n, 0.0f);
  Vec out[2];
  for (int k = 0; k < 2; ++k) {
    float *p = G.f32(p0), *gg = G.f32(g0), *m = G.f32(z), *v = G.f32(z), *mom = G.f32(z);
    G.be->adamw_update(p, gg, m, v, slices, k ? on_device : by_value);
    G.be->sgd_update(p, gg, mom, slices, 0.1f, 0.9f, true, k ? 1.0f : got[1].factor,
                     k ? factor : nullptr);
    out[k] = G.get_f32(p, n);
  }
  EXPECT_EQ(out[1], out[0]);

  // a graph of norm -> factor -> update, replayed twice, against two eager runs
  ASSERT_TRUE(G.be->graphs_supported());
  auto* sc = static_cast<Scalars*>(G.be->alloc(sizeof(Scalars)));
  Vec res[2];
  for (int k = 0; k < 2; ++k) {
    float *p = G.f32(p0), *gg = G.f32(g0), *m = G.f32(z), *v = G.f32(z);
    auto tail = [&] {
      G.be->sum_squares_total(&sc->sq, gg, slices);
      G.be->clip_factor(&sc->factor, &sc->sq, 1.0, 0.25f);
      AdamParams a{1e-3f, 0.9f, 0.999f, 1e-8f, 1, 1.0f, &sc->factor};
      G.be->adamw_update(p, gg, m, v, slices, a);
    };
    if (k == 0) {
      tail();
      tail();
    } else {
      tail();  // first run eager (lazy setup), as the trainer does
      G.be->capture_begin();
      tail();
      const int id = G.be->capture_end();
      // the capture ran nothing: p holds one update; replaying once gives the second
      G.be->launch_graph(id);
    }
    res[k] = G.get_f32(p, n);
  }
  EXPECT_EQ(res[1], res[0]);
  G.be->drop_graphs();
}

TEST_P(GpuBackend, MemoryAccounting) {
  const size_t before = gpu->be->peak_memory_bytes();
  void* p = gpu->be->alloc(size_t(64) << 20);
  EXPECT_GE(gpu->be->peak_memory_bytes(), before + (size_t(64) << 20));
  gpu->be->zero(p, size_t(64) << 20);
  gpu->be->release(p);
  EXPECT_EQ(gpu->be->name(), "cuda");
  EXPECT_EQ(gpu->be->act_size(), dtype_size(dt));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuBackend,
                         ::testing::Values(DType::F32, DType::BF16, DType::F16),
                         [](const ::testing::TestParamInfo<DType>& i) {
                           return std::string(dtype_name(i.param));
                         });


// ---- workspace planning: after plan_workspace, the ops that use the backend's internal
// workspace (reduction scratch, GEMM temporaries, multi-tensor slice tables, overlapping
// copies) allocate nothing at the planned maxima. The plan comes from workspace_plan_for, as
// in the trainer, for a ViT-Base shaped model (2 blocks), with and without ZeRO-1 lists.

// The parameter tensors of the model (timm order) in one flat buffer, as the optimizer sees
// them: weight decay `wd` on the matrices, 0 on biases, norms, cls token and pos embedding.
std::vector<ParamSlice> vit_param_slices(const ViTConfig& c, float wd) {
  const size_t C = c.hidden, M = c.mlp, K = c.classes, T = c.tokens();
  std::vector<ParamSlice> v;
  size_t at = 0;
  auto add = [&](size_t n, bool decay) {
    v.push_back({at, n, decay ? wd : 0.0f});
    at += n;
  };
  add(C * c.patch_dim(), true);
  add(C, false);
  add(C, false);      // cls token
  add(T * C, false);  // pos embedding
  for (int l = 0; l < c.depth; ++l) {
    add(C, false), add(C, false);
    add(3 * C * C, true), add(3 * C, false);
    add(C * C, true), add(C, false);
    add(C, false), add(C, false);
    add(M * C, true), add(M, false);
    add(C * M, true), add(C, false);
  }
  add(C, false), add(C, false);
  add(K * C, true), add(K, false);
  return v;
}

class GpuWorkspace : public ::testing::TestWithParam<std::tuple<DType, bool>> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(GpuWorkspace, PlannedOpsAllocateNothing) {
  const DType dt = std::get<0>(GetParam());
  const bool zero = std::get<1>(GetParam());
  Dev d(make_cuda_backend(0, dt));
  Backend& be = *d.be;
  ViTConfig cfg;
  cfg.image = 224, cfg.patch = 16, cfg.hidden = 768, cfg.depth = 2, cfg.heads = 12;
  cfg.mlp = 3072, cfg.classes = 1000;
  const int micro = 16;
  const std::vector<ParamSlice> decayed = vit_param_slices(cfg, 0.05f);
  const std::vector<ParamSlice> plain = vit_param_slices(cfg, 0.0f);
  size_t n = plain.back().offset + plain.back().n;

  // ZeRO-1 over 2 data ranks, 3 buckets: rank 0 updates the first half of each bucket, one
  // slice list per bucket (offsets from the piece's start) and one of all pieces (flat).
  struct Piece {
    size_t flat = 0, n = 0;
    std::vector<ParamSlice> slices;
  };
  std::vector<Piece> pieces;
  std::vector<ParamSlice> zslices;
  const size_t kBuckets = 3;
  if (zero) {
    const size_t bs = (n + kBuckets * 32 - 1) / (kBuckets * 32) * 32;
    n = kBuckets * bs;  // padded like the model's flat buffers
    for (size_t k = 0; k < kBuckets; ++k) {
      Piece pc;
      pc.flat = k * bs;
      pc.n = bs / 2;
      for (const ParamSlice& s : decayed) {
        const size_t lo = std::max(s.offset, pc.flat), hi = std::min(s.offset + s.n, pc.flat + pc.n);
        if (lo >= hi) continue;
        pc.slices.push_back({lo - pc.flat, hi - lo, s.weight_decay});
        zslices.push_back({lo, hi - lo, 0.0f});
      }
      pieces.push_back(std::move(pc));
    }
  }

  WorkspaceShape ws;
  ws.micro_batch = micro;
  ws.act_size = be.act_size();
  ws.optimizer = true;
  ws.param_tensors = plain.size();
  ws.local_params = n;
  ws.grad_buckets = zero ? kBuckets : 0;
  const Backend::WorkspacePlan plan = workspace_plan_for(cfg, ws);
  ASSERT_EQ(plan.max_rows, int64_t(micro) * cfg.tokens());
  ASSERT_EQ(plan.max_cols, 3072);
  be.plan_workspace(plan);

  // inputs, all allocated (and filled) before the count is taken
  const int R = static_cast<int>(plan.max_rows), Cw = static_cast<int>(plan.max_cols);
  const int C = cfg.hidden, K = cfg.classes, Mh = cfg.mlp;
  const size_t as = be.act_size(), big = size_t(R) * Cw;
  void* dy = d.raw(big * as);
  void* x = d.raw(big * as);
  void* dx = d.raw(big * as);
  void* W = d.raw(size_t(plan.max_weight_elems) * as);
  void* gamma = d.raw(size_t(Cw) * as);
  float* dW = static_cast<float*>(d.raw(size_t(plan.max_weight_elems) * 4));
  float* db = static_cast<float*>(d.raw(size_t(Cw) * 4));
  float* dgamma = static_cast<float*>(d.raw(size_t(Cw) * 4));
  float* dbeta = static_cast<float*>(d.raw(size_t(Cw) * 4));
  float* mean = static_cast<float*>(d.raw(size_t(R) * 4));
  float* rstd = static_cast<float*>(d.raw(size_t(R) * 4));
  float* sums = static_cast<float*>(d.raw(size_t(R) * 2 * 4));
  for (void* p : {dy, x, dx}) be.zero(p, big * as);
  be.zero(W, size_t(plan.max_weight_elems) * as);
  be.zero(gamma, size_t(Cw) * as);
  be.zero(mean, size_t(R) * 4);
  be.zero(rstd, size_t(R) * 4);
  const size_t cb = plan.max_copy_bytes, shift = 4104;  // 8-byte aligned, not 256
  std::vector<uint8_t> pattern(cb + shift);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
  uint8_t* cbuf = static_cast<uint8_t*>(d.raw(pattern.size()));
  be.copy_to_device(cbuf, pattern.data(), pattern.size());
  Vec gh(n);
  for (size_t i = 0; i < n; ++i) gh[i] = 0.01f * float(int(i % 13) - 6);
  float* p = d.f32(Vec(n, 0.5f));
  float* g = d.f32(gh);
  float* m = d.f32(Vec(n, 0.0f));
  float* v = d.f32(Vec(n, 0.0f));
  float* u = d.f32(Vec(n, 0.0f));
  be.synchronize();
  const int64_t before = be.device_allocations();

  // GEMM-based layers at the planned rows: bias gradients (column sums) of the widest output
  // and the head's, the patch embedding's; dW accumulated in fp32 (or through the act-dtype
  // temporary where cuBLASLt offers no fp32 output)
  be.linear_backward(dx, dW, db, dy, x, W, R, C, Cw);
  be.linear_backward(nullptr, dW, db, dy, x, W, R, C, K);
  be.linear_backward(nullptr, dW, db, dy, x, W, R, Mh, C);
  be.linear_backward(nullptr, dW, db, dy, x, W, R, cfg.patch_dim(), C);
  // LayerNorm backward: the hidden width (fused path in 16-bit) and the widest (general path)
  be.layernorm_backward(dx, dgamma, dbeta, dy, x, gamma, mean, rstd, R, C);
  be.layernorm_backward(dx, dgamma, dbeta, dy, x, gamma, mean, rstd, R, Cw);
  be.layernorm_split_backward_sums(sums, dgamma, dbeta, dy, x, gamma, mean, rstd, R, C);
  be.layernorm_split_backward_sums(sums, dgamma, dbeta, dy, x, gamma, mean, rstd, R, Cw);
  // overlapping copies of the planned size, both directions
  be.copy(cbuf + shift, cbuf, cb);
  be.copy(cbuf, cbuf + shift, cb);
  be.copy(cbuf + 1, cbuf, cb);
  // the optimizer's multi-tensor ops over every list it uses
  const AdamParams ap{1e-3f, 0.9f, 0.999f, 1e-8f, 1, 1.0f};
  std::vector<double> sq;
  if (!zero) {
    sq.resize(plain.size());
    be.sum_squares(sq.data(), g, plain);
    be.adamw_update(p, g, m, v, decayed, ap);
    be.lamb_direction(u, p, g, m, v, decayed, ap);
    std::vector<double> wn(plain.size()), un(plain.size());
    be.sum_squares(wn.data(), p, plain);
    be.sum_squares(un.data(), u, plain);
    be.lamb_apply(p, u, plain, std::vector<float>(plain.size(), 1.0f), 1e-3f);
    be.sgd_update(p, g, m, decayed, 0.1f, 0.9f, true, 1.0f);
  } else {
    sq.resize(zslices.size());
    be.sum_squares(sq.data(), g, zslices);
    for (const Piece& pc : pieces) {
      be.adamw_update(p + pc.flat, g + pc.flat, m + pc.flat / 2, v + pc.flat / 2, pc.slices, ap);
      be.lamb_direction(u + pc.flat, p + pc.flat, g + pc.flat, m + pc.flat / 2,
                        v + pc.flat / 2, pc.slices, ap);
      be.lamb_apply(p + pc.flat, u + pc.flat, pc.slices,
                    std::vector<float>(pc.slices.size(), 1.0f), 1e-3f);
      be.sgd_update(p + pc.flat, g + pc.flat, m + pc.flat / 2, pc.slices, 0.1f, 0.9f, false,
                    1.0f);
    }
  }
  EXPECT_TRUE(be.all_finite(g, n));
  be.synchronize();
  EXPECT_EQ(be.device_allocations(), before)
      << "device allocations in planned ops (" << dtype_name(dt) << (zero ? ", ZeRO" : "")
      << ")";

  // and the ops still compute what they should: the memmove, the per-slice sums of squares
  std::vector<uint8_t> want = pattern, got(pattern.size());
  std::memmove(want.data() + shift, want.data(), cb);
  std::memmove(want.data(), want.data() + shift, cb);
  std::memmove(want.data() + 1, want.data(), cb);
  be.copy_to_host(got.data(), cbuf, got.size());
  EXPECT_TRUE(got == want) << "overlapping copy differs from memmove";
  const std::vector<ParamSlice>& sl = zero ? zslices : plain;
  for (size_t i = 0; i < sl.size(); ++i) {
    double ref = 0.0;
    for (size_t j = 0; j < sl[i].n; ++j) ref += double(gh[sl[i].offset + j]) * gh[sl[i].offset + j];
    EXPECT_NEAR(sq[i], ref, 1e-9 * ref + 1e-12) << "slice " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(DtypesZero, GpuWorkspace,
                         ::testing::Combine(::testing::Values(DType::F32, DType::BF16, DType::F16),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<DType, bool>>& i) {
                           return std::string(dtype_name(std::get<0>(i.param))) +
                                  (std::get<1>(i.param) ? "_zero" : "");
                         });

// Without a plan the same ops do allocate (the counter sees internal allocations); a plan
// made afterwards covers them.
TEST(GpuWorkspaceCounter, UnplannedOpsAllocate) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Dev d(make_cuda_backend(0, DType::BF16));
  Backend& be = *d.be;
  const int N = 4096, C = 1536;
  const int64_t c0 = be.device_allocations();
  void* dy = d.raw(size_t(N) * C * 2);
  EXPECT_EQ(be.device_allocations(), c0 + 1);  // alloc() counts
  void* x = d.raw(size_t(N) * C * 2);
  void* dx = d.raw(size_t(N) * C * 2);
  void* gamma = d.raw(size_t(C) * 2);
  float* dg = static_cast<float*>(d.raw(size_t(C) * 4));
  float* dbt = static_cast<float*>(d.raw(size_t(C) * 4));
  float* mean = static_cast<float*>(d.raw(size_t(N) * 4));
  float* rstd = static_cast<float*>(d.raw(size_t(N) * 4));
  for (void* q : {dy, x, dx}) be.zero(q, size_t(N) * C * 2);
  be.zero(gamma, size_t(C) * 2);
  be.zero(mean, size_t(N) * 4);
  be.zero(rstd, size_t(N) * 4);
  const int64_t c1 = be.device_allocations();
  be.layernorm_backward(dx, dg, dbt, dy, x, gamma, mean, rstd, N, C);
  be.synchronize();
  EXPECT_GT(be.device_allocations(), c1) << "unplanned scratch did not allocate?";
  Backend::WorkspacePlan plan;
  plan.max_rows = 2 * N;
  plan.max_cols = 2 * C;
  be.plan_workspace(plan);
  const int64_t c2 = be.device_allocations();
  be.layernorm_backward(dx, dg, dbt, dy, x, gamma, mean, rstd, N, C);
  be.synchronize();
  EXPECT_EQ(be.device_allocations(), c2);
}

}  // namespace
}  // namespace vitgrid
