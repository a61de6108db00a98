// The CUTLASS side of the fused GEMM + exact-GELU kernels (gemm_gelu.h): the kernel templates,
// parametrised by a tile configuration, and the type-erased entries (GemmGeluKernel) through
// which gemm_gelu.cu dispatches. Included only by the gemm_gelu_*.cu files, each of which
// instantiates a few configurations (so that a parallel build compiles them side by side) and
// exposes them as a table; gemm_gelu.cu collects the tables in a fixed order, which fixes the
// configuration ids. Built for sm_90a only, with CUTLASS (VITGRID_HAVE_CUTLASS).
//
// Kernel: CUTLASS 3 warp-specialized persistent GEMM (TMA loads, wgmma), fp32 accumulation,
// with an epilogue visitor tree (EVT):
//   forward  D = gelu(store_h(T(acc + bias)))   aux store h, D = g
//   backward D = acc * gelu'(load_h)            aux load h, D = dx
#pragma once

#include <cassert>
#include <cstdint>
#include <type_traits>

#include "gemm_gelu_table.h"
#include "vitgrid/backend/cuda/cuda_check.h"

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
namespace gemm_gelu_detail {

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

// A tile configuration: CTA tile TM x TN x 64, cluster CM x CN, the kernel schedule and its
// epilogue schedule, the epilogue subtile (EpiN = 0: CUTLASS's choice, 128x32 cooperative and
// 64x32 ping-pong; else EpiM x EpiN). Mainloop stages: as many as the shared memory left by
// the epilogue holds (StageCountAutoCarveout).
template <class MainSchedule_, class EpiSchedule_, int TM, int TN, int CM, int CN, int EpiM,
          int EpiN>
struct Config {
  using Tile = Shape<Int<TM>, Int<TN>, _64>;
  using Cluster = Shape<Int<CM>, Int<CN>, _1>;
  using MainSchedule = MainSchedule_;
  using EpiSchedule = EpiSchedule_;
  using EpiTile = std::conditional_t<EpiN == 0, cutlass::epilogue::collective::EpilogueTileAuto,
                                     Shape<Int<EpiM>, Int<EpiN>>>;
};
// Cooperative: both consumer warp groups share one tile (each TM/2 x TN) and run its epilogue
// together after the MMAs.
template <int TM, int TN, int CM, int CN, int EpiN = 0>
using Coop = Config<cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                    cutlass::epilogue::TmaWarpSpecializedCooperative, TM, TN, CM, CN, 128, EpiN>;
// Ping-pong: each consumer warp group owns a whole tile and runs its epilogue while the other
// group's MMAs run.
template <int TM, int TN, int CM, int CN, int EpiN = 0>
using Pingpong = Config<cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                        cutlass::epilogue::TmaWarpSpecialized, TM, TN, CM, CN, 64, EpiN>;

// A GEMM with row-major A [M, K], B given by its layout tag (ColumnMajor: [N, K] K-major, the
// forward's W; RowMajor: [K, N], the backward's W), D [M, N] row-major in T, void C, the
// epilogue visitor tree Evt, fp32 accumulation.
template <class Cfg, class T, class LayoutB, class Evt>
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
template <class Cfg, class T>
using EpiDesc = cutlass::epilogue::collective::detail::EpilogueDescriptor<
    typename Cfg::Tile, typename Cfg::EpiTile, void, T, typename Cfg::EpiSchedule>;

// Forward: D = gelu(h), h = T(acc + bias[n]) stored as the aux output. h is rounded by the
// add node (ElementOutput T), so the GELU node sees exactly the stored h.
template <class Cfg, class T>
struct Fwd {
  using AuxDesc =
      cutlass::epilogue::collective::detail::AuxStoreDescriptor<EpiDesc<Cfg, T>,
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
  using Gemm = typename Kernel<Cfg, T, cutlass::layout::ColumnMajor, Evt>::Gemm;
};

// Backward: D = acc * gelu'(h), h read through the epilogue's TMA load pipeline.
template <class Cfg, class T>
struct Bwd {
  using AuxDesc =
      cutlass::epilogue::collective::detail::AuxLoadDescriptor<EpiDesc<Cfg, T>,
                                                               cutlass::layout::RowMajor, T>;
  using LoadH =
      fus::Sm90AuxLoad<AuxDesc::Stages, typename AuxDesc::EpilogueTile, T, typename AuxDesc::Stride,
                       typename AuxDesc::SmemLayoutAtom, typename AuxDesc::CopyOpS2R>;
  using Evt = fus::Sm90EVT<fus::Sm90Compute<DGeluFn, T, float, kRN>, fus::Sm90AccFetch, LoadH>;
  using Gemm = typename Kernel<Cfg, T, cutlass::layout::RowMajor, Evt>::Gemm;
};

template <class Stride>
Stride row_major_stride(int64_t ld) {  // [rows, ld] row-major as CUTLASS's (M|N, K|N, L)
  return Stride{ld, _1{}, int64_t(0)};
}

template <class Cfg, class T>
typename Fwd<Cfg, T>::Gemm::Arguments fwd_args(const Call& c) {
  using Op = Fwd<Cfg, T>;
  using GK = typename Op::Gemm::GemmKernel;
  typename Op::Gemm::Arguments a;
  a.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  a.problem_shape = {c.N, c.out, c.in, 1};
  a.mainloop.ptr_A = static_cast<const T*>(c.a);
  a.mainloop.dA = row_major_stride<typename GK::StrideA>(c.in);
  a.mainloop.ptr_B = static_cast<const T*>(c.W);  // [out, in]: N x K, K-major
  a.mainloop.dB = row_major_stride<typename GK::StrideB>(c.in);
  a.epilogue.ptr_C = nullptr;
  a.epilogue.dC = row_major_stride<typename GK::StrideC>(c.out);
  a.epilogue.ptr_D = static_cast<T*>(c.d);
  a.epilogue.dD = row_major_stride<typename GK::StrideD>(c.out);
  a.epilogue.thread = {
      // gelu(store_h(bias_add))
      {
          // store_h(bias_add)
          {
              // acc + bias
              {},                                                                // acc
              {static_cast<const T*>(c.bias), T(0), typename Op::BiasStride{}},  // bias
              {}                                                                 // plus
          },
          {static_cast<T*>(c.h_out), row_major_stride<typename Op::AuxDesc::Stride>(c.out)}  // h
      },
      {}  // gelu
  };
  return a;
}

template <class Cfg, class T>
typename Bwd<Cfg, T>::Gemm::Arguments bwd_args(const Call& c) {
  using Op = Bwd<Cfg, T>;
  using GK = typename Op::Gemm::GemmKernel;
  typename Op::Gemm::Arguments a;
  a.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  a.problem_shape = {c.N, c.in, c.out, 1};
  a.mainloop.ptr_A = static_cast<const T*>(c.a);
  a.mainloop.dA = row_major_stride<typename GK::StrideA>(c.out);
  a.mainloop.ptr_B = static_cast<const T*>(c.W);  // [out, in]: K x N, N-major
  a.mainloop.dB = typename GK::StrideB{_1{}, int64_t(c.in), int64_t(0)};
  a.epilogue.ptr_C = nullptr;
  a.epilogue.dC = row_major_stride<typename GK::StrideC>(c.in);
  a.epilogue.ptr_D = static_cast<T*>(c.d);
  a.epilogue.dD = row_major_stride<typename GK::StrideD>(c.in);
  a.epilogue.thread = {
      {},  // acc
      {static_cast<const T*>(c.h_in), T(0),
       row_major_stride<typename Op::AuxDesc::Stride>(c.in)},  // h
      {}                                                       // dgelu
  };
  return a;
}

template <class Cfg, class T, bool kFwd>
using GemmOf = typename std::conditional_t<kFwd, Fwd<Cfg, T>, Bwd<Cfg, T>>::Gemm;

// The arguments of a call, the tile scheduler's run-time options included.
template <class Cfg, class T, bool kFwd>
typename GemmOf<Cfg, T, kFwd>::Arguments make_args(const Call& c) {
  typename GemmOf<Cfg, T, kFwd>::Arguments a;
  if constexpr (kFwd) {
    a = fwd_args<Cfg, T>(c);
  } else {
    a = bwd_args<Cfg, T>(c);
  }
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  a.scheduler.raster_order =
      c.raster == 1 ? Raster::AlongM : (c.raster == 2 ? Raster::AlongN : Raster::Heuristic);
  a.scheduler.max_swizzle_size = c.swizzle;
  a.hw_info.device_id = current_device_sm_count(&a.hw_info.sm_count);
  return a;
}

template <class Cfg, class T, bool kFwd>
size_t workspace_bytes(int N, int in, int out) {
  Call c;
  c.N = N;
  c.in = in;
  c.out = out;
  size_t most = 0;
  for (int sw : {1, 8}) {  // the scheduler's share grows with the swizzle, if at all
    c.swizzle = sw;
    const size_t b = GemmOf<Cfg, T, kFwd>::get_workspace_size(make_args<Cfg, T, kFwd>(c));
    most = b > most ? b : most;
  }
  return most;
}

template <class Cfg, class T, bool kFwd>
void launch(const Call& c) {
  using Gemm = GemmOf<Cfg, T, kFwd>;
  const typename Gemm::Arguments args = make_args<Cfg, T, kFwd>(c);
  Gemm op;
  cutlass::Status st = op.can_implement(args);
  if (st != cutlass::Status::kSuccess)
    fail_call(c, "CUTLASS cannot implement", cutlassGetStatusString(st));
  const size_t need = Gemm::get_workspace_size(args);
  if (c.workspace_bytes < need) fail_call(c, "workspace too small", "");
  st = op.initialize(args, c.workspace, c.stream);
  if (st != cutlass::Status::kSuccess)
    fail_call(c, "CUTLASS initialize failed for", cutlassGetStatusString(st));
  st = op.run(c.stream);
  if (st != cutlass::Status::kSuccess)
    fail_call(c, "CUTLASS launch failed for", cudaGetErrorString(cudaGetLastError()));
  CUDA_CHECK_LAUNCH();
}

// The table entry of one kernel.
template <class Cfg, class T, bool kFwd>
constexpr GemmGeluKernel entry(const char* name) {
  return GemmGeluKernel{name, &workspace_bytes<Cfg, T, kFwd>, &launch<Cfg, T, kFwd>};
}

}  // namespace gemm_gelu_detail
}  // namespace cuda
}  // namespace vitgrid
