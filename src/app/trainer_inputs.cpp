// Inputs: the upload slots and their buffers, the device's JPEG decoder, the loaders'
// configuration and the uploads of host batches (training's through the Stepper, eval's one
// at a time).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "trainer_impl.h"

namespace vitgrid {
namespace trainer_detail {

Inputs::~Inputs() {
  for (void* p : d_raw_)
    if (p) run_.be->release(p);
  if (d_images_) run_.be->release(d_images_);
}

void Inputs::setup() {
  const Deck& deck = run_.deck;
  const ViTConfig& cfg = run_.cfg;
  const int b = run_.b;
  Backend& be = *run_.be;
  // batch upload buffers (soft targets only with Mixup / CutMix)
  const size_t img = static_cast<size_t>(cfg.image) * cfg.image * 3;
  const bool mixup = deck.data.mixup_alpha > 0 || deck.data.cutmix_alpha > 0;
  auto align = [](size_t n) { return (n + 255) / 256 * 256; };
  off_labels_ = 0;
  off_position_ = off_labels_ + align(b * sizeof(int32_t));
  off_soft_ = off_position_ + align(2 * sizeof(int64_t));
  off_aug_ = off_soft_ + (mixup ? align(static_cast<size_t>(b) * cfg.classes * sizeof(float)) : 0);
  off_images_ = off_aug_ + align(b * sizeof(SampleAug));
  raw_bytes_ = off_images_ + align(b * img);
  setup_decoder();
  for (void*& p : d_raw_) p = be.alloc(raw_bytes_);
  for (int k = 0; k < kUploadSlots; ++k) be.staging(k, raw_bytes_);
  d_images_ = be.alloc(static_cast<size_t>(b) * 3 * cfg.image * cfg.image * be.act_size());
}

LoaderConfig Inputs::loader_config(bool train) const {
  const Deck& deck = run_.deck;
  const ProcessGrid& grid = *run_.grid;
  // auto workers: this rank's share of the node's cores (a CPU-backend rank computes on one)
  LoaderConfig c = make_loader_config(deck, train, grid.rank(Axis::Data), grid.size(Axis::Data),
                                      loader_workers(deck, grid.local_size()));
  c.num_classes = run_.cfg.classes;
  if (decoder_) use_device_decoder(c, decoder_, true, resize_on_device_, run_.cfg.image);
  return c;
}

// JPEGs on the device with data.decode = device, where the backend has a decoder and the
// dataset holds encoded images (only the stage holding the patch embedding reads images); it
// takes data.device_share of them. auto decodes on the host: on an H100 nvJPEG's hardware
// decode of the next batch waits for the running step's kernels (README, "Decoding"), and 16
// loader threads per GPU keep ViT-B/16 fed. What the loader's threads decode is cropped,
// resized and flipped on the device with data.resize = device, and auto where the backend
// can (a GPU): the threads then only decode.
void Inputs::setup_decoder() {
  const Deck& deck = run_.deck;
  const Dataset* ds = run_.train_ds ? run_.train_ds.get() : run_.eval_ds.get();
  if (!ds || !ds->encoded() || !run_.model->layout().embed) return;
  const int threads = loader_config(true).workers;
  const bool jpeg = deck.data.decode == "device" && deck.data.device_share > 0.0;
  const bool resize = deck.data.resize != "host";
  decode_interp_ = make_loader_config(deck, true, 0, 1, 1).real.interp;
  if (jpeg || resize) decoder_ = run_.be->image_decoder(jpeg);
  if (!decoder_) {
    if (jpeg)
      throw UserError(
          "data.decode = device, but the " + run_.be->name() +
          " backend has no JPEG decoder (data.decode = auto or host decodes on the host)");
    if (deck.data.resize == "device")
      throw UserError("data.resize = device, but the " + run_.be->name() +
                      " backend does not resize images (data.resize = auto or host resizes on "
                      "the host)");
    run_.log("data: JPEGs decoded and resized on the host (libjpeg-turbo, %d loader threads)\n",
             threads);
    return;
  }
  resize_on_device_ = resize;
  const char* where = resize ? "resized on the device" : "resized on the host";
  if (!jpeg)
    run_.log("data: JPEGs decoded on the host (libjpeg-turbo, %d loader threads), %s\n", threads,
             where);
  else if (deck.data.device_share < 1.0)
    run_.log(
        "data: JPEGs decoded on the device (%g of them; the rest by %d loader threads, %s): "
        "%s\n",
        deck.data.device_share, threads, where, decoder_->describe().c_str());
  else
    run_.log("data: JPEGs decoded on the device: %s\n", decoder_->describe().c_str());
}

// Copies a host batch, which trains in optimizer step `step` (eval: any), into upload slot
// `slot` and starts its transfer to the device; the slot's previous batch must have been
// consumed (release) before. With the device's decoder, its views are decoded into the
// slot's images (and the host-decoded images copied there) on the decoder's stream.
void Inputs::start_upload(const HostBatch& hb, int slot, int64_t step) {
  if (hb.count == 0) return;
  const int S = run_.cfg.image;
  const size_t img = static_cast<size_t>(S) * S * 3;
  char* h = static_cast<char*>(run_.be->staging(slot, raw_bytes_));
  size_t end = off_aug_;
  std::memcpy(h + off_labels_, hb.labels.data(), hb.count * sizeof(int32_t));
  const int64_t position[2] = {step, hb.first_position};
  std::memcpy(h + off_position_, position, sizeof(position));
  if (!hb.soft.empty()) std::memcpy(h + off_soft_, hb.soft.data(), hb.soft.size() * sizeof(float));
  bad_images_ += hb.bad;
  // Only the stage holding the patch embedding reads images (every stage of a pipeline
  // loads the same batch, which keeps the loaders' cursors in step without talking).
  if (run_.model->layout().embed) {
    std::memcpy(h + off_aug_, hb.aug.data(), hb.count * sizeof(SampleAug));
    end = off_images_;
    if (decoder_) {
      decode_batch_on_device(*decoder_, hb, S, decode_interp_,
                             static_cast<uint8_t*>(d_raw_[slot]) + off_images_);
    } else {
      std::memcpy(h + off_images_, hb.images.data(), hb.count * img);
      end = off_images_ + hb.count * img;
    }
  }
  run_.be->upload_async(slot, d_raw_[slot], end);
}

// The device batch of an upload started with start_upload(hb, slot), once the caller made
// the device wait for it (Backend::wait_uploads, and the decoder's join()): the images
// prepared (crop, flip, normalise, mixing) on the device.
DeviceBatch Inputs::prepare_batch(const HostBatch& hb, int slot) {
  DeviceBatch db;
  db.count = hb.count;
  db.first_position = hb.first_position;
  if (hb.count == 0) return db;
  uint8_t* d = static_cast<uint8_t*>(d_raw_[slot]);
  db.labels = reinterpret_cast<const int32_t*>(d + off_labels_);
  db.position = reinterpret_cast<const int64_t*>(d + off_position_);
  db.soft = hb.soft.empty() ? nullptr : reinterpret_cast<const float*>(d + off_soft_);
  if (!run_.model->layout().embed) return db;
  // eval batches carry dx = dy = pad: the crop of the padded image is the image itself;
  // encoded images were cropped while decoded (no padding)
  const Deck& deck = run_.deck;
  const int pad = run_.eval_ds->encoded() ? 0 : deck.data.crop_padding;
  run_.be->prepare_images(d_images_, d + off_images_, d + off_aug_, hb.count, run_.cfg.image, pad,
                          deck.data.mean.data(), deck.data.std.data());
  db.images = d_images_;
  return db;
}

// The device waits for the uploads started so far and for the decoder's work on batch hb
// (outside a captured graph: neither the copy stream nor the decoder's is captured). Images
// the decoder refused are decoded on the host now; when one had to be replaced by another
// image, the labels and soft targets already uploaded are corrected (rare: a bitstream that
// passed its header checks, then failed on the device and on the host).
void Inputs::wait_inputs(const HostBatch& hb, int slot) {
  Backend& be = *run_.be;
  be.wait_uploads();
  if (!decoder_ || !run_.model->layout().embed || hb.count == 0) return;
  uint8_t* d = static_cast<uint8_t*>(d_raw_[slot]);
  finish_batch_on_device(
      *decoder_, *loader_, hb, run_.cfg.image, run_.cfg.classes, d + off_images_, &bad_images_,
      [&](const std::vector<int32_t>& labels, const std::vector<float>& soft) {
        be.synchronize();  // the slot's upload has landed: overwrite its labels and targets
        be.copy_to_device(d + off_labels_, labels.data(), labels.size() * sizeof(int32_t));
        if (!soft.empty())
          be.copy_to_device(d + off_soft_, soft.data(), soft.size() * sizeof(float));
      });
}

// The work enqueued so far is the last to read upload slot `slot` (its images included,
// which the device's decoder may then overwrite).
void Inputs::release(int slot) {
  run_.be->release_slot(slot);
  if (decoder_) decoder_->release_output(static_cast<uint8_t*>(d_raw_[slot]) + off_images_);
}

// Eval / predict: one batch at a time through the eval slot (its previous batch's work
// was enqueued before this call, so releasing the slot here covers it).
DeviceBatch Inputs::upload(const HostBatch& hb) {
  release(kEvalSlot);
  start_upload(hb, kEvalSlot, 0);
  wait_inputs(hb, kEvalSlot);
  return prepare_batch(hb, kEvalSlot);
}

}  // namespace trainer_detail
}  // namespace vitgrid
