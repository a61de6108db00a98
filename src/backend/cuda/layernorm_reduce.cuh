// The deterministic two-stage column reduction behind LayerNorm's dgamma / dbeta, shared by
// the unsplit LayerNorm (layernorm.cu) and the tensor-parallel split one (tp_ops.cu).
#pragma once
#include "kernel_util.cuh"

namespace vitgrid {
namespace cuda {

// Stage 1 of dgamma/dbeta: block (32 columns x 8 row lanes) over a chunk of rows.
constexpr int kLnRowsPerChunk = 1024;  // few enough chunks for a short stage 2
template <class T>
__global__ void layernorm_bwd_param_partial(float* pg, float* pb, const T* dy, const T* x,
                                            const float* mean, const float* rstd, int N,
                                            int C) {
  __shared__ float shg[8][33], shb[8][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  const int r0 = blockIdx.y * kLnRowsPerChunk;
  const int r1 = min(N, r0 + kLnRowsPerChunk);
  float sg = 0.0f, sb = 0.0f;
  if (col < C) {
    for (int r = r0 + threadIdx.y; r < r1; r += 8) {
      const int64_t i = static_cast<int64_t>(r) * C + col;
      const float d = to_f(dy[i]);
      sg += d * (to_f(x[i]) - mean[r]) * rstd[r];
      sb += d;
    }
  }
  shg[threadIdx.y][threadIdx.x] = sg;
  shb[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y == 0 && col < C) {
    float tg = 0.0f, tb = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      tg += shg[j][threadIdx.x];
      tb += shb[j][threadIdx.x];
    }
    pg[static_cast<int64_t>(blockIdx.y) * C + col] = tg;
    pb[static_cast<int64_t>(blockIdx.y) * C + col] = tb;
  }
}
// Stage 2: dgamma[col] += sum of chunks in order; dbeta likewise.
static __global__ void layernorm_bwd_param_final(float* dgamma, float* dbeta, const float* pg,
                                          const float* pb, int chunks, int C) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= C) return;
  float tg = 0.0f, tb = 0.0f;
  for (int k = 0; k < chunks; ++k) {
    tg += pg[static_cast<int64_t>(k) * C + col];
    tb += pb[static_cast<int64_t>(k) * C + col];
  }
  dgamma[col] += tg;
  dbeta[col] += tb;
}

}  // namespace cuda
}  // namespace vitgrid
