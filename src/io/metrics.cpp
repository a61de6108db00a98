// metrics.h5 (DESIGN.md): one shared file, appended collectively while the run goes on and
// flushed after every append so plotting tools (h5py) can read it mid-run.
#include <algorithm>
#include <filesystem>

#include "h5_parallel.h"
#include "vitgrid/io/metrics.h"

namespace vitgrid {

using io_detail::H5Id;

namespace {

constexpr const char* kVersion = "0.1.0";

// One 1-D column (same value on every rank) or one [steps, world] table (a column per rank).
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

}  // namespace

struct MetricsWriter::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, world = 1;
  std::string path;
  H5Id file;
  H5Id dxpl;
  H5Id train[kNumTrain];
  H5Id eval[kNumEval];
  hsize_t train_rows = 0, eval_rows = 0;  // rows already in the file
  std::vector<TrainRow> train_buf;
  std::vector<EvalRow> eval_buf;

  void create_datasets();
  void open_datasets();
  void truncate_after(int64_t resume_step);
  void write_root_attributes(const std::string& deck, const std::vector<int>& grid,
                             const std::string& tensor_mode, const std::string& backend);
  // Extends `dset` by n rows and writes them. 1-D: rank 0 writes (all ranks hold the same
  // values). Per-rank: each rank writes its own column of the new rows.
  void append(hid_t dset, const Column& c, hsize_t old_rows, hsize_t n, const void* buf);
};

void MetricsWriter::Impl::create_datasets() {
  // Chunks stay under the 64 KiB alignment threshold (see parallel_fapl), so they pack
  // densely instead of each starting on a 1 MiB boundary; 1024 rows is ~150 flushes' worth.
  const hsize_t rows_1d = 1024;
  const hsize_t rows_2d = std::max<hsize_t>(1, 4096 / static_cast<hsize_t>(world));
  H5Id lcpl(H5_CHECK(H5Pcreate(H5P_LINK_CREATE)));
  H5_CHECK(H5Pset_create_intermediate_group(lcpl, 1));
  auto make = [&](const Column& c) {
    const int nd = c.per_rank ? 2 : 1;
    hsize_t dims[2] = {0, static_cast<hsize_t>(world)};
    hsize_t maxd[2] = {H5S_UNLIMITED, static_cast<hsize_t>(world)};
    hsize_t chunk[2] = {c.per_rank ? rows_2d : rows_1d, static_cast<hsize_t>(world)};
    H5Id space(H5_CHECK(H5Screate_simple(nd, dims, maxd)));
    H5Id dcpl(H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)));
    H5_CHECK(H5Pset_chunk(dcpl, nd, chunk));
    H5_CHECK(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
    return H5Id(H5_CHECK(H5Dcreate2(file, c.path, c.is_int ? H5T_STD_I64LE : H5T_IEEE_F64LE,
                                    space, lcpl, dcpl, H5P_DEFAULT)));
  };
  for (size_t i = 0; i < kNumTrain; ++i) train[i] = make(kTrain[i]);
  for (size_t i = 0; i < kNumEval; ++i) eval[i] = make(kEval[i]);
}

void MetricsWriter::Impl::open_datasets() {
  // every dataset must be there, extendible, with one column per rank where per-rank
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
    if (!d.valid() || dims.size() != nd || (c.per_rank && dims[1] != static_cast<hsize_t>(world))) {
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
}

void MetricsWriter::Impl::truncate_after(int64_t resume_step) {
  // Rows logged after the checkpoint we resume from were recomputed by this run: cut them so
  // the file holds each step once. Steps only grow within a file, so the rows to keep are a
  // prefix: up to the first step beyond resume_step.
  auto kept_rows = [&](hid_t step_dset) -> hsize_t {
    hsize_t n = io_detail::dataset_dims(step_dset)[0];
    std::vector<int64_t> steps(n);
    int64_t dummy = 0;
    H5_CHECK(H5Dread(step_dset, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, dxpl,
                     n ? steps.data() : &dummy));
    auto it = std::find_if(steps.begin(), steps.end(), [&](int64_t s) { return s > resume_step; });
    return static_cast<hsize_t>(it - steps.begin());
  };
  auto cut = [&](H5Id* dsets, size_t count, hsize_t rows) {
    // the second entry is only read for the [steps, world] tables
    hsize_t dims[2] = {rows, static_cast<hsize_t>(world)};
    for (size_t i = 0; i < count; ++i) H5_CHECK(H5Dset_extent(dsets[i], dims));
  };
  train_rows = kept_rows(train[0]);
  eval_rows = kept_rows(eval[0]);
  cut(train, kNumTrain, train_rows);
  cut(eval, kNumEval, eval_rows);
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

void MetricsWriter::Impl::append(hid_t dset, const Column& c, hsize_t old_rows, hsize_t n,
                                 const void* buf) {
  const hsize_t w = static_cast<hsize_t>(world);
  hsize_t dims[2] = {old_rows + n, w};
  H5_CHECK(H5Dset_extent(dset, dims));  // collective: same new extent on every rank
  H5Id fspace(H5_CHECK(H5Dget_space(dset)));
  H5Id mspace(H5_CHECK(H5Screate_simple(1, &n, nullptr)));
  if (c.per_rank) {
    hsize_t off[2] = {old_rows, static_cast<hsize_t>(rank)}, cnt[2] = {n, 1};
    H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, off, nullptr, cnt, nullptr));
  } else if (rank == 0) {
    H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, &old_rows, nullptr, &n, nullptr));
  } else {
    H5_CHECK(H5Sselect_none(fspace));
    H5_CHECK(H5Sselect_none(mspace));
  }
  H5_CHECK(H5Dwrite(dset, c.is_int ? H5T_NATIVE_INT64 : H5T_NATIVE_DOUBLE, mspace, fspace, dxpl, buf));
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
  io_detail::FileProbe probe = io_detail::probe_file(comm, path);
  if (append && probe == io_detail::FileProbe::not_hdf5)
    throw UserError("metrics file '" + path + "' exists but is not an HDF5 file; cannot append");

  if (append && probe == io_detail::FileProbe::ok) {
    m.file = io_detail::open_parallel(comm, path, true);
    io_detail::throw_if_any_failed(comm, m.file.valid(),
                                   "metrics file '" + path + "' cannot be opened for appending");
    // The [steps, world] tables have one column per rank of the run that made them; another
    // layout would write into the wrong columns.
    std::vector<int> ws;
    bool ok = io_detail::read_attr_ints(m.file, "world_size", &ws) && ws.size() == 1 &&
              ws[0] == m.world;
    io_detail::throw_if_any_failed(
        comm, ok,
        "metrics file '" + path + "' was written by " +
            (ws.size() == 1 ? std::to_string(ws[0]) : std::string("an unknown number of")) +
            " ranks, this run has " + std::to_string(m.world) +
            "; resuming on another layout cannot append to it (use a new run.out_dir)");
    m.open_datasets();
    m.truncate_after(resume_step);
  } else {
    m.file = io_detail::create_parallel(comm, path);
    io_detail::throw_if_any_failed(comm, m.file.valid(),
                                   "metrics file '" + path + "': cannot create the file");
    m.create_datasets();
  }
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
    impl_->dxpl.abandon();
    impl_->file.abandon();
    return;
  }
  if (impl_->file.valid()) flush();
  for (auto& d : impl_->train) d.reset();
  for (auto& d : impl_->eval) d.reset();
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
