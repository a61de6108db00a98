// vitgrid_dataset: writes datasets in the packed HDF5 format that data.dataset = hdf5 reads
// (/images uint8 [N,S,S,3] contiguous, /labels int32 [N], root attributes num_classes and
// source).
//
// /images is contiguous (its size is known up front): the reader then finds every image at
// offset + i*S*S*3 and pread()s it without the HDF5 library or its lock. (Files from older
// versions of this tool, chunked by 64 images, are still read directly, chunk by chunk.)
//
//   vitgrid_dataset cifar10 DIR OUT_PREFIX
//       -> OUT_PREFIX_train.h5 (data_batch_1..5.bin) and OUT_PREFIX_eval.h5 (test_batch.bin)
//   vitgrid_dataset synthetic OUT_PREFIX --train N --eval M --size S --classes K --seed X
//       -> the same two files holding exactly the bytes make_synthetic generates, so other
//          tools (PyTorch references, plots) can train on the data vitgrid trains on.
//   vitgrid_dataset pack SRC OUT.h5 [--source folder|tfrecord] [--eval-fraction F]
//                   [--label-offset N]
//       -> OUT_train.h5 and OUT_val.h5 in the packed JPEG layout (data.dataset = jpeg_h5):
//          /jpeg uint8 [total] contiguous, /offsets int64 [N+1], /labels int64 [N],
//          /classes strings [K], root attributes num_classes and source. SRC is an ImageFolder
//          tree or a TFRecord directory (shards train-* / validation-*: detected, or named by
//          --source). The encoded bytes are copied unchanged, streamed in bounded memory: a first
//          pass sizes /jpeg (file sizes; TFRecord records are read), the second writes it.
//          TFRecord labels are 1-based as build_imagenet_data.py writes them: the default label
//          offset there is -1 (pass --label-offset 0 for 0-based shards).
//          --short-side N [--quality Q] [--threads T]: each image whose shorter side exceeds N
//          is stored resized to N (torchvision's Resize(N) on the PIL image: Pillow's
//          antialiased bicubic) and re-encoded as Pillow's save(quality=Q) would (default 90),
//          on T threads; the others, and images that cannot be decoded, are copied unchanged.
//          Both passes transcode (the same bytes twice: no temporary copy). Root attributes
//          short_side and quality record it. For nodes whose CPUs cannot decode full-size
//          images as fast as their GPUs train (tools/MEASURED.md, "the packed form, resized").
//   vitgrid_dataset verify SRC [--eval-fraction F] [--label-offset N] [--threads T]
//       decodes every image of SRC (folder, TFRecord directory or packed .h5) with the CPU
//       decoder and lists each one that fails with the reason, then a count; exit 1 if any did.
//
// A serial tool: one process, HDF5's default sec2 driver, no MPI needed.
#include <hdf5.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"
#include "vitgrid/data/image_decode.h"
#include "vitgrid/data/image_encode.h"
#include "vitgrid/data/image_source.h"

namespace {

constexpr int64_t kWriteImages = 1024;  // images read from the source per write (bounded memory)

// Usage on stderr with exit 2 after an error; on stdout with exit 0 for --help.
[[noreturn]] void usage(const char* msg, std::FILE* out = stderr, int code = 2) {
  if (msg && *msg) std::fprintf(stderr, "vitgrid_dataset: %s\n", msg);
  std::fprintf(out,
               "usage:\n"
               "  vitgrid_dataset cifar10 DIR OUT_PREFIX\n"
               "  vitgrid_dataset synthetic OUT_PREFIX --train N --eval M --size S --classes K "
               "--seed X\n"
               "writes OUT_PREFIX_train.h5 and OUT_PREFIX_eval.h5 (packed HDF5 images)\n"
               "  vitgrid_dataset pack SRC OUT.h5 [--source folder|tfrecord] [--eval-fraction F]\n"
               "                  [--label-offset N] [--short-side N [--quality Q]] [--threads T]\n"
               "writes OUT_train.h5 and OUT_val.h5 (packed JPEG files) from an ImageFolder tree\n"
               "or a TFRecord directory; with --short-side, images whose shorter side exceeds N\n"
               "are stored resized to N (bicubic) and re-encoded at quality Q (default 90)\n"
               "  vitgrid_dataset verify SRC [--eval-fraction F] [--label-offset N] [--threads T]\n"
               "decodes every image of a folder tree, TFRecord directory or packed .h5; lists\n"
               "those that fail; exit 1 if any\n");
  std::exit(code);
}

#define H5_OK(call)                                                              \
  do {                                                                           \
    if ((call) < 0) throw std::runtime_error(std::string("HDF5 call failed: ") + #call); \
  } while (0)

// Copies every sample of `ds` into `path` (created or truncated).
void write_packed(vitgrid::Dataset& ds, const std::string& path, const std::string& source) {
  const int64_t n = ds.size();
  const int S = ds.image_size();
  const size_t img = (size_t)S * S * 3;
  hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (file < 0) throw vitgrid::UserError("cannot create " + path);

  hsize_t dims[4] = {(hsize_t)n, (hsize_t)S, (hsize_t)S, 3};
  hid_t fspace = H5Screate_simple(4, dims, nullptr);
  hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
  H5_OK(H5Pset_layout(dcpl, H5D_CONTIGUOUS));
  H5_OK(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));  // every byte is written below
  hid_t dimages = H5Dcreate2(file, "images", H5T_STD_U8LE, fspace, H5P_DEFAULT, dcpl, H5P_DEFAULT);
  H5_OK(dimages);
  hsize_t ldims[1] = {(hsize_t)n};
  hid_t lspace = H5Screate_simple(1, ldims, nullptr);
  hid_t dlabels = H5Dcreate2(file, "labels", H5T_STD_I32LE, lspace, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5_OK(dlabels);

  std::vector<int32_t> labels((size_t)n);
  std::vector<uint8_t> buf;
  std::vector<int64_t> idx;
  for (int64_t first = 0; first < n; first += kWriteImages) {
    const int cnt = (int)std::min<int64_t>(kWriteImages, n - first);
    idx.resize(cnt);
    for (int k = 0; k < cnt; ++k) idx[k] = first + k;
    buf.resize(cnt * img);
    ds.read(idx.data(), cnt, buf.data(), labels.data() + first);
    hsize_t start[4] = {(hsize_t)first, 0, 0, 0}, count[4] = {(hsize_t)cnt, (hsize_t)S, (hsize_t)S, 3};
    H5_OK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, nullptr, count, nullptr));
    hid_t mspace = H5Screate_simple(4, count, nullptr);
    H5_OK(H5Dwrite(dimages, H5T_NATIVE_UCHAR, mspace, fspace, H5P_DEFAULT, buf.data()));
    H5Sclose(mspace);
  }
  H5_OK(H5Dwrite(dlabels, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, labels.data()));

  hid_t ascalar = H5Screate(H5S_SCALAR);
  const int32_t k = ds.num_classes();
  hid_t a = H5Acreate2(file, "num_classes", H5T_STD_I32LE, ascalar, H5P_DEFAULT, H5P_DEFAULT);
  H5_OK(H5Awrite(a, H5T_NATIVE_INT32, &k));
  H5Aclose(a);
  hid_t str = H5Tcopy(H5T_C_S1);
  H5Tset_size(str, source.size() + 1);
  a = H5Acreate2(file, "source", str, ascalar, H5P_DEFAULT, H5P_DEFAULT);
  H5_OK(H5Awrite(a, str, source.c_str()));
  H5Aclose(a);
  H5Tclose(str);
  H5Sclose(ascalar);

  H5Dclose(dlabels);
  H5Sclose(lspace);
  H5Dclose(dimages);
  H5Pclose(dcpl);
  H5Sclose(fspace);
  H5_OK(H5Fclose(file));
}

int64_t parse_int(const std::string& flag, const char* v, int64_t lo) {
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v, &end, 10);
  if (errno || end == v || *end || x < lo) usage((flag + " needs an integer >= " + std::to_string(lo) + ", got '" + v + "'").c_str());
  return x;
}

double parse_double(const std::string& flag, const char* v) {
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(v, &end);
  if (errno || end == v || *end) usage((flag + " needs a number, got '" + v + "'").c_str());
  return x;
}

// ---- pack / verify: sources of encoded images

namespace fs = std::filesystem;

bool has_shards(const std::string& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.rfind("train-", 0) == 0 || n.rfind("validation-", 0) == 0) return true;
  }
  return false;
}

struct SourceArgs {
  std::string src, kind;  // kind: folder | tfrecord | jpeg_h5 ("" = detect)
  double eval_fraction = 0.0;
  bool label_offset_set = false;
  int label_offset = 0;
  // pack: --short-side (0: the bytes unchanged), --quality (-1: not given)
  int short_side = 0;
  int quality = -1;
};

// Threads for the work of every image (verify's decodes, pack's transcodes): the machine's,
// at most 8 unless --threads says.
int default_threads() { return (int)std::max(1u, std::min(8u, std::thread::hardware_concurrency())); }

std::string detect_kind(const SourceArgs& a) {
  if (!a.kind.empty()) return a.kind;
  std::error_code ec;
  if (fs::is_directory(a.src, ec)) return has_shards(a.src) ? "tfrecord" : "folder";
  return "jpeg_h5";
}

std::unique_ptr<vitgrid::ImageSource> open_source(const SourceArgs& a, const std::string& kind,
                                                  bool train) {
  vitgrid::ImageSourceOptions o;
  o.train = train;
  o.eval_fraction = a.eval_fraction;
  // build_imagenet_data.py writes 1-based labels
  o.label_offset = a.label_offset_set ? a.label_offset : (kind == "tfrecord" ? -1 : 0);
  o.num_classes = 0;  // TFRecord: unknown; found from the labels
  if (kind == "tfrecord") return vitgrid::open_tfrecord(a.src, o);  // indexes in memory only
  if (kind == "folder") return vitgrid::open_image_folder(a.src, o);
  return vitgrid::open_jpeg_h5(a.src, o);
}

// Parses the options after the positional arguments of pack / verify (pack: packing true).
void parse_source_options(int argc, char** argv, int first, SourceArgs& a, int* threads,
                          bool packing) {
  for (int i = first; i < argc; i += 2) {
    const std::string f = argv[i];
    if (i + 1 >= argc) usage((f + " needs a value").c_str());
    const char* v = argv[i + 1];
    if (f == "--short-side" && packing) {
      a.short_side = (int)parse_int(f, v, 1);
    } else if (f == "--quality" && packing) {
      a.quality = (int)parse_int(f, v, 1);
      if (a.quality > 100) usage("--quality must be in 1..100");
    } else if (f == "--source" && packing) {
      a.kind = v;
      if (a.kind != "folder" && a.kind != "tfrecord")
        usage(("--source is folder or tfrecord, got '" + a.kind + "'").c_str());
    } else if (f == "--eval-fraction") {
      a.eval_fraction = parse_double(f, v);
      if (!(a.eval_fraction >= 0.0 && a.eval_fraction < 1.0))
        usage("--eval-fraction must be in [0, 1)");
    } else if (f == "--label-offset") {
      char* end = nullptr;
      errno = 0;
      const long x = std::strtol(v, &end, 10);
      if (errno || end == v || *end)
        usage(("--label-offset needs an integer, got '" + std::string(v) + "'").c_str());
      a.label_offset = (int)x;
      a.label_offset_set = true;
    } else if (f == "--threads") {
      *threads = (int)parse_int(f, v, 1);
    } else {
      usage(("unknown option " + f).c_str());
    }
  }
  if (a.quality >= 0 && a.short_side == 0) usage("--quality applies with --short-side only");
  if (a.quality < 0) a.quality = 90;
}

// HDF5 handles closed on scope exit.
struct H5Id {
  hid_t id;
  herr_t (*close)(hid_t);
  ~H5Id() {
    if (id >= 0) close(id);
  }
};

struct SplitPlan {
  std::vector<int64_t> offsets;  // N+1
  std::vector<int64_t> labels;   // N
  int64_t resized = 0, kept_bad = 0;  // --short-side: images resized; undecodable ones copied
};

// The samples pack stores, read kChunk at a time from the source on `threads` threads: the
// source's bytes, or (short_side > 0) transcode_short_side's. The same bytes on every call.
class PackReader {
 public:
  static constexpr int64_t kChunk = 1024;
  PackReader(const vitgrid::ImageSource& src, int short_side, int quality, int threads)
      : src_(src), short_side_(short_side), quality_(quality),
        threads_(short_side > 0 ? threads : 1) {}
  struct Item {
    std::vector<uint8_t> bytes;
    int32_t label = 0;
    bool resized = false;
    std::string bad;  // why an image could not be transcoded (copied unchanged)
  };
  // Samples [i0, min(i0 + kChunk, n)) into items (items[k]: sample i0 + k).
  void read(int64_t i0, std::vector<Item>& items) {
    const int64_t n = std::min(src_.size(), i0 + kChunk) - i0;
    items.resize((size_t)n);
    std::atomic<int64_t> next{0};
    std::exception_ptr error;
    std::mutex mu;
    auto work = [&] {
      vitgrid::TranscodeScratch t;
      for (int64_t k; (k = next.fetch_add(1)) < n;) {
        Item& it = items[(size_t)k];
        try {
          src_.read(i0 + k, it.bytes, it.label);
          it.resized = false;
          it.bad.clear();
          if (short_side_ > 0) {
            try {
              it.resized = vitgrid::transcode_short_side(it.bytes, short_side_, quality_,
                                                         vitgrid::Interp::Bicubic, t);
            } catch (const vitgrid::DecodeError& e) {
              it.bad = e.what();
            }
          }
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu);
          if (!error) error = std::current_exception();
          next = n;
        }
      }
    };
    if (threads_ <= 1) {
      work();
    } else {
      std::vector<std::thread> pool;
      for (int t = 0; t < threads_; ++t) pool.emplace_back(work);
      for (auto& t : pool) t.join();
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  const vitgrid::ImageSource& src_;
  int short_side_, quality_, threads_;
};

// First pass: the size of every sample (folder, bytes unchanged: file sizes, the labels come
// in the second pass; else each sample is read, and transcoded, which gives its label too).
SplitPlan plan_split(const vitgrid::ImageSource& src, const std::string& kind,
                     PackReader& reader, bool transcode) {
  SplitPlan p;
  const int64_t n = src.size();
  p.offsets.assign((size_t)n + 1, 0);
  p.labels.assign((size_t)n, 0);
  std::vector<PackReader::Item> items;
  for (int64_t i0 = 0; i0 < n; i0 += PackReader::kChunk) {
    const int64_t i1 = std::min(n, i0 + PackReader::kChunk);
    if (kind != "folder" || transcode) reader.read(i0, items);
    for (int64_t i = i0; i < i1; ++i) {
      int64_t size = 0;
      int32_t label = 0;
      if (kind == "folder" && !transcode) {
        struct stat st;
        const std::string path = src.where(i);
        if (stat(path.c_str(), &st) != 0)
          throw vitgrid::UserError(path + ": cannot stat: " + std::strerror(errno));
        size = (int64_t)st.st_size;
        label = -1;  // filled by the second pass
      } else {
        const PackReader::Item& it = items[(size_t)(i - i0)];
        size = (int64_t)it.bytes.size();
        label = it.label;
        p.resized += it.resized;
        if (!it.bad.empty()) {
          ++p.kept_bad;
          std::fprintf(stderr, "vitgrid_dataset: %s: copied unchanged (cannot decode it: %s)\n",
                       src.where(i).c_str(), it.bad.c_str());
        }
      }
      p.offsets[(size_t)i + 1] = p.offsets[(size_t)i] + size;
      p.labels[(size_t)i] = label;
      if ((i + 1) % 50000 == 0)
        std::fprintf(stderr, "vitgrid_dataset: sized %lld of %lld\n", (long long)(i + 1),
                     (long long)n);
    }
  }
  return p;
}

// Second pass: writes the packed file (under `path`, a temporary name the caller renames).
void write_jpeg_h5(const vitgrid::ImageSource& src, PackReader& reader, SplitPlan& p, int64_t K,
                   const std::vector<std::string>& classes, const std::string& source,
                   int short_side, int quality, const std::string& path) {
  const int64_t n = src.size();
  const hsize_t total = (hsize_t)p.offsets.back();
  H5Id file{H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose};
  if (file.id < 0) throw vitgrid::UserError("cannot create " + path);
  H5Id fspace{H5Screate_simple(1, &total, nullptr), H5Sclose};
  H5Id dcpl{H5Pcreate(H5P_DATASET_CREATE), H5Pclose};
  H5_OK(H5Pset_layout(dcpl.id, H5D_CONTIGUOUS));
  H5_OK(H5Pset_fill_time(dcpl.id, H5D_FILL_TIME_NEVER));  // every byte is written below
  H5Id djpeg{
      H5Dcreate2(file.id, "jpeg", H5T_STD_U8LE, fspace.id, H5P_DEFAULT, dcpl.id, H5P_DEFAULT),
      H5Dclose};
  H5_OK(djpeg.id);

  // Streams the bytes in slabs of up to kSlab bytes (one image may exceed it alone).
  constexpr size_t kSlab = (size_t)64 << 20;
  std::vector<uint8_t> slab;
  hsize_t slab_start = 0;
  auto flush = [&] {
    if (slab.empty()) return;
    hsize_t start = slab_start, count = slab.size();
    H5_OK(H5Sselect_hyperslab(fspace.id, H5S_SELECT_SET, &start, nullptr, &count, nullptr));
    H5Id mspace{H5Screate_simple(1, &count, nullptr), H5Sclose};
    H5_OK(H5Dwrite(djpeg.id, H5T_NATIVE_UCHAR, mspace.id, fspace.id, H5P_DEFAULT, slab.data()));
    slab_start += count;
    slab.clear();
  };
  std::vector<PackReader::Item> items;
  for (int64_t i0 = 0; i0 < n; i0 += PackReader::kChunk) {
    reader.read(i0, items);
    for (int64_t i = i0; i < i0 + (int64_t)items.size(); ++i) {
      const std::vector<uint8_t>& bytes = items[(size_t)(i - i0)].bytes;
      const int32_t label = items[(size_t)(i - i0)].label;
      const int64_t want = p.offsets[(size_t)i + 1] - p.offsets[(size_t)i];
      if (p.labels[(size_t)i] < 0) p.labels[(size_t)i] = label;
      if ((int64_t)bytes.size() != want || label != p.labels[(size_t)i])
        throw vitgrid::UserError(src.where(i) + ": changed while being packed (" +
                                 std::to_string(bytes.size()) + " bytes, " +
                                 std::to_string(want) + " before)");
      if (!slab.empty() && slab.size() + bytes.size() > kSlab) flush();
      slab.insert(slab.end(), bytes.begin(), bytes.end());
      if ((i + 1) % 50000 == 0)
        std::fprintf(stderr, "vitgrid_dataset: packed %lld of %lld\n", (long long)(i + 1),
                     (long long)n);
    }
  }
  flush();

  auto write_1d = [&](const char* name, const std::vector<int64_t>& v) {
    hsize_t d = v.size();
    H5Id sp{H5Screate_simple(1, &d, nullptr), H5Sclose};
    H5Id ds{H5Dcreate2(file.id, name, H5T_STD_I64LE, sp.id, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
            H5Dclose};
    H5_OK(ds.id);
    H5_OK(H5Dwrite(ds.id, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()));
  };
  write_1d("offsets", p.offsets);
  write_1d("labels", p.labels);
  {
    hsize_t d = (hsize_t)K;
    H5Id sp{H5Screate_simple(1, &d, nullptr), H5Sclose};
    H5Id st{H5Tcopy(H5T_C_S1), H5Tclose};
    H5_OK(H5Tset_size(st.id, H5T_VARIABLE));
    H5_OK(H5Tset_cset(st.id, H5T_CSET_UTF8));
    H5Id ds{H5Dcreate2(file.id, "classes", st.id, sp.id, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
            H5Dclose};
    H5_OK(ds.id);
    std::vector<const char*> ptr;
    for (const std::string& c : classes) ptr.push_back(c.c_str());
    H5_OK(H5Dwrite(ds.id, st.id, H5S_ALL, H5S_ALL, H5P_DEFAULT, ptr.data()));
  }
  H5Id scalar{H5Screate(H5S_SCALAR), H5Sclose};
  {
    H5Id a{H5Acreate2(file.id, "num_classes", H5T_STD_I64LE, scalar.id, H5P_DEFAULT, H5P_DEFAULT),
           H5Aclose};
    H5_OK(H5Awrite(a.id, H5T_NATIVE_INT64, &K));
  }
  {
    H5Id st{H5Tcopy(H5T_C_S1), H5Tclose};
    H5_OK(H5Tset_size(st.id, source.size() + 1));
    H5Id a{H5Acreate2(file.id, "source", st.id, scalar.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose};
    H5_OK(H5Awrite(a.id, st.id, source.c_str()));
  }
  if (short_side > 0)  // the images resized: what to and how
    for (const auto& kv : {std::make_pair("short_side", (int64_t)short_side),
                           std::make_pair("quality", (int64_t)quality)}) {
      H5Id a{H5Acreate2(file.id, kv.first, H5T_STD_I64LE, scalar.id, H5P_DEFAULT, H5P_DEFAULT),
             H5Aclose};
      H5_OK(H5Awrite(a.id, H5T_NATIVE_INT64, &kv.second));
    }
  H5Dclose(djpeg.id);  // before the file: its close then flushes everything
  djpeg.id = -1;
  const herr_t rc = H5Fclose(file.id);
  file.id = -1;
  if (rc < 0) throw vitgrid::UserError("cannot finish " + path + " (disk full?)");
}

int pack(int argc, char** argv) {
  if (argc < 4 || argv[2][0] == '-' || argv[3][0] == '-') usage("pack takes SRC and OUT.h5");
  SourceArgs a;
  a.src = argv[2];
  const std::string out = argv[3];
  int threads = default_threads();
  parse_source_options(argc, argv, 4, a, &threads, true);
  if (out.size() < 4 || out.compare(out.size() - 3, 3, ".h5") != 0)
    usage("pack's output must be named X.h5 (it writes X_train.h5 and X_val.h5)");
  const std::string stem = out.substr(0, out.size() - 3);
  std::error_code ec;
  if (!fs::is_directory(a.src, ec))
    throw vitgrid::UserError(a.src +
                             ": not a directory (pack reads an ImageFolder tree or a "
                             "TFRecord directory)");
  const std::string kind = detect_kind(a);
  auto train = open_source(a, kind, true);
  auto eval = open_source(a, kind, false);
  std::fprintf(stderr, "vitgrid_dataset: packing %s\n  and %s\n", train->describe().c_str(),
               eval->describe().c_str());
  const bool transcode = a.short_side > 0;
  PackReader rtrain(*train, a.short_side, a.quality, threads),
      reval(*eval, a.short_side, a.quality, threads);
  SplitPlan ptrain = plan_split(*train, kind, rtrain, transcode),
            peval = plan_split(*eval, kind, reval, transcode);
  int64_t K = train->num_classes();
  std::vector<std::string> classes = train->class_names();
  if (kind == "tfrecord") {  // the shards do not say: the largest label + 1
    K = 0;
    for (const SplitPlan* p : {&ptrain, &peval})
      for (int64_t l : p->labels) K = std::max(K, l + 1);
  }
  if ((int64_t)classes.size() != K) {  // no names (TFRecord): the label numbers
    classes.clear();
    for (int64_t k = 0; k < K; ++k) classes.push_back(std::to_string(k));
  }
  const std::string src_attr =
      kind + " " + fs::absolute(a.src, ec).string() +
      (transcode ? " short_side=" + std::to_string(a.short_side) +
                       " quality=" + std::to_string(a.quality)
                 : "");
  const std::string tmp_train = stem + "_train.h5.tmp", tmp_val = stem + "_val.h5.tmp";
  try {
    write_jpeg_h5(*train, rtrain, ptrain, K, classes, src_attr + " split=train", a.short_side,
                  a.quality, tmp_train);
    write_jpeg_h5(*eval, reval, peval, K, classes, src_attr + " split=val", a.short_side,
                  a.quality, tmp_val);
  } catch (...) {
    std::remove(tmp_train.c_str());
    std::remove(tmp_val.c_str());
    throw;
  }
  if (std::rename(tmp_train.c_str(), (stem + "_train.h5").c_str()) != 0 ||
      std::rename(tmp_val.c_str(), (stem + "_val.h5").c_str()) != 0)
    throw vitgrid::UserError("cannot rename " + tmp_train + " / " + tmp_val + ": " +
                             std::strerror(errno));
  std::printf(
      "vitgrid_dataset: wrote %s_train.h5 (%lld images, %lld bytes) and %s_val.h5 (%lld "
      "images, %lld bytes), %lld classes, from %s\n",
      stem.c_str(), (long long)train->size(), (long long)ptrain.offsets.back(), stem.c_str(),
      (long long)eval->size(), (long long)peval.offsets.back(), (long long)K, kind.c_str());
  if (transcode)
    std::printf("vitgrid_dataset: resized %lld of %lld images to a shorter side of %d (quality "
                "%d); %lld that could not be decoded copied unchanged\n",
                (long long)(ptrain.resized + peval.resized),
                (long long)(train->size() + eval->size()), a.short_side, a.quality,
                (long long)(ptrain.kept_bad + peval.kept_bad));
  return 0;
}

int verify(int argc, char** argv) {
  if (argc < 3 || argv[2][0] == '-') usage("verify takes SRC");
  SourceArgs a;
  a.src = argv[2];
  int threads = default_threads();
  parse_source_options(argc, argv, 3, a, &threads, false);
  const std::string kind = detect_kind(a);
  std::vector<std::unique_ptr<vitgrid::ImageSource>> splits;
  splits.push_back(open_source(a, kind, true));
  // the eval split too, unless it is the same set (a folder without train/ and val/ and no
  // hold-out) or absent (a single packed file)
  const bool same_set =
      kind == "folder" && splits[0]->describe().find("(no held-out split)") != std::string::npos;
  if (!same_set) {
    try {
      splits.push_back(open_source(a, kind, false));
    } catch (const vitgrid::UserError& e) {
      if (kind != "jpeg_h5") throw;
      std::fprintf(stderr, "vitgrid_dataset: no eval split checked: %s\n", e.what());
    }
  }
  int64_t checked = 0, failed = 0;
  for (const auto& src : splits) {
    std::fprintf(stderr, "vitgrid_dataset: verifying %s\n", src->describe().c_str());
    const int64_t n = src->size();
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::vector<std::pair<int64_t, std::string>> bad;
    auto work = [&] {
      std::vector<uint8_t> bytes;
      vitgrid::DecodedImage img;
      for (int64_t i; (i = next.fetch_add(1)) < n;) {
        std::string why;
        try {
          int32_t label = 0;
          src->read(i, bytes, label);
          vitgrid::peek_image(bytes.data(), bytes.size());
          vitgrid::decode_image(bytes.data(), bytes.size(), img);
        } catch (const std::exception& e) {
          why = e.what();
          if (why.empty()) why = "unknown error";
        }
        if (!why.empty()) {
          std::string w;
          try {
            w = src->where(i);
          } catch (const std::exception&) {
            w = "sample " + std::to_string(i);
          }
          std::lock_guard<std::mutex> lock(mu);
          bad.emplace_back(i, w + ": " + why);
        }
        const int64_t d = done.fetch_add(1) + 1;
        if (d % 50000 == 0) {
          std::lock_guard<std::mutex> lock(mu);
          std::fprintf(stderr, "vitgrid_dataset: decoded %lld of %lld\n", (long long)d,
                       (long long)n);
        }
      }
    };
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back(work);
    for (auto& t : pool) t.join();
    std::sort(bad.begin(), bad.end());
    for (const auto& b : bad) std::printf("%s\n", b.second.c_str());
    checked += n;
    failed += (int64_t)bad.size();
  }
  std::printf("vitgrid_dataset: verify: %lld images checked, %lld could not be decoded\n",
              (long long)checked, (long long)failed);
  std::fflush(stdout);
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) usage("");
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "-h") == 0 || std::strcmp(argv[i], "--help") == 0) usage("", stdout, 0);
  const std::string mode = argv[1];
  try {
    if (mode == "cifar10") {
      if (argc != 4) usage("cifar10 takes DIR and OUT_PREFIX");
      const std::string dir = argv[2], prefix = argv[3];
      auto train = vitgrid::make_cifar10(dir, true);
      auto eval = vitgrid::make_cifar10(dir, false);
      write_packed(*train, prefix + "_train.h5", "cifar10 " + dir + " train");
      write_packed(*eval, prefix + "_eval.h5", "cifar10 " + dir + " test");
      std::printf("vitgrid_dataset: wrote %s_train.h5 (%lld) and %s_eval.h5 (%lld), 32x32, 10 classes\n",
                  prefix.c_str(), (long long)train->size(), prefix.c_str(), (long long)eval->size());
    } else if (mode == "synthetic") {
      if (argc < 3 || argv[2][0] == '-') usage("synthetic takes OUT_PREFIX then options");
      const std::string prefix = argv[2];
      int64_t ntrain = -1, neval = -1, size = -1, classes = -1, seed = -1;
      for (int i = 3; i < argc; i += 2) {
        const std::string f = argv[i];
        if (i + 1 >= argc) usage((f + " needs a value").c_str());
        if (f == "--train") ntrain = parse_int(f, argv[i + 1], 1);
        else if (f == "--eval") neval = parse_int(f, argv[i + 1], 1);
        else if (f == "--size") size = parse_int(f, argv[i + 1], 4);
        else if (f == "--classes") classes = parse_int(f, argv[i + 1], 1);
        else if (f == "--seed") seed = parse_int(f, argv[i + 1], 0);
        else usage(("unknown option " + f).c_str());
      }
      if (ntrain < 0 || neval < 0 || size < 0 || classes < 0 || seed < 0)
        usage("synthetic needs --train, --eval, --size, --classes and --seed");
      auto train = vitgrid::make_synthetic((uint64_t)seed, true, ntrain, (int)size, (int)classes);
      auto eval = vitgrid::make_synthetic((uint64_t)seed, false, neval, (int)size, (int)classes);
      const std::string src = "synthetic seed=" + std::to_string(seed);
      write_packed(*train, prefix + "_train.h5", src + " split=train");
      write_packed(*eval, prefix + "_eval.h5", src + " split=eval");
      std::printf("vitgrid_dataset: wrote %s_train.h5 (%lld) and %s_eval.h5 (%lld), %lldx%lld, %lld classes, seed %lld\n",
                  prefix.c_str(), (long long)ntrain, prefix.c_str(), (long long)neval, (long long)size,
                  (long long)size, (long long)classes, (long long)seed);
    } else if (mode == "pack") {
      return pack(argc, argv);
    } else if (mode == "verify") {
      return verify(argc, argv);
    } else {
      usage(("unknown mode '" + mode + "' (cifar10 | synthetic | pack | verify)").c_str());
    }
  } catch (const vitgrid::UserError& e) {
    std::fprintf(stderr, "vitgrid_dataset: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vitgrid_dataset: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
