// Checkpointer: parameters in and out: initial parameters, checkpoint shards, save / load
// (resume included) and the free-space check before a run writes anything.
#include <sys/statvfs.h>

#include <algorithm>
#include <cstdio>
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
  host.assign(n * (1 + st.size()), 0.0f);
  std::vector<TensorShard> out;
  const bool data_root = grid.rank(Axis::Data) == 0;
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
      bool root = data_root;
      for (Axis a : p.shard.replicated_over) root = root && grid.rank(a) == 0;
      s.write = root;
      out.push_back(std::move(s));
    }
  }
  return out;
}

void Checkpointer::save() {
  const Deck& deck = run_.deck;
  const ProcessGrid& grid = *run_.grid;
  Optimizer& opt = *run_.opt;
  const int64_t step = run_.step;
  std::vector<float> host;
  auto sh = shards(host, true);
  const size_t n = run_.model->num_local_params();
  // global form whatever the layout (ZeRO: the pieces gathered over the data axis, the
  // masters' too with 16-bit activations)
  opt.master_to_host(run_.model->master(), host.data());
  auto st = opt.state();
  for (size_t k = 0; k < st.size(); ++k) opt.state_to_host(k, host.data() + (k + 1) * n);
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
  {
    WatchdogWait w("the MPI barrier before a checkpoint");
    MPI_Barrier(run_.world);
  }
  const double t0 = now_s();
  const std::string path =
      write_checkpoint(run_.world, dir(), step, sh, meta, deck.checkpoint.keep);
  const double dt = now_s() - t0;
  const double gb = bytes() / 1e9;
  stats_.write_gbs = gb / std::max(dt, 1e-9);
  run_.log("checkpoint %s written: %.3f GB in %.2f s (%.2f GB/s)\n", path.c_str(), gb, dt,
           stats_.write_gbs);
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
