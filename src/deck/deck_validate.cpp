// The deck after parsing: values derived from others (per-rank batch, micro-batch, tensor
// layouts) and every rule a valid deck obeys, each refusal naming the key to change.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "deck_internal.h"
#include "vitgrid/core/error.h"

namespace vitgrid {
namespace deck_detail {

void Parser::derive_and_validate(Deck* dp) {
  Deck& d = *dp;
  auto positive = [&](const char* key, double v) {
    if (!(v > 0)) fail(key, std::string("must be > 0, got ") + shortest(v));
  };
  auto non_negative = [&](const char* key, double v) {
    if (!(v >= 0)) fail(key, std::string("must be >= 0, got ") + shortest(v));
  };
  auto unit_interval = [&](const char* key, double v) {  // [0,1)
    if (!(v >= 0 && v < 1)) fail(key, std::string("must be in [0,1), got ") + shortest(v));
  };
  // Upper bounds where a larger value can only be a typo (an extra digit, a value meant for
  // another key). They also keep every size derived from these keys, in the checks below and
  // in the layers after the deck, far from integer overflow.
  auto at_most = [&](const char* key, double v, double max, const char* unit = "") {
    // integers as integers: "got 1000000", not "got 1e+06"
    auto text = [](double x) {
      return x == std::floor(x) && std::fabs(x) < 9007199254740992.0
                 ? std::to_string(static_cast<int64_t>(x))
                 : shortest(x);
    };
    if (v > max) fail(key, "must be at most " + text(max) + unit + ", got " + text(v));
  };

  // [run]
  non_negative("run.steps", static_cast<double>(d.run.steps));
  non_negative("run.epochs", d.run.epochs);
  if (d.run.steps > 0 && d.run.epochs > 0)
    fail("run.steps", "run.steps (" + std::to_string(d.run.steps) + ") and run.epochs (" +
                          shortest(d.run.epochs) + ", " + where("run.epochs") +
                          ") are both set; set only one");
  if (d.run.steps == 0 && d.run.epochs == 0)
    fail("run.steps", "set run.steps or run.epochs to a positive value");
  // (the step count derived from epochs must fit 64 bits whatever the dataset size)
  at_most("run.epochs", d.run.epochs, kMaxEpochs);
  positive("run.log_every", d.run.log_every);
  non_negative("run.eval_every", d.run.eval_every);
  non_negative("run.eval_samples", static_cast<double>(d.run.eval_samples));
  require(!d.run.out_dir.empty(), "run.out_dir", "must not be empty");

  // [model]
  ModelSection& m = d.model;
  positive("model.image_size", m.image_size);
  positive("model.patch_size", m.patch_size);
  require(m.channels == 3, "model.channels",
          "must be 3 (RGB inputs), got " + std::to_string(m.channels));
  positive("model.hidden", m.hidden);
  positive("model.depth", m.depth);
  positive("model.heads", m.heads);
  positive("model.mlp_ratio", m.mlp_ratio);
  positive("model.num_classes", m.num_classes);
  at_most("model.image_size", m.image_size, kMaxImageSize, " pixels");
  at_most("model.hidden", m.hidden, kMaxHidden);
  at_most("model.depth", m.depth, kMaxDepth, " blocks");
  at_most("model.mlp_ratio", m.mlp_ratio, kMaxMlpRatio);  // before mlp_hidden() converts it
  at_most("model.num_classes", m.num_classes, kMaxClasses);
  unit_interval("model.dropout", m.dropout);
  unit_interval("model.drop_path", m.drop_path);
  require(m.image_size % m.patch_size == 0, "model.patch_size",
          std::to_string(m.patch_size) + " does not divide model.image_size (" +
              std::to_string(m.image_size) + ")");
  require(
      m.hidden % m.heads == 0, "model.heads",
      std::to_string(m.heads) + " does not divide model.hidden (" + std::to_string(m.hidden) + ")");
  require(m.mlp_hidden() > 0, "model.mlp_ratio", "gives an empty MLP");
  require(
      m.checkpoint_blocks >= -1, "model.checkpoint_blocks",
      "must be -1 (every block) or a block count >= 0, got " + std::to_string(m.checkpoint_blocks));
  require(m.checkpoint_blocks == -1 || m.checkpoint_activations, "model.checkpoint_blocks",
          "= " + std::to_string(m.checkpoint_blocks) +
              " needs model.checkpoint_activations = true (it says how many blocks of each "
              "stage are recomputed)");

  // [data] (alone)
  DataSection& dt = d.data;
  if (dt.dataset != "synthetic")
    require(!dt.path.empty(), "data.path",
            "must name the " +
                std::string(dt.dataset == "cifar10"    ? "CIFAR-10 directory"
                            : dt.dataset == "hdf5"     ? "HDF5 file"
                            : dt.dataset == "tfrecord" ? "TFRecord shard directory"
                            : dt.dataset == "folder"   ? "ImageFolder root"
                                                       : "jpeg_h5 file") +
                " for data.dataset = " + dt.dataset);
  if (dt.label_offset == DataSection::kLabelOffsetAuto)
    dt.label_offset = dt.dataset == "tfrecord" ? -1 : 0;
  require(std::abs(dt.label_offset) <= 1000000 - 1, "data.label_offset",
          "must be within +-999999, got " + std::to_string(dt.label_offset));
  require(dt.eval_fraction >= 0.0 && dt.eval_fraction < 1.0, "data.eval_fraction",
          "must be in [0, 1), got " + shortest(dt.eval_fraction));
  require(dt.rrc_scale.size() == 2 && dt.rrc_scale[0] > 0 && dt.rrc_scale[0] <= dt.rrc_scale[1] &&
              dt.rrc_scale[1] <= 1.0f,
          "data.rrc_scale", "needs 2 values 0 < lo <= hi <= 1");
  require(dt.rrc_ratio.size() == 2 && dt.rrc_ratio[0] > 0 && dt.rrc_ratio[0] <= dt.rrc_ratio[1],
          "data.rrc_ratio", "needs 2 values 0 < lo <= hi");
  require(dt.crop_pct > 0.0 && dt.crop_pct <= 1.0, "data.crop_pct",
          "must be in (0, 1], got " + shortest(dt.crop_pct));
  require(dt.device_share >= 0.0 && dt.device_share <= 1.0, "data.device_share",
          "must be in [0, 1], got " + shortest(dt.device_share));
  positive("data.global_batch", static_cast<double>(dt.global_batch));
  positive("data.grad_accum", dt.grad_accum);
  at_most("data.grad_accum", dt.grad_accum, static_cast<double>(kMaxGlobalBatch));
  positive("data.synthetic_train", static_cast<double>(dt.synthetic_train));
  positive("data.synthetic_eval", static_cast<double>(dt.synthetic_eval));
  at_most("data.global_batch", static_cast<double>(dt.global_batch), kMaxGlobalBatch, " samples");
  // The sampler holds a permutation of the train split, 8 bytes per sample, on every rank.
  at_most("data.synthetic_train", static_cast<double>(dt.synthetic_train), kMaxSyntheticSamples,
          " samples");
  at_most("data.synthetic_eval", static_cast<double>(dt.synthetic_eval), kMaxSyntheticSamples,
          " samples");
  non_negative("data.crop_padding", dt.crop_padding);
  // a crop of padding alone sees no image
  at_most("data.crop_padding", dt.crop_padding, m.image_size,
          " (model.image_size; a wider padding crops nothing but zeros)");
  non_negative("data.prefetch", dt.prefetch);
  at_most("data.prefetch", dt.prefetch, kMaxPrefetch, " batches");  // each one held in memory
  non_negative("data.workers", dt.workers);
  at_most("data.workers", dt.workers, kMaxWorkers, " threads");
  require(
      dt.mean.size() == 3, "data.mean",
      "needs 3 comma-separated values (one per channel), got " + std::to_string(dt.mean.size()));
  require(dt.std.size() == 3, "data.std",
          "needs 3 comma-separated values (one per channel), got " + std::to_string(dt.std.size()));
  for (float s : dt.std) require(s > 0, "data.std", "entries must be > 0, got " + shortest(s));
  non_negative("data.mixup_alpha", dt.mixup_alpha);
  non_negative("data.cutmix_alpha", dt.cutmix_alpha);
  require(dt.mixup_prob >= 0.0 && dt.mixup_prob <= 1.0, "data.mixup_prob",
          "must be in [0, 1], got " + shortest(dt.mixup_prob));
  require(dt.mixup_switch_prob >= 0.0 && dt.mixup_switch_prob <= 1.0, "data.mixup_switch_prob",
          "must be in [0, 1], got " + shortest(dt.mixup_switch_prob));
  unit_interval("data.label_smoothing", dt.label_smoothing);

  // [optim]
  OptimSection& o = d.optim;
  positive("optim.lr", o.lr);
  non_negative("optim.min_lr", o.min_lr);
  require(o.min_lr <= o.lr, "optim.min_lr",
          shortest(o.min_lr) + " exceeds optim.lr (" + shortest(o.lr) + ")");
  non_negative("optim.weight_decay", o.weight_decay);
  unit_interval("optim.beta1", o.beta1);
  unit_interval("optim.beta2", o.beta2);
  positive("optim.eps", o.eps);
  unit_interval("optim.momentum", o.momentum);
  non_negative("optim.warmup_steps", static_cast<double>(o.warmup_steps));
  non_negative("optim.warmup_epochs", o.warmup_epochs);
  at_most("optim.warmup_epochs", o.warmup_epochs, kMaxEpochs);
  if (o.warmup_steps > 0 && o.warmup_epochs > 0)
    fail("optim.warmup_steps", "optim.warmup_steps and optim.warmup_epochs (" +
                                   where("optim.warmup_epochs") + ") are both set; set only one");
  non_negative("optim.clip_grad_norm", o.clip_grad_norm);

  // [precision]
  PrecisionSection& pr = d.precision;
  positive("precision.initial_scale", pr.initial_scale);
  positive("precision.growth_interval", pr.growth_interval);
  positive("precision.fp8_amax_history", pr.fp8_amax_history);
  at_most("precision.fp8_amax_history", pr.fp8_amax_history, 1 << 16);
  non_negative("precision.fp8_margin", pr.fp8_margin);
  at_most("precision.fp8_margin", pr.fp8_margin, 64);
  require(pr.growth_factor > 1, "precision.growth_factor",
          "must be > 1, got " + shortest(pr.growth_factor));
  require(pr.backoff_factor > 0 && pr.backoff_factor < 1, "precision.backoff_factor",
          "must be in (0,1), got " + shortest(pr.backoff_factor));

  // [checkpoint]
  non_negative("checkpoint.every_steps", static_cast<double>(d.checkpoint.every_steps));
  non_negative("checkpoint.keep", d.checkpoint.keep);
  positive("checkpoint.direct_threads", d.checkpoint.direct_threads);
  at_most("checkpoint.direct_threads", d.checkpoint.direct_threads, 64);

  // [device]
  positive("device.comm_timeout", d.device.comm_timeout);
  if (d.device.data_comm_ctas < 0 || d.device.data_comm_ctas > 64) {
    fail("device.data_comm_ctas", "must be between 0 and 64 (0: NCCL's choice)");
  }
  if (d.device.pipe_comm_ctas < 0 || d.device.pipe_comm_ctas > 64) {
    fail("device.pipe_comm_ctas", "must be between 0 and 64 (0: NCCL's choice)");
  }
  if (d.device.tensor_comm_ctas < 0 || d.device.tensor_comm_ctas > 64) {
    fail("device.tensor_comm_ctas", "must be between 0 and 64 (0: NCCL's choice)");
  }
  if (d.device.gemm_sm_margin < 0 || d.device.gemm_sm_margin > 64) {
    fail("device.gemm_sm_margin", "must be between 0 and 64 (SMs left to the reduction)");
  }
  if (d.device.gemm_tune < 0 || d.device.gemm_tune > 16) {
    fail("device.gemm_tune", "must be between 0 and 16 (GEMM algorithms timed per shape)");
  }
  non_negative("device.bucket_mb", d.device.bucket_mb);
  at_most("device.bucket_mb", d.device.bucket_mb, 1048576.0, " MiB");
  if (d.device.fused_gelu_forward_config < -1) {
    fail("device.fused_gelu_forward_config",
         "must be a configuration id >= 0, or -1 (chosen as device.fused_gelu says)");
  }
  if (d.device.fused_gelu_backward_config < -1) {
    fail("device.fused_gelu_backward_config",
         "must be a configuration id >= 0, or -1 (chosen as device.fused_gelu says)");
  }

  // [parallel]: the grid
  ParallelSection& p = d.parallel;
  positive("parallel.pipeline", p.pipeline);
  positive("parallel.tensor", p.tensor);
  positive("parallel.tensor_depth", p.tensor_depth);
  positive("parallel.micro_batches", p.micro_batches);
  at_most("parallel.micro_batches", p.micro_batches, static_cast<double>(kMaxGlobalBatch));
  positive("parallel.chunks", p.chunks);
  require(p.zero == 0 || p.zero == 1, "parallel.zero",
          "must be 0 or 1, got " + std::to_string(p.zero));
  if (d.device.data_comm == "copy_engine") {
    require(p.grad_reduce == "fp32", "device.data_comm",
            "copy_engine sums the gradients in fp32: it needs parallel.grad_reduce = fp32");
  }
  if (p.grad_reduce == "act") {
    const std::string& m = d.precision.mode;
    require(m == "bf16" || m == "fp16" || m == "fp16-naive" || m == "fp8", "parallel.grad_reduce",
            "act needs a 16-bit precision.mode (bf16, fp16, fp16-naive, fp8), got " + m);
    require(p.zero == 0, "parallel.grad_reduce",
            "act is for all-reduced gradients; ZeRO-1 (parallel.zero = 1) reduce-scatters "
            "them in fp32");
  }
  non_negative("parallel.data", p.data);
  if (world_ < 1) throw UserError("world size must be >= 1, got " + std::to_string(world_));
  require(world_ % p.tensor == 0, "parallel.tensor",
          std::to_string(p.tensor) + " does not divide the world size (" + std::to_string(world_) +
              " ranks)");
  // (64-bit product: a huge pipeline count must be refused, not wrap around)
  require(world_ % (static_cast<int64_t>(p.pipeline) * p.tensor) == 0, "parallel.pipeline",
          "parallel.pipeline (" + std::to_string(p.pipeline) + ") x parallel.tensor (" +
              std::to_string(p.tensor) + ") does not divide the world size (" +
              std::to_string(world_) + " ranks)");
  const int derived = world_ / (p.pipeline * p.tensor);
  require(p.data == 0 || p.data == derived, "parallel.data",
          "is " + std::to_string(p.data) + " but world (" + std::to_string(world_) +
              ") / (pipeline " + std::to_string(p.pipeline) + " x tensor " +
              std::to_string(p.tensor) + ") = " + std::to_string(derived) +
              "; leave it 0 to derive it");
  p.data = derived;

  // The tensor layout: q is the side of the square / cube; split_q is what each rank's
  // activations are split by along the batch (see below).
  const int t = p.tensor;
  int q = 1, batch_split = 1;
  require(p.sequence_chunks >= 1 && p.sequence_chunks <= 8, "parallel.sequence_chunks",
          "must be between 1 and 8, got " + std::to_string(p.sequence_chunks));
  require(d.precision.mode != "fp8" || t == 1 || p.tensor_mode == "1d", "precision.mode",
          "fp8 runs the Linears in tensor mode none or 1d (with or without sequence "
          "parallelism); got tensor " + std::to_string(t) + ", tensor_mode " + p.tensor_mode);
  require(!p.sequence_parallel || (t > 1 && p.tensor_mode == "1d"), "parallel.sequence_parallel",
          "needs 1d tensor parallelism (parallel.tensor > 1, tensor_mode = 1d); got tensor " +
              std::to_string(t) + ", tensor_mode " + p.tensor_mode);
  if (t > 1 && p.tensor_mode == "1d") {
    if (p.sequence_parallel) batch_split = t;
    require(m.heads % t == 0, "model.heads",
            std::to_string(m.heads) + " is not divisible by parallel.tensor (" + std::to_string(t) +
                ") for 1d tensor parallelism");
    require(m.mlp_hidden() % t == 0, "model.mlp_ratio",
            "MLP width " + std::to_string(m.mlp_hidden()) +
                " is not divisible by parallel.tensor (" + std::to_string(t) + ")");
  } else if (t > 1 && p.tensor_mode == "2d") {
    q = exact_root(t, 2);
    require(q > 0, "parallel.tensor",
            std::to_string(t) + " is not a square (2d needs tensor = q*q)");
    batch_split = q;
  } else if (t > 1 && p.tensor_mode == "2.5d") {
    const int dd = p.tensor_depth;
    require(t % dd == 0, "parallel.tensor_depth",
            std::to_string(dd) + " does not divide parallel.tensor (" + std::to_string(t) +
                "); 2.5d needs tensor = depth*q*q");
    q = exact_root(t / dd, 2);
    require(q > 0, "parallel.tensor",
            std::to_string(t) + " / parallel.tensor_depth (" + std::to_string(dd) +
                ") is not a square; 2.5d needs tensor = depth*q*q");
    batch_split = dd * q;
  } else if (t > 1 && p.tensor_mode == "3d") {
    q = exact_root(t, 3);
    require(q > 0, "parallel.tensor",
            std::to_string(t) + " is not a cube (3d needs tensor = q*q*q)");
    batch_split = q * q;
  }
  if (t > 1 && (p.tensor_mode == "2d" || p.tensor_mode == "2.5d")) {
    divisible_by_q("model.hidden", m.hidden, q, "q", p.tensor_mode);
    divisible_by_q("model.heads", m.heads, q, "q", p.tensor_mode);
    divisible_by_q("model.mlp_ratio", m.mlp_hidden(), q, "q", p.tensor_mode, "MLP width ");
  } else if (t > 1 && p.tensor_mode == "3d") {
    divisible_by_q("model.hidden", m.hidden, q * q, "q*q", p.tensor_mode);
    divisible_by_q("model.heads", m.heads, q, "q", p.tensor_mode);
    divisible_by_q("model.mlp_ratio", m.mlp_hidden(), q * q, "q*q", p.tensor_mode, "MLP width ");
  }

  // The batch: global = data x grad_accum x micro_batches x micro-batch, and in 2d/2.5d/3d
  // each micro-batch's activations are split over the batch dimension too.
  const int64_t replicas_x_accum = static_cast<int64_t>(p.data) * dt.grad_accum;
  const std::string product = "parallel.data (" + std::to_string(p.data) + ") x data.grad_accum (" +
                              std::to_string(dt.grad_accum) + ") x parallel.micro_batches (" +
                              std::to_string(p.micro_batches) + ")";
  require(dt.global_batch % replicas_x_accum == 0, "data.global_batch",
          std::to_string(dt.global_batch) + " is not divisible by " + product + " = " +
              std::to_string(replicas_x_accum * p.micro_batches));
  const int64_t per_rank = dt.global_batch / replicas_x_accum;
  require(per_rank % p.micro_batches == 0, "parallel.micro_batches",
          std::to_string(p.micro_batches) + " does not divide the per-rank batch " +
              std::to_string(per_rank) + " (data.global_batch " + std::to_string(dt.global_batch) +
              " / (" + product + " without micro-batches))");
  // Mixing pairs the samples at stream positions 2k and 2k+1: a rank's batch must hold both.
  require(!(dt.mixup_alpha > 0 || dt.cutmix_alpha > 0) || per_rank % 2 == 0, "data.global_batch",
          "Mixup / CutMix mix the samples of a pair, so the per-rank batch " +
              std::to_string(per_rank) +
              " (data.global_batch / (parallel.data x data.grad_accum)) must be even");
  const int64_t micro = per_rank / p.micro_batches;
  require(micro % batch_split == 0, "data.global_batch",
          "the micro-batch of " + std::to_string(micro) + " samples (" +
              std::to_string(dt.global_batch) + " / (" + product + ")) is not divisible by " +
              std::to_string(batch_split) + ", which " +
              (p.sequence_parallel ? "1d sequence-parallel" : p.tensor_mode) +
              " tensor parallelism splits it by");

  // The pipeline.
  const bool interleaved = p.schedule == "interleaved";
  if (interleaved)
    require(
        p.chunks >= 2, "parallel.chunks",
        "the interleaved schedule needs >= 2 chunks per stage, got " + std::to_string(p.chunks));
  else
    require(p.chunks == 1, "parallel.chunks",
            "must be 1 unless parallel.schedule = interleaved, got " + std::to_string(p.chunks));
  require(p.chunks <= m.depth, "parallel.chunks",
          std::to_string(p.chunks) + " chunks per stage exceed model.depth (" +
              std::to_string(m.depth) + " blocks)");
  // p.pipeline divides the world size and p.chunks <= model.depth, so this cannot overflow
  const int stages = p.pipeline * p.chunks;
  require(stages <= m.depth, "parallel.pipeline",
          std::to_string(stages) + " pipeline stages x chunks exceed model.depth (" +
              std::to_string(m.depth) + " blocks)");
  if (p.partition == "uniform" || interleaved)
    require(m.depth % stages == 0, "model.depth",
            std::to_string(m.depth) + " blocks cannot be split evenly over parallel.pipeline (" +
                std::to_string(p.pipeline) + ") x parallel.chunks (" + std::to_string(p.chunks) +
                ") = " + std::to_string(stages) + " stages" +
                (interleaved ? "" : "; use parallel.partition = balanced or list:n0,n1,..."));
  if (p.partition.rfind("list:", 0) == 0) {
    std::vector<std::string> items = split(p.partition.substr(5), ',');
    int sum = 0;
    for (const std::string& s : items) {
      int n = 0;
      if (!parse_integer(s, &n) || n < 1)
        fail("parallel.partition",
             "list entries must be positive integers, got '" + s + "' in '" + p.partition + "'");
      sum += n;
    }
    require(static_cast<int>(items.size()) == stages, "parallel.partition",
            "has " + std::to_string(items.size()) +
                " entries but parallel.pipeline x "
                "parallel.chunks = " +
                std::to_string(stages));
    require(
        sum == m.depth, "parallel.partition",
        "entries sum to " + std::to_string(sum) + " but model.depth is " + std::to_string(m.depth));
  }
  check_derived_sizes(d, per_rank, micro);
}

std::string Parser::blame(std::initializer_list<const char*> keys) const {
  for (const char* k : keys) {
    auto it = origins_.find(k);
    if (it != origins_.end() &&
        (it->second.kind == Origin::Deck || it->second.kind == Origin::CommandLine))
      return k;
  }
  return *keys.begin();
}

int64_t Parser::product(std::initializer_list<int64_t> factors) {
  int64_t r = 1;
  for (int64_t f : factors)
    if (__builtin_mul_overflow(r, f, &r)) return -1;
  return r;
}

int64_t Parser::sum(std::initializer_list<int64_t> terms) {
  int64_t r = 0;
  for (int64_t t : terms)
    if (t < 0 || __builtin_add_overflow(r, t, &r)) return -1;
  return r;
}

void Parser::check_derived_sizes(const Deck& d, int64_t per_rank, int64_t micro) const {
  const ModelSection& m = d.model;
  const ParallelSection& p = d.parallel;
  const int64_t S = m.image_size, P = m.patch_size, H = m.hidden, M = m.mlp_hidden();
  const int64_t K = m.num_classes, heads = m.heads;
  const int64_t T = (S / P) * (S / P) + 1;  // <= 8192^2 + 1
  const std::string tokens = std::to_string(T) + " tokens (model.image_size " + std::to_string(S) +
                             " / model.patch_size " + std::to_string(P) + ", squared, + 1)";
  const std::string micro_s = "the micro-batch of " + std::to_string(micro) + " samples";
  auto bytes = [](int64_t b) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.3g", double(b));
    return std::string(buf) + " bytes";
  };
  auto too_big = [&](int64_t v) { return v < 0 || v > kMaxRankBytes; };
  const std::string limit = " per rank, more than any machine holds (" + bytes(kMaxRankBytes) + ")";

  // The kernels take row counts as 32-bit ints: micro-batch x tokens rows in every Linear,
  // x heads in the attention's softmax.
  const int64_t rows = product({micro, T}), att_rows = product({micro, heads, T});
  if (rows < 0 || rows > INT_MAX)
    fail(blame({"model.image_size", "model.patch_size", "data.global_batch",
                "parallel.micro_batches"}),
         micro_s + " x " + tokens + " gives " + (rows < 0 ? "more" : std::to_string(rows)) +
             " activation rows, more than the kernels' limit of " + std::to_string(INT_MAX));
  if (att_rows < 0 || att_rows > INT_MAX)
    fail(blame({"model.heads", "model.image_size", "model.patch_size", "data.global_batch",
                "parallel.micro_batches"}),
         micro_s + " x " + std::to_string(heads) + " heads x " + tokens + " gives " +
             (att_rows < 0 ? "more" : std::to_string(att_rows)) +
             " attention rows, more than the kernels' limit of " + std::to_string(INT_MAX));
  // the attention matrices of every head for the micro-batch, in fp32
  const int64_t att_bytes = product({micro, heads, T, T, 4});
  if (too_big(att_bytes))
    fail(blame({"model.image_size", "model.patch_size", "model.heads", "data.global_batch"}),
         "the attention scores of " + micro_s + " x " + std::to_string(heads) + " heads x " +
             tokens + " squared take " +
             (att_bytes < 0 ? "more than 2^63 bytes" : bytes(att_bytes)) + limit);

  // Parameters: patch embedding, cls and position, per block two norms, qkv, proj and the
  // MLP, the final norm and the head. Training keeps ~16 bytes per parameter (fp32 weights,
  // gradients and two optimizer moments), over pipeline x tensor ranks.
  const int64_t block = sum({product({4, H}), product({3, H, H}), product({3, H}), product({H, H}),
                             H, product({2, H, M}), M, H});
  const int64_t params = sum({product({3, P, P, H}), H, H, product({T, H}),
                              product({m.depth, block}), product({2, H}), product({H, K}), K});
  const int64_t state = product({params, 16});
  const int64_t state_rank = state < 0 ? -1 : state / (int64_t(p.pipeline) * p.tensor);
  if (too_big(state_rank))
    fail(blame({"model.hidden", "model.depth", "model.mlp_ratio", "model.num_classes",
                "model.image_size", "model.preset"}),
         "the model has " + (params < 0 ? std::string("more than 2^63") : std::to_string(params)) +
             " parameters (model.hidden " + std::to_string(H) + ", model.depth " +
             std::to_string(m.depth) + ", MLP width " + std::to_string(M) + ", model.num_classes " +
             std::to_string(K) + "): their training state takes " +
             (state_rank < 0 ? "more than 2^63 bytes" : bytes(state_rank)) + limit);

  // Activations a stage keeps per micro-batch: ~8 hidden-wide and 2 MLP-wide fp32 tensors
  // per block (a lower estimate: enough to tell the absurd).
  const int64_t stage_blocks = (m.depth + p.pipeline - 1) / p.pipeline;
  const int64_t acts =
      product({micro, T, sum({product({8, H}), product({2, M})}), 4, stage_blocks});
  if (too_big(acts))
    fail(blame({"data.global_batch", "model.image_size", "model.patch_size", "model.hidden",
                "model.depth"}),
         "the activations of " + micro_s + " x " + tokens + " x model.hidden " + std::to_string(H) +
             " in " + std::to_string(stage_blocks) + " blocks per stage take " +
             (acts < 0 ? "more than 2^63 bytes" : bytes(acts)) + limit);

  // The batch on the host (uint8 images) and on the device (fp32 images), and Mixup's soft
  // targets.
  const int64_t images = product({per_rank, S, S, 3});
  const int64_t device_images = product({per_rank, S, S, 3, 4});
  const int64_t soft = product({per_rank, K, 4});
  if (too_big(images) || too_big(device_images))
    fail(blame({"data.global_batch", "model.image_size"}),
         "the per-rank batch of " + std::to_string(per_rank) + " images of " + std::to_string(S) +
             "x" + std::to_string(S) + " pixels takes " +
             (device_images < 0 ? "more than 2^63 bytes" : bytes(device_images)) + limit);
  if (too_big(soft))
    fail(blame({"model.num_classes", "data.global_batch"}),
         "the per-rank batch of " + std::to_string(per_rank) + " samples x " + std::to_string(K) +
             " classes of soft targets takes " + (soft < 0 ? "more than 2^63 bytes" : bytes(soft)) +
             limit);
}

void Parser::divisible_by_q(const char* key, int value, int div, const char* divname,
                            const std::string& mode, const std::string& what) const {
  if (value % div != 0)
    fail(key, what + std::to_string(value) + " is not divisible by " + divname + " = " +
                  std::to_string(div) + " of the " + mode + " tensor layout");
}

int Parser::exact_root(int n, int k) {
  for (int r = 1;; ++r) {
    int64_t pw = 1;
    for (int i = 0; i < k; ++i) pw *= r;
    if (pw == n) return r;
    if (pw > n) return 0;
  }
}

}  // namespace deck_detail
}  // namespace vitgrid
