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

  // the op set both backends implement (cpu_*.cpp)
  #include "vitgrid/backend/backend_op_overrides.inc"

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
