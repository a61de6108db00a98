// JPEG encoding with libjpeg-turbo (its libjpeg API), Pillow's settings. See
// include/vitgrid/data/image_encode.h.
#include "vitgrid/data/image_encode.h"

#include <csetjmp>
#include <cstdlib>
#include <string>

#include <jpeglib.h>

#include "libjpeg_error.h"

namespace vitgrid {

void encode_jpeg(const uint8_t* rgb, int w, int h, int quality, std::vector<uint8_t>& out) {
  if (w <= 0 || h <= 0 || quality < 1 || quality > 100)
    throw DecodeError("JPEG encode: " + std::to_string(w) + " x " + std::to_string(h) +
                      " at quality " + std::to_string(quality));
  jpeg_compress_struct cinfo;
  libjpeg::Error err;
  cinfo.err = libjpeg::install(err);
  unsigned char* mem = nullptr;
  unsigned long size = 0;
  // Nothing with a destructor lives between setjmp and the libjpeg calls that may jump back.
  if (setjmp(err.jump)) {
    jpeg_destroy_compress(&cinfo);
    std::free(mem);
    throw DecodeError(std::string("JPEG encode: ") + err.message);
  }
  jpeg_create_compress(&cinfo);
  jpeg_mem_dest(&cinfo, &mem, &size);
  cinfo.image_width = (JDIMENSION)w;
  cinfo.image_height = (JDIMENSION)h;
  cinfo.input_components = 3;
  cinfo.in_color_space = JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(rgb + (size_t)cinfo.next_scanline * (size_t)w * 3);
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  out.assign(mem, mem + size);
  std::free(mem);
}

bool transcode_short_side(std::vector<uint8_t>& bytes, int short_side, int quality,
                          Interp interp, TranscodeScratch& t) {
  const ImageInfo info = peek_image(bytes.data(), bytes.size());
  if (std::min(info.width, info.height) <= short_side) return false;
  decode_image(bytes.data(), bytes.size(), t.decoded);
  const DecodedImage& d = t.decoded;
  int w = 0, h = 0;
  resized_size(d.width, d.height, short_side, &w, &h);
  t.resized.resize((size_t)w * (size_t)h * 3);
  Box box;
  box.x1 = d.width;
  box.y1 = d.height;
  resample(d.rgb.data(), d.width, d.height, d.width * 3, box, w, h, interp, false,
           t.resized.data(), t.resample);
  encode_jpeg(t.resized.data(), w, h, quality, bytes);
  return true;
}

}  // namespace vitgrid
