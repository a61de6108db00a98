// Transformer Engine's delayed-scaling recipe: model/fp8_scaling.h.
#include "vitgrid/model/fp8_scaling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "vitgrid/core/error.h"

namespace vitgrid {

namespace {

int checked_history(int history) {
  VG_CHECK(history >= 1, "FP8 amax history of " << history << " steps");
  return history;
}

}  // namespace

Fp8ScalingState::Fp8ScalingState(std::vector<Fp8Format> formats, int history, int margin,
                                 Fp8AmaxAlgo algo)
    : formats_(std::move(formats)),
      history_len_(checked_history(history)),
      margin_(margin),
      algo_(algo),
      ring_(formats_.size() * static_cast<size_t>(history_len_), 0.0f),
      updates_(static_cast<uint64_t>(history_len_)),
      scale_(formats_.size(), 1.0f),
      scale_inv_(formats_.size(), 1.0f) {
  rebuild_max();
}

void Fp8ScalingState::merge_amax_max(const float* other) {
  for (size_t i = 0; i < tensors(); ++i) record(i, other[i]);
}

void Fp8ScalingState::push_max(size_t i, uint64_t step, float amax) {
  const size_t L = len();
  const auto rank = [](float v) { return std::isnan(v) ? std::numeric_limits<float>::infinity() : v; };
  uint64_t* qs = q_step_.data() + i * L;
  float* qa = q_amax_.data() + i * L;
  uint32_t &front = q_front_[i], &size = q_size_[i];
  // the entries that leave the window: older than history - 1 updates before `step`
  while (size > 0 && qs[front] + L <= step) {
    front = static_cast<uint32_t>((front + 1) % L);
    --size;
  }
  while (size > 0 && rank(qa[(front + size - 1) % L]) <= rank(amax)) --size;
  qs[(front + size) % L] = step;
  qa[(front + size) % L] = amax;
  ++size;
}

void Fp8ScalingState::rebuild_max() {
  if (algo_ != Fp8AmaxAlgo::Max) return;
  const size_t L = len();
  q_step_.assign(tensors() * L, 0);
  q_amax_.assign(tensors() * L, 0.0f);
  q_front_.assign(tensors(), 0);
  q_size_.assign(tensors(), 0);
  for (size_t i = 0; i < tensors(); ++i)
    for (size_t k = L - 1; k >= 1; --k)  // the closed entries, oldest first
      push_max(i, updates_ - k, ring_[i * L + (head_ + k) % L]);
}

std::vector<float> Fp8ScalingState::amax_history() const {
  const size_t L = len();
  std::vector<float> h(ring_.size());
  for (size_t i = 0; i < tensors(); ++i)
    for (size_t k = 0; k < L; ++k) h[i * L + k] = ring_[i * L + (head_ + k) % L];
  return h;
}

void Fp8ScalingState::update() {
  const size_t L = len();
  for (size_t i = 0; i < tensors(); ++i) {
    const float now = ring_[i * L + head_];
    if (!std::isfinite(now)) ++nonfinite_amaxes_;
    float amax = now;
    if (algo_ == Fp8AmaxAlgo::Max) {
      push_max(i, updates_, now);
      amax = q_amax_[i * L + q_front_[i]];  // the window's max (non-finite where any entry is)
    }
    if (std::isfinite(amax) && amax > 0.0f) {
      // fp8_max * 2^-margin is exact, so this is one rounding, as in TE.
      const float s = std::ldexp(fp8_max(formats_[i]), -margin_) / amax;
      scale_[i] = std::isinf(s) ? std::numeric_limits<float>::max() : s;
      scale_inv_[i] = 1.0f / scale_[i];
    }
  }
  // the window moves on: the oldest entry's slot becomes the next step's, zeroed
  head_ = (head_ + L - 1) % L;
  for (size_t i = 0; i < tensors(); ++i) ring_[i * L + head_] = 0.0f;
  ++updates_;
}

void Fp8ScalingState::restore(const std::vector<float>& amax_history,
                              const std::vector<float>& scales) {
  VG_CHECK(amax_history.size() == ring_.size() && scales.size() == scale_.size(),
           "FP8 scaling state of " << amax_history.size() << " history entries and "
                                   << scales.size() << " scales for " << tensors() << " tensors x "
                                   << history_len_ << " steps");
  ring_ = amax_history;
  head_ = 0;
  scale_ = scales;
  for (size_t i = 0; i < tensors(); ++i) scale_inv_[i] = 1.0f / scale_[i];
  rebuild_max();
}

}  // namespace vitgrid
