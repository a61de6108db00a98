// Pipeline plans (no MPI traffic): every schedule on many shapes replays to the end under
// blocking rendezvous send/recv, holds the activation sets the schedule promises, and the
// partitions follow the deck.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "vitgrid/core/error.h"
#include "vitgrid/parallel/pipeline.h"

namespace vitgrid {
namespace {

struct Shape {
  PipeSchedule k;
  int P, V, M;
};

std::vector<Shape> shapes() {
  std::vector<Shape> out;
  for (int P : {1, 2, 3, 4, 8})
    for (int M : {1, 2, 3, 4, 5, 8, 16}) {
      out.push_back({PipeSchedule::GPipe, P, 1, M});
      out.push_back({PipeSchedule::OneFOneB, P, 1, M});
      for (int V : {2, 3}) out.push_back({PipeSchedule::Interleaved, P, V, M});
    }
  return out;
}

std::string name(const Shape& s) {
  return std::string(pipe_schedule_name(s.k)) + " P=" + std::to_string(s.P) +
         " V=" + std::to_string(s.V) + " M=" + std::to_string(s.M);
}

TEST(PipelinePlan, EveryScheduleReplaysWithoutDeadlock) {
  for (const Shape& s : shapes())
    for (bool train : {true, false}) {
      PipelinePlans p = build_pipeline_plans(s.k, s.P, s.V, s.M, train);
      EXPECT_EQ(check_pipeline_plans(p), "") << name(s) << (train ? " train" : " eval");
      // each stage computes every (chunk, micro) forward once (and backward once in training)
      for (const auto& st : p.stages) {
        size_t f = 0, b = 0;
        for (const auto& op : st.ops) {
          f += op.kind == PipeOpKind::Forward;
          b += op.kind == PipeOpKind::Backward;
        }
        EXPECT_EQ(f, size_t(s.V * s.M)) << name(s);
        EXPECT_EQ(b, train ? size_t(s.V * s.M) : 0u) << name(s);
      }
    }
}

TEST(PipelinePlan, ActivationSetsAsTheSchedulePromises) {
  for (int P : {2, 4, 8})
    for (int M : {4, 8, 16}) {
      auto g = build_pipeline_plans(PipeSchedule::GPipe, P, 1, M, true);
      auto f = build_pipeline_plans(PipeSchedule::OneFOneB, P, 1, M, true);
      for (int s = 0; s < P; ++s) {
        // GPipe holds every micro-batch of the step
        EXPECT_EQ(g.stages[s].num_slots, M) << "gpipe P=" << P << " M=" << M << " stage " << s;
        // 1F1B: the warm-up's P - s - 1 plus the one in its steady state, and at most one
        // more whose input gradient is still on its way to the previous stage
        EXPECT_LE(f.stages[s].num_slots, std::min(M, P - s) + 1)
            << "1f1b P=" << P << " M=" << M << " stage " << s;
      }
      // the last stage runs forward then backward at once: one set
      EXPECT_EQ(f.stages[P - 1].num_slots, 1);
      // forward only: a set lives from its input to its output's send
      auto e = build_pipeline_plans(PipeSchedule::OneFOneB, P, 1, M, false);
      for (int s = 0; s < P; ++s) EXPECT_LE(e.stages[s].num_slots, 2) << "eval stage " << s;
    }
}

TEST(PipelinePlan, SimulatedBubbleFollowsTheory) {
  // unit costs: idle / total = (P-1) / (M + P - 1) for GPipe and 1F1B, i.e. bubble / work =
  // (P-1)/M; interleaving divides the bubble by V
  for (int P : {2, 4})
    for (int M : {4, 8}) {
      for (PipeSchedule k : {PipeSchedule::GPipe, PipeSchedule::OneFOneB}) {
        auto p = build_pipeline_plans(k, P, 1, M, true);
        const double b = theoretical_bubble(k, P, 1, M);
        EXPECT_NEAR(p.simulated_bubble, b / (1 + b), 1e-9) << pipe_schedule_name(k) << " P=" << P << " M=" << M;
      }
      if (M % P == 0) {
        auto p = build_pipeline_plans(PipeSchedule::Interleaved, P, 2, M, true);
        auto q = build_pipeline_plans(PipeSchedule::OneFOneB, P, 1, M, true);
        EXPECT_LT(p.simulated_bubble, q.simulated_bubble) << "interleaved P=" << P << " M=" << M;
      }
    }
  EXPECT_DOUBLE_EQ(theoretical_bubble(PipeSchedule::Interleaved, 4, 2, 8), 3.0 / 16);
  EXPECT_DOUBLE_EQ(theoretical_bubble(PipeSchedule::OneFOneB, 4, 1, 8), 3.0 / 8);
}

TEST(PipelinePlan, OneFOneBOrder) {
  // stage 0 of P=4, M=6: 3 warm-up forwards, then alternating, then 3 cool-down backwards
  auto p = build_pipeline_plans(PipeSchedule::OneFOneB, 4, 1, 6, true);
  std::string seq;
  for (const auto& op : p.stages[0].ops)
    if (op.kind == PipeOpKind::Forward || op.kind == PipeOpKind::Backward)
      seq += std::string(pipe_op_name(op.kind)) + std::to_string(op.micro) + " ";
  EXPECT_EQ(seq, "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 ");
  // every message of stage 0 goes to / comes from stage 1
  for (const auto& op : p.stages[0].ops) {
    if (op.peer >= 0) {
      EXPECT_EQ(op.peer, 1);
    }
  }
}

TEST(PipelinePlan, InterleavedChunkOrder) {
  // P=2, V=2, M=4, stage 0 forwards: micro 0,1 chunk 0, micro 0,1 chunk 1, then 2,3 ...
  auto p = build_pipeline_plans(PipeSchedule::Interleaved, 2, 2, 4, true);
  std::vector<std::pair<int, int>> f;
  for (const auto& op : p.stages[0].ops)
    if (op.kind == PipeOpKind::Forward) f.emplace_back(op.chunk, op.micro);
  std::vector<std::pair<int, int>> want = {{0, 0}, {0, 1}, {1, 0}, {1, 1},
                                           {0, 2}, {0, 3}, {1, 2}, {1, 3}};
  EXPECT_EQ(f, want);
  // the last stage's chunk 0 output wraps around to stage 0
  bool wrap = false;
  for (const auto& op : p.stages[1].ops)
    wrap = wrap || (op.kind == PipeOpKind::SendAct && op.chunk == 0 && op.peer == 0);
  EXPECT_TRUE(wrap);
}

TEST(PipelinePartition, UniformListBalanced) {
  const PipeCost flat{0.0, 1.0, 0.0};
  EXPECT_EQ(partition_blocks("uniform", 8, 4, 1, flat), (std::vector<int>{2, 2, 2, 2}));
  EXPECT_EQ(partition_blocks("uniform", 8, 2, 2, flat), (std::vector<int>{2, 2, 2, 2}));
  EXPECT_EQ(partition_blocks("list:1,3,2", 6, 3, 1, flat), (std::vector<int>{1, 3, 2}));
  EXPECT_THROW(partition_blocks("uniform", 7, 2, 1, flat), UserError);
  EXPECT_THROW(partition_blocks("list:1,2", 6, 2, 1, flat), UserError);
  EXPECT_THROW(partition_blocks("list:1,x", 6, 2, 1, flat), UserError);
  EXPECT_THROW(partition_blocks("random", 6, 2, 1, flat), UserError);
  // equal blocks and a divisible depth: balanced is uniform
  const PipeCost vit{0.3, 1.0, 0.05};
  EXPECT_EQ(partition_blocks("balanced", 8, 4, 1, vit), (std::vector<int>{2, 2, 2, 2}));
  // an uneven split: the stage with the embedding (the most expensive end) gets fewer blocks
  EXPECT_EQ(partition_blocks("balanced", 7, 2, 1, vit), (std::vector<int>{3, 4}));
  // the head end heavier instead: the last stage gives the block away
  EXPECT_EQ(partition_blocks("balanced", 7, 2, 1, PipeCost{0.05, 1.0, 0.3}), (std::vector<int>{4, 3}));
  // a very expensive embedding: stage 0 keeps a single block
  EXPECT_EQ(partition_blocks("balanced", 6, 3, 1, PipeCost{2.5, 1.0, 0.0}), (std::vector<int>{1, 2, 3}));
  // every stage keeps at least one block
  auto n = partition_blocks("balanced", 4, 4, 1, PipeCost{10.0, 1.0, 10.0});
  EXPECT_EQ(n, (std::vector<int>{1, 1, 1, 1}));
}

}  // namespace
}  // namespace vitgrid
