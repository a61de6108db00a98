// Stepper: the training step (micro-batches through the pipeline as eager bodies or CUDA
// graphs, gradient reduction, update, scalars read back a step late) and the upload of each
// next micro-batch while the current one computes.
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "trainer_impl.h"
#include "vitgrid/core/watchdog.h"

namespace vitgrid {
namespace trainer_detail {

Stepper::~Stepper() {
  if (d_step_) run_.be->release(d_step_);
}

// Called by all ranks from setup(): the step's scalars, and whether the step's micro-batches
// run as CUDA graphs. Everything a graph replays must be the same every step (what changes,
// the batch and the step and stream position that key the dropout masks, is read from the
// upload slot): with one pipeline stage (a pipeline's bubble marks and point-to-point
// schedule stay eager) and not under --profile (which times every op).
void Stepper::setup(bool training, bool profiling) {
  Backend& be = *run_.be;
  d_step_ = static_cast<StepScalars*>(be.alloc(sizeof(StepScalars)));
  be.zero(d_step_, sizeof(StepScalars));
  if (!training || !run_.deck.device.cuda_graph || !be.graphs_supported()) return;
  std::string why;
  if (run_.grid->size(Axis::Pipeline) > 1) why = "pipeline stages";
  else if (profiling) why = "--profile";
  if (!why.empty()) {
    run_.log("CUDA graphs off (%s): the step runs eagerly\n", why.c_str());
    return;
  }
  graphs_.enabled = true;
}

// Where the training batches come from (the loader; bench: the same batch again), and the
// upload of the first micro-batch, which trains in step `step`; every later one is uploaded
// while its predecessor computes (upload slots 0 and 1 alternate).
void Stepper::feed(std::function<std::shared_ptr<const HostBatch>()> next_batch, int64_t step) {
  next_batch_ = std::move(next_batch);
  next_hb_ = next_batch_();
  in_.start_upload(*next_hb_, slot_, step);
}

// Called by all ranks, once the step's batches went through the backward: gradients whole
// on every rank (zero = 0) or on this rank's pieces (zero = 1). With the overlap, the data
// reduction came first (during the backward), then the tensor groups' partial sums; sums
// commute, and ZeRO's pieces are alike on the ranks of a tensor group.
void Stepper::reduce_grads() {
  ViT& model = *run_.model;
  if (!run_.overlap) model.reduce_gradients();
  if (run_.grid->size(Axis::Data) > 1) {
    if (run_.zero || run_.overlap || run_.d_grad_stage)
      run_.reducer->finish();
    else
      run_.coll->allreduce(model.grads(), model.num_local_params(), Elem::F32, ReduceOp::Sum,
                           Axis::Data);
  }
  if (run_.overlap) model.reduce_gradients();
}

// Called by all ranks, inside the last micro-batch's body (so captured with it): the
// step's gradients reduced, the loss summed over every rank's samples, the squared norm of
// the whole gradient and the optimizer's gradient factor, all on the device.
void Stepper::finish_gradients(float scale) {
  Collectives& coll = *run_.coll;
  reduce_grads();
  double* loss = &d_step_->loss_sum;
  run_.tp->sum_over_batch_device(loss, 1);  // the tensor group's sample blocks
  coll.allreduce(loss, 1, Elem::F64, ReduceOp::Sum, Axis::Data);
  // known on the last stage only
  coll.allreduce(loss, 1, Elem::F64, ReduceOp::Sum, Axis::Pipeline);
  run_.opt->grad_norm_sq_device(run_.model->grads(), &d_step_->grad_sq);
  // every stage's parameters
  coll.allreduce(&d_step_->grad_sq, 1, Elem::F64, ReduceOp::Sum, Axis::Pipeline);
  run_.be->clip_factor(&d_step_->factor, &d_step_->grad_sq, run_.deck.optim.clip_grad_norm,
                       1.0f / scale);
}

// Called by all ranks once a step's optimizer is enqueued (precision.mode = fp8), after
// model.fp8_amaxes_start(kFp8Readback) once its backward was: delayed scaling takes the step's
// amaxes, the maximum over every rank (data replicas and tensor ranks cast parts of each
// tensor; a pipeline stage records its own blocks' only, 0 for the others), so every rank's
// scales stay the same; the new scales are in place for the next step's casts. Waits for the
// backward's kernels only (one read-back of depth x 12 floats): the reduction and the update
// run on the host while the device runs the optimizer, and the scales go up through their
// upload slot, in the device's order, without the host waiting for it.
void Stepper::fp8_update() {
  ViT& model = *run_.model;
  fp8_amax_.resize(model.fp8_tensors());
  model.fp8_amaxes_wait(kFp8Readback, fp8_amax_.data());
  for (float& a : fp8_amax_)  // an overflow is kept: MPI_MAX may drop a NaN, not an inf
    if (std::isnan(a)) a = INFINITY;
  WatchdogWait w("the MPI all-reduce of the FP8 amaxes");
  MPI_Allreduce(MPI_IN_PLACE, fp8_amax_.data(), static_cast<int>(fp8_amax_.size()), MPI_FLOAT,
                MPI_MAX, run_.world);
  model.fp8_update(fp8_amax_.data(), kFp8Upload);
}

// Runs `body` (the work of one micro-batch) eagerly, or as the CUDA graph of its key.
template <class F>
void Stepper::run_body(const GraphKey& key, F&& body) {
  if (!graphs_.enabled) return body();
  Backend& be = *run_.be;
  if (!graphs_.graph_of.empty() &&
      (be.device_allocations() != graphs_.allocs || key.grad_scale != graphs_.scale)) {
    // a buffer a graph points into may have moved, or the fp16 loss scale changed (the
    // graphs of the old one will not run again): capture anew
    be.drop_graphs();
    graphs_.graph_of.clear();
  }
  graphs_.scale = key.grad_scale;
  auto it = graphs_.graph_of.find(key);
  if (it == graphs_.graph_of.end()) {  // first run of this key: eager
    graphs_.graph_of[key] = -1;
    graphs_.allocs = be.device_allocations();
    return body();
  }
  if (it->second < 0) {
    run_.coll->capture(true);
    be.capture_begin();
    body();
    it->second = be.capture_end();
    run_.coll->capture(false);
    ++graphs_.captures;
    graphs_.allocs = be.device_allocations();
  }
  be.launch_graph(it->second);
}

// Called by all ranks: enqueues optimizer step s (0-based) with learning rate lr: the
// step's micro-batches through the pipeline, the gradient reduction, norm and clipping
// factor (run_body), then the update. Nothing waits for the device (except the fp16
// overflow verdict, which decides on the host whether the update runs); the step's
// scalars come back through finish_step. `more`: another step follows (its first
// micro-batch is uploaded during this one).
Stepper::PendingStep Stepper::enqueue_step(int64_t s, double lr, bool more) {
  const Deck& deck = run_.deck;
  Backend& be = *run_.be;
  ViT& model = *run_.model;
  PipelineRunner& pipe = *run_.pipe;
  ParamGather* gather = run_.gather.get();
  const int64_t G = deck.data.global_batch;
  const int A = deck.data.grad_accum;
  pipe.begin_step(s);
  run_.reducer->begin(model.grads());
  const float scale = run_.scaler->scale();
  const float grad_scale = scale / static_cast<float>(G);
  const float smoothing = static_cast<float>(deck.data.label_smoothing);
  double input_wait = 0.0, decode_wait = 0.0;  // in the loader; in wait_inputs
  for (int m = 0; m < A; ++m) {
    const auto hb = std::move(next_hb_);
    const int cur = slot_;
    const bool first = m == 0, last = m == A - 1;
    double t_wait = now_s();
    in_.wait_inputs(*hb, cur);  // outside the graph: the copy and decoder streams are not captured
    decode_wait += now_s() - t_wait;
    run_body({cur, first, last, !hb->soft.empty(), grad_scale}, [&] {
      if (first) {
        // the parameters the last update changed, gathered while the forward runs (each
        // layer waits for its bucket; after a skipped or no update this regathers the same)
        if (gather) gather->start(model.compute_copy());
        model.zero_grads();
        be.zero(&d_step_->loss_sum, sizeof(double));
      }
      DeviceBatch db = in_.prepare_batch(*hb, cur);
      pipe.train(db, smoothing, grad_scale, s, run_.overlap && last, &d_step_->loss_sum);
      if (first && gather) gather->finish();
      if (last) finish_gradients(scale);
    });
    in_.release(cur);
    if (!last || more) {  // the next micro-batch, during this one
      t_wait = now_s();
      next_hb_ = next_batch_();
      input_wait += now_s() - t_wait;
      slot_ ^= 1;
      in_.start_upload(*next_hb_, slot_, last ? s + 1 : s);
    }
  }
  if (model.fp8()) model.fp8_amaxes_start(kFp8Readback, kFp8Upload);  // while the optimizer runs
  PendingStep p;
  p.step = s;
  p.input_wait_s = input_wait + decode_wait;
  p.decode_wait_s = decode_wait;
  p.lr = lr;
  p.scale = scale;
  if (run_.scaler->enabled()) {  // fp16: the host decides on the overflow verdict
    int f = run_.opt->grads_finite(model.grads()) ? 1 : 0;
    WatchdogWait w("the MPI all-reduce of the fp16 overflow verdict");
    MPI_Allreduce(MPI_IN_PLACE, &f, 1, MPI_INT, MPI_MIN, run_.world);  // agreed over every axis
    p.applied = run_.scaler->update(f != 0);
  }
  if (p.applied) {
    ++run_.applied;
    if (!run_.opt->step(model.master(), model.grads(), lr, run_.applied, 1.0f, &d_step_->factor,
                        model.compute_copy(), !gather))
      model.sync_compute_params();
  }
  if (model.fp8()) fp8_update();
  p.readback = static_cast<int>(s & 1);
  be.readback_start(p.readback, d_step_, sizeof(StepScalars));
  if (graphs_.enabled) run_.coll->follow("training step (CUDA graph)");
  return p;
}

// The loss (mean over the global batch) and the gradient norm (unscaled; NaN for a skipped
// fp16 step) of an enqueued step: waits for its scalars only.
void Stepper::finish_step(const PendingStep& p, double* loss, double* gnorm) {
  const auto* r = static_cast<const StepScalars*>(run_.be->readback_wait(p.readback));
  *loss = r->loss_sum / static_cast<double>(run_.deck.data.global_batch);
  *gnorm = p.applied ? std::sqrt(r->grad_sq) / p.scale : NAN;
}

}  // namespace trainer_detail
}  // namespace vitgrid
