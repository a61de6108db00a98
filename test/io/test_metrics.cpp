// metrics.h5 (written by rank 0 from every rank's rows): rows appended over several flushes,
// per-rank columns, root attributes, h5py readability mid-run, append mode cutting the rows a
// resumed run recomputes, runs on other world sizes continuing one file (segments, NaN
// columns, truncation across segments), a file with fixed-width per-rank tables continued,
// and a full file system at creation, at a flush and at a resume: the same UserError on every
// rank, the file as the last flush left it, the ranks still in step (MetricsFullDisk: root
// only, its own ctest entries).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <tuple>

#include "io_test_util.h"
#include "vitgrid/core/test_hooks.h"
#include "vitgrid/io/checkpoint.h"
#include "vitgrid/io/metrics.h"

namespace {

using vgtest::rank_of;
using vgtest::size_of;

// Row values as functions of (step, variant, rank); check_metrics.py uses the same formulas.
vitgrid::TrainRow train_row(int64_t s, int variant = 0) {
  vitgrid::TrainRow r;
  r.step = s;
  r.loss = 10.0 - 0.5 * s + 100.0 * variant;
  r.lr = 1e-4 * s;
  r.grad_norm = s + 0.5;
  r.images_per_s = 100.0 * s;
  r.loss_scale = 1024.0;
  r.step_time_s = rank_of() + s + 1000.0 * variant;
  r.device_mem_bytes = 1e9 + 1000.0 * rank_of() + s + 1e6 * variant;
  r.bad_images = 10.0 * rank_of() + s;
  r.input_wait_s = 0.001 * rank_of() + 0.25 * s;
  return r;
}

vitgrid::EvalRow eval_row(int64_t s) { return {s, 2.0 / s, 0.1 * s, 0.2 * s}; }

const char* kDeck = "[run]\nsteps = 6\n[parallel]\ntensor = 1\n";

std::vector<int> grid() { return {1, size_of(), 1}; }

void expect_train(const std::string& path, const std::vector<int64_t>& steps,
                  const std::vector<int>& variants) {
  const size_t n = steps.size(), p = static_cast<size_t>(size_of());
  std::vector<hsize_t> dims;
  EXPECT_EQ(vgtest::read_all<int64_t>(path, "/train/step", H5T_NATIVE_INT64, &dims), steps);
  EXPECT_EQ(dims, std::vector<hsize_t>{n});
  auto loss = vgtest::read_all<double>(path, "/train/loss", H5T_NATIVE_DOUBLE);
  auto lr = vgtest::read_all<double>(path, "/train/lr", H5T_NATIVE_DOUBLE);
  auto gn = vgtest::read_all<double>(path, "/train/grad_norm", H5T_NATIVE_DOUBLE);
  auto ips = vgtest::read_all<double>(path, "/train/images_per_s", H5T_NATIVE_DOUBLE);
  auto ls = vgtest::read_all<double>(path, "/train/loss_scale", H5T_NATIVE_DOUBLE);
  std::vector<hsize_t> d2, d3;
  auto st = vgtest::read_all<double>(path, "/train/step_time_s", H5T_NATIVE_DOUBLE, &d2);
  auto mem = vgtest::read_all<double>(path, "/train/device_mem_bytes", H5T_NATIVE_DOUBLE, &d3);
  EXPECT_EQ(d2, (std::vector<hsize_t>{n, p}));
  EXPECT_EQ(d3, (std::vector<hsize_t>{n, p}));
  ASSERT_EQ(loss.size(), n);
  ASSERT_EQ(st.size(), n * p);
  for (size_t i = 0; i < n; ++i) {
    const int64_t s = steps[i];
    EXPECT_EQ(loss[i], 10.0 - 0.5 * s + 100.0 * variants[i]) << "row " << i;
    EXPECT_EQ(lr[i], 1e-4 * s);
    EXPECT_EQ(gn[i], s + 0.5);
    EXPECT_EQ(ips[i], 100.0 * s);
    EXPECT_EQ(ls[i], 1024.0);
    for (size_t r = 0; r < p; ++r) {
      EXPECT_EQ(st[i * p + r], r + s + 1000.0 * variants[i]) << "row " << i << " rank " << r;
      EXPECT_EQ(mem[i * p + r], 1e9 + 1000.0 * r + s + 1e6 * variants[i])
          << "row " << i << " rank " << r;
    }
  }
}

struct Segment {
  int64_t first_step;
  int world;
  std::string mode;
};
void expect_segments(const std::string& path, const std::vector<Segment>& segs);

void expect_eval(const std::string& path, const std::vector<int64_t>& steps) {
  EXPECT_EQ(vgtest::read_all<int64_t>(path, "/eval/step", H5T_NATIVE_INT64), steps);
  auto loss = vgtest::read_all<double>(path, "/eval/loss", H5T_NATIVE_DOUBLE);
  auto t1 = vgtest::read_all<double>(path, "/eval/top1", H5T_NATIVE_DOUBLE);
  auto t5 = vgtest::read_all<double>(path, "/eval/top5", H5T_NATIVE_DOUBLE);
  ASSERT_EQ(loss.size(), steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    auto e = eval_row(steps[i]);
    EXPECT_EQ(loss[i], e.loss);
    EXPECT_EQ(t1[i], e.top1);
    EXPECT_EQ(t5[i], e.top5);
  }
}

// Writes steps 1..6 (two explicit flushes, the last row flushed by the destructor) and eval
// rows at 2 and 4.
void write_six(const std::string& path, bool check_midrun_with_python) {
  vitgrid::MetricsWriter mw(MPI_COMM_WORLD, path, kDeck, grid(), "1d", "cpu", false, 0);
  for (int64_t s = 1; s <= 3; ++s) mw.add_train(train_row(s));
  mw.add_eval(eval_row(2));
  mw.flush();
  if (check_midrun_with_python && rank_of() == 0 && !vgtest::python3().empty() &&
      !vgtest::source_dir().empty()) {
    // another process, h5py, while the file is still open for writing
    std::string out;
    int rc = vgtest::run_command(vgtest::python3() + " " + vgtest::source_dir() +
                                     "/test/io/check_metrics.py " + path + " --steps 1,2,3 --eval 2 --world " +
                                     std::to_string(size_of()) + " 2>&1",
                                 &out);
    EXPECT_EQ(rc, 0) << out;
  }
  for (int64_t s = 4; s <= 5; ++s) mw.add_train(train_row(s));
  mw.add_eval(eval_row(4));
  mw.flush();
  mw.flush();  // nothing buffered: a no-op on every rank
  mw.add_train(train_row(6));
  mw.set_attribute("checkpoint_gbps", 1.5);
}

TEST(Metrics, FlushesColumnsAndAttributes) {
  vgtest::SharedTmpDir tmp;
  const std::string path = tmp / "run/metrics.h5";  // the writer makes run/
  write_six(path, true);
  if (rank_of() != 0) return;
  expect_train(path, {1, 2, 3, 4, 5, 6}, {0, 0, 0, 0, 0, 0});
  expect_eval(path, {2, 4});
  EXPECT_EQ(vgtest::read_string_attr(path, "deck"), kDeck);
  EXPECT_EQ(vgtest::read_string_attr(path, "tensor_mode"), "1d");
  EXPECT_EQ(vgtest::read_string_attr(path, "backend"), "cpu");
  EXPECT_EQ(vgtest::read_string_attr(path, "version"), "0.1.0");
  EXPECT_EQ(vgtest::read_int_attr(path, "world_size"), std::vector<int>{size_of()});
  EXPECT_EQ(vgtest::read_int_attr(path, "grid"), grid());
  expect_segments(path, {{1, size_of(), "1d"}});
  std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
  vitgrid::io_detail::H5Id f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  vitgrid::io_detail::H5Id a(H5Aopen(f, "checkpoint_gbps", H5P_DEFAULT));
  double v = 0;
  ASSERT_GE(H5Aread(a, H5T_NATIVE_DOUBLE, &v), 0);
  EXPECT_EQ(v, 1.5);
}

TEST(Metrics, AppendCutsRowsAfterResumeStep) {
  vgtest::SharedTmpDir tmp;
  const std::string path = tmp / "metrics.h5";
  write_six(path, false);
  {
    vitgrid::MetricsWriter mw(MPI_COMM_WORLD, path, kDeck, grid(), "1d", "cpu", true, 3);
    // rows after step 3 are gone before anything new is written
    MPI_Barrier(MPI_COMM_WORLD);
    for (int64_t s = 4; s <= 7; ++s) mw.add_train(train_row(s, 1));
    mw.add_eval(eval_row(6));
  }
  if (rank_of() == 0) {
    expect_train(path, {1, 2, 3, 4, 5, 6, 7}, {0, 0, 0, 1, 1, 1, 1});
    expect_eval(path, {2, 6});
    expect_segments(path, {{1, size_of(), "1d"}, {4, size_of(), "1d"}});
  }
  // resume before the first step: everything is cut
  { vitgrid::MetricsWriter mw(MPI_COMM_WORLD, path, kDeck, grid(), "1d", "cpu", true, 0); }
  if (rank_of() == 0) {
    expect_train(path, {}, {});
    expect_eval(path, {});
    expect_segments(path, {{1, size_of(), "1d"}});
  }
  // append to a file that does not exist yet: created
  const std::string fresh = tmp / "fresh.h5";
  {
    vitgrid::MetricsWriter mw(MPI_COMM_WORLD, fresh, kDeck, grid(), "1d", "cpu", true, 100);
    mw.add_train(train_row(1));
  }
  if (rank_of() == 0) {
    expect_train(fresh, {1}, {0});
    expect_segments(fresh, {{101, size_of(), "1d"}});
  }
}

// ---- runs on other world sizes continuing one file

std::vector<int> grid_of(int n) { return {1, n, 1}; }

// A train row as the file should hold it: its step, variant, and the world size of the run
// that wrote it (its per-rank columns beyond that are NaN).
struct Row {
  int64_t step;
  int variant;
  int ranks;
};

void expect_rows(const std::string& path, const std::vector<Row>& rows, size_t width) {
  const size_t n = rows.size();
  std::vector<int64_t> steps;
  std::vector<int> variants;
  for (const Row& r : rows) steps.push_back(r.step), variants.push_back(r.variant);
  EXPECT_EQ(vgtest::read_all<int64_t>(path, "/train/step", H5T_NATIVE_INT64), steps);
  auto loss = vgtest::read_all<double>(path, "/train/loss", H5T_NATIVE_DOUBLE);
  std::vector<hsize_t> d2, d3;
  auto st = vgtest::read_all<double>(path, "/train/step_time_s", H5T_NATIVE_DOUBLE, &d2);
  auto mem = vgtest::read_all<double>(path, "/train/device_mem_bytes", H5T_NATIVE_DOUBLE, &d3);
  EXPECT_EQ(d2, (std::vector<hsize_t>{n, width}));
  EXPECT_EQ(d3, (std::vector<hsize_t>{n, width}));
  ASSERT_EQ(loss.size(), n);
  ASSERT_EQ(st.size(), n * width);
  ASSERT_EQ(mem.size(), n * width);
  for (size_t i = 0; i < n; ++i) {
    const Row& w = rows[i];
    EXPECT_EQ(loss[i], train_row(w.step, w.variant).loss) << "row " << i;
    for (size_t r = 0; r < width; ++r) {
      const double t = st[i * width + r], m = mem[i * width + r];
      if (r < static_cast<size_t>(w.ranks)) {
        EXPECT_EQ(t, r + w.step + 1000.0 * w.variant) << "step " << w.step << " rank " << r;
        EXPECT_EQ(m, 1e9 + 1000.0 * r + w.step + 1e6 * w.variant)
            << "step " << w.step << " rank " << r;
      } else {
        EXPECT_TRUE(std::isnan(t)) << "step " << w.step << " column " << r << ": " << t;
        EXPECT_TRUE(std::isnan(m)) << "step " << w.step << " column " << r << ": " << m;
      }
    }
  }
}

void expect_segments(const std::string& path, const std::vector<Segment>& segs) {
  std::vector<int64_t> first, world, grid;
  std::vector<hsize_t> gdims;
  std::vector<std::string> modes;
  for (const Segment& g : segs) {
    first.push_back(g.first_step);
    world.push_back(g.world);
    for (int x : grid_of(g.world)) grid.push_back(x);
    modes.push_back(g.mode);
  }
  EXPECT_EQ(vgtest::read_all<int64_t>(path, "/segments/first_step", H5T_NATIVE_INT64), first);
  EXPECT_EQ(vgtest::read_all<int64_t>(path, "/segments/world_size", H5T_NATIVE_INT64), world);
  EXPECT_EQ(vgtest::read_all<int64_t>(path, "/segments/grid", H5T_NATIVE_INT64, &gdims), grid);
  EXPECT_EQ(gdims, (std::vector<hsize_t>{segs.size(), 3}));
  // fixed-length strings, read as 16-byte NUL-padded names
  std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
  vitgrid::io_detail::H5Id f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  vitgrid::io_detail::H5Id d(H5Dopen2(f, "/segments/tensor_mode", H5P_DEFAULT));
  ASSERT_TRUE(d.valid());
  vitgrid::io_detail::H5Id t(H5Tcopy(H5T_C_S1));
  H5Tset_size(t, 16);
  std::vector<char> buf(16 * segs.size() + 1, 0);
  ASSERT_GE(H5Dread(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()), 0);
  std::vector<std::string> got;
  for (size_t i = 0; i < segs.size(); ++i)
    got.emplace_back(buf.data() + 16 * i, strnlen(buf.data() + 16 * i, 16));
  EXPECT_EQ(got, modes);
}

// Runs fn(comm) on the first n ranks (a communicator of their own); the others wait.
void on_ranks(int n, const std::function<void(MPI_Comm)>& fn) {
  MPI_Comm c = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank_of() < n ? 0 : MPI_UNDEFINED, rank_of(), &c);
  if (c != MPI_COMM_NULL) {
    fn(c);
    MPI_Comm_free(&c);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// One run of the writer on the first n ranks: resumes after `resume` (fresh when < 0) and
// writes steps [first, last] as `variant`, with an eval row at `last`.
void run_on(const std::string& path, int n, const char* mode, int64_t resume, int64_t first,
            int64_t last, int variant) {
  on_ranks(n, [&](MPI_Comm c) {
    vitgrid::MetricsWriter mw(c, path, kDeck, grid_of(n), mode, "cpu", resume >= 0,
                              std::max<int64_t>(resume, 0));
    for (int64_t s = first; s <= last; ++s) {
      mw.add_train(train_row(s, variant));
      if (s == first + 1) mw.flush();
    }
    mw.add_eval(eval_row(last));
  });
}

TEST(Metrics, RunsOnOtherWorldSizesContinueTheFile) {
  const int P = size_of(), h = P / 2;
  if (P < 2) return;  // needs two world sizes
  vgtest::SharedTmpDir tmp;
  const std::string path = tmp / "metrics.h5";
  const bool root = rank_of() == 0;
  // h ranks, steps 1-6
  run_on(path, h, "1d", -1, 1, 6, 0);
  // P ranks from step 4: the table widens, the rows kept from the h-rank run NaN beyond h
  run_on(path, P, "2d", 4, 5, 8, 1);
  if (root) {
    expect_rows(
        path,
        {{1, 0, h}, {2, 0, h}, {3, 0, h}, {4, 0, h}, {5, 1, P}, {6, 1, P}, {7, 1, P}, {8, 1, P}},
        P);
    expect_segments(path, {{1, h, "1d"}, {5, P, "2d"}});
    expect_eval(path, {8});
    EXPECT_EQ(vgtest::read_int_attr(path, "world_size"), std::vector<int>{P});
    EXPECT_EQ(vgtest::read_int_attr(path, "grid"), grid_of(P));
    EXPECT_EQ(vgtest::read_string_attr(path, "tensor_mode"), "2d");
  }
  // h ranks from step 6 (inside the P-rank segment): the table stays P wide, NaN beyond h
  run_on(path, h, "none", 6, 7, 9, 2);
  if (root) {
    expect_rows(path,
                {{1, 0, h},
                 {2, 0, h},
                 {3, 0, h},
                 {4, 0, h},
                 {5, 1, P},
                 {6, 1, P},
                 {7, 2, h},
                 {8, 2, h},
                 {9, 2, h}},
                P);
    expect_segments(path, {{1, h, "1d"}, {5, P, "2d"}, {7, h, "none"}});
    expect_eval(path, {9});
    EXPECT_EQ(vgtest::read_int_attr(path, "world_size"), std::vector<int>{h});
    EXPECT_EQ(vgtest::read_string_attr(path, "tensor_mode"), "none");
  }
  // h ranks from step 2: the cut crosses two segment boundaries into the first segment; no
  // P-rank segment is left, so the tables narrow to h columns
  run_on(path, h, "1d", 2, 3, 5, 3);
  if (root) {
    expect_rows(path, {{1, 0, h}, {2, 0, h}, {3, 3, h}, {4, 3, h}, {5, 3, h}}, h);
    expect_segments(path, {{1, h, "1d"}, {3, h, "1d"}});
    expect_eval(path, {5});
  }
  // P ranks from step 5: widened again, the earlier rows' new columns NaN (not what the
  // narrowed columns held before)
  run_on(path, P, "2d", 5, 6, 7, 4);
  if (root) {
    expect_rows(path, {{1, 0, h}, {2, 0, h}, {3, 3, h}, {4, 3, h}, {5, 3, h}, {6, 4, P}, {7, 4, P}},
                P);
    expect_segments(path, {{1, h, "1d"}, {3, h, "1d"}, {6, P, "2d"}});
    expect_eval(path, {5, 7});
  }
  // from step 0 on h ranks: everything cut, one segment
  run_on(path, h, "1d", 0, 1, 2, 5);
  if (root) {
    expect_rows(path, {{1, 5, h}, {2, 5, h}}, h);
    expect_segments(path, {{1, h, "1d"}});
    expect_eval(path, {2});
  }
}

// A metrics.h5 as written before the segments table: per-rank tables of a fixed width `w`,
// steps 1-6, root attributes naming a w-rank grid (rank 0, serial HDF5).
void write_fixed_width_file(const std::string& path, int w) {
  std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
  using vitgrid::io_detail::H5Id;
  H5Id f(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  ASSERT_TRUE(f.valid());
  H5Id lcpl(H5Pcreate(H5P_LINK_CREATE));
  H5Pset_create_intermediate_group(lcpl, 1);
  const hsize_t n = 6;
  auto make = [&](const char* name, bool per_rank, hid_t type, const void* data) {
    const int nd = per_rank ? 2 : 1;
    hsize_t dims[2] = {n, static_cast<hsize_t>(w)}, maxd[2] = {H5S_UNLIMITED, dims[1]};
    hsize_t chunk[2] = {16, dims[1]};
    H5Id space(H5Screate_simple(nd, dims, maxd));
    H5Id dcpl(H5Pcreate(H5P_DATASET_CREATE));
    H5Pset_chunk(dcpl, nd, chunk);
    H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY);  // as a parallel writer's datasets are
    H5Id d(H5Dcreate2(f, name, type == H5T_NATIVE_INT64 ? H5T_STD_I64LE : H5T_IEEE_F64LE, space,
                      lcpl, dcpl, H5P_DEFAULT));
    ASSERT_TRUE(d.valid()) << name;
    ASSERT_GE(H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), 0);
  };
  std::vector<int64_t> step;
  std::vector<double> loss, lr, gn, ips, ls, st, mem;
  for (int64_t s = 1; s <= 6; ++s) {
    const auto r = train_row(s);
    step.push_back(s), loss.push_back(r.loss), lr.push_back(r.lr), gn.push_back(r.grad_norm);
    ips.push_back(r.images_per_s), ls.push_back(r.loss_scale);
    for (int k = 0; k < w; ++k) st.push_back(k + s), mem.push_back(1e9 + 1000.0 * k + s);
  }
  make("train/step", false, H5T_NATIVE_INT64, step.data());
  make("train/loss", false, H5T_NATIVE_DOUBLE, loss.data());
  make("train/lr", false, H5T_NATIVE_DOUBLE, lr.data());
  make("train/grad_norm", false, H5T_NATIVE_DOUBLE, gn.data());
  make("train/images_per_s", false, H5T_NATIVE_DOUBLE, ips.data());
  make("train/loss_scale", false, H5T_NATIVE_DOUBLE, ls.data());
  make("train/step_time_s", true, H5T_NATIVE_DOUBLE, st.data());
  make("train/device_mem_bytes", true, H5T_NATIVE_DOUBLE, mem.data());
  const int64_t es[2] = {2, 4};
  const double el[2] = {eval_row(2).loss, eval_row(4).loss},
               e1[2] = {eval_row(2).top1, eval_row(4).top1},
               e5[2] = {eval_row(2).top5, eval_row(4).top5};
  hsize_t two = 2, unl = H5S_UNLIMITED;
  for (auto [name, type, data] :
       {std::tuple<const char*, hid_t, const void*>{"eval/step", H5T_NATIVE_INT64, es},
        {"eval/loss", H5T_NATIVE_DOUBLE, el},
        {"eval/top1", H5T_NATIVE_DOUBLE, e1},
        {"eval/top5", H5T_NATIVE_DOUBLE, e5}}) {
    H5Id space(H5Screate_simple(1, &two, &unl));
    H5Id dcpl(H5Pcreate(H5P_DATASET_CREATE));
    H5Pset_chunk(dcpl, 1, &two);
    H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY);
    H5Id d(H5Dcreate2(f, name, type == H5T_NATIVE_INT64 ? H5T_STD_I64LE : H5T_IEEE_F64LE, space,
                      lcpl, dcpl, H5P_DEFAULT));
    ASSERT_GE(H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), 0);
  }
  vitgrid::io_detail::write_attr_string(f, "deck", kDeck);
  vitgrid::io_detail::write_attr_int(f, "world_size", w);
  vitgrid::io_detail::write_attr_ints(f, "grid", grid_of(w));
  vitgrid::io_detail::write_attr_string(f, "tensor_mode", "2.5d");
  vitgrid::io_detail::write_attr_string(f, "backend", "cpu");
  vitgrid::io_detail::write_attr_string(f, "version", "0.1.0");
}

// Whether the per-rank tables can now take more columns.
bool columns_unlimited(const std::string& path, const char* dset) {
  std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
  vitgrid::io_detail::H5Id f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  vitgrid::io_detail::H5Id d(H5Dopen2(f, dset, H5P_DEFAULT));
  vitgrid::io_detail::H5Id space(H5Dget_space(d));
  hsize_t dims[2] = {0, 0}, maxd[2] = {0, 0};
  if (H5Sget_simple_extent_ndims(space) != 2) return false;
  H5Sget_simple_extent_dims(space, dims, maxd);
  return maxd[1] == H5S_UNLIMITED;
}

TEST(Metrics, ContinuesAFileWithFixedWidthTables) {
  const int P = size_of();
  // written by one rank more than this run, then (P > 1) by one rank fewer
  for (int w : {P + 1, P - 1}) {
    if (w < 1) continue;
    vgtest::SharedTmpDir tmp;
    const std::string path = tmp / "metrics.h5";
    if (rank_of() == 0) write_fixed_width_file(path, w);
    MPI_Barrier(MPI_COMM_WORLD);
    run_on(path, P, "1d", 4, 5, 7, 1);
    if (rank_of() != 0) continue;
    SCOPED_TRACE("fixed width " + std::to_string(w) + ", continued on " + std::to_string(P));
    expect_rows(path, {{1, 0, w}, {2, 0, w}, {3, 0, w}, {4, 0, w}, {5, 1, P}, {6, 1, P}, {7, 1, P}},
                std::max(w, P));
    expect_segments(path, {{1, w, "2.5d"}, {5, P, "1d"}});
    expect_eval(path, {2, 4, 7});
    EXPECT_TRUE(columns_unlimited(path, "/train/step_time_s"));
    EXPECT_TRUE(columns_unlimited(path, "/train/device_mem_bytes"));
    EXPECT_EQ(vgtest::read_int_attr(path, "world_size"), std::vector<int>{P});
    // the older file had no bad_images and input_wait_s tables: added, NaN in its rows, this
    // run's values after
    const size_t width = static_cast<size_t>(std::max(w, P));
    for (const char* table : {"/train/bad_images", "/train/input_wait_s"}) {
      std::vector<hsize_t> d;
      auto got = vgtest::read_all<double>(path, table, H5T_NATIVE_DOUBLE, &d);
      ASSERT_EQ(d, (std::vector<hsize_t>{7, width})) << table;
      for (size_t row = 0; row < 7; ++row)
        for (size_t r = 0; r < width; ++r) {
          const double v = got[row * width + r];
          const double want = std::string(table) == "/train/bad_images" ? 10.0 * r + (row + 1)
                                                                         : 0.001 * r + 0.25 * (row + 1);
          if (row < 4 || r >= static_cast<size_t>(P))
            EXPECT_TRUE(std::isnan(v)) << table << " row " << row << " rank " << r;
          else
            EXPECT_EQ(v, want) << table << " row " << row << " rank " << r;
        }
    }
  }
  // from step 0: nothing of the old layout is left
  vgtest::SharedTmpDir tmp;
  const std::string path = tmp / "metrics.h5";
  if (rank_of() == 0) write_fixed_width_file(path, P + 1);
  MPI_Barrier(MPI_COMM_WORLD);
  run_on(path, P, "1d", 0, 1, 2, 1);
  if (rank_of() == 0) {
    expect_rows(path, {{1, 1, P}, {2, 1, P}}, P);
    expect_segments(path, {{1, P, "1d"}});
  }
}

TEST(Metrics, AppendRefusesGarbageAndBrokenSegments) {
  vgtest::SharedTmpDir tmp;
  const std::string garbage = tmp / "garbage.h5";
  if (rank_of() == 0) {
    FILE* f = std::fopen(garbage.c_str(), "wb");
    std::fputs("not an hdf5 file at all", f);
    std::fclose(f);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  vgtest::expect_user_error_everywhere(
      [&] {
        vitgrid::MetricsWriter mw(MPI_COMM_WORLD, garbage, kDeck, grid(), "1d", "cpu", true, 3);
      },
      {garbage, "not an HDF5 file"});

  // a segments table missing a column
  const std::string path = tmp / "metrics.h5";
  write_six(path, false);
  if (rank_of() == 0) {
    std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
    vitgrid::io_detail::H5Id f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    ASSERT_TRUE(f.valid());
    ASSERT_GE(H5Ldelete(f, "/segments/grid", H5P_DEFAULT), 0);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  vgtest::expect_user_error_everywhere(
      [&] { vitgrid::MetricsWriter mw(MPI_COMM_WORLD, path, kDeck, grid(), "1d", "cpu", true, 3); },
      {path, "/segments/grid", "missing"});
  if (rank_of() == 0) expect_train(path, {1, 2, 3, 4, 5, 6}, {0, 0, 0, 0, 0, 0});
}

// ---- a full file system (root only: a small tmpfs; skipped otherwise)

// A tmpfs of `size` mounted by rank 0 on a fresh directory for the life of the object, seen by
// every rank (they share the host). ok() is false on every rank when this process is not root
// or the mount fails.
class SmallFs {
 public:
  explicit SmallFs(const char* size) {
    char buf[256] = {0};
    int ok = 0;
    if (rank_of() == 0 && geteuid() == 0) {
      std::snprintf(buf, sizeof(buf), "%s/vg_fullfs_XXXXXX",
                    std::filesystem::temp_directory_path().c_str());
      if (mkdtemp(buf)) {
        const std::string opts = std::string("size=") + size;
        ok = mount("tmpfs", buf, "tmpfs", 0, opts.c_str()) == 0;
        if (!ok) rmdir(buf);
      }
    }
    MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_Bcast(buf, sizeof(buf), MPI_CHAR, 0, MPI_COMM_WORLD);
    ok_ = ok != 0;
    dir_ = buf;
  }
  ~SmallFs() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank_of() == 0 && ok_) {
      umount2(dir_.c_str(), MNT_DETACH);
      rmdir(dir_.c_str());
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  bool ok() const { return ok_; }
  std::string operator/(const std::string& name) const { return dir_ + "/" + name; }
  // Rank 0 writes a filler file until no byte more fits; every rank returns once it is full.
  void fill() {
    if (rank_of() == 0) {
      const int fd = ::open(filler().c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      EXPECT_GE(fd, 0);
      std::vector<char> zeros(1 << 16, 0);
      for (size_t n = zeros.size(); fd >= 0 && n > 0; n /= 2)
        while (::write(fd, zeros.data(), n) == static_cast<ssize_t>(n)) {
        }
      if (fd >= 0) ::close(fd);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  void free_filler() {
    if (rank_of() == 0) std::remove(filler().c_str());
    MPI_Barrier(MPI_COMM_WORLD);
  }

 private:
  std::string filler() const { return dir_ + "/filler"; }
  bool ok_ = false;
  std::string dir_;
};

// After a failure: the ranks are still in step (a barrier, then a writer elsewhere works).
void expect_ranks_in_step() {
  MPI_Barrier(MPI_COMM_WORLD);
  vgtest::SharedTmpDir tmp;
  const std::string path = tmp / "metrics.h5";
  write_six(path, false);
  if (rank_of() == 0) expect_train(path, {1, 2, 3, 4, 5, 6}, {0, 0, 0, 0, 0, 0});
}

// checkpoint.direct_io on a full disk: HDF5 lays out the file (its metadata fits, the data is
// not allocated on the file system yet), then the reservation of the file's space, made before
// the direct writes start beside HDF5's, meets the full disk: the same message on every rank,
// the .tmp removed, the checkpoint before it kept, the ranks in step.
TEST(CheckpointFullDisk, DirectWritesFailAlikeOnEveryRank) {
  SmallFs fs("2m");
  if (!fs.ok()) {
    GTEST_SKIP() << "needs root to mount a tmpfs";
  }
  const int r = rank_of(), p = size_of();
  auto shards_of = [&](int64_t rows, std::vector<float>& buf) {
    const int64_t cols = 700, lo = rows * r / p, hi = rows * (r + 1) / p;
    buf.assign(static_cast<size_t>((hi - lo) * cols), 1.5f);
    vitgrid::TensorShard s;
    s.name = "model/blocks.0.mlp.fc1.weight";
    s.global_shape = {rows, cols};
    s.offset = {lo, 0};
    s.count = {hi - lo, cols};
    s.data = buf.data();
    return std::vector<vitgrid::TensorShard>{s};
  };
  vitgrid::CheckpointMeta meta;
  meta.deck = "[run]\nsteps = 1\n";
  meta.grid = {1, p, 1};
  meta.world_size = p;
  meta.state["step"] = {1.0};
  std::vector<float> small, big;
  const std::string dir = fs / "checkpoints";
  // 168 KB: fits
  const std::string first = vitgrid::write_checkpoint(MPI_COMM_WORLD, dir, 1, shards_of(60, small),
                                                      meta, 0, 2);
  // 1.7 MB, more than the 2 MiB file system has left beside the first and a filler
  if (rank_of() == 0) {
    const int fd = ::open((fs / "filler").c_str(), O_WRONLY | O_CREAT, 0644);
    std::vector<char> mb(1 << 20, 0);
    EXPECT_EQ(::write(fd, mb.data(), mb.size()), static_cast<ssize_t>(mb.size()));
    ::close(fd);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  vgtest::expect_user_error_everywhere(
      [&] { vitgrid::write_checkpoint(MPI_COMM_WORLD, dir, 2, shards_of(600, big), meta, 0, 2); },
      {"step_00000002.h5' could not be written", "no space left on device",
       "reserving its space", "the partial file was removed"});
  if (rank_of() == 0) {
    EXPECT_FALSE(std::filesystem::exists(dir + "/step_00000002.h5.tmp"));
    EXPECT_FALSE(std::filesystem::exists(dir + "/step_00000002.h5"));
  }
  // the first reads back whole
  std::vector<float> back;
  auto rd = shards_of(60, back);
  std::fill(back.begin(), back.end(), 0.0f);
  vitgrid::read_checkpoint(MPI_COMM_WORLD, first, rd, nullptr);
  for (float v : back) ASSERT_EQ(v, 1.5f);
  expect_ranks_in_step();
}

TEST(MetricsFullDisk, CreationFailsAlikeOnEveryRank) {
  SmallFs fs("1m");
  if (!fs.ok()) {
    GTEST_SKIP() << "needs root to mount a tmpfs";
  }
  fs.fill();
  const std::string path = fs / "run/metrics.h5";
  vgtest::expect_user_error_everywhere(
      [&] {
        vitgrid::MetricsWriter mw(MPI_COMM_WORLD, path, kDeck, grid(), "1d", "cpu", false, 0);
      },
      {"metrics file '" + path + "'", "cannot create the file", "no space left on device"});
  // the file it could not write is not left behind
  if (rank_of() == 0) {
    EXPECT_FALSE(std::filesystem::exists(path));
  }
  expect_ranks_in_step();
}

TEST(MetricsFullDisk, FlushFailsAlikeOnEveryRankAndTheFileStays) {
  SmallFs fs("1m");
  if (!fs.ok()) {
    GTEST_SKIP() << "needs root to mount a tmpfs";
  }
  const std::string path = fs / "metrics.h5";
  const std::vector<std::string> no_space = {"metrics file '" + path + "': cannot write",
                                             "no space left on device"};
  {
    vitgrid::MetricsWriter mw(MPI_COMM_WORLD, path, kDeck, grid(), "1d", "cpu", false, 0);
    for (int64_t s = 1; s <= 3; ++s) mw.add_train(train_row(s));
    mw.add_eval(eval_row(2));
    mw.flush();
    fs.fill();
    for (int64_t s = 4; s <= 5; ++s) mw.add_train(train_row(s));
    mw.add_eval(eval_row(4));
    vgtest::expect_user_error_everywhere([&] { mw.flush(); }, no_space);
    // failed for good: the same error from every later call, nothing more written
    mw.add_train(train_row(6));
    vgtest::expect_user_error_everywhere([&] { mw.flush(); }, no_space);
    vgtest::expect_user_error_everywhere([&] { mw.set_attribute("checkpoint_gbps", 1.5); },
                                         no_space);
  }  // destroyed on every rank without an exception unwinding: no flush, no hang
  MPI_Barrier(MPI_COMM_WORLD);
  // the file is as the last flush left it
  if (rank_of() == 0) {
    expect_train(path, {1, 2, 3}, {0, 0, 0});
    expect_eval(path, {2});
    expect_segments(path, {{1, size_of(), "1d"}});
  }
  // a resume on the full disk is refused before the file is touched
  vgtest::expect_user_error_everywhere(
      [&] { vitgrid::MetricsWriter mw(MPI_COMM_WORLD, path, kDeck, grid(), "1d", "cpu", true, 2); },
      {"metrics file '" + path + "': cannot append to it", "no space left on device"});
  if (rank_of() == 0) {
    expect_train(path, {1, 2, 3}, {0, 0, 0});
    expect_segments(path, {{1, size_of(), "1d"}});
  }
  // with room again the resume continues the file
  fs.free_filler();
  {
    vitgrid::MetricsWriter mw(MPI_COMM_WORLD, path, kDeck, grid(), "1d", "cpu", true, 2);
    for (int64_t s = 3; s <= 4; ++s) mw.add_train(train_row(s, 1));
  }
  if (rank_of() == 0) {
    expect_train(path, {1, 2, 3, 4}, {0, 0, 1, 1});
    expect_eval(path, {2});
    expect_segments(path, {{1, size_of(), "1d"}, {3, size_of(), "1d"}});
  }
  expect_ranks_in_step();
}

// A write that meets the full disk all the same (the room is not reserved first: a file system
// that cannot reserve, or a copy-on-write one): the same UserError on every rank, and rank 0's
// HDF5 stays usable (HDF5 1.10 cannot close a file after a failed flush; a failed close would
// crash the process when the library terminates).
TEST(MetricsFullDisk, WriteFailingInsideHdf5FailsAlikeOnEveryRank) {
  SmallFs fs("1m");
  if (!fs.ok()) {
    GTEST_SKIP() << "needs root to mount a tmpfs";
  }
  const std::string path = fs / "metrics.h5";
  vitgrid_test_hooks.metrics_no_reserve = 1;
  {
    vitgrid::MetricsWriter mw(MPI_COMM_WORLD, path, kDeck, grid(), "1d", "cpu", false, 0);
    for (int64_t s = 1; s <= 3; ++s) mw.add_train(train_row(s));
    mw.flush();
    fs.fill();
    // past the first chunk of every table: new chunks, which do not fit
    for (int64_t s = 4; s <= 5000; ++s) mw.add_train(train_row(s));
    vgtest::expect_user_error_everywhere(
        [&] { mw.flush(); },
        {"metrics file '" + path + "': cannot write", "no space left on device"});
  }
  vitgrid_test_hooks.metrics_no_reserve = 0;
  expect_ranks_in_step();
}

}  // namespace
