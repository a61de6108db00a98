// File-backed datasets (CIFAR-10 binaries, packed HDF5) and make_dataset from a deck: round
// trips and the refusals of malformed input, each naming the file and what is wrong.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <numeric>
#include <thread>

#include "data_test_util.h"
#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"
#include "vitgrid/deck/deck.h"

using vgtest::H5Spec;
using vgtest::TempDir;

namespace {

// Expects `f` to throw a UserError whose message contains every one of `parts`.
template <class F>
void expect_user_error(F f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no UserError thrown";
  } catch (const vitgrid::UserError& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

std::vector<uint8_t> pattern_images(int64_t n, int S) {
  std::vector<uint8_t> v((size_t)n * S * S * 3);
  for (size_t i = 0; i < v.size(); ++i) v[i] = (uint8_t)(i * 31 + i / 97);
  return v;
}

}  // namespace

TEST(Cifar10, ReadsRecordsAsHwc) {
  TempDir dir;
  vgtest::write_fake_cifar(dir.path(), 2);
  auto train = vitgrid::make_cifar10(dir.path(), true);
  auto eval = vitgrid::make_cifar10(dir.path(), false);
  EXPECT_EQ(train->size(), 10);
  EXPECT_EQ(eval->size(), 2);
  EXPECT_EQ(train->image_size(), 32);
  EXPECT_EQ(train->num_classes(), 10);
  std::vector<uint8_t> img(32 * 32 * 3 * 2);
  int32_t lab[2];
  int64_t idx[2] = {7, 0};  // file 3 (data_batch_4) record 1, then file 0 record 0
  train->read(idx, 2, img.data(), lab);
  EXPECT_EQ(lab[0], 7);
  EXPECT_EQ(lab[1], 0);
  for (int p = 0; p < 1024; ++p)
    for (int c = 0; c < 3; ++c) {
      ASSERT_EQ(img[p * 3 + c], vgtest::cifar_byte(3, 1, c, p)) << p << " " << c;
      ASSERT_EQ(img[3072 + p * 3 + c], vgtest::cifar_byte(0, 0, c, p));
    }
  int64_t e = 1;
  eval->read(&e, 1, img.data(), lab);
  EXPECT_EQ(lab[0], 1);  // (5 * 2 + 1) % 10
  EXPECT_EQ(img[5 * 3 + 2], vgtest::cifar_byte(5, 1, 2, 5));
}

TEST(Cifar10, RefusesMalformedFiles) {
  {
    TempDir dir;
    vgtest::write_fake_cifar(dir.path(), 2);
    std::remove(dir.file("data_batch_3.bin").c_str());
    expect_user_error([&] { vitgrid::make_cifar10(dir.path(), true); }, {"missing", "data_batch_3.bin"});
    EXPECT_NO_THROW(vitgrid::make_cifar10(dir.path(), false));
    std::remove(dir.file("test_batch.bin").c_str());
    expect_user_error([&] { vitgrid::make_cifar10(dir.path(), false); }, {"test_batch.bin"});
  }
  {
    TempDir dir;
    vgtest::write_fake_cifar(dir.path(), 2);
    std::ofstream(dir.file("data_batch_2.bin"), std::ios::app) << "x";  // 2 * 3073 + 1 bytes
    expect_user_error([&] { vitgrid::make_cifar10(dir.path(), true); },
                      {"data_batch_2.bin", "6147 bytes", "3073"});
  }
  {
    TempDir dir;
    vgtest::write_fake_cifar(dir.path(), 2);
    std::fstream f(dir.file("data_batch_5.bin"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(3073);  // label byte of record 1
    f.put((char)10);
    f.close();
    expect_user_error([&] { vitgrid::make_cifar10(dir.path(), true); }, {"data_batch_5.bin", "record 1", "label 10"});
  }
}

TEST(Hdf5Images, RoundTripContiguousAndChunked) {
  TempDir dir;
  for (bool chunked : {false, true}) {
    H5Spec s;
    s.n = 9;
    s.h = s.w = 5;
    s.chunked = chunked;
    s.label_type = H5T_STD_U8LE;  // any integer type
    auto images = pattern_images(9, 5);
    std::vector<int64_t> labels = {0, 3, 1, 2, 3, 0, 1, 2, 1};
    const std::string path = dir.file(chunked ? "c.h5" : "k.h5");
    vgtest::write_h5(path, s, images, labels);
    auto ds = vitgrid::make_hdf5_images(path);
    EXPECT_EQ(ds->size(), 9);
    EXPECT_EQ(ds->image_size(), 5);
    EXPECT_EQ(ds->num_classes(), 4);  // no attribute: max label + 1
    // unsorted, with runs and a duplicate
    std::vector<int64_t> idx = {8, 2, 3, 4, 0, 3, 7};
    const size_t img = 5 * 5 * 3;
    std::vector<uint8_t> out(idx.size() * img);
    std::vector<int32_t> lab(idx.size());
    ds->read(idx.data(), (int)idx.size(), out.data(), lab.data());
    for (size_t k = 0; k < idx.size(); ++k) {
      EXPECT_EQ(lab[k], labels[idx[k]]);
      EXPECT_TRUE(std::equal(out.begin() + k * img, out.begin() + (k + 1) * img, images.begin() + idx[k] * img)) << k;
    }
    // sorted unique (direct path)
    std::vector<int64_t> all(9);
    std::iota(all.begin(), all.end(), 0);
    out.resize(9 * img);
    lab.resize(9);
    ds->read(all.data(), 9, out.data(), lab.data());
    EXPECT_EQ(out, images);
    int64_t bad = 9;
    EXPECT_THROW(ds->read(&bad, 1, out.data(), lab.data()), std::out_of_range);
  }
}

TEST(Hdf5Images, NumClassesAttributeAndConcurrentReads) {
  TempDir dir;
  H5Spec s;
  s.n = 64;
  s.h = s.w = 4;
  s.chunked = true;
  s.num_classes_attr = 12;
  auto images = pattern_images(64, 4);
  std::vector<int64_t> labels(64);
  for (int i = 0; i < 64; ++i) labels[i] = i % 5;
  vgtest::write_h5(dir.file("a.h5"), s, images, labels);
  auto ds = vitgrid::make_hdf5_images(dir.file("a.h5"));
  EXPECT_EQ(ds->num_classes(), 12);
  // two threads reading the same file (the loader thread and, say, an eval loader)
  std::atomic<int> bad{0};
  auto worker = [&](int seed) {
    std::vector<uint8_t> out(8 * 48);
    std::vector<int32_t> lab(8);
    for (int it = 0; it < 200; ++it) {
      std::vector<int64_t> idx(8);
      for (int k = 0; k < 8; ++k) idx[k] = (seed * 7 + it * 13 + k * 29) % 64;
      ds->read(idx.data(), 8, out.data(), lab.data());
      for (int k = 0; k < 8; ++k)
        if (lab[k] != labels[idx[k]] || !std::equal(out.begin() + k * 48, out.begin() + (k + 1) * 48, images.begin() + idx[k] * 48))
          bad++;
    }
  };
  std::thread t1(worker, 1), t2(worker, 2);
  t1.join();
  t2.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(Hdf5Images, RefusesMalformedFiles) {
  TempDir dir;
  auto images = pattern_images(4, 3);
  std::vector<int64_t> labels = {0, 1, 2, 1};
  auto make = [&](const std::string& name, H5Spec s) {
    if (!s.n) s.n = 4;
    if (!s.h) s.h = s.w = 3;
    vgtest::write_h5(dir.file(name), s, images, labels);
    return dir.file(name);
  };
  auto open = [](const std::string& p) { return [p] { vitgrid::make_hdf5_images(p); }; };

  expect_user_error(open(dir.file("absent.h5")), {"absent.h5", "no such file"});
  std::ofstream(dir.file("text.h5")) << "not hdf5 at all\n";
  expect_user_error(open(dir.file("text.h5")), {"text.h5", "not an HDF5 file"});

  H5Spec nolabels;
  nolabels.write_labels = false;
  expect_user_error(open(make("nolabels.h5", nolabels)), {"nolabels.h5", "/labels"});

  H5Spec floats;
  floats.image_type = H5T_IEEE_F32LE;
  expect_user_error(open(make("float.h5", floats)), {"float.h5", "/images", "uint8"});

  H5Spec flabels;
  flabels.label_type = H5T_IEEE_F64LE;
  expect_user_error(open(make("flabels.h5", flabels)), {"flabels.h5", "/labels", "integer"});

  H5Spec nonsquare;
  nonsquare.h = 3;
  nonsquare.w = 4;
  nonsquare.n = 1;
  expect_user_error(open(make("rect.h5", nonsquare)), {"rect.h5", "/images", "not square"});

  H5Spec gray;
  gray.c = 1;
  expect_user_error(open(make("gray.h5", gray)), {"gray.h5", "/images", "3 channels"});

  H5Spec mismatch;
  mismatch.label_count = 3;
  expect_user_error(open(make("count.h5", mismatch)), {"count.h5", "/labels", "3 entries", "4"});

  H5Spec few;
  few.num_classes_attr = 2;  // labels go up to 2
  expect_user_error(open(make("few.h5", few)), {"few.h5", "num_classes = 2"});

  labels[1] = -1;
  expect_user_error(open(make("neg.h5", H5Spec{})), {"neg.h5", "/labels", "negative"});
  labels[1] = 1;

  // rank 3 images
  hid_t f = H5Fcreate(dir.file("rank3.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  hsize_t d3[3] = {4, 3, 3};
  hid_t sp = H5Screate_simple(3, d3, nullptr);
  hid_t ds = H5Dcreate2(f, "images", H5T_STD_U8LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dclose(ds);
  H5Sclose(sp);
  H5Fclose(f);
  expect_user_error(open(dir.file("rank3.h5")), {"rank3.h5", "/images", "rank 4"});
  // missing /images
  f = H5Fcreate(dir.file("empty.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  H5Fclose(f);
  expect_user_error(open(dir.file("empty.h5")), {"empty.h5", "missing dataset /images"});
}

TEST(MakeDataset, FromDeck) {
  vitgrid::Deck deck;
  deck.data.dataset = "synthetic";
  deck.data.synthetic_train = 300;
  deck.data.synthetic_eval = 70;
  deck.model.image_size = 16;
  deck.model.num_classes = 7;
  deck.run.seed = 5;
  auto tr = vitgrid::make_dataset(deck, true);
  auto ev = vitgrid::make_dataset(deck, false);
  EXPECT_EQ(tr->size(), 300);
  EXPECT_EQ(ev->size(), 70);
  EXPECT_EQ(tr->image_size(), 16);
  EXPECT_EQ(ev->num_classes(), 7);
  // same bytes as make_synthetic with the deck's seed
  auto direct = vitgrid::make_synthetic(5, false, 70, 16, 7);
  std::vector<uint8_t> a(16 * 16 * 3), b(16 * 16 * 3);
  int32_t la, lb;
  int64_t i = 42;
  ev->read(&i, 1, a.data(), &la);
  direct->read(&i, 1, b.data(), &lb);
  EXPECT_EQ(a, b);
  EXPECT_EQ(la, lb);

  TempDir dir;
  vgtest::write_fake_cifar(dir.path(), 1);
  deck.data.dataset = "cifar10";
  deck.data.path = dir.path();
  expect_user_error([&] { vitgrid::make_dataset(deck, true); }, {"model.image_size = 16", "32x32"});
  deck.model.image_size = 32;
  expect_user_error([&] { vitgrid::make_dataset(deck, true); }, {"model.num_classes = 7", "10 classes"});
  deck.model.num_classes = 10;
  EXPECT_EQ(vitgrid::make_dataset(deck, false)->size(), 1);

  // hdf5: eval_path, then X_eval.h5 beside X_train.h5, then the train file
  H5Spec s;
  s.n = 4;
  s.h = s.w = 32;
  s.num_classes_attr = 10;
  auto images = pattern_images(4, 32);
  vgtest::write_h5(dir.file("d_train.h5"), s, images, {0, 1, 2, 3});
  s.n = 2;
  vgtest::write_h5(dir.file("d_eval.h5"), s, images, {4, 5});
  s.n = 3;
  vgtest::write_h5(dir.file("other.h5"), s, images, {6, 7, 8});
  deck.data.dataset = "hdf5";
  deck.data.path = dir.file("d_train.h5");
  EXPECT_EQ(vitgrid::make_dataset(deck, true)->size(), 4);
  EXPECT_EQ(vitgrid::make_dataset(deck, false)->size(), 2);
  deck.data.eval_path = dir.file("other.h5");
  EXPECT_EQ(vitgrid::make_dataset(deck, false)->size(), 3);
  deck.data.eval_path.clear();
  std::remove(dir.file("d_eval.h5").c_str());
  EXPECT_EQ(vitgrid::make_dataset(deck, false)->size(), 4);  // falls back, with a warning
  // an encoded source named at a file that is not what it needs
  deck.data.dataset = "tfrecord";
  expect_user_error([&] { vitgrid::make_dataset(deck, true); }, {"TFRecord directory", "not a directory"});
  deck.data.dataset = "webdataset";
  expect_user_error([&] { vitgrid::make_dataset(deck, true); }, {"data.dataset", "webdataset"});
}

// Without the num_classes attribute the count is the largest label + 1, and the dataset says
// so (make_dataset prints it) instead of deciding silently; with it, nothing to say.
TEST(Hdf5Images, InferredClassCountIsReported) {
  TempDir dir;
  H5Spec s;
  s.n = 4;
  s.h = s.w = 3;
  auto images = pattern_images(4, 3);
  vgtest::write_h5(dir.file("noattr.h5"), s, images, {0, 2, 1, 2});
  auto ds = vitgrid::make_hdf5_images(dir.file("noattr.h5"));
  EXPECT_EQ(ds->num_classes(), 3);
  const std::string w = ds->warning();
  EXPECT_NE(w.find("noattr.h5"), std::string::npos) << w;
  EXPECT_NE(w.find("num_classes"), std::string::npos) << w;
  EXPECT_NE(w.find("largest label + 1 = 3"), std::string::npos) << w;
  EXPECT_NE(w.find("f.attrs['num_classes']"), std::string::npos) << w;
  s.num_classes_attr = 3;
  vgtest::write_h5(dir.file("attr.h5"), s, images, {0, 2, 1, 2});
  EXPECT_EQ(vitgrid::make_hdf5_images(dir.file("attr.h5"))->warning(), "");
}

// A FIFO or a device named as a data file is refused as such; the reader would otherwise block
// on the FIFO or read /dev/zero forever.
TEST(DataFiles, NotRegularFilesAreRefused) {
  TempDir dir;
  ASSERT_EQ(mkfifo(dir.file("fifo.h5").c_str(), 0600), 0);
  expect_user_error([&] { vitgrid::make_hdf5_images(dir.file("fifo.h5")); },
                    {"fifo.h5", "not a regular file"});
  expect_user_error([&] { vitgrid::make_hdf5_images("/dev/zero"); },
                    {"/dev/zero", "not a regular file"});
  expect_user_error([&] { vitgrid::make_hdf5_images(dir.path()); }, {"is a directory"});
  vgtest::write_fake_cifar(dir.path(), 1);
  std::remove(dir.file("test_batch.bin").c_str());
  ASSERT_EQ(mkfifo(dir.file("test_batch.bin").c_str(), 0600), 0);
  expect_user_error([&] { vitgrid::make_cifar10(dir.path(), false); },
                    {"test_batch.bin", "not a regular file"});
}

// A header that claims more samples than the file has bytes (a corrupted or hand-made file:
// here /images and /labels declared with 2^40 entries and never written) is refused before a
// label buffer is sized from the claim (8 TiB: std::bad_alloc, or the OOM killer).
TEST(Hdf5Images, ImplausibleSampleCountIsRefused) {
  TempDir dir;
  const std::string path = dir.file("huge.h5");
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  const hsize_t n = hsize_t(1) << 40;
  hsize_t dims[4] = {n, 2, 2, 3}, chunk[4] = {1, 2, 2, 3};
  hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
  H5Pset_chunk(dcpl, 4, chunk);
  hid_t sp = H5Screate_simple(4, dims, nullptr);
  H5Dclose(H5Dcreate2(f, "images", H5T_STD_U8LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT));
  H5Sclose(sp);
  hsize_t lchunk = 1024;
  H5Pset_chunk(dcpl, 1, &lchunk);
  hid_t lsp = H5Screate_simple(1, &n, nullptr);
  H5Dclose(H5Dcreate2(f, "labels", H5T_STD_I64LE, lsp, H5P_DEFAULT, dcpl, H5P_DEFAULT));
  H5Sclose(lsp);
  H5Pclose(dcpl);
  H5Fclose(f);
  expect_user_error([&] { vitgrid::make_hdf5_images(path); },
                    {"huge.h5", std::to_string(n) + " samples", "bytes"});
}

// The sampler's permutation (8 bytes a sample, every rank) is checked against the memory a
// rank may have before the loader's thread allocates it, where a std::bad_alloc could not be
// agreed on. In a child process whose address space is limited to 1 GiB (ulimit -v), a split of
// 2^27 samples (1 GiB of permutation) is refused; the parent's limits stay as they were.
TEST(MakeDataset, SamplerPermutationMustFitTheAddressSpace) {
  vitgrid::Deck deck;
  deck.data.dataset = "synthetic";
  deck.data.synthetic_train = int64_t(1) << 27;
  deck.model.image_size = 8;
  deck.model.num_classes = 4;
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    struct rlimit rl;
    getrlimit(RLIMIT_AS, &rl);
    rl.rlim_cur = rlim_t(1) << 30;
    if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(3);
    try {
      vitgrid::make_dataset(deck, false);  // eval holds no permutation: fine
      vitgrid::make_dataset(deck, true);
    } catch (const vitgrid::UserError& e) {
      const std::string m = e.what();
      _exit(m.find("data.synthetic_train") != std::string::npos &&
                    m.find("permutation") != std::string::npos &&
                    m.find("address-space limit") != std::string::npos
                ? 0
                : 2);
    }
    _exit(1);  // accepted
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: accepted, 2: wrong message, 3: setrlimit failed";
}

// A compressed chunk whose bytes are damaged is found only when a batch reads it: the error
// names the file, the samples and HDF5's reason, and HDF5's own error stack stays quiet (it
// printed a page of "HDF5-DIAG" trace before the message).
namespace {
// An 8-sample gzip file of 2-sample chunks whose chunk `chunk` has its deflate stream damaged.
std::string gzip_file_with_damaged_chunk(const TempDir& dir, const std::string& name, int chunk) {
  H5Spec s;
  s.n = 8;
  s.h = s.w = 8;
  s.chunked = true;
  s.chunk_images = 2;
  s.gzip = 6;
  s.num_classes_attr = 4;
  const std::string path = dir.file(name);
  vgtest::write_h5(path, s, pattern_images(8, 8), {0, 1, 2, 3, 0, 1, 2, 3});
  // where the chunk lies, from the library
  haddr_t addr = HADDR_UNDEF;
  hsize_t bytes = 0;
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t d = H5Dopen2(f, "images", H5P_DEFAULT);
  hsize_t start[4] = {hsize_t(2 * chunk), 0, 0, 0};
  unsigned mask = 0;
  H5Dget_chunk_info_by_coord(d, start, &mask, &addr, &bytes);
  H5Dclose(d);
  H5Fclose(f);
  EXPECT_NE(addr, HADDR_UNDEF);
  EXPECT_GT(bytes, 8u);
  std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
  io.seekp((std::streamoff)addr + 2);  // past the zlib header: the deflate stream itself
  for (int k = 0; k < 6; ++k) io.put((char)0xff);
  return path;
}
}  // namespace

TEST(Hdf5Images, DamagedCompressedChunkIsNamed) {
  TempDir dir;
  const std::string path = gzip_file_with_damaged_chunk(dir, "gz.h5", 1);  // samples 2 and 3
  auto ds = vitgrid::make_hdf5_images(path);  // the header and chunks 0 and 3 are intact
  std::vector<uint8_t> img(8 * 8 * 3 * 2);
  int32_t lab[2];
  int64_t idx[2] = {2, 3};
  testing::internal::CaptureStderr();
  std::string what;
  try {
    ds->read(idx, 2, img.data(), lab);
  } catch (const std::exception& e) {
    what = e.what();
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(what.find("gz.h5: reading /images samples 2..3 failed"), std::string::npos) << what;
  EXPECT_NE(what.find("the file is damaged"), std::string::npos) << what;
  EXPECT_EQ(err.find("HDF5-DIAG"), std::string::npos) << err;
}

// The first and the last sample are decoded when the file is opened (as the direct path
// compares them): damage there, or filter parameters that cannot decode at all, is refused at
// setup, where every rank agrees, instead of on one rank in the middle of the run.
TEST(Hdf5Images, UndecodableFirstOrLastChunkIsRefusedAtOpen) {
  TempDir dir;
  expect_user_error(
      [&] { vitgrid::make_hdf5_images(gzip_file_with_damaged_chunk(dir, "first.h5", 0)); },
      {"first.h5", "samples 0..0", "the file is damaged"});
  expect_user_error(
      [&] { vitgrid::make_hdf5_images(gzip_file_with_damaged_chunk(dir, "last.h5", 3)); },
      {"last.h5", "samples 7..7", "the file is damaged"});
}
