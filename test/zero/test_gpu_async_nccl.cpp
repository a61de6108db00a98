// The asynchronous NCCL reductions (gradient buckets): start_allreduce and the in-place
// start_reduce_scatter on the communication stream equal the blocking collectives, they
// wait for the compute-stream kernels that produced their inputs (the buffers are written by
// a kernel enqueued just before), and wait_all orders later compute-stream work after them,
// as wait() on one's Work does (before wait_all); the same through the copy-engine path
// (device.data_comm = copy_engine).
// Launched at 2 and 4 ranks; skipped on every rank (agreed) without a GPU per local rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/cuda/cuda_backend.h"
#include "vitgrid/grid/grid.h"

namespace vitgrid {
namespace {

bool enough_gpus() {
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
  int lsize = 1, lrank = 0;
  MPI_Comm_size(local, &lsize);
  MPI_Comm_rank(local, &lrank);
  MPI_Comm_free(&local);
  int ok = cuda_device_count() >= lsize ? 1 : 0, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

// copy_engine: the data axis under device.data_comm = copy_engine (the bucket buffer from
// alloc_comm, in NCCL symmetric memory; all-to-all + local sum + all-gather). The values are
// small integers, so every summation order gives the same bits.
void buckets_match_blocking(bool copy_engine) {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  GridShape s;
  s.data = world;
  ProcessGrid grid(MPI_COMM_WORLD, s);
  auto be = make_cuda_backend(grid.local_rank(), DType::F32);
  NcclOptions o;
  o.timeout_s = 120.0;
  o.data_copy_engine = copy_engine;
  auto coll = make_nccl_collectives(grid, *be, o);
  const int D = grid.size(Axis::Data), r = grid.rank(Axis::Data);
  const size_t c = 1 << 16, n = c * D, buckets = 4;
  coll->plan_reduce(n, Axis::Data);
  std::vector<float> host(buckets * n);
  for (size_t i = 0; i < host.size(); ++i) host[i] = float((i * 7 + r * 13) % 29) - 14.0f;
  float* src = static_cast<float*>(be->alloc(host.size() * 4));
  float* a = static_cast<float*>(be->alloc_comm(host.size() * 4));
  float* ref = static_cast<float*>(be->alloc(host.size() * 4));
  be->copy_to_device(src, host.data(), host.size() * 4);
  be->copy(ref, src, host.size() * 4);
  coll->allreduce(ref, host.size(), Elem::F32, ReduceOp::Sum, Axis::Data);
  std::vector<float> want(host.size()), got(host.size());
  be->copy_to_host(want.data(), ref, host.size() * 4);
  for (int pass = 0; pass < 4; ++pass) {
    // passes 2 and 3: each bucket waited for on its own and read before wait_all
    const int zero = pass % 2;
    const bool each = pass >= 2;
    std::vector<Work> w(buckets);
    be->zero(a, host.size() * 4);
    for (size_t k = 0; k < buckets; ++k) {
      // the bucket's input is written on the compute stream right before the start
      be->copy(a + k * n, src + k * n, n * 4);
      be->scale_f32(a + k * n, n, 2.0f);
      be->scale_f32(a + k * n, n, 0.5f);
      if (zero)
        w[k] = coll->start_reduce_scatter(a + k * n + r * c, a + k * n, c, Elem::F32, Axis::Data);
      else
        w[k] = coll->start_allreduce(a + k * n, n, Elem::F32, Axis::Data);
    }
    for (size_t k = 0; each && k < buckets; ++k) {
      coll->wait(w[k]);
      const size_t lo = zero ? k * n + r * c : k * n, len = zero ? c : n;
      be->copy_to_host(got.data() + lo, a + lo, len * 4);  // on the compute stream
      for (size_t i = lo; i < lo + len; ++i)
        ASSERT_EQ(got[i], want[i]) << "waited, zero " << zero << " i " << i;
    }
    coll->wait_all();
    be->scale_f32(a, host.size(), 1.0f);  // compute-stream work after wait_all
    be->copy_to_host(got.data(), a, host.size() * 4);
    for (size_t k = 0; k < buckets; ++k) {
      const size_t lo = zero ? k * n + r * c : k * n, hi = zero ? lo + c : lo + n;
      for (size_t i = lo; i < hi; ++i) ASSERT_EQ(got[i], want[i]) << "zero " << zero << " i " << i;
    }
  }
  be->release(src);
  be->release(a);
  be->release(ref);
}

TEST(AsyncNccl, BucketsMatchBlockingCollectives) {
  if (!enough_gpus()) GTEST_SKIP() << "needs one GPU per local rank";
  buckets_match_blocking(false);
}

TEST(AsyncNccl, CopyEngineBucketsMatchBlockingCollectives) {
  if (!enough_gpus()) GTEST_SKIP() << "needs one GPU per local rank";
  buckets_match_blocking(true);
}

}  // namespace
}  // namespace vitgrid
