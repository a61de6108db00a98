// torchvision's ImageFolder layout: ROOT/<class>/**/<image>, class = sorted sub-directory name
// (label = its position), samples sorted as torchvision's make_dataset walks them (directories
// in sorted order, file names sorted within each, symlinks followed).
//
// Splits: with ROOT/train/ and ROOT/val/ those are the splits (labels from train/'s classes, so
// a val/ missing a class keeps every other label). Otherwise ROOT is one set and the eval split
// is a deterministic hold-out: the last ceil(eval_fraction * n_c) files of each class in sorted
// order, with ceil taken after a 1e-9 tolerance (eval_fraction in (0, 1)); with eval_fraction = 0
// train and eval are the same set.
//
// Accepted: .jpg .jpeg .png (case-insensitive); other files are skipped and counted. A class
// directory holding no accepted file is refused, as torchvision refuses it.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vitgrid/core/error.h"
#include "vitgrid/data/image_source.h"

namespace vitgrid {
namespace {

namespace fs = std::filesystem;

bool is_dir(const std::string& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);  // follows symlinks
}

bool accepted_extension(const std::string& name) {
  const size_t dot = name.find_last_of('.');
  if (dot == std::string::npos) return false;
  std::string ext = name.substr(dot);
  for (char& c : ext) c = (char)std::tolower((unsigned char)c);
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

// Sorted names of the sub-directories of `dir` (symlinks to directories included).
std::vector<std::string> sub_directories(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (is_dir(it->path().string())) out.push_back(it->path().filename().string());
  if (ec) throw UserError("image folder " + dir + ": cannot list: " + ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

// Every accepted file under class_dir, in torchvision's order: sorted(os.walk(followlinks=True))
// visits directories sorted by path, and each directory's file names sorted.
void collect_class(const std::string& class_dir, std::vector<std::string>& files,
                   int64_t& skipped) {
  std::vector<std::pair<std::string, std::string>> found;  // (directory, file name)
  std::vector<std::string> stack = {class_dir};
  std::vector<std::string> seen;  // real paths of visited directories (symlink loops)
  while (!stack.empty()) {
    const std::string d = stack.back();
    stack.pop_back();
    std::error_code ec;
    const std::string real = fs::canonical(d, ec).string();
    if (!ec) {
      if (std::find(seen.begin(), seen.end(), real) != seen.end()) continue;
      seen.push_back(real);
    }
    for (fs::directory_iterator it(d, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string p = it->path().string();
      const std::string name = it->path().filename().string();
      std::error_code e2;
      const fs::file_status st = fs::status(it->path(), e2);  // follows symlinks
      if (fs::is_directory(st))
        stack.push_back(p);
      else if (fs::is_regular_file(st) && accepted_extension(name))
        found.emplace_back(d, name);
      else
        ++skipped;
    }
    if (ec) throw UserError("image folder " + d + ": cannot list: " + ec.message());
  }
  std::sort(found.begin(), found.end());
  for (auto& f : found) files.push_back(f.first + "/" + f.second);
}

class ImageFolderSource final : public ImageSource {
 public:
  ImageFolderSource(const std::string& root, const ImageSourceOptions& o)
      : root_(root), train_(o.train) {
    if (!is_dir(root)) {
      std::error_code ec;
      throw UserError("image folder " + root + ": " +
                      (fs::exists(root, ec) ? "not a directory" : "no such directory"));
    }
    const bool split_dirs = is_dir(root + "/train") && is_dir(root + "/val");
    if (split_dirs) {
      split_ = train_ ? "train/" : "val/";
      classes_ = sub_directories(root + "/train");
      if (classes_.empty())
        throw UserError("image folder " + root + "/train: no class directories");
      const std::string base = root + (train_ ? "/train" : "/val");
      const std::vector<std::string> present = train_ ? classes_ : sub_directories(base);
      for (const std::string& c : present) {
        const auto it = std::lower_bound(classes_.begin(), classes_.end(), c);
        if (it == classes_.end() || *it != c)
          throw UserError("image folder " + base + "/" + c + ": class '" + c +
                          "' is not among train/'s classes");
        add_class(base + "/" + c, (int32_t)(it - classes_.begin()), 0.0, true);
      }
    } else {
      if (!(o.eval_fraction >= 0.0 && o.eval_fraction < 1.0))
        throw UserError("image folder " + root + " (no train/ and val/): the held-out share " +
                        std::to_string(o.eval_fraction) + " must be in [0, 1)");
      fraction_ = o.eval_fraction;
      classes_ = sub_directories(root);
      if (classes_.empty()) throw UserError("image folder " + root + ": no class directories");
      for (size_t c = 0; c < classes_.size(); ++c)
        add_class(root + "/" + classes_[c], (int32_t)c, fraction_, false);
    }
    if (files_.empty())
      throw UserError("image folder " + root + ": the " + (train_ ? "train" : "eval") +
                      " split holds no images");
  }

  int64_t size() const override { return (int64_t)files_.size(); }
  int num_classes() const override { return (int)classes_.size(); }
  std::vector<std::string> class_names() const override { return classes_; }

  void read(int64_t i, std::vector<uint8_t>& bytes, int32_t& label) const override {
    check(i);
    const std::string& p = files_[(size_t)i];
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw UserError(p + ": cannot open: " + std::strerror(errno));
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closer{fd};
    struct stat st;
    if (fstat(fd, &st) != 0) throw UserError(p + ": cannot stat: " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) throw UserError(p + ": not a regular file");
    bytes.resize((size_t)st.st_size);
    size_t got = 0;
    while (got < bytes.size()) {
      const ssize_t r = ::pread(fd, bytes.data() + got, bytes.size() - got, (off_t)got);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw UserError(p + ": read failed: " + std::strerror(errno));
      if (r == 0) break;  // shrank since fstat: the decoder sees the truncation
      got += (size_t)r;
    }
    bytes.resize(got);
    label = labels_[(size_t)i];
  }

  std::string where(int64_t i) const override {
    check(i);
    return files_[(size_t)i];
  }

  std::string describe() const override {
    std::string d = "folder(" + root_ + ", " + (train_ ? "train" : "eval") + " split";
    if (!split_.empty())
      d += " " + split_;
    else if (fraction_ > 0.0)
      d += " (held out: last " + std::to_string(fraction_) + " of each class)";
    else
      d += " (no held-out split)";
    d += ", " + std::to_string(files_.size()) + " images, " + std::to_string(classes_.size()) +
         " classes, " + std::to_string(skipped_) + " other files skipped)";
    return d;
  }

 private:
  void check(int64_t i) const {
    if (i < 0 || i >= size())
      throw std::out_of_range("image folder " + root_ + ": index " + std::to_string(i) +
                              " outside [0, " + std::to_string(size()) + ")");
  }

  // Adds this split's share of one class: all of it (split directories), or the first
  // n - ceil(f n) files for train and the rest for eval.
  void add_class(const std::string& dir, int32_t label, double f, bool whole) {
    std::vector<std::string> files;
    collect_class(dir, files, skipped_);
    if (files.empty())
      throw UserError("image folder " + dir + ": class '" + fs::path(dir).filename().string() +
                      "' holds no .jpg, .jpeg or .png file (torchvision's ImageFolder refuses " +
                      "an empty class too)");
    size_t lo = 0, hi = files.size();
    if (!whole && f > 0.0) {
      // (the tolerance keeps 0.1 * 30 at 3, not 4: f * n rounded up as a person would)
      const size_t held =
          std::min(files.size(), (size_t)std::ceil(f * (double)files.size() - 1e-9));
      const size_t cut = files.size() - held;
      if (train_)
        hi = cut;
      else
        lo = cut;
    }
    for (size_t k = lo; k < hi; ++k) {
      files_.push_back(std::move(files[k]));
      labels_.push_back(label);
    }
  }

  std::string root_;
  bool train_;
  std::string split_;      // "train/" or "val/" when the tree has them
  double fraction_ = 0.0;  // hold-out share (no split directories)
  std::vector<std::string> classes_;
  std::vector<std::string> files_;
  std::vector<int32_t> labels_;
  int64_t skipped_ = 0;
};

}  // namespace

std::unique_ptr<ImageSource> open_image_folder(const std::string& root,
                                               const ImageSourceOptions& o) {
  return std::make_unique<ImageFolderSource>(root, o);
}

}  // namespace vitgrid
