// The process grid: one MPI_Cart_create over (pipeline, data, tensor...) in row-major order, so
// the tensor axis varies fastest (its ranks share a node) and pipeline slowest. The tensor axis
// is itself a grid: 1d [t], 2d [q,q], 2.5d [d,q,q], 3d [q,q,q]. Every sub-communicator comes
// from MPI_Cart_sub and is owned by an RAII handle. Model code never calls MPI: it uses
// Collectives (CPU: MPI on host buffers; CUDA: NCCL communicators mirroring these).
#pragma once
#include <mpi.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace vitgrid {

enum class TensorMode : int { None = 0, D1 = 1, D2 = 2, D2p5 = 3, D3 = 4 };
TensorMode parse_tensor_mode(const std::string& s);  // "1d","2d","2.5d","3d" (throws UserError)
const char* tensor_mode_name(TensorMode m);

// Named axes. Tensor sub-axes: 2d uses Row/Col; 2.5d Depth/Row/Col; 3d X/Y/Z (Colossal-AI's
// input / weight / output groups). `Tensor` is the whole tensor group in every mode.
enum class Axis : int {
  World = 0, Pipeline, Data, Tensor,
  TensorRow, TensorCol, TensorDepth, TensorX, TensorY, TensorZ,
  Count
};
const char* axis_name(Axis a);

// An owned communicator (freed in the destructor unless it is MPI_COMM_WORLD / null).
class Comm {
 public:
  Comm() = default;
  explicit Comm(MPI_Comm c, bool owned = true);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  Comm(Comm&& o) noexcept;
  Comm& operator=(Comm&& o) noexcept;
  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  bool valid() const { return comm_ != MPI_COMM_NULL; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  bool owned_ = false;
  int rank_ = 0, size_ = 1;
};

struct GridShape {
  int pipeline = 1;
  int data = 1;
  int tensor = 1;  // total ranks in the tensor group
  TensorMode mode = TensorMode::None;
  int depth = 1;  // 2.5d depth d
  // 1d only: the residual stream's samples split over the tensor axis (Megatron's sequence
  // parallelism), gathered before each Column Linear and reduce-scattered after each Row one.
  bool sequence_parallel = false;
  // ... its overlapped gathers and reduce-scatters split into this many row chunks, each
  // GEMM waiting only for its own chunk (1..8)
  int sequence_chunks = 1;
  // Dims of the tensor sub-grid: 1d {t}, 2d {q,q}, 2.5d {d,q,q}, 3d {q,q,q}; none {1}.
  std::vector<int> tensor_dims() const;
  int q() const;  // side of the square / cube (1 for none and 1d)
};

// Validates the shape for a world size (throws UserError naming the deck key).
void check_grid_shape(const GridShape& s, int world);

class ProcessGrid {
 public:
  // Called by all ranks of `world`.
  ProcessGrid(MPI_Comm world, const GridShape& shape);
  const GridShape& shape() const { return shape_; }
  const Comm& comm(Axis a) const { return comms_[static_cast<int>(a)]; }
  int rank(Axis a) const { return comm(a).rank(); }
  int size(Axis a) const { return comm(a).size(); }
  // Cartesian coordinates: {pipeline, data, tensor dims...}
  const std::vector<int>& coords() const { return coords_; }
  int world_rank() const { return comm(Axis::World).rank(); }
  int world_size() const { return comm(Axis::World).size(); }
  int local_rank() const { return local_rank_; }  // rank on this node (GPU index)
  int local_size() const { return local_size_; }
  const std::string& host() const { return host_; }
  // Table of global rank -> host, local rank, coordinates; gathered to every rank.
  // Called by all ranks.
  std::string rank_map() const;

 private:
  GridShape shape_;
  std::array<Comm, static_cast<int>(Axis::Count)> comms_;
  Comm cart_;
  std::vector<int> coords_;
  int local_rank_ = 0, local_size_ = 1;
  std::string host_;
};

// Element types of collective buffers. F64: a few scalars kept on the device (losses, squared
// norms). Act: the backend's activation storage, act_size() bytes (backend.h): its act dtype
// under NCCL (fp32, bf16 or fp16), fp32 on the CPU, whose 16-bit modes are emulated in fp32
// storage. Gathers only move bytes: their type gives the size.
enum class Elem : uint8_t { F32, F64, Act };
enum class ReduceOp : uint8_t { Sum, Max };

// A handle on an asynchronous operation, returned by every asynchronous call of Collectives
// and resolved by the object that returned it (Collectives::wait): the operation's kind and
// its number among those of its kind. A default Work (kind None) stands for nothing to wait
// for.
struct Work {
  enum class Kind : uint8_t {
    None,
    Message,     // post_send, post_recv, fence: valid until wait_messages()
    Collective,  // start_allreduce, start_reduce_scatter, start_allgather: until wait_all()
    Overlapped   // start_overlapped_*: until waited for
  };
  Kind kind = Kind::None;
  size_t id = 0;
  bool valid() const { return kind != Kind::None; }
};

// Collective operations on backend buffers over a named axis. CPU: MPI on host memory;
// CUDA: NCCL on device memory (backend/cuda). Every rank of the axis must call.
class Collectives {
 public:
  virtual ~Collectives() = default;
  // buf[n] = the op (sum or max) of every rank's buf[n]
  virtual void allreduce(void* buf, size_t n, Elem t, ReduceOp op, Axis a) = 0;
  virtual void broadcast(void* buf, size_t bytes, int root, Axis a) = 0;
  // out[size*n] gathers each rank's in[n] in rank order
  virtual void allgather(void* out, const void* in, size_t n, Elem t, Axis a) = 0;
  // out[n] = rank's block of the sum of in[size*n]. out may be in + rank*n (in place: the
  // rest of in then holds unspecified values afterwards).
  virtual void reduce_scatter(void* out, const void* in, size_t n, Elem t, Axis a) = 0;
  virtual void send(const void* buf, size_t bytes, int peer, Axis a) = 0;
  virtual void recv(void* buf, size_t bytes, int peer, Axis a) = 0;
  // Sends and receives between group_begin() and group_end() are posted together and
  // complete together in group_end() (NCCL: ncclGroupStart/End; MPI: Isend/Irecv + Waitall),
  // so a pair of ranks can swap buffers in one step. Their buffers must not be touched before
  // group_end(); groups do not nest.
  virtual void group_begin() = 0;
  virtual void group_end() = 0;
  virtual void barrier(Axis a) = 0;

  // ---- Waiting for asynchronous work. wait(w) orders the backend work enqueued from now on
  // after the operation of w, by w's kind; a Work of kind None: nothing.
  // - Message: after the message (CPU: returns once it is complete, checking a receive's
  //   size).
  // - Collective: after that operation (CUDA: and every one started before it), without
  //   waiting on the host where the backend need not (CUDA); its buffers are free from then.
  // - Overlapped: after it (CPU: returns once it completed). Overlapped Works are waited for
  //   in the order they were started.
  void wait(Work w) {
    switch (w.kind) {
      case Work::Kind::None:
        return;
      case Work::Kind::Message:
        return wait_message(w.id);
      case Work::Kind::Collective:
        return wait_started(w.id);
      case Work::Kind::Overlapped:
        return wait_overlapped(w.id);
    }
  }

  // ---- Asynchronous point-to-point messages (the pipeline's fallback placement, pipeline.h).
  // open_links(a) first, called by every rank of the axis (NCCL creates the links: a
  // collective). Each call returns at once with a Work of kind Message; messages of one
  // channel between a pair of ranks match in posting order, and channels are independent of
  // each other, so a message that waits for its peer holds up only the later messages of its
  // own channel.
  // - post_send: sends buf[bytes] once the work enqueued so far (which produces it) is done.
  //   buf must not change until the message completes.
  // - post_recv: receives into buf[bytes] once the messages and fences in `after` completed
  //   (fences or sends still reading buf; none: the work enqueued so far), without waiting
  //   for any other work; nothing may read buf before wait() on its Work.
  // - fence: a Work that completes with the work enqueued so far.
  // - wait_messages: every message posted so far completes before later work; their Works
  //   are void from then (their ids start again from 0).
  // CPU: MPI Isend / Irecv, one tag per channel. NCCL: one stream and one two-rank
  // communicator per (channel, direction): channel 0 to the next rank of the axis and
  // channel 1 to the previous one (modulo its size, the pipeline's two flows), on
  // Axis::Pipeline only.
  virtual void open_links(Axis a) = 0;
  virtual Work post_send(const void* buf, size_t bytes, int peer, int channel, Axis a) = 0;
  virtual Work post_recv(void* buf, size_t bytes, int peer, int channel, Axis a,
                         const std::vector<Work>& after) = 0;
  virtual Work fence() = 0;
  virtual void wait_messages() = 0;

  // ---- Asynchronous collectives: data-parallel gradient buckets overlapped with the backward,
  // ZeRO-1's parameter buckets gathered during the next forward.
  // A start_* call is ordered after everything this rank enqueued on the backend before it
  // (CUDA: an event on the compute stream that the communication stream waits on) and
  // returns at once with a Work of kind Collective; its buffers must not be touched until
  // wait() on it or wait_all() returns. Every rank of the axis must start the same sequence of
  // collectives in the same order. progress() lets the library advance them (MPI:
  // MPI_Testall; call it now and then from the host thread). wait_all() returns once every
  // started collective has completed (under the watchdog on CUDA), and orders later backend
  // work after them. The defaults run the blocking calls.
  // buf[n] = the sum of every rank's buf[n]
  virtual Work start_allreduce(void* buf, size_t n, Elem t, Axis a) {
    allreduce(buf, n, t, ReduceOp::Sum, a);
    return {};
  }
  // as reduce_scatter (in place too)
  virtual Work start_reduce_scatter(void* out, const void* in, size_t n, Elem t, Axis a) {
    reduce_scatter(out, in, n, t, a);
    return {};
  }
  // as allgather (in may be out's own block)
  virtual Work start_allgather(void* out, const void* in, size_t n, Elem t, Axis a) {
    allgather(out, in, n, t, a);
    return {};
  }
  // The largest input (elements) of the start_allreduce / start_reduce_scatter calls to come
  // on axis a (a gradient bucket), so a backend can size its staging before step 1 (NCCL
  // with copy engines). A collective call over the axis.
  virtual void plan_reduce(size_t max_n, Axis a) { (void)max_n, (void)a; }
  virtual void progress() {}
  virtual void wait_all() {}

  // ---- Overlapped collectives: 1d sequence parallelism's gathers and reduce-scatters over
  // the tensor axis, run beside the GEMMs that do not need them (Megatron-LM's overlap).
  // A start_overlapped_* call is ordered after everything this rank enqueued on the backend
  // before it and returns a Work of kind Overlapped at once. They are waited for in the order
  // they were started, every one of them, and no more than kMaxOverlapped are open at once;
  // the buffers are not touched in between. Every rank of the axis starts the same sequence.
  // NCCL: a communicator and a stream of their own for the tensor axis under sequence
  // parallelism, so they neither queue behind the data axis's buckets nor hold up the
  // compute stream; the blocking calls elsewhere. The defaults run the blocking calls.
  static constexpr size_t kMaxOverlapped = 16;
  // as allgather (in may be out's own block: in place)
  virtual Work start_overlapped_allgather(void* out, const void* in, size_t n, Elem t,
                                          Axis a) {
    allgather(out, in, n, t, a);
    return {};
  }
  // as reduce_scatter, out of place
  virtual Work start_overlapped_reduce_scatter(void* out, const void* in, size_t n, Elem t,
                                               Axis a) {
    reduce_scatter(out, in, n, t, a);
    return {};
  }
  // SMs the overlapped collectives of axis a take beside the compute (their kernels' thread
  // blocks), which the GEMMs running meanwhile leave free; 0 where they do not overlap.
  virtual int overlapped_sms(Axis a) const {
    (void)a;
    return 0;
  }
  // Memory for an overlapped gather's output or reduce-scatter's input, where the collectives
  // need their own (NCCL with copy engines: symmetric memory; a collective over the tensor
  // axis, every rank asking for the same sizes in the same order); null: any backend memory
  // serves. Released with overlapped_release, before the collectives are destroyed.
  virtual void* overlapped_alloc(size_t bytes) {
    (void)bytes;
    return nullptr;
  }
  virtual void overlapped_release(void* p) { (void)p; }

  // ---- CUDA graphs. capture(true) tells the collectives that the backend's stream is being
  // captured: calls enqueue as usual (into the graph) but nothing is handed to the watchdog
  // or waited for. follow(what) hands the work enqueued so far (a launched graph with
  // collectives in it) to the watchdog as one item on every axis.
  virtual void capture(bool on) { (void)on; }
  virtual void follow(const char* what) { (void)what; }

 protected:
  // wait(w) by kind, w.id the Work's id
  virtual void wait_message(size_t id) = 0;
  virtual void wait_started(size_t id) = 0;
  virtual void wait_overlapped(size_t id) = 0;
};

std::unique_ptr<Collectives> make_mpi_collectives(const ProcessGrid& grid);

}  // namespace vitgrid
