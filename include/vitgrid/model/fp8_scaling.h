// Per-tensor FP8 scaling factors by Transformer Engine's delayed-scaling recipe
// (transformer_engine.common.recipe.DelayedScaling, and the amax_and_scale_update kernel of
// transformer_engine/common/recipe/delayed_scaling.cu that applies it).
//
// An FP8 tensor is stored as encode(x * scale) and read as decode(code) * scale_inv. Taking the
// scale from the tensor itself would cost a pass over it before the cast, so the scale is
// predicted from the past instead: the kernel that casts a tensor also reports its amax
// (max |x|, backend/fp8.h fp8_quantize), record() keeps it in the tensor's history, and
// update(), once per optimizer step, sets
//     scale = fp8_max / 2^margin / amax,   amax = max of the last `history` steps' amaxes
// ("max"; "most_recent" takes the step just closed). A tensor that grows beyond its predicted
// range saturates at +-fp8_max until the next update. One entry ("meta") per GEMM operand role:
// E4M3 for activations and weights, E5M2 for gradients (TE's "hybrid" format).
//
// Defaults are TE's: amax_history_len 1024, margin 0, amax_compute_algo "max". As in TE's
// kernel, an amax of 0 (nothing recorded) or inf/NaN (an overflow upstream) leaves the scale as
// it was, the initial scale is 1, and a scale that overflows fp32 (a tiny amax) becomes
// FLT_MAX. Unlike TE's kernel, whose fmaxf skips NaN, a NaN in the window counts as an
// overflow, like inf, as in TE's PyTorch path (torch.max in _default_get_amax_and_update_history):
// the two mean the same thing upstream, and a window that held one keeps its scale until the
// entry leaves it. TE rolls its history by -1 (entry 0 the current step, the others in ring
// order); here entry k is the step k updates ago: the same window, in time order (kept in a
// ring, so an update moves nothing; and for "max" a queue of the window's decreasing maxima per
// tensor, so an update costs the same at any history length). The model layer
// owns this state and never calls MPI: where a tensor is sharded over the tensor-parallel axis, the
// caller reduces the step's amaxes (MPI_MAX) and merges them with merge_amax_max() before update().
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "vitgrid/backend/fp8.h"

namespace vitgrid {

enum class Fp8AmaxAlgo : uint8_t { Max, MostRecent };

class Fp8ScalingState {
 public:
  static constexpr int kDefaultHistory = 1024;

  // One tensor per entry of `formats`; history >= 1 steps (the current one included).
  explicit Fp8ScalingState(std::vector<Fp8Format> formats, int history = kDefaultHistory,
                           int margin = 0, Fp8AmaxAlgo algo = Fp8AmaxAlgo::Max);

  size_t tensors() const { return formats_.size(); }
  int history() const { return history_len_; }
  int margin() const { return margin_; }
  Fp8AmaxAlgo algo() const { return algo_; }
  Fp8Format format(size_t i) const { return formats_[i]; }

  // The amax of tensor i's cast in the current step. A tensor cast several times in a step
  // (micro-batches, a recomputed forward) keeps the max; a NaN stays NaN.
  void record(size_t i, float amax) {
    float& slot = ring_[i * len() + head_];
    slot = amax_max(slot, amax);
  }
  float current_amax(size_t i) const { return ring_[i * len() + head_]; }
  // record() of other[i] for every tensor i: the step's amaxes of the other ranks, reduced by
  // the caller. MPI_MAX on floats may drop a NaN (implementation-defined), so a caller that
  // must keep it maps NaN to inf before reducing.
  void merge_amax_max(const float* other);

  // At the end of an optimizer step: new scales from the window of each tensor (above), then
  // the window moves on: the next step records into a zeroed slot, the oldest entry drops out.
  void update();

  float scale(size_t i) const { return scale_[i]; }
  float scale_inv(size_t i) const { return scale_inv_[i]; }
  const std::vector<float>& scales() const { return scale_; }
  const std::vector<float>& scale_invs() const { return scale_inv_; }
  // [tensors x history], row i tensor i's: entry 0 the current step, entry k the step k
  // updates ago (0 where none yet). With scales(), what a checkpoint keeps.
  std::vector<float> amax_history() const;
  // Loads a checkpoint's amax_history() and scales() (sizes as above); scale_inv follows.
  void restore(const std::vector<float>& amax_history, const std::vector<float>& scales);

  // Steps' amaxes closed by update() that were inf or NaN, summed over tensors: each is a
  // tensor that overflowed in a step (the counter the trainer reports).
  uint64_t nonfinite_amaxes() const { return nonfinite_amaxes_; }

 private:
  // max that keeps a NaN from either side.
  static float amax_max(float a, float b) { return (b > a || std::isnan(b)) ? b : a; }
  size_t len() const { return static_cast<size_t>(history_len_); }
  // Appends tensor i's entry of update `step` to its queue of window maxima, first dropping
  // the entries it outranks (a NaN ranks as inf: either makes the window's amax non-finite).
  void push_max(size_t i, uint64_t step, float amax);
  // The queues from the ring's closed entries (construction, restore).
  void rebuild_max();

  std::vector<Fp8Format> formats_;
  int history_len_;
  int margin_;
  Fp8AmaxAlgo algo_;
  // ring_[i * history + (head_ + k) % history]: tensor i's entry k
  std::vector<float> ring_;
  size_t head_ = 0;
  // updates so far, counted from history (so that the steps in a window are never negative)
  uint64_t updates_;
  // "max": per tensor a circular queue (capacity history) of (update, amax) whose amaxes
  // decrease from its front, the window's entries that no later entry outranks
  std::vector<uint64_t> q_step_;
  std::vector<float> q_amax_;
  std::vector<uint32_t> q_front_, q_size_;
  std::vector<float> scale_;
  std::vector<float> scale_inv_;
  uint64_t nonfinite_amaxes_ = 0;
};

}  // namespace vitgrid
