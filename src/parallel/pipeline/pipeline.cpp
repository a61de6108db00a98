// Pipeline schedules, stage partition and the point-to-point plan (pipeline.h); the plans' replays
// are in replay.cpp.
//
// Each stage's schedule is a list of compute operations (forward / backward of a chunk and
// micro-batch). We simulate the schedules with unit costs and free communication, which
// proves the orders feasible (a schedule waiting on itself never finishes the simulation) and
// gives the schedule's own bubble. Then the messages are placed, on each stage the sends of a
// compute's output right after it and the receive of a compute's input right before it, one
// of two ways:
//
// - Grouped (first choice): blocking messages, the ones between two computes posted as one
//   group. In 1F1B's steady state neighbouring stages then swap an activation and a gradient
//   in one exchange, as Megatron's send_forward_recv_backward does. NCCL runs a group's
//   messages in lockstep, so a group that sends to and receives from one stage whose partners
//   there are not in one group waits for itself: such groups are split into single messages
//   (split_unmirrored_groups; GPipe's last forward and first backward hung so on 2 H200s).
//   The plan is kept when it replays (check_pipeline_plans) at the schedule's own bubble
//   (plan_bubble): GPipe, 1F1B and interleaved with M = P (and P = 2, M = 1).
// - Async (the fallback: the other interleaved shapes, whose gradients may be consumed long
//   after they are produced, deadlock grouped, and one blocking message at a time idled
//   0.46-0.64 of the step against the schedule's 0.03-0.18 with M > P). Messages are posted asynchronously
//   (Collectives::post_send / post_recv): a send never holds its stage up, and a receive is
//   posted as soon as the buffer it fills is free, which the plan states as the receive's
//   `after` ops (the last compute that used the set, the sends still reading it). Only the
//   compute that needs the data waits for it, so every order runs at its bubble. On the GPU
//   each (channel, direction) has its own stream and NCCL communicator; on the CPU they are
//   MPI Isend / Irecv with a tag per channel. Their receive kernels wait on SMs beside the
//   compute, which cost 1F1B and GPipe 7-9% on 2 x H200: hence the fallback only.
//
// Either way the messages between two ranks (and channel) are sent and received in the same
// order (MPI does not let messages of one pair and tag overtake; NCCL send/recv match in
// order too).
//
// Activation sets ("slots") are assigned while placing: a set is taken when a chunk's input
// arrives (or its forward starts on virtual stage 0) and given back once nothing reads it any
// more: after the backward on virtual stage 0, after its d(input) was sent elsewhere, or in
// forward-only plans once its output was sent. A set a send frees is taken again only after
// the next compute (grouped: a receive of the same group would land in it while it is being
// sent; async: the receive would wait for that send, whose receiver may be waiting to send us
// that very data). The largest number held at once is what the model allocates up front: M
// for GPipe, about P - stage for 1F1B.
#include "vitgrid/parallel/pipeline.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "vitgrid/core/error.h"

namespace vitgrid {

PipeSchedule parse_pipe_schedule(const std::string& s) {
  if (s == "gpipe") return PipeSchedule::GPipe;
  if (s == "1f1b") return PipeSchedule::OneFOneB;
  if (s == "interleaved") return PipeSchedule::Interleaved;
  throw UserError("parallel.schedule: unknown schedule '" + s + "' (gpipe | 1f1b | interleaved)");
}

const char* pipe_schedule_name(PipeSchedule s) {
  switch (s) {
    case PipeSchedule::GPipe: return "gpipe";
    case PipeSchedule::OneFOneB: return "1f1b";
    case PipeSchedule::Interleaved: return "interleaved";
  }
  return "?";
}

bool pipe_op_is_message(PipeOpKind k) {
  return k == PipeOpKind::SendAct || k == PipeOpKind::SendGrad || k == PipeOpKind::RecvAct ||
         k == PipeOpKind::RecvGrad;
}

bool pipe_op_is_send(PipeOpKind k) { return k == PipeOpKind::SendAct || k == PipeOpKind::SendGrad; }

int pipe_op_channel(PipeOpKind k) {
  return k == PipeOpKind::SendGrad || k == PipeOpKind::RecvGrad ? 1 : 0;
}

const char* pipe_op_name(PipeOpKind k) {
  switch (k) {
    case PipeOpKind::Forward: return "F";
    case PipeOpKind::Backward: return "B";
    case PipeOpKind::SendAct: return "send-act";
    case PipeOpKind::RecvAct: return "recv-act";
    case PipeOpKind::SendGrad: return "send-grad";
    case PipeOpKind::RecvGrad: return "recv-grad";
    case PipeOpKind::CopyAct: return "copy-act";
    case PipeOpKind::CopyGrad: return "copy-grad";
  }
  return "?";
}

// ---- partition

std::vector<int> partition_blocks(const std::string& spec, int depth, int P, int V,
                                  const PipeCost& cost) {
  const int S = P * V;
  if (S < 1 || depth < S)
    throw UserError("parallel.pipeline: " + std::to_string(S) +
                    " (virtual) stages need at least as many blocks, model.depth is " +
                    std::to_string(depth));
  std::vector<int> n;
  if (spec == "uniform") {
    if (depth % S != 0)
      throw UserError("model.depth: " + std::to_string(depth) + " blocks do not split evenly over " +
                      std::to_string(S) + " stages (parallel.partition = uniform)");
    n.assign(S, depth / S);
  } else if (spec.rfind("list:", 0) == 0) {
    std::stringstream ss(spec.substr(5));
    std::string item;
    while (std::getline(ss, item, ',')) {
      int v = 0;
      try {
        size_t used = 0;
        v = std::stoi(item, &used);
        if (used != item.size()) v = 0;
      } catch (const std::exception&) {
        v = 0;
      }
      if (v < 1) throw UserError("parallel.partition: entry '" + item + "' is not a positive integer");
      n.push_back(v);
    }
    int sum = 0;
    for (int v : n) sum += v;
    if (static_cast<int>(n.size()) != S || sum != depth)
      throw UserError("parallel.partition: '" + spec + "' must list " + std::to_string(S) +
                      " block counts summing to model.depth (" + std::to_string(depth) + ")");
  } else if (spec == "balanced") {
    // Minimise the most expensive virtual stage over contiguous splits (every stage >= 1
    // block): best[k][j] = cheapest maximum for the first j blocks on the first k stages.
    auto stage_cost = [&](int k, int blocks) {
      return blocks * cost.block + (k == 0 ? cost.embed : 0.0) + (k == S - 1 ? cost.head : 0.0);
    };
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<std::vector<double>> best(S + 1, std::vector<double>(depth + 1, inf));
    std::vector<std::vector<int>> from(S + 1, std::vector<int>(depth + 1, -1));
    best[0][0] = 0.0;
    for (int k = 1; k <= S; ++k)
      for (int j = k; j <= depth - (S - k); ++j)
        for (int i = k - 1; i < j; ++i) {
          if (best[k - 1][i] == inf) continue;
          const double c = std::max(best[k - 1][i], stage_cost(k - 1, j - i));
          // strict improvement only: among equal maxima the first stages keep more blocks,
          // which is uniform whenever uniform is optimal
          if (c < best[k][j] - 1e-12 * std::max(1.0, c)) {
            best[k][j] = c;
            from[k][j] = i;
          }
        }
    n.assign(S, 0);
    for (int k = S, j = depth; k > 0; --k) {
      const int i = from[k][j];
      n[k - 1] = j - i;
      j = i;
    }
  } else {
    throw UserError("parallel.partition: unknown partition '" + spec +
                    "' (uniform | balanced | list:n0,n1,...)");
  }
  return n;
}

double theoretical_bubble(PipeSchedule s, int P, int V, int M) {
  if (s == PipeSchedule::Interleaved) return double(P - 1) / (double(V) * M);
  return double(P - 1) / M;
}

// ---- schedules

namespace {

struct Work {
  bool fwd;
  int chunk, micro;
};

// Forward order of (chunk, micro) pairs on a stage for the interleaved schedule (Megatron):
// micro-batches in groups of P, each group through chunk 0, then chunk 1, ...; backward goes
// through the chunks in reverse.
std::vector<std::pair<int, int>> interleaved_order(int P, int V, int M, bool forward) {
  std::vector<std::pair<int, int>> out;
  for (int g0 = 0; g0 < M; g0 += P)
    for (int ci = 0; ci < V; ++ci) {
      const int c = forward ? ci : V - 1 - ci;
      for (int m = g0; m < std::min(g0 + P, M); ++m) out.emplace_back(c, m);
    }
  return out;
}

// The compute list of stage s. `extra` lengthens the warm-up (see build_pipeline_plans).
std::vector<Work> stage_order(PipeSchedule k, int P, int V, int M, int s, bool train, int extra) {
  std::vector<Work> w;
  if (k != PipeSchedule::Interleaved) V = 1;
  auto fseq = k == PipeSchedule::Interleaved ? interleaved_order(P, V, M, true)
                                             : interleaved_order(1, 1, M, true);
  auto bseq = k == PipeSchedule::Interleaved ? interleaved_order(P, V, M, false)
                                             : interleaved_order(1, 1, M, false);
  const int total = static_cast<int>(fseq.size());
  if (!train) {
    for (auto [c, m] : fseq) w.push_back({true, c, m});
    return w;
  }
  int warm = 0;
  switch (k) {
    case PipeSchedule::GPipe: warm = total; break;
    case PipeSchedule::OneFOneB: warm = P - s - 1; break;
    case PipeSchedule::Interleaved:
      // Megatron: all forwards first when M == P, else 2 per later stage + one group per
      // extra chunk
      warm = M == P ? total : (P - s - 1) * 2 + (V - 1) * P;
      break;
  }
  warm = std::min(warm + extra, total);
  for (int i = 0; i < warm; ++i) w.push_back({true, fseq[i].first, fseq[i].second});
  for (int i = 0; i < total - warm; ++i) {
    w.push_back({true, fseq[warm + i].first, fseq[warm + i].second});
    w.push_back({false, bseq[i].first, bseq[i].second});
  }
  for (int i = total - warm; i < total; ++i) w.push_back({false, bseq[i].first, bseq[i].second});
  return w;
}

// Every message op's partner (stage, op index) when messages between a pair match in order.
std::vector<std::vector<std::pair<int, size_t>>> message_partners(const PipelinePlans& pl) {
  const int P = pl.P;
  std::vector<std::vector<std::pair<int, size_t>>> partner(P);
  std::vector<std::vector<size_t>> sends(P * P), recvs(P * P);
  for (int s = 0; s < P; ++s) {
    const auto& ops = pl.stages[s].ops;
    partner[s].assign(ops.size(), {-1, 0});
    for (size_t i = 0; i < ops.size(); ++i) {
      if (!pipe_op_is_message(ops[i].kind) || ops[i].peer < 0 || ops[i].peer >= P) continue;
      if (pipe_op_is_send(ops[i].kind)) sends[s * P + ops[i].peer].push_back(i);
      else recvs[ops[i].peer * P + s].push_back(i);
    }
  }
  for (int pair = 0; pair < P * P; ++pair)
    for (size_t k = 0; k < std::min(sends[pair].size(), recvs[pair].size()); ++k) {
      const int a = pair / P, b = pair % P;
      partner[a][sends[pair][k]] = {b, recvs[pair][k]};
      partner[b][recvs[pair][k]] = {a, sends[pair][k]};
    }
  return partner;
}

// The group of each op: the index of the message that opens it (local ops: their own index).
std::vector<size_t> group_heads(const PipelinePlan& st) {
  std::vector<size_t> head(st.ops.size());
  for (size_t i = 0; i < st.ops.size(); ++i)
    head[i] = i > 0 && pipe_op_is_message(st.ops[i].kind) && st.ops[i].joins ? head[i - 1] : i;
  return head;
}

// Splits into single messages every group that sends to and receives from one stage whose
// partners there are not in one group, until none is left (a split can unmirror the partner's
// group). In lockstep (MessageReplay::complete) such a group waits for the peer's later group, which
// waits for it: GPipe's last forward and first backward hung so on 2 H200s.
void split_unmirrored_groups(PipelinePlans& pl) {
  for (bool changed = true; changed;) {
    changed = false;
    const auto partner = message_partners(pl);
    std::vector<std::vector<size_t>> head(pl.P);
    for (int s = 0; s < pl.P; ++s) head[s] = group_heads(pl.stages[s]);
    for (int s = 0; s < pl.P; ++s) {
      auto& ops = pl.stages[s].ops;
      for (size_t i = 0; i < ops.size(); ++i) {
        bool bad = false;
        for (size_t j = i + 1; j < ops.size() && head[s][j] == head[s][i] && pipe_op_is_message(ops[i].kind); ++j) {
          if (ops[i].peer != ops[j].peer || pipe_op_is_send(ops[i].kind) == pipe_op_is_send(ops[j].kind)) continue;
          const auto [q, a] = partner[s][i];
          const auto [r, b] = partner[s][j];
          bad = bad || q < 0 || r < 0 || head[q][a] != head[r][b];
        }
        if (!bad) continue;
        for (size_t j = head[s][i]; j < ops.size() && head[s][j] == head[s][i]; ++j) {
          changed = changed || ops[j].joins;
          ops[j].joins = false;
        }
      }
    }
  }
}

// The activation sets of one stage's plan while it is placed: the set each (chunk, micro)
// holds, taken from the free ones (lowest first) or new (num_slots grows).
struct SlotSets {
  PipelinePlan& pl;
  std::map<std::pair<int, int>, int> slot_of;
  std::set<int> free_slots;
  explicit SlotSets(PipelinePlan& p) : pl(p) {}
  int take(int c, int m) {
    int slot;
    if (free_slots.empty()) {
      slot = pl.num_slots++;
    } else {
      slot = *free_slots.begin();
      free_slots.erase(free_slots.begin());
    }
    slot_of[{c, m}] = slot;
    return slot;
  }
  int held(int c, int m) const {
    auto it = slot_of.find({c, m});
    VG_CHECK(it != slot_of.end(), "pipeline plan: no set held for chunk " << c << " micro " << m);
    return it->second;
  }
  void give(int c, int m) {
    free_slots.insert(held(c, m));
    slot_of.erase({c, m});
  }
  bool empty() const { return slot_of.empty(); }
};

// Message placement stage by stage: after each compute the sends of what it produced, before
// each compute the receives of what it needs.
// - Grouped: consecutive messages form one group, posted together (the runner's group_begin /
//   group_end), so in the one-forward-one-backward phase neighbouring stages swap activation
//   and gradient in one exchange (Megatron's send_forward_recv_backward) instead of one
//   waiting for the other's next compute.
// - Async: each receive names the ops it must wait for (pipeline.h: PipeOp::after), and so
//   does a forward or copy that fills a retaken set (the sends still reading it).
void place_messages(PipelinePlans& out, const std::vector<std::vector<Work>>& order, bool train,
                    PipelinePlans::Messages kind) {
  const int P = out.P, S = out.P * out.V;
  const bool async = kind == PipelinePlans::Messages::Async;
  out.stages.assign(P, PipelinePlan{});
  out.messages = kind;
  for (int s = 0; s < P; ++s) {
    PipelinePlan& pl = out.stages[s];
    pl.stage = s;
    auto& ops = pl.ops;
    SlotSets sets(pl);
    // per set: the last compute that used it (-1: none this step) and the sends reading it
    std::vector<int> last_compute;
    std::vector<std::vector<int>> sending;
    int last_backward = -1;  // the last reader of d(output)
    auto take = [&](int c, int m) {
      const int slot = sets.take(c, m);
      if (slot == static_cast<int>(last_compute.size())) {  // a new set
        last_compute.push_back(-1);
        sending.emplace_back();
      }
      return slot;
    };
    auto here = [&] { return static_cast<int>(ops.size()); };
    // async: what a receive into a retaken set waits for; a local fill waits for the sends only
    auto fill_after = [&](int slot, bool receive) {
      std::vector<int> a;
      a.swap(sending[slot]);
      if (receive && last_compute[slot] >= 0) a.push_back(last_compute[slot]);
      std::sort(a.begin(), a.end());
      return async ? a : std::vector<int>{};
    };
    // grouped: a message joins the group of the message right before it
    auto joins = [&] { return !async && !ops.empty() && pipe_op_is_message(ops.back().kind); };
    // A set a send frees is given back only after the next compute. Grouped: the receives
    // posted in the same group would land in it while it is still being sent. Async: the
    // receive placed before that compute would wait for this send, whose own receiver may be
    // waiting to send us that very data (one set on two stages: a cycle).
    std::vector<std::pair<int, int>> sent;
    auto give_sent = [&] {
      for (auto [c, m] : sent) sets.give(c, m);
      sent.clear();
    };
    auto send = [&](PipeOpKind k, int c, int m, int slot, int peer, bool frees) {
      sending[slot].push_back(here());
      ops.push_back({k, c, m, slot, peer, -1, frees});
      if (frees) sent.emplace_back(c, m);
    };
    for (const Work& w : order[s]) {
      const int c = w.chunk, m = w.micro, v = c * P + s;
      if (w.fwd) {
        int slot;
        std::vector<int> wait;
        if (v > 0 && (v - 1) % P != s) {
          slot = take(c, m);
          ops.push_back({PipeOpKind::RecvAct, c, m, slot, (v - 1) % P, -1, false, joins(),
                         fill_after(slot, true)});
        } else if (v > 0) {
          const int src = sets.held(c - 1, m);
          slot = take(c, m);
          ops.push_back({PipeOpKind::CopyAct, c, m, slot, -1, src, !train, false, fill_after(slot, false)});
          last_compute[src] = here() - 1;
          if (!train) sets.give(c - 1, m);
        } else {
          slot = take(c, m);
          wait = fill_after(slot, false);
        }
        const bool last = v == S - 1;
        give_sent();
        ops.push_back({PipeOpKind::Forward, c, m, slot, -1, -1, !train && last, false, wait});
        last_compute[slot] = here() - 1;
        if (!train && last) sets.give(c, m);
        if (!last && (v + 1) % P != s) send(PipeOpKind::SendAct, c, m, slot, (v + 1) % P, !train);
      } else {
        const int slot = sets.held(c, m);
        if (v < S - 1 && (v + 1) % P != s) {
          std::vector<int> a;
          if (async && last_backward >= 0) a.push_back(last_backward);
          ops.push_back({PipeOpKind::RecvGrad, c, m, slot, (v + 1) % P, -1, false, joins(), a});
        } else if (v < S - 1) {
          const int src = sets.held(c + 1, m);
          ops.push_back({PipeOpKind::CopyGrad, c, m, slot, -1, src, true});
          last_compute[src] = here() - 1;
          sets.give(c + 1, m);
        }
        give_sent();
        ops.push_back({PipeOpKind::Backward, c, m, slot, -1, -1, v == 0});
        last_compute[slot] = last_backward = here() - 1;
        if (v == 0) {
          sets.give(c, m);
        } else if ((v - 1) % P != s) {
          send(PipeOpKind::SendGrad, c, m, slot, (v - 1) % P, true);
        }
      }
    }
    give_sent();
    VG_CHECK(sets.empty(), "pipeline plan: stage " << s << " ends holding sets");
  }
}

}  // namespace

PipelinePlans build_pipeline_plans(PipeSchedule k, int P, int V, int M, bool train) {
  VG_CHECK(P >= 1 && V >= 1 && M >= 1, "pipeline plan for P " << P << " V " << V << " M " << M);
  VG_CHECK(V == 1 || k == PipeSchedule::Interleaved, "model chunks without the interleaved schedule");
  const int S = P * V;
  const double cf = 1.0, cb = 2.0;
  PipelinePlans out;
  out.schedule = k;
  out.P = P;
  out.V = V;
  out.M = M;
  out.train = train;

  // 1. Simulate (unit costs, free communication); grow the warm-up until the orders are
  //    feasible (all forwards first always is).
  std::vector<std::vector<Work>> order(P);
  double makespan = 0.0;
  for (int extra = 0;; ++extra) {
    for (int s = 0; s < P; ++s) order[s] = stage_order(k, P, V, M, s, train, extra);
    std::vector<std::vector<double>> endF(S, std::vector<double>(M, -1.0)), endB = endF;
    std::vector<size_t> next(P, 0);
    std::vector<double> free_at(P, 0.0);
    bool progress = true;
    size_t done = 0, all = 0;
    for (auto& o : order) all += o.size();
    while (progress) {
      progress = false;
      for (int s = 0; s < P; ++s) {
        while (next[s] < order[s].size()) {
          const Work& w = order[s][next[s]];
          const int v = w.chunk * P + s;
          double dep = 0.0;
          if (w.fwd) {
            if (v > 0) dep = endF[v - 1][w.micro];
          } else {
            dep = endF[v][w.micro];
            if (v < S - 1) {
              const double g = endB[v + 1][w.micro];
              dep = (dep < 0.0 || g < 0.0) ? -1.0 : std::max(dep, g);
            }
          }
          if (dep < 0.0) break;
          const double t0 = std::max(free_at[s], dep);
          free_at[s] = t0 + (w.fwd ? cf : cb);
          (w.fwd ? endF : endB)[v][w.micro] = free_at[s];
          ++next[s];
          ++done;
          progress = true;
        }
      }
    }
    if (done == all) {
      makespan = *std::max_element(free_at.begin(), free_at.end());
      double idle = 0.0;
      for (int s = 0; s < P; ++s) {
        double busy = 0.0;
        for (const Work& w : order[s]) busy += w.fwd ? cf : cb;
        idle += (makespan - busy) / makespan;
      }
      out.simulated_bubble = idle / P;
      break;
    }
    if (extra > 2 * S * M)
      throw UserError("parallel.micro_batches: the " + std::string(pipe_schedule_name(k)) +
                      " schedule cannot run " + std::to_string(M) + " micro-batches on " +
                      std::to_string(P) + " stages x " + std::to_string(V) + " chunks");
  }

  // 2. Place the messages: grouped where that replays at the schedule's bubble, else
  //    asynchronous, which replays for every feasible order (the tests check many shapes; a
  //    failure there is a bug in this file).
  place_messages(out, order, train, PipelinePlans::Messages::Grouped);
  split_unmirrored_groups(out);
  if (check_pipeline_plans(out).empty() && plan_bubble(out, cf, cb) <= out.simulated_bubble + 1e-9)
    return out;
  place_messages(out, order, train, PipelinePlans::Messages::Async);
  const std::string bad = check_pipeline_plans(out);
  VG_CHECK(bad.empty(), "pipeline plan (" << pipe_schedule_name(k) << ", P " << P << ", V " << V
                                           << ", M " << M << "): " << bad);
  return out;
}

}  // namespace vitgrid
