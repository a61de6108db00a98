// The tensor-parallel seam. The model is written once against this interface; each mode
// (none, 1d, 2d, 2.5d, 3d) is one implementation in its own folder under src/parallel/,
// chosen once from the grid's mode by make_tensor_parallel. A strategy decides how every
// parameter is sharded, which block of every activation a rank holds, and which collectives
// a Linear, a LayerNorm, the loss and the gradient/norm reductions need.
//
// This interface is what the model calls; the strategy calls the backend and the grid's
// Collectives. Kernels never know about ranks and the model never calls MPI, nor branches on
// the mode: everything layout-dependent is a method here.
//
// Activation layouts. The model holds two kinds of activations, each a block of the global
// [batch, tokens, width] tensor (whole samples: attention needs every token of a sample):
//   Stream: the residual stream and everything of its shape (LayerNorm in/out, proj/fc2 out,
//           patch tokens, class-token rows);
//   Inner:  the outputs of Column Linears (qkv per q/k/v group, fc1, GELU) and the attention
//           output that feeds a Row Linear.
// act_block() says which samples and which columns of the global width this rank holds.
//   none/1d  Stream: all samples, all columns. Inner: 1d splits columns over the tensor axis.
//   2d/2.5d  both: batch split over (depth, col), columns split over the row axis.
//   3d       Stream and Inner differ (Linear layers alternate their input/output groups).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/fp8_linear.h"
#include "vitgrid/grid/grid.h"

namespace vitgrid {

// The role of a Linear in the model, which tells a strategy how to split it.
//   Column:     consumes the Stream, produces Inner (qkv, fc1; Megatron column-parallel).
//   Row:        consumes Inner, produces the Stream (proj, fc2; Megatron row-parallel).
//   Embed:      input features whole on every rank (patch pixels), output in the Stream
//               layout (patch embedding).
//   Head:       input in the Stream layout, output whole on every rank of the sample
//               (classifier: logits [samples, classes]).
//   Replicated: the whole Linear on every rank, no communication.
enum class LinearRole : int { Column = 0, Row = 1, Replicated = 2, Embed = 3, Head = 4 };

enum class ActLayout : int { Stream = 0, Inner = 1 };

// This rank's block of a global [batch, tokens, width] activation.
struct ActBlock {
  int samples = 0;         // local samples
  int sample_offset = 0;   // global index (within the micro-batch) of local sample 0
  int64_t cols = 0;        // local columns
  int64_t col_offset = 0;  // global column of local column 0
};

// Where a parameter's local shard sits in the global tensor: the checkpoint hyperslab.
struct Shard {
  std::vector<int64_t> offset;
  std::vector<int64_t> count;
  // Optional strided selection (HDF5 semantics: `count` blocks of `block` spaced `stride`),
  // e.g. a 1d shard of qkv.weight is three row blocks, one each of q, k and v. Empty: one
  // contiguous block of `count`. The local buffer is row-major over the selected elements in
  // global order.
  std::vector<int64_t> stride;
  std::vector<int64_t> block;
  // Axes over which this shard is replicated: only coordinate 0 of them writes it to a
  // checkpoint.
  std::vector<Axis> replicated_over;
  // Axes whose ranks hold different pieces of the parameter: per-parameter sums of squares
  // (clipping, LAMB trust ratios) are summed over these.
  std::vector<Axis> sharded_over;
  // Axes over which this rank's gradient is only a partial sum (its activations hold part of
  // the batch): reduce_replicated_grads sums the gradient over them. A subset of
  // replicated_over; a replicated parameter whose gradient is already whole on every rank
  // (1d LayerNorms: every tensor rank sees the whole batch) lists nothing here.
  std::vector<Axis> partial_over;

  // Local elements (count, times block when strided).
  size_t numel() const {
    size_t n = 1;
    for (size_t d = 0; d < count.size(); ++d)
      n *= static_cast<size_t>(count[d] * (block.empty() ? 1 : block[d]));
    return n;
  }
  // Global coordinate along dim d of local index l (0 <= l < local extent of d).
  int64_t global_coord(size_t d, int64_t l) const {
    if (block.empty()) return offset[d] + l;
    return offset[d] + (l / block[d]) * stride[d] + l % block[d];
  }
  int64_t local_extent(size_t d) const { return count[d] * (block.empty() ? 1 : block[d]); }
};

struct ParamInfo;

// What a strategy's layer calls accept beyond their plain forms: the fusions a block plan
// (model/block_plan.h) may choose. Declared by the strategy, read by the plan compiler only.
struct TpFusions {
  // linear_backward of a Row Linear takes gelu_db (the modes whose Column backward sums its
  // bias gradient over the rank's own dy block: none, 1d, 2d, 2.5d)
  bool gelu_bias_in_row_backward = false;
  // layernorm_backward takes dsum (the modes whose Stream is whole on every rank and whose
  // Row Linear sums its whole bias gradient over that dy: none, 1d)
  bool row_bias_in_layernorm_backward = false;
  // the LayerNorms take per-row factors on their branch (drop path fused into them): the
  // modes whose Stream rows are whole on every rank (none, 1d)
  bool layernorm_row_factors = false;
  // row_forward_produced / row_backward_consumed work in this many equal parts of the samples
  // (1d sequence parallelism: the tensor ranks'); 1: produce everything, then the Linear
  int row_parts = 1;
  // the Column and Row Linears run in FP8 when given a scaling (the linear calls' fp8): the
  // modes whose local GEMMs are whole Linears over a rank's rows (none, 1d)
  bool fp8 = false;
  // an FP8 Column Linear's backward takes gelu_pre as its dy's (Fp8LinearMeta::dy_gelu: fc1's
  // dy cast applies GELU's backward): the modes that hand gelu_pre and dy to one local
  // backward unsliced (none)
  bool fp8_gelu_in_dy_cast = false;
  // an FP8 Linear's forward cast may keep x's transpose for the weight gradient
  // (Fp8LinearMeta::x_t): the modes whose Linears each cast x once, whole, in the forward and
  // take the same rows in the backward (none)
  bool fp8_keep_x_transposes = false;
  // layernorm_forward_fp8: a LayerNorm may write the next FP8 Column Linear's input as that
  // Linear's forward cast would (Fp8LinearMeta::x_cast): the modes whose Column Linear takes
  // the LayerNorm's rows as its local input, whole (none)
  bool fp8_layernorm_cast = false;
  // attention_backward_fp8: the attention backward may write the FP8 Column Linear qkv's
  // output gradient as that Linear's backward cast would (Fp8LinearMeta::dy_cast): the modes
  // whose qkv backward takes the attention's gradient rows as its local dy, whole (none)
  bool fp8_attention_dy_cast = false;
  // layernorm_backward_fp8: a LayerNorm backward may write the output gradient of the FP8 Row
  // Linear before it (the residual branch's last Linear: proj, fc2) as that Linear's backward
  // cast would (Fp8LinearMeta::dy_cast): the modes whose Row Linear takes the LayerNorm's
  // gradient rows as its local dy, whole (none)
  bool fp8_layernorm_dy_cast = false;
};

class TensorParallel {
 public:
  virtual ~TensorParallel() = default;
  virtual TensorMode mode() const = 0;
  virtual TpFusions fusions() const = 0;

  // ---- parameter shards
  // Weight [out, in] and bias [out] of a Linear in role `role`. `groups` > 1 says the output
  // features are `groups` equal, independent groups that must each be split alike (qkv: q, k
  // and v), so the local output is [group 0 local | group 1 local | ...].
  virtual Shard shard_linear_weight(int64_t out, int64_t in, LinearRole role,
                                    int groups = 1) const = 0;
  virtual Shard shard_linear_bias(int64_t out, LinearRole role, int groups = 1) const = 0;
  // A per-hidden tensor whose last dim is the Stream width (LayerNorm weight/bias [C],
  // cls_token [1,1,C], pos_embed [1,T,C]).
  virtual Shard shard_hidden_vector(const std::vector<int64_t>& shape) const = 0;
  // Called once by the model after it built its parameter list (the order of the slices that
  // reduce_param_norms receives and of reduce_replicated_grads' params).
  virtual void register_params(const std::vector<ParamInfo>& params) = 0;
  // Sizes the strategy's own buffers (gathered inputs and weights, partial products, LayerNorm
  // sums) for Linears of these shapes (global features) over at most max_rows local rows, so
  // that the step loop allocates nothing; a larger call later still runs (the buffers grow).
  struct LinearShape {
    LinearRole role;
    int in, out, groups;
  };
  virtual void reserve(int max_rows, const std::vector<LinearShape>& linears) = 0;
  // The FP8 Linears' scratch (their operands' FP8 copies, backend/fp8_linear.h), sized now to
  // the largest call's: the model's largest fp8_linear_scratch_bytes over its Linears' local
  // shapes at the Inner rows.
  virtual void reserve_fp8(size_t bytes) = 0;

  // ---- activation layouts
  // This rank's block of a global [batch, *, width] activation of layout `l`. Throws
  // UserError when `batch` does not split evenly.
  virtual ActBlock act_block(ActLayout l, int batch, int64_t width) const = 0;
  int local_batch(int batch) const { return act_block(ActLayout::Stream, batch, 0).samples; }
  virtual int local_heads(int heads) const = 0;

  // ---- layers. Collective over the tensor group: every rank of Axis::Tensor calls each in
  // the same order. `in` and `out` are the GLOBAL feature counts; `rows` the local rows
  // (local samples x tokens) of the input. With `fp8` (a Column or Row Linear, where
  // fusions().fp8 says so): the rank's GEMMs of the Linear run in FP8 with that scaling
  // (backend/fp8_linear.h); each amax it records is this rank's part of the tensor's, which
  // the caller reduces over the tensor axis (MAX) before the scales are updated.
  // y = x W^T + b. With gelu_out, y keeps the pre-activation and gelu_out = gelu(y).
  virtual void linear_forward(LinearRole role, void* y, const void* x, const void* W,
                              const void* b, int rows, int in, int out, void* gelu_out,
                              Gelu g, int groups = 1, const Fp8LinearMeta* fp8 = nullptr) = 0;
  // dx = dy W (overwritten; skipped when null), dW += dy^T x, db += sum dy (local shards).
  // With gelu_pre (x was gelu(gelu_pre), same layout as dx): dx is the gradient of gelu_pre,
  // fused into the GEMM where the mode's dx needs no reduction (none, 1d Row), else a GELU
  // backward pass after it. With gelu_db too (Row only, where fusions() says so):
  // the GELU backward also adds this rank's share of the bias gradient of the Column Linear
  // that produced gelu_pre into gelu_db (the column sums of its local dx, which is what that
  // Linear's backward would sum), so that Linear's backward is then given no db.
  virtual void linear_backward(LinearRole role, void* dx, float* dW, float* db, const void* dy,
                               const void* x, const void* W, int rows, int in, int out,
                               int groups = 1, const void* gelu_pre = nullptr,
                               Gelu g = Gelu::Exact, float* gelu_db = nullptr,
                               const Fp8LinearMeta* fp8 = nullptr) = 0;
  // A Row Linear (no bias-GELU) whose input x, `samples` whole samples of rows / samples rows,
  // is written by produce(lo, n) (samples [lo, lo + n)) in the parts and order the mode asks
  // for, so that it can send some rows' partial sums while the rest are produced (the model's
  // attention feeding proj: with 1d sequence parallelism at t = 2 the peer's samples first,
  // their partial sums exchanged while this rank's samples' attention runs). The backward's
  // counterpart calls consume(lo, n) once dx's rows of those samples are written (this
  // rank's first, then the peer's as their dy arrives), in fusions().row_parts equal parts.
  // The default: produce everything, then linear_forward; linear_backward, then consume
  // everything.
  using SampleFn = std::function<void(int lo, int n)>;
  virtual void row_forward_produced(void* y, const void* x, const void* W, const void* b,
                                    int rows, int in, int out, int samples,
                                    const SampleFn& produce,
                                    const Fp8LinearMeta* fp8 = nullptr) {
    produce(0, samples);
    linear_forward(LinearRole::Row, y, x, W, b, rows, in, out, nullptr, Gelu::Exact, 1, fp8);
  }
  virtual void row_backward_consumed(void* dx, float* dW, float* db, const void* dy,
                                     const void* x, const void* W, int rows, int in, int out,
                                     int samples, const SampleFn& consume,
                                     const Fp8LinearMeta* fp8 = nullptr) {
    linear_backward(LinearRole::Row, dx, dW, db, dy, x, W, rows, in, out, 1, nullptr,
                    Gelu::Exact, nullptr, fp8);
    consume(0, samples);
  }
  // Fused residual add + LayerNorm over the (global) width C of Stream rows, same contract as
  // Backend::add_layernorm_forward / layernorm_backward; statistics over the whole width.
  // With bf (where fusions() says so): b's rows times their factors, as the backend's.
  virtual void layernorm_forward(void* res, void* y, float* mean, float* rstd, const void* a,
                                 const void* b, const void* gamma, const void* beta, int rows,
                                 int C, float eps, RowFactors bf = {}) = 0;
  // layernorm_forward whose y is not stored: it goes into the FP8 copy of the input of the
  // Column Linear that follows (in x out features on these rows), as that Linear's forward
  // cast would make it (next's x scale and amax, its transpose into next.x_t), where that
  // Linear, called with next.x_cast, finds it (Fp8LinearMeta::x_cast). Where
  // fusions().fp8_layernorm_cast says so.
  virtual void layernorm_forward_fp8(void* res, float* mean, float* rstd, const void* a,
                                     const void* b, const void* gamma, const void* beta,
                                     int rows, int C, float eps, RowFactors bf,
                                     const Fp8LinearMeta& next, int in, int out) = 0;
  // The backend's attention backward of B samples (their qkv [B, T, 3C], output att and
  // saved state; dqkv the act-dtype gradient's buffer, which it may leave unwritten) whose
  // gradient goes into the FP8 copies of the output gradient of qkv, the Column Linear that
  // follows (C in, 3C out features on B T rows), as that Linear's backward cast would make it
  // (prev's dy scale and amax, its transpose, db += the bias gradient), where that Linear,
  // called with prev.dy_cast and no bias gradient, finds it. Where
  // fusions().fp8_attention_dy_cast says so.
  virtual void attention_backward_fp8(void* dqkv, const void* dout, const void* qkv,
                                      const void* att, const void* saved, int B, int T, int H,
                                      int hd, void* workspace, const Fp8LinearMeta& prev,
                                      float* db) = 0;
  // With dsum (where fusions() says so): dsum += the column sums of the updated dx, which is
  // then the whole bias gradient of a Row Linear whose output gradient dx is; that Linear's
  // backward is then given no db. With bf (where fusions() says so):
  // dbranch = the updated dx's rows times their factors, and dsum sums dbranch instead.
  virtual void layernorm_backward(void* dx, float* dgamma, float* dbeta, const void* dy,
                                  const void* x, const void* gamma, const float* mean,
                                  const float* rstd, int rows, int C, float* dsum = nullptr,
                                  void* dbranch = nullptr, RowFactors bf = {}) = 0;
  // layernorm_backward whose updated dx (with bf: dbranch), the output gradient of the FP8
  // Row Linear before the LayerNorm (in x out features on these rows, its bias gradient in
  // dsum), goes into that Linear's FP8 copies of dy as its backward cast would make them
  // (prev's dy scale and amax, the transpose), where that Linear, called with prev.dy_cast and
  // no bias gradient, finds them. Where fusions().fp8_layernorm_dy_cast says so.
  virtual void layernorm_backward_fp8(void* dx, float* dgamma, float* dbeta, const void* dy,
                                      const void* x, const void* gamma, const float* mean,
                                      const float* rstd, int rows, int C, float* dsum,
                                      void* dbranch, RowFactors bf, const Fp8LinearMeta& prev,
                                      int in, int out) = 0;

  // ---- per-sample results. Collective over the tensor group.
  // Sums host values over the ranks holding other samples of the Stream layout, so each
  // tensor rank returns the whole micro-batch's sum (losses, top-k counts).
  virtual void sum_over_batch(double* v, int n) = 0;
  // The same for device doubles (the training loss, summed without the host reading it).
  virtual void sum_over_batch_device(double* v, int n) = 0;
  // out[batch, row_elems] (act dtype) = the Stream blocks in[samples, row_elems] of every
  // rank, in global sample order (logits for predictions). out may alias in.
  virtual void gather_batch(void* out, const void* in, int batch, int64_t row_elems) = 0;

  // ---- gradients and norms. Collective over the tensor group.
  // Sum of squares of the whole (unsharded) parameters: per-slice local sums reduced over the
  // axes each parameter is sharded on (Shard::sharded_over), replicated ones counted once.
  virtual void reduce_param_norms(std::vector<double>& sq) = 0;
  // The same on the device, for a total: a rank adds the squares of registered parameter i
  // into its total only when counts_in_norm(i) (it holds the copy counted for that parameter:
  // rank 0 of every tensor axis the parameter is replicated over); reduce_norm_total then sums
  // a device double over the tensor group, giving the whole parameters' squared norm.
  virtual bool counts_in_norm(size_t i) const = 0;
  virtual void reduce_norm_total(double* total) = 0;
  // Sums the partial gradients of parameters whose Shard::partial_over is not empty (weights
  // shared by ranks that see different samples), so every copy holds the whole gradient.
  virtual void reduce_replicated_grads(float* grads, const std::vector<ParamInfo>& params) = 0;
};

// Chooses the strategy once from the grid's mode: none (tensor = 1), 1d, 2d, 2.5d or 3d, on
// any backend and act dtype (activations are reduced in the act dtype, weight gradients and
// LayerNorm statistics in fp32). Throws UserError for a mode the grid does not name.
// Called by all ranks.
std::unique_ptr<TensorParallel> make_tensor_parallel(const ProcessGrid& grid, Backend& backend,
                                                     Collectives& coll);

}  // namespace vitgrid
