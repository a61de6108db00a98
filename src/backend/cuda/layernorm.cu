// Fused residual add + LayerNorm forward and the LayerNorm backward, side by side.
// One warp per row (ViT rows are C = 192..1280 wide: a warp streams them at full bandwidth and
// needs no shared memory); statistics in fp32; parameter gradients through a deterministic
// two-stage column reduction (no atomics, same bits every run).
#include "cuda_backend_impl.h"
#include "kernel_util.cuh"

namespace vitgrid {
namespace cuda {

// res = a + b (rounded to T, as stored), y = (res - mean) * rstd * gamma + beta.
// Statistics come from the stored (rounded) res, which is what the backward sees as x.
// res may alias a: every element is read and written by the same lane.
template <class T>
__global__ void add_layernorm_fwd_kernel(T* res, T* y, float* mean, float* rstd, const T* a,
                                         const T* b, const T* gamma, const T* beta, int N,
                                         int C, float eps) {
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const T* ar = a + row * C;
  T* rr = res + row * C;
  T* yr = y + row * C;
  float s = 0.0f;
  if (b) {
    const T* br = b + row * C;
    for (int c = lane; c < C; c += 32) {
      const T r = from_f<T>(to_f(ar[c]) + to_f(br[c]));
      rr[c] = r;
      s += to_f(r);
    }
  } else {
    for (int c = lane; c < C; c += 32) {
      const T r = ar[c];
      if (rr != ar) rr[c] = r;
      s += to_f(r);
    }
  }
  const float m = warp_sum(s) / C;
  float v = 0.0f;  // two-pass variance: exact enough even when |mean| >> std
  for (int c = lane; c < C; c += 32) {
    const float d = to_f(rr[c]) - m;
    v += d * d;
  }
  const float rs = 1.0f / sqrtf(warp_sum(v) / C + eps);
  for (int c = lane; c < C; c += 32)
    yr[c] = from_f<T>((to_f(rr[c]) - m) * rs * to_f(gamma[c]) + to_f(beta[c]));
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
}

// dx += rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma.
template <class T>
__global__ void layernorm_bwd_dx_kernel(T* dx, const T* dy, const T* x, const T* gamma,
                                        const float* mean, const float* rstd, int N, int C) {
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const T* dyr = dy + row * C;
  const T* xr = x + row * C;
  T* dxr = dx + row * C;
  const float m = mean[row], rs = rstd[row];
  float s1 = 0.0f, s2 = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float g = to_f(dyr[c]) * to_f(gamma[c]);
    s1 += g;
    s2 += g * (to_f(xr[c]) - m) * rs;
  }
  s1 = warp_sum(s1) / C;
  s2 = warp_sum(s2) / C;
  for (int c = lane; c < C; c += 32) {
    const float g = to_f(dyr[c]) * to_f(gamma[c]);
    const float xh = (to_f(xr[c]) - m) * rs;
    dxr[c] = from_f<T>(to_f(dxr[c]) + rs * (g - s1 - xh * s2));
  }
}

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
__global__ void layernorm_bwd_param_final(float* dgamma, float* dbeta, const float* pg,
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

using namespace cuda;

void CudaBackend::add_layernorm_forward(void* res, void* y, float* mean, float* rstd,
                                        const void* a, const void* b, const void* gamma,
                                        const void* beta, int N, int C, float eps) {
  if (N <= 0 || C <= 0) return;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int threads = 256, warps = threads / 32;
    add_layernorm_fwd_kernel<<<(N + warps - 1) / warps, threads, 0, stream_>>>(
        static_cast<T*>(res), static_cast<T*>(y), mean, rstd, static_cast<const T*>(a),
        static_cast<const T*>(b), static_cast<const T*>(gamma), static_cast<const T*>(beta), N,
        C, eps);
    CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::layernorm_backward(void* dx, float* dgamma, float* dbeta, const void* dy,
                                     const void* x, const void* gamma, const float* mean,
                                     const float* rstd, int N, int C) {
  if (N <= 0 || C <= 0) return;
  const int chunks = (N + kLnRowsPerChunk - 1) / kLnRowsPerChunk;
  float* pg = static_cast<float*>(scratch(2 * static_cast<size_t>(chunks) * C * sizeof(float)));
  float* pb = pg + static_cast<size_t>(chunks) * C;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int threads = 256, warps = threads / 32;
    layernorm_bwd_dx_kernel<<<(N + warps - 1) / warps, threads, 0, stream_>>>(
        static_cast<T*>(dx), static_cast<const T*>(dy), static_cast<const T*>(x),
        static_cast<const T*>(gamma), mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
    dim3 grid((C + 31) / 32, chunks), block(32, 8);
    layernorm_bwd_param_partial<<<grid, block, 0, stream_>>>(
        pg, pb, static_cast<const T*>(dy), static_cast<const T*>(x), mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
  });
  layernorm_bwd_param_final<<<(C + 255) / 256, 256, 0, stream_>>>(dgamma, dbeta, pg, pb,
                                                                   chunks, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace vitgrid
