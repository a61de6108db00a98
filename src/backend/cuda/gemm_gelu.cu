// Fused GEMM + exact-GELU (see gemm_gelu.h): CUTLASS 3 sm90a kernels (TMA loads, wgmma,
// warp-specialized persistent schedule) with epilogue visitor trees (EVT):
//   forward  D = gelu(store_h(T(acc + bias)))   aux store h, D = g
//   backward D = acc * gelu'(load_h)            aux load h, D = dx
// Built for sm_90a only (its own object library, see src/backend/CMakeLists.txt). Without
// CUTLASS (VITGRID_HAVE_CUTLASS unset) only the stubs at the end are compiled.
#include <atomic>
#include <cassert>
#include <cstdint>

#include "gemm_gelu.h"
#include "vitgrid/backend/cuda/cuda_check.h"

#if defined(VITGRID_HAVE_CUTLASS) && VITGRID_HAVE_CUTLASS

#include <cutlass/cutlass.h>
#include <cutlass/functional.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/kernel_hardware_info.h>

#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_store_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "gelu_math.cuh"

namespace vitgrid {
namespace cuda {
namespace {

using namespace cute;
namespace fus = cutlass::epilogue::fusion;
constexpr auto kRN = cutlass::FloatRoundStyle::round_to_nearest;

// EVT compute functors (Sm90Compute instantiates them on the fragment type Array<float, N>).
template <class X>
struct GeluFn {
  CUTLASS_DEVICE X operator()(X const& x) const { return gelu_exact_fast(x); }
};
template <int N>
struct GeluFn<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& x) const {
    cutlass::Array<float, N> y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) y[i] = gelu_exact_fast(x[i]);
    return y;
  }
};
// (dy, h) -> dy * gelu'(h)
template <class X>
struct DGeluFn {
  CUTLASS_DEVICE X operator()(X const& dy, X const& h) const {
    return dy * gelu_exact_fast_grad(h);
  }
};
template <int N>
struct DGeluFn<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& dy,
                                                     cutlass::Array<float, N> const& h) const {
    cutlass::Array<float, N> y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) y[i] = dy[i] * gelu_exact_fast_grad(h[i]);
    return y;
  }
};

// Tile configurations (Cfg picks one; each instantiation costs about a minute of nvcc).
// Pingpong: each of the two consumer warp groups owns a 128x128 tile and runs its epilogue
// (the GELU math and the stores) while the other one's MMAs run, so at these short K (768,
// 3072) the epilogue can overlap the tensor cores; 6 mainloop stages. Cooperative: both warp
// groups share a 128x256 tile (fewer operand bytes per FLOP) and run its epilogue together
// after the MMAs; 4 stages forward, 3 backward. Cluster 2x1: a CTA pair multicasts its W tile.
// Measured on an H200 (ViT-B/16, batch 256, bf16 step): Cooperative +0.8% over cuBLASLt + the
// GELU passes, Pingpong -1.4% (its fc1 forward 0.521 ms = 456 TFLOP/s, no faster than the
// unfused pair; its fc2 data gradient 0.504 ms against 0.547).
struct Pingpong {
  using Tile = Shape<_128, _128, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using MainSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpiSchedule = cutlass::epilogue::TmaWarpSpecialized;
  using EpiTile = cutlass::epilogue::collective::EpilogueTileAuto;
};
struct Cooperative {
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using MainSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpiSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using EpiTile = cutlass::epilogue::collective::EpilogueTileAuto;
};
using Cfg = Cooperative;

// A GEMM with row-major A [M, K], B given by its layout tag (ColumnMajor: [N, K] K-major, the
// forward's W; RowMajor: [K, N], the backward's W), D [M, N] row-major in T, void C, the
// epilogue visitor tree Evt, fp32 accumulation.
template <class T, class LayoutB, class Evt>
struct Kernel {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile,
      typename Cfg::Cluster, typename Cfg::EpiTile, float, float, void, cutlass::layout::RowMajor,
      8, T, cutlass::layout::RowMajor, 8, typename Cfg::EpiSchedule, Evt>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8, T,
      LayoutB, 8, float, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::MainSchedule>::CollectiveOp;
  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

// The epilogue's tile and stage counts, as the builder derives them, for the EVT's aux nodes.
template <class T>
using EpiDesc = cutlass::epilogue::collective::detail::EpilogueDescriptor<
    typename Cfg::Tile, typename Cfg::EpiTile, void, T, typename Cfg::EpiSchedule>;

// Forward: D = gelu(h), h = T(acc + bias[n]) stored as the aux output. h is rounded by the
// add node (ElementOutput T), so the GELU node sees exactly the stored h.
template <class T>
struct Fwd {
  using AuxDesc =
      cutlass::epilogue::collective::detail::AuxStoreDescriptor<EpiDesc<T>,
                                                                cutlass::layout::RowMajor, T>;
  using BiasStride = Stride<_0, _1, int64_t>;
  using BiasAdd = fus::Sm90EVT<fus::Sm90Compute<cutlass::plus, T, float, kRN>, fus::Sm90AccFetch,
                               fus::Sm90RowBroadcast<0, typename Cfg::Tile, T, float, BiasStride>>;
  using StoreH =
      fus::Sm90EVT<fus::Sm90AuxStore<AuxDesc::Stages, typename AuxDesc::EpilogueTile, T, kRN,
                                     typename AuxDesc::Stride, typename AuxDesc::SmemLayoutAtom,
                                     typename AuxDesc::CopyOpR2S>,
                   BiasAdd>;
  using Evt = fus::Sm90EVT<fus::Sm90Compute<GeluFn, T, float, kRN>, StoreH>;
  using K = Kernel<T, cutlass::layout::ColumnMajor, Evt>;
};

// Backward: D = acc * gelu'(h), h read through the epilogue's TMA load pipeline.
template <class T>
struct Bwd {
  using AuxDesc =
      cutlass::epilogue::collective::detail::AuxLoadDescriptor<EpiDesc<T>,
                                                               cutlass::layout::RowMajor, T>;
  using LoadH =
      fus::Sm90AuxLoad<AuxDesc::Stages, typename AuxDesc::EpilogueTile, T, typename AuxDesc::Stride,
                       typename AuxDesc::SmemLayoutAtom, typename AuxDesc::CopyOpS2R>;
  using Evt = fus::Sm90EVT<fus::Sm90Compute<DGeluFn, T, float, kRN>, fus::Sm90AccFetch, LoadH>;
  using K = Kernel<T, cutlass::layout::RowMajor, Evt>;
};

constexpr int kMaxDevices = 64;

// Multiprocessor count of the current device (cached per device), for the persistent grid.
cutlass::KernelHardwareInfo hw_info() {
  static std::atomic<int> sms[kMaxDevices];
  cutlass::KernelHardwareInfo hw;
  CUDA_CHECK(cudaGetDevice(&hw.device_id));
  int n = hw.device_id < kMaxDevices ? sms[hw.device_id].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, hw.device_id));
    if (hw.device_id < kMaxDevices) sms[hw.device_id].store(n, std::memory_order_relaxed);
  }
  hw.sm_count = n;
  return hw;
}

template <class Stride>
Stride row_major_stride(int64_t ld) {  // [rows, ld] row-major as CUTLASS's (M|N, K|N, L)
  return Stride{ld, _1{}, int64_t(0)};
}

template <class T>
typename Fwd<T>::K::Gemm::Arguments fwd_args(void* h, void* g, const void* x, const void* W,
                                             const void* b, int N, int in, int out) {
  using Gemm = typename Fwd<T>::K::Gemm;
  using GK = typename Gemm::GemmKernel;
  typename Gemm::Arguments a;
  a.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  a.problem_shape = {N, out, in, 1};
  a.mainloop.ptr_A = static_cast<const T*>(x);
  a.mainloop.dA = row_major_stride<typename GK::StrideA>(in);
  a.mainloop.ptr_B = static_cast<const T*>(W);  // [out, in]: N x K, K-major
  a.mainloop.dB = row_major_stride<typename GK::StrideB>(in);
  a.epilogue.ptr_C = nullptr;
  a.epilogue.dC = row_major_stride<typename GK::StrideC>(out);
  a.epilogue.ptr_D = static_cast<T*>(g);
  a.epilogue.dD = row_major_stride<typename GK::StrideD>(out);
  a.epilogue.thread = {
      // gelu(store_h(bias_add))
      {
          // store_h(bias_add)
          {
              // acc + bias
              {},                                                               // acc
              {static_cast<const T*>(b), T(0), typename Fwd<T>::BiasStride{}},  // bias
              {}                                                                // plus
          },
          {static_cast<T*>(h), row_major_stride<typename Fwd<T>::AuxDesc::Stride>(out)}  // h
      },
      {}  // gelu
  };
  a.hw_info = hw_info();
  return a;
}

template <class T>
typename Bwd<T>::K::Gemm::Arguments bwd_args(void* dx, const void* dy, const void* W, const void* h,
                                             int N, int in, int out) {
  using Gemm = typename Bwd<T>::K::Gemm;
  using GK = typename Gemm::GemmKernel;
  typename Gemm::Arguments a;
  a.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  a.problem_shape = {N, in, out, 1};
  a.mainloop.ptr_A = static_cast<const T*>(dy);
  a.mainloop.dA = row_major_stride<typename GK::StrideA>(out);
  a.mainloop.ptr_B = static_cast<const T*>(W);  // [out, in]: K x N, N-major
  a.mainloop.dB = typename GK::StrideB{_1{}, int64_t(in), int64_t(0)};
  a.epilogue.ptr_C = nullptr;
  a.epilogue.dC = row_major_stride<typename GK::StrideC>(in);
  a.epilogue.ptr_D = static_cast<T*>(dx);
  a.epilogue.dD = row_major_stride<typename GK::StrideD>(in);
  a.epilogue.thread = {
      {},  // acc
      {static_cast<const T*>(h), T(0),
       row_major_stride<typename Bwd<T>::AuxDesc::Stride>(in)},  // h
      {}                                                         // dgelu
  };
  a.hw_info = hw_info();
  return a;
}

const char* dir_name(bool fwd) { return fwd ? "gemm_bias_gelu_forward" : "gemm_dgelu_backward"; }

template <class Gemm>
void run(typename Gemm::Arguments const& args, bool fwd, cudaStream_t s, void* ws, size_t ws_bytes,
         DType act, int N, int in, int out) {
  Gemm op;
  cutlass::Status st = op.can_implement(args);
  if (st != cutlass::Status::kSuccess)
    VG_FAIL(dir_name(fwd) << ": CUTLASS cannot implement " << dtype_name(act) << " N=" << N
                          << " in=" << in << " out=" << out << ": " << cutlassGetStatusString(st));
  const size_t need = Gemm::get_workspace_size(args);
  VG_CHECK(ws_bytes >= need, dir_name(fwd)
                                 << ": workspace of " << ws_bytes << " bytes, needs " << need);
  st = op.initialize(args, ws, s);
  if (st != cutlass::Status::kSuccess)
    VG_FAIL(dir_name(fwd) << ": CUTLASS initialize failed for " << dtype_name(act) << " N=" << N
                          << " in=" << in << " out=" << out << ": " << cutlassGetStatusString(st));
  st = op.run(s);
  if (st != cutlass::Status::kSuccess)
    VG_FAIL(dir_name(fwd) << ": CUTLASS launch failed for " << dtype_name(act) << " N=" << N
                          << " in=" << in << " out=" << out << ": " << cutlassGetStatusString(st)
                          << " (" << cudaGetErrorString(cudaGetLastError()) << ")");
  CUDA_CHECK_LAUNCH();
}

[[maybe_unused]] inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace

bool gemm_gelu_available() {
  static std::atomic<int> state[kMaxDevices];  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  int v = dev < kMaxDevices ? state[dev].load(std::memory_order_relaxed) : 0;
  if (v == 0) {
    int major = 0, minor = 0;
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    v = ok && major == 9 && minor == 0 ? 1 : 2;
    if (dev < kMaxDevices) state[dev].store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

bool gemm_gelu_supported(DType act, int N, int in, int out) {
  return (act == DType::BF16 || act == DType::F16) && N >= 1 && in >= 8 && out >= 8 &&
         in % 8 == 0 && out % 8 == 0;
}

size_t gemm_gelu_workspace_bytes(DType act, int N, int in, int out) {
  if (!gemm_gelu_supported(act, N, in, out)) return 0;
  auto both = [&](auto tag) {
    using T = decltype(tag);
    using GF = typename Fwd<T>::K::Gemm;
    using GB = typename Bwd<T>::K::Gemm;
    typename GF::Arguments af;
    af.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    af.problem_shape = {N, out, in, 1};
    typename GB::Arguments ab;
    ab.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    ab.problem_shape = {N, in, out, 1};
    const size_t f = GF::get_workspace_size(af), b = GB::get_workspace_size(ab);
    return f > b ? f : b;
  };
  return act == DType::BF16 ? both(cutlass::bfloat16_t{}) : both(cutlass::half_t{});
}

void gemm_bias_gelu_forward(DType act, cudaStream_t s, void* h, void* g, const void* x,
                            const void* W, const void* b, int N, int in, int out, void* workspace,
                            size_t workspace_bytes) {
  VG_CHECK(gemm_gelu_supported(act, N, in, out), "gemm_bias_gelu_forward: unsupported "
                                                     << dtype_name(act) << " N=" << N
                                                     << " in=" << in << " out=" << out);
  assert(aligned16(h) && aligned16(g) && aligned16(x) && aligned16(W));
  if (act == DType::BF16) {
    using T = cutlass::bfloat16_t;
    run<typename Fwd<T>::K::Gemm>(fwd_args<T>(h, g, x, W, b, N, in, out), true, s, workspace,
                                  workspace_bytes, act, N, in, out);
  } else {
    using T = cutlass::half_t;
    run<typename Fwd<T>::K::Gemm>(fwd_args<T>(h, g, x, W, b, N, in, out), true, s, workspace,
                                  workspace_bytes, act, N, in, out);
  }
}

void gemm_dgelu_backward(DType act, cudaStream_t s, void* dx, const void* dy, const void* W,
                         const void* h, int N, int in, int out, void* workspace,
                         size_t workspace_bytes) {
  VG_CHECK(gemm_gelu_supported(act, N, in, out), "gemm_dgelu_backward: unsupported "
                                                     << dtype_name(act) << " N=" << N
                                                     << " in=" << in << " out=" << out);
  assert(aligned16(dx) && aligned16(dy) && aligned16(W) && aligned16(h));
  if (act == DType::BF16) {
    using T = cutlass::bfloat16_t;
    run<typename Bwd<T>::K::Gemm>(bwd_args<T>(dx, dy, W, h, N, in, out), false, s, workspace,
                                  workspace_bytes, act, N, in, out);
  } else {
    using T = cutlass::half_t;
    run<typename Bwd<T>::K::Gemm>(bwd_args<T>(dx, dy, W, h, N, in, out), false, s, workspace,
                                  workspace_bytes, act, N, in, out);
  }
}

}  // namespace cuda
}  // namespace vitgrid

#else  // no CUTLASS: the path is never taken

namespace vitgrid {
namespace cuda {

bool gemm_gelu_available() { return false; }
bool gemm_gelu_supported(DType, int, int, int) { return false; }
size_t gemm_gelu_workspace_bytes(DType, int, int, int) { return 0; }
void gemm_bias_gelu_forward(DType, cudaStream_t, void*, void*, const void*, const void*,
                            const void*, int, int, int, void*, size_t) {
  VG_FAIL("gemm_bias_gelu_forward: built without CUTLASS");
}
void gemm_dgelu_backward(DType, cudaStream_t, void*, const void*, const void*, const void*, int,
                         int, int, void*, size_t) {
  VG_FAIL("gemm_dgelu_backward: built without CUTLASS");
}

}  // namespace cuda
}  // namespace vitgrid

#endif
