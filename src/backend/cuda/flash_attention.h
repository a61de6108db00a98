// vitgrid's own fused attention kernels (flash_attention.cu), internal to the CUDA backend:
// timm's layout, qkv[B,T,3C] in, out[B,T,C] and the fp32 log-sum-exp [B,H,T] saved.
#pragma once
#include <cuda_runtime.h>

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

}  // namespace cuda
}  // namespace vitgrid
