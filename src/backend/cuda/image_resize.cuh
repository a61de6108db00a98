// Pillow's antialiased resampling coefficients (libImaging/Resample.c: precompute_coeffs and
// normalize_coeffs_8bpc), shared by the device's crop/resize kernels (image_resize.cu) and the
// host, which only sizes buffers from them. Computed in double exactly as Pillow does, then
// turned into Pillow's 22-bit fixed-point weights, so that the GPU's resize of the same decoded
// pixels equals data/image_transform.h resample() bit for bit. On the device every double
// operation is an explicit round-to-nearest intrinsic: nvcc would otherwise contract a * b + c
// into one FMA, and a tap bound or weight one ulp off changes pixels.
// Internal to src/backend/cuda.
#pragma once
#include <cmath>
#include <cstdint>

namespace vitgrid {
namespace cuda {

constexpr int kResamplePrecisionBits = 22;  // Pillow's PRECISION_BITS (32 - 8 - 2)

#ifdef __CUDACC__
#define VG_HD __host__ __device__ __forceinline__
#else
#define VG_HD inline
#endif

#ifdef __CUDA_ARCH__
#define VG_DADD(a, b) __dadd_rn((a), (b))
#define VG_DSUB(a, b) __dsub_rn((a), (b))
#define VG_DMUL(a, b) __dmul_rn((a), (b))
#else
#define VG_DADD(a, b) ((a) + (b))
#define VG_DSUB(a, b) ((a) - (b))
#define VG_DMUL(a, b) ((a) * (b))
#endif

// interp: 0 bilinear (triangle, support 1), 1 bicubic (a = -0.5, support 2); data/image_transform.h
// Interp.
VG_HD double resample_filter(int interp, double x) {
  if (x < 0.0) x = -x;
  if (interp == 0) return x < 1.0 ? VG_DSUB(1.0, x) : 0.0;
  // ((a + 2) x - (a + 3)) x x + 1 and (((x - 5) x + 8) x - 4) a, a = -0.5, left to right
  if (x < 1.0) return VG_DADD(VG_DMUL(VG_DMUL(VG_DSUB(VG_DMUL(1.5, x), 2.5), x), x), 1.0);
  if (x < 2.0) {
    return VG_DMUL(VG_DSUB(VG_DMUL(VG_DADD(VG_DMUL(VG_DSUB(x, 5.0), x), 8.0), x), 4.0), -0.5);
  }
  return 0.0;
}

// One axis of a resize: source extent [in0, in1) (Pillow takes the box as float) of an axis
// of in_size pixels mapped onto out_total outputs, of which outputs [offset, offset + S) are
// computed (offset 0, out_total S but for data/image_transform.h BoxMode::ResizeThenCrop: the
// window of the whole axis resized to out_total).
struct ResampleAxis {
  double scale = 1, support = 1, inv_filterscale = 1;
  float in0 = 0;
  int in_size = 0;
  int offset = 0;
  int ksize = 0;  // Pillow's bound on the taps of one output: ceil(support) * 2 + 1
};

VG_HD ResampleAxis resample_axis(int interp, int in_size, float in0, float in1, int out_total,
                                 int offset = 0) {
  ResampleAxis a;
  a.in0 = in0;
  a.in_size = in_size;
  a.offset = offset;
  a.scale = static_cast<double>(in1 - in0) / out_total;  // float difference, as Pillow
  const double filterscale = a.scale < 1.0 ? 1.0 : a.scale;
  a.support = VG_DMUL(interp == 0 ? 1.0 : 2.0, filterscale);
  a.inv_filterscale = 1.0 / filterscale;
  a.ksize = static_cast<int>(ceil(a.support)) * 2 + 1;
  return a;
}

// Output `xx`'s center and first/last+1 source taps (Pillow rounds with (int)(v + 0.5)).
VG_HD double resample_center(const ResampleAxis& a, int xx) {
  return VG_DADD(static_cast<double>(a.in0),
                 VG_DMUL(VG_DADD(static_cast<double>(xx + a.offset), 0.5), a.scale));
}
VG_HD int resample_first(const ResampleAxis& a, int xx) {
  const int xmin = static_cast<int>(VG_DADD(VG_DSUB(resample_center(a, xx), a.support), 0.5));
  return xmin < 0 ? 0 : xmin;
}
VG_HD int resample_end(const ResampleAxis& a, int xx) {
  const int xmax = static_cast<int>(VG_DADD(VG_DADD(resample_center(a, xx), a.support), 0.5));
  return xmax > a.in_size ? a.in_size : xmax;
}

// The fixed-point taps of output xx: k[t * kstride] for t < return value (at most kcap are
// written), first source index in *first. Weights are normalised to sum 1 in double, then
// rounded half away from zero to 22 bits, as normalize_coeffs_8bpc.
VG_HD int resample_taps(int interp, const ResampleAxis& a, int xx, int* first, int32_t* k,
                        int kstride, int kcap) {
  const double center = resample_center(a, xx);
  const int xmin = resample_first(a, xx);
  int n = resample_end(a, xx) - xmin;
  if (n > kcap) n = kcap;  // cannot happen (n <= ksize <= kcap); keeps writes in bounds
  double ww = 0.0;
  for (int t = 0; t < n; ++t) {
    ww = VG_DADD(ww, resample_filter(
                         interp, VG_DMUL(VG_DADD(VG_DSUB(static_cast<double>(t + xmin), center), 0.5),
                                         a.inv_filterscale)));
  }
  for (int t = 0; t < n; ++t) {
    double w = resample_filter(
        interp, VG_DMUL(VG_DADD(VG_DSUB(static_cast<double>(t + xmin), center), 0.5),
                        a.inv_filterscale));
    if (ww != 0.0) w = w / ww;
    const double f = VG_DMUL(w, static_cast<double>(1 << kResamplePrecisionBits));
    k[t * kstride] = static_cast<int32_t>(w < 0 ? VG_DADD(f, -0.5) : VG_DADD(f, 0.5));
  }
  *first = xmin;
  return n;
}

// Pillow's clip8: round-half-up already folded into the accumulator's start value.
VG_HD uint8_t resample_clip8(int32_t acc) {
  const int32_t v = acc >> kResamplePrecisionBits;
  return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}
constexpr int32_t kResampleHalf = 1 << (kResamplePrecisionBits - 1);

#undef VG_HD

}  // namespace cuda
}  // namespace vitgrid
