// CudaBackend's FP8 casts (backend.h Fp8Ops::fp8_cast): act-dtype rows to E4M3/E5M2 codes
// with the tensor's scale, the transpose beside (the K-contiguous operand the weight- and
// data-gradient GEMMs need), and the amax of the input for the delayed-scaling history. One
// pass: each block converts a 64 x 128 tile, writes it row-wise, and writes the transpose from
// shared memory. The conversion is CUDA's __nv_cvt_float_to_fp8 with __NV_SATFINITE (nearest
// even, saturating, NaN kept): backend/fp8.h's fp8_encode(saturate = true), code for code.
// The FP8 GEMMs are cuBLASLt's (cuda_gemm.cpp).
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

#include "cuda_backend_impl.h"
#include "gelu_ops.cuh"
#include "kernel_util.cuh"

namespace vitgrid {
namespace cuda {

namespace {

constexpr int kTileRows = 64, kTileCols = 128, kThreads = 256, kChunk = 8;

// The values cast: the input's (Plain), or gelu of it as gelu_forward stores it (GeluIn: the
// elementwise kernels' op, rounded to T).
struct Plain {
  __device__ __forceinline__ float operator()(float v) const { return v; }
};
template <class T, GeluForm F>
struct GeluIn {
  __device__ __forceinline__ float operator()(float v) const {
    return to_f<T>(from_f<T>(GeluFwdOp<F>{}(&v, 0)));
  }
};

// |v| as ordered integer bits: for non-negative floats (and NaN, whose bits exceed inf's) the
// integer maximum is the float maximum, so atomicMax on the bits keeps NaN once seen.
__device__ __forceinline__ int abs_bits(float v) { return __float_as_int(fabsf(v)); }

// Whether the block's tile takes the vector path: whole, every row and column start a multiple
// of kChunk elements, the pointers aligned for kChunk-element loads and 8-byte stores.
template <class T>
__device__ __forceinline__ bool vector_tile(const uint8_t* out, const uint8_t* out_t,
                                            const T* x, int rows, int cols, int r0, int c0) {
  const auto a = [](const void* p, unsigned n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; };
  return r0 + kTileRows <= rows && c0 + kTileCols <= cols && cols % kChunk == 0 &&
         rows % kChunk == 0 && a(x, sizeof(Pack<T, kChunk>) > 16 ? 16 : sizeof(Pack<T, kChunk>)) &&
         a(out, 8) && a(out_t, 8);
}

// One block per 64 x 128 tile: the rows converted kChunk elements per thread (one 16-byte load
// of bf16/fp16, an 8-byte store of codes), kept in shared memory, then the transpose written
// kChunk rows of one column per 8-byte store. Tiles at the edges, and inputs whose shapes or
// pointers do not allow vectors, go element by element.
template <class T, class In>
__global__ void __launch_bounds__(kThreads) fp8_cast_kernel(
    uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, float* __restrict__ amax,
    const T* __restrict__ x, int rows, int cols, const float* __restrict__ scale_p,
    __nv_fp8_interpretation_t fmt, In in) {
  __shared__ __align__(8) uint8_t tile[kTileRows][kTileCols + 8];
  __shared__ int warp_max[kThreads / 32];
  const int r0 = blockIdx.y * kTileRows, c0 = blockIdx.x * kTileCols;
  const float scale = scale_p[0];
  int m = 0;  // the thread's amax, as bits
  if (vector_tile(out, out_t, x, rows, cols, r0, c0)) {
    constexpr int kPerRow = kTileCols / kChunk;
    for (int q = threadIdx.x; q < kTileRows * kPerRow; q += kThreads) {
      const int tr = q / kPerRow, tc = (q % kPerRow) * kChunk;
      const size_t at = static_cast<size_t>(r0 + tr) * cols + c0 + tc;
      const Pack<T, kChunk> v = *reinterpret_cast<const Pack<T, kChunk>*>(x + at);
      uint8_t codes[kChunk];
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        const float f = in(to_f<T>(v.v[k]));
        m = max(m, abs_bits(f));
        codes[k] = __nv_cvt_float_to_fp8(f * scale, __NV_SATFINITE, fmt);
      }
      uint2 packed;
      memcpy(&packed, codes, sizeof packed);
      if (out) *reinterpret_cast<uint2*>(out + at) = packed;
      *reinterpret_cast<uint2*>(&tile[tr][tc]) = packed;
    }
    if (out_t) {
      __syncthreads();
      constexpr int kPerCol = kTileRows / kChunk;
      for (int q = threadIdx.x; q < kTileCols * kPerCol; q += kThreads) {
        const int tc = q / kPerCol, tr = (q % kPerCol) * kChunk;
        uint8_t codes[kChunk];
#pragma unroll
        for (int k = 0; k < kChunk; ++k) codes[k] = tile[tr + k][tc];
        uint2 packed;
        memcpy(&packed, codes, sizeof packed);
        *reinterpret_cast<uint2*>(out_t + static_cast<size_t>(c0 + tc) * rows + r0 + tr) = packed;
      }
    }
  } else {
    for (int i = threadIdx.x; i < kTileRows * kTileCols; i += kThreads) {
      const int tr = i / kTileCols, tc = i % kTileCols;
      const int r = r0 + tr, c = c0 + tc;
      uint8_t code = 0;
      if (r < rows && c < cols) {
        const float v = in(to_f<T>(x[static_cast<size_t>(r) * cols + c]));
        m = max(m, abs_bits(v));
        code = __nv_cvt_float_to_fp8(v * scale, __NV_SATFINITE, fmt);
        if (out) out[static_cast<size_t>(r) * cols + c] = code;
      }
      tile[tr][tc] = code;
    }
    if (out_t) {
      __syncthreads();
      for (int i = threadIdx.x; i < kTileRows * kTileCols; i += kThreads) {
        const int tc = i / kTileRows, tr = i % kTileRows;
        const int r = r0 + tr, c = c0 + tc;
        if (r < rows && c < cols) out_t[static_cast<size_t>(c) * rows + r] = tile[tr][tc];
      }
    }
  }
  // block maximum, then one atomic per block
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = max(m, warp_max[w]);
    atomicMax(reinterpret_cast<int*>(amax), m);
  }
}

}  // namespace

}  // namespace cuda

bool CudaBackend::fp8_supported(std::string* why) const {
  int major = 0, minor = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_));
  if (major * 10 + minor >= 89) return true;  // Ada (8.9), Hopper (9.0) and later
  if (why) {
    cudaDeviceProp p{};
    CUDA_CHECK(cudaGetDeviceProperties(&p, device_));
    *why = std::string(p.name) + " (compute capability " + std::to_string(major) + "." +
           std::to_string(minor) + ") has no FP8 tensor cores (they start with 8.9: Ada, Hopper)";
  }
  return false;
}

void CudaBackend::fp8_cast(uint8_t* out, uint8_t* out_t, float* amax, const void* x, int rows,
                           int cols, const float* scale, Fp8Format f, const Gelu* gelu_in) {
  OpScope op_scope(*this, "fp8_cast");
  check_fp8_cast_args(out, out_t, amax, rows, cols, scale);
  if (rows == 0 || cols == 0) return;
  const dim3 grid((cols + cuda::kTileCols - 1) / cuda::kTileCols,
                  (rows + cuda::kTileRows - 1) / cuda::kTileRows);
  VG_CHECK(grid.y <= 65535u, "fp8_cast: " << rows << " rows exceed the grid");
  const __nv_fp8_interpretation_t fmt = f == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
  cuda::dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto launch = [&](auto in) {
      cuda::fp8_cast_kernel<T><<<grid, cuda::kThreads, 0, stream_>>>(
          out, out_t, amax, static_cast<const T*>(x), rows, cols, scale, fmt, in);
    };
    if (!gelu_in) return launch(cuda::Plain{});
    cuda::with_gelu_form<T>(*gelu_in, [&](auto form) {
      launch(cuda::GeluIn<T, decltype(form)::value>{});
    });
  });
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace vitgrid
