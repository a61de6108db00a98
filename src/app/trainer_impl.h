// Private to src/app: Trainer::Impl, the state of one run (Run) and its jobs (Inputs, Stepper,
// Checkpointer, Evaluator, Benchmark), classes of namespace trainer_detail, each defined in a
// file of its own:
//   trainer.cpp             Trainer and Trainer::Impl: construction, setup, teardown, the public
//                           methods; the helpers the files share
//   trainer_setup.cpp       Run: the grid, backend, collectives, model, pipeline, optimizer,
//                           gradient reduction, datasets and the backend's workspace
//   trainer_inputs.cpp      Inputs: the upload slots, batch uploads (training's and eval's), the
//                           device's JPEG decoder and the loaders' configuration
//   trainer_step.cpp        Stepper: the training step (enqueue / run_body / finish, CUDA graphs)
//   trainer_train.cpp       train(): the training loop and the job record of metrics.h5
//   trainer_checkpoint.cpp  Checkpointer: parameters in and out: checkpoint shards, save / load,
//                           free space
//   trainer_eval.cpp        Evaluator: evaluation, evaluate_only() and predict()
//   trainer_bench.cpp       Benchmark: bench() and the pipeline bubble report
// Every job holds a reference to the Run (and to the Inputs or the Stepper it uses).
#pragma once
#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <exception>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
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

namespace trainer_detail {

// What setup builds and every job reads: the grid, backend, collectives, model, pipeline,
// optimizer, gradient reduction, datasets and batch sizes of one run, and the counters its
// checkpoints carry (trainer_setup.cpp).
struct Run {
  MPI_Comm world;
  const Deck& deck;
  Log log;
  std::unique_ptr<ProcessGrid> grid;
  std::unique_ptr<Backend> be;
  std::unique_ptr<Collectives> coll;
  std::unique_ptr<TensorParallel> tp;
  ViTConfig cfg;
  std::unique_ptr<ViT> model;
  std::unique_ptr<PipelineRunner> pipe;  // every step goes through it (P = 1 included)
  std::unique_ptr<Optimizer> opt;
  // data-parallel gradient reduction: buckets overlapped with the backward (overlap), ZeRO-1
  std::unique_ptr<GradReducer> reducer;
  std::unique_ptr<ParamGather> gather;  // ZeRO-1's parameter gather during the forward
  ZeroShards zero_shards;
  bool zero = false, overlap = false;
  // device.data_comm = copy_engine: gradient buckets split evenly over the data ranks, as ZeRO's
  bool copy_engine = false;
  void* d_grad_stage = nullptr;  // parallel.grad_reduce = act: the gradients in act dtype
  std::unique_ptr<LossScaler> scaler;
  std::shared_ptr<Dataset> train_ds, eval_ds;
  int b = 0;      // per-rank batch of one accumulation step (M pipeline micro-batches)
  int micro = 0;  // per-rank pipeline micro-batch (b / M)
  int64_t total_steps = 0, warmup_steps = 0;
  Backend::ReplicaMax tune_agreement;  // the training steps' (set when data > 1)
  // state carried in checkpoints
  int64_t step = 0;     // completed optimizer steps (including skipped fp16 steps)
  int64_t applied = 0;  // applied updates (Adam bias correction)

  Run(MPI_Comm w, const Deck& d) : world(w), deck(d), log(w) {}
  ~Run();  // releases d_grad_stage
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

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

  // Called by all ranks: everything above but the checkpointed counters (the optimizer, the
  // gradient reduction, the training set and the step counts only when `training`).
  void setup(bool training);
  // Called by all ranks once every job allocated its buffers: the backend's own workspace.
  void plan_workspace();

 private:
  void build_pipeline();
  size_t even_split() const;
  void setup_grad_reduction();

  int pipe_sm_margin_ = 0;  // SMs the GEMMs always leave to asynchronous messages
};

// The input side (trainer_inputs.cpp): the upload slots, the uploads of host batches into
// them (training's through the Stepper, eval's one at a time), the device's JPEG decoder and
// the loaders' configuration.
class Inputs {
 public:
  explicit Inputs(Run& run) : run_(run) {}
  ~Inputs();  // releases the device buffers
  Inputs(const Inputs&) = delete;
  Inputs& operator=(const Inputs&) = delete;

  // Binds the loader feeding the uploads (the host decode fallback) for a scope (the loaders
  // live on the stack of train / evaluate / bench).
  struct LoaderScope {
    Inputs& in;
    LoaderScope(Inputs& i, DataLoader& l) : in(i) { in.loader_ = &l; }
    ~LoaderScope() { in.loader_ = nullptr; }
  };

  // Called by all ranks from setup, after Run::setup: the buffers and the decoder.
  void setup();
  LoaderConfig loader_config(bool train) const;
  void start_upload(const HostBatch& hb, int slot, int64_t step);
  void wait_inputs(const HostBatch& hb, int slot);
  DeviceBatch prepare_batch(const HostBatch& hb, int slot);
  void release(int slot);
  DeviceBatch upload(const HostBatch& hb);
  bool device_decodes() const { return decoder_ != nullptr; }
  int64_t bad_images() const { return bad_images_; }

 private:
  void setup_decoder();

  // Upload slots: 0 and 1 alternate in training (the next micro-batch is copied while the
  // current one computes), 2 serves eval / predict (3 is the FP8 scales': Stepper::kFp8Upload).
  // Each device buffer holds one rank batch
  // as [labels | position | soft targets | aug | images], at offsets off_* (position: the
  // step it trains in and its first sample's stream position, which key the dropout masks:
  // DeviceBatch::position). With the device's JPEG decoder the images part is the
  // decoder's: it decodes the batch's views there and copies the host-decoded rest.
  static constexpr int kUploadSlots = 3, kEvalSlot = 2;
  Run& run_;
  void* d_raw_[kUploadSlots] = {nullptr, nullptr, nullptr};
  size_t off_labels_ = 0, off_position_ = 0, off_soft_ = 0, off_aug_ = 0, off_images_ = 0,
         raw_bytes_ = 0;
  // the device's JPEG decoder, when it decodes (data.decode) or resizes the host's decodes
  // (data.resize: resize_on_device_)
  ImageDecoder* decoder_ = nullptr;
  bool resize_on_device_ = false;
  int decode_interp_ = 1;            // its resize filter (data.interpolation)
  DataLoader* loader_ = nullptr;     // the loader feeding start_upload (host decode fallback)
  int64_t bad_images_ = 0;           // undecodable images this rank replaced so far
  void* d_images_ = nullptr;         // the prepared images of one rank batch
};

// The training step (trainer_step.cpp): the micro-batches through the pipeline as eager
// bodies or CUDA graphs, the gradient reduction, the update, the step's scalars read back a
// step late; the upload of each next micro-batch while the current one computes.
class Stepper {
 public:
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

  Stepper(Run& run, Inputs& in) : run_(run), in_(in) {}
  ~Stepper();  // releases the step scalars
  Stepper(const Stepper&) = delete;
  Stepper& operator=(const Stepper&) = delete;

  // Called by all ranks from setup, after Inputs::setup: the step scalars and whether the
  // step's micro-batches run as CUDA graphs.
  void setup(bool training, bool profiling);
  void feed(std::function<std::shared_ptr<const HostBatch>()> next_batch, int64_t step);
  PendingStep enqueue_step(int64_t s, double lr, bool more);
  void finish_step(const PendingStep& p, double* loss, double* gnorm);
  bool graphs_enabled() const { return graphs_.enabled; }
  int64_t graph_captures() const { return graphs_.captures; }

 private:
  // The training step's device scalars (one allocation), read back a step late: the loss sum
  // over the step's samples, the squared gradient norm (loss-scaled) and the factor the
  // optimizer multiplies the gradients by (clipping and 1/loss scale, Backend::clip_factor).
  struct StepScalars {
    double loss_sum = 0.0;
    double grad_sq = 0.0;
    float factor = 0.0f;
    float pad = 0.0f;
  };
  // CUDA graphs of the micro-batch bodies (enabled): one per combination of what a body
  // bakes in (its upload slot, first / last micro-batch of the step, the gradient scale, and
  // Mixup's soft targets), captured on the second run of its key (the first runs eagerly:
  // lazy setup, algorithm timing) and replayed after that (run_body).
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

  void reduce_grads();
  void finish_gradients(float scale);
  void fp8_update();
  template <class F>
  void run_body(const GraphKey& key, F&& body);  // defined (and used) in trainer_step.cpp

  Run& run_;
  Inputs& in_;
  StepScalars* d_step_ = nullptr;
  GraphCache graphs_;
  // Upload state of the training batches: the next micro-batch (already uploading into
  // `slot_`) and where later ones come from (the loader; bench: the same batch again).
  std::shared_ptr<const HostBatch> next_hb_;
  int slot_ = 0;
  std::vector<float> fp8_amax_;  // the step's FP8 amaxes (fp8_update)
  // the backend readback slot of the FP8 amaxes (the step scalars take 0 and 1), and the
  // upload slot of their scales (the batches take 0 to Inputs::kUploadSlots - 1)
  static constexpr int kFp8Readback = 2, kFp8Upload = 3;
  std::function<std::shared_ptr<const HostBatch>()> next_batch_;
};

// Parameters in and out (trainer_checkpoint.cpp): initial parameters, checkpoint shards,
// save / load (resume included) and the free-space check before a run writes anything.
class Checkpointer {
 public:
  // checkpoint I/O rates, GB/s of the last write and read; how long the step loop stopped for
  // the last checkpoint (synchronous: the whole write; in the background: the copy to the host)
  struct Stats {
    double write_gbs = 0.0, read_gbs = 0.0, stall_s = 0.0;
    CheckpointWriteTimes write_times;  // rank 0's, of the last write
  };
  // "hash 0.12 s, HDF5 0.30 s, direct 0.61 s, rename 0.01 s": where the last write went
  std::string write_times_text() const;
  // The state a checkpoint holds (fp32 parameters and optimizer state), bytes.
  double bytes() const;

  explicit Checkpointer(Run& run) : run_(run) {}
  ~Checkpointer();  // waits for a background write (every rank's writer takes part in it)
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;
  void init_params();
  std::string dir() const;
  // Called by all ranks. checkpoint.async: the state is copied into page-locked host memory
  // and a thread of each rank writes the file (collectively, on a communicator of its own)
  // while training goes on; a write still in flight is waited for first. Else the file is
  // written before it returns.
  void save();
  // Called by all ranks before training: with checkpoint.async, the host copy's memory
  // (allocated and page-locked here, not inside the first checkpoint's stall).
  void prepare();
  // Whether a background write is in flight: the same on every rank, since one ends only in
  // poll() or wait(). HDF5 is not thread-safe here: while one is, the main thread leaves the
  // library alone (metrics rows stay buffered).
  bool pending() const { return writer_.joinable(); }
  // Called by all ranks: ends the background write if every rank's has finished (its log
  // line; a failure ends the run with its message, as a synchronous one does).
  void poll();
  // Called by all ranks: waits for the background write, if any, and ends it.
  void wait();
  bool load(std::string path, bool full, bool resume = false);
  // Refuses (on rank 0: call it in agreed()) when run.out_dir's file system lacks room for a
  // checkpoint: before training (no name) and before each checkpoint (its path).
  void check_free_space(const std::string& checkpoint = "");
  const Stats& stats() const { return stats_; }

 private:
  void set_params(const float* host);
  std::vector<TensorShard> shards(std::vector<float>& host, bool with_optim);
  bool async() const;
  // write_checkpoint's direct_threads: checkpoint.direct_threads with direct_io, else 0
  int direct_threads() const;
  void end_write();  // after the writer's join: agreed failure, rates, log line

  Run& run_;
  Stats stats_;
  // the background write: its host copy (page-locked once, reused), communicator and thread
  std::vector<float> host_;
  // FP8's scaling state (precision.mode = fp8): the amax history, then the scales (the same
  // on every rank; rank 0 writes it), untouched while a write of it is in flight
  std::vector<float> fp8_host_;
  void* pinned_ = nullptr;
  size_t pinned_bytes_ = 0;
  MPI_Comm io_comm_ = MPI_COMM_NULL;
  std::thread writer_;
  std::atomic<bool> writer_done_{false};
  std::exception_ptr writer_error_;
  std::string writer_path_;
  double writer_s_ = 0.0;
  CheckpointWriteTimes writer_times_;
};

// Evaluation (trainer_eval.cpp): loss and top-1 / top-5 over the eval split, evaluate_only()
// and predict().
class Evaluator {
 public:
  Evaluator(Run& run, Inputs& in) : run_(run), in_(in) {}
  void evaluate(double* loss, double* top1, double* top5,
                std::vector<std::pair<int64_t, std::vector<float>>>* rows = nullptr);
  int evaluate_only();
  int predict();

 private:
  void from_last_stage(double* v, int n);

  Run& run_;
  Inputs& in_;
};

// Benchmarking (trainer_bench.cpp): bench() and the measured pipeline bubble report (train's
// too).
class Benchmark {
 public:
  Benchmark(Run& run, Inputs& in, Stepper& stepper, Checkpointer& ckpt)
      : run_(run), in_(in), stepper_(stepper), ckpt_(ckpt) {}
  // with_checkpoint (bench --checkpoint): after the timed steps, checkpoint_bench()
  int bench(int warmup, int steps, double peak_tflops, bool with_profile, bool with_checkpoint);
  void report_bubble(MetricsWriter* metrics);

 private:
  void checkpoint_bench(double step_s, const std::function<int()>& steps_beside);
  Run& run_;
  Inputs& in_;
  Stepper& stepper_;
  Checkpointer& ckpt_;
};

}  // namespace trainer_detail

// The jobs of one run, composed. Member order is construction order: each job after the
// ones it holds; teardown runs in reverse (trainer.cpp's ~Impl).
struct Trainer::Impl {
  trainer_detail::Run run;
  trainer_detail::Inputs inputs{run};
  trainer_detail::Stepper stepper{run, inputs};
  trainer_detail::Checkpointer checkpointer{run};
  trainer_detail::Evaluator evaluator{run, inputs};
  trainer_detail::Benchmark benchmark{run, inputs, stepper, checkpointer};

  Impl(MPI_Comm w, const Deck& d) : run(w, d) {}
  ~Impl();  // trainer.cpp

  // Called by all ranks: the Run, then the jobs' buffers, then the backend's workspace.
  void setup(bool training, bool profiling = false);
  int train();  // trainer_train.cpp
  int evaluate_only();
  int predict();
  int bench(int warmup, int steps, double peak_tflops, bool with_profile, bool with_checkpoint);
};

}  // namespace vitgrid
