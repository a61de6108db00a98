// predictions.h5: each rank's rows land at their dataset indices; ranks without rows still
// take part; the file appears only under its final name.
#include <gtest/gtest.h>

#include "io_test_util.h"
#include "vitgrid/io/metrics.h"

namespace {

using vgtest::rank_of;
using vgtest::size_of;

float logit(int64_t row, int k) { return static_cast<float>(row) * 10.0f + static_cast<float>(k) - 0.5f; }
int32_t label(int64_t row) { return static_cast<int32_t>((row * 7) % 5); }

// Rows [first, first + count) of this rank, in the layout write_predictions takes.
void make_rows(int64_t first, int64_t count, int k, std::vector<float>* logits, std::vector<int32_t>* labels) {
  logits->clear();
  labels->clear();
  for (int64_t i = first; i < first + count; ++i) {
    for (int c = 0; c < k; ++c) logits->push_back(logit(i, c));
    labels->push_back(label(i));
  }
}

void expect_file(const std::string& path, int64_t total, int k) {
  std::vector<hsize_t> dl, db;
  auto lg = vgtest::read_all<float>(path, "/logits", H5T_NATIVE_FLOAT, &dl);
  auto lb = vgtest::read_all<int32_t>(path, "/labels", H5T_NATIVE_INT32, &db);
  EXPECT_EQ(dl, (std::vector<hsize_t>{static_cast<hsize_t>(total), static_cast<hsize_t>(k)}));
  EXPECT_EQ(db, (std::vector<hsize_t>{static_cast<hsize_t>(total)}));
  ASSERT_EQ(lg.size(), static_cast<size_t>(total * k));
  ASSERT_EQ(lb.size(), static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) {
    EXPECT_EQ(lb[i], label(i)) << "row " << i;
    for (int c = 0; c < k; ++c) EXPECT_EQ(lg[i * k + c], logit(i, c)) << "row " << i << " class " << c;
  }
}

TEST(Predictions, RowsLandInDatasetOrder) {
  vgtest::SharedTmpDir tmp;
  const int k = 3, p = size_of(), r = rank_of();
  const int64_t total = 11;
  // uneven blocks, assigned in reverse rank order so file order != rank order
  const int part = p - 1 - r;
  const int64_t first = total * part / p, count = total * (part + 1) / p - first;
  std::vector<float> logits;
  std::vector<int32_t> labels;
  make_rows(first, count, k, &logits, &labels);
  const std::string path = tmp / "out/predictions.h5";
  vitgrid::write_predictions(MPI_COMM_WORLD, path, "deck text", total, k, first, logits, labels);
  if (r == 0) {
    expect_file(path, total, k);
    EXPECT_EQ(vgtest::read_string_attr(path, "deck"), "deck text");
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  }
}

TEST(Predictions, RanksWithoutRowsAndOverwrite) {
  vgtest::SharedTmpDir tmp;
  const int k = 2;
  const int64_t total = 5;
  const std::string path = tmp / "predictions.h5";
  // the last rank holds everything, the others nothing; written twice: the second replaces
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<float> logits;
    std::vector<int32_t> labels;
    const bool mine = rank_of() == size_of() - 1;
    make_rows(0, mine ? total : 0, k, &logits, &labels);
    vitgrid::write_predictions(MPI_COMM_WORLD, path, "pass " + std::to_string(pass), total, k,
                               mine ? 0 : -1, logits, labels);
  }
  if (rank_of() == 0) {
    expect_file(path, total, k);
    EXPECT_EQ(vgtest::read_string_attr(path, "deck"), "pass 1");
  }
}

}  // namespace
