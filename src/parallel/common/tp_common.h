// What every tensor-parallel mode shares: the Stream layout is described by one "hidden" axis
// (over which the Stream's columns are split) and a list of "batch" axes (over which its
// samples are split). From that description this base implements everything that is not a
// Column/Row Linear: the shards of per-hidden vectors, the patch embedding and the head,
// LayerNorm with statistics reduced over the hidden axis, the per-sample sums and gathers,
// and the gradient / norm reductions driven by each Shard's axis lists. A mode (none, 1d,
// 2d/2.5d, 3d) sets the description and implements the Column/Row Linears and act_block.
#pragma once
#include <utility>
#include <vector>

#include "vitgrid/parallel/tensor_parallel.h"

namespace vitgrid {

class TensorParallelBase : public TensorParallel {
 public:
  Shard shard_linear_weight(int64_t out, int64_t in, LinearRole role, int groups) const final;
  Shard shard_linear_bias(int64_t out, LinearRole role, int groups) const final;
  Shard shard_hidden_vector(const std::vector<int64_t>& shape) const override;
  void register_params(const std::vector<ParamInfo>& params) override;
  void reserve(int max_rows, const std::vector<LinearShape>& linears) final;
  void reserve_fp8(size_t bytes) final;

  void linear_forward(LinearRole role, void* y, const void* x, const void* W, const void* b,
                      int rows, int in, int out, void* gelu_out, Gelu g, int groups,
                      const Fp8LinearMeta* fp8) final;
  void linear_backward(LinearRole role, void* dx, float* dW, float* db, const void* dy,
                       const void* x, const void* W, int rows, int in, int out, int groups,
                       const void* gelu_pre, Gelu g, float* gelu_db,
                       const Fp8LinearMeta* fp8) final;
  void layernorm_forward(void* res, void* y, float* mean, float* rstd, const void* a,
                         const void* b, const void* gamma, const void* beta, int rows, int C,
                         float eps, RowFactors bf) override;
  void layernorm_forward_fp8(void* res, float* mean, float* rstd, const void* a, const void* b,
                             const void* gamma, const void* beta, int rows, int C, float eps,
                             RowFactors bf, const Fp8LinearMeta& next, int in, int out) final;
  void attention_backward_fp8(void* dqkv, const void* dout, const void* qkv, const void* att,
                              const void* saved, int B, int T, int H, int hd, void* workspace,
                              const Fp8LinearMeta& prev, float* db) final;
  void layernorm_backward(void* dx, float* dgamma, float* dbeta, const void* dy, const void* x,
                          const void* gamma, const float* mean, const float* rstd, int rows,
                          int C, float* dsum, void* dbranch, RowFactors bf) override;
  void layernorm_backward_fp8(void* dx, float* dgamma, float* dbeta, const void* dy,
                              const void* x, const void* gamma, const float* mean,
                              const float* rstd, int rows, int C, float* dsum, void* dbranch,
                              RowFactors bf, const Fp8LinearMeta& prev, int in, int out) final;
  void sum_over_batch(double* v, int n) override;
  void sum_over_batch_device(double* v, int n) override;
  void gather_batch(void* out, const void* in, int batch, int64_t row_elems) override;
  void reduce_param_norms(std::vector<double>& sq) override;
  bool counts_in_norm(size_t i) const override;
  void reduce_norm_total(double* total) override;
  void reduce_replicated_grads(float* grads, const std::vector<ParamInfo>& params) override;

 protected:
  // `mode_axes`: the tensor sub-axes of this mode (sizes 1 are dropped). `hidden`: the axis
  // the Stream's columns are split over (nullptr-like: pass has_hidden = false when they are
  // not split). `batch_axes`: axes the Stream's samples are split over, minor first (the
  // Stream block index is sum rank(a_i) * prod_{k<i} size(a_k)).
  TensorParallelBase(const ProcessGrid& grid, Backend& be, Collectives& coll,
                     std::vector<Axis> mode_axes, bool has_hidden, Axis hidden,
                     std::vector<Axis> batch_axes);

  // Column / Row Linears of the mode.
  virtual Shard parallel_weight(int64_t out, int64_t in, LinearRole role, int groups) const = 0;
  virtual Shard parallel_bias(int64_t out, LinearRole role, int groups) const = 0;
  virtual void parallel_forward(LinearRole role, void* y, const void* x, const void* W,
                                const void* b, int rows, int in, int out, void* gelu_out, Gelu g,
                                int groups) = 0;
  // The scratch slots parallel_forward / parallel_backward take for this shape, sized now
  // (reserve()); nothing for modes without buffers of their own.
  virtual void reserve_parallel(LinearRole role, int rows, int in, int out, int groups) {
    (void)role, (void)rows, (void)in, (void)out, (void)groups;
  }
  // gelu_pre, gelu_db: see TensorParallel::linear_backward (dx's local block holds rows x
  // in-local).
  virtual void parallel_backward(LinearRole role, void* dx, float* dW, float* db,
                                 const void* dy, const void* x, const void* W, int rows, int in,
                                 int out, int groups, const void* gelu_pre, Gelu g,
                                 float* gelu_db) = 0;

  // This rank's GEMMs of the Column / Row Linear being run (its shapes local): the backend's
  // Linear, or the FP8 layer with the scaling the call was given (fp8_). Modes whose
  // fusions() say fp8 run their Linears' GEMMs through these.
  void local_forward(void* y, const void* x, const void* W, const void* b, int rows, int in,
                     int out, void* gelu_out = nullptr, Gelu g = Gelu::Exact);
  void local_backward(void* dx, float* dW, float* db, const void* dy, const void* x,
                      const void* W, int rows, int in, int out, const void* gelu_pre = nullptr,
                      Gelu g = Gelu::Exact, float* gelu_db = nullptr);
  // Sets fp8_ for the duration of one Linear call (the public calls and the modes' overrides
  // of row_forward_produced / row_backward_consumed); an FP8 scaling only for a Column or Row
  // Linear of a mode that runs them in FP8 (VG_CHECK).
  class Fp8Scope {
   public:
    Fp8Scope(TensorParallelBase& tp, const Fp8LinearMeta* m, LinearRole role);
    ~Fp8Scope() { tp_.fp8_ = nullptr; }
    Fp8Scope(const Fp8Scope&) = delete;
    Fp8Scope& operator=(const Fp8Scope&) = delete;

   private:
    TensorParallelBase& tp_;
  };
  const Fp8LinearMeta* fp8_ = nullptr;

  int size(Axis a) const { return grid_.size(a); }
  int rank(Axis a) const { return grid_.rank(a); }
  // Block `idx` of `nblocks` equal blocks of `batch` samples (UserError when uneven).
  static void split_samples(int batch, int nblocks, int idx, ActBlock* blk);
  // Columns `idx` of `n` equal blocks of `width` (VG_CHECK: the deck guarantees divisibility).
  static void split_cols(int64_t width, int n, int idx, ActBlock* blk);
  ActBlock stream_block(int batch, int64_t width) const;
  // The mode axes minus `except`.
  std::vector<Axis> axes_except(std::initializer_list<Axis> except) const;
  std::vector<Axis> batch_axes_split() const;  // batch axes of size > 1
  // Backend scratch buffer `slot`, grown on demand: shapes are fixed after the first
  // micro-batch, so the step loop stops allocating after step 1. `overlapped`: the slot serves
  // an overlapped collective's gather output or reduce-scatter input
  // (Collectives::overlapped_alloc), whenever it is asked for.
  void* scratch(int slot, size_t bytes, bool overlapped = false);

  const ProcessGrid& grid_;
  Backend& be_;
  Collectives& coll_;
  std::vector<Axis> mode_axes_;
  bool has_hidden_;
  Axis hidden_;
  int hq_ = 1, hr_ = 0;  // hidden split and this rank's column block of the Stream
  // the Stream's rows are whole on every rank (its columns not split): LayerNorms are local
  bool stream_rows_whole() const { return hq_ == 1; }
  std::vector<Axis> batch_axes_;
  int bsplit_ = 1, bidx_ = 0;  // Stream batch split and this rank's block

 private:
  std::vector<std::vector<Axis>> sharded_;  // per registered parameter
  // per mode axis: the flat ranges of the parameters whose gradients are partial over it
  std::vector<std::vector<std::pair<size_t, size_t>>> partial_ranges_;
  void release_scratch(int slot);
  std::vector<void*> scratch_;
  std::vector<size_t> scratch_bytes_;
  std::vector<bool> scratch_overlapped_;  // from Collectives::overlapped_alloc

 public:
  ~TensorParallelBase() override;
};

// Factories of the modes (one folder each).
std::unique_ptr<TensorParallel> make_tensor_parallel_none(const ProcessGrid& grid, Backend& be,
                                                          Collectives& coll);
std::unique_ptr<TensorParallel> make_tensor_parallel_1d(const ProcessGrid& grid, Backend& be,
                                                        Collectives& coll);
std::unique_ptr<TensorParallel> make_tensor_parallel_2d(const ProcessGrid& grid, Backend& be,
                                                        Collectives& coll);
std::unique_ptr<TensorParallel> make_tensor_parallel_2p5d(const ProcessGrid& grid, Backend& be,
                                                          Collectives& coll);
std::unique_ptr<TensorParallel> make_tensor_parallel_3d(const ProcessGrid& grid, Backend& be,
                                                        Collectives& coll);

}  // namespace vitgrid
