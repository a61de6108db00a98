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
//
// A serial tool: one process, HDF5's default sec2 driver, no MPI needed.
#include <hdf5.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"

namespace {

constexpr int64_t kWriteImages = 1024;  // images read from the source per write (bounded memory)

[[noreturn]] void usage(const char* msg) {
  if (msg && *msg) std::fprintf(stderr, "vitgrid_dataset: %s\n", msg);
  std::fprintf(stderr,
               "usage:\n"
               "  vitgrid_dataset cifar10 DIR OUT_PREFIX\n"
               "  vitgrid_dataset synthetic OUT_PREFIX --train N --eval M --size S --classes K "
               "--seed X\n"
               "writes OUT_PREFIX_train.h5 and OUT_PREFIX_eval.h5 (packed HDF5 images)\n");
  std::exit(2);
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

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) usage("");
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
    } else {
      usage(("unknown mode '" + mode + "' (cifar10 | synthetic)").c_str());
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
