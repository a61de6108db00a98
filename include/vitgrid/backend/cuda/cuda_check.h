// One check macro per CUDA library (nccl-tests style): on failure they report host, rank,
// file, line (through VG_FAIL / fail_one) and the library's own error string, then abort the
// MPI job so that no rank hangs. NCCL_CHECK lives beside the NCCL code
// (src/backend/cuda/nccl_collectives_impl.h) so that only those translation units need nccl.h.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "vitgrid/core/error.h"

#define CUDA_CHECK(call)                                                                   \
  do {                                                                                     \
    cudaError_t vg_e_ = (call);                                                            \
    if (vg_e_ != cudaSuccess)                                                              \
      VG_FAIL("CUDA error in " #call ": " << cudaGetErrorName(vg_e_) << ": "               \
                                           << cudaGetErrorString(vg_e_));                  \
  } while (0)

#define CUBLAS_CHECK(call)                                                                 \
  do {                                                                                     \
    cublasStatus_t vg_s_ = (call);                                                         \
    if (vg_s_ != CUBLAS_STATUS_SUCCESS)                                                    \
      VG_FAIL("cuBLAS error in " #call ": " << cublasLtGetStatusName(vg_s_) << ": "          \
                                             << cublasLtGetStatusString(vg_s_));             \
  } while (0)

// A kernel launch: checks the launch configuration error at once (the asynchronous execution
// error surfaces at the next synchronising call, which is checked too).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
