// 2d tensor parallelism (SUMMA, Colossal-AI parallel_2d / Optimus), written once for q x q
// grids stacked over a depth axis so that 2.5d (Tesseract, tp2p5d/) is the same code with
// depth d > 1. Rank (k, i, j): depth k, grid row i (its rank on the Col axis), grid column j
// (its rank on the Row axis).
//   Activations (Stream and Inner alike): samples split over (depth, row) into d*q blocks,
//   block k*q + i; columns split over the Row axis, block j. So x[i, j] is [b/(dq), T, h/q].
//   Linear weight W [out, in]: rank holds W^T block (in i, out j), i.e. W[out j, in i]
//   ([out/q, in/q]); q/k/v groups of qkv split alike (strided). Replicated over depth: its
//   gradient is summed over Depth (each depth layer saw other samples).
//   Forward:  y[i,j] = sum_s x[i,s] W^T[s,j]: for s = 0..q-1, x[i,s] is broadcast along the
//             row (Row axis, root s) and W^T[s,j] along the column (Col axis, root s), then
//             multiply-accumulate (SUMMA). The bias block j is added once.
//   Backward: dx[i,s] = sum_j dy[i,j] W^T[s,j]^T and dW^T[s,j] = sum_i x[i,s]^T dy[i,j]: for
//             each s the same broadcasts, the local products stacked by s, then one
//             reduce-scatter over the Row axis (dx) and one over the Col axis (dW).
//   LayerNorm: statistics reduced over the Row axis (base class: the backend's split-LayerNorm
//   ops, so any backend runs it); its weights split over the Row axis, replicated over
//   (Col, Depth) with gradients summed there. Patch embedding:
//   output columns split over Row (no communication). Head: input columns split over Row,
//   partial logits summed over Row, loss per sample on its batch block, summed over
//   (Col, Depth) so every rank returns the whole micro-batch's loss.
#include "tensor_parallel_2d.h"

#include "vitgrid/core/error.h"

namespace vitgrid {
namespace {

class TensorParallelSumma final : public TensorParallelBase {
 public:
  TensorParallelSumma(const ProcessGrid& grid, Backend& be, Collectives& coll, TensorMode mode)
      : TensorParallelBase(grid, be, coll, {Axis::TensorRow, Axis::TensorCol, Axis::TensorDepth},
                           true, Axis::TensorRow, {Axis::TensorCol, Axis::TensorDepth}),
        mode_(mode),
        q_(grid.size(Axis::TensorRow)),
        i_(grid.rank(Axis::TensorCol)),
        j_(grid.rank(Axis::TensorRow)) {
    VG_CHECK(grid.size(Axis::TensorCol) == q_, "2d grid is not square");
  }
  TensorMode mode() const override { return mode_; }
  ActBlock act_block(ActLayout, int batch, int64_t width) const override {
    return stream_block(batch, width);
  }
  // the Stream's columns are split: its LayerNorm backward is the split one
  TpFusions fusions() const override {
    TpFusions f;
    f.gelu_bias_in_row_backward = true;
    f.layernorm_row_factors = stream_rows_whole();
    return f;
  }
  int local_heads(int heads) const override {
    if (heads % q_ != 0)
      throw UserError("model.heads: " + std::to_string(heads) + " is not divisible by q = " +
                      std::to_string(q_) + " (" + tensor_mode_name(mode_) + ")");
    return heads / q_;
  }

 private:
  void check_div(int64_t n, const char* what) const {
    if (n % q_ != 0)
      throw UserError(std::string("model.hidden: ") + what + " of " + std::to_string(n) +
                      " is not divisible by q = " + std::to_string(q_) + " (" +
                      tensor_mode_name(mode_) + "; check model.hidden, model.mlp_ratio)");
  }
  Shard parallel_weight(int64_t out, int64_t in, LinearRole, int groups) const override {
    const int64_t og = out / groups;
    check_div(og, "a Linear's output features");
    check_div(in, "a Linear's input features");
    Shard s;
    s.offset = {j_ * (og / q_), i_ * (in / q_)};
    if (groups == 1) {
      s.count = {og / q_, in / q_};
    } else {
      s.stride = {og, in};
      s.count = {groups, 1};
      s.block = {og / q_, in / q_};
    }
    s.sharded_over = axes_except({Axis::TensorDepth});
    s.replicated_over = axes_except({Axis::TensorRow, Axis::TensorCol});
    s.partial_over = s.replicated_over;
    return s;
  }
  Shard parallel_bias(int64_t out, LinearRole, int groups) const override {
    const int64_t og = out / groups;
    check_div(og, "a Linear's output features");
    Shard s;
    s.offset = {j_ * (og / q_)};
    if (groups == 1) {
      s.count = {og / q_};
    } else {
      s.stride = {og};
      s.count = {groups};
      s.block = {og / q_};
    }
    s.sharded_over = axes_except({Axis::TensorCol, Axis::TensorDepth});
    s.replicated_over = axes_except({Axis::TensorRow});
    s.partial_over = s.replicated_over;
    return s;
  }

  // Slots: 4 and 5 the broadcast blocks of x and W (forward and backward), 6 the backward's
  // dx partials, 7 its dW partials, 8 this rank's dW piece.
  void reserve_parallel(LinearRole, int rows, int in, int out, int) override {
    const int inl = in / q_, outl = out / q_;
    const size_t es = be_.act_size(), xn = size_t(rows) * inl, wn = size_t(outl) * inl;
    if (q_ > 1) {
      scratch(4, xn * es);
      scratch(5, wn * es);
    }
    scratch(6, q_ * xn * es);
    scratch(7, q_ * wn * sizeof(float));
    scratch(8, wn * sizeof(float));
  }

  // Block s of the row's x (Row axis, root s) and of the column's W (Col axis, root s).
  void broadcast_blocks(int s, const void* x, const void* W, size_t xn, size_t wn,
                        const void** xs, const void** ws) {
    const size_t es = be_.act_size();
    void* xb = j_ == s ? const_cast<void*>(x) : scratch(4, xn * es);
    void* wb = i_ == s ? const_cast<void*>(W) : scratch(5, wn * es);
    if (q_ > 1) {
      coll_.broadcast(xb, xn * es, s, Axis::TensorRow);  // the root only reads its buffer
      coll_.broadcast(wb, wn * es, s, Axis::TensorCol);
    }
    *xs = xb;
    *ws = wb;
  }

  void parallel_forward(LinearRole, void* y, const void* x, const void* W, const void* b,
                        int rows, int in, int out, void* gelu_out, Gelu g, int) override {
    const int inl = in / q_, outl = out / q_;
    for (int s = 0; s < q_; ++s) {
      const void *xs, *ws;
      broadcast_blocks(s, x, W, size_t(rows) * inl, size_t(outl) * inl, &xs, &ws);
      if (s == 0)
        be_.linear_forward(y, xs, ws, b, rows, inl, outl);
      else
        be_.gemm_batched(false, true, rows, outl, inl, 1.0f, xs, 0, ws, 0, 1.0f, y, 0, 1);
    }
    if (gelu_out) be_.gelu_forward(gelu_out, y, size_t(rows) * outl, g);
  }

  void parallel_backward(LinearRole, void* dx, float* dW, float* db, const void* dy,
                         const void* x, const void* W, int rows, int in, int out, int,
                         const void* gelu_pre, Gelu g, float* gelu_db) override {
    const int inl = in / q_, outl = out / q_;
    const size_t es = be_.act_size(), xn = size_t(rows) * inl, wn = size_t(outl) * inl;
    char* P = dx ? static_cast<char*>(scratch(6, q_ * xn * es)) : nullptr;
    float* Q = static_cast<float*>(scratch(7, q_ * wn * sizeof(float)));
    for (int s = 0; s < q_; ++s) {
      const void *xs, *ws;
      broadcast_blocks(s, x, W, xn, wn, &xs, &ws);
      be_.zero(Q + s * wn, wn * sizeof(float));
      be_.linear_backward(P ? P + s * xn * es : nullptr, Q + s * wn, s == 0 ? db : nullptr, dy,
                          xs, ws, rows, inl, outl);
    }
    // dx[i,j] = sum over the row of the partials for column block j (act dtype); dW in fp32
    if (dx) {
      coll_.reduce_scatter(dx, P, xn, Elem::Act, Axis::TensorRow);
      if (gelu_pre) be_.gelu_backward_bias(dx, gelu_pre, dx, rows, inl, gelu_db, g);
    }
    float* mine = static_cast<float*>(scratch(8, wn * sizeof(float)));
    coll_.reduce_scatter(mine, Q, wn, Elem::F32, Axis::TensorCol);
    be_.accumulate_f32(dW, mine, wn);
  }

  TensorMode mode_;
  int q_, i_, j_;
};

}  // namespace

std::unique_ptr<TensorParallel> make_tensor_parallel_summa(const ProcessGrid& grid, Backend& be,
                                                           Collectives& coll, TensorMode mode) {
  return std::make_unique<TensorParallelSumma>(grid, be, coll, mode);
}

std::unique_ptr<TensorParallel> make_tensor_parallel_2d(const ProcessGrid& grid, Backend& be,
                                                        Collectives& coll) {
  return make_tensor_parallel_summa(grid, be, coll, TensorMode::D2);
}

}  // namespace vitgrid
