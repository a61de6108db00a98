// Sources of encoded images: an ImageFolder tree (make_jpeg_tree.py, Pillow), TFRecord shards
// of the same tree written by an independent writer (write_tfrecord.py: protoc's Python
// classes, crcmod's CRC32C, 1-based labels) and the packed files vitgrid_dataset pack writes
// from either must yield the same (bytes, label) for every sample. Then the TFRecord index
// cache, the hold-out split, bad data of each kind, concurrent reads and `verify`.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "data_test_util.h"
#include "vitgrid/core/error.h"
#include "vitgrid/data/image_decode.h"
#include "vitgrid/data/image_source.h"

namespace {

namespace fs = std::filesystem;
using vitgrid::ImageSource;
using vitgrid::ImageSourceOptions;

// Runs a command; its exit status, its stdout+stderr in *out.
int run(const std::string& cmd, std::string* out = nullptr) {
  std::string text;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) text.append(buf, n);
  const int rc = pclose(p);
  if (out) *out = text;
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

std::string py() { return std::string(VG_PYTHON3) + " " + VG_TEST_DATA_DIR + "/"; }
std::string tool() { return VG_DATASET_TOOL; }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void copy_dir_files(const std::string& from, const std::string& to) {
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(from))
    if (e.is_regular_file()) fs::copy_file(e.path(), to + "/" + e.path().filename().string());
}

std::vector<std::string> idx_files(const std::string& dir) {
  std::vector<std::string> v;
  if (!fs::is_directory(dir)) return v;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".idx") v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

// Lines "offset size" of an index file.
std::vector<std::pair<uint64_t, uint64_t>> parse_idx(const std::string& path) {
  std::vector<std::pair<uint64_t, uint64_t>> v;
  std::ifstream in(path);
  uint64_t o, s;
  while (in >> o >> s) v.emplace_back(o, s);
  return v;
}

// The UserError message of f(), or "" if it did not throw one.
template <class F>
std::string user_error(F f) {
  try {
    f();
  } catch (const vitgrid::UserError& e) {
    return e.what();
  }
  return "";
}

ImageSourceOptions opts(bool train, int label_offset = 0, int K = 0, std::string index_dir = "") {
  ImageSourceOptions o;
  o.train = train;
  o.label_offset = label_offset;
  o.num_classes = K;
  o.index_dir = std::move(index_dir);
  return o;
}

constexpr int kClasses = 3;
constexpr const char* kTruncated = "n00001037_train_00000.JPEG";  // make_jpeg_tree's cut file

class ImageSources : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new vgtest::TempDir;
    const std::string d = dir_->path();
    std::string out;
    ASSERT_EQ(
        run(py() + "make_jpeg_tree.py " + d + "/tree --classes 3 --train 6 --val 2 --seed 3", &out),
        0)
        << out;
    ASSERT_EQ(run(py() + "write_tfrecord.py " + d + "/tree " + d + "/tfr --shards 2 --val-shards 1",
                  &out),
              0)
        << out;
    ASSERT_EQ(run(tool() + " pack " + d + "/tree " + d + "/packed.h5", &out), 0) << out;
    ASSERT_EQ(run(tool() + " pack " + d + "/tfr " + d + "/tpacked.h5", &out), 0) << out;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string path(const std::string& name) { return dir_->file(name); }
  static vgtest::TempDir* dir_;
};
vgtest::TempDir* ImageSources::dir_ = nullptr;

TEST_F(ImageSources, SameBytesAndLabelsAcrossSources) {
  for (bool train : {true, false}) {
    SCOPED_TRACE(train ? "train" : "eval");
    auto folder = vitgrid::open_image_folder(path("tree"), opts(train));
    auto tfr = vitgrid::open_tfrecord(path("tfr"), opts(train, -1, kClasses, path("idx_same")));
    auto h5 = vitgrid::open_jpeg_h5(path("packed.h5"), opts(train));
    auto th5 =
        vitgrid::open_jpeg_h5(path(train ? "tpacked_train.h5" : "tpacked_val.h5"), opts(train));
    ASSERT_EQ(folder->size(), train ? 18 : 6);
    EXPECT_EQ(folder->num_classes(), kClasses);
    const std::vector<std::string> names = {"n00001000", "n00001037", "n00001074"};
    EXPECT_EQ(folder->class_names(), names);
    EXPECT_EQ(h5->class_names(), names);
    EXPECT_EQ(th5->class_names(), (std::vector<std::string>{"0", "1", "2"}));
    EXPECT_TRUE(tfr->class_names().empty());
    for (const ImageSource* s : {tfr.get(), h5.get(), th5.get()}) {
      SCOPED_TRACE(s->describe());
      ASSERT_EQ(s->size(), folder->size());
      EXPECT_EQ(s->num_classes(), kClasses);
    }
    std::vector<uint8_t> a, b;
    int32_t la = -1, lb = -1;
    for (int64_t i = 0; i < folder->size(); ++i) {
      folder->read(i, a, la);
      const std::string file = slurp(folder->where(i));
      ASSERT_EQ(std::string(a.begin(), a.end()), file) << folder->where(i);
      // sorted classes, sorted files: the label is the class's position
      EXPECT_EQ(la, (int32_t)(std::find(names.begin(), names.end(),
                                        fs::path(folder->where(i)).parent_path().filename()) -
                              names.begin()));
      for (const ImageSource* s : {tfr.get(), h5.get(), th5.get()}) {
        s->read(i, b, lb);
        ASSERT_EQ(a, b) << s->where(i) << " vs " << folder->where(i);
        ASSERT_EQ(la, lb) << s->where(i);
      }
    }
  }
  // path forms: the prefix given to pack, or a split file
  EXPECT_EQ(vitgrid::open_jpeg_h5(path("packed_train.h5"), opts(false))->size(), 6);
  EXPECT_EQ(vitgrid::open_jpeg_h5(path("packed_train.h5"), opts(true))->size(), 18);
  EXPECT_NE(user_error([&] {
              vitgrid::open_jpeg_h5(path("nothing.h5"), opts(true));
            }).find("nothing_train.h5"),
            std::string::npos);
}

TEST_F(ImageSources, IndexBuiltOnceReusedAndOnlyInIndexDir) {
  vgtest::TempDir t;
  const std::string shards = t.file("shards"), idx = t.file("idx");
  copy_dir_files(path("tfr"), shards);
  auto s1 = vitgrid::open_tfrecord(shards, opts(true, -1, kClasses, idx));
  EXPECT_NE(s1->describe().find("0 beside, 0 cached, 2 built"), std::string::npos)
      << s1->describe();
  const std::vector<std::string> want = {"train-00000-of-00002.idx", "train-00001-of-00002.idx"};
  ASSERT_EQ(idx_files(idx), want);
  EXPECT_TRUE(idx_files(shards).empty()) << "an index was written beside the data";
  // DALI's format: records tile the shard, size = 16 + data length
  int64_t records = 0;
  for (const std::string& f : want) {
    const auto lines = parse_idx(idx + "/" + f);
    uint64_t end = 0;
    for (const auto& l : lines) {
      EXPECT_EQ(l.first, end);
      end += l.second;
    }
    EXPECT_EQ(end, fs::file_size(shards + "/" + f.substr(0, f.size() - 4)));
    records += (int64_t)lines.size();
  }
  EXPECT_EQ(records, s1->size());
  const std::string before = slurp(idx + "/" + want[0]);

  // reused, not rewritten
  const auto mtime = fs::last_write_time(idx + "/" + want[0]);
  auto s2 = vitgrid::open_tfrecord(shards, opts(true, -1, kClasses, idx));
  EXPECT_NE(s2->describe().find("0 beside, 2 cached, 0 built"), std::string::npos)
      << s2->describe();
  EXPECT_EQ(fs::last_write_time(idx + "/" + want[0]), mtime);

  // a corrupt index (offsets not monotone; one cut short) is rebuilt, and says so
  {
    std::ofstream(idx + "/" + want[0]) << "0 100\n50 100\n";
    std::ofstream(idx + "/" + want[1]) << "garbage\n";
  }
  auto s3 = vitgrid::open_tfrecord(shards, opts(true, -1, kClasses, idx));
  EXPECT_NE(s3->describe().find("0 cached, 2 built"), std::string::npos) << s3->describe();
  EXPECT_NE(s3->describe().find("invalid"), std::string::npos) << s3->describe();
  EXPECT_EQ(slurp(idx + "/" + want[0]), before);
  EXPECT_EQ(idx_files(idx), want) << "a temporary file was left behind";

  // an index beside the shard is read first
  fs::copy_file(idx + "/" + want[0], shards + "/" + want[0]);
  auto s4 = vitgrid::open_tfrecord(shards, opts(true, -1, kClasses, idx));
  EXPECT_NE(s4->describe().find("1 beside, 1 cached, 0 built"), std::string::npos)
      << s4->describe();
  fs::remove(shards + "/" + want[0]);

  // no index_dir: built in memory, written nowhere
  vgtest::TempDir t2;
  copy_dir_files(path("tfr"), t2.file("s"));
  auto s5 = vitgrid::open_tfrecord(t2.file("s"), opts(true, -1, kClasses, ""));
  EXPECT_NE(s5->describe().find("2 built"), std::string::npos) << s5->describe();
  EXPECT_TRUE(idx_files(t2.file("s")).empty());

  // the app's parallel build: each part takes its shards
  const std::string idx2 = t2.file("idx2");
  vitgrid::tfrecord_build_indexes(t2.file("s"), idx2, true, 1, 2);
  EXPECT_EQ(idx_files(idx2), std::vector<std::string>{want[1]});
  vitgrid::tfrecord_build_indexes(t2.file("s"), idx2, true, 0, 2);
  EXPECT_EQ(idx_files(idx2), want);
  vitgrid::tfrecord_build_indexes(t2.file("s"), idx2, false, 0, 1);
  EXPECT_EQ(idx_files(idx2).size(), 3u);
  auto s6 = vitgrid::open_tfrecord(t2.file("s"), opts(false, -1, kClasses, idx2));
  EXPECT_NE(s6->describe().find("1 cached, 0 built"), std::string::npos) << s6->describe();
  EXPECT_EQ(s6->size(), 6);
}

TEST_F(ImageSources, HoldOutSplitDeterministicAndDisjoint) {
  vgtest::TempDir t;
  const std::string root = t.file("flat");
  std::string out;
  ASSERT_EQ(
      run(py() + "make_jpeg_tree.py " + root + " --flat --no-bad --classes 3 --train 5 --val 2",
          &out),
      0)
      << out;
  std::ofstream(root + "/n00001000/notes.txt") << "not an image\n";
  ImageSourceOptions o = opts(true);
  o.eval_fraction = 0.25;  // 7 per class: ceil(1.75) = 2 held out
  auto tr = vitgrid::open_image_folder(root, o);
  o.train = false;
  auto ev = vitgrid::open_image_folder(root, o);
  EXPECT_EQ(tr->size(), 15);
  EXPECT_EQ(ev->size(), 6);
  EXPECT_NE(tr->describe().find("1 other files skipped"), std::string::npos) << tr->describe();
  std::set<std::string> seen;
  for (const ImageSource* s : {tr.get(), ev.get()})
    for (int64_t i = 0; i < s->size(); ++i) EXPECT_TRUE(seen.insert(s->where(i)).second);
  EXPECT_EQ(seen.size(), 21u);
  // the held-out files are the last two (sorted) of each class
  for (int64_t i = 0; i < ev->size(); ++i) {
    const std::string name = fs::path(ev->where(i)).filename().string();
    EXPECT_TRUE(name.find("_val_") != std::string::npos) << name;
  }
  auto ev2 = vitgrid::open_image_folder(root, o);
  for (int64_t i = 0; i < ev->size(); ++i) EXPECT_EQ(ev->where(i), ev2->where(i));
  // no hold-out: one set, said so
  o.eval_fraction = 0.0;
  auto all = vitgrid::open_image_folder(root, o);
  EXPECT_EQ(all->size(), 21);
  EXPECT_NE(all->describe().find("(no held-out split)"), std::string::npos) << all->describe();
  for (double bad : {1.0, -0.1}) {
    o.eval_fraction = bad;
    EXPECT_NE(user_error([&] { vitgrid::open_image_folder(root, o); }).find("[0, 1)"),
              std::string::npos);
  }
  // an empty class is refused by name, as torchvision refuses it
  fs::create_directories(root + "/n00009999");
  o.eval_fraction = 0.25;
  EXPECT_NE(user_error([&] { vitgrid::open_image_folder(root, o); }).find("n00009999"),
            std::string::npos);
  EXPECT_NE(user_error([&] { vitgrid::open_image_folder(t.file("none"), o); }).find("none"),
            std::string::npos);
}

// Offset of record k of a good shard, from an index built for the purpose.
uint64_t record_offset(const std::string& shards, const std::string& name, int k) {
  vgtest::TempDir t;
  vitgrid::tfrecord_build_indexes(shards, t.path(), name.rfind("train", 0) == 0, 0, 1);
  return parse_idx(t.file(name + ".idx")).at((size_t)k).first;
}

TEST_F(ImageSources, BadCrcAndCutRecordRefusedByShardAndOffset) {
  const std::string shard = "train-00000-of-00002";
  const uint64_t off1 = record_offset(path("tfr"), shard, 1);
  const auto good = parse_idx([&] {
    vgtest::TempDir t;
    vitgrid::tfrecord_build_indexes(path("tfr"), t.path(), true, 0, 1);
    static std::string keep;
    keep = slurp(t.file(shard + ".idx"));
    std::ofstream(path("good.idx")) << keep;
    return path("good.idx");
  }());
  vgtest::TempDir t;
  std::string out;
  // found by the scan that builds the index
  ASSERT_EQ(run(py() + "write_tfrecord.py " + path("tree") + " " + t.file("crc") +
                    " --damage crc --damage-record 1",
                &out),
            0)
      << out;
  std::string msg = user_error([&] { vitgrid::open_tfrecord(t.file("crc"), opts(true, -1, 3)); });
  EXPECT_NE(msg.find(shard + ": record at offset " + std::to_string(off1) + ": bad CRC"),
            std::string::npos)
      << msg;
  ASSERT_EQ(
      run(py() + "write_tfrecord.py " + path("tree") + " " + t.file("cut") + " --damage cut", &out),
      0)
      << out;
  msg = user_error([&] { vitgrid::open_tfrecord(t.file("cut"), opts(true, -1, 3)); });
  EXPECT_NE(
      msg.find(shard + ": record at offset " + std::to_string(good.back().first) + ": cut off"),
      std::string::npos)
      << msg;
  // found by read() when a valid index was made before the damage
  copy_dir_files(path("tfr"), t.file("late"));
  auto src = vitgrid::open_tfrecord(t.file("late"), opts(true, -1, 3, t.file("idx")));
  {
    std::fstream f(t.file("late/" + shard), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp((std::streamoff)(off1 + 100));
    f.put('\x42');
  }
  std::vector<uint8_t> bytes;
  int32_t label = 0;
  src->read(0, bytes, label);
  msg = user_error([&] { src->read(1, bytes, label); });
  EXPECT_NE(msg.find(shard + ": record at offset " + std::to_string(off1) + ": bad CRC"),
            std::string::npos)
      << msg;
  EXPECT_NE(src->where(1).find(shard), std::string::npos);
  // a shard that is no TFRecord at all
  fs::create_directories(t.file("junk"));
  std::ofstream(t.file("junk/train-00000-of-00001")) << "this is not a tfrecord file at all";
  msg = user_error([&] { vitgrid::open_tfrecord(t.file("junk"), opts(true)); });
  EXPECT_NE(msg.find("train-00000-of-00001: record at offset 0"), std::string::npos) << msg;
  msg = user_error([&] { vitgrid::open_tfrecord(t.file("nowhere"), opts(true)); });
  EXPECT_NE(msg.find("nowhere"), std::string::npos) << msg;
  msg = user_error([&] { vitgrid::open_tfrecord(path("tree"), opts(true)); });
  EXPECT_NE(msg.find("no train shards"), std::string::npos) << msg;
}

TEST_F(ImageSources, LabelOutOfRangeRefused) {
  auto folder = vitgrid::open_image_folder(path("tree"), opts(true));
  auto k2 = vitgrid::open_tfrecord(path("tfr"), opts(true, -1, 2, path("idx_label")));
  auto zero_based = vitgrid::open_tfrecord(path("tfr"), opts(true, 0, 3, path("idx_label")));
  std::vector<uint8_t> b;
  int32_t l = 0;
  int found = 0;
  for (int64_t i = 0; i < folder->size(); ++i) {
    folder->read(i, b, l);
    if (l == 2) {
      const std::string msg = user_error([&] { k2->read(i, b, l); });
      EXPECT_NE(msg.find("record at offset"), std::string::npos) << msg;
      EXPECT_NE(msg.find("label 2 (stored 3 - 1) outside [0, 2)"), std::string::npos) << msg;
      EXPECT_NE(msg.find(k2->where(i).substr(0, k2->where(i).find(" record"))), std::string::npos);
      const std::string msg0 = user_error([&] { zero_based->read(i, b, l); });
      EXPECT_NE(msg0.find("label 3 (stored 3 + 0) outside [0, 3)"), std::string::npos) << msg0;
      ++found;
    }
  }
  EXPECT_EQ(found, 6);
}

// Rewrites one integer dataset of a copy of a packed file.
void poke_ints(const std::string& file, const char* name, size_t at, int64_t value) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  hid_t d = H5Dopen2(f, name, H5P_DEFAULT);
  hid_t sp = H5Dget_space(d);
  std::vector<int64_t> v((size_t)H5Sget_simple_extent_npoints(sp));
  H5Dread(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
  v.at(at) = value;
  H5Dwrite(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
  H5Sclose(sp);
  H5Dclose(d);
  H5Fclose(f);
}

TEST_F(ImageSources, DamagedJpegH5Refused) {
  vgtest::TempDir t;
  auto copy = [&](const std::string& name) {
    fs::copy_file(path("packed_train.h5"), t.file(name));
    return t.file(name);
  };
  auto err = [&](const std::string& file) {
    return user_error([&] { vitgrid::open_jpeg_h5(file, opts(true)); });
  };
  const std::string mono = copy("mono_train.h5");
  poke_ints(mono, "offsets", 3, 5);
  EXPECT_NE(err(mono).find("/offsets is not monotone"), std::string::npos) << err(mono);
  const std::string last = copy("last_train.h5");
  poke_ints(last, "offsets", 18, 7);
  EXPECT_NE(err(last).find("/offsets"), std::string::npos) << err(last);
  const std::string lab = copy("lab_train.h5");
  poke_ints(lab, "labels", 4, 3);
  EXPECT_NE(err(lab).find("/labels[4] = 3 outside [0, 3)"), std::string::npos) << err(lab);
  const std::string cut = copy("cut_train.h5");
  fs::resize_file(cut, fs::file_size(cut) / 2);
  EXPECT_NE(err(cut).find(cut), std::string::npos) << err(cut);
  std::ofstream(t.file("junk_train.h5")) << "not hdf5";
  EXPECT_NE(err(t.file("junk_train.h5")).find("not an HDF5 file"), std::string::npos);

  // a chunked /jpeg (as h5py writes with chunks=True): refused, asked to repack
  const std::string chunked = t.file("chunked_train.h5");
  {
    std::vector<uint8_t> jpeg(1000, 7);
    std::vector<int64_t> offsets = {0, 400, 1000}, labels = {0, 1};
    hid_t f = H5Fcreate(chunked.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hsize_t n = jpeg.size(), chunk = 256;
    hid_t sp = H5Screate_simple(1, &n, nullptr);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(dcpl, 1, &chunk);
    hid_t d = H5Dcreate2(f, "jpeg", H5T_STD_U8LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    H5Dwrite(d, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, jpeg.data());
    H5Dclose(d);
    H5Pclose(dcpl);
    H5Sclose(sp);
    for (auto& [name, v] : {std::make_pair("offsets", offsets), std::make_pair("labels", labels)}) {
      hsize_t m = v.size();
      hid_t s2 = H5Screate_simple(1, &m, nullptr);
      hid_t d2 = H5Dcreate2(f, name, H5T_STD_I64LE, s2, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      H5Dwrite(d2, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
      H5Dclose(d2);
      H5Sclose(s2);
    }
    hid_t sc = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(f, "num_classes", H5T_STD_I64LE, sc, H5P_DEFAULT, H5P_DEFAULT);
    int64_t k = 2;
    H5Awrite(a, H5T_NATIVE_INT64, &k);
    H5Aclose(a);
    H5Sclose(sc);
    H5Fclose(f);
  }
  const std::string msg = err(chunked);
  EXPECT_NE(msg.find("/jpeg is chunked"), std::string::npos) << msg;
  EXPECT_NE(msg.find("repack"), std::string::npos) << msg;
}

TEST_F(ImageSources, ConcurrentReadsMatchSerial) {
  std::vector<std::unique_ptr<ImageSource>> sources;
  sources.push_back(vitgrid::open_image_folder(path("tree"), opts(true)));
  sources.push_back(vitgrid::open_tfrecord(path("tfr"), opts(true, -1, 3, path("idx_conc"))));
  sources.push_back(vitgrid::open_jpeg_h5(path("packed.h5"), opts(true)));
  for (const auto& s : sources) {
    SCOPED_TRACE(s->describe());
    const int64_t n = s->size();
    std::vector<std::vector<uint8_t>> serial((size_t)n);
    std::vector<int32_t> labels((size_t)n);
    for (int64_t i = 0; i < n; ++i) s->read(i, serial[(size_t)i], labels[(size_t)i]);
    std::atomic<int> mismatches{0}, errors{0};
    std::vector<std::thread> pool;
    for (int t = 0; t < 8; ++t)
      pool.emplace_back([&, t] {
        std::mt19937 rng(1234 + t);
        std::vector<uint8_t> b;
        int32_t l = 0;
        for (int k = 0; k < 300; ++k) {
          const int64_t i = (int64_t)(rng() % (uint32_t)n);
          try {
            s->read(i, b, l);
            if (b != serial[(size_t)i] || l != labels[(size_t)i]) ++mismatches;
          } catch (...) {
            ++errors;
          }
        }
      });
    for (auto& th : pool) th.join();
    EXPECT_EQ(mismatches.load(), 0);
    EXPECT_EQ(errors.load(), 0);
  }
}

TEST_F(ImageSources, VerifyListsUndecodableFiles) {
  std::string out;
  EXPECT_EQ(run(tool() + " verify " + path("tree"), &out), 1) << out;
  EXPECT_NE(out.find(kTruncated), std::string::npos) << out;
  EXPECT_NE(out.find("24 images checked, 1 could not be decoded"), std::string::npos) << out;
  EXPECT_EQ(run(tool() + " verify " + path("tfr"), &out), 1) << out;
  EXPECT_NE(out.find("train-00000-of-00002 record"), std::string::npos) << out;
  EXPECT_EQ(run(tool() + " verify " + path("packed.h5"), &out), 1) << out;
  EXPECT_NE(out.find("packed_train.h5 image"), std::string::npos) << out;
  vgtest::TempDir t;
  ASSERT_EQ(
      run(py() + "make_jpeg_tree.py " + t.file("clean") + " --no-bad --classes 2 --train 5 --val 1",
          &out),
      0);
  EXPECT_EQ(run(tool() + " verify " + t.file("clean"), &out), 0) << out;
  EXPECT_NE(out.find("12 images checked, 0 could not be decoded"), std::string::npos) << out;
  EXPECT_EQ(run(tool() + " verify " + t.file("nowhere.h5"), &out), 2) << out;
  EXPECT_EQ(run(tool() + " pack " + t.file("clean"), &out), 2) << out;  // no OUT
}

// pack --short-side: every image whose shorter side exceeds N is stored as Pillow makes it
// (torchvision's Resize(N), bicubic, then save(quality=Q): short_side_reference.py, an
// independent writer): the same size and, decoded, the same pixels within one level (the same
// bytes where Pillow's libjpeg is the one vitgrid links); smaller images and the truncated one
// unchanged; the same file on 1 and 3 threads; the attributes record N and Q; bad options
// refused.
TEST_F(ImageSources, PackShortSideIsPillowsResizeAndSave) {
  vgtest::TempDir t;
  const int N = 96, Q = 85;
  std::string out, ref;
  ASSERT_EQ(run(py() + "short_side_reference.py " + path("tree") + " " + t.file("ref") + " " +
                    std::to_string(N) + " " + std::to_string(Q),
                &ref),
            0)
      << ref;
  const std::string args = " --short-side " + std::to_string(N) + " --quality " + std::to_string(Q);
  ASSERT_EQ(run(tool() + " pack " + path("tree") + " " + t.file("s3.h5") + args + " --threads 3",
                &out),
            0)
      << out;
  EXPECT_NE(out.find(kTruncated + std::string(": copied unchanged")), std::string::npos) << out;
  EXPECT_NE(out.find("of 24 images to a shorter side of 96 (quality 85); 1 that could not be "
                     "decoded copied unchanged"),
            std::string::npos)
      << out;
  ASSERT_EQ(run(tool() + " pack " + path("tree") + " " + t.file("s1.h5") + args + " --threads 1",
                &out),
            0)
      << out;
  // (the images and labels, not the files' bytes: HDF5 stamps each object with its time)
  for (bool train : {true, false}) {
    auto s3 = vitgrid::open_jpeg_h5(t.file("s3.h5"), opts(train));
    auto s1 = vitgrid::open_jpeg_h5(t.file("s1.h5"), opts(train));
    ASSERT_EQ(s3->size(), s1->size());
    std::vector<uint8_t> a, b;
    int32_t la, lb;
    for (int64_t i = 0; i < s3->size(); ++i) {
      s3->read(i, a, la);
      s1->read(i, b, lb);
      EXPECT_TRUE(a == b && la == lb) << "1 and 3 threads differ at " << s3->where(i);
    }
  }
  // the reference's word for each file (by name: the tree's names are unique)
  std::map<std::string, std::string> status;
  {
    std::istringstream lines(ref);
    for (std::string line; std::getline(lines, line);) {
      const std::string word = line.substr(0, line.find(' '));
      status[fs::path(line.substr(line.rfind(' ') + 1)).filename().string()] = word;
    }
  }
  EXPECT_EQ(status[kTruncated], "bad");
  int resized = 0, same_bytes = 0;
  for (bool train : {true, false}) {
    auto packed = vitgrid::open_jpeg_h5(t.file("s3.h5"), opts(train));
    auto orig = vitgrid::open_image_folder(path("tree"), opts(train));
    auto pil = vitgrid::open_image_folder(t.file("ref"), opts(train));
    ASSERT_EQ(packed->size(), orig->size());
    ASSERT_EQ(pil->size(), orig->size());
    std::vector<uint8_t> a, o, r;
    int32_t la, lo, lr;
    vitgrid::DecodedImage da, dr;
    for (int64_t i = 0; i < orig->size(); ++i) {
      SCOPED_TRACE(orig->where(i));
      packed->read(i, a, la);
      orig->read(i, o, lo);
      pil->read(i, r, lr);
      EXPECT_EQ(la, lo);
      const std::string name = fs::path(orig->where(i)).filename().string();
      ASSERT_EQ(status.count(name), 1u) << ref;
      if (status[name] != "resized") {
        EXPECT_EQ(a, o) << "not resized: the source's bytes";
        continue;
      }
      ++resized;
      same_bytes += a == r;
      const vitgrid::ImageInfo ia = vitgrid::peek_image(a.data(), a.size());
      const vitgrid::ImageInfo ir = vitgrid::peek_image(r.data(), r.size());
      EXPECT_EQ(ia.format, vitgrid::ImageFormat::Jpeg);
      ASSERT_EQ(ia.width, ir.width);
      ASSERT_EQ(ia.height, ir.height);
      EXPECT_EQ(std::min(ia.width, ia.height), N);
      vitgrid::decode_image(a.data(), a.size(), da);
      vitgrid::decode_image(r.data(), r.size(), dr);
      ASSERT_EQ(da.rgb.size(), dr.rgb.size());
      int most = 0;
      for (size_t k = 0; k < da.rgb.size(); ++k) most = std::max(most, std::abs(da.rgb[k] - dr.rgb[k]));
      EXPECT_LE(most, 1);
    }
  }
  EXPECT_GE(resized, 12) << ref;  // most of the tree's 60-500 px images
  std::printf("pack --short-side: %d images resized, %d of them byte for byte Pillow's\n",
              resized, same_bytes);
  ASSERT_EQ(run("h5dump -a short_side -a quality " + t.file("s3_train.h5"), &out), 0) << out;
  EXPECT_NE(out.find("(0): 96"), std::string::npos) << out;
  EXPECT_NE(out.find("(0): 85"), std::string::npos) << out;
  for (const char* bad : {" --quality 90", " --short-side 0", " --short-side 96 --quality 101",
                          " --short-side x"})
    EXPECT_EQ(run(tool() + " pack " + path("tree") + " " + t.file("bad.h5") + bad, &out), 2)
        << bad << ": " << out;
  EXPECT_FALSE(fs::exists(t.file("bad_train.h5")));
}

}  // namespace
