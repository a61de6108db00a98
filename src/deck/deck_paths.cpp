// Deck checks that look at the file system. They are separate from parse_deck (which is pure)
// because the app runs them on every rank after the grid exists; every rank sees the same
// shared file system, so every rank reaches the same verdict.
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

void require_file(const Deck& d, const std::string& key, const std::string& path,
                  const std::string& what) {
  std::error_code ec;
  fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st))
    throw UserError(at(d) + key + ": " + what + " '" + path + "' does not exist");
  if (fs::is_directory(st))
    throw UserError(at(d) + key + ": " + what + " '" + path + "' is a directory, not a file");
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
    fs::path f = fs::path(dir) / name;
    if (!fs::is_regular_file(f, ec))
      throw UserError(at(d) + "data.path: CIFAR-10 directory '" + dir + "' lacks " + name +
                      " (expected the binary version of CIFAR-10)");
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

void check_deck_paths(const Deck& d, bool training) {
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
