// workspace_plan_for (model/workspace_plan.h): the backend workspace plan the trainer makes
// before step 1 covers the shapes a step runs: the row-wise ops, weights and copies of every
// preset, and the optimizer's slice lists of a real model (with and without ZeRO-1 buckets,
// built the way optim/optimizer.cpp builds them).
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/deck/deck.h"
#include "vitgrid/grid/grid.h"
#include "vitgrid/model/vit.h"
#include "vitgrid/model/workspace_plan.h"
#include "vitgrid/optim/grad_reduce.h"
#include "vitgrid/parallel/tensor_parallel.h"

namespace vitgrid {
namespace {

ViTConfig preset_config(const ModelPreset& p) {
  ModelSection m;
  m.image_size = p.image_size;
  m.patch_size = p.patch_size;
  m.hidden = p.hidden;
  m.depth = p.depth;
  m.heads = p.heads;
  m.mlp_ratio = p.mlp_ratio;
  m.num_classes = p.num_classes;
  return ViTConfig::from(m);
}

TEST(WorkspacePlan, CoversThePresetsShapes) {
  int checked = 0;
  for (const auto& kv : model_presets()) {
    if (kv.first == "custom") continue;
    const ViTConfig c = preset_config(kv.second);
    for (int micro : {1, 8, 64}) {
      for (size_t as : {size_t(2), size_t(4)}) {
        SCOPED_TRACE(kv.first + ", micro-batch " + std::to_string(micro) + ", act size " +
                     std::to_string(as));
        WorkspaceShape ws;
        ws.micro_batch = micro;
        ws.act_size = as;
        const Backend::WorkspacePlan p = workspace_plan_for(c, ws);
        const int64_t T = c.tokens(), C = c.hidden, M = c.mlp, K = c.classes, B = micro;
        // row-wise ops: blocks (B*T rows), patch embedding (B*patches), head and final norm (B)
        for (int64_t rows : {B * T, B * int64_t(c.patches()), B}) EXPECT_GE(p.max_rows, rows);
        // bias gradients of qkv, proj / fc2 / embedding, fc1, head; LayerNorm over hidden
        for (int64_t cols : {3 * C, C, M, K}) EXPECT_GE(p.max_cols, cols);
        // Linear weights [out, in]: qkv, proj, fc1, fc2, head, patch embedding
        for (int64_t w : {3 * C * C, C * C, M * C, C * M, K * C, C * int64_t(c.patch_dim())})
          EXPECT_GE(p.max_weight_elems, w);
        // a micro-batch's residual stream (pipeline boundaries, stage copies)
        EXPECT_GE(p.max_copy_bytes, size_t(B * T * C) * as);
        // no optimizer: no slice lists
        EXPECT_EQ(p.slice_lists, 0);
        EXPECT_EQ(p.slices, 0);
        EXPECT_EQ(p.slice_elems, 0);
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 6 * 3 * 2);
}

// What the optimizer hands the multi-tensor ops, built as optim/optimizer.cpp does.
struct ListTotals {
  int64_t lists = 0, slices = 0, elems = 0;
  void add(const std::vector<ParamSlice>& l) {
    if (l.empty()) return;
    ++lists;
    slices += static_cast<int64_t>(l.size());
    for (const ParamSlice& s : l) elems += static_cast<int64_t>(s.n);
  }
};

ListTotals optimizer_lists(const ViT& model, const ZeroShards* zero) {
  std::vector<ParamSlice> slices, plain, zslices;
  for (const ParamInfo& p : model.params()) {
    slices.push_back({p.offset, p.numel, p.decay ? 0.05f : 0.0f});
    plain.push_back({p.offset, p.numel, 0.0f});
  }
  ListTotals t;
  if (!zero) {
    t.add(slices);
    t.add(plain);
    return t;
  }
  for (size_t k = 0; k < zero->buckets.size(); ++k) {
    const size_t flat = zero->piece_offset(k), n = zero->piece_n(k);
    std::vector<ParamSlice> piece;
    for (const ParamSlice& s : slices) {
      const size_t lo = std::max(s.offset, flat), hi = std::min(s.offset + s.n, flat + n);
      if (lo >= hi) continue;
      piece.push_back({lo - flat, hi - lo, s.weight_decay});
      zslices.push_back({lo, hi - lo, 0.0f});
    }
    t.add(piece);
  }
  t.add(zslices);
  return t;
}

TEST(WorkspacePlan, Fp8LayerNormsWhereThePlansHaveThem) {
  // the LayerNorms' width where the model's plans let them write FP8 (fp8, fused, a mode that
  // allows it), else none (the CUDA backend sizes its fallback's scratch by it)
  ViTConfig c;
  c.image = 16, c.patch = 4, c.hidden = 48, c.depth = 2, c.heads = 2, c.mlp = 96, c.classes = 7;
  ProcessGrid grid(MPI_COMM_SELF, GridShape{});
  std::unique_ptr<Backend> be = make_backend("cpu", 0, DType::BF16);
  std::unique_ptr<Collectives> coll = make_mpi_collectives(grid);
  std::unique_ptr<TensorParallel> tp = make_tensor_parallel(grid, *be, *coll);
  for (int variant = 0; variant < 3; ++variant) {
    ViTConfig v = c;
    v.fp8 = variant != 0;
    v.fused_block = variant != 2;
    ViT model(v, *be, *tp, 16, StageLayout::whole(v.depth));  // 16 x 17 rows: FP8's multiple
    const bool want = variant == 1;
    EXPECT_EQ(model.layernorms_write_fp8(), want) << variant;
    WorkspaceShape ws;
    ws.micro_batch = 16;
    ws.act_size = 2;
    ws.fp8_layernorms = model.layernorms_write_fp8();
    EXPECT_EQ(workspace_plan_for(v, ws).fp8_layernorm_cols, want ? 48 : 0) << variant;
  }
}

TEST(WorkspacePlan, CoversTheOptimizerSliceLists) {
  ViTConfig c;  // small: a real model on the CPU backend gives the real parameter list
  c.image = 16, c.patch = 4, c.hidden = 48, c.depth = 3, c.heads = 2, c.mlp = 96, c.classes = 7;
  ProcessGrid grid(MPI_COMM_SELF, GridShape{});
  std::unique_ptr<Backend> be = make_backend("cpu", 0, DType::F32);
  std::unique_ptr<Collectives> coll = make_mpi_collectives(grid);
  std::unique_ptr<TensorParallel> tp = make_tensor_parallel(grid, *be, *coll);
  for (int D : {1, 2, 4, 8}) {
    StageLayout layout = StageLayout::whole(c.depth);
    if (D > 1) layout.pad_to = size_t(D) * 16;
    ViT model(c, *be, *tp, 4, layout);
    std::vector<GradRange> groups;
    for (const auto& g : model.grad_groups()) groups.push_back({g.offset, g.n});
    for (size_t bucket_elems : {size_t(0), size_t(1000), size_t(5000), size_t(40000)}) {
      SCOPED_TRACE("data ranks " + std::to_string(D) + ", bucket elements " +
                   std::to_string(bucket_elems));
      const std::vector<GradBucket> buckets = plan_grad_buckets(
          groups, model.num_local_params(), bucket_elems, D > 1 ? size_t(D) * 16 : 1);
      WorkspaceShape ws;
      ws.micro_batch = 4;
      ws.optimizer = true;
      ws.param_tensors = model.params().size();
      ws.local_params = model.num_local_params();
      ws.grad_buckets = buckets.size();
      const Backend::WorkspacePlan p = workspace_plan_for(c, ws);
      std::vector<ListTotals> cases = {optimizer_lists(model, nullptr)};
      if (D > 1) {
        for (int r = 0; r < D; ++r) {
          ZeroShards z;
          z.size = D;
          z.rank = r;
          z.buckets = buckets;
          cases.push_back(optimizer_lists(model, &z));
        }
      }
      for (const ListTotals& t : cases) {
        EXPECT_GE(p.slice_lists, t.lists);
        EXPECT_GE(p.slices, t.slices);
        EXPECT_GE(p.slice_elems, t.elems);
      }
    }
  }
}

}  // namespace
}  // namespace vitgrid
