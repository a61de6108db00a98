// Pillow's resampling (libImaging/Resample.c, Pillow 9.4) re-implemented for HWC RGB uint8, and
// torchvision's / timm's crop boxes. See include/vitgrid/data/image_transform.h.
//
// Exactness depends on computing the filter coefficients in double exactly as Pillow does: the
// same expressions in the same order, no fused multiply-add (Pillow's x86-64 builds have none;
// -march=native would let GCC contract a * b + c), hence the pragmas below.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "vitgrid/data/image_transform.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__SSE4_1__)
#include <smmintrin.h>
#endif

#include "resample_avx2.h"
#include "vitgrid/core/rng.h"

namespace vitgrid {
namespace {

using namespace resample_detail;

double bilinear_filter(double x) {
  if (x < 0.0) x = -x;
  if (x < 1.0) return 1.0 - x;
  return 0.0;
}

// Keys' cubic with a = -0.5, written as Pillow writes it (same rounding).
double bicubic_filter(double x) {
  const double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

inline uint8_t clip8(int32_t ss) {
  const int32_t v = ss >> kPrecisionBits;  // arithmetic shift, as Pillow's lookup table index
  return (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// Pillow's precompute_coeffs() followed by normalize_coeffs_8bpc(): for each output index, the
// first source index, the tap count and ksize fixed-point weights. in0/in1 are float as in
// Pillow's C layer. Only the outputs [out_offset, out_offset + out_size) of a resize to
// out_total are computed (a crop of the resized image). Returns ksize.
int precompute_coeffs(int in_size, float in0, float in1, int out_total, int out_offset,
                      int out_size, Interp interp, std::vector<double>& kd,
                      std::vector<int>& bounds, std::vector<int32_t>& kk) {
  const double filter_support = interp == Interp::Bicubic ? 2.0 : 1.0;
  double scale = (double)(in1 - in0) / out_total;
  double filterscale = scale;
  if (filterscale < 1.0) filterscale = 1.0;
  const double support = filter_support * filterscale;
  const int ksize = (int)std::ceil(support) * 2 + 1;
  kd.assign((size_t)out_size * ksize, 0.0);
  bounds.resize((size_t)out_size * 2);
  for (int o = 0; o < out_size; o++) {
    const int xx = o + out_offset;
    const double center = in0 + (xx + 0.5) * scale;
    double ww = 0.0;
    const double ss = 1.0 / filterscale;
    int xmin = (int)(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = (int)(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double* k = &kd[(size_t)o * ksize];
    for (int x = 0; x < xmax; x++) {
      const double arg = (x + xmin - center + 0.5) * ss;
      const double w = interp == Interp::Bicubic ? bicubic_filter(arg) : bilinear_filter(arg);
      k[x] = w;
      ww += w;
    }
    for (int x = 0; x < xmax; x++) {
      if (ww != 0.0) k[x] /= ww;
    }
    bounds[o * 2 + 0] = xmin;
    bounds[o * 2 + 1] = xmax < 0 ? 0 : xmax;
  }
  kk.resize(kd.size());
  for (size_t i = 0; i < kd.size(); i++) {
    if (kd[i] < 0)
      kk[i] = (int32_t)(-0.5 + kd[i] * (1 << kPrecisionBits));
    else
      kk[i] = (int32_t)(0.5 + kd[i] * (1 << kPrecisionBits));
  }
  return ksize;
}

void check_output(int out_w, int out_h) {
  if (out_w <= 0 || out_h <= 0)
    throw std::invalid_argument("resample: empty output " + std::to_string(out_w) + "x" +
                                std::to_string(out_h));
}

// How one axis of a box is resampled: Pillow's resize of [in0, in1) to out_total outputs, of
// which [out_offset, out_offset + out_size) are kept; `needed` false when Pillow skips the pass.
struct AxisPlan {
  float in0 = 0, in1 = 0;
  int out_total = 0, out_offset = 0;
  bool needed = true;
};

AxisPlan axis_plan(const Box& box, int axis, int in_size, int out_size) {
  const double b0 = axis ? box.y0 : box.x0, b1 = axis ? box.y1 : box.x1;
  AxisPlan p;
  if (box.mode == BoxMode::ResizeThenCrop) {
    // The whole axis resized to r, the window [off, off + out_size) kept. Always computed (the
    // identity when r == in_size: Pillow's coefficients are then exactly 1 and 0).
    const int r = (int)std::nearbyint(in_size * (double)out_size / (b1 - b0));
    const int off = (int)std::nearbyint(b0 * r / in_size);
    if (r < out_size || off < 0 || off + out_size > r)
      throw std::invalid_argument("resample: ResizeThenCrop window outside the resized image");
    p.in0 = 0.0f;
    p.in1 = (float)in_size;
    p.out_total = r;
    p.out_offset = off;
    return p;
  }
  p.in0 = (float)b0;
  p.in1 = (float)b1;
  p.out_total = out_size;
  // Pillow's ImagingResampleInner: skipped when it would be the identity.
  p.needed = out_size != in_size || p.in0 != 0.0f || p.in1 != (float)out_size;
  return p;
}

int plan_coeffs(const AxisPlan& p, int in_size, int out_size, Interp interp,
                std::vector<double>& kd, std::vector<int>& bounds, std::vector<int32_t>& kk) {
  return precompute_coeffs(in_size, p.in0, p.in1, p.out_total, p.out_offset, out_size, interp,
                           kd, bounds, kk);
}

// Pillow's crop of a CropThenResize box: rounded (Python's round, half to even).
void crop_rect(const Box& box, int W, int H, int* x0, int* y0, int* x1, int* y1) {
  *x0 = (int)std::nearbyint(box.x0);
  *y0 = (int)std::nearbyint(box.y0);
  *x1 = (int)std::nearbyint(box.x1);
  *y1 = (int)std::nearbyint(box.y1);
  if (*x0 < 0 || *y0 < 0 || *x1 > W || *y1 > H || *x1 <= *x0 || *y1 <= *y0)
    throw std::invalid_argument("resample: crop box outside the " + std::to_string(W) + "x" +
                                std::to_string(H) + " image");
}

// The horizontal pass as Pillow computes it: per output pixel, count taps from first.
void horizontal_generic(const uint8_t* src, int src_stride, int sx, int rows, int out_w,
                        int ksize, ResampleScratch& s) {
  for (int r = 0; r < rows; r++) {
    const uint8_t* srow = src + (size_t)r * src_stride;
    uint8_t* trow = s.tmp.data() + (size_t)r * out_w * 3;
    for (int xx = 0; xx < out_w; xx++) {
      const int n = s.bh[xx * 2 + 1];
      const int32_t* k = &s.kh[(size_t)xx * ksize];
      const uint8_t* p = srow + (size_t)(s.bh[xx * 2 + 0] - sx) * 3;
      int32_t s0 = kHalf, s1 = kHalf, s2 = kHalf;
      for (int t = 0; t < n; t++, p += 3) {
        s0 += p[0] * k[t];
        s1 += p[1] * k[t];
        s2 += p[2] * k[t];
      }
      trow[xx * 3 + 0] = clip8(s0);
      trow[xx * 3 + 1] = clip8(s1);
      trow[xx * 3 + 2] = clip8(s2);
    }
  }
}

// Output pixels [0, simd_end) of each row with the three channels in one SSE register: each
// tap loads 4 bytes (the pixel's R, G, B and the next pixel's R, whose lane is dropped) and
// adds weight x pixel in 32-bit lanes: the same integer sums as the scalar loop, then Pillow's
// clip (shift, clamp to 0..255) by saturating packs. simd_end leaves out the pixels whose last
// tap is the part's last column (the 4-byte load would pass the row's end).
template <int K>
void horizontal_k(const uint8_t* src, int src_stride, int rows, int out_w, int simd_end,
                  ResampleScratch& s) {
#if !defined(__SSE4_1__)
  simd_end = 0;
#endif
  for (int r = 0; r < rows; r++) {
    const uint8_t* srow = src + (size_t)r * src_stride;
    uint8_t* trow = s.tmp.data() + (size_t)r * out_w * 3;
    int xx = 0;
#if defined(__SSE4_1__)
    for (; xx < simd_end; xx++) {
      const int32_t* k = &s.kpad[(size_t)xx * K];
      const uint8_t* p = srow + (size_t)s.start[xx] * 3;
      __m128i acc = _mm_set1_epi32(kHalf);
      for (int t = 0; t < K; t++) {
        int32_t px;
        std::memcpy(&px, p + t * 3, 4);
        const __m128i v = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(px));
        acc = _mm_add_epi32(acc, _mm_mullo_epi32(v, _mm_set1_epi32(k[t])));
      }
      __m128i q = _mm_srai_epi32(acc, kPrecisionBits);
      q = _mm_packus_epi16(_mm_packs_epi32(q, q), q);
      const uint32_t o = static_cast<uint32_t>(_mm_cvtsi128_si32(q));
      trow[xx * 3 + 0] = static_cast<uint8_t>(o);
      trow[xx * 3 + 1] = static_cast<uint8_t>(o >> 8);
      trow[xx * 3 + 2] = static_cast<uint8_t>(o >> 16);
    }
#endif
    for (; xx < out_w; xx++) {
      const int32_t* k = &s.kpad[(size_t)xx * K];
      const uint8_t* p = srow + (size_t)s.start[xx] * 3;
      int32_t s0 = kHalf, s1 = kHalf, s2 = kHalf;
      for (int t = 0; t < K; t++) {
        s0 += p[t * 3 + 0] * k[t];
        s1 += p[t * 3 + 1] * k[t];
        s2 += p[t * 3 + 2] * k[t];
      }
      trow[xx * 3 + 0] = clip8(s0);
      trow[xx * 3 + 1] = clip8(s1);
      trow[xx * 3 + 2] = clip8(s2);
    }
  }
}

// The same sums with a fixed tap count: every output reads exactly ksize pixels, its window
// moved left where it would pass the part's right end, the weights shifted to match and the
// extra taps weighted 0 (Pillow's own sums plus zeros: identical results). False when the
// part is narrower than ksize or ksize has no specialisation.
bool horizontal_fixed(const uint8_t* src, int src_stride, int sx, int sw, int rows, int out_w,
                      int ksize, ResampleScratch& s) {
  if (sw < ksize || (ksize != 3 && ksize != 5 && ksize != 7 && ksize != 9)) return false;
  s.start.resize(out_w);
  s.kpad.assign((size_t)out_w * ksize, 0);
  int simd_end = 0;  // windows start in increasing order: those before it end before column sw-1
  for (int xx = 0; xx < out_w; xx++) {
    const int first = s.bh[xx * 2 + 0] - sx, n = s.bh[xx * 2 + 1];
    const int start = std::min(first, sw - ksize);
    s.start[xx] = start;
    if (start + ksize < sw && simd_end == xx) simd_end = xx + 1;
    for (int t = 0; t < n; t++) s.kpad[(size_t)xx * ksize + (first - start) + t] = s.kh[(size_t)xx * ksize + t];
  }
  switch (ksize) {
    case 3: horizontal_k<3>(src, src_stride, rows, out_w, simd_end, s); break;
    case 5: horizontal_k<5>(src, src_stride, rows, out_w, simd_end, s); break;
    case 7: horizontal_k<7>(src, src_stride, rows, out_w, simd_end, s); break;
    default: horizontal_k<9>(src, src_stride, rows, out_w, simd_end, s); break;
  }
  return true;
}


// Which loops resample_part() runs (set_resample_kernels_for_testing()).
std::atomic<int> g_kernels{(int)ResampleKernels::Auto};

bool cpu_has_avx2() {
#if defined(VITGRID_RESAMPLE_AVX2)
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
#else
  return false;
#endif
}

// True: the AVX2 loops.
bool use_avx2() {
  const int k = g_kernels.load(std::memory_order_relaxed);
  if (k == (int)ResampleKernels::Baseline) return false;
  return cpu_has_avx2();
}

}  // namespace

bool set_resample_kernels_for_testing(ResampleKernels k) {
  if (k == ResampleKernels::Avx2 && !cpu_has_avx2()) return false;
  g_kernels.store((int)k, std::memory_order_relaxed);
  return true;
}

void resample_part(const uint8_t* src, int src_stride, int sx, int sy, int sw, int sh, int W,
                   int H, Box box, int out_w, int out_h, Interp interp, bool flip, uint8_t* dst,
                   ResampleScratch& s) {
  check_output(out_w, out_h);
  if (box.mode == BoxMode::CropThenResize)
    throw std::invalid_argument("resample_part: cut the crop out first (see resample())");
  const AxisPlan px = axis_plan(box, 0, W, out_w), py = axis_plan(box, 1, H, out_h);
  const bool need_h = px.needed, need_v = py.needed;
  [[maybe_unused]] const bool avx2 = use_avx2();
  bool flipped = false;  // the AVX2 horizontal pass writes its rows mirrored

  const int ksize_v = plan_coeffs(py, H, out_h, interp, s.kd, s.bv, s.kv);
  const int ybox_first = s.bv[0];
  const int ybox_last = s.bv[(size_t)out_h * 2 - 2] + s.bv[(size_t)out_h * 2 - 1];

  // The input of the vertical pass: rows in_rows, row r at in + (r - in_y0) * in_stride.
  const uint8_t* in = src;
  size_t in_stride = (size_t)src_stride;
  int in_y0 = sy;  // the image row held by in's first row
  int in_w = W;
  if (need_h) {
    const int ksize_h = plan_coeffs(px, W, out_w, interp, s.kd, s.bh, s.kh);
    const int rows = ybox_last - ybox_first;
    if (ybox_first < sy || ybox_last > sy + sh || s.bh[0] < sx ||
        s.bh[(size_t)out_w * 2 - 2] + s.bh[(size_t)out_w * 2 - 1] > sx + sw)
      throw std::invalid_argument("resample_part: the part does not hold the footprint");
    s.tmp.resize((size_t)rows * out_w * 3);
    const uint8_t* src0 = src + (size_t)(ybox_first - sy) * src_stride;
    bool done = false;
#if defined(VITGRID_RESAMPLE_AVX2)
    HorizontalPlan hp;
    if (avx2 && plan_horizontal_avx2(sx, sw, out_w, ksize_h, s, hp)) {
      horizontal_avx2(src0, src_stride, sw, rows, out_w, flip, hp, s, s.tmp.data());
      flipped = flip;
      done = true;
    }
#endif
    if (!done && !horizontal_fixed(src0, src_stride, sx, sw, rows, out_w, ksize_h, s))
      horizontal_generic(src0, src_stride, sx, rows, out_w, ksize_h, s);
    in = s.tmp.data();
    in_stride = (size_t)out_w * 3;
    in_y0 = ybox_first;
    in_w = out_w;
  } else {
    if (sx != 0 || sw != W || ybox_first < sy || ybox_last > sy + sh)
      throw std::invalid_argument("resample_part: the part does not hold the footprint");
  }

  flip = flip && !flipped;  // the mirroring still to do
  if (need_v) {
    const size_t n = (size_t)in_w * 3;
#if defined(VITGRID_RESAMPLE_AVX2)
    if (avx2 && plan_vertical_avx2((int)n, out_h, ksize_v, s)) {
      vertical_avx2(in, in_stride, in_y0, (int)n, out_h, ksize_v, flip, s, dst);
      return;
    }
#endif
    s.acc.resize(n);
    for (int yy = 0; yy < out_h; yy++) {
      const int ymin = s.bv[yy * 2 + 0];
      const int cnt = s.bv[yy * 2 + 1];
      const int32_t* k = &s.kv[(size_t)yy * ksize_v];
      int32_t* acc = s.acc.data();
      for (size_t i = 0; i < n; i++) acc[i] = kHalf;
      // Taps outer, pixels inner: the same integer sums as Pillow's order (exact, no
      // overflow: |sum| <= 255 * sum|k| < 2^31), and a loop the compiler vectorises.
      for (int t = 0; t < cnt; t++) {
        const uint8_t* row = in + (size_t)(ymin + t - in_y0) * in_stride;
        const int32_t kt = k[t];
        for (size_t i = 0; i < n; i++) acc[i] += row[i] * kt;
      }
      uint8_t* drow = dst + (size_t)yy * out_w * 3;
      if (!flip) {
        for (size_t i = 0; i < n; i++) drow[i] = clip8(acc[i]);
      } else {
        for (int x = 0; x < in_w; x++) {
          const int32_t* a = acc + (size_t)(in_w - 1 - x) * 3;
          drow[x * 3 + 0] = clip8(a[0]);
          drow[x * 3 + 1] = clip8(a[1]);
          drow[x * 3 + 2] = clip8(a[2]);
        }
      }
    }
  } else {
    // No vertical pass: the output rows are the input's rows 0..H-1 (the box spans them all).
    for (int yy = 0; yy < out_h; yy++)
      store_row(in + (size_t)(yy - in_y0) * in_stride, out_w, flip,
                dst + (size_t)yy * out_w * 3);
  }
}

void resample(const uint8_t* src, int W, int H, int src_stride, Box box, int out_w, int out_h,
              Interp interp, bool flip, uint8_t* dst, ResampleScratch& scratch) {
  if (box.mode == BoxMode::CropThenResize) {
    int x0, y0, x1, y1;
    crop_rect(box, W, H, &x0, &y0, &x1, &y1);
    const int cw = x1 - x0, ch = y1 - y0;
    const Box whole{0, 0, (double)cw, (double)ch, BoxMode::Pillow};
    resample_part(src + (size_t)y0 * src_stride + (size_t)x0 * 3, src_stride, 0, 0, cw, ch, cw,
                  ch, whole, out_w, out_h, interp, flip, dst, scratch);
    return;
  }
  resample_part(src, src_stride, 0, 0, W, H, W, H, box, out_w, out_h, interp, flip, dst,
                scratch);
}

void resample(const uint8_t* src, int W, int H, int src_stride, Box box, int out_w, int out_h,
              Interp interp, bool flip, uint8_t* dst) {
  ResampleScratch scratch;
  resample(src, W, H, src_stride, box, out_w, out_h, interp, flip, dst, scratch);
}

void resample_footprint(int W, int H, Box box, int out_w, int out_h, Interp interp, int* x0,
                        int* y0, int* x1, int* y1) {
  check_output(out_w, out_h);
  if (box.mode == BoxMode::CropThenResize) {
    crop_rect(box, W, H, x0, y0, x1, y1);
    return;
  }
  std::vector<double> kd;
  std::vector<int> b;
  std::vector<int32_t> kk;
  const AxisPlan py = axis_plan(box, 1, H, out_h), px = axis_plan(box, 0, W, out_w);
  plan_coeffs(py, H, out_h, interp, kd, b, kk);
  *y0 = b[0];
  *y1 = b[(size_t)out_h * 2 - 2] + b[(size_t)out_h * 2 - 1];
  if (!px.needed) {  // the vertical pass reads every column
    *x0 = 0;
    *x1 = W;
    return;
  }
  plan_coeffs(px, W, out_w, interp, kd, b, kk);
  *x0 = b[0];
  *x1 = b[(size_t)out_w * 2 - 2] + b[(size_t)out_w * 2 - 1];
}

void resample_coeffs(int in_size, Box box, int axis, int out_size, Interp interp,
                     AxisCoeffs& out) {
  check_output(out_size, 1);
  if (box.mode == BoxMode::CropThenResize)
    throw std::invalid_argument("resample_coeffs: cut the crop out first");
  const AxisPlan p = axis_plan(box, axis, in_size, out_size);
  std::vector<double> kd;
  std::vector<int> b;
  out.ksize = plan_coeffs(p, in_size, out_size, interp, kd, b, out.weight);
  out.needed = p.needed;
  out.first.resize(out_size);
  out.count.resize(out_size);
  for (int o = 0; o < out_size; o++) {
    out.first[o] = b[o * 2];
    out.count[o] = b[o * 2 + 1];
  }
}

namespace {
// Uniform double in [a, b) from a 64-bit word (53 bits).
inline double uniform(uint64_t w, double a, double b) {
  return a + (double)(w >> 11) * (1.0 / 9007199254740992.0) * (b - a);
}
// Uniform integer in [0, n) (multiply-shift; bias < n / 2^64).
inline int uniform_int(uint64_t w, int n) {
  return (int)(((unsigned __int128)w * (uint64_t)n) >> 64);
}
}  // namespace

Box rrc_box(uint64_t seed, int64_t position, int W, int H, double scale_lo, double scale_hi,
            double ratio_lo, double ratio_hi) {
  const uint64_t stream = rng_stream(seed, kStreamCrop);
  const uint64_t base = (uint64_t)position * 64;
  const double area = (double)H * (double)W;
  const double lr0 = std::log(ratio_lo), lr1 = std::log(ratio_hi);
  for (int a = 0; a < 10; a++) {
    const uint64_t c = base + (uint64_t)a * 4;
    const double target_area = area * uniform(rng_word(stream, c + 0), scale_lo, scale_hi);
    const double aspect = std::exp(uniform(rng_word(stream, c + 1), lr0, lr1));
    // Python's round(): half to even, as nearbyint in the default rounding mode.
    const int w = (int)std::nearbyint(std::sqrt(target_area * aspect));
    const int h = (int)std::nearbyint(std::sqrt(target_area / aspect));
    if (0 < w && w <= W && 0 < h && h <= H) {
      const int top = uniform_int(rng_word(stream, c + 2), H - h + 1);
      const int left = uniform_int(rng_word(stream, c + 3), W - w + 1);
      return Box{(double)left, (double)top, (double)(left + w), (double)(top + h),
                 BoxMode::CropThenResize};
    }
  }
  // Fallback: the centre crop of the largest box within the ratio bounds.
  const double in_ratio = (double)W / (double)H;
  const double rmin = std::min(ratio_lo, ratio_hi), rmax = std::max(ratio_lo, ratio_hi);
  int w = W, h = H;
  if (in_ratio < rmin) {
    w = W;
    h = (int)std::nearbyint(w / rmin);
  } else if (in_ratio > rmax) {
    h = H;
    w = (int)std::nearbyint(h * rmax);
  }
  const int top = (H - h) / 2, left = (W - w) / 2;
  return Box{(double)left, (double)top, (double)(left + w), (double)(top + h),
             BoxMode::CropThenResize};
}

void resized_size(int W, int H, int size, int* out_w, int* out_h) {
  const int short_side = std::min(W, H), long_side = std::max(W, H);
  // torchvision's _compute_resized_output_size: int(size * long / short) (true division).
  const int new_long = (int)((double)((int64_t)size * long_side) / (double)short_side);
  *out_w = W <= H ? size : new_long;
  *out_h = W <= H ? new_long : size;
}

Box eval_box(int W, int H, int S, double crop_pct) {
  int new_w = 0, new_h = 0;
  resized_size(W, H, (int)std::floor(S / crop_pct), &new_w, &new_h);
  if (new_w < S || new_h < S)
    throw std::invalid_argument("eval_box: crop_pct > 1 would pad the " + std::to_string(S) +
                                " crop");
  // torchvision's CenterCrop: int(round((len - S) / 2.0)), Python's round (half to even).
  const int top = (int)std::nearbyint((new_h - S) / 2.0);
  const int left = (int)std::nearbyint((new_w - S) / 2.0);
  // (Resize returns the image unchanged when the size already matches: resample()'s
  // coefficients are then the identity.)
  const double sx = (double)W / new_w, sy = (double)H / new_h;
  return Box{left * sx, top * sy, (left + S) * sx, (top + S) * sy, BoxMode::ResizeThenCrop};
}

}  // namespace vitgrid
