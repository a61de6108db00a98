// Runs a stage's pipeline plan (parallel/pipeline.h) on its part of the ViT: cuts the rank's
// batch into the plan's micro-batches, calls the model's chunk forward / backward in the
// plan's order, and moves the chunk boundaries (this rank's tensor shard of the residual
// stream and its gradient) to the neighbouring stages on Axis::Pipeline: MPI on the CPU,
// NCCL on the GPU; blocking send / recv in groups, or asynchronous post_send / post_recv,
// as the plan says (PipelinePlans::messages). Shapes come from the deck and the batch's
// sample count, which every stage of a pipeline knows alike (they load the same batch), so
// nothing but the tensors themselves is exchanged.
//
// A failure inside a step on one rank (an exception from a kernel, a check) ends the whole job
// with MPI_Abort and a message naming the stage: its neighbours are blocked in send / recv and
// would otherwise wait forever.
#pragma once
#include <cstdint>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/grid/grid.h"
#include "vitgrid/model/vit.h"
#include "vitgrid/parallel/pipeline.h"

namespace vitgrid {

class PipelineRunner {
 public:
  // `micro` is the samples of one micro-batch (the per-rank batch / M); the model must have
  // been built with at least max(num_slots) sets of `micro` samples for this stage. Called by
  // every rank of the pipeline group (it opens the message links of asynchronous plans).
  PipelineRunner(ViT& model, Backend& be, Collectives& coll, const ProcessGrid& grid,
                 PipelinePlans train_plans, PipelinePlans eval_plans, int micro);

  // Called on the host before each training step's batches, outside any CUDA-graph capture
  // (a captured step replays without running the host code of train()): the test fault
  // injection, and the bubble marks of the previous step.
  void begin_step(int64_t step);
  // Called by every rank of the pipeline and tensor groups (same batch on the stages of one
  // pipeline). One forward + backward of the rank's batch `b` (b.count = M * micro): weight
  // gradients accumulate; on the last stage the loss sum over this rank's samples of b is
  // added to the device double *loss_sum (ViT::chunk_forward), which nothing waits for.
  // With `grads_final` (the optimizer step's last batch), each chunk's last backward in the
  // plan passes `final` to the model, whose gradient-ready hook then reports the gradient
  // groups as they complete (ViT::set_grad_ready_hook).
  void train(const DeviceBatch& b, float smoothing, float grad_scale, int64_t step,
             bool grads_final, double* loss_sum);
  // Called likewise. Forward only of an eval batch (b.count <= M * micro: the last batches of
  // a pass may be short or empty). Sums on the last stage (0 elsewhere); with `logits`, the
  // last stage appends b's logits rows (fp32, [count, K], sample order).
  void eval(const DeviceBatch& b, double* loss, double* top1, double* top5,
            std::vector<float>* logits);

  int stage() const { return stage_; }
  int stages() const { return P_; }
  bool last_stage() const { return stage_ == P_ - 1; }
  // Device seconds of this stage's training steps since the last reset, in total (first to
  // last op of each step) and outside its forward / backward ops (waiting on neighbours): the
  // measured bubble is wait / total. Measured with backend marks (CUDA events), so it counts
  // the GPU's idle time, not the host's. Only with P > 1 (a single stage has no bubble, and
  // its step may be a CUDA graph, which marks cannot enter).
  double wait_seconds() { harvest(); return total_s_ - busy_s_; }
  double total_seconds() { harvest(); return total_s_; }
  void reset_timers();
  const PipelinePlans& train_plans() const { return train_; }

 private:
  void run(const PipelinePlans& plans, const DeviceBatch& b, bool train, float smoothing,
           float grad_scale, int64_t step, double* sums, std::vector<float>* logits,
           bool grads_final = false, double* loss_dev = nullptr);
  DeviceBatch micro_batch(const DeviceBatch& b, int m) const;
  void harvest();

  ViT& model_;
  Backend& be_;
  Collectives& coll_;
  PipelinePlans train_, eval_;
  int micro_;
  int P_, stage_;
  // asynchronous plans: per op of this stage's plan (train 0, eval 1), whether a fence
  // follows it (a later receive waits for it); the step's message Works by op (none: no
  // message or fence)
  std::vector<char> fence_after_[2];
  std::vector<Work> work_;
  size_t image_bytes_;  // one sample's prepared image (act dtype)
  double busy_s_ = 0.0, total_s_ = 0.0;
  std::vector<int> step_marks_, busy_marks_;  // pairs of backend marks not yet harvested
  // Fault injection for the tests (vitgrid/core/test_hooks.h: fail_stage, fail_step): this
  // stage's first rank fails at the start of that step, as a crashing kernel would.
  int fail_stage_ = -1;
  int64_t fail_step_ = -1;
  bool fail_rank_ = false;
};

}  // namespace vitgrid
