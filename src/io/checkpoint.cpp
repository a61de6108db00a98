// Collective checkpoint files, the write side (DESIGN.md "Files other tools read"): every
// tensor is stored once with its global shape, each rank writing its own hyperslab, so a
// checkpoint written on one process grid loads on any other. Reading, verifying and finding
// the newest usable checkpoint: checkpoint_read.cpp.
#include "vitgrid/io/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <system_error>
#include <thread>
#include <utility>

#include "checkpoint_internal.h"
#include "h5_parallel.h"
#include "vitgrid/core/rng.h"
#include "vitgrid/core/test_hooks.h"
#include "vitgrid/core/watchdog.h"

namespace vitgrid {

using io_detail::H5Id;

namespace ckpt_detail {

constexpr const char* kVersion = "0.1.0";

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

// Parses "step_<digits>.h5" (and nothing else: a ".h5.tmp" is an unfinished write).
bool parse_step_file_name(const std::string& name, int64_t* step) {
  const std::string pre = "step_", suf = ".h5";
  if (name.size() <= pre.size() + suf.size()) return false;
  if (name.compare(0, pre.size(), pre) != 0) return false;
  if (name.compare(name.size() - suf.size(), suf.size(), suf) != 0) return false;
  std::string digits = name.substr(pre.size(), name.size() - pre.size() - suf.size());
  if (digits.empty() || digits.size() > 18) return false;
  for (char c : digits)
    if (c < '0' || c > '9') return false;
  *step = std::stoll(digits);
  return true;
}

// Rank 0 only (serial sec2 driver): is `path` an HDF5 file whose root says complete = 1? (Its
// metadata walked first in the checker process: see hdf5_metadata_problem_isolated.)
bool is_complete_serial(const std::string& path) {
  io_detail::H5ErrorSilencer quiet;
  if (H5Fis_hdf5(path.c_str()) <= 0) return false;
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  if (!file.valid()) return false;
  if (H5Aexists(file, "complete") <= 0) return false;
  H5Id attr(H5Aopen(file, "complete", H5P_DEFAULT));
  int v = 0;
  if (!attr.valid() || H5Aread(attr, H5T_NATIVE_INT, &v) < 0) return false;
  return v == 1;
}

// Rank 0 only: the step_*.h5 files of dir (complete or not), newest step first.
std::vector<std::pair<int64_t, std::string>> list_step_files(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    int64_t step = 0;
    std::string name = it->path().filename().string();
    if (parse_step_file_name(name, &step)) found.emplace_back(step, join_path(dir, name));
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return found;
}

bool strided(const TensorShard& s) { return !s.block.empty(); }

void check_shard_bounds(const TensorShard& s) {
  size_t nd = s.global_shape.size();
  VG_CHECK(s.offset.size() == nd && s.count.size() == nd,
           "shard '" << s.name << "': offset/count rank differs from the global shape's");
  VG_CHECK(!strided(s) || (s.block.size() == nd && s.stride.size() == nd),
           "shard '" << s.name << "': stride/block rank differs from the global shape's");
  for (size_t d = 0; d < nd; ++d) {
    const int64_t blk = strided(s) ? s.block[d] : 1, str = strided(s) ? s.stride[d] : 1;
    const int64_t end = s.count[d] == 0 ? s.offset[d] : s.offset[d] + (s.count[d] - 1) * str + blk;
    VG_CHECK(s.offset[d] >= 0 && s.count[d] >= 0 && blk >= 0 && end <= s.global_shape[d] &&
                 (!strided(s) || s.count[d] <= 1 || str >= blk),
             "shard '" << s.name << "': hyperslab outside the global shape on axis " << d);
  }
}

// Names and global shapes must match on every rank, since dataset creation and the
// collective transfers pair up call by call.
uint64_t shard_signature(const std::vector<TensorShard>& shards) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& s : shards) {
    h = io_detail::fnv1a(h, s.name.data(), s.name.size());
    h = io_detail::fnv1a(h, "\0", 1);
    h = io_detail::fnv1a(h, s.global_shape.data(), s.global_shape.size() * sizeof(int64_t));
    h = io_detail::fnv1a(h, "|", 1);
  }
  return h;
}

uint64_t meta_signature(const CheckpointMeta& m) {
  uint64_t h = 1469598103934665603ull;
  h = io_detail::fnv1a(h, m.deck.data(), m.deck.size());
  h = io_detail::fnv1a(h, m.grid.data(), m.grid.size() * sizeof(int));
  h = io_detail::fnv1a(h, m.tensor_mode.data(), m.tensor_mode.size());
  h = io_detail::fnv1a(h, m.backend.data(), m.backend.size());
  for (const auto& kv : m.state) {
    h = io_detail::fnv1a(h, kv.first.data(), kv.first.size());
    uint64_t n = kv.second.size();
    h = io_detail::fnv1a(h, &n, sizeof(n));
  }
  return h;
}

// File and memory dataspaces selecting this rank's hyperslab, or nothing (the rank still
// takes part in the collective transfer).
std::pair<H5Id, H5Id> shard_spaces(const TensorShard& s, bool active) {
  size_t nd = s.global_shape.size();
  std::vector<hsize_t> dims(s.global_shape.begin(), s.global_shape.end());
  H5Id fspace(nd == 0 ? H5_CHECK(H5Screate(H5S_SCALAR))
                      : H5_CHECK(H5Screate_simple(static_cast<int>(nd), dims.data(), nullptr)));
  hsize_t n = static_cast<hsize_t>(s.elements());
  if (active && n > 0) {
    if (nd > 0) {
      std::vector<hsize_t> off(s.offset.begin(), s.offset.end()), cnt(s.count.begin(), s.count.end());
      if (strided(s)) {
        std::vector<hsize_t> str(s.stride.begin(), s.stride.end()), blk(s.block.begin(), s.block.end());
        H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, off.data(), str.data(), cnt.data(), blk.data()));
      } else {
        H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, off.data(), nullptr, cnt.data(), nullptr));
      }
    }
    // the shard's buffer is row-major over the selection (HDF5 walks a strided hyperslab in
    // file order), so a flat memory space of the same size maps one to one
    H5Id mspace(H5_CHECK(H5Screate_simple(1, &n, nullptr)));
    return {std::move(fspace), std::move(mspace)};
  }
  H5_CHECK(H5Sselect_none(fspace));
  hsize_t one = 1;
  H5Id mspace(H5_CHECK(H5Screate_simple(1, &one, nullptr)));
  H5_CHECK(H5Sselect_none(mspace));
  return {std::move(fspace), std::move(mspace)};
}


// ---- integrity: one checksum per dataset
// checksum = sum over elements i (global row-major index) of mix64(i * golden ^ bits(x_i)),
// modulo 2^64: order-independent, so every rank hashes the elements it writes (or reads) and
// one all-reduce makes the dataset's value, whatever the sharding. bits is the element's raw
// IEEE pattern (uint32 for the fp32 tensors, uint64 for the fp64 state). tools/ reproduces it
// in numpy (tools/checkpoint_hash.py).
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
inline uint64_t element_hash(uint64_t i, uint64_t bits) { return mix64(i * kGolden ^ bits); }

// Calls f(k, i) for the shard's k-th element in selection order with its global flat index i.
template <class F>
void for_each_global_index(const TensorShard& s, F&& f) {
  const size_t nd = s.global_shape.size();
  if (nd == 0) {
    f(0, 0);
    return;
  }
  std::vector<std::vector<int64_t>> coords(nd);
  for (size_t d = 0; d < nd; ++d) {
    const int64_t blk = strided(s) ? s.block[d] : 1, str = strided(s) ? s.stride[d] : 1;
    for (int64_t c = 0; c < s.count[d]; ++c)
      for (int64_t b = 0; b < blk; ++b)
        coords[d].push_back(strided(s) ? s.offset[d] + c * str + b : s.offset[d] + c);
  }
  for (const auto& c : coords)
    if (c.empty()) return;
  std::vector<size_t> pos(nd, 0);
  const size_t inner = coords[nd - 1].size();
  for (size_t k = 0;;) {
    int64_t base = 0;
    for (size_t d = 0; d + 1 < nd; ++d) base = base * s.global_shape[d] + coords[d][pos[d]];
    base *= s.global_shape[nd - 1];
    for (size_t j = 0; j < inner; ++j, ++k) f(k, static_cast<uint64_t>(base + coords[nd - 1][j]));
    size_t d = nd - 1;
    while (d-- > 0) {
      if (++pos[d] < coords[d].size()) break;
      pos[d] = 0;
    }
    if (d == static_cast<size_t>(-1)) return;
  }
}

uint64_t shard_hash(const TensorShard& s) {
  uint64_t h = 0;
  for_each_global_index(s, [&](size_t k, uint64_t i) {
    uint32_t bits;
    std::memcpy(&bits, s.data + k, 4);
    h += element_hash(i, bits);
  });
  return h;
}

uint64_t values_hash(const std::vector<double>& v) {
  uint64_t h = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    uint64_t bits;
    std::memcpy(&bits, &v[i], 8);
    h += element_hash(i, bits);
  }
  return h;
}

void write_attr_u64(hid_t obj, const char* name, uint64_t v) {
  H5Id space(H5_CHECK(H5Screate(H5S_SCALAR)));
  H5Id attr(H5_CHECK(H5Acreate2(obj, name, H5T_STD_U64LE, space, H5P_DEFAULT, H5P_DEFAULT)));
  H5_CHECK(H5Awrite(attr, H5T_NATIVE_UINT64, &v));
}

bool read_attr_u64(hid_t obj, const char* name, uint64_t* v) {
  if (H5Aexists(obj, name) <= 0) return false;
  H5Id attr(H5Aopen(obj, name, H5P_DEFAULT));
  return attr.valid() && H5Aread(attr, H5T_NATIVE_UINT64, v) >= 0;
}

// The first failure among the ranks (a message naming file and dataset), the same on every
// rank, or "". Called by all ranks of comm after each step of a read that can fail on one
// rank only (a damaged block, a short read): no rank goes on to a collective call the others
// skip.
std::string first_failure(MPI_Comm comm, bool ok, std::string msg) {
  return agree_error(comm, ok, &msg) ? msg : std::string();
}

// Every dataset of the file (model, optim, state), in name order; false if the file's links
// cannot be walked (damaged metadata). Metadata is read collectively (rank 0 reads and
// broadcasts), but the verdict is agreed anyway.
bool all_datasets(hid_t file, std::vector<std::string>* names) {
  auto visit = [](hid_t g, const char* name, const H5L_info_t* info, void* op) -> herr_t {
    if (info->type != H5L_TYPE_HARD) return 0;
    H5Id obj(H5Oopen(g, name, H5P_DEFAULT));
    if (obj.valid() && H5Iget_type(obj) == H5I_DATASET)
      static_cast<std::vector<std::string>*>(op)->push_back(name);
    return 0;
  };
  io_detail::H5ErrorSilencer quiet;
  names->clear();
  return H5Lvisit(file, H5_INDEX_NAME, H5_ITER_INC, visit, names) >= 0;
}

// Called by all ranks of comm. Recomputes the checksum of each named dataset of `file` (each
// rank reading an even block of its rows) and compares it with the stored attribute; returns
// "" or a message naming the first dataset that fails, the same on every rank. One extra read
// of the data: the price of refusing a corrupted file before any of it is used. Nothing here
// aborts: a file damaged anywhere is an answer, not a crash.
std::string verify_datasets(MPI_Comm comm, hid_t file, const std::string& what,
                            const std::vector<std::string>& names) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  H5Id dxpl = io_detail::collective_dxpl();
  io_detail::H5ErrorSilencer quiet;
  std::vector<uint64_t> got(names.size(), 0), want(names.size(), 0);
  for (size_t n = 0; n < names.size(); ++n) {
    WatchdogWait w("the collective HDF5 read of a checkpoint tensor (its checksum)");
    const std::string ds = what + ": dataset '/" + names[n] + "'";
    // metadata: the dataset, its checksum, shape and type
    H5Id d(H5Dopen2(file, names[n].c_str(), H5P_DEFAULT));
    bool ok = d.valid();
    std::string msg = ds + " cannot be opened (damaged metadata?)";
    if (ok && !read_attr_u64(d, "checksum", &want[n])) {
      ok = false;
      msg = ds + " has no checksum (not a vitgrid checkpoint?)";
    }
    std::vector<hsize_t> dims;
    bool f64 = false;
    if (ok) {
      H5Id space(H5Dget_space(d));
      H5Id type(H5Dget_type(d));
      const int nd = space.valid() ? H5Sget_simple_extent_ndims(space) : -1;
      if (nd < 0 || !type.valid() || H5Tget_class(type) != H5T_FLOAT) {
        ok = false;
        msg = ds + " is not a floating-point dataset";
      } else {
        dims.resize(nd);
        if (nd > 0) H5Sget_simple_extent_dims(space, dims.data(), nullptr);
        f64 = H5Tget_size(type) == 8;
      }
    }
    if (std::string bad = first_failure(comm, ok, msg); !bad.empty()) return bad;
    TensorShard s;
    s.global_shape.assign(dims.begin(), dims.end());
    s.offset.assign(dims.size(), 0);
    s.count.assign(dims.begin(), dims.end());
    if (!dims.empty()) {
      s.offset[0] = static_cast<int64_t>(dims[0]) * rank / size;
      s.count[0] = static_cast<int64_t>(dims[0]) * (rank + 1) / size - s.offset[0];
    }
    int64_t total = 1;
    for (hsize_t x : dims) total *= static_cast<int64_t>(x);
    if (total == 0) continue;  // an empty dataset has no storage to read; its checksum is 0
    // data: this rank's rows (a collective read every rank makes)
    const int64_t ne = s.elements();
    auto spaces = shard_spaces(s, ne > 0);
    if (f64) {
      std::vector<double> buf(std::max<int64_t>(ne, 1));
      ok = H5Dread(d, H5T_NATIVE_DOUBLE, spaces.second, spaces.first, dxpl, buf.data()) >= 0;
      if (ok && ne > 0)
        for_each_global_index(s, [&](size_t k, uint64_t i) {
          uint64_t bits;
          std::memcpy(&bits, &buf[k], 8);
          got[n] += element_hash(i, bits);
        });
    } else {
      std::vector<float> buf(std::max<int64_t>(ne, 1));
      ok = H5Dread(d, H5T_NATIVE_FLOAT, spaces.second, spaces.first, dxpl, buf.data()) >= 0;
      s.data = buf.data();
      if (ok && ne > 0) got[n] = shard_hash(s);
    }
    if (std::string bad = first_failure(comm, ok, ds + " cannot be read (truncated or damaged)");
        !bad.empty())
      return bad;
  }
  if (!got.empty())
    watched("an MPI all-reduce of the checkpoint I/O", [&] {
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, got.data(), static_cast<int>(got.size()), MPI_UINT64_T,
                              MPI_SUM, comm));
    });
  for (size_t n = 0; n < names.size(); ++n) {
    if (got[n] != want[n]) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%016llx, stored %016llx", static_cast<unsigned long long>(got[n]),
                    static_cast<unsigned long long>(want[n]));
      return what + ": dataset '/" + names[n] + "' fails its checksum (computed " + buf + "): corrupted";
    }
  }
  return "";
}

}  // namespace ckpt_detail

using namespace ckpt_detail;

std::string step_file_name(int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "step_%08" PRId64 ".h5", step);
  return buf;
}

namespace {
// direct_io: bytes reserved past the datasets for the metadata written after them (checksum
// attributes, the state, the deck)
constexpr off_t kMetadataMargin = off_t(64) << 10;

// Allocates each [offset, offset + bytes) of the file, its size unchanged (the gaps that
// alignment leaves stay holes): 0, or the errno of a failure (ENOSPC, EDQUOT, EIO). A file
// system without fallocate is left as it is (0).
int reserve_space(const std::string& path, const std::vector<std::pair<off_t, off_t>>& extents) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  int err = 0;
  for (const auto& e : extents) {
    if (e.second <= 0) continue;
    int r;
    while ((r = ::fallocate(fd, FALLOC_FL_KEEP_SIZE, e.first, e.second)) != 0 && errno == EINTR) {
    }
    if (r == 0) continue;
    if (errno != EOPNOTSUPP && errno != ENOSYS && errno != EINVAL) err = errno;
    break;
  }
  ::close(fd);
  return err;
}

// Threads that hash one rank's tensors: the node's cores over its ranks, 1 to 8. Called by all
// ranks of comm (the ranks sharing a node are counted).
int hash_threads(MPI_Comm comm) {
  static int cached = 0;  // the same communicator's node layout every time
  if (cached > 0) return cached;
  MPI_Comm node = MPI_COMM_NULL;
  int on_node = 1;
  if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
    MPI_Comm_size(node, &on_node);
    MPI_Comm_free(&node);
  }
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cached = std::clamp(cores / std::max(on_node, 1), 1, 8);
  return cached;
}
}  // namespace

// tests: a slow file system (a pause per tensor laid out)
void slow_file_system_hook() {
  if (vitgrid_test_hooks.checkpoint_tensor_delay_ms > 0)
    std::this_thread::sleep_for(
        std::chrono::milliseconds(vitgrid_test_hooks.checkpoint_tensor_delay_ms));
}

// A tensor's creation properties: contiguous (chunk empty) or in chunks of that shape; allocated
// at creation, never filled (every element is written once right after).
H5Id data_dcpl(const std::vector<int64_t>& chunk) {
  H5Id dcpl(H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)));
  if (chunk.empty()) {
    H5_CHECK(H5Pset_layout(dcpl, H5D_CONTIGUOUS));
  } else {
    std::vector<hsize_t> c(chunk.begin(), chunk.end());
    H5_CHECK(H5Pset_chunk(dcpl, static_cast<int>(c.size()), c.data()));
  }
  H5_CHECK(H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY));
  H5_CHECK(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
  return dcpl;
}

// The checksum of every tensor, the same on every rank: each rank hashes what it writes, its
// tensors spread over a few threads (the node's cores per rank, at most 8: a rank's share of a
// large model is tens of GB); one all-reduce sums them. Called by all ranks of comm.
std::vector<uint64_t> checksums(MPI_Comm comm, const std::vector<TensorShard>& shards) {
  std::vector<uint64_t> sums(shards.size(), 0);
  std::atomic<size_t> next{0};
  auto hash_some = [&] {
    for (size_t i; (i = next.fetch_add(1)) < shards.size();)
      if (shards[i].write && shards[i].elements() > 0) sums[i] = shard_hash(shards[i]);
  };
  std::vector<std::thread> pool;
  const int threads = hash_threads(comm);
  for (int k = 1; k < threads; ++k) pool.emplace_back(hash_some);
  hash_some();
  for (auto& th : pool) th.join();
  if (!sums.empty())
    watched("an MPI all-reduce of the checkpoint I/O", [&] {
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, sums.data(), static_cast<int>(sums.size()),
                              MPI_UINT64_T, MPI_SUM, comm));
    });
  return sums;
}

// The small state: compact datasets (the values live in the object header, metadata), the same
// values from every rank that writes them; `after(stage)` runs after each creation and write
// (the collective file's agreement points).
template <class After>
void write_state(hid_t file, hid_t lcpl, hid_t dxpl, const CheckpointMeta& meta, After after) {
  H5Id compact(H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)));
  H5_CHECK(H5Pset_layout(compact, H5D_COMPACT));
  for (const auto& kv : meta.state) {
    hsize_t n = kv.second.size();
    // an object header holds at most 64 KiB: the state is scalars and short vectors
    VG_CHECK(n * sizeof(double) <= 16384,
             "checkpoint state '" << kv.first << "' has " << n
                                  << " values; large ones belong in tensors");
    H5Id fspace(H5_CHECK(H5Screate_simple(1, &n, nullptr)));
    H5Id dset(H5_CHECK(H5Dcreate2(file, ("state/" + kv.first).c_str(), H5T_IEEE_F64LE, fspace,
                                  lcpl, compact, H5P_DEFAULT)));
    write_attr_u64(dset, "checksum", values_hash(kv.second));
    after("creating the state");
    if (n == 0) continue;
    H5_CHECK(H5Dwrite(dset, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, dxpl, kv.second.data()));
    after("writing the state");
  }
}

// The root attributes but `complete`.
void write_root_attributes(hid_t file, const CheckpointMeta& meta, int world_size) {
  io_detail::write_attr_string(file, "deck", meta.deck);
  io_detail::write_attr_ints(file, "grid", meta.grid);
  // the communicator that wrote the file is the run's world (every rank holds a shard)
  io_detail::write_attr_int(file, "world_size", world_size);
  io_detail::write_attr_string(file, "tensor_mode", meta.tensor_mode);
  io_detail::write_attr_string(file, "backend", meta.backend);
  io_detail::write_attr_string(file, "version", kVersion);
}

// direct_io, rank 0 alone, serial HDF5 (the same alignment as the collective files): creates
// the file with every tensor's dataset (contiguous or in `chunks`, allocated, never filled),
// the state and the root attributes but `complete`. Returns the open file (invalid after a
// failure, recorded in the caller's SoftFailures scope), the tensors' datasets in `dsets`, per
// tensor its number of file offsets then the offsets (the dataset's, or each chunk's in
// row-major chunk order) in `addrs`, and the bytes each offset starts in `extents`.
H5Id lay_out_serial(const std::string& path, const std::vector<TensorShard>& shards,
                    const std::vector<std::vector<int64_t>>& chunks, const CheckpointMeta& meta,
                    int world_size, hid_t lcpl, const io_detail::SoftFailures& soft,
                    std::vector<H5Id>* dsets, std::vector<uint64_t>* addrs,
                    std::vector<std::pair<off_t, off_t>>* extents) {
  H5Id fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)));
  H5_CHECK(H5Pset_alignment(fapl, 64 * 1024, 1024 * 1024));
  // A .tmp left by a killed run is removed, not truncated: a rank of that run still alive
  // holds HDF5's lock on it and writes into the old file, not this one.
  std::remove(path.c_str());
  H5Id file(H5_CHECK(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl)));
  if (!file.valid()) return file;
  for (const char* g : {"model", "optim", "state"}) {
    H5Id group(H5_CHECK(H5Gcreate2(file, g, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)));
  }
  H5Id contiguous = data_dcpl({});
  for (size_t si = 0; si < shards.size() && !soft.failed(); ++si) {
    const TensorShard& s = shards[si];
    const std::vector<int64_t>& chunk = chunks[si];
    slow_file_system_hook();
    auto spaces = shard_spaces(s, false);
    H5Id dcpl = chunk.empty() ? H5Id() : data_dcpl(chunk);
    dsets->emplace_back(H5_CHECK(H5Dcreate2(file, s.name.c_str(), H5T_IEEE_F32LE, spaces.first,
                                            lcpl, chunk.empty() ? hid_t(contiguous) : hid_t(dcpl),
                                            H5P_DEFAULT)));
    if (!dsets->back().valid()) break;
    int64_t n = 1;
    for (int64_t e : s.global_shape) n *= e;
    if (n == 0) {
      addrs->push_back(0);
      continue;
    }
    if (chunk.empty()) {
      const haddr_t at = H5Dget_offset(dsets->back());
      VG_CHECK(at != HADDR_UNDEF, "dataset '" << s.name << "' has no storage");
      addrs->push_back(1);
      addrs->push_back(at);
      extents->push_back({static_cast<off_t>(at), static_cast<off_t>(n * sizeof(float))});
      continue;
    }
    // each chunk's address, row-major over the chunk grid
    const size_t r = chunk.size();
    std::vector<int64_t> grid(r);
    uint64_t total = 1;
    int64_t bytes = sizeof(float);
    for (size_t d = 0; d < r; ++d) {
      total *= grid[d] = s.global_shape[d] / chunk[d];
      bytes *= chunk[d];
    }
    addrs->push_back(total);
    std::vector<hsize_t> at(r, 0);
    for (uint64_t c = 0; c < total; ++c) {
      for (size_t d = r, rest = c; d-- > 0; rest /= grid[d]) at[d] = (rest % grid[d]) * chunk[d];
      haddr_t addr = HADDR_UNDEF;
      unsigned mask = 0;
      hsize_t bytes = 0;
      H5_CHECK(H5Dget_chunk_info_by_coord(dsets->back(), at.data(), &mask, &addr, &bytes));
      VG_CHECK(soft.failed() || addr != HADDR_UNDEF,
               "dataset '" << s.name << "': a chunk has no storage");
      addrs->push_back(addr);
      extents->push_back({static_cast<off_t>(addr), static_cast<off_t>(bytes)});
    }
  }
  write_state(file, lcpl, H5P_DEFAULT, meta, [](const char*) {});
  write_root_attributes(file, meta, world_size);
  return file;
}

// Called by all ranks of comm.
std::string write_checkpoint(MPI_Comm comm, const std::string& dir, int64_t step,
                             const std::vector<TensorShard>& shards, const CheckpointMeta& meta,
                             int keep, int direct_threads, CheckpointWriteTimes* times) {
  CheckpointWriteTimes t;
  double t0 = MPI_Wtime();
  auto lap = [&t0](double* into) {
    const double now = MPI_Wtime();
    *into += now - t0;
    t0 = now;
  };
  // Held for the whole write, collectives included: the data loader's thread on this rank
  // waits, but it never takes part in these collectives, so no rank can deadlock on it.
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  for (const auto& s : shards) check_shard_bounds(s);
  io_detail::check_same_on_all_ranks(comm, shard_signature(shards), "checkpoint tensor names/shapes");
  io_detail::check_same_on_all_ranks(comm, meta_signature(meta), "checkpoint metadata");

  const std::string final_path = join_path(dir, step_file_name(step));
  const std::string tmp = final_path + ".tmp";
  io_detail::make_dirs(comm, dir, final_path);
  {
    // something else under the final name (a directory): the rename at the end would fail
    int blocked = 0;
    std::error_code ec;
    if (rank == 0 && std::filesystem::exists(std::filesystem::symlink_status(final_path, ec)) &&
        !std::filesystem::is_regular_file(final_path, ec))
      blocked = 1;
    watched("an MPI broadcast of the checkpoint I/O",
            [&] { MPI_CHECK(MPI_Bcast(&blocked, 1, MPI_INT, 0, comm)); });
    if (blocked)
      throw UserError("checkpoint '" + final_path +
                      "' cannot be written: that name is taken by "
                      "something that is not a checkpoint file; move it away");
  }

  // A write can fail on some ranks only (a full disk, a quota, an I/O error: MPI-IO's
  // aggregators see it, the other ranks do not). The ranks agree after each collective step;
  // on a failure they stop together, the partial file is removed (its space freed first, so
  // that the close can finish) and every checkpoint written before stays as it was.
  io_detail::SoftFailures soft(dir);
  H5Id file;
  // direct_io: this rank's tensor bytes, written by threads from when the file is laid out
  std::unique_ptr<DirectWriter> writer;
  // direct_io: every tensor's bytes written past HDF5 (DirectWriter) into a file rank 0 lays
  // out; else HDF5's collective writes into a file all ranks create
  const bool direct = direct_threads > 0 && !shards.empty();
  struct Failed {
    std::string why;
  };
  auto agreed = [&](const char* stage) {
    const std::string why = soft.agree(comm);
    if (!why.empty()) throw Failed{why + ", " + stage};
  };
  try {
    // names like "optim/blocks.0.attn.qkv.weight/exp_avg" create their parent groups
    H5Id lcpl(H5_CHECK(H5Pcreate(H5P_LINK_CREATE)));
    H5_CHECK(H5Pset_create_intermediate_group(lcpl, 1));
    if (direct) {
      // Rank 0 lays the file out alone with serial HDF5 (hundreds of datasets in milliseconds,
      // where collective creation agrees on each), everything but the checksums and
      // `complete`; every rank then writes its parts at the offsets rank 0 sends.
      const std::vector<std::vector<int64_t>> chunks = agree_chunk_shapes(comm, shards);
      std::vector<uint64_t> addrs;  // per tensor: its count of offsets, then the offsets
      std::vector<H5Id> dsets;      // rank 0: open until their checksums are attached
      std::vector<std::pair<off_t, off_t>> extents;  // rank 0: the data's bytes in the file
      if (rank == 0)
        file = lay_out_serial(tmp, shards, chunks, meta, size, lcpl, soft, &dsets, &addrs,
                              &extents);
      agreed("laying it out");
      if (rank == 0) {
        // The file's space is reserved first (the data and a margin for the metadata still
        // to come): the direct writes beside rank 0's metadata writes can then not fill the
        // disk under them, and a disk too full fails here, cleanly.
        off_t end = 0;
        for (const auto& e : extents) end = std::max(end, e.first + e.second);
        extents.push_back({end, kMetadataMargin});
        const int err = reserve_space(tmp, extents);
        if (err != 0) soft.fail(err, "reserving the file's space (fallocate)");
      }
      agreed("reserving its space");
      uint64_t count = addrs.size();
      watched("an MPI broadcast of the checkpoint I/O", [&] {
        MPI_CHECK(MPI_Bcast(&count, 1, MPI_UINT64_T, 0, comm));
        addrs.resize(count);
        MPI_CHECK(MPI_Bcast(addrs.data(), static_cast<int>(count), MPI_UINT64_T, 0, comm));
      });
      std::vector<FileRange> ranges;
      for (size_t k = 0, si = 0; si < shards.size(); ++si) {
        const TensorShard& s = shards[si];
        VG_CHECK(!(s.write && s.elements() > 0) || s.data, "shard '" << s.name << "' has no data");
        const uint64_t n = addrs.at(k);
        direct_ranges(s, chunks[si], std::vector<uint64_t>(addrs.begin() + k + 1,
                                                           addrs.begin() + k + 1 + n),
                      &ranges);
        k += 1 + n;
      }
      // The bulk data goes to its place beside what follows (the checksums, the metadata); no
      // HDF5 write touches those ranges.
      if (!ranges.empty())
        writer = std::make_unique<DirectWriter>(tmp, std::move(ranges), direct_threads);
      lap(&t.hdf5);
      const std::vector<uint64_t> sums = checksums(comm, shards);
      lap(&t.hash);
      if (rank == 0) {
        for (size_t si = 0; si < shards.size(); ++si) write_attr_u64(dsets[si], "checksum", sums[si]);
        dsets.clear();
        // Written last; the file gets its final name only once the data is in, below.
        io_detail::write_attr_int(file, "complete", 1);
        file.reset();
      }
      agreed("writing its metadata");
    } else {
      file = io_detail::create_parallel(comm, tmp);
      io_detail::throw_if_any_failed(comm, file.valid(),
                                     "checkpoint '" + tmp + "': cannot create the file");
      H5Id dxpl = io_detail::collective_dxpl();
      // Contiguous storage: a later read of any hyperslab maps straight onto file offsets. Fill
      // values are never written, since every element is written once right after creation.
      H5Id dcpl = data_dcpl({});
      for (const char* g : {"model", "optim", "state"}) {
        H5Id group(H5_CHECK(H5Gcreate2(file, g, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)));
      }
      agreed("creating its groups");

      std::vector<H5Id> dsets;  // open until their checksums are attached
      dsets.reserve(shards.size());
      float dummy = 0.0f;
      for (size_t si = 0; si < shards.size(); ++si) {
        const TensorShard& s = shards[si];
        slow_file_system_hook();
        WatchdogWait w("the collective HDF5 write of a checkpoint tensor");
        auto spaces = shard_spaces(s, s.write);
        dsets.emplace_back(H5_CHECK(H5Dcreate2(file, s.name.c_str(), H5T_IEEE_F32LE,
                                               spaces.first, lcpl, dcpl, H5P_DEFAULT)));
        agreed("creating a dataset");
        VG_CHECK(!(s.write && s.elements() > 0) || s.data, "shard '" << s.name << "' has no data");
        const bool mine = s.write && s.elements() > 0;
        H5_CHECK(H5Dwrite(dsets.back(), H5T_NATIVE_FLOAT, spaces.second, spaces.first, dxpl,
                          mine ? s.data : &dummy));
        agreed("writing a tensor");
      }
      lap(&t.hdf5);
      const std::vector<uint64_t> sums = checksums(comm, shards);
      lap(&t.hash);
      for (size_t si = 0; si < shards.size(); ++si) write_attr_u64(dsets[si], "checksum", sums[si]);
      dsets.clear();
      agreed("writing the checksums");
      write_state(file, lcpl, dxpl, meta, [&](const char* stage) { agreed(stage); });
      write_root_attributes(file, meta, size);
      // Written last. The metadata cache may still reorder what reaches the disk before the
      // close, which is why the file only gets its final name after the close below.
      io_detail::write_attr_int(file, "complete", 1);
      agreed("writing its attributes");
      {
        // HDF5 1.10's collective flush can leave the ranks in different barriers when one of
        // them meets an I/O error (a disk filled by another job mid-write): the watchdog ends it
        WatchdogWait w("the collective HDF5 flush of a checkpoint");
        H5_CHECK(H5Fflush(file, H5F_SCOPE_GLOBAL));
      }
      agreed("flushing it");
    }
  } catch (const Failed& f) {
    // every object of the file is closed by now (the unwinding), the direct writes are stopped;
    // the file's space is freed before its collective close, whose own failure no longer matters
    writer.reset();
    if (rank == 0 && ::truncate(tmp.c_str(), 0) != 0) { /* removed below either way */
    }
    watched("an MPI barrier of the checkpoint I/O", [&] { MPI_CHECK(MPI_Barrier(comm)); });
    file.reset();
    soft.agree(comm);
    if (rank == 0) std::remove(tmp.c_str());
    watched("an MPI barrier of the checkpoint I/O", [&] { MPI_CHECK(MPI_Barrier(comm)); });
    throw UserError("checkpoint '" + final_path + "' could not be written (" + f.why +
                    "); the partial file was removed and earlier checkpoints are kept");
  }
  // collective close: every rank's data and the metadata are in the file once it returns
  {
    WatchdogWait w("the collective HDF5 close of a checkpoint");
    file.reset();
  }
  if (const std::string why = soft.agree(comm); !why.empty()) {
    writer.reset();
    if (rank == 0) std::remove(tmp.c_str());
    watched("an MPI barrier of the checkpoint I/O", [&] { MPI_CHECK(MPI_Barrier(comm)); });
    throw UserError("checkpoint '" + final_path + "' could not be written (" + why +
                    ", closing it); the partial file was removed and earlier checkpoints are kept");
  }

  lap(&t.hdf5);
  if (direct) {
    // the bulk data's writers, joined once HDF5 has closed the file; fsynced by each rank
    const std::string err = writer ? writer->finish() : std::string();
    if (const std::string bad = first_failure(comm, err.empty(), err); !bad.empty()) {
      if (rank == 0) std::remove(tmp.c_str());
      watched("an MPI barrier of the checkpoint I/O", [&] { MPI_CHECK(MPI_Barrier(comm)); });
      throw UserError("checkpoint '" + final_path + "' could not be written (" + bad +
                      "); the partial file was removed and earlier checkpoints are kept");
    }
  }
  lap(&t.direct);
  io_detail::publish_file(comm, tmp, final_path);

  if (keep > 0) {
    if (rank == 0) {
      // The file just written is never pruned, even when newer complete steps sit beside it
      // (a run restarted from an older checkpoint): it is the one this run resumes from.
      std::vector<std::string> complete;
      for (auto& f : list_step_files(dir))
        if (f.second != final_path && io_detail::hdf5_metadata_problem_isolated(f.second).empty() &&
            is_complete_serial(f.second))
          complete.push_back(f.second);
      for (size_t i = static_cast<size_t>(keep) - 1; i < complete.size(); ++i) {
        std::error_code ec;
        std::filesystem::remove(complete[i], ec);
        if (ec)
          std::fprintf(stderr, "vitgrid: warning: cannot remove old checkpoint '%s': %s\n",
                       complete[i].c_str(), ec.message().c_str());
      }
    }
    watched("an MPI barrier of the checkpoint I/O", [&] {
      MPI_CHECK(MPI_Barrier(comm));
    });  // nobody lists the directory while rank 0 prunes it
  }
  lap(&t.publish);
  if (times) *times = t;
  return final_path;
}

}  // namespace vitgrid
