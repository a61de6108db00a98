// The AVX2 loops of the Pillow-exact resize (resample_avx2.h): compiled for AVX2 whatever
// -march says (target attributes), run only where the CPU has it (image_transform.cpp).
#include "resample_avx2.h"

#if defined(VITGRID_RESAMPLE_AVX2)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace vitgrid {
namespace resample_detail {

constexpr int kSplitBits = 15;

inline bool splittable(int32_t k) { return k >= -(1 << 30) && k < (1 << 30); }
inline uint32_t lo_part(int32_t k) { return (uint32_t)k & 0x7fffu; }
inline uint32_t hi_part(int32_t k) { return (uint32_t)(k >> kSplitBits) & 0xffffu; }
// The pmaddwd operand of taps (a, b): a in the low word (it meets the first pixel of a pair).
inline int32_t pack_words(uint32_t a, uint32_t b) { return (int32_t)(a | (b << 16)); }

// (kHalf + sum p * lo) + 2^15 * (sum p * hi), shifted to the 8-bit scale (not yet clamped).
VG_AVX2 inline __m256i join(__m256i lo, __m256i hi) {
  return _mm256_srai_epi32(_mm256_add_epi32(lo, _mm256_slli_epi32(hi, kSplitBits)),
                           kPrecisionBits);
}

// The horizontal pass, for any tap count. An output pixel's window is Pillow's (first source
// index, then ksize taps, those past its tap count weighted 0), read as ceil(ksize / 2) tap pairs.
// A 128-bit lane holds one output pixel's tap pair as 16-bit words
//   [R_t R_t+1 G_t G_t+1 B_t B_t+1 0 0]  (one pshufb of the 6 bytes at the pair's first pixel)
// so pmaddwd by [k_t k_t+1] repeated gives the pair's R, G and B terms in 32-bit lanes 0..2; a
// 256-bit register holds two output pixels. Eight output pixels (a "block") are done at a time and
// stored as 24 bytes, mirrored when flip (the vertical pass works column by column, so mirroring
// its input mirrors its output).
//
// Setup (plain C++): s.hw holds, per block and tap pair, 8 vectors of 8 dwords: the lo and the hi
// weights of pixels (0, 1), then of (2, 3), (4, 5), (6, 7), each pixel's dword repeated in its
// lane. s.start holds window starts (part columns), out_w rounded up to whole blocks by repeating
// the last pixel's window with weight 0. Each tap-pair load reads 16 bytes; a block whose loads
// would pass the row's end (3 * sw bytes) reads from s.tail instead: per row, a copy of the row
// from column tail_col on, zero-padded. Returns false (use the baseline loops) when a weight does
// not split.

bool plan_horizontal_avx2(int sx, int sw, int out_w, int ksize, ResampleScratch& s,
                          HorizontalPlan& hp) {
  for (int32_t k : s.kh)
    if (!splittable(k)) return false;
  hp.pairs = (ksize + 1) / 2;
  hp.blocks = (out_w + kBlock - 1) / kBlock;
  const int padded = hp.blocks * kBlock;
  s.start.resize(padded);
  s.hw.assign((size_t)hp.blocks * hp.pairs * 64 + 8, 0);
  int32_t* weights = s.hw.data() + (32 - (uintptr_t)s.hw.data() % 32) % 32 / sizeof(int32_t);
  hp.weights = weights;
  for (int xx = 0; xx < padded; xx++) {
    s.start[xx] = s.bh[std::min(xx, out_w - 1) * 2] - sx;
    if (xx >= out_w) continue;  // weights 0
    const int n = s.bh[xx * 2 + 1];
    const int32_t* k = &s.kh[(size_t)xx * ksize];
    const int b = xx / kBlock, i = xx % kBlock;
    for (int j = 0; j < hp.pairs; j++) {
      const int32_t k0 = 2 * j < n ? k[2 * j] : 0, k1 = 2 * j + 1 < n ? k[2 * j + 1] : 0;
      // Vector 2 * (i / 2) (lo) and the next (hi), lane i % 2.
      int32_t* w = weights + ((size_t)b * hp.pairs + j) * 64 + (i / 2) * 16 + (i % 2) * 4;
      for (int d = 0; d < 4; d++) {
        w[d] = pack_words(lo_part(k0), lo_part(k1));
        w[8 + d] = pack_words(hi_part(k0), hi_part(k1));
      }
    }
  }
  const int reach = 6 * (hp.pairs - 1) + 16;  // bytes read from a window's first pixel
  hp.tail_block = hp.blocks;
  for (int b = 0; b < hp.blocks && hp.tail_block == hp.blocks; b++)
    for (int i = 0; i < kBlock; i++)
      if (3 * s.start[b * kBlock + i] + reach > 3 * sw) hp.tail_block = b;
  hp.tail_col = sw;
  for (int xx = hp.tail_block * kBlock; xx < padded; xx++)
    hp.tail_col = std::min(hp.tail_col, s.start[xx]);
  s.tail.assign((size_t)3 * (sw - hp.tail_col) + reach, 0);
  return true;
}

// Tap pair j of two output pixels whose windows start at a and b -> [a's words | b's words].
VG_AVX2 inline __m256i tap_pairs(const uint8_t* a, const uint8_t* b, __m256i spread) {
  return _mm256_shuffle_epi8(
      _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                              _mm_loadu_si128((const __m128i*)b), 1),
      spread);
}

// One row of the horizontal pass; P: the tap pairs (0: `pairs`, a loop the compiler can't
// unroll). Everything it reads is passed in locals: a store through trow (uint8_t) may alias
// anything, which would make the compiler reload the scratch's pointers after each one.
template <int P>
VG_AVX2 void horizontal_row_avx2(const uint8_t* srow, const uint8_t* tail, uint8_t* trow,
                                 int out_w, bool flip, int pairs_, int blocks, int tail_block,
                                 int tail_col, const int* start, const __m256i* weights) {
  const int pairs = P ? P : pairs_;
  const __m256i spread = _mm256_setr_epi8(  // bytes 0..5 -> [R0 R1 G0 G1 B0 B1 0 0], -1: zero
      0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1,
      0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
  // After the packs below, lane 0 holds pixels 0, 2, 4, 6 and lane 1 pixels 1, 3, 5, 7 (RGBx);
  // `order` puts pixels 0..3 in lane 0 and 4..7 in lane 1, `pack` keeps 12 bytes RGB of each
  // lane: in order at bytes 0..11 or mirrored at bytes 4..15.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i pack = flip ? _mm256_setr_epi8(
      -1, -1, -1, -1, 12, 13, 14, 8, 9, 10, 4, 5, 6, 0, 1, 2,
      -1, -1, -1, -1, 12, 13, 14, 8, 9, 10, 4, 5, 6, 0, 1, 2)
                            : _mm256_setr_epi8(
      0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
      0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
  const __m256i half = _mm256_set1_epi32(kHalf);
  const __m256i zero = _mm256_setzero_si256();
  for (int b = 0; b < blocks; b++) {
    const int* st = start + b * kBlock;
    const bool from_tail = b >= tail_block;
    const uint8_t* base = from_tail ? tail : srow;  // column c at base + 3 * (c - col0)
    const int col0 = from_tail ? tail_col : 0;
    const uint8_t* p[kBlock];
    for (int i = 0; i < kBlock; i++) p[i] = base + (size_t)3 * (st[i] - col0);
    const __m256i* w = weights + (size_t)b * pairs * 8;
    __m256i lo01 = half, hi01 = zero, lo23 = half, hi23 = zero;
    __m256i lo45 = half, hi45 = zero, lo67 = half, hi67 = zero;
    for (int j = 0; j < pairs; j++, w += 8) {
      const int o = 6 * j;
      const __m256i x01 = tap_pairs(p[0] + o, p[1] + o, spread);
      const __m256i x23 = tap_pairs(p[2] + o, p[3] + o, spread);
      const __m256i x45 = tap_pairs(p[4] + o, p[5] + o, spread);
      const __m256i x67 = tap_pairs(p[6] + o, p[7] + o, spread);
      lo01 = _mm256_add_epi32(lo01, _mm256_madd_epi16(x01, _mm256_loadu_si256(w + 0)));
      hi01 = _mm256_add_epi32(hi01, _mm256_madd_epi16(x01, _mm256_loadu_si256(w + 1)));
      lo23 = _mm256_add_epi32(lo23, _mm256_madd_epi16(x23, _mm256_loadu_si256(w + 2)));
      hi23 = _mm256_add_epi32(hi23, _mm256_madd_epi16(x23, _mm256_loadu_si256(w + 3)));
      lo45 = _mm256_add_epi32(lo45, _mm256_madd_epi16(x45, _mm256_loadu_si256(w + 4)));
      hi45 = _mm256_add_epi32(hi45, _mm256_madd_epi16(x45, _mm256_loadu_si256(w + 5)));
      lo67 = _mm256_add_epi32(lo67, _mm256_madd_epi16(x67, _mm256_loadu_si256(w + 6)));
      hi67 = _mm256_add_epi32(hi67, _mm256_madd_epi16(x67, _mm256_loadu_si256(w + 7)));
    }
    // [px0 px2 | px1 px3] and [px4 px6 | px5 px7] in 16 bits, then 8 bits (the clamp to 0..255).
    const __m256i w0123 = _mm256_packs_epi32(join(lo01, hi01), join(lo23, hi23));
    const __m256i w4567 = _mm256_packs_epi32(join(lo45, hi45), join(lo67, hi67));
    const __m256i px = _mm256_shuffle_epi8(
        _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w0123, w4567), order), pack);
    const int x = b * kBlock;
    if (x + kBlock + 2 <= out_w) {
      // Two 16-byte stores, the second overwriting the first's 4 spare bytes; the other 4 spare
      // bytes fall on the next block's first two pixels (written after this one).
      if (!flip) {
        uint8_t* d = trow + (size_t)3 * x;
        _mm_storeu_si128((__m128i*)d, _mm256_castsi256_si128(px));
        _mm_storeu_si128((__m128i*)(d + 12), _mm256_extracti128_si256(px, 1));
      } else {  // pixels x .. x+7 at out_w-1-x down to out_w-8-x
        uint8_t* d = trow + (size_t)3 * (out_w - kBlock - x);
        _mm_storeu_si128((__m128i*)(d + 8), _mm256_castsi256_si128(px));
        _mm_storeu_si128((__m128i*)(d - 4), _mm256_extracti128_si256(px, 1));
      }
    } else {  // the row's last pixels: only those below out_w, nothing outside the row
      alignas(32) uint8_t buf[32];
      _mm256_store_si256((__m256i*)buf, px);
      const int n = std::min(kBlock, out_w - x);
      for (int i = 0; i < n; i++) {
        const uint8_t* q = flip ? buf + (i < 4 ? 13 - 3 * i : 29 - 3 * (i - 4))
                                : buf + (i < 4 ? 3 * i : 16 + 3 * (i - 4));
        std::memcpy(trow + (size_t)3 * (flip ? out_w - 1 - x - i : x + i), q, 3);
      }
    }
  }
}

VG_AVX2 void horizontal_avx2(const uint8_t* src, int src_stride, int sw, int rows, int out_w,
                             bool flip, const HorizontalPlan& hp, ResampleScratch& s,
                             uint8_t* tmp) {
  const int pairs = hp.pairs, blocks = hp.blocks, tail_block = hp.tail_block;
  const int tail_col = hp.tail_col;
  const int* start = s.start.data();
  const __m256i* weights = reinterpret_cast<const __m256i*>(hp.weights);
  uint8_t* tail = s.tail.data();
  const size_t tail_bytes = (size_t)3 * (sw - tail_col);
  auto row_fn = horizontal_row_avx2<0>;
  switch (pairs) {
    case 2: row_fn = horizontal_row_avx2<2>; break;
    case 3: row_fn = horizontal_row_avx2<3>; break;
    case 4: row_fn = horizontal_row_avx2<4>; break;
    case 5: row_fn = horizontal_row_avx2<5>; break;
    default: break;
  }
  for (int r = 0; r < rows; r++) {
    const uint8_t* srow = src + (size_t)r * src_stride;
    if (tail_block < blocks) std::memcpy(tail, srow + (size_t)3 * tail_col, tail_bytes);
    row_fn(srow, tail, tmp + (size_t)r * out_w * 3, out_w, flip, pairs, blocks, tail_block,
           tail_col, start, weights);
  }
}

// The vertical pass: 32 output bytes at a time (any mix of channels: every byte of a row has
// the same weights), all taps summed in registers before the clip and the store. Taps go in pairs
// (t, t+1): unpacking the two rows' bytes with each other and then with zero gives 16-bit words
// [row_t[i], row_t+1[i], ...], which pmaddwd multiplies by [k_t, k_t+1]; an odd last tap pairs
// with itself, weighted 0. The unpacks work within 128-bit lanes, and the packs at the end
// undo their order, so the 32 bytes come out in place. s.vw: per output row, per tap pair, the
// lo and hi dwords (weights that do not split: false, the baseline loop runs). A row narrower
// than 32 bytes is left to the baseline loop too (false).
bool plan_vertical_avx2(int n, int out_h, int ksize, ResampleScratch& s) {
  if (n < 32) return false;
  for (int32_t k : s.kv)
    if (!splittable(k)) return false;
  const int pairs = (ksize + 1) / 2;
  s.vw.assign((size_t)out_h * pairs * 2, 0);
  for (int yy = 0; yy < out_h; yy++) {
    const int cnt = s.bv[yy * 2 + 1];
    const int32_t* k = &s.kv[(size_t)yy * ksize];
    for (int j = 0; 2 * j < cnt; j++) {
      const int32_t k0 = k[2 * j], k1 = 2 * j + 1 < cnt ? k[2 * j + 1] : 0;
      s.vw[((size_t)yy * pairs + j) * 2 + 0] = pack_words(lo_part(k0), lo_part(k1));
      s.vw[((size_t)yy * pairs + j) * 2 + 1] = pack_words(hi_part(k0), hi_part(k1));
    }
  }
  return true;
}

VG_AVX2 void vertical_avx2(const uint8_t* in, size_t in_stride, int in_y0, int n, int out_h,
                           int ksize, bool flip, ResampleScratch& s, uint8_t* dst) {
  const int pairs = (ksize + 1) / 2;
  const int out_w = n / 3;
  const __m256i zero = _mm256_setzero_si256();
  const __m256i half = _mm256_set1_epi32(kHalf);
  if (flip) s.row.resize(n);
  for (int yy = 0; yy < out_h; yy++) {
    const int ymin = s.bv[yy * 2 + 0], cnt = s.bv[yy * 2 + 1];
    const int32_t* w = &s.vw[(size_t)yy * pairs * 2];
    const uint8_t* row0 = in + (size_t)(ymin - in_y0) * in_stride;
    uint8_t* drow = flip ? s.row.data() : dst + (size_t)yy * n;
    // Strips of 32 bytes; the last one ends at n (overlapping the one before: the same bytes).
    for (int i = 0;; i += 32) {
      if (i > n - 32) {
        if (i == n) break;
        i = n - 32;
      }
      __m256i lo0 = half, lo1 = half, lo2 = half, lo3 = half;
      __m256i hi0 = zero, hi1 = zero, hi2 = zero, hi3 = zero;
      const uint8_t* ra = row0 + i;
      for (int j = 0; 2 * j < cnt; j++, ra += 2 * in_stride) {
        const uint8_t* rb = 2 * j + 1 < cnt ? ra + in_stride : ra;
        const __m256i a = _mm256_loadu_si256((const __m256i*)ra);
        const __m256i b = _mm256_loadu_si256((const __m256i*)rb);
        const __m256i wl = _mm256_set1_epi32(w[2 * j]), wh = _mm256_set1_epi32(w[2 * j + 1]);
        const __m256i ab_lo = _mm256_unpacklo_epi8(a, b), ab_hi = _mm256_unpackhi_epi8(a, b);
        __m256i x = _mm256_unpacklo_epi8(ab_lo, zero);  // bytes 0..3 (lane 1: 16..19)
        lo0 = _mm256_add_epi32(lo0, _mm256_madd_epi16(x, wl));
        hi0 = _mm256_add_epi32(hi0, _mm256_madd_epi16(x, wh));
        x = _mm256_unpackhi_epi8(ab_lo, zero);  // 4..7 (20..23)
        lo1 = _mm256_add_epi32(lo1, _mm256_madd_epi16(x, wl));
        hi1 = _mm256_add_epi32(hi1, _mm256_madd_epi16(x, wh));
        x = _mm256_unpacklo_epi8(ab_hi, zero);  // 8..11 (24..27)
        lo2 = _mm256_add_epi32(lo2, _mm256_madd_epi16(x, wl));
        hi2 = _mm256_add_epi32(hi2, _mm256_madd_epi16(x, wh));
        x = _mm256_unpackhi_epi8(ab_hi, zero);  // 12..15 (28..31)
        lo3 = _mm256_add_epi32(lo3, _mm256_madd_epi16(x, wl));
        hi3 = _mm256_add_epi32(hi3, _mm256_madd_epi16(x, wh));
      }
      const __m256i r01 = _mm256_packs_epi32(join(lo0, hi0), join(lo1, hi1));  // 0..7 (16..23)
      const __m256i r23 = _mm256_packs_epi32(join(lo2, hi2), join(lo3, hi3));  // 8..15 (24..31)
      _mm256_storeu_si256((__m256i*)(drow + i), _mm256_packus_epi16(r01, r23));
    }
    if (flip) store_row(s.row.data(), out_w, true, dst + (size_t)yy * n);
  }
}

}  // namespace resample_detail
}  // namespace vitgrid
#endif  // VITGRID_RESAMPLE_AVX2
