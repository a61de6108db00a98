// A batch's images through the device's JPEG decoder: the views it takes decoded there, the
// regions the loader decoded for it resized there, the images the loader decoded and resized
// on the host copied there; views the device refuses after all
// (bitstreams it cannot decode) are decoded on the host, their labels and soft targets
// following a replacement.
#include <algorithm>
#include <string>
#include <vector>

#include "vitgrid/backend/image_decoder.h"
#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"

namespace vitgrid {

void use_device_decoder(LoaderConfig& c, const ImageDecoder* dec, bool decode, bool resize,
                        int S) {
  if (decode)
    c.real.device_accepts = [dec](int comps, bool prog, int sh, int sv) {
      return dec->accepts(comps, prog, sh, sv);
    };
  if (resize) {
    const int interp = c.real.interp;
    c.real.device_resizes = [dec, S, interp](double w, double h) {
      return dec->resizes(w, h, S, interp);
    };
  }
}

void decode_batch_on_device(ImageDecoder& dec, const HostBatch& hb, int S, int interp,
                            uint8_t* out_dev) {
  const size_t img = static_cast<size_t>(S) * S * 3;
  std::vector<DecodeJob> jobs(hb.views.size());
  std::vector<char> on_device(hb.count, 0);
  for (size_t k = 0; k < jobs.size(); ++k) {
    const EncodedView& v = hb.views[k];
    DecodeJob& job = jobs[k];
    job.data = hb.encoded.data() + v.offset;
    job.size = v.size;
    job.x0 = v.x0, job.y0 = v.y0, job.x1 = v.x1, job.y1 = v.y1;
    job.mode = v.mode;
    job.flip = v.flip;
    job.slot = v.slot;
    on_device[v.slot] = 1;
  }
  if (!jobs.empty()) dec.decode_async(jobs.data(), static_cast<int>(jobs.size()), S, interp, out_dev);
  std::vector<HostRegion> regions(hb.regions.size());
  for (size_t k = 0; k < regions.size(); ++k) {
    const DecodedRegion& d = hb.regions[k];
    regions[k] = d.region;
    regions[k].pixels = hb.pixels[d.part].data() + d.offset;
    on_device[d.region.slot] = 1;
  }
  if (!regions.empty())
    dec.resize_async(regions.data(), static_cast<int>(regions.size()), S, interp, out_dev);
  std::vector<const uint8_t*> host;
  std::vector<int> slots;
  for (int j = 0; j < hb.count; ++j)
    if (!on_device[j]) {
      host.push_back(hb.images.data() + j * img);
      slots.push_back(j);
    }
  if (!slots.empty())
    dec.copy_async(host.data(), slots.data(), static_cast<int>(slots.size()), S, out_dev);
}

void finish_batch_on_device(
    ImageDecoder& dec, DataLoader& loader, const HostBatch& hb, int S, int K, uint8_t* out_dev,
    int64_t* bad,
    const std::function<void(const std::vector<int32_t>&, const std::vector<float>&)>& relabel) {
  const std::vector<int> refused = dec.join();
  if (refused.empty()) return;
  const size_t img = static_cast<size_t>(S) * S * 3;
  std::vector<uint8_t> fixed(refused.size() * img);
  std::vector<const uint8_t*> host;
  std::vector<int32_t> labels = hb.labels;
  bool changed = false;
  for (size_t k = 0; k < refused.size(); ++k) {
    const int slot = refused[k];
    const auto v = std::find_if(hb.views.begin(), hb.views.end(),
                                [slot](const EncodedView& e) { return e.slot == slot; });
    if (v == hb.views.end()) throw std::logic_error("the decoder refused a slot it was not given");
    int n_bad = 0;
    const int32_t label = loader.decode_on_host(*v, fixed.data() + k * img, &n_bad);
    *bad += n_bad;
    host.push_back(fixed.data() + k * img);
    if (label != labels[slot]) {
      if (label < 0 || label >= K)
        throw UserError("label " + std::to_string(label) + " outside [0, " + std::to_string(K) + ")");
      labels[slot] = label;
      changed = true;
    }
  }
  dec.copy_async(host.data(), refused.data(), static_cast<int>(refused.size()), S, out_dev);
  if (!dec.join().empty()) throw std::logic_error("the decoder refused a copy");
  if (!changed) return;
  // a replacement: the soft targets of every mixed sample follow its and its partner's labels
  std::vector<float> soft;
  if (!hb.soft.empty()) {
    soft.resize(static_cast<size_t>(hb.count) * K);
    mixed_soft_targets(hb.aug.data(), labels.data(), hb.count, K, soft.data());
  }
  relabel(labels, soft);
}

}  // namespace vitgrid
