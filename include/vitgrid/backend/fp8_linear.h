// A Linear layer in FP8 (precision.mode = fp8), composed from the backend's Fp8Ops and act-dtype
// ops, the same on every backend: Transformer Engine's "hybrid" recipe for the layer's GEMMs,
//   forward           y   = x W^T + b   E4M3 x E4M3   (x, W cast with their scales)
//   data gradient     dx  = dy W        E5M2 x E4M3   (dy; W's transpose)
//   weight gradient   dW += dy^T x      E5M2 x E4M3   (the transposes of dy and x), into fp32
// with fp32 sums, y and dx in the act dtype, the bias and its gradient, and the GELU of the
// MLP's first Linear, as Backend::linear_forward / linear_backward define them. Each cast
// reports its tensor's amax into the layer's amax slots (the maximum over the step's calls) for
// the delayed-scaling history (model/fp8_scaling.h), which sets the scales between steps.
//
// Hopper's FP8 GEMMs take K-contiguous operands with K a multiple of 16: in and out must be
// multiples of 16, and so must the rows where the weight gradient (whose K they are) is
// taken. The casts are passes of their own here, but where the meta says otherwise: W cast
// once for both its GEMMs (w_t), a GELU applied to x by x's cast (x_gelu), GELU's backward
// and the bias gradient in dy's (dy_gelu), x cast by the LayerNorm that produced it (x_cast),
// dy cast by the attention backward that produced it (dy_cast); fusing the casts into the
// kernels that produce x and dy is what makes FP8 pay (tools/MEASURED.md).
#pragma once
#include <cstddef>
#include <cstdint>

#include "vitgrid/backend/backend.h"

namespace vitgrid {

// One Linear's scaling, in backend memory: three values each, tensor k's at [k * stride] (a
// stride of kAligned keeps each scale_inv, which cuBLASLt reads, on a 16-byte boundary).
struct Fp8LinearMeta {
  enum Tensor { kX = 0, kW = 1, kDy = 2, kTensors = 3 };
  static constexpr int kAligned = 4;
  const float* scale = nullptr;      // a tensor is cast as fp8(v * scale[k])
  const float* scale_inv = nullptr;  // 1 / scale[k], what the GEMMs multiply their sums by
  float* amax = nullptr;             // amax[k] = max(amax[k], max |tensor k|) at each cast
  int stride = 1;
  // The layer's input is gelu(x): x holds the pre-activation (fc2 reading fc1's output before
  // its GELU), which the casts of x apply (Fp8Ops::fp8_cast's gelu_in): no GELU pass, and no
  // stored GELU output, for the FP8 GEMMs.
  const Gelu* x_gelu = nullptr;
  // The layer's output went through GELU (fc1): the backward's gelu_pre is this layer's
  // pre-activation and applies to dy, whose cast (Fp8Ops::fp8_cast_grad) takes GELU's backward
  // and the bias gradient in its pass: no stored GELU gradient, no pass of its own.
  bool dy_gelu = false;
  // Where x's transpose lives between the forward and the backward ([in, N] codes): the
  // forward's cast of x writes it, the weight gradient takes it instead of casting x again
  // (the same scale within a step, so the same codes; x is then not read by the backward).
  uint8_t* x_t = nullptr;
  // Where W's transpose lives between the forward and the backward ([in, out] codes): the
  // forward's cast of W writes it beside W's codes (one pass), the data gradient takes it
  // instead of casting W again (the same weights and scale within a step, so the same codes)
  uint8_t* w_t = nullptr;
  // x is already cast: its codes are at the start of the forward's scratch and its transpose
  // (where x_t is set) in x_t, with this layer's x scale and amax, as the LayerNorm before the
  // Linear writes them (Fp8Ops::add_layernorm_forward_fp8); the forward casts no x and reads
  // none (x may be null).
  bool x_cast = false;
  // dy is already cast: its codes and transpose are where fp8_linear_dy_codes puts them in the
  // backward's scratch, with this layer's dy scale and amax, and the bias gradient summed, as
  // the attention backward before qkv's writes them (Fp8Ops::attention_backward_fp8); the
  // backward casts no dy and reads none (dy may be null; db must be).
  bool dy_cast = false;
  const float* scale_of(int k) const { return scale + k * stride; }
  const float* scale_inv_of(int k) const { return scale_inv + k * stride; }
  float* amax_of(int k) const { return amax + k * stride; }
};

// The FP8 copies' scratch (bytes) the two calls below need for N rows.
size_t fp8_linear_scratch_bytes(int N, int in, int out);
// Where fp8_linear_backward's scratch holds dy's codes [N, out] and their transpose [out, N].
struct Fp8DyCodes {
  uint8_t* dy;
  uint8_t* dy_t;
};
Fp8DyCodes fp8_linear_dy_codes(uint8_t* scratch, int N, int out);

// Throws (VG_CHECK) unless in and out (and N, with dW) are multiples of 16 (Hopper's FP8 GEMMs).
void fp8_linear_forward(Backend& be, const Fp8LinearMeta& meta, uint8_t* scratch, void* y,
                        const void* x, const void* W, const void* b, int N, int in, int out,
                        void* gelu_out = nullptr, Gelu gelu = Gelu::Exact);
void fp8_linear_backward(Backend& be, const Fp8LinearMeta& meta, uint8_t* scratch, void* dx,
                         float* dW, float* db, const void* dy, const void* x, const void* W,
                         int N, int in, int out, const void* gelu_pre = nullptr,
                         Gelu gelu = Gelu::Exact, float* gelu_db = nullptr);

}  // namespace vitgrid
