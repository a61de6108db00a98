// Collectives over NCCL: one communicator per non-trivial axis of the process grid, each
// created from a unique id broadcast over that axis' MPI communicator, all enqueued on the
// CUDA backend's stream. Every call waits for completion under a watchdog (nccl-tests style):
// it polls cudaStreamQuery and ncclCommGetAsyncError, and on an error or after timeout_s it
// names the axis, aborts every communicator and the MPI job, so no rank hangs silently.
// The asynchronous reductions (gradient buckets overlapped with the backward) run on a
// dedicated communication stream: each waits on an event recorded on the compute stream when
// it is started; wait_all() waits for the communication stream under the same watchdog and
// makes the compute stream wait on it.
#include <mpi.h>
#include <nccl.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "cuda_backend_impl.h"
#include "vitgrid/backend/cuda/cuda_backend.h"

#define NCCL_CHECK(call)                                                                  \
  do {                                                                                    \
    ncclResult_t vg_r_ = (call);                                                          \
    if (vg_r_ != ncclSuccess && vg_r_ != ncclInProgress)                                  \
      VG_FAIL("NCCL error in " #call ": " << ncclGetErrorString(vg_r_) << " ("           \
                                          << ncclGetLastError(nullptr) << ")");          \
  } while (0)

namespace vitgrid {

namespace {

class NcclCollectives final : public Collectives {
 public:
  // Called by all ranks of the grid's world: communicator creation is collective per axis,
  // and every rank visits the axes in the same order, so creation cannot deadlock.
  NcclCollectives(const ProcessGrid& grid, CudaBackend& be, double timeout_s)
      : be_(be), stream_(be.stream()), timeout_s_(timeout_s) {
    // NVLink multicast (NVLS) must stay off on the target machines; the user may still
    // override it explicitly in the environment.
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    CUDA_CHECK(cudaSetDevice(be.device()));
    comms_.fill(nullptr);
    for (int a = 0; a < static_cast<int>(Axis::Count); ++a) {
      const Comm& c = grid.comm(static_cast<Axis>(a));
      sizes_[a] = c.valid() ? c.size() : 1;
      if (!c.valid() || c.size() <= 1) continue;
      ncclUniqueId id;
      if (c.rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
      MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, c.get()));
      NCCL_CHECK(ncclCommInitRank(&comms_[a], c.size(), id, c.rank()));
    }
    CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)));
    CUDA_CHECK(cudaMemsetAsync(barrier_buf_, 0, sizeof(float), stream_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&ready_ev_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&done_ev_, cudaEventDisableTiming));
  }

  ~NcclCollectives() override {
    cudaStreamSynchronize(comm_stream_);
    cudaStreamSynchronize(stream_);
    for (ncclComm_t c : comms_)
      if (c) ncclCommDestroy(c);
    cudaEventDestroy(done_ev_);
    cudaEventDestroy(ready_ev_);
    cudaStreamDestroy(comm_stream_);
    cudaFree(barrier_buf_);
  }

  // ---- asynchronous reductions on the communication stream
  void start_allreduce_sum(float* buf, size_t n, Axis a) override {
    if (ncclComm_t c = comm(a)) {
      order_after_compute(a);
      NCCL_CHECK(ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, c, comm_stream_));
    }
  }
  void start_reduce_scatter_sum(float* out, const float* in, size_t n, Axis a) override {
    if (ncclComm_t c = comm(a)) {
      // out == in + rank * n is NCCL's in-place form
      order_after_compute(a);
      NCCL_CHECK(ncclReduceScatter(in, out, n, ncclFloat, ncclSum, c, comm_stream_));
    } else if (out != in) {
      CUDA_CHECK(cudaMemcpyAsync(out, in, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    }
  }
  void wait_all() override {
    if (!pending_) return;
    CUDA_CHECK(cudaEventRecord(done_ev_, comm_stream_));
    // the watchdog polls the async errors of every axis that has reductions in flight
    poll([&] { return cudaEventQuery(done_ev_); }, pending_axes_, "asynchronous reduction");
    CUDA_CHECK(cudaStreamWaitEvent(stream_, done_ev_, 0));
    pending_ = false;
    pending_axes_ = 0;
  }

  void allreduce_sum(float* buf, size_t n, Axis a) override {
    if (ncclComm_t c = comm(a)) {
      NCCL_CHECK(ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, c, stream_));
      wait(a, "allreduce_sum");
    }
  }
  void allreduce_max(float* buf, size_t n, Axis a) override {
    if (ncclComm_t c = comm(a)) {
      NCCL_CHECK(ncclAllReduce(buf, buf, n, ncclFloat, ncclMax, c, stream_));
      wait(a, "allreduce_max");
    }
  }
  void allreduce_sum_act(void* buf, size_t n, size_t elem_size, Axis a) override {
    const ncclDataType_t t = act_type(elem_size, "allreduce_sum_act");
    if (ncclComm_t c = comm(a)) {
      NCCL_CHECK(ncclAllReduce(buf, buf, n, t, ncclSum, c, stream_));
      wait(a, "allreduce_sum_act");
    }
  }
  void broadcast(void* buf, size_t bytes, int root, Axis a) override {
    if (ncclComm_t c = comm(a)) {
      NCCL_CHECK(ncclBroadcast(buf, buf, bytes, ncclUint8, root, c, stream_));
      wait(a, "broadcast");
    }
  }
  void allgather(void* out, const void* in, size_t n, size_t elem_size, Axis a) override {
    if (ncclComm_t c = comm(a)) {
      NCCL_CHECK(ncclAllGather(in, out, n * elem_size, ncclUint8, c, stream_));
      wait(a, "allgather");
    } else if (out != in) {
      CUDA_CHECK(cudaMemcpyAsync(out, in, n * elem_size, cudaMemcpyDeviceToDevice, stream_));
    }
  }
  void reduce_scatter_sum(float* out, const float* in, size_t n, Axis a) override {
    if (ncclComm_t c = comm(a)) {
      NCCL_CHECK(ncclReduceScatter(in, out, n, ncclFloat, ncclSum, c, stream_));
      wait(a, "reduce_scatter_sum");
    } else if (out != in) {
      CUDA_CHECK(cudaMemcpyAsync(out, in, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    }
  }
  void reduce_scatter_sum_act(void* out, const void* in, size_t n, size_t elem_size,
                              Axis a) override {
    const ncclDataType_t t = act_type(elem_size, "reduce_scatter_sum_act");
    if (ncclComm_t c = comm(a)) {
      NCCL_CHECK(ncclReduceScatter(in, out, n, t, ncclSum, c, stream_));
      wait(a, "reduce_scatter_sum_act");
    } else if (out != in) {
      CUDA_CHECK(cudaMemcpyAsync(out, in, n * elem_size, cudaMemcpyDeviceToDevice, stream_));
    }
  }
  void send(const void* buf, size_t bytes, int peer, Axis a) override {
    ncclComm_t c = comm(a);
    VG_CHECK(c, "send over axis " << axis_name(a) << " of size 1");
    NCCL_CHECK(ncclGroupStart());
    NCCL_CHECK(ncclSend(buf, bytes, ncclUint8, peer, c, stream_));
    NCCL_CHECK(ncclGroupEnd());
    wait(a, "send");
  }
  void recv(void* buf, size_t bytes, int peer, Axis a) override {
    ncclComm_t c = comm(a);
    VG_CHECK(c, "recv over axis " << axis_name(a) << " of size 1");
    NCCL_CHECK(ncclGroupStart());
    NCCL_CHECK(ncclRecv(buf, bytes, ncclUint8, peer, c, stream_));
    NCCL_CHECK(ncclGroupEnd());
    wait(a, "recv");
  }
  void barrier(Axis a) override {
    if (ncclComm_t c = comm(a)) {
      NCCL_CHECK(ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat, ncclSum, c, stream_));
      wait(a, "barrier");
    }
  }

 private:
  ncclComm_t comm(Axis a) const { return comms_[static_cast<int>(a)]; }

  // The NCCL type of an act-dtype element: 4 bytes fp32, 2 bytes the backend's bf16/fp16.
  ncclDataType_t act_type(size_t elem_size, const char* what) const {
    if (elem_size == 2) {
      VG_CHECK(be_.act_dtype() != DType::F32, what << ": 2-byte elements with an fp32 backend");
      return be_.act_dtype() == DType::BF16 ? ncclBfloat16 : ncclFloat16;
    }
    VG_CHECK(elem_size == 4, what << ": element size " << elem_size);
    return ncclFloat;
  }

  // The communication stream starts after the compute stream's work enqueued so far.
  void order_after_compute(Axis a) {
    CUDA_CHECK(cudaEventRecord(ready_ev_, stream_));
    CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ready_ev_, 0));
    pending_ = true;
    pending_axes_ |= 1u << static_cast<int>(a);
  }

  // The watchdog: waits for the stream (hence the collective just enqueued) to drain.
  void wait(Axis a, const char* what) {
    poll([&] { return cudaStreamQuery(stream_); }, 1u << static_cast<int>(a), what);
  }

  // Polls `query` (cudaSuccess: done) while checking the NCCL async errors of the axes in
  // `axes` (bit per Axis) and the timeout.
  template <class Query>
  void poll(Query&& query, unsigned axes, const char* what) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    int first = 0;
    while (first < static_cast<int>(Axis::Count) && !(axes & (1u << first))) ++first;
    const Axis a0 = static_cast<Axis>(first);
    int spins = 0;
    for (;;) {
      const cudaError_t q = query();
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) {
        abort_all(a0, what, std::string("CUDA error while waiting: ") + cudaGetErrorString(q));
      }
      for (int i = 0; i < static_cast<int>(Axis::Count); ++i) {
        const Axis a = static_cast<Axis>(i);
        if (!(axes & (1u << i)) || !comm(a)) continue;
        ncclResult_t ae = ncclSuccess;
        const ncclResult_t r = ncclCommGetAsyncError(comm(a), &ae);
        if (r != ncclSuccess) ae = r;
        if (ae != ncclSuccess && ae != ncclInProgress) {
          abort_all(a, what, std::string("NCCL async error: ") + ncclGetErrorString(ae) + " (" +
                                 ncclGetLastError(comm(a)) + ")");
        }
      }
      const double waited = std::chrono::duration<double>(clock::now() - start).count();
      if (waited > timeout_s_) {
        abort_all(a0, what, "timed out after " + std::to_string(waited) +
                                " s (a peer is stuck, dead, or calls a different collective)");
      }
      // Spin briefly for short collectives, then back off so the poll costs no CPU.
      if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  [[noreturn]] void abort_all(Axis a, const char* what, const std::string& why) {
    for (ncclComm_t& c : comms_) {
      if (c) ncclCommAbort(c);
      c = nullptr;
    }
    VG_FAIL("NCCL " << what << " over axis " << axis_name(a) << " (size "
                    << sizes_[static_cast<int>(a)] << "): " << why);
  }

  CudaBackend& be_;
  cudaStream_t stream_;
  double timeout_s_;
  std::array<ncclComm_t, static_cast<int>(Axis::Count)> comms_;
  std::array<int, static_cast<int>(Axis::Count)> sizes_{};
  float* barrier_buf_ = nullptr;
  cudaStream_t comm_stream_ = nullptr;  // asynchronous reductions
  cudaEvent_t ready_ev_ = nullptr;      // compute stream -> communication stream
  cudaEvent_t done_ev_ = nullptr;       // communication stream -> compute stream
  bool pending_ = false;
  unsigned pending_axes_ = 0;
};

}  // namespace

std::unique_ptr<Collectives> make_nccl_collectives(const ProcessGrid& grid, Backend& backend,
                                                   double timeout_s) {
  auto* be = dynamic_cast<CudaBackend*>(&backend);
  if (!be) throw UserError("NCCL collectives need the cuda backend (device.backend = cuda)");
  return std::make_unique<NcclCollectives>(grid, *be, timeout_s);
}

}  // namespace vitgrid
