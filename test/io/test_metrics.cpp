// metrics.h5: rows appended over several flushes, per-rank columns, root attributes, h5py
// readability mid-run, and append mode cutting the rows a resumed run recomputes.
#include <gtest/gtest.h>

#include "io_test_util.h"
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
  r.step_time_s = rank_of() + s;
  r.device_mem_bytes = 1e9 + 1000.0 * rank_of() + s;
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
      EXPECT_EQ(st[i * p + r], static_cast<double>(r + s)) << "row " << i << " rank " << r;
      EXPECT_EQ(mem[i * p + r], 1e9 + 1000.0 * r + s) << "row " << i << " rank " << r;
    }
  }
}

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
  }
  // resume before the first step: everything is cut
  { vitgrid::MetricsWriter mw(MPI_COMM_WORLD, path, kDeck, grid(), "1d", "cpu", true, 0); }
  if (rank_of() == 0) {
    expect_train(path, {}, {});
    expect_eval(path, {});
  }
  // append to a file that does not exist yet: created
  const std::string fresh = tmp / "fresh.h5";
  {
    vitgrid::MetricsWriter mw(MPI_COMM_WORLD, fresh, kDeck, grid(), "1d", "cpu", true, 100);
    mw.add_train(train_row(1));
  }
  if (rank_of() == 0) expect_train(fresh, {1}, {0});
}

TEST(Metrics, AppendRefusesOtherWorldSizeAndGarbage) {
  vgtest::SharedTmpDir tmp;
  const std::string path = tmp / "metrics.h5";
  write_six(path, false);
  if (rank_of() == 0) {
    // as if written by a run with one more rank
    std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
    vitgrid::io_detail::H5Id f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    ASSERT_TRUE(f.valid());
    vitgrid::io_detail::write_attr_int(f, "world_size", size_of() + 1);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  vgtest::expect_user_error_everywhere(
      [&] { vitgrid::MetricsWriter mw(MPI_COMM_WORLD, path, kDeck, grid(), "1d", "cpu", true, 3); },
      {path, "written by " + std::to_string(size_of() + 1) + " ranks"});
  // the refused file is untouched
  if (rank_of() == 0) expect_train(path, {1, 2, 3, 4, 5, 6}, {0, 0, 0, 0, 0, 0});

  const std::string garbage = tmp / "garbage.h5";
  if (rank_of() == 0) {
    FILE* f = std::fopen(garbage.c_str(), "wb");
    std::fputs("not an hdf5 file at all", f);
    std::fclose(f);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  vgtest::expect_user_error_everywhere(
      [&] { vitgrid::MetricsWriter mw(MPI_COMM_WORLD, garbage, kDeck, grid(), "1d", "cpu", true, 3); },
      {garbage, "not an HDF5 file"});
}

}  // namespace
