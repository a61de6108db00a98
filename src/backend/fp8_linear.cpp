// The FP8 Linear layer (backend/fp8_linear.h) from the backend's ops, and the argument
// contract of those ops (backend.h) that both backends check.
#include "vitgrid/backend/fp8_linear.h"

#include <algorithm>

#include "vitgrid/core/error.h"

namespace vitgrid {

namespace {

// The GEMMs' K (in, out; the rows for the weight gradient) is a multiple of 16.
void check_shape(const char* what, int N, int in, int out, bool wgrad) {
  VG_CHECK(N >= 0 && in > 0 && out > 0, what << ": N " << N << ", in " << in << ", out " << out);
  VG_CHECK(in % 16 == 0 && out % 16 == 0,
           what << ": FP8 GEMMs need in and out features that are multiples of 16 (rows " << N
                << ", in " << in << ", out " << out << ")");
  VG_CHECK(!wgrad || N % 16 == 0,
           what << ": an FP8 weight gradient needs rows that are a multiple of 16 (rows " << N
                << ", in " << in << ", out " << out << ")");
}

}  // namespace

void check_fp8_cast_args(const uint8_t* out, const uint8_t* out_t, const float* amax, int rows,
                         int cols, const float* scale) {
  VG_CHECK(rows >= 0 && cols >= 0 && amax && scale && (out || out_t),
           "fp8_cast: rows " << rows << ", cols " << cols);
}

void Backend::attention_backward_fp8(void* dqkv, uint8_t* out, uint8_t* out_t, float* amax,
                                     const float* scale, Fp8Format f, float* db,
                                     const void* dout, const void* qkv, const void* att,
                                     const void* saved, int B, int T, int H, int hd,
                                     void* workspace) {
  OpScope op_scope(*this, "attention_backward_fp8");
  const int rows = B * T, cols = 3 * H * hd;
  check_fp8_cast_args(out, out_t, amax, rows, cols, scale);
  attention_backward(dqkv, dout, qkv, att, saved, B, T, H, hd, workspace);
  fp8_cast_grad(out, out_t, amax, dqkv, rows, cols, scale, f, db, nullptr, Gelu::Exact);
}

void Backend::layernorm_backward_fp8(void* dx, float* dgamma, float* dbeta, const void* dy,
                                     const void* x, const void* gamma, const float* mean,
                                     const float* rstd, int N, int C, float* dsum,
                                     void* dbranch, RowFactors bf, uint8_t* out, uint8_t* out_t,
                                     float* amax, const float* scale, Fp8Format f) {
  OpScope op_scope(*this, "layernorm_backward_fp8");
  check_fp8_cast_args(out, out_t, amax, N, C, scale);
  layernorm_backward(dx, dgamma, dbeta, dy, x, gamma, mean, rstd, N, C, dsum, dbranch, bf);
  fp8_cast(out, out_t, amax, bf.f ? dbranch : dx, N, C, scale, f);
}

void check_fp8_gemm_args(bool d_f32, float beta, Fp8Format fa, const float* a_scale_inv,
                         Fp8Format fb, const float* b_scale_inv, int M, int N, int K,
                         const void* bias) {
  VG_CHECK(M >= 0 && N >= 0 && K >= 0 && a_scale_inv && b_scale_inv,
           "fp8_gemm: M " << M << ", N " << N << ", K " << K);
  // cuBLASLt (CUDA 13, H100) answers CUBLAS_STATUS_NOT_SUPPORTED for a scale pointer 4 bytes
  // past a 16-byte boundary: the contract asks it of every backend, so the CPU's tests catch it
  auto aligned = [](const float* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  VG_CHECK(aligned(a_scale_inv) && aligned(b_scale_inv),
           "fp8_gemm: scale_inv pointers must be 16-byte aligned (" << a_scale_inv << ", "
                                                                   << b_scale_inv << ")");
  VG_CHECK(!(fa == Fp8Format::E5M2 && fb == Fp8Format::E5M2),
           "fp8_gemm: both operands E5M2 (no FP8 GEMM takes that)");
  VG_CHECK(d_f32 || beta == 0.0f, "fp8_gemm: an act-dtype output is overwritten (beta 0)");
  VG_CHECK(!(d_f32 && bias), "fp8_gemm: a bias only with an act-dtype output");
}

size_t fp8_linear_scratch_bytes(int N, int in, int out) {
  const size_t n = static_cast<size_t>(N), i = static_cast<size_t>(in), o = static_cast<size_t>(out);
  const size_t forward = n * i + o * i;               // x, W
  const size_t backward = 2 * n * o + i * o + n * i;  // dy, its transpose, W^T, x^T
  return std::max(forward, backward);
}

Fp8DyCodes fp8_linear_dy_codes(uint8_t* scratch, int N, int out) {
  return {scratch, scratch + static_cast<size_t>(N) * static_cast<size_t>(out)};
}

void fp8_linear_forward(Backend& be, const Fp8LinearMeta& m, uint8_t* scratch, void* y,
                        const void* x, const void* W, const void* b, int N, int in, int out,
                        void* gelu_out, Gelu gelu) {
  OpScope op_scope(be, "fp8_linear_forward");
  check_shape("fp8_linear_forward", N, in, out, false);
  if (N == 0) return;
  uint8_t* x8 = scratch;
  uint8_t* w8 = x8 + static_cast<size_t>(N) * in;
  using M = Fp8LinearMeta;
  VG_CHECK(!m.x_cast || !m.x_gelu, "fp8_linear_forward: an input cast already and a GELU to apply");
  if (!m.x_cast)
    be.fp8_cast(x8, m.x_t, m.amax_of(M::kX), x, N, in, m.scale_of(M::kX), Fp8Format::E4M3,
                m.x_gelu);
  be.fp8_cast(w8, m.w_t, m.amax_of(M::kW), W, out, in, m.scale_of(M::kW), Fp8Format::E4M3);
  be.fp8_gemm(y, false, 0.0f, x8, Fp8Format::E4M3, m.scale_inv_of(M::kX), w8, Fp8Format::E4M3,
              m.scale_inv_of(M::kW), N, out, in, b);
  if (gelu_out) be.gelu_forward(gelu_out, y, static_cast<size_t>(N) * out, gelu);
}

void fp8_linear_backward(Backend& be, const Fp8LinearMeta& m, uint8_t* scratch, void* dx,
                         float* dW, float* db, const void* dy, const void* x, const void* W,
                         int N, int in, int out, const void* gelu_pre, Gelu gelu,
                         float* gelu_db) {
  OpScope op_scope(be, "fp8_linear_backward");
  check_shape("fp8_linear_backward", N, in, out, dW != nullptr);
  VG_CHECK(!gelu_db || (dx && gelu_pre), "fp8_linear_backward: gelu_db without dx and gelu_pre");
  VG_CHECK(!m.dy_gelu || (gelu_pre && !gelu_db && (dx || dW)),
           "fp8_linear_backward: dy_gelu needs gelu_pre (of dy), no gelu_db, and dx or dW");
  VG_CHECK(!m.dy_cast || (!db && !m.dy_gelu && !gelu_pre),
           "fp8_linear_backward: dy cast already, with a bias gradient or GELU still to apply");
  if (N == 0) return;
  using M = Fp8LinearMeta;
  const size_t n = static_cast<size_t>(N);
  const Fp8DyCodes codes = fp8_linear_dy_codes(scratch, N, out);
  uint8_t* dy8 = codes.dy;                  // [N, out]
  uint8_t* dy8_t = codes.dy_t;              // [out, N]
  uint8_t* w8_t = dy8_t + n * out;          // [in, out]
  uint8_t* x8_t = w8_t + size_t(in) * out;  // [in, N]
  // dy's cast takes the bias gradient (and, dy_gelu, GELU's backward) in its pass
  const void* dy_pre = m.dy_gelu ? gelu_pre : nullptr;
  if (m.dy_gelu) gelu_pre = nullptr;
  if ((dx || dW) && !m.dy_cast) {
    be.fp8_cast_grad(dx ? dy8 : nullptr, dW ? dy8_t : nullptr, m.amax_of(M::kDy), dy, N, out,
                     m.scale_of(M::kDy), Fp8Format::E5M2, db, dy_pre, gelu);
    db = nullptr;
  }
  if (dx) {
    if (m.w_t) {
      w8_t = m.w_t;  // the forward's
    } else {
      be.fp8_cast(nullptr, w8_t, m.amax_of(M::kW), W, out, in, m.scale_of(M::kW),
                  Fp8Format::E4M3);
    }
    be.fp8_gemm(dx, false, 0.0f, dy8, Fp8Format::E5M2, m.scale_inv_of(M::kDy), w8_t,
                Fp8Format::E4M3, m.scale_inv_of(M::kW), N, in, out, nullptr);
    if (gelu_db) {
      be.gelu_backward_bias(dx, gelu_pre, dx, N, in, gelu_db, gelu);
    } else if (gelu_pre) {
      be.gelu_backward(dx, gelu_pre, dx, n * in, gelu);
    }
  }
  if (dW) {
    if (m.x_t) {
      x8_t = m.x_t;  // the forward's
    } else {
      be.fp8_cast(nullptr, x8_t, m.amax_of(M::kX), x, N, in, m.scale_of(M::kX), Fp8Format::E4M3,
                  m.x_gelu);
    }
    be.fp8_gemm(dW, true, 1.0f, dy8_t, Fp8Format::E5M2, m.scale_inv_of(M::kDy), x8_t,
                Fp8Format::E4M3, m.scale_inv_of(M::kX), out, in, N, nullptr);
  }
  // no GEMM: the bias gradient alone, from dy itself (act dtype), as the bf16 layer sums it
  if (db) be.linear_backward(nullptr, nullptr, db, dy, nullptr, nullptr, N, in, out);
}

}  // namespace vitgrid
