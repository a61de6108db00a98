// Trainer: construction, teardown and the public methods, each handing over to Trainer::Impl
// (trainer_impl.h lists the files of its jobs), and the helpers those files share.
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
  if (be) {
    // graphs first: NCCL keeps a communicator used by a captured graph alive (and its
    // destruction waiting) until the graph is gone, and the collectives go before the backend
    be->drop_graphs();
    be->synchronize();
    for (void* p : in.d_raw)
      if (p) be->release(p);
    if (in.d_images) be->release(in.d_images);
    if (d_step) be->release(d_step);
    if (d_grad_stage) be->release(d_grad_stage);
  }
}

Trainer::Trainer(MPI_Comm world, const Deck& deck) : impl_(std::make_unique<Impl>(world, deck)) {}
Trainer::~Trainer() = default;
int Trainer::train() { return impl_->train(); }
int Trainer::evaluate_only() { return impl_->evaluate_only(); }
int Trainer::predict() { return impl_->predict(); }
int Trainer::bench(int warmup, int steps, double peak, bool profile) {
  return impl_->bench(warmup, steps, peak, profile);
}

}  // namespace vitgrid
