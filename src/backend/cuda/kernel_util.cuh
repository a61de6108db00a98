// Device helpers shared by the kernel files: act-dtype conversions (fp32 math, one rounding
// on store, round-to-nearest-even like the CPU emulation), 16-byte packs, warp/block sums and
// the host-side dispatch from DType to the C++ element type.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "vitgrid/core/types.h"

namespace vitgrid {
namespace cuda {

template <class T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }

template <class T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f<__half>(float x) {
  return __float2half_rn(x);
}

// V elements of T moved as one aligned vector (16 bytes when V * sizeof(T) == 16).
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// |v| as ordered integer bits: for non-negative floats (and NaN, whose bits exceed inf's) the
// integer maximum is the float maximum, so atomicMax on the bits keeps NaN once seen (the FP8
// casts' amaxes).
__device__ __forceinline__ int abs_bits(float v) { return __float_as_int(fabsf(v)); }

// *amax = max(*amax, the block's largest m) (abs_bits values; one atomic per block, by thread
// 0). Every thread of the block calls it; `sh` holds 32 ints.
__device__ __forceinline__ void block_amax_atomic(int m, float* amax, int* sh) {
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  __syncthreads();  // sh may still be read by a previous use
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) m = max(m, sh[w]);
    atomicMax(reinterpret_cast<int*>(amax), m);
  }
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
// `sh` holds 32 values of Acc. Deterministic: fixed reduction tree.
template <class Acc>
__device__ __forceinline__ Acc block_sum(Acc v, Acc* sh) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // sh may still be read by a previous call
  if (lane == 0) sh[w] = v;
  __syncthreads();
  Acc t = lane < nw ? sh[lane] : Acc(0);
  return warp_sum(t);
}
__device__ __forceinline__ float block_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  float t = lane < nw ? sh[lane] : -INFINITY;
  return warp_max(t);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
inline bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

// Blocks for a grid-stride loop over `work` items: enough to fill an H100/H200 several times,
// never more than needed.
inline unsigned grid_for(size_t work, int threads) {
  size_t b = (work + threads - 1) / threads;
  const size_t cap = 132 * 32;  // SMs x resident blocks budget
  if (b > cap) b = cap;
  if (b == 0) b = 1;
  return static_cast<unsigned>(b);
}

template <class T> struct Tag { using type = T; };

// Calls f(Tag<T>{}) with T the element type of act dtype t.
template <class F>
void dispatch_act(DType t, F&& f) {
  switch (t) {
    case DType::F32: f(Tag<float>{}); break;
    case DType::BF16: f(Tag<__nv_bfloat16>{}); break;
    case DType::F16: f(Tag<__half>{}); break;
  }
}

// Row softmax launchers (elementwise.cu), instantiated for fp32 scores and every act type.
template <class Tin, class Tout>
void launch_softmax_fwd(cudaStream_t st, Tout* y, const Tin* x, int rows, int cols, float scale);
template <class Ty, class Tdy, class Tdx>
void launch_softmax_bwd(cudaStream_t st, Tdx* dx, const Ty* y, const Tdy* dy, int rows, int cols,
                        float scale);

}  // namespace cuda
}  // namespace vitgrid
