// The reference image preparation (the semantics Backend::prepare_images reproduces on the
// device): torchvision's RandomCrop(S, padding=pad) on the uint8 image (zero padding, so a
// padded pixel is black and normalises to -mean/std), RandomHorizontalFlip after the crop,
// ToTensor (/255), Normalize(mean, std), then the mixing with the partner (another sample of
// the batch, prepared with its own crop and flip): CutMix takes the partner's pixels inside the
// box, Mixup blends lam * self + (1 - lam) * partner.
#include "vitgrid/data/dataset.h"

namespace vitgrid {
namespace {

// Normalised value of channel c at (y, x) of the S x S crop of sample `src` (HWC uint8).
inline float crop_pixel(const uint8_t* src, int S, int pad, const SampleAug& a, int y, int x, int c,
                        const float* mean3, const float* std3) {
  const int xs = a.flip ? S - 1 - x : x;     // flip acts on the cropped window
  const int sy = y + a.dy - pad, sx = xs + a.dx - pad;  // padded -> original coordinates
  float v = 0.0f;                            // zero padding (black)
  if (sy >= 0 && sy < S && sx >= 0 && sx < S) v = src[((size_t)sy * S + sx) * 3 + c] / 255.0f;
  return (v - mean3[c]) / std3[c];
}

}  // namespace

void prepare_images_reference(float* out, const uint8_t* img, const SampleAug* aug, int count,
                              int S, int pad, const float* mean3, const float* std3) {
  const size_t plane = (size_t)S * S, image = plane * 3;
  for (int i = 0; i < count; ++i) {
    const SampleAug& a = aug[i];
    const bool mixed = a.partner >= 0 && a.partner < count;
    const SampleAug& pa = mixed ? aug[a.partner] : a;
    const uint8_t* par = mixed ? img + a.partner * image : nullptr;
    float* dst = out + i * image;
    for (int c = 0; c < 3; ++c)
      for (int y = 0; y < S; ++y)
        for (int x = 0; x < S; ++x) {
          float v = crop_pixel(img + i * image, S, pad, a, y, x, c, mean3, std3);
          if (par) {
            const bool in_box = x >= a.cut_x0 && x < a.cut_x1 && y >= a.cut_y0 && y < a.cut_y1;
            if (in_box)
              v = crop_pixel(par, S, pad, pa, y, x, c, mean3, std3);
            else if (a.lam != 1.0f)
              v = a.lam * v + (1.0f - a.lam) * crop_pixel(par, S, pad, pa, y, x, c, mean3, std3);
          }
          dst[c * plane + (size_t)y * S + x] = v;
        }
  }
}

}  // namespace vitgrid
