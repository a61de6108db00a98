// metrics.h5's file work, done by rank 0 alone (see metrics.cpp): reserving the blocks a write
// needs, creating, opening and continuing the file (older layouts included), widening the
// per-rank tables and appending the rows.
#include "vitgrid/io/metrics.h"
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include "h5_parallel.h"
#include "vitgrid/core/test_hooks.h"
#include "vitgrid/core/watchdog.h"
#include "metrics_internal.h"

namespace vitgrid {
namespace metrics_detail {

// The fixed-length string type of /segments/tensor_mode (h5py reads it as bytes, S16).
H5Id mode_type() {
  H5Id t(H5_CHECK(H5Tcopy(H5T_C_S1)));
  H5_CHECK(H5Tset_size(t, kModeBytes));
  H5_CHECK(H5Tset_strpad(t, H5T_STR_NULLPAD));
  return t;
}

bool columns_extendible(hid_t dset) {
  H5Id space(H5_CHECK(H5Dget_space(dset)));
  hsize_t dims[2], maxd[2];
  if (H5_CHECK(H5Sget_simple_extent_ndims(space)) != 2) return false;
  H5_CHECK(H5Sget_simple_extent_dims(space, dims, maxd));
  return maxd[1] == H5S_UNLIMITED;
}

// Bytes the file may grow by when `dset` (chunked) takes the extent `to` and its new cells are
// written: the chunks that appear, each allocated whole when first written, and their index
// entries.
hsize_t chunk_growth(hid_t dset, const std::vector<hsize_t>& to) {
  const std::vector<hsize_t> from = io_detail::dataset_dims(dset);
  H5Id dcpl(H5_CHECK(H5Dget_create_plist(dset)));
  H5Id type(H5_CHECK(H5Dget_type(dset)));
  hsize_t chunk[2] = {1, 1};
  const int nd = std::min(H5_CHECK(H5Pget_chunk(dcpl, 2, chunk)), 2);
  if (nd < 1 || static_cast<size_t>(nd) != to.size() || from.size() != to.size()) return 0;
  auto chunks = [&](const std::vector<hsize_t>& d) {
    hsize_t c = 1;
    for (int k = 0; k < nd; ++k) c *= (d[k] + chunk[k] - 1) / std::max<hsize_t>(chunk[k], 1);
    return c;
  };
  const hsize_t a = chunks(from), b = chunks(to);
  if (b <= a) return 0;
  hsize_t bytes = H5Tget_size(type);
  for (int k = 0; k < nd; ++k) bytes *= chunk[k];
  return (b - a) * (bytes + kPerChunkIndex);
}

// Rank 0's file access: the serial (sec2) driver, without file locks (HDF5 1.10 would hold an
// exclusive lock while the file is open, and readers such as h5py open it mid-run).
H5Id writer_fapl() {
  H5Id fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)));
  H5_CHECK(H5Pset_file_locking(fapl, false, true));
  return fapl;
}

}  // namespace metrics_detail

void MetricsWriter::Impl::reserve(hsize_t bytes) {
  // test hook (test_hooks.h): skip the reservation, so that the write itself meets the full
  // disk (what a file system that cannot reserve, or a copy-on-write one, may still do)
  if (vitgrid_test_hooks.metrics_no_reserve) return;
  bytes += kHeadroom;
  int err = 0;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0) {
    err = errno;
  } else {
    const off_t end = st.st_size + static_cast<off_t>(bytes);
    // released after the write, whatever a failing fallocate left allocated beyond the end
    reserved_end = std::max<hsize_t>(reserved_end, static_cast<hsize_t>(end));
    if (fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, end) != 0) {
      err = errno;
      // a file system that cannot reserve: the free space decides
      if (err == EOPNOTSUPP || err == ENOSYS || err == EINVAL) {
        ::close(fd);
        check_free(bytes - kHeadroom);
        return;
      }
    }
  }
  if (fd >= 0) ::close(fd);
  if (err != 0) {
    soft->fail(err, "reserving room for the write");
    throw Stopped{};
  }
}

void MetricsWriter::Impl::check_free(hsize_t bytes) {
  struct statvfs v {};
  if (statvfs(dir.c_str(), &v) == 0 &&
      double(v.f_bavail) * double(v.f_frsize) < double(bytes + kHeadroom)) {
    soft->fail(ENOSPC, "checking the free space before writing");
    throw Stopped{};
  }
}

void MetricsWriter::Impl::release_reservation() {
  if (reserved_end == 0) return;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  struct stat st {};
  // past the reserved end by a block or more: a block the range ends inside is not freed
  if (fd >= 0 && fstat(fd, &st) == 0 && static_cast<hsize_t>(st.st_size) < reserved_end)
    (void)fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, st.st_size,
                    static_cast<off_t>(reserved_end) - st.st_size + (1 << 20));
  if (fd >= 0) ::close(fd);
  reserved_end = 0;
}

bool MetricsWriter::Impl::close_file(bool detach) {
  if (!file.valid()) return true;
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  io_detail::H5ErrorSilencer quiet;
  if (detach) {
    H5Id fapl(H5Fget_access_plist(file));
    void* handle = nullptr;
    const int mem = memfd_create("vitgrid-metrics-discard", MFD_CLOEXEC);
    if (fapl.valid() && H5Pget_driver(fapl) == H5FD_SEC2 && mem >= 0 &&
        H5Fget_vfd_handle(file, H5P_DEFAULT, &handle) >= 0 && handle &&
        dup2(mem, *static_cast<int*>(handle)) >= 0) {
      // the first flush fails on the state the failed one left, and mends it
      H5Fflush(file, H5F_SCOPE_LOCAL);
      H5Fflush(file, H5F_SCOPE_LOCAL);
    }
    if (mem >= 0) ::close(mem);
  }
  bool ok = true;
  auto close_all = [&](H5Id* ids, size_t n) {
    for (size_t i = 0; i < n; ++i)
      if (ids[i].valid()) ok = H5Dclose(ids[i].release()) >= 0 && ok;
  };
  close_all(train, kNumTrain);
  close_all(eval, kNumEval);
  close_all(seg, kNumSeg);
  ok = H5Fclose(file.release()) >= 0 && ok;
  release_reservation();
  return ok;
}

void MetricsWriter::Impl::settle(const std::string& err) {
  std::string msg = err;
  if (!agree_error(comm, err.empty(), &msg)) return;
  failed = true;
  failure = msg;
  throw UserError(msg);
}

H5Id MetricsWriter::Impl::make(const char* p, hid_t type, bool two_d, hsize_t cols,
                               bool cols_unlimited, hsize_t chunk_rows) {
  H5Id lcpl(H5_CHECK(H5Pcreate(H5P_LINK_CREATE)));
  H5_CHECK(H5Pset_create_intermediate_group(lcpl, 1));
  const int nd = two_d ? 2 : 1;
  hsize_t dims[2] = {0, cols};
  hsize_t maxd[2] = {H5S_UNLIMITED, cols_unlimited ? H5S_UNLIMITED : cols};
  hsize_t chunk[2] = {chunk_rows, std::max<hsize_t>(cols, 1)};
  H5Id space(H5_CHECK(H5Screate_simple(nd, dims, maxd)));
  H5Id dcpl(H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)));
  H5_CHECK(H5Pset_chunk(dcpl, nd, chunk));
  // every cell is written (columns beyond a run's ranks with NaN), so no fill values
  H5_CHECK(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
  return H5Id(H5_CHECK(H5Dcreate2(file, p, type, space, lcpl, dcpl, H5P_DEFAULT)));
}

void MetricsWriter::Impl::create_datasets() {
  // Small chunks: 1024 rows is ~150 flushes' worth, and a per-rank table's chunk stays at
  // 4096 cells (32 KiB) whatever the world size.
  const hsize_t rows_1d = 1024;
  const hsize_t rows_2d = std::max<hsize_t>(1, 4096 / static_cast<hsize_t>(world));
  for (size_t i = 0; i < kNumTrain; ++i)
    train[i] =
        make(kTrain[i].path, kTrain[i].is_int ? H5T_STD_I64LE : H5T_IEEE_F64LE, kTrain[i].per_rank,
             static_cast<hsize_t>(world), true, kTrain[i].per_rank ? rows_2d : rows_1d);
  for (size_t i = 0; i < kNumEval; ++i)
    eval[i] = make(kEval[i].path, kEval[i].is_int ? H5T_STD_I64LE : H5T_IEEE_F64LE, false, 0, false,
                   rows_1d);
  width = static_cast<hsize_t>(world);
}

void MetricsWriter::Impl::create_segments() {
  H5Id mt = mode_type();
  seg[kSegFirstStep] = make(kSegPath[kSegFirstStep], H5T_STD_I64LE, false, 0, false, 64);
  seg[kSegWorld] = make(kSegPath[kSegWorld], H5T_STD_I64LE, false, 0, false, 64);
  seg[kSegGrid] = make(kSegPath[kSegGrid], H5T_STD_I64LE, true, 3, false, 64);
  seg[kSegMode] = make(kSegPath[kSegMode], mt, false, 0, false, 64);
}

std::vector<int64_t> MetricsWriter::Impl::read_ints(hid_t dset) {
  std::vector<hsize_t> dims = io_detail::dataset_dims(dset);
  size_t n = 1;
  for (hsize_t d : dims) n *= d;
  std::vector<int64_t> v(n);
  int64_t dummy = 0;
  H5_CHECK(H5Dread(dset, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, n ? v.data() : &dummy));
  return v;
}

// A per-rank table made with a fixed column count (a file from before the segments table):
// copied into an extendible one under the same name, so that a run on more ranks can widen
// it. The tables are small (8 bytes per rank and step).
H5Id MetricsWriter::Impl::extendible_copy(H5Id old, const char* p) {
  const std::vector<hsize_t> dims = io_detail::dataset_dims(old);
  std::vector<double> v(dims[0] * dims[1]);
  double dummy = 0;
  H5_CHECK(H5Dread(old, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                   v.empty() ? &dummy : v.data()));
  old.reset();
  stop_if_failed();
  const std::string tmp = std::string(p) + ".extendible";
  H5Id d =
      make(tmp.c_str(), H5T_IEEE_F64LE, true, dims[1], true, std::max<hsize_t>(1, 4096 / dims[1]));
  H5_CHECK(H5Dset_extent(d, dims.data()));
  write_block(d, H5T_NATIVE_DOUBLE, 0, dims[0], 0, dims[1], v.empty() ? &dummy : v.data());
  H5_CHECK(H5Ldelete(file, p, H5P_DEFAULT));
  H5_CHECK(H5Lmove(file, tmp.c_str(), file, p, H5P_DEFAULT, H5P_DEFAULT));
  stop_if_failed();
  return d;
}

void MetricsWriter::Impl::open_datasets() {
  // every dataset must be there, extendible, 2-D where per-rank
  auto open = [&](const Column& c, H5Id* out) {
    if (!io_detail::path_exists(file, c.path))
      throw Refused{"metrics file '" + path + "': dataset '/" + c.path +
                    "' is missing; cannot append"};
    io_detail::H5ErrorSilencer quiet;
    H5Id d(H5Dopen2(file, c.path, H5P_DEFAULT));
    std::vector<hsize_t> dims = d.valid() ? io_detail::dataset_dims(d) : std::vector<hsize_t>();
    size_t nd = c.per_rank ? 2 : 1;
    if (!d.valid() || dims.size() != nd || (c.per_rank && dims[1] == 0))
      throw Refused{"metrics file '" + path + "': dataset '/" + c.path + "' has shape " +
                    io_detail::shape_str(dims) + ", not one this run can append to"};
    *out = std::move(d);
  };
  // Columns newer than the file (written by an older vitgrid) are added, NaN in its rows.
  std::vector<size_t> added;
  for (size_t i = 0; i < kNumTrain; ++i) {
    if (i >= kFirstAddedTrain && !io_detail::path_exists(file, kTrain[i].path)) {
      added.push_back(i);
      continue;
    }
    open(kTrain[i], &train[i]);
  }
  for (size_t i = 0; i < kNumEval; ++i) open(kEval[i], &eval[i]);
  for (size_t i = 0; i < kNumTrain; ++i) {
    if (!kTrain[i].per_rank || !train[i].valid()) continue;
    width = io_detail::dataset_dims(train[i])[1];
    fixed_width = fixed_width || !columns_extendible(train[i]);
  }
  const hsize_t rows = io_detail::dataset_dims(train[0])[0];
  for (size_t i : added) {
    const hsize_t w = kTrain[i].per_rank ? width : 1;
    train[i] = make(kTrain[i].path, H5T_IEEE_F64LE, kTrain[i].per_rank, w, true,
                    std::max<hsize_t>(1, 4096 / std::max<hsize_t>(w, 1)));
    const hsize_t dims[2] = {rows, w};
    H5_CHECK(H5Dset_extent(train[i], dims));
    if (rows > 0) {
      std::vector<double> nan(rows * w, NAN);
      write_block(train[i], H5T_NATIVE_DOUBLE, 0, rows, 0, w, nan.data());
    }
  }
  stop_if_failed();
}

void MetricsWriter::Impl::open_segments() {
  has_segments = io_detail::path_exists(file, "segments");
  if (has_segments) {
    hsize_t n = 0;
    for (size_t i = 0; i < kNumSeg; ++i) {
      io_detail::H5ErrorSilencer quiet;
      H5Id d(io_detail::path_exists(file, kSegPath[i]) ? H5Dopen2(file, kSegPath[i], H5P_DEFAULT)
                                                       : -1);
      std::vector<hsize_t> dims = d.valid() ? io_detail::dataset_dims(d) : std::vector<hsize_t>();
      if (i == 0 && !dims.empty()) n = dims[0];
      const bool good = i == kSegGrid ? dims.size() == 2 && dims[1] == 3 : dims.size() == 1;
      if (!d.valid() || !good || dims[0] != n)
        throw Refused{
            "metrics file '" + path + "': dataset '/" + kSegPath[i] + "' is " +
            (d.valid() ? "of shape " + io_detail::shape_str(dims) : std::string("missing")) +
            ", not one this run can append to"};
      seg[i] = std::move(d);
    }
    seg_world = read_ints(seg[kSegWorld]);
    stop_if_failed();
    return;
  }
  // A file without segments (an older vitgrid's) was written by one layout, which its root
  // attributes name: that becomes its first segment (continue_old_layout), as wide as its
  // per-rank tables (their writer made them world_size wide).
  const bool ok = io_detail::read_attr_ints(file, "grid", &old_grid) && old_grid.size() == 3 &&
                  io_detail::read_attr_string(file, "tensor_mode", &old_mode);
  if (!ok)
    throw Refused{"metrics file '" + path +
                  "' has neither /segments nor the root attributes grid and tensor_mode; cannot "
                  "append"};
  old_world = static_cast<int>(width);
}

void MetricsWriter::Impl::set_rows(hid_t dset, hsize_t rows) {
  std::vector<hsize_t> dims = io_detail::dataset_dims(dset);
  dims[0] = rows;
  H5_CHECK(H5Dset_extent(dset, dims.data()));
}

// Rows logged after the checkpoint we resume from were recomputed by this run: cut them so the
// file holds each step once. Steps only grow within a file, so the rows to keep are a prefix:
// up to the first step beyond resume_step. So are the segments, by their first step: one that
// began after resume_step has no row left.
hsize_t MetricsWriter::Impl::kept_rows(hid_t step_dset, int64_t resume_step) {
  const std::vector<int64_t> steps = read_ints(step_dset);
  auto it = std::find_if(steps.begin(), steps.end(), [&](int64_t s) { return s > resume_step; });
  return static_cast<hsize_t>(it - steps.begin());
}

void MetricsWriter::Impl::truncate_to(hsize_t train_keep, hsize_t eval_keep, hsize_t seg_keep) {
  train_rows = train_keep;
  eval_rows = eval_keep;
  for (auto& d : train) set_rows(d, train_rows);
  for (auto& d : eval) set_rows(d, eval_rows);
  if (has_segments) {
    seg_world.resize(seg_keep);
    for (auto& d : seg) set_rows(d, seg_keep);
  } else if (train_rows > 0) {
    seg_world = {old_world};  // the old layout's rows are kept (continue_old_layout)
  }
  stop_if_failed();
}

// A file without segments, after its rows were cut: fixed-width per-rank tables made
// extendible, and the segments table made, its first row the old layout's (if rows of it
// are left).
void MetricsWriter::Impl::continue_old_layout() {
  if (fixed_width)
    for (size_t i = 0; i < kNumTrain; ++i)
      if (kTrain[i].per_rank) train[i] = extendible_copy(std::move(train[i]), kTrain[i].path);
  if (has_segments) return;
  create_segments();
  stop_if_failed();
  if (train_rows > 0) {
    seg_world.clear();
    add_segment(read_ints(train[0]).at(0), old_world, old_grid, old_mode);
  }
}

void MetricsWriter::Impl::add_segment(int64_t first_step, int64_t world_size,
                                      const std::vector<int>& grid, const std::string& mode) {
  const hsize_t n = seg_world.size();
  const int64_t g[3] = {grid.at(0), grid.at(1), grid.at(2)};
  char m[kModeBytes] = {0};
  std::memcpy(m, mode.data(), std::min<size_t>(mode.size(), kModeBytes));
  H5Id mt = mode_type();
  for (auto& d : seg) set_rows(d, n + 1);
  write_block(seg[kSegFirstStep], H5T_NATIVE_INT64, n, 1, 0, 0, &first_step);
  write_block(seg[kSegWorld], H5T_NATIVE_INT64, n, 1, 0, 0, &world_size);
  write_block(seg[kSegGrid], H5T_NATIVE_INT64, n, 1, 0, 3, g);
  write_block(seg[kSegMode], mt, n, 1, 0, 0, m);
  stop_if_failed();
  seg_world.push_back(world_size);
}

void MetricsWriter::Impl::set_width(hsize_t w) {
  for (size_t i = 0; i < kNumTrain; ++i) {
    if (!kTrain[i].per_rank) continue;
    hsize_t dims[2] = {train_rows, w};
    H5_CHECK(H5Dset_extent(train[i], dims));
    if (w > width && train_rows > 0) {
      // the earlier segments had no rank in the new columns
      std::vector<double> nan(train_rows * (w - width), NAN);
      write_block(train[i], H5T_NATIVE_DOUBLE, 0, train_rows, width, w - width, nan.data());
    }
    stop_if_failed();
  }
  width = w;
}

void MetricsWriter::Impl::write_root_attributes(const std::string& deck,
                                                const std::vector<int>& grid,
                                                const std::string& tensor_mode,
                                                const std::string& backend) {
  io_detail::write_attr_string(file, "deck", deck);
  io_detail::write_attr_int(file, "world_size", world);
  io_detail::write_attr_ints(file, "grid", grid);
  io_detail::write_attr_string(file, "tensor_mode", tensor_mode);
  io_detail::write_attr_string(file, "backend", backend);
  io_detail::write_attr_string(file, "version", kVersion);
  stop_if_failed();
}

void MetricsWriter::Impl::write_block(hid_t dset, hid_t memtype, hsize_t row0, hsize_t n,
                                      hsize_t col0, hsize_t cols, const void* buf) {
  H5Id fspace(H5_CHECK(H5Dget_space(dset)));
  const bool two_d = H5_CHECK(H5Sget_simple_extent_ndims(fspace)) == 2;
  const hsize_t count = n * (two_d ? cols : 1);
  if (count == 0) return;
  H5Id mspace(H5_CHECK(H5Screate_simple(1, &count, nullptr)));
  const hsize_t off[2] = {row0, col0}, cnt[2] = {n, cols};
  H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, off, nullptr, cnt, nullptr));
  H5_CHECK(H5Dwrite(dset, memtype, mspace, fspace, H5P_DEFAULT, buf));
}

void MetricsWriter::Impl::append(hid_t dset, const Column& c, hsize_t old_rows, hsize_t n,
                                 const void* buf) {
  set_rows(dset, old_rows + n);
  write_block(dset, c.is_int ? H5T_NATIVE_INT64 : H5T_NATIVE_DOUBLE, old_rows, n, 0, 0, buf);
  stop_if_failed();
}

void MetricsWriter::Impl::write_rows(const std::vector<double>& per_rank) {
  const hsize_t nt = train_buf.size(), ne = eval_buf.size();
  // what the new rows may add to the file
  hsize_t need = 0;
  for (size_t i = 0; i < kNumTrain; ++i)
    need += chunk_growth(train[i], kTrain[i].per_rank ? std::vector<hsize_t>{train_rows + nt, width}
                                                      : std::vector<hsize_t>{train_rows + nt});
  for (size_t i = 0; i < kNumEval; ++i) need += chunk_growth(eval[i], {eval_rows + ne});
  stop_if_failed();
  reserve(need);

  if (nt > 0) {
    std::vector<int64_t> step(nt);
    std::vector<double> col(nt);
    for (hsize_t i = 0; i < nt; ++i) step[i] = train_buf[i].step;
    append(train[0], kTrain[0], train_rows, nt, step.data());
    double TrainRow::*fields[] = {&TrainRow::loss, &TrainRow::lr, &TrainRow::grad_norm,
                                  &TrainRow::images_per_s, &TrainRow::loss_scale};
    for (size_t f = 0; f < 5; ++f) {
      for (hsize_t i = 0; i < nt; ++i) col[i] = train_buf[i].*fields[f];
      append(train[f + 1], kTrain[f + 1], train_rows, nt, col.data());
    }
    // The per-rank tables: rank r's values (gathered) in column r, NaN in the columns beyond
    // this run's ranks (an earlier segment had more).
    const hsize_t w = static_cast<hsize_t>(world);
    std::vector<double> block(nt * width);
    for (size_t t = 0; t < kNumPerRank; ++t) {
      for (hsize_t i = 0; i < nt; ++i)
        for (hsize_t r = 0; r < width; ++r)
          block[i * width + r] = r < w ? per_rank[r * kNumPerRank * nt + t * nt + i] : NAN;
      const size_t k = kPerRank[t];
      hsize_t dims[2] = {train_rows + nt, width};
      H5_CHECK(H5Dset_extent(train[k], dims));
      write_block(train[k], H5T_NATIVE_DOUBLE, train_rows, nt, 0, width, block.data());
      stop_if_failed();
    }
    train_rows += nt;
  }
  if (ne > 0) {
    std::vector<int64_t> step(ne);
    std::vector<double> col(ne);
    for (hsize_t i = 0; i < ne; ++i) step[i] = eval_buf[i].step;
    append(eval[0], kEval[0], eval_rows, ne, step.data());
    double EvalRow::*fields[] = {&EvalRow::loss, &EvalRow::top1, &EvalRow::top5};
    for (size_t f = 0; f < 3; ++f) {
      for (hsize_t i = 0; i < ne; ++i) col[i] = eval_buf[i].*fields[f];
      append(eval[f + 1], kEval[f + 1], eval_rows, ne, col.data());
    }
    eval_rows += ne;
  }
  // Push data and metadata to the file so a reader opening it now sees a consistent file.
  H5_CHECK(H5Fflush(file, H5F_SCOPE_GLOBAL));
}

// Called by all ranks of comm: rank 0 opens or creates the file and writes this run's segment;
// the others only take part in the agreements.
}  // namespace vitgrid
