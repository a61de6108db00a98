// Trainer::Impl's training: the step (micro-batches through the pipeline as eager bodies or
// CUDA graphs, gradient reduction, update, scalars read back a step late), the batch uploads
// (eval's too), the job record of metrics.h5 and the training loop, train().
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "trainer_impl.h"
#include "vitgrid/app/preempt.h"
#include "vitgrid/core/watchdog.h"
#include "vitgrid_commit.h"  // generated at build time (src/app/CMakeLists.txt)

namespace vitgrid {

using trainer_util::fmt_duration;
using trainer_util::fmt_flops;
using trainer_util::mkdirs;

// Called by all ranks, once the step's batches went through the backward: gradients whole
// on every rank (zero = 0) or on this rank's pieces (zero = 1). With the overlap, the data
// reduction came first (during the backward), then the tensor groups' partial sums; sums
// commute, and ZeRO's pieces are alike on the ranks of a tensor group.
void Trainer::Impl::reduce_grads() {
  if (!overlap) model->reduce_gradients();
  if (grid->size(Axis::Data) > 1) {
    if (zero || overlap || d_grad_stage)
      reducer->finish();
    else
      coll->allreduce(model->grads(), model->num_local_params(), Elem::F32, ReduceOp::Sum,
                      Axis::Data);
  }
  if (overlap) model->reduce_gradients();
}

// Called by all ranks, inside the last micro-batch's body (so captured with it): the
// step's gradients reduced, the loss summed over every rank's samples, the squared norm of
// the whole gradient and the optimizer's gradient factor, all on the device.
void Trainer::Impl::finish_gradients(float scale) {
  reduce_grads();
  double* loss = &d_step->loss_sum;
  tp->sum_over_batch_device(loss, 1);          // the tensor group's sample blocks
  coll->allreduce(loss, 1, Elem::F64, ReduceOp::Sum, Axis::Data);
  // known on the last stage only
  coll->allreduce(loss, 1, Elem::F64, ReduceOp::Sum, Axis::Pipeline);
  opt->grad_norm_sq_device(model->grads(), &d_step->grad_sq);
  // every stage's parameters
  coll->allreduce(&d_step->grad_sq, 1, Elem::F64, ReduceOp::Sum, Axis::Pipeline);
  be->clip_factor(&d_step->factor, &d_step->grad_sq, deck.optim.clip_grad_norm, 1.0f / scale);
}

// Runs `body` (the work of one micro-batch) eagerly, or as the CUDA graph of its key.
template <class F>
void Trainer::Impl::run_body(const GraphKey& key, F&& body) {
  if (!graphs.enabled) return body();
  if (!graphs.graph_of.empty() &&
      (be->device_allocations() != graphs.allocs || key.grad_scale != graphs.scale)) {
    // a buffer a graph points into may have moved, or the fp16 loss scale changed (the
    // graphs of the old one will not run again): capture anew
    be->drop_graphs();
    graphs.graph_of.clear();
  }
  graphs.scale = key.grad_scale;
  auto it = graphs.graph_of.find(key);
  if (it == graphs.graph_of.end()) {  // first run of this key: eager
    graphs.graph_of[key] = -1;
    graphs.allocs = be->device_allocations();
    return body();
  }
  if (it->second < 0) {
    coll->capture(true);
    be->capture_begin();
    body();
    it->second = be->capture_end();
    coll->capture(false);
    ++graphs.captures;
    graphs.allocs = be->device_allocations();
  }
  be->launch_graph(it->second);
}

// Called by all ranks: enqueues optimizer step s (0-based) with learning rate lr: the
// step's micro-batches through the pipeline, the gradient reduction, norm and clipping
// factor (run_body), then the update. Nothing waits for the device (except the fp16
// overflow verdict, which decides on the host whether the update runs); the step's
// scalars come back through finish_step. `more`: another step follows (its first
// micro-batch is uploaded during this one).
Trainer::Impl::PendingStep Trainer::Impl::enqueue_step(int64_t s, double lr, bool more) {
  const int64_t G = deck.data.global_batch;
  const int A = deck.data.grad_accum;
  pipe->begin_step(s);
  reducer->begin(model->grads());
  const float scale = scaler->scale();
  const float grad_scale = scale / static_cast<float>(G);
  const float smoothing = static_cast<float>(deck.data.label_smoothing);
  double input_wait = 0.0, decode_wait = 0.0;  // in the loader; in wait_inputs
  for (int m = 0; m < A; ++m) {
    const auto hb = std::move(in.next_hb);
    const int cur = in.slot;
    const bool first = m == 0, last = m == A - 1;
    double t_wait = now_s();
    wait_inputs(*hb, cur);  // outside the graph: the copy and decoder streams are not captured
    decode_wait += now_s() - t_wait;
    run_body({cur, first, last, !hb->soft.empty(), grad_scale}, [&] {
      if (first) {
        // the parameters the last update changed, gathered while the forward runs (each
        // layer waits for its bucket; after a skipped or no update this regathers the same)
        if (gather) gather->start(model->compute_copy());
        model->zero_grads();
        be->zero(&d_step->loss_sum, sizeof(double));
      }
      DeviceBatch db = prepare_batch(*hb, cur);
      pipe->train(db, smoothing, grad_scale, s, overlap && last, &d_step->loss_sum);
      if (first && gather) gather->finish();
      if (last) finish_gradients(scale);
    });
    be->release_slot(cur);
    if (in.decoder)
      in.decoder->release_output(static_cast<uint8_t*>(in.d_raw[cur]) + in.off_images);
    if (!last || more) {  // the next micro-batch, during this one
      t_wait = now_s();
      in.next_hb = in.next_batch();
      input_wait += now_s() - t_wait;
      in.slot ^= 1;
      start_upload(*in.next_hb, in.slot, last ? s + 1 : s);
    }
  }
  PendingStep p;
  p.step = s;
  p.input_wait_s = input_wait + decode_wait;
  p.decode_wait_s = decode_wait;
  p.lr = lr;
  p.scale = scale;
  if (scaler->enabled()) {  // fp16: the host decides on the overflow verdict
    int f = opt->grads_finite(model->grads()) ? 1 : 0;
    WatchdogWait w("the MPI all-reduce of the fp16 overflow verdict");
    MPI_Allreduce(MPI_IN_PLACE, &f, 1, MPI_INT, MPI_MIN, world);  // agreed over every axis
    p.applied = scaler->update(f != 0);
  }
  if (p.applied) {
    ++applied;
    if (!opt->step(model->master(), model->grads(), lr, applied, 1.0f, &d_step->factor,
                   model->compute_copy(), !gather))
      model->sync_compute_params();
  }
  p.readback = static_cast<int>(s & 1);
  be->readback_start(p.readback, d_step, sizeof(StepScalars));
  if (graphs.enabled) coll->follow("training step (CUDA graph)");
  return p;
}

// The loss (mean over the global batch) and the gradient norm (unscaled; NaN for a skipped
// fp16 step) of an enqueued step: waits for its scalars only.
void Trainer::Impl::finish_step(const PendingStep& p, double* loss, double* gnorm) {
  const auto* r = static_cast<const StepScalars*>(be->readback_wait(p.readback));
  *loss = r->loss_sum / static_cast<double>(deck.data.global_batch);
  *gnorm = p.applied ? std::sqrt(r->grad_sq) / p.scale : NAN;
}

// Copies a host batch, which trains in optimizer step `step` (eval: any), into upload slot
// `slot` and starts its transfer to the device; the slot's previous batch must have been
// consumed (release_slot) before. With the device's decoder, its views are decoded into the
// slot's images (and the host-decoded images copied there) on the decoder's stream.
void Trainer::Impl::start_upload(const HostBatch& hb, int slot, int64_t step) {
  if (hb.count == 0) return;
  const size_t img = static_cast<size_t>(cfg.image) * cfg.image * 3;
  char* h = static_cast<char*>(be->staging(slot, in.raw_bytes));
  size_t end = in.off_aug;
  std::memcpy(h + in.off_labels, hb.labels.data(), hb.count * sizeof(int32_t));
  const int64_t position[2] = {step, hb.first_position};
  std::memcpy(h + in.off_position, position, sizeof(position));
  if (!hb.soft.empty())
    std::memcpy(h + in.off_soft, hb.soft.data(), hb.soft.size() * sizeof(float));
  in.bad_images += hb.bad;
  // Only the stage holding the patch embedding reads images (every stage of a pipeline
  // loads the same batch, which keeps the loaders' cursors in step without talking).
  if (model->layout().embed) {
    std::memcpy(h + in.off_aug, hb.aug.data(), hb.count * sizeof(SampleAug));
    end = in.off_images;
    if (in.decoder) {
      decode_batch_on_device(*in.decoder, hb, cfg.image, in.decode_interp,
                             static_cast<uint8_t*>(in.d_raw[slot]) + in.off_images);
    } else {
      std::memcpy(h + in.off_images, hb.images.data(), hb.count * img);
      end = in.off_images + hb.count * img;
    }
  }
  be->upload_async(slot, in.d_raw[slot], end);
}

// The device batch of an upload started with start_upload(hb, slot), once the caller made
// the device wait for it (Backend::wait_uploads, and the decoder's join()): the images
// prepared (crop, flip, normalise, mixing) on the device.
DeviceBatch Trainer::Impl::prepare_batch(const HostBatch& hb, int slot) {
  DeviceBatch db;
  db.count = hb.count;
  db.first_position = hb.first_position;
  if (hb.count == 0) return db;
  uint8_t* d = static_cast<uint8_t*>(in.d_raw[slot]);
  db.labels = reinterpret_cast<const int32_t*>(d + in.off_labels);
  db.position = reinterpret_cast<const int64_t*>(d + in.off_position);
  db.soft = hb.soft.empty() ? nullptr : reinterpret_cast<const float*>(d + in.off_soft);
  if (!model->layout().embed) return db;
  // eval batches carry dx = dy = pad: the crop of the padded image is the image itself;
  // encoded images were cropped while decoded (no padding)
  const int pad = eval_ds->encoded() ? 0 : deck.data.crop_padding;
  be->prepare_images(in.d_images, d + in.off_images, d + in.off_aug, hb.count, cfg.image, pad,
                     deck.data.mean.data(), deck.data.std.data());
  db.images = in.d_images;
  return db;
}

// The device waits for the uploads started so far and for the decoder's work on batch hb
// (outside a captured graph: neither the copy stream nor the decoder's is captured). Images
// the decoder refused are decoded on the host now; when one had to be replaced by another
// image, the labels and soft targets already uploaded are corrected (rare: a bitstream that
// passed its header checks, then failed on the device and on the host).
void Trainer::Impl::wait_inputs(const HostBatch& hb, int slot) {
  be->wait_uploads();
  if (!in.decoder || !model->layout().embed || hb.count == 0) return;
  uint8_t* d = static_cast<uint8_t*>(in.d_raw[slot]);
  finish_batch_on_device(
      *in.decoder, *in.loader, hb, cfg.image, cfg.classes, d + in.off_images, &in.bad_images,
      [&](const std::vector<int32_t>& labels, const std::vector<float>& soft) {
        be->synchronize();  // the slot's upload has landed: overwrite its labels and targets
        be->copy_to_device(d + in.off_labels, labels.data(), labels.size() * sizeof(int32_t));
        if (!soft.empty())
          be->copy_to_device(d + in.off_soft, soft.data(), soft.size() * sizeof(float));
      });
}

// Eval / predict: one batch at a time through the eval slot (its previous batch's work
// was enqueued before this call, so releasing the slot here covers it).
DeviceBatch Trainer::Impl::upload(const HostBatch& hb) {
  be->release_slot(Inputs::kEvalSlot);
  if (in.decoder)
    in.decoder->release_output(static_cast<uint8_t*>(in.d_raw[Inputs::kEvalSlot]) + in.off_images);
  start_upload(hb, Inputs::kEvalSlot, 0);
  wait_inputs(hb, Inputs::kEvalSlot);
  return prepare_batch(hb, Inputs::kEvalSlot);
}

// Called by all ranks: which job wrote the file, from where and how (root attributes,
// rewritten by each run that continues the file): job_id (SLURM, PBS, LSF or Flux; "" when
// launched outside a scheduler), nodes (the hosts of the ranks, sorted), command_line (rank
// 0's), commit (of the source the binary was built from).
void Trainer::Impl::record_job(MetricsWriter& metrics) {
  std::string job;
  for (const char* k : {"SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID"})
    if (const char* v = std::getenv(k)) {
      job = v;
      if (const char* a = std::getenv("SLURM_ARRAY_TASK_ID")) job += std::string("_") + a;
      break;
    }
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  int world_size = 1;
  MPI_Comm_size(world, &world_size);
  std::vector<char> all(static_cast<size_t>(world_size) * sizeof host);
  {
    WatchdogWait w("the MPI gather of the host names");
    MPI_Gather(host, sizeof host, MPI_CHAR, all.data(), sizeof host, MPI_CHAR, 0, world);
  }
  std::set<std::string> hosts;
  for (int r = 0; r < world_size; ++r) hosts.insert(std::string(all.data() + r * sizeof host));
  std::string nodes;
  for (const auto& h : hosts) nodes += (nodes.empty() ? "" : ",") + h;
  std::string cmd;
  if (FILE* f = std::fopen("/proc/self/cmdline", "rb")) {
    char buf[4096];
    const size_t n = std::fread(buf, 1, sizeof buf, f);
    std::fclose(f);
    for (size_t i = 0; i < n; ++i) cmd += buf[i] ? buf[i] : ' ';
    while (!cmd.empty() && cmd.back() == ' ') cmd.pop_back();
  }
  metrics.set_attribute("job_id", job);
  metrics.set_attribute("nodes", nodes);
  metrics.set_attribute("command_line", cmd);
  metrics.set_attribute("commit", VITGRID_COMMIT);
}

int Trainer::Impl::train() {
  setup(true);
  PreemptionWatch preempt;  // SIGTERM / SIGUSR1: checkpoint at the end of the step, exit 3
  // init first in every case: it also keys the model's random streams (dropout) by the seed
  init_params();
  bool resumed = false;
  if (deck.checkpoint.resume == "auto") {
    resumed = load_checkpoint(ckpt_dir(), true, true);
    if (!resumed)
      log("checkpoint.resume = auto: no checkpoint in %s, starting fresh\n", ckpt_dir().c_str());
  }
  if (!resumed && !deck.checkpoint.load.empty()) load_checkpoint(deck.checkpoint.load, false);
  if (grid->world_rank() == 0) mkdirs(deck.run.out_dir);
  MPI_Barrier(world);
  agreed([&] { check_free_space(); });
  // a metrics.h5 this run cannot continue is refused with one message
  std::unique_ptr<MetricsWriter> metrics_file;
  agreed([&] {
    metrics_file = std::make_unique<MetricsWriter>(
        world, deck.run.out_dir + "/metrics.h5", deck.resolved_text(),
        std::vector<int>{grid->shape().pipeline, grid->shape().data, grid->shape().tensor},
        grid->shape().tensor > 1 ? tensor_mode_name(grid->shape().mode) : "none", be->name(),
        resumed, step);
  });
  MetricsWriter& metrics = *metrics_file;
  record_job(metrics);

  LrSchedule sched(deck.optim, total_steps, warmup_steps);
  const int64_t G = deck.data.global_batch;
  const int A = deck.data.grad_accum;
  DataLoader loader(train_ds, loader_config(true), step);
  LoaderScope bound(in.loader, loader);
  const double flops_sample = cfg.train_flops_per_sample();
  log("training %lld steps (%.2f epochs) from step %lld: global batch %lld = %d data x %d "
      "accumulation x %d per rank; %s, lr %.3g, warmup %lld\n",
      static_cast<long long>(total_steps), double(total_steps) * G / train_ds->size(),
      static_cast<long long>(step), static_cast<long long>(G), grid->size(Axis::Data), A, b,
      deck.optim.name.c_str(), deck.optim.lr, static_cast<long long>(warmup_steps));
  const double t_start = now_s();
  // Step times: step s took completion(s) - max(completion(s-1), start of enqueue(s)), the
  // time it held the device (CPU: the host) on its own, so neither an evaluation, a
  // checkpoint or a metrics write between two steps nor the host running ahead counts.
  double t_done = -INFINITY;  // completion of the last finished step
  double log_time = 0.0;      // the slowest rank's step times since the last log line
  double wait_since_log = 0.0;         // this rank's input waits since the last log line
  double decode_wait_since_log = 0.0;  // ... of them waiting for the JPEG decoder
  int64_t steps_since_log = 0;
  double last_loss = 0.0;
  const int64_t first_step = step;
  const int64_t allocs_before = be->device_allocations();
  // The first micro-batch is uploaded here; every later one while its predecessor computes
  // (upload slots 0 and 1 alternate).
  in.next_batch = [&loader] { return loader.next(); };
  if (step < total_steps) {
    in.next_hb = in.next_batch();
    start_upload(*in.next_hb, in.slot, step);
  }
  // On an asynchronous backend steps are enqueued one ahead of the host's bookkeeping: step
  // k's loss and norm are read back (finish) while step k+1 computes, so the host never
  // stalls the device, and step k is complete when its scalars come back. On a synchronous
  // one enqueueing computed the step: it is finished at once, so that its completion is
  // observed then, not after the next step computed too.
  const size_t ahead = be->asynchronous() ? 1 : 0;
  std::deque<std::pair<PendingStep, double>> inflight;  // with the start of its enqueue
  auto finish = [&] {
    const PendingStep p = inflight.front().first;
    const double t_enqueue = inflight.front().second;
    inflight.pop_front();
    double loss = 0.0, gnorm = 0.0;
    finish_step(p, &loss, &gnorm);
    const int64_t k = p.step + 1;  // completed steps
    const double now = now_s();
    const double dt = now - std::max(t_done, t_enqueue);
    t_done = now;
    double dt_max = dt;
    {
      WatchdogWait w("the MPI all-reduce of the step time");
      MPI_Allreduce(MPI_IN_PLACE, &dt_max, 1, MPI_DOUBLE, MPI_MAX, world);
    }
    ++steps_since_log;
    log_time += dt_max;
    wait_since_log += p.input_wait_s;
    decode_wait_since_log += p.decode_wait_s;
    if (k == first_step + 1) {
      // the workspace was planned in setup(): a first step that allocates is worth a line
      long long n = static_cast<long long>(be->device_allocations() - allocs_before);
      MPI_Allreduce(MPI_IN_PLACE, &n, 1, MPI_LONG_LONG, MPI_MAX, world);
      if (n > 0)
        log("warning: %lld device allocations during the first steps: workspace plan too "
            "small\n", n);
    }
    last_loss = loss;
    metrics.add_train({k, loss, p.lr, gnorm, double(G) / dt_max, double(p.scale), dt,
                       double(be->peak_memory_bytes()), double(in.bad_images), p.input_wait_s});
    if (k % deck.run.log_every == 0 || k == total_steps) {
      // the steps' own time: evaluations and checkpoints in the interval do not count
      const double ips = double(G) * steps_since_log / std::max(log_time, 1e-9);
      const double eta = (total_steps - k) * (now - t_start) / double(k - first_step);
      // rank 0's host waiting for input (loader, JPEG decoder), per step of the interval
      char wait[96];
      const double per = 1e3 / steps_since_log;
      if (in.decoder)
        std::snprintf(wait, sizeof wait, "input wait %.1f ms (decoder %.1f)",
                      per * wait_since_log, per * decode_wait_since_log);
      else
        std::snprintf(wait, sizeof wait, "input wait %.1f ms", per * wait_since_log);
      log("step %6lld/%lld | epoch %6.2f | loss %.4f | lr %.3e | %8.1f img/s | %s | %s | ETA "
          "%s%s\n",
          static_cast<long long>(k), static_cast<long long>(total_steps),
          double(k) * G / train_ds->size(), loss, p.lr, ips,
          fmt_flops(ips * flops_sample).c_str(), wait, fmt_duration(eta).c_str(),
          p.applied ? "" : " | overflow: step skipped");
      log_time = 0.0;
      wait_since_log = decode_wait_since_log = 0.0;
      steps_since_log = 0;
      metrics.flush();
    }
  };
  while (step < total_steps) {
    const double t_enqueue = now_s();
    inflight.emplace_back(enqueue_step(step, sched.at(step + 1), step + 1 < total_steps),
                          t_enqueue);
    ++step;
    const bool last = step == total_steps;
    const bool eval_due = (deck.run.eval_every > 0 && step % deck.run.eval_every == 0) || last;
    const bool stop = !last && preempt.requested(world);  // agreed: every rank stops here
    const bool ckpt_due =
        (deck.checkpoint.every_steps > 0 && step % deck.checkpoint.every_steps == 0) || last ||
        stop;
    // `ahead` steps stay in flight; what reads the model after this step waits for all
    while (inflight.size() > ahead || (!inflight.empty() && (eval_due || ckpt_due))) finish();
    if (eval_due) {
      double el, e1, e5;
      evaluate(&el, &e1, &e5);
      metrics.add_eval({step, el, e1, e5});
      metrics.flush();
      log("eval  %6lld | loss %.4f | top-1 %.2f%% | top-5 %.2f%%\n",
          static_cast<long long>(step), el, 100 * e1, 100 * e5);
    }
    if (ckpt_due) save_checkpoint();
    if (stop) {
      metrics.flush();
      log("preempted (signal %d) after step %lld: checkpoint written; exiting with %d so the "
          "job script requeues; checkpoint.resume = auto continues from here\n",
          preempt.signal_seen(), static_cast<long long>(step), kExitRequeue);
      return kExitRequeue;
    }
  }
  if (graphs.enabled)
    log("CUDA graphs: %lld captured, replayed for the steps after the first two\n",
        static_cast<long long>(graphs.captures));
  report_bubble(&metrics);
  metrics.set_attribute("peak_device_memory_bytes", double(be->peak_memory_bytes()));
  metrics.set_attribute("checkpoint_write_GBps", ckpt.write_gbs);
  metrics.flush();
  log("done: %lld steps in %s, final loss %.4f; outputs in %s\n",
      static_cast<long long>(step - first_step), fmt_duration(now_s() - t_start).c_str(),
      last_loss, deck.run.out_dir.c_str());
  return 0;
}

}  // namespace vitgrid
