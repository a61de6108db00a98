// Private to src/data: the AVX2 loops of the Pillow-exact resize (image_resample_avx2.cpp),
// called by image_transform.cpp's resample_part() where the CPU has AVX2.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "vitgrid/data/image_transform.h"

namespace vitgrid {
namespace resample_detail {

// 8 bits of result, 2 bits of headroom for the filters' negative lobes (Pillow's choice).
constexpr int kPrecisionBits = 32 - 8 - 2;
constexpr int32_t kHalf = 1 << (kPrecisionBits - 1);

// Writes one row of out_w pixels, mirrored when flip.
inline void store_row(const uint8_t* row, int out_w, bool flip, uint8_t* dst) {
  if (!flip) {
    std::memcpy(dst, row, (size_t)out_w * 3);
    return;
  }
  for (int x = 0; x < out_w; x++) {
    const uint8_t* p = row + (size_t)(out_w - 1 - x) * 3;
    dst[x * 3 + 0] = p[0];
    dst[x * 3 + 1] = p[1];
    dst[x * 3 + 2] = p[2];
  }
}

// ---- AVX2 loops: x86-64 only, compiled for AVX2 whatever -march says (target attributes) and
// run only on a CPU that has it (use_avx2(), below: checked once); otherwise the loops above.
//
// Both passes multiply 8-bit pixels by the 22-bit fixed-point weights with pmaddwd (16 x 16 ->
// 32-bit products, adjacent pairs summed), which needs 16-bit operands while a weight takes up to
// 23 bits. So each weight is split exactly: k = hi * 2^15 + lo with lo = k & 0x7fff (0..32767)
// and hi = k >> 15 (arithmetic: the floor), which fits int16 whenever -2^30 <= k < 2^30 (checked;
// Pillow's weights stay below 2^24 in magnitude). Then
//   kHalf + sum p * k = (kHalf + sum p * lo) + 2^15 * (sum p * hi),
// each pmaddwd pair sum bounded by 2 * 255 * 32768 < 2^31 (no overflow, no saturation; pmaddwd
// never saturates), and the int32 additions and the shift are exact modulo 2^32, so the result
// equals Pillow's int32 sum bit for bit (modulo 2^32 as well, were it ever to overflow). The clip
// (>> 22, clamp to 0..255) is done by saturating packs as in the SSE4.1 loop above.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VITGRID_RESAMPLE_AVX2 1
#define VG_AVX2 __attribute__((target("avx2")))

constexpr int kBlock = 8;  // output pixels per step of the horizontal pass

struct HorizontalPlan {
  int pairs = 0, blocks = 0;
  int tail_block = 0;  // blocks [tail_block, blocks) read s.tail
  int tail_col = 0;
  const int32_t* weights = nullptr;  // in s.hw, 32-byte aligned (no load splits a cache line)
};

bool plan_horizontal_avx2(int sx, int sw, int out_w, int ksize, ResampleScratch& s,
                          HorizontalPlan& hp);
VG_AVX2 void horizontal_avx2(const uint8_t* src, int src_stride, int sw, int rows, int out_w,
                             bool flip, const HorizontalPlan& hp, ResampleScratch& s,
                             uint8_t* out);
bool plan_vertical_avx2(int n, int out_h, int ksize, ResampleScratch& s);
VG_AVX2 void vertical_avx2(const uint8_t* in, size_t in_stride, int in_y0, int n, int out_h,
                           int ksize, bool flip, ResampleScratch& s, uint8_t* dst);
#endif

}  // namespace resample_detail
}  // namespace vitgrid
