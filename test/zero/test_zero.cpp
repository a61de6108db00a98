// Gradient buckets overlapped with the backward, and ZeRO-1, on the CPU backend under MPI
// (1, 2, 4 ranks: every rank is a data rank): bucket plans tile the buffer, the asynchronous
// reductions equal the blocking ones, the model reports every gradient group once in backward
// order, and the sharded optimizer (AdamW, LAMB, SGD) follows the replicated one, state included.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/deck/deck.h"
#include "vitgrid/grid/grid.h"
#include "vitgrid/model/vit.h"
#include "vitgrid/optim/grad_reduce.h"
#include "vitgrid/optim/optimizer.h"
#include "vitgrid/parallel/tensor_parallel.h"

namespace vitgrid {
namespace {

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

GridShape data_grid() {
  GridShape s;
  s.data = world_size();
  return s;
}

TEST(GradBuckets, TileTheBufferAtRoundedGroupStarts) {
  // groups of 100, 300, 50, 500, 70 elements; buffer padded to a multiple of 64
  std::vector<GradRange> g;
  size_t off = 0;
  for (size_t n : {100, 300, 50, 500, 70}) {
    g.push_back({off, n});
    off += n;
  }
  const size_t total = (off + 63) / 64 * 64;
  g.back().n += total - off;
  for (size_t quantum : {size_t(1), size_t(16), size_t(64)}) {
    for (size_t elems : {size_t(0), size_t(1), size_t(200), size_t(600), size_t(5000)}) {
      const auto b = plan_grad_buckets(g, total, elems, quantum);
      ASSERT_FALSE(b.empty());
      size_t at = 0;
      for (const auto& k : b) {
        EXPECT_EQ(k.offset, at);
        EXPECT_GT(k.n, 0u);
        EXPECT_EQ(k.n % quantum, 0u);
        EXPECT_EQ(k.offset % quantum, 0u);
        at += k.n;
      }
      EXPECT_EQ(at, total);
      if (elems == 0 || elems >= total) {
        EXPECT_EQ(b.size(), 1u);
      }
      if (elems == 1 && quantum == 1) {
        EXPECT_EQ(b.size(), g.size());  // one group each
      }
      // every bucket but the first starts at a group start rounded up to the quantum
      for (size_t k = 1; k < b.size(); ++k) {
        bool found = false;
        for (const auto& r : g) found = found || (r.offset + quantum - 1) / quantum * quantum == b[k].offset;
        EXPECT_TRUE(found) << "bucket " << k << " at " << b[k].offset;
      }
    }
  }
}

TEST(GradBuckets, TailGroupsGetABucketEach) {
  // groups of 40, 40, 100, 300, 300, 300: buckets of >= 500 from the end, and below
  // offset 150 (the first three groups, finished last by the backward) one per group
  std::vector<GradRange> g;
  size_t off = 0;
  for (size_t n : {40, 40, 100, 300, 300, 300}) {
    g.push_back({off, n});
    off += n;
  }
  const auto plain = plan_grad_buckets(g, off, 500, 1);
  ASSERT_EQ(plain.size(), 2u);  // [0, 480) and [480, 1080)
  EXPECT_EQ(plain[1].offset, 480u);
  const auto b = plan_grad_buckets(g, off, 500, 1, 150);
  ASSERT_EQ(b.size(), 5u);
  const size_t starts[] = {0, 40, 80, 180, 480};
  for (size_t k = 0; k < b.size(); ++k) EXPECT_EQ(b[k].offset, starts[k]) << "bucket " << k;
  // quantum 16: the cuts round up, the buckets still tile the buffer
  const auto bq = plan_grad_buckets(g, 1088, 500, 16, 150);
  size_t at = 0;
  for (const auto& k : bq) {
    EXPECT_EQ(k.offset, at);
    EXPECT_EQ(k.offset % 16, 0u);
    at += k.n;
  }
  EXPECT_EQ(at, 1088u);
  EXPECT_EQ(bq.size(), 5u);  // 0, 48, 80, 192, 480
}

TEST(AsyncCollectives, MatchTheBlockingOnes) {
  ProcessGrid grid(MPI_COMM_WORLD, data_grid());
  auto coll = make_mpi_collectives(grid);
  const int D = grid.size(Axis::Data), r = grid.rank(Axis::Data);
  const size_t c = 37, n = c * D;
  std::vector<float> a(3 * n), ref;
  for (size_t i = 0; i < a.size(); ++i) a[i] = float((i * 7 + r * 13) % 29) - 14.0f;
  ref = a;
  coll->allreduce(ref.data(), ref.size(), Elem::F32, ReduceOp::Sum, Axis::Data);
  // three all-reduces in flight at once, progressed, then waited
  std::vector<float> b = a;
  for (int k = 0; k < 3; ++k) coll->start_allreduce(b.data() + k * n, n, Elem::F32, Axis::Data);
  coll->progress();
  coll->wait_all();
  EXPECT_EQ(b, ref);
  // reduce-scatter in place (NCCL's convention) and out of place, both in flight together
  std::vector<float> in = a, out(c);
  coll->start_reduce_scatter(in.data() + r * c, in.data(), c, Elem::F32, Axis::Data);
  coll->start_reduce_scatter(out.data(), a.data() + n, c, Elem::F32, Axis::Data);
  coll->wait_all();
  for (size_t i = 0; i < c; ++i) {
    EXPECT_EQ(in[r * c + i], ref[r * c + i]) << i;
    EXPECT_EQ(out[i], ref[n + r * c + i]) << i;
  }
  // the same, each waited for on its own (the in-place block is in place once waited for)
  // before wait_all, and a gather of the pieces waited for in between
  std::vector<float> in3 = a, out3(c), g(n, -1.0f);
  const Work w0 = coll->start_reduce_scatter(in3.data() + r * c, in3.data(), c, Elem::F32,
                                             Axis::Data);
  const Work w1 = coll->start_reduce_scatter(out3.data(), a.data() + n, c, Elem::F32, Axis::Data);
  EXPECT_EQ(w0.kind, Work::Kind::Collective);
  EXPECT_EQ(w1.id, w0.id + 1);
  coll->wait(w1);
  for (size_t i = 0; i < c; ++i) EXPECT_EQ(out3[i], ref[n + r * c + i]) << i;
  coll->wait(w0);
  for (size_t i = 0; i < c; ++i) EXPECT_EQ(in3[r * c + i], ref[r * c + i]) << i;
  coll->wait(coll->start_allgather(g.data(), in3.data() + r * c, c, Elem::F32, Axis::Data));
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(g[i], ref[i]) << i;
  coll->wait_all();
  for (size_t i = 0; i < c; ++i) EXPECT_EQ(in3[r * c + i], ref[r * c + i]) << i;
  // the blocking reduce-scatter accepts the in-place form too
  std::vector<float> in2 = a;
  coll->reduce_scatter(in2.data() + r * c, in2.data(), c, Elem::F32, Axis::Data);
  for (size_t i = 0; i < c; ++i) EXPECT_EQ(in2[r * c + i], ref[r * c + i]);
}

TEST(GradReducer, BucketsReduceAsTheirGroupsComplete) {
  ProcessGrid grid(MPI_COMM_WORLD, data_grid());
  auto coll = make_mpi_collectives(grid);
  const int D = grid.size(Axis::Data), r = grid.rank(Axis::Data);
  std::vector<GradRange> g;
  size_t off = 0;
  for (size_t n : {48, 160, 32, 96, 96, 64, 16}) {
    g.push_back({off, n});
    off += n;
  }
  const size_t q = 16 * D, total = (off + q - 1) / q * q;
  g.back().n += total - off;
  for (int variant = 0; variant < 4; ++variant) {
    const bool zero = variant & 1;
    const size_t tail = variant & 2 ? 150 : 0;  // the first groups: a bucket each
    const auto buckets = plan_grad_buckets(g, total, 150, zero ? q : 1, tail);
    GradReducer red(*coll, D, r, buckets, zero);
    std::vector<int> overlap;  // the overlap hook's calls
    red.set_overlap_hook([&](bool on) { overlap.push_back(on ? 1 : 0); });
    std::vector<float> grads(total), sum(total, 0.0f);
    for (size_t i = 0; i < total; ++i) grads[i] = float((i * 3 + r) % 11) * 0.25f;
    for (int k = 0; k < D; ++k)
      for (size_t i = 0; i < total; ++i) sum[i] += float((i * 3 + k) % 11) * 0.25f;
    red.begin(grads.data());
    // backward order, the third group in two halves
    for (size_t k = g.size(); k-- > 0;) {
      if (k == 2) {
        red.ready(g[k].offset, g[k].n / 2);
        red.ready(g[k].offset + g[k].n / 2, g[k].n - g[k].n / 2);
      } else {
        red.ready(g[k].offset, g[k].n);
      }
    }
    EXPECT_EQ(overlap, std::vector<int>({1}));  // once, at the first bucket started
    red.finish();
    EXPECT_EQ(overlap, std::vector<int>({1, 0}));
    ZeroShards zs{D, r, buckets};
    for (size_t k = 0; k < buckets.size(); ++k) {
      const size_t a = zero ? zs.piece_offset(k) : buckets[k].offset;
      const size_t n = zero ? zs.piece_n(k) : buckets[k].n;
      for (size_t i = a; i < a + n; ++i) ASSERT_EQ(grads[i], sum[i]) << "zero " << zero << " i " << i;
    }
    // nothing reported: finish reduces every bucket
    for (size_t i = 0; i < total; ++i) grads[i] = float((i * 3 + r) % 11) * 0.25f;
    red.begin(grads.data());
    red.finish();
    EXPECT_EQ(overlap.size(), 2u);  // nothing overlapped the backward
    for (size_t k = 0; k < buckets.size(); ++k) {
      const size_t a = zero ? zs.piece_offset(k) : buckets[k].offset;
      const size_t n = zero ? zs.piece_n(k) : buckets[k].n;
      for (size_t i = a; i < a + n; ++i) ASSERT_EQ(grads[i], sum[i]);
    }
  }
}

ViTConfig tiny() {
  ViTConfig c;
  c.image = 8;
  c.patch = 4;
  c.hidden = 24;
  c.depth = 3;
  c.heads = 2;
  c.mlp = 40;
  c.classes = 5;
  return c;
}

TEST(ViTHook, ReportsEveryGroupOnceInBackwardOrder) {
  ProcessGrid grid(MPI_COMM_SELF, GridShape{});
  auto be = make_backend("cpu", 0, DType::F32);
  auto coll = make_mpi_collectives(grid);
  auto tp = make_tensor_parallel(grid, *be, *coll);
  StageLayout layout = StageLayout::whole(tiny().depth);
  layout.pad_to = 48;
  ViT model(tiny(), *be, *tp, 2, layout);
  EXPECT_EQ(model.num_local_params() % 48, 0u);
  const auto& groups = model.grad_groups();
  ASSERT_EQ(groups.size(), size_t(2 * tiny().depth + 2));  // blocks in two halves
  size_t at = 0;
  for (const auto& gr : groups) {
    EXPECT_EQ(gr.offset, at);
    at += gr.n;
  }
  EXPECT_EQ(at, model.num_local_params());
  model.init_params(3);
  std::vector<float> img(2 * 3 * 8 * 8, 0.5f);
  std::vector<int32_t> lab = {1, 3};
  void* dimg = be->alloc(img.size() * 4);
  auto* dlab = static_cast<int32_t*>(be->alloc(8));
  be->copy_to_device(dimg, img.data(), img.size() * 4);
  be->copy_to_device(dlab, lab.data(), 8);
  DeviceBatch b;
  b.images = dimg;
  b.labels = dlab;
  b.count = 2;
  std::vector<std::pair<size_t, size_t>> seen;
  model.set_grad_ready_hook([&](size_t o, size_t n) { seen.push_back({o, n}); });
  double loss = 0;
  model.chunk_forward(0, 0, b, 0, true, 0.f, 1.f, &loss, nullptr, nullptr);
  model.chunk_backward(0, 0, b, 0, /*final=*/false);
  EXPECT_TRUE(seen.empty());
  model.chunk_forward(0, 0, b, 0, true, 0.f, 1.f, &loss, nullptr, nullptr);
  model.chunk_backward(0, 0, b, 0, /*final=*/true);
  ASSERT_EQ(seen.size(), groups.size());
  for (size_t i = 0; i < seen.size(); ++i) {
    const auto& gr = groups[groups.size() - 1 - i];  // head first, embedding last
    EXPECT_EQ(seen[i].first, gr.offset);
    EXPECT_EQ(seen[i].second, gr.n);
  }
  be->release(dimg);
  be->release(dlab);
}

// The sharded optimizer against the replicated one: 3 steps with the same gradients (each rank
// contributes 1/D of them), master weights and state compared. With 16-bit activations (`act`,
// emulated on the CPU) the sharded one holds the masters' pieces itself (the model keeps none:
// the trainer's layout) and refreshes the compute copy from its pieces gathered in the act
// dtype: it must equal the cast of the whole masters.
void sharded_matches_replicated(const std::string& name, DType act = DType::F32) {
  ProcessGrid grid(MPI_COMM_WORLD, data_grid());
  const int D = grid.size(Axis::Data), r = grid.rank(Axis::Data);
  auto be = make_backend("cpu", 0, act);
  auto coll = make_mpi_collectives(grid);
  auto tp = make_tensor_parallel(grid, *be, *coll);
  StageLayout layout = StageLayout::whole(tiny().depth);
  layout.pad_to = static_cast<size_t>(D) * 16;
  ViT rm(tiny(), *be, *tp, 2, layout);
  layout.master_elsewhere = D > 1;
  ViT zm(tiny(), *be, *tp, 2, layout);
  EXPECT_EQ(zm.holds_master(), D == 1 || act == DType::F32);
  const size_t n = zm.num_local_params();
  std::vector<GradRange> groups;
  for (const auto& g : zm.grad_groups()) groups.push_back({g.offset, g.n});
  // small buckets: parameters straddle buckets and pieces
  ZeroShards zs{D, r, plan_grad_buckets(groups, n, 300, size_t(D) * 16)};
  OptimSection o;
  o.name = name;
  o.weight_decay = 0.05;
  o.lr = 1e-2;
  Optimizer zopt(o, *be, *tp, zm, &zs, coll.get(), grid.comm(Axis::Data).get());
  Optimizer ropt(o, *be, *tp, rm);
  EXPECT_EQ(zopt.holds_master(), !zm.holds_master());
  // the trainer's init: the model's compute copy (and masters, if it holds them), then the
  // optimizer's pieces
  const std::vector<float> init = zm.initial_params(5);
  zm.set_params(init.data());
  zopt.master_from_host(init.data());
  rm.init_params(5);
  GradReducer red(*coll, D, r, zs.buckets, true);
  std::mt19937 gen(17);
  std::normal_distribution<float> nd;
  std::vector<float> full(n, 0.0f), part(n, 0.0f);
  for (int s = 1; s <= 3; ++s) {
    for (const auto& p : zm.params())
      for (size_t i = 0; i < p.numel; ++i) full[p.offset + i] = nd(gen) * 0.1f;
    for (size_t i = 0; i < n; ++i) part[i] = full[i] / float(D);
    be->copy_to_device(rm.grads(), full.data(), n * 4);
    be->copy_to_device(zm.grads(), part.data(), n * 4);
    red.begin(zm.grads());
    red.finish();
    const double gz = zopt.grad_norm_sq(zm.grads()), gr = ropt.grad_norm_sq(rm.grads());
    EXPECT_NEAR(gz, gr, 1e-6 * gr) << name << " step " << s;
    // the device totals the trainer clips with: ZeRO's pieces summed over the data ranks
    for (Optimizer* o : {&zopt, &ropt}) {
      auto* d = static_cast<double*>(be->alloc(sizeof(double)));
      o->grad_norm_sq_device(o == &zopt ? zm.grads() : rm.grads(), d);
      double got = 0.0;
      be->copy_to_host(&got, d, sizeof got);
      be->release(d);
      EXPECT_NEAR(got, gr, 1e-6 * gr) << name << " step " << s << (o == &zopt ? " ZeRO" : "");
    }
    EXPECT_TRUE(zopt.grads_finite(zm.grads()));
    const bool refreshed = zopt.step(zm.master(), zm.grads(), 1e-2, s, 0.5f, nullptr,
                                     zm.compute_copy());
    EXPECT_EQ(refreshed, D > 1 && zm.compute_copy() != nullptr) << name << " step " << s;
    if (!refreshed) zm.sync_compute_params();
    if (!ropt.step(rm.master(), rm.grads(), 1e-2, s, 0.5f, nullptr, rm.compute_copy()))
      rm.sync_compute_params();
  }
  std::vector<float> a(n), b(n);
  zopt.master_to_host(zm.master(), a.data());
  ropt.master_to_host(rm.master(), b.data());
  double worst = 0.0;
  for (size_t i = 0; i < n; ++i) worst = std::max(worst, double(std::fabs(a[i] - b[i])));
  EXPECT_LE(worst, 2e-6) << name << ": master weights";
  if (zm.compute_copy()) {
    // the gathered compute copy is the cast of the gathered masters, bit for bit
    const size_t bytes = n * be->act_size();
    auto* m = static_cast<float*>(be->alloc(n * 4));
    void* cast = be->alloc(bytes);
    be->copy_to_device(m, a.data(), n * 4);
    be->cast_to_act(cast, m, n);
    std::vector<char> want(bytes), got(bytes);
    be->copy_to_host(want.data(), cast, bytes);
    be->copy_to_host(got.data(), zm.compute_copy(), bytes);
    EXPECT_TRUE(want == got) << name << ": compute copy";
    be->release(cast);
    be->release(m);
  }
  for (size_t k = 0; k < ropt.state().size(); ++k) {
    std::fill(a.begin(), a.end(), 0.0f);
    zopt.state_to_host(k, a.data());
    ropt.state_to_host(k, b.data());
    double w = 0.0;
    for (size_t i = 0; i < n; ++i) w = std::max(w, double(std::fabs(a[i] - b[i])));
    EXPECT_LE(w, 1e-6) << name << ": state " << ropt.state()[k].first;
    // and back: a round trip through the flat host form keeps the shard
    zopt.state_from_host(k, b.data());
    std::vector<float> c(n, 0.0f);
    zopt.state_to_host(k, c.data());
    EXPECT_EQ(c, b);
  }
}

TEST(ZeroOptimizer, AdamWMatchesReplicated) { sharded_matches_replicated("adamw"); }
TEST(ZeroOptimizer, LambMatchesReplicated) { sharded_matches_replicated("lamb"); }
TEST(ZeroOptimizer, SgdMatchesReplicated) { sharded_matches_replicated("sgd"); }
TEST(ZeroOptimizer, AdamWBf16GathersTheComputeCopy) {
  sharded_matches_replicated("adamw", DType::BF16);
}
TEST(ZeroOptimizer, LambFp16GathersTheComputeCopy) {
  sharded_matches_replicated("lamb", DType::F16);
}

TEST(ZeroOptimizer, StateIsAllocatedForTheShardOnly) {
  ProcessGrid grid(MPI_COMM_WORLD, data_grid());
  const int D = grid.size(Axis::Data), r = grid.rank(Axis::Data);
  auto be = make_backend("cpu", 0, DType::F32);
  auto coll = make_mpi_collectives(grid);
  auto tp = make_tensor_parallel(grid, *be, *coll);
  StageLayout layout = StageLayout::whole(tiny().depth);
  layout.pad_to = static_cast<size_t>(D) * 16;
  ViT m(tiny(), *be, *tp, 2, layout);
  const size_t n = m.num_local_params();
  std::vector<GradRange> groups;
  for (const auto& g : m.grad_groups()) groups.push_back({g.offset, g.n});
  ZeroShards zs{D, r, plan_grad_buckets(groups, n, 0, size_t(D) * 16)};
  OptimSection o;
  const size_t before = be->peak_memory_bytes();
  { Optimizer z(o, *be, *tp, m, &zs, coll.get(), grid.comm(Axis::Data).get()); }
  const size_t sharded = be->peak_memory_bytes() - before;
  { Optimizer full(o, *be, *tp, m); }
  const size_t whole = be->peak_memory_bytes() - before;
  // AdamW: two state buffers of n / D floats, against two of n
  EXPECT_LE(sharded, 2 * n / D * 4 + 1024);
  EXPECT_GE(whole, 2 * n * 4);
}

// With 16-bit activations the fp32 masters are sharded too: the model allocates none and the
// optimizer n / D floats of them, so the peak drops by n - n / D floats (bf16 on the CPU).
TEST(ZeroOptimizer, MastersAreAllocatedForTheShardOnlyWith16BitActivations) {
  ProcessGrid grid(MPI_COMM_WORLD, data_grid());
  const int D = grid.size(Axis::Data), r = grid.rank(Axis::Data);
  size_t peak[2] = {0, 0}, n = 0;
  for (int elsewhere = 0; elsewhere < 2; ++elsewhere) {
    auto be = make_backend("cpu", 0, DType::BF16);  // fresh: its peak is this model's
    auto coll = make_mpi_collectives(grid);
    auto tp = make_tensor_parallel(grid, *be, *coll);
    StageLayout layout = StageLayout::whole(tiny().depth);
    layout.pad_to = static_cast<size_t>(D) * 16;
    layout.master_elsewhere = elsewhere == 1;
    ViT m(tiny(), *be, *tp, 2, layout);
    EXPECT_EQ(m.holds_master(), elsewhere == 0);
    EXPECT_EQ(m.master() == nullptr, elsewhere == 1);
    n = m.num_local_params();
    std::vector<GradRange> groups;
    for (const auto& g : m.grad_groups()) groups.push_back({g.offset, g.n});
    ZeroShards zs{D, r, plan_grad_buckets(groups, n, 0, size_t(D) * 16)};
    OptimSection o;
    if (elsewhere == 1 && D == 1) return;  // one data rank is not ZeRO: nobody would hold them
    Optimizer z(o, *be, *tp, m, &zs, coll.get(), grid.comm(Axis::Data).get());
    EXPECT_EQ(z.holds_master(), elsewhere == 1);
    peak[elsewhere] = be->peak_memory_bytes();
  }
  const double saved = double(peak[0]) - double(peak[1]), want = double(n - n / D) * 4.0;
  EXPECT_NEAR(saved, want, 256.0) << n << " parameters over " << D << " data ranks";
}

}  // namespace
}  // namespace vitgrid
