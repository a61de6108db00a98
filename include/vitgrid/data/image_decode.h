// Decoding encoded images to RGB on the CPU: libjpeg-turbo (its libjpeg API, for DCT-domain
// scaling and decoding only the rows and columns of a crop) for JPEG, libpng for PNG (ImageNet
// holds a PNG named .JPEG). Pixels equal Pillow's (same library, ISLOW DCT, fancy upsampling):
// grayscale is expanded to RGB as Pillow's convert("RGB") does; Adobe CMYK/YCCK JPEGs are
// converted as Pillow does (inverted CMYK, then R = 255 - C ... with K).
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "vitgrid/data/image_transform.h"
#include "vitgrid/data/pixel_buffer.h"

namespace vitgrid {

// Not an image we can decode (corrupt, truncated, unknown format). The caller names the file.
class DecodeError : public std::runtime_error {
 public:
  explicit DecodeError(const std::string& what) : std::runtime_error(what) {}
};

enum class ImageFormat : int { Unknown = 0, Jpeg = 1, Png = 2 };

struct ImageInfo {
  ImageFormat format = ImageFormat::Unknown;
  int width = 0, height = 0;
  int components = 0;        // 1 gray, 3 YCbCr/RGB, 4 CMYK/YCCK (JPEG); PNG: 1-4
  bool progressive = false;  // JPEG SOF2 (or arithmetic / lossless: also not "baseline")
  bool cmyk = false;         // 4-component JPEG
  // JPEG chroma subsampling of a 3-component image as (h, v) of the luma sampling factors
  // relative to chroma, e.g. 2,2 for 4:2:0; 1,1 for 4:4:4; 0,0 when not applicable.
  int sub_h = 0, sub_v = 0;
};

// Reads only the header. Throws DecodeError when the bytes are not a JPEG or PNG header.
ImageInfo peek_image(const uint8_t* data, size_t size);

// A region of the source image to decode: [x0, x1) x [y0, y1) in source pixels (the whole image
// when empty). The decoder may decode more (iMCU alignment) and reports what it returned.
struct DecodeRegion {
  int x0 = 0, y0 = 0, x1 = 0, y1 = 0;
};

struct DecodedImage {
  std::vector<uint8_t> rgb;  // HWC RGB uint8, width x height
  int width = 0, height = 0;
  // The pixel (0, 0) of rgb is source pixel (x_offset, y_offset) at scale 1/scale_denom,
  // i.e. rgb covers source columns [x_offset * scale_denom, ...).
  int x_offset = 0, y_offset = 0;
  int scale_denom = 1;       // 1, 2, 4 or 8 (DCT-domain downscaling; JPEG only)
};

// Decodes to RGB. `scale_denom` > 1 asks libjpeg-turbo for DCT-domain downscaling by that
// factor (JPEG only; PNG ignores it). `region` (scaled coordinates are handled internally)
// limits decoding to the rows and columns needed; the result may be larger (aligned to iMCUs).
// Throws DecodeError on corrupt or truncated data (libjpeg warnings about premature end of data
// are errors here: a truncated file is refused, not half-decoded).
// Policy on damaged JPEGs: libjpeg's warnings are errors (premature end of data, bad Huffman
// codes, resync: the pixels would be garbage), except "extraneous bytes before marker 0xd9"
// (junk before the end-of-image marker: the pixels are whole). A region decode reads the
// entropy-coded data only as far as the region's last row when the file ends with an EOI
// marker; a file without one is decoded to its end, so a truncated file is refused whatever the
// region (corrupt data below the region of a complete file goes unnoticed).
void decode_image(const uint8_t* data, size_t size, DecodedImage& out, int scale_denom = 1,
                  const DecodeRegion* region = nullptr);

// Buffers reused across decode_crop_resize() calls by one thread: once grown to the largest
// image seen they are not reallocated (libjpeg-turbo itself still allocates its pools per call).
struct DecodeScratch {
  PixelBuffer pixels;           // the decoded region, RGB rows
  std::vector<uint8_t> row;     // one CMYK / RGBA row before conversion
  ResampleScratch resample;
};

// The DCT-domain scale decode_crop_resize() uses for `box` (source pixels) and an S x S output
// with dct_scale on: the largest d in {2, 4, 8} with box_w / d >= 2 S and box_h / d >= 2 S, else
// 1. libjpeg-turbo's 1/d scaling is a reduced-size IDCT per 8x8 block (a low-pass within a
// block, with some aliasing at block edges); keeping a further reduction of at least 2x in
// Pillow's antialiased filter afterwards makes Pillow's filter, not the IDCT, shape every output
// pixel (each still averages >= 2d source pixels per axis), which bounds the deviation from the
// exact path (measured in test/data/test_image_decode.cpp, DctScaleClose).
int dct_scale_denom(const Box& box, int S);

// What the resample of one sample reads, as decoded: the columns [x0, x0 + w) and rows
// [y0, y0 + h) of a W x H RGB image (pixel (x0, y0) at `pixels`, rows `stride` bytes apart) and
// the box in that image (BoxMode Pillow or ResizeThenCrop: a CropThenResize box is cut out
// first, the cut being the image). resample_part() of it, or the device's resize
// (backend/image_decoder.h HostRegion), gives decode_crop_resize()'s output.
struct ResizeRegion {
  const uint8_t* pixels = nullptr;
  size_t stride = 0;
  size_t offset = 0;  // decode_region(..., into): pixel (x0, y0) at into->data() + offset
  int x0 = 0, y0 = 0, w = 0, h = 0;
  int W = 0, H = 0;
  Box box;
};

// decode_crop_resize()'s decoding half: the region, pointing into scratch.pixels (valid until
// the scratch is used again), or with `into` appended to *into (a JPEG's rows decoded there
// directly, rows `stride` bytes apart; other formats' rows packed; `pixels` valid until *into
// grows, `offset` for good). Throws DecodeError as decode_image(); *into is then as it was.
ResizeRegion decode_region(const uint8_t* data, size_t size, const ImageInfo& info, Box box, int S,
                           Interp interp, bool dct_scale, DecodeScratch& scratch,
                           PixelBuffer* into = nullptr);

// The CPU path of one sample: decodes only the rows and columns of `data` that the resample of
// `box` reads (a CropThenResize box itself; with the filter's support around it otherwise),
// at 1/dct_scale_denom() when dct_scale, and writes the S x S RGB result (mirrored when flip) to
// out. With dct_scale off (or d = 1) the result equals, bit for bit, Pillow's
//   CropThenResize: img.convert("RGB").crop(box).resize((S, S), interp)  (torchvision's
//                   F.resized_crop: RandomResizedCrop),
//   ResizeThenCrop: img.convert("RGB").resize((rw, rh), interp).crop(window)  (Resize +
//                   CenterCrop: the eval transform),
//   Pillow:         img.convert("RGB").resize((S, S), interp, box=box),
// then the flip. At d > 1 the box is mapped to the scaled image (x / d) and resampled as a
// Pillow box there (CropThenResize: within the scaled pixels covering the crop).
// `info` is peek_image() of the same bytes. Throws DecodeError as decode_image().
void decode_crop_resize(const uint8_t* data, size_t size, const ImageInfo& info, Box box, int S,
                        Interp interp, bool flip, bool dct_scale, uint8_t* out /* S*S*3 */,
                        DecodeScratch& scratch);

}  // namespace vitgrid
