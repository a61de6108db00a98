// Kernel benchmarks of the CUDA backend at ViT-B/16 shapes (batch 256, T = 197, C = 768,
// H = 12, hd = 64) in bf16: linear forward/backward, attention forward and forward+backward
// (own flash kernels, the fallback, cuDNN's fused SDPA), fused add+LayerNorm forward/backward,
// the bias gradients' column sums, AdamW over 86M parameters, the MLP's GEMMs with the exact
// GELU fused (CUTLASS sm_90a, src/backend/cuda/gemm_gelu.h) beside the unfused path, and the
// Linear layers' GEMMs in FP8 (cuBLASLt) with the casts that feed them.
// Manual time: each iteration runs the op `reps` times between two stream synchronisations
// (so launch gaps are included, as in training) and reports the mean per op; counters TFLOP
// and GB are rates per second of that time (printed as TFLOP=.../s, GB=.../s). Use
// --benchmark_min_time=0.1 (seconds): the wall time is about kReps times the reported time.
// Single process: run it directly (mpirun -np 1 works too). Only built with the CUDA backend.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda_backend_impl.h"
#include "flash_attention.h"
#include "gemm_gelu.h"
#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/cuda/cuda_backend.h"
#include "vitgrid/backend/fp8_linear.h"
#include "vitgrid/core/error.h"

namespace vitgrid {

namespace {

constexpr int kB = 256, kT = 197, kC = 768, kH = 12, kHd = 64;
constexpr int kN = kB * kT;
constexpr int kReps = 10;

Backend& gpu() {
  static std::unique_ptr<Backend> be = make_cuda_backend(0, DType::BF16);
  return *be;
}

// Buffers for one benchmark on a backend (gpu() unless given), zero-filled (finite values: no
// NaN/Inf slow paths), released when it goes.
struct Bufs {
  Backend& be;
  std::vector<void*> p;
  Bufs() : be(gpu()) {}
  explicit Bufs(Backend& b) : be(b) {}
  void* get(size_t bytes) {
    void* q = be.alloc(bytes);
    be.zero(q, bytes);
    p.push_back(q);
    return q;
  }
  ~Bufs() {
    be.synchronize();
    for (void* q : p) be.release(q);
  }
};

// sync: waits for the stream the op runs on (the backend's, unless given).
template <class F, class S>
void timed(benchmark::State& st, F&& op, S&& sync) {
  op();  // warm-up: plans, scratch and slice tables are created here, never in the loop
  sync();
  for (auto _ : st) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < kReps; ++r) op();
    sync();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    st.SetIterationTime(s / kReps);
  }
}
template <class F>
void timed(benchmark::State& st, F&& op) {
  timed(st, op, [] { gpu().synchronize(); });
}

void BM_LinearForward(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const int in = static_cast<int>(st.range(0)), out = static_cast<int>(st.range(1));
  const bool gelu = st.range(2) != 0;
  const size_t a = gpu().act_size();
  Bufs b;
  void* x = b.get(size_t(kN) * in * a);
  void* W = b.get(size_t(out) * in * a);
  void* bias = b.get(size_t(out) * a);
  void* y = b.get(size_t(kN) * out * a);
  void* g = gelu ? b.get(size_t(kN) * out * a) : nullptr;
  timed(st, [&] { gpu().linear_forward(y, x, W, bias, kN, in, out, g, Gelu::Exact); });
  st.counters["TFLOP"] = benchmark::Counter(2.0 * kN * in * out * 1e-12,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

void BM_LinearBackward(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const int in = static_cast<int>(st.range(0)), out = static_cast<int>(st.range(1));
  const size_t a = gpu().act_size();
  Bufs b;
  void* x = b.get(size_t(kN) * in * a);
  void* W = b.get(size_t(out) * in * a);
  void* dy = b.get(size_t(kN) * out * a);
  void* dx = b.get(size_t(kN) * in * a);
  float* dW = static_cast<float*>(b.get(size_t(out) * in * 4));
  float* db = static_cast<float*>(b.get(size_t(out) * 4));
  timed(st, [&] { gpu().linear_backward(dx, dW, db, dy, x, W, kN, in, out); });
  st.counters["TFLOP"] = benchmark::Counter(4.0 * kN * in * out * 1e-12,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

// The weight gradient alone (linear_backward without dx: dW += dy^T x, and the bias gradient),
// K = batch x tokens, by how its cuBLASLt algorithm is chosen. Arg tune: 0 the heuristic's
// first; 1 the fastest of its first 8 (device.gemm_tune = 8; device.tuning_log prints the
// choice).
Backend& tuned_gpu(int tune) {
  static std::unique_ptr<Backend> be[2];
  if (!be[tune]) {
    BackendOptions o;
    o.gemm_tune = tune == 0 ? 1 : 8;
    be[tune] = make_cuda_backend(0, DType::BF16, o);
    Backend::WorkspacePlan w;  // tuning times the accumulating GEMMs on the scratch
    w.max_rows = kN;
    w.max_cols = 4 * kC;
    w.max_weight_elems = 2 * 4 * kC * kC;  // its fp32 dW in bf16 elements
    be[tune]->plan_workspace(w);
  }
  return *be[tune];
}

void BM_LinearWgrad(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const int in = static_cast<int>(st.range(0)), out = static_cast<int>(st.range(1));
  Backend& be = tuned_gpu(static_cast<int>(st.range(2)));
  const size_t a = be.act_size();
  Bufs b(be);
  void* x = b.get(size_t(kN) * in * a);
  void* dy = b.get(size_t(kN) * out * a);
  float* dW = static_cast<float*>(b.get(size_t(out) * in * 4));
  float* db = static_cast<float*>(b.get(size_t(out) * 4));
  timed(
      st, [&] { be.linear_backward(nullptr, dW, db, dy, x, nullptr, kN, in, out); },
      [&] { be.synchronize(); });
  st.counters["TFLOP"] = benchmark::Counter(2.0 * kN * in * out * 1e-12,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

// Attention at ViT-B/16's shape (arg T 197) and ViT-B/32's (T 50), one backend per path
// (BackendOptions::attention, deck device.attention). Arg path: 0 = the own flash kernels (flash),
// 1 = the cuBLASLt + softmax fallback (fallback), 2 = cuDNN's fused SDPA (cudnn; skipped in builds
// without cudnn_frontend; the label names the path that ran, flash if cuDNN rejected the shape).
// FLOPs: 4*B*H*T^2*hd forward (QK^T and PV), 2.5x that for the backward (5 GEMMs; the flash
// backward actually runs 7 for determinism, uncounted).
const char* const kAttentionModes[3] = {"flash", "fallback", "cudnn"};
const AttentionMode kAttentionMode[3] = {AttentionMode::Flash, AttentionMode::Fallback,
                                         AttentionMode::Cudnn};

// The backend of a path, made once; nullptr (and *why) when the mode is refused.
Backend* attention_backend(int path, std::string* why) {
  static std::unique_ptr<Backend> be[3];
  static std::string error[3];
  if (!be[path] && error[path].empty()) {
    try {
      BackendOptions o;
      o.attention = kAttentionMode[path];
      be[path] = make_cuda_backend(0, DType::BF16, o);
    } catch (const UserError& e) {
      error[path] = e.what();
    }
  }
  *why = error[path];
  return be[path].get();
}

void attention_bench(benchmark::State& st, bool backward) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const int path = static_cast<int>(st.range(0)), T = static_cast<int>(st.range(1));
  std::string why;
  Backend* bp = attention_backend(path, &why);
  if (bp == nullptr) return st.SkipWithError(why.c_str());
  Backend& be = *bp;
  const size_t a = be.act_size(), n = size_t(kB) * T;
  Bufs b(be);
  void* qkv = b.get(n * 3 * kC * a);
  void* out = b.get(n * kC * a);
  void* dout = b.get(n * kC * a);
  void* dqkv = b.get(n * 3 * kC * a);
  const size_t sb = be.attention_saved_bytes(kB, T, kH, kHd);
  const size_t wb = be.attention_workspace_bytes(kB, T, kH, kHd);
  void* saved = b.get(sb);
  void* ws = b.get(wb);
  auto op = [&] {
    be.attention_forward(out, saved, qkv, kB, T, kH, kHd, ws);
    if (backward) be.attention_backward(dqkv, dout, qkv, out, saved, kB, T, kH, kHd, ws);
  };
  op();
  be.synchronize();
  for (auto _ : st) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < kReps; ++r) op();
    be.synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    st.SetIterationTime(s / kReps);
  }
  const double fwd = 4.0 * kB * kH * double(T) * T * kHd;
  st.counters["TFLOP"] = benchmark::Counter((backward ? 3.5 : 1.0) * fwd * 1e-12,
                                              benchmark::Counter::kIsIterationInvariantRate);
  char label[160];
  std::snprintf(label, sizeof label,
                "device.attention = %s ran %s, saved %.1f MB, workspace %.1f MB",
                kAttentionModes[path], cuda_attention_path(be, kB, T, kH, kHd), sb / 1e6, wb / 1e6);
  st.SetLabel(label);
}

// The own flash kernels (flash_attention.h), batch 256, 12 heads of 64: arg kernels 0 = tiled
// over 64 rows, 1 = the best (one CTA per image and head where T <= 224); T; backward 0 =
// forward alone, 1 = forward + backward.
void BM_FlashKernels(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const auto kernels = st.range(0) ? cuda::FlashKernels::Best : cuda::FlashKernels::Tiled;
  const int T = static_cast<int>(st.range(1));
  const bool backward = st.range(2) != 0;
  Backend& be = gpu();
  const cudaStream_t s = dynamic_cast<CudaBackend&>(be).stream();
  const size_t a = be.act_size(), n = size_t(kB) * T;
  Bufs b;
  void* qkv = b.get(n * 3 * kC * a);
  void* out = b.get(n * kC * a);
  void* dout = b.get(n * kC * a);
  void* dqkv = b.get(n * 3 * kC * a);
  auto* lse = static_cast<float*>(b.get(size_t(kB) * kH * T * 4));
  auto* Dws = static_cast<float*>(b.get(size_t(kB) * kH * T * 4));
  timed(st, [&] {
    cuda::flash_attention_forward(s, DType::BF16, out, lse, qkv, kB, T, kH, kHd, kernels);
    if (backward)
      cuda::flash_attention_backward(s, DType::BF16, dqkv, Dws, dout, qkv, out, lse, kB, T, kH, kHd,
                                     kernels);
  });
  const double fwd = 4.0 * kB * kH * double(T) * T * kHd;
  st.counters["TFLOP"] = benchmark::Counter((backward ? 3.5 : 1.0) * fwd * 1e-12,
                                            benchmark::Counter::kIsIterationInvariantRate);
}

// FP8 (backend.h Fp8Ops, cuBLASLt on sm_90) at the Linear layers' shapes, beside the bf16
// BM_Linear* above. Arg pass: 0 the forward y = x W^T + b (E4M3 x E4M3 -> bf16), 1 the data
// gradient dx = dy W (E5M2 x E4M3 -> bf16, W's transpose as the K-contiguous operand), 2 the
// weight gradient dW += dy^T x (E5M2 x E4M3 -> fp32, K = batch x tokens, accumulated).
void BM_Fp8Linear(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  if (!gpu().fp8_supported(nullptr)) return st.SkipWithError("no FP8 tensor cores");
  const int in = static_cast<int>(st.range(0)), out = static_cast<int>(st.range(1));
  const int pass = static_cast<int>(st.range(2));
  Bufs b;
  const float one = 1.0f;
  float* scale = static_cast<float*>(b.get(sizeof(float)));
  gpu().copy_to_device(scale, &one, sizeof one);
  const int M = pass == 2 ? out : kN, N = pass == 1 ? in : (pass == 2 ? in : out);
  const int K = pass == 0 ? in : (pass == 1 ? out : kN);
  auto* A = static_cast<uint8_t*>(b.get(size_t(M) * K));
  auto* B = static_cast<uint8_t*>(b.get(size_t(N) * K));
  void* D = b.get(size_t(M) * N * (pass == 2 ? 4 : gpu().act_size()));
  void* bias = pass == 0 ? b.get(size_t(N) * gpu().act_size()) : nullptr;
  const Fp8Format fa = pass == 0 ? Fp8Format::E4M3 : Fp8Format::E5M2;
  timed(st, [&] {
    gpu().fp8_gemm(D, pass == 2, pass == 2 ? 1.0f : 0.0f, A, fa, scale, B, Fp8Format::E4M3,
                   scale, M, N, K, bias);
  });
  st.counters["TFLOP"] = benchmark::Counter(2.0 * kN * in * out * 1e-12,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

// The FP8 Linear layer (backend/fp8_linear.h: its casts as passes of their own, then the GEMMs)
// beside BM_LinearForward / BM_LinearBackward's bf16 layer. Arg pass: 0 forward (with the
// bias; fc1 also its GELU, as the bf16 row), 1 backward (dx, dW, db).
void BM_Fp8LinearLayer(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  if (!gpu().fp8_supported(nullptr)) return st.SkipWithError("no FP8 tensor cores");
  const int in = static_cast<int>(st.range(0)), out = static_cast<int>(st.range(1));
  const bool gelu = st.range(2) != 0, backward = st.range(3) != 0;
  const size_t a = gpu().act_size();
  Bufs b;
  const float s[12] = {1.0f, 0, 0, 0, 1.0f, 0, 0, 0, 1.0f, 0, 0, 0};  // (16-byte aligned)
  auto* scale = static_cast<float*>(b.get(sizeof s));
  gpu().copy_to_device(scale, s, sizeof s);
  const Fp8LinearMeta m{scale, scale, static_cast<float*>(b.get(sizeof s)),
                        Fp8LinearMeta::kAligned};
  auto* scratch = static_cast<uint8_t*>(b.get(fp8_linear_scratch_bytes(kN, in, out)));
  void* x = b.get(size_t(kN) * in * a);
  void* W = b.get(size_t(out) * in * a);
  void* bias = b.get(size_t(out) * a);
  void* y = b.get(size_t(kN) * out * a);
  void* g = gelu ? b.get(size_t(kN) * out * a) : nullptr;
  void* dx = b.get(size_t(kN) * in * a);
  float* dW = static_cast<float*>(b.get(size_t(out) * in * 4));
  float* db = static_cast<float*>(b.get(size_t(out) * 4));
  timed(st, [&] {
    if (backward) {
      fp8_linear_backward(gpu(), m, scratch, dx, dW, db, y, x, W, kN, in, out);
    } else {
      fp8_linear_forward(gpu(), m, scratch, y, x, W, bias, kN, in, out, g, Gelu::Exact);
    }
  });
  st.counters["TFLOP"] = benchmark::Counter((backward ? 4.0 : 2.0) * kN * in * out * 1e-12,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

// An activation [batch x tokens, cols] (bf16) to FP8 codes with its amax, with (arg 1) or
// without its transpose: the pass each FP8 GEMM operand costs while the casts are not fused
// into the kernels producing them. Arg src: 0 the values as they are (fp8_cast), 1 through
// GELU (fc2's input), 2 a gradient through GELU's backward with the bias gradient's column
// sums (fp8_cast_grad: fc1's output gradient, two inputs read). GB: the bytes read and written.
void fill_random_bf16(void* p, size_t n, float scale, unsigned seed);

void BM_Fp8Cast(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const int cols = static_cast<int>(st.range(0));
  const bool transpose = st.range(1) != 0;
  const int src = static_cast<int>(st.range(2));
  Bufs b;
  const size_t a = gpu().act_size(), n = size_t(kN) * cols;
  const float one = 1.0f;
  float* scale = static_cast<float*>(b.get(sizeof(float)));
  gpu().copy_to_device(scale, &one, sizeof one);
  float* amax = static_cast<float*>(b.get(sizeof(float)));
  void* x = b.get(n * a);
  void* pre = src == 2 ? b.get(n * a) : nullptr;
  float* db = src == 2 ? static_cast<float*>(b.get(size_t(cols) * 4)) : nullptr;
  auto* out = static_cast<uint8_t*>(b.get(n));
  auto* out_t = transpose ? static_cast<uint8_t*>(b.get(n)) : nullptr;
  fill_random_bf16(x, n, 2.0f, 1);  // random values, as in training (not the zero fill)
  if (pre) fill_random_bf16(pre, n, 2.0f, 2);
  const Gelu g = Gelu::Exact;
  timed(st, [&] {
    if (src == 2)
      gpu().fp8_cast_grad(out, out_t, amax, x, kN, cols, scale, Fp8Format::E5M2, db, pre, g);
    else
      gpu().fp8_cast(out, out_t, amax, x, kN, cols, scale, Fp8Format::E4M3, src == 1 ? &g : nullptr);
  });
  st.counters["GB"] = benchmark::Counter(
      double(n) * ((src == 2 ? 2 : 1) * a + 1 + (transpose ? 1 : 0)) * 1e-9,
      benchmark::Counter::kIsIterationInvariantRate);
}

void BM_AttentionForward(benchmark::State& st) { attention_bench(st, false); }
void BM_AttentionFwdBwd(benchmark::State& st) { attention_bench(st, true); }

// The residual add + LayerNorm forward of ViT-B/16's rows; arg fp8: 1 writing the next
// Linear's FP8 input (codes, transpose, amax: add_layernorm_forward_fp8) instead of y.
// Random values (fill_random_bf16). GB: bytes read and written.
void BM_LayerNormForward(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const bool fp8 = st.range(0) != 0;
  const size_t a = gpu().act_size(), nc = size_t(kN) * kC;
  Bufs b;
  void *res = b.get(nc * a), *y = b.get(nc * a), *x = b.get(nc * a), *r = b.get(nc * a);
  float* mean = static_cast<float*>(b.get(kN * 4));
  float* rstd = static_cast<float*>(b.get(kN * 4));
  void *g = b.get(kC * a), *be = b.get(kC * a);
  auto* out = static_cast<uint8_t*>(b.get(nc));
  auto* out_t = static_cast<uint8_t*>(b.get(nc));
  const float one[4] = {1.0f, 0, 0, 0};
  auto* scale = static_cast<float*>(b.get(sizeof one));
  gpu().copy_to_device(scale, one, sizeof one);
  auto* amax = static_cast<float*>(b.get(16));
  fill_random_bf16(x, nc, 1.0f, 1);
  fill_random_bf16(r, nc, 1.0f, 2);
  fill_random_bf16(g, kC, 1.0f, 3);
  fill_random_bf16(be, kC, 0.5f, 4);
  timed(st, [&] {
    if (fp8)
      gpu().add_layernorm_forward_fp8(res, out, out_t, amax, scale, Fp8Format::E4M3, mean, rstd,
                                      x, r, g, be, kN, kC, 1e-6f);
    else
      gpu().add_layernorm_forward(res, y, mean, rstd, x, r, g, be, kN, kC, 1e-6f);
  });
  st.counters["GB"] = benchmark::Counter((fp8 ? 3.0 * a + 2.0 : 4.0 * a) * nc * 1e-9,
                                           benchmark::Counter::kIsIterationInvariantRate);
}

void BM_LayerNormBackward(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const size_t a = gpu().act_size(), nc = size_t(kN) * kC;
  Bufs b;
  void *dx = b.get(nc * a), *dy = b.get(nc * a), *x = b.get(nc * a), *g = b.get(kC * a);
  float* mean = static_cast<float*>(b.get(kN * 4));
  float* rstd = static_cast<float*>(b.get(kN * 4));
  float* dg = static_cast<float*>(b.get(kC * 4));
  float* dbt = static_cast<float*>(b.get(kC * 4));
  timed(st, [&] { gpu().layernorm_backward(dx, dg, dbt, dy, x, g, mean, rstd, kN, kC); });
  // dx pass: read dy, x, dx, write dx; parameter pass: read dy, x again
  st.counters["GB"] = benchmark::Counter(6.0 * nc * a * 1e-9,
                                           benchmark::Counter::kIsIterationInvariantRate);
}

// LayerNorm backward on the fused kernel, bf16, N = 256 x 197 rows, at the ViT-B (768), ViT-S
// (384) and ViT-L (1024) widths; each call includes the final dgamma / dbeta reduction. GB
// counts what a fused kernel must move: dy, x and dx read, dx written. With dsum = 1 also dx's
// column sums (a Row Linear's bias gradient), inside the kernel. (The first fused kernel it
// was measured against is gone: git history.)
void BM_LayerNormBackwardKernel(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const int C = static_cast<int>(st.range(0));
  const bool ds = st.range(1) != 0;
  Backend& be = gpu();
  const size_t a = be.act_size(), nc = size_t(kN) * C;
  Bufs b(be);
  void *dx = b.get(nc * a), *dy = b.get(nc * a), *x = b.get(nc * a), *g = b.get(C * a);
  float* mean = static_cast<float*>(b.get(kN * 4));
  float* rstd = static_cast<float*>(b.get(kN * 4));
  float* dg = static_cast<float*>(b.get(C * 4));
  float* dbt = static_cast<float*>(b.get(C * 4));
  float* dsum = ds ? static_cast<float*>(b.get(C * 4)) : nullptr;
  timed(
      st, [&] { be.layernorm_backward(dx, dg, dbt, dy, x, g, mean, rstd, kN, C, dsum); },
      [&] { be.synchronize(); });
  st.counters["GB"] = benchmark::Counter(4.0 * nc * a * 1e-9,
                                           benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(ds ? "dx column sums inside" : "");
}

// The LayerNorm backward whose dx is the output gradient of the FP8 Row Linear before it (LN2
// for proj, LN1 for the previous block's fc2), ViT-B/16's rows, bf16, with the bias sums (dsum)
// and E5M2 codes, their transpose and amax: arg fused 0 the LayerNorm backward then the cast
// (Backend's two ops), 1 the fused kernel writing the codes (layernorm_backward_fp8). Random
// values (fill_random_bf16). GB: dy, x, dx read, dx written, the codes and their transpose.
void BM_LayerNormBackwardFp8(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const bool fused = st.range(0) != 0;
  Backend& be = gpu();
  const size_t a = be.act_size(), nc = size_t(kN) * kC;
  Bufs b(be);
  void *dx = b.get(nc * a), *dy = b.get(nc * a), *x = b.get(nc * a), *g = b.get(kC * a);
  float* mean = static_cast<float*>(b.get(kN * 4));
  float* rstd = static_cast<float*>(b.get(kN * 4));
  float* dg = static_cast<float*>(b.get(kC * 4));
  float* dbt = static_cast<float*>(b.get(kC * 4));
  float* dsum = static_cast<float*>(b.get(kC * 4));
  auto* out = static_cast<uint8_t*>(b.get(nc));
  auto* out_t = static_cast<uint8_t*>(b.get(nc));
  const float one[4] = {1.0f, 0, 0, 0};
  auto* scale = static_cast<float*>(b.get(sizeof one));
  be.copy_to_device(scale, one, sizeof one);
  auto* amax = static_cast<float*>(b.get(16));
  fill_random_bf16(dy, nc, 1.0f, 1);
  fill_random_bf16(x, nc, 1.0f, 2);
  fill_random_bf16(g, kC, 1.0f, 3);
  be.add_layernorm_forward(dx, b.get(nc * a), mean, rstd, x, nullptr, g, g, kN, kC, 1e-6f);
  fill_random_bf16(dx, nc, 0.01f, 4);  // (small: the repeated updates stay finite)
  timed(
      st,
      [&] {
        if (fused)
          be.layernorm_backward_fp8(dx, dg, dbt, dy, x, g, mean, rstd, kN, kC, dsum, nullptr, {},
                                    out, out_t, amax, scale, Fp8Format::E5M2);
        else
          be.Backend::layernorm_backward_fp8(dx, dg, dbt, dy, x, g, mean, rstd, kN, kC, dsum,
                                             nullptr, {}, out, out_t, amax, scale,
                                             Fp8Format::E5M2);
      },
      [&] { be.synchronize(); });
  st.counters["GB"] = benchmark::Counter((4.0 * a + 2.0) * nc * 1e-9,
                                           benchmark::Counter::kIsIterationInvariantRate);
}

// LayerNorm on wide rows (the block-per-row kernels past the warp-per-row kernels' reach; the
// A/B switch against the earlier paths is gone: git history), bf16,
// 6304 x 4096 elements in all (the large ViT's rows of 32 images in 1d tensor
// parallelism) at widths C from ViT-L's 1024 to 8192; op 0 the forward with the residual add
// (GB: a, b read, res, y written), 1 the backward (dy, x, dx read, dx written; with the
// dgamma / dbeta reduction), 2 the backward with dx's column sums (dsum: a Row Linear's bias
// gradient, as 1d tensor parallelism runs it).
void BM_LayerNormWide(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const int C = static_cast<int>(st.range(0));
  const int op = static_cast<int>(st.range(1));
  const int N = 6304 * 4096 / C;
  Backend& be = gpu();
  const size_t a = be.act_size(), nc = size_t(N) * C;
  Bufs b(be);
  void *p0 = b.get(nc * a), *p1 = b.get(nc * a), *p2 = b.get(nc * a), *p3 = b.get(nc * a);
  void *g = b.get(C * a), *bt = b.get(C * a);
  float* mean = static_cast<float*>(b.get(N * 4));
  float* rstd = static_cast<float*>(b.get(N * 4));
  float* dg = static_cast<float*>(b.get(C * 4));
  float* dbt = static_cast<float*>(b.get(C * 4));
  float* dsum = op == 2 ? static_cast<float*>(b.get(C * 4)) : nullptr;
  if (op == 0)
    timed(
        st, [&] { be.add_layernorm_forward(p0, p1, mean, rstd, p2, p3, g, bt, N, C, 1e-6f); },
        [&] { be.synchronize(); });
  else
    timed(
        st, [&] { be.layernorm_backward(p0, dg, dbt, p1, p2, g, mean, rstd, N, C, dsum); },
        [&] { be.synchronize(); });
  st.counters["GB"] = benchmark::Counter(4.0 * nc * a * 1e-9,
                                           benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(op == 0 ? "forward" : op == 1 ? "backward" : "backward + dx column sums");
}

// The LayerNorm of rows split over q tensor ranks (2d / 2.5d / 3d: layernorm_split_*), the ops
// of one rank, bf16, 6304 x 4096 elements of the whole rows (the large ViT's 32 images) over
// q = 2 ranks (local width 2048) and ViT-B's 768 over q = 2 (384, 50432 rows); op 0 the
// forward (row sums, centred squares, apply: after each of the first two the strategy sums
// over the ranks), 1 the backward (row sums of dy gamma and dy gamma xhat with the dgamma /
// dbeta reduction, then dx). vec 1: 16-byte aligned rows (16-byte packs per lane), 0: the
// rows shifted by one element (element by element). GB: what the ops must move (forward: x
// read three times, y written; backward: dy and x read twice, dx read and written).
void BM_LayerNormSplit(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const int C = static_cast<int>(st.range(0)), op = static_cast<int>(st.range(1));
  const bool vec = st.range(2) != 0;
  const int Ct = 2 * C, N = (C == 384 ? 50432 : 6304 * 4096 / Ct);
  Backend& be = gpu();
  const size_t a = be.act_size(), nc = size_t(N) * C, off = vec ? 0 : a;
  Bufs b;
  auto at = [&](void* p) { return static_cast<void*>(static_cast<char*>(p) + off); };
  void *x = at(b.get(nc * a + 16)), *y = at(b.get(nc * a + 16)), *dy = at(b.get(nc * a + 16));
  void *g = at(b.get(C * a + 16)), *bt = at(b.get(C * a + 16));
  float* mean = static_cast<float*>(b.get(N * 4));
  float* rstd = static_cast<float*>(b.get(N * 4));
  float* sums = static_cast<float*>(b.get(2 * N * 4));
  float* dg = static_cast<float*>(b.get(C * 4));
  float* dbt = static_cast<float*>(b.get(C * 4));
  if (op == 0)
    timed(st, [&] {
      be.layernorm_split_sums(mean, x, N, C);
      be.layernorm_split_centered(rstd, mean, x, N, C, Ct);
      be.layernorm_split_apply(y, rstd, x, mean, g, bt, N, C, Ct, 1e-6f);
    });
  else
    timed(st, [&] {
      be.layernorm_split_backward_sums(sums, dg, dbt, dy, x, g, mean, rstd, N, C);
      be.layernorm_split_backward_dx(y, dy, x, g, mean, rstd, sums, N, C, Ct);
    });
  st.counters["GB"] = benchmark::Counter((op == 0 ? 4.0 : 6.0) * nc * a * 1e-9,
                                           benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(std::string(vec ? "16-byte packs" : "element by element") +
              (op == 0 ? ", forward" : ", backward"));
}

// Elementwise passes over the fc1 activation [N, 4C]: op 0 add (2 reads, 1 write: the memory
// roofline of a map), 1 exact GELU forward (1 read, 1 write), 2 its backward (2 reads, 1 write),
// 3 tanh GELU forward, 4 dropout (p = 0.1, in place, as the model runs it: 1 read, 1 write),
// 5 dropout with the step and position read from device memory (what CUDA graphs replay).
void BM_Elementwise(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const int op = static_cast<int>(st.range(0));
  const size_t a = gpu().act_size(), n = size_t(kN) * 4 * kC;
  Bufs b;
  void *x = b.get(n * a), *y = b.get(n * a), *z = b.get(n * a);
  DropoutKey k{5, 0x1234, 0, 0, 0, 0};
  if (op == 5) {
    const int64_t position[2] = {7, 3};
    void* p = b.get(sizeof(position));
    gpu().copy_to_device(p, position, sizeof(position));
    k.position = static_cast<const int64_t*>(p);
    k.step_tag = 5;
    k.sample_elems = 197 * 4 * kC;
  }
  timed(st, [&] {
    if (op == 0) gpu().add(z, x, y, n);
    if (op == 1) gpu().gelu_forward(z, x, n, Gelu::Exact);
    if (op == 2) gpu().gelu_backward(z, x, y, n, Gelu::Exact);
    if (op == 3) gpu().gelu_forward(z, x, n, Gelu::Tanh);
    if (op >= 4) gpu().dropout_forward(z, z, n, 0.1f, k);
  });
  const double passes = op == 0 || op == 2 ? 3.0 : 2.0;
  st.counters["GB"] = benchmark::Counter(passes * n * a * 1e-9,
                                           benchmark::Counter::kIsIterationInvariantRate);
}

// The MLP's exact GELU with its GEMMs, bf16, batch 256 x 197 rows, at ViT-B (C = 768) and
// ViT-S (C = 384). Forward (fc1): h = x W1^T + b1 and g = gelu(h), [N, 4C] from x [N, C]
// (gemm_gelu.h: in = C, out = 4C). Backward (fc2's data gradient): dg = dy W2 [N, 4C] from
// dy [N, C] and W2 [C, 4C], then dh = dg * gelu'(h) (gemm_gelu.h: in = 4C, out = C).
// Candidates, registered at run time (main) from gemm_gelu.h's configuration list:
//  * unfused: cuBLASLt GEMM (bias epilogue forward), then gelu_forward / gelu_backward, on a
//    backend with device.gemm_tune = 8 (the cuBLASLt algorithm timed, as the bench deck);
//  * config:K: the CUTLASS kernel K with the default tile scheduling (one kernel writes h and
//    g, or dh), on a stream of its own;
//  * tuned: what that backend chooses (device.fused_gelu's default, auto: the fastest of all
//    the above and the scheduler settings of the fastest kernel, timed on the first call),
//    run as the backend runs it (forward: linear_forward; backward: the
//    chosen data-gradient path alone, without linear_backward's dW / db GEMM);
// and, ViT-B only, BM_GemmGeluSchedules: every other configuration id (each kernel with each
// raster order / swizzle). Operands random (fill_random_bf16). TFLOP counts the GEMM only.
// After the run a ranking per model and direction is printed, and the backend's choices with
// their timings. Fused rows are skipped where the kernels are unavailable (no CUTLASS at build
// time, not sm_90).
constexpr int kUnfused = -1, kTuned = -2;

// n bf16 values uniform in [-scale, scale] into device memory p: a host pattern of 2^20 values
// (from seed) repeated.
void fill_random_bf16(void* p, size_t n, float scale, unsigned seed) {
  static constexpr size_t kPattern = size_t(1) << 20;
  std::vector<uint16_t> pat(std::min(n, kPattern));
  uint32_t r = 0x9E3779B9u * (seed + 1);
  for (uint16_t& v : pat) {
    r = r * 1664525u + 1013904223u;  // LCG: plenty for operand values
    const float f = scale * (float(r >> 8) * (2.0f / 16777216.0f) - 1.0f);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>(bits >> 16);  // truncated to bf16
  }
  gpu().synchronize();  // the zero fill of p is on the backend's stream
  for (size_t off = 0; off < n; off += pat.size()) {
    const size_t k = std::min(pat.size(), n - off);
    VG_CHECK(cudaMemcpy(static_cast<uint16_t*>(p) + off, pat.data(), k * 2,
                        cudaMemcpyHostToDevice) == cudaSuccess,
             "cudaMemcpy");
  }
}

// The bias gradients' column sums (CudaBackend::column_sums_add) of a [N, C] matrix at ViT-B:
// kind 0 C = 768 (proj, fc2), 1 C = 3 x 768 (qkv); 2 the GELU backward with fc1's bias
// gradient (gelu_backward_bias, [N, 4C]: reads h and dy, writes dx, sums dx's columns).
void BM_ColumnSums(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const int kind = static_cast<int>(st.range(0));
  const int C = kind == 0 ? kC : kind == 1 ? 3 * kC : 4 * kC;
  const size_t n = size_t(kN) * C;
  Bufs b;
  void *x = b.get(n * 2), *y = b.get(n * 2), *z = b.get(n * 2);
  float* db = static_cast<float*>(b.get(C * sizeof(float)));
  fill_random_bf16(x, n, 3.0f, 1);
  fill_random_bf16(y, n, 1.0f, 2);
  auto& cb = static_cast<CudaBackend&>(gpu());
  timed(st, [&] {
    if (kind <= 1) cb.column_sums_add(db, x, kN, C);
    if (kind == 2) cb.gelu_backward_bias(z, x, y, kN, C, db, Gelu::Exact);
  });
  const double passes = kind <= 1 ? 1.0 : 3.0;
  st.counters["GB"] = benchmark::Counter(passes * n * 2 * 1e-9,
                                           benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_ColumnSums)
    ->ArgName("kind")
    ->DenseRange(0, 2)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

Backend& tuned_gpu() {
  static std::unique_ptr<Backend> be = [] {
    BackendOptions o;
    o.gemm_tune = 8;
    return make_cuda_backend(0, DType::BF16, o);
  }();
  return *be;
}

struct GemmGeluResult {
  std::string group, name;
  double ms;
  double tflops;
};
std::vector<GemmGeluResult>& gemm_gelu_results() {
  static std::vector<GemmGeluResult> r;
  return r;
}

void gemm_gelu_bench(benchmark::State& st, int C, bool fwd, int cand, const std::string& group) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const bool fused_rows = cand >= 0;
  if (fused_rows &&
      !(cuda::gemm_gelu_available() && cuda::gemm_gelu_supported(DType::BF16, kN, C, 4 * C)))
    return st.SkipWithError("fused GELU GEMMs unavailable (no CUTLASS, or not sm_90)");
  Backend& be = tuned_gpu();
  const size_t a = be.act_size(), nc = size_t(kN) * C, nh = size_t(kN) * 4 * C;
  Bufs b;
  void* x = b.get(nc * a);                 // x (forward) or dy (backward)
  void* W = b.get(size_t(4) * C * C * a);  // W1 [4C, C] or W2 [C, 4C]
  void* bias = b.get(size_t(4) * C * a);
  void* h = b.get(nh * a);
  void* g = b.get(nh * a);   // g (forward) or dh (backward)
  void* dg = b.get(nh * a);  // unfused backward: dy W2
  const int in = fwd ? C : 4 * C, out = fwd ? 4 * C : C;
  const size_t wsb = cuda::gemm_gelu_workspace_bytes(DType::BF16, kN, in, out);
  void* ws = wsb ? b.get(wsb) : nullptr;
  static cudaStream_t s = [] {
    cudaStream_t t = nullptr;
    VG_CHECK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking) == cudaSuccess, "stream");
    return t;
  }();
  // Random operands (zeros would let the tensor cores run cooler and faster than in training):
  // x / dy uniform in [-1, 1], W in [-1, 1] / sqrt(K), b in [-0.5, 0.5], h in [-2, 2].
  fill_random_bf16(x, nc, 1.0f, 1);
  fill_random_bf16(W, size_t(4) * C * C, 1.0f / std::sqrt(float(C)), 2);  // K = C both ways
  fill_random_bf16(bias, size_t(4) * C, 0.5f, 3);
  fill_random_bf16(h, nh, 2.0f, 4);
  gpu().synchronize();  // the zero fills
  int run = cand;       // what the loop runs: kUnfused, a configuration, or (forward) kTuned
  std::string label;
  if (cand == kTuned) {
    auto* cb = dynamic_cast<CudaBackend*>(&be);
    if (fwd) {
      be.linear_forward(h, x, W, bias, kN, in, out, g, Gelu::Exact);  // the choice, if new
      run = kTuned;
    } else {
      Bufs grads;
      float* dW = static_cast<float*>(grads.get(size_t(out) * in * 4));
      float* db = static_cast<float*>(grads.get(size_t(out) * 4));
      be.linear_backward(g, dW, db, x, h, W, kN, in, out, h, Gelu::Exact);
      run = cb ? cb->fused_gelu_choice(false, kN, in, out) : kUnfused;
      if (run < kUnfused) run = kUnfused;  // no decision (fused GELU off or unavailable)
      be.synchronize();                    // before grads are freed
    }
    be.synchronize();
    const int c = cb ? cb->fused_gelu_choice(fwd, kN, in, out) : -2;
    label = "tuned: " +
            (c >= 0 ? std::to_string(c) + " " + cuda::gemm_gelu_config_name(DType::BF16, fwd, c)
                    : std::string(c == -1 ? "unfused" : "unfused (fused path off or unavailable)"));
  } else if (cand == kUnfused) {
    label = "unfused (cuBLASLt + GELU pass)";
  } else {
    label = std::to_string(cand) + " " + cuda::gemm_gelu_config_name(DType::BF16, fwd, cand);
  }
  auto sync = [&] {
    if (run >= 0) {
      VG_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "cudaStreamSynchronize");
    } else {
      be.synchronize();
    }
  };
  double total = 0;
  int64_t n = 0;
  auto op = [&] {
    if (run >= 0) {
      if (fwd) {
        cuda::gemm_bias_gelu_forward(DType::BF16, s, h, g, x, W, bias, kN, in, out, ws, wsb, run);
      } else {
        cuda::gemm_dgelu_backward(DType::BF16, s, g, x, W, h, kN, in, out, ws, wsb, run);
      }
    } else if (run == kTuned) {
      be.linear_forward(h, x, W, bias, kN, in, out, g, Gelu::Exact);
    } else if (fwd) {
      be.linear_forward(h, x, W, bias, kN, in, out);
      be.gelu_forward(g, h, nh, Gelu::Exact);
    } else {
      be.gemm_batched(false, false, kN, in, out, 1.0f, x, 0, W, 0, 0.0f, dg, 0, 1);
      be.gelu_backward(g, h, dg, nh, Gelu::Exact);
    }
  };
  op();  // warm-up: plans and module loading here, never in the loop
  sync();
  for (auto _ : st) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < kReps; ++r) op();
    sync();
    const double sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kReps;
    st.SetIterationTime(sec);
    total += sec;
    ++n;
  }
  const double flop = 2.0 * kN * in * out;
  st.counters["TFLOP"] =
      benchmark::Counter(flop * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(label);
  if (n > 0)
    gemm_gelu_results().push_back({group, label, 1e3 * total / n, flop * n / total * 1e-12});
}

void register_gemm_gelu_benchmarks() {
  // Every compiled kernel is listed; on a device without them its rows are skipped.
  const bool have = cuda::gemm_gelu_kernel_count(DType::BF16, true) > 0;
  for (int C : {kC, 384}) {
    for (bool fwd : {true, false}) {
      const std::string base =
          "BM_GemmGelu/C:" + std::to_string(C) + (fwd ? "/forward" : "/backward");
      const std::string group =
          (C == kC ? "ViT-B " : "ViT-S ") +
          std::string(fwd ? "forward (fc1 + GELU)" : "backward (fc2 dgrad * GELU')");
      std::vector<std::pair<std::string, int>> cands = {{"unfused", kUnfused}, {"tuned", kTuned}};
      const int nk = have ? cuda::gemm_gelu_kernel_count(DType::BF16, fwd) : 0;
      for (int k = 0; k < nk; ++k)
        cands.push_back(
            {"config:" + std::to_string(k), cuda::gemm_gelu_config_id(DType::BF16, fwd, k, 0)});
      for (const auto& [name, cand] : cands) {
        benchmark::RegisterBenchmark(
            (base + "/" + name).c_str(),
            [=](benchmark::State& st) { gemm_gelu_bench(st, C, fwd, cand, group); })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
      if (C != kC || !have) continue;
      const std::string sgroup = group + ", every scheduler setting";
      for (int c = nk; c < cuda::gemm_gelu_config_count(DType::BF16, fwd); ++c) {
        benchmark::RegisterBenchmark(
            ("BM_GemmGeluSchedules/C:" + std::to_string(C) + (fwd ? "/forward" : "/backward") +
             "/config:" + std::to_string(c))
                .c_str(),
            [=](benchmark::State& st) { gemm_gelu_bench(st, C, fwd, c, sgroup); })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
}

// The GemmGelu rows of this run, fastest first per group, then the tuned backend's choices.
void print_gemm_gelu_ranking() {
  std::vector<GemmGeluResult> r = gemm_gelu_results();
  if (r.empty()) return;
  std::stable_sort(r.begin(), r.end(), [](const GemmGeluResult& a, const GemmGeluResult& b) {
    return a.group != b.group ? a.group < b.group : a.ms < b.ms;
  });
  std::printf("\nGemmGelu ranking (bf16, N = %d rows; TFLOP/s of the GEMM):\n", kN);
  std::string group;
  for (const GemmGeluResult& x : r) {
    if (x.group != group) {
      group = x.group;
      std::printf("  %s\n", group.c_str());
    }
    std::printf("    %8.4f ms  %6.1f TFLOP/s  %s\n", x.ms, x.tflops, x.name.c_str());
  }
  if (auto* cb = dynamic_cast<CudaBackend*>(&tuned_gpu())) {
    const std::string rep = cb->fused_gelu_report();
    if (!rep.empty()) std::printf("\nThe tuned backend's choices:\n%s", rep.c_str());
  }
  std::fflush(stdout);
}

void BM_AdamW(benchmark::State& st) {
  if (cuda_device_count() == 0) return st.SkipWithError("no CUDA device");
  const size_t n = 86'000'000;
  Bufs b;
  float* p = static_cast<float*>(b.get(n * 4));
  float* g = static_cast<float*>(b.get(n * 4));
  float* m = static_cast<float*>(b.get(n * 4));
  float* v = static_cast<float*>(b.get(n * 4));
  // ViT-B-like slice list: 12 blocks of (4 matrices + 8 vectors) plus embeddings and head.
  std::vector<ParamSlice> slices;
  size_t off = 0;
  auto add = [&](size_t k, float wd) {  // slices past n are dropped (n is a round 86M)
    if (off >= n) return;
    k = std::min(k, n - off);
    slices.push_back({off, k, wd});
    off += k;
  };
  add(768 * 768 * 3, 0.05f);
  for (int l = 0; l < 12; ++l) {
    add(768 * 2304, 0.05f); add(2304, 0); add(768 * 768, 0.05f); add(768, 0);
    add(768 * 3072, 0.05f); add(3072, 0); add(3072 * 768, 0.05f); add(768, 0);
    add(768, 0); add(768, 0); add(768, 0); add(768, 0);
  }
  if (off < n) add(n - off, 0.05f);  // the rest (head, pos embed, ...) as one slice
  const AdamParams ap{1e-3f, 0.9f, 0.999f, 1e-8f, 10, 1.0f};
  timed(st, [&] { gpu().adamw_update(p, g, m, v, slices, ap); });
  st.counters["GB"] = benchmark::Counter(7.0 * n * 4 * 1e-9,
                                           benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_LinearForward)
    ->ArgNames({"in", "out", "gelu"})
    ->Args({kC, 3 * kC, 0})
    ->Args({kC, kC, 0})
    ->Args({kC, 4 * kC, 1})
    ->Args({4 * kC, kC, 0})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LinearBackward)
    ->ArgNames({"in", "out"})
    ->Args({kC, 3 * kC})
    ->Args({kC, kC})
    ->Args({kC, 4 * kC})
    ->Args({4 * kC, kC})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LinearWgrad)
    ->ArgNames({"in", "out", "tune"})
    ->ArgsProduct({{kC}, {3 * kC, kC, 4 * kC}, {0, 1}})
    ->ArgsProduct({{4 * kC}, {kC}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Fp8Linear)
    ->ArgNames({"in", "out", "pass"})
    ->ArgsProduct({{kC}, {3 * kC, kC, 4 * kC}, {0, 1, 2}})
    ->ArgsProduct({{4 * kC}, {kC}, {0, 1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Fp8LinearLayer)
    ->ArgNames({"in", "out", "gelu", "backward"})
    ->Args({kC, 3 * kC, 0, 0})
    ->Args({kC, kC, 0, 0})
    ->Args({kC, 4 * kC, 1, 0})
    ->Args({4 * kC, kC, 0, 0})
    ->Args({kC, 3 * kC, 0, 1})
    ->Args({kC, kC, 0, 1})
    ->Args({kC, 4 * kC, 0, 1})
    ->Args({4 * kC, kC, 0, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Fp8Cast)
    ->ArgNames({"cols", "transpose", "src"})
    ->Args({kC, 0, 0})
    ->Args({kC, 1, 0})
    ->Args({3 * kC, 1, 0})
    ->Args({4 * kC, 1, 1})
    ->Args({4 * kC, 1, 2})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AttentionForward)
    ->ArgNames({"path", "T"})
    ->ArgsProduct({{0, 1, 2}, {kT, 50}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AttentionFwdBwd)
    ->ArgNames({"path", "T"})
    ->ArgsProduct({{0, 1, 2}, {kT, 50}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlashKernels)
    ->ArgNames({"kernels", "T", "backward"})
    ->ArgsProduct({{0, 1}, {kT, 50}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Elementwise)
    ->ArgName("op")
    ->DenseRange(0, 5)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LayerNormForward)->ArgName("fp8")->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LayerNormBackward)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LayerNormBackwardKernel)
    ->ArgNames({"C", "dsum"})
    ->ArgsProduct({{kC, 384, 1024}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LayerNormBackwardFp8)
    ->ArgName("fused")
    ->Arg(0)
    ->Arg(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LayerNormWide)
    ->ArgNames({"C", "op"})
    ->ArgsProduct({{1024, 1280, 1536, 2048, 4096, 8192}, {0, 1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LayerNormSplit)
    ->ArgNames({"C", "op", "vec"})
    ->ArgsProduct({{384, 2048}, {0, 1}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace vitgrid

int main(int argc, char** argv) {
  // MPI is initialised because the backend's fatal-error path reports the rank and aborts
  // the MPI job; the benchmark itself is single-process.
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  benchmark::Initialize(&argc, argv);
  vitgrid::register_gemm_gelu_benchmarks();
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
    vitgrid::print_gemm_gelu_ranking();
  }
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
