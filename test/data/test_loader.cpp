// The prefetching loader: positions, labels and augmentation per (step, micro-batch, rank),
// resume, layout independence, Mixup targets, eval coverage, errors and shutdown.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <set>
#include <stdexcept>
#include <thread>
#include <tuple>

#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"

using vitgrid::DataLoader;
using vitgrid::Dataset;
using vitgrid::HostBatch;
using vitgrid::LoaderConfig;
using vitgrid::Sampler;
using vitgrid::SampleAug;

namespace {

constexpr int kS = 8;
constexpr size_t kImg = kS * kS * 3;

std::shared_ptr<Dataset> small_synthetic(int64_t n, bool train = true) {
  return vitgrid::make_synthetic(77, train, n, kS, 10);
}

LoaderConfig train_cfg(int64_t G, int A, int D, int r) {
  LoaderConfig c;
  c.seed = 1234;
  c.global_batch = G;
  c.grad_accum = A;
  c.data_size = D;
  c.data_rank = r;
  c.crop_padding = 2;
  c.hflip = true;
  c.num_classes = 10;
  c.prefetch = 2;
  return c;
}

// Wraps a dataset: counts reads, optionally sleeps, optionally throws from read number `fail_at`.
class ProbeDataset : public Dataset {
 public:
  ProbeDataset(std::shared_ptr<Dataset> inner, int fail_at = -1, int sleep_ms = 0)
      : inner_(std::move(inner)), fail_at_(fail_at), sleep_ms_(sleep_ms) {}
  int64_t size() const override { return inner_->size(); }
  int image_size() const override { return inner_->image_size(); }
  int num_classes() const override { return inner_->num_classes(); }
  std::string describe() const override { return "probe"; }
  void read(const int64_t* idx, int n, uint8_t* images, int32_t* labels) override {
    int k = reads_++;
    if (sleep_ms_) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms_));
    if (k == fail_at_) throw std::runtime_error("disk on fire at read " + std::to_string(k));
    inner_->read(idx, n, images, labels);
  }
  std::atomic<int> reads_{0};

 private:
  std::shared_ptr<Dataset> inner_;
  int fail_at_, sleep_ms_;
};

}  // namespace

TEST(Loader, TrainPositionsLabelsAndImages) {
  auto ds = small_synthetic(40);
  const int64_t G = 16;
  const int A = 2, D = 2, r = 1, b = 4;
  DataLoader dl(ds, train_cfg(G, A, D, r));
  EXPECT_EQ(dl.per_rank_batch(), b);
  Sampler s(1234, 40);
  std::vector<uint8_t> img(kImg);
  for (int64_t step = 0; step < 6; ++step)  // 6 steps x 16 = 96 positions: crosses epochs
    for (int m = 0; m < A; ++m) {
      auto hb = dl.next();
      ASSERT_TRUE(hb);
      EXPECT_EQ(hb->step, step);
      EXPECT_EQ(hb->micro, m);
      ASSERT_EQ(hb->count, b);
      EXPECT_EQ(hb->first_position, step * G + m * (G / A) + r * b);
      ASSERT_EQ(hb->images.size(), b * kImg);
      EXPECT_TRUE(hb->soft.empty());
      for (int j = 0; j < b; ++j) {
        int64_t pos = hb->first_position + j, k = s.index_at(pos);
        int32_t label;
        ds->read(&k, 1, img.data(), &label);
        EXPECT_EQ(hb->labels[j], label);
        EXPECT_TRUE(std::equal(img.begin(), img.end(), hb->images.begin() + j * kImg));
        auto a = s.augment_at(pos, 2, true);
        EXPECT_EQ(hb->aug[j].dx, a.dx);
        EXPECT_EQ(hb->aug[j].dy, a.dy);
        EXPECT_EQ(hb->aug[j].flip, a.flip);
        EXPECT_EQ(hb->aug[j].lam, 1.0f);
        EXPECT_EQ(hb->aug[j].partner, -1);
      }
    }
}

TEST(Loader, ResumesAtStartStep) {
  auto ds = small_synthetic(30);
  DataLoader from0(ds, train_cfg(12, 3, 2, 0));
  for (int k = 0; k < 5 * 3; ++k) from0.next();
  DataLoader from5(ds, train_cfg(12, 3, 2, 0), 5);
  for (int k = 0; k < 6; ++k) {
    auto a = from0.next(), b = from5.next();
    EXPECT_EQ(a->step, b->step);
    EXPECT_EQ(a->micro, b->micro);
    EXPECT_EQ(a->first_position, b->first_position);
    EXPECT_EQ(a->labels, b->labels);
    EXPECT_EQ(a->images, b->images);
  }
}

// The union over data ranks and micro-batches of step s's samples is the same for every grid.
TEST(Loader, LayoutIndependent) {
  auto ds = small_synthetic(50);
  const int64_t G = 32;
  // pos, label, aug, the partner's position, the image hash
  using Key = std::tuple<int64_t, int32_t, int, int, int, float, int64_t, size_t>;
  auto collect = [&](int D, int A) {
    std::vector<std::set<Key>> per_step(4);
    for (int r = 0; r < D; ++r) {
      auto cfg = train_cfg(G, A, D, r);
      cfg.mix.mixup_alpha = 0.4;
      cfg.mix.cutmix_alpha = 1.0;
      cfg.mix.mode = vitgrid::MixMode::Elem;
      DataLoader dl(ds, cfg);
      for (int s = 0; s < 4; ++s)
        for (int m = 0; m < A; ++m) {
          auto hb = dl.next();
          EXPECT_EQ(hb->step, s);
          for (int j = 0; j < hb->count; ++j) {
            std::string bytes(hb->images.begin() + j * kImg, hb->images.begin() + (j + 1) * kImg);
            const SampleAug& a = hb->aug[j];
            const int64_t partner = a.partner < 0 ? -1 : hb->first_position + a.partner;
            bytes.append(reinterpret_cast<const char*>(&hb->soft[j * 10]), 10 * sizeof(float));
            per_step[s].insert(Key{hb->first_position + j, hb->labels[j], a.dx, a.dy, a.flip,
                                   a.lam + a.cut_x0 + 100 * a.cut_y1, partner,
                                   std::hash<std::string>()(bytes)});
          }
        }
    }
    return per_step;
  };
  auto ref = collect(1, 1);
  for (int s = 0; s < 4; ++s) {
    ASSERT_EQ(ref[s].size(), (size_t)G);
    EXPECT_EQ(std::get<0>(*ref[s].begin()), s * G);
  }
  EXPECT_EQ(collect(2, 1), ref);
  EXPECT_EQ(collect(4, 2), ref);
  EXPECT_EQ(collect(2, 4), ref);
}

// Mixing pairs positions 2k and 2k+1: each is the other's partner, with the draw of its unit
// (mode batch: the micro-batch, pair: the pair, elem: the sample), and its soft target is
// target_lam * own label + (1 - target_lam) * the partner's.
TEST(Loader, MixupCutmixPairsAndSoftTargets) {
  auto ds = small_synthetic(20);
  for (auto mode : {vitgrid::MixMode::Batch, vitgrid::MixMode::Pair, vitgrid::MixMode::Elem}) {
    auto cfg = train_cfg(8, 1, 1, 0);
    cfg.mix.mixup_alpha = 1.0;
    cfg.mix.cutmix_alpha = 1.0;
    cfg.mix.mode = mode;
    DataLoader dl(ds, cfg);
    Sampler s(cfg.seed, 20);
    for (int k = 0; k < 3; ++k) {
      auto hb = dl.next();
      ASSERT_EQ(hb->soft.size(), 8u * 10);
      for (int j = 0; j < 8; ++j) {
        const int64_t pos = hb->first_position + j;
        const int64_t unit = mode == vitgrid::MixMode::Batch ? pos / 8  // the global batch
                             : mode == vitgrid::MixMode::Pair ? pos / 2 : pos;
        const vitgrid::MixDraw d = s.mix_at(unit, cfg.mix, 8);
        const SampleAug& a = hb->aug[j];
        EXPECT_EQ(a.partner, j ^ 1);
        EXPECT_EQ(a.target_lam, d.lam);
        EXPECT_EQ(a.lam, d.cut ? 1.0f : d.lam);
        EXPECT_EQ(a.cut_x1 - a.cut_x0, d.x1 - d.x0);
        if (mode != vitgrid::MixMode::Elem) {  // both of a pair share the draw
          EXPECT_EQ(a.target_lam, hb->aug[j ^ 1].target_lam);
          EXPECT_EQ(a.cut_y0, hb->aug[j ^ 1].cut_y0);
        }
        float sum = 0;
        for (int c = 0; c < 10; ++c) {
          float want = (c == hb->labels[j] ? d.lam : 0.0f) + (c == hb->labels[j ^ 1] ? 1.0f - d.lam : 0.0f);
          EXPECT_FLOAT_EQ(hb->soft[j * 10 + c], want);
          sum += hb->soft[j * 10 + c];
        }
        EXPECT_NEAR(sum, 1.0f, 1e-6);
      }
    }
  }
  // an odd per-rank batch cannot hold its pairs
  auto odd = train_cfg(6, 2, 1, 0);
  odd.mix.mixup_alpha = 1.0;
  EXPECT_THROW(DataLoader(ds, odd), vitgrid::UserError);
}

// Every eval sample exactly once over the ranks; every rank runs the same number of batches.
TEST(Loader, EvalCoversEachSampleOnce) {
  for (int64_t limit : {0, 50}) {
    auto ds = small_synthetic(103, false);
    const int64_t total = limit ? limit : 103;
    const int64_t G = 32;
    const int A = 2, D = 4, b = 4;  // E = 16
    std::vector<int> seen(103, 0);
    const int64_t want_batches = (total + 15) / 16;
    for (int r = 0; r < D; ++r) {
      auto cfg = train_cfg(G, A, D, r);
      cfg.train = false;
      cfg.eval_samples = limit;
      cfg.mix.mixup_alpha = 0.5;  // ignored in eval
      DataLoader dl(ds, cfg);
      EXPECT_EQ(dl.per_rank_batch(), b);
      EXPECT_EQ(dl.batches_per_eval(), want_batches);
      int64_t got = 0;
      while (auto hb = dl.next()) {
        EXPECT_EQ(hb->first_position, got * 16 + r * b);
        EXPECT_LE(hb->count, b);
        EXPECT_GE(hb->count, 0);
        EXPECT_EQ(hb->images.size(), hb->count * kImg);
        EXPECT_TRUE(hb->soft.empty());
        std::vector<uint8_t> img(kImg);
        for (int j = 0; j < hb->count; ++j) {
          int64_t pos = hb->first_position + j;
          seen[pos]++;
          EXPECT_EQ(hb->aug[j].dx, 2);
          EXPECT_EQ(hb->aug[j].dy, 2);
          EXPECT_EQ(hb->aug[j].flip, 0);
          EXPECT_EQ(hb->aug[j].lam, 1.0f);
          int32_t l;
          ds->read(&pos, 1, img.data(), &l);
          EXPECT_EQ(hb->labels[j], l);
          EXPECT_TRUE(std::equal(img.begin(), img.end(), hb->images.begin() + j * kImg));
        }
        ++got;
      }
      EXPECT_EQ(got, want_batches) << "rank " << r;
      EXPECT_EQ(dl.next(), nullptr);  // stays exhausted
    }
    for (int64_t i = 0; i < 103; ++i) EXPECT_EQ(seen[i], i < total ? 1 : 0) << "sample " << i;
  }
}

TEST(Loader, ReadErrorReachesConsumerInOrder) {
  auto probe = std::make_shared<ProbeDataset>(small_synthetic(40), /*fail_at=*/3);
  DataLoader dl(probe, train_cfg(8, 1, 1, 0));
  for (int k = 0; k < 3; ++k) EXPECT_EQ(dl.next()->step, k);  // batches before the failure
  try {
    dl.next();
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("disk on fire at read 3"), std::string::npos);
  }
  EXPECT_THROW(dl.next(), std::runtime_error);  // and again, no hang
}

TEST(Loader, BadLabelIsRefused) {
  auto cfg = train_cfg(8, 1, 1, 0);
  cfg.num_classes = 3;  // the synthetic set has 10 classes
  DataLoader dl(small_synthetic(40), cfg);
  EXPECT_THROW(dl.next(), vitgrid::UserError);
}

TEST(Loader, ShutsDownMidStream) {
  auto slow = std::make_shared<ProbeDataset>(small_synthetic(40), -1, /*sleep_ms=*/20);
  auto t0 = std::chrono::steady_clock::now();
  {
    DataLoader dl(slow, train_cfg(8, 1, 1, 0));
    dl.next();
  }  // the thread is mid-read or waiting on a full queue
  {
    DataLoader never_read(slow, train_cfg(8, 1, 1, 0));
  }
  {
    auto cfg = train_cfg(8, 1, 1, 0);
    cfg.prefetch = 1;
    DataLoader full(small_synthetic(40), cfg);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // producer blocks on the queue
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 2.0);
  // bounded prefetch: the producer stays at most `prefetch` batches (+ the one in hand) ahead
  auto probe = std::make_shared<ProbeDataset>(small_synthetic(40));
  DataLoader dl(probe, train_cfg(8, 1, 1, 0));
  dl.next();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_LE(probe->reads_.load(), 1 + 2 + 1);
}

TEST(Loader, RefusesBadConfig) {
  auto ds = small_synthetic(40);
  EXPECT_THROW(DataLoader(ds, train_cfg(10, 1, 4, 0)), vitgrid::UserError);  // 10 % 4
  EXPECT_THROW(DataLoader(ds, train_cfg(16, 3, 1, 0)), vitgrid::UserError);  // 16 % 3
  EXPECT_THROW(DataLoader(ds, train_cfg(16, 1, 2, 2)), std::invalid_argument);
}

// data.workers: a batch read by several threads is the batch read by one, and a failure in
// any of them reaches the consumer.
TEST(Loader, ParallelReadsMatchSerial) {
  auto cfg = train_cfg(64, 1, 1, 0);
  cfg.mix.mixup_alpha = 0.4;
  auto one = cfg, four = cfg;
  one.workers = 1;
  four.workers = 4;
  DataLoader a(small_synthetic(200), one), b(small_synthetic(200), four);
  for (int k = 0; k < 3; ++k) {
    auto x = a.next(), y = b.next();
    EXPECT_EQ(x->images, y->images);
    EXPECT_EQ(x->labels, y->labels);
    EXPECT_EQ(x->soft, y->soft);
  }
  auto failing = std::make_shared<ProbeDataset>(small_synthetic(200), /*fail_at=*/2);
  DataLoader c(failing, four);
  EXPECT_THROW(c.next(), std::runtime_error);
}
