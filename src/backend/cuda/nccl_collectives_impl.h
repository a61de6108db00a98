// NcclCollectives: the class behind make_nccl_collectives(), with NCCL_CHECK and the
// symmetric-memory allocator, shared by the translation units that define it: communicators,
// collectives and reductions in nccl_collectives.cpp (whose header comment tells the design),
// the pipeline axis's asynchronous message links in nccl_links.cpp, the watchdog and the
// error checks in nccl_watch.cpp. Internal: not installed, not included outside
// src/backend/cuda; only these translation units need nccl.h.
#pragma once
#include <nccl.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

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

// NCCL memory registered as symmetric windows over the data axis's communicator: the
// allocator the backend's alloc_comm() uses under copy-engine data collectives. Shared with
// the backend, which may release blocks after the collectives are gone (then only freed).
struct SymmetricMemory {
  std::mutex mu;
  ncclComm_t comm = nullptr;  // null once the collectives are destroyed
  std::map<char*, std::pair<size_t, ncclWindow_t>> blocks;  // start -> bytes, window

  void* alloc(size_t bytes);
  // returns the block's size
  size_t release(void* p);
  // whether [p, p + bytes) lies inside one registered block
  bool holds(const void* p, size_t bytes);
};

class NcclCollectives final : public Collectives {
 public:
  // Called by all ranks of the grid's world (communicator creation is collective).
  NcclCollectives(const ProcessGrid& grid, CudaBackend& be, const NcclOptions& o);
  ~NcclCollectives() override;

  // ---- asynchronous reductions on the communication stream
  void plan_reduce(size_t max_n, Axis a) override;
  void start_allreduce_sum(float* buf, size_t n, Axis a) override;
  void start_allreduce_sum_act(void* buf, size_t n, size_t elem_size, Axis a) override;
  void start_reduce_scatter_sum(float* out, const float* in, size_t n, Axis a) override;
  size_t start_allgather(void* out, const void* in, size_t n, size_t elem_size, Axis a) override;
  void wait_started(size_t t) override;
  void wait_all() override;

  // ---- overlapped collectives on the side stream (the tensor axis under sequence
  // parallelism; elsewhere the blocking calls)
  size_t start_overlapped_allgather(void* out, const void* in, size_t n, size_t elem_size,
                                    Axis a) override;
  size_t start_overlapped_reduce_scatter_act(void* out, const void* in, size_t n,
                                             size_t elem_size, Axis a) override;
  void wait_overlapped(size_t ticket) override;
  int overlapped_sms(Axis a) const override { return side(a) ? side_sms_ : 0; }
  void* overlapped_alloc(size_t bytes) override;
  void overlapped_release(void* p) override;

  void allreduce_sum(float* buf, size_t n, Axis a) override;
  void allreduce_max(float* buf, size_t n, Axis a) override;
  void allreduce_sum_f64(double* buf, size_t n, Axis a) override;
  void allreduce_sum_act(void* buf, size_t n, size_t elem_size, Axis a) override;
  void broadcast(void* buf, size_t bytes, int root, Axis a) override;
  void allgather(void* out, const void* in, size_t n, size_t elem_size, Axis a) override;
  void reduce_scatter_sum(float* out, const float* in, size_t n, Axis a) override;
  void reduce_scatter_sum_act(void* out, const void* in, size_t n, size_t elem_size,
                              Axis a) override;
  void send(const void* buf, size_t bytes, int peer, Axis a) override;
  void recv(void* buf, size_t bytes, int peer, Axis a) override;
  void group_begin() override;
  void group_end() override;
  // ---- asynchronous messages (grid.h): each on its link's stream, tickets are events
  // (nccl_links.cpp)
  void open_links(Axis a) override;
  size_t post_send(const void* buf, size_t bytes, int peer, int channel, Axis a) override;
  size_t post_recv(void* buf, size_t bytes, int peer, int channel, Axis a,
                   const std::vector<size_t>& after) override;
  void wait_message(size_t t) override;
  size_t fence() override;
  void wait_messages() override;
  // While the stream is captured, the calls go into the graph; the graph's launch is followed
  // as a whole (follow), after it.
  void capture(bool on) override { capturing_ = on; }
  void follow(const char* what) override;
  void barrier(Axis a) override;

 private:
  ncclComm_t comm(Axis a) const { return comms_[static_cast<int>(a)]; }

  // The link of an asynchronous message: channel, direction (0 send, 1 receive), checked
  // against its peer.
  struct Link {
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;  // wait_messages
    int peer = -1;               // pipeline rank at the other end
  };
  static constexpr int kChannels = 2;
  Link& link(int channel, int dir, int peer, Axis a);
  size_t message_ticket(cudaStream_t st);

  bool copy_engine(const void* buf, size_t n, Axis a) const;
  ncclDataType_t act_type(size_t elem_size, const char* what) const;
  void* own_alloc(SymmetricMemory& m, size_t bytes);
  void own_release(SymmetricMemory& m, void* p);
  void* side_recv(size_t need);
  void stage(void* dst, const void* src, size_t bytes);
  // Whether axis a's overlapped collectives run on the side stream.
  bool side(Axis a) const { return a == Axis::Tensor && side_comm_; }
  void order_side_after_compute();
  size_t open_side(bool recorded);
  void order_after_compute(Axis a);

  static unsigned bit(Axis a) { return 1u << static_cast<int>(a); }

  // Test fault injection: true for the call that test_hooks.h's nccl_skip_* name on this rank.
  bool skipped() { return skip_call_ > 0 && ++calls_ == skip_call_; }

  // ---- the watchdog, the host's waits and the error checks (nccl_watch.cpp)
  void wait(cudaStream_t st, unsigned axes, const char* what);
  void track(cudaStream_t st, unsigned axes, const char* what);
  void watch();
  static Axis first_axis(unsigned axes);
  void check_async_errors(unsigned axes, const char* what);
  void check_async_error(ncclComm_t c, Axis a, const char* what);
  template <class Query>
  void poll(Query&& query, unsigned axes, const char* what);
  [[noreturn]] void abort_all(Axis a, const char* what, const std::string& why);
  static constexpr double kAbortGraceSeconds = 10.0;

  CudaBackend& be_;
  cudaStream_t stream_;
  double timeout_s_;
  int pipe_ctas_;   // thread blocks of each asynchronous message link (0: NCCL's choice)
  int pipe_rank_;
  std::array<ncclComm_t, static_cast<int>(Axis::Count)> comms_;
  std::array<int, static_cast<int>(Axis::Count)> sizes_{};
  float* barrier_buf_ = nullptr;
  // copy-engine data collectives: the symmetric memory and the all-to-all's receive buffer
  // (plan_reduce sizes it: ce_n_ elements); this rank's place on the data axis
  std::shared_ptr<SymmetricMemory> sym_;
  float* ce_recv_ = nullptr;
  // an open send/recv group (group_begin) and the axes its messages use
  bool grouping_ = false;
  unsigned group_axes_ = 0;
  // asynchronous message links [channel][0 send, 1 receive], their creation order (the same
  // on every rank; published to the watchdog by links_open_) and the tickets since the last
  // wait_messages (events, reused from one step to the next)
  std::array<std::array<Link, 2>, kChannels> links_{};
  std::vector<Link*> link_order_;
  std::atomic<bool> links_open_{false};
  std::vector<cudaEvent_t> msg_ev_;
  size_t msg_n_ = 0;
  size_t ce_n_ = 0;
  int data_rank_ = 0;
  cudaStream_t comm_stream_ = nullptr;  // asynchronous reductions
  // overlapped collectives: the tensor axis's second communicator, its stream, the SMs it
  // takes, and a ring of tickets (events behind them; whether one was recorded)
  static constexpr int kSideDefaultSms = 8;  // NCCL's choice: what the GEMMs leave free
  ncclComm_t side_comm_ = nullptr;
  int side_rank_ = 0;
  cudaStream_t side_stream_ = nullptr;
  int side_sms_ = 0;
  std::array<cudaEvent_t, kMaxOverlapped> side_ev_{};
  std::array<bool, kMaxOverlapped> side_recorded_{};
  size_t side_first_ = 0, side_next_ = 0;
  // copy engines: symmetric memory over side_comm_, a reduce-scatter's received blocks
  std::shared_ptr<SymmetricMemory> side_sym_;
  void* side_recv_ = nullptr;
  size_t side_recv_bytes_ = 0;
  cudaEvent_t ready_ev_ = nullptr;      // compute stream -> communication stream
  cudaEvent_t done_ev_ = nullptr;       // communication stream -> compute stream
  bool pending_ = false;
  // start_allgather's tickets since the last wait_all: an event recorded behind each on the
  // communication stream (and whether it was), reused from one step to the next
  std::vector<std::pair<cudaEvent_t, bool>> ticket_ev_;
  size_t tickets_ = 0;
  unsigned pending_axes_ = 0;
  // the watchdog
  struct Pending {
    cudaEvent_t ev;
    unsigned axes;
    const char* what;
    std::chrono::steady_clock::time_point enqueued;
  };
  static constexpr size_t kMaxPending = 4096;
  bool blocking_ = false;
  bool capturing_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> pending_q_;
  std::vector<cudaEvent_t> free_events_;
  bool stop_ = false;
  std::thread watchdog_;
  int64_t skip_call_ = 0, calls_ = 0;
};

}  // namespace vitgrid
