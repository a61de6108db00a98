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
  Work start_allreduce(void* buf, size_t n, Elem t, Axis a) override;
  Work start_reduce_scatter(void* out, const void* in, size_t n, Elem t, Axis a) override;
  Work start_allgather(void* out, const void* in, size_t n, Elem t, Axis a) override;
  void wait_all() override;

  // ---- overlapped collectives on the side stream (the tensor axis under sequence
  // parallelism; elsewhere the blocking calls)
  Work start_overlapped_allgather(void* out, const void* in, size_t n, Elem t,
                                  Axis a) override;
  Work start_overlapped_reduce_scatter(void* out, const void* in, size_t n, Elem t,
                                       Axis a) override;
  int overlapped_sms(Axis a) const override { return side(a) ? side_sms_ : 0; }
  void* overlapped_alloc(size_t bytes) override;
  void overlapped_release(void* p) override;

  void allreduce(void* buf, size_t n, Elem t, ReduceOp op, Axis a) override;
  void broadcast(void* buf, size_t bytes, int root, Axis a) override;
  void allgather(void* out, const void* in, size_t n, Elem t, Axis a) override;
  void reduce_scatter(void* out, const void* in, size_t n, Elem t, Axis a) override;
  void send(const void* buf, size_t bytes, int peer, Axis a) override;
  void recv(void* buf, size_t bytes, int peer, Axis a) override;
  void group_begin() override;
  void group_end() override;
  // ---- asynchronous messages (grid.h): each on its link's stream, their Works are events
  // (nccl_links.cpp)
  void open_links(Axis a) override;
  Work post_send(const void* buf, size_t bytes, int peer, int channel, Axis a) override;
  Work post_recv(void* buf, size_t bytes, int peer, int channel, Axis a,
                 const std::vector<Work>& after) override;
  Work fence() override;
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
  void wait_message(size_t t) override;
  // started collectives
  size_t open_started();
  void record_started(size_t t);
  void wait_started(size_t t) override;
  // overlapped collectives
  void wait_overlapped(size_t t) override;

  bool copy_engine(const void* buf, size_t n, Axis a) const;
  ncclDataType_t nccl_type(Elem t) const;
  size_t elem_size(Elem t) const;
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
  void drain(cudaStream_t st, unsigned axes, const char* what);
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
  // on every rank; published to the watchdog by links_open_) and the messages' Works since
  // the last wait_messages (events, reused from one step to the next)
  std::array<std::array<Link, 2>, kChannels> links_{};
  std::vector<Link*> link_order_;
  std::atomic<bool> links_open_{false};
  std::vector<cudaEvent_t> msg_ev_;
  size_t msg_n_ = 0;
  size_t ce_n_ = 0;
  int data_rank_ = 0;
  cudaStream_t comm_stream_ = nullptr;  // asynchronous reductions
  // overlapped collectives: the tensor axis's second communicator, its stream, the SMs it
  // takes, and a ring of their Works (events behind them; whether one was recorded)
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
  // the collectives started since the last wait_all, by Work id: where each went, and the
  // events recorded behind them on the communication stream (a gather's when it starts, a
  // reduction's when it is waited for), reused from one step to the next
  struct Started {
    enum class State : uint8_t { Local, Queued, Recorded };
    State state = State::Local;  // Local: nothing went to the communication stream
    size_t ev = 0;               // Recorded: its event in started_ev_
  };
  std::vector<Started> started_;
  std::vector<cudaEvent_t> started_ev_;
  size_t started_ev_n_ = 0;
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
