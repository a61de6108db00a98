// Reductions that return to the host (sum of squares per slice, sum, all-finite), the same
// into device scalars (sum_into, sum_squares_total, clip_factor: nothing waits), and the
// multi-tensor optimizer updates (AdamW, LAMB, SGD). Every multi-tensor launch is one grid
// over the chunk table of its slice list (uploaded once, cached by CudaBackend::slice_table);
// block i updates chunk i. Reductions are two-stage with a fixed order (deterministic) and
// accumulate in double.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cuda_backend_impl.h"
#include "kernel_util.cuh"

namespace vitgrid {
namespace cuda {

constexpr int kOptThreads = 256;

__global__ void chunk_sumsq_kernel(double* partial, const float* buf, const SliceChunk* chunks) {
  __shared__ double sh[32];
  const SliceChunk ck = chunks[blockIdx.x];
  const float* x = buf + ck.offset;
  double s = 0.0;
  for (uint32_t i = threadIdx.x; i < ck.n; i += blockDim.x) {
    const double v = x[i];
    s += v * v;
  }
  s = block_sum(s, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
__global__ void slice_total_kernel(double* out, const double* partial, const uint32_t* first,
                                   int nslices) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= nslices) return;
  double s = 0.0;
  for (uint32_t k = first[i]; k < first[i + 1]; ++k) s += partial[k];
  out[i] = s;
}

// The local step of the copy-engine reduce-scatter (NcclCollectives, device.data_comm =
// copy_engine): out[i] = sum over p < parts of in[p * c + i], in part order, in fp32: every
// element the same sum on every rank that computes it.
__global__ void sum_parts_vec_kernel(float4* out, const float4* in, size_t c4, int parts) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < c4;
       i += size_t(gridDim.x) * blockDim.x) {
    float4 s = in[i];
    for (int p = 1; p < parts; ++p) {
      const float4 v = in[p * c4 + i];
      s.x += v.x;
      s.y += v.y;
      s.z += v.z;
      s.w += v.w;
    }
    out[i] = s;
  }
}
__global__ void sum_parts_kernel(float* out, const float* in, size_t c, int parts) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < c;
       i += size_t(gridDim.x) * blockDim.x) {
    float s = in[i];
    for (int p = 1; p < parts; ++p) s += in[p * c + i];
    out[i] = s;
  }
}

constexpr int kSumBlocks = 1024;  // fixed grid: the reduction order depends on n only
__global__ void sum_partial_kernel(double* partial, const float* x, size_t n) {
  __shared__ double sh[32];
  double s = 0.0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
    s += x[i];
  s = block_sum(s, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
__global__ void sum_final_kernel(double* out, const double* partial, int np) {
  __shared__ double sh[32];
  double s = 0.0;
  for (int i = threadIdx.x; i < np; i += blockDim.x) s += partial[i];
  s = block_sum(s, sh);
  if (threadIdx.x == 0) *out = s;
}

// *acc += the partials' sum (one block, fixed order)
__global__ void sum_accumulate_kernel(double* acc, const double* partial, int np) {
  __shared__ double sh[32];
  double s = 0.0;
  for (int i = threadIdx.x; i < np; i += blockDim.x) s += partial[i];
  s = block_sum(s, sh);
  if (threadIdx.x == 0) *acc += s;
}

// backend.h's clip_factor, in the host code's arithmetic (double norm, float factor)
__global__ void clip_factor_kernel(float* out, const double* sq, double max_norm,
                                   float inv_scale) {
  const double g = sqrt(*sq) * static_cast<double>(inv_scale);
  float coef = 1.0f;
  if (max_norm > 0.0 && g > max_norm) coef = static_cast<float>(max_norm / (g + 1e-6));
  *out = coef * inv_scale;
}

__global__ void all_finite_kernel(int* flag, const float* x, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  bool bad = false;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
    bad |= !isfinite(x[i]);
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;  // same value from every writer
}

struct AdamDev {
  float lr, beta1, beta2, eps, grad_scale;
  float bc1, bc2;  // bias corrections 1 - beta^step
  const float* grad_scale_dev;  // null, or a device factor applied on top of grad_scale
};
__device__ __forceinline__ float total_scale(float s, const float* dev) {
  return dev ? s * *dev : s;
}

// PyTorch AdamW (decoupled weight decay), written as backend.h states it:
// p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p).
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v,
                             const SliceChunk* chunks, AdamDev a) {
  const SliceChunk ck = chunks[blockIdx.x];
  const float gs = total_scale(a.grad_scale, a.grad_scale_dev);
  for (uint32_t j = threadIdx.x; j < ck.n; j += blockDim.x) {
    const size_t i = ck.offset + j;
    const float gg = g[i] * gs;
    const float mi = a.beta1 * m[i] + (1.0f - a.beta1) * gg;
    const float vi = a.beta2 * v[i] + (1.0f - a.beta2) * gg * gg;
    m[i] = mi;
    v[i] = vi;
    const float mhat = mi / a.bc1, vhat = vi / a.bc2;
    const float pi = p[i];
    p[i] = pi - a.lr * (mhat / (sqrtf(vhat) + a.eps) + ck.weight_decay * pi);
  }
}

// LAMB phase 1: u = mhat / (sqrt(vhat) + eps) + wd * p, moments updated, p untouched.
__global__ void lamb_direction_kernel(float* u, const float* p, const float* g, float* m,
                                      float* v, const SliceChunk* chunks, AdamDev a) {
  const SliceChunk ck = chunks[blockIdx.x];
  const float gs = total_scale(a.grad_scale, a.grad_scale_dev);
  for (uint32_t j = threadIdx.x; j < ck.n; j += blockDim.x) {
    const size_t i = ck.offset + j;
    const float gg = g[i] * gs;
    const float mi = a.beta1 * m[i] + (1.0f - a.beta1) * gg;
    const float vi = a.beta2 * v[i] + (1.0f - a.beta2) * gg * gg;
    m[i] = mi;
    v[i] = vi;
    u[i] = (mi / a.bc1) / (sqrtf(vi / a.bc2) + a.eps) + ck.weight_decay * p[i];
  }
}

// LAMB phase 2: p -= lr * ratio[slice] * u
__global__ void lamb_apply_kernel(float* p, const float* u, const SliceChunk* chunks,
                                  const float* ratio, float lr) {
  const SliceChunk ck = chunks[blockIdx.x];
  const float s = lr * ratio[ck.slice];
  for (uint32_t j = threadIdx.x; j < ck.n; j += blockDim.x) {
    const size_t i = ck.offset + j;
    p[i] -= s * u[i];
  }
}

// PyTorch SGD with momentum, dampening 0: d = g*gs + wd*p; b = mu*b + d;
// p -= lr * (nesterov ? d + mu*b : b).
__global__ void sgd_kernel(float* p, const float* g, float* mom, const SliceChunk* chunks,
                           float lr, float mu, bool nesterov, float gs0, const float* gs_dev) {
  const SliceChunk ck = chunks[blockIdx.x];
  const float gs = total_scale(gs0, gs_dev);
  for (uint32_t j = threadIdx.x; j < ck.n; j += blockDim.x) {
    const size_t i = ck.offset + j;
    const float pi = p[i];
    const float d = g[i] * gs + ck.weight_decay * pi;
    const float b = mu * mom[i] + d;
    mom[i] = b;
    p[i] = pi - lr * (nesterov ? d + mu * b : b);
  }
}

AdamDev adam_dev(const AdamParams& a) {
  AdamDev d;
  d.lr = a.lr;
  d.beta1 = a.beta1;
  d.beta2 = a.beta2;
  d.eps = a.eps;
  d.grad_scale = a.grad_scale;
  d.bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(a.beta1), a.step));
  d.bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(a.beta2), a.step));
  d.grad_scale_dev = a.grad_scale_dev;
  return d;
}

}  // namespace cuda

using namespace cuda;

// sum_squares' partials: (nchunks + nslices) doubles for its list. Any one list of the planned
// ones has at most `slices` slices and elems / kChunkElems + slices chunks.
size_t CudaBackend::sum_squares_scratch_bytes(int64_t lists, int64_t slices, int64_t elems) {
  if (lists <= 0 || slices <= 0) return 0;
  const size_t S = static_cast<size_t>(slices);
  const size_t chunks = static_cast<size_t>(std::max<int64_t>(elems, 0)) / kChunkElems + S;
  return (chunks + S) * sizeof(double);
}

void CudaBackend::sum_squares(double* out_host, const float* buf,
                              const std::vector<ParamSlice>& slices) {
  if (slices.empty()) return;
  const SliceTable& t = slice_table(slices);
  double* partial = static_cast<double*>(
      scratch((static_cast<size_t>(t.nchunks) + t.nslices) * sizeof(double)));
  double* out = partial + t.nchunks;
  if (t.nchunks > 0) {
    chunk_sumsq_kernel<<<t.nchunks, kOptThreads, 0, stream_>>>(partial, buf, t.chunks);
    CUDA_CHECK_LAUNCH();
  }
  slice_total_kernel<<<(t.nslices + 255) / 256, 256, 0, stream_>>>(out, partial, t.first_chunk,
                                                                    t.nslices);
  CUDA_CHECK_LAUNCH();
  copy_to_host(out_host, out, t.nslices * sizeof(double));
}

double CudaBackend::sum(const float* x, size_t n) {
  if (n == 0) return 0.0;
  sum_partial_kernel<<<kSumBlocks, 256, 0, stream_>>>(reduce_buf_ + 1, x, n);
  CUDA_CHECK_LAUNCH();
  sum_final_kernel<<<1, 1024, 0, stream_>>>(reduce_buf_, reduce_buf_ + 1, kSumBlocks);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaMemcpyAsync(host_pinned_, reduce_buf_, sizeof(double), cudaMemcpyDeviceToHost,
                             stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  double r;
  std::memcpy(&r, host_pinned_, sizeof r);
  return r;
}

void CudaBackend::sum_parts_on(cudaStream_t st, float* out, const float* in, size_t c,
                               int parts) {
  if (c == 0) return;
  constexpr int kThreads = 256;
  const bool vec = c % 4 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(in) % 16 == 0;
  const size_t n = vec ? c / 4 : c;
  const int grid = static_cast<int>(std::min<size_t>((n + kThreads - 1) / kThreads, 1024));
  if (vec) {
    cuda::sum_parts_vec_kernel<<<grid, kThreads, 0, st>>>(
        reinterpret_cast<float4*>(out), reinterpret_cast<const float4*>(in), n, parts);
  } else {
    cuda::sum_parts_kernel<<<grid, kThreads, 0, st>>>(out, in, c, parts);
  }
  CUDA_CHECK(cudaGetLastError());
}

void CudaBackend::sum_into(double* acc, const float* x, size_t n) {
  if (n == 0) return;
  // per-sample losses: a few hundred values, a few blocks (the order depends on n only)
  const int blocks = static_cast<int>(std::min<size_t>(kSumBlocks, (n + 255) / 256));
  sum_partial_kernel<<<blocks, 256, 0, stream_>>>(reduce_buf_ + 1, x, n);
  CUDA_CHECK_LAUNCH();
  sum_accumulate_kernel<<<1, 1024, 0, stream_>>>(acc, reduce_buf_ + 1, blocks);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::sum_squares_total(double* out, const float* buf,
                                    const std::vector<ParamSlice>& slices) {
  OpScope op_scope(*this, "grad_norm");
  const SliceTable& t = slice_table(slices);
  if (t.nchunks == 0) {
    CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), stream_));
    return;
  }
  // the per-chunk partials of sum_squares, then one fixed-order sum over them
  double* partial = static_cast<double*>(scratch(static_cast<size_t>(t.nchunks) * sizeof(double)));
  chunk_sumsq_kernel<<<t.nchunks, kOptThreads, 0, stream_>>>(partial, buf, t.chunks);
  CUDA_CHECK_LAUNCH();
  sum_final_kernel<<<1, 1024, 0, stream_>>>(out, partial, t.nchunks);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::clip_factor(float* out, const double* sq, double max_norm, float inv_scale) {
  clip_factor_kernel<<<1, 1, 0, stream_>>>(out, sq, max_norm, inv_scale);
  CUDA_CHECK_LAUNCH();
}

bool CudaBackend::all_finite(const float* x, size_t n) {
  if (n == 0) return true;
  CUDA_CHECK(cudaMemsetAsync(flag_, 0, sizeof(int), stream_));
  all_finite_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(flag_, x, n);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaMemcpyAsync(host_pinned_, flag_, sizeof(int), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  int f;
  std::memcpy(&f, host_pinned_, sizeof f);
  return f == 0;
}

void CudaBackend::adamw_update(float* p, const float* g, float* m, float* v,
                               const std::vector<ParamSlice>& slices, const AdamParams& a) {
  OpScope op_scope(*this, "adamw_update");
  const SliceTable& t = slice_table(slices);
  if (t.nchunks == 0) return;
  adamw_kernel<<<t.nchunks, kOptThreads, 0, stream_>>>(p, g, m, v, t.chunks, adam_dev(a));
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::lamb_direction(float* u, const float* p, const float* g, float* m, float* v,
                                 const std::vector<ParamSlice>& slices, const AdamParams& a) {
  OpScope op_scope(*this, "lamb_direction");
  const SliceTable& t = slice_table(slices);
  if (t.nchunks == 0) return;
  lamb_direction_kernel<<<t.nchunks, kOptThreads, 0, stream_>>>(u, p, g, m, v, t.chunks,
                                                                adam_dev(a));
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::lamb_apply(float* p, const float* u, const std::vector<ParamSlice>& slices,
                             const std::vector<float>& ratio_host, float lr) {
  OpScope op_scope(*this, "lamb_apply");
  const SliceTable& t = slice_table(slices);
  VG_CHECK(ratio_host.size() == slices.size(),
           "lamb_apply: " << ratio_host.size() << " ratios for " << slices.size() << " slices");
  if (t.nchunks == 0) return;
  // From pageable memory cudaMemcpyAsync returns once the source is staged, so the caller's
  // vector may change afterwards; the stream orders the copy before the kernel.
  CUDA_CHECK(cudaMemcpyAsync(t.ratio, ratio_host.data(), ratio_host.size() * sizeof(float),
                             cudaMemcpyHostToDevice, stream_));
  lamb_apply_kernel<<<t.nchunks, kOptThreads, 0, stream_>>>(p, u, t.chunks, t.ratio, lr);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::sgd_update(float* p, const float* g, float* mom,
                             const std::vector<ParamSlice>& slices, float lr, float momentum,
                             bool nesterov, float grad_scale, const float* grad_scale_dev) {
  OpScope op_scope(*this, "sgd_update");
  const SliceTable& t = slice_table(slices);
  if (t.nchunks == 0) return;
  sgd_kernel<<<t.nchunks, kOptThreads, 0, stream_>>>(p, g, mom, t.chunks, lr, momentum,
                                                     nesterov, grad_scale, grad_scale_dev);
  CUDA_CHECK_LAUNCH();
}

}  // namespace vitgrid
