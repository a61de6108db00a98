// The FP8 delayed-scaling state (model/fp8_scaling.h): a few values by hand, then the state
// machine against a reference written here from the recipe's definition (a deque of closed
// steps per tensor, the scale computed in double) over random steps whose amaxes include
// zeros, tiny values, inf and NaN, for every history length, margin and algorithm tested.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <deque>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "vitgrid/model/fp8_scaling.h"

namespace vitgrid {
namespace {

const float kInf = std::numeric_limits<float>::infinity();
const float kNan = std::numeric_limits<float>::quiet_NaN();

bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }
bool same(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!same(a[i], b[i])) return false;
  }
  return true;
}

// The recipe as defined, one tensor at a time.
class ReferenceRecipe {
 public:
  ReferenceRecipe(const std::vector<Fp8Format>& formats, int history, int margin, Fp8AmaxAlgo algo)
      : history_(history), margin_(margin), algo_(algo) {
    for (Fp8Format f : formats) {
      Meta m;
      m.fp8_max = f == Fp8Format::E4M3 ? 448.0 : 57344.0;
      metas_.push_back(m);
    }
  }

  void record(size_t i, float amax) {
    float& c = metas_[i].current;
    c = (std::isnan(c) || std::isnan(amax)) ? kNan : std::max(c, amax);
  }

  void update() {
    for (Meta& m : metas_) {
      if (!std::isfinite(m.current)) ++nonfinite_;
      // The window: this step's amax and the history - 1 steps before it.
      std::vector<float> window = {m.current};
      window.insert(window.end(), m.closed.begin(), m.closed.end());
      float amax = m.current;
      if (algo_ == Fp8AmaxAlgo::Max) {
        for (float a : window) {
          if (std::isnan(a) || std::isnan(amax)) {
            amax = kNan;
          } else {
            amax = std::max(amax, a);
          }
        }
      }
      if (std::isfinite(amax) && amax > 0) {
        const double s = m.fp8_max / amax / std::pow(2.0, margin_);
        m.scale = s > FLT_MAX ? FLT_MAX : static_cast<float>(s);
        m.scale_inv = static_cast<float>(1.0 / m.scale);
      }
      m.closed.push_front(m.current);
      while (static_cast<int>(m.closed.size()) > history_ - 1) m.closed.pop_back();
      m.current = 0;
    }
  }

  // A state restored from a checkpoint counts its overflows from there.
  void forget_nonfinite() { nonfinite_ = 0; }

  // Checks `s` against this reference: scales, history rows (entry 0 the current step, entry
  // k the step k updates ago, zeros where none), the overflow counter.
  void expect_equal(const Fp8ScalingState& s, const std::string& where) const {
    ASSERT_EQ(s.tensors(), metas_.size());
    EXPECT_EQ(s.nonfinite_amaxes(), nonfinite_) << where;
    const std::vector<float>& h = s.amax_history();
    ASSERT_EQ(h.size(), metas_.size() * history_);
    for (size_t i = 0; i < metas_.size(); ++i) {
      const Meta& m = metas_[i];
      EXPECT_EQ(s.scale(i), m.scale) << where << " tensor " << i;
      EXPECT_EQ(s.scales()[i], m.scale) << where << " tensor " << i;
      EXPECT_EQ(s.scale_inv(i), m.scale_inv) << where << " tensor " << i;
      EXPECT_EQ(s.scale_invs()[i], m.scale_inv) << where << " tensor " << i;
      EXPECT_TRUE(same(s.current_amax(i), m.current)) << where << " tensor " << i;
      for (int k = 0; k < history_; ++k) {
        const float want =
            k == 0 ? m.current
                   : (k - 1 < static_cast<int>(m.closed.size()) ? m.closed[k - 1] : 0.0f);
        EXPECT_TRUE(same(h[i * history_ + k], want))
            << where << " tensor " << i << " entry " << k << ": " << h[i * history_ + k] << " vs "
            << want;
      }
    }
  }

 private:
  struct Meta {
    double fp8_max = 0;
    std::deque<float> closed;  // amaxes of closed steps, the most recent first
    float current = 0;
    float scale = 1, scale_inv = 1;
  };
  int history_, margin_;
  Fp8AmaxAlgo algo_;
  std::vector<Meta> metas_;
  uint64_t nonfinite_ = 0;
};

TEST(Fp8Scaling, HandCheckedScales) {
  Fp8ScalingState s({Fp8Format::E4M3, Fp8Format::E5M2, Fp8Format::E4M3, Fp8Format::E4M3}, 16);
  EXPECT_EQ(s.tensors(), 4u);
  EXPECT_EQ(s.scale(0), 1.0f);  // before any update
  EXPECT_EQ(s.scale_inv(0), 1.0f);
  s.record(0, 2.0f);
  s.record(1, 2.0f);
  s.record(2, 0.0f);    // an all-zero tensor
  s.record(3, 1e-40f);  // 448 / 1e-40 overflows fp32
  s.update();
  EXPECT_EQ(s.scale(0), 224.0f);
  EXPECT_EQ(s.scale_inv(0), 1.0f / 224);
  EXPECT_EQ(s.scale(1), 28672.0f);
  EXPECT_EQ(s.scale(2), 1.0f);  // nothing to go by: unchanged
  EXPECT_EQ(s.scale(3), FLT_MAX);
  EXPECT_EQ(s.current_amax(0), 0.0f);  // a fresh slot
  EXPECT_EQ(s.amax_history()[1], 2.0f);

  Fp8ScalingState m({Fp8Format::E4M3, Fp8Format::E5M2}, 1024, 2);
  m.record(0, 2.0f);
  m.record(0, 1.0f);  // a second micro-batch: the step keeps the max
  m.record(1, 7.0f);
  m.update();
  EXPECT_EQ(m.scale(0), 56.0f);  // 448 / 2 / 2^2
  EXPECT_EQ(m.scale(1), 57344.0f / 7 / 4);
}

TEST(Fp8Scaling, WindowAndAlgorithms) {
  // history 3, "max": an amax of 4 sets the scale for 3 updates, then drops out.
  Fp8ScalingState s({Fp8Format::E4M3}, 3);
  const float want[] = {112, 112, 112, 448, 448};
  const float recorded[] = {4, 1, 1, 1, 1};
  for (int t = 0; t < 5; ++t) {
    s.record(0, recorded[t]);
    s.update();
    EXPECT_EQ(s.scale(0), want[t]) << "update " << t;
  }
  Fp8ScalingState r({Fp8Format::E4M3}, 3, 0, Fp8AmaxAlgo::MostRecent);
  r.record(0, 4);
  r.update();
  EXPECT_EQ(r.scale(0), 112.0f);
  r.record(0, 1);
  r.update();
  EXPECT_EQ(r.scale(0), 448.0f);
  r.update();  // nothing recorded: unchanged
  EXPECT_EQ(r.scale(0), 448.0f);
}

TEST(Fp8Scaling, OverflowKeepsScale) {
  Fp8ScalingState s({Fp8Format::E4M3, Fp8Format::E5M2}, 2);
  s.record(0, 2.0f);
  s.record(1, 2.0f);
  s.update();
  s.record(0, kNan);
  s.record(0, 1.0f);  // NaN survives a later, larger-looking record
  s.record(1, kInf);
  s.update();
  EXPECT_EQ(s.nonfinite_amaxes(), 2u);
  EXPECT_EQ(s.scale(0), 224.0f);
  EXPECT_EQ(s.scale(1), 28672.0f);
  // The NaN and the inf are still in the window of 2.
  s.record(0, 4.0f);
  s.record(1, 4.0f);
  s.update();
  EXPECT_EQ(s.scale(0), 224.0f);
  EXPECT_EQ(s.scale(1), 28672.0f);
  s.record(0, 4.0f);
  s.record(1, 4.0f);
  s.update();
  EXPECT_EQ(s.scale(0), 112.0f);
  EXPECT_EQ(s.scale(1), 14336.0f);
  EXPECT_EQ(s.nonfinite_amaxes(), 2u);
}

TEST(Fp8Scaling, MergeAndRestore) {
  Fp8ScalingState s({Fp8Format::E4M3, Fp8Format::E5M2, Fp8Format::E4M3}, 4);
  s.record(0, 3.0f);
  s.record(1, 5.0f);
  const float other[] = {2.0f, 8.0f, kNan};  // another rank's amaxes of the step
  s.merge_amax_max(other);
  EXPECT_EQ(s.current_amax(0), 3.0f);
  EXPECT_EQ(s.current_amax(1), 8.0f);
  EXPECT_TRUE(std::isnan(s.current_amax(2)));
  s.update();
  s.record(0, 1.0f);

  // A copy through what a checkpoint keeps continues exactly as the original.
  Fp8ScalingState c({Fp8Format::E4M3, Fp8Format::E5M2, Fp8Format::E4M3}, 4);
  c.restore(s.amax_history(), s.scales());
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(c.scale_inv(i), s.scale_inv(i));
  for (int t = 0; t < 5; ++t) {
    for (size_t i = 0; i < 3; ++i) {
      const float a = static_cast<float>(t + i) * 0.5f;
      s.record(i, a);
      c.record(i, a);
    }
    s.update();
    c.update();
    EXPECT_TRUE(same(c.amax_history(), s.amax_history())) << "update " << t;
    EXPECT_EQ(c.scales(), s.scales());
    EXPECT_EQ(c.scale_invs(), s.scale_invs());
  }
}

// A step's amax: mostly 2^[-20, 20) times [1, 2), sometimes 0, inf, NaN or tiny enough that
// fp8_max / amax overflows fp32.
float random_amax(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const float p = u(rng);
  if (p < 0.03f) return 0.0f;
  if (p < 0.05f) return kInf;
  if (p < 0.07f) return kNan;
  if (p < 0.09f) return std::ldexp(1.0f + u(rng), -135);
  return std::ldexp(1.0f + u(rng), static_cast<int>(u(rng) * 40) - 20);
}

TEST(Fp8Scaling, MatchesReferenceOnRandomSteps) {
  const std::vector<Fp8Format> formats = {Fp8Format::E4M3, Fp8Format::E4M3, Fp8Format::E5M2,
                                          Fp8Format::E4M3, Fp8Format::E5M2};
  std::mt19937 rng(380);
  std::uniform_int_distribution<int> records(0, 3);
  for (int history : {1, 2, 16}) {
    for (int margin : {0, 2}) {
      for (Fp8AmaxAlgo algo : {Fp8AmaxAlgo::Max, Fp8AmaxAlgo::MostRecent}) {
        Fp8ScalingState s(formats, history, margin, algo);
        ReferenceRecipe ref(formats, history, margin, algo);
        EXPECT_EQ(s.history(), history);
        EXPECT_EQ(s.margin(), margin);
        EXPECT_EQ(s.algo(), algo);
        for (int step = 0; step < 300; ++step) {
          for (size_t i = 0; i < formats.size(); ++i) {
            for (int r = records(rng); r > 0; --r) {  // 0 .. 3 casts of the tensor this step
              const float a = random_amax(rng);
              s.record(i, a);
              ref.record(i, a);
            }
          }
          if (step % 7 == 0) {  // a reduction over other ranks
            std::vector<float> other(formats.size());
            for (float& a : other) a = random_amax(rng);
            s.merge_amax_max(other.data());
            for (size_t i = 0; i < formats.size(); ++i) ref.record(i, other[i]);
          }
          s.update();
          ref.update();
          const std::string where = "history " + std::to_string(history) + " margin " +
                                    std::to_string(margin) +
                                    (algo == Fp8AmaxAlgo::Max ? " max" : " most_recent") +
                                    " step " + std::to_string(step);
          ref.expect_equal(s, where);
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

// Long windows, where the window's maximum leaves it often: amaxes that decay by 1% a step with
// a spike now and then (and, rarely, an inf or a NaN), histories of 5, 64 and 1024 (TE's
// default) over 2,500 updates, the state copied through what a checkpoint keeps at update 1,200
// (the copy then runs beside it). Every update against the reference, both states.
TEST(Fp8Scaling, LongWindowsMatchTheReference) {
  const std::vector<Fp8Format> formats = {Fp8Format::E4M3, Fp8Format::E5M2, Fp8Format::E4M3};
  std::mt19937 rng(1024);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int history : {5, 64, 1024}) {
    Fp8ScalingState s(formats, history);
    std::unique_ptr<Fp8ScalingState> copy;
    ReferenceRecipe ref(formats, history, 0, Fp8AmaxAlgo::Max);
    std::unique_ptr<ReferenceRecipe> ref_copy;  // the reference from the restore on
    std::vector<float> level(formats.size(), 1.0f);
    for (int step = 0; step < 2500; ++step) {
      for (size_t i = 0; i < formats.size(); ++i) {
        level[i] *= 0.99f;
        const float p = u(rng);
        float a = level[i] * (1.0f + 0.1f * u(rng));
        if (p < 0.02f) level[i] = a = 1.0f + 8.0f * u(rng);  // a spike
        else if (p < 0.0205f) a = kInf;
        else if (p < 0.021f) a = kNan;
        s.record(i, a);
        if (copy) {
          copy->record(i, a);
          ref_copy->record(i, a);
        }
        ref.record(i, a);
      }
      s.update();
      ref.update();
      if (copy) {
        copy->update();
        ref_copy->update();
      }
      const std::string where = "history " + std::to_string(history) + " step " + std::to_string(step);
      ref.expect_equal(s, where);
      if (copy) ref_copy->expect_equal(*copy, where + " (restored at 1200)");
      if (::testing::Test::HasFailure()) return;
      if (step == 1200) {
        copy = std::make_unique<Fp8ScalingState>(formats, history);
        copy->restore(s.amax_history(), s.scales());
        ref_copy = std::make_unique<ReferenceRecipe>(ref);
        ref_copy->forget_nonfinite();
      }
    }
  }
}

}  // namespace
}  // namespace vitgrid
