#include "vitgrid/optim/optimizer.h"

#include <algorithm>
#include <cmath>

#include "vitgrid/core/error.h"
#include "vitgrid/deck/deck.h"

namespace vitgrid {

LrSchedule::LrSchedule(const OptimSection& o, int64_t total, int64_t warmup)
    : lr_(o.lr), min_lr_(o.min_lr), total_(std::max<int64_t>(total, 1)), warmup_(warmup) {
  kind_ = o.schedule == "linear" ? 1 : (o.schedule == "constant" ? 2 : 0);
}

double LrSchedule::at(int64_t step) const {
  if (warmup_ > 0 && step <= warmup_) return lr_ * static_cast<double>(step) / warmup_;
  if (kind_ == 2) return lr_;
  const double span = static_cast<double>(std::max<int64_t>(total_ - warmup_, 1));
  const double t = std::min(1.0, static_cast<double>(step - warmup_) / span);
  if (kind_ == 1) return lr_ - (lr_ - min_lr_) * t;
  return min_lr_ + 0.5 * (lr_ - min_lr_) * (1.0 + std::cos(M_PI * t));
}

LossScaler::LossScaler(const PrecisionSection& p, bool enabled)
    : enabled_(enabled),
      scale_(enabled ? p.initial_scale : 1.0),
      growth_(p.growth_factor),
      backoff_(p.backoff_factor),
      interval_(p.growth_interval) {}

bool LossScaler::update(bool all_finite) {
  if (!enabled_) return all_finite;
  if (!all_finite) {
    scale_ = std::max(scale_ * backoff_, 1.0);
    good_ = 0;
    return false;
  }
  if (++good_ >= interval_) {
    scale_ *= growth_;
    good_ = 0;
  }
  return true;
}

Optimizer::Optimizer(const OptimSection& o, Backend& be, TensorParallel& tp, const ViT& model)
    : o_(o), be_(be), tp_(tp), n_(model.num_local_params()) {
  for (const auto& p : model.params()) {
    ParamSlice s;
    s.offset = p.offset;
    s.n = p.numel;
    s.weight_decay = (p.decay || o.decay_norm_and_bias) ? static_cast<float>(o.weight_decay) : 0.0f;
    slices_.push_back(s);
    s.weight_decay = 0.0f;
    plain_.push_back(s);
  }
  const size_t bytes = n_ * sizeof(float);
  m_ = static_cast<float*>(be_.alloc(bytes));
  be_.zero(m_, bytes);
  if (o_.name != "sgd") {
    v_ = static_cast<float*>(be_.alloc(bytes));
    be_.zero(v_, bytes);
  }
}

Optimizer::~Optimizer() {
  if (v_) be_.release(v_);
  be_.release(m_);
}

double Optimizer::grad_norm_sq(const float* grads) {
  std::vector<double> sq(plain_.size());
  be_.sum_squares(sq.data(), grads, plain_);
  tp_.reduce_param_norms(sq);
  double total = 0.0;
  for (double s : sq) total += s;
  return total;
}

void Optimizer::step(float* params, float* grads, double lr, int64_t step, float grad_scale) {
  AdamParams a{static_cast<float>(lr), static_cast<float>(o_.beta1), static_cast<float>(o_.beta2),
               static_cast<float>(o_.eps), static_cast<int>(step), grad_scale};
  if (o_.name == "adamw") {
    be_.adamw_update(params, grads, m_, v_, slices_, a);
  } else if (o_.name == "lamb") {
    // Phase 1 writes the Adam direction (with decoupled decay) over the gradient buffer.
    be_.lamb_direction(grads, params, grads, m_, v_, slices_, a);
    // Trust ratio per whole parameter: ||w|| / ||u||, norms of the full (unsharded) tensors.
    // ||w|| is clamped to 10 as in the LAMB paper's phi and Colossal-AI's implementation.
    std::vector<double> wn(plain_.size()), un(plain_.size());
    be_.sum_squares(wn.data(), params, plain_);
    be_.sum_squares(un.data(), grads, plain_);
    tp_.reduce_param_norms(wn);
    tp_.reduce_param_norms(un);
    std::vector<float> ratio(plain_.size(), 1.0f);
    for (size_t i = 0; i < ratio.size(); ++i) {
      const double w = std::min(std::sqrt(wn[i]), 10.0), u = std::sqrt(un[i]);
      ratio[i] = (w > 0.0 && u > 0.0) ? static_cast<float>(w / u) : 1.0f;
    }
    be_.lamb_apply(params, grads, plain_, ratio, static_cast<float>(lr));
  } else {
    // SGD: PyTorch adds weight decay to the gradient; slices_ carry it.
    be_.sgd_update(params, grads, m_, slices_, static_cast<float>(lr),
                   static_cast<float>(o_.momentum), o_.nesterov, grad_scale);
  }
}

std::vector<std::pair<std::string, float*>> Optimizer::state() {
  if (o_.name == "sgd") return {{"momentum_buffer", m_}};
  return {{"exp_avg", m_}, {"exp_avg_sq", v_}};
}

}  // namespace vitgrid
