// The packed HDF5 image file: /images uint8 [N,S,S,3] (contiguous or chunked), /labels integer
// [N], root attribute num_classes (optional: max label + 1 when absent).
//
// Each process opens the file read-only with the default sec2 (POSIX) driver, not MPI-IO:
// reads happen on the loader's background threads, and an MPI-IO read there would make MPI
// calls concurrently with the main thread's collectives, which needs MPI_THREAD_MULTIPLE
// everywhere in the process. Independent POSIX reads of a read-only file need no
// coordination and the page cache serves ranks on the same node.
//
// Two read paths:
//  * direct (the common case): /images stored without filters, either contiguous or chunked
//    with chunks [c,S,S,3] (whole images per chunk, as vitgrid_dataset wrote before it went
//    contiguous). The constructor resolves every image's byte offset in the file (one offset,
//    or one per chunk), checks those bytes lie inside the file, then closes the HDF5 handles.
//    read() is plain pread()/preadv() on a descriptor of our own: no HDF5 call, no
//    hdf5_mutex(), so the loader's worker threads read in parallel.
//  * HDF5 (fallback: compressed or otherwise filtered data, chunks that split images, external
//    or virtual storage, unallocated data): hyperslab reads through the library, holding
//    hdf5_mutex() (Debian's parallel HDF5 is not thread-safe and the main thread writes
//    metrics and checkpoints with the same library), with a chunk cache of a few chunks so a
//    batch's samples that share a chunk decompress it once.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "h5_handle.h"
#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"
#include "vitgrid/io/hdf5_util.h"

namespace vitgrid {
namespace {

// The innermost message on HDF5's current error stack ("truncated file: eof = ..."), or "".
std::string hdf5_error_detail() {
  std::string detail;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* e, void* out) -> herr_t {
        if (n == 0 && e && e->desc) *static_cast<std::string*>(out) = e->desc;
        return 0;
      },
      &detail);
  return detail;
}

bool is_prime(size_t x) {
  if (x < 2) return false;
  for (size_t d = 2; d * d <= x; ++d)
    if (x % d == 0) return false;
  return true;
}

class Hdf5ImageDataset final : public Dataset {
 public:
  explicit Hdf5ImageDataset(const std::string& path) : path_(path) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0)
      throw bad(errno == ENOENT ? std::string("no such file")
                                : std::string("cannot use the file: ") + std::strerror(errno));
    // A FIFO or a device (/dev/zero) is no image file, and HDF5 would block on or read it forever.
    if (!S_ISREG(st.st_mode))
      throw bad(S_ISDIR(st.st_mode) ? "is a directory, not a file" : "not a regular file");

    std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
    io_detail::H5ErrorSilencer quiet;
    if (H5Fis_hdf5(path.c_str()) <= 0) throw bad("not an HDF5 file");
    // damaged metadata can crash the HDF5 library, not only fail in it: walked in a process of
    // its own first
    if (const std::string why = io_detail::hdf5_metadata_problem_isolated(path); !why.empty())
      throw bad("damaged: " + why);
    H5Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    if (file.id < 0) {
      const std::string d = hdf5_error_detail();
      throw bad("cannot open the file read-only" + (d.empty() ? std::string() : " (" + d + ")"));
    }

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
      if (rank != 4)
        throw bad("/images must have rank 4 [N,S,S,3], has rank " + std::to_string(rank));
      hsize_t dims[4];
      H5Sget_simple_extent_dims(space.id, dims, nullptr);
      if (dims[1] != dims[2])
        throw bad("/images is not square (" + std::to_string(dims[1]) + "x" +
                  std::to_string(dims[2]) + ")");
      if (dims[3] != 3)
        throw bad("/images must have 3 channels (HWC), has " + std::to_string(dims[3]));
      if (dims[0] == 0 || dims[1] == 0) throw bad("/images is empty");
      n_ = (int64_t)dims[0];
      S_ = (int)dims[1];
      img_ = (size_t)S_ * S_ * 3;
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
        throw bad("/labels has " + std::to_string(n) + " entries but /images has " +
                  std::to_string(n_));
      // The shape comes from the file: a corrupted header can claim any N. Every image needs
      // S*S*3 bytes somewhere, so a count the file could never hold is refused before the
      // label buffer is sized from it (filters may compress, but not below a byte per image).
      if (n > (hsize_t)st.st_size)
        throw bad("/labels and /images claim " + std::to_string(n) + " samples but the file has " +
                  std::to_string((long long)st.st_size) + " bytes (corrupted header?)");
      std::vector<int64_t> l;
      try {
        l.resize(n);
        labels_.reserve(n);
      } catch (const std::bad_alloc&) {
        throw bad("cannot allocate memory for " + std::to_string(n) + " labels");
      }
      // HDF5 converts any stored integer type to int64 on the way in
      if (H5Dread(labels.id, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, l.data()) < 0)
        throw bad("cannot read /labels");
      int64_t lo = *std::min_element(l.begin(), l.end());
      int64_t hi = *std::max_element(l.begin(), l.end());
      if (lo < 0) throw bad("/labels holds a negative label (" + std::to_string(lo) + ")");
      if (hi > (1 << 30))
        throw bad("/labels holds an implausible label (" + std::to_string(hi) + ")");
      labels_.assign(l.begin(), l.end());
      K_ = (int)hi + 1;
    }

    // root attribute num_classes (optional)
    if (H5Aexists(file.id, "num_classes") > 0) {
      H5Handle attr(H5Aopen(file.id, "num_classes", H5P_DEFAULT), H5Aclose);
      H5Handle type(H5Aget_type(attr.id), H5Tclose);
      H5Handle space(H5Aget_space(attr.id), H5Sclose);
      if (attr.id < 0 || H5Tget_class(type.id) != H5T_INTEGER ||
          H5Sget_simple_extent_npoints(space.id) != 1)
        throw bad("root attribute num_classes must be one integer");
      int64_t k = 0;
      if (H5Aread(attr.id, H5T_NATIVE_INT64, &k) < 0)
        throw bad("cannot read attribute num_classes");
      if (k < 1) throw bad("attribute num_classes = " + std::to_string(k) + " must be >= 1");
      if (k < K_)
        throw bad("/labels holds label " + std::to_string(K_ - 1) +
                  " but attribute num_classes = " + std::to_string(k));
      K_ = (int)k;
    } else {
      // The labels only bound the class count from below: a split that lacks the last classes
      // would build a smaller head than the data set has, or fail the model.num_classes check
      // with a count the user never wrote down.
      warning_ = "HDF5 images " + path_ + " has no root attribute num_classes: the class count " +
                 "is inferred from /labels as the largest label + 1 = " + std::to_string(K_) +
                 "; set the attribute to state it (h5py: f.attrs['num_classes'] = K)";
    }

    // Where the pixels are: direct reads if possible, else the library with a chunk cache.
    const std::string why_not = plan_direct(images.id);
    if (why_not.empty()) {
      check_direct_ranges();
      fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd_ < 0) throw bad(std::string("cannot open for reading: ") + std::strerror(errno));
      bool agree = false;
      try {
        agree = agrees_with_hdf5(images.id);
      } catch (...) {
        ::close(fd_);
        throw;
      }
      if (!agree) {  // a layout we misread: never serve wrong bytes
        ::close(fd_);
        fd_ = -1;
        io_ = "hdf5 reads (direct offsets did not match the library's)";
      }
    } else {
      io_ = "hdf5 reads (" + why_not + ")";
    }
    if (fd_ >= 0) return;  // the HDF5 handles close here: read() never calls the library
    if (chunk_bytes_ > 0) {
      // Reopen with a chunk cache holding a few chunks (HDF5's default is 1 MiB, less than
      // one chunk of 64 images at 224 px, so every sample would decode a whole chunk).
      const size_t cap = (size_t)256 << 20;
      const size_t keep = std::max<size_t>(1, std::min<size_t>(4, cap / chunk_bytes_));
      const size_t nbytes = std::max<size_t>((size_t)1 << 20, keep * chunk_bytes_);
      size_t nslots = std::max<size_t>(521, 100 * keep);
      while (!is_prime(nslots)) ++nslots;
      // (Close first: a second open of an open dataset shares it, cache and all.)
      H5Dclose(images.release());
      H5Handle dapl(H5Pcreate(H5P_DATASET_ACCESS), H5Pclose);
      // w0 stays at HDF5's default 0.75: with 1.0, HDF5 1.10.8 never evicts partly read
      // chunks and the cache grows to the whole decompressed dataset.
      if (dapl.id < 0 || H5Pset_chunk_cache(dapl.id, nslots, nbytes, 0.75) < 0)
        throw bad("cannot set up the chunk cache for /images");
      images.id = H5Dopen2(file.id, "images", dapl.id);
      if (images.id < 0) throw bad("cannot reopen /images");
    }
    images_ = images.release();
    file_ = file.release();
    // Decode the first and the last sample now, as the direct path compares them: filter
    // parameters damaged in the header, or a last chunk cut short, fail every read of the run,
    // and here every rank still agrees on the refusal. (A chunk damaged in the middle is only
    // found when a batch reads it.)
    try {
      for (int64_t i : {int64_t{0}, n_ - 1}) {
        std::vector<uint8_t> probe(img_);
        read_hdf5(&i, 1, probe.data());
      }
    } catch (const std::exception& e) {
      H5Dclose(images_);
      H5Fclose(file_);
      images_ = file_ = -1;
      throw UserError(e.what());
    }
  }

  ~Hdf5ImageDataset() override {
    if (fd_ >= 0) ::close(fd_);
    if (images_ >= 0 || file_ >= 0) {
      std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
      if (images_ >= 0) H5Dclose(images_);
      if (file_ >= 0) H5Fclose(file_);
    }
  }

  int64_t size() const override { return n_; }
  int image_size() const override { return S_; }
  int num_classes() const override { return K_; }
  std::string describe() const override {
    return "hdf5(" + path_ + ", n=" + std::to_string(n_) + ", " + std::to_string(S_) + "x" +
           std::to_string(S_) + ", classes=" + std::to_string(K_) + ", " + layout_ + ", " + io_ +
           ")";
  }

  std::string warning() const override { return warning_; }

  // Indices may repeat (a Mixup partner that is also in the batch) and come in any order.
  void read(const int64_t* idx, int n, uint8_t* images, int32_t* labels) override {
    if (n <= 0) return;
    for (int k = 0; k < n; ++k)
      if (idx[k] < 0 || idx[k] >= n_)
        throw std::out_of_range("HDF5 images " + path_ + ": index " + std::to_string(idx[k]) +
                                " outside [0, " + std::to_string(n_) + ")");
    if (fd_ >= 0)
      read_direct(idx, n, images);
    else
      read_hdf5(idx, n, images);
    for (int k = 0; k < n; ++k) labels[k] = labels_[(size_t)idx[k]];
  }

 private:
  UserError bad(const std::string& what) const {
    return UserError("HDF5 images " + path_ + ": " + what);
  }

  // Byte offset of image i in the file (direct path).
  uint64_t offset_of(int64_t i) const {
    return chunk_addr_[(size_t)(i / chunk_n_)] + (uint64_t)(i % chunk_n_) * img_;
  }

  // Fills layout_ and, when /images can be read directly, chunk_n_ and chunk_addr_. Returns ""
  // if it can, else why not (the caller holds hdf5_mutex()).
  std::string plan_direct(hid_t images) {
    H5Handle dcpl(H5Dget_create_plist(images), H5Pclose);
    if (dcpl.id < 0) return "no creation property list";
    const H5D_layout_t layout = H5Pget_layout(dcpl.id);
    const int nfilters = H5Pget_nfilters(dcpl.id);
    hsize_t cdims[4] = {0, 0, 0, 0};
    if (layout == H5D_CHUNKED) {
      if (H5Pget_chunk(dcpl.id, 4, cdims) != 4) return "unreadable chunk shape";
      chunk_bytes_ = (size_t)(cdims[0] * cdims[1] * cdims[2] * cdims[3]);
      layout_ = "chunked [" + std::to_string(cdims[0]) + "," + std::to_string(cdims[1]) + "," +
                std::to_string(cdims[2]) + "," + std::to_string(cdims[3]) + "]";
    } else {
      layout_ = layout == H5D_CONTIGUOUS ? "contiguous"
                : layout == H5D_COMPACT  ? "compact"
                                         : "virtual";
    }
    if (nfilters != 0) {  // compressed (or shuffled, checksummed...): only the library can decode
      std::string names;
      for (int f = 0; f < nfilters; ++f) {
        unsigned flags = 0, config = 0;
        size_t ncd = 0;
        char name[64] = {0};
        const H5Z_filter_t id =
            H5Pget_filter2(dcpl.id, (unsigned)f, &flags, &ncd, nullptr, sizeof name, name, &config);
        names +=
            (f ? ", " : "") + (name[0] ? std::string(name) : "filter " + std::to_string((int)id));
      }
      return "filters: " + names;
    }
    if (H5Pget_external_count(dcpl.id) > 0) return "external storage";
    if (layout == H5D_CONTIGUOUS) {
      const haddr_t off = H5Dget_offset(images);  // absolute: includes any user block
      if (off == HADDR_UNDEF) return "/images never written";
      if (H5Dget_storage_size(images) < (hsize_t)n_ * img_) return "short storage";
      chunk_n_ = n_;
      chunk_addr_.assign(1, (uint64_t)off);
      return "";
    }
    if (layout != H5D_CHUNKED) return layout_ + " layout";
#if H5_VERSION_GE(1, 10, 5)
    if (cdims[1] != (hsize_t)S_ || cdims[2] != (hsize_t)S_ || cdims[3] != 3 || cdims[0] < 1)
      return "chunks split images";
    // Chunk addresses are relative to the HDF5 base address (the user block size, 0 normally).
    hsize_t base = 0;
    {
      H5Handle file(H5Iget_file_id(images), H5Fclose);
      H5Handle fcpl(H5Fget_create_plist(file.id), H5Pclose);
      if (fcpl.id < 0 || H5Pget_userblock(fcpl.id, &base) < 0) return "unreadable file properties";
    }
    chunk_n_ = (int64_t)cdims[0];
    const int64_t nchunks = (n_ + chunk_n_ - 1) / chunk_n_;
    // One lookup per chunk. HDF5 1.10 answers each by walking the chunk index from its start
    // (H5Dget_chunk_info by position does the same), so the table costs ~nchunks^2/2 index
    // steps: ~5 s on a 2-core VM for 20k chunks (ImageNet-1k in the old tool's 64-image
    // chunks), minutes for 200k. Past kMaxChunkLookups, read through the library instead.
    constexpr int64_t kMaxChunkLookups = 32768;
    if (nchunks > kMaxChunkLookups)
      return std::to_string(nchunks) +
             " chunks, too many to map; vitgrid_dataset writes contiguous files";
    chunk_addr_.resize((size_t)nchunks);
    for (int64_t c = 0; c < nchunks; ++c) {
      hsize_t start[4] = {(hsize_t)(c * chunk_n_), 0, 0, 0};
      unsigned mask = 0;
      haddr_t addr = HADDR_UNDEF;
      hsize_t bytes = 0;
      if (H5Dget_chunk_info_by_coord(images, start, &mask, &addr, &bytes) < 0)
        return "chunk index unreadable";
      if (addr == HADDR_UNDEF || bytes == 0) return "unallocated chunk " + std::to_string(c);
      if (mask != 0 || bytes != (hsize_t)chunk_bytes_)
        return "chunk " + std::to_string(c) + " is not stored raw";
      chunk_addr_[(size_t)c] = (uint64_t)addr + base;
    }
    return "";
#else
    return "HDF5 < 1.10.5 cannot list chunks";
#endif
  }

  // Every image's bytes must lie inside the file: a file cut short (a copy interrupted) must
  // be refused here by name, not surface as short reads or zeros in the middle of training.
  void check_direct_ranges() const {
    struct stat st;
    if (stat(path_.c_str(), &st) != 0)
      throw bad(std::string("cannot stat: ") + std::strerror(errno));
    uint64_t end = 0;
    for (size_t c = 0; c < chunk_addr_.size(); ++c) {
      const int64_t have = std::min<int64_t>(chunk_n_, n_ - (int64_t)c * chunk_n_);
      end = std::max<uint64_t>(end, chunk_addr_[c] + (uint64_t)have * img_);
    }
    if (end > (uint64_t)st.st_size)
      throw bad("/images data ends at byte " + std::to_string(end) + " but the file has " +
                std::to_string((long long)st.st_size) + " bytes (truncated file?)");
  }

  // Reads the first and the last image both ways (the caller holds hdf5_mutex()).
  bool agrees_with_hdf5(hid_t images) {
    std::vector<uint8_t> a(img_), b(img_);
    for (int64_t i : {int64_t{0}, n_ - 1}) {
      H5Handle fspace(H5Dget_space(images), H5Sclose);
      hsize_t start[4] = {(hsize_t)i, 0, 0, 0}, count[4] = {1, (hsize_t)S_, (hsize_t)S_, 3};
      H5Handle mspace(H5Screate_simple(4, count, nullptr), H5Sclose);
      if (H5Sselect_hyperslab(fspace.id, H5S_SELECT_SET, start, nullptr, count, nullptr) < 0 ||
          H5Dread(images, H5T_NATIVE_UCHAR, mspace.id, fspace.id, H5P_DEFAULT, a.data()) < 0) {
        const std::string d = hdf5_error_detail();
        throw bad("reading /images failed" + (d.empty() ? std::string() : ": " + d));
      }
      read_direct(&i, 1, b.data());
      if (a != b) return false;
    }
    return true;
  }

  // pread()s each distinct sample into the slot of its first occurrence. Samples adjacent in
  // the file go in one preadv() (scattered into their slots, in any request order); repeats
  // are copied from the first occurrence after. No HDF5, no lock: thread-safe.
  void read_direct(const int64_t* idx, int n, uint8_t* images) const {
    std::vector<int> ord((size_t)n);
    std::iota(ord.begin(), ord.end(), 0);
    std::stable_sort(ord.begin(), ord.end(), [&](int a, int b) { return idx[a] < idx[b]; });
    std::vector<struct iovec> iov;
    iov.reserve(std::min(n, IOV_MAX));
    uint64_t run_off = 0, run_end = 0;
    for (size_t j = 0; j < ord.size(); ++j) {
      const int k = ord[j];
      if (j > 0 && idx[ord[j - 1]] == idx[k]) continue;  // a repeat: copied below
      const uint64_t off = offset_of(idx[k]);
      if (iov.empty() || off != run_end || (int)iov.size() == IOV_MAX) {
        if (!iov.empty()) preadv_all(iov, run_off);
        iov.clear();
        run_off = off;
        run_end = off;
      }
      iov.push_back({images + (size_t)k * img_, img_});
      run_end += img_;
    }
    if (!iov.empty()) preadv_all(iov, run_off);
    for (size_t j = 1; j < ord.size(); ++j)
      if (idx[ord[j]] == idx[ord[j - 1]]) {
        size_t first = j - 1;
        while (first > 0 && idx[ord[first - 1]] == idx[ord[j]]) --first;
        std::memcpy(images + (size_t)ord[j] * img_, images + (size_t)ord[first] * img_, img_);
      }
  }

  // Fills every buffer of iov from the file at `off`, retrying partial reads.
  void preadv_all(std::vector<struct iovec>& iov, uint64_t off) const {
    struct iovec* v = iov.data();
    int cnt = (int)iov.size();
    while (cnt > 0) {
      const ssize_t r = cnt == 1 ? ::pread(fd_, v->iov_base, v->iov_len, (off_t)off)
                                 : ::preadv(fd_, v, cnt, (off_t)off);
      if (r < 0) {
        if (errno == EINTR) continue;
        throw UserError("HDF5 images " + path_ + ": reading /images at byte " +
                        std::to_string(off) + " failed: " + std::strerror(errno));
      }
      if (r == 0)
        throw bad("/images ends early at byte " + std::to_string(off) +
                  " (the file was truncated while open?)");
      off += (uint64_t)r;
      size_t got = (size_t)r;
      while (cnt > 0 && got >= v->iov_len) {
        got -= v->iov_len;
        ++v;
        --cnt;
      }
      if (cnt > 0 && got > 0) {
        v->iov_base = static_cast<uint8_t*>(v->iov_base) + got;
        v->iov_len -= got;
      }
    }
  }

  // Reads the distinct requested samples in increasing order, one H5Dread of a plain hyperslab
  // per run of consecutive indices, then scatters them to the requested order. (One read of
  // the union of the runs is much slower: HDF5 1.10 maps an irregular selection onto each
  // chunk element-row by element-row.) In increasing order with a cache of a few chunks, each
  // chunk a call touches is read, and decompressed, once.
  void read_hdf5(const int64_t* idx, int n, uint8_t* images) {
    std::vector<int64_t> uniq(idx, idx + n);
    std::sort(uniq.begin(), uniq.end());
    uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
    const bool direct = (int)uniq.size() == n && std::is_sorted(idx, idx + n);
    std::vector<uint8_t> tmp;
    uint8_t* dst = images;
    if (!direct) {
      tmp.resize(uniq.size() * img_);
      dst = tmp.data();
    }
    {
      std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
      // A damaged chunk (its compressed bytes corrupted) is only found here, mid-run: one
      // message naming the file, the samples and HDF5's reason, not a page of library trace.
      io_detail::H5ErrorSilencer quiet;
      H5Handle fspace(H5Dget_space(images_), H5Sclose);
      if (fspace.id < 0) throw std::runtime_error("HDF5 images " + path_ + ": H5Dget_space failed");
      for (size_t a = 0; a < uniq.size();) {
        size_t e = a + 1;
        while (e < uniq.size() && uniq[e] == uniq[e - 1] + 1) ++e;
        hsize_t start[4] = {(hsize_t)uniq[a], 0, 0, 0};
        hsize_t count[4] = {(hsize_t)(e - a), (hsize_t)S_, (hsize_t)S_, 3};
        H5Handle mspace(H5Screate_simple(4, count, nullptr), H5Sclose);
        if (H5Sselect_hyperslab(fspace.id, H5S_SELECT_SET, start, nullptr, count, nullptr) < 0)
          throw std::runtime_error("HDF5 images " + path_ + ": hyperslab selection failed");
        if (H5Dread(images_, H5T_NATIVE_UCHAR, mspace.id, fspace.id, H5P_DEFAULT, dst + a * img_) <
            0) {
          const std::string d = hdf5_error_detail();
          throw UserError("HDF5 images " + path_ + ": reading /images samples " +
                          std::to_string(uniq[a]) + ".." + std::to_string(uniq[e - 1]) + " failed" +
                          (d.empty() ? std::string() : " (" + d + ")") + ": the file is damaged");
        }
        a = e;
      }
    }
    if (!direct) {
      for (int k = 0; k < n; ++k) {
        size_t u = (size_t)(std::lower_bound(uniq.begin(), uniq.end(), idx[k]) - uniq.begin());
        std::memcpy(images + (size_t)k * img_, tmp.data() + u * img_, img_);
      }
    }
  }

  std::string path_;
  hid_t file_ = -1, images_ = -1;  // fallback path only
  int fd_ = -1;                    // direct path only
  int64_t n_ = 0;
  int S_ = 0, K_ = 0;
  size_t img_ = 0;                     // bytes per image, S*S*3
  std::string layout_, io_ = "pread";  // for describe()
  int64_t chunk_n_ = 0;                // images per chunk (n_ when contiguous)
  size_t chunk_bytes_ = 0;             // chunked: bytes per (uncompressed) chunk
  std::vector<uint64_t> chunk_addr_;   // file offset of each chunk's first image
  std::vector<int32_t> labels_;
  std::string warning_;  // num_classes inferred
};

}  // namespace

std::unique_ptr<Dataset> make_hdf5_images(const std::string& path) {
  return std::make_unique<Hdf5ImageDataset>(path);
}

}  // namespace vitgrid
