// Geometric image transforms with torchvision / Pillow semantics, on uint8 HWC RGB.
//
// resample(): Pillow's Image.resize(size, resample, box) exactly (Pillow 9.4,
// libImaging/Resample.c): separable convolution with the filter's support widened by the scale
// when downscaling (antialias), coefficients normalised per output pixel and rounded to Pillow's
// fixed point (PRECISION_BITS 22), the horizontal pass first into uint8 (rounded, clipped) over
// only the rows the vertical pass reads, then the vertical pass; a pass is skipped when Pillow
// skips it. The box is rounded to float32 as Pillow's C layer takes it, so results equal
// Pillow's bit for bit (test/data/test_image_decode.cpp checks this against Pillow itself).
//
// Three meanings of a box (Box::mode):
//  - Pillow: Pillow's resize(box=...) with the box rounded to float32 as Pillow's C layer
//    takes it; the filter reads the neighbours outside the box.
//  - CropThenResize: torchvision's F.resized_crop on a PIL image: img.crop(box) (box rounded to
//    integers as Pillow's crop does), then resize of the cut-out image: the filter reads nothing
//    outside the box. rrc_box() returns such a box; the result equals RandomResizedCrop's.
//  - ResizeThenCrop: the box is the S x S window [left, left + S) x [top, top + S) of the whole
//    image resized to rw x rh (Resize then CenterCrop), in source coordinates:
//    x0 = left * W / rw, x1 = (left + S) * W / rw (likewise y). resample() recovers rw, left
//    etc. by rounding and computes the whole-image resize's coefficients for the window's
//    columns and rows only, so the result equals resize-then-crop exactly (Pillow mode would
//    differ by the float32 rounding of the box: up to 2 levels on a few pixels). eval_box()
//    returns such a box.
// A device implementation must honour the mode too (its coefficients: resample_coeffs()).

// rrc_box(): torchvision (0.14) RandomResizedCrop.get_params: 10 attempts of
//   area = H*W * U(scale), log_ratio = U(log r0, log r1), aspect = exp(log_ratio),
//   w = round(sqrt(area * aspect)), h = round(sqrt(area / aspect)) (Python's round: half to even),
//   accepted when 0 < w <= W and 0 < h <= H, top = U{0..H-h}, left = U{0..W-w};
// then the fallback: the centre crop of the largest box within the ratio bounds. The draws are
// rng_u64(seed, kStreamCrop, position * 64 + k) (core/rng.h): attempt a (0..9) uses
// k = 4a + 0 (area), 4a + 1 (log ratio), 4a + 2 (top), 4a + 3 (left); k 40..63 are reserved. So a
// crop is a pure function of (seed, position), whatever rank or thread computes it.
//
// eval_box(): timm's eval transform: Resize(floor(S / crop_pct)) of the short side (the long
// side int(size * long / short), as torchvision) then CenterCrop(S) (top/left
// int(round((len - S) / 2.0)), Python's round), expressed as the box of the source that
// resample() maps to the S x S output.
#pragma once
#include <cstdint>
#include <vector>

namespace vitgrid {

enum class Interp : int { Bilinear = 0, Bicubic = 1 };

// How a box maps the source to the output (see above).
enum class BoxMode : int { Pillow = 0, CropThenResize = 1, ResizeThenCrop = 2 };

// A source region in (fractional) pixel coordinates: [x0, x1) x [y0, y1).
struct Box {
  double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
  BoxMode mode = BoxMode::Pillow;
};

// Reusable buffers of resample() (coefficients, the horizontal pass's rows), so a worker thread
// that keeps one allocates nothing per image once they have grown.
struct ResampleScratch {
  std::vector<double> kd;       // coefficients in double before fixed point
  std::vector<int32_t> kh, kv;  // fixed-point coefficients, [out, ksize]
  std::vector<int> bh, bv;      // [out, 2]: first source index and tap count
  std::vector<int> start;       // horizontal pass with a fixed tap count: window starts
  std::vector<int32_t> kpad;    // and weights padded with zeros to ksize
  std::vector<uint8_t> tmp;     // horizontal pass output
  std::vector<int32_t> acc;     // one output row of the vertical pass
  // The AVX2 loops: weights split for pmaddwd, [hw]: horizontal, [vw]: vertical; a zero-padded
  // copy of a row's right end (horizontal); one output row before its mirroring (vertical).
  std::vector<int32_t> hw, vw;
  std::vector<uint8_t> tail, row;
};

// Pillow's resize of `box` of the W x H source into out_w x out_h; with flip, the output is
// mirrored left-right (RandomHorizontalFlip after the crop). src and dst are HWC RGB uint8;
// src has row stride src_stride bytes (>= W * 3). Throws std::invalid_argument on an empty
// output, or a CropThenResize / ResizeThenCrop box outside the image.
void resample(const uint8_t* src, int W, int H, int src_stride, Box box, int out_w, int out_h,
              Interp interp, bool flip, uint8_t* dst, ResampleScratch& scratch);
// The same with buffers of its own (allocates; for tests and one-off use).
void resample(const uint8_t* src, int W, int H, int src_stride, Box box, int out_w, int out_h,
              Interp interp, bool flip, uint8_t* dst);

// resample() of a source held only in part: src covers the columns [sx, sx + sw) and rows
// [sy, sy + sh) of a W x H image (box in the whole image's coordinates; not CropThenResize:
// cut the crop out by pointer and pass it as the whole image with a Pillow box). The
// result equals resample() of the whole image when the part holds every pixel the filter reads
// (resample_footprint()); the loader uses it on a region decoded by libjpeg-turbo.
void resample_part(const uint8_t* src, int src_stride, int sx, int sy, int sw, int sh, int W,
                   int H, Box box, int out_w, int out_h, Interp interp, bool flip, uint8_t* dst,
                   ResampleScratch& scratch);

// Test seam: which implementation of the resampling loops resample() / resample_part() run.
// Auto (the default) takes the AVX2 loops when the CPU has AVX2 (checked once), else Baseline:
// the SSE4.1 / scalar loops that the build's -march guarantees. Both give the same bytes (Pillow's
// integer sums); test/data/test_image_decode.cpp compares them. Process-wide and not meant to
// change while other threads resample: for tests only. Returns false, changing nothing, when
// this CPU cannot run the requested loops.
enum class ResampleKernels : int { Auto = 0, Baseline = 1, Avx2 = 2 };
bool set_resample_kernels_for_testing(ResampleKernels k);

// The source pixels [x0, x1) x [y0, y1) that resample() of `box` into out_w x out_h reads from
// a W x H image (a CropThenResize box: the rounded box itself).
void resample_footprint(int W, int H, Box box, int out_w, int out_h, Interp interp, int* x0,
                        int* y0, int* x1, int* y1);

// The coefficients resample() uses along one axis (axis 0: x, 1: y; not CropThenResize): for
// output index o, the first source index first[o], the tap count count[o] and the weights
// weight[o * ksize + t] in Pillow's fixed point (sum ~ 1 << 22; a pass adds 1 << 21, sums
// weight * pixel in int32 and clips (sum >> 22) to 0..255). `needed` is false when Pillow
// skips the pass (the identity). For a device implementation that must equal resample().
struct AxisCoeffs {
  int ksize = 0;
  bool needed = true;
  std::vector<int> first, count;
  std::vector<int32_t> weight;
};
void resample_coeffs(int in_size, Box box, int axis, int out_size, Interp interp,
                     AxisCoeffs& out);

// torchvision's RandomResizedCrop box (integer-valued, CropThenResize) for an image of W x H.
Box rrc_box(uint64_t seed, int64_t position, int W, int H, double scale_lo, double scale_hi,
            double ratio_lo, double ratio_hi);

// The size torchvision's Resize(size) gives a W x H image: the shorter side `size`, the longer
// int(size * long / short) (Python's truncation of the true quotient).
void resized_size(int W, int H, int size, int* out_w, int* out_h);

// The eval transform's box (ResizeThenCrop) for an image of W x H and output S x S.
Box eval_box(int W, int H, int S, double crop_pct);

}  // namespace vitgrid
