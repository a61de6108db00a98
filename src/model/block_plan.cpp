// The block plan compiler: the rules of include/vitgrid/model/block_plan.h, one place each.
#include "vitgrid/model/block_plan.h"

#include <sstream>

#include "vit_internal.h"
#include "vitgrid/core/error.h"

namespace vitgrid {

using namespace vit_detail;

namespace {

Op of(OpKind k) {
  Op o;
  o.kind = k;
  return o;
}
ParamRef own(int i) { return ParamRef{static_cast<int8_t>(i), false}; }
ParamRef prev(int i) { return ParamRef{static_cast<int8_t>(i), true}; }

// One block's decisions, from the chunk's spec (training unless said otherwise).
struct Rules {
  const ChunkSpec& s;
  int j;
  bool last() const { return j + 1 == s.blocks; }
  float path(int k) const { return s.drop_path[k]; }
  bool drop_act() const { return s.dropout > 0.0f; }
  bool drop_res() const { return drop_act() || path(j) > 0.0f; }
  bool in_ln(int k) const { return path_in_layernorm(s, k); }
  // residual add in LN1: the previous block's r_mid + f, unless it stored r_in[j] itself
  bool prev_feeds() const { return j > 0 && !s.checkpointed[j - 1]; }
  bool fused_add() const { return s.fused && prev_feeds(); }
  // f goes unscaled to the next block's LN1 add, which applies this block's MLP factors
  bool f_in_ln() const { return in_ln(j) && !s.checkpointed[j] && !last(); }
  // block k's Row bias gradients (proj's, fc2's) summed by the LayerNorm backwards
  bool ln_bias(int k) const {
    return s.fused && s.dropout <= 0.0f && (path(k) <= 0.0f || in_ln(k)) &&
           s.tp.row_bias_in_layernorm_backward;
  }
  // fc1's bias gradient summed by the GELU backward in fc2's data-gradient pass
  bool gelu_bias() const { return s.fused && !drop_act() && s.tp.gelu_bias_in_row_backward; }
  bool attention_parts() const { return s.fused && s.tp.row_parts > 1 && s.attention_parts_fit; }
  // fc2's FP8 casts apply fc1's GELU as they read its pre-activation
  bool gelu_in_cast() const { return s.fused && s.fp8 && !drop_act(); }
  // fc1's FP8 dy cast applies GELU's backward (and sums fc1's bias gradient): fc2's backward
  // leaves the gradient of the GELU's output
  bool gelu_in_dy_cast() const { return gelu_in_cast() && s.tp.fp8_gelu_in_dy_cast; }
};

Op need(int half) {
  Op o;
  o.kind = OpKind::Need;
  o.group = half;
  return o;
}
Op report(int half) {
  Op o;
  o.kind = OpKind::Report;
  o.group = half;
  return o;
}
Op linear(LinearRole role, Buf out, Buf x, int w, Width in, Width out_w, int groups = 1) {
  Op o;
  o.kind = OpKind::Linear;
  o.role = role;
  o.out = out;
  o.x = x;
  o.w = own(w);
  o.bias = own(w + 1);
  o.in = in;
  o.out_w = out_w;
  o.groups = groups;
  return o;
}
Op dropout(Buf buf, int site, ActLayout layout) {
  Op o;
  o.kind = OpKind::Dropout;
  o.out = o.x = buf;
  o.site = site;
  o.path = site != kSiteMlpAct;  // the residual branches' sites carry drop path
  o.layout = layout;
  return o;
}
Op dropout_backward(Buf out, Buf x, int site, ActLayout layout) {
  Op o = dropout(out, site, layout);
  o.kind = OpKind::DropoutBackward;
  o.x = x;
  return o;
}
Op gelu(Buf out, Buf x) {
  Op o;
  o.kind = OpKind::Gelu;
  o.out = out;
  o.x = x;
  o.layout = ActLayout::Inner;
  return o;
}
Op gelu_backward(Buf dx, Buf pre, Buf dy) {
  Op o = gelu(dx, pre);
  o.kind = OpKind::GeluBackward;
  o.dy = dy;
  return o;
}
Op add(Buf out, Buf a, Buf b) {
  Op o;
  o.kind = OpKind::Add;
  o.out = out;
  o.a = a;
  o.b = b;
  return o;
}
Op layernorm(int norm, Buf res, Buf out, Buf a, Buf b, Factors f) {
  Op o;
  o.kind = OpKind::LayerNorm;
  o.norm = norm;
  o.x = res;
  o.out = out;
  o.a = a;
  o.b = b;
  o.w = own(norm == 1 ? kNorm1W : kNorm2W);
  o.bias = own(norm == 1 ? kNorm1B : kNorm2B);
  o.factors = f;
  return o;
}
Op linear_backward(LinearRole role, Buf dx, int w, ParamRef db, Buf dy, Buf x, Width in,
                   Width out_w, int groups = 1) {
  Op o;
  o.kind = OpKind::LinearBackward;
  o.role = role;
  o.out = dx;
  o.w = o.dw = own(w);
  o.db = db;
  o.dy = dy;
  o.x = x;
  o.in = in;
  o.out_w = out_w;
  o.groups = groups;
  return o;
}

// The training forward (recompute: a checkpointed block's, which draws nothing, asks for no
// parameters and ends before fc2) or the evaluation forward (train = false).
std::vector<Op> forward_ops(const Rules& r, bool train, bool recompute) {
  std::vector<Op> ops;
  const ChunkSpec& s = r.s;
  const bool in_ln = train && r.in_ln(r.j);
  if (in_ln && !recompute) ops.push_back(of(OpKind::PathFactors));
  if (!recompute) ops.push_back(need(0));
  if (r.fused_add()) {
    const Factors f = train && r.in_ln(r.j - 1) ? Factors::PrevMlp : Factors::None;
    ops.push_back(layernorm(1, Buf::RIn, Buf::Y1, Buf::PrevRMid, Buf::PrevF, f));
  } else {
    if (r.prev_feeds()) ops.push_back(add(Buf::RIn, Buf::PrevRMid, Buf::PrevF));
    ops.push_back(layernorm(1, Buf::RIn, Buf::Y1, Buf::RIn, Buf::None, Factors::None));
  }
  ops.push_back(linear(LinearRole::Column, Buf::Qkv, Buf::Y1, kQkvW, Width::Hidden, Width::Qkv, 3));
  if (r.attention_parts()) {
    Op o = linear(LinearRole::Row, Buf::P, Buf::Att, kProjW, Width::Hidden, Width::Hidden);
    o.kind = OpKind::AttentionRow;
    ops.push_back(o);
  } else {
    ops.push_back(of(OpKind::Attention));
    ops.push_back(linear(LinearRole::Row, Buf::P, Buf::Att, kProjW, Width::Hidden, Width::Hidden));
  }
  const bool drop_res = train && r.drop_res(), drop_act = train && r.drop_act();
  if (drop_res && !in_ln) ops.push_back(dropout(Buf::P, kSiteProj, ActLayout::Stream));
  if (!recompute) ops.push_back(need(1));
  ops.push_back(layernorm(2, Buf::RMid, Buf::Y2, Buf::RIn, Buf::P,
                          in_ln ? Factors::Attn : Factors::None));
  Op fc1 = linear(LinearRole::Column, Buf::H, Buf::Y2, kFc1W, Width::Hidden, Width::Mlp);
  if (s.fused && !r.gelu_in_cast()) fc1.gelu = Buf::G;
  ops.push_back(fc1);
  if (!s.fused) ops.push_back(gelu(Buf::G, Buf::H));
  if (drop_act) ops.push_back(dropout(Buf::G, kSiteMlpAct, ActLayout::Inner));
  // the backward reads no f (fc2's output only feeds the residual stream, stored in
  // r_in[j + 1] or the chunk output): the recompute ends here
  if (recompute) return ops;
  Op fc2 = linear(LinearRole::Row, Buf::F, Buf::G, kFc2W, Width::Mlp, Width::Hidden);
  if (r.gelu_in_cast()) {
    fc2.x = Buf::H;
    fc2.x_gelu = true;
  }
  ops.push_back(fc2);
  if (drop_res && !(train && r.f_in_ln()))
    ops.push_back(dropout(Buf::F, kSiteMlpOut, ActLayout::Stream));
  // a checkpointed block's successor reads r_in[j + 1] only; the chunk's last block stores
  // what the next stage receives (unless the head follows)
  if (s.checkpointed[r.j] && !r.last()) ops.push_back(add(Buf::RInNext, Buf::RMid, Buf::F));
  if (r.last() && s.stores_output) ops.push_back(add(Buf::Out, Buf::RMid, Buf::F));
  return ops;
}

// The backward; Dres holds d(block output) = d(r_mid + f) on entry and d(r_in[j]) on exit.
std::vector<Op> backward_ops(const Rules& r) {
  std::vector<Op> ops;
  const ChunkSpec& s = r.s;
  const int j = r.j;
  const bool in_ln = r.in_ln(j), drop_act = r.drop_act(), drop_res = r.drop_res();
  // Without dropout or drop path on the branches, fc2's output gradient is dres; with drop
  // path in the LayerNorms, the next block's LN1 backward left dres x factors in ddrop (the
  // chunk's last block: a dropout backward, as its forward applied a pass)
  Buf df = Buf::Dres;
  if (in_ln && !r.last()) {
    df = Buf::Ddrop;
  } else if (drop_res) {
    ops.push_back(dropout_backward(Buf::Ddrop, Buf::Dres, kSiteMlpOut, ActLayout::Stream));
    df = Buf::Ddrop;
  }
  // (a checkpointed block's recompute made g; fc2's FP8 casts apply the GELU themselves)
  if (!s.checkpointed[j] && !s.keep_gelu_output && !r.gelu_in_cast()) {
    // g = dropout(gelu(h)) again: the same kernels on the same input give the same bits
    ops.push_back(gelu(Buf::G, Buf::H));
    if (drop_act) ops.push_back(dropout(Buf::G, kSiteMlpAct, ActLayout::Inner));
  }
  // fc2's bias gradient: from the next block's LN1 backward (in the chunk) where it sums it
  const ParamRef fc2_db = r.ln_bias(j) && !r.last() ? ParamRef{} : own(kFc2B);
  Op fc2 = linear_backward(LinearRole::Row, Buf::Dh, kFc2W, fc2_db, df, Buf::G, Width::Mlp,
                           Width::Hidden);
  if (r.gelu_in_cast()) {
    fc2.x = Buf::H;
    fc2.x_gelu = true;
  }
  const bool dy_cast = r.gelu_in_dy_cast();
  const bool gelu_in_gemm = s.fused && !drop_act && !dy_cast;
  if (gelu_in_gemm) fc2.gelu = Buf::H;
  if (r.gelu_bias() && !dy_cast) fc2.dsum = own(kFc1B);
  ops.push_back(fc2);
  if (drop_act) ops.push_back(dropout_backward(Buf::Dh, Buf::Dh, kSiteMlpAct, ActLayout::Inner));
  if (!gelu_in_gemm && !dy_cast) ops.push_back(gelu_backward(Buf::Dh, Buf::H, Buf::Dh));
  Op fc1 = linear_backward(LinearRole::Column, Buf::Dtmp, kFc1W,
                           r.gelu_bias() && !dy_cast ? ParamRef{} : own(kFc1B), Buf::Dh, Buf::Y2,
                           Width::Hidden, Width::Mlp);
  if (dy_cast) {
    fc1.gelu = Buf::H;
    fc1.dy_gelu = true;
  }
  ops.push_back(fc1);
  // dres += LN2 backward: now dres = d r_mid
  Op ln2;
  ln2.kind = OpKind::LayerNormBackward;
  ln2.norm = 2;
  ln2.out = Buf::Dres;
  ln2.dy = Buf::Dtmp;
  ln2.x = Buf::RMid;
  ln2.w = own(kNorm2W);
  ln2.dw = own(kNorm2W);
  ln2.db = own(kNorm2B);
  if (r.ln_bias(j)) ln2.dsum = own(kProjB);
  if (in_ln) {
    ln2.branch = Buf::Ddrop;
    ln2.factors = Factors::Attn;
  }
  ops.push_back(ln2);
  ops.push_back(report(1));
  Buf dp = Buf::Dres;
  if (in_ln) {
    dp = Buf::Ddrop;
  } else if (drop_res) {
    ops.push_back(dropout_backward(Buf::Ddrop, Buf::Dres, kSiteProj, ActLayout::Stream));
    dp = Buf::Ddrop;
  }
  const ParamRef proj_db = r.ln_bias(j) ? ParamRef{} : own(kProjB);
  Op proj = linear_backward(LinearRole::Row, Buf::Dtmp, kProjW, proj_db, dp, Buf::Att,
                            Width::Hidden, Width::Hidden);
  if (r.attention_parts()) {
    proj.kind = OpKind::AttentionRowBackward;
    ops.push_back(proj);
  } else {
    ops.push_back(proj);
    ops.push_back(of(OpKind::AttentionBackward));
  }
  ops.push_back(linear_backward(LinearRole::Column, Buf::Dtmp, kQkvW, own(kQkvB), Buf::Dqkv,
                                Buf::Y1, Width::Hidden, Width::Qkv, 3));
  // dres += LN1 backward: now dres = d r_in[j]; it also sums the previous block's fc2 bias
  // gradient and applies its MLP factors where that block's forward left them to this one
  Op ln1 = ln2;
  ln1.norm = 1;
  ln1.x = Buf::RIn;
  ln1.w = ln1.dw = own(kNorm1W);
  ln1.db = own(kNorm1B);
  ln1.dsum = j > 0 && r.ln_bias(j - 1) ? prev(kFc2B) : ParamRef{};
  const bool prev_in_ln = j > 0 && r.in_ln(j - 1);
  ln1.branch = prev_in_ln ? Buf::Ddrop : Buf::None;
  ln1.factors = prev_in_ln ? Factors::PrevMlp : Factors::None;
  ops.push_back(ln1);
  ops.push_back(report(0));
  return ops;
}

}  // namespace

bool path_in_layernorm(const ChunkSpec& s, int j) {
  return s.fused && s.dropout <= 0.0f && s.drop_path[j] > 0.0f && s.tp.layernorm_row_factors;
}

std::vector<BlockPlan> compile_chunk_plans(const ChunkSpec& s) {
  VG_CHECK(s.blocks >= 1 && static_cast<int>(s.drop_path.size()) == s.blocks &&
               static_cast<int>(s.checkpointed.size()) == s.blocks,
           "a chunk spec of " << s.blocks << " blocks with " << s.drop_path.size()
                              << " drop path rates and " << s.checkpointed.size()
                              << " checkpointing flags");
  for (int j = 1; j < s.blocks; ++j)
    VG_CHECK(!s.checkpointed[j] || s.checkpointed[j - 1],
             "a checkpointed block after a kept one (the recompute would need its f)");
  std::vector<BlockPlan> plans(s.blocks);
  for (int j = 0; j < s.blocks; ++j) {
    const Rules r{s, j};
    BlockPlan& p = plans[j];
    p.block = s.first_block + j;
    p.checkpointed = s.checkpointed[j];
    p.forward = forward_ops(r, true, false);
    p.forward_eval = forward_ops(r, false, false);
    if (p.checkpointed) p.recompute = forward_ops(r, true, true);
    p.backward = backward_ops(r);
    if (s.fp8)  // the four Linears' GEMMs, in every list (the recompute casts as its forward)
      for (auto* list : {&p.forward, &p.forward_eval, &p.recompute, &p.backward})
        for (Op& op : *list)
          op.fp8 = op.kind == OpKind::Linear || op.kind == OpKind::LinearBackward ||
                   op.kind == OpKind::AttentionRow || op.kind == OpKind::AttentionRowBackward;
    if (s.fp8 && s.tp.fp8_keep_x_transposes) {
      // The training forward's casts keep x's transpose, the recompute's too, and the weight
      // gradients take it: no second cast of x, and qkv's and fc1's bf16 inputs (Y1, Y2) are
      // not read by the backward. A checkpointed block's recompute ends before fc2, whose
      // backward then casts its input again.
      auto kept = [&](const Op& op) { return op.fp8 && (op.w.index != kFc2W || !p.checkpointed); };
      for (Op& op : p.forward) op.x_t = kept(op);
      for (Op& op : p.recompute) op.x_t = op.fp8;
      for (Op& op : p.backward) {
        op.x_t = kept(op);
        if (op.x_t && (op.x == Buf::Y1 || op.x == Buf::Y2)) op.x = Buf::None;
      }
    }
    if (s.fp8 && s.fused && s.tp.fp8_layernorm_cast) {
      // LN1 and LN2 write the FP8 copies of qkv's and fc1's inputs (and, the Linears keeping
      // x's transpose, those): nothing reads their bf16 outputs then (the evaluation forward,
      // whose casts keep no transposes, is left as it is)
      for (auto* list : {&p.forward, &p.recompute})
        for (size_t i = 0; i + 1 < list->size(); ++i) {
          Op& ln = (*list)[i];
          Op& lin = (*list)[i + 1];
          if (ln.kind != OpKind::LayerNorm || lin.kind != OpKind::Linear || !lin.fp8 ||
              !lin.x_t || lin.x_gelu || lin.role != LinearRole::Column || lin.x != ln.out)
            continue;
          ln.cast_w = lin.w;
          ln.out_w = lin.out_w;  // the Linear's output width (its FP8 scratch's size)
          ln.out = Buf::None;
          lin.x = Buf::None;
          lin.x_cast = true;
        }
    }
    if (s.fp8 && s.fused && s.tp.fp8_attention_dy_cast) {
      // the attention backward writes qkv's FP8 output gradient (codes, transpose, amax) and
      // sums qkv's bias gradient: nothing reads the act-dtype Dqkv after it
      for (size_t i = 0; i + 1 < p.backward.size(); ++i) {
        Op& at = p.backward[i];
        Op& lin = p.backward[i + 1];
        if (at.kind != OpKind::AttentionBackward || lin.kind != OpKind::LinearBackward ||
            !lin.fp8 || lin.w.index != kQkvW || lin.dy != Buf::Dqkv || lin.dy_gelu)
          continue;
        at.cast_w = lin.w;
        at.db = lin.db;
        lin.db = ParamRef{};
        lin.dy = Buf::None;
        lin.dy_cast = true;
      }
    }
  }
  if (s.fp8 && s.fused && s.tp.fp8_layernorm_dy_cast) {
    // A LayerNorm backward writes the FP8 output gradient (codes, transpose, amax) of the Row
    // Linear whose output is the residual branch it closes: LN2's proj's in the block, LN1's
    // the previous block's fc2 (in the chunk, and not checkpointed: a recompute between the
    // two would use the FP8 scratch). Where the gradient the Linear reads is the one the
    // LayerNorm leaves (dres, or with row factors its branch) and the LayerNorm sums the
    // Linear's bias gradient; nothing reads the act-dtype dy in the Linear then.
    auto fuse = [](Op& ln, Op& lin, bool prev) {
      if (ln.kind != OpKind::LayerNormBackward || ln.cast_w.valid() ||
          lin.kind != OpKind::LinearBackward || !lin.fp8 || lin.role != LinearRole::Row ||
          lin.dy_gelu || lin.dy_cast || lin.db.valid() || lin.gelu != Buf::None ||
          lin.dsum.valid() || !ln.dsum.valid() ||
          ln.dsum.prev != prev || ln.dsum.index != lin.w.index + 1 ||
          lin.dy != (ln.branch != Buf::None ? ln.branch : ln.out))
        return;
      ln.cast_w = ParamRef{lin.w.index, prev};
      ln.in = lin.in;
      ln.out_w = lin.out_w;  // the Linear's widths (its FP8 scratch's size)
      lin.dy = Buf::None;
      lin.dy_cast = true;
    };
    // the op after i that is not a Report (the gradient reduction's marker, no kernel)
    auto after = [](std::vector<Op>& ops, size_t i) -> Op* {
      for (size_t k = i + 1; k < ops.size(); ++k)
        if (ops[k].kind != OpKind::Report) return &ops[k];
      return nullptr;
    };
    // the first op of a backward that is not a Need (the parameters' gather marker) or Report
    auto first = [](std::vector<Op>& ops) -> Op* {
      for (Op& op : ops)
        if (op.kind != OpKind::Need && op.kind != OpKind::Report) return &op;
      return nullptr;
    };
    for (int j = 0; j < s.blocks; ++j) {
      std::vector<Op>& ops = plans[j].backward;
      for (size_t i = 0; i < ops.size(); ++i) {
        if (ops[i].kind != OpKind::LayerNormBackward) continue;
        if (ops[i].norm == 2) {
          if (Op* lin = after(ops, i)) fuse(ops[i], *lin, false);
        } else if (j > 0 && !plans[j - 1].checkpointed) {
          if (Op* lin = first(plans[j - 1].backward)) fuse(ops[i], *lin, true);
        }
      }
    }
  }
  return plans;
}

const char* name(Buf b) {
  static const char* const n[] = {"None", "RIn", "RInNext", "Out", "Y1", "Qkv", "Att",
                                  "P", "RMid", "Y2", "H", "G", "F", "PrevRMid", "PrevF",
                                  "Dres", "Ddrop", "Dtmp", "Dqkv", "Dh"};
  return n[static_cast<int>(b)];
}

const char* name(OpKind k) {
  static const char* const n[] = {
      "Need", "Report", "PathFactors", "LayerNorm", "Linear", "Gelu", "Dropout", "Add",
      "Attention", "AttentionRow", "LinearBackward", "GeluBackward", "DropoutBackward",
      "LayerNormBackward", "AttentionBackward", "AttentionRowBackward"};
  return n[static_cast<int>(k)];
}

std::string describe(const std::vector<Op>& ops) {
  static const char* const params[] = {"norm1.w", "norm1.b", "qkv.w",  "qkv.b",
                                       "proj.w",  "proj.b",  "norm2.w", "norm2.b",
                                       "fc1.w",   "fc1.b",   "fc2.w",  "fc2.b"};
  static const char* const sites[] = {"pos", "proj", "mlp_act", "mlp_out"};
  static const char* const factors[] = {"none", "attn", "mlp", "prev_mlp"};
  std::ostringstream o;
  auto buf = [&](const char* k, Buf b) {
    if (b != Buf::None) o << ' ' << k << '=' << name(b);
  };
  auto par = [&](const char* k, ParamRef p) {
    if (p.valid()) o << ' ' << k << '=' << (p.prev ? "prev." : "") << params[p.index];
  };
  for (const Op& op : ops) {
    o << name(op.kind);
    if (op.kind == OpKind::Need || op.kind == OpKind::Report)
      o << ' ' << (op.group ? "mlp" : "attn");
    if (op.kind == OpKind::Linear || op.kind == OpKind::LinearBackward ||
        op.kind == OpKind::AttentionRow || op.kind == OpKind::AttentionRowBackward)
      o << (op.role == LinearRole::Column ? " column" : " row") << (op.fp8 ? " fp8" : "")
        << (op.x_gelu ? " x_gelu" : "") << (op.dy_gelu ? " dy_gelu" : "")
        << (op.x_t ? " x_t" : "") << (op.x_cast ? " x_cast" : "")
        << (op.dy_cast ? " dy_cast" : "");
    if (op.norm) o << " norm" << op.norm;
    buf("out", op.out);
    buf("x", op.x);
    buf("a", op.a);
    buf("b", op.b);
    buf("dy", op.dy);
    buf("gelu", op.gelu);
    buf("branch", op.branch);
    par("w", op.w);
    par("bias", op.bias);
    par("dw", op.dw);
    par("db", op.db);
    par("dsum", op.dsum);
    par("cast", op.cast_w);
    if (op.factors != Factors::None) o << " factors=" << factors[static_cast<int>(op.factors)];
    if (op.kind == OpKind::Dropout || op.kind == OpKind::DropoutBackward)
      o << " site=" << sites[op.site] << (op.path ? "+path" : "");
    o << '\n';
  }
  return o.str();
}

}  // namespace vitgrid
