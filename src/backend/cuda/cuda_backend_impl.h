// CudaBackend: the class behind make_cuda_backend(), shared by the translation units of
// src/backend/cuda (memory in cuda_backend.cpp, GEMMs in cuda_gemm.cpp, kernels in *.cu, NCCL
// in nccl_collectives.cpp and its neighbours). Internal: not installed, not included outside src/backend/cuda.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <library_types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/cuda/cuda_backend.h"
#include "vitgrid/backend/cuda/cuda_check.h"
#include "vitgrid/backend/image_decoder.h"

namespace vitgrid {

// One chunk of a multi-tensor launch: a piece of one ParamSlice (one CUDA block each).
struct SliceChunk {
  uint64_t offset;     // first element in the flat buffer
  uint32_t n;          // elements in this chunk (<= kChunkElems)
  uint32_t slice;      // index into the slice list
  float weight_decay;  // the slice's weight decay
  float pad_ = 0.0f;   // keep the struct 8-byte aligned in size (24 bytes)
};
constexpr uint32_t kChunkElems = 16384;  // 256 threads x 64 elements

// Device copy of a slice list cut into chunks, uploaded once per distinct list.
struct SliceTable {
  std::vector<ParamSlice> slices;  // the list it was built from (exact-match check)
  SliceChunk* chunks = nullptr;    // device [nchunks]
  uint32_t* first_chunk = nullptr; // device [nslices + 1]: chunk range of each slice
  int nchunks = 0;
  int nslices = 0;
  float* ratio = nullptr;          // device [nslices]: LAMB trust ratios staged per call
  void* own = nullptr;             // the table's own allocation; null: carved from the arena
};

// Row-major GEMM description handed to the cuBLASLt layer; see matmul() in cuda_gemm.cpp.
struct GemmSpec {
  bool transA = false, transB = false;
  int M = 0, N = 0, K = 0;          // C[M,N] = op(A)[M,K] op(B)[K,N]
  const void* A = nullptr;
  int64_t lda = 0, strideA = 0;
  const void* B = nullptr;
  int64_t ldb = 0, strideB = 0;
  void* C = nullptr;
  int64_t ldc = 0, strideC = 0;
  int batch = 1;
  cudaDataType_t ab_type = CUDA_R_32F;  // A and B
  cudaDataType_t c_type = CUDA_R_32F;   // C and D
  float alpha = 1.0f, beta = 0.0f;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // [N] of the row-major output (per output column)
  void* aux = nullptr;         // GELU_AUX: pre-activation, row-major, ld = aux_ld
  int64_t aux_ld = 0;
  // FP8 operands (fp8_gemm): B's type where it differs from A's (ab_type), and the two
  // scale_inv pointers (device fp32) cuBLASLt multiplies the sums by
  cudaDataType_t b_type = CUDA_R_32F;
  bool fp8 = false;
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  bool fast_accum = false;  // FP8: CUBLASLT_MATMUL_DESC_FAST_ACCUM (no promotion to fp32)
};

namespace cuda {
class CudnnAttention;  // cudnn_attention.h: the cuDNN SDPA path, kept out of this header
struct CudnnAttentionDelete {
  void operator()(CudnnAttention* p) const;  // cudnn_attention.cpp
};
}  // namespace cuda

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, DType act, const BackendOptions& opts);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override { return "cuda"; }
  DType act_dtype() const override { return act_; }
  size_t act_size() const override { return dtype_size(act_); }
  bool asynchronous() const override { return true; }
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }

  void* alloc(size_t bytes) override;
  void* alloc_comm(size_t bytes) override;
  void release(void* p) override;
  void pin_host(void* p, size_t bytes, bool pin) override;
  // The allocator alloc_comm() uses, installed by the collectives (null: alloc_comm = alloc).
  // Its release function frees what it allocated, also after the collectives are gone.
  struct CommAllocator {
    std::function<void*(size_t)> alloc;
    std::function<void(void*)> release;
  };
  void set_comm_allocator(std::shared_ptr<CommAllocator> a) { comm_alloc_ = std::move(a); }
  // Device memory others hold for this backend's work (the collectives' symmetric staging
  // and overlapped buffers): +bytes when allocated, -bytes when freed; counted in the
  // current and peak memory as alloc() is.
  void count_memory(int64_t bytes);
  void copy_to_device(void* dst, const void* src_host, size_t bytes) override;
  void copy_to_host(void* dst_host, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void zero(void* p, size_t bytes) override;
  void synchronize() override;
  int mark() override;                           // marks.cpp
  double seconds_between(int a, int b) override;
  void clear_marks() override { marks_used_ = 0; }
  void* staging(int slot, size_t bytes) override;  // upload.cpp
  void upload_async(int slot, void* dst, size_t bytes) override;
  void wait_uploads() override;
  void release_slot(int slot) override;
  size_t peak_memory_bytes() const override;
  size_t current_memory_bytes() const;
  // Allocates the reduction scratch (which also holds linear_backward's act-dtype dW fallback
  // and overlapping copies) and the slice-table arena at the plan's bounds, each the largest
  // need of its users (the *_scratch_bytes bounds below, next to each user's heuristics).
  void plan_workspace(const WorkspacePlan& p) override;
  int64_t device_allocations() const override;
  void set_gemm_sm_margin(int sms) override;
  int gemm_sm_margin() const override { return gemm_sm_margin_; }
  void set_tune_agreement(ReplicaMax max_over_replicas) override;

  // the op set both backends implement (cuda_gemm.cpp, elementwise.cu, layernorm.cu,
  // attention.cu, vit_ops.cu, optim_reduce.cu, tp_ops.cu)
  #include "vitgrid/backend/backend_op_overrides.inc"
  // Fp8Ops::layernorm_backward_fp8: the fused LayerNorm backward writing the codes where it
  // takes the rows (16-bit rows of up to 1024, 16-byte aligned), else Backend's two ops
  void layernorm_backward_fp8(void* dx, float* dgamma, float* dbeta, const void* dy,
                              const void* x, const void* gamma, const float* mean,
                              const float* rstd, int N, int C, float* dsum, void* dbranch,
                              RowFactors bf, uint8_t* out, uint8_t* out_t, float* amax,
                              const float* scale, Fp8Format f) override;

  // Attention (attention.cu), three paths, chosen per shape by BackendOptions::attention
  // (device.attention): Auto takes the own flash kernels where one CTA holds a whole head
  // (flash_attention.h flash_head_applies: head dim 64, T <= 224), then Auto and Cudnn take
  // cuDNN's fused SDPA (cudnn_attention.cpp; bf16/fp16, head dims 64/80/128, when the build has
  // cudnn_frontend and cuDNN supports the shape), else the own flash kernels (bf16/fp16,
  // head dims 32/64/80/128), else the cuBLASLt + softmax fallback; Flash skips cuDNN, Fallback
  // forces the last. cuDNN and flash save the fp32 log-sum-exp [B,H,T] (the same quantity: a
  // shape may switch between them), the fallback the probabilities [B,H,T,T] in the act dtype.
  // Cudnn in a build without cudnn_frontend throws UserError when the backend is made.
  enum class AttentionPath { Cudnn, Flash, Fallback };
  static const char* attention_path_name(AttentionPath p);
  // The path of the shape; B <= 0 or T <= 0: by dtype and head dim alone (what shapes normally
  // get; cuDNN may still reject one). Builds and caches the cuDNN graphs of the shape.
  // backward: the backward's path (CudnnForward: Auto's), else the forward's.
  AttentionPath attention_route(int B, int T, int H, int hd, bool backward = false) const;
  // auto (or, backward, cudnn_forward) takes the whole-head flash kernels
  bool attention_head_kernels(int T, int hd, bool backward = false) const;
  // "cudnn", "flash" or "fallback": attention_route's answer, for logs.
  const char* attention_path(int hd) const {
    return attention_path_name(attention_route(0, 0, 0, hd));
  }
  const char* attention_path(int B, int T, int H, int hd) const {
    return attention_path_name(attention_route(B, T, H, hd));
  }
  bool attention_fused(int hd) const;  // not the fallback: the saved state is the LSE
  size_t attention_alignment() const override { return 16; }  // cuDNN's tensors

  // nvJPEG + the resize kernels (nvjpeg_decoder.cpp), made on first use; null without nvJPEG
  ImageDecoder* image_decoder(bool jpeg = true) override;

  // out[c] = the sum of the `parts` consecutive blocks in[parts * c], in block order, on
  // stream st (the copy-engine reduce-scatter's local step)
  void sum_parts_on(cudaStream_t st, float* out, const float* in, size_t c, int parts);
  // The same for act-dtype parts (summed in fp32, rounded once): the copy-engine
  // reduce-scatter of the tensor axis's overlapped collectives.
  void sum_parts_act_on(cudaStream_t st, void* out, const void* in, size_t c, int parts);
  bool graphs_supported() const override { return true; }
  void capture_begin() override;
  int capture_end() override;
  void launch_graph(int id) override;
  void drop_graphs() override;

  // The cuBLASLt layer: runs a row-major GEMM; returns false (and does nothing) only when
  // cuBLASLt offers no algorithm for the combination and allow_unsupported is set, so the
  // caller can take another route. Plans are cached per shape/type/epilogue/alignment key.
  bool matmul(const GemmSpec& s, bool allow_unsupported = false);
  cudaDataType_t act_cuda_type() const;

  // The fused GEMM + exact-GELU choices made so far (linear_forward with an exact-GELU output,
  // linear_backward with gelu_pre): per direction and shape the configuration (gemm_gelu.h)
  // or the unfused path, and what decided it (the candidates' timings when timed). One line
  // per choice; "" before any.
  std::string fused_gelu_report() const;
  // The choice of one shape: a configuration id, -1 unfused, -2 not decided yet.
  int fused_gelu_choice(bool forward, int N, int in, int out) const;
  struct FusedGeluChoice {
    bool forward = true;
    int N = 0, in = 0, out = 0;
    int config = -1;                             // -1: unfused
    std::string why;                             // what decided it
    std::vector<std::pair<int, float>> timings;  // (candidate, ms per call), fastest first
  };

  // Column sums of a row-major act matrix x[N,C], added into out[C] (fp32), deterministic
  // (linear_backward's bias gradients, layernorm_backward's dsum where its kernel does not sum
  // dx itself; public for bench_gpu_kernels).
  void column_sums_add(float* out, const void* x, int N, int C);

 private:
  struct MatmulPlan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool supported = false;
  };
  static constexpr int kMaxGemmTune = 16;
  void bind_epilogue_pointers(const MatmulPlan& p, const GemmSpec& s);
  std::vector<cublasLtMatmulAlgo_t> tune_candidates(const MatmulPlan& p,
                                                    const cublasLtMatmulHeuristicResult_t* res,
                                                    int n, bool split_k) const;
  cublasLtMatmulAlgo_t fastest_algo(const MatmulPlan& p, const GemmSpec& s,
                                    const std::vector<cublasLtMatmulAlgo_t>& cand,
                                    const std::string& key);
  // With set_tune_agreement's function: replaces ms (one timing per candidate of the choice
  // `what`) by the worst over the replicas, after checking that they all make this choice
  // with as many candidates (else the job ends with a message naming `what`). Without it,
  // nothing.
  void agree_timings(const std::string& what, std::vector<double>& ms);
  // Internal device memory, counted in the tracked totals and in device_allocations().
  // internal_free waits for queued work first and takes the size given to internal_alloc.
  void* internal_alloc(size_t bytes);
  void internal_free(void* p, size_t bytes);
  // Scratch for multi-stage reductions, linear_backward's act-dtype dW fallback and
  // overlapping copies; one buffer, reused in stream order. Allocated by plan_workspace; a
  // request beyond it grows it (synchronising first): the safety net of an unplanned run.
  void* scratch(size_t bytes);
  // The fused GEMM + exact-GELU path (gemm_gelu.h) of one linear: the configuration id that
  // runs fc1's forward (forward) or fc2's data gradient (backward) of this shape, or -1 for
  // the unfused path (cuBLASLt GEMM, then the GELU pass); -1 without caching where the call
  // cannot fuse (ok false: unaligned or aliased pointers). Decided on the shape's first call
  // and cached; when that decision is timed, run(c) (c: -1 or an id) is called a few times per
  // candidate and must overwrite only the outputs the real call writes afterwards. Defined
  // in cuda_gemm.cpp.
  template <class Run>
  int fused_gelu(bool forward, int N, int in, int out, bool ok, Run&& run);
  void set_fused_gelu(const BackendOptions& opts);  // the constructor's part
  // Scratch bytes each user needs for its largest call, from the same heuristics that size
  // its grids (defined beside them): column_sums_add (elementwise.cu), layernorm_backward
  // (layernorm.cu), layernorm_split_backward_sums (tp_ops.cu), sum_squares (optim_reduce.cu).
  static size_t column_sums_scratch_bytes(int64_t rows, int64_t cols);
  // fp8_cast_grad's bias-gradient partials (scratch)
  static size_t fp8_grad_scratch_bytes(int64_t rows, int64_t cols);
  static size_t layernorm_scratch_bytes(int64_t rows, int64_t cols);
  // add_layernorm_forward_fp8's y where its fused kernel does not take the rows (layernorm.cu)
  static size_t layernorm_fp8_scratch_bytes(int64_t rows, int64_t cols, size_t act_size);
  static size_t layernorm_split_scratch_bytes(int64_t rows, int64_t cols);
  static size_t sum_squares_scratch_bytes(int64_t lists, int64_t slices, int64_t elems);
  // layernorm_backward for any width and alignment (unfused: a dx pass, a parameter pass)
  void layernorm_backward_general(void* dx, float* dgamma, float* dbeta, const void* dy,
                                  const void* x, const void* gamma, const float* mean,
                                  const float* rstd, int N, int C);
  // Device tables of the multi-tensor ops, one per distinct slice list, carved from an arena
  // that plan_workspace sizes (slice_arena_bytes); past the arena, a table allocates its own.
  const SliceTable& slice_table(const std::vector<ParamSlice>& slices);
  static size_t slice_arena_bytes(int64_t lists, int64_t slices, int64_t elems);
  // The one-kernel column sums behind column_sums_add and gelu_backward_bias (elementwise.cu):
  // src / src_vec produce the values one element / one 16-byte vector at a time, U rows of
  // them per lane in flight; about `blocks` blocks (chunks of rows of each column group).
  template <class T, int U, class Src, class SrcV>
  void column_sums(float* out, int N, int C, bool vec, Src src, SrcV src_vec, int blocks);
  // Per column group, the blocks of a column sum that finished (the last one adds the
  // partials); zero between calls. Grown to `groups` (planned by plan_workspace).
  unsigned* colsum_counters(int groups);
  unsigned* colsum_done_ = nullptr;
  size_t colsum_done_n_ = 0;
  // out[i] += x[i] (x act dtype, out fp32)
  void add_act_to_f32(float* out, const void* x, size_t n);

  int device_;
  DType act_;
  bool tf32_;
  int gemm_tune_;  // GEMM candidates timed per new shape (1: the heuristic's first, untimed)
  bool fp8_fast_accum_;        // BackendOptions::fp8_fast_accum
  bool fp8_fast_accum_dgrad_;  // BackendOptions::fp8_fast_accum_dgrad
  bool gemm_tune_log_;          // BackendOptions::tuning_log: every tuned choice to stderr
  ReplicaMax tune_agree_;       // set_tune_agreement: timed choices on the worst replica's times
  bool deterministic_;  // false: attention's backward may use atomics (cuDNN)
  int sm_count_ = 0;
  int gemm_sm_margin_ = 0;  // set_gemm_sm_margin: part of the GEMM plans' key
  // Fused GEMM + exact GELU: BackendOptions::fused_gelu and its forced configurations, set at
  // construction; Off as well without the kernels (no CUTLASS, not sm_90, fp32 activations).
  FusedGeluMode fused_gelu_mode_ = FusedGeluMode::Off;
  bool fused_gelu_tune_ = false;         // time the candidates per shape (device.gemm_tune > 1)
  bool fused_gelu_log_ = false;          // BackendOptions::tuning_log: each choice to stderr
  int fused_gelu_forced_[2] = {-1, -1};  // forced configuration ids [backward, forward]
  std::vector<FusedGeluChoice> fused_gelu_choices_;  // one per (direction, shape) seen
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* lt_workspace_ = nullptr;
  size_t lt_workspace_bytes_ = 0;
  std::unordered_map<std::string, MatmulPlan> plans_;

  mutable std::mutex mem_mutex_;  // alloc/release may come from the loader thread too
  std::unordered_map<void*, size_t> live_;
  void track_alloc(void* p, size_t sz);  // the totals of a new block (mem_mutex_ held)
  std::shared_ptr<CommAllocator> comm_alloc_;
  // alloc_comm()'s blocks, released through the allocator that made them
  std::unordered_map<void*, std::shared_ptr<CommAllocator>> comm_live_;
  size_t current_bytes_ = 0;
  size_t peak_bytes_ = 0;
  int64_t allocations_ = 0;        // cudaMalloc calls: alloc() and internal_alloc()

  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  char* slice_arena_ = nullptr;    // planned device memory of the slice tables
  size_t slice_arena_bytes_ = 0;
  size_t slice_arena_used_ = 0;
  std::vector<char*> old_arenas_;  // arenas a larger plan replaced while tables used them
  double* reduce_buf_ = nullptr;   // device doubles for sum / sum_squares results
  int* flag_ = nullptr;            // device flag for all_finite
  void* host_pinned_ = nullptr;    // pinned host landing area for small results
  size_t host_pinned_bytes_ = 0;
  std::vector<SliceTable> slice_tables_;
  std::vector<cudaEvent_t> marks_;  // timing events of mark(), reused after clear_marks()
  size_t marks_used_ = 0;
  // input upload slots (upload.cpp): pinned host area, its last upload, its last reader
  struct UploadSlot {
    void* host = nullptr;
    size_t bytes = 0;
    cudaEvent_t copied = nullptr;    // on copy_stream_: the slot's last upload finished
    cudaEvent_t released = nullptr;  // on stream_: the last work reading the device buffer
    bool released_once = false;
  };
  std::vector<UploadSlot> upload_slots_;
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t uploaded_ = nullptr;  // on copy_stream_: every upload started so far
  bool uploads_pending_ = false;
  void release_upload_slots();
  // readback slots (graphs.cpp): pinned host buffer and the event behind its copy
  struct Readback {
    void* host = nullptr;
    size_t bytes = 0;
    cudaEvent_t done = nullptr;
  };
  std::vector<Readback> readbacks_;
  std::vector<cudaGraphExec_t> graphs_;  // capture_end() ids index this
  bool capturing_ = false;
  void release_graphs();  // destructor helper (graphs.cpp)
  // BackendOptions::attention, checked when the backend is constructed (attention.cu).
  static AttentionMode checked_attention_mode(AttentionMode m);
  const AttentionMode attention_mode_;
  // The cuDNN path (graph cache and handle), made on first use by attention_route().
  cuda::CudnnAttention* cudnn_attention() const;
  mutable std::unique_ptr<cuda::CudnnAttention, cuda::CudnnAttentionDelete> cudnn_attention_;
  std::unique_ptr<ImageDecoder> image_decoder_;
  bool image_decoder_tried_ = false;
  bool image_decoder_jpeg_ = false;  // made with nvJPEG
};

}  // namespace vitgrid
