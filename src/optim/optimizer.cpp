#include "vitgrid/optim/optimizer.h"

#include <algorithm>
#include <climits>
#include <cmath>

#include "vitgrid/core/error.h"
#include "vitgrid/core/watchdog.h"
#include "vitgrid/deck/deck.h"

namespace vitgrid {

LrSchedule::LrSchedule(const OptimSection& o, int64_t total, int64_t warmup)
    : lr_(o.lr), min_lr_(o.min_lr), total_(std::max<int64_t>(total, 1)), warmup_(warmup) {
  kind_ = o.schedule == "linear" ? Kind::Linear : o.schedule == "constant" ? Kind::Constant : Kind::Cosine;
}

double LrSchedule::at(int64_t step) const {
  if (warmup_ > 0 && step <= warmup_) return lr_ * static_cast<double>(step) / warmup_;
  if (kind_ == Kind::Constant) return lr_;
  const double span = static_cast<double>(std::max<int64_t>(total_ - warmup_, 1));
  const double t = std::min(1.0, static_cast<double>(step - warmup_) / span);
  if (kind_ == Kind::Linear) return lr_ - (lr_ - min_lr_) * t;
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

Optimizer::Optimizer(const OptimSection& o, Backend& be, TensorParallel& tp, const ViT& model,
                     const ZeroShards* zero, Collectives* coll, MPI_Comm data_comm)
    : o_(o),
      kind_(o.name == "lamb" ? Kind::Lamb : o.name == "sgd" ? Kind::Sgd : Kind::AdamW),
      be_(be),
      tp_(tp),
      n_(model.num_local_params()) {
  for (const auto& p : model.params()) {
    ParamSlice s;
    s.offset = p.offset;
    s.n = p.numel;
    s.weight_decay = (p.decay || o.decay_norm_and_bias) ? static_cast<float>(o.weight_decay) : 0.0f;
    slices_.push_back(s);
    s.weight_decay = 0.0f;
    plain_.push_back(s);
  }
  if (zero && zero->size > 1) {
    VG_CHECK(coll && data_comm != MPI_COMM_NULL, "ZeRO needs the data axis' collectives");
    zero_ = true;
    shards_ = *zero;
    coll_ = coll;
    data_comm_ = data_comm;
    size_t at = 0, end = 0;
    for (size_t k = 0; k < shards_.buckets.size(); ++k) {
      VG_CHECK(shards_.buckets[k].offset == end, "buckets do not tile the gradient buffer");
      end += shards_.buckets[k].n;
      Piece pc;
      pc.flat = shards_.piece_offset(k);
      pc.shard = at;
      pc.n = shards_.piece_n(k);
      for (size_t i = 0; i < slices_.size(); ++i) {
        const size_t lo = std::max(slices_[i].offset, pc.flat);
        const size_t hi = std::min(slices_[i].offset + slices_[i].n, pc.flat + pc.n);
        if (lo >= hi) continue;
        pc.slices.push_back({lo - pc.flat, hi - lo, slices_[i].weight_decay});
        pc.param.push_back(static_cast<int>(i));
        zslices_.push_back({lo, hi - lo, 0.0f});
        zparam_.push_back(static_cast<int>(i));
      }
      at += pc.n;
      pieces_.push_back(std::move(pc));
    }
    VG_CHECK(end == n_, "buckets cover " << end << " of " << n_ << " gradient elements");
    shard_n_ = at;
  }
  // the slices this rank counts in the global gradient norm (grad_norm_sq_device)
  if (zero_) {
    for (size_t k = 0; k < zslices_.size(); ++k)
      if (tp_.counts_in_norm(static_cast<size_t>(zparam_[k]))) norm_slices_.push_back(zslices_[k]);
  } else {
    for (size_t i = 0; i < plain_.size(); ++i)
      if (tp_.counts_in_norm(i)) norm_slices_.push_back(plain_[i]);
  }
  // a model without masters (16-bit activations under ZeRO-1): this rank's pieces live here
  if (!model.holds_master()) {
    VG_CHECK(zero_, "the model keeps no master weights, but the optimizer is not sharded "
                    "(ZeRO-1 over more than one data rank holds them)");
    for (const Piece& pc : pieces_)
      for (const ParamSlice& sl : pc.slices) wslices_.push_back({pc.shard + sl.offset, sl.n, 0.0f});
    w_ = static_cast<float*>(be_.alloc(shard_n_ * sizeof(float)));
    be_.zero(w_, shard_n_ * sizeof(float));
  }
  const size_t bytes = state_elems() * sizeof(float);
  m_ = static_cast<float*>(be_.alloc(bytes));
  be_.zero(m_, bytes);
  if (kind_ != Kind::Sgd) {
    v_ = static_cast<float*>(be_.alloc(bytes));
    be_.zero(v_, bytes);
  }
}

Optimizer::~Optimizer() {
  if (w_) be_.release(w_);
  if (v_) be_.release(v_);
  be_.release(m_);
}

// Called by every rank of the data axis.
std::vector<double> Optimizer::piece_norms(const float* buf, const std::vector<ParamSlice>& sl) {
  std::vector<double> part(sl.size());
  if (!sl.empty()) be_.sum_squares(part.data(), buf, sl);
  std::vector<double> sq(plain_.size(), 0.0);
  for (size_t i = 0; i < part.size(); ++i) sq[zparam_[i]] += part[i];
  // a parameter may straddle pieces of several ranks: whole-parameter sums
  WatchdogWait w("the MPI all-reduce of the parameter norms", "data");
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, sq.data(), static_cast<int>(sq.size()), MPI_DOUBLE,
                          MPI_SUM, data_comm_));
  return sq;
}

double Optimizer::grad_norm_sq(const float* grads) {
  std::vector<double> sq(plain_.size());
  if (zero_)
    sq = piece_norms(grads, zslices_);
  else
    be_.sum_squares(sq.data(), grads, plain_);
  tp_.reduce_param_norms(sq);
  double total = 0.0;
  for (double s : sq) total += s;
  return total;
}

void Optimizer::grad_norm_sq_device(const float* grads, double* out) {
  if (norm_slices_.empty())
    be_.zero(out, sizeof(double));
  else
    be_.sum_squares_total(out, grads, norm_slices_);
  tp_.reduce_norm_total(out);
  if (zero_) coll_->allreduce(out, 1, Elem::F64, ReduceOp::Sum, Axis::Data);
}

bool Optimizer::grads_finite(const float* grads) {
  if (!zero_) return be_.all_finite(grads, n_);
  bool ok = true;
  for (const Piece& pc : pieces_)
    if (pc.n > 0) ok = be_.all_finite(grads + pc.flat, pc.n) && ok;
  return ok;
}

bool Optimizer::step(float* params, float* grads, double lr, int64_t step, float grad_scale,
                     const float* grad_scale_dev, void* compute, bool gather) {
  AdamParams a{static_cast<float>(lr), static_cast<float>(o_.beta1), static_cast<float>(o_.beta2),
               static_cast<float>(o_.eps), static_cast<int>(step), grad_scale, grad_scale_dev};
  if (zero_) {
    // this rank's pieces: one multi-tensor call per bucket (state offsets differ from flat
    // ones; so do the masters' when this optimizer holds them)
    VG_CHECK(!w_ || compute, "ZeRO-1 with the masters' pieces here but no compute copy to gather");
    float* w = w_ ? w_ : params;
    auto wo = [&](const Piece& pc) { return w_ ? pc.shard : pc.flat; };
    if (kind_ == Kind::AdamW) {
      for (const Piece& pc : pieces_)
        if (!pc.slices.empty())
          be_.adamw_update(w + wo(pc), grads + pc.flat, m_ + pc.shard, v_ + pc.shard, pc.slices,
                           a);
    } else if (kind_ == Kind::Lamb) {
      for (const Piece& pc : pieces_)
        if (!pc.slices.empty())
          be_.lamb_direction(grads + pc.flat, w + wo(pc), grads + pc.flat, m_ + pc.shard,
                             v_ + pc.shard, pc.slices, a);
      std::vector<double> wn = piece_norms(w, w_ ? wslices_ : zslices_),
                          un = piece_norms(grads, zslices_);
      tp_.reduce_param_norms(wn);
      tp_.reduce_param_norms(un);
      for (const Piece& pc : pieces_) {
        if (pc.slices.empty()) continue;
        std::vector<float> ratio(pc.slices.size(), 1.0f);
        for (size_t j = 0; j < ratio.size(); ++j) {
          const int i = pc.param[j];
          const double wv = std::min(std::sqrt(wn[i]), 10.0), u = std::sqrt(un[i]);
          ratio[j] = (wv > 0.0 && u > 0.0) ? static_cast<float>(wv / u) : 1.0f;
        }
        be_.lamb_apply(w + wo(pc), grads + pc.flat, pc.slices, ratio, static_cast<float>(lr));
      }
    } else {
      for (const Piece& pc : pieces_)
        if (!pc.slices.empty())
          be_.sgd_update(w + wo(pc), grads + pc.flat, m_ + pc.shard, pc.slices,
                         static_cast<float>(lr), static_cast<float>(o_.momentum), o_.nesterov,
                         grad_scale, grad_scale_dev);
    }
    if (compute)
      gather_compute(params, compute, gather);
    else
      allgather_pieces(params, sizeof(float));  // the fp32 masters themselves (the caller casts)
    return compute != nullptr;
  }
  if (kind_ == Kind::AdamW) {
    be_.adamw_update(params, grads, m_, v_, slices_, a);
  } else if (kind_ == Kind::Lamb) {
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
                   static_cast<float>(o_.momentum), o_.nesterov, grad_scale, grad_scale_dev);
  }
  return false;
}

std::vector<std::pair<std::string, float*>> Optimizer::state() {
  if (kind_ == Kind::Sgd) return {{"momentum_buffer", m_}};
  return {{"exp_avg", m_}, {"exp_avg_sq", v_}};
}

void Optimizer::gather_pieces_to_host(const float* device, bool flat, float* host) {
  for (const Piece& pc : pieces_)
    if (pc.n > 0)
      be_.copy_to_host(host + pc.flat, device + (flat ? pc.flat : pc.shard), pc.n * sizeof(float));
  for (size_t b = 0; b < shards_.buckets.size(); ++b) {
    const size_t c = shards_.piece_n(b);
    VG_CHECK(c <= static_cast<size_t>(INT_MAX), "bucket piece of " << c << " floats");
    WatchdogWait w("the MPI all-gather of the optimizer state", "data");
    MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, host + shards_.buckets[b].offset,
                            static_cast<int>(c), MPI_FLOAT, data_comm_));
  }
}

void Optimizer::state_to_host(size_t k, float* flat) {
  const float* buf = state().at(k).second;
  if (!zero_) {
    be_.copy_to_host(flat, buf, n_ * sizeof(float));
    return;
  }
  gather_pieces_to_host(buf, false, flat);
}

void Optimizer::gather_compute(const float* params, void* compute, bool gather) {
  // every rank's pieces cast into the compute copy and gathered in the act dtype, in place
  // (the cast is elementwise, so this is the cast of whole masters)
  char* dst = static_cast<char*>(compute);
  const size_t es = be_.act_size();
  for (const Piece& pc : pieces_)
    if (pc.n > 0)
      be_.cast_to_act(dst + pc.flat * es, w_ ? w_ + pc.shard : params + pc.flat, pc.n);
  if (gather) allgather_pieces(dst, es);
}

void Optimizer::allgather_pieces(void* flat, size_t es) {
  char* f = static_cast<char*>(flat);
  for (size_t k = 0; k < shards_.buckets.size(); ++k)
    coll_->allgather(f + shards_.buckets[k].offset * es, f + shards_.piece_offset(k) * es,
                     shards_.piece_n(k), Elem::Act, Axis::Data);
}

void Optimizer::master_to_host(const float* params, float* flat) {
  if (!zero_) {
    be_.copy_to_host(flat, params, n_ * sizeof(float));
    return;
  }
  if (w_)
    gather_pieces_to_host(w_, false, flat);
  else
    gather_pieces_to_host(params, true, flat);
}

void Optimizer::pieces_from_host(const float* flat, float* shard) {
  for (const Piece& pc : pieces_)
    if (pc.n > 0) be_.copy_to_device(shard + pc.shard, flat + pc.flat, pc.n * sizeof(float));
}

void Optimizer::master_from_host(const float* flat) {
  if (w_) pieces_from_host(flat, w_);
}

void Optimizer::state_from_host(size_t k, const float* flat) {
  float* buf = state().at(k).second;
  if (!zero_) {
    be_.copy_to_device(buf, flat, n_ * sizeof(float));
    return;
  }
  pieces_from_host(flat, buf);
}

}  // namespace vitgrid
