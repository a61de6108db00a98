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
// each waits on an event recorded on the compute stream when it is started; wait() on its
// Work makes the compute stream wait for one (an event behind it), wait_all() for them all.
// With copy engines on the data axis (device.data_comm = copy_engine), its communicator uses
// NCCL's zero-CTA policy and the model's gradient buffer is NCCL memory registered as a
// symmetric window (Backend::alloc_comm); a gradient all-reduce is then an all-to-all (each
// rank receives every rank's copy of its block), a local sum of those blocks in rank order
// into the rank's own block, and an all-gather of the summed blocks in place: the two
// collectives move data with copy engines
// instead of SMs where NCCL can, and only the short sum kernel takes SMs from the backward.
// ZeRO-1's reduce-scatter is the first two steps.
// The class is declared in nccl_collectives_impl.h; its asynchronous message links are
// defined in nccl_links.cpp, its watchdog and error checks in nccl_watch.cpp.
#include <mpi.h>
#include <nccl.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "nccl_collectives_impl.h"
#include "vitgrid/backend/cuda/cuda_backend.h"
#include "vitgrid/core/test_hooks.h"

namespace vitgrid {

void* SymmetricMemory::alloc(size_t bytes) {
  void* p = nullptr;
  NCCL_CHECK(ncclMemAlloc(&p, bytes));
  ncclWindow_t win{};
  std::lock_guard<std::mutex> lock(mu);
  VG_CHECK(comm, "symmetric memory allocated after the collectives were destroyed");
  NCCL_CHECK(ncclCommWindowRegister(comm, p, bytes, &win, NCCL_WIN_COLL_SYMMETRIC));
  blocks[static_cast<char*>(p)] = {bytes, win};
  return p;
}

size_t SymmetricMemory::release(void* p) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = blocks.find(static_cast<char*>(p));
  VG_CHECK(it != blocks.end(), "release of memory that is not a symmetric window");
  if (comm) NCCL_CHECK(ncclCommWindowDeregister(comm, it->second.second));
  const size_t bytes = it->second.first;
  blocks.erase(it);
  NCCL_CHECK(ncclMemFree(p));
  return bytes;
}

bool SymmetricMemory::holds(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu);
  const char* c = static_cast<const char*>(p);
  auto it = blocks.upper_bound(const_cast<char*>(c));
  if (it == blocks.begin()) return false;
  --it;
  return c >= it->first && c + bytes <= it->first + it->second.first;
}

// Called by all ranks of the grid's world: communicator creation is collective per axis,
// and every rank visits the axes in the same order, so creation cannot deadlock.
NcclCollectives::NcclCollectives(const ProcessGrid& grid, CudaBackend& be, const NcclOptions& o)
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

NcclCollectives::~NcclCollectives() {
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
  for (cudaEvent_t e : started_ev_) cudaEventDestroy(e);
  cudaEventDestroy(done_ev_);
  cudaEventDestroy(ready_ev_);
  cudaStreamDestroy(comm_stream_);
  cudaFree(barrier_buf_);
}

// ---- asynchronous reductions on the communication stream
void NcclCollectives::plan_reduce(size_t max_n, Axis a) {
  if (a != Axis::Data || !sym_ || max_n <= ce_n_) return;
  // collective over the data axis (window registration): every rank plans the same buckets
  cudaStreamSynchronize(comm_stream_);
  if (ce_recv_) own_release(*sym_, ce_recv_);
  ce_recv_ = static_cast<float*>(own_alloc(*sym_, max_n * sizeof(float)));
  ce_n_ = max_n;
}

Work NcclCollectives::start_allreduce(void* buf, size_t n, Elem t, Axis a) {
  const size_t id = open_started();
  if (ncclComm_t c = comm(a); c && !skipped()) {
    order_after_compute(a);
    started_[id].state = Started::State::Queued;
    if (t == Elem::F32 && copy_engine(buf, n, a)) {
      // all-to-all, the local sum of this rank's block into its place in buf, all-gather
      // of the blocks in place (no copy of a rank's own block: NCCL 2.28 runs that one as a
      // kernel beside the backward's GEMMs)
      const int D = sizes_[static_cast<int>(a)];
      const size_t k = n / static_cast<size_t>(D);
      float* mine = static_cast<float*>(buf) + k * static_cast<size_t>(data_rank_);
      NCCL_CHECK(ncclAlltoAll(buf, ce_recv_, k, ncclFloat, c, comm_stream_));
      be_.sum_parts_on(comm_stream_, mine, ce_recv_, k, D);
      NCCL_CHECK(ncclAllGather(mine, buf, k, ncclFloat, c, comm_stream_));
      return {Work::Kind::Collective, id};
    }
    NCCL_CHECK(ncclAllReduce(buf, buf, n, nccl_type(t), ncclSum, c, comm_stream_));
  }
  return {Work::Kind::Collective, id};
}

Work NcclCollectives::start_reduce_scatter(void* out, const void* in, size_t n, Elem t, Axis a) {
  const size_t id = open_started();
  if (ncclComm_t c = comm(a); c && !skipped()) {
    // out == in + rank * n is NCCL's in-place form
    order_after_compute(a);
    started_[id].state = Started::State::Queued;
    const int D = sizes_[static_cast<int>(a)];
    if (t == Elem::F32 && copy_engine(in, n * static_cast<size_t>(D), a)) {
      NCCL_CHECK(ncclAlltoAll(in, ce_recv_, n, ncclFloat, c, comm_stream_));
      be_.sum_parts_on(comm_stream_, static_cast<float*>(out), ce_recv_, n, D);
      return {Work::Kind::Collective, id};
    }
    NCCL_CHECK(ncclReduceScatter(in, out, n, nccl_type(t), ncclSum, c, comm_stream_));
  } else if (out != in) {
    CUDA_CHECK(cudaMemcpyAsync(out, in, n * elem_size(t), cudaMemcpyDeviceToDevice, stream_));
  }
  return {Work::Kind::Collective, id};
}

Work NcclCollectives::start_allgather(void* out, const void* in, size_t n, Elem t, Axis a) {
  const size_t id = open_started();
  const size_t bytes = n * elem_size(t);
  if (ncclComm_t c = comm(a); c && !skipped()) {
    order_after_compute(a);
    NCCL_CHECK(ncclAllGather(in, out, bytes, ncclUint8, c, comm_stream_));
    record_started(id);
  } else if (out != in) {
    CUDA_CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  return {Work::Kind::Collective, id};
}

// A new started collective's Work id (nothing on the communication stream yet).
size_t NcclCollectives::open_started() {
  started_.emplace_back();
  return started_.size() - 1;
}

// An event behind started collective t on the communication stream, recorded now (behind
// every collective started so far).
void NcclCollectives::record_started(size_t t) {
  if (started_ev_n_ == started_ev_.size()) {
    started_ev_.push_back(nullptr);
    CUDA_CHECK(cudaEventCreateWithFlags(&started_ev_.back(), cudaEventDisableTiming));
  }
  CUDA_CHECK(cudaEventRecord(started_ev_[started_ev_n_], comm_stream_));
  started_[t].state = Started::State::Recorded;
  started_[t].ev = started_ev_n_++;
}

// A reduction gets its event when it is first waited for, so the compute stream then waits
// for every collective started so far: they run in order on the communication stream.
void NcclCollectives::wait_started(size_t t) {
  VG_CHECK(t < started_.size(), "wait for collective " << t << " of " << started_.size());
  // (Local: nothing went to the communication stream for it, a one-rank axis)
  if (started_[t].state == Started::State::Queued) record_started(t);
  if (started_[t].state == Started::State::Recorded)
    CUDA_CHECK(cudaStreamWaitEvent(stream_, started_ev_[started_[t].ev], 0));
}

void NcclCollectives::wait_all() {
  started_.clear();
  started_ev_n_ = 0;
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
Work NcclCollectives::start_overlapped_allgather(void* out, const void* in, size_t n, Elem t,
                                                 Axis a) {
  if (!side(a)) {
    allgather(out, in, n, t, a);
    return {Work::Kind::Overlapped, open_side(false)};
  }
  if (skipped()) return {Work::Kind::Overlapped, open_side(false)};
  const size_t bytes = n * elem_size(t);
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
  return {Work::Kind::Overlapped, open_side(true)};
}

Work NcclCollectives::start_overlapped_reduce_scatter(void* out, const void* in, size_t n,
                                                      Elem t, Axis a) {
  if (!side(a)) {
    reduce_scatter(out, in, n, t, a);
    return {Work::Kind::Overlapped, open_side(false)};
  }
  if (skipped()) return {Work::Kind::Overlapped, open_side(false)};
  if (side_sym_) {  // copy engines: an all-to-all of the blocks, their sum in rank order
    VG_CHECK(nccl_type(t) == nccl_type(Elem::Act),
             "overlapped reduce-scatter with copy engines of elements other than act ones");
    const int parts = sizes_[static_cast<int>(a)];
    const size_t bytes = n * elem_size(t) * parts;
    VG_CHECK(side_sym_->holds(in, bytes),
             "overlapped reduce-scatter of memory that overlapped_alloc did not hand out");
    void* recv = side_recv(bytes);
    order_side_after_compute();
    NCCL_CHECK(ncclAlltoAll(in, recv, n * elem_size(t), ncclUint8, side_comm_, side_stream_));
    be_.sum_parts_act_on(side_stream_, out, recv, n, parts);
  } else {
    order_side_after_compute();
    NCCL_CHECK(ncclReduceScatter(in, out, n, nccl_type(t), ncclSum, side_comm_, side_stream_));
  }
  track(side_stream_, bit(a), "overlapped reduce-scatter");
  return {Work::Kind::Overlapped, open_side(true)};
}

void NcclCollectives::wait_overlapped(size_t t) {
  VG_CHECK(side_first_ < side_next_ && t == side_first_,
           "overlapped collective " << t << " waited for out of order (next: " << side_first_
                                    << ", started: " << side_next_ << ")");
  if (side_recorded_[t % kMaxOverlapped])
    CUDA_CHECK(cudaStreamWaitEvent(stream_, side_ev_[t % kMaxOverlapped], 0));
  ++side_first_;
}

void* NcclCollectives::overlapped_alloc(size_t bytes) {
  if (!side_sym_) return nullptr;
  CUDA_CHECK(cudaStreamSynchronize(side_stream_));
  return own_alloc(*side_sym_, bytes);  // a collective over the tensor axis (registration)
}

void NcclCollectives::overlapped_release(void* p) {
  VG_CHECK(side_sym_, "overlapped_release without copy-engine tensor collectives");
  own_release(*side_sym_, p);
}

namespace {

// The watchdog's names of the blocking reductions.
const char* allreduce_name(Elem t, ReduceOp op) {
  if (op == ReduceOp::Max)
    return t == Elem::F32 ? "allreduce_max" : t == Elem::F64 ? "allreduce_max_f64"
                                                             : "allreduce_max_act";
  return t == Elem::F32 ? "allreduce_sum" : t == Elem::F64 ? "allreduce_sum_f64"
                                                           : "allreduce_sum_act";
}
const char* reduce_scatter_name(Elem t) {
  return t == Elem::F32 ? "reduce_scatter_sum" : t == Elem::F64 ? "reduce_scatter_sum_f64"
                                                                : "reduce_scatter_sum_act";
}

}  // namespace

void NcclCollectives::allreduce(void* buf, size_t n, Elem t, ReduceOp op, Axis a) {
  if (ncclComm_t c = comm(a); c && !skipped()) {
    NCCL_CHECK(ncclAllReduce(buf, buf, n, nccl_type(t), op == ReduceOp::Max ? ncclMax : ncclSum,
                             c, stream_));
    track(stream_, bit(a), allreduce_name(t, op));
  }
}

void NcclCollectives::broadcast(void* buf, size_t bytes, int root, Axis a) {
  if (ncclComm_t c = comm(a); c && !skipped()) {
    NCCL_CHECK(ncclBroadcast(buf, buf, bytes, ncclUint8, root, c, stream_));
    track(stream_, bit(a), "broadcast");
  }
}

void NcclCollectives::allgather(void* out, const void* in, size_t n, Elem t, Axis a) {
  const size_t bytes = n * elem_size(t);
  if (ncclComm_t c = comm(a); c && !skipped()) {
    NCCL_CHECK(ncclAllGather(in, out, bytes, ncclUint8, c, stream_));
    track(stream_, bit(a), "allgather");
  } else if (out != in) {
    CUDA_CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
}

void NcclCollectives::reduce_scatter(void* out, const void* in, size_t n, Elem t, Axis a) {
  if (ncclComm_t c = comm(a); c && !skipped()) {
    NCCL_CHECK(ncclReduceScatter(in, out, n, nccl_type(t), ncclSum, c, stream_));
    track(stream_, bit(a), reduce_scatter_name(t));
  } else if (out != in) {
    CUDA_CHECK(cudaMemcpyAsync(out, in, n * elem_size(t), cudaMemcpyDeviceToDevice, stream_));
  }
}

void NcclCollectives::send(const void* buf, size_t bytes, int peer, Axis a) {
  ncclComm_t c = comm(a);
  VG_CHECK(c, "send over axis " << axis_name(a) << " of size 1");
  NCCL_CHECK(ncclGroupStart());
  NCCL_CHECK(ncclSend(buf, bytes, ncclUint8, peer, c, stream_));
  NCCL_CHECK(ncclGroupEnd());
  if (grouping_) group_axes_ |= bit(a);
  else track(stream_, bit(a), "send");
}

void NcclCollectives::recv(void* buf, size_t bytes, int peer, Axis a) {
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
void NcclCollectives::group_begin() {
  VG_CHECK(!grouping_, "send/recv groups do not nest");
  NCCL_CHECK(ncclGroupStart());
  grouping_ = true;
  group_axes_ = 0;
}

void NcclCollectives::group_end() {
  VG_CHECK(grouping_, "group_end without group_begin");
  grouping_ = false;
  NCCL_CHECK(ncclGroupEnd());
  if (group_axes_) track(stream_, group_axes_, "send/recv group");
}

void NcclCollectives::follow(const char* what) {
  unsigned axes = 0;
  for (int i = 0; i < static_cast<int>(Axis::Count); ++i)
    if (comms_[i]) axes |= 1u << i;
  if (axes) track(stream_, axes, what);
}

void NcclCollectives::barrier(Axis a) {
  if (ncclComm_t c = comm(a)) {
    NCCL_CHECK(ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat, ncclSum, c, stream_));
    drain(stream_, bit(a), "barrier");
  }
}

// Whether a data-axis reduction of buf[n] goes the copy-engine way: buf inside a symmetric
// window, n an even split over the ranks, within the planned staging.
bool NcclCollectives::copy_engine(const void* buf, size_t n, Axis a) const {
  if (a != Axis::Data || !sym_ || !ce_recv_) return false;
  const size_t D = static_cast<size_t>(sizes_[static_cast<int>(a)]);
  return n % D == 0 && n <= ce_n_ && sym_->holds(buf, n * sizeof(float));
}

// The NCCL type and size of an element (Act: the backend's act dtype).
ncclDataType_t NcclCollectives::nccl_type(Elem t) const {
  switch (t) {
    case Elem::F32:
      return ncclFloat;
    case Elem::F64:
      return ncclFloat64;
    case Elem::Act:
      break;
  }
  if (be_.act_dtype() == DType::F32) return ncclFloat;
  return be_.act_dtype() == DType::BF16 ? ncclBfloat16 : ncclFloat16;
}

size_t NcclCollectives::elem_size(Elem t) const {
  return t == Elem::F32 ? sizeof(float) : t == Elem::F64 ? sizeof(double) : be_.act_size();
}

// Symmetric memory of the collectives' own, counted in the backend's memory use (its peak
// is the reported one).
void* NcclCollectives::own_alloc(SymmetricMemory& m, size_t bytes) {
  void* p = m.alloc(bytes);
  be_.count_memory(static_cast<int64_t>(bytes));
  return p;
}

void NcclCollectives::own_release(SymmetricMemory& m, void* p) {
  be_.count_memory(-static_cast<int64_t>(m.release(p)));
}

// The reduce-scatter's receive window of the side communicator, at least `need` bytes
// (grown while no side collective runs: the first micro-batch's; a collective over the
// tensor axis).
void* NcclCollectives::side_recv(size_t need) {
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
void NcclCollectives::stage(void* dst, const void* src, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  order_side_after_compute();
}

// The side stream starts after the compute stream's work enqueued so far.
void NcclCollectives::order_side_after_compute() {
  CUDA_CHECK(cudaEventRecord(ready_ev_, stream_));
  CUDA_CHECK(cudaStreamWaitEvent(side_stream_, ready_ev_, 0));
}

// The Work id of the overlapped collective just started (recorded: an event behind it on the
// side stream; else it ran on the compute stream or not at all).
size_t NcclCollectives::open_side(bool recorded) {
  VG_CHECK(side_next_ - side_first_ < kMaxOverlapped,
           "more than " << kMaxOverlapped << " overlapped collectives open");
  const size_t t = side_next_++, slot = t % kMaxOverlapped;
  side_recorded_[slot] = recorded;
  if (recorded) CUDA_CHECK(cudaEventRecord(side_ev_[slot], side_stream_));
  return t;
}

// The communication stream starts after the compute stream's work enqueued so far.
void NcclCollectives::order_after_compute(Axis a) {
  CUDA_CHECK(cudaEventRecord(ready_ev_, stream_));
  CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ready_ev_, 0));
  pending_ = true;
  pending_axes_ |= 1u << static_cast<int>(a);
}

std::unique_ptr<Collectives> make_nccl_collectives(const ProcessGrid& grid, Backend& backend,
                                                   const NcclOptions& options) {
  auto* be = dynamic_cast<CudaBackend*>(&backend);
  if (!be) throw UserError("NCCL collectives need the cuda backend (device.backend = cuda)");
  return std::make_unique<NcclCollectives>(grid, *be, options);
}

}  // namespace vitgrid
