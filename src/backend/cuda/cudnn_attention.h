// The cuDNN path of CudaBackend's attention (attention.cu): cuDNN's fused scaled-dot-product
// attention (SDPA), forward with fp32 softmax statistics and backward, built through the
// header-only cudnn_frontend graph API in cudnn_attention.cpp. This header pulls in neither
// cuDNN nor the frontend (both heavy); without the frontend at build time
// (VITGRID_HAVE_CUDNN_FRONTEND unset) the class still exists, available() is false and every
// shape is unsupported. Internal: included only by src/backend/cuda.
//
// Layout (the backend's, see backend.h): qkv[B,T,3C] with per token [q(H,hd) | k(H,hd) |
// v(H,hd)], C = H*hd, read in place as three [B,H,T,hd] tensors of strides [T*3C, hd, 3C, 1];
// out[B,T,C] as [B,H,T,hd] of strides [T*C, hd, C, 1]; stats fp32 [B,H,T] (log-sum-exp of the
// scaled scores, natural log: the same quantity and layout as the flash kernels' saved state,
// so the two paths may take each other's); dqkv is written with the strides of qkv.
// Non-causal, no mask, no dropout, scale 1/sqrt(hd); the backward asks cuDNN for its
// deterministic algorithm unless made with deterministic = false (device.deterministic).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string>

#include "vitgrid/core/types.h"

namespace vitgrid {
namespace cuda {

class CudnnAttention {
 public:
  // Built with cudnn_frontend.
  static bool available();
  // The (dtype, head dim) pairs this path is tried for: bf16/fp16, hd 64, 80, 128.
  static bool eligible(DType act, int hd);

  // Holds no cuDNN state yet: the handle (on `stream`, device `device`) is made on the
  // first shape that needs it. `verbose`: one stderr line per shape cuDNN rejects.
  CudnnAttention(int device, cudaStream_t stream, bool verbose, bool deterministic);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Builds the forward and backward graphs of the shape once (cached; later calls are a
  // lookup) and says whether cuDNN supports both. false: the caller takes another path.
  bool supported(DType act, int B, int T, int H, int hd);
  // The workspace a caller must provide for the shape: max(floor, the larger of the two
  // graphs' workspaces), just floor for an unsupported shape. Remembered as granted to the
  // caller: see usable().
  size_t workspace_bytes(DType act, int B, int T, int H, int hd, size_t floor);
  // supported(), and the shape's workspace fits every buffer that workspace_bytes() sized
  // for the same (T, H, hd) and a batch >= B (the model sizes its buffer at its largest
  // batch and runs smaller ones). What forward()/backward() callers check.
  bool usable(DType act, int B, int T, int H, int hd);
  // Why cuDNN rejected the shape ("" when supported or not tried).
  std::string reject_reason(DType act, int B, int T, int H, int hd);

  // Enqueue on the stream; the shape must be usable(). workspace: workspace_bytes() large.
  void forward(DType act, void* out, float* stats, const void* qkv, int B, int T, int H, int hd,
               void* workspace);
  void backward(DType act, void* dqkv, const void* dout, const void* qkv, const void* out,
                const float* stats, int B, int T, int H, int hd, void* workspace);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cuda
}  // namespace vitgrid
