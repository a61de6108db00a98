// Private to src/app: Trainer::Impl, the state of one run and its jobs, each defined in a file
// of its own:
//   trainer.cpp             construction, teardown, the public Trainer methods, shared helpers
//   trainer_setup.cpp       setup: backend, grid, model, pipeline, gradient reduction, graphs,
//                           decoder, loader configuration
//   trainer_step.cpp        the training step (enqueue / run_body / finish, uploads) and train()
//   trainer_checkpoint.cpp  parameters in and out: checkpoint shards, save / load, free space
//   trainer_eval.cpp        evaluation, evaluate_only() and predict()
//   trainer_bench.cpp       bench() and the pipeline bubble report
#pragma once
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "vitgrid/app/trainer.h"
#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/image_decoder.h"
#include "vitgrid/core/error.h"
#include "vitgrid/core/log.h"
#include "vitgrid/data/dataset.h"
#include "vitgrid/grid/grid.h"
#include "vitgrid/io/checkpoint.h"
#include "vitgrid/io/metrics.h"
#include "vitgrid/model/pipeline_runner.h"
#include "vitgrid/model/vit.h"
#include "vitgrid/optim/grad_reduce.h"
#include "vitgrid/optim/optimizer.h"
#include "vitgrid/parallel/tensor_parallel.h"

namespace vitgrid {
namespace trainer_util {

// Model FLOP rate with a unit that suits it (CPU ranks run at GFLOP/s, GPUs at TFLOP/s).
std::string fmt_flops(double flops_per_s);
// A duration as 1h02m, 3m04s or 5s ("--" when unknown).
std::string fmt_duration(double s);
// mkdir -p.
void mkdirs(const std::string& path);

}  // namespace trainer_util

struct Trainer::Impl {
  MPI_Comm world;
  const Deck& deck;
  Log log;
  std::unique_ptr<ProcessGrid> grid;
  std::unique_ptr<Backend> be;
  // bench --profile: a few more steps with the backend's op profile on (trainer_bench.cpp)
  bool profiling = false;
  std::unique_ptr<Collectives> coll;
  std::unique_ptr<TensorParallel> tp;
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

  // The input side (trainer_step.cpp's uploads; buffers planned once in setup()).
  struct Inputs {
    // Upload slots: 0 and 1 alternate in training (the next micro-batch is copied while the
    // current one computes), 2 serves eval / predict. Each device buffer holds one rank batch
    // as [labels | position | soft targets | aug | images], at offsets off_* (position: the
    // step it trains in and its first sample's stream position, which key the dropout masks:
    // DeviceBatch::position). With the device's JPEG decoder the images part is the
    // decoder's: it decodes the batch's views there and copies the host-decoded rest.
    static constexpr int kUploadSlots = 3, kEvalSlot = 2;
    void* d_raw[kUploadSlots] = {nullptr, nullptr, nullptr};
    size_t off_labels = 0, off_position = 0, off_soft = 0, off_aug = 0, off_images = 0,
           raw_bytes = 0;
    ImageDecoder* decoder = nullptr;  // the device's JPEG decoder, when it decodes (data.decode)
    int decode_interp = 1;            // its resize filter (data.interpolation)
    DataLoader* loader = nullptr;     // the loader feeding start_upload (host decode fallback)
    int64_t bad_images = 0;           // undecodable images this rank replaced so far
    void* d_images = nullptr;         // the prepared images of one rank batch
    // Upload state of the training batches: the next micro-batch (already uploading into
    // `slot`) and where later ones come from (the loader; bench: the same batch again).
    std::shared_ptr<const HostBatch> next_hb;
    int slot = 0;
    std::function<std::shared_ptr<const HostBatch>()> next_batch;
  };
  Inputs in;
  // Binds `in.loader` for a scope (the loaders live on the stack of train / evaluate / bench).
  struct LoaderScope {
    DataLoader*& slot;
    LoaderScope(DataLoader*& s, DataLoader& l) : slot(s) { slot = &l; }
    ~LoaderScope() { slot = nullptr; }
  };
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
  // CUDA graphs of the micro-batch bodies (enabled): one per combination of what a body
  // bakes in (its upload slot, first / last micro-batch of the step, the gradient scale, and
  // Mixup's soft targets), captured on the second run of its key (the first runs eagerly:
  // lazy setup, algorithm timing) and replayed after that (trainer_step.cpp's run_body).
  struct GraphKey {
    int slot;
    bool first, last, soft;
    float grad_scale;
    bool operator<(const GraphKey& o) const {
      return std::tie(slot, first, last, soft, grad_scale) <
             std::tie(o.slot, o.first, o.last, o.soft, o.grad_scale);
    }
  };
  struct GraphCache {
    bool enabled = false;
    std::map<GraphKey, int> graph_of;  // -1: ran once eagerly; else the backend's graph id
    int64_t allocs = 0;                // device allocations when the graphs were captured
    float scale = 0.0f;                // the gradient scale the graphs bake in
    int64_t captures = 0;
  };
  GraphCache graphs;
  // state carried in checkpoints
  int64_t step = 0;     // completed optimizer steps (including skipped fp16 steps)
  int64_t applied = 0;  // applied updates (Adam bias correction)
  // checkpoint I/O rates (trainer_checkpoint.cpp), GB/s of the last write and read
  struct CheckpointStats {
    double write_gbs = 0.0, read_gbs = 0.0;
  };
  CheckpointStats ckpt;
  Backend::ReplicaMax tune_agreement;  // the training steps' (set when data > 1)

  Impl(MPI_Comm w, const Deck& d) : world(w), deck(d), log(w) {}
  ~Impl();  // trainer.cpp

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

  // ---- setup (trainer_setup.cpp)
  void setup(bool training);
  void build_pipeline();
  size_t even_split() const;
  void setup_grad_reduction();
  void setup_graphs(bool training);
  void setup_decoder();
  LoaderConfig loader_config(bool train) const;

  // ---- the training step and loop (trainer_step.cpp)
  void reduce_grads();
  void finish_gradients(float scale);
  template <class F>
  void run_body(const GraphKey& key, F&& body);  // defined (and used) in trainer_step.cpp
  PendingStep enqueue_step(int64_t s, double lr, bool more);
  void finish_step(const PendingStep& p, double* loss, double* gnorm);
  void start_upload(const HostBatch& hb, int slot, int64_t step);
  DeviceBatch prepare_batch(const HostBatch& hb, int slot);
  void wait_inputs(const HostBatch& hb, int slot);
  DeviceBatch upload(const HostBatch& hb);
  void record_job(MetricsWriter& metrics);
  int train();

  // ---- parameters and checkpoints (trainer_checkpoint.cpp)
  void set_params(const float* host);
  void init_params();
  std::string ckpt_dir() const;
  std::vector<TensorShard> shards(std::vector<float>& host, bool with_optim);
  void save_checkpoint();
  double checkpoint_bytes() const;
  // Refuses (on rank 0: call it in agreed()) when run.out_dir's file system lacks room for a
  // checkpoint: before training (no name) and before each checkpoint (its path).
  void check_free_space(const std::string& checkpoint = "");
  bool load_checkpoint(std::string path, bool full, bool resume = false);

  // ---- evaluation (trainer_eval.cpp)
  void from_last_stage(double* v, int n);
  void evaluate(double* loss, double* top1, double* top5,
                std::vector<std::pair<int64_t, std::vector<float>>>* rows = nullptr);
  int evaluate_only();
  int predict();

  // ---- benchmarking (trainer_bench.cpp)
  void report_bubble(MetricsWriter* metrics);
  int bench(int warmup, int steps, double peak_tflops, bool with_profile);
};

}  // namespace vitgrid
