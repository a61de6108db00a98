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
      history_(formats_.size() * static_cast<size_t>(history_len_), 0.0f),
      scale_(formats_.size(), 1.0f),
      scale_inv_(formats_.size(), 1.0f) {}

void Fp8ScalingState::merge_amax_max(const float* other) {
  for (size_t i = 0; i < tensors(); ++i) record(i, other[i]);
}

void Fp8ScalingState::update() {
  const size_t len = static_cast<size_t>(history_len_);
  for (size_t i = 0; i < tensors(); ++i) {
    float* row = history_.data() + i * len;
    if (!std::isfinite(row[0])) ++nonfinite_amaxes_;
    float amax = row[0];
    if (algo_ == Fp8AmaxAlgo::Max) {
      for (size_t k = 1; k < len; ++k) amax = amax_max(amax, row[k]);
    }
    if (std::isfinite(amax) && amax > 0.0f) {
      // fp8_max * 2^-margin is exact, so this is one rounding, as in TE.
      const float s = std::ldexp(fp8_max(formats_[i]), -margin_) / amax;
      scale_[i] = std::isinf(s) ? std::numeric_limits<float>::max() : s;
      scale_inv_[i] = 1.0f / scale_[i];
    }
    std::copy_backward(row, row + len - 1, row + len);
    row[0] = 0.0f;
  }
}

void Fp8ScalingState::restore(const std::vector<float>& amax_history,
                              const std::vector<float>& scales) {
  VG_CHECK(amax_history.size() == history_.size() && scales.size() == scale_.size(),
           "FP8 scaling state of " << amax_history.size() << " history entries and "
                                   << scales.size() << " scales for " << tensors() << " tensors x "
                                   << history_len_ << " steps");
  history_ = amax_history;
  scale_ = scales;
  for (size_t i = 0; i < tensors(); ++i) scale_inv_[i] = 1.0f / scale_[i];
}

}  // namespace vitgrid
