// CPU decoding and the geometric transforms against Pillow 9.4 and torchvision 0.14 themselves:
// test/data/image_reference.py (run once with /usr/bin/python3, or $VG_PYTHON3) writes images of
// every kind and the references; the checks are exact unless a bound is stated.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "vitgrid/core/rng.h"
#include "vitgrid/data/image_decode.h"
#include "vitgrid/data/image_transform.h"

namespace vitgrid {
namespace {

using Bytes = std::vector<uint8_t>;

Bytes read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

struct ImageCase {
  std::string file;
  Bytes bytes;
  int w = 0, h = 0, comps = 0, prog = 0, sub_h = 0, sub_v = 0;
  Bytes ref;  // Pillow's convert("RGB")
};

struct References {
  std::string dir;
  std::map<std::string, ImageCase> images;
  std::vector<std::vector<std::string>> lines;  // the manifest, tokenised
  std::string error;
};

std::string source_dir() {
  if (const char* s = std::getenv("VITGRID_SOURCE_DIR")) return std::string(s) + "/test/data";
  std::string f = __FILE__;
  const size_t slash = f.rfind('/');
  return slash == std::string::npos ? "." : f.substr(0, slash);
}

// Removes the reference directory at exit (kept with VG_KEEP_TMP=1, for a look at a failure).
struct TmpDirRemover {
  std::string dir;
  ~TmpDirRemover() {
    const char* keep = std::getenv("VG_KEEP_TMP");
    if (!dir.empty() && !(keep && *keep == '1')) {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  }
};

// Runs the reference script once for the whole binary.
const References& refs() {
  static References r = [] {
    References r;
    char tmpl[] = "/tmp/vg_image_decode_XXXXXX";
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base ? base : "/tmp") + "/vg_image_decode_XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back(0);
    char* d = mkdtemp(buf.data());
    if (!d) d = mkdtemp(tmpl);
    if (!d) {
      r.error = "mkdtemp failed";
      return r;
    }
    r.dir = d;
    const char* py = std::getenv("VG_PYTHON3");
    const std::string python = py && *py ? py : "/usr/bin/python3";
    const std::string cmd =
        python + " " + source_dir() + "/image_reference.py " + r.dir + " > " + r.dir + "/log 2>&1";
    if (std::system(cmd.c_str()) != 0) {
      std::ifstream log(r.dir + "/log");
      std::stringstream ss;
      ss << log.rdbuf();
      r.error = "reference script failed: " + cmd + "\n" + ss.str();
      return r;
    }
    std::ifstream m(r.dir + "/manifest.txt");
    std::string line;
    while (std::getline(m, line)) {
      std::istringstream is(line);
      std::vector<std::string> tok;
      std::string t;
      while (is >> t) tok.push_back(t);
      if (tok.empty()) continue;
      if (tok[0] == "image") {
        ImageCase c;
        c.file = tok[2];
        c.bytes = read_file(c.file);
        c.w = std::stoi(tok[3]);
        c.h = std::stoi(tok[4]);
        c.comps = std::stoi(tok[5]);
        c.prog = std::stoi(tok[6]);
        c.sub_h = std::stoi(tok[7]);
        c.sub_v = std::stoi(tok[8]);
        r.images[tok[1]] = c;
      } else if (tok[0] == "decode") {
        r.images[tok[1]].ref = read_file(tok[2]);
      }
      r.lines.push_back(tok);
    }
    return r;
  }();
  static TmpDirRemover remover{r.dir};
  return r;
}

#define REQUIRE_REFS()                                  \
  const References& R = refs();                         \
  if (!R.error.empty()) FAIL() << R.error;              \
  ASSERT_FALSE(R.images.empty()) << "empty manifest"

int count_diff(const Bytes& a, const uint8_t* b, size_t n, int* max_diff = nullptr) {
  int c = 0, m = 0;
  for (size_t i = 0; i < n; i++) {
    const int d = std::abs((int)a[i] - (int)b[i]);
    c += d != 0;
    m = std::max(m, d);
  }
  if (max_diff) *max_diff = m;
  return c;
}

double mad(const Bytes& a, const Bytes& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); i++) s += std::abs((int)a[i] - (int)b[i]);
  return s / (double)a.size();
}

Interp interp_of(const std::string& s) { return s == "1" ? Interp::Bicubic : Interp::Bilinear; }

// --- 1. decoding ----------------------------------------------------------------------------

TEST(ImageDecode, PeekReadsHeaders) {
  REQUIRE_REFS();
  for (const auto& [name, c] : R.images) {
    const ImageInfo info = peek_image(c.bytes.data(), c.bytes.size());
    EXPECT_EQ(info.width, c.w) << name;
    EXPECT_EQ(info.height, c.h) << name;
    EXPECT_EQ(info.components, c.comps) << name;
    EXPECT_EQ((int)info.progressive, c.prog) << name;
    EXPECT_EQ(info.sub_h, c.sub_h) << name;
    EXPECT_EQ(info.sub_v, c.sub_v) << name;
    EXPECT_EQ(info.cmyk, c.comps == 4 && info.format == ImageFormat::Jpeg) << name;
    EXPECT_EQ(info.format, name.rfind("png", 0) == 0 ? ImageFormat::Png : ImageFormat::Jpeg);
  }
}

// Every kind equals Pillow's Image.open(p).convert("RGB") exactly.
TEST(ImageDecode, EqualsPillowExactly) {
  REQUIRE_REFS();
  for (const auto& [name, c] : R.images) {
    DecodedImage im;
    decode_image(c.bytes.data(), c.bytes.size(), im);
    ASSERT_EQ(im.width, c.w) << name;
    ASSERT_EQ(im.height, c.h) << name;
    ASSERT_EQ(im.rgb.size(), c.ref.size()) << name;
    int maxd = 0;
    EXPECT_EQ(count_diff(c.ref, im.rgb.data(), c.ref.size(), &maxd), 0)
        << name << ": pixels differ from Pillow, max " << maxd;
  }
}

// A region decode (crop + skipped scanlines) holds the same pixels as the full decode; so does a
// region of a 1/d-scaled decode.
TEST(ImageDecode, RegionEqualsFullDecode) {
  REQUIRE_REFS();
  uint64_t k = 0;
  for (const auto& [name, c] : R.images) {
    if (name.rfind("png", 0) == 0) continue;
    for (int d : {1, 2, 4, 8}) {
      DecodedImage full;
      decode_image(c.bytes.data(), c.bytes.size(), full, d);
      for (int t = 0; t < 12; t++, k++) {
        const uint64_t w = rng_u64(99, 1, k);
        DecodeRegion reg;
        reg.x0 = (int)(w % (uint64_t)(c.w - 1));
        reg.y0 = (int)((w >> 16) % (uint64_t)(c.h - 1));
        reg.x1 = reg.x0 + 1 + (int)((w >> 32) % (uint64_t)(c.w - reg.x0));
        reg.y1 = reg.y0 + 1 + (int)((w >> 48) % (uint64_t)(c.h - reg.y0));
        if (t == 0) reg = DecodeRegion{0, c.h / 2, c.w, c.h};  // bottom half, full width
        DecodedImage part;
        decode_image(c.bytes.data(), c.bytes.size(), part, d, &reg);
        ASSERT_EQ(part.scale_denom, d);
        ASSERT_LE(part.x_offset * d, reg.x0);
        ASSERT_LE(part.y_offset * d, reg.y0);
        ASSERT_GE((part.x_offset + part.width) * d, std::min(reg.x1, full.width * d));
        ASSERT_GE((part.y_offset + part.height) * d, std::min(reg.y1, full.height * d));
        int bad = 0;
        for (int y = 0; y < part.height; y++)
          for (int x = 0; x < part.width * 3; x++)
            bad += part.rgb[(size_t)y * part.width * 3 + x] !=
                   full.rgb[(size_t)(y + part.y_offset) * full.width * 3 + part.x_offset * 3 + x];
        EXPECT_EQ(bad, 0) << name << " d=" << d << " region " << reg.x0 << "," << reg.y0 << ","
                          << reg.x1 << "," << reg.y1;
      }
    }
  }
}

TEST(ImageDecode, RefusesTruncatedAndGarbage) {
  REQUIRE_REFS();
  int n = 0;
  DecodeScratch scratch;
  std::vector<uint8_t> out(64 * 64 * 3);
  for (const auto& tok : R.lines) {
    if (tok[0] != "bad") continue;
    ++n;
    const Bytes b = read_file(tok[1]);
    DecodedImage im;
    EXPECT_THROW(decode_image(b.data(), b.size(), im), DecodeError) << tok[1];
    // The crop path refuses it too, even for a box in the image's intact top rows.
    try {
      const ImageInfo info = peek_image(b.data(), b.size());
      const Box top{0, 0, (double)std::min(info.width, 32), (double)std::min(info.height, 16),
                    BoxMode::CropThenResize};
      EXPECT_THROW(decode_crop_resize(b.data(), b.size(), info, top, 64, Interp::Bilinear, false,
                                      false, out.data(), scratch),
                   DecodeError)
          << tok[1];
    } catch (const DecodeError&) {
      // peek refused it: fine
    }
  }
  EXPECT_GE(n, 6);
  EXPECT_THROW(peek_image(nullptr, 0), DecodeError);
}

// --- 2. resampling --------------------------------------------------------------------------

// Restores the default choice of resampling loops when a test that forced one ends.
struct KernelsRestorer {
  ~KernelsRestorer() { set_resample_kernels_for_testing(ResampleKernels::Auto); }
};

const char* kernels_name(ResampleKernels k) {
  return k == ResampleKernels::Avx2 ? "avx2" : k == ResampleKernels::Baseline ? "baseline" : "auto";
}

// resample() == Pillow's resize((w, h), BILINEAR|BICUBIC, box=...) (+ mirror), exactly; with
// each implementation of the loops this CPU can run.
TEST(ImageTransform, ResampleEqualsPillowExactly) {
  REQUIRE_REFS();
  KernelsRestorer restore;
  for (ResampleKernels k : {ResampleKernels::Baseline, ResampleKernels::Avx2}) {
    if (!set_resample_kernels_for_testing(k)) {
      std::printf("[resample] no %s loops on this CPU\n", kernels_name(k));
      continue;
    }
    int n = 0;
    ResampleScratch scratch;
    for (const auto& t : R.lines) {
      if (t[0] != "resize") continue;
      const ImageCase& c = R.images.at(t[1]);
      const int ow = std::stoi(t[3]), oh = std::stoi(t[4]);
      const Box box{std::stod(t[5]), std::stod(t[6]), std::stod(t[7]), std::stod(t[8]),
                    BoxMode::Pillow};
      const Bytes ref = read_file(t[10]);
      Bytes out((size_t)ow * oh * 3);
      resample(c.ref.data(), c.w, c.h, c.w * 3, box, ow, oh, interp_of(t[2]), t[9] == "1",
               out.data(), scratch);
      int maxd = 0;
      EXPECT_EQ(count_diff(ref, out.data(), out.size(), &maxd), 0)
          << kernels_name(k) << " loops: " << t[1] << " interp " << t[2] << " " << ow << "x"
          << oh << " box " << t[5] << " " << t[6] << " " << t[7] << " " << t[8] << " flip "
          << t[9] << ": max diff " << maxd;
      ++n;
    }
    EXPECT_GE(n, 40);
  }
}

// The AVX2 loops and the baseline (SSE4.1 / scalar) loops give the same bytes, so the fallback
// stays tested on a CPU with AVX2: random sources (noise, black/white, smooth: clamping, the
// bicubic overshoot), sizes from 1 pixel, row padding, up- and downscales (tap counts from 3 to
// over 100), boxes of every mode, both filters, flip on and off, whole sources and the parts
// (footprints) resample_part() gets from the loader.
TEST(ImageTransform, Avx2LoopsEqualBaseline) {
  KernelsRestorer restore;
  if (!set_resample_kernels_for_testing(ResampleKernels::Avx2))
    GTEST_SKIP() << "this CPU has no AVX2";
  uint64_t ctr = 0;
  auto draw = [&](uint64_t n) { return n ? rng_u64(2024, 7, ctr++) % n : 0; };
  auto unit = [&] { return (double)(rng_u64(2024, 7, ctr++) >> 11) / 9007199254740992.0; };
  ResampleScratch s_avx2, s_base;  // scratch kept across cases, as a loader thread does
  int cases = 0, bad = 0;
  for (int it = 0; it < 4000; it++) {
    // Mostly small and medium sizes; now and then a few pixels, or a large downscale.
    const int size_kind = (int)draw(10);
    auto side = [&] {
      if (size_kind == 0) return 1 + (int)draw(6);
      return size_kind <= 7 ? 1 + (int)draw(320) : 200 + (int)draw(400);
    };
    const int W = side(), H = side();
    const int stride = W * 3 + (int)draw(3) * (int)draw(7);
    Bytes img((size_t)stride * H);
    const int content = (int)draw(3);
    uint64_t z = rng_u64(2024, 8, it) | 1;  // xorshift64 for the pixels
    for (int y = 0; y < H; y++)
      for (int x = 0; x < stride; x++) {
        z ^= z << 13, z ^= z >> 7, z ^= z << 17;
        uint8_t& v = img[(size_t)y * stride + x];
        if (content == 0) v = (uint8_t)(z >> 32);
        else if (content == 1) v = (z >> 40) & 1 ? 255 : 0;
        else v = (uint8_t)((x * 5 + y * 3) / 4 + (z >> 40) % 9);
      }
    const int ow = size_kind >= 8 ? 1 + (int)draw(40) : 1 + (int)draw(300);
    const int oh = size_kind >= 8 ? 1 + (int)draw(40) : 1 + (int)draw(300);
    const Interp interp = draw(2) ? Interp::Bicubic : Interp::Bilinear;
    const bool flip = draw(2);
    Box box;
    int S = 0;  // ResizeThenCrop: the output is S x S
    const int mode = (int)draw(4);
    if (mode == 0) {  // the whole image, or a fractional box, Pillow's way
      if (draw(3) == 0) {
        box = Box{0, 0, (double)W, (double)H, BoxMode::Pillow};
      } else {
        const double x0 = unit() * W * 0.9, y0 = unit() * H * 0.9;
        const double x1 = x0 + 0.05 + unit() * (W - x0 - 0.05);
        const double y1 = y0 + 0.05 + unit() * (H - y0 - 0.05);
        box = Box{x0, y0, x1, y1, BoxMode::Pillow};
      }
    } else if (mode == 1) {  // RandomResizedCrop
      box = rrc_box(31, it, W, H, 0.08, 1.0, 0.75, 4.0 / 3.0);
    } else if (mode == 2) {  // a crop of integer corners
      const int x0 = (int)draw(W), y0 = (int)draw(H);
      box = Box{(double)x0, (double)y0, (double)(x0 + 1 + (int)draw(W - x0)),
                (double)(y0 + 1 + (int)draw(H - y0)), BoxMode::CropThenResize};
    } else {  // the eval transform
      S = 1 + (int)draw(std::min(W, H));
      const double crop_pct = std::min(1.0, (double)S / std::min(W, H) + unit() * 0.5);
      box = eval_box(W, H, S, crop_pct);
    }
    const int out_w = S ? S : ow, out_h = S ? S : oh;
    Bytes a((size_t)out_w * out_h * 3, 1), b((size_t)out_w * out_h * 3, 2);
    // Every other Pillow / ResizeThenCrop case through resample_part() on its footprint only.
    const bool part = box.mode != BoxMode::CropThenResize && draw(2);
    auto run = [&](ResampleKernels k, uint8_t* out, ResampleScratch& sc) {
      ASSERT_TRUE(set_resample_kernels_for_testing(k));
      if (!part) {
        resample(img.data(), W, H, stride, box, out_w, out_h, interp, flip, out, sc);
        return;
      }
      int x0, y0, x1, y1;
      resample_footprint(W, H, box, out_w, out_h, interp, &x0, &y0, &x1, &y1);
      // The part in a buffer of its own (nothing readable past its rows).
      const int pw = x1 - x0, ph = y1 - y0;
      Bytes p((size_t)pw * 3 * ph);
      for (int y = 0; y < ph; y++)
        std::memcpy(&p[(size_t)y * pw * 3], &img[(size_t)(y0 + y) * stride + (size_t)x0 * 3],
                    (size_t)pw * 3);
      resample_part(p.data(), pw * 3, x0, y0, pw, ph, W, H, box, out_w, out_h, interp, flip, out,
                    sc);
    };
    run(ResampleKernels::Baseline, a.data(), s_base);
    run(ResampleKernels::Avx2, b.data(), s_avx2);
    ++cases;
    if (a != b) {
      size_t first = 0;
      while (a[first] == b[first]) first++;
      if (++bad <= 10)
        ADD_FAILURE() << "case " << it << ": " << W << "x" << H << " stride " << stride
                      << " box " << box.x0 << "," << box.y0 << "," << box.x1 << "," << box.y1
                      << " mode " << (int)box.mode << (part ? " (part)" : "") << " -> " << out_w
                      << "x" << out_h << " interp " << (int)interp << " flip " << flip
                      << ": first difference at byte " << first << " (baseline " << (int)a[first]
                      << ", avx2 " << (int)b[first] << ")";
    }
  }
  std::printf("[resample] %d random cases: AVX2 and baseline loops differ in %d\n", cases, bad);
  EXPECT_EQ(bad, 0);
}

// decode_crop_resize (dct_scale off) of a crop box == torchvision's F.resized_crop on the PIL
// image (+ hflip), exactly; resample() of the decoded image with the same box too.
TEST(ImageTransform, CropEqualsTorchvisionExactly) {
  REQUIRE_REFS();
  int n = 0;
  DecodeScratch scratch;
  for (const auto& t : R.lines) {
    if (t[0] != "crop") continue;
    const ImageCase& c = R.images.at(t[1]);
    const int S = std::stoi(t[3]);
    const int top = std::stoi(t[4]), left = std::stoi(t[5]), h = std::stoi(t[6]),
              w = std::stoi(t[7]);
    const bool flip = t[8] == "1";
    const Box box{(double)left, (double)top, (double)(left + w), (double)(top + h),
                  BoxMode::CropThenResize};
    const Bytes ref = read_file(t[9]);
    Bytes out((size_t)S * S * 3);
    const ImageInfo info = peek_image(c.bytes.data(), c.bytes.size());
    decode_crop_resize(c.bytes.data(), c.bytes.size(), info, box, S, interp_of(t[2]), flip, false,
                       out.data(), scratch);
    int maxd = 0;
    EXPECT_EQ(count_diff(ref, out.data(), out.size(), &maxd), 0)
        << t[1] << " crop " << left << "," << top << " " << w << "x" << h << " -> " << S
        << " interp " << t[2] << " flip " << flip << ": max diff " << maxd;
    Bytes out2((size_t)S * S * 3);
    resample(c.ref.data(), c.w, c.h, c.w * 3, box, S, S, interp_of(t[2]), flip, out2.data());
    EXPECT_EQ(count_diff(ref, out2.data(), out2.size()), 0) << t[1] << " resample of the crop";
    ++n;
  }
  EXPECT_GE(n, 50);
}

// eval_box + decode_crop_resize (dct_scale off) == torchvision's Resize(floor(S / crop_pct)) +
// CenterCrop(S) on the PIL image, exactly (ResizeThenCrop computes the whole resize's
// coefficients). The same box as a plain Pillow box (float32 coordinates) is measured too.
TEST(ImageTransform, EvalMatchesTorchvision) {
  REQUIRE_REFS();
  DecodeScratch scratch;
  double sum_mad = 0, worst_mad = 0;
  int worst_max = 0, n = 0, exact = 0;
  for (const auto& t : R.lines) {
    if (t[0] != "eval") continue;
    const ImageCase& c = R.images.at(t[1]);
    const int S = std::stoi(t[3]);
    const double crop_pct = std::stod(t[4]);
    const Bytes ref = read_file(t[5]);
    const Box box = eval_box(c.w, c.h, S, crop_pct);
    EXPECT_EQ(box.mode, BoxMode::ResizeThenCrop);
    Bytes out((size_t)S * S * 3);
    const ImageInfo info = peek_image(c.bytes.data(), c.bytes.size());
    decode_crop_resize(c.bytes.data(), c.bytes.size(), info, box, S, interp_of(t[2]), false, false,
                       out.data(), scratch);
    int maxd = 0;
    EXPECT_EQ(count_diff(ref, out.data(), out.size(), &maxd), 0)
        << t[1] << " S " << S << " crop_pct " << crop_pct << ": max diff " << maxd;
    // The Pillow-box approximation of the same transform.
    Box pbox = box;
    pbox.mode = BoxMode::Pillow;
    decode_crop_resize(c.bytes.data(), c.bytes.size(), info, pbox, S, interp_of(t[2]), false,
                       false, out.data(), scratch);
    const int nd = count_diff(ref, out.data(), out.size(), &maxd);
    const double m = mad(ref, out);
    sum_mad += m;
    worst_mad = std::max(worst_mad, m);
    worst_max = std::max(worst_max, maxd);
    exact += nd == 0;
    ++n;
  }
  EXPECT_GE(n, 20);
  std::printf("[eval] %d cases exact with ResizeThenCrop; as a Pillow (float32) box: %d exact, "
              "mean MAD %.5f, worst MAD %.5f, worst max diff %d\n", n,
              exact, sum_mad / std::max(n, 1), worst_mad, worst_max);
}

// With dct_scale on, large boxes decode at 1/d; the result stays close to the exact path.
TEST(ImageTransform, DctScaleClose) {
  REQUIRE_REFS();
  const ImageCase& c = R.images.at("large");
  const ImageInfo info = peek_image(c.bytes.data(), c.bytes.size());
  DecodeScratch scratch;
  const int S = 224;
  double worst = 0, sum = 0;
  int n = 0;
  std::map<int, int> by_d;
  for (int64_t pos = 0; pos < 60; pos++) {
    Box box = pos % 3 == 2 ? eval_box(c.w, c.h, S, 0.875)
                           : rrc_box(7, pos, c.w, c.h, 0.08, 1.0, 3.0 / 4.0, 4.0 / 3.0);
    if (pos % 3 == 1) box = Box{13, 7, (double)c.w - 5, (double)c.h - 2, BoxMode::CropThenResize};
    const int d = dct_scale_denom(box, S);
    by_d[d]++;
    if (d == 1) continue;
    for (Interp ip : {Interp::Bilinear, Interp::Bicubic}) {
      Bytes exact((size_t)S * S * 3), scaled((size_t)S * S * 3);
      decode_crop_resize(c.bytes.data(), c.bytes.size(), info, box, S, ip, pos % 2, false,
                         exact.data(), scratch);
      decode_crop_resize(c.bytes.data(), c.bytes.size(), info, box, S, ip, pos % 2, true,
                         scaled.data(), scratch);
      const double m = mad(exact, scaled);
      worst = std::max(worst, m);
      sum += m;
      ++n;
      EXPECT_LT(m, 3.0) << "d=" << d << " box " << box.x0 << "," << box.y0 << "," << box.x1 << ","
                        << box.y1;
    }
  }
  ASSERT_GT(n, 0);
  std::printf("[dct_scale] %d crops of a 1400x1100 photo at d in {2,4}: MAD vs exact mean %.3f, "
              "worst %.3f (uint8 levels); crops per d:",
              n, sum / n, worst);
  for (auto [d, k] : by_d) std::printf(" %d:%d", d, k);
  std::printf("\n");
  // The rule: box / d >= 2 S on both axes.
  EXPECT_EQ(dct_scale_denom(Box{0, 0, 447, 1000}, 224), 1);
  EXPECT_EQ(dct_scale_denom(Box{0, 0, 896, 896}, 224), 2);
  EXPECT_EQ(dct_scale_denom(Box{0, 0, 3584, 4000}, 224), 8);
}

// --- 3. RandomResizedCrop's distribution ------------------------------------------------------

// Two-sample Kolmogorov-Smirnov statistic.
double ks_statistic(std::vector<double> a, std::vector<double> b) {
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  size_t i = 0, j = 0;
  double d = 0;
  while (i < a.size() && j < b.size()) {
    const double v = std::min(a[i], b[j]);
    while (i < a.size() && a[i] <= v) i++;
    while (j < b.size() && b[j] <= v) j++;
    d = std::max(d, std::fabs((double)i / a.size() - (double)j / b.size()));
  }
  return d;
}

// Critical value at significance alpha: c(alpha) sqrt((n + m) / (n m)).
double ks_critical(size_t n, size_t m, double alpha) {
  return std::sqrt(-0.5 * std::log(alpha / 2)) * std::sqrt((double)(n + m) / ((double)n * m));
}

struct Crop {
  int i, j, h, w;
};

// A deliberately wrong sampler (same structure): `wrong` 1: aspect ratio uniform instead of
// log-uniform; 2: the side uniform instead of the area.
Crop wrong_rrc(int wrong, uint64_t pos, int W, int H) {
  const double area = (double)W * H;
  for (int a = 0; a < 10; a++) {
    const double u0 = (double)(rng_u64(5, 0, pos * 64 + 4 * a) >> 11) / 9007199254740992.0;
    const double u1 = (double)(rng_u64(5, 0, pos * 64 + 4 * a + 1) >> 11) / 9007199254740992.0;
    double target, aspect;
    if (wrong == 1) {
      target = area * (0.08 + u0 * 0.92);
      aspect = 0.75 + u1 * (4.0 / 3.0 - 0.75);
    } else {
      const double side = std::sqrt(0.08) + u0 * (1.0 - std::sqrt(0.08));
      target = area * side * side;
      aspect = std::exp(std::log(0.75) + u1 * (std::log(4.0 / 3.0) - std::log(0.75)));
    }
    const int w = (int)std::nearbyint(std::sqrt(target * aspect));
    const int h = (int)std::nearbyint(std::sqrt(target / aspect));
    if (0 < w && w <= W && 0 < h && h <= H) return Crop{0, 0, h, w};
  }
  return Crop{0, 0, H, W};
}

void stats(const std::vector<Crop>& cs, int W, int H, std::vector<double>* scale,
           std::vector<double>* logr) {
  for (const Crop& c : cs) {
    scale->push_back((double)c.w * c.h / ((double)W * H));
    logr->push_back(std::log((double)c.w / c.h));
  }
}

TEST(ImageTransform, RrcMatchesTorchvisionDistribution) {
  REQUIRE_REFS();
  const double alpha = 1e-3;
  int shapes = 0;
  for (const auto& t : R.lines) {
    if (t[0] != "rrc") continue;
    ++shapes;
    const int W = std::stoi(t[1]), H = std::stoi(t[2]), N = std::stoi(t[3]);
    const Bytes raw = read_file(t[4]);
    ASSERT_EQ(raw.size(), (size_t)N * 16);
    std::vector<Crop> tv(N), ours(N), bad1(N), bad2(N);
    std::memcpy(tv.data(), raw.data(), raw.size());
    for (int k = 0; k < N; k++) {
      const Box b = rrc_box(42, k, W, H, 0.08, 1.0, 3.0 / 4.0, 4.0 / 3.0);
      ASSERT_EQ(b.mode, BoxMode::CropThenResize);
      ours[k] = Crop{(int)b.y0, (int)b.x0, (int)(b.y1 - b.y0), (int)(b.x1 - b.x0)};
      ASSERT_TRUE(ours[k].i >= 0 && ours[k].j >= 0 && b.x1 <= W && b.y1 <= H && ours[k].w > 0 &&
                  ours[k].h > 0);
      bad1[k] = wrong_rrc(1, k, W, H);
      bad2[k] = wrong_rrc(2, k, W, H);
    }
    std::vector<double> s_tv, r_tv, s_us, r_us, s_b1, r_b1, s_b2, r_b2, x_tv, x_us;
    stats(tv, W, H, &s_tv, &r_tv);
    stats(ours, W, H, &s_us, &r_us);
    stats(bad1, W, H, &s_b1, &r_b1);
    stats(bad2, W, H, &s_b2, &r_b2);
    // The position: the crop centre's relative x (uniform offsets).
    for (const Crop& c : tv) x_tv.push_back((c.j + c.w / 2.0) / W);
    for (const Crop& c : ours) x_us.push_back((c.j + c.w / 2.0) / W);
    const double crit = ks_critical(N, N, alpha);
    const double d_s = ks_statistic(s_us, s_tv), d_r = ks_statistic(r_us, r_tv);
    const double d_x = ks_statistic(x_us, x_tv);
    const double d_s1 = ks_statistic(s_b1, s_tv), d_r1 = ks_statistic(r_b1, r_tv);
    const double d_s2 = ks_statistic(s_b2, s_tv), d_r2 = ks_statistic(r_b2, r_tv);
    std::printf("[rrc %dx%d] KS D (critical %.4f at alpha %g): scale %.4f, log-ratio %.4f, "
                "centre x %.4f; wrong ratio-uniform: %.4f/%.4f, wrong side-uniform: %.4f/%.4f\n",
                W, H, crit, alpha, d_s, d_r, d_x, d_s1, d_r1, d_s2, d_r2);
    EXPECT_LT(d_s, crit) << W << "x" << H;
    EXPECT_LT(d_r, crit) << W << "x" << H;
    EXPECT_LT(d_x, crit) << W << "x" << H;
    // The test can fail: each wrong formula is rejected.
    EXPECT_GT(std::max(d_s1, d_r1), crit) << "ratio-uniform variant not rejected, " << W << "x" << H;
    EXPECT_GT(std::max(d_s2, d_r2), crit) << "side-uniform variant not rejected, " << W << "x" << H;
    // The fallback rate (crops equal to the fallback box) within binomial error.
    const Box fb = [&] {
      const double in_ratio = (double)W / H;
      int w = W, h = H;
      if (in_ratio < 0.75) h = (int)std::nearbyint(w / 0.75);
      else if (in_ratio > 4.0 / 3.0) w = (int)std::nearbyint(h * 4.0 / 3.0);
      return Box{(double)((W - w) / 2), (double)((H - h) / 2), 0, 0};
    }();
    auto is_fb = [&](const Crop& c) {
      const int w = W / (double)H > 4.0 / 3.0 ? (int)std::nearbyint(H * 4.0 / 3.0) : W;
      const int h = W / (double)H < 0.75 ? (int)std::nearbyint(W / 0.75) : H;
      return c.j == (int)fb.x0 && c.i == (int)fb.y0 && c.w == w && c.h == h;
    };
    const double p_tv = std::count_if(tv.begin(), tv.end(), is_fb) / (double)N;
    const double p_us = std::count_if(ours.begin(), ours.end(), is_fb) / (double)N;
    const double p = (p_tv + p_us) / 2;
    const double se = std::sqrt(std::max(p * (1 - p), 1e-12) * 2.0 / N);
    std::printf("[rrc %dx%d] fallback rate: torchvision %.4f, ours %.4f (z %.2f)\n", W, H, p_tv,
                p_us, (p_us - p_tv) / se);
    EXPECT_LT(std::fabs(p_us - p_tv), 4 * se + 1e-9) << W << "x" << H;
    if (W == 3 * H) {
      EXPECT_GT(p_tv, 0.01) << "the panorama should exercise the fallback";
    }
  }
  EXPECT_EQ(shapes, 3);
}

TEST(ImageTransform, RrcDeterministic) {
  int differ = 0;
  for (int64_t pos = 0; pos < 1000; pos++) {
    const Box a = rrc_box(11, pos, 640, 480, 0.08, 1.0, 0.75, 4.0 / 3.0);
    const Box b = rrc_box(11, pos, 640, 480, 0.08, 1.0, 0.75, 4.0 / 3.0);
    EXPECT_TRUE(a.x0 == b.x0 && a.y0 == b.y0 && a.x1 == b.x1 && a.y1 == b.y1);
    const Box c = rrc_box(12, pos, 640, 480, 0.08, 1.0, 0.75, 4.0 / 3.0);
    const Box e = rrc_box(11, pos + 1, 640, 480, 0.08, 1.0, 0.75, 4.0 / 3.0);
    differ += (a.x0 != c.x0 || a.x1 != c.x1) + (a.x0 != e.x0 || a.x1 != e.x1);
  }
  EXPECT_GT(differ, 1900);
  // eval_box: torchvision's sizes (short side floor(224 / 0.875) = 256, long int(256 * l / s)).
  const Box e = eval_box(500, 375, 224, 0.875);  // resized to 341x256, crop at (58.5->58, 16)
  EXPECT_NEAR(e.x0, 58 * 500.0 / 341, 1e-9);
  EXPECT_NEAR(e.y0, 16 * 375.0 / 256, 1e-9);
  EXPECT_NEAR(e.x1, (58 + 224) * 500.0 / 341, 1e-9);
}

// --- timing ---------------------------------------------------------------------------------

TEST(ImageDecode, TimingOneCore) {
  REQUIRE_REFS();
  std::vector<Bytes> files;
  std::vector<ImageInfo> infos;
  for (const auto& t : R.lines)
    if (t[0] == "bench") {
      files.push_back(read_file(t[1]));
      infos.push_back(peek_image(files.back().data(), files.back().size()));
    }
  ASSERT_FALSE(files.empty());
  DecodeScratch scratch;
  const int S = 224;
  Bytes out((size_t)S * S * 3);
  KernelsRestorer restore;
  // The AVX2 resampling loops where this CPU has them, then the baseline loops.
  std::vector<ResampleKernels> kernels{ResampleKernels::Baseline};
  if (set_resample_kernels_for_testing(ResampleKernels::Avx2))
    kernels.insert(kernels.begin(), ResampleKernels::Avx2);
  for (ResampleKernels k : kernels) {
    ASSERT_TRUE(set_resample_kernels_for_testing(k));
    for (Interp ip : {Interp::Bilinear, Interp::Bicubic}) {
      int n = 0;
      const auto t0 = std::chrono::steady_clock::now();
      double sec = 0;
      while (sec < 1.0) {
        for (size_t f = 0; f < files.size(); f++, n++) {
          const Box box =
              rrc_box(3, n, infos[f].width, infos[f].height, 0.08, 1.0, 0.75, 4.0 / 3.0);
          decode_crop_resize(files[f].data(), files[f].size(), infos[f], box, S, ip, n % 2, true,
                             out.data(), scratch);
        }
        sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      std::printf("[timing] decode_crop_resize, ~400x350 q90 4:2:0 JPEGs, RandomResizedCrop to "
                  "%d, %s: %.0f images/s on one core (%s resampling loops)\n",
                  S, ip == Interp::Bicubic ? "bicubic" : "bilinear", n / sec, kernels_name(k));
    }
  }
  {
    int n = 0;
    DecodedImage im;
    const auto t0 = std::chrono::steady_clock::now();
    double sec = 0;
    while (sec < 0.5) {
      for (size_t f = 0; f < files.size(); f++, n++)
        decode_image(files[f].data(), files[f].size(), im);
      sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    std::printf("[timing] decode_image (full decode only): %.0f images/s on one core\n", n / sec);
  }
}

}  // namespace
}  // namespace vitgrid
