// The block plan compiler (model/block_plan.h) on its own, no backend: each fusion rule shows
// in the ops it names, the unfused plan has none of them, and over every combination of
// dropout, drop path, checkpointing, kept GELU output and strategy capabilities the plans keep
// their invariants: each gradient of a chunk written exactly once, before its half is
// reported; each buffer read only after it was written; the recompute a prefix of the
// forward. The numerical equivalence of every plan with the unfused plan of the same block is
// tested on a model: test/model/test_model.cpp (1 rank) and test/parallel (every mode).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "vitgrid/model/block_plan.h"

namespace vitgrid {
namespace {

constexpr int kParams = 12;  // per block (vit_internal.h BlockParam)
enum { kNorm1W, kNorm1B, kQkvW, kQkvB, kProjW, kProjB, kNorm2W, kNorm2B, kFc1W, kFc1B, kFc2W, kFc2B };

ChunkSpec spec(int blocks, float dropout, float path, int ckpt_blocks, bool fused,
               TpFusions tp) {
  ChunkSpec s;
  s.first_block = 4;
  s.blocks = blocks;
  s.dropout = dropout;
  for (int j = 0; j < blocks; ++j) {
    s.drop_path.push_back(path * static_cast<float>(j + 1) / static_cast<float>(blocks));
    s.checkpointed.push_back(j < ckpt_blocks);
  }
  s.tp = tp;
  s.fused = fused;
  return s;
}

TpFusions all_fusions(int parts = 1) {
  TpFusions f;
  f.gelu_bias_in_row_backward = f.row_bias_in_layernorm_backward = true;
  f.layernorm_row_factors = true;
  f.row_parts = parts;
  return f;
}

bool has(const std::vector<Op>& ops, OpKind k) {
  for (const Op& o : ops)
    if (o.kind == k) return true;
  return false;
}
const Op* find(const std::vector<Op>& ops, OpKind k, int norm_or_w = -1) {
  for (const Op& o : ops)
    if (o.kind == k && (norm_or_w < 0 || o.norm == norm_or_w || o.w.index == norm_or_w))
      return &o;
  return nullptr;
}

TEST(BlockPlan, FusedRulesShowInTheOps) {
  const auto plans = compile_chunk_plans(spec(3, 0.0f, 0.0f, 0, true, all_fusions()));
  const BlockPlan& mid = plans[1];
  EXPECT_EQ(mid.block, 5);
  // residual add in LN1
  const Op* ln1 = find(mid.forward, OpKind::LayerNorm, 1);
  ASSERT_NE(ln1, nullptr);
  EXPECT_EQ(ln1->a, Buf::PrevRMid);
  EXPECT_EQ(ln1->b, Buf::PrevF);
  EXPECT_FALSE(has(mid.forward, OpKind::Add));
  // GELU epilogue forward and backward, fc1's bias in fc2's backward
  const Op* fc1 = find(mid.forward, OpKind::Linear, kFc1W);
  ASSERT_NE(fc1, nullptr);
  EXPECT_EQ(fc1->gelu, Buf::G);
  const Op* fc2b = find(mid.backward, OpKind::LinearBackward, kFc2W);
  ASSERT_NE(fc2b, nullptr);
  EXPECT_EQ(fc2b->gelu, Buf::H);
  EXPECT_EQ(fc2b->dsum.index, kFc1B);
  EXPECT_FALSE(fc2b->db.valid());  // the next block's LN1 backward sums it
  EXPECT_FALSE(has(mid.backward, OpKind::GeluBackward));
  // Row biases in the LayerNorm backwards
  EXPECT_EQ(find(mid.backward, OpKind::LayerNormBackward, 2)->dsum.index, kProjB);
  const Op* ln1b = find(mid.backward, OpKind::LayerNormBackward, 1);
  EXPECT_EQ(ln1b->dsum.index, kFc2B);
  EXPECT_TRUE(ln1b->dsum.prev);
  // the chunk's last block sums its own fc2 bias (its dres came from outside the chunk)
  EXPECT_EQ(find(plans[2].backward, OpKind::LinearBackward, kFc2W)->db.index, kFc2B);
  // the first block reads the chunk input
  EXPECT_EQ(find(plans[0].forward, OpKind::LayerNorm, 1)->a, Buf::RIn);
  EXPECT_FALSE(find(plans[0].backward, OpKind::LayerNormBackward, 1)->dsum.valid());
}

TEST(BlockPlan, Fp8MarksTheFourLinearsOnly) {
  // every list, fused or not, with attention in parts, with and without dropout: exactly qkv,
  // proj, fc1 and fc2's forward and backward ops run in FP8; the other ops are the bf16
  // plan's but for GELU: fused and without dropout on the activation, fc2's casts apply it
  // (x_gelu, reading H), so no op runs GELU and none touches G
  auto touches_g = [](const Op& o) {
    for (Buf x : {o.out, o.x, o.a, o.b, o.gelu, o.dy, o.branch})
      if (x == Buf::G) return true;
    return false;
  };
  for (bool fused : {true, false})
    for (int parts : {1, 2})
      for (float dropout : {0.0f, 0.1f}) {
        ChunkSpec s = spec(2, dropout, 0.2f, 1, fused, all_fusions(parts));
        const auto ref = compile_chunk_plans(s);
        s.fp8 = true;
        const auto plans = compile_chunk_plans(s);
        const bool in_cast = fused && dropout == 0.0f;
        for (size_t b = 0; b < plans.size(); ++b) {
          const std::vector<Op>* lists[] = {&plans[b].forward, &plans[b].forward_eval,
                                            &plans[b].recompute, &plans[b].backward};
          const std::vector<Op>* refs[] = {&ref[b].forward, &ref[b].forward_eval,
                                           &ref[b].recompute, &ref[b].backward};
          for (int k = 0; k < 4; ++k) {
            std::multiset<int> linears;
            // the bf16 plan's ops, less GELU's passes where the casts apply it
            std::vector<Op> want_ops;
            for (const Op& o : *refs[k])
              if (!(in_cast && o.kind == OpKind::Gelu)) want_ops.push_back(o);
            ASSERT_EQ(lists[k]->size(), want_ops.size());
            for (size_t i = 0; i < lists[k]->size(); ++i) {
              const Op& o = (*lists[k])[i];
              const bool linear = o.kind == OpKind::Linear || o.kind == OpKind::LinearBackward ||
                                  o.kind == OpKind::AttentionRow ||
                                  o.kind == OpKind::AttentionRowBackward;
              EXPECT_EQ(o.fp8, linear) << name(o.kind);
              EXPECT_FALSE(want_ops[i].fp8);
              EXPECT_EQ(o.kind, want_ops[i].kind);
              EXPECT_EQ(o.x_gelu, in_cast && o.w.index == kFc2W && linear);
              if (o.x_gelu) {
                EXPECT_EQ(o.x, Buf::H);
              }
              if (in_cast) {
                EXPECT_FALSE(touches_g(o)) << name(o.kind);
              }
              if (o.fp8) linears.insert(o.w.index);
            }
            if (lists[k]->empty()) continue;
            // the recompute ends before fc2
            const std::multiset<int> want =
                k == 2 ? std::multiset<int>{kQkvW, kProjW, kFc1W}
                       : std::multiset<int>{kQkvW, kProjW, kFc1W, kFc2W};
            EXPECT_EQ(linears, want) << "list " << k << " fused " << fused << " parts " << parts;
          }
        }
        EXPECT_NE(describe(plans[0].forward).find("column fp8"), std::string::npos);
      }
}

TEST(BlockPlan, Fp8DyCastTakesGeluBackwardWhereTheModeAllows) {
  // fused, FP8, no dropout on the activation, a mode that hands gelu_pre through (none): fc2's
  // backward leaves the gradient of GELU's output (no gelu, no fused fc1 bias sum), no GELU
  // backward pass runs, and fc1's backward reads H for its dy cast and sums its own bias
  // gradient; elsewhere (1d, dropout, unfused) fc2's backward applies GELU as before
  for (bool allowed : {true, false})
    for (float dropout : {0.0f, 0.1f})
      for (bool fused : {true, false}) {
        TpFusions f = all_fusions(1);
        f.fp8 = true;
        f.fp8_gelu_in_dy_cast = allowed;
        ChunkSpec s = spec(2, dropout, 0.0f, 1, fused, f);
        s.fp8 = true;
        const bool on = allowed && dropout == 0.0f && fused;
        SCOPED_TRACE(std::string(on ? "dy cast" : "no dy cast") + ", dropout " +
                     std::to_string(dropout) + (fused ? ", fused" : ""));
        for (const BlockPlan& p : compile_chunk_plans(s)) {
          const Op *fc1 = nullptr, *fc2 = nullptr;
          for (const Op& o : p.backward) {
            if (o.kind != OpKind::LinearBackward) continue;
            if (o.w.index == kFc1W) fc1 = &o;
            if (o.w.index == kFc2W) fc2 = &o;
            EXPECT_EQ(o.dy_gelu, on && o.w.index == kFc1W);
          }
          ASSERT_TRUE(fc1 && fc2);
          EXPECT_EQ(has(p.backward, OpKind::GeluBackward), !fused || dropout > 0.0f);
          if (on) {
            EXPECT_EQ(fc1->gelu, Buf::H);
            EXPECT_EQ(fc1->dy, Buf::Dh);
            EXPECT_EQ(fc1->db.index, kFc1B);
            EXPECT_EQ(fc2->gelu, Buf::None);
            EXPECT_FALSE(fc2->dsum.valid());
          } else {
            EXPECT_EQ(fc1->gelu, Buf::None);
            if (fused && dropout == 0.0f) {
              EXPECT_EQ(fc2->gelu, Buf::H);
            }
          }
        }
      }
}

TEST(BlockPlan, Fp8KeepsTheInputsTransposesWhereTheBackwardFindsThem) {
  // a mode that allows it (none): every FP8 Linear of the training forward and the recompute
  // keeps x's transpose and its backward takes it, not reading Y1 / Y2, but fc2 of a
  // checkpointed block (the recompute ends before fc2: its backward casts H again); never in
  // evaluation; nowhere in a mode that does not allow it (1d)
  for (bool allowed : {true, false})
    for (bool fused : {true, false}) {
      TpFusions f = all_fusions(1);
      f.fp8 = true;
      f.fp8_keep_x_transposes = allowed;
      ChunkSpec s = spec(3, 0.0f, 0.1f, 1, fused, f);
      s.fp8 = true;
      SCOPED_TRACE(std::string(allowed ? "allowed" : "not allowed") + (fused ? ", fused" : ""));
      for (const BlockPlan& p : compile_chunk_plans(s)) {
        auto want = [&](const Op& o) {
          return allowed && o.fp8 && (o.w.index != kFc2W || !p.checkpointed);
        };
        for (const Op& o : p.forward) EXPECT_EQ(o.x_t, want(o)) << name(o.kind);
        for (const Op& o : p.forward_eval) EXPECT_FALSE(o.x_t) << name(o.kind);
        for (const Op& o : p.recompute) EXPECT_EQ(o.x_t, allowed && o.fp8) << name(o.kind);
        int backward_kept = 0;
        for (const Op& o : p.backward) {
          EXPECT_EQ(o.x_t, want(o)) << name(o.kind);
          if (o.x_t) {
            ++backward_kept;
            EXPECT_NE(o.x, Buf::Y1);
            EXPECT_NE(o.x, Buf::Y2);
          }
        }
        EXPECT_EQ(backward_kept, allowed ? (p.checkpointed ? 3 : 4) : 0);
      }
    }
}

TEST(BlockPlan, Fp8LayerNormsWriteTheNextLinearsInput) {
  // a mode that allows it (none), fused: LN1 and LN2 of the training forward and the recompute
  // write qkv's and fc1's FP8 inputs (cast_w), store no y, and those Linears take x as cast;
  // nothing else changes (the evaluation forward, the backward); not where the mode does not
  // allow it, nor unfused
  for (bool allowed : {true, false})
    for (bool fused : {true, false})
      for (int ckpt : {0, 2})
        for (float dropout : {0.0f, 0.1f}) {
          TpFusions f = all_fusions(1);
          f.fp8 = f.fp8_keep_x_transposes = true;
          f.fp8_layernorm_cast = allowed;
          ChunkSpec s = spec(3, dropout, 0.1f, ckpt, fused, f);
          s.fp8 = true;
          const auto plans = compile_chunk_plans(s);
          ChunkSpec off = s;
          off.tp.fp8_layernorm_cast = false;
          const auto ref = compile_chunk_plans(off);
          const bool on = allowed && fused;
          SCOPED_TRACE(std::string(on ? "on" : "off") + " ckpt " + std::to_string(ckpt) +
                       " dropout " + std::to_string(dropout));
          for (size_t b = 0; b < plans.size(); ++b) {
            const BlockPlan& p = plans[b];
            EXPECT_EQ(describe(p.forward_eval), describe(ref[b].forward_eval));
            EXPECT_EQ(describe(p.backward), describe(ref[b].backward));
            for (const auto* list : {&p.forward, &p.recompute}) {
              int cast = 0;
              for (size_t i = 0; i < list->size(); ++i) {
                const Op& o = (*list)[i];
                if (o.kind == OpKind::LayerNorm) {
                  EXPECT_EQ(o.cast_w.valid(), on);
                  if (!o.cast_w.valid()) continue;
                  ++cast;
                  EXPECT_EQ(o.cast_w.index, o.norm == 1 ? kQkvW : kFc1W);
                  EXPECT_EQ(o.out_w, o.norm == 1 ? Width::Qkv : Width::Mlp);
                  EXPECT_EQ(o.out, Buf::None);
                  ASSERT_LT(i + 1, list->size());
                  const Op& lin = (*list)[i + 1];
                  EXPECT_EQ(lin.kind, OpKind::Linear);
                  EXPECT_EQ(lin.w.index, o.cast_w.index);
                  EXPECT_TRUE(lin.x_cast && lin.x_t && lin.fp8);
                  EXPECT_EQ(lin.x, Buf::None);
                } else {
                  EXPECT_EQ(o.x_cast, on && (o.w.index == kQkvW || o.w.index == kFc1W) &&
                                          o.kind == OpKind::Linear);
                  if (on) {
                    EXPECT_NE(o.x, Buf::Y1);
                    EXPECT_NE(o.x, Buf::Y2);
                  }
                }
              }
              if (!list->empty()) {
                EXPECT_EQ(cast, on ? 2 : 0);
              }
            }
          }
        }
}

TEST(BlockPlan, Fp8AttentionBackwardWritesQkvsGradient) {
  // a mode that allows it (none), fused: the attention backward casts qkv's output gradient
  // (cast_w qkv) and takes its bias gradient, qkv's backward reads no Dqkv, casts no dy and
  // sums no bias; every other op is the plan's without the rule; not where the mode does not
  // allow it, nor unfused, nor in bf16
  for (bool allowed : {true, false})
    for (bool fused : {true, false})
      for (bool fp8 : {true, false})
        for (int ckpt : {0, 2})
          for (float dropout : {0.0f, 0.1f}) {
            TpFusions f = all_fusions(1);
            f.fp8 = f.fp8_keep_x_transposes = f.fp8_layernorm_cast = f.fp8_gelu_in_dy_cast = true;
            f.fp8_attention_dy_cast = allowed;
            ChunkSpec s = spec(3, dropout, 0.1f, ckpt, fused, f);
            s.fp8 = fp8;
            const auto plans = compile_chunk_plans(s);
            ChunkSpec off = s;
            off.tp.fp8_attention_dy_cast = false;
            const auto ref = compile_chunk_plans(off);
            const bool on = allowed && fused && fp8;
            SCOPED_TRACE(std::string(on ? "on" : "off") + " ckpt " + std::to_string(ckpt) +
                         " dropout " + std::to_string(dropout));
            for (size_t b = 0; b < plans.size(); ++b) {
              const BlockPlan& p = plans[b];
              EXPECT_EQ(describe(p.forward), describe(ref[b].forward));
              EXPECT_EQ(describe(p.recompute), describe(ref[b].recompute));
              ASSERT_EQ(p.backward.size(), ref[b].backward.size());
              int cast = 0;
              for (size_t i = 0; i < p.backward.size(); ++i) {
                const Op& o = p.backward[i];
                const Op& r = ref[b].backward[i];
                EXPECT_EQ(o.kind, r.kind);
                if (o.kind == OpKind::AttentionBackward && on) {
                  ++cast;
                  EXPECT_EQ(o.cast_w.index, kQkvW);
                  EXPECT_EQ(o.db.index, kQkvB);
                  ASSERT_LT(i + 1, p.backward.size());
                  const Op& lin = p.backward[i + 1];
                  EXPECT_EQ(lin.kind, OpKind::LinearBackward);
                  EXPECT_EQ(lin.w.index, kQkvW);
                  EXPECT_TRUE(lin.dy_cast && lin.fp8);
                  EXPECT_EQ(lin.dy, Buf::None);
                  EXPECT_FALSE(lin.db.valid());
                  EXPECT_EQ(ref[b].backward[i + 1].db.index, kQkvB);
                  EXPECT_EQ(ref[b].backward[i + 1].dy, Buf::Dqkv);
                } else if (!(on && i > 0 && p.backward[i - 1].kind == OpKind::AttentionBackward)) {
                  EXPECT_EQ(describe({o}), describe({r}));
                  EXPECT_FALSE(o.dy_cast);
                  EXPECT_FALSE(o.cast_w.valid() && o.kind == OpKind::AttentionBackward);
                }
              }
              EXPECT_EQ(cast, on ? 1 : 0);
            }
          }
}

TEST(BlockPlan, Fp8LayerNormBackwardsWriteTheRowLinearsGradients) {
  // a mode that allows it (none), fused, fp8: LN2's backward casts proj's output gradient and
  // LN1's the previous block's fc2's (in the chunk, that block not checkpointed), where the
  // Linear reads what the LayerNorm leaves (dres, or with drop path in the LayerNorms its
  // branch) and the LayerNorm sums the Linear's bias gradient; the Linear then reads no dy.
  // Every other op is the plan's without the rule; nothing where the mode does not allow it,
  // unfused, or in bf16
  for (bool allowed : {true, false})
    for (bool fused : {true, false})
      for (bool fp8 : {true, false})
        for (int ckpt : {0, 2})
          for (float dropout : {0.0f, 0.1f})
            for (float path : {0.0f, 0.2f}) {
              TpFusions f = all_fusions(1);
              f.fp8 = f.fp8_keep_x_transposes = f.fp8_layernorm_cast = f.fp8_gelu_in_dy_cast =
                  f.fp8_attention_dy_cast = true;
              f.fp8_layernorm_dy_cast = allowed;
              ChunkSpec s = spec(3, dropout, path, ckpt, fused, f);
              s.fp8 = fp8;
              const auto plans = compile_chunk_plans(s);
              ChunkSpec off = s;
              off.tp.fp8_layernorm_dy_cast = false;
              const auto ref = compile_chunk_plans(off);
              const bool on = allowed && fused && fp8;
              SCOPED_TRACE(std::string(on ? "on" : "off") + " ckpt " + std::to_string(ckpt) +
                           " dropout " + std::to_string(dropout) + " path " +
                           std::to_string(path));
              // (block, op) of each Linear whose dy a LayerNorm casts
              std::vector<std::pair<size_t, size_t>> cast_for;
              int casts2 = 0, casts1 = 0;
              for (size_t b = 0; b < plans.size(); ++b) {
                const BlockPlan& p = plans[b];
                EXPECT_EQ(describe(p.forward), describe(ref[b].forward));
                EXPECT_EQ(describe(p.recompute), describe(ref[b].recompute));
                ASSERT_EQ(p.backward.size(), ref[b].backward.size());
                for (size_t i = 0; i < p.backward.size(); ++i) {
                  const Op& ln = p.backward[i];
                  if (ln.kind != OpKind::LayerNormBackward || !ln.cast_w.valid()) continue;
                  EXPECT_TRUE(on);
                  const Buf left = ln.branch != Buf::None ? ln.branch : ln.out;
                  size_t lb = b, li = i + 1;
                  if (ln.norm == 2) {
                    ++casts2;
                    EXPECT_EQ(ln.cast_w.index, kProjW);
                    EXPECT_FALSE(ln.cast_w.prev);
                    while (li < p.backward.size() && p.backward[li].kind == OpKind::Report) ++li;
                  } else {
                    ++casts1;
                    EXPECT_EQ(ln.cast_w.index, kFc2W);
                    EXPECT_TRUE(ln.cast_w.prev);
                    ASSERT_GT(b, 0u);
                    EXPECT_FALSE(plans[b - 1].checkpointed);
                    lb = b - 1;
                    li = 0;
                    while (li < plans[lb].backward.size() &&
                           (plans[lb].backward[li].kind == OpKind::Need ||
                            plans[lb].backward[li].kind == OpKind::Report))
                      ++li;
                  }
                  ASSERT_LT(li, plans[lb].backward.size());
                  const Op& lin = plans[lb].backward[li];
                  const Op& rlin = ref[lb].backward[li];
                  EXPECT_EQ(lin.kind, OpKind::LinearBackward);
                  EXPECT_EQ(lin.w.index, ln.cast_w.index);
                  EXPECT_TRUE(lin.dy_cast && lin.fp8);
                  EXPECT_EQ(lin.dy, Buf::None);
                  EXPECT_FALSE(lin.db.valid());
                  EXPECT_EQ(rlin.dy, left);  // what the unfused Linear reads
                  EXPECT_FALSE(rlin.db.valid());
                  EXPECT_EQ(ln.dsum.index, ln.cast_w.index + 1);  // its bias gradient
                  EXPECT_EQ(ln.dsum.prev, ln.cast_w.prev);
                  EXPECT_EQ(ln.out_w, Width::Hidden);
                  EXPECT_EQ(ln.in, ln.norm == 2 ? Width::Hidden : Width::Mlp);
                  Op lr = ref[b].backward[i];  // the LayerNorm is the ref's otherwise
                  lr.cast_w = ln.cast_w;
                  lr.in = ln.in;
                  lr.out_w = ln.out_w;
                  EXPECT_EQ(describe({ln}), describe({lr}));
                  cast_for.emplace_back(lb, li);
                }
              }
              for (size_t b = 0; b < plans.size(); ++b)
                for (size_t i = 0; i < plans[b].backward.size(); ++i) {
                  const Op& o = plans[b].backward[i];
                  const bool target = std::find(cast_for.begin(), cast_for.end(),
                                                std::make_pair(b, i)) != cast_for.end();
                  if (target || (o.kind == OpKind::LayerNormBackward && o.cast_w.valid()))
                    continue;
                  EXPECT_EQ(describe({o}), describe({ref[b].backward[i]}));
                }
              // without dropout (drop path or not: it rides on the LayerNorms) every proj, and
              // fc2 of each block but the chunk's last (its gradient comes from the next chunk
              // or the head) that is not checkpointed (blocks 0 and 1 with ckpt 2)
              if (on && dropout == 0.0f) {
                EXPECT_EQ(casts2, 3);
                EXPECT_EQ(casts1, ckpt == 0 ? 2 : 0);
              } else {
                EXPECT_EQ(casts1 + casts2, 0);
              }
            }
}

TEST(BlockPlan, UnfusedPlanHasNoFusion) {
  for (float dropout : {0.0f, 0.1f})
    for (float path : {0.0f, 0.3f}) {
      const auto plans = compile_chunk_plans(spec(3, dropout, path, 1, false, all_fusions(2)));
      for (const BlockPlan& p : plans)
        for (const auto* ops : {&p.forward, &p.forward_eval, &p.recompute, &p.backward})
          for (const Op& o : *ops) {
            EXPECT_NE(o.kind, OpKind::PathFactors);
            EXPECT_NE(o.kind, OpKind::AttentionRow);
            EXPECT_NE(o.kind, OpKind::AttentionRowBackward);
            EXPECT_EQ(o.gelu, Buf::None) << name(o.kind);
            EXPECT_FALSE(o.dsum.valid()) << name(o.kind);
            EXPECT_EQ(o.factors, Factors::None) << name(o.kind);
            if (o.kind == OpKind::LayerNorm) {
              EXPECT_EQ(o.b == Buf::None, o.norm == 1);
            }
          }
      // the residual stream of block 2 (after a kept block 1) is added by a pass of its own
      EXPECT_TRUE(has(plans[2].forward, OpKind::Add));
    }
}

TEST(BlockPlan, DropPathRidesOnTheLayerNormsWithoutDropout) {
  const auto in_ln = compile_chunk_plans(spec(3, 0.0f, 0.3f, 0, true, all_fusions()));
  EXPECT_TRUE(has(in_ln[1].forward, OpKind::PathFactors));
  EXPECT_FALSE(has(in_ln[1].forward, OpKind::Dropout));
  EXPECT_EQ(find(in_ln[1].forward, OpKind::LayerNorm, 2)->factors, Factors::Attn);
  EXPECT_EQ(find(in_ln[1].forward, OpKind::LayerNorm, 1)->factors, Factors::PrevMlp);
  EXPECT_FALSE(has(in_ln[1].forward_eval, OpKind::PathFactors));  // evaluation draws nothing
  // the chunk's last block scales its f by a pass (no later LayerNorm in the chunk does)
  EXPECT_TRUE(has(in_ln[2].forward, OpKind::Dropout));
  // a strategy whose LayerNorms split the rows: passes over the branches
  TpFusions split = all_fusions();
  split.layernorm_row_factors = false;
  const auto passes = compile_chunk_plans(spec(3, 0.0f, 0.3f, 0, true, split));
  EXPECT_FALSE(has(passes[1].forward, OpKind::PathFactors));
  EXPECT_TRUE(has(passes[1].forward, OpKind::Dropout));
  // with dropout: passes, and no bias sums in the LayerNorm or GELU backwards
  const auto drop = compile_chunk_plans(spec(3, 0.1f, 0.3f, 0, true, all_fusions()));
  EXPECT_FALSE(has(drop[1].forward, OpKind::PathFactors));
  EXPECT_FALSE(find(drop[1].backward, OpKind::LayerNormBackward, 2)->dsum.valid());
  EXPECT_FALSE(find(drop[1].backward, OpKind::LinearBackward, kFc2W)->dsum.valid());
}

TEST(BlockPlan, AttentionInPartsWhereTheStrategyAndBackendAllow) {
  auto s = spec(2, 0.0f, 0.0f, 0, true, all_fusions(2));
  auto plans = compile_chunk_plans(s);
  EXPECT_TRUE(has(plans[0].forward, OpKind::AttentionRow));
  EXPECT_TRUE(has(plans[0].backward, OpKind::AttentionRowBackward));
  EXPECT_FALSE(has(plans[0].forward, OpKind::Attention));
  s.attention_parts_fit = false;
  plans = compile_chunk_plans(s);
  EXPECT_TRUE(has(plans[0].forward, OpKind::Attention));
  EXPECT_FALSE(has(plans[0].forward, OpKind::AttentionRow));
  const auto whole = compile_chunk_plans(spec(2, 0.0f, 0.0f, 0, true, all_fusions(1)));
  EXPECT_FALSE(has(whole[0].backward, OpKind::AttentionRowBackward));
}

TEST(BlockPlan, RecomputeIsTheForwardUpToFc2) {
  const auto plans = compile_chunk_plans(spec(3, 0.1f, 0.3f, 2, true, all_fusions()));
  for (int j = 0; j < 3; ++j) EXPECT_EQ(plans[j].checkpointed, j < 2);
  EXPECT_TRUE(plans[2].recompute.empty());
  const BlockPlan& p = plans[1];
  std::vector<Op> fwd;  // the forward without what the recompute does not repeat
  for (const Op& o : p.forward)
    if (o.kind != OpKind::Need && o.kind != OpKind::PathFactors) fwd.push_back(o);
  ASSERT_LT(p.recompute.size(), fwd.size());
  EXPECT_EQ(describe(p.recompute), describe({fwd.begin(), fwd.begin() + p.recompute.size()}));
  EXPECT_EQ(fwd[p.recompute.size()].w.index, kFc2W);  // it stops before fc2
  // a checkpointed block stores the next block's input; the next reads it (no fused add)
  EXPECT_TRUE(has(p.forward, OpKind::Add));
  EXPECT_EQ(find(plans[2].forward, OpKind::LayerNorm, 1)->a, Buf::RIn);
}

// Every combination: each gradient of the chunk written once (dw, db or a fused dsum),
// before the Report of its half (a previous block's, by this block's backward, which runs
// first); every buffer an op reads written before (the forward) or given (the backward's
// Dres, the saved activations); a chunk output stored when asked.
TEST(BlockPlan, InvariantsOverEveryCombination) {
  int combos = 0;
  for (int blocks : {1, 3})
    for (float dropout : {0.0f, 0.1f})
      for (float path : {0.0f, 0.3f})
        for (int ckpt : {0, 1, 3})
          for (bool keep_g : {false, true})
            for (bool stores : {false, true})
              for (int caps = 0; caps < 32; ++caps)
                for (bool fused : {true, false}) {
                  TpFusions tp;
                  tp.gelu_bias_in_row_backward = caps & 1;
                  tp.row_bias_in_layernorm_backward = caps & 2;
                  tp.layernorm_row_factors = caps & 4;
                  tp.row_parts = caps & 8 ? 2 : 1;
                  // FP8 Linears with every FP8 fusion a mode may allow (the modes that allow
                  // them have no parts)
                  const bool fp8 = caps & 16;
                  tp.fp8 = fp8;
                  tp.fp8_gelu_in_dy_cast = tp.fp8_keep_x_transposes = fp8 && !(caps & 8);
                  tp.fp8_layernorm_cast = tp.fp8_attention_dy_cast = fp8 && !(caps & 8);
                  ChunkSpec s = spec(blocks, dropout, path, std::min(ckpt, blocks), fused, tp);
                  s.keep_gelu_output = keep_g;
                  s.stores_output = stores;
                  s.fp8 = fp8;
                  SCOPED_TRACE("blocks " + std::to_string(blocks) + " dropout " +
                               std::to_string(dropout) + " path " + std::to_string(path) +
                               " ckpt " + std::to_string(ckpt) + " caps " +
                               std::to_string(caps) + (fused ? " fused" : " unfused"));
                  const auto plans = compile_chunk_plans(s);
                  ++combos;
                  // gradients: block-local index (j * 12 + i) -> writes
                  std::map<int, int> writes;
                  std::set<int> reported;  // j * 2 + half
                  for (int j = blocks - 1; j >= 0; --j) {
                    for (const Op& o : plans[j].backward) {
                      for (ParamRef r : {o.dw, o.db, o.dsum}) {
                        if (!r.valid()) continue;
                        const int k = r.prev ? j - 1 : j;
                        ASSERT_GE(k, 0) << "a gradient of the block before the chunk";
                        const int half = r.index >= kNorm2W ? 1 : 0;
                        EXPECT_EQ(reported.count(k * 2 + half), 0u)
                            << "a gradient written after its half was reported";
                        ++writes[k * kParams + r.index];
                      }
                      if (o.kind == OpKind::Report) {
                        EXPECT_TRUE(reported.insert(j * 2 + o.group).second);
                      }
                    }
                  }
                  for (int k = 0; k < blocks; ++k)
                    for (int i = 0; i < kParams; ++i)
                      EXPECT_EQ(writes[k * kParams + i], 1)
                          << "block " << k << " parameter " << i;
                  EXPECT_EQ(reported.size(), static_cast<size_t>(2 * blocks));
                  for (int j = 0; j < blocks; ++j) {
                    // forward: reads after writes (the block's inputs: RIn, the previous
                    // block's r_mid and f)
                    std::set<Buf> written{Buf::None, Buf::RIn, Buf::PrevRMid, Buf::PrevF};
                    for (const Op& o : plans[j].forward) {
                      std::vector<Buf> reads{o.a, o.b};
                      if (o.kind != OpKind::LayerNorm) reads.push_back(o.x);  // (LN: its res)
                      if (o.kind == OpKind::Attention || o.kind == OpKind::AttentionRow) {
                        reads.push_back(Buf::Qkv);
                        written.insert(Buf::Att);
                      }
                      for (Buf r : reads)
                        EXPECT_TRUE(written.count(r))
                            << name(o.kind) << " reads " << name(r) << " before it is written";
                      written.insert(o.out);
                      written.insert(o.gelu);
                      if (o.kind == OpKind::LayerNorm) written.insert(o.x);
                    }
                    const bool last = j + 1 == blocks;
                    EXPECT_EQ(has(plans[j].forward, OpKind::Add) &&
                                  plans[j].forward.back().out == Buf::Out,
                              last && stores);
                    // backward: dy read after it is made (Dres given; Ddrop made by a dropout
                    // backward here or, with drop path in the LayerNorms, by the next block)
                    std::set<Buf> made{Buf::None, Buf::Dres, Buf::G, Buf::H, Buf::Y1, Buf::Y2,
                                       Buf::RMid, Buf::RIn, Buf::Att};
                    if (!last && path_in_layernorm(s, j)) made.insert(Buf::Ddrop);
                    for (const Op& o : plans[j].backward) {
                      if (o.kind == OpKind::AttentionBackward) {
                        EXPECT_TRUE(made.count(Buf::Dtmp));
                        made.insert(Buf::Dqkv);
                      }
                      // a gradient cast already was cast by the op before it
                      if (o.dy_cast) {
                        EXPECT_TRUE(&o != &plans[j].backward.front() &&
                                    (&o - 1)->cast_w.index == o.w.index);
                      }
                      if (o.kind == OpKind::AttentionRowBackward) made.insert(Buf::Dqkv);
                      EXPECT_TRUE(made.count(o.dy)) << name(o.kind) << " dy " << name(o.dy);
                      made.insert(o.out);
                      if (o.branch != Buf::None) made.insert(o.branch);
                    }
                  }
                }
  EXPECT_EQ(combos, 2 * 2 * 2 * 3 * 2 * 2 * 32 * 2);
}

}  // namespace
}  // namespace vitgrid
