#include "vitgrid/model/pipeline_runner.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <string>

#include "vitgrid/core/error.h"
#include "vitgrid/core/log.h"
#include "vitgrid/core/test_hooks.h"

namespace vitgrid {

PipelineRunner::PipelineRunner(ViT& model, Backend& be, Collectives& coll,
                               const ProcessGrid& grid, PipelinePlans train_plans,
                               PipelinePlans eval_plans, int micro)
    : model_(model),
      be_(be),
      coll_(coll),
      train_(std::move(train_plans)),
      eval_(std::move(eval_plans)),
      micro_(micro),
      P_(grid.size(Axis::Pipeline)),
      stage_(grid.rank(Axis::Pipeline)) {
  VG_CHECK(train_.P == P_ && eval_.P == P_, "pipeline plans for " << train_.P << " stages on a grid of " << P_);
  VG_CHECK(micro_ >= 1, "micro-batch of " << micro_ << " samples");
  // asynchronous plans: the computes a later receive waits for get a fence behind them
  bool async = false;
  for (int k = 0; k < 2; ++k) {
    const PipelinePlans& plans = k == 0 ? train_ : eval_;
    if (plans.messages != PipelinePlans::Messages::Async) continue;
    async = true;
    const PipelinePlan& pl = plans.stages[stage_];
    fence_after_[k].assign(pl.ops.size(), 0);
    for (const PipeOp& op : pl.ops)
      for (int a : op.after)
        if (!pipe_op_is_message(pl.ops[a].kind)) fence_after_[k][a] = 1;
  }
  if (async && P_ > 1) coll_.open_links(Axis::Pipeline);
  const ViTConfig& c = model_.config();
  image_bytes_ = static_cast<size_t>(c.channels) * c.image * c.image * be_.act_size();
  // Test fault injection (test_hooks.h): one rank of the stage; the others must be left
  // blocked on it
  if (vitgrid_test_hooks.fail_stage >= 0) {
    fail_stage_ = vitgrid_test_hooks.fail_stage;
    fail_step_ = vitgrid_test_hooks.fail_step;
    bool first = true;
    for (Axis a : {Axis::Data, Axis::Tensor}) first = first && grid.rank(a) == 0;
    fail_rank_ = first && stage_ == fail_stage_;
  }
}

DeviceBatch PipelineRunner::micro_batch(const DeviceBatch& b, int m) const {
  DeviceBatch d;
  const int first = m * micro_;
  d.count = std::max(0, std::min(micro_, b.count - first));
  d.first_position = b.first_position + first;
  d.position = b.position;
  d.position_offset = b.position_offset + first;
  if (d.count == 0) return d;
  const int K = model_.config().classes;
  if (b.images) d.images = static_cast<const char*>(b.images) + first * image_bytes_;
  if (b.labels) d.labels = b.labels + first;
  if (b.soft) d.soft = b.soft + static_cast<size_t>(first) * K;
  return d;
}

// Called by every rank of the pipeline and tensor groups.
void PipelineRunner::run(const PipelinePlans& plans, const DeviceBatch& b, bool train,
                         float smoothing, float grad_scale, int64_t step, double* sums,
                         std::vector<float>* logits, bool grads_final, double* loss_dev) {
  const PipelinePlan& plan = plans.stages[stage_];
  const int M = train_.M;
  // micro-batches of this batch (eval's last batch may leave some short or empty: both sides
  // of every message know it from the batch count and skip empty ones alike)
  std::vector<DeviceBatch> mb(M);
  for (int m = 0; m < M; ++m) mb[m] = micro_batch(b, m);
  const int last_chunk = static_cast<int>(model_.layout().chunks.size()) - 1;
  const bool holds_head = model_.layout().head;
  std::vector<float> rows;
  // each chunk's last backward in the plan: its gradients are final after it (grads_final)
  std::vector<size_t> last_backward(last_chunk + 1, plan.ops.size());
  if (grads_final)
    for (size_t i = 0; i < plan.ops.size(); ++i)
      if (plan.ops[i].kind == PipeOpKind::Backward && mb[plan.ops[i].micro].count > 0)
        last_backward[plan.ops[i].chunk] = i;
  // device-time marks around the step and each compute op (the bubble, harvested later)
  const bool marks = train && P_ > 1;
  if (marks) step_marks_.push_back(be_.mark());
  // Grouped plans: blocking messages, the ones that join the one before them posted in one
  // group with it. Asynchronous plans: work_[i] is op i's (a send's or receive's, or the
  // fence after a compute that a later receive waits for); the step's start fence stands for
  // "free since the last step" (pipeline.h).
  const bool async = plans.messages == PipelinePlans::Messages::Async;
  const std::vector<char>& fence_after = fence_after_[train ? 0 : 1];
  Work start;
  if (async) {
    work_.assign(plan.ops.size(), Work{});
    start = coll_.fence();
  }
  std::vector<Work> after;
  auto gather_after = [&](const PipeOp& op) {
    after.clear();
    for (int a : op.after) {
      VG_CHECK(work_[a].valid(), "pipeline stage " << stage_ << ": op " << a << " left no Work");
      after.push_back(work_[a]);
    }
    if (after.empty()) after.push_back(start);
  };
  bool open = false;
  try {
    for (size_t oi = 0; oi < plan.ops.size(); ++oi) {
      const PipeOp& op = plan.ops[oi];
      const bool message = pipe_op_is_message(op.kind);
      // every local operation closes a group, even one skipped for an empty micro-batch, and
      // so does a message that does not join it
      if (open && (!message || !op.joins)) {
        coll_.group_end();
        open = false;
      }
      const DeviceBatch& d = mb[op.micro];
      if (d.count == 0) {
        // skipped alike on both sides (an empty micro-batch of a short eval batch); what
        // waits for this op waits for the compute stream here, after what it waited for
        if (async) {
          for (int a : op.after) coll_.wait(work_[a]);
          work_[oi] = coll_.fence();
        }
        continue;
      }
      if (!async && message && !open) {
        coll_.group_begin();
        open = true;
      }
      const size_t bytes = model_.boundary_bytes(d.count);
      const bool compute = op.kind == PipeOpKind::Forward || op.kind == PipeOpKind::Backward;
      const int ch = pipe_op_channel(op.kind);
      // asynchronous: a forward or copy that fills a set waits for the sends still reading it
      if (async && !message)
        for (int a : op.after) coll_.wait(work_[a]);
      if (marks && compute) busy_marks_.push_back(be_.mark());
      switch (op.kind) {
        case PipeOpKind::Forward: {
          double v[3] = {0.0, 0.0, 0.0};
          if (train)  // the loss into the device sum
            model_.chunk_forward(op.chunk, op.slot, d, step, true, smoothing, grad_scale,
                                 loss_dev, nullptr, nullptr);
          else
            model_.chunk_forward(op.chunk, op.slot, d, step, false, smoothing, grad_scale,
                                 &v[0], &v[1], &v[2]);
          if (!train && holds_head && op.chunk == last_chunk) {
            for (int i = 0; i < 3; ++i) sums[i] += v[i];
            if (logits) {
              // rows arrive in micro-batch order: the plan runs a stage's forwards in order
              model_.logits_to_host(rows, d.count);
              logits->insert(logits->end(), rows.begin(), rows.end());
            }
          }
          break;
        }
        case PipeOpKind::Backward:
          model_.chunk_backward(op.chunk, op.slot, d, step,
                                grads_final && last_backward[op.chunk] == oi);
          break;
        case PipeOpKind::SendAct:
        case PipeOpKind::SendGrad: {
          const void* buf = op.kind == PipeOpKind::SendAct ? model_.stage_output(op.slot)
                                                           : model_.stage_input(op.slot);
          if (async) work_[oi] = coll_.post_send(buf, bytes, op.peer, ch, Axis::Pipeline);
          else coll_.send(buf, bytes, op.peer, Axis::Pipeline);
          break;
        }
        case PipeOpKind::RecvAct:
        case PipeOpKind::RecvGrad: {
          void* buf = op.kind == PipeOpKind::RecvAct ? model_.stage_input(op.slot) : model_.grad_input();
          if (async) {
            gather_after(op);
            work_[oi] = coll_.post_recv(buf, bytes, op.peer, ch, Axis::Pipeline, after);
            coll_.wait(work_[oi]);  // the next op is the compute that reads it
          } else {
            coll_.recv(buf, bytes, op.peer, Axis::Pipeline);
          }
          break;
        }
        case PipeOpKind::CopyAct:
          be_.copy(model_.stage_input(op.slot), model_.stage_output(op.src_slot), bytes);
          break;
        case PipeOpKind::CopyGrad:
          be_.copy(model_.grad_input(), model_.stage_input(op.src_slot), bytes);
          break;
      }
      if (marks && compute) busy_marks_.push_back(be_.mark());
      if (async && fence_after[oi]) work_[oi] = coll_.fence();
    }
    if (open) coll_.group_end();
    if (async) coll_.wait_messages();
  } catch (const std::exception& e) {
    // Only this rank saw it; its neighbours wait in send / recv: end the job.
    VG_FAIL("pipeline stage " << stage_ << ", step " << step << ": " << e.what());
  }
  if (marks) step_marks_.push_back(be_.mark());
}

// Device time of the marked steps: stage time (first to last mark of a step) and the time in
// forward / backward ops; the rest is the bubble (waiting on neighbours, plus the boundary
// copies). Harvested one step late, so reading the marks never stalls the step that made them.
void PipelineRunner::harvest() {
  for (size_t i = 0; i + 1 < step_marks_.size(); i += 2)
    total_s_ += be_.seconds_between(step_marks_[i], step_marks_[i + 1]);
  double busy = 0.0;
  for (size_t i = 0; i + 1 < busy_marks_.size(); i += 2)
    busy += be_.seconds_between(busy_marks_[i], busy_marks_[i + 1]);
  busy_s_ += busy;
  step_marks_.clear();
  busy_marks_.clear();
  be_.clear_marks();
}

void PipelineRunner::reset_timers() {
  step_marks_.clear();
  busy_marks_.clear();
  be_.clear_marks();
  busy_s_ = total_s_ = 0.0;
}

void PipelineRunner::begin_step(int64_t step) {
  if (fail_rank_ && step == fail_step_)
    VG_FAIL("injected failure (test hook fail_stage) on pipeline stage " << stage_ << " at step " << step);
  harvest();  // the previous step's marks
}

void PipelineRunner::train(const DeviceBatch& b, float smoothing, float grad_scale,
                           int64_t step, bool grads_final, double* loss_sum) {
  VG_CHECK(b.count == train_.M * micro_, "a training batch of " << b.count << " samples for "
                                             << train_.M << " micro-batches of " << micro_);
  double unused[3] = {0.0, 0.0, 0.0};
  run(train_, b, true, smoothing, grad_scale, step, unused, nullptr, grads_final,
      loss_sum);
}

void PipelineRunner::eval(const DeviceBatch& b, double* loss, double* top1, double* top5,
                          std::vector<float>* logits) {
  VG_CHECK(b.count <= eval_.M * micro_, "an eval batch of " << b.count << " samples for "
                                            << eval_.M << " micro-batches of " << micro_);
  double sums[3] = {0.0, 0.0, 0.0};
  run(eval_, b, false, 0.0f, 0.0f, 0, sums, logits);
  *loss = sums[0];
  *top1 = sums[1];
  *top5 = sums[2];
}

}  // namespace vitgrid
