// CUDA graphs of the training step and the asynchronous readback of its scalars.
// The stream is captured in thread-local mode: the NCCL watchdog thread keeps querying its
// events meanwhile (the collectives know about the capture and record none inside it).
#include "cuda_backend_impl.h"

namespace vitgrid {

void CudaBackend::readback_start(int slot, const void* src, size_t bytes) {
  VG_CHECK(slot >= 0, "cuda backend: readback slot " << slot);
  if (static_cast<size_t>(slot) >= readbacks_.size()) readbacks_.resize(slot + 1);
  Readback& r = readbacks_[slot];
  if (r.done) CUDA_CHECK(cudaEventSynchronize(r.done));  // its last copy has landed
  if (bytes > r.bytes) {
    if (r.host) CUDA_CHECK(cudaFreeHost(r.host));
    r.host = nullptr;
    CUDA_CHECK(cudaMallocHost(&r.host, bytes));  // host memory: not in the device accounting
    r.bytes = bytes;
  }
  if (!r.done) CUDA_CHECK(cudaEventCreateWithFlags(&r.done, cudaEventDisableTiming));
  CUDA_CHECK(cudaMemcpyAsync(r.host, src, bytes, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaEventRecord(r.done, stream_));
}

const void* CudaBackend::readback_wait(int slot) {
  VG_CHECK(slot >= 0 && static_cast<size_t>(slot) < readbacks_.size() && readbacks_[slot].done,
           "cuda backend: readback slot " << slot << " was never started");
  CUDA_CHECK(cudaEventSynchronize(readbacks_[slot].done));
  return readbacks_[slot].host;
}

void CudaBackend::capture_begin() {
  VG_CHECK(!capturing_, "cuda backend: capture_begin inside a capture");
  CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  capturing_ = true;
}

int CudaBackend::capture_end() {
  VG_CHECK(capturing_, "cuda backend: capture_end without capture_begin");
  capturing_ = false;
  cudaGraph_t g = nullptr;
  CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  CUDA_CHECK(cudaGraphDestroy(g));
  graphs_.push_back(exec);
  return static_cast<int>(graphs_.size()) - 1;
}

void CudaBackend::launch_graph(int id) {
  VG_CHECK(id >= 0 && static_cast<size_t>(id) < graphs_.size() && graphs_[id],
           "cuda backend: graph " << id << " does not exist");
  CUDA_CHECK(cudaGraphLaunch(graphs_[id], stream_));
}

void CudaBackend::drop_graphs() {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (cudaGraphExec_t& g : graphs_)
    if (g) CUDA_CHECK(cudaGraphExecDestroy(g));
  graphs_.clear();
}

// Destructor helper: the stream is idle by then.
void CudaBackend::release_graphs() {
  for (cudaGraphExec_t g : graphs_)
    if (g) cudaGraphExecDestroy(g);
  graphs_.clear();
  for (Readback& r : readbacks_) {
    if (r.host) cudaFreeHost(r.host);
    if (r.done) cudaEventDestroy(r.done);
  }
  readbacks_.clear();
}

}  // namespace vitgrid
