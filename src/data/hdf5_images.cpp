// The packed HDF5 image file: /images uint8 [N,S,S,3] (contiguous or chunked), /labels integer
// [N], root attribute num_classes (optional: max label + 1 when absent).
//
// Each process opens the file read-only with the default sec2 (POSIX) driver, not MPI-IO:
// reads happen on the loader's background thread, and an MPI-IO read there would make MPI
// calls concurrently with the main thread's collectives, which needs MPI_THREAD_MULTIPLE
// everywhere in the process. Independent POSIX reads of a read-only file need no
// coordination and the page cache serves ranks on the same node.
//
// Every HDF5 call holds hdf5_mutex(): Debian's parallel HDF5 is not thread-safe and the main
// thread writes metrics and checkpoints with the same library.
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"
#include "vitgrid/io/hdf5_util.h"

namespace vitgrid {
namespace {

// Turns HDF5's automatic error-stack printing off while probing a user file (a malformed file
// is reported once, as a UserError, not as a page of library traces) and restores it after.
class QuietHdf5Errors {
 public:
  QuietHdf5Errors() {
    H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietHdf5Errors() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

// Closes an HDF5 handle on scope exit (the caller holds hdf5_mutex()).
struct H5Handle {
  hid_t id = -1;
  herr_t (*close)(hid_t) = nullptr;
  H5Handle(hid_t i, herr_t (*c)(hid_t)) : id(i), close(c) {}
  ~H5Handle() {
    if (id >= 0) close(id);
  }
  H5Handle(const H5Handle&) = delete;
  H5Handle& operator=(const H5Handle&) = delete;
  hid_t release() {
    hid_t i = id;
    id = -1;
    return i;
  }
};

class Hdf5ImageDataset final : public Dataset {
 public:
  explicit Hdf5ImageDataset(const std::string& path) : path_(path) {
    auto bad = [&](const std::string& what) { return UserError("HDF5 images " + path_ + ": " + what); };
    struct stat st;
    if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) throw bad("no such file");

    std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
    QuietHdf5Errors quiet;
    if (H5Fis_hdf5(path.c_str()) <= 0) throw bad("not an HDF5 file");
    H5Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    if (file.id < 0) throw bad("cannot open the file read-only");

    // /images
    if (H5Lexists(file.id, "images", H5P_DEFAULT) <= 0) throw bad("missing dataset /images");
    H5Handle images(H5Dopen2(file.id, "images", H5P_DEFAULT), H5Dclose);
    if (images.id < 0) throw bad("/images is not a dataset");
    {
      H5Handle type(H5Dget_type(images.id), H5Tclose);
      if (H5Tget_class(type.id) != H5T_INTEGER || H5Tget_size(type.id) != 1 ||
          H5Tget_sign(type.id) != H5T_SGN_NONE)
        throw bad("/images must be uint8");
      H5Handle space(H5Dget_space(images.id), H5Sclose);
      int rank = H5Sget_simple_extent_ndims(space.id);
      if (rank != 4) throw bad("/images must have rank 4 [N,S,S,3], has rank " + std::to_string(rank));
      hsize_t dims[4];
      H5Sget_simple_extent_dims(space.id, dims, nullptr);
      if (dims[1] != dims[2])
        throw bad("/images is not square (" + std::to_string(dims[1]) + "x" + std::to_string(dims[2]) + ")");
      if (dims[3] != 3) throw bad("/images must have 3 channels (HWC), has " + std::to_string(dims[3]));
      if (dims[0] == 0 || dims[1] == 0) throw bad("/images is empty");
      n_ = (int64_t)dims[0];
      S_ = (int)dims[1];
    }

    // /labels, read whole (N integers) and checked once
    if (H5Lexists(file.id, "labels", H5P_DEFAULT) <= 0) throw bad("missing dataset /labels");
    H5Handle labels(H5Dopen2(file.id, "labels", H5P_DEFAULT), H5Dclose);
    if (labels.id < 0) throw bad("/labels is not a dataset");
    {
      H5Handle type(H5Dget_type(labels.id), H5Tclose);
      if (H5Tget_class(type.id) != H5T_INTEGER) throw bad("/labels must be an integer dataset");
      H5Handle space(H5Dget_space(labels.id), H5Sclose);
      int rank = H5Sget_simple_extent_ndims(space.id);
      if (rank != 1) throw bad("/labels must have rank 1 [N], has rank " + std::to_string(rank));
      hsize_t n = 0;
      H5Sget_simple_extent_dims(space.id, &n, nullptr);
      if ((int64_t)n != n_)
        throw bad("/labels has " + std::to_string(n) + " entries but /images has " + std::to_string(n_));
      std::vector<int64_t> l(n);
      // HDF5 converts any stored integer type to int64 on the way in
      if (H5Dread(labels.id, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, l.data()) < 0)
        throw bad("cannot read /labels");
      int64_t lo = *std::min_element(l.begin(), l.end());
      int64_t hi = *std::max_element(l.begin(), l.end());
      if (lo < 0) throw bad("/labels holds a negative label (" + std::to_string(lo) + ")");
      if (hi > (1 << 30)) throw bad("/labels holds an implausible label (" + std::to_string(hi) + ")");
      labels_.assign(l.begin(), l.end());
      K_ = (int)hi + 1;
    }

    // root attribute num_classes (optional)
    if (H5Aexists(file.id, "num_classes") > 0) {
      H5Handle attr(H5Aopen(file.id, "num_classes", H5P_DEFAULT), H5Aclose);
      H5Handle type(H5Aget_type(attr.id), H5Tclose);
      H5Handle space(H5Aget_space(attr.id), H5Sclose);
      if (attr.id < 0 || H5Tget_class(type.id) != H5T_INTEGER || H5Sget_simple_extent_npoints(space.id) != 1)
        throw bad("root attribute num_classes must be one integer");
      int64_t k = 0;
      if (H5Aread(attr.id, H5T_NATIVE_INT64, &k) < 0) throw bad("cannot read attribute num_classes");
      if (k < 1) throw bad("attribute num_classes = " + std::to_string(k) + " must be >= 1");
      if (k < K_)
        throw bad("/labels holds label " + std::to_string(K_ - 1) + " but attribute num_classes = " +
                  std::to_string(k));
      K_ = (int)k;
    }
    images_ = images.release();
    file_ = file.release();
  }

  ~Hdf5ImageDataset() override {
    std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
    H5Dclose(images_);
    H5Fclose(file_);
  }

  int64_t size() const override { return n_; }
  int image_size() const override { return S_; }
  int num_classes() const override { return K_; }
  std::string describe() const override {
    return "hdf5(" + path_ + ", n=" + std::to_string(n_) + ", " + std::to_string(S_) + "x" +
           std::to_string(S_) + ", classes=" + std::to_string(K_) + ")";
  }

  // Selects the distinct requested samples as a union of hyperslabs (sorted, runs coalesced)
  // and reads them in one H5Dread; then scatters them to the requested order (indices may
  // repeat, e.g. a Mixup partner that is also in the batch).
  void read(const int64_t* idx, int n, uint8_t* images, int32_t* labels) override {
    if (n <= 0) return;
    std::vector<int64_t> uniq(idx, idx + n);
    for (int64_t i : uniq)
      if (i < 0 || i >= n_)
        throw std::out_of_range("HDF5 images " + path_ + ": index " + std::to_string(i) +
                                " outside [0, " + std::to_string(n_) + ")");
    std::sort(uniq.begin(), uniq.end());
    uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
    const size_t img = (size_t)S_ * S_ * 3;
    const bool direct = (int)uniq.size() == n && std::is_sorted(idx, idx + n);
    std::vector<uint8_t> tmp;
    uint8_t* dst = images;
    if (!direct) {
      tmp.resize(uniq.size() * img);
      dst = tmp.data();
    }
    {
      std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
      H5Handle fspace(H5Dget_space(images_), H5Sclose);
      if (fspace.id < 0) throw std::runtime_error("HDF5 images " + path_ + ": H5Dget_space failed");
      H5Sselect_none(fspace.id);
      hsize_t count[4] = {0, (hsize_t)S_, (hsize_t)S_, 3};
      for (size_t a = 0; a < uniq.size();) {
        size_t e = a + 1;
        while (e < uniq.size() && uniq[e] == uniq[e - 1] + 1) ++e;
        hsize_t start[4] = {(hsize_t)uniq[a], 0, 0, 0};
        count[0] = (hsize_t)(e - a);
        if (H5Sselect_hyperslab(fspace.id, H5S_SELECT_OR, start, nullptr, count, nullptr) < 0)
          throw std::runtime_error("HDF5 images " + path_ + ": hyperslab selection failed");
        a = e;
      }
      hsize_t mdims[4] = {(hsize_t)uniq.size(), (hsize_t)S_, (hsize_t)S_, 3};
      H5Handle mspace(H5Screate_simple(4, mdims, nullptr), H5Sclose);
      if (H5Dread(images_, H5T_NATIVE_UCHAR, mspace.id, fspace.id, H5P_DEFAULT, dst) < 0)
        throw std::runtime_error("HDF5 images " + path_ + ": reading /images failed");
    }
    if (!direct) {
      for (int k = 0; k < n; ++k) {
        size_t u = (size_t)(std::lower_bound(uniq.begin(), uniq.end(), idx[k]) - uniq.begin());
        std::memcpy(images + (size_t)k * img, tmp.data() + u * img, img);
      }
    }
    for (int k = 0; k < n; ++k) labels[k] = labels_[(size_t)idx[k]];
  }

 private:
  std::string path_;
  hid_t file_ = -1, images_ = -1;
  int64_t n_ = 0;
  int S_ = 0, K_ = 0;
  std::vector<int32_t> labels_;
};

}  // namespace

std::unique_ptr<Dataset> make_hdf5_images(const std::string& path) {
  return std::make_unique<Hdf5ImageDataset>(path);
}

}  // namespace vitgrid
