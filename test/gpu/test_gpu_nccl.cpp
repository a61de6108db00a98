// NCCL collectives over every axis of several process grids, checked against values each
// rank can compute by itself. Launched at 2 and 4 ranks (one GPU per local rank); skipped on
// every rank (agreed) when the node has fewer GPUs than local ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <memory>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/cuda/cuda_backend.h"
#include "vitgrid/core/error.h"
#include "vitgrid/grid/grid.h"

namespace vitgrid {
namespace {

bool enough_gpus() {
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
  int lsize = 1;
  MPI_Comm_size(local, &lsize);
  MPI_Comm_free(&local);
  int ok = cuda_device_count() >= lsize ? 1 : 0, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);  // every rank agrees
  return all == 1;
}

std::vector<GridShape> shapes_for(int world) {
  std::vector<GridShape> out;
  auto add = [&](int p, int d, int t, TensorMode m, bool seq = false) {
    GridShape s;
    s.pipeline = p;
    s.data = d;
    s.tensor = t;
    s.mode = m;
    s.sequence_parallel = seq;
    try {
      check_grid_shape(s, world);
      out.push_back(s);
    } catch (const UserError&) {
      // not a valid layout for this world size: same verdict on every rank
    }
  };
  add(1, world, 1, TensorMode::None);
  add(1, world / 2, 2, TensorMode::D1);
  add(1, world / 2, 2, TensorMode::D1, true);  // the tensor axis's overlapped collectives
  add(2, world / 2, 1, TensorMode::None);
  add(2, world / 4, 2, TensorMode::D1);
  add(1, world / 4, 4, TensorMode::D2);
  return out;
}

// Checks one act-dtype / fp32 collective suite over axis a.
void check_axis(Backend& be, Collectives& coll, const ProcessGrid& grid, Axis a) {
  if (!grid.comm(a).valid()) return;
  const int size = grid.size(a), r = grid.rank(a);
  SCOPED_TRACE(std::string("axis ") + axis_name(a) + " size " + std::to_string(size));
  const size_t n = 1003;
  float* buf = static_cast<float*>(be.alloc(size * n * sizeof(float)));
  float* out = static_cast<float*>(be.alloc(size * n * sizeof(float)));
  std::vector<float> h(size * n), got(size * n);

  for (size_t i = 0; i < n; ++i) h[i] = r + 0.5f * i;
  be.copy_to_device(buf, h.data(), n * 4);
  coll.allreduce(buf, n, Elem::F32, ReduceOp::Sum, a);
  be.copy_to_host(got.data(), buf, n * 4);
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(got[i], size * (size - 1) / 2.0f + size * 0.5f * i) << "allreduce sum " << i;

  for (size_t i = 0; i < n; ++i) h[i] = r * 1000.0f + i;
  be.copy_to_device(buf, h.data(), n * 4);
  coll.allreduce(buf, n, Elem::F32, ReduceOp::Max, a);
  be.copy_to_host(got.data(), buf, n * 4);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], (size - 1) * 1000.0f + i) << "allreduce max";

  // act dtype (bf16 here): small integers are exact
  for (size_t i = 0; i < n; ++i) h[i] = float(r + 1 + (i % 7));
  be.copy_to_device(buf, h.data(), n * 4);
  void* act = be.alloc(n * be.act_size());
  be.cast_to_act(act, buf, n);
  coll.allreduce(act, n, Elem::Act, ReduceOp::Sum, a);
  be.cast_to_f32(buf, act, n);
  be.copy_to_host(got.data(), buf, n * 4);
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(got[i], size * (size + 1) / 2.0f + size * float(i % 7)) << "allreduce sum act";
  be.release(act);

  for (size_t i = 0; i < n; ++i) h[i] = r * 10.0f + i;
  be.copy_to_device(buf, h.data(), n * 4);
  coll.broadcast(buf, n * 4, size - 1, a);
  be.copy_to_host(got.data(), buf, n * 4);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], (size - 1) * 10.0f + i) << "broadcast";

  for (size_t i = 0; i < n; ++i) h[i] = r * 100.0f + i;
  be.copy_to_device(buf, h.data(), n * 4);
  coll.allgather(out, buf, n, Elem::F32, a);
  be.copy_to_host(got.data(), out, size * n * 4);
  for (int j = 0; j < size; ++j)
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[j * n + i], j * 100.0f + i) << "allgather";

  for (size_t k = 0; k < size * n; ++k) h[k] = float(r) + float(k);
  be.copy_to_device(buf, h.data(), size * n * 4);
  coll.reduce_scatter(out, buf, n, Elem::F32, a);
  be.copy_to_host(got.data(), out, n * 4);
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(got[i], size * (size - 1) / 2.0f + size * float(r * n + i)) << "reduce_scatter";

  {  // the overlapped pair, both open at once, then the blocking gather into the same buffer
    // the memory the collectives ask for (copy engines: symmetric windows), else any
    auto alloc = [&](size_t bytes) {
      void* p = coll.overlapped_alloc(bytes);
      return std::make_pair(p ? p : be.alloc(bytes), p != nullptr);
    };
    auto [og_p, og_own] = alloc(size * n * sizeof(float));
    auto [rs_in, rs_own] = alloc(size * n * be.act_size());
    float* og = static_cast<float*>(og_p);
    void* rs_out = be.alloc(n * be.act_size());
    for (size_t i = 0; i < n; ++i) h[i] = r * 100.0f + i;
    be.copy_to_device(buf, h.data(), n * 4);
    for (size_t k = 0; k < size * n; ++k) h[k] = float(r + (k % 5));
    be.copy_to_device(out, h.data(), size * n * 4);
    be.cast_to_act(rs_in, out, size * n);
    const Work tg = coll.start_overlapped_allgather(og, buf, n, Elem::F32, a);
    const Work tr = coll.start_overlapped_reduce_scatter(rs_out, rs_in, n, Elem::Act, a);
    ASSERT_EQ(tr.kind, Work::Kind::Overlapped);
    ASSERT_EQ(tr.id, tg.id + 1);
    coll.wait(tg);
    coll.wait(tr);
    be.copy_to_host(got.data(), og, size * n * 4);
    for (int j = 0; j < size; ++j)
      for (size_t i = 0; i < n; ++i)
        ASSERT_EQ(got[j * n + i], j * 100.0f + i) << "overlapped allgather";
    be.cast_to_f32(out, rs_out, n);
    be.copy_to_host(got.data(), out, n * 4);
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(got[i], size * (size - 1) / 2.0f + size * float((r * n + i) % 5))
          << "overlapped reduce_scatter";
    og_own ? coll.overlapped_release(og) : be.release(og);
    rs_own ? coll.overlapped_release(rs_in) : be.release(rs_in);
    be.release(rs_out);
  }

  if (size >= 2) {  // pairs (0,1), (2,3), ...: exchange, sender first on even ranks
    const int peer = r % 2 == 0 ? r + 1 : r - 1;
    if (peer < size) {
      for (size_t i = 0; i < n; ++i) h[i] = r * 7.0f + i;
      be.copy_to_device(buf, h.data(), n * 4);
      if (r % 2 == 0) {
        coll.send(buf, n * 4, peer, a);
        coll.recv(out, n * 4, peer, a);
      } else {
        coll.recv(out, n * 4, peer, a);
        coll.send(buf, n * 4, peer, a);
      }
      be.copy_to_host(got.data(), out, n * 4);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], peer * 7.0f + i) << "send/recv";
    }
  }
  if (a == Axis::Pipeline && size >= 2) {
    // asynchronous messages (grid.h): to the next rank on channel 0, to the previous one on
    // channel 1; channel 1's receive is waited for before channel 0's is even posted
    coll.open_links(a);
    const int next = (r + 1) % size, prev = (r + size - 1) % size;
    float* up = out + n;  // channel 1's buffers: a second block of each
    float* up_in = buf + n;
    for (size_t i = 0; i < n; ++i) h[i] = r * 7.0f + i;
    for (size_t i = 0; i < n; ++i) h[n + i] = r * 3.0f - i;
    be.copy_to_device(buf, h.data(), n * 4);
    be.copy_to_device(up, h.data() + n, n * 4);
    coll.post_send(buf, n * 4, next, 0, a);
    coll.post_send(up, n * 4, prev, 1, a);
    const Work t_up = coll.post_recv(up_in, n * 4, next, 1, a, {});
    coll.wait(t_up);
    const Work f = coll.fence();
    const Work t = coll.post_recv(out, n * 4, prev, 0, a, {f});
    coll.wait(t);
    be.copy_to_host(got.data(), out, n * 4);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], prev * 7.0f + i) << "channel 0";
    be.copy_to_host(got.data(), up_in, n * 4);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], next * 3.0f - i) << "channel 1";
    coll.wait_messages();
  }
  coll.barrier(a);
  be.release(buf);
  be.release(out);
}

TEST(GpuNccl, CollectivesOnEveryAxis) {
  if (!enough_gpus()) GTEST_SKIP() << "fewer GPUs than local ranks";
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  for (const GridShape& s : shapes_for(world)) {
    for (bool ce : {false, true}) {  // sequence parallelism: SM and copy-engine collectives
      if (ce && !s.sequence_parallel) continue;
      ProcessGrid grid(MPI_COMM_WORLD, s);
      auto be = make_cuda_backend(grid.local_rank(), DType::BF16);
      NcclOptions o;
      o.timeout_s = 120.0;
      o.tensor_copy_engine = ce;
      auto coll = make_nccl_collectives(grid, *be, o);
      SCOPED_TRACE("grid p" + std::to_string(s.pipeline) + " d" + std::to_string(s.data) + " t" +
                   std::to_string(s.tensor) + (s.sequence_parallel ? " sequence-parallel" : "") +
                   (ce ? " copy engines" : ""));
      EXPECT_EQ(coll->overlapped_sms(Axis::Tensor) > 0, s.sequence_parallel && s.tensor > 1 && !ce);
      for (Axis a : {Axis::World, Axis::Pipeline, Axis::Data, Axis::Tensor, Axis::TensorRow,
                     Axis::TensorCol}) {
        check_axis(*be, *coll, grid, a);
        // A failed ASSERT on one rank would leave peers waiting in the next collective:
        // stop here on every rank if any failed.
        int bad = ::testing::Test::HasFatalFailure() ? 1 : 0, any = 0;
        MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        ASSERT_EQ(any, 0) << "a collective failed on some rank";
      }
    }
  }
}

}  // namespace
}  // namespace vitgrid
