// The ViT (vitgrid/model/vit.h): configuration, construction, the parameters (layout,
// gradient groups, initialisation), the activation plan, dropout keys, the chunk forward and
// backward (patch embedding, head, loss) and the whole-model passes. A transformer block is
// compiled into a plan (block_plan.cpp) and replayed by vit_block.cpp; what the model's files
// share is in vit_internal.h.
#include "vitgrid/model/vit.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>

#include "vit_internal.h"
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
  c.drop_path = static_cast<float>(m.drop_path);
  c.gelu = m.gelu == "tanh" ? Gelu::Tanh : Gelu::Exact;
  c.checkpoint_activations = m.checkpoint_activations;
  c.checkpoint_blocks = m.checkpoint_blocks;
  c.keep_gelu_output = m.keep_gelu_output;
  return c;
}

double ViTConfig::train_flops_per_sample() const {
  const double T = tokens(), C = hidden, M = mlp, Np = patches(), pd = patch_dim();
  // forward multiply-adds: patch embed, per block qkv + proj + fc1 + fc2 + QK^T + PV, head
  double fwd = Np * pd * C + depth * (T * (3 * C * C + C * C + 2 * C * M) + 2 * T * T * C) +
               C * classes;
  return 3.0 * 2.0 * fwd;  // 2 flops per multiply-add; backward = 2x forward
}

using namespace vit_detail;

namespace {
// The random stream of a dropout site: its (layer, site) part, and the step's.
uint64_t site_key(int layer, int site) {
  return static_cast<uint64_t>(layer) << 8 | static_cast<uint64_t>(site);
}
uint64_t step_key(int64_t step) {
  return mix64(kStreamDropout ^ mix64(static_cast<uint64_t>(step)));
}
}  // namespace

ViT::ViT(const ViTConfig& cfg, Backend& be, TensorParallel& tp, int max_batch)
    : ViT(cfg, be, tp, max_batch, StageLayout::whole(cfg.depth)) {}

ViT::ViT(const ViTConfig& cfg, Backend& be, TensorParallel& tp, int max_batch,
         const StageLayout& layout)
    : cfg_(cfg),
      be_(be),
      tp_(tp),
      max_batch_(max_batch),
      layout_(layout),
      a_(std::make_unique<Acts>()) {
  VG_CHECK(!layout_.chunks.empty() && layout_.sets >= 1, "a stage layout without chunks or sets");
  for (size_t c = 0; c < layout_.chunks.size(); ++c) {
    const auto& ch = layout_.chunks[c];
    VG_CHECK(ch.blocks >= 1 && ch.first_block >= 0 && ch.first_block + ch.blocks <= cfg_.depth &&
                 (c == 0 || ch.first_block > layout_.chunks[c - 1].first_block),
             "chunk " << c << " (blocks " << ch.first_block << " + " << ch.blocks
                      << ") outside the model's " << cfg_.depth << " blocks or out of order");
  }
  build_params();
  compile_plans();
  compute_alias_ = be_.act_size() == 4 && be_.act_dtype() == DType::F32;
  if (compute_alias_ || !layout_.master_elsewhere) {
    master_ = static_cast<float*>(be_.alloc(n_params_ * sizeof(float)));
    be_.zero(master_, n_params_ * sizeof(float));
  }
  // (alloc_comm: the data axis may move gradients with copy engines, device.data_comm)
  grads_ = static_cast<float*>(be_.alloc_comm(n_params_ * sizeof(float)));
  compute_ = compute_alias_ ? static_cast<void*>(master_) : be_.alloc(n_params_ * be_.act_size());
  be_.zero(grads_, n_params_ * sizeof(float));
  plan_activations();
  if (cfg_.fp8) fp8_init();
}

ViT::~ViT() {
  if (fp8_dev_) be_.release(fp8_dev_);
  if (fp8_wt_pool_) be_.release(fp8_wt_pool_);
  be_.release(act_pool_);
  if (!compute_alias_) be_.release(compute_);
  be_.release(grads_);
  if (master_) be_.release(master_);
}

void ViT::build_params() {
  const int64_t C = cfg_.hidden, M = cfg_.mlp, K = cfg_.classes, T = cfg_.tokens();
  const int64_t P = cfg_.patch, Ch = cfg_.channels;
  // Every parameter is named (checkpoints list the whole model on every rank); only those
  // of this stage's layers are held. `held` is set by the loop below per layer.
  bool held = true;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, Shard sh, bool decay,
                 InitKind init) {
    all_names_.push_back({name, shape});
    if (!held) return;
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
  block_param_.assign(cfg_.depth, -1);
  // patch embedding: a conv weight [C, 3, P, P] used as a Linear [C, 3*P*P]
  held = layout_.embed;
  if (held) embed_param_ = static_cast<int>(params_.size());
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
    held = chunk_of_block(l) >= 0;
    if (held) block_param_[l] = static_cast<int>(params_.size());
    const std::string b = "blocks." + std::to_string(l);
    norm(b + ".norm1");
    linear(b + ".attn.qkv", 3 * C, C, LinearRole::Column, 3);  // q, k, v split alike
    linear(b + ".attn.proj", C, C, LinearRole::Row, 1);
    norm(b + ".norm2");
    linear(b + ".mlp.fc1", M, C, LinearRole::Column, 1);
    linear(b + ".mlp.fc2", C, M, LinearRole::Row, 1);
  }
  held = layout_.head;
  if (held) head_param_ = static_cast<int>(params_.size());
  norm("norm");
  linear("head", K, C, LinearRole::Head, 1);
  tp_.register_params(params_);
  // zero padding at the end (ZeRO: an even split over the data ranks)
  const size_t q = std::max<size_t>(layout_.pad_to, 1);
  n_params_ = (n_params_ + q - 1) / q * q;

  // Gradient groups in offset order: embedding, blocks, head; the last takes the padding.
  auto group_at = [&](int first_param, int count) {
    GradGroup g;
    g.offset = params_[first_param].offset;
    const ParamInfo& last = params_[first_param + count - 1];
    g.n = last.offset + (last.numel + 15) / 16 * 16 - g.offset;
    groups_.push_back(g);
    return static_cast<int>(groups_.size()) - 1;
  };
  // A block is two groups: attention (norm1, qkv, proj) and MLP (norm2, fc1, fc2); the
  // backward finishes the MLP's first, so its reduction can start half a block earlier.
  block_group_.assign(cfg_.depth, -1);
  if (embed_param_ >= 0) embed_group_ = group_at(embed_param_, 4);
  for (int l = 0; l < cfg_.depth; ++l)
    if (block_param_[l] >= 0) {
      block_group_[l] = group_at(block_param_[l], kNorm2W);
      group_at(block_param_[l] + kNorm2W, kParamsPerBlock - kNorm2W);
    }
  if (head_param_ >= 0) head_group_ = group_at(head_param_, 4);
  for (size_t g = 0; g < groups_.size(); ++g)
    VG_CHECK(groups_[g].offset == (g == 0 ? 0 : groups_[g - 1].offset + groups_[g - 1].n),
             "gradient groups do not tile the flat buffer");
  if (!groups_.empty()) groups_.back().n = n_params_ - groups_.back().offset;
}

// Each held block's plan, compiled from the config, the chunk it is in and what the strategy
// and the backend accept (model/block_plan.h).
void ViT::compile_plans() {
  const TpFusions tf = tp_.fusions();
  const int variants = tf.row_parts > 1 && cfg_.fused_block ? 2 : 1;
  for (int v = 0; v < variants; ++v) {
    plans_[v].assign(cfg_.depth, BlockPlan{});
    for (size_t c = 0; c < layout_.chunks.size(); ++c) {
      const auto& ch = layout_.chunks[c];
      ChunkSpec s;
      s.first_block = ch.first_block;
      s.blocks = ch.blocks;
      s.dropout = cfg_.dropout;
      for (int j = 0; j < ch.blocks; ++j) {
        s.drop_path.push_back(cfg_.drop_path_rate(ch.first_block + j));
        s.checkpointed.push_back(checkpointed_in_chunk(j));
      }
      s.keep_gelu_output = cfg_.keep_gelu_output;
      // the output of every chunk but the model's last goes on (the head reads r_mid and f)
      s.stores_output = c + 1 < layout_.chunks.size() || !layout_.head;
      s.tp = tf;
      s.attention_parts_fit = v == 0;
      s.fused = cfg_.fused_block;
      s.fp8 = cfg_.fp8;
      for (BlockPlan& p : compile_chunk_plans(s)) plans_[v][p.block] = std::move(p);
    }
  }
}

void ViT::report(int group) const {
  if (hook_ && group >= 0) hook_(groups_[group].offset, groups_[group].n);
}

void ViT::need(int group) const {
  if (need_hook_ && group >= 0) need_hook_(groups_[group].offset, groups_[group].n);
}

bool ViT::checkpointed_in_chunk(int j) const {
  return cfg_.checkpoint_activations && (cfg_.checkpoint_blocks < 0 || j < cfg_.checkpoint_blocks);
}

bool ViT::checkpointed(int l) const {
  return checkpointed_in_chunk(l - layout_.chunks[chunk_of_block(l)].first_block);
}

int ViT::chunk_of_block(int l) const {
  for (size_t c = 0; c < layout_.chunks.size(); ++c) {
    const auto& ch = layout_.chunks[c];
    if (l >= ch.first_block && l < ch.first_block + ch.blocks) return static_cast<int>(c);
  }
  return -1;
}

int64_t ViT::num_global_params() const {
  int64_t n = 0;
  for (const auto& p : all_names_) {
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
  // the Inner activations' samples (whole micro-batch under 1d sequence parallelism)
  const int Bi = tp_.act_block(ActLayout::Inner, max_batch_, cfg_.mlp).samples;
  const size_t Ni = static_cast<size_t>(Bi) * T;
  const size_t asaved = be_.attention_saved_bytes(Bi, T, H, hd);
  // (the proj Linear may ask for the attention in parts: their shape's graphs built now too)
  const int parts = tp_.fusions().row_parts;
  const size_t aws = std::max(
      be_.attention_workspace_bytes(Bi, T, H, hd),
      be_.attention_workspace_bytes(parts > 1 && Bi % parts == 0 ? Bi / parts : Bi, T, H, hd));

  // Two passes: measure, then carve. Every piece 256-byte aligned.
  char* base = nullptr;
  size_t off = 0;
  auto take = [&](size_t bytes) -> void* {
    off = (off + 255) / 256 * 256;
    void* p = base ? base + off : nullptr;
    off += bytes;
    return p;
  };
  int max_blocks = 0;
  for (const auto& ch : layout_.chunks) max_blocks = std::max(max_blocks, ch.blocks);
  // a chunk that is not the model's last sends its output on
  const bool has_out = layout_.chunks.size() > 1 || !layout_.head;
  // checkpointing: the recomputed blocks (the first of each chunk) share one block set
  const bool any_ckpt = checkpointed_in_chunk(0), all_ckpt = checkpointed_in_chunk(max_blocks - 1);
  // whether any op of the plans (only their backward lists: backward_only) passes pred
  auto any_op = [&](bool backward_only, auto pred) {
    for (const auto& plans : plans_)
      for (const BlockPlan& p : plans)
        for (const auto* list : {&p.forward, &p.forward_eval, &p.recompute, &p.backward})
          if (!backward_only || list == &p.backward)
            for (const Op& op : *list)
              if (pred(op)) return true;
    return false;
  };
  auto names = [](const Op& op, Buf b) {
    for (Buf x : {op.out, op.x, op.a, op.b, op.gelu, op.dy, op.branch})
      if (x == b) return true;
    return false;
  };
  // G (fc1's GELU output) where an op reads or writes it: not where fc2's FP8 casts apply the
  // GELU themselves (block_plan.h); kept per block (keep_gelu_output) or one scratch
  const bool g_used = any_op(false, [&](const Op& op) { return names(op, Buf::G); });
  const bool keep_g = cfg_.keep_gelu_output && g_used;  // where the block is not checkpointed
  // FP8 with the inputs' transposes kept (Op::x_t): one buffer per Linear per block; Y1 and Y2
  // then one scratch when no backward op reads them (only qkv's and fc1's weight gradients did)
  const bool keep_xt = any_op(false, [](const Op& op) { return op.x_t; });
  const bool share_y = keep_xt && !any_op(true, [&](const Op& op) {
                         return names(op, Buf::Y1) || names(op, Buf::Y2);
                       });
  bool path_f = false;
  for (const BlockPlan& p : plans_[0])
    for (const Op& op : p.forward) path_f = path_f || op.kind == OpKind::PathFactors;
  a_->path_stride = Bm;
  auto block_set = [&](Acts::BlockActs& b) {
    b.y1 = share_y ? nullptr : take(N * C * as);
    b.qkv = take(Ni * 3 * Cl * as);
    b.att = take(Ni * Cl * as);
    b.asaved = take(asaved);
    b.r_mid = take(N * C * as);
    b.y2 = share_y ? nullptr : take(N * C * as);
    if (keep_xt) {  // [in, rows] codes: qkv and fc1 read Stream rows, proj and fc2 Inner ones
      b.xt[0] = static_cast<uint8_t*>(take(N * C));
      b.xt[1] = static_cast<uint8_t*>(take(Ni * Cl));
      b.xt[2] = static_cast<uint8_t*>(take(N * C));
      b.xt[3] = static_cast<uint8_t*>(take(Ni * Ml));
    }
    b.h = take(Ni * Ml * as);
    b.g = keep_g ? take(Ni * Ml * as) : nullptr;
    b.m1 = static_cast<float*>(take(N * 4));
    b.s1 = static_cast<float*>(take(N * 4));
    b.m2 = static_cast<float*>(take(N * 4));
    b.s2 = static_cast<float*>(take(N * 4));
  };
  for (int pass = 0; pass < 2; ++pass) {
    off = 0;
    Acts& a = *a_;
    a.sets.assign(layout_.sets, {});
    for (auto& st : a.sets) {
      if (layout_.embed) st.patches = take(Np * cfg_.patch_dim() * as);
      st.r_in.assign(max_blocks, nullptr);
      for (auto& r : st.r_in) r = take(N * C * as);
      st.blocks.assign(max_blocks, {});  // the checkpointed ones stay empty
      for (int j = 0; j < max_blocks; ++j)
        if (!checkpointed_in_chunk(j)) block_set(st.blocks[j]);
      st.path_f = path_f ? static_cast<float*>(take(max_blocks * 2 * sizeof(float) * Bm))
                         : nullptr;
      if (has_out) st.out = take(N * C * as);
      if (layout_.head) {
        st.cls_rows = take(Bm * C * as);
        st.cls_norm = take(Bm * C * as);
        st.dlogits = take(Bm * K * as);
        st.mf = static_cast<float*>(take(Bm * 4));
        st.sf = static_cast<float*>(take(Bm * 4));
      }
    }
    if (any_ckpt) block_set(a.shared);  // with keep_g: its own g
    a.p_scr = take(N * C * as);
    a.g_scr = keep_g || !g_used ? nullptr : take(Ni * Ml * as);
    void* y_scr = share_y ? take(N * C * as) : nullptr;  // Y1, then Y2: never live together
    a.f_scr[0] = take(N * C * as);
    a.f_scr[1] = all_ckpt ? nullptr : take(N * C * as);  // checkpointing: f_scr[0] only
    for (auto& st : a.sets)
      for (size_t j = 0; j < st.blocks.size(); ++j) {
        st.blocks[j].p = a.p_scr;
        if (!keep_g) st.blocks[j].g = a.g_scr;
        st.blocks[j].f = a.f_scr[j & 1];
        if (share_y) st.blocks[j].y1 = st.blocks[j].y2 = y_scr;
      }
    a.shared.p = a.p_scr;
    if (!keep_g) a.shared.g = a.g_scr;
    if (share_y) a.shared.y1 = a.shared.y2 = y_scr;
    a.shared.f = a.f_scr[0];
    a.ptok = take(Np * C * as);
    a.cls_a = take(Bm * C * as);
    a.cls_b = take(Bm * C * as);
    a.logits = take(Bm * K * as);
    a.logits_all = take(static_cast<size_t>(max_batch_) * K * as);
    a.logits_f32 = static_cast<float*>(take(static_cast<size_t>(max_batch_) * K * 4));
    a.losses = static_cast<float*>(take(Bm * 4));
    a.c1 = static_cast<float*>(take(Bm * 4));
    a.c5 = static_cast<float*>(take(Bm * 4));
    a.loss_sum = static_cast<double*>(take(sizeof(double)));
    a.dres = take(N * C * as);
    a.dtmp = take(std::max(N * C, Ni * Cl) * as);  // a Column's dx, then the proj's
    a.ddrop = cfg_.dropout > 0.0f || cfg_.drop_path > 0.0f ? take(N * C * as) : nullptr;
    a.dqkv = take(Ni * 3 * Cl * as);
    a.dh = take(Ni * Ml * as);
    a.dcls_rows = take(Bm * C * as);
    a.dcls_norm = take(Bm * C * as);
    a.dptok = take(Np * C * as);
    a.attn_ws = take(aws);
    if (pass == 0) {
      act_bytes_ = off + 256;
      act_pool_ = be_.alloc(act_bytes_);
      base = static_cast<char*>(act_pool_);
      base += (256 - reinterpret_cast<uintptr_t>(base) % 256) % 256;
    }
  }
  // the tensor-parallel strategy's own buffers for a block's Linears at the largest micro-batch
  const int Cg = cfg_.hidden, Mg = cfg_.mlp;
  tp_.reserve(static_cast<int>(N), {{LinearRole::Column, Cg, 3 * Cg, 3},
                                    {LinearRole::Row, Cg, Cg, 1},
                                    {LinearRole::Column, Cg, Mg, 1},
                                    {LinearRole::Row, Mg, Cg, 1}});
}

void ViT::zero_grads() { be_.zero(grads_, n_params_ * sizeof(float)); }

void ViT::reduce_gradients() { tp_.reduce_replicated_grads(grads_, params_); }

void ViT::init_params(uint64_t seed) { set_params(initial_params(seed).data()); }

std::vector<float> ViT::initial_params(uint64_t seed) {
  seed_ = seed;
  std::vector<float> host(n_params_, 0.0f);
  // Every element is a pure function of (seed, name, global index), so parameters can be
  // filled by several threads in any order (6.4B elements of the large ViT take minutes on one).
  auto fill = [&](const ParamInfo& p) {
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
  };
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < params_.size();) fill(params_[i]);
  };
  const unsigned nt = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < nt; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  return host;
}

void ViT::set_params(const float* host) {
  const size_t bytes = n_params_ * sizeof(float);
  if (master_) {
    be_.copy_to_device(master_, host, bytes);
    sync_compute_params();
    return;
  }
  be_.copy_to_device(grads_, host, bytes);
  be_.cast_to_act(compute_, grads_, n_params_);
  be_.zero(grads_, bytes);
}

void ViT::sync_compute_params() {
  VG_CHECK(master_, "the compute copy refreshed from master weights this model does not hold");
  if (!compute_alias_) be_.cast_to_act(compute_, master_, n_params_);
}

DropoutKey ViT::dkey(const DeviceBatch& in, int64_t step, int layer, int site,
                     ActLayout layout, int64_t width, float path_p) const {
  DropoutKey k;
  k.seed = seed_;
  // The micro-batch index is deliberately not part of the key: a sample's global stream
  // position already identifies it, and its mask must not depend on how the global batch is
  // cut into micro-batches (grad_accum) or ranks.
  // This rank holds samples [off, off + samples) and columns [c0, c0 + cols) of the global
  // [B, T, width] activation: count every element by its global index.
  const ActBlock blk = tp_.act_block(layout, in.count, width);
  const uint64_t elems = static_cast<uint64_t>(cfg_.tokens()) * static_cast<uint64_t>(width);
  if (in.position) {  // the step and position as the call runs (the same key and counters)
    k.key = site_key(layer, site);
    k.position = in.position;
    k.step_tag = kStreamDropout;
    k.sample_elems = elems;
    k.counter_base = static_cast<uint64_t>(in.position_offset + blk.sample_offset) * elems;
  } else {
    k.key = step_key(step) ^ site_key(layer, site);
    k.counter_base = static_cast<uint64_t>(in.first_position + blk.sample_offset) * elems;
  }
  if (blk.cols != width) {
    k.cols = blk.cols;
    k.global_cols = width;
    k.col_offset = blk.col_offset;
  }
  if (path_p > 0.0f) {
    k.path_p = path_p;
    k.path_sample0 =
        static_cast<uint64_t>((in.position ? in.position_offset : in.first_position) +
                              blk.sample_offset);
    k.path_sample_elems = static_cast<uint64_t>(cfg_.tokens()) * static_cast<uint64_t>(blk.cols);
  }
  return k;
}

bool ViT::drop_path_kept(int64_t step, int l, int branch, int64_t sample) const {
  const float p = cfg_.drop_path_rate(l);
  const uint64_t key = step_key(step) ^ site_key(l, branch ? kSiteMlpOut : kSiteProj);
  return p <= 0.0f ||
         drop_path_keep(seed_, key, static_cast<uint64_t>(sample), dropout_threshold(p));
}

void ViT::chunk_forward(int chunk, int set, const DeviceBatch& in, int64_t step, bool train,
                        float smoothing, float grad_scale, double* loss, double* top1,
                        double* top5) {
  Acts& a = *a_;
  Acts::Set& st = a.sets[set];
  const auto& ch = layout_.chunks[chunk];
  const bool first = chunk == 0 && layout_.embed;
  const bool last = chunk + 1 == static_cast<int>(layout_.chunks.size()) && layout_.head;
  const int B = in.count, T = cfg_.tokens(), C = cfg_.hidden, K = cfg_.classes;
  const ActBlock sb = tp_.act_block(ActLayout::Stream, B, C);
  const int Bl = sb.samples;
  const size_t as = be_.act_size();
  auto P = [&](int i) -> const void* {
    return static_cast<const char*>(compute_) + params_[i].offset * as;
  };
  a.last_count = B;
  if (first) {
    // this rank's samples of the micro-batch (whole images: the patch embedding's input)
    const int e = embed_param_;
    const size_t img = static_cast<size_t>(cfg_.channels) * cfg_.image * cfg_.image;
    const void* images = static_cast<const char*>(in.images) + sb.sample_offset * img * as;
    need(embed_group_);
    be_.patchify(st.patches, images, Bl, cfg_.image, cfg_.patch);
    tp_.linear_forward(LinearRole::Embed, a.ptok, st.patches, P(e), P(e + 1),
                       Bl * cfg_.patches(), cfg_.patch_dim(), C, nullptr, cfg_.gelu);
    be_.embed_tokens(st.r_in[0], a.ptok, P(e + 2), P(e + 3), Bl, T, static_cast<int>(sb.cols));
    if (train && cfg_.dropout > 0.0f)
      be_.dropout_forward(st.r_in[0], st.r_in[0], static_cast<size_t>(Bl) * T * sb.cols,
                          cfg_.dropout,
                          dkey(in, step, 0, kSitePos, ActLayout::Stream, C));
  }
  for (int l = ch.first_block; l < ch.first_block + ch.blocks; ++l)
    block_forward(l, in, step, train, set, false);
  if (!last) return;
  // final norm on the class token only (the only row the head reads; timm normalises every
  // token, which gives the same logits and zero gradient for the others)
  Acts::BlockActs& lb =
      checkpointed(ch.first_block + ch.blocks - 1) ? a.shared : st.blocks[ch.blocks - 1];
  const int Cs = static_cast<int>(sb.cols);
  be_.gather_cls(a.cls_a, lb.r_mid, Bl, T, Cs);
  be_.gather_cls(a.cls_b, lb.f, Bl, T, Cs);
  const int fn = head_param_;
  need(head_group_);
  tp_.layernorm_forward(st.cls_rows, st.cls_norm, st.mf, st.sf, a.cls_a, a.cls_b, P(fn),
                        P(fn + 1), Bl, C, cfg_.ln_eps);
  tp_.linear_forward(LinearRole::Head, a.logits, st.cls_norm, P(fn + 2), P(fn + 3), Bl, C, K,
                     nullptr, cfg_.gelu);
  // the loss at once (Megatron's last stage does the same): dlogits wait in the set
  const int32_t* labels = in.labels + sb.sample_offset;
  if (train) {
    be_.cross_entropy(a.losses, st.dlogits, a.logits, labels,
                      in.soft ? in.soft + static_cast<size_t>(sb.sample_offset) * K : nullptr,
                      Bl, K, smoothing, grad_scale);
    if (loss) be_.sum_into(loss, a.losses, Bl);  // on the device: nothing waits
    return;
  }
  be_.cross_entropy(a.losses, nullptr, a.logits, labels, nullptr, Bl, K, 0.0f, 0.0f);
  be_.topk_correct(a.c1, a.c5, a.logits, labels, Bl, K);
  double v[3] = {be_.sum(a.losses, Bl), be_.sum(a.c1, Bl), be_.sum(a.c5, Bl)};
  tp_.sum_over_batch(v, 3);
  if (loss) *loss = v[0];
  if (top1) *top1 = v[1];
  if (top5) *top5 = v[2];
}

void ViT::chunk_backward(int chunk, int set, const DeviceBatch& in, int64_t step, bool final) {
  Acts& a = *a_;
  Acts::Set& st = a.sets[set];
  const auto& ch = layout_.chunks[chunk];
  const bool first = chunk == 0 && layout_.embed;
  const bool last = chunk + 1 == static_cast<int>(layout_.chunks.size()) && layout_.head;
  const int B = in.count, T = cfg_.tokens(), C = cfg_.hidden, K = cfg_.classes;
  const ActBlock sb = tp_.act_block(ActLayout::Stream, B, C);
  const int Bl = sb.samples;
  const size_t Cs = sb.cols;
  const size_t as = be_.act_size();
  auto P = [&](int i) -> const void* {
    return static_cast<const char*>(compute_) + params_[i].offset * as;
  };
  auto G = [&](int i) -> float* { return grads_ + params_[i].offset; };
  if (last) {
    const int fn = head_param_;
    tp_.linear_backward(LinearRole::Head, a.dcls_norm, G(fn + 2), G(fn + 3), st.dlogits,
                        st.cls_norm, P(fn + 2), Bl, C, K);
    be_.zero(a.dcls_rows, Bl * Cs * as);
    tp_.layernorm_backward(a.dcls_rows, G(fn), G(fn + 1), a.dcls_norm, st.cls_rows, P(fn),
                           st.mf, st.sf, Bl, C);
    be_.zero(a.dres, static_cast<size_t>(Bl) * T * Cs * as);
    be_.scatter_cls_backward(a.dres, a.dcls_rows, Bl, T, static_cast<int>(Cs));
    if (final) report(head_group_);
  }
  // (otherwise dres holds d(chunk output), put there by the pipeline)
  for (int l = ch.first_block + ch.blocks - 1; l >= ch.first_block; --l)
    block_backward(l, in, step, set, final);
  if (!first) {
    // d(chunk input) goes back to the previous stage from the set (r_in[0] is spent)
    be_.copy(st.r_in[0], a.dres, static_cast<size_t>(Bl) * T * Cs * as);
    return;
  }
  const int e = embed_param_;
  const void* dx0 = a.dres;
  if (cfg_.dropout > 0.0f) {
    be_.dropout_backward(a.ddrop, a.dres, static_cast<size_t>(Bl) * T * Cs, cfg_.dropout,
                         dkey(in, step, 0, kSitePos, ActLayout::Stream, C));
    dx0 = a.ddrop;
  }
  be_.embed_tokens_backward(a.dptok, G(e + 2), G(e + 3), dx0, Bl, T, static_cast<int>(Cs));
  tp_.linear_backward(LinearRole::Embed, nullptr, G(e), G(e + 1), a.dptok, st.patches, P(e),
                      Bl * cfg_.patches(), cfg_.patch_dim(), C);
  if (final) report(embed_group_);
}

void* ViT::stage_input(int set) { return a_->sets[set].r_in[0]; }
void* ViT::stage_output(int set) { return a_->sets[set].out; }
void* ViT::grad_input() { return a_->dres; }

size_t ViT::boundary_bytes(int batch) const {
  const ActBlock sb = tp_.act_block(ActLayout::Stream, batch, cfg_.hidden);
  return static_cast<size_t>(sb.samples) * cfg_.tokens() * sb.cols * be_.act_size();
}

double ViT::forward_backward(const DeviceBatch& in, float smoothing, float grad_scale,
                             int64_t step, int micro) {
  (void)micro;  // dropout masks are keyed by the samples' stream positions, not micro-batches
  VG_CHECK(layout_.chunks.size() == 1 && layout_.embed && layout_.head,
           "forward_backward needs the whole model on this rank");
  if (in.count == 0) return 0.0;
  be_.zero(a_->loss_sum, sizeof(double));
  chunk_forward(0, 0, in, step, true, smoothing, grad_scale, a_->loss_sum, nullptr, nullptr);
  chunk_backward(0, 0, in, step);
  tp_.sum_over_batch_device(a_->loss_sum, 1);
  double loss = 0.0;
  be_.copy_to_host(&loss, a_->loss_sum, sizeof loss);
  return loss;
}

void ViT::forward_eval(const DeviceBatch& in, double* loss_sum, double* top1, double* top5) {
  VG_CHECK(layout_.chunks.size() == 1 && layout_.embed && layout_.head,
           "forward_eval needs the whole model on this rank");
  *loss_sum = *top1 = *top5 = 0.0;
  if (in.count == 0) return;
  chunk_forward(0, 0, in, 0, false, 0.0f, 0.0f, loss_sum, top1, top5);
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
