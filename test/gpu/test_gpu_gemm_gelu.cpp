// The fused GEMM + exact-GELU kernels (src/backend/cuda/gemm_gelu.h, CUTLASS sm_90a) against
// the backend's unfused path, in bf16 and fp16, for every compiled configuration:
//  * forward: h against the backend's linear_forward (cuBLASLt, bias epilogue), rel L2 < tol;
//    g bit-identical to the backend's gelu_forward applied to the fused h.
//  * backward: dx against the fp32 product dy W (CPU backend, OpenBLAS) times GELU'(h) in
//    double on the host, rel L2 < tol.
// Every kernel with the default tile scheduling on every shape (ragged N, K and N residues of
// the tiles, a few rows, and shapes of several tiles per SM, so the persistent loop and the
// ping-pong hand-over run), every scheduler setting (raster order, swizzle) of every kernel on
// two shapes. Then the backend's choice (cuda_gemm.cpp): device.fused_gelu auto with
// device.gemm_tune timing the candidates, forced on / off / a forced configuration, the
// outputs of linear_forward / linear_backward against the unfused backend (dW and db
// accumulated exactly once).
// Tolerances as test_gpu_backend.cpp: bf16 1e-2, fp16 2e-3 (a few act-dtype roundings).
// Skips without a GPU, and where the kernels are unavailable (no CUTLASS at build time, or a
// device other than sm_90). Every output is poisoned with NaN first.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_backend_impl.h"
#include "gemm_gelu.h"
#include "gpu_test_util.h"
#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/cuda/cuda_backend.h"

namespace vitgrid {

namespace {

using namespace gputest;  // NOLINT: test file, the harness is its vocabulary

using Shape = std::tuple<int, int, int>;  // N, in, out
// fc1 of ViT-B at 3 images (591 rows), a ragged N at ViT-S and toy widths, K and N residues of
// the 128x128x64 tile (in 72, out 136), a few rows only; then ragged shapes of 264-528 output
// tiles in each direction (several per SM: the persistent scheduler's loop, the ping-pong
// warp groups' alternation) with N and in / out not multiples of the 256-wide tiles.
const Shape kShapes[] = {{197 * 3, 768, 3072}, {1001, 384, 1536}, {1001, 64, 256},  {333, 72, 136},
                         {5, 64, 256},         {4099, 256, 2056}, {4099, 2056, 256}};
// Where every scheduler setting runs: a small ragged one and one of many tiles.
const Shape kScheduleShapes[] = {{333, 72, 136}, {4099, 2056, 256}};

std::string shape_name(int N, int in, int out) {
  return "N=" + std::to_string(N) + " in=" + std::to_string(in) + " out=" + std::to_string(out);
}

class GpuGemmGelu : public GpuVsCpu {
 protected:
  GpuGemmGelu() : GpuVsCpu(4242) {}
  void SetUp() override {
    GpuVsCpu::SetUp();
    if (IsSkipped()) return;
    if (!cuda::gemm_gelu_available())
      GTEST_SKIP() << "fused GELU GEMMs unavailable (built without CUTLASS, or not sm_90)";
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream) cudaStreamDestroy(stream);
  }
  // Raw act-dtype bits of a device buffer.
  std::vector<uint16_t> bits(Dev& d, const void* p, size_t n) {
    std::vector<uint16_t> h(n);
    d.be->copy_to_host(h.data(), p, n * 2);
    return h;
  }
  void* workspace(int N, int in, int out, size_t* bytes) {
    *bytes = cuda::gemm_gelu_workspace_bytes(dt, N, in, out);
    return *bytes ? gpu->raw(*bytes) : nullptr;
  }
  void sync() { ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess); }
  // Number of elements where g differs from gelu_forward(h) of backend `d`, bit for bit.
  size_t gelu_mismatches(Dev& d, const void* g, const void* h, size_t n, size_t* first) {
    void* g_ref = d.nan_act(n);
    d.be->gelu_forward(g_ref, h, n, Gelu::Exact);
    const std::vector<uint16_t> a = bits(d, g, n), r = bits(d, g_ref, n);
    size_t diff = 0;
    *first = n;
    for (size_t i = 0; i < n; ++i)
      if (a[i] != r[i]) {
        if (*first == n) *first = i;
        ++diff;
      }
    return diff;
  }

  // The forward of configurations `configs` on one shape (bias or not): h against cuBLASLt,
  // g against the elementwise GELU of h.
  void check_forward(const Shape& shape, bool has_b, const std::vector<int>& configs) {
    const auto [N, in, out] = shape;
    ASSERT_TRUE(cuda::gemm_gelu_supported(dt, N, in, out));
    // |z| ~ 1.5: most of GELU's curve, tails included
    Vec x = rnd(size_t(N) * in), W = rnd(size_t(out) * in, 1.5f / std::sqrt(float(in)));
    Vec b = rnd(out, 0.5f);
    const size_t no = size_t(N) * out;
    void *xd = gpu->act(x), *Wd = gpu->act(W), *bd = has_b ? gpu->act(b) : nullptr;
    void* h_ref = gpu->nan_act(no);
    gpu->be->linear_forward(h_ref, xd, Wd, bd, N, in, out);
    const Vec href = gpu->get_act(h_ref, no);
    void* h = gpu->nan_act(no);
    void* g = gpu->nan_act(no);
    void* nan = gpu->nan_act(no);
    size_t wsb = 0;
    void* ws = workspace(N, in, out, &wsb);
    for (int c : configs) {
      SCOPED_TRACE(shape_name(N, in, out) + (has_b ? " bias" : " no bias") + ", config " +
                   std::to_string(c) + " (" + cuda::gemm_gelu_config_name(dt, true, c) + ")");
      gpu->be->copy(h, nan, no * 2);
      gpu->be->copy(g, nan, no * 2);
      gpu->be->synchronize();
      cuda::gemm_bias_gelu_forward(dt, stream, h, g, xd, Wd, bd, N, in, out, ws, wsb, c);
      sync();
      EXPECT_CLOSE(gpu->get_act(h, no), href, tol());
      size_t first = 0;
      const size_t diff = gelu_mismatches(*gpu, g, h, no, &first);
      EXPECT_EQ(diff, 0u) << "g differs from gelu_forward(h) in " << diff << " of " << no
                          << " elements, first at " << first;
    }
  }

  // The backward of configurations `configs` on one shape: dx = (dy W) * gelu'(h) against
  // the fp32 CPU product and the derivative in double.
  void check_backward(const Shape& shape, const std::vector<int>& configs) {
    const auto [N, in, out] = shape;
    ASSERT_TRUE(cuda::gemm_gelu_supported(dt, N, in, out));
    // dx = (dy W) * gelu'(h): dy [N, out], W [out, in], h [N, in]
    Vec dy = rnd(size_t(N) * out), W = rnd(size_t(out) * in, 1.0f / std::sqrt(float(out)));
    Vec h = rnd(size_t(N) * in, 1.5f);
    const size_t ni = size_t(N) * in;
    // reference: fp32 dg = dy W on the CPU backend (linear_forward with W^T [in, out])
    Vec Wt(W.size());
    for (int o = 0; o < out; ++o)
      for (int i = 0; i < in; ++i) Wt[size_t(i) * out + o] = W[size_t(o) * in + i];
    void* dg_c = cpu->nan_act(ni);
    cpu->be->linear_forward(dg_c, cpu->act(dy), cpu->act(Wt), nullptr, N, out, in);
    const Vec dg = cpu->get_act(dg_c, ni);
    Vec ref(ni);
    for (size_t i = 0; i < ni; ++i) {
      const double v = h[i];
      const double d = 0.5 * (1.0 + std::erf(v * 0.70710678118654752)) +
                       v * 0.39894228040143268 * std::exp(-0.5 * v * v);
      ref[i] = float(double(dg[i]) * d);
    }
    void* dx = gpu->nan_act(ni);
    void* nan = gpu->nan_act(ni);
    void *dyd = gpu->act(dy), *Wd = gpu->act(W), *hd = gpu->act(h);
    size_t wsb = 0;
    void* ws = workspace(N, in, out, &wsb);
    for (int c : configs) {
      SCOPED_TRACE(shape_name(N, in, out) + ", config " + std::to_string(c) + " (" +
                   cuda::gemm_gelu_config_name(dt, false, c) + ")");
      gpu->be->copy(dx, nan, ni * 2);
      gpu->be->synchronize();
      cuda::gemm_dgelu_backward(dt, stream, dx, dyd, Wd, hd, N, in, out, ws, wsb, c);
      sync();
      EXPECT_CLOSE(gpu->get_act(dx, ni), ref, tol());
    }
  }

  // Ids of every kernel with the default scheduling, or of every configuration.
  std::vector<int> kernels(bool forward) const {
    std::vector<int> v;
    for (int k = 0; k < cuda::gemm_gelu_kernel_count(dt, forward); ++k)
      v.push_back(cuda::gemm_gelu_config_id(dt, forward, k, 0));
    return v;
  }
  std::vector<int> all_configs(bool forward) const {
    std::vector<int> v;
    for (int c = 0; c < cuda::gemm_gelu_config_count(dt, forward); ++c) v.push_back(c);
    return v;
  }

  cudaStream_t stream = nullptr;
};

TEST_P(GpuGemmGelu, Supported) {
  EXPECT_TRUE(cuda::gemm_gelu_supported(dt, 50432, 768, 3072));
  EXPECT_TRUE(cuda::gemm_gelu_supported(dt, 1, 8, 8));
  EXPECT_FALSE(cuda::gemm_gelu_supported(dt, 100, 770, 3072));
  EXPECT_FALSE(cuda::gemm_gelu_supported(dt, 100, 768, 3076));
  EXPECT_FALSE(cuda::gemm_gelu_supported(dt, 0, 768, 3072));
  EXPECT_FALSE(cuda::gemm_gelu_supported(DType::F32, 100, 768, 3072));
}

TEST_P(GpuGemmGelu, Configs) {
  EXPECT_EQ(cuda::gemm_gelu_kernel_count(DType::F32, true), 0);
  EXPECT_EQ(cuda::gemm_gelu_config_count(DType::F32, false), 0);
  for (bool fwd : {true, false}) {
    SCOPED_TRACE(fwd ? "forward" : "backward");
    const int nk = cuda::gemm_gelu_kernel_count(dt, fwd);
    ASSERT_GE(nk, 1);
    if (dt == DType::BF16) {
      EXPECT_GE(nk, 4);  // the tuning space: several tile shapes
    }
    const int n = cuda::gemm_gelu_config_count(dt, fwd);
    EXPECT_EQ(n, nk * cuda::kGemmGeluSchedules);
    std::set<std::string> names;
    for (int c = 0; c < n; ++c) {
      const std::string name = cuda::gemm_gelu_config_name(dt, fwd, c);
      EXPECT_FALSE(name.empty()) << c;
      names.insert(name);
      const int k = cuda::gemm_gelu_config_kernel(dt, fwd, c);
      const int s = cuda::gemm_gelu_config_schedule(dt, fwd, c);
      EXPECT_TRUE(k >= 0 && k < nk && s >= 0 && s < cuda::kGemmGeluSchedules) << c;
      EXPECT_EQ(cuda::gemm_gelu_config_id(dt, fwd, k, s), c);
    }
    EXPECT_EQ(names.size(), size_t(n)) << "configuration names are not distinct";
    EXPECT_EQ(cuda::gemm_gelu_config_name(dt, fwd, n), "");
    EXPECT_EQ(cuda::gemm_gelu_config_name(dt, fwd, -1), "");
  }
}

TEST_P(GpuGemmGelu, Forward) {
  for (const Shape& s : kShapes)
    for (bool has_b : {true, false}) check_forward(s, has_b, kernels(true));
}

TEST_P(GpuGemmGelu, ForwardSchedules) {
  for (const Shape& s : kScheduleShapes) check_forward(s, true, all_configs(true));
}

TEST_P(GpuGemmGelu, Backward) {
  for (const Shape& s : kShapes) check_backward(s, kernels(false));
}

TEST_P(GpuGemmGelu, BackwardSchedules) {
  for (const Shape& s : kScheduleShapes) check_backward(s, all_configs(false));
}

// The backend's choice, through linear_forward / linear_backward: a backend made with opts_
// and the given gemm_tune, against the unfused path spelled out on the fixture's
// backend (linear ops without GELU arguments, which never fuse, and the GELU kernels).
class GpuGemmGeluBackend : public GpuGemmGelu {
 protected:
  // The fused-GELU options of the backends run_mlp makes (BackendOptions::fused_gelu and the
  // forced configurations; gemm_tune is run_mlp's).
  BackendOptions opts_;
  // Runs fc1's forward and fc2's backward of an MLP shape on a backend made with `gemm_tune`
  // and opts_, checks them against the unfused reference on `gpu`, and
  // returns the backend's (forward, backward) choices.
  // `agree`: the backend's tune agreement (Backend::set_tune_agreement), if any.
  std::pair<int, int> run_mlp(int gemm_tune, int N = 197 * 3, int C = 384,
                              Backend::ReplicaMax agree = {}) {
    BackendOptions o = opts_;
    o.gemm_tune = gemm_tune;
    auto d = std::make_unique<Dev>(make_cuda_backend(0, dt, o));
    auto* be = dynamic_cast<CudaBackend*>(d->be.get());
    EXPECT_NE(be, nullptr);
    if (!be) return {-2, -2};
    be->set_tune_agreement(std::move(agree));
    const int H = 4 * C;
    // forward: y = x W1^T + b1, g = gelu(y)
    Vec x = rnd(size_t(N) * C), W1 = rnd(size_t(H) * C, 1.5f / std::sqrt(float(C)));
    Vec b1 = rnd(H, 0.5f);
    const size_t nh = size_t(N) * H, nc = size_t(N) * C;
    void* y_ref = gpu->nan_act(nh);
    gpu->be->linear_forward(y_ref, gpu->act(x), gpu->act(W1), gpu->act(b1), N, C, H);
    void *xd = d->act(x), *W1d = d->act(W1), *b1d = d->act(b1);
    void* y = d->nan_act(nh);
    void* g = d->nan_act(nh);
    d->be->linear_forward(y, xd, W1d, b1d, N, C, H, g, Gelu::Exact);
    EXPECT_CLOSE(d->get_act(y, nh), gpu->get_act(y_ref, nh), tol());
    size_t first = 0;
    EXPECT_EQ(gelu_mismatches(*d, g, y, nh, &first), 0u) << "first at " << first;
    // backward of fc2 (in = H, out = C): dx = (dy W2) * gelu'(y), dW2 += dy^T g, db2 += sum dy
    Vec dy = rnd(nc), W2 = rnd(size_t(C) * H, 1.0f / std::sqrt(float(H)));
    Vec dW0 = rnd(size_t(C) * H), db0 = rnd(C);  // the accumulators' previous contents
    Vec yv = d->get_act(y, nh);
    void* dg_ref = gpu->nan_act(nh);
    void* dx_ref = gpu->nan_act(nh);
    float* dW_ref = gpu->f32(dW0);
    float* db_ref = gpu->f32(db0);
    void* y_g = gpu->act(yv);
    void* g_g = gpu->nan_act(nh);
    gpu->be->gelu_forward(g_g, y_g, nh, Gelu::Exact);
    gpu->be->linear_backward(dg_ref, dW_ref, db_ref, gpu->act(dy), g_g, gpu->act(W2), N, H, C);
    gpu->be->gelu_backward(dx_ref, y_g, dg_ref, nh, Gelu::Exact);
    void* dx = d->nan_act(nh);
    float* dW = d->f32(dW0);
    float* db = d->f32(db0);
    d->be->linear_backward(dx, dW, db, d->act(dy), g, d->act(W2), N, H, C, y, Gelu::Exact);
    EXPECT_CLOSE(d->get_act(dx, nh), gpu->get_act(dx_ref, nh), tol());
    // accumulated once: a second accumulation would double the gradient
    EXPECT_CLOSE(d->get_f32(dW, dW0.size()), gpu->get_f32(dW_ref, dW0.size()), 1e-4);
    EXPECT_CLOSE(d->get_f32(db, db0.size()), gpu->get_f32(db_ref, db0.size()), 1e-4);
    // a second call takes the cached choice
    d->be->linear_forward(y, xd, W1d, b1d, N, C, H, g, Gelu::Exact);
    EXPECT_CLOSE(d->get_act(y, nh), gpu->get_act(y_ref, nh), tol());
    const std::pair<int, int> r{be->fused_gelu_choice(true, N, C, H),
                                be->fused_gelu_choice(false, N, H, C)};
    std::printf("%s", be->fused_gelu_report().c_str());
    return r;
  }
};

TEST_P(GpuGemmGeluBackend, AutoUntimedIsUnfused) {
  const auto [fw, bw] = run_mlp(0);
  EXPECT_EQ(fw, -1);
  EXPECT_EQ(bw, -1);
}

TEST_P(GpuGemmGeluBackend, AutoTimed) {
  const auto [fw, bw] = run_mlp(4);
  EXPECT_TRUE(fw >= -1 && fw < cuda::gemm_gelu_config_count(dt, true)) << fw;
  EXPECT_TRUE(bw >= -1 && bw < cuda::gemm_gelu_config_count(dt, false)) << bw;
}

TEST_P(GpuGemmGeluBackend, OnUntimedIsDefault) {
  opts_.fused_gelu = FusedGeluMode::On;
  const auto [fw, bw] = run_mlp(0);
  EXPECT_EQ(fw, 0);
  EXPECT_EQ(bw, 0);
}

TEST_P(GpuGemmGeluBackend, OnTimedIsFused) {
  opts_.fused_gelu = FusedGeluMode::On;
  const auto [fw, bw] = run_mlp(8);
  EXPECT_GE(fw, 0);
  EXPECT_GE(bw, 0);
}

TEST_P(GpuGemmGeluBackend, Off) {
  opts_.fused_gelu = FusedGeluMode::Off;  // the forced configurations ignored
  opts_.fused_gelu_forward_config = opts_.fused_gelu_backward_config = 0;
  const auto [fw, bw] = run_mlp(8);
  EXPECT_LT(fw, 0);
  EXPECT_LT(bw, 0);
}

TEST_P(GpuGemmGeluBackend, ForcedConfig) {
  // the last configuration of each direction: the last kernel with the last scheduler setting
  const int f = cuda::gemm_gelu_config_count(dt, true) - 1;
  const int b = cuda::gemm_gelu_config_count(dt, false) - 1;
  opts_.fused_gelu_forward_config = f;
  opts_.fused_gelu_backward_config = b;
  const auto [fw, bw] = run_mlp(0);
  EXPECT_EQ(fw, f);
  EXPECT_EQ(bw, b);
}

// A stand-in for the replicas' maximum: their headers (key hash, -hash, count, -count) pass
// unchanged, as from replicas that agree; every timing becomes smaller than all before it,
// as if the other replicas found each later candidate faster. The choice must follow these
// timings: the last candidate timed, i.e. the last scheduler setting of the last kernel.
Backend::ReplicaMax later_is_faster(int* headers, int* rounds) {
  auto next = std::make_shared<double>(1e6);
  return [next, headers, rounds](double* v, int n) {
    if (n == 4 && v[0] >= 0 && v[1] == -v[0] && v[3] == -v[2]) {
      ++*headers;
      return;
    }
    ++*rounds;
    for (int i = 0; i < n; ++i) v[i] = (*next)--;
  };
}

TEST_P(GpuGemmGeluBackend, AgreedTimingsDecide) {
  int headers = 0, rounds = 0;
  const auto [fw, bw] = run_mlp(8, 197 * 3, 384, later_is_faster(&headers, &rounds));
  EXPECT_EQ(fw, cuda::gemm_gelu_config_count(dt, true) - 1);
  EXPECT_EQ(bw, cuda::gemm_gelu_config_count(dt, false) - 1);
  // each timed choice (two fused GELU rounds per direction, and the cuBLASLt GEMMs) sent
  // its header before its timings
  EXPECT_GE(rounds, 4);
  EXPECT_EQ(headers, rounds);
}

TEST_P(GpuGemmGeluBackend, ReplicasTimingDifferentChoicesFail) {
  // a replica timing another GEMM (a different hash in the maximum) or another candidate
  // count: the choice cannot be agreed, and the job ends with a message instead of mixing
  // timings (in a fresh process: the "threadsafe" death tests re-run the binary)
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto tune_disagreeing = [this](int field) {
    BackendOptions o;
    o.gemm_tune = 8;
    Dev d(make_cuda_backend(0, dt, o));
    d.be->set_tune_agreement([field](double* v, int n) {
      if (n == 4) v[field] += 1.0;  // the maximum over a replica with a larger value
    });
    const int N = 64, C = 128;
    void* y = d.nan_act(size_t(N) * C);
    d.be->linear_forward(y, d.act(rnd(size_t(N) * C)), d.act(rnd(size_t(C) * C)), nullptr, N,
                         C, C);
    d.be->synchronize();
  };
  for (int field : {0, 2}) {
    EXPECT_DEATH(tune_disagreeing(field), "replicas do not time the same choice.*cannot be agreed")
        << "field " << field;
  }
}

// A forced configuration out of range for the dtype is a user error naming the deck key
// (the deck refuses other bad values before a backend is made).
TEST_P(GpuGemmGeluBackend, BadOptions) {
  for (int forward = 0; forward < 2; ++forward) {
    BackendOptions o;
    (forward ? o.fused_gelu_forward_config : o.fused_gelu_backward_config) = 100000;
    try {
      make_cuda_backend(0, dt, o);
      ADD_FAILURE() << "configuration 100000 accepted";
    } catch (const UserError& e) {
      const char* key = forward ? "device.fused_gelu_forward_config"
                                : "device.fused_gelu_backward_config";
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  }
}

auto dtype_param_name = [](const ::testing::TestParamInfo<DType>& i) {
  return std::string(dtype_name(i.param));
};
INSTANTIATE_TEST_SUITE_P(Dtypes, GpuGemmGelu, ::testing::Values(DType::BF16, DType::F16),
                         dtype_param_name);
INSTANTIATE_TEST_SUITE_P(Dtypes, GpuGemmGeluBackend, ::testing::Values(DType::BF16, DType::F16),
                         dtype_param_name);

}  // namespace
}  // namespace vitgrid
