// CPU decoding: libjpeg-turbo through its libjpeg API (DCT scaling, jpeg_crop_scanline,
// jpeg_skip_scanlines) and libpng, with Pillow 9.4's pixel conventions. See
// include/vitgrid/data/image_decode.h.
#include "vitgrid/data/image_decode.h"

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <string>

#include <jpeglib.h>
#include <jerror.h>
#include <png.h>

#include "libjpeg_error.h"

namespace vitgrid {
namespace {

// ---------------------------------------------------------------------------------------------
// Header parsing (no library: the loader calls this per sample).

inline int be16(const uint8_t* p) { return (p[0] << 8) | p[1]; }
inline uint32_t be32(const uint8_t* p) {
  return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

bool is_sof(int m) {
  // SOF0..SOF15 except DHT (C4), JPG (C8) and DAC (CC).
  return m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
}

ImageInfo peek_jpeg(const uint8_t* d, size_t n) {
  ImageInfo info;
  info.format = ImageFormat::Jpeg;
  size_t p = 2;
  while (p < n) {
    // Markers start with 0xFF (any number of fill bytes); junk between segments is skipped
    // as libjpeg does (it warns).
    if (d[p] != 0xFF) {
      ++p;
      continue;
    }
    while (p < n && d[p] == 0xFF) ++p;
    if (p >= n) break;
    const int m = d[p++];
    if (m == 0x00) continue;  // a stuffed 0xFF00: not a marker
    if (m == 0x01 || m == 0xD8 || (m >= 0xD0 && m <= 0xD7)) continue;  // no length
    if (m == 0xD9 || m == 0xDA) break;                                 // EOI / SOS before SOF
    if (p + 2 > n) break;
    const size_t len = (size_t)be16(d + p);
    if (len < 2) throw DecodeError("corrupt JPEG marker segment");
    if (is_sof(m)) {
      if (p + 8 > n) break;
      info.height = be16(d + p + 3);
      info.width = be16(d + p + 5);
      const int nc = d[p + 7];
      if (info.width <= 0 || info.height <= 0 || (nc != 1 && nc != 3 && nc != 4) ||
          p + 8 + 3 * (size_t)nc > n)
        throw DecodeError("unsupported JPEG frame header");
      info.components = nc;
      info.progressive = !(m == 0xC0 || m == 0xC1);  // baseline / extended sequential Huffman
      info.cmyk = nc == 4;
      if (nc == 3) {
        const uint8_t* c = d + p + 8;
        const int h0 = c[1] >> 4, v0 = c[1] & 15, h1 = c[4] >> 4, v1 = c[4] & 15;
        const int h2 = c[7] >> 4, v2 = c[7] & 15;
        if (h1 == h2 && v1 == v2 && h1 > 0 && v1 > 0 && h0 % h1 == 0 && v0 % v1 == 0) {
          info.sub_h = h0 / h1;
          info.sub_v = v0 / v1;
        }
      }
      return info;
    }
    p += len;
  }
  throw DecodeError("JPEG without a frame header");
}

ImageInfo peek_png(const uint8_t* d, size_t n) {
  // Signature (8), IHDR length (4) and type (4), width, height, depth, colour type.
  if (n < 8 + 8 + 13 || std::memcmp(d + 12, "IHDR", 4) != 0)
    throw DecodeError("PNG without IHDR");
  ImageInfo info;
  info.format = ImageFormat::Png;
  info.width = (int)be32(d + 16);
  info.height = (int)be32(d + 20);
  const int color_type = d[25];
  switch (color_type) {
    case 0: info.components = 1; break;  // gray
    case 2: info.components = 3; break;  // RGB
    case 3: info.components = 3; break;  // palette
    case 4: info.components = 2; break;  // gray + alpha
    case 6: info.components = 4; break;  // RGBA
    default: throw DecodeError("PNG with an unknown colour type");
  }
  if (info.width <= 0 || info.height <= 0) throw DecodeError("PNG with an empty image");
  return info;
}

// ---------------------------------------------------------------------------------------------
// libjpeg-turbo.

// Warnings (level -1) are errors but for junk before the EOI marker; traces are ignored.
void jpeg_emit(j_common_ptr cinfo, int level) {
  if (level >= 0) return;
  if (cinfo->err->msg_code == JWRN_EXTRANEOUS_DATA && cinfo->err->msg_parm.i[1] == 0xD9) return;
  libjpeg::fail(cinfo);
}

// Pillow's convert("RGB") of its CMYK image, which holds the inverted Adobe samples
// ("CMYK;I"): with C = 255 - c etc., nk = 255 - K, R = nk - C * nk / 255 (Convert.c cmyk2rgb,
// MULDIV255 rounding).
inline uint8_t cmyk_channel(int raw_c, int raw_k) {
  const int nk = raw_k;  // 255 - (255 - raw_k)
  const int c = 255 - raw_c;
  const int tmp = c * nk + 128;
  const int v = nk - (((tmp >> 8) + tmp) >> 8);
  return (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
}

void cmyk_to_rgb(const uint8_t* in, int n, uint8_t* out) {
  for (int x = 0; x < n; x++, in += 4, out += 3) {
    out[0] = cmyk_channel(in[0], in[3]);
    out[1] = cmyk_channel(in[1], in[3]);
    out[2] = cmyk_channel(in[2], in[3]);
  }
}

// Whether the bytes after `from` end with an EOI marker (within the last 4 KiB). In a
// single-scan entropy-coded segment 0xFF is always stuffed, so 0xFF 0xD9 only occurs as the
// real EOI: a file cut inside its scan data has none.
bool ends_with_eoi(const uint8_t* d, size_t n, size_t from) {
  const size_t lo = std::max(from, n > 4096 ? n - 4096 : (size_t)0);
  for (size_t i = n; i >= lo + 2; --i)
    if (d[i - 2] == 0xFF && d[i - 1] == 0xD9) return true;
  return false;
}

// What decode_jpeg_rows() returned: rows [row0, row1) of the 1/d-scaled image, columns from
// col0 (libjpeg's iMCU-aligned crop) in `buf`, RGB, `stride` bytes per row.
struct JpegRows {
  int full_w = 0, full_h = 0;  // the scaled image
  int col0 = 0, row0 = 0, row1 = 0;
  size_t stride = 0;
};

// Decodes rows [y0, y1) and at least columns [x0, x1) of the image scaled by 1/d (region in
// scaled pixels; null: everything) to RGB in buf. Throws DecodeError.
// Rows go to buf from byte `at` (buf grows to hold them; on an error it is cut back to `at`).
template <class Buf>
void decode_jpeg_rows(const uint8_t* data, size_t size, int d, const int* region, Buf& buf,
                      std::vector<uint8_t>& rowbuf, JpegRows& r, size_t at = 0) {
  jpeg_decompress_struct cinfo;
  libjpeg::Error err;
  cinfo.err = libjpeg::install(err);
  err.pub.emit_message = jpeg_emit;
  // Nothing with a destructor lives between setjmp and the libjpeg calls that may jump back.
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    if (buf.size() > at) buf.resize(at);
    throw DecodeError(std::string("JPEG: ") + err.message);
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, (unsigned long)size);
  if (jpeg_read_header(&cinfo, TRUE) != JPEG_HEADER_OK) {
    jpeg_destroy_decompress(&cinfo);
    throw DecodeError("JPEG: no image");
  }
  const size_t after_header = (size_t)(cinfo.src->next_input_byte - data);
  const bool cmyk = cinfo.num_components == 4;
  // Pillow's settings: ISLOW DCT, fancy upsampling (the defaults); gray expanded to R = G = B.
  cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.do_fancy_upsampling = TRUE;
  cinfo.scale_num = 1;
  cinfo.scale_denom = (unsigned)d;
  jpeg_start_decompress(&cinfo);
  const int W = (int)cinfo.output_width, H = (int)cinfo.output_height;
  int x0 = 0, y0 = 0, x1 = W, y1 = H;
  if (region) {
    x0 = std::max(0, region[0]);
    y0 = std::max(0, region[1]);
    x1 = std::min(W, region[2]);
    y1 = std::min(H, region[3]);
    if (x1 <= x0 || y1 <= y0) {
      jpeg_destroy_decompress(&cinfo);
      throw DecodeError("JPEG: empty region");
    }
  }
  // Columns: a margin of 16 scaled pixels (at least one iMCU) beyond the region, because
  // fancy upsampling at a crop's edge lacks its neighbour; libjpeg aligns the left end down.
  const int margin = 16;
  JDIMENSION cx = (JDIMENSION)std::max(0, x0 - margin);
  JDIMENSION cw = (JDIMENSION)(std::min(W, x1 + margin) - (int)cx);
  if (cx > 0 || (int)cw < W) jpeg_crop_scanline(&cinfo, &cx, &cw);
  const int ncomp = cmyk ? 4 : 3;
  r.full_w = W;
  r.full_h = H;
  r.col0 = (int)cx;
  r.row0 = y0;
  r.row1 = y1;
  r.stride = (size_t)cinfo.output_width * 3;
  buf.resize(at + r.stride * (size_t)(y1 - y0));
  if (cmyk) rowbuf.resize((size_t)cinfo.output_width * ncomp);
  if (y0 > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)y0);
  while ((int)cinfo.output_scanline < y1) {
    const int y = (int)cinfo.output_scanline;
    if (cmyk) {
      JSAMPROW row = rowbuf.data();
      jpeg_read_scanlines(&cinfo, &row, 1);
      cmyk_to_rgb(rowbuf.data(), (int)cinfo.output_width,
                  buf.data() + at + (size_t)(y - y0) * r.stride);
    } else {
      JSAMPROW rows[16];
      const int n = std::min(16, y1 - y);
      for (int i = 0; i < n; i++) rows[i] = buf.data() + at + (size_t)(y - y0 + i) * r.stride;
      jpeg_read_scanlines(&cinfo, rows, (JDIMENSION)n);
    }
  }
  if (y1 < H && ends_with_eoi(data, size, after_header)) {
    // A complete file: the rows below the region are not needed.
    jpeg_destroy_decompress(&cinfo);
    return;
  }
  if (y1 < H) {
    // No EOI at the end: read on to the last row so that truncation shows as an error.
    if (H - 1 > y1) jpeg_skip_scanlines(&cinfo, (JDIMENSION)(H - 1 - y1));
    rowbuf.resize((size_t)cinfo.output_width * ncomp);
    JSAMPROW row = rowbuf.data();
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
}

// ---------------------------------------------------------------------------------------------
// libpng: the whole image to RGB as Pillow's convert("RGB"): palette and gray expanded, 16-bit
// samples to their high byte, alpha dropped (not composited), no gamma correction (Pillow ignores
// gAMA/iCCP). The simplified API would apply gAMA and round 16-bit samples, so the classic API.

struct PngInput {
  const uint8_t* data;
  size_t size, pos;
};

void png_read_mem(png_structp png, png_bytep out, png_size_t n) {
  PngInput* in = static_cast<PngInput*>(png_get_io_ptr(png));
  if (in->size - in->pos < n) png_error(png, "truncated PNG");
  std::memcpy(out, in->data + in->pos, n);
  in->pos += n;
}

[[noreturn]] void png_fail(png_structp png, png_const_charp msg) {
  char* dst = static_cast<char*>(png_get_error_ptr(png));
  std::snprintf(dst, 200, "%s", msg);
  png_longjmp(png, 1);
}

void png_warn(png_structp, png_const_charp) {}

template <class Buf>
void decode_png(const uint8_t* data, size_t size, Buf& rgb, std::vector<uint8_t>& rowbuf,
                int* width, int* height) {
  char message[200] = "corrupt PNG";
  PngInput in{data, size, 0};
  png_structp png =
      png_create_read_struct(PNG_LIBPNG_VER_STRING, message, png_fail, png_warn);
  if (!png) throw DecodeError("PNG: out of memory");
  png_infop info = png_create_info_struct(png);
  if (!info) {
    png_destroy_read_struct(&png, nullptr, nullptr);
    throw DecodeError("PNG: out of memory");
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    throw DecodeError(std::string("PNG: ") + message);
  }
  png_set_read_fn(png, &in, png_read_mem);
  png_read_info(png, info);
  const png_uint_32 W = png_get_image_width(png, info), H = png_get_image_height(png, info);
  const int color_type = png_get_color_type(png, info);
  png_set_expand(png);  // palette -> RGB(A), gray 1/2/4 -> 8 bits, tRNS -> alpha
  png_set_strip_16(png);  // the high byte, as Pillow's "RGB;16B" unpacking
  if (color_type == PNG_COLOR_TYPE_GRAY || color_type == PNG_COLOR_TYPE_GRAY_ALPHA)
    png_set_gray_to_rgb(png);
  png_set_add_alpha(png, 0xFF, PNG_FILLER_AFTER);  // RGBA always; A is dropped below
  const int passes = png_set_interlace_handling(png);
  png_read_update_info(png, info);
  if (png_get_rowbytes(png, info) != (size_t)W * 4) png_error(png, "unexpected row layout");
  *width = (int)W;
  *height = (int)H;
  rgb.resize((size_t)W * H * 3);
  if (passes > 1) {
    // Interlaced: libpng needs the whole RGBA image.
    rowbuf.resize((size_t)W * H * 4);
    for (int pass = 0; pass < passes; pass++)
      for (png_uint_32 y = 0; y < H; y++) png_read_row(png, rowbuf.data() + (size_t)y * W * 4, nullptr);
    for (size_t i = 0; i < (size_t)W * H; i++) std::memcpy(&rgb[i * 3], &rowbuf[i * 4], 3);
  } else {
    rowbuf.resize((size_t)W * 4);
    for (png_uint_32 y = 0; y < H; y++) {
      png_read_row(png, rowbuf.data(), nullptr);
      uint8_t* o = rgb.data() + (size_t)y * W * 3;
      for (png_uint_32 x = 0; x < W; x++) std::memcpy(o + x * 3, &rowbuf[x * 4], 3);
    }
  }
  png_read_end(png, nullptr);
  png_destroy_read_struct(&png, &info, nullptr);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

ImageInfo peek_image(const uint8_t* data, size_t size) {
  if (size >= 3 && data[0] == 0xFF && data[1] == 0xD8 && data[2] == 0xFF)
    return peek_jpeg(data, size);
  static const uint8_t kPngSig[8] = {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A};
  if (size >= 8 && std::memcmp(data, kPngSig, 8) == 0) return peek_png(data, size);
  throw DecodeError("neither JPEG nor PNG");
}

void decode_image(const uint8_t* data, size_t size, DecodedImage& out, int scale_denom,
                  const DecodeRegion* region) {
  const ImageInfo info = peek_image(data, size);
  if (info.format == ImageFormat::Png) {
    std::vector<uint8_t> rowbuf;
    decode_png(data, size, out.rgb, rowbuf, &out.width, &out.height);
    out.x_offset = out.y_offset = 0;
    out.scale_denom = 1;
    return;
  }
  const int d = scale_denom;
  if (d != 1 && d != 2 && d != 4 && d != 8) throw DecodeError("JPEG: scale_denom not 1/2/4/8");
  int reg[4];
  const bool has_region = region && region->x1 > region->x0 && region->y1 > region->y0;
  if (has_region) {
    // Source pixels to scaled pixels: every scaled pixel touching the region.
    reg[0] = region->x0 / d;
    reg[1] = region->y0 / d;
    reg[2] = (region->x1 + d - 1) / d;
    reg[3] = (region->y1 + d - 1) / d;
  }
  std::vector<uint8_t> buf, rowbuf;
  JpegRows r;
  decode_jpeg_rows(data, size, d, has_region ? reg : nullptr, buf, rowbuf, r);
  const int x0 = has_region ? std::max(0, reg[0]) : 0;
  const int x1 = has_region ? std::min(r.full_w, reg[2]) : r.full_w;
  out.width = x1 - x0;
  out.height = r.row1 - r.row0;
  out.x_offset = x0;
  out.y_offset = r.row0;
  out.scale_denom = d;
  if (r.col0 == x0 && r.stride == (size_t)out.width * 3) {
    out.rgb.swap(buf);
    return;
  }
  out.rgb.resize((size_t)out.width * out.height * 3);
  for (int y = 0; y < out.height; y++)
    std::memcpy(&out.rgb[(size_t)y * out.width * 3], &buf[(size_t)y * r.stride + (size_t)(x0 - r.col0) * 3],
                (size_t)out.width * 3);
}

int dct_scale_denom(const Box& box, int S) {
  const double bw = box.x1 - box.x0, bh = box.y1 - box.y0;
  for (int d = 8; d >= 2; d /= 2)
    if (bw / d >= 2.0 * S && bh / d >= 2.0 * S) return d;
  return 1;
}

ResizeRegion decode_region(const uint8_t* data, size_t size, const ImageInfo& info, Box box, int S,
                           Interp interp, bool dct_scale, DecodeScratch& scratch,
                           PixelBuffer* into) {
  const bool png = info.format == ImageFormat::Png;
  if (!png && info.format != ImageFormat::Jpeg) throw DecodeError("not an image");
  // DCT-domain scaling: JPEG only
  const int d = !png && dct_scale ? dct_scale_denom(box, S) : 1;
  // libjpeg's scaled size: ceil(W / d).
  const int sw = (info.width + d - 1) / d, sh = (info.height + d - 1) / d;
  // The image resample() works on (its origin vx, vy and size vw x vh in scaled pixels) and
  // the box within it (not CropThenResize).
  int vx = 0, vy = 0, vw = sw, vh = sh;
  Box vbox = box;
  if (box.mode == BoxMode::CropThenResize) {
    // Pillow's crop: the rounded box is the whole image the resize sees.
    const int cx0 = (int)std::nearbyint(box.x0), cy0 = (int)std::nearbyint(box.y0);
    const int cx1 = (int)std::nearbyint(box.x1), cy1 = (int)std::nearbyint(box.y1);
    if (cx0 < 0 || cy0 < 0 || cx1 > info.width || cy1 > info.height || cx1 <= cx0 || cy1 <= cy0)
      throw std::invalid_argument("decode_region: crop box outside the image");
    // At 1/d: the scaled pixels covering the crop, the crop's fraction of them as the box.
    vx = cx0 / d;
    vy = cy0 / d;
    vw = std::min(sw, (cx1 + d - 1) / d) - vx;
    vh = std::min(sh, (cy1 + d - 1) / d) - vy;
    vbox = Box{(double)cx0 / d - vx, (double)cy0 / d - vy,
               std::min((double)cx1 / d - vx, (double)vw),
               std::min((double)cy1 / d - vy, (double)vh), BoxMode::Pillow};
  } else if (d > 1) {
    vbox = Box{box.x0 / d, box.y0 / d, box.x1 / d, box.y1 / d, BoxMode::Pillow};
  }
  int fx0, fy0, fx1, fy1;
  resample_footprint(vw, vh, vbox, S, S, interp, &fx0, &fy0, &fx1, &fy1);
  ResizeRegion reg;
  reg.x0 = fx0, reg.y0 = fy0, reg.w = fx1 - fx0, reg.h = fy1 - fy0;
  reg.W = vw, reg.H = vh;
  reg.box = vbox;
  const int rg[4] = {vx + fx0, vy + fy0, vx + fx1, vy + fy1};
  if (png) {  // the whole image (libpng has no regions), then the region's rows
    int w = 0, h = 0;
    decode_png(data, size, scratch.pixels, scratch.row, &w, &h);
    if (w != info.width || h != info.height) throw DecodeError("PNG: size differs from its header");
    reg.stride = (size_t)w * 3;
    reg.pixels = scratch.pixels.data() + (size_t)rg[1] * reg.stride + (size_t)rg[0] * 3;
    if (into) {  // packed rows
      const size_t row = (size_t)reg.w * 3;
      reg.offset = into->size();
      into->resize(reg.offset + row * reg.h);
      for (int y = 0; y < reg.h; ++y)
        std::memcpy(into->data() + reg.offset + y * row, reg.pixels + y * reg.stride, row);
      reg.stride = row;
      reg.pixels = into->data() + reg.offset;
    }
    return reg;
  }
  JpegRows r;
  if (into) {  // the rows straight into *into
    const size_t at = into->size();
    decode_jpeg_rows(data, size, d, rg, *into, scratch.row, r, at);
    reg.offset = at + (size_t)(rg[0] - r.col0) * 3;
    reg.pixels = into->data() + reg.offset;
  } else {
    decode_jpeg_rows(data, size, d, rg, scratch.pixels, scratch.row, r);
    reg.pixels = scratch.pixels.data() + (size_t)(rg[0] - r.col0) * 3;
  }
  reg.stride = r.stride;
  return reg;
}

void decode_crop_resize(const uint8_t* data, size_t size, const ImageInfo& info, Box box, int S,
                        Interp interp, bool flip, bool dct_scale, uint8_t* out,
                        DecodeScratch& scratch) {
  const ResizeRegion r = decode_region(data, size, info, box, S, interp, dct_scale, scratch);
  resample_part(r.pixels, (int)r.stride, r.x0, r.y0, r.w, r.h, r.W, r.H, r.box, S, S, interp, flip,
                out, scratch.resample);
}

}  // namespace vitgrid
