// Batched image decoding on the device (the CUDA backend: nvJPEG, with the hardware JPEG engine
// where the GPU has one, A100/H100, else nvJPEG's hybrid/CUDA decoder), each image's crop box
// resampled to S x S with Pillow's antialiased filter (data/image_transform.h: resample()) and
// optionally mirrored, written as uint8 HWC into the device batch; the same crop/resize/flip
// of images the host decoded (resize_async: the loader's threads then only decode). Decoding,
// crop, resize and flip of a batch run on the decoder's own stream so they overlap the
// previous step's compute. A decoder made for resizing alone (Backend::image_decoder(false))
// accepts no JPEG.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace vitgrid {

struct DecodeJob {
  const uint8_t* data = nullptr;  // the JPEG bitstream in host memory (pinned staging)
  size_t size = 0;
  double x0 = 0, y0 = 0, x1 = 0, y1 = 0;  // source box (data/image_transform.h Box)
  int mode = 0;  // data/image_transform.h BoxMode: 0 Pillow, 1 CropThenResize, 2 ResizeThenCrop
  int flip = 0;
  int slot = 0;  // output image index: out + slot * S * S * 3
};

// An image decoded on the host, for the device's crop/resize/flip (resize_async): the columns
// [x0, x0 + w) and rows [y0, y0 + h) of the W x H RGB image the resize sees, rows `stride`
// bytes apart from `pixels` in host memory; the box in that image (mode 0 Pillow or 2
// ResizeThenCrop) as DecodeJob's.
struct HostRegion {
  const uint8_t* pixels = nullptr;
  size_t stride = 0;
  int x0 = 0, y0 = 0, w = 0, h = 0;
  int W = 0, H = 0;
  double bx0 = 0, by0 = 0, bx1 = 0, by1 = 0;
  int mode = 0;
  int flip = 0;
  int slot = 0;
};

class ImageDecoder {
 public:
  virtual ~ImageDecoder() = default;
  // Whether the device decoder takes this JPEG (from its header: data/image_decode.h
  // peek_image); the others are decoded on the CPU by the loader. nvJPEG's hardware engine
  // takes baseline 4:4:4, 4:2:2, 4:2:0, 4:4:0 and grayscale; CMYK/YCCK, progressive and PNG go
  // to the CPU (or to nvJPEG's hybrid decoder where that is the backend in use).
  virtual bool accepts(int components, bool progressive, int sub_h, int sub_v) const = 0;
  // Enqueues decoding of jobs[0..n), then the crop/resize/flip of each into out_dev (device,
  // [*, S, S, 3] uint8), on the decoder's own thread and stream: the call returns at once. The
  // host bitstreams must stay untouched until join() has returned.
  virtual void decode_async(const DecodeJob* jobs, int n, int S, int interp,
                            uint8_t* out_dev) = 0;
  // Whether resize_async takes a source box of box_w x box_h pixels to S x S (the device's
  // filter has a bound on its taps: downscales beyond ~50x are the host's).
  virtual bool resizes(double box_w, double box_h, int S, int interp) const = 0;
  // Enqueues the crop/resize/flip of host-decoded regions[0..n) into out_dev + slot * S * S * 3,
  // after the work enqueued before, equal bit for bit to the host's (data/image_transform.h
  // resample_part). The host pixels must stay untouched until join().
  virtual void resize_async(const HostRegion* regions, int n, int S, int interp,
                            uint8_t* out_dev) = 0;
  // Enqueues copies of already decoded S x S x 3 images (host memory, e.g. the loader's host
  // decodes of the images the device does not take) to out_dev + slots[k] * S * S * 3 after the
  // work enqueued before, so that the batch's images are written by the decoder alone. The
  // host images must stay untouched until join().
  virtual void copy_async(const uint8_t* const* host_images, const int* slots, int n, int S,
                          uint8_t* out_dev) = 0;
  // Waits until everything decode_async and copy_async were given has been enqueued on the
  // device, makes the backend's compute stream wait for it, and returns the output slots of the
  // images the decoder could not decode (corrupt bitstreams, in order; not written): the caller
  // decodes those on the host and copies them (copy_async, then join() again).
  virtual std::vector<int> join() = 0;
  // Later writes into out_dev (decode_async / copy_async with that output buffer) wait for the
  // work enqueued on the backend's compute stream so far: call it once the last reader of the
  // buffer has been enqueued (as Backend::release_slot for uploads). Writes into other buffers
  // do not wait, so the next batch is decoded into the other slot while this one computes.
  // Decoding itself never waits. The default does nothing (decoders that write at once).
  virtual void release_output(const uint8_t* out_dev) { (void)out_dev; }
  // "nvJPEG hardware engine" / "nvJPEG hybrid (CUDA)" / "resize only": recorded in the run's
  // outputs.
  virtual std::string describe() const = 0;
};

}  // namespace vitgrid
