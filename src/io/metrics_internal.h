// metrics.cpp's and metrics_file.cpp's shared parts: the columns of metrics.h5, the writer's
// state (MetricsWriter::Impl) and rank 0's guarded HDF5 work. Not part of the interface
// (vitgrid/io/metrics.h).
#pragma once
#include <mpi.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "h5_parallel.h"
#include "vitgrid/io/metrics.h"

namespace vitgrid {
namespace metrics_detail {

using io_detail::H5Id;

inline constexpr const char* kVersion = "0.1.0";

// One 1-D column (same value on every rank) or one [steps, width] table (a column per rank).
struct Column {
  const char* path;
  bool per_rank;
  bool is_int;
};

inline constexpr Column kTrain[] = {
    {"train/step", false, true},          {"train/loss", false, false},
    {"train/lr", false, false},           {"train/grad_norm", false, false},
    {"train/images_per_s", false, false}, {"train/loss_scale", false, false},
    {"train/step_time_s", true, false},   {"train/device_mem_bytes", true, false},
    {"train/bad_images", true, false},    {"train/input_wait_s", true, false},
};
inline constexpr Column kEval[] = {
    {"eval/step", false, true},
    {"eval/loss", false, false},
    {"eval/top1", false, false},
    {"eval/top5", false, false},
};
inline constexpr size_t kNumTrain = sizeof(kTrain) / sizeof(kTrain[0]);
inline constexpr size_t kNumEval = sizeof(kEval) / sizeof(kEval[0]);
// the per-rank tables, in kTrain and in the values each rank sends rank 0 (in this order)
inline constexpr size_t kPerRank[] = {6, 7, 8, 9};
// kTrain[i >= kFirstAddedTrain] came after the first files were written: appending to a file
// without them adds them (NaN in the earlier rows)
inline constexpr size_t kFirstAddedTrain = 8;
inline constexpr size_t kNumPerRank = sizeof(kPerRank) / sizeof(kPerRank[0]);

// The segments table: a row per run that wrote the file (the first one and each resumed one).
enum Seg : size_t { kSegFirstStep, kSegWorld, kSegGrid, kSegMode, kNumSeg };
inline constexpr const char* kSegPath[kNumSeg] = {"segments/first_step", "segments/world_size",
                                           "segments/grid", "segments/tensor_mode"};
inline constexpr hsize_t kModeBytes = 16;  // fixed-length tensor mode names ("none", "2.5d", ...)

// Room rank 0 reserves beyond the chunks and index nodes a write adds: object headers that
// grow, a global heap collection (4 KiB), blocks HDF5's aggregators take ahead.
inline constexpr hsize_t kHeadroom = 16 * 1024;
// What a new file's groups, datasets and first segment row take (about 30 KiB).
inline constexpr hsize_t kNewFileBytes = 64 * 1024;
// A chunk's share of its dataset's chunk index: a B-tree node (2-3 KiB) when the index starts
// or splits.
inline constexpr hsize_t kPerChunkIndex = 4 * 1024;

// A refusal found by rank 0 (a dataset missing or of the wrong shape): its message, agreed
// like a failed write.
struct Refused {
  std::string msg;
};
// Rank 0 stops its work at the first failed HDF5 call (recorded by the SoftFailures scope).
struct Stopped {};

// The fixed-length string type of /segments/tensor_mode (h5py reads it as bytes, S16).
H5Id mode_type();
bool columns_extendible(hid_t dset);
// Bytes the file may grow by when `dset` (chunked) takes the extent `to` and its new cells are
// written: the chunks that appear, each allocated whole when first written, and their index
// entries.
hsize_t chunk_growth(hid_t dset, const std::vector<hsize_t>& to);
// Rank 0's file access: the serial (sec2) driver, without file locks (HDF5 1.10 would hold an
// exclusive lock while the file is open, and readers such as h5py open it mid-run).
H5Id writer_fapl();

}  // namespace metrics_detail

using namespace metrics_detail;

struct MetricsWriter::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, world = 1;
  std::string path;
  std::string dir;  // the file's directory, for the free space
  // A failure agreed by every rank: the writer writes nothing more, and its calls throw it.
  bool failed = false;
  std::string failure;
  std::vector<TrainRow> train_buf;
  std::vector<EvalRow> eval_buf;

  // ---- rank 0 only: the file and what it holds
  H5Id file;
  H5Id train[kNumTrain];
  H5Id eval[kNumEval];
  H5Id seg[kNumSeg];
  hsize_t train_rows = 0, eval_rows = 0;  // rows already in the file
  hsize_t width = 0;                      // columns of the per-rank tables
  std::vector<int64_t> seg_world;         // world size of each segment in the file
  // A file without /segments: its per-rank tables may have a fixed width (copied into
  // extendible ones), and its root attributes describe the layout of its rows.
  bool has_segments = true;
  bool fixed_width = false;
  int old_world = 0;
  std::vector<int> old_grid;
  std::string old_mode;
  io_detail::SoftFailures* soft = nullptr;  // open while rank 0 works (root_work)

  // Rank 0: runs `work` under the HDF5 lock in a SoftFailures scope; returns "" or the
  // message every rank will throw ("metrics file '...': <what> (<reason>)", or a refusal).
  // On a failure the file is closed (and removed if `work` set remove_on_failure: a file it
  // created).
  template <class F>
  std::string root_work(const char* what, F&& work);
  bool remove_on_failure = false;
  // Rank 0: the first failed HDF5 call ends the work.
  void stop_if_failed() {
    if (soft->failed()) throw Stopped{};
  }
  // Rank 0, before a write that may grow the file by `bytes`: makes sure the file system holds
  // the blocks it may need, so that no write of HDF5's meets a full disk or a quota half-way
  // (a flush that fails there leaves metadata pointing at bytes never written, and HDF5 1.10
  // cannot close the file cleanly after it). fallocate, keeping the file's size, over the
  // whole file (the holes of a file written in parallel are filled when a chunk is rewritten)
  // and `bytes` plus kHeadroom beyond its end; where the file system cannot reserve
  // (EOPNOTSUPP), its free space is checked instead (statvfs, blind to quotas). When the room
  // is not there it records ENOSPC (or EDQUOT) and stops: the file stays as the last flush
  // left it.
  void reserve(hsize_t bytes);
  // Rank 0: the free space check alone (what reserve() falls back to), for a file that does
  // not exist yet: records ENOSPC and stops when the file system has less free than `bytes`
  // plus kHeadroom.
  void check_free(hsize_t bytes);
  hsize_t reserved_end = 0;  // blocks up to here may be reserved beyond the file's end
  // Rank 0: frees the blocks reserved beyond the end of the file, once it is flushed or
  // closed.
  void release_reservation();
  // Rank 0: closes every handle of the file, reporting no error (HDF5's error stack quiet);
  // false if a close failed. Never collective. After a failure (`detach`), nothing more
  // reaches the file: HDF5's descriptor is pointed at an anonymous memory file first, and the
  // cache HDF5 1.10 leaves unflushable after a failed flush is flushed there, so that the
  // close succeeds (a failed close leaves the library to crash when it terminates).
  bool close_file(bool detach = false);
  // Called by all ranks after rank 0's work: agrees on rank 0's `err` ("" when it succeeded);
  // on a failure the writer is failed on every rank and the same UserError is thrown.
  void settle(const std::string& err);

  // An empty extendible dataset: 1-D, or 2-D with `cols` columns (more may be added when
  // cols_unlimited).
  H5Id make(const char* p, hid_t type, bool two_d, hsize_t cols, bool cols_unlimited,
            hsize_t chunk_rows);
  void create_datasets();
  void create_segments();
  void open_datasets();
  void open_segments();
  H5Id extendible_copy(H5Id old, const char* p);
  std::vector<int64_t> read_ints(hid_t dset);
  void set_rows(hid_t dset, hsize_t rows);
  // The rows (and segments) a resume after `resume_step` keeps: a prefix of each table.
  hsize_t kept_rows(hid_t step_dset, int64_t resume_step);
  void truncate_to(hsize_t train_keep, hsize_t eval_keep, hsize_t seg_keep);
  void continue_old_layout();
  void add_segment(int64_t first_step, int64_t world_size, const std::vector<int>& grid,
                   const std::string& mode);
  // Gives the per-rank tables `w` columns, NaN in the new columns of the rows already there.
  void set_width(hsize_t w);
  void write_root_attributes(const std::string& deck, const std::vector<int>& grid,
                             const std::string& tensor_mode, const std::string& backend);
  // Writes rows [row0, row0 + n) x columns [col0, col0 + cols) of `dset` (2-D; 1-D: rows
  // only) from the row-major `buf`.
  void write_block(hid_t dset, hid_t memtype, hsize_t row0, hsize_t n, hsize_t col0, hsize_t cols,
                   const void* buf);
  // Extends `dset` (1-D) by n rows and writes them.
  void append(hid_t dset, const Column& c, hsize_t old_rows, hsize_t n, const void* buf);
  // Writes the buffered rows; `per_rank`: every rank's step times then device memory
  // (rank-major, as gathered).
  void write_rows(const std::vector<double>& per_rank);
};

template <class F>
std::string MetricsWriter::Impl::root_work(const char* what, F&& work) {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  io_detail::SoftFailures scope(dir);
  soft = &scope;
  std::string err;
  try {
    work();
  } catch (const Refused& r) {
    err = r.msg;
  } catch (const Stopped&) {
  } catch (const std::exception& e) {  // agreed too: the other ranks wait in settle()
    err = "metrics file '" + path + "': " + what + " (" + e.what() + ")";
  }
  const std::string why = scope.take();
  if (err.empty() && !why.empty()) err = "metrics file '" + path + "': " + what + " (" + why + ")";
  if (!err.empty()) {
    close_file(true);
    if (remove_on_failure) std::remove(path.c_str());
  }
  release_reservation();  // held for one write only (the flush made the file's size final)
  remove_on_failure = false;
  soft = nullptr;
  return err;
}

}  // namespace vitgrid
