// CpuBackend GEMM-based layers: Linear (with bias and GELU epilogue), batched GEMM and
// multi-head self-attention, forward and backward side by side. All GEMMs go to OpenBLAS
// cblas_sgemm (fp32 accumulate); act results are rounded afterwards in 16-bit emulation.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/core/error.h"

namespace vitgrid {

namespace {
inline const float* cf(const void* p) { return static_cast<const float*>(p); }
inline float* f(void* p) { return static_cast<float*>(p); }
}  // namespace

// ---- Linear

void CpuBackend::linear_forward(void* y_, const void* x_, const void* W_, const void* b_, int N,
                                int in, int out, void* gelu_out, Gelu gelu) {
  OpScope op_scope(*this, "linear_forward");
  if (op_scope.timing())
    op_scope.rename(linear_row("linear_forward", in, out, gelu_out ? " +gelu" : ""));
  float* y = f(y_);
  const float* b = cf(b_);
  if (N <= 0 || out <= 0) return;
  // Seeding y with the bias and letting sgemm add (beta = 1) saves one pass over y.
  if (b) {
    for (int r = 0; r < N; ++r) std::memcpy(y + (size_t)r * out, b, (size_t)out * sizeof(float));
  }
  if (in > 0) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, out, in, 1.0f, cf(x_), in, cf(W_),
                in, b ? 1.0f : 0.0f, y, out);
  } else if (!b) {
    std::memset(y, 0, (size_t)N * out * sizeof(float));
  }
  const size_t n = (size_t)N * out;
  round_act(y, n);
  // The epilogue reads the rounded pre-activation, as a fused GPU epilogue reading bf16 would.
  if (gelu_out) gelu_forward(gelu_out, y, n, gelu);
}

void CpuBackend::linear_backward(void* dx_, float* dW, float* db, const void* dy_, const void* x_,
                                 const void* W_, int N, int in, int out, const void* gelu_pre,
                                 Gelu gelu, float* gelu_db) {
  OpScope op_scope(*this, "linear_backward");
  if (op_scope.timing())
    op_scope.rename(linear_row("linear_backward", in, out,
                               gelu_pre ? (gelu_db ? " +dgelu +dgelu bias" : " +dgelu") : ""));
  VG_CHECK(!gelu_db || (dx_ && gelu_pre), "linear_backward: gelu_db without dx and gelu_pre");
  const float* dy = cf(dy_);
  if (N <= 0) return;  // no rows: dx is empty and the weight gradients gain nothing
  if (dx_) {
    float* dx = f(dx_);
    if (out > 0) {
      // dx[N,in] = dy[N,out] W[out,in]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, in, out, 1.0f, dy, out, cf(W_),
                  in, 0.0f, dx, in);
    } else {
      std::memset(dx, 0, (size_t)N * in * sizeof(float));
    }
    round_act(dx, (size_t)N * in);
    if (gelu_pre) gelu_backward_bias(dx, gelu_pre, dx, N, in, gelu_db, gelu);
  }
  if (dW && out > 0 && in > 0) {
    // dW[out,in] += dy^T[out,N] x[N,in]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, N, 1.0f, dy, out, cf(x_), in,
                1.0f, dW, in);
  }
  if (db) add_column_sums(db, dy, N, out);
}

void CpuBackend::add_column_sums(float* out, const float* x, int rows, int cols) {
  // row by row, so the inner loop is contiguous and vectorises
  for (int r = 0; r < rows; ++r) {
    const float* __restrict row = x + (size_t)r * cols;
    float* __restrict acc = out;
    for (int j = 0; j < cols; ++j) acc[j] += row[j];
  }
}

void CpuBackend::gemm_batched(bool transA, bool transB, int M, int N, int K, float alpha,
                              const void* A_, int64_t strideA, const void* B_, int64_t strideB,
                              float beta, void* C_, int64_t strideC, int batch) {
  OpScope op_scope(*this, "gemm_batched");
  const float* A = cf(A_);
  const float* B = cf(B_);
  float* C = f(C_);
  if (M <= 0 || N <= 0) return;
  const int lda = transA ? M : K;
  const int ldb = transB ? K : N;
  for (int i = 0; i < batch; ++i) {
    float* Ci = C + i * strideC;
    if (K > 0) {
      cblas_sgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans,
                  transB ? CblasTrans : CblasNoTrans, M, N, K, alpha, A + i * strideA, lda,
                  B + i * strideB, ldb, beta, Ci, N);
    } else {
      // An empty inner dimension: C = beta C (BLAS does this too, but some builds reject K=0).
      for (size_t j = 0; j < (size_t)M * N; ++j) Ci[j] = beta == 0.0f ? 0.0f : beta * Ci[j];
    }
    round_act(Ci, (size_t)M * N);
  }
}

// ---- attention
//
// Per (b, h) the q, k, v blocks are strided views into qkv (row stride 3C), so the GEMMs read
// them in place with lda = 3C and no copies. saved holds the probabilities P[B,H,T,T] rounded
// to the act dtype (as a 16-bit GPU kernel stores them); the workspace holds one T x T matrix
// for the backward.

size_t CpuBackend::attention_saved_bytes(int B, int T, int H, int /*hd*/) const {
  return (size_t)B * H * T * T * sizeof(float);
}

size_t CpuBackend::attention_workspace_bytes(int /*B*/, int T, int /*H*/, int /*hd*/) const {
  return (size_t)T * T * sizeof(float);
}

void CpuBackend::attention_forward(void* out_, void* saved_, const void* qkv_, int B, int T,
                                   int H, int hd, void* /*workspace*/) {
  OpScope op_scope(*this, "attention_forward");
  const int C = H * hd, C3 = 3 * C;
  const float* qkv = cf(qkv_);
  float* out = f(out_);
  float* P = f(saved_);
  const float scale = 1.0f / std::sqrt((float)hd);
  for (int b = 0; b < B; ++b) {
    const float* base = qkv + (size_t)b * T * C3;
    for (int h = 0; h < H; ++h) {
      const float* q = base + h * hd;
      const float* k = base + C + h * hd;
      const float* v = base + 2 * C + h * hd;
      float* S = P + ((size_t)b * H + h) * T * T;
      // S = scale * q k^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hd, scale, q, C3, k, C3, 0.0f,
                  S, T);
      // Row softmax in place (max-subtracted for range).
      for (int i = 0; i < T; ++i) {
        float* __restrict row = S + (size_t)i * T;
        float mx = row[0];
        for (int j = 1; j < T; ++j) mx = std::max(mx, row[j]);
        float s = 0.0f;
        for (int j = 0; j < T; ++j) {
          row[j] = std::exp(row[j] - mx);
          s += row[j];
        }
        const float inv = 1.0f / s;
        for (int j = 0; j < T; ++j) row[j] *= inv;
      }
      round_act(S, (size_t)T * T);
      // out[:, h] = P v
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hd, T, 1.0f, S, T, v, C3, 0.0f,
                  out + (size_t)b * T * C + h * hd, C);
    }
  }
  round_act(out, (size_t)B * T * C);
}

void CpuBackend::attention_backward(void* dqkv_, const void* dout_, const void* qkv_,
                                    const void* /*out*/, const void* saved_, int B, int T, int H,
                                    int hd, void* workspace) {
  OpScope op_scope(*this, "attention_backward");
  const int C = H * hd, C3 = 3 * C;
  const float* qkv = cf(qkv_);
  const float* dout = cf(dout_);
  const float* P = cf(saved_);
  float* dqkv = f(dqkv_);
  float* dS = f(workspace);
  const float scale = 1.0f / std::sqrt((float)hd);
  for (int b = 0; b < B; ++b) {
    const float* base = qkv + (size_t)b * T * C3;
    float* dbase = dqkv + (size_t)b * T * C3;
    const float* dO = dout + (size_t)b * T * C;
    for (int h = 0; h < H; ++h) {
      const float* q = base + h * hd;
      const float* k = base + C + h * hd;
      const float* v = base + 2 * C + h * hd;
      const float* Pbh = P + ((size_t)b * H + h) * T * T;
      float* dq = dbase + h * hd;
      float* dk = dbase + C + h * hd;
      float* dv = dbase + 2 * C + h * hd;
      const float* dOh = dO + h * hd;
      // dv = P^T dO
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hd, T, 1.0f, Pbh, T, dOh, C, 0.0f,
                  dv, C3);
      // dP = dO v^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hd, 1.0f, dOh, C, v, C3, 0.0f,
                  dS, T);
      // dS = P * (dP - rowsum(dP * P)) * scale  (softmax backward, with the qk^T scale folded in)
      for (int i = 0; i < T; ++i) {
        const float* __restrict pr = Pbh + (size_t)i * T;
        float* __restrict dr = dS + (size_t)i * T;
        float dot = 0.0f;
        for (int j = 0; j < T; ++j) dot += pr[j] * dr[j];
        for (int j = 0; j < T; ++j) dr[j] = pr[j] * (dr[j] - dot) * scale;
      }
      // dq = dS k ; dk = dS^T q
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hd, T, 1.0f, dS, T, k, C3, 0.0f,
                  dq, C3);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hd, T, 1.0f, dS, T, q, C3, 0.0f,
                  dk, C3);
    }
  }
  round_act(dqkv, (size_t)B * T * C3);
}

}  // namespace vitgrid
