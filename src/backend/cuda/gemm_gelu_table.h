// The dispatch table of the fused GEMM + exact-GELU kernels (gemm_gelu.h): one type-erased
// entry per compiled kernel. Shared by gemm_gelu.cu (the API, which collects the tables) and
// the gemm_gelu_*.cu files that instantiate the kernels (gemm_gelu_kernels.cuh); pulls in no
// CUTLASS header. Internal to src/backend/cuda.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>

#include "gemm_gelu.h"
#include "vitgrid/core/types.h"

namespace vitgrid {
namespace cuda {
namespace gemm_gelu_detail {

// One call, type-erased: what every kernel entry receives.
struct Call {
  DType act = DType::BF16;
  bool forward = true;
  cudaStream_t stream = nullptr;
  void* d = nullptr;           // forward: g [N, out]; backward: dx [N, in]
  void* h_out = nullptr;       // forward: h [N, out]
  const void* a = nullptr;     // forward: x [N, in]; backward: dy [N, out]
  const void* W = nullptr;     // [out, in]
  const void* bias = nullptr;  // forward: b [out] or null
  const void* h_in = nullptr;  // backward: h [N, in]
  int N = 0, in = 0, out = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int raster = 0;   // 0 CUTLASS's heuristic, 1 along M, 2 along N
  int swizzle = 1;  // the tile scheduler's max_swizzle_size: 1, 2, 4, 8
  int config = 0;   // the configuration id, for error messages
};

// A compiled kernel: its name (schedule, tile, cluster, epilogue tile) and entry points.
struct GemmGeluKernel {
  const char* name;
  size_t (*workspace_bytes)(int N, int in, int out);
  void (*launch)(const Call& c);
};

// The per-file tables (gemm_gelu_{coop,pingpong}_{fwd,bwd}.cu): the kernels of one file for
// the act dtype (*n of them; null and 0 where it has none). gemm_gelu.cu concatenates them,
// cooperative first, into the configuration ids.
const GemmGeluKernel* kernels_coop_fwd(DType act, int* n);
const GemmGeluKernel* kernels_coop_bwd(DType act, int* n);
const GemmGeluKernel* kernels_pingpong_fwd(DType act, int* n);
const GemmGeluKernel* kernels_pingpong_bwd(DType act, int* n);

// The body of those functions: a file's bf16 table, and its fp16 table where it has one.
template <size_t NB>
const GemmGeluKernel* table_for(DType act, int* n, const GemmGeluKernel (&bf16)[NB]) {
  *n = act == DType::BF16 ? static_cast<int>(NB) : 0;
  return act == DType::BF16 ? bf16 : nullptr;
}
template <size_t NB, size_t NF>
const GemmGeluKernel* table_for(DType act, int* n, const GemmGeluKernel (&bf16)[NB],
                                const GemmGeluKernel (&f16)[NF]) {
  if (act != DType::F16) return table_for(act, n, bf16);
  *n = static_cast<int>(NF);
  return f16;
}

// The current device (returned) and its multiprocessor count (*sms), for the persistent grid;
// cached per device (gemm_gelu.cu).
int current_device_sm_count(int* sms);
// VG_FAIL with the call's direction, dtype, shape and configuration.
[[noreturn]] void fail_call(const Call& c, const char* what, const char* detail);

}  // namespace gemm_gelu_detail
}  // namespace cuda
}  // namespace vitgrid
