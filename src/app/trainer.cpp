#include "vitgrid/app/trainer.h"

#include "vitgrid/app/preempt.h"

#include "vitgrid_commit.h"  // generated at build time (src/app/CMakeLists.txt)

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/image_decoder.h"
#include "vitgrid/backend/profile.h"
#include "vitgrid/core/error.h"
#include "vitgrid/core/log.h"
#include "vitgrid/core/watchdog.h"
#include "vitgrid/data/dataset.h"
#include "vitgrid/data/image_source.h"
#include "vitgrid/grid/grid.h"
#include "vitgrid/io/checkpoint.h"
#include "vitgrid/io/metrics.h"
#include "vitgrid/model/pipeline_runner.h"
#include "vitgrid/model/vit.h"
#include "vitgrid/model/workspace_plan.h"
#include "vitgrid/optim/grad_reduce.h"
#include "vitgrid/optim/optimizer.h"
#include "vitgrid/parallel/pipeline.h"
#include "vitgrid/parallel/tensor_parallel.h"
#ifdef VITGRID_HAVE_CUDA
#include "vitgrid/backend/cuda/cuda_backend.h"
#endif

namespace vitgrid {
namespace {

DType act_dtype_of(const std::string& mode) {
  if (mode == "bf16") return DType::BF16;
  if (mode == "fp16" || mode == "fp16-naive") return DType::F16;
  return DType::F32;
}

// The deck's device.attention / device.fused_gelu (validated against their choices).
AttentionMode attention_mode_of(const std::string& v) {
  if (v == "cudnn") return AttentionMode::Cudnn;
  if (v == "flash") return AttentionMode::Flash;
  if (v == "fallback") return AttentionMode::Fallback;
  return AttentionMode::Auto;
}
FusedGeluMode fused_gelu_mode_of(const std::string& v) {
  if (v == "off") return FusedGeluMode::Off;
  if (v == "on") return FusedGeluMode::On;
  return FusedGeluMode::Auto;
}

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

}  // namespace

struct Trainer::Impl {
  MPI_Comm world;
  const Deck& deck;
  Log log;
  std::unique_ptr<ProcessGrid> grid;
  std::unique_ptr<Backend> be;
  ProfiledBackend* prof = nullptr;  // set when bench --profile wraps the backend
  bool profile = false;
  std::unique_ptr<Collectives> coll;
  std::unique_ptr<TensorParallel> tp;
  Backend* compute_be = nullptr;  // be itself, or the backend inside the profiling wrapper
  ViTConfig cfg;
  std::unique_ptr<ViT> model;
  std::unique_ptr<PipelineRunner> pipe;  // every step goes through it (P = 1 included)
  int pipe_sm_margin = 0;                 // SMs the GEMMs always leave to asynchronous messages
  std::vector<int> partition;            // blocks per virtual stage
  std::unique_ptr<Optimizer> opt;
  // data-parallel gradient reduction: buckets overlapped with the backward (overlap), ZeRO-1
  std::unique_ptr<GradReducer> reducer;
  std::unique_ptr<ParamGather> gather;  // ZeRO-1's parameter gather during the forward
  ZeroShards zero_shards;
  bool zero = false, overlap = false;
  // device.data_comm = copy_engine: gradient buckets split evenly over the data ranks, as ZeRO's
  bool copy_engine = false;
  std::unique_ptr<LossScaler> scaler;
  std::shared_ptr<Dataset> train_ds, eval_ds;
  int b = 0;      // per-rank batch of one accumulation step (M pipeline micro-batches)
  int micro = 0;  // per-rank pipeline micro-batch (b / M)
  int64_t total_steps = 0, warmup_steps = 0;
  // device-side batch buffers (planned once)
  // Input upload slots: 0 and 1 alternate in training (the next micro-batch is copied while
  // the current one computes), 2 serves eval / predict. Each device buffer holds one rank
  // batch as [labels | position | soft targets | aug | images], at offsets off_*
  // (position: the step it trains in and its first sample's stream position, which key the
  // dropout masks: DeviceBatch::position). With the device's JPEG decoder the images part is
  // the decoder's: it decodes the batch's views there and copies the host-decoded rest.
  static constexpr int kUploadSlots = 3, kEvalSlot = 2;
  void* d_raw[kUploadSlots] = {nullptr, nullptr, nullptr};
  size_t off_labels = 0, off_position = 0, off_soft = 0, off_aug = 0, off_images = 0,
         raw_bytes = 0;
  ImageDecoder* decoder = nullptr;  // the device's JPEG decoder, when it decodes (data.decode)
  int decode_interp = 1;            // its resize filter (data.interpolation)
  DataLoader* loader = nullptr;     // the loader feeding start_upload (host decode fallback)
  int64_t bad_images = 0;           // undecodable images this rank replaced so far
  // Binds `loader` for a scope (the loaders live on the stack of train / evaluate / bench).
  struct LoaderScope {
    DataLoader*& slot;
    LoaderScope(DataLoader*& s, DataLoader& l) : slot(s) { slot = &l; }
    ~LoaderScope() { slot = nullptr; }
  };
  void* d_images = nullptr;
  // The training step's device scalars (one allocation), read back a step late: the loss sum
  // over the step's samples, the squared gradient norm (loss-scaled) and the factor the
  // optimizer multiplies the gradients by (clipping and 1/loss scale, Backend::clip_factor).
  struct StepScalars {
    double loss_sum = 0.0;
    double grad_sq = 0.0;
    float factor = 0.0f;
    float pad = 0.0f;
  };
  StepScalars* d_step = nullptr;
  void* d_grad_stage = nullptr;  // parallel.grad_reduce = act: the gradients in act dtype
  // What the host remembers of an enqueued step until its scalars come back (finish_step).
  struct PendingStep {
    int64_t step = 0;  // 0-based index of the step
    double lr = 0.0;
    float scale = 1.0f;
    bool applied = true;  // false: fp16 overflow, update skipped
    int readback = 0;     // readback slot of its scalars
    double input_wait_s = 0.0;  // the host waiting for its micro-batches (loader, decoder)
    double decode_wait_s = 0.0;  // ... the part spent waiting for the device's JPEG decoder
  };
  // Upload state of the training batches: the next micro-batch (already uploading into
  // `slot`) and where later ones come from (the loader; bench: the same batch again).
  std::shared_ptr<const HostBatch> next_hb;
  int slot = 0;
  std::function<std::shared_ptr<const HostBatch>()> next_batch;
  // CUDA graphs of the micro-batch bodies (use_graphs): one per combination of what a body
  // bakes in (its upload slot, first / last micro-batch of the step, the gradient scale, and
  // Mixup's soft targets), captured on the second run of its key (the first runs eagerly:
  // lazy setup, algorithm timing) and replayed after that.
  bool use_graphs = false;
  struct GraphKey {
    int slot;
    bool first, last, soft;
    float grad_scale;
    bool operator<(const GraphKey& o) const {
      return std::tie(slot, first, last, soft, grad_scale) <
             std::tie(o.slot, o.first, o.last, o.soft, o.grad_scale);
    }
  };
  std::map<GraphKey, int> graph_of;  // -1: ran once eagerly; else the backend's graph id
  int64_t graph_allocs = 0;          // device allocations when the graphs were captured
  float graph_scale = 0.0f;          // the gradient scale the graphs bake in
  int64_t graph_captures = 0;
  // state carried in checkpoints
  int64_t step = 0;     // completed optimizer steps (including skipped fp16 steps)
  int64_t applied = 0;  // applied updates (Adam bias correction)
  double ckpt_write_gbs = 0.0, ckpt_read_gbs = 0.0;
  Backend::ReplicaMax tune_agreement;  // the training steps' (set when data > 1)

  Impl(MPI_Comm w, const Deck& d) : world(w), deck(d), log(w) {}

  // Called by all ranks: turn a UserError on any rank into one message and a clean exit.
  template <class F>
  void agreed(F&& f) {
    std::string msg;
    bool ok = true;
    try {
      f();
    } catch (const UserError& e) {
      ok = false;
      msg = e.what();
    }
    if (agree_error(world, ok, &msg)) fail_all(world, msg);
  }

  void setup(bool training) {
    // a rank that stops responding ends the job instead of leaving the others waiting
    start_watchdog(deck.device.comm_timeout);
    GridShape gs;
    gs.pipeline = deck.parallel.pipeline;
    gs.data = deck.parallel.data;
    gs.tensor = deck.parallel.tensor;
    gs.mode = gs.tensor > 1 ? parse_tensor_mode(deck.parallel.tensor_mode) : TensorMode::None;
    gs.depth = deck.parallel.tensor_depth;
    gs.sequence_parallel = deck.parallel.sequence_parallel;  // the deck allows it with 1d only
    gs.sequence_chunks = deck.parallel.sequence_chunks;
    agreed([&] {
      check_grid_shape(gs, [&] { int n; MPI_Comm_size(world, &n); return n; }());
    });
    grid = std::make_unique<ProcessGrid>(world, gs);
    const std::string rank_map = grid->rank_map();
    log("vitgrid 0.1.0: %d rank%s, grid pipeline %d x data %d x tensor %d (%s)\n",
        grid->world_size(), grid->world_size() == 1 ? "" : "s", gs.pipeline, gs.data, gs.tensor,
        gs.tensor <= 1 ? "none"
                       : gs.sequence_parallel ? "1d, sequence parallel" : tensor_mode_name(gs.mode));
    log.block("---- resolved deck\n" + deck.resolved_text() + "---- rank map\n" + rank_map);

    // Backend: each rank drives the GPU of its local rank.
    std::string kind = deck.device.backend;
    agreed([&] {
      int gpus = 0;
#ifdef VITGRID_HAVE_CUDA
      gpus = cuda_device_count();
#endif
      if (kind == "auto") kind = gpus >= grid->local_size() && gpus > 0 ? "cuda" : "cpu";
      if (kind == "cuda" && gpus < grid->local_size())
        throw UserError("device.backend = cuda: host " + grid->host() + " has " +
                        std::to_string(gpus) + " GPU(s) for " +
                        std::to_string(grid->local_size()) + " local ranks");
    });
    // ranks agree on the kind (auto could differ across nodes with different GPU counts)
    int is_cuda = kind == "cuda", all_cuda = 0;
    MPI_Allreduce(&is_cuda, &all_cuda, 1, MPI_INT, MPI_MIN, world);
    kind = all_cuda ? "cuda" : "cpu";
    copy_engine = deck.device.data_comm == "copy_engine";
    agreed([&] {
      if (copy_engine && kind != "cuda")
        throw UserError("device.data_comm = copy_engine needs the cuda backend (NCCL); this "
                        "run uses the " + kind + " backend");
    });
    agreed([&] {
      BackendOptions bo;
      bo.allow_tf32 = deck.precision.mode == "tf32";
      bo.gemm_tune = deck.device.gemm_tune;
      bo.deterministic = deck.device.deterministic;
      bo.attention = attention_mode_of(deck.device.attention);
      bo.fused_gelu = fused_gelu_mode_of(deck.device.fused_gelu);
      bo.fused_gelu_forward_config = deck.device.fused_gelu_forward_config;
      bo.fused_gelu_backward_config = deck.device.fused_gelu_backward_config;
      bo.tuning_log = deck.device.tuning_log;
      be = make_backend(kind, grid->local_rank(), act_dtype_of(deck.precision.mode), bo);
      compute_be = be.get();
      if (profile) {
        auto p = make_profiled(std::move(be));
        prof = p.get();
        be = std::move(p);
      }
    });
#ifdef VITGRID_HAVE_CUDA
    if (kind == "cuda")
      coll = make_nccl_collectives(
          *grid, *compute_be,
          {deck.device.comm_timeout, deck.device.data_comm_ctas, copy_engine,
           deck.device.pipe_comm_ctas, deck.device.tensor_comm_ctas,
           deck.device.tensor_comm == "copy_engine", deck.device.nccl_blocking});
    else
#endif
      coll = make_mpi_collectives(*grid);
    if (copy_engine && grid->size(Axis::Data) > 1)
      log("data axis: gradients in NCCL symmetric memory, reduced by all-to-all + local sum + "
          "all-gather under NCCL's zero-CTA policy (device.data_comm = copy_engine)\n");
    log("backend %s, precision %s, %s\n", be->name().c_str(), deck.precision.mode.c_str(),
        kind == "cpu" && deck.precision.mode != "fp32" && deck.precision.mode != "tf32"
            ? "16-bit storage emulated on the CPU"
            : "");
    agreed([&] { tp = make_tensor_parallel(*grid, *be, *coll); });

    cfg = ViTConfig::from(deck.model);
    const int D = grid->size(Axis::Data);
    b = static_cast<int>(deck.data.global_batch / (int64_t(D) * deck.data.grad_accum));
    build_pipeline();
    log("model %s: %lld parameters, %d tokens, hidden %d, depth %d, heads %d, mlp %d, "
        "classes %d; micro-batch %d per rank, activations %.1f MiB per rank (stage 0)\n",
        deck.model.preset.c_str(), static_cast<long long>(model->num_global_params()),
        cfg.tokens(), cfg.hidden, cfg.depth, cfg.heads, cfg.mlp, cfg.classes, micro,
        model->activation_bytes() / 1048576.0);

    if (deck.data.dataset == "tfrecord") {
      // every rank indexes its share of the shards that lack an index; agreed() then waits
      // for all of them (its agreement is collective) before any rank opens the source
      int r = 0, n = 1;
      MPI_Comm_rank(world, &r);
      MPI_Comm_size(world, &n);
      agreed([&] {
        if (training) tfrecord_build_indexes(deck.data.path, tfrecord_index_dir(deck), true, r, n);
        tfrecord_build_indexes(deck.data.path, tfrecord_index_dir(deck), false, r, n);
      });
    }
    agreed([&] {
      if (training) train_ds = make_dataset(deck, true);
      eval_ds = make_dataset(deck, false);
    });
    if (training) {
      const int64_t n = train_ds->size(), G = deck.data.global_batch;
      total_steps = deck.run.steps > 0
                        ? deck.run.steps
                        : static_cast<int64_t>(std::ceil(deck.run.epochs * n / double(G)));
      warmup_steps = deck.optim.warmup_steps > 0
                         ? deck.optim.warmup_steps
                         : static_cast<int64_t>(std::llround(deck.optim.warmup_epochs * n / double(G)));
      log("data: train %s; eval %s\n", train_ds->describe().c_str(),
          eval_ds->describe().c_str());
      setup_grad_reduction();
      if (grid->size(Axis::Data) > 1) {
        // the data axis's replicas run the same operations in the same order: their timed
        // kernel choices (device.gemm_tune) are made together, on the worst replica's
        // timings, so none of them runs a slower kernel than the others; evaluate() lifts it
        const MPI_Comm dc = grid->comm(Axis::Data).get();
        tune_agreement = [dc](double* v, int n) {
          MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_DOUBLE, MPI_MAX, dc);
        };
        be->set_tune_agreement(tune_agreement);
      }
      agreed([&] {
        opt = std::make_unique<Optimizer>(deck.optim, *be, *tp, *model,
                                          zero ? &zero_shards : nullptr, coll.get(),
                                          grid->comm(Axis::Data).get());
      });
      if (zero)
        log("ZeRO-1: optimizer state%s sharded over %d data ranks: %.2f MiB per buffer per "
            "rank instead of %.2f MiB\n",
            opt->holds_master() ? " and fp32 master weights" : "", grid->size(Axis::Data),
            opt->state_elems() * 4.0 / 1048576.0, model->num_local_params() * 4.0 / 1048576.0);
    } else {
      log("data: eval %s\n", eval_ds->describe().c_str());
    }
    const bool fp16 = deck.precision.mode == "fp16" || deck.precision.mode == "fp16-naive";
    scaler = std::make_unique<LossScaler>(deck.precision, fp16);

    // batch upload buffers (soft targets only with Mixup / CutMix)
    const size_t img = static_cast<size_t>(cfg.image) * cfg.image * 3;
    const bool mixup = deck.data.mixup_alpha > 0 || deck.data.cutmix_alpha > 0;
    auto align = [](size_t n) { return (n + 255) / 256 * 256; };
    off_labels = 0;
    off_position = off_labels + align(b * sizeof(int32_t));
    off_soft = off_position + align(2 * sizeof(int64_t));
    off_aug = off_soft + (mixup ? align(static_cast<size_t>(b) * cfg.classes * sizeof(float)) : 0);
    off_images = off_aug + align(b * sizeof(SampleAug));
    raw_bytes = off_images + align(b * img);
    setup_decoder();
    for (void*& p : d_raw) p = be->alloc(raw_bytes);
    for (int k = 0; k < kUploadSlots; ++k) be->staging(k, raw_bytes);
    d_images = be->alloc(static_cast<size_t>(b) * 3 * cfg.image * cfg.image * be->act_size());
    d_step = static_cast<StepScalars*>(be->alloc(sizeof(StepScalars)));
    be->zero(d_step, sizeof(StepScalars));
    setup_graphs(training);

    // Parameters, gradients, optimizer state and activations are allocated; now the backend's
    // own workspace (reduction scratch, GEMM temporaries, optimizer tables) at the largest
    // shapes this rank's steps run, so that no step allocates.
    WorkspaceShape ws;
    ws.micro_batch = micro;
    ws.act_size = be->act_size();
    ws.optimizer = opt != nullptr;
    ws.param_tensors = model->params().size();
    ws.local_params = model->num_local_params();
    ws.grad_buckets = reducer ? reducer->buckets().size() : 0;
    agreed([&] { be->plan_workspace(workspace_plan_for(cfg, ws)); });
  }

  // Called by all ranks from setup(): the stage partition, the schedules' plans, this stage's
  // part of the model (its layers, and activation sets for the micro-batches the plans keep in
  // flight) and the runner. Every rank computes every stage's plan, so they agree without
  // talking.
  void build_pipeline() {
    const ParallelSection& pp = deck.parallel;
    const int P = grid->size(Axis::Pipeline), s = grid->rank(Axis::Pipeline);
    const int M = pp.micro_batches;
    micro = b / M;
    PipeSchedule kind = PipeSchedule::OneFOneB;
    PipelinePlans train_plans, eval_plans;
    agreed([&] {
      kind = parse_pipe_schedule(pp.schedule);
      const int V = kind == PipeSchedule::Interleaved ? pp.chunks : 1;
      // counted forward multiply-adds per sample (balanced partition): a block is the same in
      // every stage; the embedding and the head + final norm sit on the ends
      const double T = cfg.tokens(), C = cfg.hidden, Mh = cfg.mlp;
      PipeCost cost;
      cost.block = T * (4 * C * C + 2 * C * Mh) + 2 * T * T * C;
      cost.embed = double(cfg.patches()) * cfg.patch_dim() * C + T * C;
      cost.head = C * cfg.classes + 4 * C;
      partition = partition_blocks(pp.partition, cfg.depth, P, V, cost);
      train_plans = build_pipeline_plans(kind, P, V, M, true);
      eval_plans = build_pipeline_plans(kind, P, V, M, false);
    });
    const int V = train_plans.V;
    StageLayout layout;
    layout.chunks.clear();
    for (int c = 0; c < V; ++c) {
      const int k = c * P + s;  // virtual stage
      int first = 0;
      for (int i = 0; i < k; ++i) first += partition[i];
      layout.chunks.push_back({first, partition[k]});
    }
    layout.embed = s == 0;
    layout.head = s == P - 1;
    layout.sets = std::max(train_plans.stages[s].num_slots, eval_plans.stages[s].num_slots);
    // ZeRO-1 splits every gradient bucket evenly over the data ranks, in 16-element pieces
    const int D = grid->size(Axis::Data);
    zero = deck.parallel.zero == 1 && D > 1;
    layout.pad_to = even_split();
    // with 16-bit activations the optimizer keeps this rank's pieces of the fp32 masters
    layout.master_elsewhere = zero;
    // planned memory is allocated here: running out is reported once, on every rank
    agreed([&] { model = std::make_unique<ViT>(cfg, *be, *tp, micro, layout); });
    if (P > 1 || M > 1) {
      std::string parts;
      for (size_t k = 0; k < partition.size(); ++k)
        parts += (k ? "," : "") + std::to_string(partition[k]);
      // every stage's sets, gathered for the log (rank 0 is stage 0)
      std::vector<int> sets(P, 0);
      sets[s] = layout.sets;
      MPI_Allreduce(MPI_IN_PLACE, sets.data(), P, MPI_INT, MPI_MAX, world);
      std::string set_list;
      for (int k = 0; k < P; ++k) set_list += (k ? "," : "") + std::to_string(sets[k]);
      log("pipeline: %d stages x %d chunk(s), schedule %s, %d micro-batches of %d per rank; "
          "blocks per virtual stage %s (partition %s); activation sets per stage %s; bubble "
          "(P-1)/%s = %.3f, simulated idle fraction %.3f; messages %s\n",
          P, V, pipe_schedule_name(kind), M, micro, parts.c_str(), pp.partition.c_str(),
          set_list.c_str(), kind == PipeSchedule::Interleaved ? "(V*M)" : "M",
          theoretical_bubble(kind, P, V, M), train_plans.simulated_bubble,
          train_plans.messages == PipelinePlans::Messages::Async
              ? "asynchronous (the grouped placement cannot run this order at its bubble)"
              : "grouped");
    }
    // Asynchronous training messages: their NCCL receive kernels wait on their SMs beside the
    // compute (a receive is posted as soon as its buffer is free), so the GEMMs, whose
    // persistent grids would otherwise wait for those SMs, leave them free throughout (up to
    // 4 links at once, each with device.pipe_comm_ctas blocks; 8 SMs with NCCL's choice,
    // measured best on 2 x H200). 5172 -> 5669 img/s on 2 x H200 (ViT-B/16, interleaved).
    if (P > 1 && train_plans.messages == PipelinePlans::Messages::Async)
      pipe_sm_margin = 4 * (deck.device.pipe_comm_ctas > 0 ? deck.device.pipe_comm_ctas : 2);
    if (pipe_sm_margin > 0) be->set_gemm_sm_margin(pipe_sm_margin);
    pipe = std::make_unique<PipelineRunner>(*model, *be, *coll, *grid, std::move(train_plans),
                                            std::move(eval_plans), micro);
  }

  // Called by all ranks from setup(): the gradient buckets of this stage (alike on its data
  // ranks), the reducer and the model's gradient-ready hook.
  // The granularity of gradient buckets and their padding: ZeRO-1's shards and the
  // copy-engine reduction's blocks split every bucket evenly over the data ranks, in
  // 16-element pieces (1: no constraint). Needs `zero` set (build_pipeline).
  size_t even_split() const {
    return zero || copy_engine ? static_cast<size_t>(grid->size(Axis::Data)) * 16 : 1;
  }

  void setup_grad_reduction() {
    const int D = grid->size(Axis::Data);
    const double mb = deck.device.bucket_mb;  // MiB of fp32 gradients per bucket (0: one)
    overlap = D > 1 && mb > 0.0;
    std::vector<GradRange> groups;
    for (const auto& g : model->grad_groups()) groups.push_back({g.offset, g.n});
    const size_t n = model->num_local_params();
    // the last bucket's worth of the backward (the patch embedding, then block 0's halves) is
    // reduced group by group: what is left to reduce after the backward is one small group
    const size_t elems = overlap ? static_cast<size_t>(mb * 262144.0) : 0;
    auto buckets = plan_grad_buckets(groups, n, elems, even_split(), elems);
    zero_shards.size = D;
    zero_shards.rank = grid->rank(Axis::Data);
    zero_shards.buckets = buckets;
    reducer = std::make_unique<GradReducer>(*coll, D, grid->rank(Axis::Data), buckets, zero);
    if (overlap) model->set_grad_ready_hook([this](size_t o, size_t c) { reducer->ready(o, c); });
    // ZeRO-1 with a 16-bit copy: each bucket of parameters is gathered during the next forward
    if (zero && model->compute_copy() && deck.parallel.zero_gather == "forward") {
      gather = std::make_unique<ParamGather>(*coll, zero_shards, be->act_size());
      model->set_param_need_hook([this](size_t o, size_t c) { gather->need(o, c); });
    }
    const bool act_reduce = D > 1 && deck.parallel.grad_reduce == "act";
    if (act_reduce) {
      agreed([&] { d_grad_stage = be->alloc(n * be->act_size()); });
      reducer->reduce_in_act(*be, d_grad_stage);
    }
    const int margin = deck.device.gemm_sm_margin;
    if (overlap && margin > 0)
      reducer->set_overlap_hook(
          [this, margin](bool on) { be->set_gemm_sm_margin(pipe_sm_margin + (on ? margin : 0)); });
    if (D > 1)
      log("data-parallel gradients (%s): %zu bucket(s) of %.2f MiB on average (stage 0), %s%s; "
          "%s\n",
          act_reduce ? (deck.precision.mode == "bf16" ? "summed in bf16" : "summed in fp16")
                     : "fp32",
          buckets.size(), n * 4.0 / 1048576.0 / std::max<size_t>(buckets.size(), 1),
          overlap ? "reduced during the backward" : "reduced after the backward",
          overlap && margin > 0 ? (", the GEMMs leave " + std::to_string(margin) +
                                   " SMs to it meanwhile").c_str()
                                : "",
          zero ? (gather ? "ZeRO-1: reduce-scatter, sharded update, all-gather of the 16-bit "
                           "parameters bucket by bucket during the next forward"
                         : "ZeRO-1: reduce-scatter, sharded update, all-gather of the parameters")
               : "all-reduce");
  }

  // Called by all ranks, once the step's batches went through the backward: gradients whole
  // on every rank (zero = 0) or on this rank's pieces (zero = 1). With the overlap, the data
  // reduction came first (during the backward), then the tensor groups' partial sums; sums
  // commute, and ZeRO's pieces are alike on the ranks of a tensor group.
  void reduce_grads() {
    if (!overlap) model->reduce_gradients();
    if (grid->size(Axis::Data) > 1) {
      if (zero || overlap || d_grad_stage)
        reducer->finish();
      else
        coll->allreduce_sum(model->grads(), model->num_local_params(), Axis::Data);
    }
    if (overlap) model->reduce_gradients();
  }

  // Called by all ranks: the loss (or any sums) known on the last stage, on every stage.
  void from_last_stage(double* v, int n) {
    const int P = grid->size(Axis::Pipeline);
    if (P == 1) return;
    WatchdogWait w("an MPI broadcast from the last stage", "pipeline");
    MPI_Bcast(v, n, MPI_DOUBLE, P - 1, grid->comm(Axis::Pipeline).get());
  }

  // Called by all ranks from setup(): whether the step's micro-batches run as CUDA graphs.
  // Everything a graph replays must be the same every step (what changes, the batch and the
  // step and stream position that key the dropout masks, is read from the upload slot): with
  // one pipeline stage (a pipeline's bubble marks and point-to-point schedule stay eager) and
  // not under --profile (which times every op).
  void setup_graphs(bool training) {
    if (!training || !deck.device.cuda_graph || !be->graphs_supported()) return;
    std::string why;
    if (grid->size(Axis::Pipeline) > 1) why = "pipeline stages";
    else if (profile) why = "--profile";
    if (!why.empty()) {
      log("CUDA graphs off (%s): the step runs eagerly\n", why.c_str());
      return;
    }
    use_graphs = true;
  }

  // Called by all ranks, inside the last micro-batch's body (so captured with it): the
  // step's gradients reduced, the loss summed over every rank's samples, the squared norm of
  // the whole gradient and the optimizer's gradient factor, all on the device.
  void finish_gradients(float scale) {
    reduce_grads();
    double* loss = &d_step->loss_sum;
    tp->sum_over_batch_device(loss, 1);          // the tensor group's sample blocks
    coll->allreduce_sum_f64(loss, 1, Axis::Data);
    coll->allreduce_sum_f64(loss, 1, Axis::Pipeline);  // known on the last stage only
    opt->grad_norm_sq_device(model->grads(), &d_step->grad_sq);
    coll->allreduce_sum_f64(&d_step->grad_sq, 1, Axis::Pipeline);  // every stage's parameters
    be->clip_factor(&d_step->factor, &d_step->grad_sq, deck.optim.clip_grad_norm, 1.0f / scale);
  }

  // Runs `body` (the work of one micro-batch) eagerly, or as the CUDA graph of its key.
  template <class F>
  void run_body(const GraphKey& key, F&& body) {
    if (!use_graphs) return body();
    if (!graph_of.empty() &&
        (be->device_allocations() != graph_allocs || key.grad_scale != graph_scale)) {
      // a buffer a graph points into may have moved, or the fp16 loss scale changed (the
      // graphs of the old one will not run again): capture anew
      be->drop_graphs();
      graph_of.clear();
    }
    graph_scale = key.grad_scale;
    auto it = graph_of.find(key);
    if (it == graph_of.end()) {  // first run of this key: eager
      graph_of[key] = -1;
      graph_allocs = be->device_allocations();
      return body();
    }
    if (it->second < 0) {
      coll->capture(true);
      be->capture_begin();
      body();
      it->second = be->capture_end();
      coll->capture(false);
      ++graph_captures;
      graph_allocs = be->device_allocations();
    }
    be->launch_graph(it->second);
  }

  // Called by all ranks: enqueues optimizer step s (0-based) with learning rate lr: the
  // step's micro-batches through the pipeline, the gradient reduction, norm and clipping
  // factor (run_body), then the update. Nothing waits for the device (except the fp16
  // overflow verdict, which decides on the host whether the update runs); the step's
  // scalars come back through finish_step. `more`: another step follows (its first
  // micro-batch is uploaded during this one).
  PendingStep enqueue_step(int64_t s, double lr, bool more) {
    const int64_t G = deck.data.global_batch;
    const int A = deck.data.grad_accum;
    pipe->begin_step(s);
    reducer->begin(model->grads());
    const float scale = scaler->scale();
    const float grad_scale = scale / static_cast<float>(G);
    const float smoothing = static_cast<float>(deck.data.label_smoothing);
    double input_wait = 0.0, decode_wait = 0.0;  // in the loader; in wait_inputs
    for (int m = 0; m < A; ++m) {
      const auto hb = std::move(next_hb);
      const int cur = slot;
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
      if (decoder) decoder->release_output(static_cast<uint8_t*>(d_raw[cur]) + off_images);
      if (!last || more) {  // the next micro-batch, during this one
        t_wait = now_s();
        next_hb = next_batch();
        input_wait += now_s() - t_wait;
        slot ^= 1;
        start_upload(*next_hb, slot, last ? s + 1 : s);
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
    if (use_graphs) coll->follow("training step (CUDA graph)");
    return p;
  }

  // The loss (mean over the global batch) and the gradient norm (unscaled; NaN for a skipped
  // fp16 step) of an enqueued step: waits for its scalars only.
  void finish_step(const PendingStep& p, double* loss, double* gnorm) {
    const auto* r = static_cast<const StepScalars*>(be->readback_wait(p.readback));
    *loss = r->loss_sum / static_cast<double>(deck.data.global_batch);
    *gnorm = p.applied ? std::sqrt(r->grad_sq) / p.scale : NAN;
  }

  // Called by all ranks: which job wrote the file, from where and how (root attributes,
  // rewritten by each run that continues the file): job_id (SLURM, PBS, LSF or Flux; "" when
  // launched outside a scheduler), nodes (the hosts of the ranks, sorted), command_line (rank
  // 0's), commit (of the source the binary was built from).
  void record_job(MetricsWriter& metrics) {
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

  // Called by all ranks: the measured bubble of each stage (device time outside its forward /
  // backward ops over the time of the steps so far, summed over the stage's ranks), logged beside the
  // schedule's theoretical bubble; with `metrics`, also stored as root attributes
  // bubble_fraction_stage<k> and bubble_fraction_theoretical.
  void report_bubble(MetricsWriter* metrics) {
    const int P = grid->size(Axis::Pipeline), s = grid->rank(Axis::Pipeline);
    if (P == 1) return;
    std::vector<double> v(2 * P, 0.0);
    v[s] = pipe->wait_seconds();
    v[P + s] = pipe->total_seconds();
    WatchdogWait w("the MPI all-reduce of the pipeline bubble");
    MPI_Allreduce(MPI_IN_PLACE, v.data(), 2 * P, MPI_DOUBLE, MPI_SUM, world);
    const PipelinePlans& pl = pipe->train_plans();
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
    log("pipeline bubble (device time outside forward/backward / stage time) per stage: %s; schedule %s: "
        "theoretical (P-1)/%s = %.3f, i.e. %.3f of the step; simulated %.3f\n",
        line.c_str(), pipe_schedule_name(pl.schedule),
        pl.schedule == PipeSchedule::Interleaved ? "(V*M)" : "M", theory, theory / (1 + theory),
        pl.simulated_bubble);
  }

  ~Impl() {
    stop_watchdog();
    if (be) {
      // graphs first: NCCL keeps a communicator used by a captured graph alive (and its
      // destruction waiting) until the graph is gone, and the collectives go before the backend
      be->drop_graphs();
      be->synchronize();
      for (void* p : d_raw)
        if (p) be->release(p);
      if (d_images) be->release(d_images);
      if (d_step) be->release(d_step);
      if (d_grad_stage) be->release(d_grad_stage);
    }
  }

  LoaderConfig loader_config(bool train) const {
    // auto workers: this rank's share of the node's cores (a CPU-backend rank computes on one)
    const int workers =
        deck.data.workers > 0
            ? deck.data.workers
            : std::max(1, std::min<int>(16, static_cast<int>(std::thread::hardware_concurrency()) /
                                                std::max(1, grid->local_size())));
    LoaderConfig c = make_loader_config(deck, train, grid->rank(Axis::Data),
                                        grid->size(Axis::Data), workers);
    c.num_classes = cfg.classes;
    if (decoder) {
      const ImageDecoder* dec = decoder;
      c.real.device_accepts = [dec](int comps, bool prog, int sh, int sv) {
        return dec->accepts(comps, prog, sh, sv);
      };
    }
    return c;
  }

  // JPEGs on the device where the backend has a decoder (data.decode = auto | device) and the
  // dataset holds encoded images; only the stage holding the patch embedding reads images.
  void setup_decoder() {
    const Dataset* ds = train_ds ? train_ds.get() : eval_ds.get();
    if (!ds || !ds->encoded() || deck.data.decode == "host" || !model->layout().embed) return;
    decoder = be->image_decoder();
    decode_interp = make_loader_config(deck, true, 0, 1, 1).real.interp;
    if (!decoder && deck.data.decode == "device")
      throw UserError("data.decode = device, but the " + be->name() +
                      " backend has no JPEG decoder (data.decode = auto decodes on the host)");
    if (decoder) log("data: JPEGs decoded on the device: %s\n", decoder->describe().c_str());
  }

  // Copies a host batch, which trains in optimizer step `step` (eval: any), into upload slot
  // `slot` and starts its transfer to the device; the slot's previous batch must have been
  // consumed (release_slot) before. With the device's decoder, its views are decoded into the
  // slot's images (and the host-decoded images copied there) on the decoder's stream.
  void start_upload(const HostBatch& hb, int slot, int64_t step) {
    if (hb.count == 0) return;
    const size_t img = static_cast<size_t>(cfg.image) * cfg.image * 3;
    char* h = static_cast<char*>(be->staging(slot, raw_bytes));
    size_t end = off_aug;
    std::memcpy(h + off_labels, hb.labels.data(), hb.count * sizeof(int32_t));
    const int64_t position[2] = {step, hb.first_position};
    std::memcpy(h + off_position, position, sizeof(position));
    if (!hb.soft.empty()) std::memcpy(h + off_soft, hb.soft.data(), hb.soft.size() * sizeof(float));
    bad_images += hb.bad;
    // Only the stage holding the patch embedding reads images (every stage of a pipeline
    // loads the same batch, which keeps the loaders' cursors in step without talking).
    if (model->layout().embed) {
      std::memcpy(h + off_aug, hb.aug.data(), hb.count * sizeof(SampleAug));
      end = off_images;
      if (decoder) {
        decode_batch_on_device(*decoder, hb, cfg.image, decode_interp,
                               static_cast<uint8_t*>(d_raw[slot]) + off_images);
      } else {
        std::memcpy(h + off_images, hb.images.data(), hb.count * img);
        end = off_images + hb.count * img;
      }
    }
    be->upload_async(slot, d_raw[slot], end);
  }

  // The device batch of an upload started with start_upload(hb, slot), once the caller made
  // the device wait for it (Backend::wait_uploads, and the decoder's join()): the images
  // prepared (crop, flip, normalise, mixing) on the device.
  DeviceBatch prepare_batch(const HostBatch& hb, int slot) {
    DeviceBatch db;
    db.count = hb.count;
    db.first_position = hb.first_position;
    if (hb.count == 0) return db;
    uint8_t* d = static_cast<uint8_t*>(d_raw[slot]);
    db.labels = reinterpret_cast<const int32_t*>(d + off_labels);
    db.position = reinterpret_cast<const int64_t*>(d + off_position);
    db.soft = hb.soft.empty() ? nullptr : reinterpret_cast<const float*>(d + off_soft);
    if (!model->layout().embed) return db;
    // eval batches carry dx = dy = pad: the crop of the padded image is the image itself;
    // encoded images were cropped while decoded (no padding)
    const int pad = eval_ds->encoded() ? 0 : deck.data.crop_padding;
    be->prepare_images(d_images, d + off_images, d + off_aug, hb.count, cfg.image, pad,
                       deck.data.mean.data(), deck.data.std.data());
    db.images = d_images;
    return db;
  }

  // The device waits for the uploads started so far and for the decoder's work on batch hb
  // (outside a captured graph: neither the copy stream nor the decoder's is captured). Images
  // the decoder refused are decoded on the host now; when one had to be replaced by another
  // image, the labels and soft targets already uploaded are corrected (rare: a bitstream that
  // passed its header checks, then failed on the device and on the host).
  void wait_inputs(const HostBatch& hb, int slot) {
    be->wait_uploads();
    if (!decoder || !model->layout().embed || hb.count == 0) return;
    uint8_t* d = static_cast<uint8_t*>(d_raw[slot]);
    finish_batch_on_device(
        *decoder, *loader, hb, cfg.image, cfg.classes, d + off_images, &bad_images,
        [&](const std::vector<int32_t>& labels, const std::vector<float>& soft) {
          be->synchronize();  // the slot's upload has landed: overwrite its labels and targets
          be->copy_to_device(d + off_labels, labels.data(), labels.size() * sizeof(int32_t));
          if (!soft.empty()) be->copy_to_device(d + off_soft, soft.data(), soft.size() * sizeof(float));
        });
  }

  // Eval / predict: one batch at a time through the eval slot (its previous batch's work
  // was enqueued before this call, so releasing the slot here covers it).
  DeviceBatch upload(const HostBatch& hb) {
    be->release_slot(kEvalSlot);
    if (decoder) decoder->release_output(static_cast<uint8_t*>(d_raw[kEvalSlot]) + off_images);
    start_upload(hb, kEvalSlot, 0);
    wait_inputs(hb, kEvalSlot);
    return prepare_batch(hb, kEvalSlot);
  }

  // Parameters from a flat host copy into the model and, when it holds the masters' pieces
  // (ZeRO-1 with 16-bit activations), the optimizer.
  void set_params(const float* host) {
    model->set_params(host);
    if (opt) opt->master_from_host(host);
  }
  void init_params() { set_params(model->initial_params(deck.run.seed).data()); }

  // ---- checkpoints
  std::string ckpt_dir() const { return deck.run.out_dir + "/checkpoints"; }

  // Shards of every parameter (and optimizer state) with host staging buffers.
  std::vector<TensorShard> shards(std::vector<float>& host, bool with_optim) {
    const size_t n = model->num_local_params();
    std::vector<std::pair<std::string, float*>> st;
    if (with_optim && opt) st = opt->state();
    host.assign(n * (1 + st.size()), 0.0f);
    std::vector<TensorShard> out;
    const bool data_root = grid->rank(Axis::Data) == 0;
    // Every rank lists every tensor of the model (dataset creation is collective); a
    // pipeline stage selects nothing of the layers it does not hold.
    std::map<std::string, const ParamInfo*> held;
    for (const auto& p : model->params()) held[p.name] = &p;
    for (size_t k = 0; k <= st.size(); ++k) {
      for (const auto& g : model->all_param_names()) {
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
        for (Axis a : p.shard.replicated_over) root = root && grid->rank(a) == 0;
        s.write = root;
        out.push_back(std::move(s));
      }
    }
    return out;
  }

  void save_checkpoint() {
    std::vector<float> host;
    auto sh = shards(host, true);
    const size_t n = model->num_local_params();
    // global form whatever the layout (ZeRO: the pieces gathered over the data axis, the
    // masters' too with 16-bit activations)
    opt->master_to_host(model->master(), host.data());
    auto st = opt->state();
    for (size_t k = 0; k < st.size(); ++k) opt->state_to_host(k, host.data() + (k + 1) * n);
    CheckpointMeta meta;
    meta.deck = deck.resolved_text();
    meta.grid = {grid->shape().pipeline, grid->shape().data, grid->shape().tensor};
    meta.tensor_mode = grid->shape().tensor > 1 ? tensor_mode_name(grid->shape().mode) : "none";
    meta.backend = be->name();
    meta.world_size = grid->world_size();
    meta.state["step"] = {double(step)};
    meta.state["applied_steps"] = {double(applied)};
    meta.state["epoch"] = {double(step) * deck.data.global_batch / double(train_ds->size())};
    meta.state["sample_cursor"] = {double(step) * deck.data.global_batch};
    meta.state["seed"] = {double(deck.run.seed)};
    meta.state["loss_scale"] = {double(scaler->scale())};
    meta.state["scaler_good_steps"] = {double(scaler->good_steps())};
    {
      WatchdogWait w("the MPI barrier before a checkpoint");
      MPI_Barrier(world);
    }
    const double t0 = now_s();
    const std::string path =
        write_checkpoint(world, ckpt_dir(), step, sh, meta, deck.checkpoint.keep);
    const double dt = now_s() - t0;
    const double gb = checkpoint_bytes() / 1e9;
    ckpt_write_gbs = gb / std::max(dt, 1e-9);
    log("checkpoint %s written: %.3f GB in %.2f s (%.2f GB/s)\n", path.c_str(), gb, dt,
        ckpt_write_gbs);
  }

  // Bytes of one checkpoint of this run: every parameter and optimizer state in fp32.
  double checkpoint_bytes() const {
    return double(model->num_global_params()) * 4.0 * (1 + (opt ? opt->state().size() : 0));
  }

  // Called by all ranks before the run writes anything: a run whose out_dir cannot hold one
  // checkpoint is refused now, not after hours of training (a full disk found mid-write ends
  // the run too, but only after the work since the last checkpoint).
  // Rank 0 looks; agreed() gives its verdict to every rank.
  void check_free_space() {
    struct statvfs v {};
    if (grid->world_rank() != 0 || ::statvfs(deck.run.out_dir.c_str(), &v) != 0) return;
    const double free_b = double(v.f_bavail) * double(v.f_frsize);
    const double need = checkpoint_bytes() * 1.02 + 262144.0;  // + metadata and metrics
    if (free_b >= need) return;
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "run.out_dir '%s': no space left on device: %.1f MB free on its file system, a "
                  "checkpoint of this run needs %.1f MB; free space or choose another run.out_dir",
                  deck.run.out_dir.c_str(), free_b / 1e6, need / 1e6);
    throw UserError(buf);
  }

  // Loads parameters (and optimizer state + counters when `full`) from `path`; with `resume`,
  // from the newest checkpoint in the directory `path` that can be resumed from (false: the
  // directory holds none).
  bool load_checkpoint(std::string path, bool full, bool resume = false) {
    std::vector<float> host;
    auto sh = shards(host, full);
    CheckpointMeta meta;
    const double t0 = now_s();
    agreed([&] {
      if (resume)
        path = resume_checkpoint(world, path, sh, &meta);
      else
        read_checkpoint(world, path, sh, &meta);
    });
    if (path.empty()) return false;
    const double dt = now_s() - t0;
    const size_t n = model->num_local_params();
    set_params(host.data());
    if (full) {
      auto st = opt->state();
      for (size_t k = 0; k < st.size(); ++k) opt->state_from_host(k, host.data() + (k + 1) * n);
      auto get = [&](const char* k) {
        auto it = meta.state.find(k);
        return it == meta.state.end() || it->second.empty() ? 0.0 : it->second[0];
      };
      step = static_cast<int64_t>(get("step"));
      applied = static_cast<int64_t>(get("applied_steps"));
      scaler->restore(get("loss_scale") > 0 ? get("loss_scale") : scaler->scale(),
                      static_cast<int64_t>(get("scaler_good_steps")));
    }
    const double gb = double(model->num_global_params()) * 4.0 * (full ? 1 + opt->state().size() : 1) / 1e9;
    ckpt_read_gbs = gb / std::max(dt, 1e-9);
    log("checkpoint %s loaded%s: %.3f GB in %.2f s (%.2f GB/s)\n", path.c_str(),
        full ? " (resuming)" : "", gb, dt, ckpt_read_gbs);
    return true;
  }

  // ---- evaluation over the eval split; returns loss, top1, top5 (fractions)
  void evaluate(double* loss, double* top1, double* top5,
                std::vector<std::pair<int64_t, std::vector<float>>>* rows = nullptr) {
    // eval's kernels are timed by each rank alone: the last eval batch has a different number
    // of samples (so different GEMM shapes) on each data rank
    be->set_tune_agreement(nullptr);
    if (gather) gather->gather_now(model->compute_copy());  // the last update's, all of them
    DataLoader loader(eval_ds, loader_config(false));
    LoaderScope bound(this->loader, loader);
    double s[4] = {0, 0, 0, 0};
    int64_t t = 0;
    const int64_t E = deck.data.global_batch / deck.data.grad_accum;
    while (auto hb = loader.next()) {
      DeviceBatch db = upload(*hb);
      double l = 0, c1 = 0, c5 = 0;
      std::vector<float> logits;
      const bool want_rows = rows && pipe->last_stage();
      pipe->eval(db, &l, &c1, &c5, want_rows ? &logits : nullptr);
      s[0] += l;
      s[1] += c1;
      s[2] += c5;
      s[3] += hb->count;
      if (want_rows && hb->count > 0) {
        const int K = cfg.classes;
        const int64_t first = t * E + int64_t(grid->rank(Axis::Data)) * b;
        for (int i = 0; i < hb->count; ++i) {
          std::vector<float> r(logits.begin() + int64_t(i) * K, logits.begin() + int64_t(i + 1) * K);
          r.push_back(static_cast<float>(hb->labels[i]));
          rows->emplace_back(first + i, std::move(r));
        }
      }
      ++t;
    }
    WatchdogWait w("the MPI all-reduce of the evaluation sums", "data");
    MPI_Allreduce(MPI_IN_PLACE, s, 4, MPI_DOUBLE, MPI_SUM, grid->comm(Axis::Data).get());
    from_last_stage(s, 3);  // the sums are known on the last stage; the counts everywhere
    const double n = std::max(s[3], 1.0);
    *loss = s[0] / n;
    *top1 = s[1] / n;
    *top5 = s[2] / n;
    be->set_tune_agreement(tune_agreement);
  }

  int train() {
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
    LoaderScope bound(this->loader, loader);
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
    next_batch = [&loader] { return loader.next(); };
    if (step < total_steps) {
      next_hb = next_batch();
      start_upload(*next_hb, slot, step);
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
                         double(be->peak_memory_bytes()), double(bad_images), p.input_wait_s});
      if (k % deck.run.log_every == 0 || k == total_steps) {
        // the steps' own time: evaluations and checkpoints in the interval do not count
        const double ips = double(G) * steps_since_log / std::max(log_time, 1e-9);
        const double eta = (total_steps - k) * (now - t_start) / double(k - first_step);
        // rank 0's host waiting for input (loader, JPEG decoder), per step of the interval
        char wait[96];
        const double per = 1e3 / steps_since_log;
        if (decoder)
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
    if (use_graphs)
      log("CUDA graphs: %lld captured, replayed for the steps after the first two\n",
          static_cast<long long>(graph_captures));
    report_bubble(&metrics);
    metrics.set_attribute("peak_device_memory_bytes", double(be->peak_memory_bytes()));
    metrics.set_attribute("checkpoint_write_GBps", ckpt_write_gbs);
    metrics.flush();
    log("done: %lld steps in %s, final loss %.4f; outputs in %s\n",
        static_cast<long long>(step - first_step), fmt_duration(now_s() - t_start).c_str(),
        last_loss, deck.run.out_dir.c_str());
    return 0;
  }

  int bench(int warmup, int steps, double peak_tflops, bool with_profile) {
    profile = with_profile;
    setup(true);
    init_params();
    const int64_t G = deck.data.global_batch;
    // one real batch from the loader, reused: times the model, not the input pipeline
    DataLoader loader(train_ds, loader_config(true), 0);
    LoaderScope bound(this->loader, loader);
    auto hb = loader.next();
    LrSchedule sched(deck.optim, warmup + steps, 0);
    next_batch = [&hb] { return hb; };
    next_hb = hb;
    start_upload(*next_hb, slot, 0);  // as in train(): the next micro-batch's upload overlaps
    // exactly the training step (clipping, readback and CUDA graphs included)
    auto one_step = [&](int64_t s) { enqueue_step(s, sched.at(s + 1), true); };
    // the two upload slots' graphs are captured in the third and fourth step
    if (use_graphs && warmup < 4) {
      log("bench: --warmup=%d raised to 4 (CUDA graphs are captured in steps 3 and 4)\n", warmup);
      warmup = 4;
    }
    const int64_t allocs0 = be->device_allocations();  // setup() planned the workspace
    for (int s = 0; s < warmup; ++s) one_step(s);
    be->synchronize();
    const int64_t allocs1 = be->device_allocations();
    pipe->reset_timers();  // the bubble of the timed steps only
    MPI_Barrier(world);
    const double t0 = now_s();
    for (int s = 0; s < steps; ++s) one_step(warmup + s);
    be->synchronize();
    double dt = (now_s() - t0) / std::max(steps, 1);
    // device allocations from step 1 on, and in the timed steps only (the most of any rank)
    long long allocs[2] = {static_cast<long long>(be->device_allocations() - allocs0),
                           static_cast<long long>(be->device_allocations() - allocs1)};
    MPI_Allreduce(MPI_IN_PLACE, allocs, 2, MPI_LONG_LONG, MPI_MAX, world);
    MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, world);
    double mem = double(be->peak_memory_bytes()), mem_max = mem;
    MPI_Allreduce(MPI_IN_PLACE, &mem_max, 1, MPI_DOUBLE, MPI_MAX, world);
    report_bubble(nullptr);
    if (prof) {
      // a few more steps with every op synchronised and timed: where the time goes
      const int ps = 3;
      be->synchronize();
      prof->set_enabled(true);
      const double p0 = now_s();
      for (int s = 0; s < ps; ++s) one_step(warmup + steps + s);
      be->synchronize();
      const double pdt = (now_s() - p0) / ps;
      prof->set_enabled(false);
      log("profile (rank 0, %d steps, every op synchronised: %.2f ms/step vs %.2f ms "
          "unsynchronised)\n%s",
          ps, pdt * 1e3, dt * 1e3, prof->table(ps).c_str());
    }
    const double ips = double(G) / dt;
    const double tflops = ips * cfg.train_flops_per_sample() / 1e12;
    const double per_dev = tflops / grid->world_size();
    std::string attention = be->name();  // the CPU backend has one attention path
#ifdef VITGRID_HAVE_CUDA
    if (be->name() == "cuda")  // this rank's micro-batch shape
      attention = cuda_attention_path(*compute_be, micro, cfg.tokens(),
                                      tp->local_heads(cfg.heads), cfg.head_dim());
#endif
    // MFU against the peak dense TFLOP/s of one device: --peak-tflops, else on the cuda backend
    // H100/H200's (bf16/fp16 989, tf32 494, fp32 67). A CPU's peak depends on the machine and
    // its cores: no MFU unless given.
    if (peak_tflops <= 0.0 && be->name() == "cuda") {
      const std::string& m = deck.precision.mode;
      peak_tflops = (m == "bf16" || m == "fp16" || m == "fp16-naive") ? 989.0
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
                    be->name().c_str());
    log("bench | %s | %s | %s | world %d | global batch %lld | step %.2f ms | %.1f img/s | "
        "%.1f img/s/device | %s/device | %s | peak mem %.2f GiB (%.3f MiB) | zero %d | grad "
        "buckets %zu%s | allocs from step 1 %lld | allocs in timed steps %lld | attention %s | "
        "cuda graphs %lld\n",
        deck.model.preset.c_str(), deck.precision.mode.c_str(), be->name().c_str(),
        grid->world_size(), static_cast<long long>(G), dt * 1e3, ips, ips / grid->world_size(),
        fmt_flops(per_dev * 1e12).c_str(), mfu, mem_max / 1073741824.0, mem_max / 1048576.0,
        zero ? 1 : 0, reducer->buckets().size(), overlap ? " overlapped" : "", allocs[0], allocs[1],
        attention.c_str(), static_cast<long long>(graph_captures));
    return 0;
  }

  int evaluate_only() {
    setup(false);
    init_params();
    load_checkpoint(deck.checkpoint.load, false);
    double el, e1, e5;
    evaluate(&el, &e1, &e5);
    log("eval %s | loss %.4f | top-1 %.2f%% | top-5 %.2f%%\n", deck.checkpoint.load.c_str(), el,
        100 * e1, 100 * e5);
    return 0;
  }

  int predict() {
    setup(false);
    init_params();
    load_checkpoint(deck.checkpoint.load, false);
    std::vector<std::pair<int64_t, std::vector<float>>> rows;
    double el, e1, e5;
    evaluate(&el, &e1, &e5, &rows);
    // Rows come interleaved over data ranks (eval batches are split across them); move them
    // so that data rank r holds the contiguous block [r*chunk, (r+1)*chunk) and write those
    // hyperslabs collectively. Ranks outside tensor/pipeline coordinate 0 hold copies.
    const MPI_Comm dc = grid->comm(Axis::Data).get();
    const int D = grid->size(Axis::Data), r = grid->rank(Axis::Data);
    int64_t total = static_cast<int64_t>(rows.size());
    MPI_Allreduce(MPI_IN_PLACE, &total, 1, MPI_INT64_T, MPI_SUM, dc);
    const int64_t chunk = (total + D - 1) / D;
    const int K = cfg.classes, W = K + 2;  // position, K logits, label
    std::vector<std::vector<double>> out(D);
    for (auto& [pos, v] : rows) {
      auto& o = out[std::min<int64_t>(pos / chunk, D - 1)];
      o.push_back(double(pos));
      o.insert(o.end(), v.begin(), v.end());
    }
    std::vector<int> sc(D), rc(D), sd(D), rd(D);
    std::vector<double> sbuf;
    for (int i = 0; i < D; ++i) {
      sd[i] = static_cast<int>(sbuf.size());
      sc[i] = static_cast<int>(out[i].size());
      sbuf.insert(sbuf.end(), out[i].begin(), out[i].end());
    }
    MPI_Alltoall(sc.data(), 1, MPI_INT, rc.data(), 1, MPI_INT, dc);
    int rtot = 0;
    for (int i = 0; i < D; ++i) {
      rd[i] = rtot;
      rtot += rc[i];
    }
    std::vector<double> rbuf(rtot);
    MPI_Alltoallv(sbuf.data(), sc.data(), sd.data(), MPI_DOUBLE, rbuf.data(), rc.data(),
                  rd.data(), MPI_DOUBLE, dc);
    const int64_t nrows = rtot / W, first = std::min<int64_t>(int64_t(r) * chunk, total);
    std::vector<float> logits(nrows * K);
    std::vector<int32_t> labels(nrows);
    for (int64_t i = 0; i < nrows; ++i) {
      const double* row = rbuf.data() + i * W;
      const int64_t at = static_cast<int64_t>(row[0]) - first;
      for (int k = 0; k < K; ++k) logits[at * K + k] = static_cast<float>(row[1 + k]);
      labels[at] = static_cast<int32_t>(row[1 + K]);
    }
    if (grid->world_rank() == 0) mkdirs(deck.run.out_dir);
    MPI_Barrier(world);
    // The logits are on the last stage, alike on its tensor ranks: one data group writes.
    if (pipe->last_stage() && grid->rank(Axis::Tensor) == 0)
      write_predictions(dc, deck.run.out_dir + "/predictions.h5", deck.resolved_text(), total,
                        K, first, logits, labels);
    MPI_Barrier(world);
    double rows_written = static_cast<double>(total);
    from_last_stage(&rows_written, 1);
    log("predict %s: %lld rows written to %s/predictions.h5 (top-1 %.2f%%)\n",
        deck.checkpoint.load.c_str(), static_cast<long long>(rows_written),
        deck.run.out_dir.c_str(), 100 * e1);
    return 0;
  }
};

Trainer::Trainer(MPI_Comm world, const Deck& deck) : impl_(std::make_unique<Impl>(world, deck)) {}
Trainer::~Trainer() = default;
int Trainer::train() { return impl_->train(); }
int Trainer::evaluate_only() { return impl_->evaluate_only(); }
int Trainer::predict() { return impl_->predict(); }
int Trainer::bench(int warmup, int steps, double peak, bool profile) {
  return impl_->bench(warmup, steps, peak, profile);
}

}  // namespace vitgrid
