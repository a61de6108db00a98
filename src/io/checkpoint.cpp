// Collective checkpoint files (DESIGN.md "Files other tools read"): every tensor is stored once
// with its global shape, each rank writing / reading its own hyperslab, so a checkpoint written
// on one process grid loads on any other.
#include "vitgrid/io/checkpoint.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <system_error>
#include <utility>

#include "h5_parallel.h"

namespace vitgrid {

using io_detail::H5Id;

namespace {

constexpr const char* kVersion = "0.1.0";

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string step_file_name(int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "step_%08" PRId64 ".h5", step);
  return buf;
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

// Rank 0 only (serial sec2 driver): is `path` an HDF5 file whose root says complete = 1?
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

int64_t shard_elements(const TensorShard& s) {
  int64_t n = 1;
  for (size_t d = 0; d < s.count.size(); ++d) n *= s.count[d] * (strided(s) ? s.block[d] : 1);
  return n;
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
  hsize_t n = static_cast<hsize_t>(shard_elements(s));
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

}  // namespace

// Called by all ranks of comm.
std::string write_checkpoint(MPI_Comm comm, const std::string& dir, int64_t step,
                             const std::vector<TensorShard>& shards, const CheckpointMeta& meta,
                             int keep) {
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
    H5Id file = io_detail::create_parallel(comm, tmp);
    io_detail::throw_if_any_failed(comm, file.valid(),
                                   "checkpoint '" + tmp + "': cannot create the file");
    H5Id dxpl = io_detail::collective_dxpl();
    // names like "optim/blocks.0.attn.qkv.weight/exp_avg" create their parent groups
    H5Id lcpl(H5_CHECK(H5Pcreate(H5P_LINK_CREATE)));
    H5_CHECK(H5Pset_create_intermediate_group(lcpl, 1));
    // Contiguous storage: a later read of any hyperslab maps straight onto file offsets. Fill
    // values are never written, since every element is written once right after creation.
    H5Id dcpl(H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)));
    H5_CHECK(H5Pset_layout(dcpl, H5D_CONTIGUOUS));
    H5_CHECK(H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY));
    H5_CHECK(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));

    for (const char* g : {"model", "optim", "state"}) {
      H5Id group(H5_CHECK(H5Gcreate2(file, g, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)));
    }

    float dummy = 0.0f;
    for (const auto& s : shards) {
      auto spaces = shard_spaces(s, s.write);
      H5Id dset(H5_CHECK(H5Dcreate2(file, s.name.c_str(), H5T_IEEE_F32LE, spaces.first, lcpl,
                                    dcpl, H5P_DEFAULT)));
      VG_CHECK(!(s.write && shard_elements(s) > 0) || s.data, "shard '" << s.name << "' has no data");
      const float* buf = (s.write && shard_elements(s) > 0) ? s.data : &dummy;
      H5_CHECK(H5Dwrite(dset, H5T_NATIVE_FLOAT, spaces.second, spaces.first, dxpl, buf));
    }

    // small state: rank 0 writes, the others select nothing (values are the same everywhere)
    double ddummy = 0.0;
    for (const auto& kv : meta.state) {
      hsize_t n = kv.second.size();
      H5Id fspace(H5_CHECK(H5Screate_simple(1, &n, nullptr)));
      H5Id dset(H5_CHECK(H5Dcreate2(file, ("state/" + kv.first).c_str(), H5T_IEEE_F64LE, fspace,
                                    lcpl, dcpl, H5P_DEFAULT)));
      if (n == 0) continue;
      H5Id mspace(H5_CHECK(H5Screate_simple(1, &n, nullptr)));
      if (rank != 0) {
        H5_CHECK(H5Sselect_none(fspace));
        H5_CHECK(H5Sselect_none(mspace));
      }
      H5_CHECK(H5Dwrite(dset, H5T_NATIVE_DOUBLE, mspace, fspace, dxpl,
                        rank == 0 ? kv.second.data() : &ddummy));
    }

    io_detail::write_attr_string(file, "deck", meta.deck);
    io_detail::write_attr_ints(file, "grid", meta.grid);
    // the communicator that wrote the file is the run's world (every rank holds a shard)
    io_detail::write_attr_int(file, "world_size", size);
    io_detail::write_attr_string(file, "tensor_mode", meta.tensor_mode);
    io_detail::write_attr_string(file, "backend", meta.backend);
    io_detail::write_attr_string(file, "version", kVersion);
    // Written last. The metadata cache may still reorder what reaches the disk before the
    // close, which is why the file only gets its final name after the close below.
    io_detail::write_attr_int(file, "complete", 1);
  }  // collective close: every rank's data is in the file once this returns

  io_detail::publish_file(comm, tmp, final_path);

  if (keep > 0) {
    if (rank == 0) {
      // The file just written is never pruned, even when newer complete steps sit beside it
      // (a run restarted from an older checkpoint): it is the one this run resumes from.
      std::vector<std::string> complete;
      for (auto& f : list_step_files(dir))
        if (f.second != final_path && is_complete_serial(f.second)) complete.push_back(f.second);
      for (size_t i = static_cast<size_t>(keep) - 1; i < complete.size(); ++i) {
        std::error_code ec;
        std::filesystem::remove(complete[i], ec);
        if (ec)
          std::fprintf(stderr, "vitgrid: warning: cannot remove old checkpoint '%s': %s\n",
                       complete[i].c_str(), ec.message().c_str());
      }
    }
    MPI_CHECK(MPI_Barrier(comm));  // nobody lists the directory while rank 0 prunes it
  }
  return final_path;
}

// Called by all ranks of comm.
void read_checkpoint(MPI_Comm comm, const std::string& path, std::vector<TensorShard>& shards,
                     CheckpointMeta* meta) {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  const std::string what = "checkpoint '" + path + "'";
  for (const auto& s : shards) check_shard_bounds(s);
  io_detail::check_same_on_all_ranks(comm, shard_signature(shards), "checkpoint tensor names/shapes");

  switch (io_detail::probe_file(comm, path)) {
    case io_detail::FileProbe::missing: throw UserError(what + ": no such file");
    case io_detail::FileProbe::not_hdf5: throw UserError(what + " is not an HDF5 file");
    case io_detail::FileProbe::ok: break;
  }

  H5Id file = io_detail::open_parallel(comm, path, false);
  // Metadata is read collectively (rank 0 reads, broadcasts), so every rank sees the same
  // answers below; agreeing anyway costs one all-reduce and rules out a hang.
  io_detail::throw_if_any_failed(comm, file.valid(),
                                 what + " cannot be opened as HDF5 (truncated or corrupt?)");

  {
    bool ok = true;
    std::string msg;
    io_detail::H5ErrorSilencer quiet;
    if (H5Aexists(file, "complete") <= 0) {
      ok = false;
      msg = what + " is incomplete (no 'complete' attribute)";
    } else {
      std::vector<int> c;
      if (!io_detail::read_attr_ints(file, "complete", &c) || c.size() != 1 || c[0] != 1) {
        ok = false;
        msg = what + " is incomplete ('complete' attribute is not 1)";
      }
    }
    io_detail::throw_if_any_failed(comm, ok, msg);
  }

  // Check every tensor before reading any, so a bad file fails before touching the caller's
  // buffers and without collective reads that only some ranks would reach.
  std::vector<H5Id> dsets;
  {
    bool ok = true;
    std::string msg;
    io_detail::H5ErrorSilencer quiet;
    for (const auto& s : shards) {
      const std::string ds = "/" + s.name;
      if (!io_detail::path_exists(file, s.name)) {
        ok = false;
        msg = what + ": dataset '" + ds + "' is missing";
        break;
      }
      H5Id d(H5Dopen2(file, s.name.c_str(), H5P_DEFAULT));
      if (!d.valid()) {
        ok = false;
        msg = what + ": '" + ds + "' is not a dataset";
        break;
      }
      H5Id type(H5Dget_type(d));
      if (H5Tget_class(type) != H5T_FLOAT) {
        ok = false;
        msg = what + ": dataset '" + ds + "' is not floating point";
        break;
      }
      std::vector<hsize_t> dims = io_detail::dataset_dims(d);
      if (dims != std::vector<hsize_t>(s.global_shape.begin(), s.global_shape.end())) {
        ok = false;
        msg = what + ": dataset '" + ds + "' has shape " + io_detail::shape_str(dims) +
              ", expected " + io_detail::shape_str(s.global_shape);
        break;
      }
      dsets.push_back(std::move(d));
    }
    if (!ok) dsets.clear();
    io_detail::throw_if_any_failed(comm, ok, msg);
  }

  H5Id dxpl = io_detail::collective_dxpl();
  float dummy = 0.0f;
  for (size_t i = 0; i < shards.size(); ++i) {
    auto& s = shards[i];
    bool active = shard_elements(s) > 0;
    VG_CHECK(!active || s.data, "shard '" << s.name << "' has no buffer");
    auto spaces = shard_spaces(s, active);
    H5_CHECK(H5Dread(dsets[i], H5T_NATIVE_FLOAT, spaces.second, spaces.first, dxpl,
                     active ? s.data : &dummy));
  }
  dsets.clear();

  if (!meta) return;
  io_detail::read_attr_string(file, "deck", &meta->deck);
  io_detail::read_attr_ints(file, "grid", &meta->grid);
  io_detail::read_attr_string(file, "tensor_mode", &meta->tensor_mode);
  io_detail::read_attr_string(file, "backend", &meta->backend);
  std::vector<int> ws;
  if (io_detail::read_attr_ints(file, "world_size", &ws) && ws.size() == 1) meta->world_size = ws[0];

  // /state/<name>: every dataset below the group (names may contain '/'), read in full by
  // every rank. Link iteration goes in name order, the same on every rank.
  meta->state.clear();
  if (!io_detail::path_exists(file, "state")) return;
  H5Id group(H5_CHECK(H5Gopen2(file, "state", H5P_DEFAULT)));
  std::vector<std::string> names;
  auto visit = [](hid_t g, const char* name, const H5L_info_t* info, void* op) -> herr_t {
    if (info->type != H5L_TYPE_HARD) return 0;
    H5Id obj(H5Oopen(g, name, H5P_DEFAULT));
    if (obj.valid() && H5Iget_type(obj) == H5I_DATASET)
      static_cast<std::vector<std::string>*>(op)->push_back(name);
    return 0;
  };
  H5_CHECK(H5Lvisit(group, H5_INDEX_NAME, H5_ITER_INC, visit, &names));
  double ddummy = 0.0;
  for (const auto& n : names) {
    H5Id d(H5_CHECK(H5Dopen2(group, n.c_str(), H5P_DEFAULT)));
    H5Id space(H5_CHECK(H5Dget_space(d)));
    hssize_t count = H5_CHECK(H5Sget_simple_extent_npoints(space));
    std::vector<double> v(static_cast<size_t>(count));
    if (count > 0)
      H5_CHECK(H5Dread(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, dxpl, v.empty() ? &ddummy : v.data()));
    meta->state[n] = std::move(v);
  }
}

// Called by all ranks of comm.
std::string latest_checkpoint(MPI_Comm comm, const std::string& dir) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  std::string path;
  if (rank == 0) {
    std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
    // newest first; a file without complete = 1 (a hand-made copy, another tool's partial
    // write) is skipped in favour of the next older one
    for (auto& f : list_step_files(dir)) {
      if (is_complete_serial(f.second)) {
        path = f.second;
        break;
      }
    }
  }
  int len = static_cast<int>(path.size());
  MPI_CHECK(MPI_Bcast(&len, 1, MPI_INT, 0, comm));
  path.resize(len);
  if (len > 0) MPI_CHECK(MPI_Bcast(&path[0], len, MPI_CHAR, 0, comm));
  return path;
}

}  // namespace vitgrid
