// Optimizers (AdamW, LAMB, SGD with momentum), the learning-rate schedule, global-norm
// clipping and dynamic loss scaling. State lives in flat fp32 buffers parallel to the model's
// parameters; every update is one multi-tensor backend call over the parameter slices.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/model/vit.h"
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
  double lr_, min_lr_;
  int64_t total_, warmup_;
  int kind_;  // 0 cosine, 1 linear, 2 constant
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
  Optimizer(const OptimSection& o, Backend& be, TensorParallel& tp, const ViT& model);
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Sum of squares of the whole gradient (true norms across tensor shards), before unscaling.
  double grad_norm_sq(const float* grads);
  // One update with this step's lr; grads are multiplied by grad_scale first (unscale and
  // clip). step is the 1-based count of applied updates (bias correction).
  void step(float* params, float* grads, double lr, int64_t step, float grad_scale);

  // Named state buffers for checkpoints: ("exp_avg", m), ("exp_avg_sq", v) for Adam-type,
  // ("momentum_buffer", mom) for SGD (PyTorch's names).
  std::vector<std::pair<std::string, float*>> state();
  const std::vector<ParamSlice>& slices() const { return slices_; }

 private:
  const OptimSection& o_;
  Backend& be_;
  TensorParallel& tp_;
  size_t n_;
  std::vector<ParamSlice> slices_;
  std::vector<ParamSlice> plain_;  // the same slices, weight decay 0 (for norms)
  float* m_ = nullptr;
  float* v_ = nullptr;
};

}  // namespace vitgrid
