// CudaBackend: construction, memory accounting, copies, scratch and slice tables. The cuBLASLt
// GEMM layer (linear layers, the fused GELU GEMMs, batched GEMMs) is in cuda_gemm.cpp; kernels
// live in the *.cu files beside these.
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "cuda_backend_impl.h"
#ifdef VITGRID_HAVE_NVJPEG
#include "nvjpeg_decoder.h"
#endif
#include "vitgrid/backend/cuda/cuda_backend.h"

namespace vitgrid {

namespace {
constexpr size_t kLtWorkspaceBytes = 32u << 20;  // cuBLASLt workspace, allocated once
constexpr size_t kReduceDoubles = 1u << 16;      // device result/partial area (doubles)
constexpr size_t kPinnedBytes = 1u << 20;        // pinned landing area for host results
constexpr size_t kCopyPieceBytes = 4u << 20;     // overlapping copies go through the scratch
                                                 // in pieces of at most this (or its size)

size_t align256(size_t n) { return (n + 255) & ~size_t(255); }
}  // namespace

int cuda_device_count() {
  int n = 0;
  // No driver / no device is an answer (0), not an error: CI compiles with nvcc on machines
  // without a GPU and the gpu tests skip themselves.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error state for later calls
    return 0;
  }
  return n;
}

std::unique_ptr<Backend> make_cuda_backend(int device, DType act, const BackendOptions& opts) {
  const int n = cuda_device_count();
  if (n == 0) throw UserError("device.backend = cuda but no CUDA device is visible");
  if (device < 0 || device >= n) {
    throw UserError("CUDA device " + std::to_string(device) + " requested but only " +
                    std::to_string(n) + " visible (one rank per GPU: check the launch)");
  }
  return std::make_unique<CudaBackend>(device, act, opts);
}

CudaBackend::CudaBackend(int device, DType act, const BackendOptions& opts)
    : device_(device),
      act_(act),
      tf32_(opts.allow_tf32 && act == DType::F32),
      gemm_tune_(std::max(1, std::min(opts.gemm_tune, kMaxGemmTune))),
      fp8_fast_accum_(opts.fp8_fast_accum),
      fp8_fast_accum_dgrad_(opts.fp8_fast_accum_dgrad),
      gemm_tune_log_(opts.tuning_log),
      deterministic_(opts.deterministic),
      attention_mode_(checked_attention_mode(opts.attention)) {
  CUDA_CHECK(cudaSetDevice(device_));
  CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));
  set_fused_gelu(opts);
  // A non-blocking stream: no implicit serialisation with the legacy default stream, which
  // NCCL and other libraries might use.
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUBLAS_CHECK(cublasLtCreate(&lt_));
  lt_workspace_bytes_ = kLtWorkspaceBytes;
  lt_workspace_ = internal_alloc(lt_workspace_bytes_);
  reduce_buf_ = static_cast<double*>(internal_alloc(kReduceDoubles * sizeof(double)));
  flag_ = static_cast<int*>(internal_alloc(sizeof(int) * 4));
  host_pinned_bytes_ = kPinnedBytes;
  CUDA_CHECK(cudaMallocHost(&host_pinned_, host_pinned_bytes_));
  // every op an NVTX range (header-only NVTX 3: a no-op unless a tool such as Nsight Systems
  // is attached)
  op_profile().set_ranges([](const char* op) { nvtxRangePushA(op); }, [] { nvtxRangePop(); });
}

CudaBackend::~CudaBackend() {
  // Destructors must not abort a job that is already unwinding: report, do not VG_FAIL.
  cudaSetDevice(device_);
  if (stream_) cudaStreamSynchronize(stream_);
  cudnn_attention_.reset();  // cuDNN graphs and handle, while their stream still exists
  image_decoder_.reset();    // its join events target stream_; it counts memory here
  for (cudaEvent_t e : marks_) cudaEventDestroy(e);
  release_upload_slots();
  release_graphs();
  for (auto& kv : plans_) {
    MatmulPlan& p = kv.second;
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.c) cublasLtMatrixLayoutDestroy(p.c);
    if (p.desc) cublasLtMatmulDescDestroy(p.desc);
  }
  for (auto& t : slice_tables_) cudaFree(t.own);  // null for tables in the arena
  for (char* a : old_arenas_) cudaFree(a);
  cudaFree(slice_arena_);
  cudaFree(scratch_);
  cudaFree(colsum_done_);
  cudaFree(reduce_buf_);
  cudaFree(flag_);
  cudaFree(lt_workspace_);
  for (auto& kv : live_) cudaFree(kv.first);
  if (host_pinned_) cudaFreeHost(host_pinned_);
  if (lt_) cublasLtDestroy(lt_);
  if (stream_) cudaStreamDestroy(stream_);
}

ImageDecoder* CudaBackend::image_decoder(bool jpeg) {
#ifdef VITGRID_HAVE_NVJPEG
  if (!image_decoder_tried_) {
    image_decoder_tried_ = true;
    image_decoder_jpeg_ = jpeg;
    cuda::NvjpegDecoderOptions o;
    o.jpeg = jpeg;
    o.count_memory = [this](int64_t bytes) { count_memory(bytes); };
    image_decoder_ = cuda::make_nvjpeg_decoder(device_, stream_, o);
  }
  VG_CHECK(!jpeg || image_decoder_jpeg_,
           "image_decoder(): made for resizing alone, then asked for a JPEG decoder");
#else
  (void)jpeg;
#endif
  return image_decoder_.get();
}

// ---------------------------------------------------------------- memory

void* CudaBackend::internal_alloc(size_t bytes) {
  void* p = nullptr;
  const size_t sz = std::max<size_t>(bytes, 256);
  cudaError_t e = cudaMalloc(&p, sz);
  if (e != cudaSuccess) {
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    VG_FAIL("cudaMalloc of " << bytes << " bytes failed on device " << device_ << ": "
                              << cudaGetErrorString(e) << " (backend holds " << current_bytes_
                              << " bytes; device free " << free_b << " of " << total_b << ")");
  }
  std::lock_guard<std::mutex> lock(mem_mutex_);
  ++allocations_;
  current_bytes_ += sz;
  peak_bytes_ = std::max(peak_bytes_, current_bytes_);
  return p;
}

void CudaBackend::internal_free(void* p, size_t bytes) {
  if (!p) return;
  // The only callers free buffers that queued kernels may still use: wait for them first.
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaFree(p));
  std::lock_guard<std::mutex> lock(mem_mutex_);
  current_bytes_ -= std::max<size_t>(bytes, 256);  // what internal_alloc counted
}

void* CudaBackend::alloc(size_t bytes) {
  CUDA_CHECK(cudaSetDevice(device_));  // the loader thread may call us
  void* p = nullptr;
  // cudaMalloc returns 256-byte aligned memory, which every vector load and cuBLASLt needs.
  const size_t sz = std::max<size_t>(bytes, 256);
  cudaError_t e = cudaMalloc(&p, sz);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    throw UserError("cuda backend: out of device memory allocating " + std::to_string(bytes) +
                    " bytes (" + std::to_string(current_bytes_) + " held; device free " +
                    std::to_string(free_b) + " of " + std::to_string(total_b) +
                    "): reduce data.global_batch or raise data.grad_accum");
  }
  std::lock_guard<std::mutex> lock(mem_mutex_);
  track_alloc(p, sz);
  return p;
}

void CudaBackend::track_alloc(void* p, size_t sz) {
  ++allocations_;
  live_[p] = sz;
  current_bytes_ += sz;
  peak_bytes_ = std::max(peak_bytes_, current_bytes_);
}

void* CudaBackend::alloc_comm(size_t bytes) {
  std::shared_ptr<CommAllocator> a = comm_alloc_;
  if (!a) return alloc(bytes);
  CUDA_CHECK(cudaSetDevice(device_));
  const size_t sz = std::max<size_t>(bytes, 256);
  void* p = a->alloc(sz);  // 256-byte aligned like cudaMalloc (the allocator's granularity)
  std::lock_guard<std::mutex> lock(mem_mutex_);
  track_alloc(p, sz);
  comm_live_[p] = std::move(a);
  return p;
}

void CudaBackend::pin_host(void* p, size_t bytes, bool pin) {
  if (!p || bytes == 0) return;
  CUDA_CHECK(cudaSetDevice(device_));
  if (pin)
    CUDA_CHECK(cudaHostRegister(p, bytes, cudaHostRegisterDefault));
  else
    CUDA_CHECK(cudaHostUnregister(p));
}

void CudaBackend::release(void* p) {
  if (!p) return;
  size_t sz = 0;
  std::shared_ptr<CommAllocator> comm;
  {
    std::lock_guard<std::mutex> lock(mem_mutex_);
    auto it = live_.find(p);
    VG_CHECK(it != live_.end(), "cuda backend: release of a pointer not from alloc()");
    sz = it->second;
    live_.erase(it);
    current_bytes_ -= sz;
    auto c = comm_live_.find(p);
    if (c != comm_live_.end()) {
      comm = std::move(c->second);
      comm_live_.erase(c);
    }
  }
  CUDA_CHECK(cudaSetDevice(device_));
  if (comm) {
    CUDA_CHECK(cudaDeviceSynchronize());  // nothing may still use p
    comm->release(p);
    return;
  }
  CUDA_CHECK(cudaFree(p));  // cudaFree waits for work using p
}

void CudaBackend::count_memory(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mem_mutex_);
  current_bytes_ = static_cast<size_t>(static_cast<int64_t>(current_bytes_) + bytes);
  peak_bytes_ = std::max(peak_bytes_, current_bytes_);
}

size_t CudaBackend::peak_memory_bytes() const {
  std::lock_guard<std::mutex> lock(mem_mutex_);
  return peak_bytes_;
}
size_t CudaBackend::current_memory_bytes() const {
  std::lock_guard<std::mutex> lock(mem_mutex_);
  return current_bytes_;
}
int64_t CudaBackend::device_allocations() const {
  std::lock_guard<std::mutex> lock(mem_mutex_);
  return allocations_;
}

void CudaBackend::plan_workspace(const WorkspacePlan& p) {
  const int64_t rows = std::max<int64_t>(p.max_rows, 0), cols = std::max<int64_t>(p.max_cols, 0);
  const int64_t lists = std::max<int64_t>(p.slice_lists, 0);
  const int64_t slices = std::max<int64_t>(p.slices, 0);
  const int64_t elems = std::max<int64_t>(p.slice_elems, 0);
  // One scratch serves every user in stream order: its size is the largest single need.
  const size_t need = std::max({
      column_sums_scratch_bytes(rows, cols),            // linear_backward's bias gradient
      fp8_grad_scratch_bytes(rows, cols),               // fp8_cast_grad's bias gradient
      layernorm_scratch_bytes(rows, cols),              // dgamma / dbeta partials
      layernorm_split_scratch_bytes(rows, cols),        // the same, rows split over ranks
      layernorm_fp8_scratch_bytes(rows, std::max<int64_t>(p.fp8_layernorm_cols, 0),
                                  act_size()),          // a LayerNorm's y before its FP8 cast
      sum_squares_scratch_bytes(lists, slices, elems),  // per-chunk partial sums
      static_cast<size_t>(std::max<int64_t>(p.max_weight_elems, 0)) * act_size(),  // dW temp
      std::min(p.max_copy_bytes, kCopyPieceBytes)});    // overlapping copies, in pieces
  if (need > scratch_bytes_) {
    internal_free(scratch_, scratch_bytes_);
    scratch_ = nullptr;
    scratch_bytes_ = need;
    scratch_ = internal_alloc(scratch_bytes_);
  }
  colsum_counters(static_cast<int>((cols + 31) / 32));
  const size_t arena = slice_arena_bytes(lists, slices, elems);
  if (arena > slice_arena_bytes_ - slice_arena_used_) {
    if (slice_arena_used_ == 0) {
      internal_free(slice_arena_, slice_arena_bytes_);
    } else if (slice_arena_) {
      old_arenas_.push_back(slice_arena_);  // tables point into it: kept until destruction
    }
    slice_arena_ = nullptr;
    slice_arena_bytes_ = arena;
    slice_arena_used_ = 0;
    slice_arena_ = static_cast<char*>(internal_alloc(slice_arena_bytes_));
  }
}

void CudaBackend::copy_to_device(void* dst, const void* src_host, size_t bytes) {
  OpScope op_scope(*this, "copy_to_device");
  if (!bytes) return;
  CUDA_CHECK(cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, stream_));
  // Pageable source memory may be reused by the caller as soon as we return; for pageable
  // memory cudaMemcpyAsync has staged it already, for pinned memory it has not: wait.
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}
void CudaBackend::copy_to_host(void* dst_host, const void* src, size_t bytes) {
  if (!bytes) return;
  CUDA_CHECK(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}
void CudaBackend::copy(void* dst, const void* src, size_t bytes) {
  OpScope op_scope(*this, "copy");
  if (!bytes || dst == src) return;
  // Device-to-device cudaMemcpy handles overlapping ranges like memmove? It does not
  // promise so; overlapping copies go through a scratch buffer.
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  const bool overlap = (d < s + bytes) && (s < d + bytes);
  if (overlap) {
    // memmove through the scratch, in pieces no larger than it (or kCopyPieceBytes when it is
    // smaller), so the copy never needs a scratch of its own size. Each piece is read whole
    // before it is written; pieces go forward when dst < src (a piece's write covers source
    // bytes of this or earlier pieces only) and backward otherwise.
    const size_t piece = std::min(bytes, std::max(scratch_bytes_, kCopyPieceBytes));
    char* tmp = static_cast<char*>(scratch(piece));
    const size_t n = (bytes + piece - 1) / piece;
    for (size_t i = 0; i < n; ++i) {
      const size_t off = (d < s ? i : n - 1 - i) * piece;
      const size_t len = std::min(piece, bytes - off);
      CUDA_CHECK(cudaMemcpyAsync(tmp, s + off, len, cudaMemcpyDeviceToDevice, stream_));
      CUDA_CHECK(cudaMemcpyAsync(d + off, tmp, len, cudaMemcpyDeviceToDevice, stream_));
    }
  } else {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
}
void CudaBackend::zero(void* p, size_t bytes) {
  OpScope op_scope(*this, "zero");
  if (bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
}
void CudaBackend::synchronize() { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

unsigned* CudaBackend::colsum_counters(int groups) {
  const size_t n = static_cast<size_t>(std::max(groups, 1));
  if (n > colsum_done_n_) {  // planned by plan_workspace; beyond the plan (or none): grow
    internal_free(colsum_done_, colsum_done_n_ * sizeof(unsigned));
    colsum_done_n_ = n;
    colsum_done_ = static_cast<unsigned*>(internal_alloc(n * sizeof(unsigned)));
    CUDA_CHECK(cudaMemsetAsync(colsum_done_, 0, n * sizeof(unsigned), stream_));
  }
  return colsum_done_;
}

void* CudaBackend::scratch(size_t bytes) {
  if (bytes > scratch_bytes_) {
    // Only when the request is beyond plan_workspace's bound (or nothing was planned): grows
    // to the largest request seen, so at least the steady state never allocates.
    internal_free(scratch_, scratch_bytes_);
    scratch_ = nullptr;
    scratch_bytes_ = std::max(bytes, scratch_bytes_ * 2);
    scratch_ = internal_alloc(scratch_bytes_);
  }
  return scratch_;
}

// One table: chunks [max(1, nchunks)], first_chunk [nslices + 1], ratio [max(1, nslices)], each
// 256-byte aligned. Over several lists: sum(ceil(n_i / kChunkElems)) <= elems / kChunkElems +
// slices chunks, max(1, x) <= x + 1 and each alignment adds < 256 bytes.
size_t CudaBackend::slice_arena_bytes(int64_t lists, int64_t slices, int64_t elems) {
  if (lists <= 0) return 0;
  const size_t L = static_cast<size_t>(lists), S = static_cast<size_t>(std::max<int64_t>(slices, 0));
  const size_t chunks = static_cast<size_t>(std::max<int64_t>(elems, 0)) / kChunkElems + S;
  return sizeof(SliceChunk) * (chunks + L) + sizeof(uint32_t) * (S + L) +
         sizeof(float) * (S + L) + 3 * 256 * L;
}

const SliceTable& CudaBackend::slice_table(const std::vector<ParamSlice>& slices) {
  // The model passes the same few slice lists every step: an exact-match linear search over
  // the (few) cached tables is cheaper than hashing and never confuses two lists.
  for (const SliceTable& t : slice_tables_) {
    if (t.slices.size() != slices.size()) continue;
    bool same = true;
    for (size_t i = 0; i < slices.size() && same; ++i) {
      same = t.slices[i].offset == slices[i].offset && t.slices[i].n == slices[i].n &&
             t.slices[i].weight_decay == slices[i].weight_decay;
    }
    if (same) return t;
  }
  SliceTable t;
  t.slices = slices;
  t.nslices = static_cast<int>(slices.size());
  std::vector<SliceChunk> chunks;
  std::vector<uint32_t> first(slices.size() + 1, 0);
  for (size_t i = 0; i < slices.size(); ++i) {
    first[i] = static_cast<uint32_t>(chunks.size());
    for (size_t o = 0; o < slices[i].n; o += kChunkElems) {
      SliceChunk c{};
      c.offset = slices[i].offset + o;
      c.n = static_cast<uint32_t>(std::min<size_t>(kChunkElems, slices[i].n - o));
      c.slice = static_cast<uint32_t>(i);
      c.weight_decay = slices[i].weight_decay;
      chunks.push_back(c);
    }
  }
  first[slices.size()] = static_cast<uint32_t>(chunks.size());
  VG_CHECK(chunks.size() < (1u << 31), "slice list too large");
  t.nchunks = static_cast<int>(chunks.size());
  // one block for the three arrays: from the planned arena, or (beyond the plan) its own
  const size_t b_chunks = align256(std::max<size_t>(1, chunks.size()) * sizeof(SliceChunk));
  const size_t b_first = align256(first.size() * sizeof(uint32_t));
  const size_t b_ratio = align256(std::max<size_t>(1, slices.size()) * sizeof(float));
  const size_t bytes = b_chunks + b_first + b_ratio;
  char* mem = nullptr;
  if (slice_arena_ && bytes <= slice_arena_bytes_ - slice_arena_used_) {
    mem = slice_arena_ + slice_arena_used_;
    slice_arena_used_ += bytes;
  } else {
    t.own = internal_alloc(bytes);
    mem = static_cast<char*>(t.own);
  }
  t.chunks = reinterpret_cast<SliceChunk*>(mem);
  t.first_chunk = reinterpret_cast<uint32_t*>(mem + b_chunks);
  t.ratio = reinterpret_cast<float*>(mem + b_chunks + b_first);
  if (!chunks.empty()) {
    CUDA_CHECK(cudaMemcpyAsync(t.chunks, chunks.data(), chunks.size() * sizeof(SliceChunk),
                               cudaMemcpyHostToDevice, stream_));
  }
  CUDA_CHECK(cudaMemcpyAsync(t.first_chunk, first.data(), first.size() * sizeof(uint32_t),
                             cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host vectors die with this scope
  slice_tables_.push_back(std::move(t));
  return slice_tables_.back();
}

}  // namespace vitgrid
