// Helpers shared by the CPU backend tests: seeded random data, tolerance comparisons against
// double-precision references, and central finite differences in double.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <sstream>
#include <vector>

namespace vgtest {

inline std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

inline std::vector<float> randu(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

inline std::vector<double> to_d(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// |actual - expected| <= atol + rtol * |expected| elementwise; reports the worst element.
inline ::testing::AssertionResult all_close(const float* actual, const double* expected, size_t n,
                                            double atol, double rtol) {
  size_t worst = 0, bad = 0;
  double worst_excess = -1.0;
  for (size_t i = 0; i < n; ++i) {
    const double err = std::fabs((double)actual[i] - expected[i]);
    const double tol = atol + rtol * std::fabs(expected[i]);
    const bool ok = err <= tol;  // false for NaN
    if (!ok) ++bad;
    const double excess = std::isnan(err) ? 1e300 : err - tol;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << n << " elements differ; worst at " << worst << ": actual "
         << actual[worst] << " expected " << expected[worst] << " (atol " << atol << ", rtol "
         << rtol << ")";
}

inline ::testing::AssertionResult all_close(const std::vector<float>& a,
                                            const std::vector<double>& e, double atol,
                                            double rtol) {
  if (a.size() != e.size()) return ::testing::AssertionFailure() << "size mismatch";
  return all_close(a.data(), e.data(), a.size(), atol, rtol);
}

// Gradient of the scalar f at x by central differences in double. With h = 1e-5 and the
// smooth, O(1)-scaled functions of these tests the truncation error is O(h^2) ~ 1e-10 and
// the rounding error O(1e-16 / h) ~ 1e-11, far below the fp32 tolerances it is compared with.
inline std::vector<double> fd_grad(const std::function<double(const std::vector<double>&)>& f,
                                   std::vector<double> x, double h = 1e-5) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2.0 * h);
  }
  return g;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

inline std::vector<double> add(std::vector<double> a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  return a;
}

}  // namespace vgtest
