// Shared harness of the GPU tests: the CUDA backend against the CPU reference backend (fp32)
// on the same host inputs. rel_l2 / EXPECT_CLOSE measure ||gpu - cpu|| / ||cpu|| (NaN fails);
// Dev owns a backend and the buffers one test allocates; GpuVsCpu is the fixture parametrised
// by the act dtype, skipping when no GPU is visible, with inputs representable in that dtype.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/cpu/emulate16.h"
#include "vitgrid/backend/cuda/cuda_backend.h"

namespace vitgrid {
namespace gputest {

using Vec = std::vector<float>;
const float kNaN = std::numeric_limits<float>::quiet_NaN();

double rel_l2(const Vec& a, const Vec& ref) {
  EXPECT_EQ(a.size(), ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < ref.size(); ++i) {
    const double d = double(a[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);  // NaN anywhere in a makes this NaN: fails every EXPECT_LT
}

#define EXPECT_CLOSE(gpu, cpu, tol_)                                                    \
  do {                                                                                  \
    const double vg_err_ = rel_l2(gpu, cpu);                                            \
    EXPECT_TRUE(vg_err_ < (tol_)) << #gpu << " vs " << #cpu << ": rel L2 " << vg_err_   \
                                  << " >= " << (tol_);                                  \
  } while (0)

// A backend plus the buffers it allocated for one test (released at the end).
class Dev {
 public:
  explicit Dev(std::unique_ptr<Backend> b) : be(std::move(b)) {}
  ~Dev() {
    for (void* p : bufs) be->release(p);
  }
  void* raw(size_t bytes) {
    void* p = be->alloc(bytes);
    bufs.push_back(p);
    return p;
  }
  float* f32(const Vec& h) {
    float* p = static_cast<float*>(raw(std::max<size_t>(1, h.size()) * 4));
    be->copy_to_device(p, h.data(), h.size() * 4);
    return p;
  }
  void* act(const Vec& h) {
    void* p = raw(std::max<size_t>(1, h.size()) * be->act_size());
    float* t = static_cast<float*>(be->alloc(std::max<size_t>(1, h.size()) * 4));
    be->copy_to_device(t, h.data(), h.size() * 4);
    be->cast_to_act(p, t, h.size());
    be->synchronize();
    be->release(t);
    return p;
  }
  void* nan_act(size_t n) { return act(Vec(n, kNaN)); }
  float* nan_f32(size_t n) { return f32(Vec(n, kNaN)); }
  Vec get_f32(const float* p, size_t n) {
    Vec h(n);
    be->copy_to_host(h.data(), p, n * 4);
    return h;
  }
  Vec get_act(const void* p, size_t n) {
    float* t = static_cast<float*>(be->alloc(std::max<size_t>(1, n) * 4));
    be->cast_to_f32(t, p, n);
    Vec h = get_f32(t, n);
    be->release(t);
    return h;
  }
  std::unique_ptr<Backend> be;
  std::vector<void*> bufs;
};

class GpuVsCpu : public ::testing::TestWithParam<DType> {
 protected:
  explicit GpuVsCpu(unsigned seed) : rng(seed) {}
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
    dt = GetParam();
    cpu = std::make_unique<Dev>(make_backend("cpu", 0, DType::F32));
    gpu = std::make_unique<Dev>(make_cuda_backend(0, dt));
  }
  double tol() const { return dt == DType::F32 ? 1e-5 : (dt == DType::BF16 ? 1e-2 : 2e-3); }
  // Random values representable in the act dtype.
  Vec rnd(size_t n, float scale = 1.0f, float shift = 0.0f) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    Vec v(n);
    for (auto& x : v) x = round_to(dt, shift + scale * d(rng));
    return v;
  }
  DType dt = DType::F32;
  std::mt19937 rng;
  std::unique_ptr<Dev> cpu, gpu;
};

}  // namespace gputest
}  // namespace vitgrid
