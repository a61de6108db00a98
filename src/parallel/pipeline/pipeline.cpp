// Pipeline schedules, stage partition and the point-to-point plan (pipeline.h).
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

bool is_send(PipeOpKind k) { return k == PipeOpKind::SendAct || k == PipeOpKind::SendGrad; }

// "stage s op i (kind chunk c micro m): what", for the replays' findings.
std::string op_problem(const PipelinePlans& plans, int s, size_t i, const std::string& what) {
  const PipeOp& op = plans.stages[s].ops[i];
  std::ostringstream e;
  e << "stage " << s << " op " << i << " (" << pipe_op_name(op.kind) << " chunk " << op.chunk
    << " micro " << op.micro << "): " << what;
  return e.str();
}

// The message side of a plan's replay, shared by check_pipeline_plans and plan_bubble: each
// stage's position and open group, the posted messages of each directed pair in order, and
// which messages matched.
struct MessageReplay {
  const PipelinePlans& plans;
  const int P;
  std::vector<size_t> pc, group_end;
  std::vector<bool> in_group;
  std::vector<std::vector<size_t>> sends, recvs;  // per pair (from * P + to): op indices
  std::vector<size_t> sh, rh;                     // their unmatched heads
  std::vector<std::vector<std::pair<int, size_t>>> partner;  // matched (stage, op), or -1

  explicit MessageReplay(const PipelinePlans& p)
      : plans(p), P(p.P), pc(P, 0), group_end(P, 0), in_group(P, false), sends(P * P),
        recvs(P * P), sh(P * P, 0), rh(P * P, 0), partner(P) {
    for (int s = 0; s < P; ++s) partner[s].assign(plans.stages[s].ops.size(), {-1, 0});
  }

  // Posts the group that opens at stage s's pc (a message and those joining it). Returns the
  // index of a message with a bad peer, or -1.
  long post(int s) {
    const auto& ops = plans.stages[s].ops;
    size_t e = pc[s];
    for (; e < ops.size() && pipe_op_is_message(ops[e].kind) && (e == pc[s] || ops[e].joins); ++e) {
      const int q = ops[e].peer;
      if (q < 0 || q >= P || q == s) return static_cast<long>(e);
      if (is_send(ops[e].kind)) sends[s * P + q].push_back(e);
      else recvs[q * P + s].push_back(e);
    }
    group_end[s] = e;
    in_group[s] = true;
    return -1;
  }

  // Matches the posted messages of each pair in order; on_match(s, si, q, ri) (sender, receiver)
  // returns "" or what is wrong, and the first such answer is returned.
  template <class F>
  std::string match(F&& on_match, bool& progress) {
    for (int pair = 0; pair < P * P; ++pair)
      while (sh[pair] < sends[pair].size() && rh[pair] < recvs[pair].size()) {
        const int s = pair / P, q = pair % P;
        const size_t si = sends[pair][sh[pair]++], ri = recvs[pair][rh[pair]++];
        if (std::string e = on_match(s, si, q, ri); !e.empty()) return e;
        partner[s][si] = {q, ri};
        partner[q][ri] = {s, si};
        progress = true;
      }
    return "";
  }

  // Completes every open group whose lockstep component is matched: NCCL runs a group's
  // messages in lockstep (a send's next piece waits for the receive beside it), so a message
  // completes only with every group it is tied to, directly or through others. on_done gets
  // the component's stages (their groups still open) before they move past them.
  template <class F>
  void complete(F&& on_done, bool& progress) {
    for (int s = 0; s < P; ++s) {
      if (!in_group[s]) continue;
      const std::vector<int> comp = component(s);
      if (comp.empty()) continue;
      on_done(comp);
      for (int t : comp) {
        pc[t] = group_end[t];
        in_group[t] = false;
      }
      progress = true;
    }
  }

  std::string fail_at(int s, size_t i, const std::string& what) const {
    return op_problem(plans, s, i, what);
  }

  // Runs the replay: each stage runs its computes (on_compute(s, op) returns "" or what is
  // wrong; the stage then moves past the op) up to its next group and posts it; the posted
  // messages match and groups complete as above (on_match, on_done). Returns "" when every
  // stage reached its end, else the first problem (a bad peer, a deadlock, or a callback's).
  template <class C, class Mt, class D>
  std::string run(C&& on_compute, Mt&& on_match, D&& on_done) {
    bool progress = true;
    while (progress) {
      progress = false;
      for (int s = 0; s < P; ++s) {
        const auto& ops = plans.stages[s].ops;
        while (!in_group[s] && pc[s] < ops.size()) {
          if (pipe_op_is_message(ops[pc[s]].kind)) {
            if (const long bad = post(s); bad >= 0)
              return fail_at(s, static_cast<size_t>(bad), "bad peer");
            progress = true;
            break;
          }
          if (std::string e = on_compute(s, ops[pc[s]]); !e.empty()) return e;
          ++pc[s];
          progress = true;
        }
      }
      if (std::string e = match(on_match, progress); !e.empty()) return e;
      complete(on_done, progress);
    }
    for (int s = 0; s < P; ++s)
      if (pc[s] < plans.stages[s].ops.size()) return "deadlock: " + fail_at(s, pc[s], "blocked");
    return "";
  }

  // The stages whose open groups are tied to stage s's by matched messages, s's first; empty
  // while some message of them is not matched yet.
  std::vector<int> component(int s) const {
    std::vector<int> comp{s};
    std::vector<char> seen(P, 0);
    seen[s] = 1;
    for (size_t k = 0; k < comp.size(); ++k) {
      const int t = comp[k];
      for (size_t i = pc[t]; i < group_end[t]; ++i) {
        const auto [q, j] = partner[t][i];
        if (q < 0 || !in_group[q] || j < pc[q] || j >= group_end[q]) return {};
        if (!seen[q]) {
          seen[q] = 1;
          comp.push_back(q);
        }
      }
    }
    return comp;
  }
};

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
      if (is_send(ops[i].kind)) sends[s * P + ops[i].peer].push_back(i);
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
          if (ops[i].peer != ops[j].peer || is_send(ops[i].kind) == is_send(ops[j].kind)) continue;
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

// ---- replay

namespace {

// The grouped plans' replay: blocking rendezvous messages, groups in lockstep.
std::string check_grouped(const PipelinePlans& plans) {
  const int P = plans.P, V = plans.V, M = plans.M, S = P * V;
  if (static_cast<int>(plans.stages.size()) != P) return "wrong number of stage plans";
  MessageReplay r(plans);
  const std::vector<size_t>& pc = r.pc;
  // slot owner: virtual stage * M + micro, or -1
  std::vector<std::vector<int>> owner(P);
  for (int s = 0; s < P; ++s) owner[s].assign(plans.stages[s].num_slots, -1);
  std::vector<std::vector<int>> fdone(S, std::vector<int>(M, 0)), bdone = fdone;
  auto key = [&](int s, int c, int m) { return (c * P + s) * M + m; };
  auto fail_at = [&](int s, size_t i, const std::string& what) { return r.fail_at(s, i, what); };
  auto slot_ok = [&](int s, int slot) {
    return slot >= 0 && slot < static_cast<int>(owner[s].size());
  };
  // the computes, in each stage's program order
  auto compute = [&](int s, const PipeOp& op) -> std::string {
    const int v = op.chunk * P + s;
    const int k = key(s, op.chunk, op.micro);
    if (!slot_ok(s, op.slot)) return fail_at(s, pc[s], "set out of range");
    switch (op.kind) {
      case PipeOpKind::Forward:
        if (v == 0) {
          if (owner[s][op.slot] != -1) return fail_at(s, pc[s], "starts in a set in use");
          owner[s][op.slot] = k;
        }
        if (owner[s][op.slot] != k) return fail_at(s, pc[s], "runs without its input");
        fdone[v][op.micro] = 1;
        break;
      case PipeOpKind::Backward:
        if (owner[s][op.slot] != k) return fail_at(s, pc[s], "runs on a set it does not hold");
        if (!fdone[v][op.micro]) return fail_at(s, pc[s], "backward before forward");
        if (v < S - 1 && !bdone[v + 1][op.micro]) return fail_at(s, pc[s], "backward before its gradient");
        bdone[v][op.micro] = 1;
        break;
      case PipeOpKind::CopyAct:
      case PipeOpKind::CopyGrad: {
        const bool act = op.kind == PipeOpKind::CopyAct;
        const int sv = act ? v - 1 : v + 1;
        if (!slot_ok(s, op.src_slot) || sv < 0 || sv >= S || sv % P != s ||
            owner[s][op.src_slot] != sv * M + op.micro)
          return fail_at(s, pc[s], "copies from a set it does not hold");
        if (act ? !fdone[sv][op.micro] : !bdone[sv][op.micro]) return fail_at(s, pc[s], "copies before computing");
        if (act) {
          if (owner[s][op.slot] != -1) return fail_at(s, pc[s], "copies into a set in use");
          owner[s][op.slot] = k;
        }
        if (op.frees) owner[s][op.src_slot] = -1;
        return "";
      }
      default: break;
    }
    if (op.frees) owner[s][op.slot] = -1;
    return "";
  };
  // the posted messages of each pair in order: the receiver must expect exactly this message
  auto matched = [&](int s, size_t si, int q, size_t ri) -> std::string {
    const PipeOp& op = plans.stages[s].ops[si];
    const PipeOp& rv_op = plans.stages[q].ops[ri];
    const int v = op.chunk * P + s;
    const bool act = op.kind == PipeOpKind::SendAct;
    const int rv = rv_op.chunk * P + q;
    if (rv_op.kind != (act ? PipeOpKind::RecvAct : PipeOpKind::RecvGrad) ||
        rv_op.micro != op.micro || rv != (act ? v + 1 : v - 1))
      return fail_at(s, si, "matched by a receive of another message on stage " + std::to_string(q));
    if (!slot_ok(s, op.slot) || owner[s][op.slot] != key(s, op.chunk, op.micro))
      return fail_at(s, si, "sends from a set it does not hold");
    if (act ? !fdone[v][op.micro] : !bdone[v][op.micro]) return fail_at(s, si, "sends before computing");
    if (!slot_ok(q, rv_op.slot)) return fail_at(s, si, "receiver's set out of range");
    if (act) {
      if (owner[q][rv_op.slot] != -1) return fail_at(q, ri, "receives into a set in use");
      owner[q][rv_op.slot] = key(q, rv_op.chunk, rv_op.micro);
    } else if (owner[q][rv_op.slot] != key(q, rv_op.chunk, rv_op.micro)) {
      return fail_at(q, ri, "receives a gradient for a set it does not hold");
    }
    return "";
  };
  // groups complete together with every group tied to them; the sets their sends free are
  // free from then
  auto done = [&](const std::vector<int>& comp) {
    for (int t : comp)
      for (size_t i = pc[t]; i < r.group_end[t]; ++i) {
        const PipeOp& op = plans.stages[t].ops[i];
        if (is_send(op.kind) && op.frees) owner[t][op.slot] = -1;
      }
  };
  if (std::string bad = r.run(compute, matched, done); !bad.empty()) return bad;
  for (int v = 0; v < S; ++v)
    for (int m = 0; m < M; ++m) {
      if (!fdone[v][m]) return "forward of virtual stage " + std::to_string(v) + " micro " + std::to_string(m) + " never ran";
      if (plans.train && !bdone[v][m])
        return "backward of virtual stage " + std::to_string(v) + " micro " + std::to_string(m) + " never ran";
    }
  for (int s = 0; s < P; ++s)
    for (int o : owner[s])
      if (o != -1) return "stage " + std::to_string(s) + " ends holding a set";
  return "";
}

double bubble_grouped(const PipelinePlans& plans, double cf, double cb) {
  const int P = plans.P;
  MessageReplay r(plans);
  std::vector<double> t(P, 0.0), busy(P, 0.0);
  auto compute = [&](int s, const PipeOp& op) {
    const double c = op.kind == PipeOpKind::Forward ? cf : op.kind == PipeOpKind::Backward ? cb : 0.0;
    t[s] += c;
    busy[s] += c;
    return std::string();
  };
  // a group completes with every group tied to it, once the last of them was posted
  auto done = [&](const std::vector<int>& comp) {
    double when = 0.0;
    for (int q : comp) when = std::max(when, t[q]);
    for (int q : comp) t[q] = when;
  };
  if (!r.run(compute, [](int, size_t, int, size_t) { return std::string(); }, done).empty())
    return -1.0;
  const double makespan = *std::max_element(t.begin(), t.end());
  if (makespan <= 0.0) return 0.0;
  double idle = 0.0;
  for (int s = 0; s < P; ++s) idle += (makespan - busy[s]) / makespan;
  return idle / P;
}


// The asynchronous plans' replay: the local checks in each stage's program order, the
// matching of each channel's messages in order, and the times under the asynchronous
// semantics (pipeline.h). `err` gets the first problem; the return is the bubble, or -1.
double replay_async(const PipelinePlans& plans, double cf, double cb, std::string* err) {
  const int P = plans.P, V = plans.V, M = plans.M, S = P * V;
  auto fail = [&](int s, size_t i, const std::string& what) {
    if (err) *err = op_problem(plans, s, i, what);
    return -1.0;
  };
  auto fail_msg = [&](const std::string& what) {
    if (err) *err = what;
    return -1.0;
  };
  if (static_cast<int>(plans.stages.size()) != P) return fail_msg("wrong number of stage plans");

  // 1. Program order, stage by stage: sets held and freed, computes in a valid order, and
  //    every `after` an earlier op.
  std::vector<std::vector<int>> fdone(S, std::vector<int>(M, 0)), bdone = fdone;
  for (int s = 0; s < P; ++s) {
    const auto& ops = plans.stages[s].ops;
    std::vector<int> owner(plans.stages[s].num_slots, -1);  // virtual stage * M + micro
    // per set: the last compute that used it and the sends reading it since it was filled;
    // a receive into it must wait for both (a fence after a compute covers the ones before),
    // a local fill for the sends
    std::vector<int> last_use(owner.size(), -1);
    std::vector<std::vector<int>> reading(owner.size());
    int last_backward = -1;
    auto slot_ok = [&](int slot) { return slot >= 0 && slot < static_cast<int>(owner.size()); };
    auto covers = [&](const PipeOp& op, int slot, bool compute) {
      for (int x : reading[slot])
        if (std::find(op.after.begin(), op.after.end(), x) == op.after.end()) return false;
      if (!compute || last_use[slot] < 0) return true;
      for (int x : op.after)
        if (x >= last_use[slot] && !pipe_op_is_message(ops[x].kind)) return true;
      return false;
    };
    for (size_t i = 0; i < ops.size(); ++i) {
      const PipeOp& op = ops[i];
      const int v = op.chunk * P + s, k = v * M + op.micro;
      if (op.chunk < 0 || op.chunk >= V || op.micro < 0 || op.micro >= M) return fail(s, i, "out of range");
      for (int a : op.after)
        if (a < 0 || static_cast<size_t>(a) >= i) return fail(s, i, "waits for an op that is not earlier");
      if (!slot_ok(op.slot)) return fail(s, i, "set out of range");
      const bool fills = op.kind == PipeOpKind::RecvAct || op.kind == PipeOpKind::CopyAct ||
                         (op.kind == PipeOpKind::Forward && v == 0);
      if (fills) {
        if (!covers(op, op.slot, op.kind == PipeOpKind::RecvAct))
          return fail(s, i, "fills a set before the ops that used it are done (after)");
        reading[op.slot].clear();
      }
      if (op.kind == PipeOpKind::RecvGrad) {
        bool ok = last_backward < 0;
        for (int x : op.after) ok = ok || x >= last_backward;
        if (!ok) return fail(s, i, "receives d(output) before the last backward is done with it (after)");
      }
      if (op.kind == PipeOpKind::SendAct || op.kind == PipeOpKind::SendGrad) reading[op.slot].push_back(static_cast<int>(i));
      if (!pipe_op_is_message(op.kind)) {
        last_use[op.slot] = static_cast<int>(i);
        if (op.src_slot >= 0 && slot_ok(op.src_slot)) last_use[op.src_slot] = static_cast<int>(i);
      }
      if (op.kind == PipeOpKind::Backward) last_backward = static_cast<int>(i);
      if (pipe_op_is_message(op.kind) && (op.peer < 0 || op.peer >= P || op.peer == s))
        return fail(s, i, "bad peer");
      switch (op.kind) {
        case PipeOpKind::Forward:
          if (v == 0) {
            if (owner[op.slot] != -1) return fail(s, i, "starts in a set in use");
            owner[op.slot] = k;
          }
          if (owner[op.slot] != k) return fail(s, i, "runs without its input");
          fdone[v][op.micro] = 1;
          break;
        case PipeOpKind::Backward:
          if (owner[op.slot] != k) return fail(s, i, "runs on a set it does not hold");
          if (!fdone[v][op.micro]) return fail(s, i, "backward before forward");
          bdone[v][op.micro] = 1;
          break;
        case PipeOpKind::RecvAct:
          if (owner[op.slot] != -1) return fail(s, i, "receives into a set in use");
          owner[op.slot] = k;
          break;
        case PipeOpKind::RecvGrad:
          if (owner[op.slot] != k) return fail(s, i, "receives a gradient for a set it does not hold");
          break;
        case PipeOpKind::SendAct:
        case PipeOpKind::SendGrad:
          if (owner[op.slot] != k) return fail(s, i, "sends from a set it does not hold");
          if (op.kind == PipeOpKind::SendAct ? !fdone[v][op.micro] : !bdone[v][op.micro])
            return fail(s, i, "sends before computing");
          break;
        case PipeOpKind::CopyAct:
        case PipeOpKind::CopyGrad: {
          const bool act = op.kind == PipeOpKind::CopyAct;
          const int sv = act ? v - 1 : v + 1;
          if (!slot_ok(op.src_slot) || sv < 0 || sv >= S || sv % P != s ||
              owner[op.src_slot] != sv * M + op.micro)
            return fail(s, i, "copies from a set it does not hold");
          if (act ? !fdone[sv][op.micro] : !bdone[sv][op.micro]) return fail(s, i, "copies before computing");
          if (act) {
            if (owner[op.slot] != -1) return fail(s, i, "copies into a set in use");
            owner[op.slot] = k;
          } else if (owner[op.slot] != k) {
            return fail(s, i, "copies a gradient for a set it does not hold");
          }
          if (op.frees) owner[op.src_slot] = -1;
          continue;
        }
      }
      if (op.frees) owner[op.slot] = -1;
    }
    for (int o : owner)
      if (o != -1) return fail_msg("stage " + std::to_string(s) + " ends holding a set");
  }
  for (int v = 0; v < S; ++v)
    for (int m = 0; m < M; ++m) {
      if (!fdone[v][m]) return fail_msg("forward of virtual stage " + std::to_string(v) + " micro " + std::to_string(m) + " never ran");
      if (plans.train && !bdone[v][m])
        return fail_msg("backward of virtual stage " + std::to_string(v) + " micro " + std::to_string(m) + " never ran");
    }

  // 2. Each channel's messages between a pair match in order; the receiver must expect
  //    exactly the message it gets. prev: the same stream's previous message (-1: none).
  std::vector<std::vector<std::pair<int, int>>> partner(P);
  std::vector<std::vector<int>> prev(P);
  std::map<std::tuple<int, int, int>, std::pair<std::vector<int>, std::vector<int>>> chan;  // (from, to, channel)
  for (int s = 0; s < P; ++s) {
    const auto& ops = plans.stages[s].ops;
    partner[s].assign(ops.size(), {-1, -1});
    prev[s].assign(ops.size(), -1);
    std::map<std::pair<int, int>, int> last;  // (channel, send?) -> op
    for (size_t i = 0; i < ops.size(); ++i) {
      if (!pipe_op_is_message(ops[i].kind)) continue;
      const int ch = pipe_op_channel(ops[i].kind);
      const bool snd = is_send(ops[i].kind);
      auto& l = last.try_emplace({ch, snd}, -1).first->second;
      prev[s][i] = l;
      l = static_cast<int>(i);
      auto& q = chan[{snd ? s : ops[i].peer, snd ? ops[i].peer : s, ch}];
      (snd ? q.first : q.second).push_back(static_cast<int>(i));
    }
  }
  for (const auto& [key, q] : chan) {
    const auto [from, to, ch] = key;
    if (q.first.size() != q.second.size())
      return fail_msg("stage " + std::to_string(from) + " sends " + std::to_string(q.first.size()) +
                      " messages on channel " + std::to_string(ch) + " to stage " + std::to_string(to) +
                      ", which receives " + std::to_string(q.second.size()));
    for (size_t k = 0; k < q.first.size(); ++k) {
      const int si = q.first[k], ri = q.second[k];
      const PipeOp& sop = plans.stages[from].ops[si];
      const PipeOp& rop = plans.stages[to].ops[ri];
      const bool act = sop.kind == PipeOpKind::SendAct;
      const int v = sop.chunk * P + from, rv = rop.chunk * P + to;
      if (rop.kind != (act ? PipeOpKind::RecvAct : PipeOpKind::RecvGrad) || rop.micro != sop.micro ||
          rv != (act ? v + 1 : v - 1))
        return fail(from, si, "matched by a receive of another message on stage " + std::to_string(to));
      partner[from][si] = {to, ri};
      partner[to][ri] = {from, si};
    }
  }

  // 3. Times. Per op: for computes their end; for sends `ready` (their data computed),
  //    `start` (and the stream's previous send done) and `done` (the receive posted); for
  //    receives `start` (posted) and `done` (the send started). Unknown: NaN. The compute
  //    stream waits only for receives, right where they are; sends wait on their own stream.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<std::vector<double>> ready(P), start(P), done(P);
  std::vector<size_t> pc(P, 0);
  std::vector<double> t(P, 0.0), busy(P, 0.0);
  for (int s = 0; s < P; ++s) {
    ready[s].assign(plans.stages[s].ops.size(), nan);
    start[s].assign(plans.stages[s].ops.size(), nan);
    done[s].assign(plans.stages[s].ops.size(), nan);
  }
  auto known = [](double x) { return x == x; };
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < P; ++s) {
      const auto& ops = plans.stages[s].ops;
      // sends whose stream or receive moved meanwhile
      for (size_t i = 0; i < ops.size(); ++i) {
        if (!is_send(ops[i].kind) || !known(ready[s][i]) || known(done[s][i])) continue;
        const int pv = prev[s][i];
        if (!known(start[s][i]) && (pv < 0 || known(done[s][pv]))) {
          start[s][i] = std::max(ready[s][i], pv < 0 ? 0.0 : done[s][pv]);
          progress = true;
        }
        const auto [q, j] = partner[s][i];
        if (known(start[s][i]) && known(start[q][j])) {
          done[s][i] = std::max(start[s][i], start[q][j]);
          progress = true;
        }
      }
      while (pc[s] < ops.size()) {
        const size_t i = pc[s];
        const PipeOp& op = ops[i];
        if (is_send(op.kind)) {  // never holds the stage up
          ready[s][i] = t[s];
          ++pc[s];
          progress = true;
          continue;
        }
        double dep = 0.0;
        bool ok = true;
        for (int a : op.after) {
          ok = ok && known(done[s][a]);
          if (ok) dep = std::max(dep, done[s][a]);
        }
        if (pipe_op_is_message(op.kind) && prev[s][i] >= 0) {
          ok = ok && known(done[s][prev[s][i]]);
          if (ok) dep = std::max(dep, done[s][prev[s][i]]);
        }
        if (!ok) break;
        if (pipe_op_is_message(op.kind)) {
          start[s][i] = dep;  // posted
          const auto [q, j] = partner[s][i];
          if (!known(start[q][j])) break;
          done[s][i] = std::max(dep, start[q][j]);
          t[s] = std::max(t[s], done[s][i]);
        } else {
          const double c = op.kind == PipeOpKind::Forward ? cf : op.kind == PipeOpKind::Backward ? cb : 0.0;
          start[s][i] = std::max(t[s], dep);
          t[s] = done[s][i] = start[s][i] + c;
          busy[s] += c;
        }
        ++pc[s];
        progress = true;
      }
    }
  }
  for (int s = 0; s < P; ++s) {
    const auto& ops = plans.stages[s].ops;
    if (pc[s] < ops.size()) return fail(s, pc[s], "deadlock: blocked here");
    for (size_t i = 0; i < ops.size(); ++i)
      if (!known(done[s][i])) return fail(s, i, "deadlock: never completes");
  }
  const double makespan = *std::max_element(t.begin(), t.end());
  if (err) err->clear();
  if (makespan <= 0.0) return 0.0;
  double idle = 0.0;
  for (int s = 0; s < P; ++s) idle += (makespan - busy[s]) / makespan;
  return idle / P;
}

}  // namespace

std::string check_pipeline_plans(const PipelinePlans& plans) {
  if (plans.messages == PipelinePlans::Messages::Grouped) return check_grouped(plans);
  std::string err;
  replay_async(plans, 1.0, 2.0, &err);
  return err;
}

double plan_bubble(const PipelinePlans& plans, double cf, double cb) {
  if (plans.messages == PipelinePlans::Messages::Grouped) return bubble_grouped(plans, cf, cb);
  return replay_async(plans, cf, cb, nullptr);
}

}  // namespace vitgrid
