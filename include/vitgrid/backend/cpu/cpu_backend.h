// The CPU backend: the reference implementation of the op set (OpenBLAS GEMMs plus plain,
// single-threaded loops; each MPI rank is one core). With act = BF16 or F16 it emulates
// 16-bit activations: storage stays fp32 (act_size() == 4) but every act-dtype result is
// rounded to the 16-bit format (see emulate16.h); fp32 outputs (weight gradients, master
// weights, optimizer state, layernorm statistics, losses) are not rounded.
//
// Conventions beyond backend.h, fixed here so the CUDA backend can match them:
//  * topk_correct ranks a label by (logit descending, index ascending): its rank is the number
//    of logits strictly greater plus the number of equal logits at a smaller index. So on a
//    tie the first maximum wins top-1, and a label is in the top-k iff its rank < k.
//  * cross_entropy: a label outside [0, K) gives that row a NaN loss and NaN gradient (as on
//    CUDA; a throw on one rank would hang the others), caught by the trainer's all_finite.
//    The gradient is exact also for targets that do not sum to one:
//    dlogits = (p * sum(target) - target) * grad_scale.
//  * attention: saved holds the softmax probabilities [B,H,T,T] rounded to the act dtype
//    (as the CUDA fallback path stores them), and the forward's P V uses those rounded values.
//  * sgd_update: the momentum buffer is zero-initialised by the caller; b = mu*0 + d_p on the
//    first step equals PyTorch's "buffer = clone(d_p)", so the sequence matches PyTorch from
//    step 1 with dampening 0.
//  * prepare_images: out[b,c,y,x] takes padded pixel (dy + y, dx + xs) with xs = S-1-x when
//    flipped, else x (crop, then flip the crop, as RandomCrop then RandomHorizontalFlip);
//    padding pixels are 0 in the 0-255 image, i.e. (0 - mean)/std after normalisation; Mixup
//    mixes the normalised images.
#pragma once
#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "vitgrid/backend/backend.h"

namespace vitgrid {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(DType act = DType::F32);
  ~CpuBackend() override;
  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  std::string name() const override { return "cpu"; }
  DType act_dtype() const override { return act_; }
  size_t act_size() const override { return sizeof(float); }
  bool asynchronous() const override { return false; }

  void* alloc(size_t bytes) override;
  void release(void* p) override;
  void copy_to_device(void* dst, const void* src_host, size_t bytes) override;
  void copy_to_host(void* dst_host, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void zero(void* p, size_t bytes) override;
  void synchronize() override {}
  int mark() override;
  double seconds_between(int a, int b) override;
  void clear_marks() override { marks_.clear(); }
  void* staging(int slot, size_t bytes) override;
  void upload_async(int slot, void* dst, size_t bytes) override;
  void wait_uploads() override {}
  void release_slot(int) override {}
  size_t peak_memory_bytes() const override;
  int64_t device_allocations() const override {
    std::lock_guard<std::mutex> lock(mem_mutex_);
    return allocations_;
  }
  size_t current_memory_bytes() const;

  void cast_to_act(void* dst_act, const float* src, size_t n) override;
  void cast_to_f32(float* dst, const void* src_act, size_t n) override;

  void linear_forward(void* y, const void* x, const void* W, const void* b, int N, int in,
                      int out, void* gelu_out = nullptr, Gelu gelu = Gelu::Exact) override;
  void linear_backward(void* dx, float* dW, float* db, const void* dy, const void* x,
                       const void* W, int N, int in, int out, const void* gelu_pre = nullptr,
                       Gelu gelu = Gelu::Exact, float* gelu_db = nullptr) override;
  void gemm_batched(bool transA, bool transB, int M, int N, int K, float alpha, const void* A,
                    int64_t strideA, const void* B, int64_t strideB, float beta, void* C,
                    int64_t strideC, int batch) override;

  void gelu_forward(void* y, const void* x, size_t n, Gelu g) override;
  void gelu_backward(void* dx, const void* x, const void* dy, size_t n, Gelu g) override;
  void gelu_backward_bias(void* dx, const void* x, const void* dy, int rows, int cols, float* db,
                          Gelu g) override;
  void dropout_forward(void* y, const void* x, size_t n, float p, DropoutKey k) override;
  void drop_path_factors(float* out, int samples, DropoutKey k) override;
  void dropout_backward(void* dx, const void* dy, size_t n, float p, DropoutKey k) override;
  void add(void* y, const void* a, const void* b, size_t n) override;
  void accumulate(void* y, const void* x, size_t n) override;
  void scale_f32(float* x, size_t n, float s) override;

  void add_layernorm_forward(void* res, void* y, float* mean, float* rstd, const void* a,
                             const void* b, const void* gamma, const void* beta, int N, int C,
                             float eps, RowFactors bf = {}) override;
  void layernorm_backward(void* dx, float* dgamma, float* dbeta, const void* dy, const void* x,
                          const void* gamma, const float* mean, const float* rstd, int N, int C,
                          float* dsum = nullptr, void* dbranch = nullptr,
                          RowFactors bf = {}) override;
  void softmax_forward(void* y, const void* x, int rows, int cols, float scale) override;
  void softmax_backward(void* dx, const void* y, const void* dy, int rows, int cols,
                        float scale) override;

  size_t attention_saved_bytes(int B, int T, int H, int hd) const override;
  size_t attention_workspace_bytes(int B, int T, int H, int hd) const override;
  void attention_forward(void* out, void* saved, const void* qkv, int B, int T, int H, int hd,
                         void* workspace) override;
  void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                          const void* saved, int B, int T, int H, int hd,
                          void* workspace) override;

  void prepare_images(void* out, const uint8_t* images, const void* aug, int B, int S,
                      int pad, const float* mean3_host, const float* std3_host) override;
  void patchify(void* patches, const void* images, int B, int S, int P) override;
  void embed_tokens(void* x, const void* patch_tokens, const void* cls, const void* pos, int B,
                    int T, int C) override;
  void embed_tokens_backward(void* dpatch_tokens, float* dcls, float* dpos, const void* dx,
                             int B, int T, int C) override;
  void gather_cls(void* rows, const void* x, int B, int T, int C) override;
  void scatter_cls_backward(void* dx, const void* drows, int B, int T, int C) override;

  void cross_entropy(float* losses, void* dlogits, const void* logits, const int32_t* labels,
                     const float* soft_targets, int N, int K, float smoothing,
                     float grad_scale) override;
  void topk_correct(float* correct1, float* correct5, const void* logits,
                    const int32_t* labels, int N, int K) override;

  void sum_squares(double* out_host, const float* buf,
                   const std::vector<ParamSlice>& slices) override;
  double sum(const float* x, size_t n) override;
  bool all_finite(const float* x, size_t n) override;
  void sum_into(double* acc, const float* x, size_t n) override;
  void sum_squares_total(double* out, const float* buf,
                         const std::vector<ParamSlice>& slices) override;
  void clip_factor(float* out, const double* sq, double max_norm, float inv_scale) override;
  void readback_start(int slot, const void* src, size_t bytes) override;
  const void* readback_wait(int slot) override;

  void adamw_update(float* p, const float* g, float* m, float* v,
                    const std::vector<ParamSlice>& slices, const AdamParams& a) override;
  void lamb_direction(float* u, const float* p, const float* g, float* m, float* v,
                      const std::vector<ParamSlice>& slices, const AdamParams& a) override;
  void lamb_apply(float* p, const float* u, const std::vector<ParamSlice>& slices,
                  const std::vector<float>& ratio_host, float lr) override;
  void sgd_update(float* p, const float* g, float* mom, const std::vector<ParamSlice>& slices,
                  float lr, float momentum, bool nesterov, float grad_scale,
                  const float* grad_scale_dev = nullptr) override;

  // Tensor-parallel ops (cpu_tp_ops.cpp): fp32 accumulation of reduced weight
  // gradients and the LayerNorm of rows split over ranks.
  void accumulate_f32(float* y, const float* x, size_t n) override;
  void layernorm_split_sums(float* sum, const void* x, int N, int C) override;
  void layernorm_split_centered(float* sq, float* mean, const void* x, int N, int C,
                                int C_total) override;
  void layernorm_split_apply(void* y, float* rstd, const void* x, const float* mean,
                             const void* gamma, const void* beta, int N, int C, int C_total,
                             float eps) override;
  void layernorm_split_backward_sums(float* sums, float* dgamma, float* dbeta, const void* dy,
                                     const void* x, const void* gamma, const float* mean,
                                     const float* rstd, int N, int C) override;
  void layernorm_split_backward_dx(void* dx, const void* dy, const void* x, const void* gamma,
                                   const float* mean, const float* rstd, const float* sums,
                                   int N, int C, int C_total) override;

 private:
  // Rounds an act-dtype result in place (no-op in fp32 mode).
  void round_act(float* p, size_t n) const;
  // out[cols] += the column sums of the row-major x[rows, cols] (the bias gradients).
  static void add_column_sums(float* out, const float* x, int rows, int cols);

  DType act_;
  mutable std::mutex mem_mutex_;  // alloc/release may come from the loader thread too
  std::unordered_map<void*, size_t> live_;
  size_t current_bytes_ = 0;
  int64_t allocations_ = 0;  // alloc() calls
  size_t peak_bytes_ = 0;
  std::vector<double> marks_;  // host clock at each mark()
  std::vector<std::vector<unsigned char>> staging_;  // host areas of the upload slots
  std::vector<std::vector<char>> readback_;           // readback_start copies
};

}  // namespace vitgrid
