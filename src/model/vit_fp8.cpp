// The ViT's FP8 scaling (precision.mode = fp8, model/vit.h): the delayed-scaling state of the
// block Linears' tensors, on the host, and their scales and amaxes in backend memory, which
// the FP8 Linears (backend/fp8_linear.h, called by the strategy) read and write.
#include <cstring>
#include <string>
#include <vector>

#include "vitgrid/backend/fp8_linear.h"
#include "vitgrid/core/error.h"
#include "vitgrid/model/vit.h"

namespace vitgrid {

namespace {
constexpr size_t kStride = Fp8LinearMeta::kAligned;
}  // namespace

void ViT::fp8_init() {
  std::string why;
  if (!be_.fp8_supported(&why)) throw UserError("precision.mode = fp8: " + why);
  if (!tp_.fusions().fp8)
    throw UserError(std::string("precision.mode = fp8 runs its Linears in tensor mode none or "
                                "1d (with or without sequence parallelism), not ") +
                    tensor_mode_name(tp_.mode()));
  // The FP8 GEMMs' K is a multiple of 16: the local features of every block Linear, and the
  // rows of the weight gradients (a rank's rows of a micro-batch, and of each part)
  const int C = cfg_.hidden, M = cfg_.mlp;
  const ActBlock qkv = tp_.act_block(ActLayout::Inner, max_batch_, 3 * C);
  const ActBlock mlp = tp_.act_block(ActLayout::Inner, max_batch_, M);
  const int64_t attn = static_cast<int64_t>(tp_.local_heads(cfg_.heads)) * cfg_.head_dim();
  for (int64_t f : {int64_t(C), qkv.cols, mlp.cols, attn})
    if (f % 16 != 0)
      throw UserError("precision.mode = fp8: the FP8 GEMMs need features that are multiples of "
                      "16; a block Linear of this model and layout has " + std::to_string(f) +
                      " on a rank (model.hidden " + std::to_string(C) + ", mlp " +
                      std::to_string(M) + ")");
  const int T = cfg_.tokens();
  const int parts = tp_.fusions().row_parts;
  for (int64_t samples : {int64_t(tp_.local_batch(max_batch_)), int64_t(mlp.samples),
                          int64_t(parts > 1 ? mlp.samples / parts : mlp.samples)})
    if (samples * T % 16 != 0)
      throw UserError("precision.mode = fp8: the FP8 weight gradients need a multiple of 16 "
                      "rows; a rank's part of a micro-batch has " + std::to_string(samples) +
                      " samples x " + std::to_string(T) + " tokens = " +
                      std::to_string(samples * T) + " (choose data.global_batch, "
                      "data.grad_accum or the pipeline's micro-batches so that it is)");
  // the FP8 copies' scratch at the largest Linear call: the Inner rows (the whole micro-batch's
  // under sequence parallelism) and each Linear's local features
  const int Ni = mlp.samples * T;
  const int q = static_cast<int>(qkv.cols), m = static_cast<int>(mlp.cols);
  const int at = static_cast<int>(attn);
  tp_.reserve_fp8(std::max({fp8_linear_scratch_bytes(Ni, C, q),    // qkv
                            fp8_linear_scratch_bytes(Ni, at, C),   // proj
                            fp8_linear_scratch_bytes(Ni, C, m),    // fc1
                            fp8_linear_scratch_bytes(Ni, m, C)}));  // fc2
  // W's transposes, kept from each forward's cast of W for the data gradients: the four
  // Linears' local [in, out] of every block this rank holds
  const size_t wt[kFp8Linears] = {size_t(C) * q, size_t(at) * C, size_t(C) * m, size_t(m) * C};
  const size_t wt_block = wt[0] + wt[1] + wt[2] + wt[3];
  size_t held = 0;
  for (int l = 0; l < cfg_.depth; ++l) held += chunk_of_block(l) >= 0 ? 1 : 0;
  fp8_wt_.assign(cfg_.depth, std::vector<uint8_t*>(kFp8Linears, nullptr));
  if (held > 0) {
    fp8_wt_pool_ = be_.alloc(held * wt_block);
    auto* p = static_cast<uint8_t*>(fp8_wt_pool_);
    for (int l = 0; l < cfg_.depth; ++l) {
      if (chunk_of_block(l) < 0) continue;
      for (int k = 0; k < kFp8Linears; ++k) {
        fp8_wt_[l][k] = p;
        p += wt[k];
      }
    }
  }
  std::vector<Fp8Format> formats(static_cast<size_t>(cfg_.depth) * kFp8Linears *
                                 Fp8LinearMeta::kTensors);
  for (size_t i = 0; i < formats.size(); ++i)
    formats[i] = i % Fp8LinearMeta::kTensors == Fp8LinearMeta::kDy ? Fp8Format::E5M2
                                                                   : Fp8Format::E4M3;
  fp8_state_ = std::make_unique<Fp8ScalingState>(std::move(formats), cfg_.fp8_history,
                                                 cfg_.fp8_margin, cfg_.fp8_algo);
  // [scales | scale_invs | amaxes], each value on a 16-byte boundary (Fp8LinearMeta::kAligned)
  const size_t n = fp8_state_->tensors() * kStride;
  fp8_dev_ = static_cast<float*>(be_.alloc(3 * n * sizeof(float)));
  be_.zero(fp8_dev_ + 2 * n, n * sizeof(float));
  fp8_upload_scales();
}

Fp8LinearMeta ViT::fp8_meta(int l, int linear) const {
  const size_t n = fp8_state_->tensors() * kStride, i = fp8_tensor(l, linear, 0) * kStride;
  Fp8LinearMeta m{fp8_dev_ + i, fp8_dev_ + n + i, fp8_dev_ + 2 * n + i, kStride};
  m.w_t = fp8_wt_[l][linear];
  return m;
}

bool ViT::layernorms_write_fp8() const {
  for (const auto& plans : plans_)
    for (const BlockPlan& p : plans)
      for (const auto* list : {&p.forward, &p.recompute, &p.forward_eval})
        for (const Op& op : *list)
          if (op.cast_w.valid()) return true;
  return false;
}

void ViT::fp8_upload_scales(int upload_slot) {
  const size_t t = fp8_state_->tensors(), n = t * kStride, bytes = 2 * n * sizeof(float);
  std::vector<float> h(2 * n, 0.0f);
  for (size_t i = 0; i < t; ++i) {
    h[i * kStride] = fp8_state_->scale(i);
    h[n + i * kStride] = fp8_state_->scale_inv(i);
  }
  if (upload_slot < 0) {
    be_.copy_to_device(fp8_dev_, h.data(), bytes);
    return;
  }
  // staged (once the slot's last upload has read it), copied after the work fp8_amaxes_start
  // marked (the step's casts and GEMMs), before the work enqueued from now on: the host does
  // not wait for the device here
  std::memcpy(be_.staging(upload_slot, bytes), h.data(), bytes);
  be_.upload_async(upload_slot, fp8_dev_, bytes);
  be_.wait_uploads();
}

void ViT::fp8_amaxes_start(int slot, int upload_slot) {
  const size_t n = fp8_state_->tensors() * kStride;
  be_.readback_start(slot, fp8_dev_ + 2 * n, n * sizeof(float));
  be_.zero(fp8_dev_ + 2 * n, n * sizeof(float));  // after the copy, in stream order
  // the step's last reader of the scales is enqueued: the next upload may overwrite them
  if (upload_slot >= 0) be_.release_slot(upload_slot);
}

void ViT::fp8_amaxes_wait(int slot, float* amax) {
  const auto* h = static_cast<const float*>(be_.readback_wait(slot));
  for (size_t i = 0; i < fp8_state_->tensors(); ++i) amax[i] = h[i * kStride];
}

void ViT::fp8_update(const float* amax, int upload_slot) {
  fp8_state_->merge_amax_max(amax);
  fp8_state_->update();
  fp8_upload_scales(upload_slot);
}

void ViT::fp8_discard_amaxes() {
  const size_t n = fp8_state_->tensors() * kStride;
  be_.zero(fp8_dev_ + 2 * n, n * sizeof(float));
}

}  // namespace vitgrid
