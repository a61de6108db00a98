#include "vitgrid/model/vit.h"

#include <cmath>
#include <cstring>

#include "vitgrid/core/error.h"
#include "vitgrid/core/rng.h"
#include "vitgrid/deck/deck.h"

namespace vitgrid {

ViTConfig ViTConfig::from(const ModelSection& m) {
  ViTConfig c;
  c.image = m.image_size;
  c.patch = m.patch_size;
  c.channels = m.channels;
  c.hidden = m.hidden;
  c.depth = m.depth;
  c.heads = m.heads;
  c.mlp = m.mlp_hidden();
  c.classes = m.num_classes;
  c.dropout = static_cast<float>(m.dropout);
  c.gelu = m.gelu == "tanh" ? Gelu::Tanh : Gelu::Exact;
  c.checkpoint_activations = m.checkpoint_activations;
  return c;
}

double ViTConfig::train_flops_per_sample() const {
  const double T = tokens(), C = hidden, M = mlp, Np = patches(), pd = patch_dim();
  // forward multiply-adds: patch embed, per block qkv + proj + fc1 + fc2 + QK^T + PV, head
  double fwd = Np * pd * C + depth * (T * (3 * C * C + C * C + 2 * C * M) + 2 * T * T * C) +
               C * classes;
  return 3.0 * 2.0 * fwd;  // 2 flops per multiply-add; backward = 2x forward
}

// Activation buffers, carved from one pool planned at construction.
struct ViT::Acts {
  struct BlockActs {
    void *y1, *qkv, *att, *p, *r_mid, *y2, *h, *g, *f;
    float *m1, *s1, *m2, *s2;
    void* asaved;
  };
  void* patches;
  void* ptok;
  std::vector<void*> r_in;           // residual stream entering each block (always kept)
  std::vector<BlockActs> blocks;     // per block, or one shared set with checkpointing
  void *cls_a, *cls_b, *cls_rows, *cls_norm, *logits;
  void* logits_all;   // [max_batch, K]: every rank's logits rows gathered (predictions)
  float* logits_f32;  // the same in fp32 for the host copy
  float *mf, *sf, *losses, *c1, *c5;
  // gradients of activations
  void *dres, *dtmp, *ddrop, *dqkv, *dh, *dcls_rows, *dcls_norm, *dlogits, *dptok;
  void* attn_ws;
  int last_count = 0;
  BlockActs& blk(int l) { return blocks.size() == 1 ? blocks[0] : blocks[l]; }
};

namespace {
constexpr int kParamsPerBlock = 12;
enum BlockParam {
  kNorm1W, kNorm1B, kQkvW, kQkvB, kProjW, kProjB, kNorm2W, kNorm2B, kFc1W, kFc1B, kFc2W, kFc2B
};
enum DropSite { kSitePos = 0, kSiteProj = 1, kSiteMlpAct = 2, kSiteMlpOut = 3 };
}  // namespace

ViT::ViT(const ViTConfig& cfg, Backend& be, TensorParallel& tp, int max_batch)
    : cfg_(cfg), be_(be), tp_(tp), max_batch_(max_batch), a_(std::make_unique<Acts>()) {
  build_params();
  master_ = static_cast<float*>(be_.alloc(n_params_ * sizeof(float)));
  grads_ = static_cast<float*>(be_.alloc(n_params_ * sizeof(float)));
  compute_alias_ = be_.act_size() == 4 && be_.act_dtype() == DType::F32;
  compute_ = compute_alias_ ? static_cast<void*>(master_) : be_.alloc(n_params_ * be_.act_size());
  be_.zero(master_, n_params_ * sizeof(float));
  be_.zero(grads_, n_params_ * sizeof(float));
  plan_activations();
}

ViT::~ViT() {
  be_.release(act_pool_);
  if (!compute_alias_) be_.release(compute_);
  be_.release(grads_);
  be_.release(master_);
}

void ViT::build_params() {
  const int64_t C = cfg_.hidden, M = cfg_.mlp, K = cfg_.classes, T = cfg_.tokens();
  const int64_t P = cfg_.patch, Ch = cfg_.channels;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, Shard sh, bool decay,
                 InitKind init) {
    ParamInfo p;
    p.name = name;
    p.global_shape = std::move(shape);
    p.shard = std::move(sh);
    p.numel = p.shard.numel();
    p.offset = n_params_;
    // keep every parameter 16-element aligned (vector loads, cache lines)
    n_params_ += (p.numel + 15) / 16 * 16;
    p.decay = decay;
    p.init = init;
    params_.push_back(std::move(p));
  };
  auto linear = [&](const std::string& base, int64_t out, int64_t in, LinearRole role,
                    int groups) {
    Shard w = tp_.shard_linear_weight(out, in, role, groups);
    add(base + ".weight", {out, in}, w, true, InitKind::TruncNormal02);
    add(base + ".bias", {out}, tp_.shard_linear_bias(out, role, groups), false,
        InitKind::Zeros);
  };
  auto norm = [&](const std::string& base) {
    add(base + ".weight", {C}, tp_.shard_hidden_vector({C}), false, InitKind::Ones);
    add(base + ".bias", {C}, tp_.shard_hidden_vector({C}), false, InitKind::Zeros);
  };
  // patch embedding: a conv weight [C, 3, P, P] used as a Linear [C, 3*P*P]
  {
    // the strategy splits only the output rows of the patch embedding (its input is whole)
    Shard w4 = tp_.shard_linear_weight(C, Ch * P * P, LinearRole::Embed);
    VG_CHECK(w4.block.empty() && w4.offset[1] == 0 && w4.count[1] == Ch * P * P,
             "the patch embedding's input features must be whole on every rank");
    w4.offset = {w4.offset[0], 0, 0, 0};
    w4.count = {w4.count[0], Ch, P, P};
    add("patch_embed.proj.weight", {C, Ch, P, P}, w4, true, InitKind::PatchUniform);
    add("patch_embed.proj.bias", {C}, tp_.shard_linear_bias(C, LinearRole::Embed), false,
        InitKind::PatchUniform);
  }
  add("cls_token", {1, 1, C}, tp_.shard_hidden_vector({1, 1, C}), false, InitKind::Normal1e6);
  add("pos_embed", {1, T, C}, tp_.shard_hidden_vector({1, T, C}), false,
      InitKind::TruncNormal02);
  for (int l = 0; l < cfg_.depth; ++l) {
    const std::string b = "blocks." + std::to_string(l);
    norm(b + ".norm1");
    linear(b + ".attn.qkv", 3 * C, C, LinearRole::Column, 3);  // q, k, v split alike
    linear(b + ".attn.proj", C, C, LinearRole::Row, 1);
    norm(b + ".norm2");
    linear(b + ".mlp.fc1", M, C, LinearRole::Column, 1);
    linear(b + ".mlp.fc2", C, M, LinearRole::Row, 1);
  }
  norm("norm");
  linear("head", K, C, LinearRole::Head, 1);
  tp_.register_params(params_);
}

int64_t ViT::num_global_params() const {
  int64_t n = 0;
  for (const auto& p : params_) {
    int64_t e = 1;
    for (int64_t d : p.global_shape) e *= d;
    n += e;
  }
  return n;
}

void ViT::plan_activations() {
  const size_t as = be_.act_size();
  const int Bm = tp_.local_batch(max_batch_);
  const size_t T = cfg_.tokens(), K = cfg_.classes;
  // local widths: C of the Stream (residual stream, norms), Ml of the MLP's inner activations
  const size_t C = tp_.act_block(ActLayout::Stream, max_batch_, cfg_.hidden).cols;
  const size_t Ml = tp_.act_block(ActLayout::Inner, max_batch_, cfg_.mlp).cols;
  const size_t N = Bm * T, Np = static_cast<size_t>(Bm) * cfg_.patches();
  const int H = tp_.local_heads(cfg_.heads), hd = cfg_.head_dim();
  const size_t Cl = static_cast<size_t>(H) * hd;  // local attention width
  const size_t asaved = be_.attention_saved_bytes(Bm, T, H, hd);
  const size_t aws = be_.attention_workspace_bytes(Bm, T, H, hd);

  // Two passes: measure, then carve. Every piece 256-byte aligned.
  char* base = nullptr;
  size_t off = 0;
  auto take = [&](size_t bytes) -> void* {
    off = (off + 255) / 256 * 256;
    void* p = base ? base + off : nullptr;
    off += bytes;
    return p;
  };
  const int nsets = cfg_.checkpoint_activations ? 1 : cfg_.depth;
  for (int pass = 0; pass < 2; ++pass) {
    off = 0;
    Acts& a = *a_;
    a.patches = take(Np * cfg_.patch_dim() * as);
    a.ptok = take(Np * C * as);
    a.r_in.assign(cfg_.depth, nullptr);
    for (int l = 0; l < cfg_.depth; ++l) a.r_in[l] = take(N * C * as);
    a.blocks.assign(nsets, {});
    for (auto& b : a.blocks) {
      b.y1 = take(N * C * as);
      b.qkv = take(N * 3 * Cl * as);
      b.att = take(N * Cl * as);
      b.asaved = take(asaved);
      b.p = take(N * C * as);
      b.r_mid = take(N * C * as);
      b.y2 = take(N * C * as);
      b.h = take(N * Ml * as);
      b.g = take(N * Ml * as);
      b.f = take(N * C * as);
      b.m1 = static_cast<float*>(take(N * 4));
      b.s1 = static_cast<float*>(take(N * 4));
      b.m2 = static_cast<float*>(take(N * 4));
      b.s2 = static_cast<float*>(take(N * 4));
    }
    a.cls_a = take(Bm * C * as);
    a.cls_b = take(Bm * C * as);
    a.cls_rows = take(Bm * C * as);
    a.cls_norm = take(Bm * C * as);
    a.logits = take(Bm * K * as);
    a.logits_all = take(static_cast<size_t>(max_batch_) * K * as);
    a.logits_f32 = static_cast<float*>(take(static_cast<size_t>(max_batch_) * K * 4));
    a.mf = static_cast<float*>(take(Bm * 4));
    a.sf = static_cast<float*>(take(Bm * 4));
    a.losses = static_cast<float*>(take(Bm * 4));
    a.c1 = static_cast<float*>(take(Bm * 4));
    a.c5 = static_cast<float*>(take(Bm * 4));
    a.dres = take(N * C * as);
    a.dtmp = take(N * C * as);
    a.ddrop = take(N * C * as);
    a.dqkv = take(N * 3 * Cl * as);
    a.dh = take(N * Ml * as);
    a.dcls_rows = take(Bm * C * as);
    a.dcls_norm = take(Bm * C * as);
    a.dlogits = take(Bm * K * as);
    a.dptok = take(Np * C * as);
    a.attn_ws = take(aws);
    if (pass == 0) {
      act_bytes_ = off + 256;
      act_pool_ = be_.alloc(act_bytes_);
      base = static_cast<char*>(act_pool_);
      base += (256 - reinterpret_cast<uintptr_t>(base) % 256) % 256;
    }
  }
}

void ViT::zero_grads() { be_.zero(grads_, n_params_ * sizeof(float)); }

void ViT::reduce_gradients() { tp_.reduce_replicated_grads(grads_, params_); }

void ViT::init_params(uint64_t seed) {
  seed_ = seed;
  std::vector<float> host(n_params_, 0.0f);
  for (const auto& p : params_) {
    const uint64_t key = key_of(p.name.c_str()) ^ kStreamInit;
    const size_t nd = p.global_shape.size();
    // fan-in of the conv patch embedding (PyTorch Conv2d default init: kaiming_uniform(a=sqrt 5)
    // gives U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias)
    const float bound = 1.0f / std::sqrt(static_cast<float>(cfg_.patch_dim()));
    std::vector<int64_t> idx(nd, 0);
    for (size_t e = 0; e < p.numel; ++e) {
      // global flat index of local element e (row-major over the shard's selection, which
      // may be strided: qkv holds row blocks of q, k and v)
      int64_t g = 0;
      for (size_t d = 0; d < nd; ++d)
        g = g * p.global_shape[d] + p.shard.global_coord(d, idx[d]);
      const uint64_t ctr = static_cast<uint64_t>(g);
      float v = 0.0f;
      switch (p.init) {
        case InitKind::Zeros: v = 0.0f; break;
        case InitKind::Ones: v = 1.0f; break;
        case InitKind::TruncNormal02: v = rng_trunc_normal(seed, key, ctr, 0.02f); break;
        case InitKind::Normal1e6: v = 1e-6f * rng_normal(seed, key, ctr); break;
        case InitKind::PatchUniform: v = (2.0f * rng_uniform(seed, key, ctr) - 1.0f) * bound; break;
      }
      host[p.offset + e] = v;
      for (size_t d = nd; d-- > 0;) {
        if (++idx[d] < p.shard.local_extent(d)) break;
        idx[d] = 0;
      }
    }
  }
  be_.copy_to_device(master_, host.data(), n_params_ * sizeof(float));
  sync_compute_params();
}

void ViT::sync_compute_params() {
  if (!compute_alias_) be_.cast_to_act(compute_, master_, n_params_);
}

DropoutKey ViT::dkey(int64_t step, int layer, int site, int64_t first_pos, ActLayout layout,
                     int B, int64_t width) const {
  DropoutKey k;
  k.seed = seed_;
  // The micro-batch index is deliberately not part of the key: a sample's global stream
  // position already identifies it, and its mask must not depend on how the global batch is
  // cut into micro-batches (grad_accum) or ranks.
  k.key = mix64(kStreamDropout ^ mix64(static_cast<uint64_t>(step))) ^
          (static_cast<uint64_t>(layer) << 8 | static_cast<uint64_t>(site));
  // This rank holds samples [off, off + samples) and columns [c0, c0 + cols) of the global
  // [B, T, width] activation: count every element by its global index.
  const ActBlock blk = tp_.act_block(layout, B, width);
  const int64_t T = cfg_.tokens();
  k.counter_base = static_cast<uint64_t>(first_pos + blk.sample_offset) *
                   static_cast<uint64_t>(T * width);
  if (blk.cols != width) {
    k.cols = blk.cols;
    k.global_cols = width;
    k.col_offset = blk.col_offset;
  }
  return k;
}

void ViT::block_forward(int l, int B, int64_t step, int micro, int64_t fp, bool train) {
  (void)micro;
  Acts& a = *a_;
  Acts::BlockActs& b = a.blk(l);
  // B is the whole micro-batch; this rank computes its blocks (Bl samples, Cs / Ml columns)
  const int T = cfg_.tokens(), C = cfg_.hidden, M = cfg_.mlp;
  const int Bl = tp_.local_batch(B), N = Bl * T;
  const size_t Cs = tp_.act_block(ActLayout::Stream, B, C).cols;
  const size_t Ml = tp_.act_block(ActLayout::Inner, B, M).cols;
  const int H = tp_.local_heads(cfg_.heads), hd = cfg_.head_dim();
  const size_t as = be_.act_size();
  const int base = 4 + l * kParamsPerBlock;
  auto W = [&](int i) -> const void* {
    return static_cast<const char*>(compute_) + params_[base + i].offset * as;
  };
  const bool drop = train && cfg_.dropout > 0.0f;
  // LayerNorm 1 on the residual stream entering the block. For l > 0 the stream is the
  // previous block's r_mid + f: fused add (unless recomputing from the stored r_in).
  const bool fused_add = l > 0 && !(cfg_.checkpoint_activations);
  if (fused_add) {
    Acts::BlockActs& pb = a.blk(l - 1);
    tp_.layernorm_forward(a.r_in[l], b.y1, b.m1, b.s1, pb.r_mid, pb.f, W(kNorm1W), W(kNorm1B),
                          N, C, cfg_.ln_eps);
  } else {
    tp_.layernorm_forward(a.r_in[l], b.y1, b.m1, b.s1, a.r_in[l], nullptr, W(kNorm1W),
                          W(kNorm1B), N, C, cfg_.ln_eps);
  }
  tp_.linear_forward(LinearRole::Column, b.qkv, b.y1, W(kQkvW), W(kQkvB), N, C, 3 * C, nullptr,
                     cfg_.gelu, 3);
  be_.attention_forward(b.att, b.asaved, b.qkv, Bl, T, H, hd, a.attn_ws);
  tp_.linear_forward(LinearRole::Row, b.p, b.att, W(kProjW), W(kProjB), N, C, C, nullptr,
                     cfg_.gelu);
  if (drop)
    be_.dropout_forward(b.p, b.p, N * Cs, cfg_.dropout,
                        dkey(step, l, kSiteProj, fp, ActLayout::Stream, B, C));
  tp_.layernorm_forward(b.r_mid, b.y2, b.m2, b.s2, a.r_in[l], b.p, W(kNorm2W), W(kNorm2B), N, C,
                        cfg_.ln_eps);
  tp_.linear_forward(LinearRole::Column, b.h, b.y2, W(kFc1W), W(kFc1B), N, C, M, b.g,
                     cfg_.gelu);
  if (drop)
    be_.dropout_forward(b.g, b.g, N * Ml, cfg_.dropout,
                        dkey(step, l, kSiteMlpAct, fp, ActLayout::Inner, B, M));
  tp_.linear_forward(LinearRole::Row, b.f, b.g, W(kFc2W), W(kFc2B), N, M, C, nullptr,
                     cfg_.gelu);
  if (drop)
    be_.dropout_forward(b.f, b.f, N * Cs, cfg_.dropout,
                        dkey(step, l, kSiteMlpOut, fp, ActLayout::Stream, B, C));
  // With activation checkpointing the next block reads only r_in[l+1]: store it now.
  if (cfg_.checkpoint_activations && l + 1 < cfg_.depth) be_.add(a.r_in[l + 1], b.r_mid, b.f, N * Cs);
}

void ViT::forward(const DeviceBatch& in, int64_t step, int micro, bool train) {
  Acts& a = *a_;
  const int B = in.count, T = cfg_.tokens(), C = cfg_.hidden, K = cfg_.classes;
  const ActBlock sb = tp_.act_block(ActLayout::Stream, B, C);
  const int Bl = sb.samples;
  const size_t as = be_.act_size();
  auto P = [&](int i) -> const void* {
    return static_cast<const char*>(compute_) + params_[i].offset * as;
  };
  a.last_count = B;
  // this rank's samples of the micro-batch (whole images: the patch embedding's input)
  const size_t img = static_cast<size_t>(cfg_.channels) * cfg_.image * cfg_.image;
  const void* images = static_cast<const char*>(in.images) + sb.sample_offset * img * as;
  be_.patchify(a.patches, images, Bl, cfg_.image, cfg_.patch);
  tp_.linear_forward(LinearRole::Embed, a.ptok, a.patches, P(0), P(1), Bl * cfg_.patches(),
                     cfg_.patch_dim(), C, nullptr, cfg_.gelu);
  be_.embed_tokens(a.r_in[0], a.ptok, P(2), P(3), Bl, T, static_cast<int>(sb.cols));
  if (train && cfg_.dropout > 0.0f)
    be_.dropout_forward(a.r_in[0], a.r_in[0], static_cast<size_t>(Bl) * T * sb.cols,
                        cfg_.dropout,
                        dkey(step, 0, kSitePos, in.first_position, ActLayout::Stream, B, C));
  for (int l = 0; l < cfg_.depth; ++l) block_forward(l, B, step, micro, in.first_position, train);
  // final norm on the class token only (the only row the head reads; timm normalises every
  // token, which gives the same logits and zero gradient for the others)
  Acts::BlockActs& lb = a.blk(cfg_.depth - 1);
  const int Cs = static_cast<int>(sb.cols);
  be_.gather_cls(a.cls_a, lb.r_mid, Bl, T, Cs);
  be_.gather_cls(a.cls_b, lb.f, Bl, T, Cs);
  const int fn = 4 + cfg_.depth * kParamsPerBlock;
  tp_.layernorm_forward(a.cls_rows, a.cls_norm, a.mf, a.sf, a.cls_a, a.cls_b, P(fn), P(fn + 1),
                        Bl, C, cfg_.ln_eps);
  tp_.linear_forward(LinearRole::Head, a.logits, a.cls_norm, P(fn + 2), P(fn + 3), Bl, C, K,
                     nullptr, cfg_.gelu);
}

void ViT::block_backward(int l, int B, int64_t step, int micro, int64_t fp) {
  Acts& a = *a_;
  if (cfg_.checkpoint_activations) block_forward(l, B, step, micro, fp, true);
  Acts::BlockActs& b = a.blk(l);
  const int T = cfg_.tokens(), C = cfg_.hidden, M = cfg_.mlp;
  const int Bl = tp_.local_batch(B), N = Bl * T;
  const size_t Cs = tp_.act_block(ActLayout::Stream, B, C).cols;
  const size_t Ml = tp_.act_block(ActLayout::Inner, B, M).cols;
  const int H = tp_.local_heads(cfg_.heads), hd = cfg_.head_dim();
  const size_t as = be_.act_size();
  const int base = 4 + l * kParamsPerBlock;
  auto W = [&](int i) -> const void* {
    return static_cast<const char*>(compute_) + params_[base + i].offset * as;
  };
  auto G = [&](int i) -> float* { return grads_ + params_[base + i].offset; };
  const bool drop = cfg_.dropout > 0.0f;
  const size_t NC = N * Cs, NM = N * Ml;
  // dres holds d(block output) = d(r_mid + f)
  const void* df = a.dres;
  if (drop) {
    be_.dropout_backward(a.ddrop, a.dres, NC, cfg_.dropout,
                         dkey(step, l, kSiteMlpOut, fp, ActLayout::Stream, B, C));
    df = a.ddrop;
  }
  tp_.linear_backward(LinearRole::Row, a.dh, G(kFc2W), G(kFc2B), df, b.g, W(kFc2W), N, M, C);
  if (drop)
    be_.dropout_backward(a.dh, a.dh, NM, cfg_.dropout,
                         dkey(step, l, kSiteMlpAct, fp, ActLayout::Inner, B, M));
  be_.gelu_backward(a.dh, b.h, a.dh, NM, cfg_.gelu);
  tp_.linear_backward(LinearRole::Column, a.dtmp, G(kFc1W), G(kFc1B), a.dh, b.y2, W(kFc1W), N,
                      C, M);
  // dres += LN2 backward: now dres = d r_mid
  tp_.layernorm_backward(a.dres, G(kNorm2W), G(kNorm2B), a.dtmp, b.r_mid, W(kNorm2W), b.m2,
                         b.s2, N, C);
  const void* dp = a.dres;
  if (drop) {
    be_.dropout_backward(a.ddrop, a.dres, NC, cfg_.dropout,
                         dkey(step, l, kSiteProj, fp, ActLayout::Stream, B, C));
    dp = a.ddrop;
  }
  tp_.linear_backward(LinearRole::Row, a.dtmp, G(kProjW), G(kProjB), dp, b.att, W(kProjW), N, C,
                      C);
  be_.attention_backward(a.dqkv, a.dtmp, b.qkv, b.att, b.asaved, Bl, T, H, hd, a.attn_ws);
  tp_.linear_backward(LinearRole::Column, a.dtmp, G(kQkvW), G(kQkvB), a.dqkv, b.y1, W(kQkvW), N,
                      C, 3 * C, 3);
  // dres += LN1 backward: now dres = d r_in[l]
  tp_.layernorm_backward(a.dres, G(kNorm1W), G(kNorm1B), a.dtmp, a.r_in[l], W(kNorm1W), b.m1,
                         b.s1, N, C);
}

double ViT::forward_backward(const DeviceBatch& in, float smoothing, float grad_scale,
                             int64_t step, int micro) {
  if (in.count == 0) return 0.0;
  Acts& a = *a_;
  const int B = in.count, T = cfg_.tokens(), C = cfg_.hidden, K = cfg_.classes;
  forward(in, step, micro, true);
  const ActBlock sb = tp_.act_block(ActLayout::Stream, B, C);
  const int Bl = sb.samples;
  const size_t Cs = sb.cols;
  be_.cross_entropy(a.losses, a.dlogits, a.logits, in.labels + sb.sample_offset,
                    in.soft ? in.soft + static_cast<size_t>(sb.sample_offset) * K : nullptr, Bl,
                    K, smoothing, grad_scale);
  const int fn = 4 + cfg_.depth * kParamsPerBlock;
  const size_t as = be_.act_size();
  auto P = [&](int i) -> const void* {
    return static_cast<const char*>(compute_) + params_[i].offset * as;
  };
  auto G = [&](int i) -> float* { return grads_ + params_[i].offset; };
  tp_.linear_backward(LinearRole::Head, a.dcls_norm, G(fn + 2), G(fn + 3), a.dlogits,
                      a.cls_norm, P(fn + 2), Bl, C, K);
  be_.zero(a.dcls_rows, Bl * Cs * as);
  tp_.layernorm_backward(a.dcls_rows, G(fn), G(fn + 1), a.dcls_norm, a.cls_rows, P(fn), a.mf,
                         a.sf, Bl, C);
  be_.zero(a.dres, static_cast<size_t>(Bl) * T * Cs * as);
  be_.scatter_cls_backward(a.dres, a.dcls_rows, Bl, T, static_cast<int>(Cs));
  for (int l = cfg_.depth - 1; l >= 0; --l) block_backward(l, B, step, micro, in.first_position);
  const void* dx0 = a.dres;
  if (cfg_.dropout > 0.0f) {
    be_.dropout_backward(a.ddrop, a.dres, static_cast<size_t>(Bl) * T * Cs, cfg_.dropout,
                         dkey(step, 0, kSitePos, in.first_position, ActLayout::Stream, B, C));
    dx0 = a.ddrop;
  }
  be_.embed_tokens_backward(a.dptok, G(2), G(3), dx0, Bl, T, static_cast<int>(Cs));
  tp_.linear_backward(LinearRole::Embed, nullptr, G(0), G(1), a.dptok, a.patches, P(0),
                      Bl * cfg_.patches(), cfg_.patch_dim(), C);
  // the loss of the whole micro-batch on every tensor rank
  double loss = be_.sum(a.losses, Bl);
  tp_.sum_over_batch(&loss, 1);
  return loss;
}

void ViT::forward_eval(const DeviceBatch& in, double* loss_sum, double* top1, double* top5) {
  *loss_sum = *top1 = *top5 = 0.0;
  if (in.count == 0) return;
  Acts& a = *a_;
  const int B = in.count, K = cfg_.classes;
  forward(in, 0, 0, false);
  const ActBlock sb = tp_.act_block(ActLayout::Stream, B, cfg_.hidden);
  const int Bl = sb.samples;
  const int32_t* labels = in.labels + sb.sample_offset;
  be_.cross_entropy(a.losses, nullptr, a.logits, labels, nullptr, Bl, K, 0.0f, 0.0f);
  be_.topk_correct(a.c1, a.c5, a.logits, labels, Bl, K);
  double v[3] = {be_.sum(a.losses, Bl), be_.sum(a.c1, Bl), be_.sum(a.c5, Bl)};
  tp_.sum_over_batch(v, 3);
  *loss_sum = v[0];
  *top1 = v[1];
  *top5 = v[2];
}

void ViT::logits_to_host(std::vector<float>& out, int count) {
  const size_t n = static_cast<size_t>(count) * cfg_.classes;
  out.resize(n);
  if (n == 0) return;
  // every rank's rows of the last forward, in sample order (collective over the tensor group)
  tp_.gather_batch(a_->logits_all, a_->logits, count, cfg_.classes);
  be_.cast_to_f32(a_->logits_f32, a_->logits_all, n);
  be_.copy_to_host(out.data(), a_->logits_f32, n * sizeof(float));
}

}  // namespace vitgrid
