// Datasets, the layout-independent sampler and the prefetching loader.
//
// The global batch of optimizer step s is the same whatever the grid: it is positions
// [s*G, (s+1)*G) of an endless stream whose epoch e is a permutation of the train split drawn
// from (seed, e). Micro-batch m (of grad_accum A) of data rank r (of D) holds positions
// s*G + m*(G/A) + r*b ... + b - 1 with b = G/(A*D). Crop offsets, flips and Mixup (lambda and
// partner sample) are functions of (seed, stream position), so they do not depend on the grid.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "vitgrid/backend/image_decoder.h"
#include "vitgrid/data/pixel_buffer.h"

namespace vitgrid {

struct Deck;
class ImageSource;

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
  // Datasets of encoded images (tfrecord, folder, jpeg_h5) return their source: the loader
  // then cuts each sample's view itself (RandomResizedCrop + flip at its stream position, or the
  // eval view), decoding on the host or leaving it to the device. read() gives the eval view.
  virtual const ImageSource* encoded() const { return nullptr; }
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
// A dataset of encoded images of `source`, S x S eval views (read()); K from the source.
std::unique_ptr<Dataset> make_encoded_dataset(std::unique_ptr<ImageSource> source, int image_size,
                                              int interp, double crop_pct);
// From the deck (data.dataset, data.path, data.eval_path, synthetic sizes). A tfrecord source
// needs its shards' indexes: the app builds the missing ones first (tfrecord_build_indexes on
// every rank, then a barrier) in tfrecord_index_dir(deck).
std::unique_ptr<Dataset> make_dataset(const Deck& deck, bool train);
std::string tfrecord_index_dir(const Deck& deck);

// How the views of encoded images are cut (LoaderConfig::real): RandomResizedCrop for
// training, resize + centre crop for evaluation (data/image_transform.h).
struct RealImageConfig {
  double scale_lo = 0.08, scale_hi = 1.0, ratio_lo = 0.75, ratio_hi = 4.0 / 3.0;
  int interp = 1;          // data/image_transform.h Interp: 0 bilinear, 1 bicubic
  double crop_pct = 0.875;
  bool dct_scale = true;   // host decoding may downscale in the DCT domain
  // Whether the device's decoder takes a JPEG with this header (backend/image_decoder.h
  // accepts()); null: every image is decoded on the host.
  std::function<bool(int components, bool progressive, int sub_h, int sub_v)> device_accepts;
  // The share of the images the device is offered, by stream position (device_turn()): the
  // rest are decoded by the loader's threads while the device decodes its part.
  double device_share = 1.0;
  // Whether the device resizes the host's decodes (data.resize = device): the loader's threads
  // then only decode (the region each crop's resize reads: HostBatch::regions) and the device
  // crops, resizes and flips, bit for bit as the host would. Given the source box's width and
  // height in pixels: false for a box the device cannot take (a downscale beyond its filter
  // bound), which the host resizes. Null: the host resizes everything.
  std::function<bool(double box_w, double box_h)> device_resizes;
};

// Whether the sample at stream `position` is offered to the device's decoder: evenly spread
// positions, round(share x n) of any n consecutive ones within one, the same on every layout.
bool device_turn(double share, int64_t position);


// Per-sample augmentation decided on the host, applied by Backend::prepare_images. Mixing
// (Mixup, CutMix) pairs the samples at stream positions 2k and 2k+1, which a micro-batch of an
// even per-rank size always holds together: the partner is the other sample of the pair, with
// its own crop and flip, as timm mixes a batch with its flipped self.
struct SampleAug {
  int32_t dx = 0, dy = 0;  // crop offset in [0, 2*pad] into the zero-padded image
  int32_t flip = 0;        // horizontal flip
  float lam = 1.0f;        // Mixup: weight of this sample's pixels (1 - lam of the partner's)
  int32_t partner = -1;    // index in the batch of the sample mixed in; -1: not mixed
  // CutMix box [x0, x1) x [y0, y1) in output pixels, filled with the partner's pixels (empty
  // without CutMix).
  int16_t cut_x0 = 0, cut_y0 = 0, cut_x1 = 0, cut_y1 = 0;
  float target_lam = 1.0f;  // this sample's share of the soft target (host only)
};
static_assert(sizeof(SampleAug) == 32, "SampleAug is mirrored by the device kernels");

// The soft targets of a mixed batch into out[count, K] (zeroed first): sample j's row holds
// target_lam at its label and 1 - target_lam at its partner's (1 at its own when not mixed).
void mixed_soft_targets(const SampleAug* aug, const int32_t* labels, int count, int K, float* out);

// Mixup / CutMix as timm's Mixup: with probability `prob` a unit (the step's global batch in
// mode batch, a pair of positions in mode pair, a position in mode elem) is mixed; with both
// alphas set, CutMix is chosen with probability switch_prob; lam ~ Beta(alpha, alpha); CutMix's
// box covers a (1 - lam) share of the image, centred uniformly and clipped, and lam is then
// corrected to the box's actual area.
enum class MixMode : int { Batch = 0, Pair = 1, Elem = 2 };
struct MixConfig {
  double mixup_alpha = 0.0, cutmix_alpha = 0.0;
  double prob = 1.0, switch_prob = 0.5;
  MixMode mode = MixMode::Batch;
  bool on() const { return mixup_alpha > 0.0 || cutmix_alpha > 0.0; }
};
struct MixDraw {
  float lam = 1.0f;  // the share of this sample's label (after CutMix's correction)
  bool cut = false;
  int x0 = 0, y0 = 0, x1 = 0, y1 = 0;  // CutMix box in an S x S image
};

// A sample the device's decoder will decode (HostBatch::views): its bytes are
// encoded[offset, offset + size); box and flip as data/image_transform.h.
struct EncodedView {
  int slot = 0;  // index in the batch
  size_t offset = 0, size = 0;
  double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
  int mode = 0;  // data/image_transform.h BoxMode
  int flip = 0;
  int64_t index = 0, position = 0;  // dataset index and stream position (for the CPU fallback)
};

// A sample decoded on the host, for the device's resize (RealImageConfig::device_resizes): the
// region as backend/image_decoder.h HostRegion describes it (its slot the index in the batch),
// its first pixel at HostBatch::pixels[part][offset] (region.pixels is set from them once the
// batch is complete: the buffer may move while it grows).
struct DecodedRegion {
  int part = 0;
  size_t offset = 0;
  HostRegion region;
};

// One micro-batch on the host, ready to copy to the device.
struct HostBatch {
  int64_t step = 0;
  int micro = 0;
  int count = 0;                   // samples in this batch (eval's last batch may be short)
  int64_t first_position = 0;      // global stream position of sample 0 (dropout counters)
  std::vector<uint8_t> images;     // [count, S, S, 3]; slots in `views` are left for the device
  std::vector<SampleAug> aug;      // [count]
  std::vector<int32_t> labels;     // [count]
  std::vector<float> soft;         // mixed soft targets [count, K] (empty without mixing)
  std::vector<uint8_t> encoded;    // bitstreams of `views`, back to back
  std::vector<EncodedView> views;  // samples for the device's decoder (empty: all decoded)
  // samples decoded on the host for the device's resize, by slot; their pixels, one buffer per
  // loader thread (kept with the batch's storage when the loader reuses it)
  std::vector<DecodedRegion> regions;
  std::vector<PixelBuffer> pixels;
  int bad = 0;                     // undecodable samples replaced in this batch
};

struct LoaderConfig {
  uint64_t seed = 0;
  int64_t global_batch = 0;
  int grad_accum = 1;
  int data_rank = 0, data_size = 1;
  int crop_padding = 0;
  bool hflip = false;
  MixConfig mix;
  int num_classes = 0;
  int prefetch = 2;
  int workers = 1;          // threads reading one batch's samples in parallel (0: auto)
  bool train = true;        // false: sequential eval order, no augmentation
  int64_t eval_samples = 0; // eval: how many samples (0 = all)
  // Sources of encoded images (Dataset::encoded()): the views cut from each image.
  RealImageConfig real;
};

// The loader's configuration from the deck (data.*, run.seed, run.eval_samples) for data rank
// `data_rank` of `data_size` with `workers` threads; device_accepts is left to the caller.
LoaderConfig make_loader_config(const Deck& deck, bool train, int data_rank, int data_size,
                                int workers);
// The loader's threads: data.workers, or where that is 0 this rank's share of the node's cores
// (local_ranks ranks on the node), at most 16.
int loader_workers(const Deck& deck, int local_ranks);

// Which dataset indices, augmentation and Mixup draws make up a micro-batch: pure functions,
// tested for layout independence.
class Sampler {
 public:
  Sampler(uint64_t seed, int64_t dataset_size);
  // Dataset index at global stream position pos.
  int64_t index_at(int64_t pos) const;
  int64_t epoch_of(int64_t pos) const { return pos / n_; }
  // Crop offset and flip of the sample at pos (lam 1, no partner).
  SampleAug augment_at(int64_t pos, int pad, bool hflip) const;
  bool flip_at(int64_t pos) const;
  // The mixing draw of `unit` (see MixConfig) for S x S images.
  MixDraw mix_at(int64_t unit, const MixConfig& mix, int S) const;

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
  // A view of the batch that the device's decoder refused after all, decoded on the host into
  // out (S x S x 3; replaced like any undecodable sample, *bad counting it): returns its label.
  // Call from the consumer's thread only.
  int32_t decode_on_host(const EncodedView& v, uint8_t* out, int* bad);
  int64_t batches_per_eval() const;  // eval: micro-batches this rank will deliver

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A batch's images through the device's JPEG decoder (backend/image_decoder.h) into out_dev
// ([count, S, S, 3] uint8): its views decoded there, its regions resized there, the other
// host-decoded images copied there.
// Returns at once (the decoder works on its own thread and stream); the batch must stay alive
// until finish_batch_on_device().
void decode_batch_on_device(class ImageDecoder& dec, const HostBatch& hb, int S, int interp,
                            uint8_t* out_dev);
// Before the batch is consumed: waits for the decoder (its join()), decodes on the host the
// views it refused (`loader`: the batch's loader), and copies them. When one of them had to be
// replaced by another image, relabel(labels, soft) gets the batch's corrected labels and soft
// targets (empty without mixing) for the caller to upload. *bad counts replacements.
void finish_batch_on_device(
    class ImageDecoder& dec, DataLoader& loader, const HostBatch& hb, int S, int K,
    uint8_t* out_dev, int64_t* bad,
    const std::function<void(const std::vector<int32_t>&, const std::vector<float>&)>& relabel);

// Routes a loader's encoded images to the device decoder `dec`: the JPEGs it accepts are left
// to it (decode), and what the threads decode is cut to the regions it resizes on the device
// to S x S with c.real.interp (resize).
void use_device_decoder(LoaderConfig& c, const ImageDecoder* dec, bool decode, bool resize, int S);

// The reference (CPU) image preparation that Backend::prepare_images must reproduce:
// out[count,3,S,S] fp32 = normalise(crop/flip(img)), mixed with the partner sample of the batch
// (its own crop and flip) inside the CutMix box or by lam.
void prepare_images_reference(float* out, const uint8_t* img, const SampleAug* aug, int count,
                              int S, int pad, const float* mean3, const float* std3);

}  // namespace vitgrid
