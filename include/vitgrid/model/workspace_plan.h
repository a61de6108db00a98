// The backend workspace plan of a rank's steps (Backend::WorkspacePlan) from the model shape:
// upper bounds of the row-wise ops, weights, copies and optimizer slice lists that a training
// or evaluation step of this rank can run, so that the backend allocates its internal
// workspace before step 1 (the trainer calls Backend::plan_workspace once, in its setup).
// Pure: no MPI, no device; unit-tested against the shapes of the presets.
//
// Where the bounds come from (model/vit.cpp, parallel/*, optim/optimizer.cpp):
//  * rows: a micro-batch of B samples runs its row-wise ops on at most B * tokens rows. A
//    tensor-parallel strategy splits samples or columns, and the 3-D one gathers q pieces of
//    rows that were split q^2 ways, so no op sees more rows than its micro-batch's tokens; the
//    patch embedding has B * patches rows and the head B.
//  * cols: a Linear's bias gradient spans its output features (qkv 3*hidden, proj / fc2 /
//    patch embedding hidden, fc1 mlp, head classes), LayerNorm spans hidden; tensor
//    parallelism only narrows them.
//  * weights: the largest [out, in] of the model (qkv, fc1 / fc2, head, patch embedding);
//    strategies run linear_backward on blocks of these.
//  * copies: boundary / residual-stream tensors of a micro-batch (B * tokens * hidden act
//    elements) and fp32 gradients of a parameter (tensor-parallel reductions).
//  * FP8 LayerNorms: where the plans' LayerNorms write FP8, their width (hidden) on those rows.
//  * slice lists: the optimizer passes two lists over the whole flat buffer (with and without
//    weight decay), or with ZeRO-1 one per gradient bucket plus one of all its pieces; a
//    parameter cut by a bucket boundary adds a slice. Bounded together by 2 + buckets lists,
//    2 * (tensors + buckets) slices and 2 * the flat elements.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "vitgrid/backend/backend.h"
#include "vitgrid/model/vit.h"

namespace vitgrid {

struct WorkspaceShape {
  int micro_batch = 0;       // largest micro-batch of samples on this rank (ViT's max_batch)
  size_t act_size = 4;       // Backend::act_size()
  bool optimizer = false;    // an optimizer steps (train, bench): plan its slice lists
  size_t param_tensors = 0;  // ViT::params().size() on this rank
  size_t local_params = 0;   // ViT::num_local_params() (flat elements, padding included)
  size_t grad_buckets = 0;   // gradient buckets (with ZeRO-1, one slice list each)
  bool fp8_layernorms = false;  // ViT::layernorms_write_fp8()
};

inline Backend::WorkspacePlan workspace_plan_for(const ViTConfig& cfg, const WorkspaceShape& s) {
  Backend::WorkspacePlan p;
  const int64_t T = cfg.tokens(), C = cfg.hidden, M = cfg.mlp, K = cfg.classes;
  const int64_t B = std::max(s.micro_batch, 0);
  p.max_rows = B * T;
  p.max_cols = std::max({3 * C, C, M, K});
  p.max_weight_elems = std::max({3 * C * C, M * C, K * C, C * int64_t(cfg.patch_dim())});
  p.max_copy_bytes = std::max(static_cast<size_t>(B * T * C) * s.act_size,
                              static_cast<size_t>(p.max_weight_elems) * sizeof(float));
  if (s.fp8_layernorms) p.fp8_layernorm_cols = C;  // LN1 / LN2, the Stream's rows
  if (s.optimizer) {
    const int64_t P = static_cast<int64_t>(s.param_tensors);
    const int64_t Bk = static_cast<int64_t>(s.grad_buckets);
    // the update's and the norm's lists, the norm's list of this rank's counted slices
    // (Optimizer::grad_norm_sq_device), and with ZeRO-1 one per bucket
    p.slice_lists = 3 + Bk;
    p.slices = 3 * (P + Bk);
    p.slice_elems = 3 * static_cast<int64_t>(s.local_params);
  }
  return p;
}

}  // namespace vitgrid
