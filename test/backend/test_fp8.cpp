// FP8 emulation (backend/fp8.h) against the OCP definitions, computed here independently: the
// value of each of the 256 codes of both formats from its sign, exponent and mantissa fields;
// every midpoint between neighbours rounding to the even code and its fp32 neighbours to the
// nearest; and the conversion against a nearest-value search over the decoded codes on random
// fp32 inputs of every binade, in both saturation modes. Plus the special cases by hand and
// the scaled cast's codes and amax.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "vitgrid/backend/fp8.h"

namespace {

using vitgrid::fp8_decode;
using vitgrid::fp8_encode;
using vitgrid::Fp8Format;

const float kInf = std::numeric_limits<float>::infinity();
const float kNan = std::numeric_limits<float>::quiet_NaN();
const Fp8Format kFormats[] = {Fp8Format::E4M3, Fp8Format::E5M2};

// The OCP field layout of a format, written out here rather than taken from the header.
struct Fields {
  int exponent_bits, mantissa_bits, bias;
};
Fields fields(Fp8Format f) { return f == Fp8Format::E4M3 ? Fields{4, 3, 7} : Fields{5, 2, 15}; }

bool is_nan_code(uint8_t c, Fp8Format f) {
  return f == Fp8Format::E4M3 ? (c & 0x7F) == 0x7F : (c & 0x7F) > 0x7C;
}
bool is_inf_code(uint8_t c, Fp8Format f) { return f == Fp8Format::E5M2 && (c & 0x7F) == 0x7C; }

// (-1)^s * 2^(1 - bias) * m / 2^M for exponent field 0, (-1)^s * 2^(e - bias) * (1 + m / 2^M)
// otherwise, in double.
double reference_value(uint8_t c, Fp8Format f) {
  const Fields F = fields(f);
  const int s = c >> 7;
  const int e = (c >> F.mantissa_bits) & ((1 << F.exponent_bits) - 1);
  const int m = c & ((1 << F.mantissa_bits) - 1);
  const double frac = m / std::pow(2.0, F.mantissa_bits);
  const double mag =
      e == 0 ? std::pow(2.0, 1 - F.bias) * frac : std::pow(2.0, e - F.bias) * (1 + frac);
  return s ? -mag : mag;
}

// Codes 0 .. max (non-negative finite values, increasing with the code).
std::vector<uint8_t> finite_positive_codes(Fp8Format f) {
  std::vector<uint8_t> codes;
  for (int c = 0; c < 0x80; ++c) {
    if (!is_nan_code(static_cast<uint8_t>(c), f) && !is_inf_code(static_cast<uint8_t>(c), f)) {
      codes.push_back(static_cast<uint8_t>(c));
    }
  }
  return codes;
}

// Rounding by search: the nearest of the finite non-negative values, a tie to the even code.
// Overflow is what IEEE 754 calls it: rounding (ties to even) onto the value one step above
// the max, which the code after max's would carry with more range (E4M3: 480, E5M2: 2^16).
// Saturating, overflow and +-inf give max; otherwise E4M3's NaN (it has no inf) or E5M2's inf.
class NearestValueEncoder {
 public:
  explicit NearestValueEncoder(Fp8Format f)
      : f_(f), codes_(finite_positive_codes(f)), beyond_(f == Fp8Format::E4M3 ? 480.0 : 65536.0) {
    for (uint8_t c : codes_) values_.push_back(reference_value(c, f));
  }

  uint8_t operator()(float x, bool saturate) const {
    if (std::isnan(x)) return 0x7F;
    const int sign = std::signbit(x) ? 0x80 : 0x00;
    const double a = std::fabs(static_cast<double>(x));
    const int max_code = codes_.back();
    bool overflow = std::isinf(a);
    int best = 0;
    if (!overflow) {
      double best_err = std::numeric_limits<double>::infinity();
      for (size_t k = 0; k < codes_.size(); ++k) {
        const double err = std::fabs(values_[k] - a);
        if (err < best_err || (err == best_err && codes_[k] % 2 == 0)) {
          best = codes_[k];
          best_err = err;
        }
      }
      const double beyond_err = beyond_ - a;
      overflow = beyond_err < best_err || (beyond_err == best_err && (max_code + 1) % 2 == 0);
    }
    if (overflow) {
      if (saturate) return static_cast<uint8_t>(sign | max_code);
      return static_cast<uint8_t>(sign | (f_ == Fp8Format::E4M3 ? 0x7F : 0x7C));
    }
    return static_cast<uint8_t>(sign | best);
  }

 private:
  Fp8Format f_;
  std::vector<uint8_t> codes_;
  std::vector<double> values_;
  double beyond_;
};

TEST(Fp8, KnownCodes) {
  // A few values by hand, so that the field formula above cannot share a wrong bias.
  EXPECT_EQ(fp8_decode(0x38, Fp8Format::E4M3), 1.0f);
  EXPECT_EQ(fp8_decode(0x7E, Fp8Format::E4M3), 448.0f);
  EXPECT_EQ(fp8_decode(0x08, Fp8Format::E4M3), 1.0f / 64);   // smallest normal
  EXPECT_EQ(fp8_decode(0x01, Fp8Format::E4M3), 1.0f / 512);  // smallest subnormal
  EXPECT_EQ(fp8_decode(0x07, Fp8Format::E4M3), 7.0f / 512);  // largest subnormal
  EXPECT_EQ(fp8_decode(0xC4, Fp8Format::E4M3), -3.0f);
  EXPECT_EQ(fp8_decode(0x3C, Fp8Format::E5M2), 1.0f);
  EXPECT_EQ(fp8_decode(0x7B, Fp8Format::E5M2), 57344.0f);
  EXPECT_EQ(fp8_decode(0x04, Fp8Format::E5M2), 1.0f / 16384);  // smallest normal
  EXPECT_EQ(fp8_decode(0x01, Fp8Format::E5M2), 1.0f / 65536);  // smallest subnormal
  EXPECT_EQ(fp8_decode(0xC2, Fp8Format::E5M2), -3.0f);
  EXPECT_EQ(fp8_decode(0x7C, Fp8Format::E5M2), kInf);
  EXPECT_EQ(fp8_decode(0xFC, Fp8Format::E5M2), -kInf);
  for (int c : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) {
    EXPECT_TRUE(std::isnan(fp8_decode(static_cast<uint8_t>(c), Fp8Format::E5M2))) << c;
  }
  EXPECT_TRUE(std::isnan(fp8_decode(0x7F, Fp8Format::E4M3)));
  EXPECT_TRUE(std::isnan(fp8_decode(0xFF, Fp8Format::E4M3)));
  EXPECT_EQ(vitgrid::fp8_max(Fp8Format::E4M3), 448.0f);
  EXPECT_EQ(vitgrid::fp8_max(Fp8Format::E5M2), 57344.0f);
  EXPECT_STREQ(vitgrid::fp8_format_name(Fp8Format::E4M3), "e4m3");
  EXPECT_STREQ(vitgrid::fp8_format_name(Fp8Format::E5M2), "e5m2");
}

TEST(Fp8, AllCodesDecode) {
  for (Fp8Format f : kFormats) {
    int nans = 0, infs = 0;
    for (int i = 0; i < 256; ++i) {
      const uint8_t c = static_cast<uint8_t>(i);
      const float v = fp8_decode(c, f);
      if (is_nan_code(c, f)) {
        EXPECT_TRUE(std::isnan(v)) << vitgrid::fp8_format_name(f) << " code " << i;
        ++nans;
      } else if (is_inf_code(c, f)) {
        EXPECT_EQ(v, (c & 0x80) ? -kInf : kInf) << i;
        ++infs;
      } else {
        EXPECT_EQ(static_cast<double>(v), reference_value(c, f))
            << vitgrid::fp8_format_name(f) << " code " << i;
        EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << i;  // -0 included
      }
    }
    EXPECT_EQ(nans, f == Fp8Format::E4M3 ? 2 : 6);
    EXPECT_EQ(infs, f == Fp8Format::E4M3 ? 0 : 2);
    EXPECT_EQ(vitgrid::fp8_max(f), fp8_decode(finite_positive_codes(f).back(), f));
  }
}

TEST(Fp8, EveryCodeRoundTrips) {
  for (Fp8Format f : kFormats) {
    for (int i = 0; i < 256; ++i) {
      const uint8_t c = static_cast<uint8_t>(i);
      if (is_nan_code(c, f)) continue;
      const float v = fp8_decode(c, f);
      EXPECT_EQ(fp8_encode(v, f, false), c) << vitgrid::fp8_format_name(f) << " code " << i;
      // Saturation sends E5M2's infinities to +-max; everything else is its own code.
      const uint8_t saturated = is_inf_code(c, f) ? static_cast<uint8_t>((c & 0x80) | 0x7B) : c;
      EXPECT_EQ(fp8_encode(v, f, true), saturated) << vitgrid::fp8_format_name(f) << " code " << i;
    }
  }
}

TEST(Fp8, MidpointsRoundToEven) {
  for (Fp8Format f : kFormats) {
    const std::vector<uint8_t> codes = finite_positive_codes(f);
    for (size_t k = 0; k + 1 < codes.size(); ++k) {
      const uint8_t lo = codes[k], hi = codes[k + 1];
      const float a = fp8_decode(lo, f), b = fp8_decode(hi, f);
      const float mid = (a + b) / 2;  // exact: one more bit than the FP8 values hold
      ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(a) + b) / 2);
      const uint8_t even = lo % 2 == 0 ? lo : hi;
      for (bool sat : {true, false}) {
        EXPECT_EQ(fp8_encode(mid, f, sat), even) << vitgrid::fp8_format_name(f) << " " << mid;
        EXPECT_EQ(fp8_encode(-mid, f, sat), 0x80 | even) << vitgrid::fp8_format_name(f);
        EXPECT_EQ(fp8_encode(std::nextafter(mid, kInf), f, sat), hi) << mid;
        EXPECT_EQ(fp8_encode(std::nextafter(mid, 0.0f), f, sat), lo) << mid;
        EXPECT_EQ(fp8_encode(-std::nextafter(mid, kInf), f, sat), 0x80 | hi) << mid;
      }
    }
  }
}

TEST(Fp8, OverflowSaturationAndSpecials) {
  const Fp8Format e4 = Fp8Format::E4M3, e5 = Fp8Format::E5M2;
  // E4M3: 464 is the tie between 448 (even code 0x7E) and the NaN code: it stays 448; above it
  // overflows (CUDA's threshold).
  EXPECT_EQ(fp8_encode(464.0f, e4, false), 0x7E);
  EXPECT_EQ(fp8_encode(std::nextafter(464.0f, kInf), e4, false), 0x7F);
  EXPECT_EQ(fp8_encode(std::nextafter(464.0f, kInf), e4, true), 0x7E);
  EXPECT_EQ(fp8_encode(-1e6f, e4, false), 0xFF);
  EXPECT_EQ(fp8_encode(-1e6f, e4, true), 0xFE);
  EXPECT_EQ(fp8_encode(kInf, e4, true), 0x7E);
  EXPECT_EQ(fp8_encode(-kInf, e4, true), 0xFE);
  EXPECT_TRUE(std::isnan(fp8_decode(fp8_encode(kInf, e4, false), e4)));
  // E5M2: 61440 is the tie between 57344 (odd code 0x7B) and 2^16 (inf's code): it overflows.
  EXPECT_EQ(fp8_encode(std::nextafter(61440.0f, 0.0f), e5, false), 0x7B);
  EXPECT_EQ(fp8_encode(61440.0f, e5, false), 0x7C);
  EXPECT_EQ(fp8_encode(61440.0f, e5, true), 0x7B);
  EXPECT_EQ(fp8_encode(-61440.0f, e5, false), 0xFC);
  EXPECT_EQ(fp8_encode(kInf, e5, false), 0x7C);
  EXPECT_EQ(fp8_encode(-kInf, e5, false), 0xFC);
  EXPECT_EQ(fp8_encode(kInf, e5, true), 0x7B);
  EXPECT_EQ(fp8_encode(-kInf, e5, true), 0xFB);
  EXPECT_EQ(fp8_encode(std::numeric_limits<float>::max(), e5, true), 0x7B);
  for (Fp8Format f : kFormats) {
    for (bool sat : {true, false}) {
      // NaN of either sign is CUDA's canonical NaN code.
      EXPECT_EQ(fp8_encode(kNan, f, sat), 0x7F);
      EXPECT_EQ(fp8_encode(-kNan, f, sat), 0x7F);
      EXPECT_EQ(fp8_encode(0.0f, f, sat), 0x00);
      EXPECT_EQ(fp8_encode(-0.0f, f, sat), 0x80);
      // Underflow keeps the sign; fp32 subnormals flush to (signed) zero.
      EXPECT_EQ(fp8_encode(-1e-30f, f, sat), 0x80);
      EXPECT_EQ(fp8_encode(std::numeric_limits<float>::denorm_min(), f, sat), 0x00);
      EXPECT_TRUE(std::signbit(vitgrid::round_fp8(-1e-30f, f, sat)));
    }
  }
  // Subnormal rounding: half the smallest subnormal is a tie to 0, above it 1 quantum,
  // 1.5 quanta a tie to 2.
  EXPECT_EQ(fp8_encode(1.0f / 1024, e4), 0x00);
  EXPECT_EQ(fp8_encode(std::nextafter(1.0f / 1024, 1.0f), e4), 0x01);
  EXPECT_EQ(fp8_encode(1.5f / 512, e4), 0x02);
  EXPECT_EQ(fp8_encode(1.0f / 131072, e5), 0x00);
  EXPECT_EQ(fp8_encode(3.0f / 131072, e5), 0x02);
  // Largest subnormal + half a quantum carries into the smallest normal.
  EXPECT_EQ(fp8_encode(7.5f / 512, e4), 0x08);
  EXPECT_EQ(fp8_encode(3.5f / 65536, e5), 0x04);
  EXPECT_EQ(vitgrid::round_fp8(0.3952f, e4), 0.40625f);
  EXPECT_EQ(vitgrid::round_fp8(0.3952f, e5), 0.375f);
}

// Random fp32 patterns: mostly with exponents 2^-24 .. 2^18 (both formats' subnormal,
// normal and overflow ranges, and below), a tenth of them any bit pattern (fp32 subnormals,
// huge values, inf, NaN).
TEST(Fp8, EncodeMatchesNearestValueSearch) {
  std::mt19937 rng(38);
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_int_distribution<uint32_t> exponent(127 - 24, 127 + 18);
  const int kInputs = 300000;
  const NearestValueEncoder nearest[] = {NearestValueEncoder(Fp8Format::E4M3),
                                         NearestValueEncoder(Fp8Format::E5M2)};
  int checked = 0;
  for (int n = 0; n < kInputs; ++n) {
    uint32_t u = bits(rng);
    if (n % 10 != 0) u = (u & 0x807FFFFFu) | (exponent(rng) << 23);
    const float x = vitgrid::f32_from_bits(u);
    for (int fi = 0; fi < 2; ++fi) {
      const Fp8Format f = kFormats[fi];
      for (bool sat : {true, false}) {
        const uint8_t got = fp8_encode(x, f, sat);
        const uint8_t want = nearest[fi](x, sat);
        if (got != want) {
          ADD_FAILURE() << vitgrid::fp8_format_name(f) << (sat ? " saturating" : "") << " x = " << x
                        << " (0x" << std::hex << u << "): got 0x" << int(got) << ", nearest 0x"
                        << int(want);
          return;
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, kInputs * 4);
}

TEST(Fp8, QuantizeCodesAndAmax) {
  const std::vector<float> x = {0.5f, -3.0f, 1e-4f, -0.0f, 200.0f, -250.0f, 7.0f};
  const float scale = 2.0f;
  for (Fp8Format f : kFormats) {
    std::vector<uint8_t> codes(x.size());
    EXPECT_EQ(vitgrid::fp8_quantize(x.data(), x.size(), scale, f, codes.data()), 250.0f);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(codes[i], fp8_encode(x[i] * scale, f)) << i;
  }
  // -250 * 2 saturates in E4M3.
  std::vector<uint8_t> codes(x.size());
  vitgrid::fp8_quantize(x.data(), x.size(), scale, Fp8Format::E4M3, codes.data());
  EXPECT_EQ(codes[5], 0xFE);
  // A NaN makes the amax NaN wherever it is and stays NaN; an inf makes the amax inf and
  // saturates.
  const std::vector<float> y = {1.0f, kNan, -2.0f};
  EXPECT_TRUE(std::isnan(vitgrid::fp8_quantize(y.data(), y.size(), 1.0f, Fp8Format::E5M2, codes.data())));
  EXPECT_EQ(codes[1], 0x7F);
  EXPECT_EQ(codes[2], vitgrid::fp8_encode(-2.0f, Fp8Format::E5M2));
  const std::vector<float> z = {1.0f, -kInf, 3.0f};
  EXPECT_EQ(vitgrid::fp8_quantize(z.data(), z.size(), 1.0f, Fp8Format::E4M3, codes.data()), kInf);
  EXPECT_EQ(codes[1], 0xFE);
  const std::vector<float> w = {kNan, 5.0f};
  EXPECT_TRUE(std::isnan(vitgrid::fp8_quantize(w.data(), w.size(), 1.0f, Fp8Format::E4M3, codes.data())));
  EXPECT_EQ(vitgrid::fp8_quantize(nullptr, 0, 1.0f, Fp8Format::E4M3, nullptr), 0.0f);
}

}  // namespace
