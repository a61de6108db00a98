// Checkpointer: parameters in and out: initial parameters, checkpoint shards, save / load
// (resume included) and the free-space check before a run writes anything.
#include <sys/statvfs.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "trainer_impl.h"
#include "vitgrid/core/watchdog.h"

namespace vitgrid {
namespace trainer_detail {

// Parameters from a flat host copy into the model and, when it holds the masters' pieces
// (ZeRO-1 with 16-bit activations), the optimizer.
void Checkpointer::set_params(const float* host) {
  run_.model->set_params(host);
  if (run_.opt) run_.opt->master_from_host(host);
}

void Checkpointer::init_params() {
  set_params(run_.model->initial_params(run_.deck.run.seed).data());
}

// ---- checkpoints
std::string Checkpointer::dir() const { return run_.deck.run.out_dir + "/checkpoints"; }

// Shards of every parameter (and optimizer state) with host staging buffers.
std::vector<TensorShard> Checkpointer::shards(std::vector<float>& host, bool with_optim) {
  const ViT& model = *run_.model;
  const ProcessGrid& grid = *run_.grid;
  Optimizer* opt = run_.opt.get();
  const size_t n = model.num_local_params();
  std::vector<std::pair<std::string, float*>> st;
  if (with_optim && opt) st = opt->state();
  // every element is written below or by the copies that follow (prepare()'s buffer is reused
  // as it is: no page of it touched again before the copies)
  if (host.size() != n * (1 + st.size())) host.assign(n * (1 + st.size()), 0.0f);
  std::vector<TensorShard> out;
  // Each tensor is written by one data replica (they all hold it): the one with the fewest
  // bytes so far, in the same order on every replica, so that D replicas write a D-th each.
  const int data_ranks = grid.size(Axis::Data), data_rank = grid.rank(Axis::Data);
  std::vector<int64_t> replica_bytes(data_ranks, 0);
  // Every rank lists every tensor of the model (dataset creation is collective); a
  // pipeline stage selects nothing of the layers it does not hold.
  std::map<std::string, const ParamInfo*> held;
  for (const auto& p : model.params()) held[p.name] = &p;
  for (size_t k = 0; k <= st.size(); ++k) {
    for (const auto& g : model.all_param_names()) {
      TensorShard s;
      s.name = k == 0 ? "model/" + g.name : "optim/" + g.name + "/" + st[k - 1].first;
      s.global_shape = g.global_shape;
      auto it = held.find(g.name);
      if (it == held.end()) {
        s.offset.assign(g.global_shape.size(), 0);
        s.count.assign(g.global_shape.size(), 0);
        s.write = false;
        out.push_back(std::move(s));
        continue;
      }
      const ParamInfo& p = *it->second;
      s.offset = p.shard.offset;
      s.count = p.shard.count;
      s.stride = p.shard.stride;
      s.block = p.shard.block;
      s.data = host.data() + k * n + p.offset;
      const int writer = static_cast<int>(
          std::min_element(replica_bytes.begin(), replica_bytes.end()) - replica_bytes.begin());
      replica_bytes[writer] += s.elements();
      bool root = writer == data_rank;
      for (Axis a : p.shard.replicated_over) root = root && grid.rank(a) == 0;
      s.write = root;
      out.push_back(std::move(s));
    }
  }
  // FP8's delayed-scaling state, whole on every rank (its amaxes are reduced over all of
  // them): fp8/amax_history [tensors, history] (entry 0 the step in progress, entry k the
  // step k updates ago) and fp8/scale [tensors], tensor (block * 4 + linear) * 3 + x|W|dy
  if (with_optim && model.fp8()) {
    const Fp8ScalingState& f = model.fp8_scaling();
    const int64_t T = static_cast<int64_t>(f.tensors()), H = f.history();
    fp8_host_.resize(static_cast<size_t>(T * (H + 1)));
    auto whole = [&](const char* name, std::vector<int64_t> shape, float* data) {
      TensorShard s;
      s.name = name;
      s.global_shape = shape;
      s.offset.assign(shape.size(), 0);
      s.count = shape;
      s.data = data;
      s.write = grid.world_rank() == 0;
      s.optional = true;  // a checkpoint of a bf16 run continues in fp8 from fresh scales
      out.push_back(std::move(s));
    };
    whole("fp8/amax_history", {T, H}, fp8_host_.data());
    whole("fp8/scale", {T}, fp8_host_.data() + T * H);
  }
  return out;
}

int Checkpointer::direct_threads() const {
  const CheckpointSection& c = run_.deck.checkpoint;
  return c.direct_io ? c.direct_threads : 0;
}

// checkpoint.async: true, or auto on the CUDA backend; only where MPI gives every thread its
// calls (MPI_THREAD_MULTIPLE), else the checkpoints are written before save() returns.
bool Checkpointer::async() const {
  const std::string& a = run_.deck.checkpoint.async;
  if (a == "false" || (a == "auto" && run_.be->name() != "cuda")) return false;
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  if (level == MPI_THREAD_MULTIPLE) return true;
  static bool said = false;
  if (!said)
    run_.log("checkpoint.async = %s: this MPI library does not give threads their own calls "
             "(MPI_THREAD_MULTIPLE); checkpoints are written synchronously\n", a.c_str());
  said = true;
  return false;
}

void Checkpointer::save() {
  wait();  // at most one write in flight
  const Deck& deck = run_.deck;
  const ProcessGrid& grid = *run_.grid;
  Optimizer& opt = *run_.opt;
  const int64_t step = run_.step;
  const bool background = async();
  const double t_stop = now_s();
  std::vector<float> local;
  std::vector<float>& host = background ? host_ : local;
  if (background) prepare();
  auto sh = shards(host, true);
  const size_t n = run_.model->num_local_params();
  // global form whatever the layout (ZeRO: the pieces gathered over the data axis, the
  // masters' too with 16-bit activations)
  opt.master_to_host(run_.model->master(), host.data());
  auto st = opt.state();
  for (size_t k = 0; k < st.size(); ++k) opt.state_to_host(k, host.data() + (k + 1) * n);
  if (run_.model->fp8()) {
    const Fp8ScalingState& f = run_.model->fp8_scaling();
    const std::vector<float> h = f.amax_history();  // in time order, from the ring
    std::copy(h.begin(), h.end(), fp8_host_.begin());
    std::copy(f.scales().begin(), f.scales().end(), fp8_host_.begin() + h.size());
  }
  CheckpointMeta meta;
  meta.deck = deck.resolved_text();
  meta.grid = {grid.shape().pipeline, grid.shape().data, grid.shape().tensor};
  meta.tensor_mode = grid.shape().tensor > 1 ? tensor_mode_name(grid.shape().mode) : "none";
  meta.backend = run_.be->name();
  meta.world_size = grid.world_size();
  meta.state["step"] = {double(step)};
  meta.state["applied_steps"] = {double(run_.applied)};
  meta.state["epoch"] = {double(step) * deck.data.global_batch / double(run_.train_ds->size())};
  meta.state["sample_cursor"] = {double(step) * deck.data.global_batch};
  meta.state["seed"] = {double(deck.run.seed)};
  meta.state["loss_scale"] = {double(run_.scaler->scale())};
  meta.state["scaler_good_steps"] = {double(run_.scaler->good_steps())};
  // Room for the whole file first, agreed by every rank: a write that meets a full disk inside
  // parallel HDF5's collective flush can leave the ranks in different barriers for good (HDF5
  // 1.10 returns early on the rank that saw the error).
  run_.agreed([&] { check_free_space(dir() + "/" + step_file_name(step)); });
  if (background) {
    // The writer's collectives run on a communicator of their own, beside the main thread's.
    if (io_comm_ == MPI_COMM_NULL) MPI_Comm_dup(run_.world, &io_comm_);
    writer_done_.store(false);
    writer_error_ = nullptr;
    writer_path_.clear();
    writer_ = std::thread([this, sh = std::move(sh), meta = std::move(meta), step,
                           keep = deck.checkpoint.keep, direct = direct_threads(),
                           d = dir()] {
      WatchdogOff unwatched;  // the main thread's wait() is what may hang
      const double t0 = now_s();
      try {
        writer_path_ = write_checkpoint(io_comm_, d, step, sh, meta, keep, direct, &writer_times_);
      } catch (...) {
        writer_error_ = std::current_exception();
      }
      writer_s_ = now_s() - t0;
      writer_done_.store(true, std::memory_order_release);
    });
    // a run that ends with an agreed error (fail_all) before the next wait lets it finish first
    set_before_finalize([this] {
      if (writer_.joinable()) writer_.join();
    });
    stats_.stall_s = now_s() - t_stop;
    return;
  }
  {
    WatchdogWait w("the MPI barrier before a checkpoint");
    MPI_Barrier(run_.world);
  }
  const double t0 = now_s();
  const std::string path =
      write_checkpoint(run_.world, dir(), step, sh, meta, deck.checkpoint.keep, direct_threads(),
                       &stats_.write_times);
  const double dt = now_s() - t0;
  const double gb = bytes() / 1e9;
  stats_.write_gbs = gb / std::max(dt, 1e-9);
  stats_.stall_s = now_s() - t_stop;
  run_.log("checkpoint %s written: %.3f GB in %.2f s (%.2f GB/s; %s)\n", path.c_str(), gb, dt,
           stats_.write_gbs, write_times_text().c_str());
}

void Checkpointer::prepare() {
  if (!async() || !run_.opt) return;
  const size_t need = run_.model->num_local_params() * (1 + run_.opt->state().size());
  if (host_.size() == need) return;
  // allocated, faulted in and page-locked once (the size never changes within a run), so that
  // a checkpoint's copies run at the bus's speed and touch no new page
  if (pinned_) run_.be->pin_host(pinned_, pinned_bytes_, false);
  pinned_ = nullptr;
  host_.assign(need, 0.0f);
  pinned_bytes_ = need * sizeof(float);
  run_.be->pin_host(host_.data(), pinned_bytes_, true);
  pinned_ = host_.data();
}

void Checkpointer::poll() {
  if (!pending()) return;
  int done = writer_done_.load(std::memory_order_acquire) ? 1 : 0;
  watched("the MPI all-reduce of the background checkpoint's progress", [&] {
    MPI_Allreduce(MPI_IN_PLACE, &done, 1, MPI_INT, MPI_MIN, run_.world);
  });
  if (!done) return;
  writer_.join();
  end_write();
}

void Checkpointer::wait() {
  if (!pending()) return;
  // Not watched: a whole write may outlast device.comm_timeout; the writer's collectives
  // involve only the writers, which finish whatever the main threads do.
  writer_.join();
  end_write();
}

void Checkpointer::end_write() {
  set_before_finalize(nullptr);
  run_.agreed([&] {
    if (writer_error_) std::rethrow_exception(std::exchange(writer_error_, nullptr));
  });
  const double gb = bytes() / 1e9;
  stats_.write_gbs = gb / std::max(writer_s_, 1e-9);
  stats_.write_times = writer_times_;
  run_.log("checkpoint %s written in the background: %.3f GB in %.2f s (%.2f GB/s; %s); the "
           "step loop stopped %.3f s for it\n",
           writer_path_.c_str(), gb, writer_s_, stats_.write_gbs, write_times_text().c_str(),
           stats_.stall_s);
}

Checkpointer::~Checkpointer() {
  set_before_finalize(nullptr);
  if (writer_.joinable()) writer_.join();
  try {
    if (pinned_) run_.be->pin_host(pinned_, pinned_bytes_, false);
  } catch (...) {  // a failed device: the process is ending with its own message
  }
  if (io_comm_ != MPI_COMM_NULL) MPI_Comm_free(&io_comm_);
}

std::string Checkpointer::write_times_text() const {
  const CheckpointWriteTimes& t = stats_.write_times;
  char buf[160];
  std::snprintf(buf, sizeof buf, "hash %.2f s, HDF5 %.2f s, direct %.2f s, rename %.2f s", t.hash,
                t.hdf5, t.direct, t.publish);
  return buf;
}

// Bytes of one checkpoint of this run: every parameter and optimizer state in fp32.
double Checkpointer::bytes() const {
  return double(run_.model->num_global_params()) * 4.0 *
         (1 + (run_.opt ? run_.opt->state().size() : 0));
}

// Called by all ranks before the run writes anything: a run whose out_dir cannot hold one
// checkpoint is refused now, not after hours of training (a full disk found mid-write ends
// the run too, but only after the work since the last checkpoint).
// Rank 0 looks; agreed() gives its verdict to every rank.
void Checkpointer::check_free_space(const std::string& checkpoint) {
  const std::string& out_dir = run_.deck.run.out_dir;
  struct statvfs v {};
  if (run_.grid->world_rank() != 0 || ::statvfs(out_dir.c_str(), &v) != 0) return;
  const double free_b = double(v.f_bavail) * double(v.f_frsize);
  const double need = bytes() * 1.02 + 262144.0;  // + metadata and metrics
  if (free_b >= need) return;
  char buf[512];
  if (checkpoint.empty())
    std::snprintf(buf, sizeof buf,
                  "run.out_dir '%s': no space left on device: %.1f MB free on its file system, a "
                  "checkpoint of this run needs %.1f MB; free space or choose another run.out_dir",
                  out_dir.c_str(), free_b / 1e6, need / 1e6);
  else
    std::snprintf(buf, sizeof buf,
                  "checkpoint '%s' not written: no space left on device (%.1f MB free on the file "
                  "system of run.out_dir '%s', the checkpoint needs %.1f MB); earlier checkpoints "
                  "are kept",
                  checkpoint.c_str(), free_b / 1e6, out_dir.c_str(), need / 1e6);
  throw UserError(buf);
}

// Loads parameters (and optimizer state + counters when `full`) from `path`; with `resume`,
// from the newest checkpoint in the directory `path` that can be resumed from (false: the
// directory holds none).
bool Checkpointer::load(std::string path, bool full, bool resume) {
  std::vector<float> host;
  auto sh = shards(host, full);
  CheckpointMeta meta;
  const double t0 = now_s();
  run_.agreed([&] {
    if (resume)
      path = resume_checkpoint(run_.world, path, sh, &meta);
    else
      read_checkpoint(run_.world, path, sh, &meta);
  });
  if (path.empty()) return false;
  const double dt = now_s() - t0;
  const size_t n = run_.model->num_local_params();
  set_params(host.data());
  if (full) {
    auto st = run_.opt->state();
    for (size_t k = 0; k < st.size(); ++k)
      run_.opt->state_from_host(k, host.data() + (k + 1) * n);
    auto get = [&](const char* k) {
      auto it = meta.state.find(k);
      return it == meta.state.end() || it->second.empty() ? 0.0 : it->second[0];
    };
    LossScaler& scaler = *run_.scaler;
    run_.step = static_cast<int64_t>(get("step"));
    run_.applied = static_cast<int64_t>(get("applied_steps"));
    scaler.restore(get("loss_scale") > 0 ? get("loss_scale") : scaler.scale(),
                   static_cast<int64_t>(get("scaler_good_steps")));
    const bool fp8_found = std::all_of(sh.begin(), sh.end(), [](const TensorShard& s) {
      return s.found || s.name.rfind("fp8/", 0) != 0;
    });
    if (run_.model->fp8() && !fp8_found)
      run_.log("checkpoint %s holds no FP8 scaling state (written in another precision): the "
               "FP8 scales start at 1, the amax history empty\n", path.c_str());
    if (run_.model->fp8() && fp8_found) {
      Fp8ScalingState& f = run_.model->fp8_scaling();
      const size_t h = f.tensors() * static_cast<size_t>(f.history());
      f.restore(std::vector<float>(fp8_host_.begin(), fp8_host_.begin() + h),
                std::vector<float>(fp8_host_.begin() + h, fp8_host_.end()));
      run_.model->fp8_upload_scales();
    }
  }
  const double gb = double(run_.model->num_global_params()) * 4.0 *
                    (full ? 1 + run_.opt->state().size() : 1) / 1e9;
  stats_.read_gbs = gb / std::max(dt, 1e-9);
  run_.log("checkpoint %s loaded%s: %.3f GB in %.2f s (%.2f GB/s)\n", path.c_str(),
           full ? " (resuming)" : "", gb, dt, stats_.read_gbs);
  return true;
}

}  // namespace trainer_detail
}  // namespace vitgrid
