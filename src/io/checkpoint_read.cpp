// Collective checkpoint files, the read side: reading a checkpoint into any layout's shards,
// verifying every dataset's checksum, and finding the newest usable checkpoint of a run
// (checkpoint.cpp writes them).
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include "checkpoint_internal.h"
#include "h5_parallel.h"
#include "vitgrid/core/rng.h"
#include "vitgrid/core/watchdog.h"
#include "vitgrid/io/checkpoint.h"

namespace vitgrid {

using io_detail::H5Id;
using namespace ckpt_detail;

namespace {

// Called by all ranks of comm. Opens `path` for a collective read; a missing, non-HDF5,
// unreadable or incomplete file gives an invalid handle and *err, the same on every rank.
H5Id open_complete_checkpoint(MPI_Comm comm, const std::string& path, const std::string& what,
                              std::string* err) {
  std::string why;
  switch (io_detail::probe_file(comm, path, &why)) {
    case io_detail::FileProbe::missing:
      *err = what + ": no such file";
      return H5Id();
    case io_detail::FileProbe::not_hdf5:
      *err = what + " is not an HDF5 file";
      return H5Id();
    case io_detail::FileProbe::damaged:
      *err = what + " is damaged: " + why;
      return H5Id();
    case io_detail::FileProbe::ok: break;
  }
  H5Id file = io_detail::open_parallel(comm, path, false);
  // Metadata is read collectively (rank 0 reads, broadcasts), so every rank sees the same
  // answers below; agreeing anyway costs one all-reduce and rules out a hang.
  *err =
      first_failure(comm, file.valid(), what + " cannot be opened as HDF5 (truncated or corrupt?)");
  if (!err->empty()) return H5Id();
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
  *err = first_failure(comm, ok, msg);
  return err->empty() ? std::move(file) : H5Id();
}

// Called by all ranks of comm: every dataset of the file, the same list on every rank, or *err.
std::vector<std::string> agreed_datasets(MPI_Comm comm, hid_t file, const std::string& what,
                                         std::string* err) {
  std::vector<std::string> names;
  bool ok = all_datasets(file, &names);
  *err = first_failure(comm, ok, what + ": its datasets cannot be listed (damaged metadata)");
  if (!err->empty()) return {};
  uint64_t h = 1469598103934665603ull;
  for (const auto& n : names) h = io_detail::fnv1a(h, n.data(), n.size() + 1);
  uint64_t lo = 0, hi = 0;
  watched("an MPI all-reduce of the checkpoint I/O",
          [&] { MPI_CHECK(MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, comm)); });
  watched("an MPI all-reduce of the checkpoint I/O",
          [&] { MPI_CHECK(MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, comm)); });
  if (lo != hi) *err = what + ": its ranks read different dataset lists (damaged metadata)";
  return names;
}

// Called by all ranks of comm: the whole read of read_checkpoint (checks, integrity of every
// dataset, the shards' hyperslabs, the metadata), returning "" or what is wrong, the same on
// every rank. The caller's buffers are written only once every check has passed.
std::string try_read_checkpoint(MPI_Comm comm, const std::string& path,
                                std::vector<TensorShard>& shards, CheckpointMeta* meta) {
  const std::string what = "checkpoint '" + path + "'";
  std::string err;
  H5Id file = open_complete_checkpoint(comm, path, what, &err);
  if (!err.empty()) return err;

  // Every tensor this run needs, at its shape, before any data is read.
  std::vector<H5Id> dsets;
  {
    bool ok = true;
    std::string msg;
    io_detail::H5ErrorSilencer quiet;
    for (auto& s : shards) {
      const std::string ds = "/" + s.name;
      s.found = io_detail::path_exists(file, s.name);
      if (!s.found && s.optional) {
        dsets.emplace_back();  // (not read)
        continue;
      }
      if (!s.found) {
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
      H5Id space(H5Dget_space(d));
      const int nd = space.valid() ? H5Sget_simple_extent_ndims(space) : -1;
      if (!type.valid() || H5Tget_class(type) != H5T_FLOAT || nd < 0) {
        ok = false;
        msg = what + ": dataset '" + ds + "' is not floating point";
        break;
      }
      std::vector<hsize_t> dims(nd);
      if (nd > 0) H5Sget_simple_extent_dims(space, dims.data(), nullptr);
      if (dims != std::vector<hsize_t>(s.global_shape.begin(), s.global_shape.end())) {
        ok = false;
        msg = what + ": dataset '" + ds + "' has shape " + io_detail::shape_str(dims) +
              ", expected " + io_detail::shape_str(s.global_shape);
        break;
      }
      dsets.push_back(std::move(d));
    }
    err = first_failure(comm, ok, msg);
    if (!err.empty()) return err;
  }

  // Integrity before use: every dataset of the file against its checksum, not only the ones
  // read (a checkpoint that fails anywhere is not one to continue from).
  const std::vector<std::string> names = agreed_datasets(comm, file, what, &err);
  if (!err.empty()) return err;
  err = verify_datasets(comm, file, what, names);
  if (!err.empty()) return err;

  H5Id dxpl = io_detail::collective_dxpl();
  io_detail::H5ErrorSilencer quiet;
  float dummy = 0.0f;
  for (size_t i = 0; i < shards.size(); ++i) {
    WatchdogWait w("the collective HDF5 read of a checkpoint tensor");
    auto& s = shards[i];
    if (!s.found) continue;  // an optional tensor the file lacks (the same on every rank)
    bool active = s.elements() > 0;
    VG_CHECK(!active || s.data, "shard '" << s.name << "' has no buffer");
    auto spaces = shard_spaces(s, active);
    const bool ok = H5Dread(dsets[i], H5T_NATIVE_FLOAT, spaces.second, spaces.first, dxpl,
                            active ? s.data : &dummy) >= 0;
    err = first_failure(comm, ok, what + ": dataset '/" + s.name + "' cannot be read");
    if (!err.empty()) return err;
  }
  dsets.clear();

  if (!meta) return "";
  io_detail::read_attr_string(file, "deck", &meta->deck);
  io_detail::read_attr_ints(file, "grid", &meta->grid);
  io_detail::read_attr_string(file, "tensor_mode", &meta->tensor_mode);
  io_detail::read_attr_string(file, "backend", &meta->backend);
  std::vector<int> ws;
  if (io_detail::read_attr_ints(file, "world_size", &ws) && ws.size() == 1) meta->world_size = ws[0];

  // /state/<name>: every dataset below the group (names may contain '/'), read in full by
  // every rank, in the verified list's (name) order.
  meta->state.clear();
  double ddummy = 0.0;
  for (const auto& full : names) {
    if (full.rfind("state/", 0) != 0) continue;
    H5Id d(H5Dopen2(file, full.c_str(), H5P_DEFAULT));
    H5Id space(d.valid() ? H5Dget_space(d) : -1);
    const hssize_t count = space.valid() ? H5Sget_simple_extent_npoints(space) : -1;
    std::vector<double> v(static_cast<size_t>(std::max<hssize_t>(count, 0)));
    bool ok = count >= 0;
    if (ok && count > 0)
      ok = H5Dread(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, dxpl, v.data()) >= 0;
    else if (ok)
      ok = H5Dread(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, dxpl, &ddummy) >= 0 || count == 0;
    err = first_failure(comm, ok, what + ": dataset '/" + full + "' cannot be read");
    if (!err.empty()) return err;
    meta->state[full.substr(6)] = std::move(v);
  }
  return "";
}

// A checkpoint file found in a run's directory.
struct StepFile {
  int64_t step;
  std::string path;
  bool regular;
};

}  // namespace

// Called by all ranks of comm.
void read_checkpoint(MPI_Comm comm, const std::string& path, std::vector<TensorShard>& shards,
                     CheckpointMeta* meta) {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  for (const auto& s : shards) check_shard_bounds(s);
  io_detail::check_same_on_all_ranks(comm, shard_signature(shards),
                                     "checkpoint tensor names/shapes");
  const std::string bad = try_read_checkpoint(comm, path, shards, meta);
  if (!bad.empty()) throw UserError(bad);  // the same verdict on every rank
}

// Called by all ranks of comm.
void verify_checkpoint(MPI_Comm comm, const std::string& path) {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  const std::string what = "checkpoint '" + path + "'";
  std::string err;
  H5Id file = open_complete_checkpoint(comm, path, what, &err);
  if (err.empty()) {
    const std::vector<std::string> names = agreed_datasets(comm, file, what, &err);
    if (err.empty()) err = verify_datasets(comm, file, what, names);
  }
  if (!err.empty()) throw UserError(err);
}

// Called by all ranks of comm.
std::string resume_checkpoint(MPI_Comm comm, const std::string& dir,
                              std::vector<TensorShard>& shards, CheckpointMeta* meta) {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  for (const auto& s : shards) check_shard_bounds(s);
  io_detail::check_same_on_all_ranks(comm, shard_signature(shards),
                                     "checkpoint tensor names/shapes");
  auto warn = [&](const std::string& m) {
    if (rank != 0) return;
    std::fprintf(stderr, "vitgrid: warning: checkpoint.resume = auto: %s\n", m.c_str());
    std::fflush(stderr);
  };

  // Rank 0 lists the directory: every entry named like a checkpoint, newest first, and the
  // unfinished writes beside them; the others get the list.
  std::string listing;  // "<r|n><step> <path>\n" per entry; "!<message>" for a refusal
  if (rank == 0) {
    std::error_code ec;
    const std::filesystem::file_status st = std::filesystem::status(dir, ec);
    if (std::filesystem::exists(st) && !std::filesystem::is_directory(st)) {
      listing = "!checkpoint directory '" + dir + "' exists and is not a directory";
    } else {
      std::vector<StepFile> found;
      std::filesystem::directory_iterator it(dir, ec), end;
      for (; !ec && it != end; it.increment(ec)) {
        const std::string name = it->path().filename().string();
        int64_t step = 0;
        std::error_code e2;
        if (parse_step_file_name(name, &step))
          found.push_back({step, join_path(dir, name), it->is_regular_file(e2)});
        else if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0 &&
                 parse_step_file_name(name.substr(0, name.size() - 4), &step))
          warn("ignoring '" + join_path(dir, name) + "', a write that never finished");
      }
      std::sort(found.begin(), found.end(),
                [](const StepFile& a, const StepFile& b) { return a.step > b.step; });
      for (const auto& f : found)
        listing +=
            std::string(f.regular ? "r" : "n") + std::to_string(f.step) + " " + f.path + "\n";
    }
  }
  int len = static_cast<int>(listing.size());
  watched("an MPI broadcast of the checkpoint I/O",
          [&] { MPI_CHECK(MPI_Bcast(&len, 1, MPI_INT, 0, comm)); });
  listing.resize(len);
  if (len > 0)
    watched("an MPI broadcast of the checkpoint I/O",
            [&] { MPI_CHECK(MPI_Bcast(&listing[0], len, MPI_CHAR, 0, comm)); });
  if (!listing.empty() && listing[0] == '!') throw UserError(listing.substr(1));
  std::vector<StepFile> files;
  for (size_t a = 0, b; (b = listing.find('\n', a)) != std::string::npos; a = b + 1) {
    const std::string line = listing.substr(a, b - a);
    const size_t sp = line.find(' ');
    files.push_back({std::stoll(line.substr(1, sp - 1)), line.substr(sp + 1), line[0] == 'r'});
  }

  // Newest first, the first that reads whole and fits this model; every one passed over is
  // named with the reason.
  std::vector<std::pair<std::string, std::string>> rejected;  // path, reason
  std::string chosen;
  for (const StepFile& f : files) {
    std::string bad = f.regular ? try_read_checkpoint(comm, f.path, shards, meta)
                                : "checkpoint '" + f.path + "' is not a regular file";
    if (bad.empty()) {
      chosen = f.path;
      break;
    }
    warn(bad + "; trying an older checkpoint");
    rejected.emplace_back(f.path, bad);
  }
  if (chosen.empty()) {
    if (files.empty()) return "";
    // Starting over would write these names again: never replace a checkpoint that may hold
    // the only copy of the run's work.
    std::string msg = "none of the " + std::to_string(files.size()) + " checkpoint file(s) in '" +
                      dir + "' can be resumed from (";
    for (size_t i = 0; i < rejected.size(); ++i) msg += (i ? "; " : "") + rejected[i].second;
    msg +=
        "); starting over would overwrite them: move them away (or give checkpoint.load = "
        "PATH to start from one of them) and run again";
    throw UserError("checkpoint.resume = auto: " + msg);
  }
  // The rejected ones are newer than the one resumed from: this run writes their steps
  // again, so they are kept aside under another name instead.
  if (rank == 0)
    for (const auto& r : rejected) {
      std::error_code ec;
      std::filesystem::rename(r.first, r.first + ".rejected", ec);
      if (ec)
        warn("cannot rename '" + r.first + "' to '" + r.first + ".rejected': " + ec.message() +
             "; this run will write over it");
      else
        warn("kept '" + r.first + "' as '" + r.first +
             ".rejected' (this run writes that step again)");
    }
  watched("an MPI barrier of the checkpoint I/O", [&] { MPI_CHECK(MPI_Barrier(comm)); });
  return chosen;
}

}  // namespace vitgrid
