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
void decode_image(const uint8_t* data, size_t size, DecodedImage& out, int scale_denom = 1,
                  const DecodeRegion* region = nullptr);

}  // namespace vitgrid
