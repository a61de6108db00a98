// CPU backend GEMM-based ops (Linear, batched GEMM, attention) against double-precision naive
// references; every backward against central finite differences of the reference forward.
//
// Tolerances: the backend runs in fp32 with O(1) inputs and inner dimensions < 30, so its
// results carry ~1e-6 relative error; atol 2e-5 / rtol 1e-4 leaves margin while any indexing
// or formula error (O(1) differences) fails.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend_test_util.h"
#include "vitgrid/backend/cpu/cpu_backend.h"

namespace {

using vgtest::all_close;
using vgtest::fd_grad;
using vgtest::randn;
using vgtest::to_d;
using vitgrid::CpuBackend;
using vitgrid::Gelu;

constexpr double kAtol = 2e-5, kRtol = 1e-4;

// y = x W^T + b in double.
std::vector<double> ref_linear(const std::vector<double>& x, const std::vector<double>& W,
                               const std::vector<double>* b, int N, int in, int out) {
  std::vector<double> y((size_t)N * out);
  for (int r = 0; r < N; ++r)
    for (int o = 0; o < out; ++o) {
      double s = b ? (*b)[o] : 0.0;
      for (int i = 0; i < in; ++i) s += x[(size_t)r * in + i] * W[(size_t)o * in + i];
      y[(size_t)r * out + o] = s;
    }
  return y;
}

double ref_gelu(double x, Gelu g) {
  if (g == Gelu::Exact) return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

TEST(CpuGemm, LinearForwardWithAndWithoutBiasAndGeluEpilogue) {
  const int N = 7, in = 13, out = 11;
  CpuBackend be;
  auto x = randn((size_t)N * in, 1), W = randn((size_t)out * in, 2), b = randn(out, 3);
  auto xd = to_d(x), Wd = to_d(W), bd = to_d(b);
  std::vector<float> y((size_t)N * out), g((size_t)N * out);

  be.linear_forward(y.data(), x.data(), W.data(), b.data(), N, in, out);
  EXPECT_TRUE(all_close(y, ref_linear(xd, Wd, &bd, N, in, out), kAtol, kRtol));

  be.linear_forward(y.data(), x.data(), W.data(), nullptr, N, in, out);
  const auto ref_nb = ref_linear(xd, Wd, nullptr, N, in, out);
  EXPECT_TRUE(all_close(y, ref_nb, kAtol, kRtol));

  for (Gelu kind : {Gelu::Exact, Gelu::Tanh}) {
    be.linear_forward(y.data(), x.data(), W.data(), b.data(), N, in, out, g.data(), kind);
    const auto pre = ref_linear(xd, Wd, &bd, N, in, out);
    std::vector<double> post(pre.size());
    for (size_t i = 0; i < pre.size(); ++i) post[i] = ref_gelu(pre[i], kind);
    EXPECT_TRUE(all_close(y, pre, kAtol, kRtol)) << "pre-activation kept, gelu " << (int)kind;
    EXPECT_TRUE(all_close(g, post, kAtol, kRtol)) << "gelu " << (int)kind;
  }
}

TEST(CpuGemm, LinearBackwardMatchesFiniteDifferencesAndAccumulates) {
  const int N = 6, in = 9, out = 5;
  CpuBackend be;
  auto x = randn((size_t)N * in, 11), W = randn((size_t)out * in, 12), b = randn(out, 13);
  auto dy = randn((size_t)N * out, 14);
  auto dW0 = randn((size_t)out * in, 15), db0 = randn(out, 16);  // existing accumulations
  const auto R = to_d(dy);
  auto xd = to_d(x), Wd = to_d(W), bd = to_d(b);

  std::vector<float> dx((size_t)N * in), dW = dW0, db = db0;
  be.linear_backward(dx.data(), dW.data(), db.data(), dy.data(), x.data(), W.data(), N, in, out);

  // L = sum(dy * y): its gradient with respect to each input is what the backward returns.
  auto gx = fd_grad([&](const std::vector<double>& v) {
    return vgtest::dot(R, ref_linear(v, Wd, &bd, N, in, out));
  }, xd);
  auto gW = fd_grad([&](const std::vector<double>& v) {
    return vgtest::dot(R, ref_linear(xd, v, &bd, N, in, out));
  }, Wd);
  auto gb = fd_grad([&](const std::vector<double>& v) {
    return vgtest::dot(R, ref_linear(xd, Wd, &v, N, in, out));
  }, bd);
  EXPECT_TRUE(all_close(dx, gx, kAtol, kRtol));
  EXPECT_TRUE(all_close(dW, vgtest::add(gW, dW0), kAtol, kRtol)) << "dW += dy^T x";
  EXPECT_TRUE(all_close(db, vgtest::add(gb, db0), kAtol, kRtol)) << "db += colsum dy";

  // Null dx and db are skipped; dW still accumulates (a second time).
  std::vector<float> dW2 = dW;
  be.linear_backward(nullptr, dW2.data(), nullptr, dy.data(), x.data(), W.data(), N, in, out);
  std::vector<double> twice = vgtest::add(gW, dW0);
  for (size_t i = 0; i < twice.size(); ++i) twice[i] += gW[i];
  EXPECT_TRUE(all_close(dW2, twice, kAtol, kRtol));
}

// C = alpha op(A) op(B) + beta C for every transpose combination, with strides larger than
// the matrices so that batch addressing is tested and the gaps must stay untouched.
TEST(CpuGemm, BatchedEveryTransposeCombination) {
  const int M = 5, N = 7, K = 9, batch = 3;
  const float alpha = 0.7f, beta = 0.3f;
  const int64_t sA = M * K + 4, sB = K * N + 3, sC = M * N + 5;
  CpuBackend be;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      auto A = randn((size_t)sA * batch, 20 + ta), B = randn((size_t)sB * batch, 22 + tb);
      auto C = randn((size_t)sC * batch, 24);
      std::vector<double> ref(C.begin(), C.end());
      for (int i = 0; i < batch; ++i)
        for (int m = 0; m < M; ++m)
          for (int n = 0; n < N; ++n) {
            double s = 0.0;
            for (int k = 0; k < K; ++k) {
              const double a = ta ? A[i * sA + (size_t)k * M + m] : A[i * sA + (size_t)m * K + k];
              const double bb = tb ? B[i * sB + (size_t)n * K + k] : B[i * sB + (size_t)k * N + n];
              s += a * bb;
            }
            double& c = ref[i * sC + (size_t)m * N + n];
            c = alpha * s + beta * c;
          }
      be.gemm_batched(ta, tb, M, N, K, alpha, A.data(), sA, B.data(), sB, beta, C.data(), sC,
                      batch);
      EXPECT_TRUE(all_close(C, ref, kAtol, kRtol)) << "transA " << ta << " transB " << tb;
    }
  }
}

// ---- attention

// Naive multi-head attention on qkv[B,T,3C] (timm layout), in double.
std::vector<double> ref_attention(const std::vector<double>& qkv, int B, int T, int H, int hd) {
  const int C = H * hd;
  const double scale = 1.0 / std::sqrt((double)hd);
  std::vector<double> out((size_t)B * T * C, 0.0), s(T);
  auto at = [&](int b, int t, int part, int h, int d) {
    return qkv[((size_t)b * T + t) * 3 * C + part * C + h * hd + d];
  };
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < T; ++i) {
        double mx = -1e300;
        for (int j = 0; j < T; ++j) {
          double dd = 0.0;
          for (int d = 0; d < hd; ++d) dd += at(b, i, 0, h, d) * at(b, j, 1, h, d);
          s[j] = dd * scale;
          mx = std::max(mx, s[j]);
        }
        double z = 0.0;
        for (int j = 0; j < T; ++j) z += (s[j] = std::exp(s[j] - mx));
        for (int d = 0; d < hd; ++d) {
          double o = 0.0;
          for (int j = 0; j < T; ++j) o += s[j] / z * at(b, j, 2, h, d);
          out[((size_t)b * T + i) * C + h * hd + d] = o;
        }
      }
  return out;
}

TEST(CpuAttention, ForwardMatchesNaivePerHeadComputation) {
  const int B = 2, T = 5, H = 3, hd = 7, C = H * hd;
  CpuBackend be;
  auto qkv = randn((size_t)B * T * 3 * C, 31);
  std::vector<float> out((size_t)B * T * C);
  std::vector<float> saved(be.attention_saved_bytes(B, T, H, hd) / 4);
  std::vector<float> ws(be.attention_workspace_bytes(B, T, H, hd) / 4 + 1);
  be.attention_forward(out.data(), saved.data(), qkv.data(), B, T, H, hd, ws.data());
  EXPECT_TRUE(all_close(out, ref_attention(to_d(qkv), B, T, H, hd), kAtol, kRtol));
  // saved holds probabilities: rows sum to one.
  for (int r = 0; r < B * H * T; ++r) {
    double s = 0.0;
    for (int j = 0; j < T; ++j) s += saved[(size_t)r * T + j];
    EXPECT_NEAR(s, 1.0, 1e-5);
  }
}

TEST(CpuAttention, BackwardMatchesFiniteDifferences) {
  const int B = 2, T = 5, H = 3, hd = 7, C = H * hd;
  CpuBackend be;
  auto qkv = randn((size_t)B * T * 3 * C, 41);
  auto dout = randn((size_t)B * T * C, 42);
  std::vector<float> out((size_t)B * T * C);
  std::vector<float> saved(be.attention_saved_bytes(B, T, H, hd) / 4);
  std::vector<float> ws(be.attention_workspace_bytes(B, T, H, hd) / 4);
  be.attention_forward(out.data(), saved.data(), qkv.data(), B, T, H, hd, ws.data());
  std::vector<float> dqkv(qkv.size(), 123.0f);  // overwritten, not accumulated
  be.attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), saved.data(), B, T, H,
                        hd, ws.data());
  const auto R = to_d(dout);
  auto g = fd_grad([&](const std::vector<double>& v) {
    return vgtest::dot(R, ref_attention(v, B, T, H, hd));
  }, to_d(qkv));
  EXPECT_TRUE(all_close(dqkv, g, kAtol, kRtol));
}

}  // namespace
