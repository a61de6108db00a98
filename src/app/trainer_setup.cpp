// Run's setup: the grid, backend and collectives, the model and its pipeline, the datasets, the
// optimizer and the data-parallel gradient reduction, and the backend's workspace.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "trainer_impl.h"
#include "vitgrid/core/watchdog.h"
#include "vitgrid/data/image_source.h"
#include "vitgrid/model/workspace_plan.h"
#include "vitgrid/parallel/pipeline.h"
#ifdef VITGRID_HAVE_CUDA
#include "vitgrid/backend/cuda/cuda_backend.h"
#endif

namespace vitgrid {
namespace trainer_detail {
namespace {

DType act_dtype_of(const std::string& mode) {
  if (mode == "bf16" || mode == "fp8") return DType::BF16;  // fp8: the Linears' GEMMs only
  if (mode == "fp16" || mode == "fp16-naive") return DType::F16;
  return DType::F32;
}

// The deck's device.attention / device.fused_gelu (validated against their choices).
AttentionMode attention_mode_of(const std::string& v) {
  if (v == "cudnn") return AttentionMode::Cudnn;
  if (v == "cudnn_forward") return AttentionMode::CudnnForward;
  if (v == "flash") return AttentionMode::Flash;
  if (v == "fallback") return AttentionMode::Fallback;
  return AttentionMode::Auto;
}
FusedGeluMode fused_gelu_mode_of(const std::string& v) {
  if (v == "off") return FusedGeluMode::Off;
  if (v == "on") return FusedGeluMode::On;
  return FusedGeluMode::Auto;
}
}  // namespace

Run::~Run() {
  if (d_grad_stage) be->release(d_grad_stage);
}

void Run::setup(bool training) {
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
  // device.data_comm = auto: copy engines for data parallelism alone within one node (4 x H100:
  // 65.0-65.5 ms per ViT-B/16 step against 65.2-66.0 with NCCL's kernels on 4 SMs), where the
  // SM-path keys (data_comm_ctas, gemm_sm_margin) are left at 0
  const ParallelSection& par = deck.parallel;
  copy_engine = deck.device.data_comm == "copy_engine" ||
                (deck.device.data_comm == "auto" && kind == "cuda" && grid->world_size() > 1 &&
                 grid->local_size() == grid->world_size() && par.pipeline == 1 &&
                 par.tensor == 1 && par.zero == 0 && par.grad_reduce == "fp32" &&
                 deck.device.data_comm_ctas == 0 && deck.device.gemm_sm_margin == 0);
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
    bo.fp8_fast_accum = deck.precision.fp8_fast_accum;
    bo.fp8_fast_accum_dgrad = deck.precision.fp8_fast_accum_dgrad;
    be = make_backend(kind, grid->local_rank(), act_dtype_of(deck.precision.mode), bo);
  });
#ifdef VITGRID_HAVE_CUDA
  if (kind == "cuda")
    coll = make_nccl_collectives(
        *grid, *be,
        {deck.device.comm_timeout, deck.device.data_comm_ctas, copy_engine,
         deck.device.pipe_comm_ctas, deck.device.tensor_comm_ctas,
         deck.device.tensor_comm == "copy_engine", deck.device.nccl_blocking});
  else
#endif
    coll = make_mpi_collectives(*grid);
  if (copy_engine && grid->size(Axis::Data) > 1)
    log("data axis: gradients in NCCL symmetric memory, reduced by all-to-all + local sum + "
        "all-gather under NCCL's zero-CTA policy (device.data_comm = %s)\n",
        deck.device.data_comm.c_str());
  const bool fp8 = deck.precision.mode == "fp8";
  std::string how;
  if (kind == "cpu" && deck.precision.mode != "fp32" && deck.precision.mode != "tf32")
    how = ", 16-bit storage emulated on the CPU";
  else if (fp8) {
    // which FP8 GEMMs accumulate unpromoted, and the keys that say so
    const bool fwd = deck.precision.fp8_fast_accum, dgrad = deck.precision.fp8_fast_accum_dgrad;
    const char* which = fwd && dgrad ? "forward's and the data gradients'"
                        : fwd        ? "forward's"
                                     : "data gradients'";
    const char* keys = fwd && dgrad ? "fp8_fast_accum, fp8_fast_accum_dgrad"
                       : fwd        ? "fp8_fast_accum"
                                    : "fp8_fast_accum_dgrad";
    how = !fwd && !dgrad ? std::string(", every FP8 GEMM's sums promoted to fp32")
                         : std::string(", the ") + which +
                               " FP8 GEMMs accumulating unpromoted (precision." + keys + ")";
  }
  log("backend %s, precision %s%s\n", be->name().c_str(), deck.precision.mode.c_str(),
      how.c_str());
  agreed([&] { tp = make_tensor_parallel(*grid, *be, *coll); });

  cfg = ViTConfig::from(deck.model);
  cfg.fp8 = fp8;
  cfg.fp8_history = deck.precision.fp8_amax_history;
  cfg.fp8_margin = deck.precision.fp8_margin;
  cfg.fp8_algo = deck.precision.fp8_amax_compute == "most_recent" ? Fp8AmaxAlgo::MostRecent
                                                                   : Fp8AmaxAlgo::Max;
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
}

// Parameters, gradients, optimizer state and activations are allocated, the jobs' buffers too;
// now the backend's own workspace (reduction scratch, GEMM temporaries, optimizer tables) at
// the largest shapes this rank's steps run, so that no step allocates.
void Run::plan_workspace() {
  WorkspaceShape ws;
  ws.micro_batch = micro;
  ws.act_size = be->act_size();
  ws.optimizer = opt != nullptr;
  ws.param_tensors = model->params().size();
  ws.local_params = model->num_local_params();
  ws.grad_buckets = reducer ? reducer->buckets().size() : 0;
  ws.fp8_layernorms = model->layernorms_write_fp8();
  agreed([&] { be->plan_workspace(workspace_plan_for(cfg, ws)); });
}

// Called by all ranks from setup(): the stage partition, the schedules' plans, this stage's
// part of the model (its layers, and activation sets for the micro-batches the plans keep in
// flight) and the runner. Every rank computes every stage's plan, so they agree without
// talking.
void Run::build_pipeline() {
  const ParallelSection& pp = deck.parallel;
  const int P = grid->size(Axis::Pipeline), s = grid->rank(Axis::Pipeline);
  const int M = pp.micro_batches;
  micro = b / M;
  PipeSchedule kind = PipeSchedule::OneFOneB;
  PipelinePlans train_plans, eval_plans;
  std::vector<int> partition;  // blocks per virtual stage
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
    pipe_sm_margin_ = 4 * (deck.device.pipe_comm_ctas > 0 ? deck.device.pipe_comm_ctas : 2);
  if (pipe_sm_margin_ > 0) be->set_gemm_sm_margin(pipe_sm_margin_);
  pipe = std::make_unique<PipelineRunner>(*model, *be, *coll, *grid, std::move(train_plans),
                                          std::move(eval_plans), micro);
}

// The granularity of gradient buckets and their padding: ZeRO-1's shards and the
// copy-engine reduction's blocks split every bucket evenly over the data ranks, in
// 16-element pieces (1: no constraint). Needs `zero` set (build_pipeline).
size_t Run::even_split() const {
  return zero || copy_engine ? static_cast<size_t>(grid->size(Axis::Data)) * 16 : 1;
}

// Called by all ranks from setup(): the gradient buckets of this stage (alike on its data
// ranks), the reducer and the model's gradient-ready hook.
void Run::setup_grad_reduction() {
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
        [this, margin](bool on) { be->set_gemm_sm_margin(pipe_sm_margin_ + (on ? margin : 0)); });
  if (D > 1)
    log("data-parallel gradients (%s): %zu bucket(s) of %.2f MiB on average (stage 0), %s%s; "
        "%s\n",
        act_reduce ? (be->act_dtype() == DType::BF16 ? "summed in bf16" : "summed in fp16")
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

}  // namespace trainer_detail
}  // namespace vitgrid
