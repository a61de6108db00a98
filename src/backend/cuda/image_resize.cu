// The device's crop + resize + flip of a batch of decoded images (nvjpeg_decoder.cpp): Pillow's
// two-pass antialiased resampling (image_resize.cuh) with the same fixed-point arithmetic, so
// the output equals data/image_transform.h resample() on the same decoded pixels. Two launches
// per batch, every image of the batch in each: the horizontal pass of the source rows the
// vertical pass needs (into uint8, rounded and clipped, as Pillow), then the vertical pass with
// the left-right mirror folded into the store. Each block computes the coefficients it uses in
// shared memory (a few hundred double evaluations per block), so nothing is precomputed on the
// host.
#include <cuda_runtime.h>

#include <algorithm>

#include "image_resize.cuh"
#include "nvjpeg_decoder.h"
#include "vitgrid/backend/cuda/cuda_check.h"

namespace vitgrid {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerVerticalBlock = 8;

// The rows [first, last) of the source the vertical pass reads (Pillow's ybox_first/last).
__device__ void vertical_span(const ResizeJob& j, int S, int interp, int* first, int* last) {
  const ResampleAxis ay = resample_axis(interp, j.H, j.y0, j.y1, j.ry, j.oy);
  *first = resample_first(ay, 0);
  *last = resample_end(ay, S - 1);
}

// grid (blocks per image, images): the horizontal pass of rows [ybox_first, ybox_last) of
// each source into job.tmp [rows][S][3]. Shared: kcap x S weights, S first-tap indices, S
// tap counts.
__global__ void resize_horizontal_kernel(const ResizeJob* __restrict__ jobs, int S, int interp,
                                         int kcap) {
  extern __shared__ int32_t smem[];
  int32_t* kw = smem;              // [kcap][S]
  int32_t* first = kw + kcap * S;  // [S]
  int32_t* count = first + S;      // [S]
  const ResizeJob j = jobs[blockIdx.y];
  const ResampleAxis ax = resample_axis(interp, j.W, j.x0, j.x1, j.rx, j.ox);
  for (int x = threadIdx.x; x < S; x += blockDim.x) {
    int f = 0;
    count[x] = resample_taps(interp, ax, x, &f, kw + x, S, kcap);
    first[x] = f;
  }
  int y_first = 0, y_last = 0;
  vertical_span(j, S, interp, &y_first, &y_last);
  __syncthreads();
  const int rows = min(y_last - y_first, j.tmp_rows);
  const int total = rows * S;
  const uint8_t* r_plane = j.src;
  const uint8_t* g_plane = j.gray ? j.src : j.src + j.plane;
  const uint8_t* b_plane = j.gray ? j.src : j.src + 2 * j.plane;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int r = i / S, x = i - r * S;
    const ptrdiff_t row = static_cast<ptrdiff_t>(y_first + r - j.org_y) * j.pitch;
    const int n = count[x];
    const int x0 = first[x] - j.org_x;
    int32_t s0 = kResampleHalf, s1 = kResampleHalf, s2 = kResampleHalf;
    for (int t = 0; t < n; ++t) {
      const int32_t w = kw[t * S + x];
      const ptrdiff_t o = row + static_cast<ptrdiff_t>(x0 + t) * j.step;
      s0 += static_cast<int32_t>(r_plane[o]) * w;
      s1 += static_cast<int32_t>(g_plane[o]) * w;
      s2 += static_cast<int32_t>(b_plane[o]) * w;
    }
    uint8_t* d = j.tmp + (static_cast<size_t>(r) * S + x) * 3;
    d[0] = resample_clip8(s0);
    d[1] = resample_clip8(s1);
    d[2] = resample_clip8(s2);
  }
}

// grid (S / rows per block, images): output rows [r0, r0 + R) of each image from job.tmp,
// mirrored when job.flip, into job.dst [S][S][3]. Shared: kcap x R weights, R first taps
// (relative to ybox_first), R tap counts.
__global__ void resize_vertical_kernel(const ResizeJob* __restrict__ jobs, int S, int interp,
                                       int kcap) {
  constexpr int R = kRowsPerVerticalBlock;
  extern __shared__ int32_t smem[];
  int32_t* kw = smem;              // [kcap][R]
  int32_t* first = kw + kcap * R;  // [R]
  int32_t* count = first + R;      // [R]
  const ResizeJob j = jobs[blockIdx.y];
  const int r0 = blockIdx.x * R;
  const int rows = min(R, S - r0);
  const ResampleAxis ay = resample_axis(interp, j.H, j.y0, j.y1, j.ry, j.oy);
  const int y_first = resample_first(ay, 0);
  if (threadIdx.x < rows) {
    int f = 0;
    count[threadIdx.x] = resample_taps(interp, ay, r0 + threadIdx.x, &f, kw + threadIdx.x, R, kcap);
    first[threadIdx.x] = f - y_first;
  }
  __syncthreads();
  const int total = rows * S;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int r = i / S, x = i - r * S;
    int n = count[r];
    const int y0 = first[r];
    if (y0 + n > j.tmp_rows) n = max(0, j.tmp_rows - y0);  // only if the host bound was short
    int32_t s0 = kResampleHalf, s1 = kResampleHalf, s2 = kResampleHalf;
    const uint8_t* src = j.tmp + (static_cast<size_t>(y0) * S + x) * 3;
    for (int t = 0; t < n; ++t) {
      const int32_t w = kw[t * R + r];
      const uint8_t* p = src + static_cast<size_t>(t) * S * 3;
      s0 += static_cast<int32_t>(p[0]) * w;
      s1 += static_cast<int32_t>(p[1]) * w;
      s2 += static_cast<int32_t>(p[2]) * w;
    }
    const int ox = j.flip ? S - 1 - x : x;
    uint8_t* d = j.dst + (static_cast<size_t>(r0 + r) * S + ox) * 3;
    d[0] = resample_clip8(s0);
    d[1] = resample_clip8(s1);
    d[2] = resample_clip8(s2);
  }
}

}  // namespace

size_t resize_tmp_rows_bound(int interp, int H, float y0, float y1, int ry, int oy, int S) {
  const ResampleAxis ay = resample_axis(interp, H, y0, y1, ry, oy);
  const int lo = std::max(0, resample_first(ay, 0));
  const int hi = std::min(H, resample_end(ay, S - 1));
  return static_cast<size_t>(std::max(0, hi - lo) + 2);  // +2: host/device rounding slack
}

int resize_taps_bound(int interp, int in_size, float in0, float in1, int r) {
  return resample_axis(interp, in_size, in0, in1, r).ksize + 2;
}

void launch_resize(const ResizeJob* jobs_dev, int n, int S, int interp, int kcap_h, int kcap_v,
                   int max_tmp_rows, cudaStream_t stream) {
  if (n == 0) return;
  const size_t smem_h = (static_cast<size_t>(kcap_h) * S + 2 * S) * sizeof(int32_t);
  const size_t smem_v =
      (static_cast<size_t>(kcap_v) * kRowsPerVerticalBlock + 2 * kRowsPerVerticalBlock) *
      sizeof(int32_t);
  if (smem_h > 48 * 1024) {
    CUDA_CHECK(cudaFuncSetAttribute(resize_horizontal_kernel,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem_h)));
  }
  // Enough blocks per image that each thread handles a few rows' pixels.
  const int per_image_h = std::max(1, std::min(16, (max_tmp_rows * S) / (kThreads * 8)));
  resize_horizontal_kernel<<<dim3(per_image_h, n), kThreads, smem_h, stream>>>(jobs_dev, S,
                                                                               interp, kcap_h);
  CUDA_CHECK_LAUNCH();
  const int per_image_v = (S + kRowsPerVerticalBlock - 1) / kRowsPerVerticalBlock;
  resize_vertical_kernel<<<dim3(per_image_v, n), kThreads, smem_v, stream>>>(jobs_dev, S, interp,
                                                                             kcap_v);
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace vitgrid
