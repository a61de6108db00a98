// Geometric image transforms with torchvision / Pillow semantics, on uint8 HWC RGB.
//
// resample(): Pillow's Image.resize(size, resample, box) exactly: separable convolution with
// the filter's support widened by the scale when downscaling (antialias), coefficients
// normalised per output pixel, horizontal pass first into uint8 (rounded, clipped), then the
// vertical pass; Pillow's fixed-point arithmetic (PRECISION_BITS 22), so results equal Pillow's.
// torchvision's RandomResizedCrop and Resize + CenterCrop on PIL images call exactly this.
//
// rrc_box(): torchvision's RandomResizedCrop.get_params: 10 attempts of
//   area = H*W * U(scale), log_ratio = U(log r0, log r1), aspect = exp(log_ratio),
//   w = round(sqrt(area * aspect)), h = round(sqrt(area / aspect)),
//   accepted when 0 < w <= W and 0 < h <= H, i = U{0..H-h}, j = U{0..W-w};
// then the fallback: the centre crop of the largest box within ratio bounds. Every uniform is
// drawn from (seed, kStreamCrop, position) so the crop is a function of the stream position.
//
// eval_box(): timm's eval transform: Resize(floor(S / crop_pct)) of the short side (the long
// side int(size * long / short), as torchvision) then CenterCrop(S) (top/left
// int(round((len - S) / 2))), expressed as the box of the source that resample() maps to the
// S x S output (identical to resizing the whole image and cropping, see resample()).
#pragma once
#include <cstdint>

namespace vitgrid {

enum class Interp : int { Bilinear = 0, Bicubic = 1 };

// A source region in (fractional) pixel coordinates: [x0, x1) x [y0, y1).
struct Box {
  double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
};

// Pillow's resize of `box` of the W x H source into out_w x out_h; with flip, the output is
// mirrored left-right (RandomHorizontalFlip after the crop). src and dst are HWC RGB uint8;
// src has row stride src_stride bytes (>= W * 3).
void resample(const uint8_t* src, int W, int H, int src_stride, Box box, int out_w, int out_h,
              Interp interp, bool flip, uint8_t* dst);

// torchvision's RandomResizedCrop box (integer-valued) for an image of W x H.
Box rrc_box(uint64_t seed, int64_t position, int W, int H, double scale_lo, double scale_hi,
            double ratio_lo, double ratio_hi);

// The eval transform's box for an image of W x H and output S x S.
Box eval_box(int W, int H, int S, double crop_pct);

}  // namespace vitgrid
