// The backend: a device (memory, copies, completion, graphs, timing marks, upload slots) and
// the op set on it (LayerOps, NormAttentionOps, TrainOps). Everything the model, optimizers
// and trainer compute goes through it, implemented once on the CPU (OpenBLAS + loops,
// backend/cpu) and once on CUDA (cuBLASLt, cuDNN, own kernels, backend/cuda). Kernels know
// nothing of ranks.
//
// Conventions
//  * Row-major. "act" pointers (void*) hold act elements of act_size() bytes;
//    float* pointers are always fp32 (gradients of weights, master weights, optimizer state,
//    layernorm statistics, losses). Activation gradients are act dtype too.
//  * A Linear weight is [out, in] (PyTorch), y = x W^T + b.
//  * "+=" in a comment means the op accumulates into that output (weight gradients accumulate
//    over micro-batches; the caller zeroes them once per optimizer step).
//  * All pointers are device pointers of this backend (host pointers on the CPU backend) unless
//    the name ends in _host. Ops are asynchronous on CUDA; only functions returning values to
//    the host, and synchronize(), block.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "vitgrid/backend/fp8.h"
#include "vitgrid/backend/op_profile.h"
#include "vitgrid/core/rng.h"
#include "vitgrid/core/types.h"

namespace vitgrid {

enum class Gelu : int { Exact = 0, Tanh = 1 };

// Dropout is a pure function of (seed, key, element counter): the element with index i of a
// call is kept iff dropout_keep(rng_stream(seed, key), counter_base + i, dropout_threshold(p));
// kept values scale by 1/(1-p). With tensor parallelism a rank holds a column block of a wider
// global row: when cols > 0 the buffer is rows of `cols` local elements, and local element
// (r, c) has the global counter counter_base + r * global_cols + col_offset + c. cols == 0
// means contiguous (counter_base + i).
// With `position` set, the step and the stream position are read from backend memory when the
// call runs, so that a CUDA graph that captured the call replays with the current ones.
// With path_p > 0 the call also drops whole samples (stochastic depth, timm's DropPath): local
// element i belongs to sample path_sample0 + i / path_sample_elems (plus the position where
// set), kept iff drop_path_keep(stream key, sample, dropout_threshold(path_p)); kept samples
// scale by 1/(1-path_p) on top.
struct DropoutKey;
// Per-row factors on a LayerNorm call's residual branch (drop path fused into the LayerNorm,
// Backend::add_layernorm_forward / layernorm_backward): row r of the branch is multiplied by
// f[r / rows_per] as dropout_forward multiplies (the fp32 product rounded to the act dtype;
// a zero factor gives +0). f null: none.
struct RowFactors {
  const float* f = nullptr;
  int rows_per = 1;
};

struct DropoutKey {
  uint64_t seed = 0;
  uint64_t key = 0;           // stream key: (step, layer, site) mixed together
  uint64_t counter_base = 0;  // global index of this call's element 0
  int64_t cols = 0;           // local row length (0: contiguous numbering)
  int64_t global_cols = 0;    // global row length
  int64_t col_offset = 0;     // global column of local column 0
  // {step, stream position} in backend memory, or null. Where set, the call's stream key is
  // key ^ mix64(step_tag ^ mix64(step)) and its element 0 counts counter_base + position *
  // sample_elems (dropout_stream).
  const int64_t* position = nullptr;
  uint64_t step_tag = 0;
  uint64_t sample_elems = 0;
  float path_p = 0.0f;             // drop-path rate (0: none)
  uint64_t path_sample0 = 0;       // global sample of local element 0 (without the position)
  uint64_t path_sample_elems = 0;  // local elements per sample
};

// The stream key and the counter of element 0 of the call k describes (host and device code;
// `position` is dereferenced, so on the device it must point to device memory).
VG_HD void dropout_stream(const DropoutKey& k, uint64_t* key, uint64_t* base) {
  *key = k.key;
  *base = k.counter_base;
  if (k.position) {
    *key ^= mix64(k.step_tag ^ mix64(static_cast<uint64_t>(k.position[0])));
    *base += static_cast<uint64_t>(k.position[1]) * k.sample_elems;
  }
}

// Dropout's draw: one random word per four consecutive counters, 16 bits each: element c is
// kept iff bits [16 (c mod 4), 16 (c mod 4) + 16) of word c / 4 are >= ceil(p * 65536), so
// that drop probability is p to within 2^-16. (A 24-bit uniform per element made the pass
// compute-bound on the GPU: three 64-bit multiply chains per element.)
inline uint32_t dropout_threshold(float p) {
  return static_cast<uint32_t>(std::ceil(static_cast<double>(p) * 65536.0));
}
// What kept elements are multiplied by (both backends: one fp32 product, the same bits).
inline float dropout_scale(float p, float path_p) {
  return (1.0f / (1.0f - p)) * (1.0f / (1.0f - path_p));
}
VG_HD bool dropout_keep_bits(uint64_t word, uint64_t c, uint32_t threshold) {
  return ((word >> ((c & 3u) * 16u)) & 0xFFFFu) >= threshold;
}
VG_HD bool dropout_keep(uint64_t stream, uint64_t c, uint32_t threshold) {
  return dropout_keep_bits(rng_word(stream, c >> 2), c, threshold);
}
// Drop path's draw for a global sample: its own stream beside the elements' (the call's stream
// key with a high bit flipped), one word per sample.
VG_HD bool drop_path_keep(uint64_t seed, uint64_t key, uint64_t sample, uint32_t threshold) {
  return ((rng_u64(seed, key ^ (1ull << 62), sample) >> 48) & 0xFFFFu) >= threshold;
}
// The global sample of the call's element 0 (key as dropout_stream gives it: the position read).
VG_HD uint64_t drop_path_sample0(const DropoutKey& k) {
  return k.path_sample0 + (k.position ? static_cast<uint64_t>(k.position[1]) : 0u);
}

// Optimizer hyper-parameters for one step (already scheduled: lr is this step's lr).
struct AdamParams {
  float lr, beta1, beta2, eps;
  int step;          // 1-based optimizer step, for bias correction
  float grad_scale;  // gradients are multiplied by this before use (1/loss_scale, clipping)
  // When set, gradients are multiplied by *grad_scale_dev (fp32 on the device) as well: the
  // clipping factor and 1/loss_scale computed on the device (clip_factor) without the host
  // reading the gradient norm.
  const float* grad_scale_dev = nullptr;
};

// The device: memory and copies, completion, the workspace plan, read-backs, CUDA graphs,
// timing marks, the JPEG decoder and the input upload slots.
class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;  // "cpu" or "cuda"
  // Precision of activations and compute weights. act_size() is their storage size in bytes:
  // 2 for bf16/fp16 on CUDA; 4 on the CPU, whose 16-bit modes are emulated (fp32 storage,
  // every act result rounded to the 16-bit format's precision and range).
  virtual DType act_dtype() const = 0;
  virtual size_t act_size() const = 0;

  // ---- memory (planned up front: the trainer allocates a few large buffers before step 1)
  virtual void* alloc(size_t bytes) = 0;
  // Memory the data axis's collectives can move with copy engines (CUDA with
  // device.data_comm = copy_engine: NCCL memory registered as a symmetric window over the
  // data axis; a collective call on every data rank, in the same order). Otherwise alloc().
  // release() frees either.
  virtual void* alloc_comm(size_t bytes) { return alloc(bytes); }
  virtual void release(void* p) = 0;
  virtual void copy_to_device(void* dst, const void* src_host, size_t bytes) = 0;
  virtual void copy_to_host(void* dst_host, const void* src, size_t bytes) = 0;
  // Page-locks (pin = true) or releases host memory that copy_to_host fills often (the
  // background checkpoint's copy of the state), so the copies run at the bus's speed. CPU:
  // nothing.
  virtual void pin_host(void* p, size_t bytes, bool pin) { (void)p, (void)bytes, (void)pin; }
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  virtual void synchronize() = 0;
  // Whether ops return before their work is done. CUDA: true, work is enqueued on streams and
  // completes later (a caller sees it done through a call that returns values, e.g.
  // readback_wait). CPU: false, every op's work is done when it returns.
  virtual bool asynchronous() const = 0;
  virtual size_t peak_memory_bytes() const = 0;  // high-water mark of alloc()

  // ---- workspace planning: the largest shapes the step will run, known from the deck, so a
  // backend allocates its internal workspace (reduction scratch, GEMM temporaries, the device
  // tables of the multi-tensor ops) before step 1 and never in the step loop. Zeros plan
  // nothing; a later plan only grows what an earlier one allocated. An op beyond the plan
  // still runs (the backend then allocates, and device_allocations() shows it).
  struct WorkspacePlan {
    int64_t max_rows = 0;          // rows of any row-wise op: LayerNorm (plain and split over
                                   // ranks) backward, linear_backward's bias gradient
    int64_t max_cols = 0;          // widest row of those ops (hidden, 3*hidden, mlp, classes)
    int64_t max_weight_elems = 0;  // largest Linear weight [out, in] of a linear_backward
    size_t max_copy_bytes = 0;     // largest copy() (its source and destination may overlap)
    // Multi-tensor ops (sum_squares, adamw_update, lamb_*, sgd_update): how many distinct
    // slice lists they see, and over all those lists together, their slices and the elements
    // the slices cover.
    int64_t slice_lists = 0;
    int64_t slices = 0;
    int64_t slice_elems = 0;
    // The width of the LayerNorms that write FP8 (Fp8Ops::add_layernorm_forward_fp8) on up to
    // max_rows rows; 0: none do.
    int64_t fp8_layernorm_cols = 0;
  };
  virtual void plan_workspace(const WorkspacePlan& p) { (void)p; }
  // Device allocations the backend made so far (alloc() and internal ones; on the CPU, alloc()
  // calls); the bench and the tests use it to show that the step loop allocates nothing.
  virtual int64_t device_allocations() const { return 0; }

  // ---- reading results back without stalling the device: readback_start(slot, src, bytes)
  // enqueues a copy of src into the slot's host buffer and returns; readback_wait(slot) waits
  // for that copy (only) and returns the host buffer. CPU: a plain copy.
  virtual void readback_start(int slot, const void* src, size_t bytes) = 0;
  virtual const void* readback_wait(int slot) = 0;

  // ---- CUDA graphs: work enqueued between capture_begin() and capture_end() (on the
  // backend's streams, and by NCCL on them) is recorded instead of run; capture_end() returns
  // an id that launch_graph() enqueues as a whole, replaying the same kernels with the same
  // arguments and pointers. graphs_supported() is false on the CPU backend (the others then
  // must not be called). A capture must not contain host synchronisation or allocation, and
  // must start after the first eager run of the same work (lazy setup, algorithm timing).
  virtual bool graphs_supported() const { return false; }
  virtual void capture_begin() {}
  virtual int capture_end() { return -1; }
  virtual void launch_graph(int id) { (void)id; }
  // Destroys every graph (their ids become invalid), once work they enqueued has completed
  // in stream order: e.g. after a buffer they point into was reallocated.
  virtual void drop_graphs() {}

  // ---- device-time marks (the pipeline bubble): mark() records a point in the order of the
  // work enqueued so far and returns its id; seconds_between(a, b) is the time from mark a to
  // mark b, waiting for b to pass; clear_marks() forgets every mark (ids are reused). CPU: the
  // host clock at the call (its ops complete before returning); CUDA: events on the stream.
  virtual int mark() = 0;
  virtual double seconds_between(int a, int b) = 0;
  virtual void clear_marks() = 0;

  // The device's JPEG decoder (backend/image_decoder.h), created on first use; null where the
  // backend has none (the CPU backend: the loader decodes and resizes with libjpeg-turbo and
  // its own resampling). jpeg = false: the device's crop/resize of host decodes alone (no
  // JPEG decoder is initialised; the first call's choice stays, true including false's).
  virtual class ImageDecoder* image_decoder(bool jpeg = true) {
    (void)jpeg;
    return nullptr;
  }
  // ---- input batches, copied while the previous batch computes. A slot is a host staging
  // area (page-locked on CUDA) plus the device buffer the caller uploads it into.
  // staging(slot, bytes) returns the slot's host area once its previous upload has read it;
  // upload_async(slot, dst, bytes) starts copying it to dst (CUDA: on a copy stream, after the
  // work enqueued before the slot's last release_slot(), which read dst's previous contents)
  // and returns; wait_uploads() orders the work enqueued after it behind every upload started;
  // release_slot(slot) marks the work enqueued so far as the last to read the slot's device
  // buffer. CPU: plain memory and synchronous copies.
  virtual void* staging(int slot, size_t bytes) = 0;
  virtual void upload_async(int slot, void* dst, size_t bytes) = 0;
  virtual void wait_uploads() = 0;
  virtual void release_slot(int slot) = 0;

  // Where the step's time goes (backend/op_profile.h): every op opens an OpScope; off unless
  // `vitgrid bench --profile` turns it on.
  OpProfile& op_profile() { return profile_; }

 private:
  OpProfile profile_;
};

// Dense layer ops: casts, GEMMs (Linear layers, batched) and their tuning, elementwise ops,
// dropout.
class LayerOps {
 public:
  virtual ~LayerOps() = default;
  // ---- conversions between fp32 and act dtype (identity copies when act dtype is fp32)
  virtual void cast_to_act(void* dst_act, const float* src, size_t n) = 0;
  virtual void cast_to_f32(float* dst, const void* src_act, size_t n) = 0;

  // ---- GEMM-based layers
  // y[N,out] = x[N,in] W[out,in]^T + b[out] (b may be null). With gelu_out != null the GELU
  // epilogue is applied: y keeps the pre-activation and gelu_out = gelu(y).
  virtual void linear_forward(void* y, const void* x, const void* W, const void* b, int N,
                              int in, int out, void* gelu_out = nullptr,
                              Gelu gelu = Gelu::Exact) = 0;
  // dx[N,in] = dy W (overwritten; skipped when dx is null), dW[out,in] += dy^T x (skipped
  // when dW is null; x is then not read), db[out] += sum_rows dy (skipped when null). With
  // gelu_pre (x was gelu(gelu_pre)): dx is the gradient of gelu_pre instead,
  // (dy W) * gelu'(gelu_pre), as gelu_backward would give.
  // With gelu_db as well: db of the Linear that produced gelu_pre (the column sums of the final
  // dx) is added into gelu_db in the same pass (the GELU backward's) instead of another pass
  // over dx in that Linear's backward.
  virtual void linear_backward(void* dx, float* dW, float* db, const void* dy, const void* x,
                               const void* W, int N, int in, int out,
                               const void* gelu_pre = nullptr, Gelu gelu = Gelu::Exact,
                               float* gelu_db = nullptr) = 0;
  // The GEMMs enqueued from now on leave `sms` multiprocessors free (0: none) to kernels
  // running beside them: the data axis's NCCL reductions during the backward
  // (device.gemm_sm_margin). CUDA: cuBLASLt's SM count target and the fused GELU GEMMs'
  // persistent grids; the CPU ignores it.
  virtual void set_gemm_sm_margin(int sms) { (void)sms; }
  virtual int gemm_sm_margin() const { return 0; }
  // Timed choices made alike on every replica: while `max_over_replicas` is set, it replaces
  // v[0..n) by the element-wise maximum of v over the ranks that run the same operations in
  // the same order (the trainer passes the data axis, during training steps), and each timed
  // choice (device.gemm_tune: cuBLASLt algorithms, the fused GELU kernels) is made on those
  // worst-rank timings, so every replica runs the same kernels and none waits at the gradient
  // reduction for one that picked a slower kernel on noise. Every rank of the group must then
  // make the same sequence of new choices; where they do not, the job ends with a message
  // naming the operation (never a hang). Empty (the default): each rank chooses on its own
  // timings. The CPU backend times nothing and ignores it.
  using ReplicaMax = std::function<void(double* v, int n)>;
  virtual void set_tune_agreement(ReplicaMax max_over_replicas) { (void)max_over_replicas; }
  // Plain batched strided GEMM on act dtype, fp32 accumulate:
  // C_i = alpha op(A_i) op(B_i) + beta C_i, i < batch; row-major; op = transpose when flag set.
  virtual void gemm_batched(bool transA, bool transB, int M, int N, int K, float alpha,
                            const void* A, int64_t strideA, const void* B, int64_t strideB,
                            float beta, void* C, int64_t strideC, int batch) = 0;

  // ---- elementwise
  virtual void gelu_forward(void* y, const void* x, size_t n, Gelu g) = 0;
  // dx = dy * gelu'(x); dx may alias dy.
  virtual void gelu_backward(void* dx, const void* x, const void* dy, size_t n, Gelu g) = 0;
  // The same over a row-major [rows, cols] matrix, and db[cols] += the column sums of dx (the
  // bias gradient of the Linear that produced x) in the same pass; db null: gelu_backward.
  virtual void gelu_backward_bias(void* dx, const void* x, const void* dy, int rows, int cols,
                                  float* db, Gelu g) = 0;
  // y = x with dropout applied (y may alias x). p == 0 copies.
  virtual void dropout_forward(void* y, const void* x, size_t n, float p, DropoutKey k) = 0;
  // Drop path's factors of call k (k.path_p > 0): out[i] (fp32) = dropout_scale(0, path_p)
  // when sample drop_path_sample0(k) + i is kept, else 0, i < samples: what dropout_forward
  // with p = 0 multiplies that sample's elements by (a RowFactors vector).
  virtual void drop_path_factors(float* out, int samples, DropoutKey k) = 0;
  // dx = dy masked and scaled with the same mask as the forward (dx may alias dy).
  virtual void dropout_backward(void* dx, const void* dy, size_t n, float p, DropoutKey k) = 0;
  // y = a + b (y may alias a)
  virtual void add(void* y, const void* a, const void* b, size_t n) = 0;
  // y += x (act dtype)
  virtual void accumulate(void* y, const void* x, size_t n) = 0;
  // x *= s (fp32 buffer)
  virtual void scale_f32(float* x, size_t n, float s) = 0;
  // y += x (fp32 buffers: weight gradients reduced by a tensor-parallel strategy)
  virtual void accumulate_f32(float* y, const float* x, size_t n) = 0;
};

// LayerNorm (whole and split rows), softmax and attention.
class NormAttentionOps {
 public:
  virtual ~NormAttentionOps() = default;
  // ---- normalisation
  // Fused residual add + LayerNorm over the last dim C of N rows:
  // res = a + b (b may be null: res = a; res may alias a); y = (res - mean) * rstd * gamma + beta.
  // mean and rstd (fp32, N each) are saved for the backward. With bf: b's rows are multiplied
  // by their factors (rounded) before the add, as a dropout pass over b would leave them.
  virtual void add_layernorm_forward(void* res, void* y, float* mean, float* rstd,
                                     const void* a, const void* b, const void* gamma,
                                     const void* beta, int N, int C, float eps,
                                     RowFactors bf = {}) = 0;
  // dx[N,C] += LayerNorm backward of dy (dx is the residual-stream gradient, accumulated);
  // dgamma[C] += ..., dbeta[C] += ... (fp32). With dsum: dsum[C] += the column sums of the
  // updated dx as stored (act dtype), i.e. the bias gradient of a Linear whose output gradient
  // dx is, summed while dx is at hand instead of in a pass of its own. With bf (the factors
  // the forward's branch b had): dbranch = the updated dx's rows times their factors (the
  // branch's output gradient, as a dropout backward pass over dx would give it; dbranch does
  // not alias dx), and dsum sums dbranch instead.
  virtual void layernorm_backward(void* dx, float* dgamma, float* dbeta, const void* dy,
                                  const void* x, const void* gamma, const float* mean,
                                  const float* rstd, int N, int C, float* dsum = nullptr,
                                  void* dbranch = nullptr, RowFactors bf = {}) = 0;
  // ---- LayerNorm of rows split over ranks (tensor parallelism: 2d/2.5d/3d Stream rows).
  // A rank holds C of the C_total columns of N rows (x[N,C], gamma/beta[C] its slices). The
  // ops produce fp32 per-row partial sums; between two ops the caller sums them over the
  // ranks that share the rows (an fp32 allreduce), so statistics cover the whole width.
  // The statistics are two-pass like add_layernorm_forward (mean first, then the centred sum
  // of squares), which avoids the cancellation of E[x^2] - E[x]^2. Forward:
  //   layernorm_split_sums:     sum[r] = sum_j x[r,j]                              -> reduce
  //   layernorm_split_centered: mean[r] = mean[r] / C_total (in: the reduced sums, in place),
  //                             sq[r] = sum_j (x[r,j] - mean[r])^2                 -> reduce
  //   layernorm_split_apply:    rstd[r] = 1 / sqrt(rstd[r] / C_total + eps) (in: the reduced
  //                             sq, in place); y = (x - mean) rstd gamma + beta (act dtype)
  // mean and rstd then hold what add_layernorm_forward saves for the backward.
  virtual void layernorm_split_sums(float* sum, const void* x, int N, int C) = 0;
  virtual void layernorm_split_centered(float* sq, float* mean, const void* x, int N, int C,
                                        int C_total) = 0;
  virtual void layernorm_split_apply(void* y, float* rstd, const void* x, const float* mean,
                                     const void* gamma, const void* beta, int N, int C,
                                     int C_total, float eps) = 0;
  // Backward, with g = dy gamma and xhat = (x - mean) rstd:
  //   layernorm_split_backward_sums: sums[2r] = sum_j g, sums[2r+1] = sum_j g xhat (fp32
  //                             [N,2]) -> reduce; dgamma[C] += sum_r dy xhat, dbeta[C] +=
  //                             sum_r dy (this rank's columns: nothing to reduce over the row)
  //   layernorm_split_backward_dx: dx[N,C] += rstd (g - sums[2r]/C_total - xhat sums[2r+1]/
  //                             C_total) (the residual-stream gradient, accumulated)
  virtual void layernorm_split_backward_sums(float* sums, float* dgamma, float* dbeta,
                                             const void* dy, const void* x, const void* gamma,
                                             const float* mean, const float* rstd, int N,
                                             int C) = 0;
  virtual void layernorm_split_backward_dx(void* dx, const void* dy, const void* x,
                                           const void* gamma, const float* mean,
                                           const float* rstd, const float* sums, int N, int C,
                                           int C_total) = 0;

  // Row softmax of x[rows, cols] (scaled by `scale` first) into y.
  virtual void softmax_forward(void* y, const void* x, int rows, int cols, float scale) = 0;
  // dx = y * (dy - sum(dy * y)) * scale, rowwise.
  virtual void softmax_backward(void* dx, const void* y, const void* dy, int rows, int cols,
                                float scale) = 0;

  // ---- attention (non-causal multi-head self-attention, timm layout)
  // qkv[B,T,3C] holds per token [q(H,hd) | k(H,hd) | v(H,hd)], C = H*hd; out[B,T,C] holds
  // heads concatenated. `saved` is backend-owned state for the backward (softmax probabilities
  // on the CPU, log-sum-exp statistics with cuDNN), attention_saved_bytes() large.
  virtual size_t attention_saved_bytes(int B, int T, int H, int hd) const = 0;
  virtual size_t attention_workspace_bytes(int B, int T, int H, int hd) const = 0;
  // The byte alignment attention_forward / _backward need of their buffers (cuDNN: 16): the
  // model runs the attention in parts only where every part starts at such an address.
  virtual size_t attention_alignment() const { return 1; }
  virtual void attention_forward(void* out, void* saved, const void* qkv, int B, int T, int H,
                                 int hd, void* workspace) = 0;
  // dqkv[B,T,3C] is overwritten.
  virtual void attention_backward(void* dqkv, const void* dout, const void* qkv,
                                  const void* out, const void* saved, int B, int T, int H,
                                  int hd, void* workspace) = 0;
};

// The ViT's glue, the loss and metrics, reductions and the optimizers' updates.
class TrainOps {
 public:
  virtual ~TrainOps() = default;
  // ---- ViT-specific glue
  // Input pipeline on the device: out[B,3,S,S] (act dtype) from uint8 HWC images[B,S,S,3]:
  // zero-pad by `pad`, crop at (aug.dx, aug.dy), flip when aug.flip, normalise with
  // mean3/std3 (host arrays, 0-255 images scaled to [0,1] first) and, when aug.partner >= 0,
  // mix with that image of the batch (prepared with its own aug): its pixels inside the CutMix
  // box [cut_x0, cut_x1) x [cut_y0, cut_y1), lam * image + (1 - lam) * partner outside.
  // aug is a device array of SampleAug (data/dataset.h, 32 bytes); null: centre, no mixing.
  // Must match data::prepare_images_reference.
  virtual void prepare_images(void* out, const uint8_t* images, const void* aug, int B, int S,
                              int pad, const float* mean3_host, const float* std3_host) = 0;
  // images[B,3,S,S] (act dtype, normalised) -> patches[B*(S/P)^2, 3*P*P] in the order of a
  // conv weight [C,3,P,P] flattened (channel, row, col), patches row-major over the image.
  virtual void patchify(void* patches, const void* images, int B, int S, int P) = 0;
  // x[B,T,C] = concat(cls, patch_tokens[B,T-1,C]) + pos[T,C]
  virtual void embed_tokens(void* x, const void* patch_tokens, const void* cls,
                            const void* pos, int B, int T, int C) = 0;
  // dpatch_tokens[B,T-1,C] = dx[:,1:], dcls[C] += sum_b dx[b,0], dpos[T,C] += sum_b dx[b]
  virtual void embed_tokens_backward(void* dpatch_tokens, float* dcls, float* dpos,
                                     const void* dx, int B, int T, int C) = 0;
  // rows[B,C] = x[b, 0, :] (class-token pooling); backward writes dx[b,0,:] += drows[b], other
  // tokens untouched.
  virtual void gather_cls(void* rows, const void* x, int B, int T, int C) = 0;
  virtual void scatter_cls_backward(void* dx, const void* drows, int B, int T, int C) = 0;

  // ---- loss and metrics
  // Softmax cross-entropy on logits[N,K] (act dtype) with label smoothing eps: the target is
  // (1-eps) * t + eps/K where t is one-hot(labels) or, when soft_targets (fp32 [N,K]) is given,
  // those soft targets (Mixup). losses[N] (fp32) gets each row's loss. When dlogits is not null
  // it gets dloss/dlogits * grad_scale (the caller passes 1/global_batch and the loss scale).
  virtual void cross_entropy(float* losses, void* dlogits, const void* logits,
                             const int32_t* labels, const float* soft_targets, int N, int K,
                             float smoothing, float grad_scale) = 0;
  // correct1[N], correct5[N] (fp32 0/1): label in top-1 / top-5 of logits.
  virtual void topk_correct(float* correct1, float* correct5, const void* logits,
                            const int32_t* labels, int N, int K) = 0;

  // ---- reductions (blocking: results land on the host)
  // out_host[i] = sum of squares of buf[slices[i]] (fp32 buffer), in double for accuracy.
  virtual void sum_squares(double* out_host, const float* buf,
                           const std::vector<ParamSlice>& slices) = 0;
  virtual double sum(const float* x, size_t n) = 0;
  // true if every element of the fp32 buffer is finite
  virtual bool all_finite(const float* x, size_t n) = 0;

  // ---- reductions into device scalars (asynchronous: nothing returns to the host, so the
  // training step never waits for the device; the trainer reads its scalars back a step late)
  // *acc += sum of x[n] (fp32 buffer, double accumulator on the device).
  virtual void sum_into(double* acc, const float* x, size_t n) = 0;
  // *out = sum over every slice of the squares of buf[slice] (double, on the device): the same
  // partial sums as sum_squares, totalled on the device.
  virtual void sum_squares_total(double* out, const float* buf,
                                 const std::vector<ParamSlice>& slices) = 0;
  // The factor an optimizer multiplies the summed gradients by (AdamParams::grad_scale_dev),
  // from the squared norm *sq of the loss-scaled gradients: with g = sqrt(*sq) * inv_scale,
  // *out = (max_norm > 0 && g > max_norm ? float(max_norm / (g + 1e-6)) : 1) * inv_scale
  // (global-norm clipping as torch.nn.utils.clip_grad_norm_, and the loss scale undone).
  virtual void clip_factor(float* out, const double* sq, double max_norm, float inv_scale) = 0;

  // ---- optimizers: one call updates every slice of the flat buffers (multi-tensor)
  // AdamW (decoupled weight decay, PyTorch semantics): p -= lr * (mhat/(sqrt(vhat)+eps) + wd*p)
  virtual void adamw_update(float* p, const float* g, float* m, float* v,
                            const std::vector<ParamSlice>& slices, const AdamParams& a) = 0;
  // LAMB phase 1: update direction u = mhat/(sqrt(vhat)+eps) + wd*p (moments updated).
  virtual void lamb_direction(float* u, const float* p, const float* g, float* m, float* v,
                              const std::vector<ParamSlice>& slices, const AdamParams& a) = 0;
  // LAMB phase 2: p[slice i] -= lr * ratio_host[i] * u[slice i]
  virtual void lamb_apply(float* p, const float* u, const std::vector<ParamSlice>& slices,
                          const std::vector<float>& ratio_host, float lr) = 0;
  // SGD with momentum (PyTorch semantics): b = mu*b + (g*gs + wd*p); p -= lr*b (nesterov: g+mu*b)
  virtual void sgd_update(float* p, const float* g, float* mom,
                          const std::vector<ParamSlice>& slices, float lr, float momentum,
                          bool nesterov, float grad_scale,
                          const float* grad_scale_dev = nullptr) = 0;
};

// FP8 GEMM operands (precision.mode = fp8, Transformer Engine's recipe): one byte per element,
// the codes of an Fp8Format (backend/fp8.h), with a per-tensor fp32 scale in backend memory: a
// tensor x is stored as fp8(x * scale) and a GEMM multiplies its fp32 sums by both operands'
// scale_inv = 1 / scale. The scales come from the amax history (model/fp8_scaling.h); the
// casts report each tensor's amax for it. The CPU backend emulates the formats exactly
// (rounding, saturation) and sums in fp32, as the tensor cores do.
class Fp8Ops {
 public:
  virtual ~Fp8Ops() = default;
  // Whether this backend runs FP8 GEMMs; false with *why (CUDA: a GPU without FP8 tensor cores).
  virtual bool fp8_supported(std::string* why) const = 0;
  // out[rows, cols] = fp8(x * scale[0]) (nearest even, saturating at the format's largest
  // finite value; NaN stays NaN) and, where out_t is not null, out_t[cols, rows] = its
  // transpose; *amax = max(*amax, max |x|) (fp32 in backend memory; a NaN in x makes it NaN).
  // x is act dtype, row-major; out may be null when only the transpose is needed. With gelu_in
  // the values cast (and whose amax is taken) are gelu(x) as gelu_forward would store it
  // (rounded to the act dtype): the same codes as gelu_forward then the cast, in one pass.
  virtual void fp8_cast(uint8_t* out, uint8_t* out_t, float* amax, const void* x, int rows,
                        int cols, const float* scale, Fp8Format f,
                        const Gelu* gelu_in = nullptr) = 0;
  // A Linear's output gradient cast for its backward GEMMs, as fp8_cast (out, out_t, amax) of
  // g[rows, cols]: g = dy, or with gelu_pre (the Linear's output went through GELU; gelu_pre
  // is that pre-activation) g = dy * gelu'(gelu_pre) as gelu_backward stores it (rounded to the
  // act dtype); and, where db is not null, db[cols] += the column sums of g (fp32, in an order
  // fixed by the shape: the same bits run to run). One pass over dy: no stored GELU gradient
  // and no second read for the bias gradient.
  virtual void fp8_cast_grad(uint8_t* out, uint8_t* out_t, float* amax, const void* dy,
                             int rows, int cols, const float* scale, Fp8Format f, float* db,
                             const void* gelu_pre, Gelu g) = 0;
  // NormAttentionOps::add_layernorm_forward (res, mean, rstd, a, b, gamma, beta, N, C, eps,
  // bf) whose output y is not stored but cast as fp8_cast would cast it (out, out_t, amax,
  // scale, f): the same codes, transpose and amax as add_layernorm_forward then fp8_cast, in one
  // pass (the LayerNorm before an FP8 Linear writes that Linear's input in FP8).
  virtual void add_layernorm_forward_fp8(void* res, uint8_t* out, uint8_t* out_t, float* amax,
                                         const float* scale, Fp8Format f, float* mean,
                                         float* rstd, const void* a, const void* b,
                                         const void* gamma, const void* beta, int N, int C,
                                         float eps, RowFactors bf = {}) = 0;
  // NormAttentionOps::attention_backward (dqkv, dout, qkv, out, saved, B, T, H, hd,
  // workspace) whose qkv gradient g [B*T, 3C] goes to qkv's FP8 backward as fp8_cast_grad
  // casts it (out, out_t, amax, scale, f; db[3C] += its column sums): the same codes,
  // transpose and amax as attention_backward then fp8_cast_grad, the column sums within fp32
  // rounding of them in another order fixed by the shape. dqkv is the act-dtype buffer of g
  // that a backend not fusing the two writes (and may leave untouched otherwise).
  virtual void attention_backward_fp8(void* dqkv, uint8_t* out, uint8_t* out_t, float* amax,
                                      const float* scale, Fp8Format f, float* db,
                                      const void* dout, const void* qkv, const void* att,
                                      const void* saved, int B, int T, int H, int hd,
                                      void* workspace) = 0;
  // NormAttentionOps::layernorm_backward (dx, dgamma, dbeta, dy, x, gamma, mean, rstd, N, C,
  // dsum, dbranch, bf) whose updated dx (with row factors: dbranch) is the output gradient of
  // the FP8 Linear before the LayerNorm (a Row Linear whose output is the residual branch),
  // cast for that Linear's backward as fp8_cast casts it (out, out_t, amax, scale, f): dx,
  // dbranch, the codes, transpose and amax as layernorm_backward then fp8_cast of the stored
  // gradient, dgamma, dbeta and dsum within fp32 rounding of them in another order fixed by
  // the shape.
  virtual void layernorm_backward_fp8(void* dx, float* dgamma, float* dbeta, const void* dy,
                                      const void* x, const void* gamma, const float* mean,
                                      const float* rstd, int N, int C, float* dsum,
                                      void* dbranch, RowFactors bf, uint8_t* out,
                                      uint8_t* out_t, float* amax, const float* scale,
                                      Fp8Format f) = 0;
  // D[M,N] = (A[M,K] B[N,K]^T) * a_scale_inv[0] * b_scale_inv[0] + beta D: both operands
  // K-contiguous (the form Hopper's FP8 tensor cores take; a Linear's transposed operands come
  // from fp8_cast's out_t), not both E5M2; fp32 sums (on GPUs, E4M3 x E4M3 under
  // BackendOptions::fp8_fast_accum, a data gradient (an E5M2 operand, act D) under
  // fp8_fast_accum_dgrad: the tensor cores' accumulator alone); the scale_inv
  // pointers 16-byte aligned (cuBLASLt refuses others). D is act dtype (beta 0), or fp32 where
  // d_f32 (a weight gradient: beta 1 accumulates). bias[N] (act dtype, act D only) may be null.
  virtual void fp8_gemm(void* D, bool d_f32, float beta, const uint8_t* A, Fp8Format fa,
                        const float* a_scale_inv, const uint8_t* B, Fp8Format fb,
                        const float* b_scale_inv, int M, int N, int K, const void* bias) = 0;
};

// The argument contract of Fp8Ops::fp8_cast / fp8_gemm, checked by every backend's
// implementation first (VG_CHECK: a caller's error ends the job naming it).
void check_fp8_cast_args(const uint8_t* out, const uint8_t* out_t, const float* amax, int rows,
                         int cols, const float* scale);
void check_fp8_gemm_args(bool d_f32, float beta, Fp8Format fa, const float* a_scale_inv,
                         Fp8Format fb, const float* b_scale_inv, int M, int N, int K,
                         const void* bias);

// A backend: one device and the op set that runs on it.
class Backend : public Device, public LayerOps, public NormAttentionOps, public TrainOps,
                public Fp8Ops {
 public:
  ~Backend() override = default;
  // Fp8Ops::attention_backward_fp8 as the two ops it stands for, on every backend: the cast's
  // arguments checked, attention_backward into dqkv, then fp8_cast_grad of it (a backend whose
  // attention backward could write FP8 itself would override this; the whole-head flash
  // backward doing so measured slower, tools/MEASURED.md).
  void attention_backward_fp8(void* dqkv, uint8_t* out, uint8_t* out_t, float* amax,
                              const float* scale, Fp8Format f, float* db, const void* dout,
                              const void* qkv, const void* att, const void* saved, int B, int T,
                              int H, int hd, void* workspace) override;
  // Fp8Ops::layernorm_backward_fp8 as the two ops it stands for: the cast's arguments
  // checked, layernorm_backward, then fp8_cast of dx (dbranch with row factors); the CUDA
  // backend's fused LayerNorm backward writes the codes itself where its kernel takes the rows.
  void layernorm_backward_fp8(void* dx, float* dgamma, float* dbeta, const void* dy,
                              const void* x, const void* gamma, const float* mean,
                              const float* rstd, int N, int C, float* dsum, void* dbranch,
                              RowFactors bf, uint8_t* out, uint8_t* out_t, float* amax,
                              const float* scale, Fp8Format f) override;
};

// Attention's path on GPUs (device.attention): see make_cuda_backend.
enum class AttentionMode { Auto, Cudnn, Flash, Fallback, CudnnForward };
// Fused GEMM + exact GELU on GPUs (device.fused_gelu): see make_cuda_backend.
enum class FusedGeluMode { Auto, Off, On };

// How a backend may trade reproducibility or precision for speed, and how it tunes itself
// (the CPU backend has nothing to trade and ignores them all).
struct BackendOptions {
  bool allow_tf32 = false;    // fp32 GEMMs on TF32 tensor cores (precision.mode = tf32)
  int gemm_tune = 0;          // device.gemm_tune: see make_cuda_backend
  bool deterministic = true;  // device.deterministic: false lets attention's backward use
                              // atomics (faster; gradients differ in the last bits run to run)
  AttentionMode attention = AttentionMode::Auto;  // device.attention
  FusedGeluMode fused_gelu = FusedGeluMode::Auto;  // device.fused_gelu
  int fused_gelu_forward_config = -1;   // device.fused_gelu_forward_config (-1: chosen)
  int fused_gelu_backward_config = -1;  // device.fused_gelu_backward_config (-1: chosen)
  bool tuning_log = false;              // device.tuning_log: each tuned choice to stderr
  bool fp8_fast_accum = false;  // precision.fp8_fast_accum: E4M3 x E4M3 fp8_gemm unpromoted
  bool fp8_fast_accum_dgrad = false;  // precision.fp8_fast_accum_dgrad: fp8_gemm with an
                                      // E5M2 operand and an act-dtype D unpromoted
};

// Factory: "cpu" always; "cuda" when built with CUDA (throws UserError otherwise).
// `device` is the local GPU index; `act` the activation dtype (on the CPU a 16-bit act dtype is
// emulated: fp32 storage, every act result rounded to the 16-bit format's precision and
// range, so the mixed-precision logic is exercised without a GPU).
std::unique_ptr<Backend> make_backend(const std::string& kind, int device, DType act,
                                      const BackendOptions& opts = {});
bool cuda_available();  // built with CUDA and at least one device visible

}  // namespace vitgrid
