// CIFAR-10 in its binary distribution (cifar-10-batches-bin): records of one label byte and
// 3072 image bytes (R plane, G plane, B plane, each 32x32 row-major). The split is loaded into
// memory at construction (150 MB for train) and converted once to HWC, so read() is a copy.
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <vector>

#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"

namespace vitgrid {
namespace {

constexpr int kS = 32;
constexpr int kPixels = kS * kS;
constexpr int kRecord = 1 + 3 * kPixels;
constexpr int kClasses = 10;

class Cifar10Dataset final : public Dataset {
 public:
  Cifar10Dataset(const std::string& dir, bool train) : dir_(dir), train_(train) {
    std::vector<std::string> files;
    if (train) {
      for (int k = 1; k <= 5; ++k) files.push_back(dir + "/data_batch_" + std::to_string(k) + ".bin");
    } else {
      files.push_back(dir + "/test_batch.bin");
    }
    for (const auto& f : files) load(f);
    if (labels_.empty()) throw UserError("CIFAR-10: no records in " + dir);
  }

  int64_t size() const override { return (int64_t)labels_.size(); }
  int image_size() const override { return kS; }
  int num_classes() const override { return kClasses; }
  std::string describe() const override {
    return "cifar10(" + dir_ + ", " + (train_ ? "train" : "eval") + ", n=" +
           std::to_string(labels_.size()) + ")";
  }

  void read(const int64_t* idx, int n, uint8_t* images, int32_t* labels) override {
    const size_t img = 3 * kPixels;
    for (int k = 0; k < n; ++k) {
      if (idx[k] < 0 || idx[k] >= size())
        throw std::out_of_range("CIFAR-10: index " + std::to_string(idx[k]) + " outside [0, " +
                                std::to_string(size()) + ")");
      std::memcpy(images + k * img, hwc_.data() + (size_t)idx[k] * img, img);
      labels[k] = labels_[(size_t)idx[k]];
    }
  }

 private:
  void load(const std::string& path) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0)
      throw UserError(errno == ENOENT
                          ? "CIFAR-10: missing file " + path
                          : "CIFAR-10: cannot use " + path + ": " + std::strerror(errno));
    if (!S_ISREG(st.st_mode))  // a FIFO would block the read, a device never end
      throw UserError("CIFAR-10: " + path + " is not a regular file");
    const size_t bytes = (size_t)st.st_size;
    if (bytes == 0 || bytes % kRecord != 0)
      throw UserError("CIFAR-10: " + path + " has " + std::to_string(bytes) +
                      " bytes, not a positive multiple of the record size " + std::to_string(kRecord));
    std::ifstream in(path, std::ios::binary);
    std::vector<uint8_t> raw(bytes);
    if (!in.read(reinterpret_cast<char*>(raw.data()), (std::streamsize)bytes))
      throw UserError("CIFAR-10: cannot read " + path);
    const size_t n = bytes / kRecord;
    const size_t first = labels_.size();
    labels_.resize(first + n);
    hwc_.resize((first + n) * 3 * kPixels);
    for (size_t r = 0; r < n; ++r) {
      const uint8_t* rec = raw.data() + r * kRecord;
      if (rec[0] >= kClasses)
        throw UserError("CIFAR-10: " + path + " record " + std::to_string(r) + " has label " +
                        std::to_string(rec[0]) + " (must be < 10)");
      labels_[first + r] = rec[0];
      uint8_t* dst = hwc_.data() + (first + r) * 3 * kPixels;
      const uint8_t* planes = rec + 1;  // CHW -> HWC
      for (int p = 0; p < kPixels; ++p) {
        dst[3 * p + 0] = planes[p];
        dst[3 * p + 1] = planes[kPixels + p];
        dst[3 * p + 2] = planes[2 * kPixels + p];
      }
    }
  }

  std::string dir_;
  bool train_;
  std::vector<uint8_t> hwc_;
  std::vector<int32_t> labels_;
};

}  // namespace

std::unique_ptr<Dataset> make_cifar10(const std::string& dir, bool train) {
  return std::make_unique<Cifar10Dataset>(dir, train);
}

}  // namespace vitgrid
