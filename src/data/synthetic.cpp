// The embedded synthetic dataset.
//
// Each class is an oriented sinusoidal grating: its orientation and frequency are the class's
// identity. A sample shows its class's grating inside a Gaussian window at a random position,
// with a random phase, in a foreground colour over a background colour, the pair drawn from a
// palette shared by all classes, then random contrast, brightness and pixel noise. So:
//  * the class is carried by local orientation/frequency, which patch embeddings plus
//    attention pick up quickly (a small ViT reaches >= 90% top-1 in a couple of CPU minutes);
//  * the class-mean image is almost flat (random phase, position and colours average out), so
//    raw-pixel template matching and mean colour do not identify the class (the unit tests
//    check that nearest-class-mean on pixels stays near chance);
//  * everything is a pure function of (seed, split, index) via the counter RNG, generated on
//    the fly in read(): no storage, any image size, identical bytes on every rank and in the
//    vitgrid_dataset tool's HDF5 export.
// Generation is separable (sin(ax + by + p) = sin(ax)cos(by+p) + cos(ax)sin(by+p), window =
// gx(x)gy(y))
// so a pixel costs a few multiply-adds; 32x32 images come out at well over 20k/s per core.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <utility>
#include <stdexcept>
#include <vector>

#include "vitgrid/core/error.h"
#include "vitgrid/core/rng.h"
#include "vitgrid/data/dataset.h"

namespace vitgrid {
namespace {

// Noise amplitude in byte units (triangular noise in [-a, a], std a/sqrt(6)). This is the
// difficulty knob; the default keeps the task learnable to >= 90% by a small ViT.
constexpr float kNoiseAmplitude = 24.0f;

// Palette shared across classes: the foreground and background colours are drawn from it per
// sample, independently of the class.
constexpr int kPaletteSize = 8;
constexpr float kPalette[kPaletteSize][3] = {
    {225, 60, 50}, {45, 160, 75}, {50, 95, 220}, {235, 200, 45},
    {150, 65, 180}, {45, 185, 195}, {215, 215, 215}, {45, 45, 50}};

// Smallest Euclidean RGB distance between a sample's background and foreground colours.
constexpr float kMinColourDistance = 150.0f;

constexpr double kPi = 3.14159265358979323846;

// Per-sample draws use counters idx * kDrawsPerSample + k on the split's sample stream.
constexpr uint64_t kDrawsPerSample = 16;

struct ClassPattern {
  // Per-column sin/cos of the grating's x phase, and its y wave number.
  std::vector<float> sx, cx;
  float ky = 0;
};

inline float u01(uint64_t w) { return (float)(w >> 40) * (1.0f / 16777216.0f); }

class SyntheticDataset final : public Dataset {
 public:
  SyntheticDataset(uint64_t seed, bool train, int64_t n, int S, int K)
      : seed_(seed), train_(train), n_(n), S_(S), K_(K) {
    if (n <= 0) throw UserError("synthetic dataset: size must be positive, got " + std::to_string(n));
    if (S < 4) throw UserError("synthetic dataset: image size must be >= 4, got " + std::to_string(S));
    if (K < 1) throw UserError("synthetic dataset: num_classes must be >= 1, got " + std::to_string(K));
    // The two splits share the class definitions (they depend on the class only) but draw
    // their samples from different streams.
    sample_key_ = kStreamSynthetic ^ (train ? 0x7472616900000000ull : 0x6576616c00000000ull);
    label_key_ = sample_key_ ^ 0x4c4142454cull;
    noise_key_ = sample_key_ ^ 0x4e4f495345ull;
    // render() reads the noise words as bytes, least significant first
    const uint16_t one = 1;
    if (*reinterpret_cast<const unsigned char*>(&one) != 1)
      throw std::logic_error("synthetic dataset: the noise byte order assumes a little-endian host");
    build_classes();
    // (background, foreground) pairs far enough apart that the pattern stays visible
    for (int a = 0; a < kPaletteSize; ++a)
      for (int b = 0; b < kPaletteSize; ++b) {
        float d2 = 0;
        for (int ch = 0; ch < 3; ++ch) d2 += (kPalette[a][ch] - kPalette[b][ch]) * (kPalette[a][ch] - kPalette[b][ch]);
        if (d2 >= kMinColourDistance * kMinColourDistance) colour_pairs_.emplace_back(a, b);
      }
  }

  int64_t size() const override { return n_; }
  int image_size() const override { return S_; }
  int num_classes() const override { return K_; }
  std::string describe() const override {
    std::ostringstream os;
    os << "synthetic(" << (train_ ? "train" : "eval") << ", n=" << n_ << ", " << S_ << "x" << S_
       << ", classes=" << K_ << ", seed=" << seed_ << ")";
    return os.str();
  }

  void read(const int64_t* idx, int n, uint8_t* images, int32_t* labels) override {
    std::vector<float> row(2 * S_);  // per-row sin/cos of the grating phase
    std::vector<float> gx(S_), gy(S_);
    for (int k = 0; k < n; ++k) {
      if (idx[k] < 0 || idx[k] >= n_)
        throw std::out_of_range("synthetic dataset: index " + std::to_string(idx[k]) +
                                " outside [0, " + std::to_string(n_) + ")");
      render(idx[k], images + (size_t)k * S_ * S_ * 3, labels + k, row, gx, gy);
    }
  }

 private:
  // Class c is a grating with tilt index c % No and frequency index c / No on an No x Nf grid:
  // No ~ sqrt(2K) tilts |theta| from 0 to 90 degrees, Nf frequencies spaced geometrically; for
  // K = 10, classes are 22.5 degrees or a factor 2 in frequency apart. Each sample tilts its
  // grating by +theta or -theta at random, so a horizontal flip (the default augmentation,
  // which turns theta into -theta) keeps the class: the classes are flip-invariant.
  // No * Nf >= K, so classes never coincide; with many classes (K = 1000) neighbours get close,
  // which suits throughput benchmarks rather than accuracy targets.
  void build_classes() {
    classes_.resize(K_);
    const int No = std::max(2, (int)std::ceil(std::sqrt(2.0 * K_)));  // >= 2: 0 and 90 degrees
    const int Nf = (K_ + No - 1) / No;
    const double fmax = std::min(5.0, S_ / 4.0);  // cycles per image, well below aliasing
    const double fmin = std::min(2.5, fmax * 0.5);
    for (int c = 0; c < K_; ++c) {
      const int o = c % No, q = c / No;
      const double theta = 0.5 * kPi * o / (No - 1);
      const double freq = Nf > 1 ? fmin * std::pow(fmax / fmin, (double)q / (Nf - 1)) : fmax;
      const double w = 2 * kPi * freq / S_;
      const double kx = w * std::cos(theta);
      ClassPattern& p = classes_[c];
      p.ky = (float)(w * std::sin(theta));
      p.sx.resize(S_);
      p.cx.resize(S_);
      for (int x = 0; x < S_; ++x) {
        p.sx[x] = (float)std::sin(kx * x);
        p.cx[x] = (float)std::cos(kx * x);
      }
    }
  }

  void render(int64_t i, uint8_t* out, int32_t* label, std::vector<float>& row,
              std::vector<float>& gx, std::vector<float>& gy) const {
    const int c = (int)(rng_u64(seed_, label_key_, (uint64_t)i) % (uint64_t)K_);
    *label = c;
    const ClassPattern& p = classes_[c];
    const uint64_t base = (uint64_t)i * kDrawsPerSample;
    auto draw = [&](int k) { return u01(rng_u64(seed_, sample_key_, base + k)); };
    const float phase = (float)(2 * kPi) * draw(0);
    const float cxw = S_ * (0.25f + 0.5f * draw(2)), cyw = S_ * (0.25f + 0.5f * draw(3));
    const float sigma = S_ * (0.35f + 0.15f * draw(4));
    const auto& pair = colour_pairs_[(size_t)(draw(5) * colour_pairs_.size())];
    const int bg = pair.first, fg = pair.second;
    const float contrast = 0.8f + 0.4f * draw(7);
    const float brightness = -30.0f + 60.0f * draw(8);
    const float tilt = draw(9) < 0.5f ? 1.0f : -1.0f;  // +theta or -theta: sin(-kx x) = -sin(kx x)

    const float inv2s2 = 1.0f / (2 * sigma * sigma);
    for (int t = 0; t < S_; ++t) {
      gx[t] = std::exp(-(t - cxw) * (t - cxw) * inv2s2);
      gy[t] = std::exp(-(t - cyw) * (t - cyw) * inv2s2);
    }
    for (int y = 0; y < S_; ++y) {
      row[2 * y + 0] = std::sin(p.ky * y + phase);
      row[2 * y + 1] = std::cos(p.ky * y + phase);
    }
    // Colours after contrast/brightness: pixel = base + m * t * diff with t in [0, 1].
    float base_c[3], diff_c[3];
    for (int ch = 0; ch < 3; ++ch) {
      float b = kPalette[bg][ch], f = kPalette[fg][ch];
      base_c[ch] = (b - 128.0f) * contrast + 128.0f + brightness;
      diff_c[ch] = (f - b) * contrast;
    }
    // Noise: one 64-bit word gives 4 triangular samples (sum of two 8-bit uniforms each).
    const int npix = S_ * S_ * 3;
    const uint64_t noise_base = (uint64_t)i * (uint64_t)((npix + 3) / 4);
    const float nscale = kNoiseAmplitude / 255.0f;
    // rng_u64(seed, noise_key, c) with the stream part hoisted
    const uint64_t noise_stream = rng_stream(seed_, noise_key_);
    // The noise words of the whole image first (the sample o takes bytes 2o and 2o+1 of the
    // little-endian word stream), then the pixels in a branch-free loop the compiler vectorises.
    const size_t nwords = (size_t)(npix + 3) / 4;
    thread_local std::vector<uint64_t> words;
    thread_local std::vector<float> mrow;
    if (words.size() < nwords + 1) words.resize(nwords + 1);
    if (mrow.size() < (size_t)S_) mrow.resize(S_);
    for (size_t w = 0; w < nwords; ++w) words[w] = rng_word(noise_stream, noise_base + w);
    // byte k of the stream is byte k % 8 of word k / 8, counted from the least significant
    // (a little-endian host: checked in the constructor)
    const unsigned char* nb = reinterpret_cast<const unsigned char*>(words.data());
    for (int y = 0; y < S_; ++y) {
      const float s0 = row[2 * y], c0 = row[2 * y + 1];
      const float gyy = gy[y];
      for (int x = 0; x < S_; ++x) {
        // sin(kx x + ky y + phase), separably
        const float g = tilt * p.sx[x] * c0 + p.cx[x] * s0;
        mrow[x] = gx[x] * gyy * (0.5f + 0.5f * g);
      }
      const int o0 = y * S_ * 3;
      uint8_t* dst = out + o0;
      for (int x = 0; x < S_; ++x) {
        const float m = mrow[x];
        for (int ch = 0; ch < 3; ++ch) {
          const size_t o = (size_t)o0 + 3 * x + ch;
          float noise = ((float)nb[2 * o] + (float)nb[2 * o + 1] - 255.0f) * nscale;
          float v = base_c[ch] + m * diff_c[ch] + noise;
          v = std::min(255.0f, std::max(0.0f, v));
          dst[3 * x + ch] = (uint8_t)(v + 0.5f);
        }
      }
    }
  }

  uint64_t seed_;
  bool train_;
  int64_t n_;
  int S_, K_;
  uint64_t sample_key_ = 0, label_key_ = 0, noise_key_ = 0;
  std::vector<ClassPattern> classes_;
  std::vector<std::pair<int, int>> colour_pairs_;
};

}  // namespace

std::unique_ptr<Dataset> make_synthetic(uint64_t seed, bool train, int64_t n, int image_size,
                                        int num_classes) {
  return std::make_unique<SyntheticDataset>(seed, train, n, image_size, num_classes);
}

}  // namespace vitgrid
