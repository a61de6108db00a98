// Deck checks that look at the file system. They are separate from parse_deck (which is pure)
// because the app runs them on every rank after the grid exists; every rank sees the same
// shared file system, so every rank reaches the same verdict.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "vitgrid/core/error.h"
#include "vitgrid/deck/deck.h"

namespace fs = std::filesystem;

namespace vitgrid {
namespace {

std::string at(const Deck& d) { return d.source.empty() ? std::string() : d.source + ": "; }

// An input file every rank will read: it must exist, be a regular file (a FIFO would block
// the reader, a device like /dev/zero reads forever) and open for reading.
void require_file(const Deck& d, const std::string& key, const std::string& path,
                  const std::string& what) {
  const std::string named = at(d) + key + ": " + what + " '" + path + "'";
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) throw UserError(named + " does not exist");
    throw UserError(named + " cannot be used: " + std::strerror(errno));
  }
  if (S_ISDIR(st.st_mode)) throw UserError(named + " is a directory, not a file");
  if (!S_ISREG(st.st_mode))
    throw UserError(named + " is not a regular file (" + file_type_name(st.st_mode) + ")");
  // Permission bits alone do not tell (root, ACLs): open it. O_NONBLOCK in case the name was
  // swapped for a FIFO since the stat.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw UserError(named + " cannot be opened for reading: " + std::strerror(errno));
  ::close(fd);
}

// The run directory must be usable before any work starts: otherwise the metrics file or the
// first checkpoint fails after setup, where the ranks no longer agree on errors. Tried for real
// rather than judged from permission bits: root passes every access() check yet cannot write
// under /proc or on a read-only mount, and ACLs or quotas are invisible to the bits. The
// directory is created (with its parents) if missing and kept. The app probes on one rank
// only; the probe file's name is its own anyway (host and pid), so that several jobs starting
// in one directory never remove each other's.
void require_writable_dir(const Deck& d, const std::string& key, const std::string& dir) {
  const std::string named = at(d) + key + ": '" + dir + "'";
  std::error_code ec;
  fs::create_directories(dir, ec);  // no error when it exists (or another rank made it)
  if (ec) throw UserError(named + " cannot be created: " + ec.message());
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0)
    throw UserError(named + " cannot be used: " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) throw UserError(named + " exists and is not a directory");
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const std::string probe =
      (fs::path(dir) / (".vitgrid-probe-" + std::string(host) + "-" + std::to_string(::getpid())))
          .string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    throw UserError(
        named + " is not writable (creating a file in it failed: " + std::strerror(errno) + ")");
  const bool wrote = ::write(fd, "x", 1) == 1;
  const int write_errno = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  if (!wrote)
    throw UserError(named + " is not writable (writing a file in it failed: " +
                    std::strerror(write_errno) + ")");
}

void check_cifar10(const Deck& d, bool training) {
  const std::string& dir = d.data.path;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw UserError(at(d) + "data.path: CIFAR-10 directory '" + dir +
                    "' does not exist or is not a directory (it holds the binary version: "
                    "data_batch_1.bin ... data_batch_5.bin, test_batch.bin)");
  // Only the splits this run reads: training reads the five train batches and evaluates on
  // the test batch; eval and predict read only the test batch.
  std::vector<std::string> needed;
  if (training)
    for (int i = 1; i <= 5; ++i) needed.push_back("data_batch_" + std::to_string(i) + ".bin");
  needed.push_back("test_batch.bin");
  for (const std::string& name : needed) {
    const std::string f = (fs::path(dir) / name).string();
    struct stat st;
    if (::stat(f.c_str(), &st) != 0 && errno == ENOENT)
      throw UserError(at(d) + "data.path: CIFAR-10 directory '" + dir + "' lacks " + name +
                      " (expected the binary version of CIFAR-10)");
    require_file(d, "data.path", f, "CIFAR-10 file");
  }
}

// A directory that exists and holds at least one entry.
bool non_empty_dir(const fs::path& p) {
  std::error_code ec;
  if (!fs::is_directory(p, ec)) return false;
  fs::directory_iterator it(p, ec);
  return !ec && it != fs::directory_iterator();
}

}  // namespace

void check_deck_paths(const Deck& d, bool training, bool writes_out_dir) {
  if (d.data.dataset == "cifar10") {
    check_cifar10(d, training);
  } else if (d.data.dataset == "hdf5") {
    require_file(d, "data.path", d.data.path, "HDF5 dataset");
    if (!d.data.eval_path.empty())
      require_file(d, "data.eval_path", d.data.eval_path, "HDF5 eval dataset");
  }
  if (!d.checkpoint.load.empty())
    require_file(d, "checkpoint.load", d.checkpoint.load, "checkpoint");

  std::error_code ec;
  const fs::path out(d.run.out_dir);
  if (fs::exists(out, ec) && !fs::is_directory(out, ec))
    throw UserError(at(d) + "run.out_dir: '" + d.run.out_dir + "' exists and is not a directory");
  // After the inputs: a run refused for its data creates no directory.
  if (writes_out_dir) {
    require_writable_dir(d, "run.out_dir", d.run.out_dir);
    if (training && fs::exists(out / "checkpoints", ec) &&
        !fs::is_directory(out / "checkpoints", ec))
      throw UserError(at(d) + "run.out_dir: '" + (out / "checkpoints").string() +
                      "' exists and is not a directory (checkpoints are written there)");
  }
  // A new training run must not mix its metrics and checkpoints with another run's: either the
  // user meant to continue (resume = auto) or picked the wrong directory.
  if (training && d.checkpoint.resume == "none") {
    const char* what = nullptr;
    if (fs::exists(out / "metrics.h5", ec))
      what = "metrics.h5";
    else if (non_empty_dir(out / "checkpoints"))
      what = "checkpoints/";
    if (what)
      throw UserError(at(d) + "run.out_dir '" + d.run.out_dir + "' holds another run (" + what +
                      "); choose another out_dir or set checkpoint.resume = auto");
  }
}

}  // namespace vitgrid
