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
// The same with V consecutive columns per thread (16-byte loads; C % V == 0, dy and x 16-byte
// aligned): block (32 x V columns, 8 row lanes). Each column is summed in the same order as
// above (the same bits).
template <class T, int V>
__global__ void layernorm_bwd_param_partial_vec(float* pg, float* pb, const T* dy, const T* x,
                                                const float* mean, const float* rstd, int N,
                                                int C) {
  __shared__ float shg[8][32 * V + 1], shb[8][32 * V + 1];
  const int p = blockIdx.x * 32 + threadIdx.x;  // this thread's pack of columns
  const int r0 = blockIdx.y * kLnRowsPerChunk;
  const int r1 = min(N, r0 + kLnRowsPerChunk);
  float sg[V] = {}, sb[V] = {};
  if (p < C / V) {
    for (int r = r0 + threadIdx.y; r < r1; r += 8) {
      const int64_t i = static_cast<int64_t>(r) * C + static_cast<int64_t>(p) * V;
      const Pack<T, V> d = *reinterpret_cast<const Pack<T, V>*>(dy + i);
      const Pack<T, V> a = *reinterpret_cast<const Pack<T, V>*>(x + i);
      const float m = mean[r], rs = rstd[r];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float dd = to_f(d.v[j]);
        sg[j] += dd * (to_f(a.v[j]) - m) * rs;
        sb[j] += dd;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    shg[threadIdx.y][threadIdx.x * V + j] = sg[j];
    shb[threadIdx.y][threadIdx.x * V + j] = sb[j];
  }
  __syncthreads();
  if (threadIdx.y == 0 && p < C / V) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float tg = 0.0f, tb = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        tg += shg[k][threadIdx.x * V + j];
        tb += shb[k][threadIdx.x * V + j];
      }
      pg[static_cast<int64_t>(blockIdx.y) * C + p * V + j] = tg;
      pb[static_cast<int64_t>(blockIdx.y) * C + p * V + j] = tb;
    }
  }
}
// Stage 1 on either kernel: the vector one where the width and the buffers allow.
template <class T>
void launch_layernorm_bwd_param_partial(cudaStream_t st, float* pg, float* pb, const T* dy,
                                        const T* x, const float* mean, const float* rstd, int N,
                                        int C) {
  constexpr int V = 16 / sizeof(T);
  const int chunks = (N + kLnRowsPerChunk - 1) / kLnRowsPerChunk;
  if (C % V == 0 && aligned16(dy) && aligned16(x)) {
    dim3 grid((C / V + 31) / 32, chunks), block(32, 8);
    layernorm_bwd_param_partial_vec<T, V><<<grid, block, 0, st>>>(pg, pb, dy, x, mean, rstd, N, C);
  } else {
    dim3 grid((C + 31) / 32, chunks), block(32, 8);
    layernorm_bwd_param_partial<T><<<grid, block, 0, st>>>(pg, pb, dy, x, mean, rstd, N, C);
  }
}
// Stage 2: dgamma[col] += the sum of the chunks' partials; dbeta likewise, and dsum from pd
// where given (the fused backward's column sums of dx). A block covers 32 columns with 32 row
// lanes: lane y sums chunks y, y + 32, ... in order, then lane 0 adds the 32 lane sums in
// order (fixed tree: the same bits every run). A thread per column summing hundreds of
// partials serially was latency-bound: ~0.2 ms per ViT-B LayerNorm.
template <bool DS>
__global__ void __launch_bounds__(1024) layernorm_bwd_param_final(
    float* dgamma, float* dbeta, float* dsum, const float* pg, const float* pb, const float* pd,
    int chunks, int C) {
  constexpr int A = DS ? 3 : 2;
  __shared__ float sh[A][32][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float t[A] = {};
  if (col < C) {
    for (int k = threadIdx.y; k < chunks; k += 32) {
      const int64_t i = static_cast<int64_t>(k) * C + col;
      t[0] += pg[i];
      t[1] += pb[i];
      if constexpr (DS) t[2] += pd[i];
    }
  }
#pragma unroll
  for (int a = 0; a < A; ++a) sh[a][threadIdx.y][threadIdx.x] = t[a];
  __syncthreads();
  if (threadIdx.y == 0 && col < C) {
    float s[A] = {};
#pragma unroll
    for (int j = 0; j < 32; ++j) {
#pragma unroll
      for (int a = 0; a < A; ++a) s[a] += sh[a][j][threadIdx.x];
    }
    dgamma[col] += s[0];
    dbeta[col] += s[1];
    if constexpr (DS) dsum[col] += s[2];
  }
}
inline void launch_layernorm_bwd_param_final(cudaStream_t st, float* dgamma, float* dbeta,
                                             const float* pg, const float* pb, int chunks, int C,
                                             float* dsum = nullptr, const float* pd = nullptr) {
  const dim3 grid((C + 31) / 32), block(32, 32);
  if (dsum)
    layernorm_bwd_param_final<true><<<grid, block, 0, st>>>(dgamma, dbeta, dsum, pg, pb, pd,
                                                            chunks, C);
  else
    layernorm_bwd_param_final<false><<<grid, block, 0, st>>>(dgamma, dbeta, nullptr, pg, pb,
                                                             nullptr, chunks, C);
}

}  // namespace cuda
}  // namespace vitgrid
