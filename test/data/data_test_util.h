// Helpers for the data-layer tests: a scratch directory and a small HDF5 image-file writer
// (able to write deliberately malformed files).
#pragma once
#include <hdf5.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace vgtest {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents at scope exit.
class TempDir {
 public:
  TempDir() {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/vg_data_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data())) path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;  // best effort: a leftover temp dir must not fail a test
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct H5Spec {
  int64_t n = 0;
  int h = 0, w = 0, c = 3;
  bool chunked = false;
  int64_t chunk_images = 2;          // chunked: chunk [chunk_images, h, w, c]
  int chunk_h = 0;                   // chunked: > 0 gives chunks that split images [.., chunk_h, w, c]
  int gzip = 0;                      // chunked: deflate level (0: no filter)
  bool labels_first = false;         // write /labels before /images (the pixels end the file)
  hsize_t userblock = 0;             // user block bytes before the HDF5 data (0 or 512, 1024, ...)
  bool write_labels = true;
  hid_t image_type = H5T_STD_U8LE;   // stored type of /images
  hid_t label_type = H5T_STD_I64LE;  // stored type of /labels
  int64_t label_count = -1;          // -1: n
  int num_classes_attr = -1;         // -1: no attribute
};

// Writes /images (values given as uint8 HWC, converted to the stored type) and /labels.
inline void write_h5(const std::string& path, const H5Spec& s, const std::vector<uint8_t>& images,
                     const std::vector<int64_t>& labels) {
  hid_t fcpl = H5Pcreate(H5P_FILE_CREATE);
  if (s.userblock) H5Pset_userblock(fcpl, s.userblock);
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, fcpl, H5P_DEFAULT);
  H5Pclose(fcpl);
  auto write_images = [&] {
    hsize_t dims[4] = {(hsize_t)s.n, (hsize_t)s.h, (hsize_t)s.w, (hsize_t)s.c};
    hid_t sp = H5Screate_simple(4, dims, nullptr);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    if (s.chunked) {
      hsize_t ch[4] = {(hsize_t)s.chunk_images, (hsize_t)(s.chunk_h > 0 ? s.chunk_h : s.h), (hsize_t)s.w,
                       (hsize_t)s.c};
      H5Pset_chunk(dcpl, 4, ch);
      if (s.gzip > 0) H5Pset_deflate(dcpl, (unsigned)s.gzip);
    }
    hid_t d = H5Dcreate2(f, "images", s.image_type, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    H5Dwrite(d, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, images.data());
    H5Dclose(d);
    H5Pclose(dcpl);
    H5Sclose(sp);
  };
  if (!s.labels_first) write_images();
  if (s.write_labels) {
    hsize_t ln = (hsize_t)(s.label_count >= 0 ? s.label_count : s.n);
    std::vector<int64_t> l(labels);
    l.resize(ln, 0);
    hid_t lsp = H5Screate_simple(1, &ln, nullptr);
    hid_t ld = H5Dcreate2(f, "labels", s.label_type, lsp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(ld, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, l.data());
    H5Dclose(ld);
    H5Sclose(lsp);
  }
  if (s.labels_first) write_images();
  if (s.num_classes_attr >= 0) {
    hid_t as = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(f, "num_classes", H5T_STD_I32LE, as, H5P_DEFAULT, H5P_DEFAULT);
    int32_t k = s.num_classes_attr;
    H5Awrite(a, H5T_NATIVE_INT32, &k);
    H5Aclose(a);
    H5Sclose(as);
  }
  H5Fclose(f);
}

}  // namespace vgtest

#include <fstream>

namespace vgtest {

// A fake CIFAR-10 binary directory: every file holds `per_file` records; record r of file f has
// label (f * per_file + r) % 10 and pixel bytes derived from (file, record, channel, pixel).
inline uint8_t cifar_byte(int file, int rec, int ch, int pix) {
  return (uint8_t)(file * 53 + rec * 29 + ch * 71 + pix * 7);
}
inline void write_fake_cifar(const std::string& dir, int per_file) {
  for (int f = 0; f < 6; ++f) {
    std::string name = f < 5 ? dir + "/data_batch_" + std::to_string(f + 1) + ".bin" : dir + "/test_batch.bin";
    std::ofstream out(name, std::ios::binary);
    for (int r = 0; r < per_file; ++r) {
      out.put((char)((f * per_file + r) % 10));
      for (int ch = 0; ch < 3; ++ch)
        for (int p = 0; p < 1024; ++p) out.put((char)cifar_byte(f, r, ch, p));
    }
  }
}

}  // namespace vgtest
