// The pipeline plans replayed (pipeline.h: check_pipeline_plans, plan_bubble): the grouped
// plans with blocking rendezvous messages, groups in lockstep (MessageReplay); the asynchronous
// ones with sends that never hold their stage up and receives posted once their `after` ops
// are done. Both find a deadlock or a misplaced message and name the op; the asynchronous
// replay also gives the plan's bubble with unit compute costs (see pipeline.cpp for the plans).
#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "vitgrid/core/error.h"
#include "vitgrid/parallel/pipeline.h"

namespace vitgrid {

namespace {

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
      if (pipe_op_is_send(ops[e].kind)) sends[s * P + q].push_back(e);
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

}  // namespace

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
        if (pipe_op_is_send(op.kind) && op.frees) owner[t][op.slot] = -1;
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
      const bool snd = pipe_op_is_send(ops[i].kind);
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
        if (!pipe_op_is_send(ops[i].kind) || !known(ready[s][i]) || known(done[s][i])) continue;
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
        if (pipe_op_is_send(op.kind)) {  // never holds the stage up
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
