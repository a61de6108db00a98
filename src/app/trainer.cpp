// Trainer and Trainer::Impl: construction, setup (the Run, then the jobs' buffers), teardown
// and the public methods, each handing over to its job (trainer_impl.h lists their files), and
// the helpers those files share.
#include "vitgrid/app/trainer.h"

#include <sys/stat.h>

#include <cstdio>
#include <sstream>
#include <string>

#include "trainer_impl.h"
#include "vitgrid/core/watchdog.h"

namespace vitgrid {
namespace trainer_util {

// Model FLOP rate with a unit that suits it (CPU ranks run at GFLOP/s, GPUs at TFLOP/s).
std::string fmt_flops(double flops_per_s) {
  char buf[32];
  if (flops_per_s >= 1e12)
    std::snprintf(buf, sizeof buf, "%.1f TFLOP/s", flops_per_s / 1e12);
  else
    std::snprintf(buf, sizeof buf, "%.1f GFLOP/s", flops_per_s / 1e9);
  return buf;
}

std::string fmt_duration(double s) {
  if (!(s >= 0.0) || s > 1e8) return "--";
  const long t = static_cast<long>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, (t / 60) % 60);
  else if (t >= 60)
    std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%lds", t);
  return buf;
}

void mkdirs(const std::string& path) {
  std::string cur;
  std::stringstream ss(path);
  std::string part;
  if (!path.empty() && path[0] == '/') cur = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    cur += part + "/";
    ::mkdir(cur.c_str(), 0755);
  }
}

}  // namespace trainer_util

Trainer::Impl::~Impl() {
  stop_watchdog();
  // graphs first: NCCL keeps a communicator used by a captured graph alive (and its
  // destruction waiting) until the graph is gone, and the collectives go before the backend;
  // then each job releases its device buffers (the members' destructors, in reverse order)
  if (run.be) {
    run.be->drop_graphs();
    run.be->synchronize();
  }
}

void Trainer::Impl::setup(bool training, bool profiling) {
  run.setup(training);
  inputs.setup();
  stepper.setup(training, profiling);
  run.plan_workspace();
}

int Trainer::Impl::evaluate_only() {
  setup(false);
  checkpointer.init_params();
  checkpointer.load(run.deck.checkpoint.load, false);
  return evaluator.evaluate_only();
}

int Trainer::Impl::predict() {
  setup(false);
  checkpointer.init_params();
  checkpointer.load(run.deck.checkpoint.load, false);
  return evaluator.predict();
}

int Trainer::Impl::bench(int warmup, int steps, double peak_tflops, bool with_profile,
                         bool with_checkpoint) {
  setup(true, with_profile);
  checkpointer.init_params();
  return benchmark.bench(warmup, steps, peak_tflops, with_profile, with_checkpoint);
}

Trainer::Trainer(MPI_Comm world, const Deck& deck) : impl_(std::make_unique<Impl>(world, deck)) {}
Trainer::~Trainer() = default;
int Trainer::train() { return impl_->train(); }
int Trainer::evaluate_only() { return impl_->evaluate_only(); }
int Trainer::predict() { return impl_->predict(); }
int Trainer::bench(int warmup, int steps, double peak, bool profile, bool checkpoint) {
  return impl_->bench(warmup, steps, peak, profile, checkpoint);
}

}  // namespace vitgrid
