// The ViT's transformer block: block_forward (LayerNorm, attention, MLP; also the recompute of
// a checkpointed block) and block_backward, on this rank's shards through the TensorParallel
// strategy. The rest of the model is in vit.cpp; what the two share is in vit_internal.h.
#include <cstddef>

#include "vit_internal.h"
#include "vitgrid/model/vit.h"

namespace vitgrid {

using namespace vit_detail;

namespace {
// Where sample `lo` of the attention's buffers starts: its output (or output gradient) [B, T,
// H hd], its qkv (or their gradient) [B, T, 3 H hd] and what it saves for the backward.
struct AttnParts {
  AttnParts(const Backend& be, int T, int H, int hd, size_t es)
      : o(size_t(T) * H * hd * es), saved_b(be.attention_saved_bytes(1, T, H, hd)) {}
  void* out(void* p, int lo) const { return static_cast<char*>(p) + o * lo; }
  void* qkv(void* p, int lo) const { return static_cast<char*>(p) + 3 * o * lo; }
  void* saved(void* p, int lo) const { return static_cast<char*>(p) + saved_b * lo; }
  // whether parts of n samples start where the backend's attention may start (cuDNN: 16 bytes)
  bool splits_at(int n) const { return (o * n) % 16 == 0 && (saved_b * n) % 16 == 0; }
  size_t o, saved_b;
};
}  // namespace

// Block l (global index: it keys the dropout masks) of micro-batch `in` in set `set`. With
// checkpointing the block's activations live in the shared set and this also runs as the
// recompute of the backward (`recompute`: the outputs it stores for others are already there).
void ViT::block_forward(int l, const DeviceBatch& in, int64_t step, bool train, int set,
                        bool recompute) {
  Acts& a = *a_;
  Acts::Set& st = a.sets[set];
  const auto& ch = layout_.chunks[chunk_of_block(l)];
  const int j = l - ch.first_block;  // index within the chunk
  const bool ckpt = checkpointed(l);
  Acts::BlockActs& b = ckpt ? a.shared : st.blocks[j];
  // B is the whole micro-batch; this rank computes its blocks: Bl samples (N rows) and Cs
  // columns of the Stream, Bi samples (Ni rows) and Ml columns of the Inner activations
  const int B = in.count, T = cfg_.tokens(), C = cfg_.hidden, M = cfg_.mlp;
  const int Bl = tp_.local_batch(B), N = Bl * T;
  const ActBlock ib = tp_.act_block(ActLayout::Inner, B, M);
  const int Bi = ib.samples, Ni = Bi * T;
  const size_t Cs = tp_.act_block(ActLayout::Stream, B, C).cols, Ml = ib.cols;
  const int H = tp_.local_heads(cfg_.heads), hd = cfg_.head_dim();
  const size_t as = be_.act_size();
  const int base = block_param_[l];
  auto W = [&](int i) -> const void* {
    return static_cast<const char*>(compute_) + params_[base + i].offset * as;
  };
  // dropout on the MLP's activation; dropout and drop path on the two residual branches
  const float path = train ? cfg_.drop_path_rate(l) : 0.0f;
  const bool drop_act = train && cfg_.dropout > 0.0f, drop_res = drop_act || path > 0.0f;
  // LayerNorm 1 on the residual stream entering the block. Inside a chunk the stream is the
  // previous block's r_mid + f: fused add (unless recomputing from the stored r_in). The
  // chunk's first block reads its input (embedding output or the previous stage's output),
  // and a block after a checkpointed one the r_in[j] that one stored. (A checkpointed block
  // follows only checkpointed ones: its recompute never needs the previous block's f.)
  const bool fused_add = j > 0 && !checkpointed(l - 1);
  // Drop path in the LayerNorms: the branches' per-sample factors go into LayerNorm 2's add
  // (the attention branch) and the next block's LayerNorm 1's (the MLP branch, when that add
  // is fused: else a pass over f as with dropout). The recompute finds them in the set.
  const bool in_ln = train && path_in_layernorm(l);
  if (in_ln && !recompute) {
    be_.drop_path_factors(a.path_factors(set, j, 0), Bl,
                          dkey(in, step, l, kSiteProj, ActLayout::Stream, C, path));
    be_.drop_path_factors(a.path_factors(set, j, 1), Bl,
                          dkey(in, step, l, kSiteMlpOut, ActLayout::Stream, C, path));
  }
  const bool f_in_ln = in_ln && !ckpt && j + 1 < ch.blocks;  // f goes unscaled to that add
  a.shared_set = a.shared_block = -1;
  if (!recompute) need(block_group_[l]);
  if (fused_add) {
    Acts::BlockActs& pb = st.blocks[j - 1];
    const RowFactors pf = train && path_in_layernorm(l - 1)
                              ? RowFactors{a.path_factors(set, j - 1, 1), T}
                              : RowFactors{};
    tp_.layernorm_forward(st.r_in[j], b.y1, b.m1, b.s1, pb.r_mid, pb.f, W(kNorm1W), W(kNorm1B),
                          N, C, cfg_.ln_eps, pf);
  } else {
    tp_.layernorm_forward(st.r_in[j], b.y1, b.m1, b.s1, st.r_in[j], nullptr, W(kNorm1W),
                          W(kNorm1B), N, C, cfg_.ln_eps);
  }
  tp_.linear_forward(LinearRole::Column, b.qkv, b.y1, W(kQkvW), W(kQkvB), N, C, 3 * C, nullptr,
                     cfg_.gelu, 3);
  // the attention of the samples the proj Linear asks for, when it asks (see TensorParallel)
  const AttnParts ap(be_, T, H, hd, as);
  auto attention = [&](int lo, int n) {
    be_.attention_forward(ap.out(b.att, lo), ap.saved(b.asaved, lo), ap.qkv(b.qkv, lo), n, T, H,
                          hd, a.attn_ws);
  };
  if (ap.splits_at(tp_.row_part_samples(Bi)))
    tp_.row_forward_produced(b.p, b.att, W(kProjW), W(kProjB), Ni, C, C, Bi, attention);
  else  // (parts the backend cannot start at: the attention whole first, the default)
    tp_.TensorParallel::row_forward_produced(b.p, b.att, W(kProjW), W(kProjB), Ni, C, C, Bi,
                                             attention);
  if (drop_res && !in_ln)
    be_.dropout_forward(b.p, b.p, N * Cs, cfg_.dropout,
                        dkey(in, step, l, kSiteProj, ActLayout::Stream, C, path));
  if (!recompute) need(block_group_[l] + 1);
  const RowFactors pb = in_ln ? RowFactors{a.path_factors(set, j, 0), T} : RowFactors{};
  tp_.layernorm_forward(b.r_mid, b.y2, b.m2, b.s2, st.r_in[j], b.p, W(kNorm2W), W(kNorm2B), N,
                        C, cfg_.ln_eps, pb);
  tp_.linear_forward(LinearRole::Column, b.h, b.y2, W(kFc1W), W(kFc1B), N, C, M, b.g,
                     cfg_.gelu);
  if (drop_act)
    be_.dropout_forward(b.g, b.g, size_t(Ni) * Ml, cfg_.dropout,
                        dkey(in, step, l, kSiteMlpAct, ActLayout::Inner, M));
  // The backward reads no f (fc2's output only feeds the residual stream, stored in r_in[j + 1]
  // or the chunk output): the recompute ends before fc2.
  if (recompute) return;
  tp_.linear_forward(LinearRole::Row, b.f, b.g, W(kFc2W), W(kFc2B), Ni, M, C, nullptr,
                     cfg_.gelu);
  if (drop_res && !f_in_ln)
    be_.dropout_forward(b.f, b.f, N * Cs, cfg_.dropout,
                        dkey(in, step, l, kSiteMlpOut, ActLayout::Stream, C, path));
  // With activation checkpointing the next block reads only r_in[j+1]: store it now. The
  // chunk's last block stores the output the next stage receives (unless the head follows).
  if (ckpt && j + 1 < ch.blocks) be_.add(st.r_in[j + 1], b.r_mid, b.f, N * Cs);
  if (j + 1 == ch.blocks && st.out) be_.add(st.out, b.r_mid, b.f, N * Cs);
  if (ckpt && train) {
    a.shared_set = set;
    a.shared_block = l;
  }
}

void ViT::block_backward(int l, const DeviceBatch& in, int64_t step, int set, bool final) {
  Acts& a = *a_;
  // With checkpointing, recompute the block's activations into shared, unless its own forward
  // is still there (the chunk's last block when no other forward ran since: the same bits).
  const bool ckpt = checkpointed(l);
  if (ckpt && (a.shared_set != set || a.shared_block != l))
    block_forward(l, in, step, true, set, true);
  a.shared_set = a.shared_block = -1;
  Acts::Set& st = a.sets[set];
  const auto& chunk = layout_.chunks[chunk_of_block(l)];
  const int j = l - chunk.first_block;
  Acts::BlockActs& b = ckpt ? a.shared : st.blocks[j];
  const int B = in.count, T = cfg_.tokens(), C = cfg_.hidden, M = cfg_.mlp;
  const int N = tp_.local_batch(B) * T;  // the Stream's rows; Ni the Inner's (block_forward)
  const ActBlock ib = tp_.act_block(ActLayout::Inner, B, M);
  const int Bi = ib.samples, Ni = Bi * T;
  const size_t Cs = tp_.act_block(ActLayout::Stream, B, C).cols, Ml = ib.cols;
  const int H = tp_.local_heads(cfg_.heads), hd = cfg_.head_dim();
  const size_t as = be_.act_size();
  const int base = block_param_[l];
  auto W = [&](int i) -> const void* {
    return static_cast<const char*>(compute_) + params_[base + i].offset * as;
  };
  // gradient of parameter i of block k (G: of this block)
  auto Gk = [&](int k, int i) -> float* { return grads_ + params_[block_param_[k] + i].offset; };
  auto G = [&](int i) { return Gk(l, i); };
  const float path = cfg_.drop_path_rate(l);
  const bool drop_act = cfg_.dropout > 0.0f, drop_res = drop_act || path > 0.0f;
  const size_t NC = N * Cs, NM = size_t(Ni) * Ml;
  // Without dropout or drop path on block k's residual branches, proj's output gradient is
  // dres as LN2's backward leaves it, and fc2's is dres as the next block's LN1 backward leaves
  // it; with drop path in the LayerNorms (path_in_layernorm), those backwards also leave dres
  // times the branch's factors in ddrop, which is then that gradient. Where the strategy can,
  // those passes add the bias gradients (the column sums of that gradient): LN2's here
  // proj's, LN1's here the previous block's fc2's (in this chunk); this block's fc2 sums its
  // own only as the chunk's last block (its dres came from the head or the next stage). Drop
  // path's rate differs from block to block, so the two blocks decide apart.
  const bool last_in_chunk = l + 1 == chunk.first_block + chunk.blocks;
  auto ln_bias = [&](int k) {
    return cfg_.dropout <= 0.0f && (cfg_.drop_path_rate(k) <= 0.0f || path_in_layernorm(k)) &&
           tp_.row_bias_in_layernorm_backward();
  };
  float* fc2_db = ln_bias(l) && !last_in_chunk ? nullptr : G(kFc2B);
  float* proj_db_ln = ln_bias(l) ? G(kProjB) : nullptr;
  float* prev_fc2_db = l > chunk.first_block && ln_bias(l - 1) ? Gk(l - 1, kFc2B) : nullptr;
  const bool in_ln = path_in_layernorm(l);
  auto factors = [&](int jj, int branch) { return RowFactors{a.path_factors(set, jj, branch), T}; };
  // dres holds d(block output) = d(r_mid + f)
  const void* df = a.dres;
  if (in_ln && !last_in_chunk) {
    df = a.ddrop;  // the next block's LayerNorm 1 backward left it there
  } else if (drop_res) {
    be_.dropout_backward(a.ddrop, a.dres, NC, cfg_.dropout,
                         dkey(in, step, l, kSiteMlpOut, ActLayout::Stream, C, path));
    df = a.ddrop;
  }
  if (!ckpt && !cfg_.keep_gelu_output) {  // (a checkpointed block's recompute made g)
    // g = dropout(gelu(h)) again: the same kernels on the same input give the same bits
    be_.gelu_forward(b.g, b.h, NM, cfg_.gelu);
    if (drop_act)
      be_.dropout_forward(b.g, b.g, NM, cfg_.dropout,
                          dkey(in, step, l, kSiteMlpAct, ActLayout::Inner, M));
  }
  // Without dropout between them, the GELU backward goes into fc2's (dh = (df W2) * gelu'(h)),
  // and where the strategy can, fc1's bias gradient (the column sums of dh) into that pass;
  // with dropout, after the dropout's.
  float* fc1_db = drop_act || !tp_.gelu_bias_in_row_backward() ? nullptr : G(kFc1B);
  tp_.linear_backward(LinearRole::Row, a.dh, G(kFc2W), fc2_db, df, b.g, W(kFc2W), Ni, M, C, 1,
                      drop_act ? nullptr : b.h, cfg_.gelu, fc1_db);
  if (drop_act) {
    be_.dropout_backward(a.dh, a.dh, NM, cfg_.dropout,
                         dkey(in, step, l, kSiteMlpAct, ActLayout::Inner, M));
    be_.gelu_backward(a.dh, b.h, a.dh, NM, cfg_.gelu);
  }
  tp_.linear_backward(LinearRole::Column, a.dtmp, G(kFc1W), fc1_db ? nullptr : G(kFc1B), a.dh,
                      b.y2, W(kFc1W), N, C, M);
  // dres += LN2 backward: now dres = d r_mid
  tp_.layernorm_backward(a.dres, G(kNorm2W), G(kNorm2B), a.dtmp, b.r_mid, W(kNorm2W), b.m2,
                         b.s2, N, C, proj_db_ln, in_ln ? a.ddrop : nullptr,
                         in_ln ? factors(j, 0) : RowFactors{});
  if (final) report(block_group_[l] + 1);  // the MLP half
  const void* dp = a.dres;
  if (in_ln) {
    dp = a.ddrop;
  } else if (drop_res) {
    be_.dropout_backward(a.ddrop, a.dres, NC, cfg_.dropout,
                         dkey(in, step, l, kSiteProj, ActLayout::Stream, C, path));
    dp = a.ddrop;
  }
  // the attention backward of each part of the samples as proj's dx for them is complete
  const AttnParts ap(be_, T, H, hd, as);
  auto attention = [&](int lo, int n) {
    be_.attention_backward(ap.qkv(a.dqkv, lo), ap.out(a.dtmp, lo), ap.qkv(b.qkv, lo),
                           ap.out(b.att, lo), ap.saved(b.asaved, lo), n, T, H, hd, a.attn_ws);
  };
  float* proj_db = proj_db_ln ? nullptr : G(kProjB);
  if (ap.splits_at(tp_.row_part_samples(Bi)))
    tp_.row_backward_consumed(a.dtmp, G(kProjW), proj_db, dp, b.att, W(kProjW), Ni, C, C, Bi,
                              attention);
  else
    tp_.TensorParallel::row_backward_consumed(a.dtmp, G(kProjW), proj_db, dp, b.att, W(kProjW),
                                              Ni, C, C, Bi, attention);
  tp_.linear_backward(LinearRole::Column, a.dtmp, G(kQkvW), G(kQkvB), a.dqkv, b.y1, W(kQkvW), N,
                      C, 3 * C, 3);
  // dres += LN1 backward: now dres = d r_in[l]
  const bool prev_in_ln = l > chunk.first_block && path_in_layernorm(l - 1);
  tp_.layernorm_backward(a.dres, G(kNorm1W), G(kNorm1B), a.dtmp, st.r_in[j], W(kNorm1W), b.m1,
                         b.s1, N, C, prev_fc2_db, prev_in_ln ? a.ddrop : nullptr,
                         prev_in_ln ? factors(j - 1, 1) : RowFactors{});
  if (final) report(block_group_[l]);  // the attention half
}

}  // namespace vitgrid
