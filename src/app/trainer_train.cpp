// Trainer::Impl::train(): the training loop (steps through the Stepper, evaluations and
// checkpoints at their intervals, preemption, the log lines and metrics.h5) and the job record
// of metrics.h5.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
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

namespace {

// Called by all ranks: which job wrote the file, from where and how (root attributes,
// rewritten by each run that continues the file): job_id (SLURM, PBS, LSF or Flux; "" when
// launched outside a scheduler), nodes (the hosts of the ranks, sorted), command_line (rank
// 0's), commit (of the source the binary was built from).
void record_job(MPI_Comm world, MetricsWriter& metrics) {
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

}  // namespace

int Trainer::Impl::train() {
  setup(true);
  const Deck& deck = run.deck;
  const ProcessGrid& grid = *run.grid;
  Backend& be = *run.be;
  const Log& log = run.log;
  int64_t& step = run.step;
  const int64_t total_steps = run.total_steps;
  PreemptionWatch preempt;  // SIGTERM / SIGUSR1: checkpoint at the end of the step, exit 3
  // init first in every case: it also keys the model's random streams (dropout) by the seed
  checkpointer.init_params();
  bool resumed = false;
  if (deck.checkpoint.resume == "auto") {
    resumed = checkpointer.load(checkpointer.dir(), true, true);
    if (!resumed)
      log("checkpoint.resume = auto: no checkpoint in %s, starting fresh\n",
          checkpointer.dir().c_str());
  }
  if (!resumed && !deck.checkpoint.load.empty()) checkpointer.load(deck.checkpoint.load, false);
  if (grid.world_rank() == 0) mkdirs(deck.run.out_dir);
  MPI_Barrier(run.world);
  run.agreed([&] { checkpointer.check_free_space(); });
  checkpointer.prepare();
  // a metrics.h5 this run cannot continue is refused with one message
  std::unique_ptr<MetricsWriter> metrics_file;
  run.agreed([&] {
    metrics_file = std::make_unique<MetricsWriter>(
        run.world, deck.run.out_dir + "/metrics.h5", deck.resolved_text(),
        std::vector<int>{grid.shape().pipeline, grid.shape().data, grid.shape().tensor},
        grid.shape().tensor > 1 ? tensor_mode_name(grid.shape().mode) : "none", be.name(), resumed,
        step);
  });
  MetricsWriter& metrics = *metrics_file;
  record_job(run.world, metrics);

  LrSchedule sched(deck.optim, total_steps, run.warmup_steps);
  const int64_t G = deck.data.global_batch;
  const int A = deck.data.grad_accum;
  const Dataset& train_ds = *run.train_ds;
  DataLoader loader(run.train_ds, inputs.loader_config(true), step);
  trainer_detail::Inputs::LoaderScope bound(inputs, loader);
  const double flops_sample = run.cfg.train_flops_per_sample();
  log("training %lld steps (%.2f epochs) from step %lld: global batch %lld = %d data x %d "
      "accumulation x %d per rank; %s, lr %.3g, warmup %lld\n",
      static_cast<long long>(total_steps), double(total_steps) * G / train_ds.size(),
      static_cast<long long>(step), static_cast<long long>(G), grid.size(Axis::Data), A, run.b,
      deck.optim.name.c_str(), deck.optim.lr, static_cast<long long>(run.warmup_steps));
  const double t_start = now_s();
  // Step times: step s took completion(s) - max(completion(s-1), start of enqueue(s)), the
  // time it held the device (CPU: the host) on its own, so neither an evaluation, a
  // checkpoint or a metrics write between two steps nor the host running ahead counts.
  double t_done = -INFINITY;  // completion of the last finished step
  double log_time = 0.0;      // the slowest rank's step times since the last log line
  double wait_since_log = 0.0;         // this rank's input waits since the last log line
  double decode_wait_since_log = 0.0;  // ... of them waiting for the JPEG decoder
  int64_t steps_since_log = 0;
  bool said_input_bound = false;
  double last_loss = 0.0;
  const int64_t first_step = step;
  const int64_t allocs_before = be.device_allocations();
  // The first micro-batch is uploaded here; every later one while its predecessor computes
  // (upload slots 0 and 1 alternate).
  if (step < total_steps) stepper.feed([&loader] { return loader.next(); }, step);
  // On an asynchronous backend steps are enqueued one ahead of the host's bookkeeping: step
  // k's loss and norm are read back (finish) while step k+1 computes, so the host never
  // stalls the device, and step k is complete when its scalars come back. On a synchronous
  // one enqueueing computed the step: it is finished at once, so that its completion is
  // observed then, not after the next step computed too.
  const size_t ahead = be.asynchronous() ? 1 : 0;
  // with the start of its enqueue
  std::deque<std::pair<trainer_detail::Stepper::PendingStep, double>> inflight;
  auto finish = [&] {
    const trainer_detail::Stepper::PendingStep p = inflight.front().first;
    const double t_enqueue = inflight.front().second;
    inflight.pop_front();
    double loss = 0.0, gnorm = 0.0;
    stepper.finish_step(p, &loss, &gnorm);
    const int64_t k = p.step + 1;  // completed steps
    const double now = now_s();
    const double dt = now - std::max(t_done, t_enqueue);
    t_done = now;
    double dt_max = dt;
    {
      WatchdogWait w("the MPI all-reduce of the step time");
      MPI_Allreduce(MPI_IN_PLACE, &dt_max, 1, MPI_DOUBLE, MPI_MAX, run.world);
    }
    ++steps_since_log;
    log_time += dt_max;
    wait_since_log += p.input_wait_s;
    decode_wait_since_log += p.decode_wait_s;
    if (k == first_step + 1) {
      // the workspace was planned in setup(): a first step that allocates is worth a line
      long long n = static_cast<long long>(be.device_allocations() - allocs_before);
      MPI_Allreduce(MPI_IN_PLACE, &n, 1, MPI_LONG_LONG, MPI_MAX, run.world);
      if (n > 0)
        log("warning: %lld device allocations during the first steps: workspace plan too "
            "small\n", n);
    }
    last_loss = loss;
    metrics.add_train({k, loss, p.lr, gnorm, double(G) / dt_max, double(p.scale), dt,
                       double(be.peak_memory_bytes()), double(inputs.bad_images()),
                       p.input_wait_s});
    if (k % deck.run.log_every == 0 || k == total_steps) {
      // the steps' own time: evaluations and checkpoints in the interval do not count
      const double ips = double(G) * steps_since_log / std::max(log_time, 1e-9);
      const double eta = (total_steps - k) * (now - t_start) / double(k - first_step);
      // rank 0's host waiting for input (loader, JPEG decoder), per step of the interval
      char wait[96];
      const double per = 1e3 / steps_since_log;
      if (inputs.device_decodes())
        std::snprintf(wait, sizeof wait, "input wait %.1f ms (decoder %.1f)",
                      per * wait_since_log, per * decode_wait_since_log);
      else
        std::snprintf(wait, sizeof wait, "input wait %.1f ms", per * wait_since_log);
      log("step %6lld/%lld | epoch %6.2f | loss %.4f | lr %.3e | %8.1f img/s | %s | %s | ETA "
          "%s%s\n",
          static_cast<long long>(k), static_cast<long long>(total_steps),
          double(k) * G / train_ds.size(), loss, p.lr, ips, fmt_flops(ips * flops_sample).c_str(),
          wait, fmt_duration(eta).c_str(), p.applied ? "" : " | overflow: step skipped");
      // Waits for the loader's batches of a tenth of the step (and a millisecond) in the steady
      // state mean that it delivers fewer images than the device trains on: said once, with
      // what helps (the first interval, in which the loader fills its queue, aside; the device
      // decoder's waits, which include the running step's end, do not count).
      const double loader_ms = per * (wait_since_log - decode_wait_since_log);
      const double step_ms = 1e3 * log_time / steps_since_log;
      if (!said_input_bound && k - steps_since_log > first_step && loader_ms >= 1.0 &&
          loader_ms > 0.1 * step_ms) {
        said_input_bound = true;
        log("warning: input-bound: in steps %lld-%lld rank 0 waited %.1f ms a step for the "
            "loader's next batch, in steps of %.1f ms: the input pipeline delivers fewer images "
            "than the model trains on. More cores per GPU or data.workers, data.decode = device "
            "for JPEGs, or a faster file system help (README, \"Decoding\")\n",
            static_cast<long long>(k - steps_since_log + 1), static_cast<long long>(k), loader_ms,
            step_ms);
      }
      log_time = 0.0;
      wait_since_log = decode_wait_since_log = 0.0;
      steps_since_log = 0;
      // a background checkpoint that has finished everywhere ends here; while one is still
      // being written the rows stay buffered (it holds the HDF5 library)
      checkpointer.poll();
      if (!checkpointer.pending()) metrics.flush();
    }
  };
  while (step < total_steps) {
    const double t_enqueue = now_s();
    inflight.emplace_back(stepper.enqueue_step(step, sched.at(step + 1), step + 1 < total_steps),
                          t_enqueue);
    ++step;
    const bool last = step == total_steps;
    const bool eval_due = (deck.run.eval_every > 0 && step % deck.run.eval_every == 0) || last;
    const bool stop = !last && preempt.requested(run.world);  // agreed: every rank stops here
    const bool ckpt_due =
        (deck.checkpoint.every_steps > 0 && step % deck.checkpoint.every_steps == 0) || last ||
        stop;
    // `ahead` steps stay in flight; what reads the model after this step waits for all
    while (inflight.size() > ahead || (!inflight.empty() && (eval_due || ckpt_due))) finish();
    if (eval_due) {
      double el, e1, e5;
      evaluator.evaluate(&el, &e1, &e5);
      metrics.add_eval({step, el, e1, e5});
      if (!checkpointer.pending()) metrics.flush();
      log("eval  %6lld | loss %.4f | top-1 %.2f%% | top-5 %.2f%%\n",
          static_cast<long long>(step), el, 100 * e1, 100 * e5);
    }
    if (ckpt_due) {
      // the write in flight ends first (at most one); HDF5 is then free for the rows buffered
      // while it was written, so metrics.h5 keeps up however often checkpoints come
      checkpointer.wait();
      metrics.flush();
      checkpointer.save();
    }
    // the last checkpoint, and a preemption's (after the one in flight), are complete on disk
    // before the run ends
    if (last || stop) checkpointer.wait();
    if (stop) {
      metrics.flush();
      log("preempted (signal %d) after step %lld: checkpoint written; exiting with %d so the "
          "job script requeues; checkpoint.resume = auto continues from here\n",
          preempt.signal_seen(), static_cast<long long>(step), kExitRequeue);
      return kExitRequeue;
    }
  }
  if (stepper.graphs_enabled())
    log("CUDA graphs: %lld captured, replayed for the steps after the first two\n",
        static_cast<long long>(stepper.graph_captures()));
  benchmark.report_bubble(&metrics);
  metrics.set_attribute("peak_device_memory_bytes", double(be.peak_memory_bytes()));
  metrics.set_attribute("checkpoint_write_GBps", checkpointer.stats().write_gbs);
  metrics.flush();
  log("done: %lld steps in %s, final loss %.4f; outputs in %s\n",
      static_cast<long long>(step - first_step), fmt_duration(now_s() - t_start).c_str(),
      last_loss, deck.run.out_dir.c_str());
  return 0;
}

}  // namespace vitgrid
