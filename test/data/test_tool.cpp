// tools/vitgrid_dataset: its files read back through make_hdf5_images hold exactly the samples
// of make_synthetic / make_cifar10; bad arguments exit 2.
#include <gtest/gtest.h>

#include <cstdlib>
#include <numeric>
#include <string>
#include <sys/wait.h>

#include "data_test_util.h"
#include "vitgrid/data/dataset.h"

namespace {

int run(const std::string& args) {
  int rc = std::system((std::string(VG_DATASET_TOOL) + " " + args + " >/dev/null 2>&1").c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

void expect_same(vitgrid::Dataset& a, vitgrid::Dataset& b) {
  ASSERT_EQ(a.size(), b.size());
  ASSERT_EQ(a.image_size(), b.image_size());
  ASSERT_EQ(a.num_classes(), b.num_classes());
  const int n = (int)a.size();
  const size_t img = (size_t)a.image_size() * a.image_size() * 3;
  std::vector<int64_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::vector<uint8_t> ia(n * img), ib(n * img);
  std::vector<int32_t> la(n), lb(n);
  a.read(idx.data(), n, ia.data(), la.data());
  b.read(idx.data(), n, ib.data(), lb.data());
  EXPECT_EQ(la, lb);
  EXPECT_EQ(ia, ib);
}

}  // namespace

TEST(DatasetTool, SyntheticMatchesMakeSynthetic) {
  vgtest::TempDir dir;
  const std::string prefix = dir.file("syn");
  // 150 train images (older versions of the tool wrote chunks of 64: a partial last chunk)
  ASSERT_EQ(run("synthetic " + prefix + " --train 150 --eval 30 --size 12 --classes 5 --seed 9"), 0);
  auto tr = vitgrid::make_hdf5_images(prefix + "_train.h5");
  auto ev = vitgrid::make_hdf5_images(prefix + "_eval.h5");
  // /images is contiguous and unfiltered, so the reader pread()s it without the HDF5 lock
  for (const char* split : {"_train.h5", "_eval.h5"}) {
    hid_t f = H5Fopen((prefix + split).c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, "images", H5P_DEFAULT);
    hid_t dcpl = H5Dget_create_plist(d);
    EXPECT_EQ(H5Pget_layout(dcpl), H5D_CONTIGUOUS) << split;
    EXPECT_EQ(H5Pget_nfilters(dcpl), 0) << split;
    H5Pclose(dcpl);
    H5Dclose(d);
    H5Fclose(f);
  }
  EXPECT_NE(tr->describe().find("contiguous, pread"), std::string::npos) << tr->describe();
  EXPECT_NE(ev->describe().find("contiguous, pread"), std::string::npos) << ev->describe();
  expect_same(*tr, *vitgrid::make_synthetic(9, true, 150, 12, 5));
  expect_same(*ev, *vitgrid::make_synthetic(9, false, 30, 12, 5));
}

TEST(DatasetTool, Cifar10MatchesReader) {
  vgtest::TempDir dir;
  vgtest::write_fake_cifar(dir.path(), 3);
  ASSERT_EQ(run("cifar10 " + dir.path() + " " + dir.file("c")), 0);
  expect_same(*vitgrid::make_hdf5_images(dir.file("c_train.h5")), *vitgrid::make_cifar10(dir.path(), true));
  expect_same(*vitgrid::make_hdf5_images(dir.file("c_eval.h5")), *vitgrid::make_cifar10(dir.path(), false));
}

TEST(DatasetTool, BadArgumentsExit2) {
  vgtest::TempDir dir;
  EXPECT_EQ(run(""), 2);
  EXPECT_EQ(run("imagenet x"), 2);
  EXPECT_EQ(run("synthetic " + dir.file("s") + " --train 10 --eval 10 --size 8 --classes 3"), 2);  // no seed
  EXPECT_EQ(run("synthetic " + dir.file("s") + " --train ten --eval 10 --size 8 --classes 3 --seed 1"), 2);
  EXPECT_EQ(run("synthetic " + dir.file("s") + " --train 10 --eval 10 --size 8 --classes 3 --seed 1 --bogus 1"), 2);
  EXPECT_EQ(run("cifar10 " + dir.file("nowhere") + " " + dir.file("o")), 2);  // missing files: UserError
}
