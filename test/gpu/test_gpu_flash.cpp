// vitgrid's own attention kernels (src/backend/cuda/flash_attention.h): the whole-head kernels
// (one CTA per image and head, the head in shared memory: bf16/fp16, head dim 64, T <= 224)
// against the tiled kernels, which run the same tile bodies in the same order: the output,
// the saved log-sum-exp and the backward's dqkv must be the same bits, and every element
// written (the outputs are poisoned with NaN first). Both against the CPU backend's attention
// (fp32) within the tolerances of test_gpu_backend.cpp's attention test, and twice the same.
// Sequence lengths: one token, a partial 16-row tile, ViT-B/32's 50, ViT-B/16's 197, 208 (whole
// tiles) and 224 (the largest the whole-head kernels take); then 225, which both run tiled.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_backend_impl.h"
#include "flash_attention.h"
#include "gpu_test_util.h"
#include "vitgrid/backend/backend.h"

namespace vitgrid {
namespace {

using namespace gputest;  // NOLINT: test file, the harness is its vocabulary

class GpuFlash : public GpuVsCpu {
 protected:
  GpuFlash() : GpuVsCpu(9090) {}
  cudaStream_t stream() const { return dynamic_cast<CudaBackend&>(*gpu->be).stream(); }
  std::vector<uint16_t> bits(const void* p, size_t n) {
    std::vector<uint16_t> h(n);
    gpu->be->copy_to_host(h.data(), p, n * 2);
    return h;
  }
  std::vector<float> floats(const float* p, size_t n) { return gpu->get_f32(p, n); }
};

struct KernelRun {
  std::vector<uint16_t> out, dqkv, dqkv2;
  std::vector<float> lse;
};

TEST_P(GpuFlash, WholeHeadKernelsEqualTiledOnes) {
  if (dt == DType::F32) GTEST_SKIP() << "the fused kernels are bf16/fp16";
  const int hd = 64;
  const double tol_f = 2 * tol(), tol_b = dt == DType::BF16 ? 2.5e-2 : 2 * tol();
  struct Shape {
    int B, T, H;
  };
  for (Shape s : {Shape{3, 1, 2}, Shape{2, 13, 3}, Shape{3, 50, 4}, Shape{2, 197, 3},
                  Shape{1, 208, 2}, Shape{2, 224, 2}, Shape{1, 225, 2}}) {
    const std::string tag =
        "B T H = " + std::to_string(s.B) + " " + std::to_string(s.T) + " " + std::to_string(s.H);
    SCOPED_TRACE(tag);
    EXPECT_EQ(s.T <= 224, cuda::flash_head_applies(dt, hd, s.T));
    const size_t C = size_t(s.H) * hd, nqkv = size_t(s.B) * s.T * 3 * C,
                 nout = size_t(s.B) * s.T * C, nl = size_t(s.B) * s.H * s.T;
    const Vec qkv_h = rnd(nqkv), dout_h = rnd(nout);
    void* qkv = gpu->act(qkv_h);
    void* dout = gpu->act(dout_h);
    float* Dws = gpu->nan_f32(nl);
    // the CPU backend's attention (fp32)
    Vec ref_o, ref_g;
    {
      void* cq = cpu->act(qkv_h);
      void* cd = cpu->act(dout_h);
      void* co = cpu->raw(nout * 4);
      void* cg = cpu->raw(nqkv * 4);
      void* saved = cpu->raw(cpu->be->attention_saved_bytes(s.B, s.T, s.H, hd));
      const size_t wb = cpu->be->attention_workspace_bytes(s.B, s.T, s.H, hd);
      void* ws = wb ? cpu->raw(wb) : nullptr;
      cpu->be->attention_forward(co, saved, cq, s.B, s.T, s.H, hd, ws);
      cpu->be->attention_backward(cg, cd, cq, co, saved, s.B, s.T, s.H, hd, ws);
      ref_o = cpu->get_act(co, nout);
      ref_g = cpu->get_act(cg, nqkv);
    }
    KernelRun run[2];
    for (int k = 0; k < 2; ++k) {
      SCOPED_TRACE(k == 0 ? "tiled" : "whole-head where it applies");
      const auto kernels = k == 0 ? cuda::FlashKernels::Tiled : cuda::FlashKernels::Best;
      void* out = gpu->nan_act(nout);
      float* lse = gpu->nan_f32(nl);
      cuda::flash_attention_forward(stream(), dt, out, lse, qkv, s.B, s.T, s.H, hd, kernels);
      void* dq = gpu->nan_act(nqkv);
      void* dq2 = gpu->nan_act(nqkv);
      cuda::flash_attention_backward(stream(), dt, dq, Dws, dout, qkv, out, lse, s.B, s.T, s.H, hd,
                                     kernels);
      cuda::flash_attention_backward(stream(), dt, dq2, Dws, dout, qkv, out, lse, s.B, s.T, s.H, hd,
                                     kernels);
      ASSERT_EQ(cudaStreamSynchronize(stream()), cudaSuccess);
      run[k].out = bits(out, nout);
      run[k].lse = floats(lse, nl);
      run[k].dqkv = bits(dq, nqkv);
      run[k].dqkv2 = bits(dq2, nqkv);
      EXPECT_CLOSE(gpu->get_act(out, nout), ref_o, tol_f);
      EXPECT_CLOSE(gpu->get_act(dq, nqkv), ref_g, tol_b);
    }
    for (int k = 0; k < 2; ++k)  // every element written, the same bits twice
      EXPECT_EQ(run[k].dqkv, run[k].dqkv2) << (k ? "whole-head" : "tiled");
    EXPECT_EQ(run[0].out, run[1].out) << "forward output";
    EXPECT_EQ(0, std::memcmp(run[0].lse.data(), run[1].lse.data(), nl * sizeof(float)))
        << "log-sum-exp";
    size_t ndiff = 0, first = 0;  // backward dqkv: how many differ, and where first
    for (size_t i = nqkv; i-- > 0;)
      if (run[0].dqkv[i] != run[1].dqkv[i]) first = i, ++ndiff;
    EXPECT_EQ(ndiff, 0u) << "backward dqkv elements differ of " << nqkv << ", the first at token "
                         << first / (3 * C) << ", column " << first % (3 * C);
    for (float v : run[1].lse) ASSERT_FALSE(std::isnan(v)) << "a log-sum-exp left unwritten";
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuFlash, ::testing::Values(DType::BF16, DType::F16),
                         [](const ::testing::TestParamInfo<DType>& i) {
                           return std::string(dtype_name(i.param));
                         });

}  // namespace
}  // namespace vitgrid
