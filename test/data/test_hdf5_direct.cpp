// The packed-HDF5 reader's two paths: direct pread() of unfiltered contiguous files and of files
// chunked by whole images [c,S,S,3] (the layout of older vitgrid_dataset files), and HDF5
// hyperslab reads for everything else (gzip, chunks that split images, unallocated chunks).
// Each must return exactly the written bytes and labels for unsorted index lists with repeats
// (Mixup partners), from several threads at once; files cut short must be refused by name.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <thread>

#include "data_test_util.h"
#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"

using vgtest::H5Spec;
using vgtest::TempDir;

namespace {

// Bytes that differ between images and positions, so a misplaced image or offset shows.
std::vector<uint8_t> distinct_images(int64_t n, int S) {
  const size_t img = (size_t)S * S * 3;
  std::vector<uint8_t> v((size_t)n * img);
  for (int64_t i = 0; i < n; ++i)
    for (size_t b = 0; b < img; ++b)
      v[(size_t)i * img + b] = (uint8_t)(i * 131 + b * 7 + (b >> 8) * 3 + 1);
  return v;
}

std::vector<int64_t> labels_for(int64_t n) {
  std::vector<int64_t> l((size_t)n);
  for (int64_t i = 0; i < n; ++i) l[(size_t)i] = (i * 7) % 11;
  return l;
}

// Index lists the loader produces: random with repeats, unsorted runs, reversed runs, sorted
// unique ranges, single samples.
std::vector<std::vector<int64_t>> index_lists(int64_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<std::vector<int64_t>> out;
  for (int t = 0; t < 30; ++t) {
    std::vector<int64_t> v(1 + g() % 40);
    for (auto& x : v) x = (int64_t)(g() % (uint32_t)n);
    if (t % 3 == 0 && v.size() > 3) v[v.size() - 1] = v[0];  // a certain repeat
    out.push_back(v);
  }
  std::vector<int64_t> all((size_t)n);
  std::iota(all.begin(), all.end(), 0);
  out.push_back(all);                         // sorted unique: one run
  out.push_back({all.rbegin(), all.rend()});  // reversed: adjacent in the file, not in the batch
  out.push_back({n - 1});
  out.push_back({0, 0, 0});
  if (n >= 6) out.push_back({4, 2, 3, 5, 2, 0, 1, 4});
  return out;
}

// Reads every list and compares with what was written; returns the number of mismatches.
int check_reads(vitgrid::Dataset& ds, const std::vector<uint8_t>& images,
                const std::vector<int64_t>& labels,
                const std::vector<std::vector<int64_t>>& lists) {
  const size_t img = (size_t)ds.image_size() * ds.image_size() * 3;
  int bad = 0;
  for (const auto& idx : lists) {
    std::vector<uint8_t> out(idx.size() * img, 0xEE);
    std::vector<int32_t> lab(idx.size(), -1);
    ds.read(idx.data(), (int)idx.size(), out.data(), lab.data());
    for (size_t k = 0; k < idx.size(); ++k) {
      if (lab[k] != labels[(size_t)idx[k]]) ++bad;
      if (!std::equal(out.begin() + k * img, out.begin() + (k + 1) * img,
                      images.begin() + idx[k] * img))
        ++bad;
    }
  }
  return bad;
}

// Single-threaded, then 4 threads at once on the same dataset object.
void check_everything(vitgrid::Dataset& ds, const std::vector<uint8_t>& images,
                      const std::vector<int64_t>& labels) {
  EXPECT_EQ(check_reads(ds, images, labels, index_lists(ds.size(), 1)), 0) << ds.describe();
  std::atomic<int> bad{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < 4; ++t)
    pool.emplace_back([&, t] {
      for (int rep = 0; rep < 5; ++rep)
        bad += check_reads(ds, images, labels, index_lists(ds.size(), 100 + t * 10 + rep));
    });
  for (auto& th : pool) th.join();
  EXPECT_EQ(bad.load(), 0) << ds.describe();
  int64_t out_of_range = ds.size();
  std::vector<uint8_t> buf((size_t)ds.image_size() * ds.image_size() * 3);
  int32_t l;
  EXPECT_THROW(ds.read(&out_of_range, 1, buf.data(), &l), std::out_of_range);
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

template <class F>
void expect_user_error(F f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no UserError thrown";
  } catch (const vitgrid::UserError& e) {
    for (const auto& p : parts)
      EXPECT_TRUE(contains(e.what(), p)) << "missing '" << p << "' in: " << e.what();
  }
}

struct Case {
  std::string name;
  H5Spec spec;
  std::string expect_layout, expect_io;
};

H5Spec spec(int64_t n, int S) {
  H5Spec s;
  s.n = n;
  s.h = s.w = S;
  return s;
}

// Byte offset of /images in the file (HDF5 says: absolute, user block included).
int64_t images_offset(const std::string& path) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t d = H5Dopen2(f, "images", H5P_DEFAULT);
  const haddr_t off = H5Dget_offset(d);
  H5Dclose(d);
  H5Fclose(f);
  return off == HADDR_UNDEF ? -1 : (int64_t)off;
}

int64_t file_size(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? (int64_t)st.st_size : -1;
}

}  // namespace

TEST(Hdf5Direct, EveryLayoutReadsTheWrittenBytes) {
  TempDir dir;
  std::vector<Case> cases;
  {
    Case c{"contig", spec(37, 7), "contiguous", "pread"};
    cases.push_back(c);
  }
  {
    Case c{"chunk3", spec(10, 6), "chunked [3,6,6,3]",
           "pread"};  // 10 = 3*3 + 1: partial last chunk
    c.spec.chunked = true;
    c.spec.chunk_images = 3;
    cases.push_back(c);
  }
  {
    Case c{"chunk64", spec(150, 6), "chunked [64,6,6,3]", "pread"};  // the old tool's layout
    c.spec.chunked = true;
    c.spec.chunk_images = 64;
    cases.push_back(c);
  }
  {
    Case c{"gzip", spec(45, 6), "chunked [4,6,6,3]", "hdf5 reads (filters: deflate)"};
    c.spec.chunked = true;
    c.spec.chunk_images = 4;
    c.spec.gzip = 4;
    cases.push_back(c);
  }
  {
    Case c{"split", spec(20, 8), "chunked [2,4,8,3]", "hdf5 reads (chunks split images)"};
    c.spec.chunked = true;
    c.spec.chunk_h = 4;
    cases.push_back(c);
  }
  {
    Case c{"ub_contig", spec(13, 5), "contiguous", "pread"};  // a 512-byte user block
    c.spec.userblock = 512;
    cases.push_back(c);
  }
  {
    Case c{"ub_chunk", spec(13, 5), "chunked [4,5,5,3]", "pread"};  // chunk addresses are relative
    c.spec.userblock = 1024;
    c.spec.chunked = true;
    c.spec.chunk_images = 4;
    cases.push_back(c);
  }
  {
    Case c{"labels_first", spec(11, 5), "contiguous", "pread"};
    c.spec.labels_first = true;
    cases.push_back(c);
  }
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto images = distinct_images(c.spec.n, c.spec.h);
    auto labels = labels_for(c.spec.n);
    const std::string path = dir.file(c.name + ".h5");
    vgtest::write_h5(path, c.spec, images, labels);
    auto ds = vitgrid::make_hdf5_images(path);
    EXPECT_EQ(ds->size(), c.spec.n);
    EXPECT_EQ(ds->image_size(), c.spec.h);
    EXPECT_EQ(ds->num_classes(), 11);
    EXPECT_TRUE(contains(ds->describe(), c.expect_layout)) << ds->describe();
    EXPECT_TRUE(contains(ds->describe(), c.expect_io)) << ds->describe();
    check_everything(*ds, images, labels);
  }
}

// Chunks never written (a file whose writer stopped early) read as the fill value, through HDF5.
TEST(Hdf5Direct, UnallocatedChunksFallBack) {
  TempDir dir;
  const int S = 4;
  const int64_t n = 12;
  auto images = distinct_images(n, S);
  auto labels = labels_for(n);
  const std::string path = dir.file("partial.h5");
  H5Spec s = spec(n, S);
  s.chunked = true;
  s.chunk_images = 4;
  vgtest::write_h5(path, s, images, labels);
  // replace /images by one with only chunk 1 (images 4..7) written
  {
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    H5Ldelete(f, "images", H5P_DEFAULT);
    hsize_t dims[4] = {(hsize_t)n, S, S, 3}, ch[4] = {4, S, S, 3};
    hid_t sp = H5Screate_simple(4, dims, nullptr);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(dcpl, 4, ch);
    hid_t d = H5Dcreate2(f, "images", H5T_STD_U8LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    hsize_t start[4] = {4, 0, 0, 0};
    H5Sselect_hyperslab(sp, H5S_SELECT_SET, start, nullptr, ch, nullptr);
    hid_t ms = H5Screate_simple(4, ch, nullptr);
    H5Dwrite(d, H5T_NATIVE_UCHAR, ms, sp, H5P_DEFAULT, images.data() + 4 * S * S * 3);
    H5Sclose(ms);
    H5Dclose(d);
    H5Pclose(dcpl);
    H5Sclose(sp);
    H5Fclose(f);
  }
  auto ds = vitgrid::make_hdf5_images(path);
  EXPECT_TRUE(contains(ds->describe(), "hdf5 reads (unallocated chunk 0)")) << ds->describe();
  std::vector<uint8_t> expect(images.size(), 0);
  std::copy(images.begin() + 4 * S * S * 3, images.begin() + 8 * S * S * 3,
            expect.begin() + 4 * S * S * 3);
  check_everything(*ds, expect, labels);
}

// A copy cut short in the middle of /images: HDF5 itself refuses it (its end-of-file address is
// past the end); with the end-of-file address patched to match, the reader's own range check
// must; and a file cut while open must fail the read. Each names the file; none crashes.
TEST(Hdf5Direct, TruncatedFilesAreRefusedByName) {
  TempDir dir;
  const int S = 16;
  const int64_t n = 20;
  const size_t img = (size_t)S * S * 3;
  auto images = distinct_images(n, S);
  auto labels = labels_for(n);
  H5Spec s = spec(n, S);
  s.labels_first = true;  // the pixels end the file, so a cut inside them leaves the metadata whole
  const std::string good = dir.file("good.h5");
  vgtest::write_h5(good, s, images, labels);
  const int64_t off = images_offset(good), size = file_size(good);
  ASSERT_GT(off, 0);
  ASSERT_EQ(off + (int64_t)(n * img), size)
      << "test premise: /images is the last thing in the file";
  const int64_t cut = off + (int64_t)(n / 2 * img) + 100;  // mid-image 10

  auto copy_cut = [&](const std::string& name) {
    const std::string p = dir.file(name);
    std::ifstream in(good, std::ios::binary);
    std::vector<char> bytes((size_t)size);
    in.read(bytes.data(), size);
    std::ofstream(p, std::ios::binary).write(bytes.data(), cut);
    return p;
  };

  // (1) plain truncation
  const std::string t1 = copy_cut("cut.h5");
  expect_user_error([&] { vitgrid::make_hdf5_images(t1); }, {"cut.h5", "truncated"});

  // (2) truncated, superblock (version 0) end-of-file address patched to the new size
  const std::string t2 = copy_cut("cut_patched.h5");
  {
    std::fstream f(t2, std::ios::in | std::ios::out | std::ios::binary);
    char sb[56];
    f.read(sb, sizeof sb);
    ASSERT_EQ(std::string(sb, 8), std::string("\x89HDF\r\n\x1a\n", 8));
    ASSERT_EQ(sb[8], 0) << "test premise: superblock version 0";
    uint64_t eoa = 0;
    for (int b = 7; b >= 0; --b) eoa = (eoa << 8) | (uint8_t)sb[40 + b];
    ASSERT_EQ((int64_t)eoa, size) << "test premise: end-of-file address at byte 40";
    for (int b = 0; b < 8; ++b) sb[40 + b] = (char)(((uint64_t)cut >> (8 * b)) & 0xff);
    f.seekp(40);
    f.write(sb + 40, 8);
  }
  expect_user_error([&] { vitgrid::make_hdf5_images(t2); },
                    {"cut_patched.h5", "/images", "truncated"});

  // (3) cut while open: the read that reaches past the end fails by name; earlier images still read
  const std::string t3 = dir.file("shrinks.h5");
  vgtest::write_h5(t3, s, images, labels);
  auto ds = vitgrid::make_hdf5_images(t3);
  ASSERT_TRUE(contains(ds->describe(), "pread")) << ds->describe();
  ASSERT_EQ(truncate(t3.c_str(), cut), 0);
  std::vector<uint8_t> out(3 * img);
  std::vector<int32_t> lab(3);
  std::vector<int64_t> early = {3, 0, 9};
  ds->read(early.data(), 3, out.data(), lab.data());
  EXPECT_TRUE(std::equal(out.begin(), out.begin() + img, images.begin() + 3 * img));
  std::vector<int64_t> late = {2, 19, 11};
  expect_user_error([&] { ds->read(late.data(), 3, out.data(), lab.data()); },
                    {"shrinks.h5", "/images"});
}
