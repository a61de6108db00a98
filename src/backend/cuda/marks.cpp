// Device-time marks: timing events recorded on the backend's stream, kept in a pool that
// clear_marks() recycles (no event is created in a steady-state step loop).
#include "cuda_backend_impl.h"

namespace vitgrid {

int CudaBackend::mark() {
  if (marks_used_ == marks_.size()) {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));
    marks_.push_back(e);
  }
  CUDA_CHECK(cudaEventRecord(marks_[marks_used_], stream_));
  return static_cast<int>(marks_used_++);
}

double CudaBackend::seconds_between(int a, int b) {
  VG_CHECK(a >= 0 && b >= 0 && static_cast<size_t>(std::max(a, b)) < marks_used_,
           "cuda backend: marks " << a << ", " << b << " of " << marks_used_);
  CUDA_CHECK(cudaEventSynchronize(marks_[b]));
  float ms = 0.0f;
  CUDA_CHECK(cudaEventElapsedTime(&ms, marks_[a], marks_[b]));
  return ms * 1e-3;
}

}  // namespace vitgrid
