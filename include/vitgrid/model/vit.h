// The Vision Transformer with timm VisionTransformer semantics (DESIGN.md): conv patch
// embedding (k = s = patch), class token, learned position embedding, pre-norm blocks
// (LayerNorm eps 1e-6, one qkv Linear with bias, scale hd^-0.5, output projection, MLP
// Linear-GELU-Linear), final LayerNorm, class-token pooling, Linear head.
//
// Written once against the op set (Backend) and a TensorParallel strategy; it never calls MPI.
// Memory is planned up front: one flat buffer each for master weights, compute weights,
// gradients, and activations, sized for `max_batch` samples at construction.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/model/block_plan.h"
#include "vitgrid/model/fp8_scaling.h"
#include "vitgrid/parallel/tensor_parallel.h"

namespace vitgrid {

struct ModelSection;

struct ViTConfig {
  int image = 32, patch = 4, channels = 3, hidden = 256, depth = 7, heads = 4, mlp = 512;
  int classes = 10;
  float dropout = 0.0f;
  float drop_path = 0.0f;  // the last block's; block l's is drop_path * l / (depth - 1)
  Gelu gelu = Gelu::Exact;
  bool checkpoint_activations = false;
  // With checkpoint_activations: the blocks recomputed, the first n of each chunk (pipeline
  // stage or virtual stage); -1: all of them.
  int checkpoint_blocks = -1;
  bool keep_gelu_output = false;  // per-block GELU output kept, not recomputed in the backward
  // false: every block runs its unfused plan (model/block_plan.h), the reference each fused
  // plan is tested against
  bool fused_block = true;
  // precision.mode = fp8: the block Linears' GEMMs in FP8 (model/block_plan.h), scaled by
  // delayed scaling with this amax history, margin and algorithm (model/fp8_scaling.h)
  bool fp8 = false;
  int fp8_history = Fp8ScalingState::kDefaultHistory;
  int fp8_margin = 0;
  Fp8AmaxAlgo fp8_algo = Fp8AmaxAlgo::Max;
  float ln_eps = 1e-6f;
  int patches() const { return (image / patch) * (image / patch); }
  int tokens() const { return patches() + 1; }
  int patch_dim() const { return channels * patch * patch; }
  int head_dim() const { return hidden / heads; }
  float drop_path_rate(int block) const {
    return depth > 1 ? drop_path * static_cast<float>(block) / static_cast<float>(depth - 1) : 0.0f;
  }
  static ViTConfig from(const ModelSection& m);
  // Model FLOPs of one training sample (forward + backward = 3x forward; GEMMs + attention).
  double train_flops_per_sample() const;
};

enum class InitKind : int { Zeros, Ones, TruncNormal02, Normal1e6, PatchUniform };

struct ParamInfo {
  std::string name;                   // timm state_dict key
  std::vector<int64_t> global_shape;  // timm shape
  Shard shard;                        // this rank's (possibly strided) hyperslab of it
  size_t offset = 0;                  // in the flat local buffers (elements)
  size_t numel = 0;                   // local elements (row-major over the selection)
  bool decay = true;                  // weight decay applies (off for biases, norms, cls, pos)
  InitKind init = InitKind::Zeros;
};

// One micro-batch on the device.
struct DeviceBatch {
  const void* images = nullptr;       // act [count, 3, S, S], normalised and augmented
  const int32_t* labels = nullptr;    // [count]
  const float* soft = nullptr;        // [count, K] Mixup targets or null
  int count = 0;
  int64_t first_position = 0;         // global stream position of sample 0 (dropout counters)
  // Or, where set: {step, stream position} of an uploaded batch in backend memory, whose
  // sample position_offset is this batch's sample 0. The dropout masks then read the step and
  // position there when they run (a CUDA graph of the step replays with the current ones)
  // instead of taking `step` and first_position as the calls are made.
  const int64_t* position = nullptr;
  int64_t position_offset = 0;
};

// The part of the model one pipeline stage holds: its chunks (runs of consecutive blocks, in
// forward order: chunk c of stage s is virtual stage c * P + s), whether its first chunk starts
// with the patch embedding (virtual stage 0) and whether its last chunk ends with the final
// norm, head and loss (the last virtual stage), and how many activation sets (micro-batches in
// flight) to plan up front. whole(): the unsplit model, one set.
struct StageLayout {
  struct Chunk {
    int first_block = 0;
    int blocks = 0;
  };
  std::vector<Chunk> chunks;
  bool embed = true;
  bool head = true;
  int sets = 1;
  // The flat buffers (master, compute, gradients) are padded with zeros to a multiple of this
  // many elements (ZeRO splits them evenly over the data ranks).
  size_t pad_to = 1;
  // The fp32 master weights are kept elsewhere (ZeRO-1's optimizer holds this data rank's
  // pieces): when the compute copy is a buffer of its own (16-bit activations) the model
  // allocates no master buffer, master() is null and set_params writes the compute copy
  // only. Ignored with fp32 storage (the masters are the compute copy).
  bool master_elsewhere = false;
  static StageLayout whole(int depth, int sets = 1) {
    StageLayout l;
    l.chunks = {{0, depth}};
    l.sets = sets;
    return l;
  }
};

// (name, global shape) of every parameter of the whole model, in timm order, whatever this
// rank holds: checkpoints need the full list on every rank.
struct ParamName {
  std::string name;
  std::vector<int64_t> global_shape;
};

class ViT {
 public:
  ViT(const ViTConfig& cfg, Backend& be, TensorParallel& tp, int max_batch);
  // A pipeline stage's part of the model: parameters of its layers only (global names), and
  // `layout.sets` activation sets for micro-batches of up to max_batch samples.
  ViT(const ViTConfig& cfg, Backend& be, TensorParallel& tp, int max_batch,
      const StageLayout& layout);
  ~ViT();
  ViT(const ViT&) = delete;
  ViT& operator=(const ViT&) = delete;

  const ViTConfig& config() const { return cfg_; }
  // The parameters this rank holds (all of them without pipelining).
  const std::vector<ParamInfo>& params() const { return params_; }
  const std::vector<ParamName>& all_param_names() const { return all_names_; }
  const StageLayout& layout() const { return layout_; }
  size_t num_local_params() const { return n_params_; }
  int64_t num_global_params() const;

  // Layout-independent init: element e of parameter p is a function of (seed, name(p), e's
  // global index) whatever the shard. initial_params returns those values (flat local layout,
  // num_local_params() floats) and keys the model's random streams (dropout) by the seed;
  // init_params also writes them (set_params).
  std::vector<float> initial_params(uint64_t seed);
  void init_params(uint64_t seed);
  // Parameters from a flat host copy (num_local_params() floats): into the masters and the
  // compute copy, or the compute copy alone when the masters are kept elsewhere (staged
  // through the gradient buffer, which is zeroed after: no allocation).
  void set_params(const float* host);
  // After the optimizer changed master weights: refresh the compute (act dtype) copy. A no-op
  // alias when act is fp32 storage.
  void sync_compute_params();

  // The fp32 masters; null when they are kept elsewhere (StageLayout::master_elsewhere).
  float* master() { return master_; }
  bool holds_master() const { return master_ != nullptr; }
  // The act-dtype compute copy when it is a buffer of its own (16-bit activations), else null
  // (fp32 storage: the masters are the compute copy).
  void* compute_copy() { return compute_alias_ ? nullptr : compute_; }
  float* grads() { return grads_; }
  void zero_grads();

  // Gradient-ready hook (data-parallel reduction overlapped with the backward): during a
  // chunk_backward called with `final` (this step's last backward of that chunk), once the
  // kernels producing a gradient group are enqueued, hook(offset, n) says that elements
  // [offset, offset + n) of grads() are final for this step. The groups are listed by
  // grad_groups(): the patch embedding with cls_token and pos_embed, each block's attention
  // half (norm1, qkv, proj) and MLP half (norm2, fc1, fc2), the final norm with the head; they
  // tile [0, num_local_params()) (padding included), and each is reported once per final
  // pass, in backward order.
  using GradReadyHook = std::function<void(size_t offset, size_t n)>;
  void set_grad_ready_hook(GradReadyHook hook) { hook_ = std::move(hook); }
  // Parameter-need hook (ZeRO-1's parameter gather overlapped with the forward): every forward
  // calls hook(offset, n) with a group's range (grad_groups()) before its first kernel reads
  // that group's parameters from the compute copy, in forward order.
  using ParamNeedHook = std::function<void(size_t offset, size_t n)>;
  void set_param_need_hook(ParamNeedHook hook) { need_hook_ = std::move(hook); }
  struct GradGroup {
    size_t offset = 0, n = 0;
  };
  const std::vector<GradGroup>& grad_groups() const { return groups_; }
  // Once per optimizer step, after the last micro-batch and before the data-parallel
  // reduction: sums the partial gradients of parameters replicated inside the tensor group
  // (the strategy knows which). Nothing to do without tensor parallelism.
  void reduce_gradients();

  // Forward + loss + backward of one micro-batch; weight gradients accumulate. dlogits are
  // scaled by grad_scale (1/global_batch times the loss scale). Returns the sum of the
  // per-sample losses of this micro-batch (blocking read of one scalar). Every rank of the
  // tensor group passes the same whole micro-batch (count samples) and gets the whole sum;
  // the strategy picks this rank's samples. Collective over the tensor group (as are
  // forward_eval, logits_to_host and reduce_gradients).
  // `step` keys the dropout masks (`micro` does not: a sample's mask depends on its global
  // stream position only). The whole-model calls (forward_backward, forward_eval) need a
  // layout holding the whole model (the default constructor's); pipeline stages use the
  // chunk_* calls below through PipelineRunner.
  double forward_backward(const DeviceBatch& b, float smoothing, float grad_scale,
                          int64_t step, int micro);
  // Forward only; returns loss sum (no smoothing) and top-1 / top-5 counts.
  void forward_eval(const DeviceBatch& b, double* loss_sum, double* top1, double* top5);
  // Logits of the last forward (act dtype, [count, K]) copied to the host as fp32.
  void logits_to_host(std::vector<float>& out, int count);
  // Whether drop path keeps global sample `sample` in block l's attention (branch 0) or MLP
  // (branch 1) residual branch at step `step`, as the kernels draw it (for checks against a
  // reference; true at rate 0).
  bool drop_path_kept(int64_t step, int l, int branch, int64_t sample) const;

  // ---- FP8 (config().fp8). Each block Linear (qkv, proj, fc1, fc2) casts three tensors, x, W
  // and dy (Fp8LinearMeta), each with its scale and the amax its casts record; the model's
  // depth x 4 x 3 tensors are numbered fp8_tensor(l, linear, k). Every rank keeps the whole
  // scaling state (the same on every rank: the amaxes it is updated with are reduced over all
  // of them), so a layout change needs no resharding of it. The casts of a step record into
  // backend memory; between steps the caller
  //   fp8_amaxes_start(slot, up)  enqueues, once the step's backward is, the read-back of
  //                           this rank's amaxes (0 for blocks it does not hold) into the
  //                           backend's readback slot, and their zeroing for the next step;
  //                           with an upload slot up >= 0, marks the work so far as the last
  //                           to read the scales (Backend::release_slot),
  //   (enqueues the optimizer, which the device runs meanwhile)
  //   fp8_amaxes_wait(slot, a) waits for that read-back only and copies the amaxes to a,
  //   reduces a over every rank (MAX; NaN as inf: MPI_MAX may drop a NaN), and
  //   fp8_update(a, up)       records them, updates the scales and uploads them for the next
  //                           step: through upload slot up (>= 0: staged, copied once the
  //                           marked work is done, the work enqueued after it behind the copy;
  //                           the host does not wait), else a copy that waits for the stream.
  static constexpr int kFp8Linears = 4;
  static size_t fp8_tensor(int l, int linear, int k) {
    return (static_cast<size_t>(l) * kFp8Linears + linear) * Fp8LinearMeta::kTensors + k;
  }
  bool fp8() const { return cfg_.fp8; }
  // Whether the plans' LayerNorms write FP8 (block_plan.h: the next FP8 Linear's input).
  bool layernorms_write_fp8() const;
  size_t fp8_tensors() const { return fp8_state_ ? fp8_state_->tensors() : 0; }
  void fp8_amaxes_start(int slot, int upload_slot = -1);
  void fp8_amaxes_wait(int slot, float* amax);
  void fp8_update(const float* amax, int upload_slot = -1);
  // Forgets what the casts recorded since the last update (after an evaluation: its forwards
  // must not widen the training scales).
  void fp8_discard_amaxes();
  // The host state (checkpoints); after Fp8ScalingState::restore, fp8_upload_scales() makes
  // the casts use the restored scales.
  Fp8ScalingState& fp8_scaling() { return *fp8_state_; }
  const Fp8ScalingState& fp8_scaling() const { return *fp8_state_; }
  void fp8_upload_scales(int upload_slot = -1);

  size_t activation_bytes() const { return act_bytes_; }
  // The plan block l (held by this rank) runs for a micro-batch of `batch` samples.
  const BlockPlan& block_plan(int l, int batch) const;

  // ---- pipeline stages (PipelineRunner drives these). Collective over the tensor group, like
  // the rest; never over the pipeline axis (the runner moves the boundary tensors).
  // Forward of local chunk `chunk` on micro-batch b in activation set `set`. The first chunk of
  // the first stage reads b.images; any other chunk reads its input from stage_input(set). The
  // last chunk of the model computes the loss at once: training (train = true) stores
  // dlogits (scaled by grad_scale, with label smoothing) for the backward and adds this rank's
  // loss sum to the DEVICE double *loss (may be null; nothing waits: the caller sums it over
  // the tensor group's batch split, TensorParallel::sum_over_batch_device, and reads it back
  // when it likes); eval returns the loss sum and the top-1 / top-5 counts in the HOST doubles
  // *loss, *top1, *top5. Other chunks leave their output in stage_output(set).
  void chunk_forward(int chunk, int set, const DeviceBatch& b, int64_t step, bool train,
                     float smoothing, float grad_scale, double* loss, double* top1,
                     double* top5);
  // Backward of local chunk `chunk` on micro-batch b in set `set`. A chunk that is not the
  // model's last reads d(its output) from grad_input() (received or copied there first).
  // Weight gradients accumulate. A chunk that is not the model's first leaves d(its input) in
  // stage_input(set) (the set's input is not needed any more).
  // With `final`, the gradient-ready hook reports each group of the chunk as it completes.
  void chunk_backward(int chunk, int set, const DeviceBatch& b, int64_t step,
                      bool final = false);
  void* stage_input(int set);
  void* stage_output(int set);
  void* grad_input();
  // Bytes of this rank's shard of a chunk boundary (the residual stream, Stream layout) of a
  // micro-batch of `batch` samples: what goes between stages.
  size_t boundary_bytes(int batch) const;

 private:
  struct Block;
  struct Set;
  void build_params();
  void compile_plans();
  void plan_activations();
  int chunk_of_block(int l) const;
  // Block l is recomputed in the backward (its activations live in the shared set) rather
  // than kept from its forward.
  bool checkpointed(int l) const;
  bool checkpointed_in_chunk(int j) const;  // the same by the block's index in its chunk
  // Whether the attention of Bi (Inner) samples can run in the strategy's parts: the backend
  // can start at each part.
  bool attention_parts_fit(int Bi) const;
  void block_forward(int l, const DeviceBatch& in, int64_t step, bool train, int set,
                     bool recompute);
  void block_backward(int l, const DeviceBatch& in, int64_t step, int set, bool final);
  void run_ops(const std::vector<Op>& ops, int l, const DeviceBatch& in, int64_t step, int set,
               bool final);
  // The mask key of a dropout site on this rank's block of the global [B, T, width]
  // activation of `layout` (counters are global element indices), with drop path at rate
  // path_p (the residual branches' sites).
  DropoutKey dkey(const DeviceBatch& in, int64_t step, int layer, int site, ActLayout layout,
                  int64_t width, float path_p = 0.0f) const;

  void fp8_init();
  // The scaling of block l's Linear `linear` (0 qkv, 1 proj, 2 fc1, 3 fc2) in backend memory.
  Fp8LinearMeta fp8_meta(int l, int linear) const;

  ViTConfig cfg_;
  Backend& be_;
  TensorParallel& tp_;
  int max_batch_;
  StageLayout layout_;
  std::vector<ParamInfo> params_;
  std::vector<ParamName> all_names_;
  // index in params_ of the first parameter of block l (-1: not on this stage), of the
  // patch embedding's weight and of the final norm's weight (-1: not held)
  std::vector<int> block_param_;
  // the plan of each held block (by global index): [0] as compiled, [1] (only where the
  // strategy runs the attention in parts) the same without parts, for micro-batches whose
  // parts the backend's attention cannot start at
  std::vector<BlockPlan> plans_[2];
  int embed_param_ = -1, head_param_ = -1;
  // gradient groups: groups_ in offset order; the group index of block l / embedding / head
  std::vector<GradGroup> groups_;
  std::vector<int> block_group_;
  int embed_group_ = -1, head_group_ = -1;
  GradReadyHook hook_;
  ParamNeedHook need_hook_;
  void report(int group) const;
  void need(int group) const;
  size_t n_params_ = 0;
  float* master_ = nullptr;
  float* grads_ = nullptr;
  void* compute_ = nullptr;  // act dtype copy of master_ (== master_ for fp32 storage)
  bool compute_alias_ = false;
  void* act_pool_ = nullptr;
  size_t act_bytes_ = 0;
  struct Acts;
  std::unique_ptr<Acts> a_;
  uint64_t seed_ = 0;
  // FP8: the host state, and in backend memory [scales | scale_invs | amaxes] of its tensors
  std::unique_ptr<Fp8ScalingState> fp8_state_;
  float* fp8_dev_ = nullptr;
  // FP8: W's transposed codes [in, out] of each held block's four Linears (Fp8LinearMeta::w_t:
  // written by the forward's cast of W, read by the data gradient); null for blocks not held
  std::vector<std::vector<uint8_t*>> fp8_wt_;
  void* fp8_wt_pool_ = nullptr;
};

}  // namespace vitgrid
