// Datasets of encoded images: the per-sample views (RandomResizedCrop + flip or the eval
// resize + centre crop, torchvision's semantics) cut from a source's JPEG/PNG bytes, decoded on
// the host (libjpeg-turbo) or left for the device's batched decoder.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

#include "views.h"
#include "vitgrid/core/error.h"
#include "vitgrid/data/image_source.h"
#include "vitgrid/data/image_transform.h"

namespace vitgrid {
namespace {

// Replacements tried for one undecodable sample before the source is declared broken.
constexpr int kMaxReplacements = 64;

// A JPEG the device may take: a baseline one its decoder accepts, whose bitstream ends with
// the EOI marker (a file cut short is left to the host, which refuses it, so both paths
// replace it the same way).
bool device_takes(const RealImageConfig& cfg, const ImageInfo& info, const uint8_t* p, size_t n) {
  if (!cfg.device_accepts || info.format != ImageFormat::Jpeg) return false;
  if (!cfg.device_accepts(info.components, info.progressive, info.sub_h, info.sub_v)) return false;
  const size_t tail = std::min<size_t>(n, 64);
  for (size_t k = n - tail; k + 1 < n; ++k)
    if (p[k] == 0xFF && p[k + 1] == 0xD9) return true;
  return false;
}

// A file that cannot be decoded is named once per process, by the rank that met it (any data
// rank may: the replacements themselves are counted per rank in metrics.h5).
void warn_once(const std::string& what) {
  static std::mutex mu;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mu);
  if (seen.size() < 1000 && seen.insert(what).second)
    std::fprintf(stderr, "warning: %s: cannot be decoded; replaced by the next image that can\n",
                 what.c_str());
}

Box view_box(const RealImageConfig& cfg, uint64_t seed, bool train, int64_t position, int W, int H,
             int S) {
  return train ? rrc_box(seed, position, W, H, cfg.scale_lo, cfg.scale_hi, cfg.ratio_lo, cfg.ratio_hi)
               : eval_box(W, H, S, cfg.crop_pct);
}

class EncodedDataset final : public Dataset {
 public:
  EncodedDataset(std::unique_ptr<ImageSource> src, int S, int interp, double crop_pct)
      : src_(std::move(src)), S_(S) {
    cfg_.interp = interp;
    cfg_.crop_pct = crop_pct;
    cfg_.dct_scale = false;  // read() is the exact eval view
  }
  int64_t size() const override { return src_->size(); }
  int image_size() const override { return S_; }
  int num_classes() const override { return src_->num_classes(); }
  void read(const int64_t* idx, int n, uint8_t* images, int32_t* labels) override {
    ViewScratch scratch;
    int bad = 0;
    for (int j = 0; j < n; ++j) {
      ViewTarget to;
      to.out = images + (size_t)j * S_ * S_ * 3;
      labels[j] = cut_view(*src_, cfg_, 0, false, false, idx[j], idx[j], S_, to, &bad, scratch);
    }
  }
  std::string describe() const override { return src_->describe(); }
  const ImageSource* encoded() const override { return src_.get(); }

 private:
  std::unique_ptr<ImageSource> src_;
  int S_;
  RealImageConfig cfg_;
};

}  // namespace

bool device_turn(double share, int64_t position) {
  if (share >= 1.0) return true;
  if (share <= 0.0) return false;
  return std::floor(static_cast<double>(position + 1) * share) >
         std::floor(static_cast<double>(position) * share);
}

int32_t cut_view(const ImageSource& src, const RealImageConfig& cfg, uint64_t seed, bool train,
                 bool flip, int64_t index, int64_t position, int S, const ViewTarget& to,
                 int* bad, ViewScratch& scratch) {
  const int64_t n = src.size();
  std::string first_error;
  for (int attempt = 0; attempt <= kMaxReplacements && attempt < n; ++attempt) {
    const int64_t i = (index + attempt) % n;
    int32_t label = 0;
    src.read(i, scratch.bytes, label);
    const uint8_t* p = scratch.bytes.data();
    const size_t size = scratch.bytes.size();
    try {
      const ImageInfo info = peek_image(p, size);
      const Box box = view_box(cfg, seed, train, position, info.width, info.height, S);
      if (to.views && device_turn(cfg.device_share, position) && device_takes(cfg, info, p, size)) {
        EncodedView v;
        v.slot = to.slot;
        v.offset = to.encoded->size();
        v.size = size;
        v.x0 = box.x0, v.y0 = box.y0, v.x1 = box.x1, v.y1 = box.y1;
        v.mode = static_cast<int>(box.mode);
        v.flip = flip ? 1 : 0;
        v.index = i;
        v.position = position;
        to.encoded->insert(to.encoded->end(), p, p + size);
        to.views->push_back(v);
      } else if (to.regions && cfg.device_resizes &&
                 cfg.device_resizes(box.x1 - box.x0, box.y1 - box.y0)) {
        const ResizeRegion r = decode_region(p, size, info, box, S, static_cast<Interp>(cfg.interp),
                                             cfg.dct_scale, scratch.decode, to.pixels);
        DecodedRegion d;
        d.part = to.part;
        d.offset = r.offset;
        HostRegion& g = d.region;
        g.stride = r.stride;
        g.x0 = r.x0, g.y0 = r.y0, g.w = r.w, g.h = r.h;
        g.W = r.W, g.H = r.H;
        g.bx0 = r.box.x0, g.by0 = r.box.y0, g.bx1 = r.box.x1, g.by1 = r.box.y1;
        g.mode = static_cast<int>(r.box.mode);
        g.flip = flip ? 1 : 0;
        g.slot = to.slot;
        to.regions->push_back(d);
      } else {
        decode_crop_resize(p, size, info, box, S, static_cast<Interp>(cfg.interp), flip,
                           cfg.dct_scale, to.out, scratch.decode);
      }
      return label;
    } catch (const DecodeError& e) {
      const std::string what = src.where(i) + ": " + e.what();
      if (first_error.empty()) first_error = what;
      ++*bad;
      warn_once(what);
    }
  }
  throw UserError(src.describe() + ": " + std::to_string(kMaxReplacements + 1) +
                  " images in a row from sample " + std::to_string(index) +
                  " cannot be decoded (the first: " + first_error + ")");
}

int32_t decode_view_on_host(const ImageSource& src, const RealImageConfig& cfg, uint64_t seed,
                            bool train, const EncodedView& v, int S, uint8_t* out, int* bad,
                            ViewScratch& scratch) {
  RealImageConfig host = cfg;
  host.device_accepts = nullptr;
  host.device_resizes = nullptr;
  ViewTarget to;
  to.slot = v.slot;
  to.out = out;
  return cut_view(src, host, seed, train, v.flip != 0, v.index, v.position, S, to, bad, scratch);
}

std::unique_ptr<Dataset> make_encoded_dataset(std::unique_ptr<ImageSource> source, int image_size,
                                              int interp, double crop_pct) {
  return std::make_unique<EncodedDataset>(std::move(source), image_size, interp, crop_pct);
}

}  // namespace vitgrid
