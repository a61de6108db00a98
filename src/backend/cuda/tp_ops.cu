// CudaBackend ops for tensor parallelism: fp32 accumulation of reduced weight gradients and
// the LayerNorm of rows whose columns are split over ranks, forward and backward side by side.
// Same shape as layernorm.cu: one warp per row for the row sums and the elementwise passes
// (statistics in fp32, one rounding to the act dtype on store), and a deterministic two-stage
// column reduction for dgamma/dbeta (no atomics, same bits every run). The CPU reference is
// src/backend/cpu/cpu_tp_ops.cpp.
#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "cuda_backend_impl.h"
#include "kernel_util.cuh"
#include "layernorm_reduce.cuh"

namespace vitgrid {
namespace cuda {

__global__ void accumulate_f32_kernel(float* y, const float* x, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
    y[i] += x[i];
}

// The split LayerNorm's row kernels: a warp per row, each lane taking V-element packs of the
// row (V = 16 / sizeof(T): 16-byte loads where the width and the buffers allow, else V = 1,
// element by element; split_row_pack picks). A wide local row (the large ViT's 4096 over q = 2
// ranks: 2048) element by element is latency-bound: 2-byte loads, 64 per lane.
template <class T, int V>
__device__ __forceinline__ Pack<T, V> ld_pack(const T* row, int p) {
  return reinterpret_cast<const Pack<T, V>*>(row)[p];
}

// sum[r] = sum_j x[r,j]
template <class T, int V>
__global__ void ln_split_sums_kernel(float* sum, const T* x, int N, int C) {
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const T* xr = x + row * C;
  float s = 0.0f;
  for (int p = lane; p < C / V; p += 32) {
    const Pack<T, V> a = ld_pack<T, V>(xr, p);
#pragma unroll
    for (int j = 0; j < V; ++j) s += to_f(a.v[j]);
  }
  s = warp_sum(s);
  if (lane == 0) sum[row] = s;
}

// mean[r] = mean[r] / C_total (in place); sq[r] = sum_j (x[r,j] - mean[r])^2
template <class T, int V>
__global__ void ln_split_centered_kernel(float* sq, float* mean, const T* x, int N, int C,
                                         float Ct) {
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const float m = mean[row] / Ct;  // divided as add_layernorm_forward does
  const T* xr = x + row * C;
  float v = 0.0f;
  for (int p = lane; p < C / V; p += 32) {
    const Pack<T, V> a = ld_pack<T, V>(xr, p);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = to_f(a.v[j]) - m;
      v += d * d;
    }
  }
  v = warp_sum(v);
  __syncwarp();  // every lane has read mean[row] before lane 0 overwrites it
  if (lane == 0) {
    mean[row] = m;
    sq[row] = v;
  }
}

// rstd[r] = 1 / sqrt(rstd[r] / C_total + eps) (in place); y = (x - mean) rstd gamma + beta
template <class T, int V>
__global__ void ln_split_apply_kernel(T* y, float* rstd, const T* x, const float* mean,
                                      const T* gamma, const T* beta, int N, int C, float Ct,
                                      float eps) {
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const float m = mean[row];
  const float rs = 1.0f / sqrtf(rstd[row] / Ct + eps);
  const T* xr = x + row * C;
  T* yr = y + row * C;  // may alias x: each element is read and written by the same lane
  for (int p = lane; p < C / V; p += 32) {
    const Pack<T, V> a = ld_pack<T, V>(xr, p), g = ld_pack<T, V>(gamma, p),
                     b = ld_pack<T, V>(beta, p);
    Pack<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j)
      o.v[j] = from_f<T>((to_f(a.v[j]) - m) * rs * to_f(g.v[j]) + to_f(b.v[j]));
    reinterpret_cast<Pack<T, V>*>(yr)[p] = o;
  }
  __syncwarp();  // every lane has read rstd[row] before lane 0 overwrites it
  if (lane == 0) rstd[row] = rs;
}

// sums[2r] = sum_j dy gamma, sums[2r+1] = sum_j dy gamma xhat
template <class T, int V>
__global__ void ln_split_bwd_sums_kernel(float* sums, const T* dy, const T* x, const T* gamma,
                                         const float* mean, const float* rstd, int N, int C) {
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const T* dyr = dy + row * C;
  const T* xr = x + row * C;
  const float m = mean[row], rs = rstd[row];
  float s1 = 0.0f, s2 = 0.0f;
  for (int p = lane; p < C / V; p += 32) {
    const Pack<T, V> d = ld_pack<T, V>(dyr, p), a = ld_pack<T, V>(xr, p),
                     g = ld_pack<T, V>(gamma, p);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float gg = to_f(d.v[j]) * to_f(g.v[j]);
      s1 += gg;
      s2 += gg * (to_f(a.v[j]) - m) * rs;
    }
  }
  s1 = warp_sum(s1);
  s2 = warp_sum(s2);
  if (lane == 0) {
    sums[2 * row] = s1;
    sums[2 * row + 1] = s2;
  }
}

// dx += rstd (g - sums[2r]/C_total - xhat sums[2r+1]/C_total), g = dy gamma
template <class T, int V>
__global__ void ln_split_bwd_dx_kernel(T* dx, const T* dy, const T* x, const T* gamma,
                                       const float* mean, const float* rstd, const float* sums,
                                       int N, int C, float invC) {
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const T* dyr = dy + row * C;
  const T* xr = x + row * C;
  T* dxr = dx + row * C;
  const float m = mean[row], rs = rstd[row];
  const float mg = sums[2 * row] * invC, mgx = sums[2 * row + 1] * invC;
  for (int p = lane; p < C / V; p += 32) {
    const Pack<T, V> d = ld_pack<T, V>(dyr, p), a = ld_pack<T, V>(xr, p),
                     g = ld_pack<T, V>(gamma, p);
    Pack<T, V> o = ld_pack<T, V>(dxr, p);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float gg = to_f(d.v[j]) * to_f(g.v[j]);
      const float xh = (to_f(a.v[j]) - m) * rs;
      o.v[j] = from_f<T>(to_f(o.v[j]) + rs * (gg - mg - xh * mgx));
    }
    reinterpret_cast<Pack<T, V>*>(dxr)[p] = o;
  }
}

constexpr int kRowThreads = 256;  // 8 rows (warps) per block
inline unsigned row_blocks(int N) {
  const int warps = kRowThreads / 32;
  return static_cast<unsigned>((N + warps - 1) / warps);
}
// Runs launch(std::integral_constant<int, V>) with V = 16 / sizeof(T) (16-byte packs) when
// rows of C elements of every pointer given start on 16-byte boundaries, else with V = 1.
template <class T, class F>
void split_row_pack(int C, std::initializer_list<const void*> ptrs, F&& launch) {
  constexpr int V = 16 / sizeof(T);
  bool vec = C % V == 0;
  for (const void* p : ptrs) vec = vec && aligned16(p);
  if (vec) launch(std::integral_constant<int, V>{});
  else launch(std::integral_constant<int, 1>{});
}

}  // namespace cuda

using namespace cuda;

void CudaBackend::accumulate_f32(float* y, const float* x, size_t n) {
  OpScope op_scope(*this, "accumulate_f32");
  if (n == 0) return;
  accumulate_f32_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(y, x, n);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::layernorm_split_sums(float* sum, const void* x, int N, int C) {
  OpScope op_scope(*this, "layernorm_split_sums");
  if (N <= 0 || C <= 0) return;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    split_row_pack<T>(C, {x}, [&](auto v) {
      ln_split_sums_kernel<T, decltype(v)::value><<<row_blocks(N), kRowThreads, 0, stream_>>>(
          sum, static_cast<const T*>(x), N, C);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void CudaBackend::layernorm_split_centered(float* sq, float* mean, const void* x, int N, int C,
                                           int C_total) {
  OpScope op_scope(*this, "layernorm_split_centered");
  if (N <= 0 || C <= 0) return;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    split_row_pack<T>(C, {x}, [&](auto v) {
      ln_split_centered_kernel<T, decltype(v)::value><<<row_blocks(N), kRowThreads, 0, stream_>>>(
          sq, mean, static_cast<const T*>(x), N, C, static_cast<float>(C_total));
      CUDA_CHECK_LAUNCH();
    });
  });
}

void CudaBackend::layernorm_split_apply(void* y, float* rstd, const void* x, const float* mean,
                                        const void* gamma, const void* beta, int N, int C,
                                        int C_total, float eps) {
  OpScope op_scope(*this, "layernorm_split_apply");
  if (N <= 0 || C <= 0) return;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    split_row_pack<T>(C, {y, x, gamma, beta}, [&](auto v) {
      ln_split_apply_kernel<T, decltype(v)::value><<<row_blocks(N), kRowThreads, 0, stream_>>>(
          static_cast<T*>(y), rstd, static_cast<const T*>(x), mean, static_cast<const T*>(gamma),
          static_cast<const T*>(beta), N, C, static_cast<float>(C_total), eps);
      CUDA_CHECK_LAUNCH();
    });
  });
}

// layernorm_split_backward_sums' partials: 2 x [chunks, C], a chunk per kLnRowsPerChunk rows.
size_t CudaBackend::layernorm_split_scratch_bytes(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  const int64_t chunks = (rows + kLnRowsPerChunk - 1) / kLnRowsPerChunk;
  return 2 * static_cast<size_t>(chunks) * static_cast<size_t>(cols) * sizeof(float);
}

void CudaBackend::layernorm_split_backward_sums(float* sums, float* dgamma, float* dbeta,
                                                const void* dy, const void* x, const void* gamma,
                                                const float* mean, const float* rstd, int N,
                                                int C) {
  OpScope op_scope(*this, "layernorm_split_backward_sums");
  if (N <= 0 || C <= 0) return;
  const int chunks = (N + kLnRowsPerChunk - 1) / kLnRowsPerChunk;
  float* pg = static_cast<float*>(scratch(2 * static_cast<size_t>(chunks) * C * sizeof(float)));
  float* pb = pg + static_cast<size_t>(chunks) * C;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    split_row_pack<T>(C, {dy, x, gamma}, [&](auto v) {
      ln_split_bwd_sums_kernel<T, decltype(v)::value><<<row_blocks(N), kRowThreads, 0, stream_>>>(
          sums, static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(gamma),
          mean, rstd, N, C);
      CUDA_CHECK_LAUNCH();
    });
    launch_layernorm_bwd_param_partial(stream_, pg, pb, static_cast<const T*>(dy),
                                       static_cast<const T*>(x), mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
  });
  launch_layernorm_bwd_param_final(stream_, dgamma, dbeta, pg, pb, chunks, C);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::layernorm_split_backward_dx(void* dx, const void* dy, const void* x,
                                              const void* gamma, const float* mean,
                                              const float* rstd, const float* sums, int N, int C,
                                              int C_total) {
  OpScope op_scope(*this, "layernorm_split_backward_dx");
  if (N <= 0 || C <= 0) return;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    split_row_pack<T>(C, {dx, dy, x, gamma}, [&](auto v) {
      ln_split_bwd_dx_kernel<T, decltype(v)::value><<<row_blocks(N), kRowThreads, 0, stream_>>>(
          static_cast<T*>(dx), static_cast<const T*>(dy), static_cast<const T*>(x),
          static_cast<const T*>(gamma), mean, rstd, sums, N, C,
          1.0f / static_cast<float>(C_total));
      CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace vitgrid
