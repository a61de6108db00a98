// Collectives over NCCL: one communicator per non-trivial axis of the process grid, each
// created from a unique id broadcast over that axis' MPI communicator, all enqueued on the
// CUDA backend's stream. Every call waits for completion under a watchdog (nccl-tests style):
// it polls cudaStreamQuery and ncclCommGetAsyncError, and on an error or after timeout_s it
// names the axis, aborts every communicator and the MPI job, so no rank hangs silently.
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
  }

  ~NcclCollectives() override {
    cudaStreamSynchronize(stream_);
    for (ncclComm_t c : comms_)
      if (c) ncclCommDestroy(c);
    cudaFree(barrier_buf_);
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
    ncclDataType_t t = ncclFloat;
    if (elem_size == 2) {
      VG_CHECK(be_.act_dtype() != DType::F32, "2-byte elements with an fp32 backend");
      t = be_.act_dtype() == DType::BF16 ? ncclBfloat16 : ncclFloat16;
    } else {
      VG_CHECK(elem_size == 4, "allreduce_sum_act: element size " << elem_size);
    }
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

  // The watchdog: waits for the stream (hence the collective just enqueued) to drain.
  void wait(Axis a, const char* what) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    int spins = 0;
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) {
        abort_all(a, what, std::string("CUDA error while waiting: ") + cudaGetErrorString(q));
      }
      ncclResult_t ae = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm(a), &ae);
      if (r != ncclSuccess) ae = r;
      if (ae != ncclSuccess && ae != ncclInProgress) {
        abort_all(a, what, std::string("NCCL async error: ") + ncclGetErrorString(ae) + " (" +
                               ncclGetLastError(comm(a)) + ")");
      }
      const double waited = std::chrono::duration<double>(clock::now() - start).count();
      if (waited > timeout_s_) {
        abort_all(a, what, "timed out after " + std::to_string(waited) +
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
};

}  // namespace

std::unique_ptr<Collectives> make_nccl_collectives(const ProcessGrid& grid, Backend& backend,
                                                   double timeout_s) {
  auto* be = dynamic_cast<CudaBackend*>(&backend);
  if (!be) throw UserError("NCCL collectives need the cuda backend (device.backend = cuda)");
  return std::make_unique<NcclCollectives>(grid, *be, timeout_s);
}

}  // namespace vitgrid
