// The watchdog of NcclCollectives (nccl_collectives_impl.h): the thread that follows every
// collective's event and its communicators' asynchronous errors, the host's waits under the
// same checks (barrier, NcclOptions::blocking), and abort_all, which names the collective and
// the axis and takes the communicators and the MPI job down (no rank hangs).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include "nccl_collectives_impl.h"

namespace vitgrid {

// Waits on the host for the stream (hence the collective just enqueued) to drain, under the
// same checks as the watchdog thread (barrier, and every call with NcclOptions::blocking).
void NcclCollectives::drain(cudaStream_t st, unsigned axes, const char* what) {
  poll([&] { return cudaStreamQuery(st); }, axes, what);
}

// Hands the collective just enqueued on `st` to the watchdog: an event recorded behind it.
void NcclCollectives::track(cudaStream_t st, unsigned axes, const char* what) {
  if (capturing_) return;  // follow() hands over the graph's launch instead
  if (blocking_) return drain(st, axes, what);
  cudaEvent_t ev = nullptr;
  bool full = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_events_.empty()) {
      ev = free_events_.back();
      free_events_.pop_back();
    }
    full = pending_q_.size() >= kMaxPending;
  }
  if (full) drain(st, axes, what);  // bound the queue: the host is far ahead of the GPU
  if (!ev) CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(ev, st));
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_q_.push_back({ev, axes, what, std::chrono::steady_clock::now()});
  }
  cv_.notify_one();
}

// The watchdog thread: follows the oldest pending collective until it completes; the clock
// of a collective starts when it becomes the oldest (or when it was enqueued, if later), so
// time spent queued behind compute never counts against the timeout.
void NcclCollectives::watch() {
  using clock = std::chrono::steady_clock;
  cudaSetDevice(be_.device());
  std::unique_lock<std::mutex> lock(mu_);
  clock::time_point last_done = clock::now();
  while (!stop_) {
    if (pending_q_.empty()) {
      cv_.wait(lock, [&] { return stop_ || !pending_q_.empty(); });
      continue;
    }
    const Pending p = pending_q_.front();
    lock.unlock();
    const cudaError_t q = cudaEventQuery(p.ev);
    if (q == cudaSuccess) {
      last_done = clock::now();
      lock.lock();
      pending_q_.pop_front();
      free_events_.push_back(p.ev);
      continue;
    }
    if (q != cudaErrorNotReady)
      abort_all(first_axis(p.axes), p.what,
                std::string("CUDA error while waiting: ") + cudaGetErrorString(q));
    check_async_errors(p.axes, p.what);
    const clock::time_point start = std::max(p.enqueued, last_done);
    const double waited = std::chrono::duration<double>(clock::now() - start).count();
    if (waited > timeout_s_)
      abort_all(first_axis(p.axes), p.what,
                "timed out after " + std::to_string(waited) +
                    " s (a peer is stuck, dead, or calls a different collective; "
                    "device.comm_timeout sets the limit)");
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    lock.lock();
  }
}

Axis NcclCollectives::first_axis(unsigned axes) {
  int first = 0;
  while (first < static_cast<int>(Axis::Count) && !(axes & (1u << first))) ++first;
  return static_cast<Axis>(first);
}

void NcclCollectives::check_async_errors(unsigned axes, const char* what) {
  for (int i = 0; i < static_cast<int>(Axis::Count); ++i) {
    const Axis a = static_cast<Axis>(i);
    if (!(axes & (1u << i)) || !comm(a)) continue;
    check_async_error(comm(a), a, what);
    if (a == Axis::Pipeline && links_open_.load(std::memory_order_acquire))
      for (Link* l : link_order_) check_async_error(l->comm, a, what);
  }
}

void NcclCollectives::check_async_error(ncclComm_t c, Axis a, const char* what) {
  ncclResult_t ae = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(c, &ae);
  if (r != ncclSuccess) ae = r;
  if (ae != ncclSuccess && ae != ncclInProgress)
    abort_all(a, what, std::string("NCCL async error: ") + ncclGetErrorString(ae) + " (" +
                           ncclGetLastError(c) + ")");
}

// Polls `query` (cudaSuccess: done) while checking the NCCL async errors of the axes in
// `axes` (bit per Axis) and the timeout.
template <class Query>
void NcclCollectives::poll(Query&& query, unsigned axes, const char* what) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const Axis a0 = first_axis(axes);
  int spins = 0;
  for (;;) {
    const cudaError_t q = query();
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) {
      abort_all(a0, what, std::string("CUDA error while waiting: ") + cudaGetErrorString(q));
    }
    check_async_errors(axes, what);
    const double waited = std::chrono::duration<double>(clock::now() - start).count();
    if (waited > timeout_s_) {
      abort_all(a0, what, "timed out after " + std::to_string(waited) +
                              " s (a peer is stuck, dead, or calls a different collective)");
    }
    // Spin briefly for short collectives, then back off so the poll costs no CPU.
    if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// From the host thread or the watchdog thread: the first caller names the collective,
// aborts the communicators (which unblocks kernels stuck in them) and the MPI job. Either
// abort can itself block behind a stuck kernel or peer: a reaper ends the process after
// kAbortGraceSeconds regardless, and the launcher then takes the other ranks down.
void NcclCollectives::abort_all(Axis a, const char* what, const std::string& why) {
  static std::mutex abort_mu;
  std::lock_guard<std::mutex> lock(abort_mu);
  std::ostringstream msg;
  msg << "NCCL " << what << " over axis " << axis_name(a) << " (size "
      << sizes_[static_cast<int>(a)] << "): " << why;
  fail_one_with_cleanup(
      __FILE__, __LINE__, msg.str(),
      [this] {
        if (links_open_.load(std::memory_order_acquire))
          for (Link* l : link_order_) ncclCommAbort(l->comm);
        for (ncclComm_t& c : comms_) {
          if (c) ncclCommAbort(c);
          c = nullptr;
        }
      },
      kAbortGraceSeconds);
}

}  // namespace vitgrid
