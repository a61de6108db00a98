// The process grid: one Cartesian communicator over (pipeline, data, tensor dims...) and one
// owned sub-communicator per named axis.
//
// Layout (row-major, last dim fastest, reorder = 0 so the Cartesian rank equals the world rank):
//   world rank = ((pipeline * data_size + data) * tensor_size) + tensor_rank
//   tensor_rank: 1d  t
//                2d  row * q + col                      dims [q, q]
//                2.5d (depth * q + row) * q + col       dims [d, q, q]
//                3d  (c0 * q + c1) * q + c2             dims [q, q, q]
// Tensor sub-axes follow Colossal-AI's process-group initializers, so the tensor-parallel
// layers can follow its algorithms one to one:
//   2d   Row = same row, varying col (Colossal-AI PARALLEL_2D_ROW: ranks j*q + k, k varies);
//        Col = same col, varying row (PARALLEL_2D_COL).
//   2.5d Row = varying col, Col = varying row, Depth = varying depth (PARALLEL_2P5D_ROW /
//        _COL / _DEP: rank i + q*(j + q*k), i varies in ROW, j in COL, k in DEP).
//   3d   with rank c2 + q*(c1 + q*c0), as in Colossal-AI's initializer_3d.py
//        (i + depth*(j + depth*k)):  X = input group  (PARALLEL_3D_INPUT,  j = c1 varies),
//                                    Y = weight group (PARALLEL_3D_WEIGHT, i = c2 varies),
//                                    Z = output group (PARALLEL_3D_OUTPUT, k = c0 varies).
#include "vitgrid/grid/grid.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <deque>
#include <sstream>

#include "vitgrid/core/error.h"
#include "vitgrid/core/watchdog.h"

namespace vitgrid {

TensorMode parse_tensor_mode(const std::string& s) {
  if (s == "1d") return TensorMode::D1;
  if (s == "2d") return TensorMode::D2;
  if (s == "2.5d") return TensorMode::D2p5;
  if (s == "3d") return TensorMode::D3;
  if (s == "none") return TensorMode::None;
  throw UserError("parallel.tensor_mode: expected one of 1d|2d|2.5d|3d, got '" + s + "'");
}

const char* tensor_mode_name(TensorMode m) {
  switch (m) {
    case TensorMode::None:
      return "none";
    case TensorMode::D1:
      return "1d";
    case TensorMode::D2:
      return "2d";
    case TensorMode::D2p5:
      return "2.5d";
    case TensorMode::D3:
      return "3d";
  }
  return "?";
}

const char* axis_name(Axis a) {
  switch (a) {
    case Axis::World:
      return "world";
    case Axis::Pipeline:
      return "pipeline";
    case Axis::Data:
      return "data";
    case Axis::Tensor:
      return "tensor";
    case Axis::TensorRow:
      return "tensor_row";
    case Axis::TensorCol:
      return "tensor_col";
    case Axis::TensorDepth:
      return "tensor_depth";
    case Axis::TensorX:
      return "tensor_x";
    case Axis::TensorY:
      return "tensor_y";
    case Axis::TensorZ:
      return "tensor_z";
    case Axis::Count:
      break;
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Comm

Comm::Comm(MPI_Comm c, bool owned) : comm_(c) {
  // The predefined communicators are never freed, whatever the caller says.
  owned_ = owned && c != MPI_COMM_NULL && c != MPI_COMM_WORLD && c != MPI_COMM_SELF;
  if (c != MPI_COMM_NULL) {
    MPI_CHECK(MPI_Comm_rank(c, &rank_));
    MPI_CHECK(MPI_Comm_size(c, &size_));
  }
}

Comm::~Comm() {
  if (!owned_ || comm_ == MPI_COMM_NULL) return;
  // Freeing after MPI_Finalize is erroneous; a handle that outlived MPI just leaks.
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm_);
}

Comm::Comm(Comm&& o) noexcept : comm_(o.comm_), owned_(o.owned_), rank_(o.rank_), size_(o.size_) {
  o.comm_ = MPI_COMM_NULL;
  o.owned_ = false;
  o.rank_ = 0;
  o.size_ = 1;
}

Comm& Comm::operator=(Comm&& o) noexcept {
  if (this != &o) {
    Comm tmp(std::move(*this));  // frees our old communicator when it goes out of scope
    comm_ = o.comm_;
    owned_ = o.owned_;
    rank_ = o.rank_;
    size_ = o.size_;
    o.comm_ = MPI_COMM_NULL;
    o.owned_ = false;
    o.rank_ = 0;
    o.size_ = 1;
  }
  return *this;
}

// ---------------------------------------------------------------------------------------------
// GridShape

namespace {

// The integer r with r^k <= n < (r+1)^k.
int int_root(int n, int k) {
  if (n <= 0) return 0;
  int r = 1;
  while (true) {
    long long pw = 1;
    for (int i = 0; i < k; ++i) pw *= (r + 1);
    if (pw > n) return r;
    ++r;
  }
}

std::string num(int v) { return std::to_string(v); }

}  // namespace

std::vector<int> GridShape::tensor_dims() const {
  const int s = q();
  switch (mode) {
    case TensorMode::None:
      return {1};
    case TensorMode::D1:
      return {tensor};
    case TensorMode::D2:
      return {s, s};
    case TensorMode::D2p5:
      return {depth, s, s};
    case TensorMode::D3:
      return {s, s, s};
  }
  return {tensor};
}

int GridShape::q() const {
  switch (mode) {
    case TensorMode::None:
    case TensorMode::D1:
      return 1;
    case TensorMode::D2:
      return int_root(tensor, 2);
    case TensorMode::D2p5:
      return depth > 0 ? int_root(tensor / depth, 2) : 0;
    case TensorMode::D3:
      return int_root(tensor, 3);
  }
  return 1;
}

void check_grid_shape(const GridShape& s, int world) {
  if (s.pipeline < 1) throw UserError("parallel.pipeline: must be >= 1, got " + num(s.pipeline));
  if (s.tensor < 1) throw UserError("parallel.tensor: must be >= 1, got " + num(s.tensor));
  if (s.data < 1) throw UserError("parallel.data: must be >= 1, got " + num(s.data));
  if (s.sequence_chunks < 1 || s.sequence_chunks > 8)
    throw UserError("parallel.sequence_chunks: must be 1..8, got " + num(s.sequence_chunks));
  const std::string mode = tensor_mode_name(s.mode);
  switch (s.mode) {
    case TensorMode::None:
      if (s.tensor != 1)
        throw UserError("parallel.tensor: " + num(s.tensor) +
                        " tensor ranks need a parallel.tensor_mode (1d|2d|2.5d|3d)");
      break;
    case TensorMode::D1:
      break;
    case TensorMode::D2:
      if (s.q() * s.q() != s.tensor)
        throw UserError("parallel.tensor: " + num(s.tensor) +
                        " is not a square (2d needs tensor = q*q)");
      break;
    case TensorMode::D2p5:
      if (s.depth < 1 || s.tensor % s.depth != 0)
        throw UserError("parallel.tensor_depth: " + num(s.depth) +
                        " does not divide parallel.tensor (" + num(s.tensor) +
                        "); 2.5d needs tensor = depth*q*q");
      if (s.depth * s.q() * s.q() != s.tensor)
        throw UserError("parallel.tensor: " + num(s.tensor) + " / parallel.tensor_depth (" +
                        num(s.depth) + ") is not a square; 2.5d needs tensor = depth*q*q");
      break;
    case TensorMode::D3:
      if (s.q() * s.q() * s.q() != s.tensor)
        throw UserError("parallel.tensor: " + num(s.tensor) +
                        " is not a cube (3d needs tensor = q*q*q)");
      break;
  }
  if (world % s.tensor != 0)
    throw UserError("parallel.tensor: " + num(s.tensor) + " does not divide the world size (" +
                    num(world) + " ranks)");
  if (world % (s.pipeline * s.tensor) != 0)
    throw UserError("parallel.pipeline: " + num(s.pipeline) + " x parallel.tensor (" +
                    num(s.tensor) + ") does not divide the world size (" + num(world) + " ranks)");
  if (s.pipeline * s.data * s.tensor != world)
    throw UserError("parallel.data: " + num(s.data) + " but world (" + num(world) +
                    ") / (pipeline " + num(s.pipeline) + " x tensor " + num(s.tensor) +
                    ") = " + num(world / (s.pipeline * s.tensor)));
}

// ---------------------------------------------------------------------------------------------
// ProcessGrid

namespace {

Comm dup(MPI_Comm c) {
  MPI_Comm out = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_dup(c, &out));
  return Comm(out);
}

// The sub-communicator of `cart` that keeps the dims flagged in `remain`. Called by all ranks
// of cart.
Comm cart_sub(const Comm& cart, const std::vector<int>& remain) {
  MPI_Comm out = MPI_COMM_NULL;
  MPI_CHECK(MPI_Cart_sub(cart.get(), remain.data(), &out));
  return Comm(out);
}

}  // namespace

ProcessGrid::ProcessGrid(MPI_Comm world, const GridShape& shape) : shape_(shape) {
  int wsize = 1;
  MPI_CHECK(MPI_Comm_size(world, &wsize));
  check_grid_shape(shape_, wsize);  // same verdict on every rank: no rank is left waiting

  comms_[static_cast<int>(Axis::World)] = dup(world);

  std::vector<int> dims = {shape_.pipeline, shape_.data};
  const std::vector<int> tdims = shape_.tensor_dims();
  dims.insert(dims.end(), tdims.begin(), tdims.end());
  const int ndims = static_cast<int>(dims.size());
  std::vector<int> periods(ndims, 0);
  MPI_Comm cart = MPI_COMM_NULL;
  // reorder = 0: the Cartesian rank is the world rank, so the layout is predictable and the
  // tensor group (fastest dim) lands on consecutive ranks, i.e. on one node with usual launchers.
  MPI_CHECK(MPI_Cart_create(world, ndims, dims.data(), periods.data(), /*reorder=*/0, &cart));
  cart_ = Comm(cart);
  coords_.assign(ndims, 0);
  MPI_CHECK(MPI_Cart_coords(cart_.get(), cart_.rank(), ndims, coords_.data()));

  // remain flags: index 0 pipeline, 1 data, 2.. tensor dims
  auto only = [&](std::initializer_list<int> keep) {
    std::vector<int> r(ndims, 0);
    for (int k : keep) r[k] = 1;
    return r;
  };
  std::vector<int> tensor_all(ndims, 0);
  for (int i = 2; i < ndims; ++i) tensor_all[i] = 1;
  auto set = [&](Axis a, Comm c) { comms_[static_cast<int>(a)] = std::move(c); };
  set(Axis::Pipeline, cart_sub(cart_, only({0})));
  set(Axis::Data, cart_sub(cart_, only({1})));
  set(Axis::Tensor, cart_sub(cart_, tensor_all));
  switch (shape_.mode) {
    case TensorMode::D2:  // dims [row, col]
      set(Axis::TensorRow, cart_sub(cart_, only({3})));
      set(Axis::TensorCol, cart_sub(cart_, only({2})));
      break;
    case TensorMode::D2p5:  // dims [depth, row, col]
      set(Axis::TensorDepth, cart_sub(cart_, only({2})));
      set(Axis::TensorRow, cart_sub(cart_, only({4})));
      set(Axis::TensorCol, cart_sub(cart_, only({3})));
      break;
    case TensorMode::D3:  // dims [c0, c1, c2]
      set(Axis::TensorX, cart_sub(cart_, only({3})));
      set(Axis::TensorY, cart_sub(cart_, only({4})));
      set(Axis::TensorZ, cart_sub(cart_, only({2})));
      break;
    case TensorMode::None:
    case TensorMode::D1:
      break;
  }
  // Axes this mode lacks: a size-1 communicator, so callers never branch on the mode.
  for (int a = 0; a < static_cast<int>(Axis::Count); ++a)
    if (!comms_[a].valid()) comms_[a] = dup(MPI_COMM_SELF);

  // Ranks sharing memory are one node; the local rank picks the GPU whatever the launcher.
  MPI_Comm node = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split_type(comms_[0].get(), MPI_COMM_TYPE_SHARED, comms_[0].rank(),
                                MPI_INFO_NULL, &node));
  Comm node_comm(node);
  local_rank_ = node_comm.rank();
  local_size_ = node_comm.size();

  char name[MPI_MAX_PROCESSOR_NAME] = {0};
  int len = 0;
  MPI_CHECK(MPI_Get_processor_name(name, &len));
  host_.assign(name, len);
}

std::string ProcessGrid::rank_map() const {
  const Comm& w = comm(Axis::World);
  const int n = w.size();
  const int ndims = static_cast<int>(coords_.size());
  constexpr int kHost = MPI_MAX_PROCESSOR_NAME;
  std::vector<char> hosts(static_cast<size_t>(n) * kHost, 0);
  std::vector<char> my_host(kHost, 0);
  std::memcpy(my_host.data(), host_.data(), std::min<size_t>(host_.size(), kHost - 1));
  MPI_CHECK(MPI_Allgather(my_host.data(), kHost, MPI_CHAR, hosts.data(), kHost, MPI_CHAR, w.get()));
  std::vector<int> mine = {local_rank_};
  mine.insert(mine.end(), coords_.begin(), coords_.end());
  std::vector<int> all(static_cast<size_t>(n) * (ndims + 1));
  MPI_CHECK(
      MPI_Allgather(mine.data(), ndims + 1, MPI_INT, all.data(), ndims + 1, MPI_INT, w.get()));

  size_t host_w = 4;
  for (int r = 0; r < n; ++r)
    host_w = std::max(host_w, std::strlen(&hosts[static_cast<size_t>(r) * kHost]));
  std::ostringstream out;
  auto pad = [](const std::string& s, size_t width) {
    return s + std::string(width > s.size() ? width - s.size() : 0, ' ');
  };
  std::string tensor_label = std::string("tensor(") + tensor_mode_name(shape_.mode) + ")";
  out << pad("rank", 6) << pad("host", host_w + 2) << pad("local", 7) << pad("pipeline", 10)
      << pad("data", 6) << tensor_label << "\n";
  for (int r = 0; r < n; ++r) {
    const int* row = &all[static_cast<size_t>(r) * (ndims + 1)];
    std::string t = "(";
    for (int i = 2; i < ndims; ++i) t += (i > 2 ? "," : "") + std::to_string(row[1 + i]);
    t += ")";
    out << pad(std::to_string(r), 6) << pad(&hosts[static_cast<size_t>(r) * kHost], host_w + 2)
        << pad(std::to_string(row[0]), 7) << pad(std::to_string(row[1]), 10)
        << pad(std::to_string(row[2]), 6) << t << "\n";
  }
  return out.str();
}

// ---------------------------------------------------------------------------------------------
// Collectives on host buffers with MPI (the CPU backend's; CUDA uses NCCL).

namespace {

// MPI counts are int: large buffers go in pieces of at most this many elements.
constexpr size_t kMaxCount = size_t(1) << 30;

class MpiCollectives final : public Collectives {
 public:
  // The grid must outlive this object.
  explicit MpiCollectives(const ProcessGrid& grid) : grid_(grid) {}

  void allreduce(void* buf, size_t n, Elem t, ReduceOp op, Axis a) override {
    WatchdogWait w("an MPI all-reduce", axis_name(a));
    char* p = static_cast<char*>(buf);
    for (size_t off = 0; off < n; off += kMaxCount) {
      const int c = static_cast<int>(std::min(kMaxCount, n - off));
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, p + off * elem_size(t), c, mpi_type(t),
                              op == ReduceOp::Max ? MPI_MAX : MPI_SUM, comm(a)));
    }
  }

  void broadcast(void* buf, size_t bytes, int root, Axis a) override {
    WatchdogWait w("an MPI broadcast", axis_name(a));
    char* p = static_cast<char*>(buf);
    for (size_t off = 0; off < bytes; off += kMaxCount) {
      const int c = static_cast<int>(std::min(kMaxCount, bytes - off));
      MPI_CHECK(MPI_Bcast(p + off, c, MPI_BYTE, root, comm(a)));
    }
  }

  void allgather(void* out, const void* in, size_t n, Elem t, Axis a) override {
    WatchdogWait w("an MPI all-gather", axis_name(a));
    const GatherArgs g = gather_args(out, in, n, elem_size(t), a);
    MPI_CHECK(MPI_Allgather(g.send, g.count, g.type, out, g.count, g.type, comm(a)));
    if (g.type != MPI_BYTE) free_type(g.type);
  }

  void reduce_scatter(void* out, const void* in, size_t n, Elem t, Axis a) override {
    WatchdogWait w("an MPI reduce-scatter", axis_name(a));
    VG_CHECK(n <= static_cast<size_t>(INT_MAX), "reduce_scatter block of " << n << " elements");
    const Move m = in_place(out, in, n, t, a);
    if (m.dst) {
      // In place (NCCL's convention): MPI's in-place form leaves the block at the front.
      MPI_CHECK(MPI_Reduce_scatter_block(MPI_IN_PLACE, m.src, static_cast<int>(n), mpi_type(t),
                                         MPI_SUM, comm(a)));
      if (m.dst != m.src) std::memcpy(m.dst, m.src, m.bytes);
      return;
    }
    MPI_CHECK(MPI_Reduce_scatter_block(in, out, static_cast<int>(n), mpi_type(t), MPI_SUM,
                                       comm(a)));
  }

  // Act buffers (parallel.grad_reduce = act) are reduced at once by the blocking all-reduce
  // (MPI_Iallreduce may sum in another order).
  Work start_allreduce(void* buf, size_t n, Elem t, Axis a) override {
    if (t == Elem::Act) {
      allreduce(buf, n, t, ReduceOp::Sum, a);
      return open_started();
    }
    const Work w = open_started();
    char* p = static_cast<char*>(buf);
    for (size_t off = 0; off < n; off += kMaxCount) {
      const int c = static_cast<int>(std::min(kMaxCount, n - off));
      reqs_.emplace_back();
      MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, p + off * elem_size(t), c, mpi_type(t), MPI_SUM,
                               comm(a), &reqs_.back()));
    }
    started_.back().end = reqs_.size();
    return w;
  }

  Work start_reduce_scatter(void* out, const void* in, size_t n, Elem t, Axis a) override {
    VG_CHECK(n <= static_cast<size_t>(INT_MAX), "reduce_scatter block of " << n << " elements");
    const Work w = open_started();
    Started& s = started_.back();
    reqs_.emplace_back();
    s.end = reqs_.size();
    const Move m = in_place(out, in, n, t, a);
    if (m.dst) {
      MPI_CHECK(MPI_Ireduce_scatter_block(MPI_IN_PLACE, m.src, static_cast<int>(n),
                                          mpi_type(t), MPI_SUM, comm(a), &reqs_.back()));
      if (m.dst != m.src) s.move = m;  // done once it completed (wait, wait_all)
      return w;
    }
    MPI_CHECK(MPI_Ireduce_scatter_block(in, out, static_cast<int>(n), mpi_type(t), MPI_SUM,
                                        comm(a), &reqs_.back()));
    return w;
  }

  Work start_allgather(void* out, const void* in, size_t n, Elem t, Axis a) override {
    const GatherArgs g = gather_args(out, in, n, elem_size(t), a);
    if (g.type != MPI_BYTE) types_.push_back(g.type);  // freed in wait_all, once it completed
    const Work w = open_started();
    reqs_.emplace_back();
    started_.back().end = reqs_.size();
    MPI_CHECK(MPI_Iallgather(g.send, g.count, g.type, out, g.count, g.type, comm(a),
                             &reqs_.back()));
    return w;
  }

  void progress() override {
    if (reqs_.empty()) return;
    int done = 0;
    MPI_CHECK(MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &done,
                          MPI_STATUSES_IGNORE));
  }

  void wait_all() override {
    WatchdogWait w("a wait for the started MPI collectives");
    if (!reqs_.empty())
      MPI_CHECK(MPI_Waitall(static_cast<int>(reqs_.size()), reqs_.data(), MPI_STATUSES_IGNORE));
    reqs_.clear();
    for (Started& s : started_) finish(s);
    started_.clear();
    for (MPI_Datatype t : types_) free_type(t);
    types_.clear();
  }

  // Overlapped collectives: non-blocking MPI calls, waited for in order.
  Work start_overlapped_allgather(void* out, const void* in, size_t n, Elem t,
                                  Axis a) override {
    const GatherArgs g = gather_args(out, in, n, elem_size(t), a);
    Overlapped& o = open_overlapped(g.type);
    MPI_CHECK(MPI_Iallgather(g.send, g.count, g.type, out, g.count, g.type, comm(a), &o.req));
    return {Work::Kind::Overlapped, overlapped_first_ + overlapped_.size() - 1};
  }
  Work start_overlapped_reduce_scatter(void* out, const void* in, size_t n, Elem t,
                                       Axis a) override {
    VG_CHECK(n <= static_cast<size_t>(INT_MAX), "reduce_scatter block of " << n << " elements");
    Overlapped& o = open_overlapped(MPI_BYTE);
    MPI_CHECK(MPI_Ireduce_scatter_block(in, out, static_cast<int>(n), mpi_type(t), MPI_SUM,
                                        comm(a), &o.req));
    return {Work::Kind::Overlapped, overlapped_first_ + overlapped_.size() - 1};
  }


  void send(const void* buf, size_t bytes, int peer, Axis a) override {
    WatchdogWait w("an MPI send", axis_name(a));
    const char* p = static_cast<const char*>(buf);
    for_pieces(bytes, [&](size_t off, int c) {
      if (grouping_) {
        p2p_.push_back({MPI_REQUEST_NULL, -1, 0, a});
        MPI_CHECK(MPI_Isend(p + off, c, MPI_BYTE, peer, kTag, comm(a), &p2p_.back().req));
      } else {
        MPI_CHECK(MPI_Send(p + off, c, MPI_BYTE, peer, kTag, comm(a)));
      }
    });
  }

  void recv(void* buf, size_t bytes, int peer, Axis a) override {
    WatchdogWait w("an MPI receive", axis_name(a));
    char* p = static_cast<char*>(buf);
    for_pieces(bytes, [&](size_t off, int c) {
      if (grouping_) {
        p2p_.push_back({MPI_REQUEST_NULL, peer, c, a});
        MPI_CHECK(MPI_Irecv(p + off, c, MPI_BYTE, peer, kTag, comm(a), &p2p_.back().req));
      } else {
        MPI_Status st;
        MPI_CHECK(MPI_Recv(p + off, c, MPI_BYTE, peer, kTag, comm(a), &st));
        check_count(st, c, peer, a);
      }
    });
  }

  void group_begin() override {
    VG_CHECK(!grouping_, "send/recv groups do not nest");
    grouping_ = true;
  }
  void group_end() override {
    VG_CHECK(grouping_, "group_end without group_begin");
    grouping_ = false;
    std::vector<MPI_Request> r;
    for (const P2p& q : p2p_) r.push_back(q.req);
    std::vector<MPI_Status> st(r.size());
    WatchdogWait w("a group of MPI sends and receives");
    if (!r.empty()) MPI_CHECK(MPI_Waitall(static_cast<int>(r.size()), r.data(), st.data()));
    for (size_t i = 0; i < p2p_.size(); ++i)
      if (p2p_[i].peer >= 0) check_count(st[i], p2p_[i].count, p2p_[i].peer, p2p_[i].axis);
    p2p_.clear();
  }

  // Asynchronous messages of channel c use tag kTag + 1 + c.
  void open_links(Axis) override {}
  Work post_send(const void* buf, size_t bytes, int peer, int channel, Axis a) override {
    return post(const_cast<void*>(buf), bytes, peer, channel, a, false);
  }
  // On the host the computes in `after` are done when the caller posts (their fences are
  // complete), but the sends in it may still be reading the buffer: MPI_Isend reads it until
  // its request completes (a rendezvous send, long after the call), so a receive posted into
  // it before then could overwrite the data on its way out. Wait for them first.
  Work post_recv(void* buf, size_t bytes, int peer, int channel, Axis a,
                 const std::vector<Work>& after) override {
    for (const Work& w : after) {
      VG_CHECK(w.kind == Work::Kind::Message && w.id < messages_.size(),
               "post_recv after a Work that is no message of " << messages_.size() << " (kind "
                                                               << static_cast<int>(w.kind)
                                                               << ", id " << w.id << ")");
      wait_message(w.id);
    }
    return post(buf, bytes, peer, channel, a, true);
  }
  Work fence() override {
    messages_.emplace_back();  // complete already: the host's work is done
    return {Work::Kind::Message, messages_.size() - 1};
  }
  void wait_messages() override {
    for (size_t t = 0; t < messages_.size(); ++t) wait_message(t);
    messages_.clear();
  }

  void barrier(Axis a) override {
    WatchdogWait w("an MPI barrier", axis_name(a));
    MPI_CHECK(MPI_Barrier(comm(a)));
  }

 private:
  static constexpr int kTag = 0;

  // The MPI type and size of an element: the CPU backend stores activations in fp32, in its
  // 16-bit modes too.
  static MPI_Datatype mpi_type(Elem t) { return t == Elem::F64 ? MPI_DOUBLE : MPI_FLOAT; }
  static size_t elem_size(Elem t) { return t == Elem::F64 ? sizeof(double) : sizeof(float); }

  // Calls f(offset, count) for each piece of a message of `bytes` (at most kMaxCount each; one
  // empty piece for an empty message). The pieces arrive in order: MPI messages between one
  // pair on one tag do not overtake.
  template <class F>
  static void for_pieces(size_t bytes, F&& f) {
    size_t off = 0;
    do {
      f(off, static_cast<int>(std::min(kMaxCount, bytes - off)));
      off += kMaxCount;
    } while (off < bytes);
  }
  // An asynchronous send or receive (its pieces' requests).
  Work post(void* buf, size_t bytes, int peer, int channel, Axis a, bool receive) {
    char* p = static_cast<char*>(buf);
    Message m;
    for_pieces(bytes, [&](size_t off, int c) {
      m.parts.push_back({MPI_REQUEST_NULL, receive ? c : -1});
      if (receive)
        MPI_CHECK(MPI_Irecv(p + off, c, MPI_BYTE, peer, kTag + 1 + channel, comm(a), &m.parts.back().req));
      else
        MPI_CHECK(MPI_Isend(p + off, c, MPI_BYTE, peer, kTag + 1 + channel, comm(a), &m.parts.back().req));
    });
    m.peer = peer;
    m.axis = a;
    messages_.push_back(std::move(m));
    return {Work::Kind::Message, messages_.size() - 1};
  }
  void wait_message(size_t t) override {
    VG_CHECK(t < messages_.size(), "wait for message " << t << " of " << messages_.size());
    Message& m = messages_[t];
    WatchdogWait w("a wait for an MPI message", axis_name(m.axis));
    for (Part& q : m.parts) {
      MPI_Status st;
      MPI_CHECK(MPI_Wait(&q.req, &st));
      if (q.count >= 0) check_count(st, q.count, m.peer, m.axis);
      q.count = -1;  // checked once
    }
  }

  MPI_Comm comm(Axis a) const { return grid_.comm(a).get(); }

  // An all-gather's send buffer, count and type: a rank that already placed its block in
  // `out` passes that block as `in`, which MPI only accepts as MPI_IN_PLACE; blocks over 2 GiB
  // count elements of a committed contiguous element-sized type (free it: free_type) instead
  // of bytes.
  struct GatherArgs {
    const void* send;
    int count;
    MPI_Datatype type;
  };
  GatherArgs gather_args(void* out, const void* in, size_t n, size_t elem_size, Axis a) const {
    const size_t bytes = n * elem_size;
    GatherArgs g{in, 0, MPI_BYTE};
    if (in == static_cast<char*>(out) + bytes * grid_.comm(a).rank()) g.send = MPI_IN_PLACE;
    if (bytes <= static_cast<size_t>(INT_MAX)) {
      g.count = static_cast<int>(bytes);
      return g;
    }
    VG_CHECK(n <= static_cast<size_t>(INT_MAX), "allgather block of " << n << " elements");
    MPI_CHECK(MPI_Type_contiguous(static_cast<int>(elem_size), MPI_BYTE, &g.type));
    MPI_CHECK(MPI_Type_commit(&g.type));
    g.count = static_cast<int>(n);
    return g;
  }
  static void free_type(MPI_Datatype t) { MPI_CHECK(MPI_Type_free(&t)); }

  // A reduce-scatter's block once it completed in place: MPI's in-place form leaves it at the
  // front of the buffer (src), NCCL's convention wants it at out = in + rank * n (dst).
  struct Move {
    char* dst = nullptr;  // null: not in place
    char* src = nullptr;
    size_t bytes = 0;
  };
  Move in_place(void* out, const void* in, size_t n, Elem t, Axis a) const {
    const size_t bytes = n * elem_size(t);
    const size_t r = static_cast<size_t>(grid_.comm(a).rank());
    char* o = static_cast<char*>(out);
    if (o != static_cast<const char*>(in) + r * bytes) return {};
    return {o, o - r * bytes, bytes};
  }

  const ProcessGrid& grid_;
  // outstanding non-blocking collectives: their requests, and by Work id the range of them
  // each holds and the in-place reduce-scatter block to move into place once it completed
  struct Started {
    size_t first = 0, end = 0;  // requests [first, end) of reqs_
    Move move;                  // dst null: none (left)
  };
  std::vector<MPI_Request> reqs_;
  std::vector<Started> started_;
  Work open_started() {
    started_.push_back({reqs_.size(), reqs_.size(), {}});
    return {Work::Kind::Collective, started_.size() - 1};
  }
  void wait_started(size_t t) override {
    WatchdogWait w("a wait for an overlapped MPI collective");
    VG_CHECK(t < started_.size(), "wait for collective " << t << " of " << started_.size());
    Started& s = started_[t];
    if (s.end > s.first)
      MPI_CHECK(MPI_Waitall(static_cast<int>(s.end - s.first), reqs_.data() + s.first,
                            MPI_STATUSES_IGNORE));
    finish(s);
  }
  // once s completed: its block moved into place (once)
  static void finish(Started& s) {
    if (s.move.dst) std::memcpy(s.move.dst, s.move.src, s.move.bytes);
    s.move = {};
  }
  // the sends and receives of the open group (group_begin): receives keep what they expect
  struct P2p {
    MPI_Request req;
    int peer;  // -1: a send
    int count;
    Axis axis;
  };
  std::vector<P2p> p2p_;
  bool grouping_ = false;
  // posted asynchronous messages (and fences) since the last wait_messages, by Work id: their
  // requests, and for a receive's pieces the bytes they expect (-1: a send, or already checked)
  struct Part {
    MPI_Request req;
    int count;
  };
  struct Message {
    std::vector<Part> parts;
    int peer = -1;
    Axis axis = Axis::World;
  };
  std::vector<Message> messages_;

  // A short message means the two sides disagree on a shape: stop here, not in a kernel.
  static void check_count(const MPI_Status& st, int expected, int peer, Axis a) {
    int got = 0;
    MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &got));
    VG_CHECK(got == expected, "recv on axis " << axis_name(a) << " from " << peer << ": expected "
                                              << expected << " bytes, got " << got);
  }
  std::vector<MPI_Datatype> types_;  // of started gathers over 2 GiB
  // open overlapped collectives, oldest first (Work id overlapped_first_), and the datatype
  // of a gather over 2 GiB to free once it completed
  struct Overlapped {
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Datatype type = MPI_BYTE;
  };
  Overlapped& open_overlapped(MPI_Datatype type) {
    VG_CHECK(overlapped_.size() < kMaxOverlapped,
             "more than " << kMaxOverlapped << " overlapped collectives open");
    overlapped_.push_back({MPI_REQUEST_NULL, type});
    return overlapped_.back();
  }
  void wait_overlapped(size_t t) override {
    VG_CHECK(!overlapped_.empty() && t == overlapped_first_,
             "overlapped collective " << t << " waited for out of order (next: "
                                      << overlapped_first_ << ", open: " << overlapped_.size()
                                      << ")");
    WatchdogWait w("a wait for an overlapped MPI collective");
    MPI_CHECK(MPI_Wait(&overlapped_.front().req, MPI_STATUS_IGNORE));
    if (overlapped_.front().type != MPI_BYTE) free_type(overlapped_.front().type);
    overlapped_.pop_front();
    ++overlapped_first_;
  }
  std::deque<Overlapped> overlapped_;
  size_t overlapped_first_ = 0;
};

}  // namespace

std::unique_ptr<Collectives> make_mpi_collectives(const ProcessGrid& grid) {
  return std::make_unique<MpiCollectives>(grid);
}

}  // namespace vitgrid
