// Elementwise ops (casts, GELU, dropout, add/accumulate/scale), row softmax and the
// deterministic column-sum reduction, with their backward passes side by side.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda_backend_impl.h"
#include "gelu_ops.cuh"
#include "kernel_util.cuh"
#include "vitgrid/core/rng.h"

namespace vitgrid {
namespace cuda {

template <class T, int NIN>
struct InPtrs {
  const T* p[NIN];
};

// y[i] = op(in_0[i], ..., in_{NIN-1}[i], i) in fp32, one rounding on store. The vector path
// moves 16 bytes per operand per thread when every pointer is 16-byte aligned. y may alias an
// input: each thread reads all of its operands before writing the same elements.
template <class Tout, class Tin, int NIN, class Op>
__global__ void map_kernel(Tout* y, InPtrs<Tin, NIN> in, size_t n, Op op, bool vec) {
  constexpr int V = 16 / (sizeof(Tin) > sizeof(Tout) ? sizeof(Tin) : sizeof(Tout));
  const size_t tid = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t done = 0;
  if (vec) {
    // U packs per thread per iteration, all loads in flight before any is used: 64 bytes of
    // loads per thread (four packs of a single input, two of each of two). On the H200
    // (bench_gpu_kernels, [N, 4C] of ViT-B): tanh GELU forward 3.46 -> 3.76 TB/s, its backward
    // 3.86 -> 3.98; add stays at 4.19. (Exact GELU forward now 3.6-3.8 TB/s, backward 4.1; U = 8
    // or the next packs' loads issued before the current ones are computed: slower.)
    constexpr int U = NIN == 1 ? 4 : 2;
    const size_t npk = n / V;
    for (size_t pk0 = tid; pk0 < npk; pk0 += U * stride) {
      Pack<Tin, V> a[U][NIN];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const size_t pk = pk0 + u * stride;
        if (pk >= npk) continue;
#pragma unroll
        for (int j = 0; j < NIN; ++j) a[u][j] = reinterpret_cast<const Pack<Tin, V>*>(in.p[j])[pk];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const size_t pk = pk0 + u * stride;
        if (pk >= npk) continue;
        Pack<Tout, V> o;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          float v[NIN];
#pragma unroll
          for (int j = 0; j < NIN; ++j) v[j] = to_f(a[u][j].v[e]);
          o.v[e] = from_f<Tout>(op(v, pk * V + e));
        }
        reinterpret_cast<Pack<Tout, V>*>(y)[pk] = o;
      }
    }
    done = npk * V;
  }
  for (size_t i = done + tid; i < n; i += stride) {
    float v[NIN];
#pragma unroll
    for (int j = 0; j < NIN; ++j) v[j] = to_f(in.p[j][i]);
    y[i] = from_f<Tout>(op(v, i));
  }
}

template <class Tout, class Tin, int NIN, class Op>
void launch_map(cudaStream_t st, Tout* y, InPtrs<Tin, NIN> in, size_t n, Op op) {
  if (n == 0) return;
  bool vec = aligned16(y);
  for (int j = 0; j < NIN; ++j) vec = vec && aligned16(in.p[j]);
  const int threads = 256;
  constexpr int V = 16 / (sizeof(Tin) > sizeof(Tout) ? sizeof(Tin) : sizeof(Tout));
  map_kernel<<<grid_for(vec ? (n + V - 1) / V : n, threads), threads, 0, st>>>(y, in, n, op,
                                                                               vec);
  CUDA_CHECK_LAUNCH();
}

struct CastOp {
  __device__ float operator()(const float* v, size_t) const { return v[0]; }
};
struct AddOp {
  __device__ float operator()(const float* v, size_t) const { return v[0] + v[1]; }
};
struct ScaleOp {
  float s;
  __device__ float operator()(const float* v, size_t) const { return v[0] * s; }
};

// Drop path's factors of a call (Backend::drop_path_factors): one thread per sample.
__global__ void drop_path_factors_kernel(float* out, int samples, DropoutKey k,
                                         uint32_t threshold, float scale) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= samples) return;
  uint64_t key, base;
  dropout_stream(k, &key, &base);
  out[i] = drop_path_keep(k.seed, key, drop_path_sample0(k) + i, threshold) ? scale : 0.0f;
}

// The mask bit of element i is the counter RNG at counter_base + i, as on the CPU.
// The counter of element i: contiguous (cols == 0), or, for a tensor-parallel column block of
// wider global rows, row * global_cols + col_offset + col (DropoutKey in backend.h), so every
// layout draws the 1-rank run's mask.
// Dropout and drop path (backend.h: dropout_keep, drop_path_keep). Per thread once: the stream
// (with the step and position read from device memory where k.position is set). Per 16-byte
// pack of V elements: their global counters (one division for a column block), one random word
// per four counters, and the sample's verdict (a pack never spans two samples: V divides the
// elements per sample wherever the vector path runs). U packs' loads are in flight before any
// is used, as in map_kernel.
template <class T>
__global__ void dropout_kernel(T* y, const T* x, size_t n, DropoutKey k, uint32_t threshold,
                               uint32_t path_threshold, float scale, bool vec) {
  uint64_t key, base;
  dropout_stream(k, &key, &base);
  const uint64_t stream = rng_stream(k.seed, key);
  const uint64_t sample0 = drop_path_sample0(k);
  auto sample_kept = [&](size_t i) {
    return path_threshold == 0 ||
           drop_path_keep(k.seed, key, sample0 + i / k.path_sample_elems, path_threshold);
  };
  auto elem_kept = [&](uint64_t c, uint64_t& word_at, uint64_t& word) {
    if (threshold == 0) return true;
    if ((c >> 2) != word_at) word = rng_word(stream, word_at = c >> 2);
    return dropout_keep_bits(word, c, threshold);
  };
  const size_t tid = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const uint64_t cols = static_cast<uint64_t>(k.cols);
  // the global counter of element i and the next: contiguous, or rows of a column block
  auto first = [&](size_t i, uint64_t& r, uint64_t& col) {
    if (cols == 0) return;
    r = i / cols;
    col = i - r * cols;
  };
  auto counter = [&](size_t i, uint64_t r, uint64_t col) {
    return cols == 0 ? base + i
                     : base + r * static_cast<uint64_t>(k.global_cols) +
                           static_cast<uint64_t>(k.col_offset) + col;
  };
  auto next = [&](uint64_t& r, uint64_t& col) {
    if (cols != 0 && ++col == cols) {
      col = 0;
      ++r;
    }
  };
  constexpr int V = 16 / sizeof(T);
  size_t done = 0;
  if (vec) {
    constexpr int U = 4;
    const size_t npk = n / V;
    for (size_t pk0 = tid; pk0 < npk; pk0 += U * stride) {
      Pack<T, V> a[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const size_t pk = pk0 + u * stride;
        if (pk < npk) a[u] = reinterpret_cast<const Pack<T, V>*>(x)[pk];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const size_t pk = pk0 + u * stride;
        if (pk >= npk) continue;
        uint64_t r = 0, col = 0, word_at = ~0ull, word = 0;
        first(pk * V, r, col);
        const bool kept = sample_kept(pk * V);
        Pack<T, V> o;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const uint64_t c = counter(pk * V + e, r, col);
          o.v[e] = from_f<T>(kept && elem_kept(c, word_at, word) ? to_f(a[u].v[e]) * scale : 0.0f);
          next(r, col);
        }
        reinterpret_cast<Pack<T, V>*>(y)[pk] = o;
      }
    }
    done = npk * V;
  }
  for (size_t i = done + tid; i < n; i += stride) {
    uint64_t r = 0, col = 0;
    first(i, r, col);
    const uint64_t c = counter(i, r, col);
    uint64_t word_at = ~0ull, word = 0;
    y[i] = from_f<T>(sample_kept(i) && elem_kept(c, word_at, word) ? to_f(x[i]) * scale : 0.0f);
  }
}

template <class T>
__global__ void add_act_to_f32_kernel(float* out, const T* x, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride)
    out[i] += to_f(x[i]);
}

// out[i] = sum over p < parts of in[p * c + i] in fp32, in part order, rounded once; V
// elements per thread and step (packs of V: nv = c / V of them).
template <class T, int V>
__global__ void sum_parts_act_kernel(T* out, const T* in, size_t nv, size_t c, int parts) {
  using P = Pack<T, V>;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < nv;
       i += stride) {
    float s[V];
    const P first = reinterpret_cast<const P*>(in)[i];
#pragma unroll
    for (int k = 0; k < V; ++k) s[k] = to_f(first.v[k]);
    for (int p = 1; p < parts; ++p) {
      const P v = reinterpret_cast<const P*>(in + p * c)[i];
#pragma unroll
      for (int k = 0; k < V; ++k) s[k] += to_f(v.v[k]);
    }
    P o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = from_f<T>(s[k]);
    reinterpret_cast<P*>(out)[i] = o;
  }
}

// One warp per row: max, sum of exponentials, then the normalised values. Rows are read
// three times; they are short (attention: T) and stay in L1/L2.
template <class Tin, class Tout>
__global__ void softmax_fwd_kernel(Tout* y, const Tin* x, int rows, int cols, float scale) {
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const Tin* xr = x + row * cols;
  Tout* yr = y + row * cols;
  float m = -INFINITY;
  for (int c = lane; c < cols; c += 32) m = fmaxf(m, scale * to_f(xr[c]));
  m = warp_max(m);
  float s = 0.0f;
  for (int c = lane; c < cols; c += 32) s += expf(scale * to_f(xr[c]) - m);
  s = warp_sum(s);
  const float inv = 1.0f / s;
  for (int c = lane; c < cols; c += 32) yr[c] = from_f<Tout>(expf(scale * to_f(xr[c]) - m) * inv);
}

// dx = y * (dy - sum(dy * y)) * scale, one warp per row.
template <class Ty, class Tdy, class Tdx>
__global__ void softmax_bwd_kernel(Tdx* dx, const Ty* y, const Tdy* dy, int rows, int cols,
                                   float scale) {
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const Ty* yr = y + row * cols;
  const Tdy* dyr = dy + row * cols;
  Tdx* dxr = dx + row * cols;
  float dot = 0.0f;
  for (int c = lane; c < cols; c += 32) dot += to_f(dyr[c]) * to_f(yr[c]);
  dot = warp_sum(dot);
  for (int c = lane; c < cols; c += 32)
    dxr[c] = from_f<Tdx>(to_f(yr[c]) * (to_f(dyr[c]) - dot) * scale);
}

// Column sums of a row-major [N, C] matrix, added into out[C] (fp32), deterministic: block
// (32 column lanes x 8 row lanes) sums a chunk of rows of its columns into
// partial[chunk, col], U rows' loads per lane in flight before any is summed; the last block
// of a column group to finish (a counter per group) adds the chunks' partials into out in a
// fixed order (so the sums do not depend on timing), and no second kernel runs. Where C is a
// multiple of V = 16 / sizeof(T) and the rows are 16-byte aligned, each lane reads V
// consecutive columns with one 16-byte load (a warp: 512 contiguous bytes of a row at 16-bit
// types), else one element. The values come from Src (load: the loads of one row's V
// elements; finish: their values): the matrix itself (ColsumRead), or the GELU backward that
// writes it in the same pass (ColsumGeluBwd).
constexpr int kColsumMinRows = 256;  // rows per chunk at least: bounds the partials (scratch)

template <class T, int V>
struct ColsumRead {
  const T* x;
  using Regs = Pack<T, V>;
  __device__ Regs load(int64_t i) const { return *reinterpret_cast<const Regs*>(x + i); }
  __device__ void finish(int64_t, const Regs& r, float* v) const {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = to_f(r.v[k]);
  }
};

// dx = dy * gelu'(h) (GeluBwdOp's math), written, and its stored (rounded) values summed.
template <class T, int V, class Op>
struct ColsumGeluBwd {
  T* dx;
  const T* h;
  const T* dy;
  struct Regs {
    Pack<T, V> h, g;
  };
  __device__ Regs load(int64_t i) const {
    return Regs{*reinterpret_cast<const Pack<T, V>*>(h + i),
                *reinterpret_cast<const Pack<T, V>*>(dy + i)};
  }
  __device__ void finish(int64_t i, const Regs& r, float* v) const {
    Pack<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float in[2] = {to_f(r.h.v[k]), to_f(r.g.v[k])};
      o.v[k] = from_f<T>(Op{}(in, 0));
      v[k] = to_f(o.v[k]);
    }
    *reinterpret_cast<Pack<T, V>*>(dx + i) = o;
  }
};

template <int V, int U, class Src>
__global__ void __launch_bounds__(256)
    colsum_kernel(float* out, float* partial, unsigned* done, Src src, int N, int C,
                  int rows_per_chunk) {
  __shared__ float sh[8][32 * V + 1];
  __shared__ bool last;
  const int col = (blockIdx.x * 32 + threadIdx.x) * V;
  const int r0 = blockIdx.y * rows_per_chunk;
  const int r1 = min(N, r0 + rows_per_chunk);
  float s[V];
#pragma unroll
  for (int k = 0; k < V; ++k) s[k] = 0.0f;
  if (col < C) {
    // U rows' loads issued before any of them is used, then summed in row order
    for (int r = r0 + threadIdx.y; r < r1; r += 8 * U) {
      typename Src::Regs q[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (r + 8 * u < r1) q[u] = src.load(static_cast<int64_t>(r + 8 * u) * C + col);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (r + 8 * u < r1) {
          float v[V];
          src.finish(static_cast<int64_t>(r + 8 * u) * C + col, q[u], v);
#pragma unroll
          for (int k = 0; k < V; ++k) s[k] += v[k];
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) sh[threadIdx.y][threadIdx.x * V + k] = s[k];
  __syncthreads();
  const int c0 = blockIdx.x * 32 * V;
  for (int c = threadIdx.y * 32 + threadIdx.x; c < 32 * V; c += 256) {
    if (c0 + c >= C) continue;
    float t = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) t += sh[j][c];
    partial[static_cast<int64_t>(blockIdx.y) * C + c0 + c] = t;
  }
  // the last block of this column group to get here adds the partials of every chunk
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0)
    last = atomicAdd(&done[blockIdx.x], 1u) == gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // lane y sums chunks y, y + 8, ... of columns x, x + 32, ...: V independent loads per chunk
  float t[V];
#pragma unroll
  for (int k = 0; k < V; ++k) t[k] = 0.0f;
  for (int ch = threadIdx.y; ch < static_cast<int>(gridDim.y); ch += 8) {
    const float* p = partial + static_cast<int64_t>(ch) * C + c0 + threadIdx.x;
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (c0 + threadIdx.x + 32 * k < C) t[k] += __ldcg(p + 32 * k);
  }
#pragma unroll
  for (int k = 0; k < V; ++k) sh[threadIdx.y][threadIdx.x + 32 * k] = t[k];
  __syncthreads();
  for (int c = threadIdx.y * 32 + threadIdx.x; c < 32 * V; c += 256) {
    if (c0 + c >= C) continue;
    float u = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) u += sh[j][c];
    out[c0 + c] += u;
  }
  if (threadIdx.x == 0 && threadIdx.y == 0) done[blockIdx.x] = 0;  // ready for the next call
}

template <class Tin, class Tout>
void launch_softmax_fwd(cudaStream_t st, Tout* y, const Tin* x, int rows, int cols,
                        float scale) {
  if (rows <= 0 || cols <= 0) return;
  const int threads = 256, warps = threads / 32;
  softmax_fwd_kernel<<<(rows + warps - 1) / warps, threads, 0, st>>>(y, x, rows, cols, scale);
  CUDA_CHECK_LAUNCH();
}
template <class Ty, class Tdy, class Tdx>
void launch_softmax_bwd(cudaStream_t st, Tdx* dx, const Ty* y, const Tdy* dy, int rows,
                        int cols, float scale) {
  if (rows <= 0 || cols <= 0) return;
  const int threads = 256, warps = threads / 32;
  softmax_bwd_kernel<<<(rows + warps - 1) / warps, threads, 0, st>>>(dx, y, dy, rows, cols,
                                                                     scale);
  CUDA_CHECK_LAUNCH();
}

// Instantiations used by attention.cu (scores kept in fp32).
#define VG_SOFTMAX_INST(T)                                                                   \
  template void launch_softmax_fwd<float, T>(cudaStream_t, T*, const float*, int, int, float); \
  template void launch_softmax_bwd<T, float, T>(cudaStream_t, T*, const T*, const float*, int, \
                                                int, float);
VG_SOFTMAX_INST(float)
VG_SOFTMAX_INST(__nv_bfloat16)
VG_SOFTMAX_INST(__half)

}  // namespace cuda

using namespace cuda;

void CudaBackend::cast_to_act(void* dst_act, const float* src, size_t n) {
  OpScope op_scope(*this, "cast_to_act");
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (std::is_same<T, float>::value) {
      copy(dst_act, src, n * sizeof(float));
    } else {
      launch_map(stream_, static_cast<T*>(dst_act), InPtrs<float, 1>{{src}}, n, CastOp{});
    }
  });
}

void CudaBackend::cast_to_f32(float* dst, const void* src_act, size_t n) {
  OpScope op_scope(*this, "cast_to_f32");
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (std::is_same<T, float>::value) {
      copy(dst, src_act, n * sizeof(float));
    } else {
      launch_map(stream_, dst, InPtrs<T, 1>{{static_cast<const T*>(src_act)}}, n, CastOp{});
    }
  });
}

void CudaBackend::gelu_forward(void* y, const void* x, size_t n, Gelu g) {
  OpScope op_scope(*this, "gelu_forward");
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    with_gelu_form<T>(g, [&](auto form) {
      launch_map(stream_, static_cast<T*>(y), InPtrs<T, 1>{{static_cast<const T*>(x)}}, n,
                 GeluFwdOp<decltype(form)::value>{});
    });
  });
}

void CudaBackend::gelu_backward(void* dx, const void* x, const void* dy, size_t n, Gelu g) {
  OpScope op_scope(*this, "gelu_backward");
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    with_gelu_form<T>(g, [&](auto form) {
      launch_map(stream_, static_cast<T*>(dx),
                 InPtrs<T, 2>{{static_cast<const T*>(x), static_cast<const T*>(dy)}}, n,
                 GeluBwdOp<decltype(form)::value>{});
    });
  });
}

void CudaBackend::dropout_forward(void* y, const void* x, size_t n, float p, DropoutKey k) {
  OpScope op_scope(*this, "dropout_forward");
  if (p <= 0.0f && k.path_p <= 0.0f) {
    copy(y, x, n * act_size());
    return;
  }
  if (n == 0) return;
  const float scale = dropout_scale(p, k.path_p);
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = 16 / sizeof(T);
    const bool vec = aligned16(y) && aligned16(x) &&
                     (k.path_p <= 0.0f || k.path_sample_elems % V == 0);
    dropout_kernel<T><<<grid_for(vec ? (n + V - 1) / V : n, 256), 256, 0, stream_>>>(
        static_cast<T*>(y), static_cast<const T*>(x), n, k, dropout_threshold(p),
        dropout_threshold(k.path_p), scale, vec);
    CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::drop_path_factors(float* out, int samples, DropoutKey k) {
  OpScope op_scope(*this, "drop_path_factors");
  if (samples <= 0) return;
  drop_path_factors_kernel<<<(samples + 255) / 256, 256, 0, stream_>>>(
      out, samples, k, dropout_threshold(k.path_p), dropout_scale(0.0f, k.path_p));
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::dropout_backward(void* dx, const void* dy, size_t n, float p, DropoutKey k) {
  OpScope op_scope(*this, "dropout_backward");
  // Same mask, same scale: the backward of y = m * x / (1-p) is dx = m * dy / (1-p).
  dropout_forward(dx, dy, n, p, k);
}

void CudaBackend::add(void* y, const void* a, const void* b, size_t n) {
  OpScope op_scope(*this, "add");
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_map(stream_, static_cast<T*>(y),
               InPtrs<T, 2>{{static_cast<const T*>(a), static_cast<const T*>(b)}}, n, AddOp{});
  });
}

void CudaBackend::accumulate(void* y, const void* x, size_t n) {
  OpScope op_scope(*this, "accumulate"); add(y, y, x, n); }

void CudaBackend::scale_f32(float* x, size_t n, float s) {
  OpScope op_scope(*this, "scale_f32");
  launch_map(stream_, x, InPtrs<float, 1>{{x}}, n, ScaleOp{s});
}

void CudaBackend::sum_parts_act_on(cudaStream_t st, void* out, const void* in, size_t c,
                                   int parts) {
  if (c == 0) return;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = 16 / sizeof(T);
    const bool vec = c % V == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(in) % 16 == 0;
    if (vec) {
      sum_parts_act_kernel<T, V><<<grid_for(c / V, 256), 256, 0, st>>>(
          static_cast<T*>(out), static_cast<const T*>(in), c / V, c, parts);
    } else {
      sum_parts_act_kernel<T, 1><<<grid_for(c, 256), 256, 0, st>>>(
          static_cast<T*>(out), static_cast<const T*>(in), c, c, parts);
    }
    CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::add_act_to_f32(float* out, const void* x, size_t n) {
  if (n == 0) return;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    add_act_to_f32_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(out, static_cast<const T*>(x),
                                                                  n);
    CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::softmax_forward(void* y, const void* x, int rows, int cols, float scale) {
  OpScope op_scope(*this, "softmax_forward");
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rows <= 0 || cols <= 0) return;
    const int threads = 256, warps = threads / 32;
    softmax_fwd_kernel<<<(rows + warps - 1) / warps, threads, 0, stream_>>>(
        static_cast<T*>(y), static_cast<const T*>(x), rows, cols, scale);
    CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::softmax_backward(void* dx, const void* y, const void* dy, int rows, int cols,
                                   float scale) {
  OpScope op_scope(*this, "softmax_backward");
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_softmax_bwd(stream_, static_cast<T*>(dx), static_cast<const T*>(y),
                       static_cast<const T*>(dy), rows, cols, scale);
  });
}

// column_sums_add's partials: one row of C per chunk, chunks of kColsumMinRows rows at most.
size_t CudaBackend::column_sums_scratch_bytes(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  const int64_t chunks = (rows + kColsumMinRows - 1) / kColsumMinRows;
  return static_cast<size_t>(chunks) * static_cast<size_t>(cols) * sizeof(float);
}

// The column sums of a [N, C] matrix whose values src produces (column_sums_add,
// gelu_backward_bias), into out: one kernel, U rows in flight per lane, chunks of rows such
// that about `blocks` blocks run (at least kColsumMinRows rows each; blocks = 0: chunks of
// kColsumMinRows rows).
template <class T, int U, class Src, class SrcV>
void CudaBackend::column_sums(float* out, int N, int C, bool vec, Src src, SrcV src_vec,
                              int blocks) {
  if (N <= 0 || C <= 0) return;
  constexpr int V = 16 / sizeof(T);
  const int groups = vec ? (C / V + 31) / 32 : (C + 31) / 32;
  int rows = kColsumMinRows;
  if (blocks > 0) {
    const int want = std::max(1, blocks / groups);
    rows = std::max(kColsumMinRows, ((N + want - 1) / want + 63) / 64 * 64);
  }
  const int chunks = (N + rows - 1) / rows;
  float* partial = static_cast<float*>(scratch(static_cast<size_t>(chunks) * C * sizeof(float)));
  unsigned* done = colsum_counters(groups);
  auto launch = [&](auto kernel, auto source) {
    kernel<<<dim3(groups, chunks), dim3(32, 8), 0, stream_>>>(out, partial, done, source, N, C,
                                                              rows);
    CUDA_CHECK_LAUNCH();
  };
  if (vec) {
    launch(colsum_kernel<V, U, SrcV>, src_vec);
  } else {
    launch(colsum_kernel<1, U, Src>, src);
  }
}

void CudaBackend::column_sums_add(float* out, const void* x, int N, int C) {
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = 16 / sizeof(T);
    const T* p = static_cast<const T*>(x);
    // 8 rows in flight, about 1.5 blocks per SM (bench_gpu_kernels BM_ColumnSums, H200, ViT-B:
    // 0.037 -> 0.030 ms at C = 768, 0.081 -> 0.065 at 2304 against one row, 256-row chunks)
    column_sums<T, 8>(out, N, C, C % V == 0 && aligned16(x), ColsumRead<T, 1>{p},
                      ColsumRead<T, V>{p}, sm_count_ * 3 / 2);
  });
}

void CudaBackend::gelu_backward_bias(void* dx, const void* x, const void* dy, int rows, int cols,
                                     float* db, Gelu g) {
  OpScope op_scope(*this, db ? "gelu_backward + bias gradient" : "gelu_backward");
  if (!db) return gelu_backward(dx, x, dy, static_cast<size_t>(rows) * cols, g);
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = 16 / sizeof(T);
    T* d = static_cast<T*>(dx);
    const T *h = static_cast<const T*>(x), *gy = static_cast<const T*>(dy);
    const bool vec = cols % V == 0 && aligned16(dx) && aligned16(x) && aligned16(dy);
    with_gelu_form<T>(g, [&](auto form) {
      using Op = GeluBwdOp<decltype(form)::value>;
      // 2 rows in flight (more: registers, fewer blocks per SM), 256-row chunks: 0.281 ->
      // 0.262 ms at ViT-B's [50432, 3072] against one row (one wave of longer chunks: the same)
      column_sums<T, 2>(db, rows, cols, vec, ColsumGeluBwd<T, 1, Op>{d, h, gy},
                        ColsumGeluBwd<T, V, Op>{d, h, gy}, 0);
    });
  });
}

}  // namespace vitgrid
