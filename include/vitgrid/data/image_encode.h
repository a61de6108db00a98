// JPEG encoding for the dataset tool (vitgrid_dataset pack --short-side): libjpeg-turbo with
// Pillow's settings for Image.save(format="JPEG", quality=q), and the transcode that shrinks an
// image whose shorter side exceeds a bound, as torchvision's Resize(N) on a PIL image followed
// by that save.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "vitgrid/data/image_decode.h"
#include "vitgrid/data/image_transform.h"

namespace vitgrid {

// rgb (HWC RGB uint8, w x h) as a baseline JPEG into out (replaced), as Pillow 9.4 saves an
// RGB image with quality q and no other option: libjpeg's defaults (YCbCr 4:2:0, ISLOW DCT,
// standard Huffman tables, a JFIF header with 1:1 density) and jpeg_set_quality(q, baseline).
// q in 1..100. Throws DecodeError (the codec's error class) on a libjpeg failure.
void encode_jpeg(const uint8_t* rgb, int w, int h, int quality, std::vector<uint8_t>& out);

// What a transcode keeps between images (decoded pixels, the resized ones, resampling state).
struct TranscodeScratch {
  DecodedImage decoded;
  std::vector<uint8_t> resized;
  ResampleScratch resample;
};

// An encoded image (JPEG or PNG) whose shorter side exceeds short_side is decoded (Pillow's
// convert("RGB")), resized to resized_size(short_side) with Pillow's antialiased `interp` filter
// (Image.resize without a box) and re-encoded with encode_jpeg at `quality`, replacing bytes;
// returns true. Smaller images are left as they are (false). Throws DecodeError where the
// image cannot be decoded (bytes unchanged).
bool transcode_short_side(std::vector<uint8_t>& bytes, int short_side, int quality,
                          Interp interp, TranscodeScratch& scratch);

}  // namespace vitgrid
