// FP8 code packing shared by the kernels that write FP8 operands (fp8.cu's casts, layernorm.cu's
// LayerNorm writing FP8): two values converted by one instruction, and an 8 x 4 block of codes
// transposed in registers for the K-contiguous copies the weight-gradient GEMMs take.
#pragma once
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace vitgrid {
namespace cuda {

// fp8(a * scale), fp8(b * scale) (nearest even, saturating, NaN kept) in the low 16 bits, a's
// code in the low byte (the element at the lower address).
__device__ __forceinline__ uint32_t fp8x2_codes(float a, float b, float scale,
                                                __nv_fp8_interpretation_t fmt) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a * scale, b * scale), __NV_SATFINITE, fmt);
}

// v[i]: the 4 codes of row i of an 8 x 4 block (byte 0 its first column). col[j][h]: column j's
// codes of rows 4h .. 4h + 3 (byte 0 the first row), so make_uint2(col[j][0], col[j][1]) is
// column j's 8 rows in order. Byte permutes only.
__device__ __forceinline__ void transpose_codes_8x4(const uint32_t (&v)[8], uint32_t (&col)[4][2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t* a = v + 4 * h;
    const uint32_t t0 = __byte_perm(a[0], a[1], 0x5140), t1 = __byte_perm(a[2], a[3], 0x5140);
    const uint32_t t2 = __byte_perm(a[0], a[1], 0x7362), t3 = __byte_perm(a[2], a[3], 0x7362);
    col[0][h] = __byte_perm(t0, t1, 0x5410);
    col[1][h] = __byte_perm(t0, t1, 0x7632);
    col[2][h] = __byte_perm(t2, t3, 0x5410);
    col[3][h] = __byte_perm(t2, t3, 0x7632);
  }
}

// The 8 x 4 block of codes at rows 8 rb .. 8 rb + 7, bytes 4 wc .. 4 wc + 3 of a shared tile
// (rows pitch bytes apart, pitch a multiple of 4) written transposed: column 4 wc + j's 8 codes
// at out_t[(c0 + 4 wc + j) ld + r0 .. + 7], one 8-byte store each (c0, r0: the tile's first
// column and the block's first row in the untransposed tensor; ld: its row count). A warp
// whose lanes take 4 row blocks x 8 word columns reads 32-bit words without bank conflicts
// (pitch not a multiple of 128) and writes 32-byte runs.
__device__ __forceinline__ void store_codes_8x4_transposed(const uint8_t* tile, int pitch, int rb,
                                                           int wc, uint8_t* out_t, size_t c0,
                                                           size_t ld, size_t r0) {
  uint32_t v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    v[i] = *reinterpret_cast<const uint32_t*>(tile + (rb * 8 + i) * pitch + wc * 4);
  uint32_t col[4][2];
  transpose_codes_8x4(v, col);
#pragma unroll
  for (int j = 0; j < 4; ++j)
    *reinterpret_cast<uint2*>(out_t + (c0 + wc * 4 + j) * ld + r0) =
        make_uint2(col[j][0], col[j][1]);
}

}  // namespace cuda
}  // namespace vitgrid
