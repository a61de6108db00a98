// CudaBackend's FP8 casts (backend.h Fp8Ops::fp8_cast, fp8_cast_grad): act-dtype rows to
// E4M3/E5M2 codes with the tensor's scale, the transpose beside (the K-contiguous operand the
// weight- and data-gradient GEMMs need), and the amax of the input for the delayed-scaling
// history. One pass: each block converts 64 x 128 tiles, writes them row-wise, and writes the
// transposes from shared memory; a gradient's cast also applies GELU's backward where asked and
// sums the bias gradient's columns (partials per block, added by a second small kernel). The conversion is CUDA's __nv_cvt_float_to_fp8 with __NV_SATFINITE (nearest
// even, saturating, NaN kept): backend/fp8.h's fp8_encode(saturate = true), code for code.
// The FP8 GEMMs are cuBLASLt's (cuda_gemm.cpp).
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

#include "cuda_backend_impl.h"
#include "fp8_codes.cuh"
#include "gelu_ops.cuh"
#include "kernel_util.cuh"

namespace vitgrid {
namespace cuda {

namespace {

constexpr int kTileRows = 64, kTileCols = 128, kThreads = 256, kChunk = 8;
// fp8_cast_grad's blocks take this many row tiles each: a bias-gradient partial per 256 rows
constexpr int kGradTiles = 4;

// The values cast, read at a flat index of the [rows, cols] input: kChunk of them (the vector
// path) or one. Plain: the input's. GeluIn: gelu of it as gelu_forward stores it (the
// elementwise kernels' op, rounded to T). GradGelu: dy * gelu'(pre) as gelu_backward stores it.
// The vector path reads in two steps, so that a thread's loads are all in flight before it
// computes: fetch (the raw kChunk elements) and value (them converted and through the op).
template <class T>
struct Plain {
  const T* x;
  using Raw = Pack<T, kChunk>;
  __device__ __forceinline__ bool aligned() const { return aligned_to(x, sizeof(Pack<T, kChunk>)); }
  __device__ __forceinline__ void fetch(size_t at, Raw& r) const {
    r = *reinterpret_cast<const Pack<T, kChunk>*>(x + at);
  }
  __device__ __forceinline__ void value(const Raw& v, float* f) const {
#pragma unroll
    for (int k = 0; k < kChunk; ++k) f[k] = to_f<T>(v.v[k]);
  }
  __device__ __forceinline__ float load1(size_t at) const { return to_f<T>(x[at]); }
  static __device__ __forceinline__ bool aligned_to(const void* p, unsigned n) {
    if (n > 16) n = 16;
    return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0;
  }
};
template <class T, GeluForm F>
struct GeluIn : Plain<T> {
  static __device__ __forceinline__ float op(float v) {
    return to_f<T>(from_f<T>(GeluFwdOp<F>{}(&v, 0)));
  }
  __device__ __forceinline__ void value(const typename Plain<T>::Raw& v, float* f) const {
    Plain<T>::value(v, f);
#pragma unroll
    for (int k = 0; k < kChunk; ++k) f[k] = op(f[k]);
  }
  __device__ __forceinline__ float load1(size_t at) const { return op(Plain<T>::load1(at)); }
};
template <class T, GeluForm F>
struct GradGelu {
  const T* dy;
  const T* pre;
  static __device__ __forceinline__ float op(float h, float g) {
    const float in[2] = {h, g};
    return to_f<T>(from_f<T>(GeluBwdOp<F>{}(in, 0)));
  }
  __device__ __forceinline__ bool aligned() const {
    return Plain<T>::aligned_to(dy, sizeof(Pack<T, kChunk>)) &&
           Plain<T>::aligned_to(pre, sizeof(Pack<T, kChunk>));
  }
  struct Raw {
    Pack<T, kChunk> g, h;
  };
  __device__ __forceinline__ void fetch(size_t at, Raw& r) const {
    r.g = *reinterpret_cast<const Pack<T, kChunk>*>(dy + at);
    r.h = *reinterpret_cast<const Pack<T, kChunk>*>(pre + at);
  }
  __device__ __forceinline__ void value(const Raw& r, float* f) const {
#pragma unroll
    for (int k = 0; k < kChunk; ++k) f[k] = op(to_f<T>(r.h.v[k]), to_f<T>(r.g.v[k]));
  }
  __device__ __forceinline__ float load1(size_t at) const {
    return op(to_f<T>(pre[at]), to_f<T>(dy[at]));
  }
};

// Whether a tile takes the vector path: whole, every row and column start a multiple of kChunk
// elements, the pointers aligned for kChunk-element loads and 8-byte stores.
template <class Src>
__device__ __forceinline__ bool vector_tile(const uint8_t* out, const uint8_t* out_t,
                                            const Src& src, int rows, int cols, int r0, int c0) {
  const auto a = [](const void* p, unsigned n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; };
  return r0 + kTileRows <= rows && c0 + kTileCols <= cols && cols % kChunk == 0 &&
         rows % kChunk == 0 && src.aligned() && a(out, 8) && a(out_t, 8);
}

// Each block casts `tiles` 64 x 128 tiles down one column of tiles. Vector path: each thread
// converts kChunk elements of four rows (16-byte loads of bf16/fp16, all four issued before the
// first is converted; two elements per conversion instruction) and stores their codes row-wise
// (8-byte stores) and into shared memory; then each thread reads one 8-row x 4-column block of
// the tile as eight 32-bit words (no bank conflicts: rows are 33 words apart and a warp reads 4
// row blocks x 8 word columns), transposes it with byte permutes and writes the 8 rows of each
// of its 4 columns (8-byte stores; a warp writes 32-byte runs). Tiles at the edges, and inputs
// whose shapes or pointers do not allow vectors, go element by element. With partial
// (fp8_cast_grad's bias gradient), the block's column sums of the values over its rows go to
// partial[blockIdx.y][cols], in a fixed order: each thread sums its column(s) down its rows,
// then the 16 row groups are added in turn. kSums: partial is set (the casts without it skip
// the sums' additions at compile time).
template <class T, class Src, bool kSums>
__global__ void __launch_bounds__(kThreads) fp8_cast_kernel(
    uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, float* __restrict__ amax, Src src,
    int rows, int cols, const float* __restrict__ scale_p, __nv_fp8_interpretation_t fmt,
    int tiles, float* __restrict__ partial) {
  constexpr int kStride = kTileCols + 4;  // bytes per shared row: 33 words
  __shared__ __align__(16) uint8_t tile[kTileRows][kStride];
  __shared__ int warp_max[32];
  constexpr int kGroups = kThreads * kChunk / kTileCols;  // 16 row groups of the column sums
  __shared__ float sums[kGroups][kTileCols];
  const int c0 = blockIdx.x * kTileCols;
  const float scale = scale_p[0];
  int m = 0;  // the thread's amax, as bits
  // the thread's column sums: the vector path's kChunk columns (tc fixed per thread), the
  // element path's one column
  float acc[kChunk], eacc = 0.0f;
#pragma unroll
  for (int k = 0; k < kChunk; ++k) acc[k] = 0.0f;
  for (int t = 0; t < tiles; ++t) {
    const int r0 = (blockIdx.y * tiles + t) * kTileRows;
    if (r0 >= rows) break;
    if (t > 0) __syncthreads();  // the previous tile's transpose has read the shared tile
    if (vector_tile(out, out_t, src, rows, cols, r0, c0)) {
      constexpr int kPerRow = kTileCols / kChunk;        // 16 threads per row
      constexpr int kIter = kTileRows * kPerRow / kThreads;  // 4 rows per thread
      static_assert(kIter * kThreads == kTileRows * kPerRow, "whole rows per pass");
      const int tr0 = threadIdx.x / kPerRow, tc = (threadIdx.x % kPerRow) * kChunk;
      typename Src::Raw raw[kIter];
#pragma unroll
      for (int i = 0; i < kIter; ++i)
        src.fetch(static_cast<size_t>(r0 + tr0 + i * (kThreads / kPerRow)) * cols + c0 + tc, raw[i]);
#pragma unroll
      for (int i = 0; i < kIter; ++i) {
        const int tr = tr0 + i * (kThreads / kPerRow);
        float f[kChunk];
        src.value(raw[i], f);
        uint32_t w[kChunk / 4];
#pragma unroll
        for (int k = 0; k < kChunk; k += 2) {
          m = max(m, max(abs_bits(f[k]), abs_bits(f[k + 1])));
          if constexpr (kSums) {
            acc[k] += f[k];
            acc[k + 1] += f[k + 1];
          }
          const uint32_t two = fp8x2_codes(f[k], f[k + 1], scale, fmt);
          if (k % 4 == 0) w[k / 4] = two;
          else w[k / 4] |= two << 16;
        }
        if (out)
          *reinterpret_cast<uint2*>(out + static_cast<size_t>(r0 + tr) * cols + c0 + tc) =
              make_uint2(w[0], w[1]);
        uint32_t* sw = reinterpret_cast<uint32_t*>(&tile[tr][tc]);
        sw[0] = w[0];
        sw[1] = w[1];
      }
      if (out_t) {
        __syncthreads();
        // warp wp: row blocks (wp & 1) * 4 + lane / 8, word columns (wp >> 1) * 8 + lane % 8
        const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
        const int rb = (wp & 1) * 4 + lane / 8, wc = (wp >> 1) * 8 + lane % 8;
        store_codes_8x4_transposed(&tile[0][0], kStride, rb, wc, out_t, c0, rows, r0 + rb * 8);
      }
    } else {
      for (int i = threadIdx.x; i < kTileRows * kTileCols; i += kThreads) {
        const int tr = i / kTileCols, tc = i % kTileCols;
        const int r = r0 + tr, c = c0 + tc;
        uint8_t code = 0;
        if (r < rows && c < cols) {
          const float v = src.load1(static_cast<size_t>(r) * cols + c);
          m = max(m, abs_bits(v));
          if constexpr (kSums) eacc += v;
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
  }
  if constexpr (kSums) {
    // Vector path: thread t summed columns (t % 16) * 8 + k of rows t / 16 + 16 i; element
    // path (edge tiles; a block's last tile short of 64 rows): column t % 128 of rows
    // t / 128 + 2 i. Both kinds of partial sums, then each column's in turn.
    __shared__ float esums[kThreads / kTileCols][kTileCols];
    const int g = threadIdx.x / (kTileCols / kChunk), tc = (threadIdx.x % (kTileCols / kChunk)) * kChunk;
#pragma unroll
    for (int k = 0; k < kChunk; ++k) sums[g][tc + k] = acc[k];
    esums[threadIdx.x / kTileCols][threadIdx.x % kTileCols] = eacc;
    __syncthreads();
    if (threadIdx.x < kTileCols && c0 + threadIdx.x < cols) {
      float s = 0.0f;
      for (int r = 0; r < kGroups; ++r) s += sums[r][threadIdx.x];
      for (int r = 0; r < kThreads / kTileCols; ++r) s += esums[r][threadIdx.x];
      partial[static_cast<size_t>(blockIdx.y) * cols + c0 + threadIdx.x] = s;
    }
  }
  block_amax_atomic(m, amax, warp_max);
}

// db[c] += the sum over p of partial[p][c], in a fixed order: 8 strided runs of the partials
// per column (one per thread row), then those 8 in turn.
__global__ void __launch_bounds__(256) add_partials_kernel(float* __restrict__ db,
                                                           const float* __restrict__ partial,
                                                           int parts, int cols) {
  __shared__ float s8[8][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float s = 0.0f;
  if (c < cols)
    for (int p = threadIdx.y; p < parts; p += 8) s += partial[static_cast<size_t>(p) * cols + c];
  s8[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = 0.0f;
    for (int y = 0; y < 8; ++y) t += s8[y][threadIdx.x];
    db[c] += t;
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

size_t CudaBackend::fp8_grad_scratch_bytes(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  const int64_t rows_per = int64_t(cuda::kTileRows) * cuda::kGradTiles;
  return static_cast<size_t>((rows + rows_per - 1) / rows_per) * static_cast<size_t>(cols) *
         sizeof(float);
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
    auto launch = [&](auto src) {
      cuda::fp8_cast_kernel<T, decltype(src), false><<<grid, cuda::kThreads, 0, stream_>>>(
          out, out_t, amax, src, rows, cols, scale, fmt, 1, nullptr);
    };
    const T* xt = static_cast<const T*>(x);
    if (!gelu_in) return launch(cuda::Plain<T>{xt});
    cuda::with_gelu_form<T>(*gelu_in, [&](auto form) {
      launch(cuda::GeluIn<T, decltype(form)::value>{{xt}});
    });
  });
  CUDA_CHECK(cudaGetLastError());
}

void CudaBackend::fp8_cast_grad(uint8_t* out, uint8_t* out_t, float* amax, const void* dy,
                                int rows, int cols, const float* scale, Fp8Format f, float* db,
                                const void* gelu_pre, Gelu g) {
  OpScope op_scope(*this, db ? "fp8_cast_grad + bias gradient" : "fp8_cast_grad");
  check_fp8_cast_args(out, out_t, amax, rows, cols, scale);
  if (rows == 0 || cols == 0) return;
  const int row_tiles = (rows + cuda::kTileRows - 1) / cuda::kTileRows;
  const int tiles = db ? cuda::kGradTiles : 1;
  const dim3 grid((cols + cuda::kTileCols - 1) / cuda::kTileCols, (row_tiles + tiles - 1) / tiles);
  VG_CHECK(grid.y <= 65535u, "fp8_cast_grad: " << rows << " rows exceed the grid");
  float* partial = db ? static_cast<float*>(scratch(fp8_grad_scratch_bytes(rows, cols))) : nullptr;
  const __nv_fp8_interpretation_t fmt = f == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
  cuda::dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto launch = [&](auto src) {
      if (partial)
        cuda::fp8_cast_kernel<T, decltype(src), true><<<grid, cuda::kThreads, 0, stream_>>>(
            out, out_t, amax, src, rows, cols, scale, fmt, tiles, partial);
      else
        cuda::fp8_cast_kernel<T, decltype(src), false><<<grid, cuda::kThreads, 0, stream_>>>(
            out, out_t, amax, src, rows, cols, scale, fmt, tiles, nullptr);
    };
    const T* d = static_cast<const T*>(dy);
    if (!gelu_pre) return launch(cuda::Plain<T>{d});
    cuda::with_gelu_form<T>(g, [&](auto form) {
      launch(cuda::GradGelu<T, decltype(form)::value>{d, static_cast<const T*>(gelu_pre)});
    });
  });
  CUDA_CHECK(cudaGetLastError());
  if (db) {
    cuda::add_partials_kernel<<<(cols + 31) / 32, dim3(32, 8), 0, stream_>>>(db, partial, grid.y,
                                                                             cols);
    CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace vitgrid
