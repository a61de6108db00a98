// The process grid at 1, 2, 4 and 8 ranks: for every layout that fits the world size, the
// coordinates, the membership of every sub-communicator and the collectives are checked against
// an independent computation of the row-major layout (this file never asks the grid how it
// decomposed a rank; it computes the answer itself).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "vitgrid/core/error.h"
#include "vitgrid/grid/grid.h"

namespace vitgrid {
namespace {

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

struct Layout {
  int pipeline, data, tensor;
  TensorMode mode;
  int depth;
  std::vector<int> tdims;  // tensor dims, written out by hand
};

std::string describe(const Layout& l) {
  std::ostringstream s;
  s << "pipeline " << l.pipeline << " data " << l.data << " tensor " << l.tensor << " ("
    << tensor_mode_name(l.mode) << ", depth " << l.depth << ")";
  return s.str();
}

// Every layout exercised at each world size.
std::vector<Layout> layouts(int n) {
  using M = TensorMode;
  std::vector<Layout> all = {
      {1, 1, 1, M::None, 1, {1}},     {1, 1, 1, M::D1, 1, {1}},
      {1, 2, 1, M::None, 1, {1}},     {2, 1, 1, M::None, 1, {1}},
      {1, 1, 2, M::D1, 1, {2}},       {1, 1, 4, M::D1, 1, {4}},
      {1, 1, 4, M::D2, 1, {2, 2}},    {1, 1, 4, M::D2p5, 1, {1, 2, 2}},
      {2, 2, 1, M::None, 1, {1}},     {1, 2, 2, M::D1, 1, {2}},
      {2, 1, 2, M::D1, 1, {2}},       {1, 4, 1, M::None, 1, {1}},
      {1, 1, 8, M::D1, 1, {8}},       {1, 4, 2, M::D1, 1, {2}},
      {1, 2, 4, M::D2, 1, {2, 2}},    {1, 1, 8, M::D2p5, 2, {2, 2, 2}},
      {1, 1, 8, M::D3, 1, {2, 2, 2}}, {2, 2, 2, M::D1, 1, {2}},
      {2, 1, 4, M::D2, 1, {2, 2}},    {1, 2, 4, M::D2p5, 1, {1, 2, 2}},
      {8, 1, 1, M::None, 1, {1}},
  };
  std::vector<Layout> out;
  for (const Layout& l : all)
    if (l.pipeline * l.data * l.tensor == n) out.push_back(l);
  return out;
}

// Row-major coordinates of a world rank over dims (last dim fastest).
std::vector<int> decompose(int rank, const std::vector<int>& dims) {
  std::vector<int> c(dims.size());
  for (int i = static_cast<int>(dims.size()) - 1; i >= 0; --i) {
    c[i] = rank % dims[i];
    rank /= dims[i];
  }
  return c;
}

// The dims each axis keeps (0 pipeline, 1 data, 2.. tensor dims), following the conventions in
// grid.cpp's header comment (Colossal-AI's groups). Empty = the axis is absent (size 1).
std::vector<int> kept_dims(Axis a, const Layout& l) {
  const int nd = 2 + static_cast<int>(l.tdims.size());
  switch (a) {
    case Axis::World: {
      std::vector<int> all(nd);
      std::iota(all.begin(), all.end(), 0);
      return all;
    }
    case Axis::Pipeline:
      return {0};
    case Axis::Data:
      return {1};
    case Axis::Tensor: {
      std::vector<int> t;
      for (int i = 2; i < nd; ++i) t.push_back(i);
      return t;
    }
    case Axis::TensorRow:  // same row, varying column (the last dim)
      if (l.mode == TensorMode::D2) return {3};
      if (l.mode == TensorMode::D2p5) return {4};
      return {};
    case Axis::TensorCol:
      if (l.mode == TensorMode::D2) return {2};
      if (l.mode == TensorMode::D2p5) return {3};
      return {};
    case Axis::TensorDepth:
      if (l.mode == TensorMode::D2p5) return {2};
      return {};
    case Axis::TensorX:  // Colossal-AI 3d input group: middle index varies
      if (l.mode == TensorMode::D3) return {3};
      return {};
    case Axis::TensorY:  // weight group: fastest index varies
      if (l.mode == TensorMode::D3) return {4};
      return {};
    case Axis::TensorZ:  // output group: slowest index varies
      if (l.mode == TensorMode::D3) return {2};
      return {};
    case Axis::Count:
      break;
  }
  return {};
}

// World ranks sharing my coordinates on every dim but the kept ones, ascending (which is the
// sub-communicator's rank order, because Cart_sub keeps the Cartesian order).
std::vector<int> expected_members(Axis a, const Layout& l, int me, int n) {
  std::vector<int> dims = {l.pipeline, l.data};
  dims.insert(dims.end(), l.tdims.begin(), l.tdims.end());
  const std::vector<int> keep = kept_dims(a, l);
  if (keep.empty()) return {me};
  const std::vector<int> mine = decompose(me, dims);
  std::vector<int> out;
  for (int r = 0; r < n; ++r) {
    const std::vector<int> c = decompose(r, dims);
    bool same = true;
    for (size_t i = 0; i < dims.size(); ++i)
      if (std::find(keep.begin(), keep.end(), static_cast<int>(i)) == keep.end() && c[i] != mine[i])
        same = false;
    if (same) out.push_back(r);
  }
  return out;
}

GridShape shape_of(const Layout& l) {
  GridShape s;
  s.pipeline = l.pipeline;
  s.data = l.data;
  s.tensor = l.tensor;
  s.mode = l.mode;
  s.depth = l.depth;
  return s;
}

const Axis kAxes[] = {Axis::World,     Axis::Pipeline,  Axis::Data,        Axis::Tensor,
                      Axis::TensorRow, Axis::TensorCol, Axis::TensorDepth, Axis::TensorX,
                      Axis::TensorY,   Axis::TensorZ};

TEST(Grid, CoordinatesAreRowMajor) {
  const int n = world_size(), me = world_rank();
  for (const Layout& l : layouts(n)) {
    SCOPED_TRACE(describe(l));
    ProcessGrid g(MPI_COMM_WORLD, shape_of(l));
    std::vector<int> dims = {l.pipeline, l.data};
    dims.insert(dims.end(), l.tdims.begin(), l.tdims.end());
    EXPECT_EQ(g.shape().tensor_dims(), l.tdims);
    EXPECT_EQ(g.coords(), decompose(me, dims));
    EXPECT_EQ(g.world_rank(), me);
    EXPECT_EQ(g.world_size(), n);
  }
}

TEST(Grid, SubCommunicatorsHoldTheExpectedRanks) {
  const int n = world_size(), me = world_rank();
  for (const Layout& l : layouts(n)) {
    SCOPED_TRACE(describe(l));
    ProcessGrid g(MPI_COMM_WORLD, shape_of(l));
    for (Axis a : kAxes) {
      SCOPED_TRACE(axis_name(a));
      const std::vector<int> want = expected_members(a, l, me, n);
      const Comm& c = g.comm(a);
      ASSERT_TRUE(c.valid());
      ASSERT_EQ(c.size(), static_cast<int>(want.size()));
      EXPECT_EQ(g.size(a), c.size());
      EXPECT_EQ(g.rank(a), c.rank());
      std::vector<int> got(c.size());
      MPI_Allgather(&me, 1, MPI_INT, got.data(), 1, MPI_INT, c.get());
      EXPECT_EQ(got, want);
      // my rank in the axis is my position among its members
      EXPECT_EQ(want[c.rank()], me);
    }
    // the axis sizes multiply out as the layout says
    EXPECT_EQ(g.size(Axis::Pipeline), l.pipeline);
    EXPECT_EQ(g.size(Axis::Data), l.data);
    EXPECT_EQ(g.size(Axis::Tensor), l.tensor);
  }
}

TEST(Grid, CollectivesOverEveryAxis) {
  const int n = world_size(), me = world_rank();
  for (const Layout& l : layouts(n)) {
    SCOPED_TRACE(describe(l));
    ProcessGrid g(MPI_COMM_WORLD, shape_of(l));
    auto coll = make_mpi_collectives(g);
    for (Axis a : kAxes) {
      SCOPED_TRACE(axis_name(a));
      const std::vector<int> members = expected_members(a, l, me, n);
      const int size = static_cast<int>(members.size());
      const int my = g.rank(a);
      const float sum = static_cast<float>(std::accumulate(members.begin(), members.end(), 0));
      const float max = static_cast<float>(*std::max_element(members.begin(), members.end()));

      std::vector<float> v = {static_cast<float>(me), 1.0f, -static_cast<float>(me)};
      coll->allreduce(v.data(), v.size(), Elem::F32, ReduceOp::Sum, a);
      EXPECT_EQ(v, (std::vector<float>{sum, static_cast<float>(size), -sum}));

      std::vector<float> m = {static_cast<float>(me), -static_cast<float>(me)};
      coll->allreduce(m.data(), m.size(), Elem::F32, ReduceOp::Max, a);
      EXPECT_EQ(m[0], max);
      EXPECT_EQ(m[1], -static_cast<float>(members.front()));

      float act = 2.0f * me;  // the CPU's act storage: fp32
      coll->allreduce(&act, 1, Elem::Act, ReduceOp::Sum, a);
      EXPECT_EQ(act, 2.0f * sum);

      std::vector<double> d = {0.5 * me, static_cast<double>(me)};
      coll->allreduce(d.data(), d.size(), Elem::F64, ReduceOp::Sum, a);
      EXPECT_EQ(d, (std::vector<double>{0.5 * sum, sum}));
      std::vector<double> dm = {0.5 * me, -static_cast<double>(me)};
      coll->allreduce(dm.data(), dm.size(), Elem::F64, ReduceOp::Max, a);
      EXPECT_EQ(dm, (std::vector<double>{0.5 * max, -static_cast<double>(members.front())}));

      const int root = size - 1;
      int b[2] = {me, me * 3};
      coll->broadcast(b, sizeof(b), root, a);
      EXPECT_EQ(b[0], members[root]);
      EXPECT_EQ(b[1], members[root] * 3);

      // allgather: rank order of the axis, two int32 per rank (4-byte elements: F32's size)
      int in[2] = {me, 100 + me};
      std::vector<int> out(2 * size, -1);
      coll->allgather(out.data(), in, 2, Elem::F32, a);
      std::vector<int> want;
      for (int r : members) {
        want.push_back(r);
        want.push_back(100 + r);
      }
      EXPECT_EQ(out, want);
      // in place: my block already in out
      std::vector<int> inplace(2 * size, -1);
      inplace[2 * my] = me;
      inplace[2 * my + 1] = 100 + me;
      coll->allgather(inplace.data(), inplace.data() + 2 * my, 2, Elem::F32, a);
      EXPECT_EQ(inplace, want);

      // reduce_scatter: block j element k of rank r holds r*100 + j*10 + k
      const size_t blk = 3;
      std::vector<float> rs_in(size * blk);
      for (int j = 0; j < size; ++j)
        for (size_t k = 0; k < blk; ++k) rs_in[j * blk + k] = me * 100.0f + j * 10.0f + k;
      std::vector<float> rs_out(blk, -1);
      coll->reduce_scatter(rs_out.data(), rs_in.data(), blk, Elem::F32, a);
      for (size_t k = 0; k < blk; ++k)
        EXPECT_EQ(rs_out[k], 100.0f * sum + size * (my * 10.0f + k)) << "element " << k;
      // the same in fp64, in place
      std::vector<double> rs_d(rs_in.begin(), rs_in.end());
      coll->reduce_scatter(rs_d.data() + my * blk, rs_d.data(), blk, Elem::F64, a);
      for (size_t k = 0; k < blk; ++k) EXPECT_EQ(rs_d[my * blk + k], rs_out[k]) << "element " << k;

      // the overlapped pair, both open at once
      std::vector<int> og(2 * size, -1);
      std::vector<float> ors(blk, -1);
      const Work tg = coll->start_overlapped_allgather(og.data(), in, 2, Elem::F32, a);
      const Work tr =
          coll->start_overlapped_reduce_scatter(ors.data(), rs_in.data(), blk, Elem::Act, a);
      EXPECT_EQ(tg.kind, Work::Kind::Overlapped);
      EXPECT_EQ(tr.kind, Work::Kind::Overlapped);
      EXPECT_EQ(tr.id, tg.id + 1);
      coll->wait(tg);
      coll->wait(tr);
      EXPECT_EQ(og, want);
      EXPECT_EQ(ors, rs_out);
      // an overlapped gather in place (sequence parallelism's exchange): my block already in
      std::vector<int> oip(2 * size, -1);
      oip[2 * my] = me;
      oip[2 * my + 1] = 100 + me;
      coll->wait(
          coll->start_overlapped_allgather(oip.data(), oip.data() + 2 * my, 2, Elem::F32, a));
      EXPECT_EQ(oip, want);

      coll->barrier(a);
    }
  }
}

// Runs f(coll, stages, s, next, prev) on every layout of the world with two or more pipeline
// stages: `stages` are the world ranks of this rank's pipeline, s its stage, next / prev its
// neighbours' stages around the ring.
template <class F>
void on_every_pipeline_ring(F&& f) {
  const int n = world_size(), me = world_rank();
  for (const Layout& l : layouts(n)) {
    if (l.pipeline < 2) continue;
    SCOPED_TRACE(describe(l));
    ProcessGrid g(MPI_COMM_WORLD, shape_of(l));
    auto coll = make_mpi_collectives(g);
    const std::vector<int> stages = expected_members(Axis::Pipeline, l, me, n);
    const int p = g.size(Axis::Pipeline), s = g.rank(Axis::Pipeline);
    f(*coll, stages, s, (s + 1) % p, (s + p - 1) % p);
  }
}

TEST(Grid, SendRecvRingAlongPipeline) {
  const int me = world_rank();
  on_every_pipeline_ring([&](Collectives& coll, const std::vector<int>& stages, int s, int next, int prev) {
    std::vector<double> out = {static_cast<double>(me), 0.5 * me}, in(2, -1);
    // even stages send first, odd ones receive first: blocking sends cannot deadlock
    if (s % 2 == 0) {
      coll.send(out.data(), out.size() * sizeof(double), next, Axis::Pipeline);
      coll.recv(in.data(), in.size() * sizeof(double), prev, Axis::Pipeline);
    } else {
      coll.recv(in.data(), in.size() * sizeof(double), prev, Axis::Pipeline);
      coll.send(out.data(), out.size() * sizeof(double), next, Axis::Pipeline);
    }
    EXPECT_EQ(in[0], static_cast<double>(stages[prev]));
    EXPECT_EQ(in[1], 0.5 * stages[prev]);
  });
}

TEST(Grid, SendRecvGroupSwapsInOneStep) {
  // every stage sends to the next and receives from the previous in one group: with messages
  // large enough for MPI's rendezvous protocol, the same calls one at a time and in this
  // order on every stage would deadlock
  const int me = world_rank();
  on_every_pipeline_ring([&](Collectives& coll, const std::vector<int>& stages, int, int next, int prev) {
    const size_t count = size_t(1) << 20;  // 8 MiB
    std::vector<double> out(count), in(count, -1.0), back(2, -1.0);
    for (size_t i = 0; i < count; ++i) out[i] = me + 1e-6 * static_cast<double>(i);
    const std::vector<double> small = {2.0 * me, 3.0 * me};
    coll.group_begin();
    coll.send(out.data(), count * sizeof(double), next, Axis::Pipeline);
    coll.recv(in.data(), count * sizeof(double), prev, Axis::Pipeline);
    // and a second, smaller message the other way round in the same group
    coll.send(small.data(), small.size() * sizeof(double), prev, Axis::Pipeline);
    coll.recv(back.data(), back.size() * sizeof(double), next, Axis::Pipeline);
    coll.group_end();
    EXPECT_EQ(in[0], static_cast<double>(stages[prev]));
    EXPECT_EQ(in[count - 1], stages[prev] + 1e-6 * static_cast<double>(count - 1));
    EXPECT_EQ(back[0], 2.0 * stages[next]);
    EXPECT_EQ(back[1], 3.0 * stages[next]);
  });
}

TEST(Grid, MessagesFlowOnIndependentChannels) {
  // Every stage sends a large message (MPI's rendezvous protocol) and a small one to the next
  // stage on channel 0 and a small one to the previous stage on channel 1, then waits for
  // channel 1 before it even posts channel 0's receives: posting never blocks, channels do not
  // wait for each other, and one channel's messages arrive in posting order.
  const int me = world_rank();
  on_every_pipeline_ring([&](Collectives& coll, const std::vector<int>& stages, int, int next, int prev) {
    coll.open_links(Axis::Pipeline);
    const size_t count = size_t(1) << 20;  // 8 MiB
    std::vector<double> big(count), in(count, -1.0);
    for (size_t i = 0; i < count; ++i) big[i] = me + 1e-6 * static_cast<double>(i);
    const std::vector<double> small = {2.0 * me, 3.0 * me}, up = {5.0 * me};
    std::vector<double> small_in(2, -1.0), up_in(1, -1.0);
    coll.post_send(big.data(), count * sizeof(double), next, 0, Axis::Pipeline);
    coll.post_send(small.data(), small.size() * sizeof(double), next, 0, Axis::Pipeline);
    coll.post_send(up.data(), sizeof(double), prev, 1, Axis::Pipeline);
    const Work t_up = coll.post_recv(up_in.data(), sizeof(double), next, 1, Axis::Pipeline, {});
    EXPECT_EQ(t_up.kind, Work::Kind::Message);
    coll.wait(t_up);
    EXPECT_EQ(up_in[0], 5.0 * stages[next]);
    const Work f = coll.fence();
    const Work t_big = coll.post_recv(in.data(), count * sizeof(double), prev, 0, Axis::Pipeline, {f});
    const Work t_small = coll.post_recv(small_in.data(), small_in.size() * sizeof(double), prev, 0,
                                        Axis::Pipeline, {f, t_up});
    coll.wait(t_small);
    coll.wait(t_big);
    EXPECT_EQ(in[0], static_cast<double>(stages[prev]));
    EXPECT_EQ(in[count - 1], stages[prev] + 1e-6 * static_cast<double>(count - 1));
    EXPECT_EQ(small_in[0], 2.0 * stages[prev]);
    EXPECT_EQ(small_in[1], 3.0 * stages[prev]);
    coll.wait_messages();  // the sends
  });
}

TEST(Grid, RankMapListsEveryRank) {
  const int n = world_size(), me = world_rank();
  for (const Layout& l : layouts(n)) {
    SCOPED_TRACE(describe(l));
    ProcessGrid g(MPI_COMM_WORLD, shape_of(l));
    const std::string map = g.rank_map();
    std::istringstream in(map);
    std::string line;
    std::getline(in, line);
    EXPECT_EQ(line.rfind("rank", 0), 0u) << line;
    std::set<int> seen;
    std::set<std::pair<std::string, int>> host_local;
    while (std::getline(in, line)) {
      std::istringstream f(line);
      int rank = -1, local = -1, pipe = -1, data = -1;
      std::string host, tensor;
      f >> rank >> host >> local >> pipe >> data >> tensor;
      ASSERT_TRUE(static_cast<bool>(f)) << line;
      seen.insert(rank);
      // one GPU index per rank on each host
      EXPECT_TRUE(host_local.insert({host, local}).second) << line;
      if (rank == me) {
        EXPECT_EQ(host, g.host());
        EXPECT_EQ(local, g.local_rank());
        EXPECT_EQ(pipe, g.coords()[0]);
        EXPECT_EQ(data, g.coords()[1]);
        std::string t = "(";
        for (size_t i = 2; i < g.coords().size(); ++i)
          t += (i > 2 ? "," : "") + std::to_string(g.coords()[i]);
        EXPECT_EQ(tensor, t + ")");
      }
    }
    EXPECT_EQ(static_cast<int>(seen.size()), n);
    EXPECT_EQ(*seen.begin(), 0);
    EXPECT_EQ(*seen.rbegin(), n - 1);
    EXPECT_GE(g.local_rank(), 0);
    EXPECT_LT(g.local_rank(), g.local_size());
    EXPECT_LE(g.local_size(), n);
    EXPECT_FALSE(g.host().empty());
  }
}

TEST(Grid, CommIsOwnedAndMovable) {
  MPI_Comm d = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &d);
  Comm a(d);
  EXPECT_TRUE(a.valid());
  EXPECT_EQ(a.size(), world_size());
  EXPECT_EQ(a.rank(), world_rank());
  Comm b(std::move(a));
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from state is specified
  EXPECT_EQ(b.get(), d);
  Comm c;
  EXPECT_FALSE(c.valid());
  c = std::move(b);
  EXPECT_EQ(c.get(), d);
  int cmp = MPI_UNEQUAL;
  MPI_Comm_compare(c.get(), MPI_COMM_WORLD, &cmp);
  EXPECT_EQ(cmp, MPI_CONGRUENT);
  { Comm w(MPI_COMM_WORLD, /*owned=*/true); }  // never frees a predefined communicator
  int size = 0;
  EXPECT_EQ(MPI_Comm_size(MPI_COMM_WORLD, &size), MPI_SUCCESS);
}

TEST(Grid, ShapeRules) {
  GridShape s;
  s.mode = TensorMode::D2;
  s.tensor = 9;
  EXPECT_EQ(s.q(), 3);
  EXPECT_EQ(s.tensor_dims(), (std::vector<int>{3, 3}));
  s.mode = TensorMode::D2p5;
  s.tensor = 18;
  s.depth = 2;
  EXPECT_EQ(s.q(), 3);
  EXPECT_EQ(s.tensor_dims(), (std::vector<int>{2, 3, 3}));
  s.mode = TensorMode::D3;
  s.tensor = 27;
  EXPECT_EQ(s.q(), 3);
  s.mode = TensorMode::None;
  s.tensor = 1;
  EXPECT_EQ(s.tensor_dims(), (std::vector<int>{1}));

  auto refusal = [](GridShape g, int world) -> std::string {
    try {
      check_grid_shape(g, world);
    } catch (const UserError& e) {
      return e.what();
    }
    return "<accepted>";
  };
  GridShape t;
  t.mode = TensorMode::D2;
  t.tensor = 2;
  t.data = 1;
  EXPECT_EQ(refusal(t, 2).rfind("parallel.tensor: 2 is not a square", 0), 0u);
  t.mode = TensorMode::D2p5;
  t.tensor = 8;
  t.depth = 3;
  EXPECT_EQ(refusal(t, 8).rfind("parallel.tensor_depth: 3", 0), 0u);
  t.depth = 2;
  EXPECT_EQ(refusal(t, 8), "<accepted>");
  t.mode = TensorMode::D3;
  t.tensor = 4;
  EXPECT_EQ(refusal(t, 4).rfind("parallel.tensor: 4 is not a cube", 0), 0u);
  GridShape p;
  p.pipeline = 3;
  EXPECT_EQ(refusal(p, 4).rfind("parallel.pipeline: 3", 0), 0u);
  p.pipeline = 2;
  p.data = 1;
  EXPECT_EQ(refusal(p, 4).rfind("parallel.data: 1", 0), 0u);
  GridShape none;
  none.tensor = 2;
  EXPECT_EQ(refusal(none, 2).rfind("parallel.tensor: 2 tensor ranks need", 0), 0u);

  // a bad shape throws on every rank before any collective, so nobody hangs
  GridShape bad;
  bad.pipeline = world_size() + 1;
  EXPECT_THROW(ProcessGrid(MPI_COMM_WORLD, bad), UserError);
}

TEST(Grid, ModeAndAxisNames) {
  for (TensorMode m :
       {TensorMode::D1, TensorMode::D2, TensorMode::D2p5, TensorMode::D3, TensorMode::None})
    EXPECT_EQ(parse_tensor_mode(tensor_mode_name(m)), m);
  EXPECT_THROW(parse_tensor_mode("4d"), UserError);
  std::set<std::string> names;
  for (Axis a : kAxes) names.insert(axis_name(a));
  EXPECT_EQ(names.size(), static_cast<size_t>(Axis::Count));
}

}  // namespace
}  // namespace vitgrid
