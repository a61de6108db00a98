// Collectives over NCCL: one communicator per non-trivial axis of the process grid, each
// created from a unique id broadcast over that axis' MPI communicator, all enqueued on the
// CUDA backend's stream, so they are ordered after the kernels that produced their inputs and
// before the kernels that consume their outputs without the host waiting for them (the host
// keeps launching while the GPU communicates; nothing in the step loop blocks on NCCL).
// A watchdog thread follows them instead: every collective records an event behind it, and
// the thread polls the oldest pending event and ncclCommGetAsyncError of its axis; on an error,
// or when that collective has been the oldest incomplete one for more than timeout_s, it names
// the collective and the axis, aborts every communicator and the MPI job (no rank hangs).
// NcclOptions::blocking (deck device.nccl_blocking) makes every call wait for completion
// instead (debugging; the old behaviour, like CUDA_LAUNCH_BLOCKING for kernels).
// The asynchronous collectives (gradient buckets overlapped with the backward, ZeRO's
// parameter buckets gathered during the forward) run on a dedicated communication stream:
// each waits on an event recorded on the compute stream when it is started; wait_started()
// makes the compute stream wait for one gather (an event behind it), wait_all() for them all.
// With copy engines on the data axis (device.data_comm = copy_engine), its communicator uses
// NCCL's zero-CTA policy and the model's gradient buffer is NCCL memory registered as a
// symmetric window (Backend::alloc_comm); a gradient all-reduce is then an all-to-all (each
// rank receives every rank's copy of its block), a local sum of those blocks in rank order
// into the rank's own block, and an all-gather of the summed blocks in place: the two
// collectives move data with copy engines
// instead of SMs where NCCL can, and only the short sum kernel takes SMs from the backward.
// ZeRO-1's reduce-scatter is the first two steps.
#include <mpi.h>
#include <nccl.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cuda_backend_impl.h"
#include "vitgrid/backend/cuda/cuda_backend.h"
#include "vitgrid/core/test_hooks.h"

#define NCCL_CHECK(call)                                                                  \
  do {                                                                                    \
    ncclResult_t vg_r_ = (call);                                                          \
    if (vg_r_ != ncclSuccess && vg_r_ != ncclInProgress)                                  \
      VG_FAIL("NCCL error in " #call ": " << ncclGetErrorString(vg_r_) << " ("           \
                                          << ncclGetLastError(nullptr) << ")");          \
  } while (0)

namespace vitgrid {

namespace {

// NCCL memory registered as symmetric windows over the data axis's communicator: the
// allocator the backend's alloc_comm() uses under copy-engine data collectives. Shared with
// the backend, which may release blocks after the collectives are gone (then only freed).
struct SymmetricMemory {
  std::mutex mu;
  ncclComm_t comm = nullptr;  // null once the collectives are destroyed
  std::map<char*, std::pair<size_t, ncclWindow_t>> blocks;  // start -> bytes, window

  void* alloc(size_t bytes) {
    void* p = nullptr;
    NCCL_CHECK(ncclMemAlloc(&p, bytes));
    ncclWindow_t win{};
    std::lock_guard<std::mutex> lock(mu);
    VG_CHECK(comm, "symmetric memory allocated after the collectives were destroyed");
    NCCL_CHECK(ncclCommWindowRegister(comm, p, bytes, &win, NCCL_WIN_COLL_SYMMETRIC));
    blocks[static_cast<char*>(p)] = {bytes, win};
    return p;
  }
  // returns the block's size
  size_t release(void* p) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = blocks.find(static_cast<char*>(p));
    VG_CHECK(it != blocks.end(), "release of memory that is not a symmetric window");
    if (comm) NCCL_CHECK(ncclCommWindowDeregister(comm, it->second.second));
    const size_t bytes = it->second.first;
    blocks.erase(it);
    NCCL_CHECK(ncclMemFree(p));
    return bytes;
  }
  // whether [p, p + bytes) lies inside one registered block
  bool holds(const void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    const char* c = static_cast<const char*>(p);
    auto it = blocks.upper_bound(const_cast<char*>(c));
    if (it == blocks.begin()) return false;
    --it;
    return c >= it->first && c + bytes <= it->first + it->second.first;
  }
};

class NcclCollectives final : public Collectives {
 public:
  // Called by all ranks of the grid's world: communicator creation is collective per axis,
  // and every rank visits the axes in the same order, so creation cannot deadlock.
  NcclCollectives(const ProcessGrid& grid, CudaBackend& be, const NcclOptions& o)
      : be_(be), stream_(be.stream()), timeout_s_(o.timeout_s), pipe_ctas_(o.pipe_ctas),
        pipe_rank_(grid.rank(Axis::Pipeline)),
        data_rank_(grid.rank(Axis::Data)) {
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
      // The data axis's reductions overlap the backward: o.data_ctas > 0 caps the thread blocks
      // (SMs) their kernels take from it.
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      if (static_cast<Axis>(a) == Axis::Data && o.data_copy_engine) {
        config.CTAPolicy = NCCL_CTA_POLICY_ZERO;  // copy engines wherever NCCL can
      } else if (static_cast<Axis>(a) == Axis::Data && o.data_ctas > 0) {
        config.minCTAs = 1;
        config.maxCTAs = o.data_ctas;
      }
      NCCL_CHECK(ncclCommInitRankConfig(&comms_[a], c.size(), id, c.rank(), &config));
    }
    // 1d sequence parallelism's overlapped collectives: a communicator split off the tensor
    // axis's (every rank of it calls) and a stream of their own; o.tensor_ctas > 0 caps their
    // thread blocks, which the GEMMs beside them leave free; with copy engines (zero-CTA
    // policy) they take no SMs, and their buffers are symmetric memory over it
    if (grid.shape().sequence_parallel && comm(Axis::Tensor)) {
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      if (o.tensor_copy_engine) {
        config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
      } else if (o.tensor_ctas > 0) {
        config.minCTAs = 1;
        config.maxCTAs = o.tensor_ctas;
      }
      side_rank_ = grid.rank(Axis::Tensor);  // (the split keeps the ranks' order)
      NCCL_CHECK(ncclCommSplit(comm(Axis::Tensor), 0, side_rank_, &side_comm_, &config));
      if (o.tensor_copy_engine) {
        side_sym_ = std::make_shared<SymmetricMemory>();
        side_sym_->comm = side_comm_;
      } else {
        side_sms_ = o.tensor_ctas > 0 ? o.tensor_ctas : kSideDefaultSms;
      }
      CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
      for (auto& e : side_ev_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    if (o.data_copy_engine && comm(Axis::Data)) {
      sym_ = std::make_shared<SymmetricMemory>();
      sym_->comm = comm(Axis::Data);
      auto a = std::make_shared<CudaBackend::CommAllocator>();
      std::shared_ptr<SymmetricMemory> keep = sym_;  // the backend's blocks outlive us
      a->alloc = [keep](size_t bytes) { return keep->alloc(bytes); };
      a->release = [keep](void* p) { keep->release(p); };
      be_.set_comm_allocator(std::move(a));
    }
    CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)));
    CUDA_CHECK(cudaMemsetAsync(barrier_buf_, 0, sizeof(float), stream_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&ready_ev_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&done_ev_, cudaEventDisableTiming));
    blocking_ = o.blocking;
    // Test fault injection (test_hooks.h): that world rank silently skips its n-th collective
    // (1-based), as a rank taking a different code path would.
    if (vitgrid_test_hooks.nccl_skip_call > 0) {
      int world_rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
      if (vitgrid_test_hooks.nccl_skip_rank == world_rank)
        skip_call_ = vitgrid_test_hooks.nccl_skip_call;
    }
    if (!blocking_) watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCollectives() override {
    if (side_stream_) cudaStreamSynchronize(side_stream_);
    cudaStreamSynchronize(comm_stream_);
    if (side_sym_) {
      if (side_recv_) own_release(*side_sym_, side_recv_);
      std::lock_guard<std::mutex> lock(side_sym_->mu);
      side_sym_->comm = nullptr;
    }
    cudaStreamSynchronize(stream_);
    if (sym_) {
      be_.set_comm_allocator(nullptr);
      if (ce_recv_) own_release(*sym_, ce_recv_);
      std::lock_guard<std::mutex> lock(sym_->mu);
      sym_->comm = nullptr;  // blocks the backend still holds are only freed from now on
    }
    if (watchdog_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
      }
      cv_.notify_all();
      watchdog_.join();
    }
    for (auto& dir : links_)
      for (Link& l : dir)
        if (l.stream) cudaStreamSynchronize(l.stream);
    for (const Pending& p : pending_q_) cudaEventDestroy(p.ev);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    for (Link* l : link_order_) {
      ncclCommDestroy(l->comm);
      cudaStreamDestroy(l->stream);
      cudaEventDestroy(l->done);
    }
    for (cudaEvent_t e : msg_ev_) cudaEventDestroy(e);
    if (side_comm_) ncclCommDestroy(side_comm_);  // (after the symmetric windows above)
    if (side_stream_) cudaStreamDestroy(side_stream_);
    for (cudaEvent_t e : side_ev_)
      if (e) cudaEventDestroy(e);
    for (ncclComm_t c : comms_)
      if (c) ncclCommDestroy(c);
    for (auto& e : ticket_ev_) cudaEventDestroy(e.first);
    cudaEventDestroy(done_ev_);
    cudaEventDestroy(ready_ev_);
    cudaStreamDestroy(comm_stream_);
    cudaFree(barrier_buf_);
  }

  // ---- asynchronous reductions on the communication stream
  void plan_reduce(size_t max_n, Axis a) override {
    if (a != Axis::Data || !sym_ || max_n <= ce_n_) return;
    // collective over the data axis (window registration): every rank plans the same buckets
    cudaStreamSynchronize(comm_stream_);
    if (ce_recv_) own_release(*sym_, ce_recv_);
    ce_recv_ = static_cast<float*>(own_alloc(*sym_, max_n * sizeof(float)));
    ce_n_ = max_n;
  }
  void start_allreduce_sum(float* buf, size_t n, Axis a) override {
    if (ncclComm_t c = comm(a); c && !skipped()) {
      order_after_compute(a);
      if (copy_engine(buf, n, a)) {
        // all-to-all, the local sum of this rank's block into its place in buf, all-gather
        // of the blocks in place (no copy of a rank's own block: NCCL 2.28 runs that one as a
        // kernel beside the backward's GEMMs)
        const int D = sizes_[static_cast<int>(a)];
        const size_t k = n / static_cast<size_t>(D);
        float* mine = buf + k * static_cast<size_t>(data_rank_);
        NCCL_CHECK(ncclAlltoAll(buf, ce_recv_, k, ncclFloat, c, comm_stream_));
        be_.sum_parts_on(comm_stream_, mine, ce_recv_, k, D);
        NCCL_CHECK(ncclAllGather(mine, buf, k, ncclFloat, c, comm_stream_));
        return;
      }
      NCCL_CHECK(ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, c, comm_stream_));
    }
  }
  void start_allreduce_sum_act(void* buf, size_t n, size_t elem_size, Axis a) override {
    const ncclDataType_t t = act_type(elem_size, "start_allreduce_sum_act");
    if (ncclComm_t c = comm(a); c && !skipped()) {
      order_after_compute(a);
      NCCL_CHECK(ncclAllReduce(buf, buf, n, t, ncclSum, c, comm_stream_));
    }
  }
  void start_reduce_scatter_sum(float* out, const float* in, size_t n, Axis a) override {
    if (ncclComm_t c = comm(a); c && !skipped()) {
      // out == in + rank * n is NCCL's in-place form
      order_after_compute(a);
      const int D = sizes_[static_cast<int>(a)];
      if (copy_engine(in, n * static_cast<size_t>(D), a)) {
        NCCL_CHECK(ncclAlltoAll(in, ce_recv_, n, ncclFloat, c, comm_stream_));
        be_.sum_parts_on(comm_stream_, out, ce_recv_, n, D);
        return;
      }
      NCCL_CHECK(ncclReduceScatter(in, out, n, ncclFloat, ncclSum, c, comm_stream_));
    } else if (out != in) {
      CUDA_CHECK(cudaMemcpyAsync(out, in, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    }
  }
  size_t start_allgather(void* out, const void* in, size_t n, size_t elem_size, Axis a) override {
    const size_t t = tickets_++;
    if (t == ticket_ev_.size()) {
      ticket_ev_.emplace_back(nullptr, false);
      CUDA_CHECK(cudaEventCreateWithFlags(&ticket_ev_[t].first, cudaEventDisableTiming));
    }
    ticket_ev_[t].second = false;
    if (ncclComm_t c = comm(a); c && !skipped()) {
      order_after_compute(a);
      NCCL_CHECK(ncclAllGather(in, out, n * elem_size, ncclUint8, c, comm_stream_));
      CUDA_CHECK(cudaEventRecord(ticket_ev_[t].first, comm_stream_));
      ticket_ev_[t].second = true;
    } else if (out != in) {
      CUDA_CHECK(cudaMemcpyAsync(out, in, n * elem_size, cudaMemcpyDeviceToDevice, stream_));
    }
    return t;
  }
  void wait_started(size_t t) override {
    VG_CHECK(t < tickets_, "wait for collective " << t << " of " << tickets_);
    // (nothing went to the communication stream for it: a one-rank axis)
    if (ticket_ev_[t].second) CUDA_CHECK(cudaStreamWaitEvent(stream_, ticket_ev_[t].first, 0));
  }
  void wait_all() override {
    tickets_ = 0;
    if (!pending_) return;
    // the compute stream continues after the reductions; the watchdog follows them
    track(comm_stream_, pending_axes_, "asynchronous reduction");
    CUDA_CHECK(cudaEventRecord(done_ev_, comm_stream_));
    CUDA_CHECK(cudaStreamWaitEvent(stream_, done_ev_, 0));
    pending_ = false;
    pending_axes_ = 0;
  }

  // ---- overlapped collectives on the side stream (the tensor axis under sequence
  // parallelism; elsewhere the blocking calls)
  size_t start_overlapped_allgather(void* out, const void* in, size_t n, size_t elem_size,
                                    Axis a) override {
    if (!side(a)) {
      allgather(out, in, n, elem_size, a);
      return open_side(false);
    }
    if (skipped()) return open_side(false);
    const size_t bytes = n * elem_size;
    void* mine = static_cast<char*>(out) + bytes * side_rank_;
    VG_CHECK(!side_sym_ || side_sym_->holds(out, bytes * sizes_[static_cast<int>(a)]),
             "overlapped all-gather into memory that overlapped_alloc did not hand out");
    if (side_sym_ && in != mine) {  // copy engines: in place, in staged into this rank's block
      stage(mine, in, bytes);
      in = mine;
    } else {
      order_side_after_compute();
    }
    NCCL_CHECK(ncclAllGather(in, out, bytes, ncclUint8, side_comm_, side_stream_));
    track(side_stream_, bit(a), "overlapped all-gather");
    return open_side(true);
  }
  size_t start_overlapped_reduce_scatter_act(void* out, const void* in, size_t n,
                                             size_t elem_size, Axis a) override {
    const ncclDataType_t t = act_type(elem_size, "start_overlapped_reduce_scatter_act");
    if (!side(a)) {
      reduce_scatter_sum_act(out, in, n, elem_size, a);
      return open_side(false);
    }
    if (skipped()) return open_side(false);
    if (side_sym_) {  // copy engines: an all-to-all of the blocks, their sum in rank order
      const int parts = sizes_[static_cast<int>(a)];
      const size_t bytes = n * elem_size * parts;
      VG_CHECK(side_sym_->holds(in, bytes),
               "overlapped reduce-scatter of memory that overlapped_alloc did not hand out");
      void* recv = side_recv(bytes);
      order_side_after_compute();
      NCCL_CHECK(ncclAlltoAll(in, recv, n * elem_size, ncclUint8, side_comm_, side_stream_));
      be_.sum_parts_act_on(side_stream_, out, recv, n, parts);
    } else {
      order_side_after_compute();
      NCCL_CHECK(ncclReduceScatter(in, out, n, t, ncclSum, side_comm_, side_stream_));
    }
    track(side_stream_, bit(a), "overlapped reduce-scatter");
    return open_side(true);
  }
  void wait_overlapped(size_t ticket) override {
    VG_CHECK(side_first_ < side_next_ && ticket == side_first_,
             "overlapped collective " << ticket << " waited for out of order (next: "
                                      << side_first_ << ", started: " << side_next_ << ")");
    if (side_recorded_[ticket % kMaxOverlapped])
      CUDA_CHECK(cudaStreamWaitEvent(stream_, side_ev_[ticket % kMaxOverlapped], 0));
    ++side_first_;
  }
  int overlapped_sms(Axis a) const override { return side(a) ? side_sms_ : 0; }
  void* overlapped_alloc(size_t bytes) override {
    if (!side_sym_) return nullptr;
    CUDA_CHECK(cudaStreamSynchronize(side_stream_));
    return own_alloc(*side_sym_, bytes);  // a collective over the tensor axis (registration)
  }
  void overlapped_release(void* p) override {
    VG_CHECK(side_sym_, "overlapped_release without copy-engine tensor collectives");
    own_release(*side_sym_, p);
  }

  void allreduce_sum(float* buf, size_t n, Axis a) override {
    if (ncclComm_t c = comm(a); c && !skipped()) {
      NCCL_CHECK(ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, c, stream_));
      track(stream_, bit(a), "allreduce_sum");
    }
  }
  void allreduce_max(float* buf, size_t n, Axis a) override {
    if (ncclComm_t c = comm(a); c && !skipped()) {
      NCCL_CHECK(ncclAllReduce(buf, buf, n, ncclFloat, ncclMax, c, stream_));
      track(stream_, bit(a), "allreduce_max");
    }
  }
  void allreduce_sum_f64(double* buf, size_t n, Axis a) override {
    if (ncclComm_t c = comm(a); c && !skipped()) {
      NCCL_CHECK(ncclAllReduce(buf, buf, n, ncclFloat64, ncclSum, c, stream_));
      track(stream_, bit(a), "allreduce_sum_f64");
    }
  }
  void allreduce_sum_act(void* buf, size_t n, size_t elem_size, Axis a) override {
    const ncclDataType_t t = act_type(elem_size, "allreduce_sum_act");
    if (ncclComm_t c = comm(a); c && !skipped()) {
      NCCL_CHECK(ncclAllReduce(buf, buf, n, t, ncclSum, c, stream_));
      track(stream_, bit(a), "allreduce_sum_act");
    }
  }
  void broadcast(void* buf, size_t bytes, int root, Axis a) override {
    if (ncclComm_t c = comm(a); c && !skipped()) {
      NCCL_CHECK(ncclBroadcast(buf, buf, bytes, ncclUint8, root, c, stream_));
      track(stream_, bit(a), "broadcast");
    }
  }
  void allgather(void* out, const void* in, size_t n, size_t elem_size, Axis a) override {
    if (ncclComm_t c = comm(a); c && !skipped()) {
      NCCL_CHECK(ncclAllGather(in, out, n * elem_size, ncclUint8, c, stream_));
      track(stream_, bit(a), "allgather");
    } else if (out != in) {
      CUDA_CHECK(cudaMemcpyAsync(out, in, n * elem_size, cudaMemcpyDeviceToDevice, stream_));
    }
  }
  void reduce_scatter_sum(float* out, const float* in, size_t n, Axis a) override {
    if (ncclComm_t c = comm(a); c && !skipped()) {
      NCCL_CHECK(ncclReduceScatter(in, out, n, ncclFloat, ncclSum, c, stream_));
      track(stream_, bit(a), "reduce_scatter_sum");
    } else if (out != in) {
      CUDA_CHECK(cudaMemcpyAsync(out, in, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    }
  }
  void reduce_scatter_sum_act(void* out, const void* in, size_t n, size_t elem_size,
                              Axis a) override {
    const ncclDataType_t t = act_type(elem_size, "reduce_scatter_sum_act");
    if (ncclComm_t c = comm(a); c && !skipped()) {
      NCCL_CHECK(ncclReduceScatter(in, out, n, t, ncclSum, c, stream_));
      track(stream_, bit(a), "reduce_scatter_sum_act");
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
    if (grouping_) group_axes_ |= bit(a);
    else track(stream_, bit(a), "send");
  }
  void recv(void* buf, size_t bytes, int peer, Axis a) override {
    ncclComm_t c = comm(a);
    VG_CHECK(c, "recv over axis " << axis_name(a) << " of size 1");
    NCCL_CHECK(ncclGroupStart());
    NCCL_CHECK(ncclRecv(buf, bytes, ncclUint8, peer, c, stream_));
    NCCL_CHECK(ncclGroupEnd());
    if (grouping_) group_axes_ |= bit(a);
    else track(stream_, bit(a), "recv");
  }
  // the inner ncclGroupStart/End of send and recv nest inside this one: NCCL launches the
  // whole group at the outer ncclGroupEnd, and the watchdog follows it from there
  void group_begin() override {
    VG_CHECK(!grouping_, "send/recv groups do not nest");
    NCCL_CHECK(ncclGroupStart());
    grouping_ = true;
    group_axes_ = 0;
  }
  void group_end() override {
    VG_CHECK(grouping_, "group_end without group_begin");
    grouping_ = false;
    NCCL_CHECK(ncclGroupEnd());
    if (group_axes_) track(stream_, group_axes_, "send/recv group");
  }
  // ---- asynchronous messages (grid.h): each on its link's stream, tickets are events.
  // The links: per channel, one two-rank communicator per sending rank (its key 0 makes the
  // sender rank 0 there), split from the axis's by every rank of it in the same order. Each
  // is connected at once with a one-byte message: NCCL connects a pair at its first message
  // and holds the host until the peer's first message arrives, so links first used in
  // opposite orders on two ranks (as asynchronous messages are) would wait for each other
  // there. They are destroyed in the same order too.
  void open_links(Axis a) override {
    VG_CHECK(a == Axis::Pipeline, "point-to-point links over axis " << axis_name(a)
                                      << ": NCCL links exist on the pipeline axis only");
    ncclComm_t pc = comm(a);
    if (!pc || links_open_.load(std::memory_order_acquire)) return;
    void* one = nullptr;
    CUDA_CHECK(cudaMalloc(&one, 1));
    const int P = sizes_[static_cast<int>(a)];
    const int me = pipe_rank_;
    int least = 0, greatest = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    for (int ch = 0; ch < kChannels; ++ch)
      for (int src = 0; src < P; ++src) {
        const int dst = ch == 0 ? (src + 1) % P : (src + P - 1) % P;
        const bool member = me == src || me == dst;
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        if (pipe_ctas_ > 0) {
          config.minCTAs = 1;
          config.maxCTAs = pipe_ctas_;
        }
        ncclComm_t c = nullptr;
        NCCL_CHECK(ncclCommSplit(pc, member ? 0 : NCCL_SPLIT_NOCOLOR, me == src ? 0 : 1, &c, &config));
        if (!member) continue;
        Link& l = links_[ch][me == src ? 0 : 1];
        l.comm = c;
        l.peer = me == src ? dst : src;
        // messages are latency-bound hand-offs between stages: first in line for SMs
        CUDA_CHECK(cudaStreamCreateWithPriority(&l.stream, cudaStreamNonBlocking, greatest));
        CUDA_CHECK(cudaEventCreateWithFlags(&l.done, cudaEventDisableTiming));
        if (me == src) NCCL_CHECK(ncclSend(one, 1, ncclUint8, 1, c, l.stream));
        else NCCL_CHECK(ncclRecv(one, 1, ncclUint8, 0, c, l.stream));
        CUDA_CHECK(cudaStreamSynchronize(l.stream));
        link_order_.push_back(&l);
      }
    CUDA_CHECK(cudaFree(one));
    links_open_.store(true, std::memory_order_release);  // the watchdog may look at them now
  }
  size_t post_send(const void* buf, size_t bytes, int peer, int channel, Axis a) override {
    Link& l = link(channel, 0, peer, a);
    CUDA_CHECK(cudaEventRecord(ready_ev_, stream_));  // the data is computed
    CUDA_CHECK(cudaStreamWaitEvent(l.stream, ready_ev_, 0));
    NCCL_CHECK(ncclSend(buf, bytes, ncclUint8, 1, l.comm, l.stream));
    const size_t t = message_ticket(l.stream);
    // blocking mode waits for receives only: a send waits for its peer's receive, which may
    // come after this rank's own next receive (that is what the channels are for)
    if (!blocking_) track(l.stream, bit(a), "pipeline send");
    return t;
  }
  size_t post_recv(void* buf, size_t bytes, int peer, int channel, Axis a,
                   const std::vector<size_t>& after) override {
    Link& l = link(channel, 1, peer, a);
    if (after.empty()) {
      CUDA_CHECK(cudaEventRecord(ready_ev_, stream_));
      CUDA_CHECK(cudaStreamWaitEvent(l.stream, ready_ev_, 0));
    }
    for (size_t t : after) {
      VG_CHECK(t < msg_n_, "post_recv after ticket " << t << " of " << msg_n_);
      CUDA_CHECK(cudaStreamWaitEvent(l.stream, msg_ev_[t], 0));
    }
    NCCL_CHECK(ncclRecv(buf, bytes, ncclUint8, 0, l.comm, l.stream));
    const size_t t = message_ticket(l.stream);
    track(l.stream, bit(a), "pipeline recv");
    return t;
  }
  void wait_message(size_t t) override {
    VG_CHECK(t < msg_n_, "wait for message " << t << " of " << msg_n_);
    CUDA_CHECK(cudaStreamWaitEvent(stream_, msg_ev_[t], 0));
  }
  size_t fence() override { return message_ticket(stream_); }
  void wait_messages() override {
    for (auto& dir : links_)
      for (Link& l : dir) {
        if (!l.stream) continue;
        CUDA_CHECK(cudaEventRecord(l.done, l.stream));
        CUDA_CHECK(cudaStreamWaitEvent(stream_, l.done, 0));
      }
    msg_n_ = 0;
  }
  // While the stream is captured, the calls go into the graph; the graph's launch is followed
  // as a whole (follow), after it.
  void capture(bool on) override { capturing_ = on; }
  void follow(const char* what) override {
    unsigned axes = 0;
    for (int i = 0; i < static_cast<int>(Axis::Count); ++i)
      if (comms_[i]) axes |= 1u << i;
    if (axes) track(stream_, axes, what);
  }
  void barrier(Axis a) override {
    if (ncclComm_t c = comm(a)) {
      NCCL_CHECK(ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat, ncclSum, c, stream_));
      wait(stream_, bit(a), "barrier");
    }
  }

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
  Link& link(int channel, int dir, int peer, Axis a) {
    VG_CHECK(a == Axis::Pipeline, "point-to-point messages over axis " << axis_name(a)
                                      << ": NCCL links exist on the pipeline axis only");
    VG_CHECK(channel >= 0 && channel < kChannels, "message channel " << channel);
    Link& l = links_[channel][dir];
    VG_CHECK(l.comm && l.peer == peer,
             (dir == 0 ? "send to" : "receive from") << " pipeline rank " << peer << " on channel " << channel
             << ": " << (link_order_.empty() ? std::string("open_links was not called")
                                             : "that channel's link " + std::string(dir == 0 ? "goes to " : "comes from ") +
                                                   std::to_string(l.peer) +
                                                   " (channel 0 flows to the next rank, channel 1 to the previous one)"));
    return l;
  }
  // A new ticket: an event recorded on `st` now.
  size_t message_ticket(cudaStream_t st) {
    if (msg_n_ == msg_ev_.size()) {
      msg_ev_.push_back(nullptr);
      CUDA_CHECK(cudaEventCreateWithFlags(&msg_ev_.back(), cudaEventDisableTiming));
    }
    CUDA_CHECK(cudaEventRecord(msg_ev_[msg_n_], st));
    return msg_n_++;
  }

  // Whether a data-axis reduction of buf[n] goes the copy-engine way: buf inside a symmetric
  // window, n an even split over the ranks, within the planned staging.
  bool copy_engine(const void* buf, size_t n, Axis a) const {
    if (a != Axis::Data || !sym_ || !ce_recv_) return false;
    const size_t D = static_cast<size_t>(sizes_[static_cast<int>(a)]);
    return n % D == 0 && n <= ce_n_ && sym_->holds(buf, n * sizeof(float));
  }

  // The NCCL type of an act-dtype element: 4 bytes fp32, 2 bytes the backend's bf16/fp16.
  ncclDataType_t act_type(size_t elem_size, const char* what) const {
    if (elem_size == 2) {
      VG_CHECK(be_.act_dtype() != DType::F32, what << ": 2-byte elements with an fp32 backend");
      return be_.act_dtype() == DType::BF16 ? ncclBfloat16 : ncclFloat16;
    }
    VG_CHECK(elem_size == 4, what << ": element size " << elem_size);
    return ncclFloat;
  }

  // Symmetric memory of the collectives' own, counted in the backend's memory use (its peak
  // is the reported one).
  void* own_alloc(SymmetricMemory& m, size_t bytes) {
    void* p = m.alloc(bytes);
    be_.count_memory(static_cast<int64_t>(bytes));
    return p;
  }
  void own_release(SymmetricMemory& m, void* p) {
    be_.count_memory(-static_cast<int64_t>(m.release(p)));
  }
  // The reduce-scatter's receive window of the side communicator, at least `need` bytes
  // (grown while no side collective runs: the first micro-batch's; a collective over the
  // tensor axis).
  void* side_recv(size_t need) {
    if (need <= side_recv_bytes_) return side_recv_;
    CUDA_CHECK(cudaStreamSynchronize(side_stream_));
    if (side_recv_) own_release(*side_sym_, side_recv_);
    side_recv_ = own_alloc(*side_sym_, need);
    side_recv_bytes_ = need;
    return side_recv_;
  }
  // Copies a gather's input into its block of the symmetric output, on the compute stream,
  // and orders the side stream after it. There the copy runs at once at full speed: on the
  // side stream its kernel waited for the SMs that the GEMM beside it held (up to 0.2 ms
  // each; ViT-L/16, t = 2: 120.1 ms per step against 114.0), and the copy-engine form
  // (cudaMemcpyBatchAsync, cudaMemcpyFlagPreferOverlapWithCompute) cannot be captured in a
  // CUDA graph.
  void stage(void* dst, const void* src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    order_side_after_compute();
  }
  // Whether axis a's overlapped collectives run on the side stream.
  bool side(Axis a) const { return a == Axis::Tensor && side_comm_; }
  // The side stream starts after the compute stream's work enqueued so far.
  void order_side_after_compute() {
    CUDA_CHECK(cudaEventRecord(ready_ev_, stream_));
    CUDA_CHECK(cudaStreamWaitEvent(side_stream_, ready_ev_, 0));
  }
  // The ticket of the overlapped collective just started (recorded: an event behind it on the
  // side stream; else it ran on the compute stream or not at all).
  size_t open_side(bool recorded) {
    VG_CHECK(side_next_ - side_first_ < kMaxOverlapped,
             "more than " << kMaxOverlapped << " overlapped collectives open");
    const size_t t = side_next_++, slot = t % kMaxOverlapped;
    side_recorded_[slot] = recorded;
    if (recorded) CUDA_CHECK(cudaEventRecord(side_ev_[slot], side_stream_));
    return t;
  }

  // The communication stream starts after the compute stream's work enqueued so far.
  void order_after_compute(Axis a) {
    CUDA_CHECK(cudaEventRecord(ready_ev_, stream_));
    CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ready_ev_, 0));
    pending_ = true;
    pending_axes_ |= 1u << static_cast<int>(a);
  }

  static unsigned bit(Axis a) { return 1u << static_cast<int>(a); }

  // Test fault injection: true for the call that test_hooks.h's nccl_skip_* name on this rank.
  bool skipped() { return skip_call_ > 0 && ++calls_ == skip_call_; }

  // Waits on the host for the stream (hence the collective just enqueued) to drain, under the
  // same checks as the watchdog thread (barrier, and every call with NcclOptions::blocking).
  void wait(cudaStream_t st, unsigned axes, const char* what) {
    poll([&] { return cudaStreamQuery(st); }, axes, what);
  }

  // Hands the collective just enqueued on `st` to the watchdog: an event recorded behind it.
  void track(cudaStream_t st, unsigned axes, const char* what) {
    if (capturing_) return;  // follow() hands over the graph's launch instead
    if (blocking_) return wait(st, axes, what);
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
    if (full) wait(st, axes, what);  // bound the queue: the host is far ahead of the GPU
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
  void watch() {
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

  static Axis first_axis(unsigned axes) {
    int first = 0;
    while (first < static_cast<int>(Axis::Count) && !(axes & (1u << first))) ++first;
    return static_cast<Axis>(first);
  }

  void check_async_errors(unsigned axes, const char* what) {
    for (int i = 0; i < static_cast<int>(Axis::Count); ++i) {
      const Axis a = static_cast<Axis>(i);
      if (!(axes & (1u << i)) || !comm(a)) continue;
      check_async_error(comm(a), a, what);
      if (a == Axis::Pipeline && links_open_.load(std::memory_order_acquire))
        for (Link* l : link_order_) check_async_error(l->comm, a, what);
    }
  }
  void check_async_error(ncclComm_t c, Axis a, const char* what) {
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
  void poll(Query&& query, unsigned axes, const char* what) {
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
  [[noreturn]] void abort_all(Axis a, const char* what, const std::string& why) {
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

}  // namespace

std::unique_ptr<Collectives> make_nccl_collectives(const ProcessGrid& grid, Backend& backend,
                                                   const NcclOptions& options) {
  auto* be = dynamic_cast<CudaBackend*>(&backend);
  if (!be) throw UserError("NCCL collectives need the cuda backend (device.backend = cuda)");
  return std::make_unique<NcclCollectives>(grid, *be, options);
}

}  // namespace vitgrid
