// Fused GEMM + exact-GELU (see gemm_gelu.h): the API over the compiled configurations.
// The kernels themselves (CUTLASS 3 sm90a warp-specialized persistent GEMMs, TMA loads, wgmma,
// epilogue visitor trees: forward D = gelu(store_h(T(acc + bias))), backward
// D = acc * gelu'(load_h)) are instantiated in gemm_gelu_{coop,pingpong}_{fwd,bwd}.cu from the
// templates of gemm_gelu_kernels.cuh, a few per file so that a parallel build compiles them
// side by side (each instantiation costs ~50 s of nvcc); this file only collects their tables
// (gemm_gelu_table.h) in a fixed order, which defines the configuration ids:
//
//   forward,  bf16: 0 coop 128x256 c2x1, 1 coop 128x256 c1x2, 2 coop 256x128 c1x2,
//                   3 pingpong 128x128 c2x1, 4 pingpong 128x128 c2x1 epi 64x64,
//                   5 pingpong 64x256 c1x2
//   backward, bf16: 0 coop 128x256 c2x1, 1 coop 256x128 c2x1, 2 coop 256x128 c1x2,
//                   3 pingpong 128x128 c2x1, 4 pingpong 128x128 c2x1 epi 64x64,
//                   5 pingpong 64x256 c2x1
//   fp16, both directions: 0 coop 128x256 c2x1 only (compile time; fp16 runs are rarer)
//
// (CTA tiles M x N of the output, 64 deep in K; c2x1: clusters of two CTAs along M, which
// share W's tile by TMA multicast, c1x2: along N, sharing x's / dy's; mainloop stages as many
// as fit beside the epilogue: cooperative 4 forward / 3 backward, ping-pong 5-6; ids from the
// kernel count up add the tile scheduler's raster order / swizzle, see gemm_gelu.h).
// Cooperative: both consumer warp groups share the tile and run its epilogue together after
// the MMAs (fewer operand bytes per FLOP, no epilogue overlap). Ping-pong: each warp group owns
// a tile and runs its epilogue (the GELU math and the two stores) while the other group's MMAs
// run, which matters at the MLP's short K. Which wins is shape-dependent and measured at run
// time (CudaBackend, device.gemm_tune); for the ViT shapes on the H200: to be measured.
//
// Built for sm_90a only (an object library, see src/backend/CMakeLists.txt). Without CUTLASS
// (VITGRID_HAVE_CUTLASS unset) only the stubs at the end are compiled.
#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstdint>
#include <string>

#include "gemm_gelu.h"
#include "vitgrid/backend/cuda/cuda_check.h"

#if defined(VITGRID_HAVE_CUTLASS) && VITGRID_HAVE_CUTLASS

#include <vector>

#include "gemm_gelu_table.h"

namespace vitgrid {
namespace cuda {

namespace gemm_gelu_detail {

constexpr int kMaxDevices = 64;
std::atomic<int> sm_margin{0};

int current_device_sm_count(int* sms) {
  static std::atomic<int> cache[kMaxDevices];
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  int n = dev < kMaxDevices ? cache[dev].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    if (dev < kMaxDevices) cache[dev].store(n, std::memory_order_relaxed);
  }
  *sms = std::max(1, n - sm_margin.load(std::memory_order_relaxed));
  return dev;
}

void fail_call(const Call& c, const char* what, const char* detail) {
  VG_FAIL((c.forward ? "gemm_bias_gelu_forward" : "gemm_dgelu_backward")
          << ": " << what << " " << dtype_name(c.act) << " N=" << c.N << " in=" << c.in
          << " out=" << c.out << " with configuration " << c.config << " ("
          << gemm_gelu_config_name(c.act, c.forward, c.config) << ")"
          << (detail && *detail ? ": " : "") << (detail ? detail : "")
          << " (workspace " << c.workspace_bytes << " bytes)");
}

}  // namespace gemm_gelu_detail

namespace {

using gemm_gelu_detail::GemmGeluKernel;

// The kernels of (act, forward), in id order: the cooperative file's, then the ping-pong one's.
const std::vector<GemmGeluKernel>& kernel_list(DType act, bool forward) {
  using Part = const GemmGeluKernel* (*)(DType, int*);
  struct Table {
    std::vector<GemmGeluKernel> k[2][2];  // [bf16, fp16][backward, forward]
  };
  static const Table table = [] {
    Table t;
    const Part fwd[] = {&gemm_gelu_detail::kernels_coop_fwd,
                        &gemm_gelu_detail::kernels_pingpong_fwd};
    const Part bwd[] = {&gemm_gelu_detail::kernels_coop_bwd,
                        &gemm_gelu_detail::kernels_pingpong_bwd};
    for (int d = 0; d < 2; ++d) {
      const DType act = d == 0 ? DType::BF16 : DType::F16;
      for (int f = 0; f < 2; ++f) {
        for (Part p : f ? fwd : bwd) {
          int n = 0;
          const GemmGeluKernel* k = p(act, &n);
          for (int i = 0; i < n; ++i) t.k[d][f].push_back(k[i]);
        }
      }
    }
    return t;
  }();
  static const std::vector<GemmGeluKernel> none;
  if (act != DType::BF16 && act != DType::F16) return none;
  return table.k[act == DType::BF16 ? 0 : 1][forward ? 1 : 0];
}

// Raster (0 heuristic, 1 along M, 2 along N) and swizzle of a scheduler setting.
void schedule_of(int s, int* raster, int* swizzle) {
  if (s <= 0) {
    *raster = 0;
    *swizzle = 1;
  } else {
    *raster = s <= 4 ? 2 : 1;
    *swizzle = 1 << ((s - 1) % 4);
  }
}

std::string schedule_name(int s) {
  if (s <= 0) return "";
  int raster = 0, swizzle = 1;
  schedule_of(s, &raster, &swizzle);
  return std::string(", raster ") + (raster == 2 ? "N" : "M") + " swizzle " +
         std::to_string(swizzle);
}

[[maybe_unused]] inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

void dispatch(gemm_gelu_detail::Call& c, int config) {
  const std::vector<GemmGeluKernel>& ks = kernel_list(c.act, c.forward);
  const int nk = static_cast<int>(ks.size());
  const char* dir = c.forward ? "gemm_bias_gelu_forward" : "gemm_dgelu_backward";
  VG_CHECK(gemm_gelu_supported(c.act, c.N, c.in, c.out),
           dir << ": unsupported " << dtype_name(c.act) << " N=" << c.N << " in=" << c.in
               << " out=" << c.out);
  VG_CHECK(nk > 0 && config >= 0 && config < nk * kGemmGeluSchedules,
           dir << ": configuration " << config << " out of range for " << dtype_name(c.act)
               << " (" << nk * kGemmGeluSchedules << " configurations)");
  schedule_of(config / nk, &c.raster, &c.swizzle);
  c.config = config;
  ks[config % nk].launch(c);
}

}  // namespace

void gemm_gelu_set_sm_margin(int sms) {
  gemm_gelu_detail::sm_margin.store(std::max(0, sms), std::memory_order_relaxed);
}

bool gemm_gelu_available() {
  static std::atomic<int> state[gemm_gelu_detail::kMaxDevices];  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  int v = dev < gemm_gelu_detail::kMaxDevices ? state[dev].load(std::memory_order_relaxed) : 0;
  if (v == 0) {
    int major = 0, minor = 0;
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    v = ok && major == 9 && minor == 0 ? 1 : 2;
    if (dev < gemm_gelu_detail::kMaxDevices) state[dev].store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

bool gemm_gelu_supported(DType act, int N, int in, int out) {
  return (act == DType::BF16 || act == DType::F16) && N >= 1 && in >= 8 && out >= 8 &&
         in % 8 == 0 && out % 8 == 0;
}

int gemm_gelu_kernel_count(DType act, bool forward) {
  return static_cast<int>(kernel_list(act, forward).size());
}

int gemm_gelu_config_count(DType act, bool forward) {
  return gemm_gelu_kernel_count(act, forward) * kGemmGeluSchedules;
}

std::string gemm_gelu_config_name(DType act, bool forward, int config) {
  const std::vector<GemmGeluKernel>& ks = kernel_list(act, forward);
  const int nk = static_cast<int>(ks.size());
  if (nk == 0 || config < 0 || config >= nk * kGemmGeluSchedules) return "";
  return ks[config % nk].name + schedule_name(config / nk);
}

size_t gemm_gelu_workspace_bytes(DType act, int N, int in, int out) {
  if (!gemm_gelu_supported(act, N, in, out)) return 0;
  size_t most = 0;
  for (bool fwd : {true, false}) {
    for (const GemmGeluKernel& k : kernel_list(act, fwd)) {
      const size_t b = k.workspace_bytes(N, in, out);
      most = b > most ? b : most;
    }
  }
  return most;
}

void gemm_bias_gelu_forward(DType act, cudaStream_t s, void* h, void* g, const void* x,
                            const void* W, const void* b, int N, int in, int out, void* workspace,
                            size_t workspace_bytes, int config) {
  assert(aligned16(h) && aligned16(g) && aligned16(x) && aligned16(W) && aligned16(b));
  gemm_gelu_detail::Call c;
  c.act = act;
  c.forward = true;
  c.stream = s;
  c.d = g;
  c.h_out = h;
  c.a = x;
  c.W = W;
  c.bias = b;
  c.N = N;
  c.in = in;
  c.out = out;
  c.workspace = workspace;
  c.workspace_bytes = workspace_bytes;
  dispatch(c, config);
}

void gemm_dgelu_backward(DType act, cudaStream_t s, void* dx, const void* dy, const void* W,
                         const void* h, int N, int in, int out, void* workspace,
                         size_t workspace_bytes, int config) {
  assert(aligned16(dx) && aligned16(dy) && aligned16(W) && aligned16(h));
  gemm_gelu_detail::Call c;
  c.act = act;
  c.forward = false;
  c.stream = s;
  c.d = dx;
  c.a = dy;
  c.W = W;
  c.h_in = h;
  c.N = N;
  c.in = in;
  c.out = out;
  c.workspace = workspace;
  c.workspace_bytes = workspace_bytes;
  dispatch(c, config);
}

}  // namespace cuda
}  // namespace vitgrid

#else  // no CUTLASS: the path is never taken

namespace vitgrid {
namespace cuda {

bool gemm_gelu_available() { return false; }
void gemm_gelu_set_sm_margin(int) {}
bool gemm_gelu_supported(DType, int, int, int) { return false; }
size_t gemm_gelu_workspace_bytes(DType, int, int, int) { return 0; }
int gemm_gelu_kernel_count(DType, bool) { return 0; }
int gemm_gelu_config_count(DType, bool) { return 0; }
std::string gemm_gelu_config_name(DType, bool, int) { return ""; }
void gemm_bias_gelu_forward(DType, cudaStream_t, void*, void*, const void*, const void*,
                            const void*, int, int, int, void*, size_t, int) {
  VG_FAIL("gemm_bias_gelu_forward: built without CUTLASS");
}
void gemm_dgelu_backward(DType, cudaStream_t, void*, const void*, const void*, const void*, int,
                         int, int, void*, size_t, int) {
  VG_FAIL("gemm_dgelu_backward: built without CUTLASS");
}

}  // namespace cuda
}  // namespace vitgrid

#endif
