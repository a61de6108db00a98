// Shared helpers of the io tests: a scratch directory seen by all ranks, serial (rank-0) HDF5
// readers that check files independently of the code under test, and a check that a
// UserError is thrown on every rank with the same message.
#pragma once
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "h5_parallel.h"
#include "vitgrid/core/error.h"

namespace vgtest {

inline int rank_of(MPI_Comm c = MPI_COMM_WORLD) {
  int r = 0;
  MPI_Comm_rank(c, &r);
  return r;
}
inline int size_of(MPI_Comm c = MPI_COMM_WORLD) {
  int s = 1;
  MPI_Comm_size(c, &s);
  return s;
}

// A fresh directory made by rank 0 and broadcast; removed when the test ends.
class SharedTmpDir {
 public:
  SharedTmpDir() {
    char buf[256] = {0};
    if (rank_of() == 0) {
      std::snprintf(buf, sizeof(buf), "%s/vg_io_XXXXXX",
                    std::filesystem::temp_directory_path().c_str());
      if (!mkdtemp(buf)) buf[0] = 0;
    }
    MPI_Bcast(buf, sizeof(buf), MPI_CHAR, 0, MPI_COMM_WORLD);
    path_ = buf;
  }
  ~SharedTmpDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank_of() == 0 && !path_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Serial read of a whole dataset (rank-local, default sec2 driver), with its dims.
template <typename T>
std::vector<T> read_all(const std::string& file, const std::string& dset, hid_t memtype,
                        std::vector<hsize_t>* dims = nullptr) {
  std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
  vitgrid::io_detail::H5Id f(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  EXPECT_TRUE(f.valid()) << file;
  if (!f.valid()) return {};
  vitgrid::io_detail::H5Id d(H5Dopen2(f, dset.c_str(), H5P_DEFAULT));
  EXPECT_TRUE(d.valid()) << file << ":" << dset;
  if (!d.valid()) return {};
  std::vector<hsize_t> dd = vitgrid::io_detail::dataset_dims(d);
  size_t n = 1;
  for (auto x : dd) n *= x;
  std::vector<T> v(n);
  if (n) {
    EXPECT_GE(H5Dread(d, memtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0);
  }
  if (dims) *dims = dd;
  return v;
}

inline std::string read_string_attr(const std::string& file, const std::string& name) {
  std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
  vitgrid::io_detail::H5Id f(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  std::string v = "<missing>";
  if (f.valid()) vitgrid::io_detail::read_attr_string(f, name, &v);
  return v;
}

inline std::vector<int> read_int_attr(const std::string& file, const std::string& name) {
  std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
  vitgrid::io_detail::H5Id f(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  std::vector<int> v;
  if (f.valid()) vitgrid::io_detail::read_attr_ints(f, name, &v);
  return v;
}

// Runs fn on every rank; expects a vitgrid::UserError on every rank, the same message
// everywhere, containing each of `needles`.
inline void expect_user_error_everywhere(const std::function<void()>& fn,
                                         const std::vector<std::string>& needles) {
  std::string msg;
  bool threw = false;
  try {
    fn();
  } catch (const vitgrid::UserError& e) {
    threw = true;
    msg = e.what();
  }
  EXPECT_TRUE(threw) << "no UserError on rank " << rank_of();
  for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << msg << "' lacks '" << n << "'";
  // same message on every rank (rank 0's broadcast, compared locally)
  int len = static_cast<int>(msg.size());
  MPI_Bcast(&len, 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::string root(len, '\0');
  if (rank_of() == 0) root = msg;
  MPI_Bcast(&root[0], len, MPI_CHAR, 0, MPI_COMM_WORLD);
  EXPECT_EQ(msg, root) << "ranks disagree on the error";
}

// Runs a shell command (rank-local) and returns its exit status and stdout.
inline int run_command(const std::string& cmd, std::string* out) {
  out->clear();
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

inline std::string python3() {
  const char* p = std::getenv("VG_PYTHON3");
  return p && *p ? p : "";
}
inline std::string source_dir() {
  const char* p = std::getenv("VITGRID_SOURCE_DIR");
  return p && *p ? p : "";
}

}  // namespace vgtest
