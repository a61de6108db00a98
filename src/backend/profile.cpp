// Generated once from backend.h's op list: every op forwards to the inner backend; the
// timed ones (everything that launches work) synchronise after the call.
#include "vitgrid/backend/profile.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "vitgrid/core/log.h"

namespace vitgrid {
namespace {

class Profiled final : public ProfiledBackend {
 public:
  explicit Profiled(std::unique_ptr<Backend> b) : b_(std::move(b)) {}
  const std::map<std::string, OpTime>& times() const override { return t_; }
  void reset() override { t_.clear(); }
  void set_enabled(bool on) override { on_ = on; }
  std::string name() const override { return b_->name(); }
  bool asynchronous() const override { return b_->asynchronous(); }
  DType act_dtype() const override { return b_->act_dtype(); }
  size_t act_size() const override { return b_->act_size(); }
  void* alloc(size_t bytes) override { return b_->alloc(bytes); }
  void* alloc_comm(size_t bytes) override { return b_->alloc_comm(bytes); }
  void release(void* p) override { b_->release(p); }
  void copy_to_device(void* dst, const void* src_host, size_t bytes) override {
    const double t0 = now_s();
    b_->copy_to_device(dst, src_host, bytes);
    if (on_) {
      b_->synchronize();
      add("copy_to_device", t0);
    }
  }
  void copy_to_host(void* dst_host, const void* src, size_t bytes) override {
    b_->copy_to_host(dst_host, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    const double t0 = now_s();
    b_->copy(dst, src, bytes);
    if (on_) {
      b_->synchronize();
      add("copy", t0);
    }
  }
  void zero(void* p, size_t bytes) override {
    const double t0 = now_s();
    b_->zero(p, bytes);
    if (on_) {
      b_->synchronize();
      add("zero", t0);
    }
  }
  void synchronize() override { b_->synchronize(); }
  void plan_workspace(const WorkspacePlan& p) override { b_->plan_workspace(p); }
  void set_gemm_sm_margin(int sms) override { b_->set_gemm_sm_margin(sms); }
  int gemm_sm_margin() const override { return b_->gemm_sm_margin(); }
  void set_tune_agreement(ReplicaMax f) override { b_->set_tune_agreement(std::move(f)); }
  int64_t device_allocations() const override { return b_->device_allocations(); }
  int mark() override { return b_->mark(); }
  double seconds_between(int a, int b) override { return b_->seconds_between(a, b); }
  void clear_marks() override { b_->clear_marks(); }
  void* staging(int slot, size_t bytes) override { return b_->staging(slot, bytes); }
  void upload_async(int slot, void* dst, size_t bytes) override {
    if (!on_) return b_->upload_async(slot, dst, bytes);
    // timed on its own here; unprofiled, it runs beside the previous batch's compute
    b_->synchronize();
    const double t0 = now_s();
    b_->upload_async(slot, dst, bytes);
    b_->wait_uploads();
    b_->synchronize();
    add("upload_async (overlapped when not profiled)", t0);
  }
  void wait_uploads() override { b_->wait_uploads(); }
  void release_slot(int slot) override { b_->release_slot(slot); }
  size_t peak_memory_bytes() const override { return b_->peak_memory_bytes(); }
  void cast_to_act(void* dst_act, const float* src, size_t n) override {
    const double t0 = now_s();
    b_->cast_to_act(dst_act, src, n);
    if (on_) {
      b_->synchronize();
      add("cast_to_act", t0);
    }
  }
  void cast_to_f32(float* dst, const void* src_act, size_t n) override {
    const double t0 = now_s();
    b_->cast_to_f32(dst, src_act, n);
    if (on_) {
      b_->synchronize();
      add("cast_to_f32", t0);
    }
  }
  void linear_forward(void* y, const void* x, const void* W, const void* b, int N, int in, int out,
                      void* gelu_out, Gelu gelu) override {
    const double t0 = now_s();
    b_->linear_forward(y, x, W, b, N, in, out, gelu_out, gelu);
    if (on_) {
      b_->synchronize();
      add("linear_forward " + std::to_string(in) + "->" + std::to_string(out) +
              (gelu_out ? " +gelu" : ""),
          t0);
    }
  }
  void linear_backward(void* dx, float* dW, float* db, const void* dy, const void* x, const void* W,
                       int N, int in, int out, const void* gelu_pre, Gelu gelu,
                       float* gelu_db) override {
    const double t0 = now_s();
    b_->linear_backward(dx, dW, db, dy, x, W, N, in, out, gelu_pre, gelu, gelu_db);
    if (on_) {
      b_->synchronize();
      add("linear_backward " + std::to_string(in) + "->" + std::to_string(out) +
              (gelu_pre ? (gelu_db ? " +dgelu +dgelu bias" : " +dgelu") : ""),
          t0);
    }
  }
  void gemm_batched(bool transA, bool transB, int M, int N, int K, float alpha, const void* A,
                    int64_t strideA, const void* B, int64_t strideB, float beta, void* C,
                    int64_t strideC, int batch) override {
    const double t0 = now_s();
    b_->gemm_batched(transA, transB, M, N, K, alpha, A, strideA, B, strideB, beta, C, strideC,
                     batch);
    if (on_) {
      b_->synchronize();
      add("gemm_batched", t0);
    }
  }
  void gelu_forward(void* y, const void* x, size_t n, Gelu g) override {
    const double t0 = now_s();
    b_->gelu_forward(y, x, n, g);
    if (on_) {
      b_->synchronize();
      add("gelu_forward", t0);
    }
  }
  void gelu_backward(void* dx, const void* x, const void* dy, size_t n, Gelu g) override {
    const double t0 = now_s();
    b_->gelu_backward(dx, x, dy, n, g);
    if (on_) {
      b_->synchronize();
      add("gelu_backward", t0);
    }
  }
  void gelu_backward_bias(void* dx, const void* x, const void* dy, int rows, int cols, float* db,
                          Gelu g) override {
    const double t0 = now_s();
    b_->gelu_backward_bias(dx, x, dy, rows, cols, db, g);
    if (on_) {
      b_->synchronize();
      add(db ? "gelu_backward + bias gradient" : "gelu_backward", t0);
    }
  }
  void dropout_forward(void* y, const void* x, size_t n, float p, DropoutKey k) override {
    const double t0 = now_s();
    b_->dropout_forward(y, x, n, p, k);
    if (on_) {
      b_->synchronize();
      add("dropout_forward", t0);
    }
  }
  void drop_path_factors(float* out, int samples, DropoutKey k) override {
    const double t0 = now_s();
    b_->drop_path_factors(out, samples, k);
    if (on_) {
      b_->synchronize();
      add("drop_path_factors", t0);
    }
  }
  void dropout_backward(void* dx, const void* dy, size_t n, float p, DropoutKey k) override {
    const double t0 = now_s();
    b_->dropout_backward(dx, dy, n, p, k);
    if (on_) {
      b_->synchronize();
      add("dropout_backward", t0);
    }
  }
  void add(void* y, const void* a, const void* b, size_t n) override {
    const double t0 = now_s();
    b_->add(y, a, b, n);
    if (on_) {
      b_->synchronize();
      add("add", t0);
    }
  }
  void accumulate(void* y, const void* x, size_t n) override {
    const double t0 = now_s();
    b_->accumulate(y, x, n);
    if (on_) {
      b_->synchronize();
      add("accumulate", t0);
    }
  }
  void scale_f32(float* x, size_t n, float s) override {
    const double t0 = now_s();
    b_->scale_f32(x, n, s);
    if (on_) {
      b_->synchronize();
      add("scale_f32", t0);
    }
  }
  void accumulate_f32(float* y, const float* x, size_t n) override {
    const double t0 = now_s();
    b_->accumulate_f32(y, x, n);
    if (on_) {
      b_->synchronize();
      add("accumulate_f32", t0);
    }
  }
  void layernorm_split_sums(float* sum, const void* x, int N, int C) override {
    const double t0 = now_s();
    b_->layernorm_split_sums(sum, x, N, C);
    if (on_) {
      b_->synchronize();
      add("layernorm_split_sums", t0);
    }
  }
  void layernorm_split_centered(float* sq, float* mean, const void* x, int N, int C,
                                int C_total) override {
    const double t0 = now_s();
    b_->layernorm_split_centered(sq, mean, x, N, C, C_total);
    if (on_) {
      b_->synchronize();
      add("layernorm_split_centered", t0);
    }
  }
  void layernorm_split_apply(void* y, float* rstd, const void* x, const float* mean,
                             const void* gamma, const void* beta, int N, int C, int C_total,
                             float eps) override {
    const double t0 = now_s();
    b_->layernorm_split_apply(y, rstd, x, mean, gamma, beta, N, C, C_total, eps);
    if (on_) {
      b_->synchronize();
      add("layernorm_split_apply", t0);
    }
  }
  void layernorm_split_backward_sums(float* sums, float* dgamma, float* dbeta, const void* dy,
                                     const void* x, const void* gamma, const float* mean,
                                     const float* rstd, int N, int C) override {
    const double t0 = now_s();
    b_->layernorm_split_backward_sums(sums, dgamma, dbeta, dy, x, gamma, mean, rstd, N, C);
    if (on_) {
      b_->synchronize();
      add("layernorm_split_backward_sums", t0);
    }
  }
  void layernorm_split_backward_dx(void* dx, const void* dy, const void* x, const void* gamma,
                                   const float* mean, const float* rstd, const float* sums,
                                   int N, int C, int C_total) override {
    const double t0 = now_s();
    b_->layernorm_split_backward_dx(dx, dy, x, gamma, mean, rstd, sums, N, C, C_total);
    if (on_) {
      b_->synchronize();
      add("layernorm_split_backward_dx", t0);
    }
  }
  void add_layernorm_forward(void* res, void* y, float* mean, float* rstd, const void* a,
                             const void* b, const void* gamma, const void* beta, int N, int C,
                             float eps, RowFactors bf) override {
    const double t0 = now_s();
    b_->add_layernorm_forward(res, y, mean, rstd, a, b, gamma, beta, N, C, eps, bf);
    if (on_) {
      b_->synchronize();
      add("add_layernorm_forward", t0);
    }
  }
  void layernorm_backward(void* dx, float* dgamma, float* dbeta, const void* dy, const void* x,
                          const void* gamma, const float* mean, const float* rstd, int N, int C,
                          float* dsum, void* dbranch, RowFactors bf) override {
    const double t0 = now_s();
    b_->layernorm_backward(dx, dgamma, dbeta, dy, x, gamma, mean, rstd, N, C, dsum, dbranch, bf);
    if (on_) {
      b_->synchronize();
      add("layernorm_backward", t0);
    }
  }
  void softmax_forward(void* y, const void* x, int rows, int cols, float scale) override {
    const double t0 = now_s();
    b_->softmax_forward(y, x, rows, cols, scale);
    if (on_) {
      b_->synchronize();
      add("softmax_forward", t0);
    }
  }
  void softmax_backward(void* dx, const void* y, const void* dy, int rows, int cols,
                        float scale) override {
    const double t0 = now_s();
    b_->softmax_backward(dx, y, dy, rows, cols, scale);
    if (on_) {
      b_->synchronize();
      add("softmax_backward", t0);
    }
  }
  size_t attention_saved_bytes(int B, int T, int H, int hd) const override {
    return b_->attention_saved_bytes(B, T, H, hd);
  }
  size_t attention_alignment() const override { return b_->attention_alignment(); }
  size_t attention_workspace_bytes(int B, int T, int H, int hd) const override {
    return b_->attention_workspace_bytes(B, T, H, hd);
  }
  void attention_forward(void* out, void* saved, const void* qkv, int B, int T, int H, int hd,
                         void* workspace) override {
    const double t0 = now_s();
    b_->attention_forward(out, saved, qkv, B, T, H, hd, workspace);
    if (on_) {
      b_->synchronize();
      add("attention_forward", t0);
    }
  }
  void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                          const void* saved, int B, int T, int H, int hd,
                          void* workspace) override {
    const double t0 = now_s();
    b_->attention_backward(dqkv, dout, qkv, out, saved, B, T, H, hd, workspace);
    if (on_) {
      b_->synchronize();
      add("attention_backward", t0);
    }
  }
  void prepare_images(void* out, const uint8_t* images, const void* aug,
                      int B, int S, int pad, const float* mean3_host,
                      const float* std3_host) override {
    const double t0 = now_s();
    b_->prepare_images(out, images, aug, B, S, pad, mean3_host, std3_host);
    if (on_) {
      b_->synchronize();
      add("prepare_images", t0);
    }
  }
  void patchify(void* patches, const void* images, int B, int S, int P) override {
    const double t0 = now_s();
    b_->patchify(patches, images, B, S, P);
    if (on_) {
      b_->synchronize();
      add("patchify", t0);
    }
  }
  void embed_tokens(void* x, const void* patch_tokens, const void* cls, const void* pos, int B,
                    int T, int C) override {
    const double t0 = now_s();
    b_->embed_tokens(x, patch_tokens, cls, pos, B, T, C);
    if (on_) {
      b_->synchronize();
      add("embed_tokens", t0);
    }
  }
  void embed_tokens_backward(void* dpatch_tokens, float* dcls, float* dpos, const void* dx, int B,
                             int T, int C) override {
    const double t0 = now_s();
    b_->embed_tokens_backward(dpatch_tokens, dcls, dpos, dx, B, T, C);
    if (on_) {
      b_->synchronize();
      add("embed_tokens_backward", t0);
    }
  }
  void gather_cls(void* rows, const void* x, int B, int T, int C) override {
    const double t0 = now_s();
    b_->gather_cls(rows, x, B, T, C);
    if (on_) {
      b_->synchronize();
      add("gather_cls", t0);
    }
  }
  void scatter_cls_backward(void* dx, const void* drows, int B, int T, int C) override {
    const double t0 = now_s();
    b_->scatter_cls_backward(dx, drows, B, T, C);
    if (on_) {
      b_->synchronize();
      add("scatter_cls_backward", t0);
    }
  }
  void cross_entropy(float* losses, void* dlogits, const void* logits, const int32_t* labels,
                     const float* soft_targets, int N, int K, float smoothing,
                     float grad_scale) override {
    const double t0 = now_s();
    b_->cross_entropy(losses, dlogits, logits, labels, soft_targets, N, K, smoothing, grad_scale);
    if (on_) {
      b_->synchronize();
      add("cross_entropy", t0);
    }
  }
  void topk_correct(float* correct1, float* correct5, const void* logits, const int32_t* labels,
                    int N, int K) override {
    const double t0 = now_s();
    b_->topk_correct(correct1, correct5, logits, labels, N, K);
    if (on_) {
      b_->synchronize();
      add("topk_correct", t0);
    }
  }
  void sum_squares(double* out_host, const float* buf,
                   const std::vector<ParamSlice>& slices) override {
    b_->sum_squares(out_host, buf, slices);
  }
  double sum(const float* x, size_t n) override { return b_->sum(x, n); }
  bool all_finite(const float* x, size_t n) override { return b_->all_finite(x, n); }
  void sum_into(double* acc, const float* x, size_t n) override { b_->sum_into(acc, x, n); }
  void sum_squares_total(double* out, const float* buf,
                         const std::vector<ParamSlice>& slices) override {
    const double t0 = now_s();
    b_->sum_squares_total(out, buf, slices);
    if (on_) {
      b_->synchronize();
      add("grad_norm", t0);
    }
  }
  void clip_factor(float* out, const double* sq, double max_norm, float inv_scale) override {
    b_->clip_factor(out, sq, max_norm, inv_scale);
  }
  void readback_start(int slot, const void* src, size_t bytes) override {
    b_->readback_start(slot, src, bytes);
  }
  const void* readback_wait(int slot) override { return b_->readback_wait(slot); }
  void adamw_update(float* p, const float* g, float* m, float* v,
                    const std::vector<ParamSlice>& slices, const AdamParams& a) override {
    const double t0 = now_s();
    b_->adamw_update(p, g, m, v, slices, a);
    if (on_) {
      b_->synchronize();
      add("adamw_update", t0);
    }
  }
  void lamb_direction(float* u, const float* p, const float* g, float* m, float* v,
                      const std::vector<ParamSlice>& slices, const AdamParams& a) override {
    const double t0 = now_s();
    b_->lamb_direction(u, p, g, m, v, slices, a);
    if (on_) {
      b_->synchronize();
      add("lamb_direction", t0);
    }
  }
  void lamb_apply(float* p, const float* u, const std::vector<ParamSlice>& slices,
                  const std::vector<float>& ratio_host, float lr) override {
    const double t0 = now_s();
    b_->lamb_apply(p, u, slices, ratio_host, lr);
    if (on_) {
      b_->synchronize();
      add("lamb_apply", t0);
    }
  }
  void sgd_update(float* p, const float* g, float* mom, const std::vector<ParamSlice>& slices,
                  float lr, float momentum, bool nesterov, float grad_scale,
                  const float* grad_scale_dev) override {
    const double t0 = now_s();
    b_->sgd_update(p, g, mom, slices, lr, momentum, nesterov, grad_scale, grad_scale_dev);
    if (on_) {
      b_->synchronize();
      add("sgd_update", t0);
    }
  }

 private:
  void add(const std::string& op, double t0) {
    OpTime& o = t_[op];
    o.seconds += now_s() - t0;
    ++o.calls;
  }
  std::unique_ptr<Backend> b_;
  std::map<std::string, OpTime> t_;
  bool on_ = false;
};

}  // namespace

std::unique_ptr<ProfiledBackend> make_profiled(std::unique_ptr<Backend> inner) {
  return std::make_unique<Profiled>(std::move(inner));
}

std::string ProfiledBackend::table(int steps) const {
  std::vector<std::pair<std::string, OpTime>> v(times().begin(), times().end());
  std::sort(v.begin(), v.end(),
            [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  double total = 0.0;
  for (const auto& e : v) total += e.second.seconds;
  std::string s = "| op | calls/step | ms/step | share |\n|---|---|---|---|\n";
  char buf[160];
  for (const auto& e : v) {
    std::snprintf(buf, sizeof buf, "| %s | %.0f | %.3f | %.1f%% |\n", e.first.c_str(),
                  double(e.second.calls) / steps, 1e3 * e.second.seconds / steps,
                  100.0 * e.second.seconds / std::max(total, 1e-12));
    s += buf;
  }
  std::snprintf(buf, sizeof buf, "| total (synchronised per op) | | %.3f | 100%% |\n",
                1e3 * total / steps);
  s += buf;
  return s;
}

}  // namespace vitgrid
