// Fused GEMM + exact-GELU kernels for the MLP (gemm_gelu*.cu): CUTLASS 3 sm90a
// warp-specialized (TMA + wgmma) persistent GEMMs whose epilogues do the GELU pass that otherwise
// follows the cuBLASLt GEMM as a separate elementwise kernel. Only built with CUTLASS
// (VITGRID_HAVE_CUTLASS); without it gemm_gelu_available() is false, every shape is unsupported
// and there are no configurations. This header pulls in neither CUTLASS nor the CUDA headers
// beyond the runtime API. Internal: included only by src/backend/cuda (and its tests/benches).
//
// Layouts (row-major, as the backend's linear ops): x [N, in], W [out, in], b [out],
// h and g [N, out], dy [N, out], dx [N, in]; all in the act dtype T (bf16 or fp16), fp32
// accumulation.
//  * gemm_bias_gelu_forward: z = x W^T + b in fp32, h = T(z), g = T(gelu(float(h))) with the
//    GELU of gelu_math.cuh: g is bit-identical to CudaBackend::gelu_forward(g, h, Gelu::Exact).
//    b may be null (no bias).
//  * gemm_dgelu_backward: dx = T(float(dy W) * gelu'(float(h))), the derivative as in
//    CudaBackend::gelu_backward (one rounding instead of two).
// Pointers must be 16-byte aligned (the backend's allocations are); asserted in debug builds.
// Both only enqueue on the stream: no allocation, no host synchronisation. A CUTLASS
// can_implement / initialize / launch failure is fatal (VG_FAIL naming the shape and the
// configuration).
//
// Configurations: per act dtype and direction a list of compiled kernels (schedule, CTA tile,
// cluster, epilogue subtile; gemm_gelu_kernel_count), each runnable with kGemmGeluSchedules
// settings of the persistent tile scheduler (raster order and swizzle: run-time arguments, no
// extra code). Configuration id = kernel + kernels * schedule, so ids 0 .. kernels - 1 are the
// kernels with CUTLASS's default scheduling, and id 0 is the default configuration. Which one
// is fastest depends on the shape; CudaBackend times them (device.gemm_tune, see
// cuda_gemm.cpp). Every configuration computes the same function; results differ between
// configurations only in the fp32 accumulation order of the GEMM.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "vitgrid/core/types.h"

namespace vitgrid {
namespace cuda {

// Built with CUTLASS and the current device is sm_90 (compute capability 9.0 exactly).
bool gemm_gelu_available();
// Multiprocessors the kernels launched from now on leave free (Backend::set_gemm_sm_margin):
// their persistent grids size to the device's count minus this (at least 1). Per process.
void gemm_gelu_set_sm_margin(int sms);
// The shapes the fused kernels take: act bf16 or fp16, in % 8 == 0, out % 8 == 0, N >= 1
// (and in, out >= 8).
bool gemm_gelu_supported(DType act, int N, int in, int out);
// Workspace bytes the kernels need for this shape, the most over every configuration of both
// directions (0 if none); the caller passes at least this.
size_t gemm_gelu_workspace_bytes(DType act, int N, int in, int out);

// Tile-scheduler settings per kernel: 0 CUTLASS's default (no swizzle, raster order by its
// heuristic: along N unless the tile grid has more columns than rows, so for the MLP's tall
// shapes 0 and 1 are the same), 1-4 raster along N (consecutive tiles share a row block of x /
// dy) with swizzle 1, 2, 4, 8, 5-8 raster along M (they share W's column block) with swizzle
// 1, 2, 4, 8.
constexpr int kGemmGeluSchedules = 9;
// Compiled kernels for act in that direction (0 without CUTLASS, or for F32).
int gemm_gelu_kernel_count(DType act, bool forward);
// Configuration ids: 0 .. gemm_gelu_config_count - 1 (kernels * kGemmGeluSchedules).
int gemm_gelu_config_count(DType act, bool forward);
// E.g. "coop 128x256x64 cluster 2x1" or "pingpong 128x128x64 cluster 2x1 epi 64x64, raster M
// swizzle 4"; "" for an id out of range.
std::string gemm_gelu_config_name(DType act, bool forward, int config);
// The kernel and the scheduler setting of a configuration id.
inline int gemm_gelu_config_kernel(DType act, bool forward, int config) {
  const int k = gemm_gelu_kernel_count(act, forward);
  return k > 0 ? config % k : 0;
}
inline int gemm_gelu_config_schedule(DType act, bool forward, int config) {
  const int k = gemm_gelu_kernel_count(act, forward);
  return k > 0 ? config / k : 0;
}
inline int gemm_gelu_config_id(DType act, bool forward, int kernel, int schedule) {
  return kernel + gemm_gelu_kernel_count(act, forward) * schedule;
}

// config: an id of gemm_gelu_config_count(act, forward); out of range is fatal.
void gemm_bias_gelu_forward(DType act, cudaStream_t s, void* h, void* g, const void* x,
                            const void* W, const void* b, int N, int in, int out, void* workspace,
                            size_t workspace_bytes, int config = 0);
void gemm_dgelu_backward(DType act, cudaStream_t s, void* dx, const void* dy, const void* W,
                         const void* h, int N, int in, int out, void* workspace,
                         size_t workspace_bytes, int config = 0);

}  // namespace cuda
}  // namespace vitgrid
