// metrics.h5 (layout: vitgrid/io/metrics.h): one shared file, appended collectively while the
// run goes on and flushed after every append so plotting tools (h5py) can read it mid-run.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "h5_parallel.h"
#include "vitgrid/io/metrics.h"

namespace vitgrid {

using io_detail::H5Id;

namespace {

constexpr const char* kVersion = "0.1.0";

// One 1-D column (same value on every rank) or one [steps, width] table (a column per rank).
struct Column {
  const char* path;
  bool per_rank;
  bool is_int;
};

constexpr Column kTrain[] = {
    {"train/step", false, true},          {"train/loss", false, false},
    {"train/lr", false, false},           {"train/grad_norm", false, false},
    {"train/images_per_s", false, false}, {"train/loss_scale", false, false},
    {"train/step_time_s", true, false},   {"train/device_mem_bytes", true, false},
};
constexpr Column kEval[] = {
    {"eval/step", false, true},
    {"eval/loss", false, false},
    {"eval/top1", false, false},
    {"eval/top5", false, false},
};
constexpr size_t kNumTrain = sizeof(kTrain) / sizeof(kTrain[0]);
constexpr size_t kNumEval = sizeof(kEval) / sizeof(kEval[0]);

// The segments table: a row per run that wrote the file (the first one and each resumed one).
enum Seg : size_t { kSegFirstStep, kSegWorld, kSegGrid, kSegMode, kNumSeg };
constexpr const char* kSegPath[kNumSeg] = {"segments/first_step", "segments/world_size",
                                           "segments/grid", "segments/tensor_mode"};
constexpr hsize_t kModeBytes = 16;  // fixed-length tensor mode names ("none", "2.5d", ...)

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

}  // namespace

struct MetricsWriter::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, world = 1;
  std::string path;
  H5Id file;
  H5Id dxpl;
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
  std::vector<TrainRow> train_buf;
  std::vector<EvalRow> eval_buf;

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
  void truncate_after(int64_t resume_step);
  void continue_old_layout();
  void add_segment(int64_t first_step, int64_t world_size, const std::vector<int>& grid,
                   const std::string& mode);
  // Gives the per-rank tables `w` columns, NaN in the new columns of the rows already there.
  void set_width(hsize_t w);
  void write_root_attributes(const std::string& deck, const std::vector<int>& grid,
                             const std::string& tensor_mode, const std::string& backend);
  // Writes rows [row0, row0 + n) x columns [col0, col0 + cols) of `dset` (2-D; 1-D: rows
  // only) from rank 0's row-major `buf`; collective, the other ranks select nothing.
  void write_from_root(hid_t dset, hid_t memtype, hsize_t row0, hsize_t n, hsize_t col0,
                       hsize_t cols, const void* buf);
  // Extends `dset` by n rows and writes them. 1-D: rank 0 writes (all ranks hold the same
  // values). Per-rank: each rank writes its own column of the new rows, and rank 0 fills the
  // columns beyond this run's ranks with NaN.
  void append(hid_t dset, const Column& c, hsize_t old_rows, hsize_t n, const void* buf);
};

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
  // Chunks stay under the 64 KiB alignment threshold (see parallel_fapl), so they pack
  // densely instead of each starting on a 1 MiB boundary; 1024 rows is ~150 flushes' worth.
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
  H5_CHECK(H5Dread(dset, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, dxpl, n ? v.data() : &dummy));
  return v;
}

// A per-rank table made with a fixed column count (a file from before the segments table):
// copied into an extendible one under the same name, so that a run on more ranks can widen
// it. The tables are small (8 bytes per rank and step).
H5Id MetricsWriter::Impl::extendible_copy(H5Id old, const char* p) {
  const std::vector<hsize_t> dims = io_detail::dataset_dims(old);
  std::vector<double> v(dims[0] * dims[1]);
  double dummy = 0;
  H5_CHECK(H5Dread(old, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, dxpl, v.empty() ? &dummy : v.data()));
  old.reset();
  const std::string tmp = std::string(p) + ".extendible";
  H5Id d =
      make(tmp.c_str(), H5T_IEEE_F64LE, true, dims[1], true, std::max<hsize_t>(1, 4096 / dims[1]));
  H5_CHECK(H5Dset_extent(d, dims.data()));
  write_from_root(d, H5T_NATIVE_DOUBLE, 0, dims[0], 0, dims[1], v.empty() ? &dummy : v.data());
  H5_CHECK(H5Ldelete(file, p, H5P_DEFAULT));
  H5_CHECK(H5Lmove(file, tmp.c_str(), file, p, H5P_DEFAULT, H5P_DEFAULT));
  return d;
}

void MetricsWriter::Impl::open_datasets() {
  // every dataset must be there, extendible, 2-D where per-rank
  bool ok = true;
  std::string msg;
  auto open = [&](const Column& c, H5Id* out) {
    if (!ok) return;
    if (!io_detail::path_exists(file, c.path)) {
      ok = false;
      msg = "metrics file '" + path + "': dataset '/" + c.path + "' is missing; cannot append";
      return;
    }
    io_detail::H5ErrorSilencer quiet;
    H5Id d(H5Dopen2(file, c.path, H5P_DEFAULT));
    std::vector<hsize_t> dims = d.valid() ? io_detail::dataset_dims(d) : std::vector<hsize_t>();
    size_t nd = c.per_rank ? 2 : 1;
    if (!d.valid() || dims.size() != nd || (c.per_rank && dims[1] == 0)) {
      ok = false;
      msg = "metrics file '" + path + "': dataset '/" + c.path + "' has shape " +
            io_detail::shape_str(dims) + ", not one this run can append to";
      return;
    }
    *out = std::move(d);
  };
  for (size_t i = 0; i < kNumTrain; ++i) open(kTrain[i], &train[i]);
  for (size_t i = 0; i < kNumEval; ++i) open(kEval[i], &eval[i]);
  io_detail::throw_if_any_failed(comm, ok, msg);
  for (size_t i = 0; i < kNumTrain; ++i) {
    if (!kTrain[i].per_rank) continue;
    width = io_detail::dataset_dims(train[i])[1];
    fixed_width = fixed_width || !columns_extendible(train[i]);
  }
}

void MetricsWriter::Impl::open_segments() {
  has_segments = io_detail::path_exists(file, "segments");
  if (has_segments) {
    bool ok = true;
    std::string msg;
    hsize_t n = 0;
    for (size_t i = 0; i < kNumSeg && ok; ++i) {
      io_detail::H5ErrorSilencer quiet;
      H5Id d(io_detail::path_exists(file, kSegPath[i]) ? H5Dopen2(file, kSegPath[i], H5P_DEFAULT)
                                                       : -1);
      std::vector<hsize_t> dims = d.valid() ? io_detail::dataset_dims(d) : std::vector<hsize_t>();
      if (i == 0 && !dims.empty()) n = dims[0];
      const bool good = i == kSegGrid ? dims.size() == 2 && dims[1] == 3 : dims.size() == 1;
      if (!d.valid() || !good || dims[0] != n) {
        ok = false;
        msg = "metrics file '" + path + "': dataset '/" + kSegPath[i] + "' is " +
              (d.valid() ? "of shape " + io_detail::shape_str(dims) : std::string("missing")) +
              ", not one this run can append to";
      } else {
        seg[i] = std::move(d);
      }
    }
    io_detail::throw_if_any_failed(comm, ok, msg);
    seg_world = read_ints(seg[kSegWorld]);
    return;
  }
  // A file without segments (an older vitgrid's) was written by one layout, which its root
  // attributes name: that becomes its first segment (continue_old_layout), as wide as its
  // per-rank tables (their writer made them world_size wide).
  const bool ok = io_detail::read_attr_ints(file, "grid", &old_grid) && old_grid.size() == 3 &&
                  io_detail::read_attr_string(file, "tensor_mode", &old_mode);
  io_detail::throw_if_any_failed(
      comm, ok,
      "metrics file '" + path +
          "' has neither /segments nor the root attributes grid and tensor_mode; cannot append");
  old_world = static_cast<int>(width);
}

void MetricsWriter::Impl::set_rows(hid_t dset, hsize_t rows) {
  std::vector<hsize_t> dims = io_detail::dataset_dims(dset);
  dims[0] = rows;
  H5_CHECK(H5Dset_extent(dset, dims.data()));  // collective: same new extent on every rank
}

void MetricsWriter::Impl::truncate_after(int64_t resume_step) {
  // Rows logged after the checkpoint we resume from were recomputed by this run: cut them so
  // the file holds each step once. Steps only grow within a file, so the rows to keep are a
  // prefix: up to the first step beyond resume_step. So are the segments, by their first
  // step: one that began after resume_step has no row left.
  auto kept_rows = [&](hid_t step_dset) -> hsize_t {
    const std::vector<int64_t> steps = read_ints(step_dset);
    auto it = std::find_if(steps.begin(), steps.end(), [&](int64_t s) { return s > resume_step; });
    return static_cast<hsize_t>(it - steps.begin());
  };
  train_rows = kept_rows(train[0]);
  eval_rows = kept_rows(eval[0]);
  for (auto& d : train) set_rows(d, train_rows);
  for (auto& d : eval) set_rows(d, eval_rows);
  if (has_segments) {
    const hsize_t segs = kept_rows(seg[kSegFirstStep]);
    seg_world.resize(segs);
    for (auto& d : seg) set_rows(d, segs);
  } else if (train_rows > 0) {
    seg_world = {old_world};  // the old layout's rows are kept (continue_old_layout)
  }
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
  write_from_root(seg[kSegFirstStep], H5T_NATIVE_INT64, n, 1, 0, 0, &first_step);
  write_from_root(seg[kSegWorld], H5T_NATIVE_INT64, n, 1, 0, 0, &world_size);
  write_from_root(seg[kSegGrid], H5T_NATIVE_INT64, n, 1, 0, 3, g);
  write_from_root(seg[kSegMode], mt, n, 1, 0, 0, m);
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
      write_from_root(train[i], H5T_NATIVE_DOUBLE, 0, train_rows, width, w - width, nan.data());
    }
  }
  width = w;
}

void MetricsWriter::Impl::write_root_attributes(const std::string& deck, const std::vector<int>& grid,
                                                const std::string& tensor_mode,
                                                const std::string& backend) {
  io_detail::write_attr_string(file, "deck", deck);
  io_detail::write_attr_int(file, "world_size", world);
  io_detail::write_attr_ints(file, "grid", grid);
  io_detail::write_attr_string(file, "tensor_mode", tensor_mode);
  io_detail::write_attr_string(file, "backend", backend);
  io_detail::write_attr_string(file, "version", kVersion);
}

void MetricsWriter::Impl::write_from_root(hid_t dset, hid_t memtype, hsize_t row0, hsize_t n,
                                          hsize_t col0, hsize_t cols, const void* buf) {
  H5Id fspace(H5_CHECK(H5Dget_space(dset)));
  const bool two_d = H5_CHECK(H5Sget_simple_extent_ndims(fspace)) == 2;
  const hsize_t count = n * (two_d ? cols : 1);
  H5Id mspace(H5_CHECK(H5Screate_simple(1, &count, nullptr)));
  if (rank == 0 && count > 0) {
    const hsize_t off[2] = {row0, col0}, cnt[2] = {n, cols};
    H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, off, nullptr, cnt, nullptr));
  } else {
    H5_CHECK(H5Sselect_none(fspace));
    H5_CHECK(H5Sselect_none(mspace));
  }
  H5_CHECK(H5Dwrite(dset, memtype, mspace, fspace, dxpl, buf));
}

void MetricsWriter::Impl::append(hid_t dset, const Column& c, hsize_t old_rows, hsize_t n,
                                 const void* buf) {
  const hid_t memtype = c.is_int ? H5T_NATIVE_INT64 : H5T_NATIVE_DOUBLE;
  if (!c.per_rank) {
    set_rows(dset, old_rows + n);
    write_from_root(dset, memtype, old_rows, n, 0, 0, buf);
    return;
  }
  hsize_t dims[2] = {old_rows + n, width};
  H5_CHECK(H5Dset_extent(dset, dims));  // collective: same new extent on every rank
  H5Id fspace(H5_CHECK(H5Dget_space(dset)));
  H5Id mspace(H5_CHECK(H5Screate_simple(1, &n, nullptr)));
  hsize_t off[2] = {old_rows, static_cast<hsize_t>(rank)}, cnt[2] = {n, 1};
  H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, off, nullptr, cnt, nullptr));
  H5_CHECK(H5Dwrite(dset, memtype, mspace, fspace, dxpl, buf));
  const hsize_t w = static_cast<hsize_t>(world);
  if (width > w) {  // an earlier segment had more ranks: no rank of this run in those columns
    std::vector<double> nan(n * (width - w), NAN);
    write_from_root(dset, H5T_NATIVE_DOUBLE, old_rows, n, w, width - w, nan.data());
  }
}

// Called by all ranks of comm.
MetricsWriter::MetricsWriter(MPI_Comm comm, const std::string& path, const std::string& deck,
                             const std::vector<int>& grid, const std::string& tensor_mode,
                             const std::string& backend, bool append, int64_t resume_step)
    : impl_(std::make_unique<Impl>()) {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  Impl& m = *impl_;
  m.comm = comm;
  m.path = path;
  MPI_Comm_rank(comm, &m.rank);
  MPI_Comm_size(comm, &m.world);
  m.dxpl = io_detail::collective_dxpl();

  io_detail::make_dirs(comm, std::filesystem::path(path).parent_path().string(), path);
  std::string why;
  io_detail::FileProbe probe = io_detail::probe_file(comm, path, &why);
  if (append && probe == io_detail::FileProbe::not_hdf5)
    throw UserError("metrics file '" + path + "' exists but is not an HDF5 file; cannot append");
  if (append && probe == io_detail::FileProbe::damaged)
    throw UserError("metrics file '" + path + "' is damaged (" + why +
                    "); cannot append: move it away to continue the run");

  // This run is a segment of its own (its layout may differ from the last one's); the
  // per-rank tables are as wide as the largest segment left in the file.
  auto new_width = [&] {
    int64_t w = m.world;
    for (int64_t s : m.seg_world) w = std::max(w, s);
    return static_cast<hsize_t>(w);
  };
  if (append && probe == io_detail::FileProbe::ok) {
    m.file = io_detail::open_parallel(comm, path, true);
    io_detail::throw_if_any_failed(comm, m.file.valid(),
                                   "metrics file '" + path + "' cannot be opened for appending");
    m.open_datasets();
    m.open_segments();
    // Every cut first, then a flush, then the writes: a cut through a chunk rewrites that
    // chunk (its cut-off part set to the fill value) from HDF5's chunk cache when the file is
    // flushed, while collective writes go straight to the file; a write between the two
    // would be undone.
    m.truncate_after(resume_step);
    const hsize_t w = new_width();
    if (w < m.width && !m.fixed_width) m.set_width(w);
    H5_CHECK(H5Fflush(m.file, H5F_SCOPE_GLOBAL));
    m.continue_old_layout();
  } else {
    m.file = io_detail::create_parallel(comm, path);
    io_detail::throw_if_any_failed(comm, m.file.valid(),
                                   "metrics file '" + path + "': cannot create the file");
    m.create_datasets();
    m.create_segments();
  }
  m.add_segment(resume_step + 1, m.world, grid, tensor_mode);
  m.set_width(new_width());
  m.write_root_attributes(deck, grid, tensor_mode, backend);
  H5_CHECK(H5Fflush(m.file, H5F_SCOPE_GLOBAL));
}

// Called by all ranks of comm: writes the rows still buffered, then closes the file. While an
// error unwinds the stack it does neither (both are collective, and this rank may be the only
// one failing): the file keeps the rows flushed so far, and fail_agreed decides the rest.
MetricsWriter::~MetricsWriter() {
  if (!impl_) return;
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  if (unwinding()) {
    for (auto& d : impl_->train) d.abandon();
    for (auto& d : impl_->eval) d.abandon();
    for (auto& d : impl_->seg) d.abandon();
    impl_->dxpl.abandon();
    impl_->file.abandon();
    return;
  }
  if (impl_->file.valid()) flush();
  for (auto& d : impl_->train) d.reset();
  for (auto& d : impl_->eval) d.reset();
  for (auto& d : impl_->seg) d.reset();
  impl_->dxpl.reset();
  impl_->file.reset();
}

void MetricsWriter::add_train(const TrainRow& r) { impl_->train_buf.push_back(r); }
void MetricsWriter::add_eval(const EvalRow& r) { impl_->eval_buf.push_back(r); }

// Called by all ranks of comm, each having added the same number of rows.
void MetricsWriter::flush() {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  Impl& m = *impl_;
  // Row counts must agree, or the extents below would differ between ranks: check with one
  // small all-reduce rather than corrupting the file or hanging.
  uint64_t counts[2] = {m.train_buf.size(), m.eval_buf.size()};
  uint64_t h = io_detail::fnv1a(1469598103934665603ull, counts, sizeof(counts));
  io_detail::check_same_on_all_ranks(m.comm, h, "metrics row counts");
  if (counts[0] == 0 && counts[1] == 0) return;

  if (counts[0] > 0) {
    const hsize_t n = counts[0];
    std::vector<int64_t> step(n);
    std::vector<double> col(n);
    for (hsize_t i = 0; i < n; ++i) step[i] = m.train_buf[i].step;
    m.append(m.train[0], kTrain[0], m.train_rows, n, step.data());
    double TrainRow::*fields[] = {&TrainRow::loss,         &TrainRow::lr,
                                  &TrainRow::grad_norm,    &TrainRow::images_per_s,
                                  &TrainRow::loss_scale,   &TrainRow::step_time_s,
                                  &TrainRow::device_mem_bytes};
    for (size_t f = 0; f < 7; ++f) {
      for (hsize_t i = 0; i < n; ++i) col[i] = m.train_buf[i].*fields[f];
      m.append(m.train[f + 1], kTrain[f + 1], m.train_rows, n, col.data());
    }
    m.train_rows += n;
    m.train_buf.clear();
  }
  if (counts[1] > 0) {
    const hsize_t n = counts[1];
    std::vector<int64_t> step(n);
    std::vector<double> col(n);
    for (hsize_t i = 0; i < n; ++i) step[i] = m.eval_buf[i].step;
    m.append(m.eval[0], kEval[0], m.eval_rows, n, step.data());
    double EvalRow::*fields[] = {&EvalRow::loss, &EvalRow::top1, &EvalRow::top5};
    for (size_t f = 0; f < 3; ++f) {
      for (hsize_t i = 0; i < n; ++i) col[i] = m.eval_buf[i].*fields[f];
      m.append(m.eval[f + 1], kEval[f + 1], m.eval_rows, n, col.data());
    }
    m.eval_rows += n;
    m.eval_buf.clear();
  }
  // Push data and metadata to the file so a reader opening it now sees a consistent file.
  H5_CHECK(H5Fflush(m.file, H5F_SCOPE_GLOBAL));
}

// Called by all ranks of comm with the same name and value.
void MetricsWriter::set_attribute(const std::string& name, double value) {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  io_detail::write_attr_double(impl_->file, name, value);
  H5_CHECK(H5Fflush(impl_->file, H5F_SCOPE_GLOBAL));
}

}  // namespace vitgrid
