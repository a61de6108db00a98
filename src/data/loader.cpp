// The prefetching data loader: a background thread turns (step, micro-batch) or eval batch
// numbers into HostBatches through the Sampler and the Dataset, keeping up to `prefetch`
// finished batches in a bounded queue. The consumer (the training loop) only waits when the
// thread falls behind. A failure in the thread (a read error) is handed to the consumer by
// next() in the order it happened, after the batches finished before it.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "views.h"
#include "vitgrid/core/error.h"
#include "vitgrid/core/test_hooks.h"
#include "vitgrid/data/dataset.h"
#include "vitgrid/data/image_source.h"

namespace vitgrid {

struct DataLoader::Impl {
  std::shared_ptr<Dataset> ds;
  LoaderConfig cfg;
  int64_t start_step = 0;
  int b = 0;             // per-rank micro-batch
  int64_t E = 0;         // global micro-batch G / A
  int K = 0;             // classes (soft targets)
  int64_t eval_n = 0;    // eval: samples in the pass
  int64_t eval_batches = 0;

  std::mutex mu;
  std::condition_variable not_full, not_empty;
  std::deque<std::shared_ptr<const HostBatch>> queue;
  std::exception_ptr error;
  bool finished = false;  // producer delivered its last batch (eval) or failed
  bool stop = false;      // consumer is going away
  std::thread worker;

  void run();
  // A label outside [0, K) would index past the soft targets and the loss: refuse it.
  void check_labels(const std::vector<int32_t>& labels) const {
    for (int32_t l : labels)
      if (l < 0 || l >= K)
        throw UserError(ds->describe() + ": label " + std::to_string(l) + " outside [0, " +
                        std::to_string(K) + ")");
  }
  // Batches the consumer has dropped come back here and are refilled, so their buffers (38 MB
  // of images for 256 samples at 224 px) are not allocated and page-faulted again per batch.
  struct Pool {
    std::mutex mu;
    std::vector<std::unique_ptr<HostBatch>> free;
  };
  std::shared_ptr<Pool> pool = std::make_shared<Pool>();
  std::shared_ptr<HostBatch> new_batch() {
    std::unique_ptr<HostBatch> hb;
    {
      std::lock_guard<std::mutex> lock(pool->mu);
      if (!pool->free.empty()) {
        hb = std::move(pool->free.back());
        pool->free.pop_back();
      }
    }
    if (!hb) hb = std::make_unique<HostBatch>();
    std::weak_ptr<Pool> home = pool;  // the loader may be gone when the last user drops it
    return std::shared_ptr<HostBatch>(hb.release(), [home](HostBatch* p) {
      if (auto pl = home.lock()) {
        std::lock_guard<std::mutex> lock(pl->mu);
        if (pl->free.size() < 8) {
          pl->free.emplace_back(p);
          return;
        }
      }
      delete p;
    });
  }
  std::shared_ptr<HostBatch> make_train(const Sampler& sampler, int64_t k);
  std::shared_ptr<HostBatch> make_eval(int64_t t);
  void read_views(HostBatch& hb, const int64_t* idx, const Sampler* sampler);
  void mix(HostBatch& hb, const Sampler& sampler) const;
  ViewScratch host_scratch;  // decode_on_host (the consumer's thread)
  // the workers' buffers, kept across batches (a worker's decode buffers grow to the largest
  // image once instead of being allocated and page-faulted for every batch)
  std::vector<std::unique_ptr<ViewScratch>> scratch;
};

// Reads samples idx[0..n) into images/labels with `workers` threads, each a contiguous part
// (datasets are thread-safe: synthetic and CIFAR-10 are pure/in-memory, HDF5 reads with
// positioned reads, or serialises on its fallback path).
void read_parallel(Dataset& ds, const int64_t* idx, int n, uint8_t* images, int32_t* labels,
                   int workers) {
  const size_t img = (size_t)ds.image_size() * ds.image_size() * 3;
  const int w = std::max(1, std::min(workers, n / 8));  // >= 8 samples per thread
  if (w <= 1) {
    ds.read(idx, n, images, labels);
    return;
  }
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(w);
  for (int t = 0; t < w; ++t) {
    const int a = (int)((int64_t)n * t / w), b = (int)((int64_t)n * (t + 1) / w);
    pool.emplace_back([&, t, a, b] {
      try {
        ds.read(idx + a, b - a, images + a * img, labels + a);
      } catch (...) {
        errors[t] = std::current_exception();
      }
    });
  }
  for (auto& th : pool) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// The views of an encoded dataset's samples idx[0..count) at positions first_position + j
// (train: RandomResizedCrop and flip of that position; eval: the eval view), with `workers`
// threads taking samples one at a time (images differ in size several times over, so equal
// shares would leave threads waiting for the slowest). The result does not depend on which
// thread took which sample: images go to their slots, views are sorted by slot (their bytes
// stay where their thread appended them), and the error reported is that of the first sample.
void DataLoader::Impl::read_views(HostBatch& hb, const int64_t* idx, const Sampler* sampler) {
  const ImageSource& src = *ds->encoded();
  const int n = hb.count, S = ds->image_size();
  const size_t img = (size_t)S * S * 3;
  const int w = std::max(1, std::min(cfg.workers, n));
  struct Part {
    std::vector<uint8_t> encoded;
    std::vector<EncodedView> views;
    std::vector<DecodedRegion> regions;
    int bad = 0;
    int error_at = -1;  // the sample whose error stopped this thread
    std::exception_ptr error;
  };
  std::vector<Part> parts(w);
  while ((int)scratch.size() < w) scratch.push_back(std::make_unique<ViewScratch>());
  // each thread's region pixels go to a buffer of the batch's own (it keeps its capacity when
  // the batch is reused: no allocation or first touch per batch)
  const bool regions = static_cast<bool>(cfg.real.device_resizes);
  if (regions && (int)hb.pixels.size() < w) hb.pixels.resize(w);
  for (auto& px : hb.pixels) px.clear();
  std::atomic<int> next{0};
  auto work = [&](int t) {
    Part& part = parts[t];
    ViewScratch& mine = *scratch[t];
    for (int j = next++; j < n; j = next++) {
      try {
        const int64_t pos = hb.first_position + j;
        ViewTarget to;
        to.slot = j;
        to.out = hb.images.data() + j * img;
        to.encoded = &part.encoded;
        to.views = cfg.real.device_accepts ? &part.views : nullptr;
        if (regions) {
          to.part = t;
          to.pixels = &hb.pixels[t];
          to.regions = &part.regions;
        }
        const bool flip = cfg.train && cfg.hflip && sampler->flip_at(pos);
        hb.labels[j] = cut_view(src, cfg.real, cfg.seed, cfg.train, flip, idx[j],
                                cfg.train ? pos : idx[j], S, to, &part.bad, mine);
      } catch (...) {
        part.error = std::current_exception();
        part.error_at = j;
        return;
      }
    }
  };
  if (w == 1) {
    work(0);
  } else {
    std::vector<std::thread> pool;
    for (int t = 0; t < w; ++t) pool.emplace_back(work, t);
    for (auto& th : pool) th.join();
  }
  // Every sample before the lowest failing one was taken (the counter only grows) and read.
  const Part* failed = nullptr;
  for (const Part& part : parts)
    if (part.error && (!failed || part.error_at < failed->error_at)) failed = &part;
  if (failed) std::rethrow_exception(failed->error);
  hb.encoded.clear();
  hb.views.clear();
  hb.regions.clear();
  hb.bad = 0;
  for (Part& part : parts) {
    for (EncodedView v : part.views) {
      v.offset += hb.encoded.size();
      hb.views.push_back(v);
    }
    hb.encoded.insert(hb.encoded.end(), part.encoded.begin(), part.encoded.end());
    hb.regions.insert(hb.regions.end(), part.regions.begin(), part.regions.end());
    hb.bad += part.bad;
  }
  std::sort(hb.views.begin(), hb.views.end(),
            [](const EncodedView& a, const EncodedView& b) { return a.slot < b.slot; });
  std::sort(
      hb.regions.begin(), hb.regions.end(),
      [](const DecodedRegion& a, const DecodedRegion& b) { return a.region.slot < b.region.slot; });
}

// Mixup / CutMix: sample j is mixed with j ^ 1 (positions 2k and 2k+1: first_position and the
// batch size are even), with the draw of its unit (the optimizer step's global batch, the pair,
// or the sample: never the rank's share, so that no layout or accumulation changes a draw), and
// its soft target is lam * own label + (1 - lam) * the partner's.
void DataLoader::Impl::mix(HostBatch& hb, const Sampler& sampler) const {
  const int S = ds->image_size();
  hb.soft.resize((size_t)hb.count * K);
  for (int j = 0; j < hb.count; ++j) {
    const int64_t pos = hb.first_position + j;
    const int64_t unit = cfg.mix.mode == MixMode::Batch  ? pos / cfg.global_batch
                         : cfg.mix.mode == MixMode::Pair ? pos / 2
                                                          : pos;
    const MixDraw d = sampler.mix_at(unit, cfg.mix, S);
    SampleAug& a = hb.aug[j];
    const int partner = j ^ 1;
    if (d.lam != 1.0f || d.cut) {
      a.partner = partner;
      a.lam = d.cut ? 1.0f : d.lam;
      a.target_lam = d.lam;
      if (d.cut) {
        a.cut_x0 = (int16_t)d.x0, a.cut_y0 = (int16_t)d.y0;
        a.cut_x1 = (int16_t)d.x1, a.cut_y1 = (int16_t)d.y1;
      }
    }
  }
  mixed_soft_targets(hb.aug.data(), hb.labels.data(), hb.count, K, hb.soft.data());
}

void mixed_soft_targets(const SampleAug* aug, const int32_t* labels, int count, int K, float* out) {
  std::fill(out, out + static_cast<size_t>(count) * K, 0.0f);
  for (int j = 0; j < count; ++j) {
    const SampleAug& a = aug[j];
    float* row = out + static_cast<size_t>(j) * K;
    const float own = a.partner >= 0 ? a.target_lam : 1.0f;
    row[labels[j]] += own;
    if (a.partner >= 0) row[labels[a.partner]] += 1.0f - own;
  }
}

std::shared_ptr<HostBatch> DataLoader::Impl::make_train(const Sampler& sampler, int64_t k) {
  const int A = cfg.grad_accum;
  auto hb = new_batch();
  hb->step = start_step + k / A;
  hb->micro = (int)(k % A);
  hb->count = b;
  hb->first_position = hb->step * cfg.global_batch + hb->micro * E + (int64_t)cfg.data_rank * b;
  const size_t img = (size_t)ds->image_size() * ds->image_size() * 3;
  const bool encoded = ds->encoded() != nullptr;
  std::vector<int64_t> idx(b);
  hb->aug.assign(b, SampleAug());
  for (int j = 0; j < b; ++j) {
    const int64_t pos = hb->first_position + j;
    idx[j] = sampler.index_at(pos);
    // encoded images are cropped and flipped while they are decoded
    if (!encoded) hb->aug[j] = sampler.augment_at(pos, cfg.crop_padding, cfg.hflip);
  }
  hb->images.resize(b * img);
  hb->labels.resize(b);
  if (encoded)
    read_views(*hb, idx.data(), &sampler);
  else
    read_parallel(*ds, idx.data(), b, hb->images.data(), hb->labels.data(), cfg.workers);
  check_labels(hb->labels);
  if (cfg.mix.on()) mix(*hb, sampler);
  else hb->soft.clear();
  return hb;
}

// Eval batch t: positions [t*E + r*b, t*E + (r+1)*b) of the eval split, cut at eval_n (so a
// rank's last batches may be short or empty; every rank still delivers eval_batches of them).
// HostBatch::step holds t.
std::shared_ptr<HostBatch> DataLoader::Impl::make_eval(int64_t t) {
  auto hb = new_batch();
  hb->step = t;
  hb->micro = 0;
  hb->first_position = t * E + (int64_t)cfg.data_rank * b;
  hb->count = (int)std::max<int64_t>(0, std::min<int64_t>(b, eval_n - hb->first_position));
  const int n = hb->count;
  const size_t img = (size_t)ds->image_size() * ds->image_size() * 3;
  std::vector<int64_t> idx(n);
  for (int j = 0; j < n; ++j) idx[j] = hb->first_position + j;  // eval order is the split order
  SampleAug centre;  // no augmentation: the crop at (pad, pad) is the original image
  if (!ds->encoded()) centre.dx = centre.dy = cfg.crop_padding;
  hb->aug.assign(n, centre);
  hb->images.resize(n * img);
  hb->labels.resize(n);
  hb->soft.clear();
  if (n > 0 && ds->encoded())
    read_views(*hb, idx.data(), nullptr);
  else if (n > 0)
    read_parallel(*ds, idx.data(), n, hb->images.data(), hb->labels.data(), cfg.workers);
  check_labels(hb->labels);
  return hb;
}

void DataLoader::Impl::run() {
  try {
    std::unique_ptr<Sampler> sampler;
    if (cfg.train) sampler = std::make_unique<Sampler>(cfg.seed, ds->size());
    const size_t cap = (size_t)std::max(1, cfg.prefetch);
    for (int64_t k = 0; cfg.train || k < eval_batches; ++k) {
      if (cfg.train && vitgrid_test_hooks.loader_batch_delay_ms > 0)  // tests: a slow loader
        std::this_thread::sleep_for(
            std::chrono::milliseconds(vitgrid_test_hooks.loader_batch_delay_ms));
      auto hb = cfg.train ? make_train(*sampler, k) : make_eval(k);
      std::unique_lock<std::mutex> lock(mu);
      not_full.wait(lock, [&] { return stop || queue.size() < cap; });
      if (stop) return;
      queue.push_back(std::move(hb));
      not_empty.notify_one();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu);
    error = std::current_exception();
  }
  std::lock_guard<std::mutex> lock(mu);
  finished = true;
  not_empty.notify_all();
}

DataLoader::DataLoader(std::shared_ptr<Dataset> ds, const LoaderConfig& cfg, int64_t start_step)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  if (!ds) throw std::invalid_argument("DataLoader: no dataset");
  if (cfg.global_batch <= 0 || cfg.grad_accum <= 0 || cfg.data_size <= 0 ||
      cfg.global_batch % ((int64_t)cfg.grad_accum * cfg.data_size) != 0)
    throw UserError("data.global_batch = " + std::to_string(cfg.global_batch) +
                    " must be a positive multiple of data.grad_accum (" + std::to_string(cfg.grad_accum) +
                    ") x data-parallel size (" + std::to_string(cfg.data_size) + ")");
  if (cfg.data_rank < 0 || cfg.data_rank >= cfg.data_size)
    throw std::invalid_argument("DataLoader: data_rank outside [0, data_size)");
  if (start_step < 0) throw std::invalid_argument("DataLoader: negative start_step");
  m.ds = std::move(ds);
  m.cfg = cfg;
  if (m.cfg.workers <= 0)
    m.cfg.workers = (int)std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  m.start_step = start_step;
  m.E = cfg.global_batch / cfg.grad_accum;
  m.b = (int)(m.E / cfg.data_size);
  m.K = cfg.num_classes > 0 ? cfg.num_classes : m.ds->num_classes();
  if (cfg.train && cfg.mix.on() && m.b % 2 != 0)
    throw UserError("Mixup / CutMix mix the samples of a pair, so the per-rank batch " +
                    std::to_string(m.b) + " must be even");
  if (!cfg.train) {
    m.eval_n = cfg.eval_samples > 0 ? std::min(cfg.eval_samples, m.ds->size()) : m.ds->size();
    m.eval_batches = (m.eval_n + m.E - 1) / m.E;  // same on every rank: depends on E only
  }
  m.worker = std::thread([&m] { m.run(); });
}

DataLoader::~DataLoader() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->not_full.notify_all();
  // The worker finishes the batch it is preparing (one dataset read) and exits.
  if (impl_->worker.joinable()) impl_->worker.join();
}

std::shared_ptr<const HostBatch> DataLoader::next() {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu);
  m.not_empty.wait(lock, [&] { return !m.queue.empty() || m.finished; });
  if (!m.queue.empty()) {
    auto hb = std::move(m.queue.front());
    m.queue.pop_front();
    m.not_full.notify_one();
    return hb;
  }
  if (m.error) std::rethrow_exception(m.error);
  return nullptr;
}

int DataLoader::per_rank_batch() const { return impl_->b; }

int32_t DataLoader::decode_on_host(const EncodedView& v, uint8_t* out, int* bad) {
  Impl& m = *impl_;
  return decode_view_on_host(*m.ds->encoded(), m.cfg.real, m.cfg.seed, m.cfg.train, v,
                             m.ds->image_size(), out, bad, m.host_scratch);
}

int64_t DataLoader::batches_per_eval() const { return impl_->eval_batches; }

}  // namespace vitgrid
