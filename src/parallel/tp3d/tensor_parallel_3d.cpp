// 3d tensor parallelism (Colossal-AI parallel_3d, Agarwal et al.'s 3D matrix multiply) on a
// q x q x q cube. Axes: A = TensorY (the weight group: a weight's pieces are gathered over
// it), and TensorX / TensorZ, which take turns as the input group G (inputs gathered over it,
// output features split by it) and the output group S (partial products reduce-scattered
// over it, input features split by it): Column Linears (qkv, fc1) use G = X, S = Z, Row
// Linears (proj, fc2) G = Z, S = X, so each Linear's output is in the layout the next one
// reads.
//   Stream (residual stream; input of Column, output of Row): samples block a*q + x,
//          columns block z.             Inner: samples block a*q + z, columns block x.
//   W [out, in]: rank holds rows block (g*q + a) of out/q^2 rows (per q/k/v group for qkv)
//          and columns block s of in/q, i.e. Colossal-AI's [in/q, out/q^2]; g = rank on G,
//          s = rank on S. Every rank holds a different piece: no replication.
//   Forward:  X = allgather_G(x) [q*rows, in/q]; W_g = allgather_A(W) [out/q, in/q];
//             y = reduce_scatter_S(X W_g^T) (+ bias block g, added by s = 0 only).
//   Backward: dY = allgather_S(dy); dx = reduce_scatter_G(dY W_g);
//             dW = reduce_scatter_A(dY^T X); db += sum dY (partial over A: summed there).
// LayerNorm statistics are reduced over Z (the Stream's column axis, base class); the patch
// embedding, cls/pos, LayerNorm weights and head split their hidden dim over Z and are
// replicated over (A, X), where their gradients are summed. The loss is per sample on the
// Stream's sample block, summed over (X, A).
#include <algorithm>

#include "../common/tp_common.h"
#include "vitgrid/core/error.h"

namespace vitgrid {
namespace {

class TensorParallel3D final : public TensorParallelBase {
 public:
  TensorParallel3D(const ProcessGrid& grid, Backend& be, Collectives& coll)
      : TensorParallelBase(grid, be, coll, {Axis::TensorX, Axis::TensorY, Axis::TensorZ}, true,
                           Axis::TensorZ, {Axis::TensorX, Axis::TensorY}),
        q_(grid.size(Axis::TensorY)),
        a_(grid.rank(Axis::TensorY)) {}
  TensorMode mode() const override { return TensorMode::D3; }
  ActBlock act_block(ActLayout l, int batch, int64_t width) const override {
    if (l == ActLayout::Stream) return stream_block(batch, width);
    ActBlock b;
    split_samples(batch, q_ * q_, a_ * q_ + rank(Axis::TensorZ), &b);
    split_cols(width, q_, rank(Axis::TensorX), &b);
    return b;
  }
  // its Column backward sums the bias gradient over the gathered dy, not the rank's own
  // block; the Stream's columns are split: its LayerNorm backward is the split one
  TpFusions fusions() const override {
    TpFusions f;
    f.layernorm_row_factors = stream_rows_whole();
    return f;
  }
  int local_heads(int heads) const override {
    if (heads % q_ != 0)
      throw UserError("model.heads: " + std::to_string(heads) + " is not divisible by q = " +
                      std::to_string(q_) + " (3d)");
    return heads / q_;
  }

 private:
  static Axis gather_axis(LinearRole r) {
    return r == LinearRole::Column ? Axis::TensorX : Axis::TensorZ;
  }
  static Axis scatter_axis(LinearRole r) {
    return r == LinearRole::Column ? Axis::TensorZ : Axis::TensorX;
  }
  void check_div(int64_t n, int64_t by, const char* what) const {
    if (n % by != 0)
      throw UserError(std::string("model.hidden: ") + what + " of " + std::to_string(n) +
                      " is not divisible by " + std::to_string(by) +
                      " (3d; check model.hidden, model.mlp_ratio)");
  }

  Shard parallel_weight(int64_t out, int64_t in, LinearRole role, int groups) const override {
    const int64_t og = out / groups, qq = int64_t(q_) * q_;
    check_div(og, qq, "a Linear's output features");
    check_div(in, q_, "a Linear's input features");
    const int g = rank(gather_axis(role)), s = rank(scatter_axis(role));
    Shard sh;
    sh.offset = {g * (og / q_) + a_ * (og / qq), s * (in / q_)};
    if (groups == 1) {
      sh.count = {og / qq, in / q_};
    } else {
      sh.stride = {og, in};
      sh.count = {groups, 1};
      sh.block = {og / qq, in / q_};
    }
    sh.sharded_over = axes_except({});
    return sh;
  }
  Shard parallel_bias(int64_t out, LinearRole role, int groups) const override {
    const int64_t og = out / groups;
    check_div(og, q_, "a Linear's output features");
    const int g = rank(gather_axis(role));
    Shard sh;
    sh.offset = {g * (og / q_)};
    if (groups == 1) {
      sh.count = {og / q_};
    } else {
      sh.stride = {og};
      sh.count = {groups};
      sh.block = {og / q_};
    }
    sh.sharded_over = axes_except({Axis::TensorY, scatter_axis(role)});
    sh.replicated_over = axes_except({gather_axis(role)});
    // the bias gradient comes from dY gathered over S: whole over S, partial over A
    sh.partial_over = axes_except({gather_axis(role), scatter_axis(role)});
    return sh;
  }

  // Slots: 4 the gathered x, 5 the gathered W (9 permuted for grouped weights), 6 the
  // forward's partial y and the backward's partial dx, 7 the gathered dy, 8 the dW partials
  // (10 permuted back), 11 this rank's dW piece.
  void reserve_parallel(LinearRole, int rows, int in, int out, int groups) override {
    const int inl = in / q_, outl = out / q_;
    const size_t es = be_.act_size(), wn = size_t(outl) * inl;
    const size_t piece = size_t(out) / (size_t(q_) * q_) * inl;
    scratch(4, size_t(q_) * rows * inl * es);
    scratch(5, piece * q_ * es);
    if (groups > 1) scratch(9, piece * q_ * es);
    scratch(6, size_t(q_) * rows * std::max(inl, outl) * es);
    scratch(7, size_t(q_) * rows * outl * es);
    scratch(8, wn * sizeof(float));
    if (groups > 1) scratch(10, wn * sizeof(float));
    scratch(11, wn / q_ * sizeof(float));
  }

  // W_g [out/q, in/q]: the weight pieces of the A axis, rows in global order (q/k/v groups
  // of qkv: the gathered [a][group][rows] is permuted to [group][a][rows]).
  const void* gather_weight(const void* W, int out, int inl, int groups) {
    const size_t es = be_.act_size();
    const size_t piece = size_t(out) / (size_t(q_) * q_) * inl;  // one rank's elements
    char* g = static_cast<char*>(scratch(5, piece * q_ * es));
    coll_.allgather(g, W, piece, Elem::Act, Axis::TensorY);
    if (groups == 1) return g;
    char* p = static_cast<char*>(scratch(9, piece * q_ * es));
    permute(p, g, q_, groups, piece / groups * es);
    return p;
  }
  // dst[k][j] = src[j][k] for blocks of `bytes`, src [n0][n1].
  void permute(char* dst, const char* src, int n0, int n1, size_t bytes) {
    for (int j = 0; j < n0; ++j)
      for (int k = 0; k < n1; ++k)
        be_.copy(dst + (size_t(k) * n0 + j) * bytes, src + (size_t(j) * n1 + k) * bytes, bytes);
  }

  void parallel_forward(LinearRole role, void* y, const void* x, const void* W, const void* b,
                        int rows, int in, int out, void* gelu_out, Gelu g, int groups) override {
    const Axis G = gather_axis(role), S = scatter_axis(role);
    const int inl = in / q_, outl = out / q_;
    const size_t es = be_.act_size();
    void* X = scratch(4, size_t(q_) * rows * inl * es);
    coll_.allgather(X, x, size_t(rows) * inl, Elem::Act, G);
    const void* Wg = gather_weight(W, out, inl, groups);
    void* P = scratch(6, size_t(q_) * rows * outl * es);
    be_.linear_forward(P, X, Wg, rank(S) == 0 ? b : nullptr, q_ * rows, inl, outl);
    coll_.reduce_scatter(y, P, size_t(rows) * outl, Elem::Act, S);
    if (gelu_out) be_.gelu_forward(gelu_out, y, size_t(rows) * outl, g);
  }

  void parallel_backward(LinearRole role, void* dx, float* dW, float* db, const void* dy,
                         const void* x, const void* W, int rows, int in, int out, int groups,
                         const void* gelu_pre, Gelu g, float*) override {
    const Axis G = gather_axis(role), S = scatter_axis(role);
    const int inl = in / q_, outl = out / q_;
    const size_t es = be_.act_size();
    void* X = scratch(4, size_t(q_) * rows * inl * es);
    coll_.allgather(X, x, size_t(rows) * inl, Elem::Act, G);
    const void* Wg = gather_weight(W, out, inl, groups);
    void* dY = scratch(7, size_t(q_) * rows * outl * es);
    coll_.allgather(dY, dy, size_t(rows) * outl, Elem::Act, S);
    void* dX = dx ? scratch(6, size_t(q_) * rows * inl * es) : nullptr;
    const size_t wn = size_t(outl) * inl;
    float* dWg = static_cast<float*>(scratch(8, wn * sizeof(float)));
    be_.zero(dWg, wn * sizeof(float));
    be_.linear_backward(dX, dWg, db, dY, X, Wg, q_ * rows, inl, outl);
    if (dx) {
      coll_.reduce_scatter(dx, dX, size_t(rows) * inl, Elem::Act, G);
      if (gelu_pre) be_.gelu_backward(dx, gelu_pre, dx, size_t(rows) * inl, g);
    }
    float* src = dWg;
    if (groups > 1) {  // back to [a][group][rows] so that piece a is contiguous
      src = static_cast<float*>(scratch(10, wn * sizeof(float)));
      permute(reinterpret_cast<char*>(src), reinterpret_cast<const char*>(dWg), groups, q_,
              wn / (size_t(groups) * q_) * sizeof(float));
    }
    float* mine = static_cast<float*>(scratch(11, wn / q_ * sizeof(float)));
    coll_.reduce_scatter(mine, src, wn / q_, Elem::F32, Axis::TensorY);
    be_.accumulate_f32(dW, mine, wn / q_);
  }

  int q_, a_;
};

}  // namespace

std::unique_ptr<TensorParallel> make_tensor_parallel_3d(const ProcessGrid& grid, Backend& be,
                                                        Collectives& coll) {
  return std::make_unique<TensorParallel3D>(grid, be, coll);
}

}  // namespace vitgrid
