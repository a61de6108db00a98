// Google Benchmark of the CPU backend's hot kernels at ViT-Lite-7/4 sizes (CIFAR-10, 32x32
// images, patch 4: T = 65 tokens, C = 256, MLP 512, 4 heads of 64; micro-batch 128). One core
// per MPI rank in training, so run with OPENBLAS_NUM_THREADS=1 for representative numbers.
// GEMM cases report FLOP/s, memory-bound ones bytes/s, all of them items (rows, params)/s.
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <vector>

#include "vitgrid/backend/cpu/cpu_backend.h"

namespace {

using vitgrid::CpuBackend;
using vitgrid::DType;

constexpr int kTokens = 65, kBatch = 128, kRows = kBatch * kTokens, kWidth = 256;

// A backend buffer of n floats filled with small random values (never denormal-heavy zeros).
float* filled(CpuBackend& be, size_t n, uint32_t seed, float scale = 0.5f) {
  float* p = static_cast<float*>(be.alloc(n * sizeof(float)));
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  for (size_t i = 0; i < n; ++i) p[i] = d(gen);
  return p;
}

void set_flops(benchmark::State& st, double flops_per_iter) {
  st.counters["FLOP/s"] = benchmark::Counter(flops_per_iter, benchmark::Counter::kIsIterationInvariantRate,
                                             benchmark::Counter::kIs1000);
}

// Linear [N, in] -> [N, out]: the qkv (256 -> 768), proj (256 -> 256) and MLP (256 <-> 512)
// shapes of a block.
void BM_LinearForward(benchmark::State& st) {
  const int in = (int)st.range(0), out = (int)st.range(1), N = kRows;
  CpuBackend be(DType::F32);
  float *x = filled(be, (size_t)N * in, 1), *W = filled(be, (size_t)out * in, 2),
        *b = filled(be, out, 3), *y = filled(be, (size_t)N * out, 4);
  for (auto _ : st) {
    be.linear_forward(y, x, W, b, N, in, out);
    benchmark::DoNotOptimize(y);
    benchmark::ClobberMemory();
  }
  set_flops(st, 2.0 * N * in * out);
  st.SetItemsProcessed(st.iterations() * (int64_t)N);
}
BENCHMARK(BM_LinearForward)->Args({kWidth, 3 * kWidth})->Args({kWidth, kWidth})
    ->Args({kWidth, 2 * kWidth})->Args({2 * kWidth, kWidth})->Unit(benchmark::kMillisecond);

void BM_LinearForwardGelu(benchmark::State& st) {
  const int in = kWidth, out = 2 * kWidth, N = kRows;
  CpuBackend be(DType::F32);
  float *x = filled(be, (size_t)N * in, 1), *W = filled(be, (size_t)out * in, 2),
        *b = filled(be, out, 3), *y = filled(be, (size_t)N * out, 4),
        *g = filled(be, (size_t)N * out, 5);
  const auto kind = st.range(0) ? vitgrid::Gelu::Tanh : vitgrid::Gelu::Exact;
  for (auto _ : st) {
    be.linear_forward(y, x, W, b, N, in, out, g, kind);
    benchmark::ClobberMemory();
  }
  set_flops(st, 2.0 * N * in * out);
  st.SetItemsProcessed(st.iterations() * (int64_t)N);
}
BENCHMARK(BM_LinearForwardGelu)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

void BM_LinearBackward(benchmark::State& st) {
  const int in = (int)st.range(0), out = (int)st.range(1), N = kRows;
  CpuBackend be(DType::F32);
  float *x = filled(be, (size_t)N * in, 1), *W = filled(be, (size_t)out * in, 2),
        *dy = filled(be, (size_t)N * out, 3), *dx = filled(be, (size_t)N * in, 4),
        *dW = filled(be, (size_t)out * in, 5), *db = filled(be, out, 6);
  for (auto _ : st) {
    be.linear_backward(dx, dW, db, dy, x, W, N, in, out);
    benchmark::ClobberMemory();
  }
  set_flops(st, 4.0 * N * in * out);  // dx and dW GEMMs
  st.SetItemsProcessed(st.iterations() * (int64_t)N);
}
BENCHMARK(BM_LinearBackward)->Args({kWidth, 3 * kWidth})->Args({kWidth, 2 * kWidth})
    ->Unit(benchmark::kMillisecond);

// Multi-head attention forward + backward, B = 32 sequences of 65 tokens, 4 heads of 64.
void BM_AttentionFwdBwd(benchmark::State& st) {
  const int B = 32, T = kTokens, H = 4, hd = 64, C = H * hd;
  CpuBackend be(DType::F32);
  float *qkv = filled(be, (size_t)B * T * 3 * C, 1), *out = filled(be, (size_t)B * T * C, 2),
        *dout = filled(be, (size_t)B * T * C, 3), *dqkv = filled(be, (size_t)B * T * 3 * C, 4);
  void* saved = be.alloc(be.attention_saved_bytes(B, T, H, hd));
  void* ws = be.alloc(be.attention_workspace_bytes(B, T, H, hd));
  for (auto _ : st) {
    be.attention_forward(out, saved, qkv, B, T, H, hd, ws);
    be.attention_backward(dqkv, dout, qkv, out, saved, B, T, H, hd, ws);
    benchmark::ClobberMemory();
  }
  // Forward 2 GEMMs of 2*T*T*hd, backward 4: per (b, h).
  set_flops(st, 12.0 * B * H * T * T * hd);
  st.SetItemsProcessed(st.iterations() * (int64_t)B * T);
}
BENCHMARK(BM_AttentionFwdBwd)->Unit(benchmark::kMillisecond);

void BM_AddLayernormForward(benchmark::State& st) {
  const int N = kRows, C = kWidth;
  CpuBackend be(DType::F32);
  float *a = filled(be, (size_t)N * C, 1), *b = filled(be, (size_t)N * C, 2),
        *res = filled(be, (size_t)N * C, 3), *y = filled(be, (size_t)N * C, 4),
        *g = filled(be, C, 5), *bt = filled(be, C, 6), *mean = filled(be, N, 7),
        *rstd = filled(be, N, 8);
  for (auto _ : st) {
    be.add_layernorm_forward(res, y, mean, rstd, a, b, g, bt, N, C, 1e-6f);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * (int64_t)N * C * 4 * 4);  // read a, b; write res, y
  st.SetItemsProcessed(st.iterations() * (int64_t)N);
}
BENCHMARK(BM_AddLayernormForward)->Unit(benchmark::kMicrosecond);

void BM_LayernormBackward(benchmark::State& st) {
  const int N = kRows, C = kWidth;
  CpuBackend be(DType::F32);
  float *x = filled(be, (size_t)N * C, 1), *y = filled(be, (size_t)N * C, 2),
        *res = filled(be, (size_t)N * C, 3), *dy = filled(be, (size_t)N * C, 4),
        *dx = filled(be, (size_t)N * C, 5), *g = filled(be, C, 6), *bt = filled(be, C, 7),
        *dg = filled(be, C, 8), *db = filled(be, C, 9), *mean = filled(be, N, 10),
        *rstd = filled(be, N, 11);
  be.add_layernorm_forward(res, y, mean, rstd, x, nullptr, g, bt, N, C, 1e-6f);
  for (auto _ : st) {
    be.layernorm_backward(dx, dg, db, dy, res, g, mean, rstd, N, C);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * (int64_t)N * C * 4 * 4);  // read dy, x, dx; write dx
  st.SetItemsProcessed(st.iterations() * (int64_t)N);
}
BENCHMARK(BM_LayernormBackward)->Unit(benchmark::kMicrosecond);

// AdamW over 4M parameters in two slices (decayed weights, undecayed biases).
void BM_AdamW(benchmark::State& st) {
  const size_t n = 4u << 20;
  CpuBackend be(DType::F32);
  float *p = filled(be, n, 1), *g = filled(be, n, 2), *m = filled(be, n, 3, 0.01f);
  float* v = filled(be, n, 4, 0.01f);
  for (size_t i = 0; i < n; ++i) v[i] *= v[i];  // second moments are non-negative
  const std::vector<vitgrid::ParamSlice> slices = {{0, n - 4096, 0.05f}, {n - 4096, 4096, 0.0f}};
  int step = 1;
  for (auto _ : st) {
    be.adamw_update(p, g, m, v, slices, vitgrid::AdamParams{1e-3f, 0.9f, 0.999f, 1e-8f, step++, 1.0f});
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * (int64_t)n * 7 * 4);  // read p g m v, write p m v
  st.SetItemsProcessed(st.iterations() * (int64_t)n);
}
BENCHMARK(BM_AdamW)->Unit(benchmark::kMillisecond);

// 16-bit emulation overhead: the same Linear forward rounding every output to bf16.
void BM_LinearForwardBf16Emulated(benchmark::State& st) {
  const int in = kWidth, out = kWidth, N = kRows;
  CpuBackend be(DType::BF16);
  float *x = filled(be, (size_t)N * in, 1), *W = filled(be, (size_t)out * in, 2),
        *y = filled(be, (size_t)N * out, 4);
  for (auto _ : st) {
    be.linear_forward(y, x, W, nullptr, N, in, out);
    benchmark::ClobberMemory();
  }
  set_flops(st, 2.0 * N * in * out);
  st.SetItemsProcessed(st.iterations() * (int64_t)N);
}
BENCHMARK(BM_LinearForwardBf16Emulated)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
