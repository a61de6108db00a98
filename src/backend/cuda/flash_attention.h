// vitgrid's own fused attention kernels (flash_attention.cu), internal to the CUDA backend:
// timm's layout, qkv[B,T,3C] in, out[B,T,C] and the fp32 log-sum-exp [B,H,T] saved.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "vitgrid/core/types.h"

namespace vitgrid {
namespace cuda {

// Which kernels run. Best: one CTA per (image, head) holding the whole head in shared memory
// where flash_head_applies(), else the kernels tiled over 64 rows; Tiled forces the tiled
// ones (the tests compare the two: they give the same bits).
enum class FlashKernels { Best, Tiled };

bool flash_attention_supported(DType act, int hd);
// The whole-head kernels: bf16/fp16, head dim 64, T <= 224 (ViT's 224 px at patch 16 or 32).
bool flash_head_applies(DType act, int hd, int T);

void flash_attention_forward(cudaStream_t st, DType act, void* out, float* lse, const void* qkv,
                             int B, int T, int H, int hd, FlashKernels k = FlashKernels::Best);
// Dws: fp32 [B,H,T] workspace (the tiled kernels' D = rowsum(dO * O)).
void flash_attention_backward(cudaStream_t st, DType act, void* dqkv, float* Dws, const void* dout,
                              const void* qkv, const void* out, const float* lse, int B, int T,
                              int H, int hd, FlashKernels k = FlashKernels::Best);

// The whole-head backward's qkv gradient cast for qkv's FP8 backward instead of stored
// (Fp8Ops::attention_backward_fp8): out [rows, 3C] and out_t [3C, rows] (either may be null)
// get fp8(g * scale[0]) of g = dqkv as flash_attention_backward would store it (the act dtype),
// *amax = max(*amax, max |g|), and sums (if not null) fp32 [B, 3C]: each image's column sums
// of g, in a fixed order (the bias gradient's partials).
struct FlashGradCast {
  uint8_t* out = nullptr;
  uint8_t* out_t = nullptr;
  float* amax = nullptr;
  const float* scale = nullptr;
  float* sums = nullptr;
  int64_t rows = 0;  // B * T
  int C = 0;         // H * hd
  bool e5m2 = true;  // the codes' format: E5M2 (a gradient's), else E4M3
};

// Only where flash_head_applies (VG_CHECK otherwise).
void flash_attention_backward_cast(cudaStream_t st, DType act, const FlashGradCast& cast,
                                   const void* dout, const void* qkv, const void* out,
                                   const float* lse, int B, int T, int H, int hd);

}  // namespace cuda
}  // namespace vitgrid
