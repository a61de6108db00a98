// Fused residual add + LayerNorm forward and the LayerNorm backward, side by side.
// One warp per row (ViT rows are C = 192..1280 wide: a warp streams them at full bandwidth and
// needs no shared memory); statistics in fp32; parameter gradients through a deterministic
// two-stage column reduction (no atomics, same bits every run).
#include <algorithm>

#include "cuda_backend_impl.h"
#include "kernel_util.cuh"
#include "layernorm_reduce.cuh"

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

// The same for rows of up to 32*K packs of V elements (16-byte vectors): each lane keeps its
// packs of the row in registers, so a and b are read once and res and y written once (the
// generic kernel above re-reads the row from memory for the variance and the output).
template <class T, int K>
__global__ void __launch_bounds__(256) add_layernorm_fwd_vec_kernel(
    T* res, T* y, float* mean, float* rstd, const T* a, const T* b, const T* gamma,
    const T* beta, int N, int C, float eps) {
  constexpr int V = 16 / sizeof(T);
  using P = Pack<T, V>;
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const int packs = C / V;
  const P* ar = reinterpret_cast<const P*>(a + row * C);
  const P* br = b ? reinterpret_cast<const P*>(b + row * C) : nullptr;
  P* rr = reinterpret_cast<P*>(res + row * C);
  P* yr = reinterpret_cast<P*>(y + row * C);
  float r[K][V];
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int p = lane + 32 * k;
    if (p >= packs) continue;
    const P ap = ar[p];
    P bp;
    if (br) bp = br[p];
    P o;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      // rounded to T as stored: the statistics see what the backward will read as x
      o.v[j] = br ? from_f<T>(to_f(ap.v[j]) + to_f(bp.v[j])) : ap.v[j];
      r[k][j] = to_f(o.v[j]);
      s += r[k][j];
    }
    if (br || rr != ar) rr[p] = o;
  }
  const float m = warp_sum(s) / C;
  float v = 0.0f;  // two-pass variance from registers
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (lane + 32 * k >= packs) continue;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = r[k][j] - m;
      v += d * d;
    }
  }
  const float rs = 1.0f / sqrtf(warp_sum(v) / C + eps);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int p = lane + 32 * k;
    if (p >= packs) continue;
    const P gp = reinterpret_cast<const P*>(gamma)[p];
    const P bp = reinterpret_cast<const P*>(beta)[p];
    P o;
#pragma unroll
    for (int j = 0; j < V; ++j)
      o.v[j] = from_f<T>((r[k][j] - m) * rs * to_f(gp.v[j]) + to_f(bp.v[j]));
    yr[p] = o;
  }
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



// Fused backward for rows of up to 32*K packs of V elements (C <= 1024 in 16-bit types): one
// warp per row, each lane owning the same K packs (16-byte vectors) of every row it visits, so
// dy and x are read once for dx, dgamma and dbeta; per-lane column sums stay in registers,
// then the block's warps combine them in fixed order in shared memory and the block writes
// one partial row. Deterministic like the generic path.
template <class T, int K>
__global__ void __launch_bounds__(128) layernorm_bwd_fused_kernel(
    T* dx, float* pg, float* pb, const T* dy, const T* x, const T* gamma, const float* mean,
    const float* rstd, int N, int C) {
  constexpr int V = 16 / sizeof(T);
  constexpr int W = 4;  // warps per block
  extern __shared__ float sh[];  // [W][2][C]
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int packs = C / V;
  float gam[K][V], accg[K][V], accb[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int p = lane + 32 * k;
    Pack<T, V> gp;
    if (p < packs) gp = reinterpret_cast<const Pack<T, V>*>(gamma)[p];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      gam[k][j] = p < packs ? to_f(gp.v[j]) : 0.0f;
      accg[k][j] = accb[k][j] = 0.0f;
    }
  }
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * W + w; row < N;
       row += static_cast<int64_t>(gridDim.x) * W) {
    const Pack<T, V>* dyr = reinterpret_cast<const Pack<T, V>*>(dy + row * C);
    const Pack<T, V>* xr = reinterpret_cast<const Pack<T, V>*>(x + row * C);
    Pack<T, V>* dxr = reinterpret_cast<Pack<T, V>*>(dx + row * C);
    const float m = mean[row], rs = rstd[row];
    float d[K][V], xh[K][V];
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int p = lane + 32 * k;
      Pack<T, V> dp, xp;
      if (p < packs) {
        dp = dyr[p];
        xp = xr[p];
      }
#pragma unroll
      for (int j = 0; j < V; ++j) {
        d[k][j] = p < packs ? to_f(dp.v[j]) : 0.0f;
        xh[k][j] = p < packs ? (to_f(xp.v[j]) - m) * rs : 0.0f;
        const float g = d[k][j] * gam[k][j];
        s1 += g;
        s2 += g * xh[k][j];
        accg[k][j] += d[k][j] * xh[k][j];
        accb[k][j] += d[k][j];
      }
    }
    s1 = warp_sum(s1) / C;
    s2 = warp_sum(s2) / C;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int p = lane + 32 * k;
      if (p >= packs) continue;
      Pack<T, V> o = dxr[p];
#pragma unroll
      for (int j = 0; j < V; ++j)
        o.v[j] = from_f<T>(to_f(o.v[j]) + rs * (d[k][j] * gam[k][j] - s1 - xh[k][j] * s2));
      dxr[p] = o;
    }
  }
  // combine the warps' column sums in a fixed order
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int p = lane + 32 * k;
    if (p >= packs) continue;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      sh[(w * 2 + 0) * C + p * V + j] = accg[k][j];
      sh[(w * 2 + 1) * C + p * V + j] = accb[k][j];
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float tg = 0.0f, tb = 0.0f;
#pragma unroll
    for (int ww = 0; ww < W; ++ww) {
      tg += sh[(ww * 2 + 0) * C + c];
      tb += sh[(ww * 2 + 1) * C + c];
    }
    pg[static_cast<int64_t>(blockIdx.x) * C + c] = tg;
    pb[static_cast<int64_t>(blockIdx.x) * C + c] = tb;
  }
}

}  // namespace cuda

using namespace cuda;

namespace {
// The fused backward's grid: a few blocks per SM (132 on an H100 / H200) keep every row's loads
// in flight; each block writes one partial row of dgamma and one of dbeta.
constexpr int kLnBwdMaxBlocks = 132 * 4;
int ln_bwd_fused_blocks(int64_t N) {
  return static_cast<int>(std::min<int64_t>((N + 3) / 4, kLnBwdMaxBlocks));
}
}  // namespace

// layernorm_backward's partials: 2 x [blocks, C] on the fused path (blocks capped), 2 x
// [chunks, C] on the general one (a chunk per kLnRowsPerChunk rows); the larger of the two,
// whichever path the width and alignments pick.
size_t CudaBackend::layernorm_scratch_bytes(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  const int64_t chunks = (rows + kLnRowsPerChunk - 1) / kLnRowsPerChunk;
  const int64_t parts = std::max<int64_t>(ln_bwd_fused_blocks(rows), chunks);
  return 2 * static_cast<size_t>(parts) * static_cast<size_t>(cols) * sizeof(float);
}

void CudaBackend::add_layernorm_forward(void* res, void* y, float* mean, float* rstd,
                                        const void* a, const void* b, const void* gamma,
                                        const void* beta, int N, int C, float eps) {
  if (N <= 0 || C <= 0) return;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int threads = 256, warps = threads / 32;
    const unsigned blocks = (N + warps - 1) / warps;
    constexpr int V = 16 / sizeof(T);
    const int K = (C / V + 31) / 32;
    const bool vec = C % V == 0 && K <= 16 && aligned16(res) && aligned16(y) && aligned16(a) &&
                     (!b || aligned16(b)) && aligned16(gamma) && aligned16(beta);
    auto launch = [&](auto kernel) {
      kernel<<<blocks, threads, 0, stream_>>>(
          static_cast<T*>(res), static_cast<T*>(y), mean, rstd, static_cast<const T*>(a),
          static_cast<const T*>(b), static_cast<const T*>(gamma), static_cast<const T*>(beta),
          N, C, eps);
      CUDA_CHECK_LAUNCH();
    };
    if (!vec) launch(add_layernorm_fwd_kernel<T>);
    else if (K <= 1) launch(add_layernorm_fwd_vec_kernel<T, 1>);
    else if (K == 2) launch(add_layernorm_fwd_vec_kernel<T, 2>);
    else if (K == 3) launch(add_layernorm_fwd_vec_kernel<T, 3>);
    else if (K == 4) launch(add_layernorm_fwd_vec_kernel<T, 4>);
    else if (K <= 6) launch(add_layernorm_fwd_vec_kernel<T, 6>);
    else if (K <= 8) launch(add_layernorm_fwd_vec_kernel<T, 8>);
    else launch(add_layernorm_fwd_vec_kernel<T, 16>);
  });
}

void CudaBackend::layernorm_backward(void* dx, float* dgamma, float* dbeta, const void* dy,
                                     const void* x, const void* gamma, const float* mean,
                                     const float* rstd, int N, int C) {
  if (N <= 0 || C <= 0) return;
  bool done = false;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = 16 / sizeof(T);
    const int packs = C / V;
    const bool vec = C % V == 0 && aligned16(dx) && aligned16(dy) && aligned16(x) &&
                     aligned16(gamma) && packs <= 32 * 4;
    if (!vec) return;
    // one partial row per block: a few blocks per SM keep every row's loads in flight
    const int blocks = ln_bwd_fused_blocks(N);
    float* pg = static_cast<float*>(scratch(2 * static_cast<size_t>(blocks) * C * sizeof(float)));
    float* pb = pg + static_cast<size_t>(blocks) * C;
    const size_t smem = 4 * 2 * static_cast<size_t>(C) * sizeof(float);
    auto launch = [&](auto kernel) {
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
      kernel<<<blocks, 128, smem, stream_>>>(static_cast<T*>(dx), pg, pb,
                                             static_cast<const T*>(dy), static_cast<const T*>(x),
                                             static_cast<const T*>(gamma), mean, rstd, N, C);
      CUDA_CHECK_LAUNCH();
    };
    const int K = (packs + 31) / 32;
    if (K <= 1) launch(layernorm_bwd_fused_kernel<T, 1>);
    else if (K == 2) launch(layernorm_bwd_fused_kernel<T, 2>);
    else if (K == 3) launch(layernorm_bwd_fused_kernel<T, 3>);
    else launch(layernorm_bwd_fused_kernel<T, 4>);
    launch_layernorm_bwd_param_final(stream_, dgamma, dbeta, pg, pb, blocks, C);
    CUDA_CHECK_LAUNCH();
    done = true;
  });
  if (done) return;
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
  launch_layernorm_bwd_param_final(stream_, dgamma, dbeta, pg, pb, chunks, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace vitgrid
