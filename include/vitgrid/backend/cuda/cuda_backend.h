// The CUDA backend of the op set (cuBLASLt GEMMs, own kernels, NCCL collectives).
// Only declared when the library is built with VITGRID_HAVE_CUDA; this header pulls in no
// CUDA header so that plain C++ translation units (the backend factory, the app) can use it.
//
// Conventions beyond backend.h, fixed here:
//  * act_size() is 4 (fp32), 2 (bf16 / fp16): activations are stored in the act dtype.
//  * Every kernel computes in fp32 and rounds once when it stores an act-dtype result;
//    reductions (layernorm statistics and parameter gradients, bias gradients, embedding
//    gradients, sums) are deterministic two-stage reductions (no floating-point atomics), so
//    two runs of the same step give bit-identical results.
//  * Attention: the fallback path (cuBLASLt strided GEMMs + softmax kernel) saves the softmax
//    probabilities [B,H,T,T] in the act dtype, like the CPU backend. Scores are kept in fp32.
//  * cross_entropy: a label outside [0, K) cannot throw from the device; that row's loss
//    (and its gradient row) become NaN, which the trainer's all_finite check catches.
//  * peak_memory_bytes() counts alloc() plus the backend's own buffers (cuBLASLt workspace,
//    reduction scratch, slice tables): all device memory the backend holds.
#pragma once
#include <memory>

#include "vitgrid/backend/backend.h"
#include "vitgrid/grid/grid.h"

namespace vitgrid {

// A backend on local GPU `device` with activations in `act`. opts.allow_tf32 lets fp32 GEMMs
// use TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32); ignored for bf16/fp16.
// opts.gemm_tune > 1 (deck device.gemm_tune, at most 16): the first time a GEMM shape runs,
// time cuBLASLt's first gemm_tune candidates for it and keep the fastest (the choice depends
// on timing, so runs are no longer bit-identical); 0 or 1: the heuristic's first choice.
// opts.deterministic = false: cuDNN's attention backward may take its non-deterministic
// (atomic dQ accumulation) algorithm.
// opts.attention (device.attention): Auto takes cuDNN's fused SDPA where the build has
// cudnn_frontend and cuDNN accepts the shape, else vitgrid's flash kernels, else the cuBLASLt +
// softmax fallback; Cudnn the same (UserError in a build without cudnn_frontend); Flash skips
// cuDNN; Fallback always the last.
// opts.fused_gelu (device.fused_gelu): fc1's forward and fc2's data gradient as CUTLASS GEMMs
// with GELU epilogues (sm_90, bf16/fp16, built with CUTLASS): Auto per shape the faster of the
// unfused path and the configurations, timed when gemm_tune > 1, else unfused (the
// reproducible default); Off never; On always, the configuration timed when gemm_tune > 1,
// else configuration 0. fused_gelu_forward_config / _backward_config >= 0 force those
// configuration ids (unless Off; UserError when out of range for the act dtype).
// opts.tuning_log: each tuned GEMM and fused-GELU choice to stderr.
std::unique_ptr<Backend> make_cuda_backend(int device, DType act, const BackendOptions& opts = {});

// The attention path a CUDA backend takes for a shape: "cudnn" (cuDNN's fused SDPA), "flash"
// (vitgrid's own kernels) or "fallback" (cuBLASLt + softmax), as BackendOptions::attention
// chooses. "none" for a backend that is not a CUDA one.
const char* cuda_attention_path(const Backend& be, int B, int T, int H, int hd);

// Number of visible CUDA devices; 0 when there is no driver or no device (never aborts).
int cuda_device_count();

// NCCL collectives mirroring every non-trivial axis of `grid` (one communicator per axis
// communicator of size > 1), enqueued on `backend`'s stream (which must be a CUDA backend)
// so they are ordered after the ops that produced their inputs and before the ops enqueued
// after them. Calls return once enqueued (the host does not wait for the GPU); a watchdog
// thread follows every collective (an event behind it), polls for NCCL async errors and for a
// collective that stays the oldest incomplete one longer than options.timeout_s seconds, and on
// either aborts every communicator and the MPI job (never hangs). barrier() waits on the host;
// options.blocking (deck device.nccl_blocking) makes every call wait (debugging).
// Sets NCCL_NVLS_ENABLE=0 unless the environment sets it (NVLink multicast stays off).
// Called by all ranks of the grid's world communicator (communicator creation is collective).
// Elem::Act maps to the backend's act dtype (ncclFloat, ncclBfloat16 or ncclFloat16).
// send/recv are stream-ordered: issue them in an order that would be deadlock-free with
// blocking MPI_Send/MPI_Recv. Operations on an axis of size 1 are
// local (copies or no-ops). The asynchronous messages (post_send / post_recv, after
// open_links) run on streams of their own, one two-rank communicator per channel and
// direction; pipe_ctas > 0 (deck device.pipe_comm_ctas) caps the thread blocks of each, since
// a receive posted early waits on its SMs beside the compute.
// start_allreduce / start_reduce_scatter / start_allgather run on a dedicated communication
// stream that first waits on an event recorded on the backend's stream (so they follow the kernels
// that produced their inputs, and the compute stream is never blocked by them); wait_all()
// makes the backend's stream wait on that stream (the watchdog follows it too).
// data_ctas > 0 (deck device.data_comm_ctas): the data axis's NCCL kernels use at most that
// many thread blocks (SMs), leaving the rest to the backward they overlap.
// data_copy_engine (deck device.data_comm = copy_engine): the data axis's communicator uses
// NCCL's zero-CTA policy, the backend's alloc_comm() hands out NCCL memory registered as
// symmetric windows over it, and the gradient reductions of such memory run as all-to-all +
// local sum (+ all-gather), which NCCL moves with copy engines (see nccl_collectives.cpp).
// Under 1d sequence parallelism (grid.shape().sequence_parallel) the tensor axis's
// overlapped collectives (grid.h) get a communicator split off its own and a stream of their
// own; tensor_ctas > 0 (deck device.tensor_comm_ctas) caps their thread blocks.
// tensor_copy_engine (deck device.tensor_comm = copy_engine): that communicator uses NCCL's
// zero-CTA policy and overlapped_alloc() hands out symmetric memory over it; a gather copies
// its input into its own block of such an output and all-gathers in place, a reduce-scatter
// is an all-to-all of such memory and a local sum in rank order (no SMs but the sum's).
struct NcclOptions {
  double timeout_s = 600.0;         // device.comm_timeout
  int data_ctas = 0;                // device.data_comm_ctas
  bool data_copy_engine = false;    // device.data_comm = copy_engine
  int pipe_ctas = 0;                // device.pipe_comm_ctas
  int tensor_ctas = 0;              // device.tensor_comm_ctas
  bool tensor_copy_engine = false;  // device.tensor_comm = copy_engine
  bool blocking = false;            // device.nccl_blocking
};
std::unique_ptr<Collectives> make_nccl_collectives(const ProcessGrid& grid, Backend& backend,
                                                   const NcclOptions& options);

}  // namespace vitgrid
