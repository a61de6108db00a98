// Datasets, the layout-independent sampler and the prefetching loader.
//
// The global batch of optimizer step s is the same whatever the grid: it is positions
// [s*G, (s+1)*G) of an endless stream whose epoch e is a permutation of the train split drawn
// from (seed, e). Micro-batch m (of grad_accum A) of data rank r (of D) holds positions
// s*G + m*(G/A) + r*b ... + b - 1 with b = G/(A*D). Crop offsets, flips and Mixup (lambda and
// partner sample) are functions of (seed, stream position), so they do not depend on the grid.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace vitgrid {

struct Deck;

// A labelled image set held as uint8 HWC images.
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual int image_size() const = 0;  // square images, S x S x 3
  virtual int num_classes() const = 0;
  // Reads images (uint8 [n, S, S, 3]) and labels of the given sample indices. Thread-safe
  // against other datasets' reads (HDF5 access is serialised in-process).
  virtual void read(const int64_t* idx, int n, uint8_t* images, int32_t* labels) = 0;
  virtual std::string describe() const = 0;
  // Something about how the data was read that the user should hear (make_dataset prints it
  // once, on rank 0), or "".
  virtual std::string warning() const { return std::string(); }
};

// The embedded synthetic dataset: class-conditional images a small ViT can learn but not
// trivially, deterministic from (seed, split, index); any image size.
std::unique_ptr<Dataset> make_synthetic(uint64_t seed, bool train, int64_t n, int image_size,
                                        int num_classes);
// CIFAR-10 binaries in `dir` (data_batch_1..5.bin for train, test_batch.bin for eval).
// Throws UserError naming the missing or malformed file.
std::unique_ptr<Dataset> make_cifar10(const std::string& dir, bool train);
// Packed HDF5 image file: /images uint8 [N,S,S,3], /labels int [N] (any integer type), root
// attribute num_classes (without it: the largest label + 1, and warning() says so). Throws
// UserError naming the file and dataset when malformed.
std::unique_ptr<Dataset> make_hdf5_images(const std::string& path);
// From the deck (data.dataset, data.path, data.eval_path, synthetic sizes).
std::unique_ptr<Dataset> make_dataset(const Deck& deck, bool train);

// Per-sample augmentation decided on the host, applied by Backend::prepare_images.
struct SampleAug {
  int32_t dx = 0, dy = 0;  // crop offset in [0, 2*pad] into the zero-padded image
  int32_t flip = 0;        // horizontal flip
  float lam = 1.0f;        // Mixup weight of the sample (1 - lam of the partner)
};

// One micro-batch on the host, ready to copy to the device.
struct HostBatch {
  int64_t step = 0;
  int micro = 0;
  int count = 0;                   // samples in this batch (eval's last batch may be short)
  int64_t first_position = 0;      // global stream position of sample 0 (dropout counters)
  std::vector<uint8_t> images;     // [count, S, S, 3]
  std::vector<uint8_t> partners;   // Mixup partners [count, S, S, 3] (empty without Mixup)
  std::vector<SampleAug> aug;      // [count]
  std::vector<int32_t> labels;     // [count]
  std::vector<float> soft;         // Mixup soft targets [count, K] (empty without Mixup)
};

struct LoaderConfig {
  uint64_t seed = 0;
  int64_t global_batch = 0;
  int grad_accum = 1;
  int data_rank = 0, data_size = 1;
  int crop_padding = 0;
  bool hflip = false;
  double mixup_alpha = 0.0;
  int num_classes = 0;
  int prefetch = 2;
  int workers = 1;          // threads reading one batch's samples in parallel (0: auto)
  bool train = true;        // false: sequential eval order, no augmentation
  int64_t eval_samples = 0; // eval: how many samples (0 = all)
};

// Which dataset indices, augmentation and Mixup draws make up a micro-batch: pure functions,
// tested for layout independence.
class Sampler {
 public:
  Sampler(uint64_t seed, int64_t dataset_size);
  // Dataset index at global stream position pos.
  int64_t index_at(int64_t pos) const;
  int64_t epoch_of(int64_t pos) const { return pos / n_; }
  SampleAug augment_at(int64_t pos, int pad, bool hflip, double mixup_alpha) const;
  int64_t partner_at(int64_t pos) const;  // Mixup partner dataset index

 private:
  uint64_t seed_;
  int64_t n_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
};

// Delivers this rank's micro-batches in order, prepared by a background thread `prefetch`
// batches ahead. Train: micro-batches of steps start_step, start_step+1, ... (resume-safe).
// Eval: the eval split in order, split over data ranks, batches of global_batch/grad_accum/D.
class DataLoader {
 public:
  DataLoader(std::shared_ptr<Dataset> ds, const LoaderConfig& cfg, int64_t start_step = 0);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  // The next micro-batch; nullptr when an eval pass is exhausted.
  std::shared_ptr<const HostBatch> next();
  int per_rank_batch() const;  // b
  int64_t batches_per_eval() const;  // eval: micro-batches this rank will deliver

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The reference (CPU) image preparation that Backend::prepare_images must reproduce:
// out[count,3,S,S] fp32 = normalise(crop/flip(img)) mixed with the partner by lam.
void prepare_images_reference(float* out, const uint8_t* img, const uint8_t* partner,
                              const SampleAug* aug, int count, int S, int pad,
                              const float* mean3, const float* std3);

}  // namespace vitgrid
