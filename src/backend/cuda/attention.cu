// Multi-head self-attention, three paths (BackendOptions::attention, deck device.attention:
// auto | cudnn | flash | fallback; default auto):
//  * cuDNN's fused SDPA (cudnn_attention.cpp): cudnn, and auto where the own whole-head
//    kernels do not apply, bf16/fp16 with head dim 64, 80
//    or 128, when the build has cudnn_frontend and cuDNN builds both graphs of the shape
//    (saved state: fp32 log-sum-exp [B,H,T]; workspace: what the graphs ask for, never less
//    than the flash path's, so a shape cuDNN rejects can run the flash kernels instead).
//  * the own flash kernels of flash_attention.cu: flash; auto where they hold the whole head
//    (head dim 64, T <= 224: ViT at 224 px) or cuDNN is not there; bf16/fp16 with head dim
//    32, 64, 80, 128
//    (saved state: fp32 log-sum-exp [B,H,T], the same quantity as cuDNN's; workspace: fp32
//    D = rowsum(dO * O) [B,H,T] for the backward).
//  * the fallback below: everything else, or every case with device.attention = fallback.
//
// Fallback path: cuBLASLt strided-batched GEMMs read q, k, v
// straight out of the qkv[B,T,3C] layout (leading dimension 3C, head offset h*hd), scores
// are kept in fp32, the softmax kernel writes the probabilities P[B,H,T,T] in the act dtype
// (the `saved` state, as on the CPU), and the backward recomputes nothing.
// Each GEMM is one launch per head with the batch running over b (or per image with the batch
// over heads, whichever gives fewer launches), since (b, h) is not a single stride.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda_backend_impl.h"
#include "cudnn_attention.h"
#include "flash_attention.h"
#include "kernel_util.cuh"

namespace vitgrid {

namespace {

// Byte offsets of one operand for batch index b and head h.
struct Offs {
  int64_t per_b, per_h;  // in elements
  size_t elem;           // element size in bytes
};

const void* shift(const void* p, int64_t elems, size_t elem) {
  return static_cast<const char*>(p) + elems * static_cast<int64_t>(elem);
}

}  // namespace

// Runs spec for all (b, h): A/B/C pointers in spec are the (b=0, h=0) operands.
static void attention_gemm(CudaBackend& be, GemmSpec s, Offs oa, Offs ob, Offs oc, int B,
                           int H) {
  const void* A0 = s.A;
  const void* B0 = s.B;
  void* C0 = s.C;
  if (H <= B) {  // loop over heads, batch over images
    s.batch = B;
    s.strideA = oa.per_b;
    s.strideB = ob.per_b;
    s.strideC = oc.per_b;
    for (int h = 0; h < H; ++h) {
      s.A = shift(A0, h * oa.per_h, oa.elem);
      s.B = shift(B0, h * ob.per_h, ob.elem);
      s.C = const_cast<void*>(shift(C0, h * oc.per_h, oc.elem));
      be.matmul(s);
    }
  } else {  // loop over images, batch over heads
    s.batch = H;
    s.strideA = oa.per_h;
    s.strideB = ob.per_h;
    s.strideC = oc.per_h;
    for (int b = 0; b < B; ++b) {
      s.A = shift(A0, b * oa.per_b, oa.elem);
      s.B = shift(B0, b * ob.per_b, ob.elem);
      s.C = const_cast<void*>(shift(C0, b * oc.per_b, oc.elem));
      be.matmul(s);
    }
  }
}

AttentionMode CudaBackend::checked_attention_mode(AttentionMode m) {
  if ((m == AttentionMode::Cudnn || m == AttentionMode::CudnnForward) &&
      !cuda::CudnnAttention::available()) {
    throw UserError(
        std::string("device.attention = ") +
        (m == AttentionMode::Cudnn ? "cudnn" : "cudnn_forward") +
        ", but this build has no cudnn_frontend (the cuDNN SDPA path "
        "is not compiled in: run `make deps` or tools/fetch_cudnn_frontend.sh, or point "
        "VITGRID_CUDNN_FRONTEND_DIR at the headers, and reconfigure); use auto, flash or "
        "fallback");
  }
  return m;
}

const char* CudaBackend::attention_path_name(AttentionPath p) {
  switch (p) {
    case AttentionPath::Cudnn: return "cudnn";
    case AttentionPath::Flash: return "flash";
    default: return "fallback";
  }
}

cuda::CudnnAttention* CudaBackend::cudnn_attention() const {
  if (!cudnn_attention_) {
    cudnn_attention_.reset(
        new cuda::CudnnAttention(device_, stream_, attention_mode_ == AttentionMode::Cudnn,
                                 deterministic_));
  }
  return cudnn_attention_.get();
}

// Auto with a sequence length: the own whole-head kernels where they apply (at ViT's lengths
// they beat cuDNN's SDPA: tools/MEASURED.md, "attention"), else cuDNN, else the tiled kernels.
// CudnnForward: cuDNN's forward where it takes the shape, the backward Auto's (both paths save
// the same log-sum-exp, so the backward reads either's).
bool CudaBackend::attention_head_kernels(int T, int hd, bool backward) const {
  const bool auto_like = attention_mode_ == AttentionMode::Auto ||
                         (attention_mode_ == AttentionMode::CudnnForward && backward);
  return auto_like && T > 0 && cuda::flash_head_applies(act_, hd, T);
}

CudaBackend::AttentionPath CudaBackend::attention_route(int B, int T, int H, int hd,
                                                        bool backward) const {
  if (attention_mode_ == AttentionMode::Fallback) return AttentionPath::Fallback;
  if (attention_head_kernels(T, hd, backward)) return AttentionPath::Flash;
  if (attention_mode_ != AttentionMode::Flash && cuda::CudnnAttention::available() &&
      cuda::CudnnAttention::eligible(act_, hd)) {
    // usable(): supported, and the workspace fits what attention_workspace_bytes() granted
    if (B <= 0 || T <= 0 || cudnn_attention()->usable(act_, B, T, H, hd)) {
      return AttentionPath::Cudnn;
    }
  }
  return cuda::flash_attention_supported(act_, hd) ? AttentionPath::Flash
                                                   : AttentionPath::Fallback;
}

bool CudaBackend::attention_fused(int hd) const {
  return attention_route(0, 0, 0, hd) != AttentionPath::Fallback;
}

const char* cuda_attention_path(const Backend& be, int B, int T, int H, int hd) {
  const auto* cb = dynamic_cast<const CudaBackend*>(&be);
  return cb ? cb->attention_path(B, T, H, hd) : "none";
}

size_t CudaBackend::attention_saved_bytes(int B, int T, int H, int hd) const {
  if (attention_fused(hd)) return static_cast<size_t>(B) * H * T * sizeof(float);  // LSE
  return static_cast<size_t>(B) * H * T * T * act_size();  // P in the act dtype
}

size_t CudaBackend::attention_workspace_bytes(int B, int T, int H, int hd) const {
  const size_t lse_ws = static_cast<size_t>(B) * H * T * sizeof(float);  // flash: D
  const AttentionPath path = attention_route(0, 0, 0, hd);
  if (path == AttentionPath::Cudnn && B > 0 && T > 0 && !attention_head_kernels(T, hd, false)) {
    // builds the shape's graphs now (not in the step); never below the flash path's need
    return cudnn_attention()->workspace_bytes(act_, B, T, H, hd, lse_ws);
  }
  if (path != AttentionPath::Fallback) return lse_ws;
  // fp32 scores (forward) / fp32 dP (backward), then dS in the act dtype (backward).
  const size_t n = static_cast<size_t>(B) * H * T * T;
  const size_t f32 = (n * sizeof(float) + 255) / 256 * 256;
  return f32 + n * act_size();
}

void CudaBackend::attention_forward(void* out, void* saved, const void* qkv, int B, int T, int H,
                                    int hd, void* workspace) {
  OpScope op_scope(*this, "attention_forward");
  if (B <= 0 || T <= 0) return;
  const AttentionPath path = attention_route(B, T, H, hd);
  if (path == AttentionPath::Cudnn) {
    cudnn_attention()->forward(act_, out, static_cast<float*>(saved), qkv, B, T, H, hd,
                               workspace);
    return;
  }
  if (path == AttentionPath::Flash) {
    cuda::flash_attention_forward(stream_, act_, out, static_cast<float*>(saved), qkv, B, T, H,
                                  hd);
    return;
  }
  const int64_t C = static_cast<int64_t>(H) * hd, C3 = 3 * C, TT = static_cast<int64_t>(T) * T;
  const size_t es = act_size();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* S = static_cast<float*>(workspace);
  const cudaDataType_t at = act_cuda_type();

  GemmSpec s;  // S[b,h] = Q K^T  (M=T, N=T, K=hd), fp32 output
  s.transB = true;
  s.M = T;
  s.N = T;
  s.K = hd;
  s.A = qkv;
  s.lda = C3;
  s.B = shift(qkv, C, es);
  s.ldb = C3;
  s.C = S;
  s.ldc = T;
  s.ab_type = at;
  s.c_type = CUDA_R_32F;
  attention_gemm(*this, s, {T * C3, hd, es}, {T * C3, hd, es}, {H * TT, TT, sizeof(float)}, B,
                 H);

  cuda::dispatch_act(act_, [&](auto tag) {
    using E = typename decltype(tag)::type;
    cuda::launch_softmax_fwd<float, E>(stream_, static_cast<E*>(saved), S, B * H * T, T, scale);
  });

  GemmSpec p;  // out[b, :, h] = P V  (M=T, N=hd, K=T)
  p.M = T;
  p.N = hd;
  p.K = T;
  p.A = saved;
  p.lda = T;
  p.B = shift(qkv, 2 * C, es);
  p.ldb = C3;
  p.C = out;
  p.ldc = C;
  p.ab_type = p.c_type = at;
  attention_gemm(*this, p, {H * TT, TT, es}, {T * C3, hd, es}, {T * C, hd, es}, B, H);
}

void CudaBackend::attention_backward(void* dqkv, const void* dout, const void* qkv,
                                     const void* out, const void* saved, int B, int T, int H,
                                     int hd, void* workspace) {
  OpScope op_scope(*this, "attention_backward");
  if (B <= 0 || T <= 0) return;
  const AttentionPath path = attention_route(B, T, H, hd, true);
  if (path == AttentionPath::Cudnn) {
    cudnn_attention()->backward(act_, dqkv, dout, qkv, out, static_cast<const float*>(saved), B,
                                T, H, hd, workspace);
    return;
  }
  if (path == AttentionPath::Flash) {
    cuda::flash_attention_backward(stream_, act_, dqkv, static_cast<float*>(workspace), dout,
                                   qkv, out, static_cast<const float*>(saved), B, T, H, hd);
    return;
  }
  const int64_t C = static_cast<int64_t>(H) * hd, C3 = 3 * C, TT = static_cast<int64_t>(T) * T;
  const size_t es = act_size();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const size_t n = static_cast<size_t>(B) * H * TT;
  float* dP = static_cast<float*>(workspace);
  void* dS = static_cast<char*>(workspace) + (n * sizeof(float) + 255) / 256 * 256;
  const cudaDataType_t at = act_cuda_type();

  GemmSpec s;  // dP = dO V^T  (M=T, N=T, K=hd), fp32 output
  s.transB = true;
  s.M = T;
  s.N = T;
  s.K = hd;
  s.A = dout;
  s.lda = C;
  s.B = shift(qkv, 2 * C, es);
  s.ldb = C3;
  s.C = dP;
  s.ldc = T;
  s.ab_type = at;
  s.c_type = CUDA_R_32F;
  attention_gemm(*this, s, {T * C, hd, es}, {T * C3, hd, es}, {H * TT, TT, sizeof(float)}, B,
                 H);

  // dS = P * (dP - rowsum(dP * P)) * scale (the scale of the scores folds in here).
  cuda::dispatch_act(act_, [&](auto tag) {
    using E = typename decltype(tag)::type;
    cuda::launch_softmax_bwd<E, float, E>(stream_, static_cast<E*>(dS),
                                          static_cast<const E*>(saved), dP, B * H * T, T, scale);
  });

  GemmSpec q;  // dQ = dS K  (M=T, N=hd, K=T)
  q.M = T;
  q.N = hd;
  q.K = T;
  q.A = dS;
  q.lda = T;
  q.B = shift(qkv, C, es);
  q.ldb = C3;
  q.C = dqkv;
  q.ldc = C3;
  q.ab_type = q.c_type = at;
  attention_gemm(*this, q, {H * TT, TT, es}, {T * C3, hd, es}, {T * C3, hd, es}, B, H);

  GemmSpec k = q;  // dK = dS^T Q
  k.transA = true;
  k.B = qkv;
  k.C = static_cast<char*>(dqkv) + C * es;
  attention_gemm(*this, k, {H * TT, TT, es}, {T * C3, hd, es}, {T * C3, hd, es}, B, H);

  GemmSpec v = q;  // dV = P^T dO
  v.transA = true;
  v.A = saved;
  v.B = dout;
  v.ldb = C;
  v.C = static_cast<char*>(dqkv) + 2 * C * es;
  attention_gemm(*this, v, {H * TT, TT, es}, {T * C, hd, es}, {T * C3, hd, es}, B, H);
}

}  // namespace vitgrid
