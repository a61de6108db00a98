// Fused (FlashAttention-2 style) multi-head self-attention for bf16/fp16, non-causal, timm
// layout: qkv[B,T,3C] with per token [q(H,hd) | k(H,hd) | v(H,hd)], out[B,T,C].
// The T x T matrix never reaches device memory; the forward saves only the per-row
// log-sum-exp (natural log, of the scaled scores), fp32 [B,H,T].
//
// Tensor cores through mma.sync.m16n8k16 (bf16/fp16 in, fp32 accumulate) with ldmatrix
// fragment loads from shared memory (rows padded by 16 bytes: conflict-free ldmatrix for
// every supported head dim). Tiles are staged with 16-byte cp.async loads, double-buffered
// along the loop dimension; rows past T are zero-filled and masked (keys: score -inf / P = 0;
// queries: P = 0 in the backward, never stored). Full tiles run a branch-free, mask-free
// instantiation of the tile body; the ragged last tile a masked one in which 16-wide blocks
// wholly past T skip their MMAs, and warps whose rows lie wholly past T skip the tile, so a
// tail such as T = 197 = 3*64 + 5 costs little. Supported head dims: 32, 64, 80, 128.
//
// Forward: one CTA of 4 warps per (b, h, 64-query tile); each warp owns 16 query rows and
//   keeps its Q fragments, the O accumulator and the online-softmax state (row max, row sum,
//   base-2 exponentials with the scale folded in) in registers; the loop runs over 64-key
//   tiles of K and V.
// Backward (deterministic, no atomics; two kernels):
//   dQ kernel: one CTA per (b, h, 64-query tile) loops over 32-key tiles: S = Q K^T,
//     dP = dO V^T, P = exp(S - LSE), dS = P (dP - D), dQ += dS K. It also computes
//     D = rowsum(dO * O) for its rows (written to the workspace for the second kernel).
//   dK/dV kernel: one CTA per (b, h, 64-key tile) loops over 32-query tiles with the
//     transposed products S^T = K Q^T, dP^T = V dO^T (so P^T and dS^T land in registers in the
//     A-operand layout): dV += P^T dO, dK += dS^T Q.
// Whole-head kernels (head dim 64, T <= 224: ViT at 224 px; what FlashKernels::Best runs
//   there): one CTA per (b, h) loads Q, K, V (and dO) of the head once into shared memory and
//   runs the same tile bodies in the same order. Forward: its warps take 16-row query tiles.
//   Backward, one kernel, D kept in shared memory: the warps take the 16-key dK/dV tiles,
//   storing dS^T in shared memory, then the 16-query dQ tiles read it back: S and dP are
//   computed once (5 tile GEMMs, against the tiled kernels' 7). Same bits as the tiled kernels.
//   H100, B = 256, 12 heads: T = 197 forward 0.207 ms against 0.235 tiled and cuDNN's 0.176;
//   forward + backward on an H200 0.756-0.782 ms against 1.02 tiled (the backward that
//   recomputed S and dP: 0.785-0.792), T = 50 0.128 against 0.163 (0.136) (tools/MEASURED.md).
//   Every output element is written by exactly one thread after a fixed-order fp32
//   accumulation: bitwise reproducible run to run. Cost of that choice against FA2's atomic
//   dQ in the tiled kernels: S and dP are computed twice (7 tile GEMMs instead of 5, i.e. 1.4x
//   the backward tensor-core work), no fp32 dQ workspace, no atomics and no cast kernel.
// Kernels are templated on tile sizes and on MT (16-row MMA tiles per warp: one shared-memory
// fragment feeds MT MMAs); Cfg below holds the choice per head dim and the measurements.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda_backend_impl.h"
#include "flash_attention.h"
#include "kernel_util.cuh"

namespace vitgrid {
namespace cuda {

namespace {

constexpr int kThreads = 128;  // 4 warps, 16 rows each
constexpr int kRows = 64;      // rows owned by one CTA (queries forward/dQ, keys dK/dV)
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; valid == false zero-fills (the source is not read).
__device__ __forceinline__ void cp_async16(void* s, const void* g, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(s)), "l"(g),
               "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 b16 matrices; lane l gives the address of row (l & 7) of matrix (l >> 3).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// c[16x8] += a[16x16] b[16x8], fp32 accumulators.
template <class E>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same<E, __nv_bfloat16>::value) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <class E>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same<E, __nv_bfloat16>::value) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

__device__ __forceinline__ float ex2(float x) {  // 2^x; ex2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Shared-memory layouts of row-major [rows x HD] tiles of E, both conflict-free for ldmatrix's
// 8-row reads. Padded: rows of HD + 8 elements (the tiled kernels). Swizzled: rows of HD
// elements whose 16-byte chunks are permuted by XOR with (row & 7) (the whole-head kernels, which
// hold three or four operands of a head). off(r, c): element offset of row r,
// column c (a multiple of 8); a tile addressed from the base of its own rows starts at a row
// that is a multiple of 8.
template <int HD>
struct Padded {
  static constexpr int kStride = HD + 8;
  __device__ __forceinline__ static int off(int r, int c) { return r * kStride + c; }
};
template <int HD>
struct Swizzled {
  static_assert(HD % 64 == 0, "the swizzle permutes groups of 8 chunks of 16 bytes");
  __device__ __forceinline__ static int off(int r, int c) {
    const int ch = c >> 3;
    return r * HD + (((ch & ~7) | ((ch ^ r) & 7)) << 3) + (c & 7);
  }
};

// R rows of HD elements (row stride ld in global, HD + 8 in shared) from g; rows >= nvalid
// are zero-filled. nvalid >= 1.
template <class E, int HD, int R>
__device__ __forceinline__ void load_tile(E* s, const E* g, int64_t ld, int nvalid) {
  constexpr int CPR = HD / 8, SP = HD + 8;
#pragma unroll
  for (int i = threadIdx.x; i < R * CPR; i += kThreads) {
    const int r = i / CPR, c = (i % CPR) * 8;
    const bool v = r < nvalid;
    cp_async16(s + r * SP + c, v ? g + r * ld + c : g, v);
  }
}

// The warp's 16 rows of a [16 x HD] fp32 accumulator, times mul, rounded to E, staged in
// shared memory (stride SP, rows of this warp only), then stored with 16-byte writes to
// rows t0 + r (r < 16, t0 + r < T) of g (row stride ld).
template <class E, int HD>
__device__ __forceinline__ void store_rows(E* stage, const float (&acc)[HD / 8][4], float mul0,
                                           float mul1, E* g, int64_t ld, int t0, int T) {
  constexpr int SP = HD + 8, DT = HD / 8;
  const int lane = threadIdx.x & 31, r0 = lane >> 2, c0 = (lane & 3) * 2;
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    *reinterpret_cast<uint32_t*>(stage + r0 * SP + dt * 8 + c0) =
        pack2<E>(acc[dt][0] * mul0, acc[dt][1] * mul0);
    *reinterpret_cast<uint32_t*>(stage + (r0 + 8) * SP + dt * 8 + c0) =
        pack2<E>(acc[dt][2] * mul1, acc[dt][3] * mul1);
  }
  __syncwarp();
  for (int i = lane; i < 16 * DT; i += 32) {
    const int r = i / DT, c = (i % DT) * 8;
    if (t0 + r < T)
      *reinterpret_cast<uint4*>(g + (t0 + r) * ld + c) =
          *reinterpret_cast<const uint4*>(stage + r * SP + c);
  }
}

// ---------------------------------------------------------------------------------------
// Forward
// One key tile for the warp's MT x 16 query rows (each K/V fragment loaded from shared memory
// feeds MT MMAs). kFull: all BN keys valid (no masks, no branches inside the unrolled loops,
// so loads and MMAs interleave freely); else kvn valid keys.
template <class Lay, class E, int HD, int BN, int MT, bool kFull>
__device__ __forceinline__ void fwd_tile(const E* ks_, const E* vs_, int kvn,
                                         const uint32_t (&qf)[MT][HD / 16][4],
                                         float (&o)[MT][HD / 8][4], float (&mrow)[MT][2],
                                         float (&lrow)[MT][2], float sl2, int lane, int lr,
                                         int lc) {
  constexpr int KS = HD / 16, NT = BN / 8, DT = HD / 8;
  float s[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < NT; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      if (kFull || np * 16 < kvn) {
        uint32_t r[4];
        ldsm_x4(r, ks_ + Lay::off(np * 16 + lr, ks * 16 + lc));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<E>(s[mt][2 * np], qf[mt][ks], r[0], r[2]);
          mma<E>(s[mt][2 * np + 1], qf[mt][ks], r[1], r[3]);
        }
      }
    }
  }
  // mask, online softmax (base 2, scale folded in)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float mx0 = mrow[mt][0], mx1 = mrow[mt][1];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (!kFull && nt * 8 + (lane & 3) * 2 + e >= kvn)
          s[mt][nt][e] = s[mt][nt][e + 2] = -INFINITY;
        mx0 = fmaxf(mx0, s[mt][nt][e]);
        mx1 = fmaxf(mx1, s[mt][nt][e + 2]);
      }
    }
    mx0 = quad_max(mx0);
    mx1 = quad_max(mx1);
    const float al0 = ex2((mrow[mt][0] - mx0) * sl2), al1 = ex2((mrow[mt][1] - mx1) * sl2);
    mrow[mt][0] = mx0;
    mrow[mt][1] = mx1;
    const float mb0 = mx0 * sl2, mb1 = mx1 * sl2;
    float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[mt][nt][e] = ex2(fmaf(s[mt][nt][e], sl2, -mb0));
        s[mt][nt][e + 2] = ex2(fmaf(s[mt][nt][e + 2], sl2, -mb1));
        rs0 += s[mt][nt][e];
        rs1 += s[mt][nt][e + 2];
      }
    }
    lrow[mt][0] = lrow[mt][0] * al0 + rs0;
    lrow[mt][1] = lrow[mt][1] * al1 + rs1;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[mt][dt][0] *= al0;
      o[mt][dt][1] *= al0;
      o[mt][dt][2] *= al1;
      o[mt][dt][3] *= al1;
    }
  }
  // O += P V
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    if (kFull || kk * 16 < kvn) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack2<E>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<E>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<E>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<E>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t r[4];
        ldsm_x4_t(r, vs_ + Lay::off(kk * 16 + lr, dp * 16 + lc));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<E>(o[mt][2 * dp], a[mt], r[0], r[1]);
          mma<E>(o[mt][2 * dp + 1], a[mt], r[2], r[3]);
        }
      }
    }
  }
}

// One CTA of 4 warps per (b, h, 64*MT query rows); warp w owns rows [w*16*MT, (w+1)*16*MT).
template <class E, int HD, int BN, int MT, int MinB>
__global__ void __launch_bounds__(kThreads, MinB)
    fa_fwd_kernel(E* __restrict__ out, float* __restrict__ lse, const E* __restrict__ qkv, int T,
                  int H, int ntq, float scale) {
  constexpr int SP = HD + 8, KS = HD / 16, DT = HD / 8, RQ = kRows * MT, WR = 16 * MT;
  extern __shared__ __align__(16) unsigned char smem[];
  E* sQ = reinterpret_cast<E*>(smem);  // [RQ][SP], later the output staging
  E* sK = sQ + RQ * SP;                // [2][BN][SP]
  E* sV = sK + 2 * BN * SP;            // [2][BN][SP]

  const int tile = blockIdx.x % ntq, bh = blockIdx.x / ntq, h = bh % H, b = bh / H;
  const int C = H * HD;
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const int q0 = tile * RQ, nq = min(RQ, T - q0);
  const E* base = qkv + static_cast<int64_t>(b) * T * ld + h * HD;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool active = warp * WR < nq;  // warp-uniform
  const int lr = (lane & 7) + ((lane >> 3) & 1) * 8, lc = (lane >> 4) * 8;
  const float sl2 = scale * kLog2e;

  load_tile<E, HD, RQ>(sQ, base + q0 * ld, ld, nq);
  load_tile<E, HD, BN>(sK, base + C, ld, min(BN, T));
  load_tile<E, HD, BN>(sV, base + 2 * C, ld, min(BN, T));
  cp_async_commit();

  uint32_t qf[MT][KS][4];
  float o[MT][DT][4], mrow[MT][2], lrow[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < DT; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
    mrow[mt][0] = mrow[mt][1] = -INFINITY;
    lrow[mt][0] = lrow[mt][1] = 0.0f;
  }

  const int nkv = (T + BN - 1) / BN;
  for (int j = 0; j < nkv; ++j) {
    const int buf = j & 1;
    if (j + 1 < nkv) {
      const int n0 = (j + 1) * BN;
      load_tile<E, HD, BN>(sK + (buf ^ 1) * BN * SP, base + C + n0 * ld, ld, min(BN, T - n0));
      load_tile<E, HD, BN>(sV + (buf ^ 1) * BN * SP, base + 2 * C + n0 * ld, ld,
                           min(BN, T - n0));
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (active) {
      if (j == 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int ks = 0; ks < KS; ++ks)
            ldsm_x4(qf[mt][ks], sQ + (warp * WR + mt * 16 + lr) * SP + ks * 16 + lc);
      }
      const int kvn = min(BN, T - j * BN);
      const E* ks_ = sK + buf * BN * SP;
      const E* vs_ = sV + buf * BN * SP;
      if (kvn == BN)
        fwd_tile<Padded<HD>, E, HD, BN, MT, true>(ks_, vs_, kvn, qf, o, mrow, lrow, sl2, lane, lr,
                                                  lc);
      else
        fwd_tile<Padded<HD>, E, HD, BN, MT, false>(ks_, vs_, kvn, qf, o, mrow, lrow, sl2, lane, lr,
                                                   lc);
    }
    __syncthreads();
  }

  if (active) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float l0 = quad_sum(lrow[mt][0]), l1 = quad_sum(lrow[mt][1]);
      const int t0 = q0 + warp * WR + mt * 16;
      store_rows<E, HD>(sQ + (warp * WR + mt * 16) * SP, o[mt], 1.0f / l0, 1.0f / l1,
                        out + static_cast<int64_t>(b) * T * C + h * HD, C, t0, T);
      if ((lane & 3) == 0) {
        const int r = t0 + (lane >> 2);
        float* L = lse + static_cast<int64_t>(bh) * T;
        if (r < T) L[r] = mrow[mt][0] * scale + logf(l0);
        if (r + 8 < T) L[r + 8] = mrow[mt][1] * scale + logf(l1);
      }
    }
  }
}

// D = rowsum(dO * O) of one row, two lanes per row (lanes 2i and 2i + 1: half a head each, in
// order, then the pair's sum); row_off: the row's element offset in out / dout, valid false for
// rows past T (sum 0). Every lane of the warp calls it.
template <class E, int HD>
__device__ __forceinline__ float row_dot_pair(const E* out, const E* dout, int64_t row_off,
                                              int half, bool valid) {
  float acc = 0.0f;
  if (valid) {
    const int64_t off = row_off + half * (HD / 2);
#pragma unroll
    for (int c = 0; c < HD / 2; c += 8) {
      const Pack<E, 8> x = *reinterpret_cast<const Pack<E, 8>*>(out + off + c);
      const Pack<E, 8> y = *reinterpret_cast<const Pack<E, 8>*>(dout + off + c);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc = fmaf(to_f(x.v[e]), to_f(y.v[e]), acc);
    }
  }
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  return acc;
}

// ---------------------------------------------------------------------------------------
// Backward, dQ (and D = rowsum(dO * O))
template <class Lay, class E, int HD, int BN, int MT, bool kFull>
__device__ __forceinline__ void dq_tile(const E* ks_, const E* vs_, int kvn,
                                        const uint32_t (&qf)[MT][HD / 16][4],
                                        const uint32_t (&df)[MT][HD / 16][4],
                                        float (&dq)[MT][HD / 8][4], const float (&L)[MT][2],
                                        const float (&D)[MT][2], float sl2, int lane, int lr,
                                        int lc) {
  constexpr int KS = HD / 16, NT = BN / 8;
  float s[MT][NT][4], dp[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
      dp[mt][i][0] = dp[mt][i][1] = dp[mt][i][2] = dp[mt][i][3] = 0.0f;
    }
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      if (kFull || np * 16 < kvn) {
        uint32_t r[4];
        ldsm_x4(r, ks_ + Lay::off(np * 16 + lr, ks * 16 + lc));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<E>(s[mt][2 * np], qf[mt][ks], r[0], r[2]);
          mma<E>(s[mt][2 * np + 1], qf[mt][ks], r[1], r[3]);
        }
        ldsm_x4(r, vs_ + Lay::off(np * 16 + lr, ks * 16 + lc));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<E>(dp[mt][2 * np], df[mt][ks], r[0], r[2]);
          mma<E>(dp[mt][2 * np + 1], df[mt][ks], r[1], r[3]);
        }
      }
    }
  }
  // dS = P * (dP - D), kept in s
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool v = kFull || nt * 8 + (lane & 3) * 2 + e < kvn;
        const float p0 = v ? ex2(fmaf(s[mt][nt][e], sl2, -L[mt][0])) : 0.0f;
        const float p1 = v ? ex2(fmaf(s[mt][nt][e + 2], sl2, -L[mt][1])) : 0.0f;
        s[mt][nt][e] = p0 * (dp[mt][nt][e] - D[mt][0]);
        s[mt][nt][e + 2] = p1 * (dp[mt][nt][e + 2] - D[mt][1]);
      }
    }
  // dQ += dS K
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    if (kFull || kk * 16 < kvn) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack2<E>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<E>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<E>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<E>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int d2 = 0; d2 < HD / 16; ++d2) {
        uint32_t r[4];
        ldsm_x4_t(r, ks_ + Lay::off(kk * 16 + lr, d2 * 16 + lc));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<E>(dq[mt][2 * d2], a[mt], r[0], r[1]);
          mma<E>(dq[mt][2 * d2 + 1], a[mt], r[2], r[3]);
        }
      }
    }
  }
}

template <class E, int HD, int BN, int MT, int MinB>
__global__ void __launch_bounds__(kThreads, MinB)
    fa_bwd_dq_kernel(E* __restrict__ dqkv, float* __restrict__ Dws, const E* __restrict__ dout,
                     const E* __restrict__ qkv, const E* __restrict__ out,
                     const float* __restrict__ lse, int T, int H, int ntq, float scale) {
  constexpr int SP = HD + 8, KS = HD / 16, DT = HD / 8, RQ = kRows * MT, WR = 16 * MT;
  extern __shared__ __align__(16) unsigned char smem[];
  E* sQ = reinterpret_cast<E*>(smem);  // [RQ][SP], later the dQ staging
  E* sO = sQ + RQ * SP;                // dO [RQ][SP]
  E* sK = sO + RQ * SP;                // [2][BN][SP]
  E* sV = sK + 2 * BN * SP;            // [2][BN][SP]
  float* sD = reinterpret_cast<float*>(sV + 2 * BN * SP);  // [RQ]

  const int tile = blockIdx.x % ntq, bh = blockIdx.x / ntq, h = bh % H, b = bh / H;
  const int C = H * HD;
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const int q0 = tile * RQ, nq = min(RQ, T - q0);
  const E* base = qkv + static_cast<int64_t>(b) * T * ld + h * HD;
  const int64_t obase = static_cast<int64_t>(b) * T * C + h * HD;  // out / dout head base
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool active = warp * WR < nq;
  const int lr = (lane & 7) + ((lane >> 3) & 1) * 8, lc = (lane >> 4) * 8;
  const float sl2 = scale * kLog2e;

  load_tile<E, HD, RQ>(sQ, base + q0 * ld, ld, nq);
  load_tile<E, HD, RQ>(sO, dout + obase + static_cast<int64_t>(q0) * C, C, nq);
  load_tile<E, HD, BN>(sK, base + C, ld, min(BN, T));
  load_tile<E, HD, BN>(sV, base + 2 * C, ld, min(BN, T));
  cp_async_commit();

  float L[MT][2], D[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) L[mt][0] = L[mt][1] = D[mt][0] = D[mt][1] = 0.0f;
  if (active) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {  // D: two lanes per row, half a head each
      const int r = warp * WR + mt * 16 + (lane >> 1), half = lane & 1, t = q0 + r;
      const float acc =
          row_dot_pair<E, HD>(out, dout, obase + static_cast<int64_t>(t) * C, half, t < T);
      if (half == 0) {
        sD[r] = acc;
        if (t < T) Dws[static_cast<int64_t>(bh) * T + t] = acc;
      }
    }
    __syncwarp();
    const float* Lg = lse + static_cast<int64_t>(bh) * T;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int r0 = warp * WR + mt * 16 + (lane >> 2), t0 = q0 + r0;
      if (t0 < T) L[mt][0] = Lg[t0] * kLog2e;
      if (t0 + 8 < T) L[mt][1] = Lg[t0 + 8] * kLog2e;
      D[mt][0] = sD[r0];
      D[mt][1] = sD[r0 + 8];
    }
  }

  uint32_t qf[MT][KS][4], df[MT][KS][4];
  float dq[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < DT; ++i) dq[mt][i][0] = dq[mt][i][1] = dq[mt][i][2] = dq[mt][i][3] = 0.0f;

  const int nkv = (T + BN - 1) / BN;
  for (int j = 0; j < nkv; ++j) {
    const int buf = j & 1;
    if (j + 1 < nkv) {
      const int n0 = (j + 1) * BN;
      load_tile<E, HD, BN>(sK + (buf ^ 1) * BN * SP, base + C + n0 * ld, ld, min(BN, T - n0));
      load_tile<E, HD, BN>(sV + (buf ^ 1) * BN * SP, base + 2 * C + n0 * ld, ld,
                           min(BN, T - n0));
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (active) {
      if (j == 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int ks = 0; ks < KS; ++ks) {
            ldsm_x4(qf[mt][ks], sQ + (warp * WR + mt * 16 + lr) * SP + ks * 16 + lc);
            ldsm_x4(df[mt][ks], sO + (warp * WR + mt * 16 + lr) * SP + ks * 16 + lc);
          }
      }
      const int kvn = min(BN, T - j * BN);
      const E* ks_ = sK + buf * BN * SP;
      const E* vs_ = sV + buf * BN * SP;
      if (kvn == BN)
        dq_tile<Padded<HD>, E, HD, BN, MT, true>(ks_, vs_, kvn, qf, df, dq, L, D, sl2, lane, lr,
                                                 lc);
      else
        dq_tile<Padded<HD>, E, HD, BN, MT, false>(ks_, vs_, kvn, qf, df, dq, L, D, sl2, lane, lr,
                                                  lc);
    }
    __syncthreads();
  }

  if (active) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      store_rows<E, HD>(sQ + (warp * WR + mt * 16) * SP, dq[mt], scale, scale,
                        dqkv + static_cast<int64_t>(b) * T * ld + h * HD, ld,
                        q0 + warp * WR + mt * 16, T);
  }
}

// ---------------------------------------------------------------------------------------
// Backward, dK and dV
// One query tile for the warp's MT x 16 key rows (kw, vw: the warp's rows of K and V in
// shared memory, read when the fragments are not held in registers).
// kStoreDS (the whole-head backward): dS^T, rounded to E as the dK product takes it, is also
// stored to ds (row r: the warp's key r, column c: the tile's query c; row stride ss elements),
// 0 for keys >= kvalid (the dQ product of the tiled kernels sees 0 there).
template <class Lay, class E, int HD, int BM, int MT, bool kHold, bool kFull, bool kStoreDS = false>
__device__ __forceinline__ void dkdv_tile(const E* qs_, const E* os_, const float* Lb,
                                          const float* Db, int qn, const E* kw, const E* vw,
                                          const uint32_t (&kf)[MT][kHold ? HD / 16 : 1][4],
                                          const uint32_t (&vf)[MT][kHold ? HD / 16 : 1][4],
                                          float (&dk)[MT][HD / 8][4], float (&dv)[MT][HD / 8][4],
                                          float sl2, int lane, int lr, int lc, E* ds = nullptr,
                                          int ss = 0, int kvalid = 0) {
  constexpr int KS = HD / 16, NT = BM / 8;
  float s[MT][NT][4], dp[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
      dp[mt][i][0] = dp[mt][i][1] = dp[mt][i][2] = dp[mt][i][3] = 0.0f;
    }
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    uint32_t ka[MT][4], va[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if constexpr (kHold) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          ka[mt][i] = kf[mt][kHold ? ks : 0][i];
          va[mt][i] = vf[mt][kHold ? ks : 0][i];
        }
      } else {
        ldsm_x4(ka[mt], kw + Lay::off(mt * 16 + lr, ks * 16 + lc));
        ldsm_x4(va[mt], vw + Lay::off(mt * 16 + lr, ks * 16 + lc));
      }
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      if (kFull || np * 16 < qn) {
        uint32_t r[4];
        ldsm_x4(r, qs_ + Lay::off(np * 16 + lr, ks * 16 + lc));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<E>(s[mt][2 * np], ka[mt], r[0], r[2]);
          mma<E>(s[mt][2 * np + 1], ka[mt], r[1], r[3]);
        }
        ldsm_x4(r, os_ + Lay::off(np * 16 + lr, ks * 16 + lc));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<E>(dp[mt][2 * np], va[mt], r[0], r[2]);
          mma<E>(dp[mt][2 * np + 1], va[mt], r[1], r[3]);
        }
      }
    }
  }
  // P^T (kept in s) and dS^T = P^T (dP^T - D) (kept in dp); columns are queries
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = nt * 8 + (lane & 3) * 2 + e;
      const bool v = kFull || col < qn;
      const float Lc = Lb[col], Dc = Db[col];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float p0 = v ? ex2(fmaf(s[mt][nt][e], sl2, -Lc)) : 0.0f;
        const float p1 = v ? ex2(fmaf(s[mt][nt][e + 2], sl2, -Lc)) : 0.0f;
        dp[mt][nt][e] = p0 * (dp[mt][nt][e] - Dc);
        dp[mt][nt][e + 2] = p1 * (dp[mt][nt][e + 2] - Dc);
        s[mt][nt][e] = p0;
        s[mt][nt][e + 2] = p1;
      }
    }
  }
  // dV += P^T dO, dK += dS^T Q
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) {
    if (kFull || kk * 16 < qn) {
      uint32_t ap[MT][4], as[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        ap[mt][0] = pack2<E>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        ap[mt][1] = pack2<E>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        ap[mt][2] = pack2<E>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        ap[mt][3] = pack2<E>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        as[mt][0] = pack2<E>(dp[mt][2 * kk][0], dp[mt][2 * kk][1]);
        as[mt][1] = pack2<E>(dp[mt][2 * kk][2], dp[mt][2 * kk][3]);
        as[mt][2] = pack2<E>(dp[mt][2 * kk + 1][0], dp[mt][2 * kk + 1][1]);
        as[mt][3] = pack2<E>(dp[mt][2 * kk + 1][2], dp[mt][2 * kk + 1][3]);
        if constexpr (kStoreDS) {  // the A fragment's four 2-element pieces, at their places
          const int r = mt * 16 + (lane >> 2), c = kk * 16 + (lane & 3) * 2;
          const bool v0 = r < kvalid, v1 = r + 8 < kvalid;
          *reinterpret_cast<uint32_t*>(ds + r * ss + c) = v0 ? as[mt][0] : 0u;
          *reinterpret_cast<uint32_t*>(ds + (r + 8) * ss + c) = v1 ? as[mt][1] : 0u;
          *reinterpret_cast<uint32_t*>(ds + r * ss + c + 8) = v0 ? as[mt][2] : 0u;
          *reinterpret_cast<uint32_t*>(ds + (r + 8) * ss + c + 8) = v1 ? as[mt][3] : 0u;
        }
      }
#pragma unroll
      for (int d2 = 0; d2 < HD / 16; ++d2) {
        uint32_t r[4];
        ldsm_x4_t(r, os_ + Lay::off(kk * 16 + lr, d2 * 16 + lc));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<E>(dv[mt][2 * d2], ap[mt], r[0], r[1]);
          mma<E>(dv[mt][2 * d2 + 1], ap[mt], r[2], r[3]);
        }
        ldsm_x4_t(r, qs_ + Lay::off(kk * 16 + lr, d2 * 16 + lc));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<E>(dk[mt][2 * d2], as[mt], r[0], r[1]);
          mma<E>(dk[mt][2 * d2 + 1], as[mt], r[2], r[3]);
        }
      }
    }
  }
}

// One CTA of 4 warps per (b, h, 64*MT key rows); warp w owns keys [w*16*MT, (w+1)*16*MT).
template <class E, int HD, int BM, int MT, bool kHold, int MinB>
__global__ void __launch_bounds__(kThreads, MinB)
    fa_bwd_dkdv_kernel(E* __restrict__ dqkv, const E* __restrict__ dout,
                       const E* __restrict__ qkv, const float* __restrict__ lse,
                       const float* __restrict__ Dws, int T, int H, int ntk, float scale) {
  constexpr int SP = HD + 8, KS = HD / 16, DT = HD / 8, RK = kRows * MT, WR = 16 * MT;
  extern __shared__ __align__(16) unsigned char smem[];
  E* sK = reinterpret_cast<E*>(smem);  // [RK][SP], later the dK staging
  E* sV = sK + RK * SP;                // [RK][SP], later the dV staging
  E* sQ = sV + RK * SP;                // [2][BM][SP]
  E* sO = sQ + 2 * BM * SP;            // dO [2][BM][SP]
  float* sL = reinterpret_cast<float*>(sO + 2 * BM * SP);  // [2][BM] lse * log2(e)
  float* sD = sL + 2 * BM;                                 // [2][BM]

  const int tile = blockIdx.x % ntk, bh = blockIdx.x / ntk, h = bh % H, b = bh / H;
  const int C = H * HD;
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const int k0 = tile * RK, nk = min(RK, T - k0);
  const E* base = qkv + static_cast<int64_t>(b) * T * ld + h * HD;
  const E* obase = dout + static_cast<int64_t>(b) * T * C + h * HD;
  const float* Lg = lse + static_cast<int64_t>(bh) * T;
  const float* Dg = Dws + static_cast<int64_t>(bh) * T;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool active = warp * WR < nk;
  const int lr = (lane & 7) + ((lane >> 3) & 1) * 8, lc = (lane >> 4) * 8;
  const float sl2 = scale * kLog2e;

  auto load_stats = [&](int buf, int m0) {
    for (int i = threadIdx.x; i < BM; i += kThreads) {
      const int t = m0 + i;
      sL[buf * BM + i] = t < T ? Lg[t] * kLog2e : 0.0f;
      sD[buf * BM + i] = t < T ? Dg[t] : 0.0f;
    }
  };

  load_tile<E, HD, RK>(sK, base + C + k0 * ld, ld, nk);
  load_tile<E, HD, RK>(sV, base + 2 * C + k0 * ld, ld, nk);
  load_tile<E, HD, BM>(sQ, base, ld, min(BM, T));
  load_tile<E, HD, BM>(sO, obase, C, min(BM, T));
  cp_async_commit();
  load_stats(0, 0);

  uint32_t kf[MT][kHold ? KS : 1][4], vf[MT][kHold ? KS : 1][4];
  float dk[MT][DT][4], dv[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      dk[mt][i][0] = dk[mt][i][1] = dk[mt][i][2] = dk[mt][i][3] = 0.0f;
      dv[mt][i][0] = dv[mt][i][1] = dv[mt][i][2] = dv[mt][i][3] = 0.0f;
    }
  const E* kw = sK + warp * WR * SP;
  const E* vw = sV + warp * WR * SP;

  const int nqt = (T + BM - 1) / BM;
  for (int j = 0; j < nqt; ++j) {
    const int buf = j & 1;
    if (j + 1 < nqt) {
      const int m0 = (j + 1) * BM;
      load_tile<E, HD, BM>(sQ + (buf ^ 1) * BM * SP, base + m0 * ld, ld, min(BM, T - m0));
      load_tile<E, HD, BM>(sO + (buf ^ 1) * BM * SP, obase + static_cast<int64_t>(m0) * C, C,
                           min(BM, T - m0));
      cp_async_commit();
      load_stats(buf ^ 1, m0);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (active) {
      if (kHold && j == 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int ks = 0; ks < (kHold ? KS : 1); ++ks) {
            ldsm_x4(kf[mt][ks], kw + (mt * 16 + lr) * SP + ks * 16 + lc);
            ldsm_x4(vf[mt][ks], vw + (mt * 16 + lr) * SP + ks * 16 + lc);
          }
      }
      const int qn = min(BM, T - j * BM);
      const E* qs_ = sQ + buf * BM * SP;
      const E* os_ = sO + buf * BM * SP;
      const float* Lb = sL + buf * BM;
      const float* Db = sD + buf * BM;
      if (qn == BM)
        dkdv_tile<Padded<HD>, E, HD, BM, MT, kHold, true>(qs_, os_, Lb, Db, qn, kw, vw, kf, vf, dk,
                                                          dv, sl2, lane, lr, lc);
      else
        dkdv_tile<Padded<HD>, E, HD, BM, MT, kHold, false>(qs_, os_, Lb, Db, qn, kw, vw, kf, vf, dk,
                                                           dv, sl2, lane, lr, lc);
    }
    __syncthreads();
  }

  if (active) {
    E* g = dqkv + static_cast<int64_t>(b) * T * ld + h * HD;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int r = warp * WR + mt * 16;
      store_rows<E, HD>(sK + r * SP, dk[mt], scale, scale, g + C, ld, k0 + r, T);
      store_rows<E, HD>(sV + r * SP, dv[mt], 1.0f, 1.0f, g + 2 * C, ld, k0 + r, T);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Whole-head kernels (T <= kHeadMaxT): one CTA per (b, h) loads the head's operands
// once into shared memory (swizzled rows, T rounded up to 16) and runs the tiled kernels' tile
// bodies over them, in the same order: the same bits as the tiled kernels, without their
// reloads of K and V (forward, dQ) or Q and dO (dK/dV) by every 64-row CTA of the head, nor
// the second backward kernel's pass over D, nor (backward) the dQ tiles' second computation of
// S and dP. At ViT's sequence lengths (T = 197: four 64-row tiles per head) that saves 20-25%
// of the time (tools/MEASURED.md); both are then bound by the tile bodies' ldmatrix traffic
// from shared memory, not by the tensor cores. kHeadMaxT: the backward's shared memory
// (Q, K, V, dO and dS^T: 4 T 128 + 2 T^2 bytes) within the SM's 227 KB.
constexpr int kHeadMaxT = 224;
// The forward: at most 8 warps, MinB 2 (two CTAs per SM: registers capped at
// 65536 / (2 x 32 x warps)). The backward: a warp per 16-key tile, one CTA per SM (13 or 14
// warps get 128 registers), query tiles of 16 in its dK/dV loop.
constexpr int kHeadFwdWarps = 8, kHeadFwdMinB = 2;
constexpr int kHeadBwdWarps = kHeadMaxT / 16, kHeadBwdBM = 16;

// Rows [0, R) of a head's operand (row stride ld in global) into a swizzled [R x HD] tile;
// rows >= nvalid zero-filled. Every thread of the CTA takes part.
template <class E, int HD>
__device__ __forceinline__ void load_head(E* s, const E* g, int64_t ld, int R, int nvalid) {
  constexpr int CPR = HD / 8;
  for (int i = threadIdx.x; i < R * CPR; i += blockDim.x) {
    const int r = i / CPR, c = (i % CPR) * 8;
    const bool v = r < nvalid;
    cp_async16(s + Swizzled<HD>::off(r, c), v ? g + r * ld + c : g, v);
  }
}

// The warp's 16 rows of a [16 x HD] fp32 accumulator, times mul, rounded to E (store_rows'
// values), stored from the registers to rows t0 + r (< T) of g (row stride ld).
template <class E, int HD>
__device__ __forceinline__ void store_acc(const float (&acc)[HD / 8][4], float mul0, float mul1,
                                          E* g, int64_t ld, int t0, int T) {
  const int lane = threadIdx.x & 31, r = t0 + (lane >> 2), c0 = (lane & 3) * 2;
#pragma unroll
  for (int dt = 0; dt < HD / 8; ++dt) {
    if (r < T)
      *reinterpret_cast<uint32_t*>(g + r * ld + dt * 8 + c0) =
          pack2<E>(acc[dt][0] * mul0, acc[dt][1] * mul0);
    if (r + 8 < T)
      *reinterpret_cast<uint32_t*>(g + (r + 8) * ld + dt * 8 + c0) =
          pack2<E>(acc[dt][2] * mul1, acc[dt][3] * mul1);
  }
}

// Forward: Q, K and V of the head in shared memory; of nw warps, warp w takes the 16-row query
// tiles w, w + nw, ... through the key tiles of BN as fa_fwd_kernel does.
template <class E, int HD, int BN, int NW, int MinB>
__global__ void __launch_bounds__(NW * 32, MinB)
    fa_head_fwd_kernel(E* __restrict__ out, float* __restrict__ lse, const E* __restrict__ qkv,
                       int T, int H, float scale) {
  using Lay = Swizzled<HD>;
  constexpr int KS = HD / 16, DT = HD / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  const int TP = (T + 15) & ~15;
  E* sQ = reinterpret_cast<E*>(smem);  // [TP][HD] each
  E* sK = sQ + TP * HD;
  E* sV = sK + TP * HD;

  const int bh = blockIdx.x, h = bh % H, b = bh / H;
  const int C = H * HD;
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const E* base = qkv + static_cast<int64_t>(b) * T * ld + h * HD;
  load_head<E, HD>(sQ, base, ld, TP, T);
  load_head<E, HD>(sK, base + C, ld, TP, T);
  load_head<E, HD>(sV, base + 2 * C, ld, TP, T);
  cp_async_commit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int lr = (lane & 7) + ((lane >> 3) & 1) * 8, lc = (lane >> 4) * 8;
  const float sl2 = scale * kLog2e;
  E* og = out + static_cast<int64_t>(b) * T * C + h * HD;
  float* Lg = lse + static_cast<int64_t>(bh) * T;
  cp_async_wait<0>();
  __syncthreads();

  for (int tq = warp; tq * 16 < T; tq += nw) {
    uint32_t qf[1][KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) ldsm_x4(qf[0][ks], sQ + Lay::off(tq * 16 + lr, ks * 16 + lc));
    float o[1][DT][4], mrow[1][2], lrow[1][2];
#pragma unroll
    for (int i = 0; i < DT; ++i) o[0][i][0] = o[0][i][1] = o[0][i][2] = o[0][i][3] = 0.0f;
    mrow[0][0] = mrow[0][1] = -INFINITY;
    lrow[0][0] = lrow[0][1] = 0.0f;
    for (int j = 0; j * BN < T; ++j) {
      const int kvn = min(BN, T - j * BN);
      const E* ks_ = sK + j * BN * HD;
      const E* vs_ = sV + j * BN * HD;
      if (kvn == BN)
        fwd_tile<Lay, E, HD, BN, 1, true>(ks_, vs_, kvn, qf, o, mrow, lrow, sl2, lane, lr, lc);
      else
        fwd_tile<Lay, E, HD, BN, 1, false>(ks_, vs_, kvn, qf, o, mrow, lrow, sl2, lane, lr, lc);
    }
    const float l0 = quad_sum(lrow[0][0]), l1 = quad_sum(lrow[0][1]);
    const int t0 = tq * 16;
    store_acc<E, HD>(o[0], 1.0f / l0, 1.0f / l1, og, C, t0, T);
    if ((lane & 3) == 0) {
      const int r = t0 + (lane >> 2);
      if (r < T) Lg[r] = mrow[0][0] * scale + logf(l0);
      if (r + 8 < T) Lg[r + 8] = mrow[0][1] * scale + logf(l1);
    }
  }
}

// Rows of the backward's per-query statistics in shared memory: T rounded up to 64, as far as
// the tile bodies read them.
__host__ __device__ constexpr int head_stat_rows(int T) { return (T + 63) & ~63; }

// Backward: Q, K, V and dO of the head in shared memory, L = lse * log2(e) and
// D = rowsum(dO * O) (the tiled dQ kernel's sums) beside them, and dS^T [TP x (TP + 8)] of E.
// Phase 1: warp w takes the 16-key tiles w, w + nw, ... through the tiled dK/dV kernel's loop
// over query tiles of BM (16: no spills under the 128 registers of 13-14 warps), storing dS^T
// as it goes. Phase 2: warp w takes the 16-query tiles w, w + nw, ...: dQ = dS K over the
// 16-key blocks in order, dS read back through transposing ldmatrix: the tiled dQ kernel's
// products in its order, without computing S and dP again (5 tile GEMMs instead of 7).
template <class E, int HD, int BM, int NW>
__global__ void __launch_bounds__(NW * 32, 1)
    fa_head_bwd_kernel(E* __restrict__ dqkv, const E* __restrict__ dout, const E* __restrict__ qkv,
                       const E* __restrict__ out, const float* __restrict__ lse, int T, int H,
                       float scale) {
  using Lay = Swizzled<HD>;
  constexpr int DT = HD / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  const int TP = (T + 15) & ~15, TS = head_stat_rows(T), SS = TP + 8;
  E* sQ = reinterpret_cast<E*>(smem);  // [TP][HD] each
  E* sK = sQ + TP * HD;
  E* sV = sK + TP * HD;
  E* sO = sV + TP * HD;                                // dO
  float* sL = reinterpret_cast<float*>(sO + TP * HD);  // [TS], 0 past T
  float* sD = sL + TS;                                 // [TS], 0 past T
  E* sS = reinterpret_cast<E*>(sD + TS);               // dS^T [TP][SS]: rows keys, columns queries

  const int bh = blockIdx.x, h = bh % H, b = bh / H;
  const int C = H * HD;
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const E* base = qkv + static_cast<int64_t>(b) * T * ld + h * HD;
  const int64_t obase = static_cast<int64_t>(b) * T * C + h * HD;  // out / dout head base
  load_head<E, HD>(sQ, base, ld, TP, T);
  load_head<E, HD>(sK, base + C, ld, TP, T);
  load_head<E, HD>(sV, base + 2 * C, ld, TP, T);
  load_head<E, HD>(sO, dout + obase, C, TP, T);
  cp_async_commit();

  const float* Lg = lse + static_cast<int64_t>(bh) * T;
  for (int i = threadIdx.x; i < TS; i += blockDim.x) sL[i] = i < T ? Lg[i] * kLog2e : 0.0f;
  // D: two lanes per row, half a head each (2 * TS is a multiple of 32: whole warps iterate)
  for (int i = threadIdx.x; i < 2 * TS; i += blockDim.x) {
    const int r = i >> 1, half = i & 1;
    const float acc =
        row_dot_pair<E, HD>(out, dout, obase + static_cast<int64_t>(r) * C, half, r < T);
    if (half == 0) sD[r] = acc;
  }

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int lr = (lane & 7) + ((lane >> 3) & 1) * 8, lc = (lane >> 4) * 8;
  const float sl2 = scale * kLog2e;
  E* g = dqkv + static_cast<int64_t>(b) * T * ld + h * HD;
  cp_async_wait<0>();
  __syncthreads();

  const int nt = TP / 16;
  for (int kt = warp; kt < nt; kt += nw) {  // dK, dV and dS^T of keys [16 kt, 16 kt + 16)
    const int k0 = kt * 16;
    const uint32_t kf[1][1][4] = {}, vf[1][1][4] = {};  // not held (kHold = false)
    float dk[1][DT][4], dv[1][DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      dk[0][i][0] = dk[0][i][1] = dk[0][i][2] = dk[0][i][3] = 0.0f;
      dv[0][i][0] = dv[0][i][1] = dv[0][i][2] = dv[0][i][3] = 0.0f;
    }
    const E* kw = sK + k0 * HD;
    const E* vw = sV + k0 * HD;
    E* dsw = sS + k0 * SS;
    for (int j = 0; j * BM < T; ++j) {
      const int qn = min(BM, T - j * BM);
      const E* qs_ = sQ + j * BM * HD;
      const E* os_ = sO + j * BM * HD;
      if (qn == BM)
        dkdv_tile<Lay, E, HD, BM, 1, false, true, true>(qs_, os_, sL + j * BM, sD + j * BM, qn, kw,
                                                        vw, kf, vf, dk, dv, sl2, lane, lr, lc,
                                                        dsw + j * BM, SS, T - k0);
      else
        dkdv_tile<Lay, E, HD, BM, 1, false, false, true>(qs_, os_, sL + j * BM, sD + j * BM, qn, kw,
                                                         vw, kf, vf, dk, dv, sl2, lane, lr, lc,
                                                         dsw + j * BM, SS, T - k0);
    }
    store_acc<E, HD>(dk[0], scale, scale, g + C, ld, k0, T);
    store_acc<E, HD>(dv[0], 1.0f, 1.0f, g + 2 * C, ld, k0, T);
  }
  __syncthreads();

  // ldmatrix.trans of dS^T's [16 keys x 16 queries] block gives dS's A fragment: matrices
  // (queries 0-7 | 8-15) x (keys 0-7 | 8-15) in the order a0..a3
  const int sr = (lane & 7) + ((lane >> 4) & 1) * 8, sc = ((lane >> 3) & 1) * 8;
  for (int qt = warp; qt < nt; qt += nw) {  // dQ of queries [16 qt, 16 qt + 16)
    const int q0 = qt * 16;
    float dq[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;
    for (int kb = 0; kb < nt; ++kb) {
      uint32_t a[4];
      ldsm_x4_t(a, sS + (kb * 16 + sr) * SS + q0 + sc);
#pragma unroll
      for (int d2 = 0; d2 < HD / 16; ++d2) {
        uint32_t r[4];
        ldsm_x4_t(r, sK + Lay::off(kb * 16 + lr, d2 * 16 + lc));
        mma<E>(dq[2 * d2], a, r[0], r[1]);
        mma<E>(dq[2 * d2 + 1], a, r[2], r[3]);
      }
    }
    store_acc<E, HD>(dq, scale, scale, g, ld, q0, T);
  }
}

// ---------------------------------------------------------------------------------------
// Launchers
template <class K>
void set_smem(K kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
}

unsigned grid_of(int B, int H, int tiles) {
  const int64_t n = static_cast<int64_t>(B) * H * tiles;
  VG_CHECK(n > 0 && n < (int64_t(1) << 31), "attention grid of " << n << " blocks");
  return static_cast<unsigned>(n);
}

// Tile configuration per head dim. MT: 16-row MMA tiles per warp (rows per CTA = 64 * MT);
// MinB: the __launch_bounds__ minimum of resident CTAs per SM (1 = no register cap below 255).
// Picked on an H200 at B = 256, T = 197, H = 12, hd = 64, bf16 (per-kernel times, ms):
//   forward  BN=64 MT=1: 0.271, + MinB=4 (128 registers): 0.240, BN=64 MT=2: 0.244,
//            BN=32 MT=1/2: 0.262/0.265;
//   dQ       BN=32 MT=1: 0.346, BN=64: 0.402, BN=32 MT=2: 0.342, BN=16 MT=2: 0.373;
//   dK/dV    BM=64: 0.494, BM=32: 0.570, BM=32 + MinB=3 (168 registers): 0.434,
//            BM=32 MT=2: 0.438, BM=64 MT=2: 0.484; K/V fragments held in registers: slower
//            (register pressure), so they are re-read from shared memory.
// hd 80/128 keep the register-light defaults (no cap).
template <int HD> struct Cfg {
  static constexpr int kFwdBN = 64, kFwdMT = 1, kFwdMinB = HD <= 64 ? 4 : 1;  // keys per tile
  static constexpr int kDqBN = 32, kDqMT = 1, kDqMinB = 1;                     // keys per tile
  static constexpr int kKvBM = 32, kKvMT = 1, kKvMinB = HD <= 64 ? 3 : 1;      // queries/tile
  static constexpr bool kKvHold = false;
};

template <class E, int HD, int BN, int MT, int MinB>
void fwd_launch(cudaStream_t st, E* out, float* lse, const E* qkv, int B, int T, int H) {
  const int ntq = (T + kRows * MT - 1) / (kRows * MT);
  const size_t smem = static_cast<size_t>(kRows * MT + 4 * BN) * (HD + 8) * sizeof(E);
  auto k = fa_fwd_kernel<E, HD, BN, MT, MinB>;
  set_smem(k, smem);
  k<<<grid_of(B, H, ntq), kThreads, smem, st>>>(out, lse, qkv, T, H, ntq,
                                                1.0f / std::sqrt(static_cast<float>(HD)));
  CUDA_CHECK_LAUNCH();
}

template <class E, int HD, int BN, int MT, int MinB>
void dq_launch(cudaStream_t st, E* dqkv, float* Dws, const E* dout, const E* qkv, const E* out,
               const float* lse, int B, int T, int H) {
  const int nt = (T + kRows * MT - 1) / (kRows * MT);
  const size_t smem = static_cast<size_t>(2 * kRows * MT + 4 * BN) * (HD + 8) * sizeof(E) +
                      kRows * MT * sizeof(float);
  auto k = fa_bwd_dq_kernel<E, HD, BN, MT, MinB>;
  set_smem(k, smem);
  k<<<grid_of(B, H, nt), kThreads, smem, st>>>(dqkv, Dws, dout, qkv, out, lse, T, H, nt,
                                               1.0f / std::sqrt(static_cast<float>(HD)));
  CUDA_CHECK_LAUNCH();
}

template <class E, int HD, int BM, int MT, bool kHold, int MinB>
void dkdv_launch(cudaStream_t st, E* dqkv, const E* dout, const E* qkv, const float* lse,
                 const float* Dws, int B, int T, int H) {
  const int nt = (T + kRows * MT - 1) / (kRows * MT);
  const size_t smem = static_cast<size_t>(2 * kRows * MT + 4 * BM) * (HD + 8) * sizeof(E) +
                      4 * BM * sizeof(float);
  auto k = fa_bwd_dkdv_kernel<E, HD, BM, MT, kHold, MinB>;
  set_smem(k, smem);
  k<<<grid_of(B, H, nt), kThreads, smem, st>>>(dqkv, dout, qkv, lse, Dws, T, H, nt,
                                               1.0f / std::sqrt(static_cast<float>(HD)));
  CUDA_CHECK_LAUNCH();
}

// Warps for `items` equal work items, at most `most`: as few as finish them in the fewest
// rounds (T = 197: 13 query tiles on 7 warps, 26 backward items on 6; T = 50: 4 and 4).
int head_warps(int items, int most) {
  const int rounds = (items + most - 1) / most;
  return (items + rounds - 1) / rounds;
}

// The whole-head forward takes the tiled one's key tile size; two CTAs per SM (at T = 197 it
// holds 78 KB of shared memory).
template <class E, int HD>
void head_fwd(cudaStream_t st, E* out, float* lse, const E* qkv, int B, int T, int H) {
  const size_t smem = static_cast<size_t>(3) * ((T + 15) & ~15) * HD * sizeof(E);
  auto k = fa_head_fwd_kernel<E, HD, Cfg<HD>::kFwdBN, kHeadFwdWarps, kHeadFwdMinB>;
  set_smem(k, smem);
  const int nw = head_warps((T + 15) / 16, kHeadFwdWarps);
  k<<<grid_of(B, H, 1), nw * 32, smem, st>>>(out, lse, qkv, T, H,
                                             1.0f / std::sqrt(static_cast<float>(HD)));
  CUDA_CHECK_LAUNCH();
}

// The backward: one CTA per SM at T = 197 (194 KB of shared memory with dS^T), a warp per 16-row
// tile (13 at T = 197, 4 at T = 50).
template <class E, int HD>
void head_bwd(cudaStream_t st, E* dqkv, const E* dout, const E* qkv, const E* out, const float* lse,
              int B, int T, int H) {
  const size_t TP = (T + 15) & ~15;
  const size_t smem = 4 * TP * HD * sizeof(E) +
                      2 * static_cast<size_t>(head_stat_rows(T)) * sizeof(float) +
                      TP * (TP + 8) * sizeof(E);
  auto k = fa_head_bwd_kernel<E, HD, kHeadBwdBM, kHeadBwdWarps>;
  set_smem(k, smem);
  const int nw = head_warps(static_cast<int>(TP / 16), kHeadBwdWarps);
  k<<<grid_of(B, H, 1), nw * 32, smem, st>>>(dqkv, dout, qkv, out, lse, T, H,
                                             1.0f / std::sqrt(static_cast<float>(HD)));
  CUDA_CHECK_LAUNCH();
}

template <class E, int HD>
void fwd(cudaStream_t st, E* out, float* lse, const E* qkv, int B, int T, int H, bool head) {
  if constexpr (HD == 64) {
    if (head) return head_fwd<E, HD>(st, out, lse, qkv, B, T, H);
  }
  using K = Cfg<HD>;
  fwd_launch<E, HD, K::kFwdBN, K::kFwdMT, K::kFwdMinB>(st, out, lse, qkv, B, T, H);
}

// Tiled: the dQ kernel runs first; it also writes D, which the dK/dV kernel reads.
template <class E, int HD>
void bwd(cudaStream_t st, E* dqkv, float* Dws, const E* dout, const E* qkv, const E* out,
         const float* lse, int B, int T, int H, bool head) {
  if constexpr (HD == 64) {
    if (head) return head_bwd<E, HD>(st, dqkv, dout, qkv, out, lse, B, T, H);
  }
  using K = Cfg<HD>;
  dq_launch<E, HD, K::kDqBN, K::kDqMT, K::kDqMinB>(st, dqkv, Dws, dout, qkv, out, lse, B, T, H);
  dkdv_launch<E, HD, K::kKvBM, K::kKvMT, K::kKvHold, K::kKvMinB>(st, dqkv, dout, qkv, lse, Dws,
                                                                 B, T, H);
}

template <class F>
void dispatch(DType act, int hd, F&& f) {
  auto by_hd = [&](auto tag) {
    using E = typename decltype(tag)::type;
    switch (hd) {
      case 32: f(Tag<E>{}, std::integral_constant<int, 32>{}); break;
      case 64: f(Tag<E>{}, std::integral_constant<int, 64>{}); break;
      case 80: f(Tag<E>{}, std::integral_constant<int, 80>{}); break;
      case 128: f(Tag<E>{}, std::integral_constant<int, 128>{}); break;
      default: VG_FAIL("flash attention: unsupported head dim " << hd);
    }
  };
  switch (act) {
    case DType::BF16: by_hd(Tag<__nv_bfloat16>{}); break;
    case DType::F16: by_hd(Tag<__half>{}); break;
    default: VG_FAIL("flash attention: act dtype must be bf16 or fp16");
  }
}

}  // namespace

bool flash_attention_supported(DType act, int hd) {
  return (act == DType::BF16 || act == DType::F16) &&
         (hd == 32 || hd == 64 || hd == 80 || hd == 128);
}

bool flash_head_applies(DType act, int hd, int T) {
  return (act == DType::BF16 || act == DType::F16) && hd == 64 && T >= 1 && T <= kHeadMaxT;
}

void flash_attention_forward(cudaStream_t st, DType act, void* out, float* lse, const void* qkv,
                             int B, int T, int H, int hd, FlashKernels kernels) {
  VG_CHECK(aligned16(out) && aligned16(qkv), "flash attention needs 16-byte aligned tensors");
  const bool head = kernels == FlashKernels::Best && flash_head_applies(act, hd, T);
  dispatch(act, hd, [&](auto tag, auto hdc) {
    using E = typename decltype(tag)::type;
    fwd<E, decltype(hdc)::value>(st, static_cast<E*>(out), lse, static_cast<const E*>(qkv), B, T, H,
                                 head);
  });
}

void flash_attention_backward(cudaStream_t st, DType act, void* dqkv, float* Dws, const void* dout,
                              const void* qkv, const void* out, const float* lse, int B, int T,
                              int H, int hd, FlashKernels kernels) {
  VG_CHECK(aligned16(dqkv) && aligned16(dout) && aligned16(qkv) && aligned16(out),
           "flash attention needs 16-byte aligned tensors");
  const bool head = kernels == FlashKernels::Best && flash_head_applies(act, hd, T);
  dispatch(act, hd, [&](auto tag, auto hdc) {
    using E = typename decltype(tag)::type;
    bwd<E, decltype(hdc)::value>(st, static_cast<E*>(dqkv), Dws, static_cast<const E*>(dout),
                                 static_cast<const E*>(qkv), static_cast<const E*>(out), lse, B, T,
                                 H, head);
  });
}

}  // namespace cuda
}  // namespace vitgrid
