// Model-level tests on the CPU backend: activation checkpointing leaves gradients unchanged,
// parameter init is a function of the seed only, 16-bit storage emulation with loss scaling,
// the LR schedule, the loss scaler and the LAMB trust ratio.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/deck/deck.h"
#include "vitgrid/grid/grid.h"
#include "vitgrid/model/vit.h"
#include "vitgrid/optim/optimizer.h"
#include "vitgrid/parallel/tensor_parallel.h"

namespace vitgrid {
namespace {

ViTConfig tiny(bool ckpt, float dropout, float drop_path = 0.0f) {
  ViTConfig c;
  c.drop_path = drop_path;
  c.image = 8;
  c.patch = 4;
  c.hidden = 24;
  c.depth = 3;
  c.heads = 2;
  c.mlp = 40;
  c.classes = 5;
  c.dropout = dropout;
  c.checkpoint_activations = ckpt;
  return c;
}

// A model with its own backend and strategy on a 1-rank grid.
struct Rig {
  std::unique_ptr<ProcessGrid> grid;
  std::unique_ptr<Backend> be;
  std::unique_ptr<Collectives> coll;
  std::unique_ptr<TensorParallel> tp;
  std::unique_ptr<ViT> model;
  void* images = nullptr;
  int32_t* labels = nullptr;
  int B;
  // sets > 1: the unsplit model with that many activation sets (micro-batches in flight)
  Rig(const ViTConfig& c, DType act, int B_, int sets = 1) : B(B_) {
    grid = std::make_unique<ProcessGrid>(MPI_COMM_SELF, GridShape{});
    be = make_backend("cpu", 0, act);
    coll = make_mpi_collectives(*grid);
    tp = make_tensor_parallel(*grid, *be, *coll);
    model = std::make_unique<ViT>(c, *be, *tp, B, StageLayout::whole(c.depth, sets));
    model->init_params(11);
    std::mt19937 gen(5);
    std::normal_distribution<float> nd;
    std::vector<float> img(size_t(B) * 3 * c.image * c.image);
    for (auto& v : img) v = nd(gen);
    std::vector<int32_t> lab(B);
    for (int i = 0; i < B; ++i) lab[i] = i % c.classes;
    std::vector<float> act_img(img.size());
    images = be->alloc(img.size() * be->act_size());
    float* tmp = static_cast<float*>(be->alloc(img.size() * 4));
    be->copy_to_device(tmp, img.data(), img.size() * 4);
    be->cast_to_act(images, tmp, img.size());
    be->release(tmp);
    labels = static_cast<int32_t*>(be->alloc(B * 4));
    be->copy_to_device(labels, lab.data(), B * 4);
  }
  ~Rig() {
    be->release(images);
    be->release(labels);
  }
  double step(float grad_scale, int64_t step = 3) {
    model->zero_grads();
    DeviceBatch b{images, labels, nullptr, B, 40};
    return model->forward_backward(b, 0.1f, grad_scale, step, 0);
  }
  // The same step with the step and stream position read from backend memory, as the
  // trainer's graphs do: {step, position} there, this batch `offset` samples after position.
  double step_at(float grad_scale, const int64_t* position, int64_t offset) {
    model->zero_grads();
    DeviceBatch b{images, labels, nullptr, B, -1, position, offset};
    return model->forward_backward(b, 0.1f, grad_scale, -1, 0);
  }
  std::vector<float> grads() {
    std::vector<float> g(model->num_local_params());
    be->copy_to_host(g.data(), model->grads(), g.size() * 4);
    return g;
  }
};

TEST(Model, ActivationCheckpointingLeavesGradientsUnchanged) {
  // with dropout, and with drop path alone (applied in the LayerNorms: the recompute reuses
  // the forward's factors); every block recomputed, and only the first 1 or 2 of the 3
  // (model.checkpoint_blocks: the recomputed block after a kept one reads the r_in its fused
  // add stored), with and without kept GELU outputs
  for (float dropout : {0.2f, 0.0f})
    for (bool keep_g : {false, true}) {
      SCOPED_TRACE("dropout " + std::to_string(dropout) + (keep_g ? ", kept GELU output" : ""));
      ViTConfig ca = tiny(false, dropout, 0.3f);
      ca.keep_gelu_output = keep_g;
      Rig a(ca, DType::F32, 6);
      const double la = a.step(1.0f / 6);
      const auto ga = a.grads();
      double norm = 0;
      for (float v : ga) norm += double(v) * v;
      EXPECT_GT(norm, 0.0);
      size_t prev_bytes = a.model->activation_bytes();
      for (int n : {1, 2, 3, -1}) {
        SCOPED_TRACE("checkpoint_blocks " + std::to_string(n));
        ViTConfig cb = tiny(true, dropout, 0.3f);
        cb.keep_gelu_output = keep_g;
        cb.checkpoint_blocks = n;
        Rig b(cb, DType::F32, 6);
        EXPECT_EQ(la, b.step(1.0f / 6));
        const auto gb = b.grads();
        ASSERT_EQ(ga.size(), gb.size());
        for (size_t i = 0; i < ga.size(); ++i)
          ASSERT_EQ(ga[i], gb[i]) << "gradient element " << i;  // recomputation is bit-identical
        // each block more recomputed keeps less, except the first (its activations move to
        // the shared set the recompute needs); 3 of 3 is every block
        const size_t bytes = b.model->activation_bytes();
        if (n == -1 || n == 1)
          EXPECT_EQ(bytes, prev_bytes);
        else
          EXPECT_LT(bytes, prev_bytes);
        prev_bytes = bytes;
      }
    }
}

TEST(Model, CheckpointedBackwardRecomputesWhatAnotherForwardOverwrote) {
  // The backward of the chunk's last block skips its recompute while the block's own forward
  // is still in the shared set. Two micro-batches in two sets, in 1F1B's orders on one stage:
  // F0 B0 F1 B1 (both skip) and F0 F1 B0 B1 (set 1's forward holds the shared set when set
  // 0's backward starts, which must recompute; so must set 1's, after it). Both orders, with
  // and without checkpointing, must give the same gradients bit for bit; an eval forward
  // between the orders must change nothing either.
  const int B = 8, mb = 4;
  std::vector<std::vector<float>> got;
  // (and with only the first block recomputed: its backward comes last, after the others')
  for (int ckpt : {0, 1, 2}) {
    ViTConfig c = tiny(ckpt > 0, 0.2f, 0.3f);
    if (ckpt == 2) c.checkpoint_blocks = 1;
    Rig r(c, DType::F32, B, 2);
    const size_t img = 3 * 8 * 8 * r.be->act_size();
    const DeviceBatch m0{r.images, r.labels, nullptr, mb, 40};
    const DeviceBatch m1{static_cast<const char*>(r.images) + mb * img, r.labels + mb, nullptr,
                         mb, 44};
    for (bool interleaved : {false, true}) {
      r.model->zero_grads();
      auto F = [&](int set, const DeviceBatch& b) {
        r.model->chunk_forward(0, set, b, 5, true, 0.1f, 1.0f / B, nullptr, nullptr, nullptr);
      };
      if (interleaved) {
        F(0, m0);
        F(1, m1);
        r.model->chunk_backward(0, 0, m0, 5);
        r.model->chunk_backward(0, 1, m1, 5);
      } else {
        F(0, m0);
        r.model->chunk_backward(0, 0, m0, 5);
        F(1, m1);
        r.model->chunk_backward(0, 1, m1, 5);
      }
      got.push_back(r.grads());
      double l, t1, t5;
      r.model->forward_eval(m1, &l, &t1, &t5);
    }
  }
  ASSERT_EQ(got.size(), 6u);
  double norm = 0;
  for (float v : got[0]) norm += double(v) * v;
  EXPECT_GT(norm, 0.0);
  for (size_t k = 1; k < got.size(); ++k) EXPECT_EQ(got[k], got[0]) << "run " << k;
}

TEST(Model, KeptGeluOutputLeavesGradientsUnchanged) {
  // with dropout after the GELU: the kept g must be the dropped one the recompute gives
  ViTConfig kc = tiny(false, 0.2f);
  kc.keep_gelu_output = true;
  Rig a(tiny(false, 0.2f), DType::F32, 6), b(kc, DType::F32, 6);
  // two steps: a kept g from the first must not leak into the second
  for (int64_t s : {3, 4}) {
    const double la = a.step(1.0f / 6, s), lb = b.step(1.0f / 6, s);
    EXPECT_EQ(la, lb);
    auto ga = a.grads(), gb = b.grads();
    ASSERT_EQ(ga.size(), gb.size());
    for (size_t i = 0; i < ga.size(); ++i) ASSERT_EQ(ga[i], gb[i]) << "step " << s << " element " << i;
  }
  // one [N, mlp] buffer per block instead of one shared: (depth - 1) x N x mlp more, each
  // buffer rounded up to the pool's 256-byte alignment
  const size_t g = 6 * kc.tokens() * kc.mlp * sizeof(float);
  EXPECT_EQ(b.model->activation_bytes() - a.model->activation_bytes(),
            (kc.depth - 1) * ((g + 255) / 256 * 256));
}

// Every block plan against the unfused plan of the same block (model/block_plan.h: no
// residual add, GELU, bias sum or drop path folded into another op), on one rank; the
// tensor-parallel modes in test/parallel. Loss, every gradient and the eval logits, over
// dropout, drop path (in the LayerNorms without dropout), checkpointing and kept GELU outputs.
TEST(Model, FusedPlansEqualUnfused) {
  struct V {
    float dropout, path;
    int ckpt;  // 0: none, else checkpoint_blocks
    bool keep_g;
  };
  for (const V& v : {V{0.0f, 0.0f, 0, false}, V{0.0f, 0.3f, 0, false}, V{0.2f, 0.3f, 0, false},
                     V{0.0f, 0.3f, 1, true}, V{0.0f, 0.3f, -1, false}, V{0.2f, 0.0f, 2, true}}) {
    SCOPED_TRACE("dropout " + std::to_string(v.dropout) + " drop path " +
                 std::to_string(v.path) + " checkpoint " + std::to_string(v.ckpt) +
                 (v.keep_g ? " kept GELU" : ""));
    ViTConfig c = tiny(v.ckpt != 0, v.dropout, v.path);
    c.checkpoint_blocks = v.ckpt == 0 ? -1 : v.ckpt;
    c.keep_gelu_output = v.keep_g;
    ViTConfig u = c;
    u.fused_block = false;
    Rig a(c, DType::F32, 6), b(u, DType::F32, 6);
    // (the plans differ: else this compares a plan with itself)
    auto plan = [](const Rig& r) {
      const BlockPlan& p = r.model->block_plan(1, 6);
      return describe(p.forward) + describe(p.backward);
    };
    EXPECT_NE(plan(a), plan(b));
    for (int64_t s : {3, 4}) {
      const double la = a.step(1.0f / 6, s), lb = b.step(1.0f / 6, s);
      EXPECT_NEAR(la, lb, 1e-6 * std::abs(la)) << "step " << s;
      const auto ga = a.grads(), gb = b.grads();
      ASSERT_EQ(ga.size(), gb.size());
      double gmax = 0, diff = 0;
      for (size_t i = 0; i < ga.size(); ++i) {
        gmax = std::max(gmax, double(std::abs(ga[i])));
        diff = std::max(diff, double(std::abs(ga[i] - gb[i])));
      }
      EXPECT_GT(gmax, 0.0);
      EXPECT_LE(diff, 1e-5 * gmax) << "step " << s;
    }
    double l1, t1, f1, l2, t2, f2;
    const DeviceBatch e{a.images, a.labels, nullptr, 6, 0}, eb{b.images, b.labels, nullptr, 6, 0};
    a.model->forward_eval(e, &l1, &t1, &f1);
    b.model->forward_eval(eb, &l2, &t2, &f2);
    EXPECT_NEAR(l1, l2, 1e-6 * std::abs(l1));
    std::vector<float> za, zb;
    a.model->logits_to_host(za, 6);
    b.model->logits_to_host(zb, 6);
    ASSERT_EQ(za.size(), zb.size());
    for (size_t i = 0; i < za.size(); ++i) EXPECT_NEAR(za[i], zb[i], 1e-5) << "logit " << i;
  }
}

// FP8 without dropout on the activation: fc2's casts apply fc1's GELU to its pre-activation
// and fc1's gradient cast GELU's backward (block_plan.h), so no GELU pass runs and no GELU
// output or gradient is held, kept or not; the forward's casts keep the inputs' transposes for
// the weight gradients, LN1 / LN2 write qkv's / fc1's inputs in FP8 themselves (no Y1, Y2
// in training), the attention backward qkv's output gradient, and the LayerNorm backwards
// proj's and fc2's. The step is the unfused plan's bit for bit (a GELU pass, then fc2 casting its
// output; LayerNorms storing y, then the Linears casting it: the same codes; without dropout
// and drop path the other fusions round alike).
TEST(Model, Fp8GeluInTheCasts) {
  ViTConfig c = tiny(false, 0.0f);
  c.hidden = 32;
  c.mlp = 64;
  c.fp8 = true;
  const int B = 16;  // 80 rows: the FP8 weight gradients' multiple of 16
  ViTConfig kept = c, unfused = c, bf = c;
  kept.keep_gelu_output = true;
  unfused.fused_block = false;
  bf.fp8 = false;
  Rig a(c, DType::BF16, B), k(kept, DType::BF16, B), u(unfused, DType::BF16, B);
  Rig b(bf, DType::BF16, B);
  const std::string fwd = describe(a.model->block_plan(1, B).forward);
  const std::string bwd = describe(a.model->block_plan(1, B).backward);
  EXPECT_NE(fwd.find("Linear row fp8 x_gelu x_t out=F x=H"), std::string::npos) << fwd;
  EXPECT_NE(fwd.find("cast=qkv.w\nLinear column fp8 x_t x_cast out=Qkv w=qkv.w"),
            std::string::npos)
      << fwd;
  EXPECT_NE(fwd.find("cast=fc1.w\nLinear column fp8 x_t x_cast out=H w=fc1.w"), std::string::npos)
      << fwd;
  EXPECT_EQ(fwd.find("Y1"), std::string::npos) << fwd;
  EXPECT_EQ(fwd.find("Y2"), std::string::npos) << fwd;
  // evaluation: the LayerNorms store y and the Linears cast it (no transposes to keep)
  const std::string ev = describe(a.model->block_plan(1, B).forward_eval);
  EXPECT_EQ(ev.find("cast="), std::string::npos) << ev;
  EXPECT_NE(ev.find("Linear column fp8 out=Qkv x=Y1"), std::string::npos) << ev;
  EXPECT_EQ(fwd.find("gelu=G"), std::string::npos) << fwd;
  EXPECT_EQ(fwd.find("Gelu "), std::string::npos) << fwd;
  // fc2 and proj: their output gradients cast by the LayerNorm backwards that leave them (the
  // next block's LN1, LN2), which sum their bias gradients; the chunk's first block's LN1 casts
  // for no Linear
  EXPECT_NE(bwd.find("LinearBackward row fp8 x_gelu x_t dy_cast out=Dh x=H w=fc2.w dw=fc2.w\n"),
            std::string::npos)
      << bwd;
  EXPECT_NE(bwd.find("dsum=proj.b cast=proj.w\nReport mlp\n"
                     "LinearBackward row fp8 x_t dy_cast out=Dtmp x=Att w=proj.w dw=proj.w\n"),
            std::string::npos)
      << bwd;
  EXPECT_NE(bwd.find("LayerNormBackward norm1 out=Dres x=RIn dy=Dtmp w=norm1.w dw=norm1.w "
                     "db=norm1.b dsum=prev.fc2.b cast=prev.fc2.w\n"),
            std::string::npos)
      << bwd;
  const std::string bwd0 = describe(a.model->block_plan(0, B).backward);
  EXPECT_EQ(bwd0.find("cast=prev"), std::string::npos) << bwd0;
  // fc1: GELU's backward in its dy cast, x's transpose from the forward (Y2 not read)
  EXPECT_NE(bwd.find("LinearBackward column fp8 dy_gelu x_t out=Dtmp dy=Dh gelu=H w=fc1.w"),
            std::string::npos)
      << bwd;
  EXPECT_EQ(bwd.find("Y1"), std::string::npos) << bwd;
  EXPECT_EQ(bwd.find("Y2"), std::string::npos) << bwd;
  EXPECT_EQ(bwd.find("Gelu "), std::string::npos) << bwd;
  // qkv: its output gradient cast by the attention backward, which sums its bias gradient
  EXPECT_NE(bwd.find("AttentionBackward db=qkv.b cast=qkv.w\n"
                     "LinearBackward column fp8 x_t dy_cast out=Dtmp w=qkv.w dw=qkv.w\n"),
            std::string::npos)
      << bwd;
  EXPECT_EQ(bwd.find("Dqkv"), std::string::npos) << bwd;
  // no G: kept or not the same bytes, and one [N, mlp] buffer fewer than bf16's shared one
  EXPECT_EQ(k.model->activation_bytes(), a.model->activation_bytes());
  const size_t g = size_t(B) * c.tokens() * c.mlp * sizeof(float);
  EXPECT_GE(b.model->activation_bytes() - a.model->activation_bytes(), g);
  for (int64_t s : {3, 4}) {
    const double la = a.step(1.0f / B, s), lk = k.step(1.0f / B, s), lu = u.step(1.0f / B, s);
    EXPECT_EQ(la, lk) << "step " << s;
    EXPECT_EQ(la, lu) << "step " << s;
    const auto ga = a.grads(), gu = u.grads(), gk = k.grads();
    ASSERT_EQ(ga.size(), gu.size());
    double gmax = 0;
    for (size_t i = 0; i < ga.size(); ++i) {
      ASSERT_EQ(ga[i], gu[i]) << "step " << s << " element " << i;
      ASSERT_EQ(ga[i], gk[i]) << "step " << s << " element " << i;
      gmax = std::max(gmax, double(std::abs(ga[i])));
    }
    EXPECT_GT(gmax, 0.0);
  }
}

TEST(Model, DropoutDependsOnStepAndChangesLoss) {
  Rig a(tiny(false, 0.3f), DType::F32, 4);
  const double l1 = a.step(0.25f, 1), l1b = a.step(0.25f, 1), l2 = a.step(0.25f, 2);
  EXPECT_EQ(l1, l1b);  // a pure function of (seed, step, sample)
  EXPECT_NE(l1, l2);
}

TEST(Model, DropPathRisesWithDepthAndChangesTheStep) {
  const ViTConfig c = tiny(false, 0.0f, 0.5f);
  EXPECT_EQ(c.drop_path_rate(0), 0.0f);  // timm: linspace(0, drop_path_rate, depth)
  EXPECT_EQ(c.drop_path_rate(1), 0.25f);
  EXPECT_EQ(c.drop_path_rate(2), 0.5f);
  Rig a(tiny(false, 0.0f), DType::F32, 16), b(c, DType::F32, 16);
  const double la = a.step(1.0f / 16, 1), lb = b.step(1.0f / 16, 1), lb2 = b.step(1.0f / 16, 2);
  EXPECT_NE(la, lb);   // 16 samples at rates 0.25 and 0.5: some branch dropped
  EXPECT_NE(lb, lb2);  // another step, other samples dropped
  EXPECT_EQ(lb, b.step(1.0f / 16, 1));  // a pure function of (seed, step, sample)
}

TEST(Model, DropoutReadsStepAndPositionWhenTheyRun) {
  // checkpointing too: the recompute in the backward must draw the forward's masks; drop path
  // reads the position for its samples' indices
  for (bool ckpt : {false, true}) {
    Rig a(tiny(ckpt, 0.3f, 0.4f), DType::F32, 4);
    int64_t* pos = static_cast<int64_t*>(a.be->alloc(2 * sizeof(int64_t)));
    for (int64_t s : {3, 4}) {
      const double host = a.step(0.25f, s);  // first position 40
      const auto g_host = a.grads();
      const int64_t at[2] = {s, 30};
      a.be->copy_to_device(pos, at, sizeof(at));
      const double dev = a.step_at(0.25f, pos, 10);
      EXPECT_EQ(dev, host) << "step " << s << (ckpt ? ", checkpointing" : "");
      EXPECT_EQ(a.grads(), g_host) << "step " << s << (ckpt ? ", checkpointing" : "");
    }
    a.be->release(pos);
  }
}

TEST(Model, TimmNamesAndShapes) {
  Rig a(tiny(false, 0.f), DType::F32, 2);
  const auto& p = a.model->params();
  ASSERT_EQ(p.size(), 4u + 3 * 12 + 4);
  EXPECT_EQ(p[0].name, "patch_embed.proj.weight");
  EXPECT_EQ(p[0].global_shape, (std::vector<int64_t>{24, 3, 4, 4}));
  EXPECT_EQ(p[3].name, "pos_embed");
  EXPECT_EQ(p[3].global_shape, (std::vector<int64_t>{1, 5, 24}));
  EXPECT_EQ(p[6].name, "blocks.0.attn.qkv.weight");
  EXPECT_EQ(p[6].global_shape, (std::vector<int64_t>{72, 24}));
  EXPECT_EQ(p.back().name, "head.bias");
  EXPECT_FALSE(p[1].decay);
  EXPECT_FALSE(p[2].decay);
  EXPECT_TRUE(p[6].decay);
  EXPECT_FALSE(p[7].decay);
}

TEST(Model, Fp16EmulationOverflowsAndMatchesFp32WhenScaled) {
  Rig f32(tiny(false, 0.f), DType::F32, 4), f16(tiny(false, 0.f), DType::F16, 4);
  // Scaled by 2^16 (the initial loss scale) the fp16 gradients are finite and close to fp32's.
  const float scale = 65536.0f;
  f32.step(scale / 4);
  f16.step(scale / 4);
  EXPECT_TRUE(f16.be->all_finite(f16.model->grads(), f16.model->num_local_params()));
  auto a = f32.grads(), b = f16.grads();
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += double(a[i] - b[i]) * (a[i] - b[i]);
    den += double(a[i]) * a[i];
  }
  EXPECT_LT(std::sqrt(num / den), 2e-2);  // fp16 storage: ~1e-3 per op, a few ops deep
  // A scale far beyond fp16's range overflows the activation gradients: the step must be
  // detected as non-finite (the trainer then skips it and halves the scale).
  f16.step(1e9f);
  EXPECT_FALSE(f16.be->all_finite(f16.model->grads(), f16.model->num_local_params()));
  f32.step(1e9f);
  EXPECT_TRUE(f32.be->all_finite(f32.model->grads(), f32.model->num_local_params()));
}

TEST(Model, Bf16EmulationCloseToFp32) {
  Rig f32(tiny(false, 0.f), DType::F32, 4), bf(tiny(false, 0.f), DType::BF16, 4);
  const double la = f32.step(0.25f), lb = bf.step(0.25f);
  EXPECT_NEAR(la, lb, 0.05 * std::fabs(la));
  EXPECT_NE(la, lb);  // the emulation really rounds
}

TEST(Optim, LossScalerGrowsAndBacksOff) {
  PrecisionSection p;
  p.initial_scale = 1024;
  p.growth_interval = 3;
  LossScaler s(p, true);
  EXPECT_TRUE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 1024.0f);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 2048.0f);
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 1024.0f);
  EXPECT_EQ(s.good_steps(), 0);
  LossScaler off(p, false);
  EXPECT_EQ(off.scale(), 1.0f);
  EXPECT_TRUE(off.update(true));
}

TEST(Optim, LrScheduleWarmupCosineLinear) {
  OptimSection o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  LrSchedule cos(o, 110, 10);
  EXPECT_DOUBLE_EQ(cos.at(1), 0.1);
  EXPECT_DOUBLE_EQ(cos.at(10), 1.0);
  EXPECT_NEAR(cos.at(60), 0.55, 1e-12);  // half way: min + (max-min)/2
  EXPECT_NEAR(cos.at(110), 0.1, 1e-12);
  o.schedule = "linear";
  LrSchedule lin(o, 110, 10);
  EXPECT_NEAR(lin.at(60), 0.55, 1e-12);
  EXPECT_NEAR(lin.at(35), 1.0 - 0.9 * 0.25, 1e-12);
  o.schedule = "constant";
  EXPECT_DOUBLE_EQ(LrSchedule(o, 100, 0).at(50), 1.0);
}

TEST(Optim, LambUsesWholeParameterTrustRatio) {
  Rig r(tiny(false, 0.f), DType::F32, 4);
  r.step(0.25f);
  OptimSection o;
  o.name = "lamb";
  o.weight_decay = 0.1;
  Optimizer opt(o, *r.be, *r.tp, *r.model);
  const size_t n = r.model->num_local_params();
  std::vector<float> p0(n), g(n), p1(n);
  r.be->copy_to_host(p0.data(), r.model->master(), n * 4);
  r.be->copy_to_host(g.data(), r.model->grads(), n * 4);
  opt.step(r.model->master(), r.model->grads(), 0.01, 1, 1.0f);
  r.be->copy_to_host(p1.data(), r.model->master(), n * 4);
  // host reference, double precision: step 1 of Adam gives mhat = g, vhat = g^2
  for (const auto& p : r.model->params()) {
    const double wd = p.decay ? 0.1 : 0.0;
    double wn = 0, un = 0;
    std::vector<double> u(p.numel);
    for (size_t i = 0; i < p.numel; ++i) {
      const double gi = g[p.offset + i], w = p0[p.offset + i];
      u[i] = gi / (std::fabs(gi) + 1e-8) + wd * w;
      wn += w * w;
      un += u[i] * u[i];
    }
    wn = std::min(std::sqrt(wn), 10.0);
    un = std::sqrt(un);
    const double ratio = (wn > 0 && un > 0) ? wn / un : 1.0;
    for (size_t i = 0; i < p.numel; ++i) {
      const double want = p0[p.offset + i] - 0.01 * ratio * u[i];
      ASSERT_NEAR(p1[p.offset + i], want, 1e-6 + 1e-5 * std::fabs(want)) << p.name << "[" << i << "]";
    }
  }
}

}  // namespace
}  // namespace vitgrid
