// The CUDA backend's ImageDecoder (backend/image_decoder.h): nvJPEG's batched decoder (the
// hardware JPEG engines where the GPU has them) into planar RGB, then the crop/resize/flip
// kernels of image_resize.cu. Internal to src/backend/cuda (the GPU tests include it).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "vitgrid/backend/image_decoder.h"

namespace vitgrid {
namespace cuda {

// One image of a batch for the resize kernels (device copy, one per accepted job).
struct ResizeJob {
  // the decoded pixels: channel c of pixel (x, y) of the W x H image the resize sees at
  // src + (y - org_y) * pitch + (x - org_x) * step + c * plane (nvJPEG's planar RGB: step 1,
  // plane W * H; a host region, packed RGB: step 3, plane 1, org its first pixel)
  const uint8_t* src = nullptr;
  uint8_t* tmp = nullptr;        // the horizontal pass's rows: [tmp_rows][S][3]
  uint8_t* dst = nullptr;        // the output image: [S][S][3]
  size_t plane = 0;              // bytes between channel planes
  int pitch = 0;                 // bytes between rows
  int step = 1;                  // bytes between pixels of a row
  int org_x = 0, org_y = 0;
  int W = 0, H = 0;
  int tmp_rows = 0;              // rows allocated at tmp (>= the rows the vertical pass reads)
  int gray = 0;                  // one plane: R = G = B = plane 0
  int flip = 0;
  float x0 = 0, y0 = 0, x1 = 0, y1 = 0;  // the box, as float (Pillow's resize takes floats)
  int rx = 0, ry = 0;  // outputs of the whole resize per axis (S but for ResizeThenCrop)
  int ox = 0, oy = 0;  // the first of the S outputs kept (0 but for ResizeThenCrop)
};

// Enqueues both passes for jobs_dev[0..n) on `stream`; kcap_h / kcap_v bound the taps of one
// output column / row over the batch (resize_taps_bound), max_tmp_rows the rows of any tmp.
void launch_resize(const ResizeJob* jobs_dev, int n, int S, int interp, int kcap_h, int kcap_v,
                   int max_tmp_rows, cudaStream_t stream);
// Host-side bounds used to size buffers and shared memory (image_resize.cu).
size_t resize_tmp_rows_bound(int interp, int H, float y0, float y1, int ry, int oy, int S);
int resize_taps_bound(int interp, int in_size, float in0, float in1, int r);

struct NvjpegDecoderOptions {
  // false: no nvJPEG at all, the crop/resize/flip of host decodes (resize_async) and copies
  // alone; accepts() takes nothing.
  bool jpeg = true;
  // Try nvJPEG's hardware backend first (else GPU_HYBRID, else DEFAULT).
  bool prefer_hardware = true;
  // NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION: chroma upsampled by interpolation (closer to
  // libjpeg-turbo's "fancy" upsampling, which Pillow and the CPU decoder use) instead of
  // replication. Dropped when the library refuses the flag.
  bool interpolate_chroma = true;
  // Device memory the decoder holds, reported as it changes (+bytes / -bytes): the backend's
  // count_memory, so that its current and peak memory include the decoder's buffers.
  std::function<void(int64_t)> count_memory;
};

// Null when nvJPEG cannot be initialised on `device` (reported on stderr once); join() makes
// `join_stream` (the backend's compute stream) wait for the decoder's work.
std::unique_ptr<ImageDecoder> make_nvjpeg_decoder(int device, cudaStream_t join_stream,
                                                  const NvjpegDecoderOptions& opts = {});

}  // namespace cuda
}  // namespace vitgrid
