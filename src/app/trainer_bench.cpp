// Benchmark: bench() (timed training steps on one fixed batch, the op profile with --profile)
// and the measured pipeline bubble report (train's too).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "trainer_impl.h"
#include "vitgrid/core/watchdog.h"
#include "vitgrid/parallel/pipeline.h"
#ifdef VITGRID_HAVE_CUDA
#include "vitgrid/backend/cuda/cuda_backend.h"
#endif

namespace vitgrid {
namespace trainer_detail {
namespace {

// Writes whole MiB of a fixed pattern (at least `bytes`) to a new file `path`, with O_DIRECT
// where the file system takes it (else through the page cache), then fsync, and removes the
// file: the seconds from the first write to the end of the fsync. *bytes_written and *direct
// say what was done. Throws UserError naming the file when it cannot be written.
double probe_write(const std::string& path, size_t bytes, size_t* bytes_written, bool* direct) {
  constexpr size_t kChunk = size_t(1) << 20;  // O_DIRECT: aligned buffer, whole blocks
  const size_t chunks = std::max<size_t>(1, (bytes + kChunk - 1) / kChunk);
  void* p = nullptr;
  if (posix_memalign(&p, 4096, kChunk) != 0) throw std::bad_alloc();
  std::unique_ptr<void, decltype(&std::free)> buf(p, &std::free);
  std::memset(p, 0x5a, kChunk);
  auto fail = [&](const char* what, int err) {
    unlink(path.c_str());
    throw UserError("bench --checkpoint: " + std::string(what) + " " + path + ": " +
                    std::strerror(err));
  };
  for (bool use_direct : {true, false}) {
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | (use_direct ? O_DIRECT : 0),
                        0600);
    if (fd < 0) {
      if (use_direct && errno == EINVAL) continue;  // a file system without O_DIRECT (tmpfs)
      fail("cannot create", errno);
    }
    const double t0 = now_s();
    size_t c = 0;
    while (c < chunks && write(fd, p, kChunk) == static_cast<ssize_t>(kChunk)) ++c;
    const int err = errno;
    const bool synced = c == chunks && fsync(fd) == 0;
    const double dt = now_s() - t0;
    close(fd);
    if (!synced) {
      if (use_direct && c == 0 && err == EINVAL) continue;  // O_DIRECT refused at the write
      fail("writing", c == chunks ? errno : err);
    }
    unlink(path.c_str());
    *bytes_written = chunks * kChunk;
    *direct = use_direct;
    return dt;
  }
  fail("writing", EINVAL);
  return 0.0;
}

}  // namespace

using trainer_util::fmt_flops;

// Called by all ranks: the measured bubble of each stage (device time outside its forward /
// backward ops over the time of the steps so far, summed over the stage's ranks), logged beside the
// schedule's theoretical bubble; with `metrics`, also stored as root attributes
// bubble_fraction_stage<k> and bubble_fraction_theoretical.
void Benchmark::report_bubble(MetricsWriter* metrics) {
  const int P = run_.grid->size(Axis::Pipeline), s = run_.grid->rank(Axis::Pipeline);
  if (P == 1) return;
  PipelineRunner& pipe = *run_.pipe;
  std::vector<double> v(2 * P, 0.0);
  v[s] = pipe.wait_seconds();
  v[P + s] = pipe.total_seconds();
  WatchdogWait w("the MPI all-reduce of the pipeline bubble");
  MPI_Allreduce(MPI_IN_PLACE, v.data(), 2 * P, MPI_DOUBLE, MPI_SUM, run_.world);
  const PipelinePlans& pl = pipe.train_plans();
  const double theory = theoretical_bubble(pl.schedule, pl.P, pl.V, pl.M);
  std::string line;
  for (int k = 0; k < P; ++k) {
    const double f = v[k] / std::max(v[P + k], 1e-12);
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s%d %.3f", k ? ", " : "", k, f);
    line += buf;
    if (metrics) metrics->set_attribute("bubble_fraction_stage" + std::to_string(k), f);
  }
  if (metrics) metrics->set_attribute("bubble_fraction_theoretical", theory);
  run_.log(
      "pipeline bubble (device time outside forward/backward / stage time) per stage: %s; "
      "schedule %s: theoretical (P-1)/%s = %.3f, i.e. %.3f of the step; simulated %.3f\n",
      line.c_str(), pipe_schedule_name(pl.schedule),
      pl.schedule == PipeSchedule::Interleaved ? "(V*M)" : "M", theory, theory / (1 + theory),
      pl.simulated_bubble);
}

// Called by all ranks after the timed steps (bench --checkpoint): one checkpoint of the state,
// written as train() writes them, timed from the step loop's side (from the call to its
// return, on the slowest rank: how long training stops), and the disk's own rate beside it:
// the same bytes written by one writer per node (local rank 0, the node's share) into the
// checkpoint directory, with O_DIRECT where the file system takes it, fsynced and removed.
void Benchmark::checkpoint_bench(double step_s, const std::function<int()>& steps_beside) {
  const MPI_Comm world = run_.world;
  run_.be->synchronize();
  {
    WatchdogWait w("the MPI barrier before the checkpoint bench");
    MPI_Barrier(world);
  }
  const double t0 = now_s();
  ckpt_.save();
  double stall = now_s() - t0;
  const bool background = ckpt_.pending();
  double beside = 0.0;  // the mean step time of steps run while the file is written
  if (background) {
    const double t1 = now_s();
    const int n = steps_beside();
    beside = (now_s() - t1) / std::max(n, 1);
    MPI_Allreduce(MPI_IN_PLACE, &beside, 1, MPI_DOUBLE, MPI_MAX, world);
  }
  ckpt_.wait();  // in the background: the file's own time is the writer's
  MPI_Allreduce(MPI_IN_PLACE, &stall, 1, MPI_DOUBLE, MPI_MAX, world);
  const double bytes = ckpt_.bytes();
  int writer = run_.grid->local_rank() == 0 ? 1 : 0, writers = 0, rank = 0;
  MPI_Allreduce(&writer, &writers, 1, MPI_INT, MPI_SUM, world);
  MPI_Comm_rank(world, &rank);
  double dt = 0.0, written = 0.0;
  int direct = 1;
  {
    WatchdogWait w("the MPI barrier before the disk probe");
    MPI_Barrier(world);
  }
  run_.agreed([&] {
    if (!writer) return;
    size_t n = 0;
    bool d = false;
    dt = probe_write(ckpt_.dir() + "/.disk_probe." + std::to_string(rank),
                     static_cast<size_t>(bytes / writers), &n, &d);
    written = double(n);
    direct = d ? 1 : 0;
  });
  MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, world);
  MPI_Allreduce(MPI_IN_PLACE, &written, 1, MPI_DOUBLE, MPI_SUM, world);
  MPI_Allreduce(MPI_IN_PLACE, &direct, 1, MPI_INT, MPI_MIN, world);
  const double disk = written / 1e9 / std::max(dt, 1e-9);
  const double file = ckpt_.stats().write_gbs;
  char during[96] = "";
  if (background)
    std::snprintf(during, sizeof during, " | steps during the write %.2f ms (%.2f ms before)",
                  beside * 1e3, step_s * 1e3);
  run_.log("checkpoint bench | %.4g GB | %s | step loop stopped %.4g s | file written at %.3g "
           "GB/s | disk %.3g GB/s (%s, %d writer%s, %.4g GB) | file at %.0f%% of the disk%s | "
           "rank 0's write: %s\n",
           bytes / 1e9, background ? "background" : "synchronous", stall, file, disk,
           direct ? "O_DIRECT" : "page cache + fsync", writers,
           writers == 1 ? "" : "s", written / 1e9, 100.0 * file / std::max(disk, 1e-12), during,
           ckpt_.write_times_text().c_str());
}

// Called by all ranks after setup(true, with_profile) and the initial parameters.
int Benchmark::bench(int warmup, int steps, double peak_tflops, bool with_profile,
                     bool with_checkpoint) {
  const Deck& deck = run_.deck;
  const ProcessGrid& grid = *run_.grid;
  Backend& be = *run_.be;
  const Log& log = run_.log;
  const MPI_Comm world = run_.world;
  const ViTConfig& cfg = run_.cfg;
  const int64_t G = deck.data.global_batch;
  // one real batch from the loader, reused: times the model, not the input pipeline
  DataLoader loader(run_.train_ds, in_.loader_config(true), 0);
  Inputs::LoaderScope bound(in_, loader);
  auto hb = loader.next();
  LrSchedule sched(deck.optim, warmup + steps, 0);
  stepper_.feed([&hb] { return hb; }, 0);  // as in train(): the next micro-batch's upload overlaps
  // exactly the training step (clipping, readback and CUDA graphs included)
  auto one_step = [&](int64_t s) { stepper_.enqueue_step(s, sched.at(s + 1), true); };
  // the two upload slots' graphs are captured in the third and fourth step
  if (stepper_.graphs_enabled() && warmup < 4) {
    log("bench: --warmup=%d raised to 4 (CUDA graphs are captured in steps 3 and 4)\n", warmup);
    warmup = 4;
  }
  if (with_checkpoint) ckpt_.prepare();  // as train() does before its first step
  const int64_t allocs0 = be.device_allocations();  // setup() planned the workspace
  for (int s = 0; s < warmup; ++s) one_step(s);
  be.synchronize();
  const int64_t allocs1 = be.device_allocations();
  run_.pipe->reset_timers();  // the bubble of the timed steps only
  MPI_Barrier(world);
  const double t0 = now_s();
  for (int s = 0; s < steps; ++s) one_step(warmup + s);
  be.synchronize();
  int64_t done = warmup + steps;  // steps the state has taken (a checkpoint's step)
  double dt = (now_s() - t0) / std::max(steps, 1);
  // device allocations from step 1 on, and in the timed steps only (the most of any rank)
  long long allocs[2] = {static_cast<long long>(be.device_allocations() - allocs0),
                         static_cast<long long>(be.device_allocations() - allocs1)};
  MPI_Allreduce(MPI_IN_PLACE, allocs, 2, MPI_LONG_LONG, MPI_MAX, world);
  MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, world);
  double mem = double(be.peak_memory_bytes()), mem_max = mem;
  MPI_Allreduce(MPI_IN_PLACE, &mem_max, 1, MPI_DOUBLE, MPI_MAX, world);
  report_bubble(nullptr);
  if (with_profile) {
    // a few more steps with every op synchronised and timed: where the time goes
    const int ps = 3;
    be.synchronize();
    be.op_profile().reset();
    be.op_profile().set_enabled(true);
    const double p0 = now_s();
    for (int s = 0; s < ps; ++s) one_step(warmup + steps + s);
    done += ps;
    be.synchronize();
    const double pdt = (now_s() - p0) / ps;
    be.op_profile().set_enabled(false);
    log("profile (rank 0, %d steps, every op synchronised: %.2f ms/step vs %.2f ms "
        "unsynchronised)\n%s",
        ps, pdt * 1e3, dt * 1e3, be.op_profile().table(ps).c_str());
  }
  const double ips = double(G) / dt;
  const double tflops = ips * cfg.train_flops_per_sample() / 1e12;
  const double per_dev = tflops / grid.world_size();
  std::string attention = be.name();  // the CPU backend has one attention path
#ifdef VITGRID_HAVE_CUDA
  if (be.name() == "cuda")  // this rank's micro-batch shape
    attention = cuda_attention_path(be, run_.micro, cfg.tokens(), run_.tp->local_heads(cfg.heads),
                                    cfg.head_dim());
#endif
  // MFU against the peak dense TFLOP/s of one device: --peak-tflops, else on the cuda backend
  // H100/H200's (bf16/fp16 989, tf32 494, fp32 67; fp8 against the bf16 peak, as Transformer
  // Engine's users count it). A CPU's peak depends on the machine and
  // its cores: no MFU unless given.
  if (peak_tflops <= 0.0 && be.name() == "cuda") {
    const std::string& m = deck.precision.mode;
    peak_tflops = (m == "bf16" || m == "fp16" || m == "fp16-naive" || m == "fp8") ? 989.0
                  : m == "tf32"                                     ? 494.0
                                                                    : 67.0;
  }
  char mfu[96];
  if (peak_tflops > 0.0)
    std::snprintf(mfu, sizeof mfu, "MFU %.2f%% (peak %g TFLOP/s)", 100.0 * per_dev / peak_tflops,
                  peak_tflops);
  else
    std::snprintf(mfu, sizeof mfu,
                  "MFU n/a (no known peak for the %s backend; give --peak-tflops=X)",
                  be.name().c_str());
  log("bench | %s | %s | %s | world %d | global batch %lld | step %.2f ms | %.1f img/s | "
      "%.1f img/s/device | %s/device | %s | peak mem %.2f GiB (%.3f MiB) | zero %d | grad "
      "buckets %zu%s | allocs from step 1 %lld | allocs in timed steps %lld | attention %s | "
      "cuda graphs %lld\n",
      deck.model.preset.c_str(), deck.precision.mode.c_str(), be.name().c_str(), grid.world_size(),
      static_cast<long long>(G), dt * 1e3, ips, ips / grid.world_size(),
      fmt_flops(per_dev * 1e12).c_str(), mfu, mem_max / 1073741824.0, mem_max / 1048576.0,
      run_.zero ? 1 : 0, run_.reducer->buckets().size(), run_.overlap ? " overlapped" : "",
      allocs[0], allocs[1], attention.c_str(), static_cast<long long>(stepper_.graph_captures()));
  if (with_checkpoint) {
    run_.step = done;
    // with a background write: as many steps again while it is written, their mean beside
    // the timed steps' (what the writer costs the training it runs beside)
    checkpoint_bench(dt, [&] {
      for (int s = 0; s < steps; ++s) one_step(done + s);
      be.synchronize();
      return steps;
    });
  }
  return 0;
}

}  // namespace trainer_detail
}  // namespace vitgrid
