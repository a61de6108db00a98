// 1d tensor parallelism (Megatron-LM): Column Linears (qkv, fc1) split their output features
// over the tensor axis, Row Linears (proj, fc2) their input features. The Stream (residual
// stream, LayerNorms, embeddings, head) is whole on every tensor rank, so LayerNorm, patch
// embedding, cls/pos, head and loss run replicated and their gradients are already whole and
// identical on every tensor rank (nothing to reduce). Attention runs on this rank's heads.
//   Column: y = x W_r^T + b_r (no communication); backward: dx = dy_r W_r summed over ranks.
//   Row:    y = sum_r x_r W_r^T + b (allreduce; the bias added once); backward: dx_r = dy W_r,
//           dW_r = dy^T x_r, db whole (dy is whole on every rank).
// qkv's rows are [q; k; v]: a rank holds its heads of each, rows j*C + [r*C/t, (r+1)*C/t)
// for j = 0,1,2 (a strided shard), so its qkv output is [q_r | k_r | v_r] and the backend's
// attention op works on H/t heads unchanged.
// Sequence parallelism (GridShape::sequence_parallel, Megatron-LM's): the Stream's samples are
// split over the tensor axis too (block r of t), so LayerNorms, residual adds, dropout, the
// patch embedding and the head run on 1/t of the rows, and what they keep between forward and
// backward shrinks by t. The Inner activations still hold the whole micro-batch:
//   Column: x_r all-gathered over the tensor axis, then y = x W_r^T + b_r; backward: x
//           gathered again for dW_r, the full-row dx = dy_r W_r reduce-scattered back to the
//           rows of x_r (the sum over ranks in the same collective).
//   Row:    y_r = this rank's rows of sum_r x_r W_r^T (+ b once): a reduce-scatter instead of
//           the all-reduce; backward: dy_r all-gathered, dx_r = dy W_r, dW_r = dy^T x_r.
//   The Row bias is replicated with its gradient partial over the tensor axis (each rank adds
//   its rows' column sums, or rank 0 those of the gathered dy), summed with the LayerNorms'.
//   The collectives overlap the GEMMs that do not need them, on Collectives' overlapped path
//   (Megatron-LM's): the Column forward multiplies this rank's own rows while the others'
//   arrive; its backward gathers x beside the data-gradient GEMM and reduce-scatters dx beside
//   the weight-gradient GEMM; the Row backward multiplies its own rows of dy while the others'
//   arrive (dW summed over the row blocks); the Row forward reduce-scatters its partial sums
//   chunk by chunk while the next chunk's are computed. With t = 2 both reduce-scatters are
//   an exchange instead: the peer's rows are computed first and sent while this rank's own
//   are computed, then added. Where the model lets the mode ask for its input in parts (the
//   proj Linear: row_forward_produced), the peer's samples' attention runs first and this
//   rank's beside the exchange; backward, this rank's samples' attention backward runs while
//   the peer's dy arrives (row_backward_consumed). The gathers of the Column forward and the
//   Row backward, and the Row forward's chunked reduce-scatter, go in
//   GridShape::sequence_chunks row chunks, so a GEMM waits only for the chunk it needs. The
//   GEMMs beside a collective leave it Collectives::overlapped_sms SMs. (The A/B variant that
//   ran each collective whole first, then the GEMMs, is gone: git history.)
// Either way a Linear's `rows` are the rows of its x: Column gets the Stream's, Row the Inner's.
#include <algorithm>
#include <cstdlib>
#include <string>

#include "../common/tp_common.h"
#include "vitgrid/core/error.h"

namespace vitgrid {
namespace {

// Between on() and off() (or its end) the GEMMs enqueued leave `sms` more SMs free (to the
// collectives beside them).
class SmMargin {
 public:
  SmMargin(Backend& be, int sms) : be_(be), sms_(sms) {}
  ~SmMargin() { off(); }
  SmMargin(const SmMargin&) = delete;
  SmMargin& operator=(const SmMargin&) = delete;
  void on() {
    if (sms_ <= 0 || on_) return;  // (copy-engine collectives take no SMs: nothing to change)
    old_ = be_.gemm_sm_margin();
    be_.set_gemm_sm_margin(old_ + sms_);
    on_ = true;
  }
  void off() {
    if (on_) be_.set_gemm_sm_margin(old_);
    on_ = false;
  }

 private:
  Backend& be_;
  int sms_, old_ = 0;
  bool on_ = false;
};

class TensorParallel1D final : public TensorParallelBase {
 public:
  TensorParallel1D(const ProcessGrid& grid, Backend& be, Collectives& coll)
      : TensorParallelBase(grid, be, coll, {Axis::Tensor}, false, Axis::Tensor,
                           grid.shape().sequence_parallel ? std::vector<Axis>{Axis::Tensor}
                                                          : std::vector<Axis>{}),
        t_(grid.size(Axis::Tensor)),
        r_(grid.rank(Axis::Tensor)),
        seq_(grid.shape().sequence_parallel),
        chunks_(grid.shape().sequence_chunks),
        side_sms_(coll.overlapped_sms(Axis::Tensor)) {
    VG_CHECK(chunks_ >= 1 && chunks_ <= kMaxChunks, "sequence_chunks " << chunks_);
  }
  TensorMode mode() const override { return TensorMode::D1; }

  ActBlock act_block(ActLayout l, int batch, int64_t width) const override {
    ActBlock b = stream_block(batch, width);
    if (l == ActLayout::Inner) {
      b.samples = batch;  // (sequence parallelism: gathered)
      b.sample_offset = 0;
      split_cols(width, t_, r_, &b);
    }
    return b;
  }
  // The Stream's rows are whole on every rank: a Row Linear's bias gradient is the column sums
  // of its rows (whole, or with sequence parallelism this rank's rows: partial, see above).
  // With sequence parallelism the Row Linears exchange the tensor ranks' sample blocks.
  TpFusions fusions() const override {
    TpFusions f;
    f.gelu_bias_in_row_backward = f.row_bias_in_layernorm_backward = true;
    f.layernorm_row_factors = stream_rows_whole();
    f.row_parts = seq_ ? t_ : 1;
    f.fp8 = true;
    return f;
  }
  int local_heads(int heads) const override {
    if (heads % t_ != 0)
      throw UserError("model.heads: " + std::to_string(heads) +
                      " is not divisible by parallel.tensor (" + std::to_string(t_) + ")");
    return heads / t_;
  }

 private:
  // Output rows of a Column Linear: each of `groups` groups split over the tensor axis.
  Shard column_rows(const std::vector<int64_t>& shape, int groups) const {
    const int64_t out = shape[0], og = out / groups;
    if (og % t_ != 0)
      throw UserError("parallel.tensor: a Linear with " + std::to_string(og) +
                      " output features per group does not split over " + std::to_string(t_) +
                      " 1d ranks (check model.hidden, model.heads, model.mlp_ratio)");
    Shard s;
    s.offset.assign(shape.size(), 0);
    s.count = shape;
    s.offset[0] = r_ * (og / t_);
    if (groups == 1) {
      s.count[0] = og / t_;
    } else {
      s.stride = shape;
      s.stride[0] = og;
      s.count.assign(shape.size(), 1);
      s.count[0] = groups;
      s.block = shape;
      s.block[0] = og / t_;
    }
    s.sharded_over = {Axis::Tensor};
    return s;
  }

  Shard parallel_weight(int64_t out, int64_t in, LinearRole role, int groups) const override {
    if (role == LinearRole::Column) return column_rows({out, in}, groups);
    if (in % t_ != 0)
      throw UserError("parallel.tensor: a Row Linear with " + std::to_string(in) +
                      " input features does not split over " + std::to_string(t_) + " ranks");
    Shard s;
    s.offset = {0, r_ * (in / t_)};
    s.count = {out, in / t_};
    s.sharded_over = {Axis::Tensor};
    return s;
  }
  Shard parallel_bias(int64_t out, LinearRole role, int groups) const override {
    if (role == LinearRole::Column) return column_rows({out}, groups);
    Shard s;  // Row bias: whole, added once (by rank 0's partial sum)
    s.offset = {0};
    s.count = {out};
    s.replicated_over = {Axis::Tensor};
    if (seq_) s.partial_over = {Axis::Tensor};  // else its gradient is whole everywhere
    return s;
  }

  // Sequence parallelism's slots: 4 the gathered x (Column) or dy (Row), 5 the full-row
  // output of a Row forward or dx of a Column backward (the overlapped collectives' memory).
  // `rows`: the Stream's.
  void* buf(int slot, size_t bytes) { return scratch(slot, bytes, seq_); }
  void reserve_parallel(LinearRole, int rows, int in, int out, int) override {
    if (!seq_) return;
    const size_t full = size_t(rows) * t_ * std::max(in, out) * be_.act_size();
    buf(4, full);
    buf(5, full);
  }

  void parallel_forward(LinearRole role, void* y, const void* x, const void* W, const void* b,
                        int rows, int in, int out, void* gelu_out, Gelu g, int) override {
    if (seq_) {
      overlapped_forward(role, y, x, W, b, rows, in, out, gelu_out, g);
      return;
    }
    if (role == LinearRole::Column) {
      local_forward(y, x, W, b, rows, in, out / t_, gelu_out, g);
      return;
    }
    local_forward(y, x, W, r_ == 0 ? b : nullptr, rows, in / t_, out);
    coll_.allreduce(y, static_cast<size_t>(rows) * out, Elem::Act, ReduceOp::Sum, Axis::Tensor);
    if (gelu_out) be_.gelu_forward(gelu_out, y, static_cast<size_t>(rows) * out, g);
  }
  void parallel_backward(LinearRole role, void* dx, float* dW, float* db, const void* dy,
                         const void* x, const void* W, int rows, int in, int out, int,
                         const void* gelu_pre, Gelu g, float* gelu_db) override {
    if (seq_) {
      overlapped_backward(role, dx, dW, db, dy, x, W, rows, in, out, gelu_pre, g, gelu_db);
      return;
    }
    if (role == LinearRole::Column) {
      local_backward(dx, dW, db, dy, x, W, rows, in, out / t_);
      if (dx) {
        const size_t n = static_cast<size_t>(rows) * in;
        coll_.allreduce(dx, n, Elem::Act, ReduceOp::Sum, Axis::Tensor);
        if (gelu_pre) be_.gelu_backward(dx, gelu_pre, dx, n, g);
      }
      return;
    }
    // Row: this rank's input columns are its own, dx needs no reduction: fused
    local_backward(dx, dW, db, dy, x, W, rows, in / t_, out, gelu_pre, g, gelu_db);
  }

  // Sequence parallelism with the collectives overlapped (see the top). Row blocks of `rows`
  // rows each: block k of an Inner buffer is rank k's Stream rows.
  static const void* at(const void* p, size_t elems, size_t es) {
    return p ? static_cast<const char*>(p) + elems * es : nullptr;
  }
  static void* at(void* p, size_t elems, size_t es) {
    return p ? static_cast<char*>(p) + elems * es : nullptr;
  }
  // Calls f(j, lo, n) for each non-empty chunk j of a block of `rows` rows: its rows
  // [lo, lo + n). A chunked collective holds chunk j of every rank's block together:
  // [j][rank][chunk j's rows]. An FP8 Linear's chunks start at multiples of 16 rows (its
  // weight gradient's K; the model makes `rows` one).
  template <class F>
  void for_chunks(int rows, F&& f) const {
    const int64_t g = fp8_ ? 16 : 1;
    auto edge = [&](int j) {
      if (j == chunks_) return rows;
      return static_cast<int>(static_cast<int64_t>(rows) * j / chunks_ / g * g);
    };
    for (int j = 0; j < chunks_; ++j) {
      const int lo = edge(j), hi = edge(j + 1);
      if (hi > lo) f(j, lo, hi - lo);
    }
  }
  // Gathers every rank's block of `rows` rows (`width` elements each; this rank's at `local`)
  // into `full` chunk by chunk while own() runs (this rank's rows, from `local` itself), then
  // calls peer(k, lo, n, xk) for each other rank k's rows [lo, lo + n) at xk as their chunk
  // arrives. The GEMMs meanwhile leave the collectives their SMs.
  template <class Own, class Peer>
  void gather_beside(void* full, const void* local, int rows, int width, Own&& own,
                     Peer&& peer) {
    const size_t es = be_.act_size();
    Work tk[kMaxChunks];
    for_chunks(rows, [&](int j, int lo, int n) {
      tk[j] = coll_.start_overlapped_allgather(at(full, size_t(lo) * t_ * width, es),
                                               at(local, size_t(lo) * width, es),
                                               size_t(n) * width, Elem::Act, Axis::Tensor);
    });
    SmMargin m(be_, side_sms_);
    m.on();
    own();
    for_chunks(rows, [&](int j, int lo, int n) {
      coll_.wait(tk[j]);
      if (j == chunks_ - 1) m.off();  // nothing left in flight
      for (int k = 0; k < t_; ++k)
        if (k != r_) peer(k, lo, n, at(full, (size_t(lo) * t_ + size_t(k) * n) * width, es));
    });
  }

  // t = 2: a reduce-scatter as an exchange. This rank's block of `ex` ([rank][n]) holds its
  // partial sums of the peer's rows; gathered in place, the peer's block then holds the peer's
  // partial sums of this rank's rows (added by the caller): what an all-to-all sends, without
  // its copy of a rank's own block (a kernel on the SMs beside the GEMMs, in NCCL 2.28).
  Work exchange(void* ex, size_t n) {
    const size_t es = be_.act_size();
    return coll_.start_overlapped_allgather(ex, at(ex, r_ * n, es), n, Elem::Act, Axis::Tensor);
  }

  void overlapped_forward(LinearRole role, void* y, const void* x, const void* W, const void* b,
                          int rows, int in, int out, void* gelu_out, Gelu g) {
    if (role == LinearRole::Row) {
      overlapped_row_forward(y, x, W, b, rows, in, out, gelu_out, g);
      return;
    }
    // Column: this rank's rows from its own x while the others' arrive, then theirs chunk by
    // chunk as each arrives
    const size_t es = be_.act_size();
    const int ol = out / t_;
    auto gemm = [&](int k, int lo, int n, const void* xk) {  // y's rows lo.. of block k
      const size_t o = (size_t(k) * rows + lo) * ol;
      local_forward(at(y, o, es), xk, W, b, n, in, ol, at(gelu_out, o, es), g);
    };
    gather_beside(buf(4, size_t(rows) * t_ * in * es), x, rows, in,
                  [&] { gemm(r_, 0, rows, x); }, gemm);
  }
  // Row: with t = 2 the partial sums of the peer's rows exchanged (see exchange) while this
  // rank's own are computed; else the partial sums of every rank's rows chunk by chunk, each
  // chunk reduce-scattered while the next is computed (with one chunk the reduce-scatter needs
  // every row's sums first, as not overlapped).
  void overlapped_row_forward(void* y, const void* x, const void* W, const void* b, int rows,
                              int in, int out, void* gelu_out, Gelu g) {
    if (t_ == 2) {
      exchange_row_forward(y, x, W, b, rows, in, out, gelu_out, g, [](int) {});
      return;
    }
    const size_t es = be_.act_size();
    const int mine = rows / t_, li = in / t_;  // rows: the whole micro-batch's
    void* full = buf(5, size_t(rows) * out * es);
    if (chunks_ == 1) {
      local_forward(full, x, W, r_ == 0 ? b : nullptr, rows, li, out);
      coll_.reduce_scatter(y, full, size_t(mine) * out, Elem::Act, Axis::Tensor);
      if (gelu_out) be_.gelu_forward(gelu_out, y, size_t(mine) * out, g);
      return;
    }
    Work tk[kMaxChunks];
    SmMargin m(be_, side_sms_);
    for_chunks(mine, [&](int j, int lo, int n) {
      for (int k = 0; k < t_; ++k)  // (rank 0's partial sums carry the bias)
        local_forward(at(full, (size_t(lo) * t_ + size_t(k) * n) * out, es),
                           at(x, (size_t(k) * mine + lo) * li, es), W, r_ == 0 ? b : nullptr,
                           n, li, out);
      tk[j] = coll_.start_overlapped_reduce_scatter(at(y, size_t(lo) * out, es),
                                                    at(full, size_t(lo) * t_ * out, es),
                                                    size_t(n) * out, Elem::Act, Axis::Tensor);
      m.on();
    });
    m.off();
    for_chunks(mine, [&](int j, int, int) { coll_.wait(tk[j]); });
    if (gelu_out) be_.gelu_forward(gelu_out, y, size_t(mine) * out, g);
  }
  // The Row forward at t = 2: the peer's rows' partial sums first (produce(k) writes x's
  // block k before it is read), exchanged (see exchange) while this rank's own are computed,
  // then added.
  template <class Produce>
  void exchange_row_forward(void* y, const void* x, const void* W, const void* b, int rows,
                            int in, int out, void* gelu_out, Gelu g, Produce&& produce) {
    const size_t es = be_.act_size();
    const int mine = rows / t_, li = in / t_, p = 1 - r_;  // rows: the whole micro-batch's
    const size_t n = size_t(mine) * out;
    void* ex = buf(5, n * t_ * es);
    produce(p);
    local_forward(at(ex, r_ * n, es), at(x, size_t(p) * mine * li, es), W,
                       r_ == 0 ? b : nullptr, mine, li, out);
    const Work tk = exchange(ex, n);
    {
      SmMargin m(be_, side_sms_);
      m.on();
      produce(r_);
      local_forward(y, at(x, size_t(r_) * mine * li, es), W, r_ == 0 ? b : nullptr, mine,
                         li, out);
    }
    coll_.wait(tk);
    be_.accumulate(y, at(ex, p * n, es), n);
    if (gelu_out) be_.gelu_forward(gelu_out, y, n, g);
  }
  // x's blocks produced by the caller as they are needed (see TensorParallel): with t = 2 the
  // exchange above, else everything first.
  void row_forward_produced(void* y, const void* x, const void* W, const void* b, int rows,
                            int in, int out, int samples, const SampleFn& produce,
                            const Fp8LinearMeta* fp8) override {
    if (!seq_ || t_ != 2) {
      TensorParallelBase::row_forward_produced(y, x, W, b, rows, in, out, samples, produce, fp8);
      return;
    }
    Fp8Scope f8(*this, fp8, LinearRole::Row);
    const int part = row_part_samples(samples);
    exchange_row_forward(y, x, W, b, rows, in, out, nullptr, Gelu::Exact,
                         [&](int k) { produce(k * part, part); });
  }
  // dx's blocks handed to the caller as they are complete: this rank's own rows first (while
  // the others' dy arrives), then the others'.
  void row_backward_consumed(void* dx, float* dW, float* db, const void* dy, const void* x,
                             const void* W, int rows, int in, int out, int samples,
                             const SampleFn& consume, const Fp8LinearMeta* fp8) override {
    if (!seq_) {
      TensorParallelBase::row_backward_consumed(dx, dW, db, dy, x, W, rows, in, out, samples,
                                                consume, fp8);
      return;
    }
    Fp8Scope f8(*this, fp8, LinearRole::Row);
    const int part = row_part_samples(samples);
    overlapped_row_backward(dx, dW, db, dy, x, W, rows, in, out, nullptr, Gelu::Exact, nullptr,
                            [&](int k) { consume(k * part, part); });
  }
  int row_part_samples(int samples) const {
    if (!seq_) return samples;
    VG_CHECK(samples % t_ == 0, samples << " samples over " << t_ << " tensor ranks");
    return samples / t_;  // block k: rank k's Stream samples
  }
  void overlapped_backward(LinearRole role, void* dx, float* dW, float* db, const void* dy,
                           const void* x, const void* W, int rows, int in, int out,
                           const void* gelu_pre, Gelu g, float* gelu_db) {
    const size_t es = be_.act_size();
    if (role == LinearRole::Column) {  // rows: this rank's Stream rows
      const size_t n = size_t(rows) * in;
      SmMargin m(be_, side_sms_);
      void* xg = buf(4, n * t_ * es);
      const Work tx = coll_.start_overlapped_allgather(xg, x, n, Elem::Act, Axis::Tensor);
      Work tdx;
      void* ex = dx ? buf(5, n * t_ * es) : nullptr;
      const int ol = out / t_, p = 1 - r_;
      m.on();
      if (dx && t_ == 2) {  // the peer's rows' dx first, exchanged beside this rank's own
        local_backward(at(ex, r_ * n, es), nullptr, nullptr,
                            at(dy, size_t(p) * rows * ol, es), nullptr, W, rows, in, ol);
        tdx = exchange(ex, n);
        local_backward(dx, nullptr, nullptr, at(dy, size_t(r_) * rows * ol, es), nullptr,
                            W, rows, in, ol);
      } else if (dx) {  // dx's full rows beside the gather, reduce-scattered beside dW's GEMM
        local_backward(ex, nullptr, nullptr, dy, nullptr, W, rows * t_, in, ol);
        tdx = coll_.start_overlapped_reduce_scatter(dx, ex, n, Elem::Act, Axis::Tensor);
      }
      coll_.wait(tx);
      local_backward(nullptr, dW, db, dy, xg, W, rows * t_, in, ol);
      m.off();
      if (dx) {
        coll_.wait(tdx);
        if (t_ == 2) be_.accumulate(dx, at(ex, p * n, es), n);
        if (gelu_pre) be_.gelu_backward(dx, gelu_pre, dx, n, g);
      }
      return;
    }
    overlapped_row_backward(dx, dW, db, dy, x, W, rows, in, out, gelu_pre, g, gelu_db,
                            [](int) {});
  }
  // Row: rows are the whole micro-batch's; dy is this rank's block of them, gathered chunk by
  // chunk while this rank's own rows are multiplied. The bias gradient: this rank's rows'
  // column sums (partial over the tensor axis). done(k): dx's block k is written.
  template <class Done>
  void overlapped_row_backward(void* dx, float* dW, float* db, const void* dy, const void* x,
                               const void* W, int rows, int in, int out, const void* gelu_pre,
                               Gelu g, float* gelu_db, Done&& done) {
    const size_t es = be_.act_size();
    const int mine = rows / t_;
    const int li = in / t_;
    auto block = [&](int k, int lo, int n, const void* dyk, float* dbk) {
      const size_t o = (size_t(k) * mine + lo) * li;
      local_backward(at(dx, o, es), dW, dbk, dyk, at(x, o, es), W, n, li, out,
                          at(gelu_pre, o, es), g, gelu_db);
    };
    gather_beside(buf(4, size_t(mine) * t_ * out * es), dy, mine, out,
                  [&] {
                    block(r_, 0, mine, dy, db);
                    done(r_);
                  },
                  [&](int k, int lo, int n, const void* dyk) { block(k, lo, n, dyk, nullptr); });
    for (int k = 0; k < t_; ++k)
      if (k != r_) done(k);
  }

  static constexpr int kMaxChunks = 8;
  int t_, r_;
  bool seq_;
  int chunks_;     // ... split into this many row chunks (GridShape::sequence_chunks)
  int side_sms_;   // SMs the GEMMs beside them leave free
};

}  // namespace

std::unique_ptr<TensorParallel> make_tensor_parallel_1d(const ProcessGrid& grid, Backend& be,
                                                        Collectives& coll) {
  return std::make_unique<TensorParallel1D>(grid, be, coll);
}

}  // namespace vitgrid
