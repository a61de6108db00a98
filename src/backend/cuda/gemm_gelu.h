// Fused GEMM + exact-GELU kernels for the MLP's fc1 (gemm_gelu.cu): CUTLASS 3 sm90a
// warp-specialized (TMA + wgmma) GEMMs whose epilogues do the GELU pass that otherwise follows
// the cuBLASLt GEMM as a separate elementwise kernel. Only built with CUTLASS
// (VITGRID_HAVE_CUTLASS); without it gemm_gelu_available() is false and every shape is
// unsupported. This header pulls in neither CUTLASS nor the CUDA headers beyond the runtime API.
// Internal: included only by src/backend/cuda (and its tests).
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
// can_implement / initialize / launch failure is fatal (VG_FAIL naming the shape).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>

#include "vitgrid/core/types.h"

namespace vitgrid {
namespace cuda {

// Built with CUTLASS and the current device is sm_90 (compute capability 9.0 exactly).
bool gemm_gelu_available();
// The shapes the fused kernels take: act bf16 or fp16, in % 8 == 0, out % 8 == 0, N >= 1
// (and in, out >= 8).
bool gemm_gelu_supported(DType act, int N, int in, int out);
// Workspace bytes the kernels need for this shape (0 if none); the caller passes at least this.
size_t gemm_gelu_workspace_bytes(DType act, int N, int in, int out);
void gemm_bias_gelu_forward(DType act, cudaStream_t s, void* h, void* g, const void* x,
                            const void* W, const void* b, int N, int in, int out, void* workspace,
                            size_t workspace_bytes);
void gemm_dgelu_backward(DType act, cudaStream_t s, void* dx, const void* dy, const void* W,
                         const void* h, int N, int in, int out, void* workspace,
                         size_t workspace_bytes);

}  // namespace cuda
}  // namespace vitgrid
