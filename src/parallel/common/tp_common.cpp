#include "tp_common.h"

#include <mpi.h>

#include <algorithm>
#include <utility>

#include "vitgrid/core/error.h"
#include "vitgrid/core/watchdog.h"
#include "vitgrid/model/vit.h"  // ParamInfo (header-only struct)

namespace vitgrid {

namespace {
bool contains(const std::vector<Axis>& v, Axis a) {
  return std::find(v.begin(), v.end(), a) != v.end();
}

// The flat ranges [offset, offset + n) of the parameters whose gradients are partial sums over
// axis a, neighbours merged (a LayerNorm's weight and bias, the Row bias before them): each
// range one copy into the pack buffer and one back.
std::vector<std::pair<size_t, size_t>> partial_ranges(const std::vector<ParamInfo>& params,
                                                      Axis a) {
  std::vector<std::pair<size_t, size_t>> r;
  for (const auto& p : params) {
    if (!contains(p.shard.partial_over, a) || p.numel == 0) continue;
    if (!r.empty() && r.back().first + r.back().second == p.offset)
      r.back().second += p.numel;
    else
      r.emplace_back(p.offset, p.numel);
  }
  return r;
}
size_t elems(const std::vector<std::pair<size_t, size_t>>& ranges) {
  size_t n = 0;
  for (const auto& r : ranges) n += r.second;
  return n;
}
}  // namespace

TensorParallelBase::TensorParallelBase(const ProcessGrid& grid, Backend& be, Collectives& coll,
                                       std::vector<Axis> mode_axes, bool has_hidden, Axis hidden,
                                       std::vector<Axis> batch_axes)
    : grid_(grid), be_(be), coll_(coll), has_hidden_(has_hidden), hidden_(hidden) {
  for (Axis a : mode_axes)
    if (grid.size(a) > 1) mode_axes_.push_back(a);
  if (has_hidden_) {
    hq_ = grid.size(hidden);
    hr_ = grid.rank(hidden);
  }
  int stride = 1;
  for (Axis a : batch_axes) {
    bidx_ += grid.rank(a) * stride;
    stride *= grid.size(a);
    batch_axes_.push_back(a);
  }
  bsplit_ = stride;
}

TensorParallelBase::~TensorParallelBase() {
  for (size_t i = 0; i < scratch_.size(); ++i) release_scratch(static_cast<int>(i));
}

void TensorParallelBase::release_scratch(int slot) {
  void* p = scratch_[slot];
  if (!p) return;
  if (scratch_overlapped_[slot])
    coll_.overlapped_release(p);
  else
    be_.release(p);
  scratch_[slot] = nullptr;
}

void* TensorParallelBase::scratch(int slot, size_t bytes, bool overlapped) {
  if (static_cast<size_t>(slot) >= scratch_.size()) {
    scratch_.resize(slot + 1, nullptr);
    scratch_bytes_.resize(slot + 1, 0);
    scratch_overlapped_.resize(slot + 1, false);
  }
  if (scratch_bytes_[slot] < bytes) {
    release_scratch(slot);
    void* p = overlapped ? coll_.overlapped_alloc(bytes) : nullptr;
    scratch_overlapped_[slot] = p != nullptr;
    scratch_[slot] = p ? p : be_.alloc(bytes);
    scratch_bytes_[slot] = bytes;
  }
  return scratch_[slot];
}

void TensorParallelBase::split_samples(int batch, int nblocks, int idx, ActBlock* blk) {
  if (batch % nblocks != 0)
    throw UserError("data.global_batch: a micro-batch of " + std::to_string(batch) +
                    " samples does not split over the " + std::to_string(nblocks) +
                    " tensor ranks that share its samples");
  blk->samples = batch / nblocks;
  blk->sample_offset = idx * blk->samples;
}

void TensorParallelBase::split_cols(int64_t width, int n, int idx, ActBlock* blk) {
  VG_CHECK(width % n == 0, "width " << width << " does not split in " << n << " blocks");
  blk->cols = width / n;
  blk->col_offset = idx * blk->cols;
}

ActBlock TensorParallelBase::stream_block(int batch, int64_t width) const {
  ActBlock b;
  split_samples(batch, bsplit_, bidx_, &b);
  split_cols(width, hq_, hr_, &b);
  return b;
}

std::vector<Axis> TensorParallelBase::axes_except(std::initializer_list<Axis> except) const {
  std::vector<Axis> out;
  for (Axis a : mode_axes_)
    if (std::find(except.begin(), except.end(), a) == except.end()) out.push_back(a);
  return out;
}

std::vector<Axis> TensorParallelBase::batch_axes_split() const {
  std::vector<Axis> out;
  for (Axis a : batch_axes_)
    if (size(a) > 1) out.push_back(a);
  return out;
}

// ---- shards of the Stream-shaped parameters

Shard TensorParallelBase::shard_hidden_vector(const std::vector<int64_t>& shape) const {
  Shard s;
  s.offset.assign(shape.size(), 0);
  s.count = shape;
  const int64_t C = shape.back();
  VG_CHECK(C % hq_ == 0, "hidden " << C << " does not split over " << hq_ << " ranks");
  s.offset.back() = hr_ * (C / hq_);
  s.count.back() = C / hq_;
  if (hq_ > 1) s.sharded_over = {hidden_};
  s.replicated_over = has_hidden_ ? axes_except({hidden_}) : mode_axes_;
  // Each copy only saw this rank's samples: the gradients are partial over the batch axes.
  s.partial_over = batch_axes_split();
  return s;
}

Shard TensorParallelBase::shard_linear_weight(int64_t out, int64_t in, LinearRole role,
                                              int groups) const {
  switch (role) {
    case LinearRole::Column:
    case LinearRole::Row:
      return parallel_weight(out, in, role, groups);
    case LinearRole::Embed: {
      // rows = output features = Stream columns: split like a hidden vector
      Shard s = shard_hidden_vector({in, out});
      return Shard{{s.offset[1], 0}, {s.count[1], in}, {}, {}, s.replicated_over,
                   s.sharded_over, s.partial_over};
    }
    case LinearRole::Head: {
      // columns = input features = Stream columns
      Shard s = shard_hidden_vector({out, in});
      return s;
    }
    case LinearRole::Replicated:
      break;
  }
  Shard s;
  s.offset = {0, 0};
  s.count = {out, in};
  s.replicated_over = mode_axes_;
  s.partial_over = batch_axes_split();
  return s;
}

Shard TensorParallelBase::shard_linear_bias(int64_t out, LinearRole role, int groups) const {
  switch (role) {
    case LinearRole::Column:
    case LinearRole::Row:
      return parallel_bias(out, role, groups);
    case LinearRole::Embed:
      return shard_hidden_vector({out});
    case LinearRole::Head:
    case LinearRole::Replicated:
      break;
  }
  // whole on every rank; the head's bias is added once after the hidden-axis reduction
  Shard s;
  s.offset = {0};
  s.count = {out};
  s.replicated_over = mode_axes_;
  s.partial_over = batch_axes_split();
  return s;
}

void TensorParallelBase::register_params(const std::vector<ParamInfo>& params) {
  sharded_.clear();
  for (const auto& p : params) sharded_.push_back(p.shard.sharded_over);
  // reduce_replicated_grads' ranges per mode axis, and its pack buffer: the partial gradients
  // of one axis at a time
  partial_ranges_.clear();
  size_t most = 0;
  for (Axis a : mode_axes_) {
    partial_ranges_.push_back(partial_ranges(params, a));
    most = std::max(most, elems(partial_ranges_.back()));
  }
  if (most > 0) scratch(3, most * sizeof(float));
}

void TensorParallelBase::reserve(int max_rows, const std::vector<LinearShape>& linears) {
  if (max_rows <= 0) return;
  if (hq_ > 1) scratch(0, sizeof(float) * 2 * static_cast<size_t>(max_rows));  // LayerNorm sums
  for (const LinearShape& l : linears)
    if (l.role == LinearRole::Column || l.role == LinearRole::Row)
      reserve_parallel(l.role, max_rows, l.in, l.out, l.groups);
}

// ---- Linears

TensorParallelBase::Fp8Scope::Fp8Scope(TensorParallelBase& tp, const Fp8LinearMeta* m,
                                       LinearRole role)
    : tp_(tp) {
  VG_CHECK(!m || role == LinearRole::Column || role == LinearRole::Row,
           "an FP8 embedding, head or replicated Linear (the block Linears only)");
  VG_CHECK(!m || tp.fusions().fp8,
           "an FP8 Linear in tensor mode " << tensor_mode_name(tp.mode())
                                           << ", whose Linears run in the act dtype only");
  tp_.fp8_ = m;
}

// slot 12: the FP8 copies of the Linear's operands (backend/fp8_linear.h)
void TensorParallelBase::reserve_fp8(size_t bytes) {
  if (bytes > 0) scratch(12, bytes);
}

void TensorParallelBase::local_forward(void* y, const void* x, const void* W, const void* b,
                                       int rows, int in, int out, void* gelu_out, Gelu g) {
  if (!fp8_) {
    be_.linear_forward(y, x, W, b, rows, in, out, gelu_out, g);
    return;
  }
  auto* s = static_cast<uint8_t*>(scratch(12, fp8_linear_scratch_bytes(rows, in, out)));
  fp8_linear_forward(be_, *fp8_, s, y, x, W, b, rows, in, out, gelu_out, g);
}

void TensorParallelBase::local_backward(void* dx, float* dW, float* db, const void* dy,
                                        const void* x, const void* W, int rows, int in, int out,
                                        const void* gelu_pre, Gelu g, float* gelu_db) {
  if (!fp8_) {
    be_.linear_backward(dx, dW, db, dy, x, W, rows, in, out, gelu_pre, g, gelu_db);
    return;
  }
  auto* s = static_cast<uint8_t*>(scratch(12, fp8_linear_scratch_bytes(rows, in, out)));
  fp8_linear_backward(be_, *fp8_, s, dx, dW, db, dy, x, W, rows, in, out, gelu_pre, g, gelu_db);
}

void TensorParallelBase::linear_forward(LinearRole role, void* y, const void* x, const void* W,
                                        const void* b, int rows, int in, int out, void* gelu_out,
                                        Gelu g, int groups, const Fp8LinearMeta* fp8) {
  Fp8Scope f8(*this, fp8, role);
  switch (role) {
    case LinearRole::Column:
    case LinearRole::Row:
      parallel_forward(role, y, x, W, b, rows, in, out, gelu_out, g, groups);
      return;
    case LinearRole::Embed:
      // whole input features, this rank's output columns: no communication
      be_.linear_forward(y, x, W, b, rows, in, out / hq_, gelu_out, g);
      return;
    case LinearRole::Head:
      // partial logits over the hidden axis; the bias is added by hidden rank 0 only, so the
      // sum holds it once
      be_.linear_forward(y, x, W, hr_ == 0 ? b : nullptr, rows, in / hq_, out, nullptr, g);
      if (hq_ > 1)
        coll_.allreduce(y, static_cast<size_t>(rows) * out, Elem::Act, ReduceOp::Sum, hidden_);
      if (gelu_out) be_.gelu_forward(gelu_out, y, static_cast<size_t>(rows) * out, g);
      return;
    case LinearRole::Replicated:
      be_.linear_forward(y, x, W, b, rows, in, out, gelu_out, g);
      return;
  }
}

void TensorParallelBase::linear_backward(LinearRole role, void* dx, float* dW, float* db,
                                         const void* dy, const void* x, const void* W, int rows,
                                         int in, int out, int groups, const void* gelu_pre,
                                         Gelu g, float* gelu_db, const Fp8LinearMeta* fp8) {
  Fp8Scope f8(*this, fp8, role);
  VG_CHECK(gelu_pre == nullptr || role == LinearRole::Column || role == LinearRole::Row,
           "a GELU backward fused into an embedding, head or replicated Linear");
  VG_CHECK(gelu_db == nullptr || (role == LinearRole::Row && dx && gelu_pre &&
                                  fusions().gelu_bias_in_row_backward),
           "a GELU bias gradient without a Row Linear's dx and GELU backward in this mode");
  switch (role) {
    case LinearRole::Column:
    case LinearRole::Row:
      parallel_backward(role, dx, dW, db, dy, x, W, rows, in, out, groups,
                        dx ? gelu_pre : nullptr, g, gelu_db);
      return;
    case LinearRole::Embed:
      // dx (not needed by the model: the input is pixels) sums over the output columns
      be_.linear_backward(dx, dW, db, dy, x, W, rows, in, out / hq_);
      if (dx && hq_ > 1)
        coll_.allreduce(dx, static_cast<size_t>(rows) * in, Elem::Act, ReduceOp::Sum, hidden_);
      return;
    case LinearRole::Head:
      // dy (whole logits gradient) is the same on every hidden rank: dx is this rank's
      // columns, dW its column block, db whole (identical over the hidden axis).
      be_.linear_backward(dx, dW, db, dy, x, W, rows, in / hq_, out);
      return;
    case LinearRole::Replicated:
      be_.linear_backward(dx, dW, db, dy, x, W, rows, in, out);
      return;
  }
}

// ---- LayerNorm with the statistics reduced over the hidden axis

// The FP8 copy goes where local_forward's scratch puts x's (slot 12, asked for the Linear's
// own size, so the same buffer the Linear then gets).
void TensorParallelBase::layernorm_forward_fp8(void* res, float* mean, float* rstd,
                                               const void* a, const void* b, const void* gamma,
                                               const void* beta, int rows, int C, float eps,
                                               RowFactors bf, const Fp8LinearMeta& next, int in,
                                               int out) {
  VG_CHECK(fusions().fp8_layernorm_cast && hq_ == 1 && in == C && next.x_cast && !next.x_gelu,
           "a LayerNorm writing FP8 in tensor mode " << tensor_mode_name(mode()) << " (in " << in
                                                     << ", C " << C << ")");
  auto* s = static_cast<uint8_t*>(scratch(12, fp8_linear_scratch_bytes(rows, in, out)));
  using M = Fp8LinearMeta;
  be_.add_layernorm_forward_fp8(res, s, next.x_t, next.amax_of(M::kX), next.scale_of(M::kX),
                                Fp8Format::E4M3, mean, rstd, a, b, gamma, beta, rows, C, eps, bf);
}

// The codes go where local_backward's scratch puts dy's (slot 12, asked for qkv's own size, so
// the same buffer the Linear then gets).
void TensorParallelBase::attention_backward_fp8(void* dqkv, const void* dout, const void* qkv,
                                                const void* att, const void* saved, int B, int T,
                                                int H, int hd, void* workspace,
                                                const Fp8LinearMeta& prev, float* db) {
  VG_CHECK(fusions().fp8_attention_dy_cast && prev.dy_cast && !prev.dy_gelu,
           "an attention backward writing FP8 in tensor mode " << tensor_mode_name(mode()));
  const int rows = B * T, C = H * hd;
  auto* s = static_cast<uint8_t*>(scratch(12, fp8_linear_scratch_bytes(rows, C, 3 * C)));
  const Fp8DyCodes codes = fp8_linear_dy_codes(s, rows, 3 * C);
  using M = Fp8LinearMeta;
  be_.attention_backward_fp8(dqkv, codes.dy, codes.dy_t, prev.amax_of(M::kDy),
                             prev.scale_of(M::kDy), Fp8Format::E5M2, db, dout, qkv, att, saved,
                             B, T, H, hd, workspace);
}

void TensorParallelBase::layernorm_forward(void* res, void* y, float* mean, float* rstd,
                                           const void* a, const void* b, const void* gamma,
                                           const void* beta, int rows, int C, float eps,
                                           RowFactors bf) {
  if (hq_ == 1) {
    be_.add_layernorm_forward(res, y, mean, rstd, a, b, gamma, beta, rows, C, eps, bf);
    return;
  }
  VG_CHECK(!bf.f, "row factors on a LayerNorm whose rows are split over ranks");
  // Two-pass statistics as in the fused op, each pass's per-row partial sums (fp32, in the
  // mean / rstd buffers themselves) reduced over the hidden axis between the backend ops.
  const int Cl = C / hq_;
  const size_t n = static_cast<size_t>(rows) * Cl;
  if (b)
    be_.add(res, a, b, n);  // rounded to the act dtype before the statistics see it
  else if (res != a)
    be_.copy(res, a, n * be_.act_size());
  be_.layernorm_split_sums(mean, res, rows, Cl);
  coll_.allreduce(mean, rows, Elem::F32, ReduceOp::Sum, hidden_);
  be_.layernorm_split_centered(rstd, mean, res, rows, Cl, C);
  coll_.allreduce(rstd, rows, Elem::F32, ReduceOp::Sum, hidden_);
  be_.layernorm_split_apply(y, rstd, res, mean, gamma, beta, rows, Cl, C, eps);
}

void TensorParallelBase::layernorm_backward(void* dx, float* dgamma, float* dbeta,
                                            const void* dy, const void* x, const void* gamma,
                                            const float* mean, const float* rstd, int rows,
                                            int C, float* dsum, void* dbranch,
                                            RowFactors bf) {
  VG_CHECK(dsum == nullptr || (hq_ == 1 && fusions().row_bias_in_layernorm_backward),
           "a Row bias gradient from the LayerNorm backward in a mode that splits the Stream");
  VG_CHECK(!bf.f || hq_ == 1, "row factors on a LayerNorm whose rows are split over ranks");
  if (hq_ == 1) {
    be_.layernorm_backward(dx, dgamma, dbeta, dy, x, gamma, mean, rstd, rows, C, dsum, dbranch,
                           bf);
    return;
  }
  // per row: sum(g) and sum(g xhat) over the whole width (g = dy gamma), reduced over the
  // hidden axis; dgamma/dbeta are this rank's columns already
  const int Cl = C / hq_;
  float* sums = static_cast<float*>(scratch(0, sizeof(float) * 2 * static_cast<size_t>(rows)));
  be_.layernorm_split_backward_sums(sums, dgamma, dbeta, dy, x, gamma, mean, rstd, rows, Cl);
  coll_.allreduce(sums, 2 * static_cast<size_t>(rows), Elem::F32, ReduceOp::Sum, hidden_);
  be_.layernorm_split_backward_dx(dx, dy, x, gamma, mean, rstd, sums, rows, Cl, C);
}

// The codes go where local_backward's scratch puts dy's (slot 12, asked for the Linear's own
// size, so the same buffer the Linear then gets).
void TensorParallelBase::layernorm_backward_fp8(void* dx, float* dgamma, float* dbeta,
                                                const void* dy, const void* x, const void* gamma,
                                                const float* mean, const float* rstd, int rows,
                                                int C, float* dsum, void* dbranch, RowFactors bf,
                                                const Fp8LinearMeta& prev, int in, int out) {
  VG_CHECK(fusions().fp8_layernorm_dy_cast && hq_ == 1 && out == C && prev.dy_cast &&
               !prev.dy_gelu,
           "a LayerNorm backward writing FP8 in tensor mode " << tensor_mode_name(mode())
                                                              << " (out " << out << ", C " << C
                                                              << ")");
  auto* s = static_cast<uint8_t*>(scratch(12, fp8_linear_scratch_bytes(rows, in, out)));
  const Fp8DyCodes codes = fp8_linear_dy_codes(s, rows, out);
  using M = Fp8LinearMeta;
  be_.layernorm_backward_fp8(dx, dgamma, dbeta, dy, x, gamma, mean, rstd, rows, C, dsum, dbranch,
                             bf, codes.dy, codes.dy_t, prev.amax_of(M::kDy),
                             prev.scale_of(M::kDy), Fp8Format::E5M2);
}

// ---- per-sample results

void TensorParallelBase::sum_over_batch(double* v, int n) {
  // host doubles: MPI on the axis communicator (valid whatever the backend)
  for (Axis a : batch_axes_split()) {
    WatchdogWait w("an MPI all-reduce of per-sample sums", axis_name(a));
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_DOUBLE, MPI_SUM, grid_.comm(a).get()));
  }
}

void TensorParallelBase::sum_over_batch_device(double* v, int n) {
  for (Axis a : batch_axes_split()) coll_.allreduce(v, n, Elem::F64, ReduceOp::Sum, a);
}

void TensorParallelBase::gather_batch(void* out, const void* in, int batch, int64_t row_elems) {
  const size_t es = be_.act_size();
  const size_t local = static_cast<size_t>(batch / bsplit_) * row_elems;
  if (bsplit_ == 1) {
    if (out != in) be_.copy(out, in, local * es);
    return;
  }
  // Minor axis first: after gathering over axes 0..i the buffer holds the blocks of every
  // rank that differs from this one in those axes only, in block-index order.
  const void* src = in;
  size_t n = local;
  int slot = 1;
  for (Axis a : batch_axes_) {
    if (size(a) == 1) continue;
    void* dst = scratch(slot, n * size(a) * es);
    coll_.allgather(dst, src, n, Elem::Act, a);
    n *= size(a);
    src = dst;
    slot = slot == 1 ? 2 : 1;
  }
  be_.copy(out, src, n * es);
}

// ---- gradients and norms

void TensorParallelBase::reduce_param_norms(std::vector<double>& sq) {
  VG_CHECK(sq.size() == sharded_.size(),
           sq.size() << " norms for " << sharded_.size() << " registered parameters");
  // Sequential sums over each axis: summing over A then over B sums over A x B.
  std::vector<double> v(sq.size());
  for (Axis a : mode_axes_) {
    bool any = false;
    for (size_t i = 0; i < sq.size(); ++i) {
      v[i] = contains(sharded_[i], a) ? sq[i] : 0.0;
      any = any || contains(sharded_[i], a);
    }
    if (!any) continue;  // the same verdict on every rank of the axis: same parameter list
    WatchdogWait w("the MPI all-reduce of sharded parameter norms", axis_name(a));
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE,
                            MPI_SUM, grid_.comm(a).get()));
    for (size_t i = 0; i < sq.size(); ++i)
      if (contains(sharded_[i], a)) sq[i] = v[i];
  }
}

bool TensorParallelBase::counts_in_norm(size_t i) const {
  VG_CHECK(i < sharded_.size(), "parameter " << i << " of " << sharded_.size() << " registered");
  for (Axis a : mode_axes_)
    if (!contains(sharded_[i], a) && rank(a) != 0) return false;
  return true;
}

void TensorParallelBase::reduce_norm_total(double* total) {
  for (Axis a : mode_axes_) coll_.allreduce(total, 1, Elem::F64, ReduceOp::Sum, a);
}

void TensorParallelBase::reduce_replicated_grads(float* grads,
                                                 const std::vector<ParamInfo>& params) {
  VG_CHECK(params.size() == sharded_.size(),
           params.size() << " parameters, " << sharded_.size() << " registered");
  for (size_t i = 0; i < mode_axes_.size(); ++i) {
    const Axis a = mode_axes_[i];
    const auto& ranges = partial_ranges_[i];
    if (ranges.empty()) continue;
    if (ranges.size() == 1) {  // one range: summed in place
      coll_.allreduce(grads + ranges[0].first, ranges[0].second, Elem::F32, ReduceOp::Sum, a);
      continue;
    }
    // pack the partial gradients, one allreduce, unpack
    float* buf = static_cast<float*>(scratch(3, elems(ranges) * sizeof(float)));
    size_t off = 0;
    for (const auto& r : ranges) {
      be_.copy(buf + off, grads + r.first, r.second * sizeof(float));
      off += r.second;
    }
    coll_.allreduce(buf, off, Elem::F32, ReduceOp::Sum, a);
    off = 0;
    for (const auto& r : ranges) {
      be_.copy(grads + r.first, buf + off, r.second * sizeof(float));
      off += r.second;
    }
  }
}

}  // namespace vitgrid
