// A batch's images through the device's JPEG decoder: the views it takes decoded there, the
// images the loader decoded on the host copied there, and views the device refuses after all
// (bitstreams it cannot parse) decoded on the host, their labels and soft targets following a
// replacement.
#include <algorithm>
#include <string>
#include <vector>

#include "vitgrid/backend/image_decoder.h"
#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"

namespace vitgrid {

void decode_batch_on_device(ImageDecoder& dec, DataLoader& loader, const HostBatch& hb, int S,
                            int interp, uint8_t* out_dev, int32_t* labels, float* soft, int K,
                            int64_t* bad) {
  const size_t img = static_cast<size_t>(S) * S * 3;
  std::vector<DecodeJob> jobs(hb.views.size());
  std::vector<const uint8_t*> src(hb.count, nullptr);  // host images by slot
  for (int j = 0; j < hb.count; ++j) src[j] = hb.images.data() + j * img;
  for (size_t k = 0; k < jobs.size(); ++k) {
    const EncodedView& v = hb.views[k];
    DecodeJob& job = jobs[k];
    job.data = hb.encoded.data() + v.offset;
    job.size = v.size;
    job.x0 = v.x0, job.y0 = v.y0, job.x1 = v.x1, job.y1 = v.y1;
    job.mode = v.mode;
    job.flip = v.flip;
    job.slot = v.slot;
    src[v.slot] = nullptr;
  }
  const std::vector<int> refused =
      jobs.empty() ? std::vector<int>()
                   : dec.decode_async(jobs.data(), static_cast<int>(jobs.size()), S, interp, out_dev);
  // kept alive until join(): copy_async may read it later
  static thread_local std::vector<uint8_t> fixed;
  fixed.resize(refused.size() * img);
  for (size_t k = 0; k < refused.size(); ++k) {
    const EncodedView& v = hb.views[refused[k]];
    int n_bad = 0;
    const int32_t label = loader.decode_on_host(v, fixed.data() + k * img, &n_bad);
    *bad += n_bad;
    src[v.slot] = fixed.data() + k * img;
    if (!labels || label == labels[v.slot]) continue;
    if (label < 0 || label >= K)
      throw UserError("label " + std::to_string(label) + " outside [0, " + std::to_string(K) + ")");
    labels[v.slot] = label;
    // the soft targets of the sample and of its partner name the replacement's label
    for (int j : {v.slot, v.slot ^ 1}) {
      if (!soft || j >= hb.count) continue;
      const SampleAug& a = hb.aug[j];
      float* row = soft + static_cast<size_t>(j) * K;
      std::fill(row, row + K, 0.0f);
      const float own = a.partner >= 0 ? a.target_lam : 1.0f;
      row[labels[j]] += own;
      if (a.partner >= 0) row[labels[a.partner]] += 1.0f - own;
    }
  }
  std::vector<const uint8_t*> host;
  std::vector<int> slots;
  for (int j = 0; j < hb.count; ++j)
    if (src[j]) {
      host.push_back(src[j]);
      slots.push_back(j);
    }
  if (!slots.empty())
    dec.copy_async(host.data(), slots.data(), static_cast<int>(slots.size()), S, out_dev);
}

}  // namespace vitgrid
