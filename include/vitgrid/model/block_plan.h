// The transformer block as a plan. The model states WHAT a pre-norm block computes (ViT
// semantics: x + drop(proj(attn(LN1 x))), then + drop(fc2(drop(gelu(fc1(LN2 .)))))); the plan
// decides HOW, once at construction: the ordered ops of the forward (training, evaluation,
// the recompute of a checkpointed block) and of the backward, each op with its buffers and
// epilogues, chosen by rules from
//   - what the tensor-parallel strategy's layer calls accept (TensorParallel::fusions()),
//   - dropout, drop path (its rate per block), activation checkpointing, the kept GELU output,
//   - the block's position in its chunk (the previous block's output feeds this one's
//     LayerNorm; the chunk's last block stores what the next stage receives).
// The replay (src/model/vit_block.cpp) resolves the buffers against the activation set and
// runs the ops, nothing else: a new fusion is one rule here and one case in the tests that
// compare every plan with the unfused plan of the same block (test/model, test/parallel).
//
// The rules (each undone by BlockRules::fused = false, the reference plan):
//   residual add in LN1:     block j > 0 (previous block not checkpointed) adds r_mid + f in
//                            its LayerNorm 1 instead of a pass storing r_in[j] first;
//   GELU epilogue:           fc1's GEMM applies GELU, fc2's data-gradient GEMM its backward;
//   fc1 bias in fc2's dx:    the GELU backward also sums fc1's bias gradient (no dropout on
//                            the activation; strategies whose Column bias gradient is the
//                            column sums of the rank's dy block);
//   Row biases in LN bwd:    the LayerNorm backwards sum proj's (LN2) and the previous
//                            block's fc2's (LN1) bias gradients (no dropout; drop path only
//                            where it rides on the LayerNorms; Stream rows whole per rank);
//   drop path in LN:         without dropout, drop path's per-sample factors are applied by
//                            the LayerNorms' residual adds (no passes over the branches);
//   attention in parts:      under 1d sequence parallelism the attention runs in the parts
//                            the proj Linear exchanges (forward and backward), overlapping it.
//   GELU in the FP8 casts:   with FP8 Linears and no dropout on the activation, fc1 stores
//                            only its pre-activation H and fc2's casts apply the GELU as they
//                            read it (x_gelu), forward and backward: no GELU pass, no G.
//   LayerNorm writes FP8:    with FP8 Linears keeping their inputs' transposes, LN1 and LN2
//                            write qkv's and fc1's inputs in FP8 (and their transposes) with
//                            those Linears' scales: no bf16 Y1 / Y2 in training, no cast pass.
//   attention writes FP8:    with FP8 Linears, the attention backward writes qkv's output
//                            gradient in FP8 (codes, transpose, amax) with qkv's dy scale and
//                            sums qkv's bias gradient; qkv's backward casts no dy.
// And one rule no flag undoes (it is the precision, not a fusion):
//   FP8 Linears:             with precision.mode = fp8 (ChunkSpec::fp8), the four Linears
//                            (qkv, proj, fc1, fc2) run their forward, data and weight
//                            gradient GEMMs in FP8 with their own scaling (model/vit.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "vitgrid/parallel/tensor_parallel.h"

namespace vitgrid {

// The buffers of a block's ops, resolved at replay against the activation set and the block:
// the block's own activations (y1 ... f, model/vit_internal.h), the previous block's r_mid and
// f (in the chunk), the chunk's stored residual inputs r_in[j] (RIn) and r_in[j + 1] (RInNext),
// the chunk output (Out), and the backward's shared gradient buffers (Dres ... Dh).
enum class Buf : uint8_t {
  None, RIn, RInNext, Out, Y1, Qkv, Att, P, RMid, Y2, H, G, F, PrevRMid, PrevF,
  Dres, Ddrop, Dtmp, Dqkv, Dh,
};

// A parameter (or its gradient) of the block: BlockParam index (vit_internal.h), of this
// block or of the previous one in the chunk; index < 0: none.
struct ParamRef {
  int8_t index = -1;
  bool prev = false;
  bool valid() const { return index >= 0; }
};

// Drop path's per-sample factors on a LayerNorm's residual branch: none, this block's
// attention branch, this block's MLP branch, the previous block's MLP branch.
enum class Factors : uint8_t { None, Attn, Mlp, PrevMlp };

// A width of the block's activations (global features): the hidden size C, the MLP's M, qkv's 3C.
enum class Width : uint8_t { Hidden, Mlp, Qkv };

enum class OpKind : uint8_t {
  Need,               // the parameter-need hook of half `group` (0 attention, 1 MLP)
  Report,             // the gradient-ready hook of half `group` (final backward only)
  PathFactors,        // draw drop path's factors of both branches (drop path in LN)
  LayerNorm,          // x = a + b * factors (b None: x = a), out = LN(x); stats of `norm`
  Linear,             // out = x W^T + bias [+ GELU into gelu]
  Gelu,               // out = gelu(x)
  Dropout,            // out = dropout(x) at site `site` (with drop path when `path`)
  Add,                // out = a + b
  Attention,          // Att = attention(Qkv), the whole micro-batch
  AttentionRow,       // P = proj(attention(Qkv)), the attention in the strategy's parts
  LinearBackward,     // dx = dy W [+ GELU backward of gelu], dW += dy^T x, db += sum dy
  GeluBackward,       // dx = gelu'(x) * dy
  DropoutBackward,    // out = dropout mask applied to x (site, path)
  LayerNormBackward,  // out += LN backward of dy at x; dsum += its column sums; branch =
                      // out * factors (the branch's gradient)
  AttentionBackward,  // Dqkv = attention backward of Dtmp, the whole micro-batch
  AttentionRowBackward,  // proj's backward with the attention backward in parts
};

struct Op {
  OpKind kind = OpKind::Need;
  LinearRole role = LinearRole::Column;
  Width in = Width::Hidden, out_w = Width::Hidden;  // Linear: global in / out features
  int groups = 1;                                   // Linear: qkv's 3
  Buf out = Buf::None, x = Buf::None, a = Buf::None, b = Buf::None, gelu = Buf::None;
  Buf dy = Buf::None, branch = Buf::None;
  ParamRef w, bias;            // forward weights (LayerNorm: gamma, beta)
  ParamRef dw, db, dsum;       // gradients: weight, bias, a fused bias-gradient sum
  Factors factors = Factors::None;
  int norm = 0;                // LayerNorm(Backward): statistics of norm 1 or 2
  int site = 0;                // Dropout(Backward): vit_internal.h DropSite
  bool path = false;           // Dropout(Backward): the site carries drop path
  int group = 0;               // Need / Report: the block's half
  ActLayout layout = ActLayout::Stream;  // Dropout, Gelu, Add: the activation's layout
  bool fp8 = false;            // Linear(Backward), AttentionRow(Backward): GEMMs in FP8
  bool x_gelu = false;         // FP8 Linear(Backward): its input is gelu(x), applied by the casts
  bool dy_gelu = false;        // FP8 LinearBackward: `gelu` is its own pre-activation, GELU's
                               // backward applied to dy by dy's cast (fc1)
  bool x_t = false;            // FP8 Linear(Backward): x's transpose kept by the forward's cast
                               // in the block's buffer, taken by the weight gradient
  ParamRef cast_w;             // LayerNorm: out not stored; the LayerNorm writes the FP8 copy
                               // of the input of the Linear of these weights (out_w wide), which
                               // follows. AttentionBackward: the FP8 copies of the output
                               // gradient of the Linear of these weights (qkv), which follows,
                               // and its bias gradient (db). LayerNormBackward: the FP8 copies
                               // of the output gradient of the Row Linear of these weights
                               // (in x out_w; proj, or prev: the previous block's fc2), whose
                               // backward comes next, its bias gradient in dsum
  bool x_cast = false;         // FP8 Linear: its input cast already (by the LayerNorm before it)
  bool dy_cast = false;        // FP8 LinearBackward: its output gradient cast already (by the
                               // attention or LayerNorm backward before it), its bias gradient
                               // summed
};

struct BlockPlan {
  int block = 0;                    // global block index
  std::vector<Op> forward;          // training forward
  std::vector<Op> forward_eval;     // evaluation forward (no dropout, no drop path)
  std::vector<Op> recompute;        // a checkpointed block's recompute (ends before fc2)
  std::vector<Op> backward;
  bool checkpointed = false;
};

// What the plans of one chunk are compiled from (the model fills it from its config, its
// stage layout and the strategy; tests fill it directly).
struct ChunkSpec {
  int first_block = 0;
  int blocks = 1;
  float dropout = 0.0f;
  std::vector<float> drop_path;      // per block of the chunk
  std::vector<bool> checkpointed;    // per block of the chunk
  bool keep_gelu_output = false;
  bool stores_output = false;        // the chunk's output is sent on (not the model's head)
  TpFusions tp;                      // what the strategy's calls accept
  bool attention_parts_fit = true;   // the backend's attention can start at every part
  bool fp8 = false;                  // the block Linears in FP8 (precision.mode = fp8)
  bool fused = true;                 // false: the unfused reference plans
};

// Whether block j of the chunk applies drop path in its LayerNorms.
bool path_in_layernorm(const ChunkSpec& s, int j);
std::vector<BlockPlan> compile_chunk_plans(const ChunkSpec& s);

// One line per op ("LayerNorm out=Y1 x=RIn a=PrevRMid b=PrevF ..."), for tests and debugging.
std::string describe(const std::vector<Op>& ops);
const char* name(Buf b);
const char* name(OpKind k);

}  // namespace vitgrid
