#include "vitgrid/io/hdf5_util.h"

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

extern char** environ;

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

// A handle closed with the matching H5?close (the io layer's H5Id lives above this library).
class Hid {
 public:
  explicit Hid(hid_t id) : id_(id) {}
  ~Hid() {
    if (id_ < 0) return;
    switch (H5Iget_type(id_)) {
      case H5I_FILE:
        H5Fclose(id_);
        break;
      case H5I_DATASET:
        H5Dclose(id_);
        break;
      case H5I_DATASPACE:
        H5Sclose(id_);
        break;
      case H5I_DATATYPE:
        H5Tclose(id_);
        break;
      case H5I_ATTR:
        H5Aclose(id_);
        break;
      case H5I_GENPROP_LST:
        H5Pclose(id_);
        break;
      default:
        H5Oclose(id_);
        break;
    }
  }
  Hid(const Hid&) = delete;
  Hid& operator=(const Hid&) = delete;
  operator hid_t() const { return id_; }  // NOLINT
  bool valid() const { return id_ >= 0; }

 private:
  hid_t id_;
};

// The serial walk: "" or where the metadata cannot be read.
struct WalkState {
  hsize_t file_size = 0;
  std::string why;
};

herr_t check_attribute(hid_t obj, const char* name, const H5A_info_t*, void* op) {
  auto* w = static_cast<WalkState*>(op);
  Hid attr(H5Aopen(obj, name, H5P_DEFAULT));
  Hid type(attr.valid() ? H5Aget_type(attr) : -1);
  Hid space(attr.valid() ? H5Aget_space(attr) : -1);
  const hssize_t n = space.valid() ? H5Sget_simple_extent_npoints(space) : -1;
  bool ok = type.valid() && n >= 0;
  if (ok && H5Tis_variable_str(type) > 0) {
    std::vector<char*> p(static_cast<size_t>(n) + 1, nullptr);
    Hid mtype(H5Tcopy(H5T_C_S1));
    H5Tset_size(mtype, H5T_VARIABLE);
    H5Tset_cset(mtype, H5Tget_cset(type));
    ok = H5Aread(attr, mtype, p.data()) >= 0;
    for (char* q : p)
      if (q) H5free_memory(q);
  } else if (ok) {
    std::vector<char> buf(static_cast<size_t>(n) * H5Tget_size(type) + 16);
    ok = H5Aread(attr, type, buf.data()) >= 0;
  }
  if (ok) return 0;
  w->why = std::string("attribute '") + name + "' cannot be read";
  return -1;
}

herr_t check_object(hid_t g, const char* name, const H5L_info_t* info, void* op) {
  auto* w = static_cast<WalkState*>(op);
  if (info->type != H5L_TYPE_HARD) return 0;
  Hid obj(H5Oopen(g, name, H5P_DEFAULT));
  if (!obj.valid()) {
    w->why = std::string("object '/") + name + "' cannot be opened";
    return -1;
  }
  if (H5Aiterate2(obj, H5_INDEX_NAME, H5_ITER_INC, nullptr, check_attribute, w) < 0) {
    if (w->why.empty()) w->why = std::string("the attributes of '/") + name + "' cannot be listed";
    w->why = std::string("'/") + name + "': " + w->why;
    return -1;
  }
  if (H5Iget_type(obj) != H5I_DATASET) return 0;
  Hid space(H5Dget_space(obj));
  Hid type(H5Dget_type(obj));
  Hid dcpl(H5Dget_create_plist(obj));
  const hssize_t n = space.valid() ? H5Sget_simple_extent_npoints(space) : -1;
  if (n < 0 || !type.valid() || !dcpl.valid()) {
    w->why = std::string("dataset '/") + name + "' has an unreadable shape or type";
    return -1;
  }
  const H5D_layout_t layout = H5Pget_layout(dcpl);
  if (layout == H5D_CONTIGUOUS) {
    const haddr_t at = H5Dget_offset(obj);
    const hsize_t bytes = H5Dget_storage_size(obj);
    if (at != HADDR_UNDEF && (at > w->file_size || bytes > w->file_size - at)) {
      w->why = std::string("dataset '/") + name + "' extends past the end of the file (truncated?)";
      return -1;
    }
  } else if (layout == H5D_CHUNKED) {
    // the chunk index is metadata too: every chunk's place, without reading (or decompressing)
    // the data; an index of very many chunks is left to the reads (looking one up by number
    // walks the index again each time)
    hsize_t chunks = 0;
    if (H5Dget_num_chunks(obj, space, &chunks) < 0) {
      w->why = std::string("dataset '/") + name + "' has an unreadable chunk index";
      return -1;
    }
    for (hsize_t i = 0; chunks <= 4096 && i < chunks; ++i) {
      haddr_t at = HADDR_UNDEF;
      hsize_t bytes = 0;
      if (H5Dget_chunk_info(obj, space, i, nullptr, nullptr, &at, &bytes) < 0 ||
          (at != HADDR_UNDEF && (at > w->file_size || bytes > w->file_size - at))) {
        w->why = std::string("dataset '/") + name + "' has a damaged chunk index";
        return -1;
      }
    }
  }
  return 0;
}

std::string walk_metadata(const std::string& path) {
  H5ErrorSilencer quiet;
  WalkState w;
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return "cannot stat";
  w.file_size = static_cast<hsize_t>(st.st_size);
  Hid file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  if (!file.valid()) return "cannot be opened (truncated or damaged metadata)";
  if (H5Aiterate2(file, H5_INDEX_NAME, H5_ITER_INC, nullptr, check_attribute, &w) < 0)
    return w.why.empty() ? "its root attributes cannot be listed" : w.why;
  if (H5Lvisit(file, H5_INDEX_NAME, H5_ITER_INC, check_object, &w) < 0)
    return w.why.empty() ? "its objects cannot be walked (damaged metadata)" : w.why;
  return "";
}

}  // namespace

H5ErrorSilencer::H5ErrorSilencer() {
  H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

H5ErrorSilencer::~H5ErrorSilencer() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }

std::string hdf5_metadata_problem(const std::string& path) { return walk_metadata(path); }

std::string hdf5_metadata_problem_isolated(const std::string& path) {
  // the checker beside this executable (every vitgrid binary is built into one directory)
  char self[4096] = {0};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  std::string checker;
  if (n > 0) {
    std::string dir(self, static_cast<size_t>(n));
    dir = dir.substr(0, dir.find_last_of('/') + 1);
    checker = dir + "vitgrid-h5check";
  }
  if (checker.empty() || ::access(checker.c_str(), X_OK) != 0) return walk_metadata(path);
  int fds[2];
  if (::pipe(fds) != 0) return walk_metadata(path);
  // Its environment without the MPI launcher's variables: the checker is no rank of the job.
  std::vector<std::string> env_s;
  for (char** e = environ; e && *e; ++e) {
    const std::string v(*e);
    if (v.rfind("OMPI_", 0) == 0 || v.rfind("PMIX_", 0) == 0 || v.rfind("PMI_", 0) == 0 ||
        v.rfind("LD_PRELOAD=", 0) == 0)
      continue;
    env_s.push_back(v);
  }
  std::vector<char*> envp;
  for (auto& v : env_s) envp.push_back(&v[0]);
  envp.push_back(nullptr);
  std::string a0 = checker, a1 = path;
  char* argv[] = {&a0[0], &a1[0], nullptr};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  // the signals the application blocks in its threads (SignalThread) unblocked in the child
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, checker.c_str(), &fa, &attr, argv, envp.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    return walk_metadata(path);
  }
  // its answer, within a minute (a walk that loops on crafted metadata is an answer too)
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool timed_out = false;
  for (;;) {
    struct pollfd p {
      fds[0], POLLIN, 0
    };
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          deadline - std::chrono::steady_clock::now())
                                          .count());
    if (left <= 0) {
      timed_out = true;
      break;
    }
    const int r = ::poll(&p, 1, left);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      timed_out = r == 0;
      break;
    }
    char buf[512];
    const ssize_t k = ::read(fds[0], buf, sizeof buf);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    out.append(buf, static_cast<size_t>(k));
  }
  ::close(fds[0]);
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) return "walking its metadata did not finish within 60 s (damaged metadata)";
  if (WIFSIGNALED(status))
    return "the HDF5 library died reading its metadata (signal " +
           std::to_string(WTERMSIG(status)) + ", in a checker process)";
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out.empty() ? "its metadata cannot be read" : out;
}

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
}

SoftFailures::~SoftFailures() { g_soft = SoftState(); }

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
      msg =
          std::string("HDF5 call failed: ") + g_soft.call + (have ? std::string("; ") + space : "");
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
