// CpuBackend ViT glue: image preparation, patchify, token embedding, class-token pooling,
// and the loss and accuracy metrics.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"

namespace vitgrid {

namespace {
inline const float* cf(const void* p) { return static_cast<const float*>(p); }
inline float* f(void* p) { return static_cast<float*>(p); }
}  // namespace

// ---- input pipeline

void CpuBackend::prepare_images(void* out_, const uint8_t* images, const void* aug_, int B,
                                int S, int pad, const float* mean3, const float* std3) {
  OpScope op_scope(*this, "prepare_images");
  float* out = f(out_);
  const SampleAug* aug = static_cast<const SampleAug*>(aug_);
  const size_t plane = (size_t)S * S;
  // Normalised value of channel c of pixel (py, px) of an HWC image, with the zero padding:
  // coordinates are in the unpadded image, out-of-range ones read 0.
  auto pixel = [&](const uint8_t* img, int c, int py, int px) -> float {
    // Same operation order as data::prepare_images_reference (multiply by 1/255), so the two
    // agree bit for bit.
    const float v = (py < 0 || py >= S || px < 0 || px >= S)
                        ? 0.0f
                        : img[((size_t)py * S + px) * 3 + c] * (1.0f / 255.0f);
    return (v - mean3[c]) / std3[c];
  };
  // Without an aug array (evaluation) every sample is the centre crop, unflipped, unmixed.
  auto aug_of = [&](int b) {
    SampleAug a;
    if (aug) return aug[b];
    a.dx = a.dy = pad;
    return a;
  };
  for (int b = 0; b < B; ++b) {
    const SampleAug a = aug_of(b);
    if (a.dx < 0 || a.dx > 2 * pad || a.dy < 0 || a.dy > 2 * pad || a.partner >= B) {
      std::ostringstream os;
      os << "prepare_images: crop offset (" << a.dx << ", " << a.dy << ") or partner " << a.partner
         << " of sample " << b << " outside [0, " << 2 * pad << "] / [0, " << B << ")";
      throw UserError(os.str());
    }
    const uint8_t* img = images + (size_t)b * plane * 3;
    const bool mixed = a.partner >= 0;
    const SampleAug pa = mixed ? aug_of(a.partner) : a;
    const uint8_t* par = mixed ? images + (size_t)a.partner * plane * 3 : nullptr;
    const float lam = a.lam, lam1 = 1.0f - a.lam;
    for (int c = 0; c < 3; ++c) {
      float* o = out + ((size_t)b * 3 + c) * plane;
      for (int y = 0; y < S; ++y) {
        const int py = a.dy + y - pad, ppy = pa.dy + y - pad;
        const bool row_in_box = y >= a.cut_y0 && y < a.cut_y1;
        for (int x = 0; x < S; ++x) {
          const int px = a.dx + (a.flip ? S - 1 - x : x) - pad;
          float v = pixel(img, c, py, px);
          if (par) {
            const float w = pixel(par, c, ppy, pa.dx + (pa.flip ? S - 1 - x : x) - pad);
            if (row_in_box && x >= a.cut_x0 && x < a.cut_x1)
              v = w;
            else if (lam != 1.0f)
              v = lam * v + lam1 * w;
          }
          o[(size_t)y * S + x] = v;
        }
      }
    }
  }
  round_act(out, (size_t)B * 3 * plane);
}

void CpuBackend::patchify(void* patches_, const void* images_, int B, int S, int P) {
  OpScope op_scope(*this, "patchify");
  if (P <= 0 || S % P != 0) {
    std::ostringstream os;
    os << "patchify: image size " << S << " is not a multiple of the patch size " << P;
    throw UserError(os.str());
  }
  const float* images = cf(images_);
  float* patches = f(patches_);
  const int G = S / P;  // patches per side
  const size_t rowlen = (size_t)3 * P * P;
  for (int b = 0; b < B; ++b) {
    for (int gy = 0; gy < G; ++gy) {
      for (int gx = 0; gx < G; ++gx) {
        float* dst = patches + ((size_t)b * G * G + (size_t)gy * G + gx) * rowlen;
        for (int c = 0; c < 3; ++c) {
          const float* src = images + (((size_t)b * 3 + c) * S + (size_t)gy * P) * S + gx * P;
          // One contiguous run of P pixels per patch row.
          for (int i = 0; i < P; ++i) {
            std::memcpy(dst + ((size_t)c * P + i) * P, src + (size_t)i * S, P * sizeof(float));
          }
        }
      }
    }
  }
  // A pure permutation of act values: nothing to round.
}

void CpuBackend::embed_tokens(void* x_, const void* patch_tokens_, const void* cls_,
                              const void* pos_, int B, int T, int C) {
  OpScope op_scope(*this, "embed_tokens");
  float* x = f(x_);
  const float* pt = cf(patch_tokens_);
  const float* cls = cf(cls_);
  const float* pos = cf(pos_);
  for (int b = 0; b < B; ++b) {
    float* __restrict xb = x + (size_t)b * T * C;
    for (int j = 0; j < C; ++j) xb[j] = cls[j] + pos[j];
    const float* __restrict src = pt + (size_t)b * (T - 1) * C;
    const float* __restrict pp = pos + C;
    float* __restrict dst = xb + C;
    const size_t n = (size_t)(T - 1) * C;
    for (size_t i = 0; i < n; ++i) dst[i] = src[i] + pp[i];
  }
  round_act(x, (size_t)B * T * C);
}

void CpuBackend::embed_tokens_backward(void* dpatch_tokens_, float* dcls, float* dpos,
                                       const void* dx_, int B, int T, int C) {
  OpScope op_scope(*this, "embed_tokens_backward");
  const float* dx = cf(dx_);
  float* dpt = f(dpatch_tokens_);
  const size_t n = (size_t)T * C;
  for (int b = 0; b < B; ++b) {
    const float* __restrict dxb = dx + (size_t)b * n;
    if (dpt) {
      std::memcpy(dpt + (size_t)b * (T - 1) * C, dxb + C, (n - C) * sizeof(float));
    }
    if (dcls) {
      for (int j = 0; j < C; ++j) dcls[j] += dxb[j];
    }
    if (dpos) {
      for (size_t i = 0; i < n; ++i) dpos[i] += dxb[i];
    }
  }
}

void CpuBackend::gather_cls(void* rows_, const void* x_, int B, int T, int C) {
  OpScope op_scope(*this, "gather_cls");
  float* rows = f(rows_);
  const float* x = cf(x_);
  for (int b = 0; b < B; ++b) {
    std::memcpy(rows + (size_t)b * C, x + (size_t)b * T * C, (size_t)C * sizeof(float));
  }
}

void CpuBackend::scatter_cls_backward(void* dx_, const void* drows_, int B, int T, int C) {
  OpScope op_scope(*this, "scatter_cls_backward");
  float* dx = f(dx_);
  const float* drows = cf(drows_);
  for (int b = 0; b < B; ++b) {
    float* __restrict d = dx + (size_t)b * T * C;
    const float* __restrict s = drows + (size_t)b * C;
    for (int j = 0; j < C; ++j) d[j] += s[j];
    round_act(d, C);
  }
}

// ---- loss and metrics

void CpuBackend::cross_entropy(float* losses, void* dlogits_, const void* logits_,
                               const int32_t* labels, const float* soft, int N, int K,
                               float smoothing, float grad_scale) {
  OpScope op_scope(*this, "cross_entropy");
  const float* logits = cf(logits_);
  float* dlogits = f(dlogits_);
  const double eps = smoothing, off = smoothing / (double)K;
  std::vector<double> logp(K);
  for (int r = 0; r < N; ++r) {
    const float* z = logits + (size_t)r * K;
    const float* t = soft ? soft + (size_t)r * K : nullptr;
    int label = -1;
    if (!t) {
      label = labels[r];
      if (label < 0 || label >= K) {
        // Not thrown: only this rank would see it and the others would hang in the next
        // collective. A NaN loss and gradient row is what the CUDA backend produces too, and
        // the trainer's all_finite check stops on it.
        losses[r] = std::numeric_limits<float>::quiet_NaN();
        if (dlogits) {
          for (int k = 0; k < K; ++k) dlogits[(size_t)r * K + k] = losses[r];
        }
        continue;
      }
    }
    // log-softmax in double: losses are reported and compared across backends, and K is small
    // next to the GEMMs, so the extra precision costs nothing that matters.
    double mx = z[0];
    for (int k = 1; k < K; ++k) mx = std::max(mx, (double)z[k]);
    double s = 0.0;
    for (int k = 0; k < K; ++k) s += std::exp((double)z[k] - mx);
    const double lse = mx + std::log(s);
    for (int k = 0; k < K; ++k) logp[k] = (double)z[k] - lse;
    double loss = 0.0, tsum = 0.0;
    for (int k = 0; k < K; ++k) {
      const double tk = (1.0 - eps) * (t ? (double)t[k] : (k == label ? 1.0 : 0.0)) + off;
      loss -= tk * logp[k];
      tsum += tk;
    }
    losses[r] = (float)loss;
    if (dlogits) {
      // d/dz_k of -sum_j t_j log p_j = p_k sum_j t_j - t_k (exact also when sum t != 1).
      float* g = dlogits + (size_t)r * K;
      for (int k = 0; k < K; ++k) {
        const double tk = (1.0 - eps) * (t ? (double)t[k] : (k == label ? 1.0 : 0.0)) + off;
        g[k] = (float)((std::exp(logp[k]) * tsum - tk) * (double)grad_scale);
      }
      round_act(g, K);
    }
  }
}

void CpuBackend::topk_correct(float* correct1, float* correct5, const void* logits_,
                              const int32_t* labels, int N, int K) {
  OpScope op_scope(*this, "topk_correct");
  const float* logits = cf(logits_);
  for (int r = 0; r < N; ++r) {
    const float* z = logits + (size_t)r * K;
    const int label = labels[r];
    if (label < 0 || label >= K) {  // no logit for it: never correct
      if (correct1) correct1[r] = 0.0f;
      if (correct5) correct5[r] = 0.0f;
      continue;
    }
    // Rank in the order (logit descending, index ascending); see cpu_backend.h.
    const float zl = z[label];
    int rank = 0;
    for (int k = 0; k < K; ++k) rank += (z[k] > zl) || (z[k] == zl && k < label);
    if (correct1) correct1[r] = rank < 1 ? 1.0f : 0.0f;
    if (correct5) correct5[r] = rank < 5 ? 1.0f : 0.0f;
  }
}

}  // namespace vitgrid
