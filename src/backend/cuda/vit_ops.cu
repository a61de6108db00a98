// ViT glue on the device: image preparation (pad/crop/flip/normalise/Mixup), patchify, token
// embedding and class-token pooling (forward and backward side by side), and the loss and
// accuracy kernels (cross-entropy fused with its gradient, top-1/top-5).
#include <algorithm>
#include <cmath>

#include "cuda_backend_impl.h"
#include "kernel_util.cuh"

namespace vitgrid {
namespace cuda {

// Mirror of data::SampleAug (data/dataset.h); the backend layer may not include the data
// layer, so the layout is restated and pinned here.
struct AugDev {
  int32_t dx, dy, flip;
  float lam;
  int32_t partner;
  int16_t cut_x0, cut_y0, cut_x1, cut_y1;
  float target_lam;
};
static_assert(sizeof(AugDev) == 32, "SampleAug layout");

struct Norm3 {
  float mean[3], std[3];
};

// out[b,c,y,x]: padded pixel (dy + y, dx + xs), xs = S-1-x when flipped (crop, then flip the
// crop); padding is 0 in the 0-255 image, so it becomes (0 - mean)/std after normalisation.
__device__ __forceinline__ float prep_pixel(const uint8_t* img, int b, int c, int y, int x,
                                            int S, int pad, const AugDev& a, const Norm3& nm) {
  const int xs = a.flip ? S - 1 - x : x;
  const int iy = a.dy + y - pad, ix = a.dx + xs - pad;
  float v = 0.0f;
  if (iy >= 0 && iy < S && ix >= 0 && ix < S)
    v = static_cast<float>(img[((static_cast<int64_t>(b) * S + iy) * S + ix) * 3 + c]);
  return (v / 255.0f - nm.mean[c]) / nm.std[c];
}

// One block per output row (b, y): the sample's augmentation is read once, and the index
// arithmetic is 32-bit per row instead of 64-bit divisions per element (which made this
// elementwise pass ~10x slower than its memory traffic).
template <class T>
__global__ void prepare_images_kernel(T* out, const uint8_t* images, const AugDev* aug, int S,
                                      int pad, Norm3 nm) {
  const int b = static_cast<int>(blockIdx.x / static_cast<unsigned>(S));
  const int y = static_cast<int>(blockIdx.x % static_cast<unsigned>(S));
  const AugDev a = aug[b];
  const bool mixed = a.partner >= 0;
  const AugDev pa = mixed ? aug[a.partner] : a;
  const bool row_in_box = y >= a.cut_y0 && y < a.cut_y1;
  const int64_t plane = static_cast<int64_t>(S) * S;
  T* o = out + static_cast<int64_t>(b) * 3 * plane + static_cast<int64_t>(y) * S;
  for (int x = threadIdx.x; x < S; x += blockDim.x) {
    const bool in_box = row_in_box && x >= a.cut_x0 && x < a.cut_x1;
#pragma unroll
    for (int c = 0; c < 3; ++c) {
      float v = prep_pixel(images, b, c, y, x, S, pad, a, nm);
      if (mixed) {
        const float w = prep_pixel(images, a.partner, c, y, x, S, pad, pa, nm);
        if (in_box)
          v = w;
        else if (a.lam != 1.0f)
          v = a.lam * v + (1.0f - a.lam) * w;
      }
      o[c * plane + x] = from_f<T>(v);
    }
  }
}

// patches[b*np*np + py*np + px, c*P*P + i*P + j] = images[b, c, py*P + i, px*P + j]
// One block per patch row (b, py, px); 32-bit index arithmetic.
template <class T>
__global__ void patchify_kernel(T* patches, const T* images, int S, int P) {
  const unsigned np = static_cast<unsigned>(S / P);
  const unsigned r = blockIdx.x;
  const int b = static_cast<int>(r / (np * np));
  const int py = static_cast<int>((r / np) % np), px = static_cast<int>(r % np);
  const int PP = P * P, cols = 3 * PP;
  const T* src = images + static_cast<int64_t>(b) * 3 * S * S + static_cast<int64_t>(py) * P * S +
                 px * P;
  T* dst = patches + static_cast<int64_t>(r) * cols;
  for (int k = threadIdx.x; k < cols; k += blockDim.x) {
    const int c = k / PP, i = (k - c * PP) / P, j = k - c * PP - i * P;
    dst[k] = src[(static_cast<int64_t>(c) * S + i) * S + j];
  }
}

// x[b,t,c] = (t == 0 ? cls[c] : patch[b,t-1,c]) + pos[t,c]; one block per token row (b, t)
template <class T>
__global__ void embed_tokens_kernel(T* x, const T* patch, const T* cls, const T* pos, int T_,
                                    int C) {
  const unsigned row = blockIdx.x;
  const int t = static_cast<int>(row % static_cast<unsigned>(T_));
  const int64_t b = row / static_cast<unsigned>(T_);
  const T* src = t == 0 ? cls : patch + (b * (T_ - 1) + t - 1) * C;
  const T* p = pos + static_cast<int64_t>(t) * C;
  T* dst = x + static_cast<int64_t>(row) * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) dst[c] = from_f<T>(to_f(src[c]) + to_f(p[c]));
}

// The same two with 16-byte packs of V elements (P, S, C multiples of V, aligned rows), a
// grid-stride loop over all packs with 32-bit index arithmetic: the one-block-per-row kernels
// above moved 2 bytes per thread and ran at a quarter of the memory bandwidth (H200, ViT-B:
// patchify 0.185 ms, embed_tokens 0.101 ms for 154 MB each).
template <class T>
__global__ void patchify_vec_kernel(T* patches, const T* images, int S, int P, unsigned packs) {
  constexpr int V = 16 / sizeof(T);
  using Pk = Pack<T, V>;
  const unsigned np = static_cast<unsigned>(S / P), PP = static_cast<unsigned>(P * P);
  const unsigned per_row = 3 * PP / V;
  const unsigned stride = gridDim.x * blockDim.x;
  for (unsigned g = blockIdx.x * blockDim.x + threadIdx.x; g < packs; g += stride) {
    const unsigned r = g / per_row, k = (g - r * per_row) * V;
    const unsigned b = r / (np * np), rp = r - b * np * np;
    const unsigned py = rp / np, px = rp - py * np;
    const unsigned c = k / PP, ij = k - c * PP, i = ij / P, j = ij - i * P;
    const int64_t src = ((static_cast<int64_t>(b) * 3 + c) * S + py * P + i) * S + px * P + j;
    reinterpret_cast<Pk*>(patches)[g] = *reinterpret_cast<const Pk*>(images + src);
  }
}
template <class T>
__global__ void embed_tokens_vec_kernel(T* x, const T* patch, const T* cls, const T* pos,
                                        int T_, int C, unsigned packs) {
  constexpr int V = 16 / sizeof(T);
  using Pk = Pack<T, V>;
  const unsigned per_row = static_cast<unsigned>(C / V);
  const unsigned stride = gridDim.x * blockDim.x;
  for (unsigned g = blockIdx.x * blockDim.x + threadIdx.x; g < packs; g += stride) {
    const unsigned row = g / per_row, q = g - row * per_row;
    const unsigned b = row / static_cast<unsigned>(T_), t = row - b * static_cast<unsigned>(T_);
    const Pk a = t == 0 ? reinterpret_cast<const Pk*>(cls)[q]
                        : reinterpret_cast<const Pk*>(
                              patch)[(static_cast<int64_t>(b) * (T_ - 1) + t - 1) * per_row + q];
    const Pk e = reinterpret_cast<const Pk*>(pos)[static_cast<int64_t>(t) * per_row + q];
    Pk o;
#pragma unroll
    for (int v = 0; v < V; ++v) o.v[v] = from_f<T>(to_f(a.v[v]) + to_f(e.v[v]));
    reinterpret_cast<Pk*>(x)[g] = o;
  }
}

// One thread per (t, c): sums over the batch in order (deterministic), writes the patch-token
// gradient as it goes.
template <class T>
__global__ void embed_tokens_bwd_kernel(T* dpatch, float* dcls, float* dpos, const T* dx, int B,
                                        int T_, int C) {
  const int64_t tc = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (tc >= static_cast<int64_t>(T_) * C) return;
  const int c = static_cast<int>(tc % C);
  const int t = static_cast<int>(tc / C);
  float s = 0.0f;
  for (int b = 0; b < B; ++b) {
    const T v = dx[(static_cast<int64_t>(b) * T_ + t) * C + c];
    s += to_f(v);
    if (t > 0) dpatch[(static_cast<int64_t>(b) * (T_ - 1) + t - 1) * C + c] = v;
  }
  dpos[tc] += s;
  if (t == 0) dcls[c] += s;
}

// The same with 16-byte packs (C a multiple of V, aligned rows): one thread per (t, pack of V
// columns), U batch rows' loads in flight before they are summed (in batch order, as above:
// the same bits).
template <class T>
__global__ void embed_tokens_bwd_vec_kernel(T* dpatch, float* dcls, float* dpos, const T* dx,
                                            int B, int T_, int C) {
  constexpr int V = 16 / sizeof(T), U = 8;
  using Pk = Pack<T, V>;
  const int per_row = C / V;
  const int tq = blockIdx.x * blockDim.x + threadIdx.x;
  if (tq >= T_ * per_row) return;
  const int t = tq / per_row, q = tq - t * per_row;
  float s[V];
#pragma unroll
  for (int v = 0; v < V; ++v) s[v] = 0.0f;
  const Pk* src = reinterpret_cast<const Pk*>(dx);
  Pk* dst = reinterpret_cast<Pk*>(dpatch);
  for (int b0 = 0; b0 < B; b0 += U) {
    Pk in[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (b0 + u < B) in[u] = src[(static_cast<int64_t>(b0 + u) * T_ + t) * per_row + q];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (b0 + u >= B) continue;
#pragma unroll
      for (int v = 0; v < V; ++v) s[v] += to_f(in[u].v[v]);
      if (t > 0) dst[(static_cast<int64_t>(b0 + u) * (T_ - 1) + t - 1) * per_row + q] = in[u];
    }
  }
#pragma unroll
  for (int v = 0; v < V; ++v) {
    dpos[static_cast<int64_t>(t) * C + q * V + v] += s[v];
    if (t == 0) dcls[q * V + v] += s[v];
  }
}

template <class T>
__global__ void gather_cls_kernel(T* rows, const T* x, int B, int T_, int C) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<int64_t>(B) * C) return;
  rows[i] = x[(i / C) * T_ * C + i % C];
}
template <class T>
__global__ void scatter_cls_kernel(T* dx, const T* drows, int B, int T_, int C) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<int64_t>(B) * C) return;
  const int64_t o = (i / C) * T_ * C + i % C;
  dx[o] = from_f<T>(to_f(dx[o]) + to_f(drows[i]));
}

// One block per row. target_j = (1-eps) t_j + eps/K; loss = sum_j target_j (lse - z_j);
// dlogits_j = (p_j * sum(target) - target_j) * grad_scale (exact for targets not summing to 1).
template <class T>
__global__ void cross_entropy_kernel(float* losses, T* dlogits, const T* logits,
                                     const int32_t* labels, const float* soft, int N, int K,
                                     float eps, float grad_scale) {
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  const T* z = logits + row * K;
  const int label = soft ? -1 : labels[row];
  const bool bad = !soft && (label < 0 || label >= K);
  const float* sr = soft ? soft + row * K : nullptr;
  const float base = eps / K;
  float m = -INFINITY;
  for (int j = threadIdx.x; j < K; j += blockDim.x) m = fmaxf(m, to_f(z[j]));
  m = block_max(m, sh);
  float se = 0.0f;
  for (int j = threadIdx.x; j < K; j += blockDim.x) se += expf(to_f(z[j]) - m);
  se = block_sum(se, sh);
  const float lse = m + logf(se);
  float loss = 0.0f, tsum = 0.0f;
  for (int j = threadIdx.x; j < K; j += blockDim.x) {
    const float t = sr ? (1.0f - eps) * sr[j] + base : (j == label ? 1.0f - eps + base : base);
    loss += t * (lse - to_f(z[j]));
    tsum += t;
  }
  loss = block_sum(loss, sh);
  tsum = block_sum(tsum, sh);
  if (threadIdx.x == 0) losses[row] = bad ? NAN : loss;
  if (dlogits) {
    T* d = dlogits + row * K;
    for (int j = threadIdx.x; j < K; j += blockDim.x) {
      const float t = sr ? (1.0f - eps) * sr[j] + base : (j == label ? 1.0f - eps + base : base);
      const float p = expf(to_f(z[j]) - lse);
      d[j] = from_f<T>(bad ? NAN : (p * tsum - t) * grad_scale);
    }
  }
}

// rank(label) = #{j : z_j > z_l} + #{j < l : z_j == z_l} (first maximum wins ties, as on the
// CPU); in the top-k iff rank < k.
template <class T>
__global__ void topk_kernel(float* c1, float* c5, const T* logits, const int32_t* labels, int N,
                            int K) {
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  const T* z = logits + row * K;
  const int l = labels[row];
  const bool ok = l >= 0 && l < K;
  const float zl = ok ? to_f(z[l]) : 0.0f;
  float cnt = 0.0f;  // counts up to K < 2^24 are exact in fp32
  if (ok)
    for (int j = threadIdx.x; j < K; j += blockDim.x) {
      const float v = to_f(z[j]);
      cnt += (v > zl || (v == zl && j < l)) ? 1.0f : 0.0f;
    }
  cnt = block_sum(cnt, sh);
  if (threadIdx.x == 0) {
    c1[row] = ok && cnt < 1.0f ? 1.0f : 0.0f;
    c5[row] = ok && cnt < 5.0f ? 1.0f : 0.0f;
  }
}

}  // namespace cuda

using namespace cuda;

void CudaBackend::prepare_images(void* out, const uint8_t* images, const void* aug, int B,
                                 int S, int pad,
                                 const float* mean3_host, const float* std3_host) {
  OpScope op_scope(*this, "prepare_images");
  if (B <= 0) return;
  Norm3 nm;
  for (int c = 0; c < 3; ++c) {
    nm.mean[c] = mean3_host[c];
    nm.std[c] = std3_host[c];
  }
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned rows = static_cast<unsigned>(B) * static_cast<unsigned>(S);
    prepare_images_kernel<<<rows, std::min(256, (S + 31) / 32 * 32), 0, stream_>>>(
        static_cast<T*>(out), images, static_cast<const AugDev*>(aug), S, pad, nm);
    CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::patchify(void* patches, const void* images, int B, int S, int P) {
  OpScope op_scope(*this, "patchify");
  VG_CHECK(P > 0 && S % P == 0, "patchify: image size " << S << " not a multiple of " << P);
  const size_t total = static_cast<size_t>(B) * S * S * 3;
  if (total == 0) return;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = 16 / sizeof(T);
    if (P % V == 0 && S % V == 0 && aligned16(patches) && aligned16(images) &&
        total / V < (size_t(1) << 31)) {
      const unsigned packs = static_cast<unsigned>(total / V);
      patchify_vec_kernel<<<grid_for(packs, 256), 256, 0, stream_>>>(
          static_cast<T*>(patches), static_cast<const T*>(images), S, P, packs);
      CUDA_CHECK_LAUNCH();
      return;
    }
    const unsigned rows = static_cast<unsigned>(B) * (S / P) * (S / P);
    patchify_kernel<<<rows, std::min(256, (3 * P * P + 31) / 32 * 32), 0, stream_>>>(
        static_cast<T*>(patches), static_cast<const T*>(images), S, P);
    CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::embed_tokens(void* x, const void* patch_tokens, const void* cls,
                               const void* pos, int B, int T, int C) {
  OpScope op_scope(*this, "embed_tokens");
  const size_t total = static_cast<size_t>(B) * T * C;
  if (total == 0) return;
  dispatch_act(act_, [&](auto tag) {
    using E = typename decltype(tag)::type;
    constexpr int V = 16 / sizeof(E);
    if (C % V == 0 && aligned16(x) && aligned16(patch_tokens) && aligned16(cls) &&
        aligned16(pos) && total / V < (size_t(1) << 31)) {
      const unsigned packs = static_cast<unsigned>(total / V);
      embed_tokens_vec_kernel<<<grid_for(packs, 256), 256, 0, stream_>>>(
          static_cast<E*>(x), static_cast<const E*>(patch_tokens), static_cast<const E*>(cls),
          static_cast<const E*>(pos), T, C, packs);
      CUDA_CHECK_LAUNCH();
      return;
    }
    embed_tokens_kernel<<<static_cast<unsigned>(B) * T, std::min(256, (C + 31) / 32 * 32), 0,
                          stream_>>>(static_cast<E*>(x), static_cast<const E*>(patch_tokens),
                                     static_cast<const E*>(cls), static_cast<const E*>(pos), T, C);
    CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::embed_tokens_backward(void* dpatch_tokens, float* dcls, float* dpos,
                                        const void* dx, int B, int T, int C) {
  OpScope op_scope(*this, "embed_tokens_backward");
  const int64_t tc = static_cast<int64_t>(T) * C;
  if (tc == 0 || B == 0) return;
  dispatch_act(act_, [&](auto tag) {
    using E = typename decltype(tag)::type;
    constexpr int V = 16 / sizeof(E);
    if (C % V == 0 && aligned16(dpatch_tokens) && aligned16(dx)) {
      const int64_t threads = tc / V;
      embed_tokens_bwd_vec_kernel<<<static_cast<unsigned>((threads + 127) / 128), 128, 0,
                                    stream_>>>(static_cast<E*>(dpatch_tokens), dcls, dpos,
                                               static_cast<const E*>(dx), B, T, C);
      CUDA_CHECK_LAUNCH();
      return;
    }
    embed_tokens_bwd_kernel<<<static_cast<unsigned>((tc + 255) / 256), 256, 0, stream_>>>(
        static_cast<E*>(dpatch_tokens), dcls, dpos, static_cast<const E*>(dx), B, T, C);
    CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::gather_cls(void* rows, const void* x, int B, int T, int C) {
  OpScope op_scope(*this, "gather_cls");
  const int64_t n = static_cast<int64_t>(B) * C;
  if (n == 0) return;
  dispatch_act(act_, [&](auto tag) {
    using E = typename decltype(tag)::type;
    gather_cls_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream_>>>(
        static_cast<E*>(rows), static_cast<const E*>(x), B, T, C);
    CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::scatter_cls_backward(void* dx, const void* drows, int B, int T, int C) {
  OpScope op_scope(*this, "scatter_cls_backward");
  const int64_t n = static_cast<int64_t>(B) * C;
  if (n == 0) return;
  dispatch_act(act_, [&](auto tag) {
    using E = typename decltype(tag)::type;
    scatter_cls_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream_>>>(
        static_cast<E*>(dx), static_cast<const E*>(drows), B, T, C);
    CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::cross_entropy(float* losses, void* dlogits, const void* logits,
                                const int32_t* labels, const float* soft_targets, int N, int K,
                                float smoothing, float grad_scale) {
  OpScope op_scope(*this, "cross_entropy");
  if (N <= 0) return;
  dispatch_act(act_, [&](auto tag) {
    using E = typename decltype(tag)::type;
    cross_entropy_kernel<<<N, 256, 0, stream_>>>(losses, static_cast<E*>(dlogits),
                                                 static_cast<const E*>(logits), labels,
                                                 soft_targets, N, K, smoothing, grad_scale);
    CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::topk_correct(float* correct1, float* correct5, const void* logits,
                               const int32_t* labels, int N, int K) {
  OpScope op_scope(*this, "topk_correct");
  if (N <= 0) return;
  dispatch_act(act_, [&](auto tag) {
    using E = typename decltype(tag)::type;
    topk_kernel<<<N, 256, 0, stream_>>>(correct1, correct5, static_cast<const E*>(logits),
                                        labels, N, K);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace vitgrid
