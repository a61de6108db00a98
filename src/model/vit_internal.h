// Private to src/model: what vit.cpp (construction, parameters, the activation plan, embedding,
// head and the chunk / whole-model passes) and vit_block.cpp (a transformer block's forward and
// backward) share: ViT::Acts, the activation buffers, and the block's parameter and dropout-site
// indices. Not installed, not included outside src/model.
#pragma once
#include <cstddef>
#include <vector>

#include "vitgrid/model/vit.h"

namespace vitgrid {

// Activation buffers, carved from one pool planned at construction. What a micro-batch needs
// between its forward and its backward lives in a Set (one per micro-batch in flight on this
// stage: PipelinePlan::num_slots); scratch that is consumed at once is shared.
struct ViT::Acts {
  struct BlockActs {
    void *y1, *qkv, *att, *p, *r_mid, *y2, *h, *g, *f;
    float *m1, *s1, *m2, *s2;
    void* asaved;
    // FP8: the transposed codes of qkv's, proj's, fc1's and fc2's inputs, kept from the forward
    // for the weight gradients (Op::x_t; null where no op keeps them)
    uint8_t* xt[4] = {nullptr, nullptr, nullptr, nullptr};
  };
  struct Set {
    void* patches = nullptr;         // embedding input (first chunk of the first stage)
    std::vector<void*> r_in;         // residual stream entering each block of the chunk; r_in[0]
                                     // is the chunk input, and d(input) after the backward
    std::vector<BlockActs> blocks;   // per block of the chunk (empty where checkpointed)
    // Drop path's factors where the LayerNorms apply them (block_plan.h): per block of
    // the chunk, the attention branch's then the MLP branch's, path_stride floats each.
    float* path_f = nullptr;
    void* out = nullptr;             // chunk output (r_mid + f of its last block), sent on
    void *cls_rows = nullptr, *cls_norm = nullptr, *dlogits = nullptr;  // head (last chunk)
    float *mf = nullptr, *sf = nullptr;
  };
  std::vector<Set> sets;
  BlockActs shared;  // the checkpointed blocks' one block set, recomputed per block
  // The (set, block) whose training forward shared holds, untouched since (-1: none): the
  // backward of that block, next, needs no recompute (the chunk's last block, unless another
  // micro-batch's forward ran in between).
  int shared_set = -1, shared_block = -1;
  int path_stride = 0;  // the largest local batch: floats per factor vector of a Set
  // Set `set`'s drop path factors of the chunk's block j, branch 0 (attention) or 1 (MLP)
  float* path_factors(int set, int j, int branch) {
    return sets[set].path_f + (static_cast<size_t>(j) * 2 + branch) * path_stride;
  }
  // Not kept between a block's forward and its backward, so shared by every block and set: the
  // projection output p (consumed by the fused residual add at once), the MLP output f (read by
  // the next block's fused add, by the chunk output and by the head: two buffers alternate by
  // block parity) and the GELU output g (recomputed from h in the backward: one elementwise
  // pass instead of N x mlp elements of memory per block; model.keep_gelu_output gives each
  // block its own g instead).
  void *p_scr = nullptr, *g_scr = nullptr, *f_scr[2] = {nullptr, nullptr};
  void* ptok;
  void *cls_a, *cls_b, *logits;
  void* logits_all;   // [max_batch, K]: every rank's logits rows gathered (predictions)
  float* logits_f32;  // the same in fp32 for the host copy
  float *losses, *c1, *c5;
  double* loss_sum;  // forward_backward's device total
  // gradients of activations
  void *dres, *dtmp, *dqkv, *dh, *dcls_rows, *dcls_norm, *dptok;
  void* ddrop;  // the dropout and drop path passes' output (null without either)
  void* attn_ws;
  int last_count = 0;
};

namespace vit_detail {
constexpr int kParamsPerBlock = 12;
enum BlockParam {
  kNorm1W, kNorm1B, kQkvW, kQkvB, kProjW, kProjB, kNorm2W, kNorm2B, kFc1W, kFc1B, kFc2W, kFc2B
};
enum DropSite { kSitePos = 0, kSiteProj = 1, kSiteMlpAct = 2, kSiteMlpOut = 3 };
}  // namespace vit_detail

}  // namespace vitgrid
