// Packed JPEG files (vitgrid_dataset pack writes them; readable with h5py alone), one per split:
// /jpeg uint8 [total] (the encoded files back to back), /offsets int64 [N+1], /labels int64 [N],
// /classes strings [K] (variable or fixed length), root attributes num_classes and source.
//
// At open the small datasets are read with the HDF5 library (serially, default sec2 driver,
// holding hdf5_mutex(), after the metadata was walked in the checker process: damaged metadata
// can crash the library) and validated. /jpeg must be contiguous and unfiltered: its file
// offset (H5Dget_offset) is taken once and every read() is then one pread() on a descriptor of
// our own, without the library or its lock, so the loader's threads read in parallel.
//
// Path resolution: data.path may be what `vitgrid_dataset pack` was given (X.h5, meaning
// X_train.h5 and X_val.h5) or a split file (X_train.h5, whose eval split is X_val.h5); an
// explicit eval_path wins for the eval split.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "h5_handle.h"
#include "vitgrid/core/error.h"
#include "vitgrid/data/image_source.h"
#include "vitgrid/io/hdf5_util.h"

namespace vitgrid {
namespace {

bool ends_with(const std::string& s, const std::string& t) {
  return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
}

bool is_file(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// The file of the requested split.
std::string resolve(const std::string& path, const ImageSourceOptions& o) {
  if (!o.train && !o.eval_path.empty()) return o.eval_path;
  if (ends_with(path, "_train.h5"))
    return o.train ? path : path.substr(0, path.size() - 9) + "_val.h5";
  if (ends_with(path, "_val.h5")) {
    if (!o.train) return path;
    throw UserError("packed JPEG " + path + ": this is an eval split file; name the train file (" +
                    path.substr(0, path.size() - 7) + "_train.h5) or the prefix (" +
                    path.substr(0, path.size() - 7) + ".h5)");
  }
  const std::string stem = ends_with(path, ".h5") ? path.substr(0, path.size() - 3) : path;
  const std::string split = stem + (o.train ? "_train.h5" : "_val.h5");
  if (is_file(split) || !is_file(path)) return split;
  // A single packed file under another name: it is the train split; eval needs naming.
  if (o.train) return path;
  throw UserError("packed JPEG " + path + ": no eval split file " + split +
                  " beside it; name the eval file (eval_path)");
}

class JpegH5Source final : public ImageSource {
 public:
  JpegH5Source(const std::string& given, const ImageSourceOptions& o)
      : path_(resolve(given, o)), train_(o.train) {
    struct stat st;
    if (stat(path_.c_str(), &st) != 0)
      throw bad(errno == ENOENT ? std::string("no such file") +
                                      (path_ != given ? " (resolved from " + given + ")" : "")
                                : std::string("cannot use the file: ") + std::strerror(errno));
    if (!S_ISREG(st.st_mode))
      throw bad(S_ISDIR(st.st_mode) ? "is a directory, not a file" : "not a regular file");
    const uint64_t fsize = (uint64_t)st.st_size;

    std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
    io_detail::H5ErrorSilencer quiet;
    if (H5Fis_hdf5(path_.c_str()) <= 0) throw bad("not an HDF5 file");
    if (const std::string why = io_detail::hdf5_metadata_problem_isolated(path_); !why.empty())
      throw bad("damaged: " + why);
    H5Handle file(H5Fopen(path_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    if (file.id < 0) throw bad("cannot open the file read-only");

    // /jpeg: uint8, rank 1, contiguous, no filters, stored inside the file
    if (H5Lexists(file.id, "jpeg", H5P_DEFAULT) <= 0) throw bad("missing dataset /jpeg");
    H5Handle jpeg(H5Dopen2(file.id, "jpeg", H5P_DEFAULT), H5Dclose);
    if (jpeg.id < 0) throw bad("/jpeg is not a dataset");
    uint64_t total = 0;
    {
      H5Handle type(H5Dget_type(jpeg.id), H5Tclose);
      if (H5Tget_class(type.id) != H5T_INTEGER || H5Tget_size(type.id) != 1)
        throw bad("/jpeg must be uint8");
      H5Handle space(H5Dget_space(jpeg.id), H5Sclose);
      if (H5Sget_simple_extent_ndims(space.id) != 1) throw bad("/jpeg must have rank 1");
      hsize_t n = 0;
      H5Sget_simple_extent_dims(space.id, &n, nullptr);
      total = (uint64_t)n;
      H5Handle dcpl(H5Dget_create_plist(jpeg.id), H5Pclose);
      if (dcpl.id < 0) throw bad("/jpeg: no creation property list");
      const H5D_layout_t layout = H5Pget_layout(dcpl.id);
      if (layout != H5D_CONTIGUOUS || H5Pget_nfilters(dcpl.id) != 0 ||
          H5Pget_external_count(dcpl.id) > 0)
        throw bad(std::string("/jpeg is ") +
                  (layout == H5D_CHUNKED      ? "chunked"
                   : layout == H5D_COMPACT    ? "compact"
                   : layout == H5D_VIRTUAL    ? "virtual"
                   : H5Pget_nfilters(dcpl.id) ? "filtered"
                                              : "stored externally") +
                  "; the reader needs it contiguous and uncompressed: repack it with "
                  "`vitgrid_dataset pack`");
      if (total > 0) {
        const haddr_t off = H5Dget_offset(jpeg.id);  // absolute: includes any user block
        if (off == HADDR_UNDEF) throw bad("/jpeg was never written");
        if ((uint64_t)off > fsize || total > fsize - (uint64_t)off)
          throw bad("/jpeg ends at byte " + std::to_string((uint64_t)off + total) +
                    " but the file has " + std::to_string(fsize) + " bytes (truncated file?)");
        base_ = (uint64_t)off;
      }
    }

    // /offsets int64 [N+1]
    offsets_ = read_ints(file.id, "offsets", fsize);
    if (offsets_.size() < 2) throw bad("/offsets must hold N+1 >= 2 entries (no images?)");
    const size_t n = offsets_.size() - 1;
    if (offsets_[0] != 0) throw bad("/offsets[0] = " + std::to_string(offsets_[0]) + ", not 0");
    for (size_t i = 0; i < n; ++i)
      if (offsets_[i + 1] < offsets_[i])
        throw bad("/offsets is not monotone: /offsets[" + std::to_string(i + 1) +
                  "] = " + std::to_string(offsets_[i + 1]) + " < /offsets[" + std::to_string(i) +
                  "] = " + std::to_string(offsets_[i]));
    if ((uint64_t)offsets_[n] != total)
      throw bad("/offsets[N] = " + std::to_string(offsets_[n]) + " but /jpeg holds " +
                std::to_string(total) + " bytes");

    // /labels int64 [N]
    const std::vector<int64_t> l = read_ints(file.id, "labels", fsize);
    if (l.size() != n)
      throw bad("/labels has " + std::to_string(l.size()) + " entries, /offsets describes " +
                std::to_string(n) + " images");

    // /classes strings [K], root attribute num_classes
    if (H5Lexists(file.id, "classes", H5P_DEFAULT) > 0) classes_ = read_strings(file.id, "classes");
    int64_t k = -1;
    if (H5Aexists(file.id, "num_classes") > 0) {
      H5Handle attr(H5Aopen(file.id, "num_classes", H5P_DEFAULT), H5Aclose);
      H5Handle type(H5Aget_type(attr.id), H5Tclose);
      H5Handle space(H5Aget_space(attr.id), H5Sclose);
      if (attr.id < 0 || H5Tget_class(type.id) != H5T_INTEGER ||
          H5Sget_simple_extent_npoints(space.id) != 1 || H5Aread(attr.id, H5T_NATIVE_INT64, &k) < 0)
        throw bad("root attribute num_classes must be one integer");
      if (k < 1 || k > (1 << 30)) throw bad("attribute num_classes = " + std::to_string(k));
      if (!classes_.empty() && (size_t)k != classes_.size())
        throw bad("attribute num_classes = " + std::to_string(k) + " but /classes holds " +
                  std::to_string(classes_.size()) + " names");
    } else if (!classes_.empty()) {
      k = (int64_t)classes_.size();
    } else {
      throw bad("neither a root attribute num_classes nor /classes: the class count is unknown");
    }
    K_ = (int)k;
    labels_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      if (l[i] < 0 || l[i] >= K_)
        throw bad("/labels[" + std::to_string(i) + "] = " + std::to_string(l[i]) + " outside [0, " +
                  std::to_string(K_) + ")");
      labels_[i] = (int32_t)l[i];
    }

    if (H5Aexists(file.id, "source") > 0) source_ = read_string_attr(file.id, "source");

    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw bad(std::string("cannot open for reading: ") + std::strerror(errno));
  }

  ~JpegH5Source() override {
    if (fd_ >= 0) ::close(fd_);
  }

  int64_t size() const override { return (int64_t)labels_.size(); }
  int num_classes() const override { return K_; }
  std::vector<std::string> class_names() const override { return classes_; }

  void read(int64_t i, std::vector<uint8_t>& bytes, int32_t& label) const override {
    check(i);
    const uint64_t lo = (uint64_t)offsets_[(size_t)i], hi = (uint64_t)offsets_[(size_t)i + 1];
    bytes.resize((size_t)(hi - lo));
    size_t got = 0;
    while (got < bytes.size()) {
      const ssize_t r =
          ::pread(fd_, bytes.data() + got, bytes.size() - got, (off_t)(base_ + lo + got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0)
        throw bad("reading image " + std::to_string(i) + " failed: " + std::strerror(errno));
      if (r == 0)
        throw bad("/jpeg ends early at image " + std::to_string(i) +
                  " (the file was truncated while open?)");
      got += (size_t)r;
    }
    label = labels_[(size_t)i];
  }

  std::string where(int64_t i) const override {
    check(i);
    return path_ + " image " + std::to_string(i) + " (/jpeg bytes " +
           std::to_string(offsets_[(size_t)i]) + ".." + std::to_string(offsets_[(size_t)i + 1]) +
           ")";
  }

  std::string describe() const override {
    return "jpeg_h5(" + path_ + ", " + (train_ ? "train" : "eval") + ", " + std::to_string(size()) +
           " images, " + std::to_string(offsets_.back()) + " bytes, classes=" + std::to_string(K_) +
           (source_.empty() ? std::string() : ", source: " + source_) + ")";
  }

 private:
  UserError bad(const std::string& what) const {
    return UserError("packed JPEG " + path_ + ": " + what);
  }

  void check(int64_t i) const {
    if (i < 0 || i >= size())
      throw std::out_of_range("packed JPEG " + path_ + ": index " + std::to_string(i) +
                              " outside [0, " + std::to_string(size()) + ")");
  }

  // A rank-1 integer dataset read as int64 (HDF5 converts). Its length is bounded by the file
  // size before allocating: a damaged header can claim any count.
  std::vector<int64_t> read_ints(hid_t file, const char* name, uint64_t fsize) const {
    const std::string nm = std::string("/") + name;
    if (H5Lexists(file, name, H5P_DEFAULT) <= 0) throw bad("missing dataset " + nm);
    H5Handle d(H5Dopen2(file, name, H5P_DEFAULT), H5Dclose);
    if (d.id < 0) throw bad(nm + " is not a dataset");
    H5Handle type(H5Dget_type(d.id), H5Tclose);
    if (H5Tget_class(type.id) != H5T_INTEGER) throw bad(nm + " must be an integer dataset");
    H5Handle space(H5Dget_space(d.id), H5Sclose);
    if (H5Sget_simple_extent_ndims(space.id) != 1) throw bad(nm + " must have rank 1");
    hsize_t n = 0;
    H5Sget_simple_extent_dims(space.id, &n, nullptr);
    if (n > fsize) throw bad(nm + " claims " + std::to_string(n) + " entries (corrupted header?)");
    std::vector<int64_t> v((size_t)n);
    if (n > 0 && H5Dread(d.id, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) < 0)
      throw bad("cannot read " + nm);
    return v;
  }

  // A rank-1 string dataset, variable or fixed length.
  std::vector<std::string> read_strings(hid_t file, const char* name) const {
    const std::string nm = std::string("/") + name;
    H5Handle d(H5Dopen2(file, name, H5P_DEFAULT), H5Dclose);
    if (d.id < 0) throw bad(nm + " is not a dataset");
    H5Handle type(H5Dget_type(d.id), H5Tclose);
    if (H5Tget_class(type.id) != H5T_STRING) throw bad(nm + " must hold strings");
    H5Handle space(H5Dget_space(d.id), H5Sclose);
    if (H5Sget_simple_extent_ndims(space.id) != 1) throw bad(nm + " must have rank 1");
    hsize_t n = 0;
    H5Sget_simple_extent_dims(space.id, &n, nullptr);
    if (n > (1u << 30)) throw bad(nm + " claims " + std::to_string(n) + " names");
    std::vector<std::string> out((size_t)n);
    if (n == 0) return out;
    if (H5Tis_variable_str(type.id) > 0) {
      H5Handle mt(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(mt.id, H5T_VARIABLE);
      H5Tset_cset(mt.id, H5Tget_cset(type.id));
      std::vector<char*> p((size_t)n, nullptr);
      if (H5Dread(d.id, mt.id, H5S_ALL, H5S_ALL, H5P_DEFAULT, p.data()) < 0)
        throw bad("cannot read " + nm);
      for (size_t i = 0; i < p.size(); ++i) out[i] = p[i] ? p[i] : "";
      H5Dvlen_reclaim(mt.id, space.id, H5P_DEFAULT, p.data());
    } else {
      const size_t len = H5Tget_size(type.id);
      if (len == 0 || len > 4096) throw bad(nm + ": implausible string size");
      H5Handle mt(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(mt.id, len);
      H5Tset_strpad(mt.id, H5T_STR_NULLPAD);
      std::vector<char> buf((size_t)n * len);
      if (H5Dread(d.id, mt.id, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) < 0)
        throw bad("cannot read " + nm);
      for (size_t i = 0; i < (size_t)n; ++i) {
        std::string s(buf.data() + i * len, len);
        s.erase(std::find(s.begin(), s.end(), '\0'), s.end());
        while (!s.empty() && s.back() == ' ') s.pop_back();  // space-padded (Fortran style)
        out[i] = s;
      }
    }
    return out;
  }

  std::string read_string_attr(hid_t file, const char* name) const {
    H5Handle a(H5Aopen(file, name, H5P_DEFAULT), H5Aclose);
    H5Handle type(H5Aget_type(a.id), H5Tclose);
    H5Handle space(H5Aget_space(a.id), H5Sclose);
    if (a.id < 0 || H5Tget_class(type.id) != H5T_STRING ||
        H5Sget_simple_extent_npoints(space.id) != 1)
      return "";
    if (H5Tis_variable_str(type.id) > 0) {
      H5Handle mt(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(mt.id, H5T_VARIABLE);
      char* p = nullptr;
      if (H5Aread(a.id, mt.id, &p) < 0) return "";
      std::string s = p ? p : "";
      H5Dvlen_reclaim(mt.id, space.id, H5P_DEFAULT, &p);
      return s;
    }
    const size_t len = H5Tget_size(type.id);
    if (len == 0 || len > (1u << 20)) return "";
    H5Handle mt(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mt.id, len);
    std::vector<char> buf(len + 1, '\0');
    if (H5Aread(a.id, mt.id, buf.data()) < 0) return "";
    return std::string(buf.data());
  }

  std::string path_;
  bool train_;
  uint64_t base_ = 0;  // file offset of /jpeg
  int fd_ = -1;
  int K_ = 0;
  std::vector<int64_t> offsets_;
  std::vector<int32_t> labels_;
  std::vector<std::string> classes_;
  std::string source_;
};

}  // namespace

std::unique_ptr<ImageSource> open_jpeg_h5(const std::string& path, const ImageSourceOptions& o) {
  return std::make_unique<JpegH5Source>(path, o);
}

}  // namespace vitgrid
