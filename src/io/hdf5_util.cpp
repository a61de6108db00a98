#include "vitgrid/io/hdf5_util.h"

#include <sys/statvfs.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

namespace vitgrid {

std::recursive_mutex& hdf5_mutex() {
  static std::recursive_mutex m;
  return m;
}

namespace io_detail {
namespace {

// The open SoftFailures scope of this thread and its first failure.
struct SoftState {
  bool open = false;
  bool failed = false;
  std::string call;
  int err = 0;
};
thread_local SoftState g_soft;

struct SavedAuto {
  H5E_auto2_t func;
  void* data;
};

}  // namespace

void h5_failed(const char* call, const char* file, int line) {
  if (!g_soft.open) fail_one(file, line, std::string("HDF5 call failed: ") + call);
  if (g_soft.failed) return;
  g_soft.failed = true;
  g_soft.call = call;
  g_soft.err = errno;
}

SoftFailures::SoftFailures(std::string dir) : dir_(std::move(dir)) {
  VG_CHECK(!g_soft.open, "SoftFailures scopes do not nest");
  g_soft = SoftState();
  g_soft.open = true;
  errno = 0;
  auto* saved = new SavedAuto{nullptr, nullptr};
  H5Eget_auto2(H5E_DEFAULT, &saved->func, &saved->data);
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  quiet_ = saved;
}

SoftFailures::~SoftFailures() {
  auto* saved = static_cast<SavedAuto*>(quiet_);
  H5Eset_auto2(H5E_DEFAULT, saved->func, saved->data);
  delete saved;
  g_soft = SoftState();
}

std::string SoftFailures::take() {
  std::string msg;
  if (g_soft.failed) {
    // errno survives HDF5's and MPI-IO's error paths often enough; the free space decides
    // where it did not
    struct statvfs v {};
    const bool have = !dir_.empty() && statvfs(dir_.c_str(), &v) == 0;
    const double free_b = have ? double(v.f_bavail) * double(v.f_frsize) : -1.0;
    char space[160] = {0};
    if (have)
      std::snprintf(space, sizeof space, "%.1f MB free on the file system of '%s'", free_b / 1e6,
                    dir_.c_str());
    if (g_soft.err == ENOSPC || g_soft.err == EDQUOT || (have && free_b < 1048576.0))
      msg = std::string(g_soft.err == EDQUOT ? "disk quota exceeded" : "no space left on device") +
            (have ? std::string(" (") + space + ")" : std::string());
    else if (g_soft.err == EIO || g_soft.err == EROFS || g_soft.err == EACCES)
      msg = std::strerror(g_soft.err);
    else
      msg = std::string("HDF5 call failed: ") + g_soft.call + (have ? std::string("; ") + space : "");
  }
  g_soft.failed = false;
  errno = 0;
  return msg;
}

std::string SoftFailures::agree(MPI_Comm comm) {
  std::string msg = take();
  const bool ok = msg.empty();
  return agree_error(comm, ok, &msg) ? msg : std::string();
}

bool SoftFailures::failed() const { return g_soft.failed; }

void SoftFailures::fail(int err, const char* what) {
  if (g_soft.failed) return;
  g_soft.failed = true;
  g_soft.call = what;
  g_soft.err = err;
}

}  // namespace io_detail
}  // namespace vitgrid
