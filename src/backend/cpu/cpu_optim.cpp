// CpuBackend reductions and optimizer updates (multi-tensor: one call walks every slice of the
// flat parameter, gradient and state buffers). Everything here is fp32 master state: nothing
// is rounded to the act dtype.
#include <cmath>
#include <sstream>

#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/core/error.h"

namespace vitgrid {

namespace {

// Bias corrections of Adam step t, in double so that beta^t is exact to fp32 precision even
// for large t, then used as fp32 factors as PyTorch does.
struct AdamFactors {
  float b1, b2, one_m_b1, one_m_b2;
  float bc1;        // 1 - beta1^t
  float bc2_sqrt;   // sqrt(1 - beta2^t)
};

AdamFactors adam_factors(const AdamParams& a) {
  if (a.step < 1) {
    std::ostringstream os;
    os << "Adam/LAMB update with step " << a.step << ": steps are 1-based";
    throw UserError(os.str());
  }
  AdamFactors f;
  f.b1 = a.beta1;
  f.b2 = a.beta2;
  f.one_m_b1 = 1.0f - a.beta1;
  f.one_m_b2 = 1.0f - a.beta2;
  f.bc1 = (float)(1.0 - std::pow((double)a.beta1, a.step));
  f.bc2_sqrt = (float)std::sqrt(1.0 - std::pow((double)a.beta2, a.step));
  return f;
}

}  // namespace

void CpuBackend::sum_squares(double* out_host, const float* buf,
                             const std::vector<ParamSlice>& slices) {
  for (size_t i = 0; i < slices.size(); ++i) {
    const float* x = buf + slices[i].offset;
    // Four partial sums let the compiler keep several lanes busy without reassociating.
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    const size_t n = slices[i].n;
    size_t j = 0;
    for (; j + 4 <= n; j += 4) {
      s0 += (double)x[j] * x[j];
      s1 += (double)x[j + 1] * x[j + 1];
      s2 += (double)x[j + 2] * x[j + 2];
      s3 += (double)x[j + 3] * x[j + 3];
    }
    for (; j < n; ++j) s0 += (double)x[j] * x[j];
    out_host[i] = (s0 + s1) + (s2 + s3);
  }
}

double CpuBackend::sum(const float* x, size_t n) {
  double s = 0.0;
  for (size_t i = 0; i < n; ++i) s += x[i];
  return s;
}

void CpuBackend::sum_into(double* acc, const float* x, size_t n) { *acc += sum(x, n); }

void CpuBackend::sum_squares_total(double* out, const float* buf,
                                   const std::vector<ParamSlice>& slices) {
  OpScope op_scope(*this, "grad_norm");
  std::vector<double> per(slices.size());
  sum_squares(per.data(), buf, slices);
  double t = 0.0;
  for (double v : per) t += v;
  *out = t;
}

void CpuBackend::clip_factor(float* out, const double* sq, double max_norm, float inv_scale) {
  const double g = std::sqrt(*sq) * static_cast<double>(inv_scale);
  float coef = 1.0f;
  if (max_norm > 0.0 && g > max_norm) coef = static_cast<float>(max_norm / (g + 1e-6));
  *out = coef * inv_scale;
}

void CpuBackend::readback_start(int slot, const void* src, size_t bytes) {
  VG_CHECK(slot >= 0, "cpu backend: readback slot " << slot);
  if (static_cast<size_t>(slot) >= readback_.size()) readback_.resize(slot + 1);
  readback_[slot].assign(static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
}

const void* CpuBackend::readback_wait(int slot) {
  VG_CHECK(slot >= 0 && static_cast<size_t>(slot) < readback_.size(),
           "cpu backend: readback slot " << slot << " was never started");
  return readback_[slot].data();
}

bool CpuBackend::all_finite(const float* x, size_t n) {
  // Branch-free scan (x - x is 0 for finite x, NaN for inf and NaN) so the loop vectorises;
  // only the final verdict is tested.
  float acc = 0.0f;
  for (size_t i = 0; i < n; ++i) acc += x[i] - x[i];
  return acc == 0.0f;
}

void CpuBackend::adamw_update(float* p, const float* g, float* m, float* v,
                              const std::vector<ParamSlice>& slices, const AdamParams& a) {
  OpScope op_scope(*this, "adamw_update");
  const AdamFactors k = adam_factors(a);
  const float step_size = a.lr / k.bc1;
  const float gs = a.grad_scale * (a.grad_scale_dev ? *a.grad_scale_dev : 1.0f);
  for (const ParamSlice& s : slices) {
    float* __restrict ps = p + s.offset;
    const float* __restrict gp = g + s.offset;
    float* __restrict ms = m + s.offset;
    float* __restrict vs = v + s.offset;
    const float decay = 1.0f - a.lr * s.weight_decay;
    // PyTorch's order: decoupled decay on the old p, then the Adam step.
    for (size_t i = 0; i < s.n; ++i) {
      const float gi = gp[i] * gs;
      const float mi = k.b1 * ms[i] + k.one_m_b1 * gi;
      const float vi = k.b2 * vs[i] + k.one_m_b2 * gi * gi;
      ms[i] = mi;
      vs[i] = vi;
      const float denom = std::sqrt(vi) / k.bc2_sqrt + a.eps;
      ps[i] = ps[i] * decay - step_size * mi / denom;
    }
  }
}

void CpuBackend::lamb_direction(float* u, const float* p, const float* g, float* m, float* v,
                                const std::vector<ParamSlice>& slices, const AdamParams& a) {
  OpScope op_scope(*this, "lamb_direction");
  const AdamFactors k = adam_factors(a);
  const float inv_bc1 = 1.0f / k.bc1;
  const float gs = a.grad_scale * (a.grad_scale_dev ? *a.grad_scale_dev : 1.0f);
  for (const ParamSlice& s : slices) {
    float* __restrict us = u + s.offset;
    const float* __restrict ps = p + s.offset;
    const float* __restrict gp = g + s.offset;
    float* __restrict ms = m + s.offset;
    float* __restrict vs = v + s.offset;
    const float wd = s.weight_decay;
    for (size_t i = 0; i < s.n; ++i) {
      const float gi = gp[i] * gs;
      const float mi = k.b1 * ms[i] + k.one_m_b1 * gi;
      const float vi = k.b2 * vs[i] + k.one_m_b2 * gi * gi;
      ms[i] = mi;
      vs[i] = vi;
      us[i] = (mi * inv_bc1) / (std::sqrt(vi) / k.bc2_sqrt + a.eps) + wd * ps[i];
    }
  }
}

void CpuBackend::lamb_apply(float* p, const float* u, const std::vector<ParamSlice>& slices,
                            const std::vector<float>& ratio_host, float lr) {
  OpScope op_scope(*this, "lamb_apply");
  VG_CHECK(ratio_host.size() >= slices.size(),
           "lamb_apply: " << ratio_host.size() << " ratios for " << slices.size() << " slices");
  for (size_t i = 0; i < slices.size(); ++i) {
    const ParamSlice& s = slices[i];
    float* __restrict ps = p + s.offset;
    const float* __restrict us = u + s.offset;
    const float f = lr * ratio_host[i];
    for (size_t j = 0; j < s.n; ++j) ps[j] -= f * us[j];
  }
}

void CpuBackend::sgd_update(float* p, const float* g, float* mom,
                            const std::vector<ParamSlice>& slices, float lr, float momentum,
                            bool nesterov, float grad_scale, const float* grad_scale_dev) {
  OpScope op_scope(*this, "sgd_update");
  if (grad_scale_dev) grad_scale *= *grad_scale_dev;
  // PyTorch SGD (dampening 0): d = g*gs + wd*p; b = mu*b + d; d = nesterov ? d + mu*b : b;
  // p -= lr*d. The zero-initialised buffer makes step 1 give b = d, PyTorch's clone.
  for (const ParamSlice& s : slices) {
    float* __restrict ps = p + s.offset;
    const float* __restrict gp = g + s.offset;
    float* __restrict bs = mom + s.offset;
    const float wd = s.weight_decay;
    for (size_t i = 0; i < s.n; ++i) {
      const float d = gp[i] * grad_scale + wd * ps[i];
      const float b = momentum * bs[i] + d;
      bs[i] = b;
      ps[i] -= lr * (nesterov ? d + momentum * b : b);
    }
  }
}

}  // namespace vitgrid
