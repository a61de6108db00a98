// Parallel-HDF5 helpers: one shared file, collective metadata, collective transfers.
#pragma once
#include <hdf5.h>
#include <mpi.h>

#include <mutex>
#include <sstream>
#include <string>

#include "vitgrid/core/error.h"

#define H5_CHECK(call)                                                          \
  ([&]() {                                                                      \
    auto vg_h5_ = (call);                                                       \
    if (vg_h5_ < 0) ::vitgrid::io_detail::h5_failed(#call, __FILE__, __LINE__); \
    return vg_h5_;                                                              \
  }())

namespace vitgrid {

// HDF5 (Debian's parallel build) is not thread-safe: every HDF5 call in this process (the
// data loader's thread and the main thread) holds this lock.
std::recursive_mutex& hdf5_mutex();

namespace io_detail {

// Turns off HDF5's automatic error-stack printing for its lifetime: used around probes whose
// failure is an expected answer (a missing attribute, a file that is not HDF5).
class H5ErrorSilencer {
 public:
  H5ErrorSilencer();
  ~H5ErrorSilencer();
  H5ErrorSilencer(const H5ErrorSilencer&) = delete;
  H5ErrorSilencer& operator=(const H5ErrorSilencer&) = delete;

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

// "" when every piece of the file's metadata can be read serially (every object header,
// attribute, contiguous dataset's storage inside the file, chunked dataset's chunk index), else
// where it cannot. The isolated form walks in a process of its own (vitgrid-h5check, beside
// the running executable): HDF5 1.10 can crash, not only fail, on crafted metadata, and a
// damaged file is an answer, not a reason to crash the job. Without the checker it walks here.
std::string hdf5_metadata_problem(const std::string& path);
std::string hdf5_metadata_problem_isolated(const std::string& path);

// A failed HDF5 call (H5_CHECK): a local fatal error (fail_one), unless a SoftFailures scope
// is open on this thread, which records it instead.
void h5_failed(const char* call, const char* file, int line);

// Writing a file that can fail for reasons outside the program (a full disk, a quota, an I/O
// error) on some ranks only. While the scope is open, failed HDF5 calls are recorded (the
// first one, with errno) and HDF5's error stack is not printed; the caller goes on making the
// same calls as the other ranks up to its next agreement point, agree(), where every rank
// learns whether any failed, and stops together. Called from one thread; scopes do not nest.
class SoftFailures {
 public:
  // `dir`: where the file lives, for the free space in the message.
  explicit SoftFailures(std::string dir);
  ~SoftFailures();
  SoftFailures(const SoftFailures&) = delete;
  SoftFailures& operator=(const SoftFailures&) = delete;
  // Called by all ranks of comm: "" when no rank recorded a failure; else the lowest failing
  // rank's reason ("no space left on device (12.0 MB free on the file system of 'dir')", an
  // errno text, or the failed call), the same on every rank.
  std::string agree(MPI_Comm comm);
  // This rank alone, for a file only it writes: its reason ("" when none was recorded), as
  // agree() words it; the record is cleared. The caller shares it with the other ranks.
  std::string take();
  // Whether a failure was recorded since the last agree() or take(): a writer that alone
  // writes its file stops there.
  bool failed() const;
  // Records a failure found without an HDF5 call, as a failed call with errno `err` would be
  // (e.g. ENOSPC from a free-space check made before writing).
  void fail(int err, const char* what);

 private:
  std::string dir_;
  H5ErrorSilencer quiet_;
};

}  // namespace io_detail
}  // namespace vitgrid
