// The ViT's transformer block: the replay of its plan (model/block_plan.h). block_forward and
// block_backward pick the op list (training, evaluation, recompute; backward) and run_ops
// resolves each op's buffers against the activation set and runs it on this rank's shards
// through the TensorParallel strategy: what the block computes and how is in the plan, not
// here. The rest of the model is in vit.cpp; what the two share is in vit_internal.h.
#include <cstddef>

#include "vit_internal.h"
#include "vitgrid/core/error.h"
#include "vitgrid/model/vit.h"

namespace vitgrid {

using namespace vit_detail;

namespace {
// Where sample `lo` of the attention's buffers starts: its output (or output gradient) [B, T,
// H hd], its qkv (or their gradient) [B, T, 3 H hd] and what it saves for the backward.
struct AttnParts {
  AttnParts(const Backend& be, int T, int H, int hd, size_t es)
      : o(size_t(T) * H * hd * es), saved_b(be.attention_saved_bytes(1, T, H, hd)),
        align(be.attention_alignment()) {}
  void* out(void* p, int lo) const { return static_cast<char*>(p) + o * lo; }
  void* qkv(void* p, int lo) const { return static_cast<char*>(p) + 3 * o * lo; }
  void* saved(void* p, int lo) const { return static_cast<char*>(p) + saved_b * lo; }
  // whether parts of n samples start where the backend's attention may start
  bool splits_at(int n) const { return (o * n) % align == 0 && (saved_b * n) % align == 0; }
  size_t o, saved_b, align;
};
}  // namespace

bool ViT::attention_parts_fit(int Bi) const {
  const int parts = tp_.fusions().row_parts;
  if (parts <= 1 || Bi % parts != 0) return false;
  const AttnParts ap(be_, cfg_.tokens(), tp_.local_heads(cfg_.heads), cfg_.head_dim(),
                     be_.act_size());
  return ap.splits_at(Bi / parts);
}

const BlockPlan& ViT::block_plan(int l, int batch) const {
  // (the plans without attention parts, for micro-batches whose parts the backend cannot start
  // at, exist only where the strategy has parts)
  if (plans_[1].empty()) return plans_[0][l];
  const int Bi = tp_.act_block(ActLayout::Inner, batch, cfg_.mlp).samples;
  return plans_[attention_parts_fit(Bi) ? 0 : 1][l];
}

// Block l (global index: it keys the dropout masks) of micro-batch `in` in set `set`. With
// checkpointing the block's activations live in the shared set and this also runs as the
// recompute of the backward.
void ViT::block_forward(int l, const DeviceBatch& in, int64_t step, bool train, int set,
                        bool recompute) {
  const BlockPlan& p = block_plan(l, in.count);
  a_->shared_set = a_->shared_block = -1;
  run_ops(recompute ? p.recompute : train ? p.forward : p.forward_eval, l, in, step, set, false);
  if (p.checkpointed && train && !recompute) {
    a_->shared_set = set;
    a_->shared_block = l;
  }
}

void ViT::block_backward(int l, const DeviceBatch& in, int64_t step, int set, bool final) {
  const BlockPlan& p = block_plan(l, in.count);
  // With checkpointing, recompute the block's activations into shared, unless its own forward
  // is still there (the chunk's last block when no other forward ran since: the same bits).
  if (p.checkpointed && (a_->shared_set != set || a_->shared_block != l))
    block_forward(l, in, step, true, set, true);
  a_->shared_set = a_->shared_block = -1;
  run_ops(p.backward, l, in, step, set, final);
}

void ViT::run_ops(const std::vector<Op>& ops, int l, const DeviceBatch& in, int64_t step,
                  int set, bool final) {
  Acts& a = *a_;
  Acts::Set& st = a.sets[set];
  const auto& ch = layout_.chunks[chunk_of_block(l)];
  const int j = l - ch.first_block;  // index within the chunk
  Acts::BlockActs& b = checkpointed(l) ? a.shared : st.blocks[j];
  // B is the whole micro-batch; this rank computes its blocks: Bl samples (N rows) and Cs
  // columns of the Stream, Bi samples (Ni rows) and Ml columns of the Inner activations
  const int B = in.count, T = cfg_.tokens(), C = cfg_.hidden, M = cfg_.mlp;
  const int Bl = tp_.local_batch(B), N = Bl * T;
  const ActBlock ib = tp_.act_block(ActLayout::Inner, B, M);
  const int Bi = ib.samples, Ni = Bi * T;
  const size_t Cs = tp_.act_block(ActLayout::Stream, B, C).cols, Ml = ib.cols;
  const int H = tp_.local_heads(cfg_.heads), hd = cfg_.head_dim();
  const size_t as = be_.act_size();
  const float path = cfg_.drop_path_rate(l);
  auto buf = [&](Buf x) -> void* {
    switch (x) {
      case Buf::None: return nullptr;
      case Buf::RIn: return st.r_in[j];
      case Buf::RInNext: return st.r_in[j + 1];
      case Buf::Out: return st.out;
      case Buf::Y1: return b.y1;
      case Buf::Qkv: return b.qkv;
      case Buf::Att: return b.att;
      case Buf::P: return b.p;
      case Buf::RMid: return b.r_mid;
      case Buf::Y2: return b.y2;
      case Buf::H: return b.h;
      case Buf::G: return b.g;
      case Buf::F: return b.f;
      case Buf::PrevRMid: return st.blocks[j - 1].r_mid;
      case Buf::PrevF: return st.blocks[j - 1].f;
      case Buf::Dres: return a.dres;
      case Buf::Ddrop: return a.ddrop;
      case Buf::Dtmp: return a.dtmp;
      case Buf::Dqkv: return a.dqkv;
      case Buf::Dh: return a.dh;
    }
    return nullptr;
  };
  auto param = [&](ParamRef r) -> size_t {
    return params_[block_param_[r.prev ? l - 1 : l] + r.index].offset;
  };
  auto W = [&](ParamRef r) -> const void* {
    return r.valid() ? static_cast<const char*>(compute_) + param(r) * as : nullptr;
  };
  auto G = [&](ParamRef r) -> float* { return r.valid() ? grads_ + param(r) : nullptr; };
  auto width = [&](Width w) { return w == Width::Hidden ? C : w == Width::Mlp ? M : 3 * C; };
  // a Column Linear reads Stream rows, a Row Linear Inner rows
  auto rows = [&](LinearRole r) { return r == LinearRole::Column ? N : Ni; };
  auto count = [&](ActLayout x) { return x == ActLayout::Stream ? N * Cs : size_t(Ni) * Ml; };
  auto key = [&](const Op& op) {
    return dkey(in, step, l, op.site, op.layout, op.layout == ActLayout::Stream ? C : M,
                op.path ? path : 0.0f);
  };
  auto factors = [&](Factors f) {
    switch (f) {
      case Factors::None: return RowFactors{};
      case Factors::Attn: return RowFactors{a.path_factors(set, j, 0), T};
      case Factors::Mlp: return RowFactors{a.path_factors(set, j, 1), T};
      case Factors::PrevMlp: return RowFactors{a.path_factors(set, j - 1, 1), T};
    }
    return RowFactors{};
  };
  const AttnParts ap(be_, T, H, hd, as);
  auto attention = [&](int lo, int n) {
    be_.attention_forward(ap.out(b.att, lo), ap.saved(b.asaved, lo), ap.qkv(b.qkv, lo), n, T, H,
                          hd, a.attn_ws);
  };
  auto attention_backward = [&](int lo, int n) {
    be_.attention_backward(ap.qkv(a.dqkv, lo), ap.out(a.dtmp, lo), ap.qkv(b.qkv, lo),
                           ap.out(b.att, lo), ap.saved(b.asaved, lo), n, T, H, hd, a.attn_ws);
  };
  // an FP8 Linear's scaling: qkv, proj, fc1 or fc2 by its weight (x_t: the transpose of its
  // input kept in the block's buffer)
  auto meta = [&](int w, bool x_t) {
    VG_CHECK(w == kQkvW || w == kProjW || w == kFc1W || w == kFc2W, "an FP8 op on param " << w);
    const int k = w == kQkvW ? 0 : w == kProjW ? 1 : w == kFc1W ? 2 : 3;
    Fp8LinearMeta m = fp8_meta(l, k);
    m.x_t = x_t ? b.xt[k] : nullptr;
    VG_CHECK(!x_t || m.x_t, "an FP8 Linear keeping x's transpose without its buffer");
    return m;
  };
  Fp8LinearMeta m8;
  auto fp8 = [&](const Op& op) -> const Fp8LinearMeta* {
    VG_CHECK(!(op.x_gelu || op.dy_gelu || op.x_cast || op.dy_cast) || op.fp8,
             "a GELU applied by the casts, or a cast input or gradient, of a Linear not in FP8");
    if (!op.fp8) return nullptr;
    m8 = meta(op.w.index, op.x_t);
    m8.x_gelu = op.x_gelu ? &cfg_.gelu : nullptr;
    m8.dy_gelu = op.dy_gelu;
    m8.x_cast = op.x_cast;
    m8.dy_cast = op.dy_cast;
    return &m8;
  };
  for (const Op& op : ops) {
    switch (op.kind) {
      case OpKind::Need:
        need(block_group_[l] + op.group);
        break;
      case OpKind::Report:
        if (final) report(block_group_[l] + op.group);
        break;
      case OpKind::PathFactors:
        be_.drop_path_factors(a.path_factors(set, j, 0), Bl,
                              dkey(in, step, l, kSiteProj, ActLayout::Stream, C, path));
        be_.drop_path_factors(a.path_factors(set, j, 1), Bl,
                              dkey(in, step, l, kSiteMlpOut, ActLayout::Stream, C, path));
        break;
      case OpKind::LayerNorm: {
        float* m = op.norm == 1 ? b.m1 : b.m2;
        float* s = op.norm == 1 ? b.s1 : b.s2;
        if (op.cast_w.valid()) {  // into the FP8 copy of the Column Linear's input that follows
          Fp8LinearMeta next = meta(op.cast_w.index, true);
          next.x_cast = true;
          tp_.layernorm_forward_fp8(buf(op.x), m, s, buf(op.a), buf(op.b), W(op.w), W(op.bias),
                                    N, C, cfg_.ln_eps, factors(op.factors), next, C,
                                    width(op.out_w));
          break;
        }
        tp_.layernorm_forward(buf(op.x), buf(op.out), m, s, buf(op.a), buf(op.b), W(op.w),
                              W(op.bias), N, C, cfg_.ln_eps, factors(op.factors));
        break;
      }
      case OpKind::Linear:
        tp_.linear_forward(op.role, buf(op.out), buf(op.x), W(op.w), W(op.bias), rows(op.role),
                           width(op.in), width(op.out_w), buf(op.gelu), cfg_.gelu, op.groups,
                           fp8(op));
        break;
      case OpKind::Gelu:
        be_.gelu_forward(buf(op.out), buf(op.x), count(op.layout), cfg_.gelu);
        break;
      case OpKind::Dropout:
        be_.dropout_forward(buf(op.out), buf(op.x), count(op.layout), cfg_.dropout, key(op));
        break;
      case OpKind::Add:
        be_.add(buf(op.out), buf(op.a), buf(op.b), count(op.layout));
        break;
      case OpKind::Attention:
        attention(0, Bi);
        break;
      case OpKind::AttentionRow:
        tp_.row_forward_produced(buf(op.out), buf(op.x), W(op.w), W(op.bias), Ni, C, C, Bi,
                                 attention, fp8(op));
        break;
      case OpKind::LinearBackward:
        tp_.linear_backward(op.role, buf(op.out), G(op.dw), G(op.db), buf(op.dy), buf(op.x),
                            W(op.w), rows(op.role), width(op.in), width(op.out_w), op.groups,
                            buf(op.gelu), cfg_.gelu, G(op.dsum), fp8(op));
        break;
      case OpKind::GeluBackward:
        be_.gelu_backward(buf(op.out), buf(op.x), buf(op.dy), count(op.layout), cfg_.gelu);
        break;
      case OpKind::DropoutBackward:
        be_.dropout_backward(buf(op.out), buf(op.x), count(op.layout), cfg_.dropout, key(op));
        break;
      case OpKind::LayerNormBackward: {
        const float* m = op.norm == 1 ? b.m1 : b.m2;
        const float* s = op.norm == 1 ? b.s1 : b.s2;
        if (op.cast_w.valid()) {  // into the FP8 copies of the Row Linear's output gradient
          VG_CHECK(op.cast_w.index == kProjW || op.cast_w.index == kFc2W,
                   "a LayerNorm backward casting for param " << int(op.cast_w.index));
          Fp8LinearMeta prev = fp8_meta(op.cast_w.prev ? l - 1 : l,
                                        op.cast_w.index == kProjW ? 1 : 3);
          prev.dy_cast = true;
          tp_.layernorm_backward_fp8(buf(op.out), G(op.dw), G(op.db), buf(op.dy), buf(op.x),
                                     W(op.w), m, s, N, C, G(op.dsum), buf(op.branch),
                                     factors(op.factors), prev, width(op.in), width(op.out_w));
          break;
        }
        tp_.layernorm_backward(buf(op.out), G(op.dw), G(op.db), buf(op.dy), buf(op.x), W(op.w),
                               m, s, N, C, G(op.dsum), buf(op.branch), factors(op.factors));
        break;
      }
      case OpKind::AttentionBackward:
        if (op.cast_w.valid()) {  // into the FP8 copies of qkv's output gradient, which follows
          Fp8LinearMeta prev = meta(op.cast_w.index, false);
          prev.dy_cast = true;
          tp_.attention_backward_fp8(a.dqkv, a.dtmp, b.qkv, b.att, b.asaved, Bi, T, H, hd,
                                     a.attn_ws, prev, G(op.db));
          break;
        }
        attention_backward(0, Bi);
        break;
      case OpKind::AttentionRowBackward:
        tp_.row_backward_consumed(buf(op.out), G(op.dw), G(op.db), buf(op.dy), buf(op.x),
                                  W(op.w), Ni, C, C, Bi, attention_backward, fp8(op));
        break;
    }
  }
}

}  // namespace vitgrid
