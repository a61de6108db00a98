// Pipeline plans (no MPI traffic): every schedule on many shapes replays to the end under
// its messages' semantics (grouped blocking send/recv, or asynchronous messages where the
// grouped placement cannot run the order), runs at its schedule's bubble, holds the activation
// sets the schedule promises, and the partitions follow the deck.
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
        // more whose input gradient is still on its way to the previous stage (the grouped
        // exchange sends it while the next input arrives)
        EXPECT_LE(f.stages[s].num_slots, std::min(M, P - s) + 1)
            << "1f1b P=" << P << " M=" << M << " stage " << s;
        // ... never more than the first stage, which sets the job's peak
        EXPECT_LE(f.stages[s].num_slots, f.stages[0].num_slots) << "1f1b stage " << s;
      }
      // the last stage runs forward then backward at once: one set, and one arriving while
      // the previous one's input gradient leaves
      EXPECT_EQ(f.stages[P - 1].num_slots, 2);
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

TEST(PipelinePlan, PlacementRunsAtTheScheduleBubble) {
  // Sends right after the producing compute, receives right before the consuming one: grouped
  // (posted together, blocking) where that replays at the schedule's bubble, else
  // asynchronous (receives posted as soon as their set is free). Either way every schedule
  // idles exactly as with free communication. One blocking message at a time, 1F1B idled
  // about twice that (P = 4, M = 8: 0.51 of the step against 0.27, what the GPUs measured),
  // and interleaved shapes with M > P 0.46-0.64 against 0.03-0.18.
  // (Interleaved with M = P: grouped.)
  using Msg = PipelinePlans::Messages;
  for (int P : {2, 3, 4, 8})
    for (int M : {1, 2, 3, 4, 5, 8, 16})
      for (PipeSchedule k : {PipeSchedule::GPipe, PipeSchedule::OneFOneB, PipeSchedule::Interleaved})
        for (int V : {1, 2, 3, 4}) {
          if ((V > 1) != (k == PipeSchedule::Interleaved)) continue;
          for (bool train : {true, false}) {
            auto p = build_pipeline_plans(k, P, V, M, train);
            const std::string what = name({k, P, V, M}) + (train ? " train" : " eval");
            if (train) {
              EXPECT_NEAR(plan_bubble(p), p.simulated_bubble, 1e-12) << what;
            } else {
              EXPECT_GE(plan_bubble(p), 0.0) << what;
            }
            // GPipe and 1F1B always grouped (their receives never wait beside the compute
            // on a GPU); interleaved training with M != P cannot be (its gradients wait long
            // for their consumer; P = 2, M = 1 aside): asynchronous
            if (k != PipeSchedule::Interleaved) {
              EXPECT_EQ(p.messages, Msg::Grouped) << what;
            } else if (train && M != P && !(P == 2 && M == 1)) {
              EXPECT_EQ(p.messages, Msg::Async) << what;
            }
          }
        }
  EXPECT_NEAR(plan_bubble(build_pipeline_plans(PipeSchedule::OneFOneB, 4, 1, 8, true)), 3.0 / 11, 1e-12);
  // 1F1B's exchanges are grouped (GPipe's messages mostly stay single: a group there would
  // tie a send to a receive that waits for it)
  for (int P : {2, 3, 4, 8})
    for (int M : {2, 4, 8}) {
      size_t joined = 0;
      for (const auto& st : build_pipeline_plans(PipeSchedule::OneFOneB, P, 1, M, true).stages)
        for (const auto& op : st.ops) joined += op.joins;
      EXPECT_GT(joined, 0u) << "1f1b P=" << P << " M=" << M;
    }
  // interleaved below 1F1B whenever M is a multiple of P (V = 2: P = 4, M = 8: 0.158 against
  // 0.273)
  for (int P : {2, 4, 8})
    for (int M : {P, 2 * P, 4 * P})
      EXPECT_LT(plan_bubble(build_pipeline_plans(PipeSchedule::Interleaved, P, 2, M, true)),
                plan_bubble(build_pipeline_plans(PipeSchedule::OneFOneB, P, 1, M, true)))
          << "P=" << P << " M=" << M;
}

TEST(PipelinePlan, PlanBubbleSeesDeadlocksAndGroups) {
  // two stages that each send before receiving: one message at a time a deadlock (-1), as one
  // group per stage a swap
  PipelinePlans p;
  p.P = 2;
  p.M = 1;
  p.stages.resize(2);
  for (int s = 0; s < 2; ++s) {
    p.stages[s].stage = s;
    p.stages[s].num_slots = 1;
    p.stages[s].ops = {{PipeOpKind::Forward, 0, 0, 0},
                       {PipeOpKind::SendAct, 0, 0, 0, 1 - s},
                       {PipeOpKind::RecvAct, 0, 0, 0, 1 - s},
                       {PipeOpKind::Forward, 0, 0, 0}};
  }
  ASSERT_EQ(p.messages, PipelinePlans::Messages::Grouped);
  EXPECT_EQ(plan_bubble(p), -1.0);
  for (auto& st : p.stages) st.ops[2].joins = true;
  EXPECT_EQ(plan_bubble(p), 0.0);
  // a backward (2 units) first on stage 1: stage 0 waits for it in its group, idle 2 of the
  // 4-unit step, stage 1 never
  p.stages[1].ops.insert(p.stages[1].ops.begin(), {PipeOpKind::Backward, 0, 0, 0});
  EXPECT_NEAR(plan_bubble(p), (2.0 / 4 + 0.0) / 2, 1e-12);
}

TEST(PipelinePlan, LockstepGroupsThatWaitOnEachOtherDeadlock) {
  // GPipe on 2 stages with stage 0's last send and first receive in one group: NCCL runs them
  // in lockstep, so the send never finishes while the receive waits for the gradient that
  // stage 1 computes only after it has the activation. That hung on 2 H200s; the checker and
  // the timing see it, and the builder keeps such messages apart.
  auto p = build_pipeline_plans(PipeSchedule::GPipe, 2, 1, 4, true);
  EXPECT_EQ(check_pipeline_plans(p), "");
  auto& ops = p.stages[0].ops;
  size_t joined = 0;
  for (size_t i = 1; i < ops.size(); ++i)
    if (ops[i].kind == PipeOpKind::RecvGrad && ops[i - 1].kind == PipeOpKind::SendAct) {
      ops[i].joins = true;
      ++joined;
    }
  ASSERT_EQ(joined, 1u);
  ASSERT_EQ(p.messages, PipelinePlans::Messages::Grouped);
  EXPECT_NE(check_pipeline_plans(p).find("deadlock"), std::string::npos) << check_pipeline_plans(p);
  EXPECT_EQ(plan_bubble(p), -1.0);
  // 1F1B's steady-state groups are mirrored on the neighbour (an exchange), which completes
  for (int P : {2, 3, 4})
    for (const auto& st : build_pipeline_plans(PipeSchedule::OneFOneB, P, 1, 8, true).stages) {
      size_t groups = 0;
      for (const auto& op : st.ops) groups += op.joins;
      EXPECT_GT(groups, 0u) << "P=" << P << " stage " << st.stage;
    }
}

// Empty asynchronous forward-only plans of 2 stages x 2 chunks for M micro-batches.
PipelinePlans async_forward_plans(int M) {
  PipelinePlans p;
  p.messages = PipelinePlans::Messages::Async;
  p.P = 2;
  p.V = 2;
  p.M = M;
  p.train = false;
  p.stages.resize(2);
  return p;
}

// Two stages exchanging one activation each way, asynchronously.
PipelinePlans swap_plans() {
  PipelinePlans p = async_forward_plans(1);
  for (int s = 0; s < 2; ++s) {
    p.stages[s].stage = s;
    p.stages[s].num_slots = 2;
  }
  // stage 0: chunk 0 (virtual stage 0) -> stage 1 chunk 0 (1) -> stage 0 chunk 1 (2) ->
  // stage 1 chunk 1 (3)
  p.stages[0].ops = {{PipeOpKind::Forward, 0, 0, 0},
                     {PipeOpKind::SendAct, 0, 0, 0, 1, -1, true},
                     {PipeOpKind::RecvAct, 1, 0, 1, 1},
                     {PipeOpKind::Forward, 1, 0, 1},
                     {PipeOpKind::SendAct, 1, 0, 1, 1, -1, true}};
  p.stages[1].ops = {{PipeOpKind::RecvAct, 0, 0, 0, 0},
                     {PipeOpKind::Forward, 0, 0, 0},
                     {PipeOpKind::SendAct, 0, 0, 0, 0, -1, true},
                     {PipeOpKind::RecvAct, 1, 0, 1, 0},
                     {PipeOpKind::Forward, 1, 0, 1, -1, -1, true}};
  return p;
}

TEST(PipelinePlan, AsyncReplaySeesDeadlocksOrderAndBufferHazards) {
  PipelinePlans p = swap_plans();
  EXPECT_EQ(check_pipeline_plans(p), "");
  EXPECT_GE(plan_bubble(p), 0.0);
  // stage 1 sends before it receives from the same peer: asynchronous sends never block
  // (blocking rendezvous sends on both sides deadlocked here)
  std::swap(p.stages[1].ops[2], p.stages[1].ops[3]);
  p.stages[1].ops[2].after = {};
  EXPECT_NE(check_pipeline_plans(p), "");  // ... but the receive now fills the set in use
  // Interleaved forward (P = 2, V = 2, M = 2) with one set per stage, each receive
  // waiting for the sends still reading that set: stage 0's receive of (1, 0) waits for its
  // send of (0, 1), which finishes only when stage 1 posts that receive, which waits for
  // stage 1's send of (0, 0), which finishes only when stage 0's receive of (1, 0) is posted.
  // (The builder gives a set a send frees back only after the next compute: two sets.)
  using K = PipeOpKind;
  PipelinePlans d = async_forward_plans(2);
  d.stages[0] = {0, {{K::Forward, 0, 0, 0}, {K::SendAct, 0, 0, 0, 1, -1, true},
                     {K::Forward, 0, 1, 0, -1, -1, false, false, {1}}, {K::SendAct, 0, 1, 0, 1, -1, true},
                     {K::RecvAct, 1, 0, 0, 1, -1, false, false, {2, 3}}, {K::Forward, 1, 0, 0},
                     {K::SendAct, 1, 0, 0, 1, -1, true}, {K::RecvAct, 1, 1, 0, 1, -1, false, false, {5, 6}},
                     {K::Forward, 1, 1, 0}, {K::SendAct, 1, 1, 0, 1, -1, true}}, 1};
  d.stages[1] = {1, {{K::RecvAct, 0, 0, 0, 0}, {K::Forward, 0, 0, 0},
                     {K::SendAct, 0, 0, 0, 0, -1, true}, {K::RecvAct, 0, 1, 0, 0, -1, false, false, {1, 2}},
                     {K::Forward, 0, 1, 0}, {K::SendAct, 0, 1, 0, 0, -1, true},
                     {K::RecvAct, 1, 0, 0, 0, -1, false, false, {4, 5}}, {K::Forward, 1, 0, 0, -1, -1, true},
                     {K::RecvAct, 1, 1, 0, 0, -1, false, false, {7}}, {K::Forward, 1, 1, 0, -1, -1, true}}, 1};
  EXPECT_NE(check_pipeline_plans(d).find("deadlock"), std::string::npos) << check_pipeline_plans(d);
  EXPECT_EQ(plan_bubble(d), -1.0);
  // without the send in `after` the receive could overwrite the set while it is being sent
  d.stages[0].ops[4].after = {2};
  EXPECT_NE(check_pipeline_plans(d).find("fills a set before"), std::string::npos) << check_pipeline_plans(d);
  // the builder's own plan for this shape runs
  EXPECT_EQ(check_pipeline_plans(build_pipeline_plans(PipeSchedule::Interleaved, 2, 2, 2, false)), "");
  // two messages of one channel received in the other order: matched wrongly
  PipelinePlans g = build_pipeline_plans(PipeSchedule::Interleaved, 2, 2, 4, true);
  ASSERT_EQ(g.messages, PipelinePlans::Messages::Async);
  auto& ops1 = g.stages[1].ops;
  std::vector<size_t> recvs;
  for (size_t i = 0; i < ops1.size(); ++i)
    if (ops1[i].kind == PipeOpKind::RecvAct) recvs.push_back(i);
  ASSERT_GE(recvs.size(), 2u);
  std::swap(ops1[recvs[0]].micro, ops1[recvs[1]].micro);
  EXPECT_NE(check_pipeline_plans(g), "");
}

TEST(PipelinePlan, AsyncReceivesWaitForWhatUsedTheirBuffer) {
  // every receive of every asynchronous plan names, in `after`, the compute that last used
  // its buffer and the sends still reading it (the checker enforces it; here: some plans do
  // need them)
  size_t with_send = 0, with_compute = 0, async = 0;
  for (const Shape& s : shapes()) {
    const PipelinePlans p = build_pipeline_plans(s.k, s.P, s.V, s.M, true);
    if (p.messages != PipelinePlans::Messages::Async) continue;
    ++async;
    for (const auto& st : p.stages)
      for (const auto& op : st.ops)
        for (int a : op.after) {
          with_send += pipe_op_is_message(st.ops[a].kind);
          with_compute += !pipe_op_is_message(st.ops[a].kind);
        }
  }
  EXPECT_GT(async, 0u);
  EXPECT_GT(with_send, 0u);
  EXPECT_GT(with_compute, 0u);
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
