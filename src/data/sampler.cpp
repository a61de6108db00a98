// The layout-independent sampler: which dataset index, crop, flip and Mixup draw sit at each
// position of the endless training stream. Everything is a pure function of (seed, position),
// so any grid (data ranks x micro-batches) that covers the same positions sees the same data.
#include <cmath>
#include <stdexcept>
#include <string>

#include "vitgrid/core/rng.h"
#include "vitgrid/data/dataset.h"

namespace vitgrid {
namespace {

// Uniform integer in [0, n) from a 64-bit word (multiply-high: unbiased to 2^-64 * n and,
// unlike %, uses the strong high bits).
inline uint64_t below(uint64_t word, uint64_t n) {
  return (uint64_t)(((unsigned __int128)word * n) >> 64);
}

// Uniform double in (0, 1) with 53 bits.
inline double open01(uint64_t word) { return ((double)(word >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

// Counters of stream kStreamMixup per mixing unit: [0] unused, then the two Gamma draws of the
// Beta sample, each with room for kGammaTries rejection attempts (3 words per attempt).
constexpr uint64_t kMixupPerPos = 256;
constexpr uint64_t kGammaTries = 40;
constexpr uint64_t kGammaX = 1, kGammaY = 1 + 3 * kGammaTries + 8;
// Counters of stream kStreamAugment per position: dx, dy, flip; of kStreamCutmix per mixing
// unit: mix or not, Mixup or CutMix, box centre y, x.
constexpr uint64_t kAugPerPos = 4;

// Gamma(a, 1) by Marsaglia-Tsang, every uniform taken from (seed, key, first + k). For a < 1
// it boosts: Gamma(a) = Gamma(a + 1) * U^(1/a).
double gamma_draw(uint64_t seed, uint64_t key, uint64_t first, double a) {
  double boost = 1.0;
  if (a < 1.0) {
    boost = std::pow(open01(rng_u64(seed, key, first)), 1.0 / a);
    a += 1.0;
  }
  const double d = a - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
  for (uint64_t t = 0; t < kGammaTries; ++t) {
    const uint64_t k = first + 1 + 3 * t;
    // standard normal by Box-Muller from two words
    double u1 = open01(rng_u64(seed, key, k)), u2 = open01(rng_u64(seed, key, k + 1));
    double x = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    double v = 1.0 + c * x;
    if (v <= 0.0) continue;
    v = v * v * v;
    double u = open01(rng_u64(seed, key, k + 2));
    if (std::log(u) < 0.5 * x * x + d - d * v + d * std::log(v)) return d * v * boost;
  }
  // Acceptance is > 95% per try, so this is reached with probability < 1e-50; the mode keeps
  // the function total and deterministic.
  return d * boost;
}

}  // namespace

Sampler::Sampler(uint64_t seed, int64_t dataset_size) : seed_(seed), n_(dataset_size) {
  if (dataset_size <= 0)
    throw std::invalid_argument("Sampler: dataset size must be positive, got " + std::to_string(dataset_size));
}

// Epoch e's permutation is a Fisher-Yates shuffle whose step i uses word i of stream
// kStreamShuffle ^ ((e + 1) << 32). The epoch goes in the high half of the key so that no
// epoch's key equals another stream's small enum value (kStreamShuffle ^ 1 would be
// kStreamAugment, whose counters overlap the shuffle's).
int64_t Sampler::index_at(int64_t pos) const {
  if (pos < 0) throw std::out_of_range("Sampler: negative stream position");
  const int64_t e = pos / n_;
  if (e != cached_epoch_) {
    perm_.resize((size_t)n_);
    for (int64_t i = 0; i < n_; ++i) perm_[(size_t)i] = i;
    const uint64_t key = kStreamShuffle ^ ((uint64_t)(e + 1) << 32);
    for (int64_t i = n_ - 1; i > 0; --i) {
      int64_t j = (int64_t)below(rng_u64(seed_, key, (uint64_t)i), (uint64_t)(i + 1));
      std::swap(perm_[(size_t)i], perm_[(size_t)j]);
    }
    cached_epoch_ = e;
  }
  return perm_[(size_t)(pos % n_)];
}

SampleAug Sampler::augment_at(int64_t pos, int pad, bool hflip) const {
  SampleAug a;
  const uint64_t base = (uint64_t)pos * kAugPerPos;
  if (pad > 0) {
    a.dx = (int32_t)below(rng_u64(seed_, kStreamAugment, base + 0), (uint64_t)(2 * pad + 1));
    a.dy = (int32_t)below(rng_u64(seed_, kStreamAugment, base + 1), (uint64_t)(2 * pad + 1));
  }
  if (hflip) a.flip = flip_at(pos) ? 1 : 0;
  return a;
}

bool Sampler::flip_at(int64_t pos) const {
  return (rng_u64(seed_, kStreamAugment, (uint64_t)pos * kAugPerPos + 2) >> 63) != 0;
}

// timm's Mixup._params_per_batch / _params_per_elem and rand_bbox, every uniform drawn from
// (seed, unit): counter block unit * kMixupPerPos of kStreamMixup holds the two Gamma draws of
// lam; kStreamCutmix holds [0] whether to mix at all (prob), [1] Mixup or CutMix, [2], [3] the
// box centre.
MixDraw Sampler::mix_at(int64_t unit, const MixConfig& mix, int S) const {
  MixDraw d;
  if (!mix.on()) return d;
  const uint64_t cb = (uint64_t)unit * kAugPerPos;
  if (open01(rng_u64(seed_, kStreamCutmix, cb + 0)) >= mix.prob) return d;
  bool cut = mix.mixup_alpha <= 0.0;
  if (mix.mixup_alpha > 0.0 && mix.cutmix_alpha > 0.0)
    cut = open01(rng_u64(seed_, kStreamCutmix, cb + 1)) < mix.switch_prob;
  const double alpha = cut ? mix.cutmix_alpha : mix.mixup_alpha;
  const uint64_t mb = (uint64_t)unit * kMixupPerPos;
  const double x = gamma_draw(seed_, kStreamMixup, mb + kGammaX, alpha);
  const double y = gamma_draw(seed_, kStreamMixup, mb + kGammaY, alpha);
  const double lam = (x + y) > 0.0 ? x / (x + y) : 0.5;
  if (!cut) {
    d.lam = (float)lam;
    return d;
  }
  // rand_bbox: a box of side S * sqrt(1 - lam) centred at a uniform pixel, clipped to the image;
  // lam becomes the share of the image outside the box (timm's correct_lam).
  const double rat = std::sqrt(1.0 - lam);
  const int cw = (int)(S * rat), ch = (int)(S * rat);
  const int cy = (int)below(rng_u64(seed_, kStreamCutmix, cb + 2), (uint64_t)S);
  const int cx = (int)below(rng_u64(seed_, kStreamCutmix, cb + 3), (uint64_t)S);
  auto clip = [S](int v) { return v < 0 ? 0 : (v > S ? S : v); };
  d.cut = true;
  d.y0 = clip(cy - ch / 2);
  d.y1 = clip(cy + ch / 2);
  d.x0 = clip(cx - cw / 2);
  d.x1 = clip(cx + cw / 2);
  d.lam = (float)(1.0 - double(d.x1 - d.x0) * double(d.y1 - d.y0) / (double(S) * S));
  return d;
}

}  // namespace vitgrid
