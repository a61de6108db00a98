// The view of one encoded sample (internal to the data layer: the loader and the encoded
// dataset's read()).
#pragma once
#include <cstdint>
#include <vector>

#include "vitgrid/data/dataset.h"
#include "vitgrid/data/image_decode.h"

namespace vitgrid {

// Reusable buffers of one worker thread.
struct ViewScratch {
  std::vector<uint8_t> bytes;
  DecodeScratch decode;
};

// Where a view goes: decoded on the host into `out` (S x S x 3), or, when the device's decoder
// takes the image (cfg.device_accepts) and `views` is given, left for the device: its bytes are
// appended to *encoded and a view with `slot` to *views (out untouched); or, when the device
// resizes it (cfg.device_resizes) and `regions` is given, decoded on the host and left for the
// device's resize: the region's rows decoded at the end of *pixels, a region of part `part`
// with `slot` to *regions (out untouched).
struct ViewTarget {
  int slot = 0;
  uint8_t* out = nullptr;
  std::vector<uint8_t>* encoded = nullptr;
  std::vector<EncodedView>* views = nullptr;
  int part = 0;
  PixelBuffer* pixels = nullptr;
  std::vector<DecodedRegion>* regions = nullptr;
};

// Sample `index` at stream position `position`: train = RandomResizedCrop drawn from
// (seed, position) and the flip `flip`; eval = resize + centre crop. An image that cannot be
// decoded is replaced by the next index (index + 1, ... modulo the size) whose image can, with
// the same position's draws, so every layout makes the same replacement; *bad counts them. A
// source that cannot be read (I/O, framing) throws UserError. Returns the label used.
int32_t cut_view(const ImageSource& src, const RealImageConfig& cfg, uint64_t seed, bool train,
                 bool flip, int64_t index, int64_t position, int S, const ViewTarget& to,
                 int* bad, ViewScratch& scratch);

// The host decode of a view the device's decoder refused after all (a bitstream it could not
// parse): the same sample on the host, replaced like cut_view if it does not decode there
// either. Writes S x S x 3 into out and returns the label used.
int32_t decode_view_on_host(const ImageSource& src, const RealImageConfig& cfg, uint64_t seed,
                            bool train, const EncodedView& v, int S, uint8_t* out, int* bad,
                            ViewScratch& scratch);

}  // namespace vitgrid
