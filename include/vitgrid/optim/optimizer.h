// Optimizers (AdamW, LAMB, SGD with momentum), the learning-rate schedule, global-norm
// clipping and dynamic loss scaling. State lives in flat fp32 buffers parallel to the model's
// parameters; every update is one multi-tensor backend call over the parameter slices.
//
// ZeRO-1 (a ZeroShards given): the state holds only this data rank's pieces of the flat
// buffer (grad_reduce.h), so it takes 1/D of the memory. With 16-bit activations the fp32
// master weights are sharded the same way: the model keeps none (StageLayout::
// master_elsewhere) and the optimizer holds this rank's pieces. A step updates the rank's
// pieces of the masters (one multi-tensor call per bucket) from the reduce-scattered gradient
// pieces, then all-gathers the parameters over the data axis: the pieces cast into the 16-bit
// compute copy, or (fp32 storage, whole masters on every rank) the fp32 masters. Norms
// (clipping, LAMB trust ratios) are whole-parameter norms: per-parameter partial sums of
// squares over the pieces, summed over the data axis, then over the tensor axes as without
// ZeRO.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/grid/grid.h"
#include "vitgrid/model/vit.h"
#include "vitgrid/optim/grad_reduce.h"
#include "vitgrid/parallel/tensor_parallel.h"

namespace vitgrid {

struct OptimSection;
struct PrecisionSection;

// Linear warmup from 0 to lr over `warmup` steps, then cosine or linear decay to min_lr at
// `total`, or constant. Stepped per optimizer step; step is 1-based.
class LrSchedule {
 public:
  LrSchedule(const OptimSection& o, int64_t total, int64_t warmup);
  double at(int64_t step) const;

 private:
  enum class Kind { Cosine, Linear, Constant };
  double lr_, min_lr_;
  int64_t total_, warmup_;
  Kind kind_;
};

// Dynamic loss scaling for fp16 (initial 2^16, x growth after `interval` clean steps, x backoff
// on overflow; the step is skipped). Disabled (scale 1) in the other modes.
class LossScaler {
 public:
  LossScaler(const PrecisionSection& p, bool enabled);
  float scale() const { return static_cast<float>(scale_); }
  bool enabled() const { return enabled_; }
  // After a step's gradients are known: all_finite agreed over every rank. Returns whether the
  // optimizer step should be applied.
  bool update(bool all_finite);
  int64_t good_steps() const { return good_; }
  void restore(double scale, int64_t good) { scale_ = scale; good_ = good; }

 private:
  bool enabled_;
  double scale_, growth_, backoff_;
  int interval_;
  int64_t good_ = 0;
};

class Optimizer {
 public:
  // zero: ZeRO-1 over the data axis (`coll` all-gathers the updated parameters: see step(),
  // `data_comm` reduces norms and gathers checkpoint data); null: every rank holds the whole
  // state.
  Optimizer(const OptimSection& o, Backend& be, TensorParallel& tp, const ViT& model,
            const ZeroShards* zero = nullptr, Collectives* coll = nullptr,
            MPI_Comm data_comm = MPI_COMM_NULL);
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Sum of squares of the whole gradient (true norms across tensor shards, and across data
  // ranks with ZeRO), before unscaling. Collective over the tensor (and, with ZeRO, data) axes.
  // Blocking (per-parameter sums on the host): the tests' reference for grad_norm_sq_device,
  // which the trainer uses.
  double grad_norm_sq(const float* grads);
  // The same into the device double *out, enqueued only (no host wait): each rank sums the
  // slices it counts (TensorParallel::counts_in_norm), then over the tensor group (and the
  // data axis with ZeRO). The caller adds the pipeline stages.
  void grad_norm_sq_device(const float* grads, double* out);
  // Whether this rank's reduced gradients are finite (with ZeRO: its pieces only; the caller
  // agrees the verdict over every rank).
  bool grads_finite(const float* grads);
  // One update with this step's lr; grads are multiplied by grad_scale first (unscale and
  // clip). step is the 1-based count of applied updates (bias correction). With ZeRO, called by
  // every data rank. grad_scale_dev, when set, multiplies grad_scale on the device
  // (Backend::clip_factor). `params`: the model's masters (null when the model keeps none);
  // `compute`: the model's act-dtype copy of the parameters when it is a buffer of its own
  // (bf16 / fp16), else null.
  // Returns whether `compute` was refreshed here. With ZeRO and `compute`: each rank casts its
  // updated pieces into `compute` and the act-dtype pieces are all-gathered (half the bytes
  // of fp32 masters, and no cast of the whole model); with gather = false only the cast is
  // done, the caller gathers (ParamGather, during the next forward). Otherwise (false) the
  // masters are whole on every rank and the caller casts them.
  bool step(float* params, float* grads, double lr, int64_t step, float grad_scale,
            const float* grad_scale_dev = nullptr, void* compute = nullptr, bool gather = true);
  // The master weights in the model's flat layout on the host (num_local_params() floats):
  // with ZeRO each rank's own pieces (held here, or in `params`), all-gathered over the data
  // axis on the host (called by every data rank); without, a copy of `params`.
  void master_to_host(const float* params, float* flat_host);
  // The reverse, for the masters held here (this rank's pieces of a flat host copy: after
  // init or a checkpoint load); nothing when the model holds them (ViT::set_params writes
  // those).
  void master_from_host(const float* flat_host);
  // Whether this optimizer holds the masters (this rank's pieces; the model keeps none).
  bool holds_master() const { return w_ != nullptr; }

  // Named state buffers for checkpoints: ("exp_avg", m), ("exp_avg_sq", v) for Adam-type,
  // ("momentum_buffer", mom) for SGD (PyTorch's names). With ZeRO they hold the pieces only
  // (state_elems() each); use the host helpers below for the flat (global-layout) form.
  std::vector<std::pair<std::string, float*>> state();
  size_t state_elems() const { return zero_ ? shard_n_ : n_; }
  bool sharded() const { return zero_; }
  // State k in the model's flat layout on the host (num_local_params() floats). With ZeRO,
  // all-gathered over the data axis on the host (called by every data rank).
  void state_to_host(size_t k, float* flat_host);
  // The reverse: this rank's part of a flat host copy into state k.
  void state_from_host(size_t k, const float* flat_host);
  const std::vector<ParamSlice>& slices() const { return slices_; }

 private:
  // ZeRO: the pieces of `device` (at their flat offsets when `flat`, else at their shard
  // offsets) gathered into the flat host buffer over the data axis
  void gather_pieces_to_host(const float* device, bool flat, float* flat_host);
  // ZeRO: the parameters' intersections with piece k, offsets relative to the piece
  struct Piece {
    size_t flat = 0, shard = 0, n = 0;
    std::vector<ParamSlice> slices;
    std::vector<int> param;  // index of each slice's parameter
  };
  // per-parameter sums of squares of buf's slices `sl` (zslices_ or wslices_: a parameter's
  // intersections with the pieces), summed over the data axis
  std::vector<double> piece_norms(const float* buf, const std::vector<ParamSlice>& sl);
  // ZeRO with a compute copy: this rank's updated master pieces (w_, else params at flat
  // offsets) cast into `compute`, then (gather) every rank's act-dtype pieces gathered in place
  void gather_compute(const float* params, void* compute, bool gather);
  // every rank's pieces of the flat buffer `flat` (es bytes per element) to every rank, in place
  void allgather_pieces(void* flat, size_t es);
  // this rank's pieces of a flat host copy into a shard-layout device buffer
  void pieces_from_host(const float* flat, float* shard);

  enum class Kind { AdamW, Lamb, Sgd };  // optim.name, resolved once
  const OptimSection& o_;
  Kind kind_;
  Backend& be_;
  TensorParallel& tp_;
  size_t n_;
  std::vector<ParamSlice> slices_;
  std::vector<ParamSlice> plain_;  // the same slices, weight decay 0 (for norms)
  float* m_ = nullptr;
  float* v_ = nullptr;
  // ZeRO-1
  bool zero_ = false;
  ZeroShards shards_;
  Collectives* coll_ = nullptr;
  MPI_Comm data_comm_ = MPI_COMM_NULL;
  size_t shard_n_ = 0;
  std::vector<Piece> pieces_;
  std::vector<ParamSlice> zslices_;  // every piece's slices, flat offsets, decay 0 (norms)
  std::vector<int> zparam_;          // parameter of each zslice
  float* w_ = nullptr;               // this rank's master pieces (when the model keeps none)
  std::vector<ParamSlice> wslices_;  // zslices_ at shard offsets (norms of w_)
  std::vector<ParamSlice> norm_slices_;  // the slices this rank counts in the global norm
};

}  // namespace vitgrid
