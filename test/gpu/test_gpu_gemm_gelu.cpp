// The fused GEMM + exact-GELU kernels (src/backend/cuda/gemm_gelu.h, CUTLASS sm_90a) against
// the backend's unfused path, in bf16 and fp16:
//  * forward: h against the backend's linear_forward (cuBLASLt, bias epilogue), rel L2 < tol;
//    g bit-identical to the backend's gelu_forward applied to the fused h.
//  * backward: dx against the fp32 product dy W (CPU backend, OpenBLAS) times GELU'(h) in
//    double on the host, rel L2 < tol.
// Tolerances as test_gpu_backend.cpp: bf16 1e-2, fp16 2e-3 (a few act-dtype roundings).
// Skips without a GPU, and where the kernels are unavailable (no CUTLASS at build time, or a
// device other than sm_90). Every output is poisoned with NaN first.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "gemm_gelu.h"
#include "gpu_test_util.h"
#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/cuda/cuda_backend.h"

namespace vitgrid {

namespace {

using namespace gputest;  // NOLINT: test file, the harness is its vocabulary

using Shape = std::tuple<int, int, int>;  // N, in, out
// fc1 of ViT-B at 3 images (591 rows), a ragged N at ViT-S and toy widths, K and N residues of
// the 128x128x64 tile (in 72, out 136), a few rows only.
const Shape kShapes[] = {
    {197 * 3, 768, 3072}, {1001, 384, 1536}, {1001, 64, 256}, {333, 72, 136}, {5, 64, 256}};

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
  std::vector<uint16_t> bits(const void* p, size_t n) {
    std::vector<uint16_t> h(n);
    gpu->be->copy_to_host(h.data(), p, n * 2);
    return h;
  }
  void* workspace(int N, int in, int out, size_t* bytes) {
    *bytes = cuda::gemm_gelu_workspace_bytes(dt, N, in, out);
    return *bytes ? gpu->raw(*bytes) : nullptr;
  }
  void sync() { ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess); }
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

TEST_P(GpuGemmGelu, Forward) {
  for (const auto& [N, in, out] : kShapes) {
    for (bool has_b : {true, false}) {
      SCOPED_TRACE("N=" + std::to_string(N) + " in=" + std::to_string(in) +
                   " out=" + std::to_string(out) + (has_b ? " bias" : " no bias"));
      ASSERT_TRUE(cuda::gemm_gelu_supported(dt, N, in, out));
      // |z| ~ 1.5: most of GELU's curve, tails included
      Vec x = rnd(size_t(N) * in), W = rnd(size_t(out) * in, 1.5f / std::sqrt(float(in)));
      Vec b = rnd(out, 0.5f);
      const size_t no = size_t(N) * out;
      void *xd = gpu->act(x), *Wd = gpu->act(W), *bd = has_b ? gpu->act(b) : nullptr;
      void* h_ref = gpu->nan_act(no);
      gpu->be->linear_forward(h_ref, xd, Wd, bd, N, in, out);
      void* h = gpu->nan_act(no);
      void* g = gpu->nan_act(no);
      size_t wsb = 0;
      void* ws = workspace(N, in, out, &wsb);
      gpu->be->synchronize();
      cuda::gemm_bias_gelu_forward(dt, stream, h, g, xd, Wd, bd, N, in, out, ws, wsb);
      sync();
      EXPECT_CLOSE(gpu->get_act(h, no), gpu->get_act(h_ref, no), tol());
      // g == the elementwise exact GELU of the fused h, bit for bit
      void* g_ref = gpu->nan_act(no);
      gpu->be->gelu_forward(g_ref, h, no, Gelu::Exact);
      const std::vector<uint16_t> a = bits(g, no), r = bits(g_ref, no);
      size_t diff = 0, first = no;
      for (size_t i = 0; i < no; ++i)
        if (a[i] != r[i]) {
          if (first == no) first = i;
          ++diff;
        }
      EXPECT_EQ(diff, 0u) << "g differs from gelu_forward(h) in " << diff << " of " << no
                          << " elements, first at " << first;
    }
  }
}

TEST_P(GpuGemmGelu, Backward) {
  for (const auto& [N, in, out] : kShapes) {
    SCOPED_TRACE("N=" + std::to_string(N) + " in=" + std::to_string(in) +
                 " out=" + std::to_string(out));
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
    void *dyd = gpu->act(dy), *Wd = gpu->act(W), *hd = gpu->act(h);
    size_t wsb = 0;
    void* ws = workspace(N, in, out, &wsb);
    gpu->be->synchronize();
    cuda::gemm_dgelu_backward(dt, stream, dx, dyd, Wd, hd, N, in, out, ws, wsb);
    sync();
    EXPECT_CLOSE(gpu->get_act(dx, ni), ref, tol());
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuGemmGelu, ::testing::Values(DType::BF16, DType::F16),
                         [](const ::testing::TestParamInfo<DType>& i) {
                           return std::string(dtype_name(i.param));
                         });

}  // namespace
}  // namespace vitgrid
