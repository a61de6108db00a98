// Fused residual add + LayerNorm forward (also writing FP8 codes for the FP8 Linear that reads
// it: add_layernorm_forward_fp8) and the LayerNorm backward, side by side.
// One warp per row (ViT rows are C = 192..1280 wide: a warp streams them at full bandwidth and
// needs no shared memory), a thread block per row past that (the large ViT's 4096); statistics in fp32; parameter gradients through a deterministic
// two-stage column reduction (no atomics, same bits every run).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

#include <cuda_fp8.h>

#include "cuda_backend_impl.h"
#include "fp8_codes.cuh"
#include "kernel_util.cuh"
#include "layernorm_reduce.cuh"
#include "vitgrid/core/error.h"

namespace vitgrid {
namespace cuda {

// b's element times its row factor fr as a dropout pass stores it (rounded; +0 when dropped),
// as float; fr = 1 without factors (the element itself). The product is rounded on its own
// (__fmul_rn): in fp32 the compiler would otherwise fuse it with the residual add (one FMA),
// which the pass does not.
template <class T>
__device__ __forceinline__ float branch_elem(T v, const float* bf, float fr) {
  return !bf ? to_f(v) : fr != 0.0f ? to_f(from_f<T>(__fmul_rn(to_f(v), fr))) : 0.0f;
}

// res = a + b (rounded to T, as stored), y = (res - mean) * rstd * gamma + beta.
// Statistics come from the stored (rounded) res, which is what the backward sees as x.
// res may alias a: every element is read and written by the same lane. With bf, b's row r is
// b's row times bf[r / bf_rows] first (RowFactors).
template <class T>
__global__ void add_layernorm_fwd_kernel(T* res, T* y, float* mean, float* rstd, const T* a,
                                         const T* b, const T* gamma, const T* beta, int N,
                                         int C, float eps, const float* bf, int bf_rows) {
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const T* ar = a + row * C;
  T* rr = res + row * C;
  T* yr = y + row * C;
  float s = 0.0f;
  if (b) {
    const T* br = b + row * C;
    const float fr = bf ? bf[row / bf_rows] : 1.0f;
    for (int c = lane; c < C; c += 32) {
      const T r = from_f<T>(to_f(ar[c]) + branch_elem(br[c], bf, fr));
      rr[c] = r;
      s += to_f(r);
    }
  } else {
    for (int c = lane; c < C; c += 32) {
      const T r = ar[c];
      if (rr != ar) rr[c] = r;
      s += to_f(r);
    }
  }
  const float m = warp_sum(s) / C;
  float v = 0.0f;  // two-pass variance: exact enough even when |mean| >> std
  for (int c = lane; c < C; c += 32) {
    const float d = to_f(rr[c]) - m;
    v += d * d;
  }
  const float rs = 1.0f / sqrtf(warp_sum(v) / C + eps);
  for (int c = lane; c < C; c += 32)
    yr[c] = from_f<T>((to_f(rr[c]) - m) * rs * to_f(gamma[c]) + to_f(beta[c]));
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
}

// A pack of res as stored, kept for the variance and the output: bf16 as its pack (its value
// is a shift away: half the registers, which lets add_layernorm_fwd_fp8_kernel's four blocks a
// SM fit without spills), other types as fp32 (fp16's conversions cost more than they save).
template <class T, int V>
struct KeptPack {
  float f[V];
  __device__ __forceinline__ void set(const Pack<T, V>& o) {
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = to_f(o.v[j]);
  }
  __device__ __forceinline__ float operator[](int j) const { return f[j]; }
};
template <int V>
struct KeptPack<__nv_bfloat16, V> {
  Pack<__nv_bfloat16, V> p;
  __device__ __forceinline__ void set(const Pack<__nv_bfloat16, V>& o) { p = o; }
  __device__ __forceinline__ float operator[](int j) const { return to_f(p.v[j]); }
};

// The row body, shared with the block-per-row kernel and the FP8 one below: thread t of a team
// of nt owns packs t + nt k, k < K; sum(v) adds v over the team (every thread gets the total);
// store(p, o) writes pack p of y (as rounded to T); thread 0 writes the statistics.
template <class T, int K, class Sum, class Store>
__device__ __forceinline__ void add_layernorm_row(int64_t row, int t, int nt, Sum sum, T* res,
                                                  Store store, float* mean, float* rstd,
                                                  const T* a, const T* b, const T* gamma,
                                                  const T* beta, int C, float eps,
                                                  const float* bf, int bf_rows) {
  constexpr int V = 16 / sizeof(T);
  using P = Pack<T, V>;
  const int packs = C / V;
  const P* ar = reinterpret_cast<const P*>(a + row * C);
  const P* br = b ? reinterpret_cast<const P*>(b + row * C) : nullptr;
  P* rr = reinterpret_cast<P*>(res + row * C);
  KeptPack<T, V> r[K];
  float s = 0.0f;
  const float fr = bf && br ? bf[row / bf_rows] : 1.0f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int p = t + nt * k;
    if (p >= packs) continue;
    const P ap = ar[p];
    P bp;
    if (br) bp = br[p];
    P o;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      // rounded to T as stored: the statistics see what the backward will read as x
      o.v[j] = br ? from_f<T>(to_f(ap.v[j]) + branch_elem(bp.v[j], bf, fr)) : ap.v[j];
      s += to_f(o.v[j]);
    }
    r[k].set(o);
    if (br || rr != ar) rr[p] = o;
  }
  const float m = sum(s) / C;
  float v = 0.0f;  // two-pass variance from registers
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (t + nt * k >= packs) continue;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = r[k][j] - m;
      v += d * d;
    }
  }
  const float rs = 1.0f / sqrtf(sum(v) / C + eps);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int p = t + nt * k;
    if (p >= packs) continue;
    const P gp = reinterpret_cast<const P*>(gamma)[p];
    const P bp = reinterpret_cast<const P*>(beta)[p];
    P o;
#pragma unroll
    for (int j = 0; j < V; ++j)
      o.v[j] = from_f<T>((r[k][j] - m) * rs * to_f(gp.v[j]) + to_f(bp.v[j]));
    store(p, o);
  }
  if (t == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
}

// add_layernorm_row's store of y's packs into row `row` of y[N, C].
template <class T>
struct RowStore {
  T* y;
  int64_t row;
  int C;
  __device__ __forceinline__ void operator()(int p, const Pack<T, 16 / sizeof(T)>& o) const {
    reinterpret_cast<Pack<T, 16 / sizeof(T)>*>(y + row * C)[p] = o;
  }
};

// The same for rows of up to 32*K packs of V elements (16-byte vectors): each lane keeps its
// packs of the row in registers, so a and b are read once and res and y written once (the
// generic kernel above re-reads the row from memory for the variance and the output).
template <class T, int K>
__global__ void __launch_bounds__(256) add_layernorm_fwd_vec_kernel(
    T* res, T* y, float* mean, float* rstd, const T* a, const T* b, const T* gamma,
    const T* beta, int N, int C, float eps, const float* bf, int bf_rows) {
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  if (row >= N) return;
  add_layernorm_row<T, K>(
      row, threadIdx.x & 31, 32, [](float v) { return warp_sum(v); }, res, RowStore<T>{y, row, C},
      mean, rstd, a, b, gamma, beta, C, eps, bf, bf_rows);
}

// The transpose of a tile of FP8 codes in shared memory (`rows` <= 32 rows of C codes, pitch
// bytes apart, pitch a multiple of 4 and not of 128: 32-bit words of one column fall in
// distinct banks) to out_t[C, N] at rows r0 ..: where the tile has 32 rows, N is a multiple of
// 8 and C of 32, each thread reads an 8-row x 4-column block as eight 32-bit words, transposes
// it with byte permutes and writes its 4 columns' 8 rows (8-byte stores; a warp's 4 row blocks
// x 8 word columns write 32-byte runs, as fp8.cu's cast); else byte by byte. The block's nw
// warps take part.
__device__ __forceinline__ void store_tile_transpose(const uint8_t* tile, int pitch, int rows,
                                                     uint8_t* out_t, int64_t N, int C,
                                                     int64_t r0, int nw) {
  if (rows == 32 && N % 8 == 0 && C % 32 == 0) {
    const int lane = threadIdx.x & 31, rb = lane >> 3;  // rows rb * 8 .. rb * 8 + 7
    for (int g = threadIdx.x >> 5; g < C / 32; g += nw) {
      const int wc = g * 8 + (lane & 7);  // columns wc * 4 .. wc * 4 + 3
      store_codes_8x4_transposed(tile, pitch, rb, wc, out_t, 0, N, r0 + rb * 8);
    }
  } else {
    for (int q = threadIdx.x; q < C * rows; q += 32 * nw) {
      const int c = q / rows, rr = q % rows;
      out_t[static_cast<int64_t>(c) * N + r0 + rr] = tile[rr * pitch + c];
    }
  }
}

// add_layernorm_forward_fp8: a block of kLnFp8Warps warps takes kLnFp8Rows rows (a warp per row
// at a time, as add_layernorm_fwd_vec_kernel), converts y's packs to FP8 codes as it would
// store them (rounded to T first: fp8_cast of the stored y, code for code; two values per
// conversion instruction), writes them to out (row-major) and to a shared tile (rows C + 4
// bytes apart: 32-bit words of one column fall in distinct banks), then writes the tile's
// transpose to out_t[C, N]: where the block's rows are whole, N a multiple of 8 and C of 32,
// each thread reads an 8-row x 4-column block as eight 32-bit words, transposes it with byte
// permutes and writes its 4 columns' 8 rows (store_tile_transpose). Adds its largest |y| to
// *amax. Dynamic shared memory: kLnFp8Rows x (C + 4) bytes. Up to C = 768 (K <= 3) four blocks
// a SM (64 registers, no spills; 77 unbounded: three blocks), C = 1024 three (80).
constexpr int kLnFp8Rows = 32, kLnFp8Warps = 8;

template <class T, int K>
__global__ void __launch_bounds__(32 * kLnFp8Warps, K <= 3 ? 4 : 3) add_layernorm_fwd_fp8_kernel(
    T* res, uint8_t* out, uint8_t* out_t, float* amax, const float* scale_p,
    __nv_fp8_interpretation_t fmt, float* mean, float* rstd, const T* a, const T* b,
    const T* gamma, const T* beta, int N, int C, float eps, const float* bf, int bf_rows) {
  extern __shared__ __align__(16) uint8_t ln_fp8_tile[];
  __shared__ int sh_max[32];
  constexpr int V = 16 / sizeof(T);
  static_assert(V == 8, "FP8 LayerNorm output: 8 codes per pack (bf16 / fp16 rows)");
  static_assert(kLnFp8Rows == 32, "the transpose's 4 row blocks of 8 per warp");
  const int pitch = C + 4;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kLnFp8Rows;
  const int rows = static_cast<int>(min(static_cast<int64_t>(kLnFp8Rows), N - r0));
  const float scale = scale_p[0];
  int m = 0;  // the thread's amax, as bits
  for (int i = threadIdx.x >> 5; i < rows; i += kLnFp8Warps) {
    const int64_t row = r0 + i;
    auto store = [&](int p, const Pack<T, V>& o) {
      uint32_t w[2];
#pragma unroll
      for (int j = 0; j < V; j += 2) {
        const float f0 = to_f(o.v[j]), f1 = to_f(o.v[j + 1]);
        m = max(m, max(abs_bits(f0), abs_bits(f1)));
        const uint32_t two = fp8x2_codes(f0, f1, scale, fmt);
        if (j % 4 == 0) w[j / 4] = two;
        else w[j / 4] |= two << 16;
      }
      if (out) *reinterpret_cast<uint2*>(out + row * C + p * V) = make_uint2(w[0], w[1]);
      uint32_t* sw = reinterpret_cast<uint32_t*>(ln_fp8_tile + i * pitch + p * V);
      sw[0] = w[0];
      sw[1] = w[1];
    };
    add_layernorm_row<T, K>(
        row, threadIdx.x & 31, 32, [](float v) { return warp_sum(v); }, res, store, mean, rstd,
        a, b, gamma, beta, C, eps, bf, bf_rows);
  }
  if (out_t) {
    __syncthreads();
    store_tile_transpose(ln_fp8_tile, pitch, rows, out_t, N, C, r0, kLnFp8Warps);
  }
  block_amax_atomic(m, amax, sh_max);
}

// dx += rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma.
template <class T>
__global__ void layernorm_bwd_dx_kernel(T* dx, const T* dy, const T* x, const T* gamma,
                                        const float* mean, const float* rstd, int N, int C) {
  const int warps = blockDim.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const T* dyr = dy + row * C;
  const T* xr = x + row * C;
  T* dxr = dx + row * C;
  const float m = mean[row], rs = rstd[row];
  float s1 = 0.0f, s2 = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float g = to_f(dyr[c]) * to_f(gamma[c]);
    s1 += g;
    s2 += g * (to_f(xr[c]) - m) * rs;
  }
  s1 = warp_sum(s1) / C;
  s2 = warp_sum(s2) / C;
  for (int c = lane; c < C; c += 32) {
    const float g = to_f(dyr[c]) * to_f(gamma[c]);
    const float xh = (to_f(xr[c]) - m) * rs;
    dxr[c] = from_f<T>(to_f(dxr[c]) + rs * (g - s1 - xh * s2));
  }
}



// The fused backwards' last step: one partial row of dgamma / dbeta (and with DS of dx's
// column sums) per block. Each warp's per-lane column sums (accg / accb / accd: K packs of V
// per lane) go to sh as [W][A][C] floats (A = 2, or 3 with DS), then the block adds them in
// warp order (fixed: deterministic) and writes row blockIdx.x of pg / pb / pd. The block is W
// warps; sh holds A W C floats that nothing else reads any more. Without DS, accd and pd are
// not touched (a [1][V] placeholder and null).
// acc = 0 (register arrays of per-thread partial sums)
template <int K, int V>
__device__ __forceinline__ void zero_acc(float (&acc)[K][V]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int j = 0; j < V; ++j) acc[k][j] = 0.0f;
  }
}

template <int K, int V, int W, bool DS, int KD>
__device__ __forceinline__ void write_block_partials(float* sh, const float (&accg)[K][V],
                                                     const float (&accb)[K][V],
                                                     const float (&accd)[KD][V], int packs,
                                                     int C, float* pg, float* pb, float* pd) {
  constexpr int A = DS ? 3 : 2;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int p = lane + 32 * k;
    if (p >= packs) continue;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      sh[(w * A + 0) * C + p * V + j] = accg[k][j];
      sh[(w * A + 1) * C + p * V + j] = accb[k][j];
      if constexpr (DS) sh[(w * A + 2) * C + p * V + j] = accd[k][j];
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += 32 * W) {
    float tg = 0.0f, tb = 0.0f, td = 0.0f;
#pragma unroll
    for (int ww = 0; ww < W; ++ww) {
      tg += sh[(ww * A + 0) * C + c];
      tb += sh[(ww * A + 1) * C + c];
      if constexpr (DS) td += sh[(ww * A + 2) * C + c];
    }
    pg[static_cast<int64_t>(blockIdx.x) * C + c] = tg;
    pb[static_cast<int64_t>(blockIdx.x) * C + c] = tb;
    if constexpr (DS) pd[static_cast<int64_t>(blockIdx.x) * C + c] = td;
  }
}

// The fused backward for rows of up to 32*K packs of V elements: one warp per row, each lane
// owning the same K packs (16-byte vectors) of every row it visits, so dy and x are read once
// for dx, dgamma and dbeta; per-lane column sums stay in registers, then the block's warps
// combine them in fixed order in shared memory and the block writes one partial row
// (deterministic like the generic path). It replaced a first fused kernel that held the row
// in registers (git history: layernorm_bwd_fused_kernel); per row it does the same arithmetic
// in the same order: each lane owns packs lane + 32 k of the row, sums its g and g * xhat over
// (k, j) in that order, the warp sums are the same butterflies, and the rounded operations
// are written out (__fmul_rn / __fadd_rn / __fmaf_rn: never contracted) exactly as the
// compiler emitted them for the first kernel (FMUL g = d * gamma; FADD s1; FFMA s2; dx: FADD
// g - s1, FFMA -xhat * s2, FFMA rstd * t + dx), so dx is bit-identical to it.
//
// Why: the first kernel measured 0.154 ms at ViT-B/16 (bf16, N = 50432, C = 768: ~2 TB/s,
// the forward 3.7) and is latency-bound. Each warp holds its row in registers (155..200
// registers: gamma, the two column sums and the row's d and xhat as fp32 arrays), so only 3
// blocks of 4 warps fit per SM; a warp has one row's dy and x in flight (3 KB at C = 768),
// then after the warp sums a second memory round trip for dx, and nothing in flight while it
// computes; and its 528 blocks do not fit at once (396 resident), so the last quarter of the
// rows runs as a second wave of one 4-warp block per SM. Here:
//  * the rows travel through shared memory by asynchronous copies (cp.async, 16 bytes per
//    lane and pack, L2 only): dy, x and dx of a row in one group, no registers held while in
//    flight, and ptxas cannot sink them (with the row in registers it delays loads to stay
//    under the register cap: a second round trip again);
//  * per warp two stages: the next row's group is issued before the current row is
//    computed, so every warp always has a row (3 x 2 x C bytes: 4.6 KB at C = 768) in
//    flight, also while it computes and reduces; mean / rstd of the next row likewise
//    (registers);
//  * registers: the lane's 2 x V x K column sums and the working set of one pack (96 at
//    C = 768 in 16-bit types: 5 blocks of 4 warps per SM, where the first kernel fits 3 of
//    4 warps), so 20 warps x 4.6 KB = 92 KB are always in flight per SM at C = 768, more
//    while a warp waits (8, 6, 5, 4, 3, 2 blocks for K = 1..6, ln_bwd2_blocks_per_sm);
//  * a grid of exactly the blocks resident at once on an H100 / H200: one wave, no tail.
// Expected: near the forward's bandwidth on the 4 x N x C x 2 bytes, ~0.09 ms at ViT-B
// instead of 0.154 (bench_gpu_kernels --benchmark_filter=LayerNormBackward).
constexpr int kLnBwd2Warps = 4;     // warps per block
constexpr int kLnBwd2MaxPacks = 6;  // K <= 6: C <= 1536 in 16-bit types, <= 768 in fp32
// Dynamic shared memory, in 16-byte slots: gamma [32 K], then per warp 2 stages x {dy, x, dx}
// x [32 K] (lane-consecutive: conflict-free); at the end reused for the warps' column sums.
__host__ __device__ constexpr size_t ln_bwd2_smem(int K, int W = kLnBwd2Warps) {
  return static_cast<size_t>(16) * 32 * K * (1 + 2 * 3 * W);
}
// layernorm_backward_fp8's variant: groups of 32 rows (the transposed tile's), 8 warps a block,
// the tile of C + 4 bytes a row after the stages; at most 4 packs per lane (C <= 1024).
constexpr int kLnBwdF8Rows = 32, kLnBwdF8Warps = 8, kLnBwdF8MaxPacks = 4;
__host__ __device__ constexpr size_t ln_bwd_f8_smem(int K, int C) {
  return ln_bwd2_smem(K, kLnBwdF8Warps) + static_cast<size_t>(kLnBwdF8Rows) * (C + 4);
}
// Blocks of 4 warps per SM, the grid's width and __launch_bounds__' minimum: what fits in
// registers (sm_90, 64 K per SM: <= 64, 80, 96, 128, 168, 255 per thread; measured 56, 80,
// 96, 128, 168, 229 with CUDA 13) and in shared memory (ln_bwd2_smem + 1 KB each, <= 228 KB).
// Narrow rows get more warps: the bytes in flight per warp shrink with the row. With DS (dx's
// column sums too: V K more registers; measured 64, 96, 128, 168, 234 for K = 1..5, no
// spills) one block fewer from K = 2 on; K = 6 with DS would not fit in 255 registers, so it
// is not built (layernorm_backward then sums dx in a pass of its own).
constexpr int kLnBwd2MaxPacksDs = 5;
// With PF (drop path's row factors: dx times its row's factor written out as well, and the
// column sums taken of that) one more pack in flight per element: one block fewer again from
// K = 2 on, and K <= 4 (C <= 1024 in 16-bit types; wider rows take a pass of their own).
constexpr int kLnBwd2MaxPacksPf = 4;
__host__ __device__ constexpr int ln_bwd2_blocks_per_sm(int K, bool DS, bool PF = false) {
  return PF   ? (K == 1 ? 8 : K == 2 ? 4 : K == 3 ? 3 : 2)
         : DS ? (K == 1 ? 8 : K == 2 ? 5 : K == 3 ? 4 : K == 4 ? 3 : 2)
              : (K == 1 ? 8 : K == 2 ? 6 : K == 3 ? 5 : K == 4 ? 4 : K == 5 ? 3 : 2);
}

// The rows are handled as raw 16-byte words (uint4), not as Pack<T, V>: a struct of 8 16-bit
// elements gets split into 8 registers, one per element.
// Element j of a pack of T, as float (exactly to_f: bf16 / fp16 / fp32 widen exactly).
template <class T>
__device__ __forceinline__ float pack_elem(const uint4& u, int j) {
  constexpr int per = 4 / sizeof(T);  // elements per 32-bit word
  const int wi = j / per;             // compile-time after unrolling
  const uint32_t w = wi == 0 ? u.x : wi == 1 ? u.y : wi == 2 ? u.z : u.w;
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(j % 2 == 0 ? w : w >> 16)));
  } else {  // bf16 is the upper half of its fp32 value
    return __uint_as_float(j % 2 == 0 ? w << 16 : w & 0xffff0000u);
  }
}
// The bits of from_f<T>(v), in the low bits of a word.
template <class T>
__device__ __forceinline__ uint32_t elem_bits(float v) {
  if constexpr (sizeof(T) == 4) return __float_as_uint(v);
  else if constexpr (std::is_same_v<T, __half>) return __half_as_ushort(from_f<T>(v));
  else return __bfloat16_as_ushort(from_f<T>(v));
}
// 16 bytes global -> shared, asynchronous, through L2 only; zero-filled when !full (nothing
// read). Completion: cp_async_commit() groups them, cp_async_wait<n>() waits for all but the
// last n groups of this thread, whose writes it then sees.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool full) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(full ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int n>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory");
}

// With DS, also the column sums of the stored (rounded) dx, one partial row per block in pd.
// With PF (and DS): dbr = the stored dx's rows times bf[row / bf_rows] (rounded, +0 where the
// factor is 0: RowFactors), and pd sums dbr instead.
// With F8 (layernorm_backward_fp8: the stored dx, or with PF dbr, is the output gradient of the
// FP8 Linear before the LayerNorm): its FP8 codes with scale_p[0] as fp8_cast would write them
// from the stored values, row-major to out and transposed to out_t[C, N], and their amax into
// *amax. The block then takes groups of kLnBwdF8Rows consecutive rows (group i of the block:
// blockIdx.x + i gridDim.x; warp w its rows w, w + W, ...), each group's codes staged in a
// shared tile (after the stages, rows C + 4 bytes apart) and written transposed as the FP8
// LayerNorm forward writes its tile (store_tile_transpose); W is then 8 warps, so that a group
// is 4 rows a warp and two blocks of 8 hold as many warps as four of 4 (the tile's 24 KB at
// C = 768 fits beside them).
template <class T, int K, bool DS, bool PF, bool F8 = false, int W = kLnBwd2Warps>
__global__ void __launch_bounds__(32 * W, ln_bwd2_blocks_per_sm(K, DS, PF) * kLnBwd2Warps / W)
    layernorm_bwd_fused2_kernel(T* dx, float* pg, float* pb, float* pd, const T* __restrict__ dy,
                                const T* __restrict__ x, const T* __restrict__ gamma,
                                const float* __restrict__ mean,
                                const float* __restrict__ rstd, int N, int C, T* dbr,
                                const float* __restrict__ bf, int bf_rows,
                                uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                                float* amax, const float* __restrict__ scale_p,
                                __nv_fp8_interpretation_t fmt) {
  static_assert(!PF || DS, "the row factors' kernel sums the branch gradient");
  constexpr int V = 16 / sizeof(T);  // elements per pack
  constexpr int KS = 32 * K;         // 16-byte slots of one array of one row
  constexpr int G = kLnBwdF8Rows, R = G / W;  // F8: a group's rows, a warp's rows of a group
  static_assert(!F8 || (V == 8 && G % W == 0), "FP8 codes of 16-bit rows, whole rows per warp");
  extern __shared__ uint4 ln_bwd2_sh[];
  __shared__ int warp_max[32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int packs = C / V;
  uint4* gs = ln_bwd2_sh;                          // gamma, pack p at gs[p], zero past the row
  uint4* stage = ln_bwd2_sh + KS + w * 2 * 3 * KS;  // this warp's stages: [2][dy, x, dx][KS]
  uint8_t* tile = reinterpret_cast<uint8_t*>(ln_bwd2_sh + KS * (1 + 2 * 3 * W));  // F8: codes
  const int pitch = C + 4;
  for (int p = threadIdx.x; p < KS; p += 32 * W)
    gs[p] = p < packs ? __ldg(reinterpret_cast<const uint4*>(gamma + p * V))
                      : make_uint4(0u, 0u, 0u, 0u);
  const float scale = F8 ? scale_p[0] : 0.0f;
  int mx = 0;  // F8: the thread's amax, as bits

  // the lane's packs of dy, x and dx of row r into stage s; zeros past the row
  auto issue = [&](int64_t r, int s) {
    uint4* b = stage + s * 3 * KS;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int p = lane + 32 * k;
      const bool in = p < packs;
      const int64_t at = r * C + static_cast<int64_t>(in ? p : 0) * V;
      cp_async16(b + k * 32 + lane, dy + at, in);
      cp_async16(b + KS + k * 32 + lane, x + at, in);
      cp_async16(b + 2 * KS + k * 32 + lane, dx + at, in);
    }
  };
  // the warp's rows in order: a row per warp of the block's W, gridDim.x W apart; with F8 its R
  // rows of each of the block's groups
  const int64_t step = static_cast<int64_t>(gridDim.x) * W;
  auto next_of = [&](int64_t r) -> int64_t {
    if constexpr (!F8) return r + step;
    return r % G + W < G ? r + W : (r / G + gridDim.x) * G + w;
  };
  int64_t row = F8 ? static_cast<int64_t>(blockIdx.x) * G + w
                   : static_cast<int64_t>(blockIdx.x) * W + w;
  float m_next = 0.0f, rs_next = 0.0f, f_next = 1.0f;
  if (row < N) {
    issue(row, 0);
    m_next = __ldg(mean + row);
    rs_next = __ldg(rstd + row);
    if constexpr (PF) f_next = __ldg(bf + row / bf_rows);
  }
  cp_async_commit();
  __syncthreads();  // gamma

  constexpr int KD = DS ? K : 1;
  float accg[K][V], accb[K][V];  // this lane's column sums of dy * xhat and dy
  float accd[KD][V];             // with DS: of dx as stored
  zero_acc(accg);
  zero_acc(accb);
  zero_acc(accd);
  int s = 0;
  // Row r from stage s (the next row's loads issued first); nothing past N but the loads'
  // (empty) group, which keeps the count uniform. F8: the codes to tile row tr.
  auto do_row = [&](int64_t r, int tr) {
    const float m = m_next, rs = rs_next, fr = f_next;
    const int64_t next = next_of(r);
    __syncwarp();  // the last row's reads of stage s ^ 1 are done before it is refilled
    if (next < N) {
      issue(next, s ^ 1);
      m_next = __ldg(mean + next);
      rs_next = __ldg(rstd + next);
      if constexpr (PF) f_next = __ldg(bf + next / bf_rows);
    }
    cp_async_commit();  // (empty past the end: the group count stays uniform)
    cp_async_wait<1>();  // this row's group has landed
    if (r >= N) return;
    const uint4* b = stage + s * 3 * KS;
    // the row sums of g and g * xhat in the first kernel's lane order, the column sums.
    // Packs past the row are zeros (gamma too): g = +0 leaves the row sums as they are, as
    // the first kernel's +0 does; their column sums are never read.
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const uint4 dk = b[k * 32 + lane], xk = b[KS + k * 32 + lane], gk = gs[k * 32 + lane];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = pack_elem<T>(dk, j);
        const float xh = __fmul_rn(__fsub_rn(pack_elem<T>(xk, j), m), rs);
        const float g = __fmul_rn(d, pack_elem<T>(gk, j));
        s1 = __fadd_rn(s1, g);
        s2 = __fmaf_rn(g, xh, s2);
        accg[k][j] = __fmaf_rn(d, xh, accg[k][j]);
        accb[k][j] = __fadd_rn(accb[k][j], d);
      }
    }
    // warp_sum's butterflies (the same additions, the same bits), the two interleaved
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      s1 += __shfl_xor_sync(0xffffffffu, s1, o);
      s2 += __shfl_xor_sync(0xffffffffu, s2, o);
    }
    s1 = s1 / C;
    s2 = s2 / C;
    // dx += rstd * (g - mean(g) - xhat * mean(g * xhat))
    T* dxr = dx + r * C;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int p = lane + 32 * k;
      if (p >= packs) continue;
      const uint4 dk = b[k * 32 + lane], xk = b[KS + k * 32 + lane],
                  ok = b[2 * KS + k * 32 + lane], gk = gs[k * 32 + lane];
      uint32_t o[4] = {0u, 0u, 0u, 0u}, ob[4] = {0u, 0u, 0u, 0u};
      float cv[V];  // the values as stored (dx's, or with PF dbr's)
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = pack_elem<T>(dk, j);
        const float xh = __fmul_rn(__fsub_rn(pack_elem<T>(xk, j), m), rs);
        const float g = __fmul_rn(d, pack_elem<T>(gk, j));
        const float t = __fmaf_rn(-xh, s2, __fsub_rn(g, s1));
        const float v = __fmaf_rn(rs, t, pack_elem<T>(ok, j));
        const int sh = 8 * sizeof(T) * (j % (4 / sizeof(T)));
        o[j * sizeof(T) / 4] |= elem_bits<T>(v) << sh;
        if constexpr (PF) {
          const float vb = fr != 0.0f ? __fmul_rn(to_f(from_f<T>(v)), fr) : 0.0f;
          ob[j * sizeof(T) / 4] |= elem_bits<T>(vb) << sh;
          cv[j] = to_f(from_f<T>(vb));
          accd[k][j] = __fadd_rn(accd[k][j], cv[j]);
        } else {
          cv[j] = to_f(from_f<T>(v));
          if constexpr (DS) accd[k][j] = __fadd_rn(accd[k][j], cv[j]);
        }
      }
      if constexpr (F8) {  // two values per conversion instruction, as fp8.cu's cast
        uint32_t c8[2];
#pragma unroll
        for (int j = 0; j < V; j += 2) {
          mx = max(mx, max(abs_bits(cv[j]), abs_bits(cv[j + 1])));
          const uint32_t two = fp8x2_codes(cv[j], cv[j + 1], scale, fmt);
          if (j % 4 == 0) c8[j / 4] = two;
          else c8[j / 4] |= two << 16;
        }
        if (out)
          *reinterpret_cast<uint2*>(out + r * C + static_cast<int64_t>(p) * V) =
              make_uint2(c8[0], c8[1]);
        uint32_t* sw = reinterpret_cast<uint32_t*>(tile + tr * pitch + p * V);
        sw[0] = c8[0];
        sw[1] = c8[1];
      }
      *reinterpret_cast<uint4*>(dxr + static_cast<int64_t>(p) * V) =
          make_uint4(o[0], o[1], o[2], o[3]);
      if constexpr (PF)
        *reinterpret_cast<uint4*>(dbr + r * C + static_cast<int64_t>(p) * V) =
            make_uint4(ob[0], ob[1], ob[2], ob[3]);
    }
  };
  if constexpr (!F8) {
#pragma unroll 1
    for (; row < N; row += step, s ^= 1) do_row(row, 0);
  } else {
    // whole groups on every warp (rows past N skipped inside), a barrier before and after each
    // group's transpose
#pragma unroll 1
    for (int64_t g0 = static_cast<int64_t>(blockIdx.x) * G; g0 < N;
         g0 += static_cast<int64_t>(gridDim.x) * G) {
#pragma unroll 1
      for (int i = 0; i < R; ++i, s ^= 1) do_row(g0 + w + W * i, w + W * i);
      __syncthreads();
      if (out_t)
        store_tile_transpose(tile, pitch, static_cast<int>(min(static_cast<int64_t>(G), N - g0)),
                             out_t, N, C, g0, W);
      __syncthreads();
    }
  }
  cp_async_wait<0>();
  // one partial row per block, through the (now idle) stages
  __syncthreads();
  // (3 W C floats with DS fit: the stages hold W 2 3 KS 16-byte slots, C <= KS V, V <= 8)
  write_block_partials<K, V, W, DS>(reinterpret_cast<float*>(ln_bwd2_sh + KS), accg, accb,
                                    accd, packs, C, pg, pb, pd);
  if constexpr (F8) block_amax_atomic(mx, amax, warp_max);
}

// out = in's rows times their factors, as a dropout pass multiplies (RowFactors): the
// LayerNorm backward's dbranch where its kernel does not write it.
template <class T>
__global__ void row_factors_kernel(T* out, const T* in, const float* f, int rows_per, int64_t N,
                                   int C) {
  const int64_t n = N * C;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float fr = f[(i / C) / rows_per];
    out[i] = from_f<T>(fr != 0.0f ? to_f(in[i]) * fr : 0.0f);
  }
}

// ---- Wide rows (C past the warp-per-row kernels' reach: the hybrid-parallel guide's large ViT
// is 4096 wide). A warp per row then holds too much of the row in registers (the vector
// forward's 16 packs per lane) or falls back to scalar loads (the general backward: 155 us for
// 788 rows of 4096 where the bytes need 7), so here a block spans the row: thread t owns packs
// t + blockDim.x k, k < K, the row statistics are block sums (warp butterflies, then the warps'
// sums in warp order: deterministic).
// Threads per block for a row of `packs` 16-byte packs at K packs per thread.
__host__ __device__ constexpr int ln_wide_threads(int packs, int K) {
  return 32 * ((packs + 32 * K - 1) / (32 * K));
}

// Forward: one row per block, the row in registers (a and b read once, res and y written
// once), as add_layernorm_fwd_vec_kernel does per warp.
template <class T, int K>
__global__ void __launch_bounds__(1024) add_layernorm_fwd_wide_kernel(
    T* res, T* y, float* mean, float* rstd, const T* a, const T* b, const T* gamma,
    const T* beta, int N, int C, float eps, const float* bf, int bf_rows) {
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  if (row >= N) return;  // (uniform over the block)
  add_layernorm_row<T, K>(
      row, threadIdx.x, blockDim.x, [&](float v) { return block_sum(v, sh); }, res,
      RowStore<T>{y, row, C}, mean, rstd, a, b, gamma, beta, C, eps, bf, bf_rows);
}

// Backward: a fixed grid of blocks striding over the rows (block i: rows i, i + grid, ...);
// each thread keeps its columns' sums of dy * xhat and dy (with DS of the stored dx, with PF
// of the branch gradient dbr = dx's rows times their factors, as layernorm_bwd_fused2_kernel)
// in registers and writes them as the block's partial row: the threads own disjoint columns,
// so no combining within the block. The next row's dy, x and dx are loaded before the
// current row is reduced and written (registers), so each thread has a row in flight while
// the block waits on its sums. Per row one barrier: the warps' sums go to shared memory by
// row parity, so a fast warp writing row r + 2's sums cannot overwrite row r's before every
// warp has read them (it passed row r + 1's barrier, which they reach after reading).
template <class T, int K, bool DS, bool PF>
__global__ void __launch_bounds__(512) layernorm_bwd_wide_kernel(
    T* dx, float* pg, float* pb, float* pd, const T* __restrict__ dy, const T* __restrict__ x,
    const T* __restrict__ gamma, const float* __restrict__ mean,
    const float* __restrict__ rstd, int N, int C, T* dbr, const float* __restrict__ bf,
    int bf_rows) {
  static_assert(!PF || DS, "the row factors' kernel sums the branch gradient");
  constexpr int V = 16 / sizeof(T);
  constexpr int KD = DS ? K : 1;
  __shared__ float red[2][32][2];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int packs = C / V;
  uint4 gk[K];
  float accg[K][V], accb[K][V], accd[KD][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int p = threadIdx.x + blockDim.x * k;
    gk[k] = p < packs ? __ldg(reinterpret_cast<const uint4*>(gamma + p * V))
                      : make_uint4(0u, 0u, 0u, 0u);
  }
  zero_acc(accg);
  zero_acc(accb);
  zero_acc(accd);
  // the thread's packs of dy, x and dx of row r (zeros past the row), and the row's
  // statistics and drop-path factor
  auto load = [&](int64_t r, uint4 (&d)[K], uint4 (&xx)[K], uint4 (&o)[K], float& mr, float& rsr,
                  float& frr) {
    mr = __ldg(mean + r);
    rsr = __ldg(rstd + r);
    if constexpr (PF) frr = __ldg(bf + r / bf_rows);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int p = threadIdx.x + blockDim.x * k;
      if (p < packs) {
        const int64_t at = r * C + static_cast<int64_t>(p) * V;
        d[k] = __ldg(reinterpret_cast<const uint4*>(dy + at));
        xx[k] = __ldg(reinterpret_cast<const uint4*>(x + at));
        o[k] = *reinterpret_cast<const uint4*>(dx + at);
      } else {
        d[k] = xx[k] = o[k] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  int64_t row = blockIdx.x;
  uint4 cd[K], cx[K], co[K];
  float m = 0.0f, rs = 0.0f, fr = 1.0f;
  if (row < N) load(row, cd, cx, co, m, rs, fr);
  int par = 0;
#pragma unroll 1
  for (; row < N; row += gridDim.x, par ^= 1) {
    const int64_t next = row + gridDim.x;
    uint4 nd[K], nx[K], no[K];
    float nm = 0.0f, nrs = 0.0f, nfr = 1.0f;
    if (next < N) load(next, nd, nx, no, nm, nrs, nfr);
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int j = 0; j < V; ++j) {  // (zeros past the row: g = 0 adds nothing)
        const float d = pack_elem<T>(cd[k], j);
        const float xh = (pack_elem<T>(cx[k], j) - m) * rs;
        const float g = d * pack_elem<T>(gk[k], j);
        s1 += g;
        s2 += g * xh;
        accg[k][j] += d * xh;
        accb[k][j] += d;
      }
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    if (lane == 0) {
      red[par][w][0] = s1;
      red[par][w][1] = s2;
    }
    __syncthreads();
    s1 = 0.0f;
    s2 = 0.0f;
    for (int i = 0; i < nw; ++i) {
      s1 += red[par][i][0];
      s2 += red[par][i][1];
    }
    s1 /= C;
    s2 /= C;
    // dx += rstd * (g - mean(g) - xhat * mean(g * xhat))
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int p = threadIdx.x + blockDim.x * k;
      if (p >= packs) continue;
      uint32_t o[4] = {0u, 0u, 0u, 0u}, ob[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = pack_elem<T>(cd[k], j);
        const float xh = (pack_elem<T>(cx[k], j) - m) * rs;
        const float g = d * pack_elem<T>(gk[k], j);
        const float v = pack_elem<T>(co[k], j) + rs * (g - s1 - xh * s2);
        const int sh = 8 * sizeof(T) * (j % (4 / sizeof(T)));
        o[j * sizeof(T) / 4] |= elem_bits<T>(v) << sh;
        if constexpr (PF) {
          const float vb = fr != 0.0f ? __fmul_rn(to_f(from_f<T>(v)), fr) : 0.0f;
          ob[j * sizeof(T) / 4] |= elem_bits<T>(vb) << sh;
          accd[k][j] += to_f(from_f<T>(vb));
        } else if constexpr (DS) {
          accd[k][j] += to_f(from_f<T>(v));
        }
      }
      const int64_t at = row * C + static_cast<int64_t>(p) * V;
      *reinterpret_cast<uint4*>(dx + at) = make_uint4(o[0], o[1], o[2], o[3]);
      if constexpr (PF) *reinterpret_cast<uint4*>(dbr + at) = make_uint4(ob[0], ob[1], ob[2], ob[3]);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      cd[k] = nd[k];
      cx[k] = nx[k];
      co[k] = no[k];
    }
    m = nm;
    rs = nrs;
    fr = nfr;
  }
  // the block's partial rows: each thread its own columns
  const int64_t base = static_cast<int64_t>(blockIdx.x) * C;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int p = threadIdx.x + blockDim.x * k;
    if (p >= packs) continue;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      pg[base + p * V + j] = accg[k][j];
      pb[base + p * V + j] = accb[k][j];
      if constexpr (DS) pd[base + p * V + j] = accd[k][j];
    }
  }
}

}  // namespace cuda

using namespace cuda;

namespace {
// The partial rows the first fused kernel (since removed) needed: still part of the planned
// scratch (layernorm_scratch_bytes), so the workspace plan is what it was.
constexpr int kLnBwdMaxBlocks = 132 * 4;
int ln_bwd_fused_blocks(int64_t N) {
  return static_cast<int>(std::min<int64_t>((N + 3) / 4, kLnBwdMaxBlocks));
}
// The fused kernel's grid: the blocks resident at once on an H100 /
// H200 (132 SMs x ln_bwd2_blocks_per_sm(K): 264..1056): one wave; fewer when the rows run out
// (a row per warp). A constant, not the device's SM count: the partial rows, hence the dgamma /
// dbeta bits, are the same on every GPU.
int ln_bwd2_blocks(int64_t N, int K, bool DS, bool PF = false) {
  return static_cast<int>(std::min<int64_t>((N + kLnBwd2Warps - 1) / kLnBwd2Warps,
                                            132 * ln_bwd2_blocks_per_sm(K, DS, PF)));
}
// The wide kernels' packs per thread: the forward up to 4 (256 threads up to 1024 packs, then
// more threads: <= 4096 packs), the backward up to 2 with at most 512 threads (it also holds
// the next row and its column sums: <= 128 registers; <= 1024 packs: C <= 8192 in 16-bit
// types, 4096 in fp32).
constexpr int kLnWideMaxPacksFwd = 4096, kLnWideMaxPacksBwd = 1024;
int ln_wide_fwd_k(int packs) { return packs <= 256 ? 1 : packs <= 512 ? 2 : 4; }
int ln_wide_bwd_k(int packs) { return packs <= 512 ? 1 : 2; }
// The wide backward's grid: at least 8 rows per block (the partial rows cost the final
// reduction), at most what fits at once, up to 2 blocks per SM (its register use is fixed at
// compile time, so this is the same on every sm_90 GPU) on 132 SMs: a constant, not the
// device's SM count, as ln_bwd2_blocks.
constexpr int kLnWideMaxBlocks = 132 * 2;
int ln_wide_bwd_blocks(int64_t N, int fit_per_sm) {
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>((N + 7) / 8, 132 * std::min(std::max(fit_per_sm, 1), 2))));
}
}  // namespace

// layernorm_backward's partials: 2 x [blocks, C] on the fused path (blocks capped), 2 x
// [chunks, C] on the general one (a chunk per kLnRowsPerChunk rows), 3 x [blocks, C] on the
// fused one with dx's column sums and on the wide one; the largest, whichever path the width,
// the alignments and dsum pick (and the removed first fused kernel's 2 x [blocks, C]).
size_t CudaBackend::layernorm_scratch_bytes(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  const int64_t chunks = (rows + kLnRowsPerChunk - 1) / kLnRowsPerChunk;
  int64_t floats = 2 * std::max<int64_t>(ln_bwd_fused_blocks(rows), chunks) * cols;
  // the second fused kernel: its grid depends on K, the packs per lane (C <= 256 K), and DS
  for (int K = 1; K <= kLnBwd2MaxPacks; ++K)
    for (int ds = 0; ds < (K <= kLnBwd2MaxPacksDs ? 2 : 1); ++ds)
      floats = std::max<int64_t>(floats, (2 + ds) *
                                             static_cast<int64_t>(ln_bwd2_blocks(rows, K, ds)) *
                                             std::min<int64_t>(cols, 256 * K));
  // the wide kernel: 3 x [blocks, C], at most kLnWideMaxBlocks blocks
  floats = std::max<int64_t>(floats, 3 * std::min<int64_t>((rows + 7) / 8, kLnWideMaxBlocks) *
                                         cols);
  return static_cast<size_t>(floats) * sizeof(float);
}

void CudaBackend::add_layernorm_forward(void* res, void* y, float* mean, float* rstd,
                                        const void* a, const void* b, const void* gamma,
                                        const void* beta, int N, int C, float eps,
                                        RowFactors bf) {
  OpScope op_scope(*this, "add_layernorm_forward");
  if (N <= 0 || C <= 0) return;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int threads = 256, warps = threads / 32;
    const unsigned blocks = (N + warps - 1) / warps;
    constexpr int V = 16 / sizeof(T);
    const int K = (C / V + 31) / 32;
    const bool packed = C % V == 0 && aligned16(res) && aligned16(y) && aligned16(a) &&
                        (!b || aligned16(b)) && aligned16(gamma) && aligned16(beta);
    const bool vec = packed && K <= 16;
    auto launch = [&](auto kernel) {
      kernel<<<blocks, threads, 0, stream_>>>(
          static_cast<T*>(res), static_cast<T*>(y), mean, rstd, static_cast<const T*>(a),
          static_cast<const T*>(b), static_cast<const T*>(gamma), static_cast<const T*>(beta),
          N, C, eps, b ? bf.f : nullptr, bf.rows_per);
      CUDA_CHECK_LAUNCH();
    };
    const int packs = C / V;
    const bool wide = packed && packs <= kLnWideMaxPacksFwd && C > 1024;
    if (wide) {
      // a block per row (past 4 packs per lane a warp holds too much of the row)
      const int kw = ln_wide_fwd_k(packs);
      auto launch_wide = [&](auto kernel) {
        kernel<<<N, ln_wide_threads(packs, kw), 0, stream_>>>(
            static_cast<T*>(res), static_cast<T*>(y), mean, rstd, static_cast<const T*>(a),
            static_cast<const T*>(b), static_cast<const T*>(gamma), static_cast<const T*>(beta),
            N, C, eps, b ? bf.f : nullptr, bf.rows_per);
        CUDA_CHECK_LAUNCH();
      };
      if (kw == 1) launch_wide(add_layernorm_fwd_wide_kernel<T, 1>);
      else if (kw == 2) launch_wide(add_layernorm_fwd_wide_kernel<T, 2>);
      else launch_wide(add_layernorm_fwd_wide_kernel<T, 4>);
    } else if (!vec) launch(add_layernorm_fwd_kernel<T>);
    else if (K <= 1) launch(add_layernorm_fwd_vec_kernel<T, 1>);
    else if (K == 2) launch(add_layernorm_fwd_vec_kernel<T, 2>);
    else if (K == 3) launch(add_layernorm_fwd_vec_kernel<T, 3>);
    else if (K == 4) launch(add_layernorm_fwd_vec_kernel<T, 4>);
    else if (K <= 6) launch(add_layernorm_fwd_vec_kernel<T, 6>);
    else if (K <= 8) launch(add_layernorm_fwd_vec_kernel<T, 8>);
    else launch(add_layernorm_fwd_vec_kernel<T, 16>);
  });
}

// Rows the fused kernel takes: 16-bit, whole 16-byte packs, at most 4 packs per lane (C <= 1024).
static bool layernorm_fp8_fused(int64_t C, size_t act_size) {
  return act_size == 2 && C % 8 == 0 && (C / 8 + 31) / 32 <= 4;
}

size_t CudaBackend::layernorm_fp8_scratch_bytes(int64_t rows, int64_t cols, size_t act_size) {
  if (rows <= 0 || cols <= 0 || layernorm_fp8_fused(cols, act_size)) return 0;
  return static_cast<size_t>(rows) * static_cast<size_t>(cols) * act_size;
}

void CudaBackend::add_layernorm_forward_fp8(void* res, uint8_t* out, uint8_t* out_t,
                                            float* amax, const float* scale, Fp8Format f,
                                            float* mean, float* rstd, const void* a,
                                            const void* b, const void* gamma, const void* beta,
                                            int N, int C, float eps, RowFactors bf) {
  OpScope op_scope(*this, "add_layernorm_forward_fp8");
  check_fp8_cast_args(out, out_t, amax, N, C, scale);
  if (N <= 0 || C <= 0) return;
  const __nv_fp8_interpretation_t fmt = f == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
  bool fused = false;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = 16 / sizeof(T);
    if constexpr (V == 8) {
      const int K = (C / V + 31) / 32;
      if (!layernorm_fp8_fused(C, sizeof(T)) || !aligned16(res) || !aligned16(a) ||
          (b && !aligned16(b)) || !aligned16(gamma) || !aligned16(beta) ||
          (out && !aligned8(out)) || (out_t && !aligned8(out_t)))
        return;
      const unsigned blocks = static_cast<unsigned>((N + kLnFp8Rows - 1) / kLnFp8Rows);
      const size_t smem = static_cast<size_t>(kLnFp8Rows) * (C + 4);
      auto launch = [&](auto kernel) {
        kernel<<<blocks, 32 * kLnFp8Warps, smem, stream_>>>(
            static_cast<T*>(res), out, out_t, amax, scale, fmt, mean, rstd,
            static_cast<const T*>(a), static_cast<const T*>(b), static_cast<const T*>(gamma),
            static_cast<const T*>(beta), N, C, eps, b ? bf.f : nullptr, bf.rows_per);
        CUDA_CHECK_LAUNCH();
      };
      if (K <= 1) launch(add_layernorm_fwd_fp8_kernel<T, 1>);
      else if (K == 2) launch(add_layernorm_fwd_fp8_kernel<T, 2>);
      else if (K == 3) launch(add_layernorm_fwd_fp8_kernel<T, 3>);
      else launch(add_layernorm_fwd_fp8_kernel<T, 4>);
      fused = true;
    }
  });
  if (fused) return;
  // wider rows, fp32 activations, unaligned buffers: the LayerNorm into scratch (planned:
  // layernorm_fp8_scratch_bytes), then the cast
  void* y = scratch(static_cast<size_t>(N) * C * act_size());
  add_layernorm_forward(res, y, mean, rstd, a, b, gamma, beta, N, C, eps, bf);
  fp8_cast(out, out_t, amax, y, N, C, scale, f);
}

void CudaBackend::layernorm_backward(void* dx, float* dgamma, float* dbeta, const void* dy,
                                     const void* x, const void* gamma, const float* mean,
                                     const float* rstd, int N, int C, float* dsum,
                                     void* dbranch, RowFactors bf) {
  OpScope op_scope(*this, "layernorm_backward");
  if (N <= 0 || C <= 0) return;
  VG_CHECK(!bf.f || (dbranch && dbranch != dx), "layernorm_backward: row factors need dbranch");
  const bool pf = bf.f != nullptr;
  bool done = false, summed = false;  // dx's (or dbranch's) column sums into dsum too
  bool factored = false;              // dbranch written
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = 16 / sizeof(T);
    const int packs = C / V;
    const int K = (packs + 31) / 32;  // packs per lane
    // the kernel's variant: dbranch and its sums (PF), dx's sums (DS), or dx alone (then the
    // passes below); each reaches so many packs per lane
    const bool pf_fused = pf && K <= kLnBwd2MaxPacksPf && aligned16(dbranch);
    const bool ds_fused = dsum && !pf;
    const int kmax = pf_fused ? kLnBwd2MaxPacksPf : ds_fused ? kLnBwd2MaxPacksDs : kLnBwd2MaxPacks;
    const bool vec_ok = C % V == 0 && aligned16(dx) && aligned16(dy) && aligned16(x) &&
                        aligned16(gamma) && (!pf || aligned16(dbranch));
    // the block-per-row kernel: past the reach (packs per lane) of the fused kernel's variant
    // the call would take; it does the factors and the sums
    const int warp_reach = pf ? kLnBwd2MaxPacksPf : dsum ? kLnBwd2MaxPacksDs : kLnBwd2MaxPacks;
    if (vec_ok && packs <= kLnWideMaxPacksBwd && K > warp_reach) {
      const int kw = ln_wide_bwd_k(packs), threads = ln_wide_threads(packs, kw);
      auto launch_wide = [&](auto kernel, bool DS) {
        // blocks of this many threads that fit on an SM, once per kernel and width
        static std::mutex mu;
        static std::map<int, int> fit;
        int per_sm = 1;
        {
          std::lock_guard<std::mutex> lock(mu);
          auto it = fit.find(threads);
          if (it == fit.end()) {
            if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) !=
                cudaSuccess) {
              (void)cudaGetLastError();
              per_sm = 1;
            }
            it = fit.emplace(threads, per_sm).first;
          }
          per_sm = it->second;
        }
        const int blocks = ln_wide_bwd_blocks(N, per_sm);
        const size_t part = static_cast<size_t>(blocks) * C;
        float* pg = static_cast<float*>(scratch((DS ? 3 : 2) * part * sizeof(float)));
        float* pb = pg + part;
        float* pd = DS ? pb + part : nullptr;
        kernel<<<blocks, threads, 0, stream_>>>(
            static_cast<T*>(dx), pg, pb, pd, static_cast<const T*>(dy),
            static_cast<const T*>(x), static_cast<const T*>(gamma), mean, rstd, N, C,
            static_cast<T*>(dbranch), bf.f, bf.rows_per);
        CUDA_CHECK_LAUNCH();
        launch_layernorm_bwd_param_final(stream_, dgamma, dbeta, pg, pb, blocks, C,
                                         DS ? dsum : nullptr, pd);
        CUDA_CHECK_LAUNCH();
      };
      if (kw == 1) {
        if (pf) launch_wide(layernorm_bwd_wide_kernel<T, 1, true, true>, true);
        else if (dsum) launch_wide(layernorm_bwd_wide_kernel<T, 1, true, false>, true);
        else launch_wide(layernorm_bwd_wide_kernel<T, 1, false, false>, false);
      } else {
        if (pf) launch_wide(layernorm_bwd_wide_kernel<T, 2, true, true>, true);
        else if (dsum) launch_wide(layernorm_bwd_wide_kernel<T, 2, true, false>, true);
        else launch_wide(layernorm_bwd_wide_kernel<T, 2, false, false>, false);
      }
      done = true;
      summed = dsum != nullptr || pf;
      factored = pf;
      return;
    }
    // the fused kernel: one partial row per block. With a dbranch that is not 16-byte aligned
    // (vec_ok false for that alone) the variant without the factors and sums, which the passes
    // below then do.
    const bool plain_ok = C % V == 0 && aligned16(dx) && aligned16(dy) && aligned16(x) &&
                          aligned16(gamma);
    if (plain_ok && K <= kmax) {
      auto launch2 = [&](auto k_tag, auto ds_tag, auto pf_tag) {
        constexpr int K = decltype(k_tag)::value;
        constexpr bool DS = decltype(ds_tag)::value, PF = decltype(pf_tag)::value;
        auto kernel = layernorm_bwd_fused2_kernel<T, K, DS, PF>;
        const int blocks = ln_bwd2_blocks(N, K, DS, PF);
        const size_t part = static_cast<size_t>(blocks) * C;
        float* pg = static_cast<float*>(scratch((DS ? 3 : 2) * part * sizeof(float)));
        float* pb = pg + part;
        float* pd = DS ? pb + part : nullptr;
        const size_t smem = ln_bwd2_smem(K);
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
        // all of L1 as shared memory: the grid assumes ln_bwd2_blocks_per_sm(K, DS) blocks fit
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
        // once per kernel: say so when the grid does not fit in one wave on this GPU (other
        // SM count or register use): the rows of the blocks left over then run in a second
        // wave at low occupancy (same results, slower)
        static const bool fits = [&] {
          int per_sm = 0, sms = 0;
          if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * kLnBwd2Warps,
                                                            smem) != cudaSuccess ||
              cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_) !=
                  cudaSuccess) {
            (void)cudaGetLastError();
            return true;  // unknown: nothing to report
          }
          const int want = 132 * ln_bwd2_blocks_per_sm(K, DS, PF);
          if (per_sm * sms >= want) return true;
          std::fprintf(stderr,
                       "vitgrid: LayerNorm backward (fused kernel, %d packs per lane%s): %d "
                       "blocks fit at once (%d SMs x %d), the grid has up to %d; expect it "
                       "slower than on an H100 / H200\n",
                       K, DS ? ", dx column sums" : "", per_sm * sms, sms, per_sm, want);
          return false;
        }();
        (void)fits;
        kernel<<<blocks, 32 * kLnBwd2Warps, smem, stream_>>>(
            static_cast<T*>(dx), pg, pb, pd, static_cast<const T*>(dy),
            static_cast<const T*>(x), static_cast<const T*>(gamma), mean, rstd, N, C,
            static_cast<T*>(dbranch), bf.f, bf.rows_per, nullptr, nullptr, nullptr, nullptr,
            __NV_E5M2);
        CUDA_CHECK_LAUNCH();
        launch_layernorm_bwd_param_final(stream_, dgamma, dbeta, pg, pb, blocks, C,
                                         DS ? dsum : nullptr, pd);
        CUDA_CHECK_LAUNCH();
      };
      auto with_k = [&](auto ds_tag, auto pf_tag) {
        constexpr bool DS = decltype(ds_tag)::value, PF = decltype(pf_tag)::value;
        switch (K) {
          case 1: launch2(std::integral_constant<int, 1>{}, ds_tag, pf_tag); break;
          case 2: launch2(std::integral_constant<int, 2>{}, ds_tag, pf_tag); break;
          case 3: launch2(std::integral_constant<int, 3>{}, ds_tag, pf_tag); break;
          case 4: launch2(std::integral_constant<int, 4>{}, ds_tag, pf_tag); break;
          case 5:
            if constexpr (!PF) launch2(std::integral_constant<int, 5>{}, ds_tag, pf_tag);
            break;
          default:
            if constexpr (!DS) launch2(std::integral_constant<int, 6>{}, ds_tag, pf_tag);
            break;
        }
      };
      if (pf_fused) with_k(std::true_type{}, std::true_type{});  // (pd unread without dsum)
      else if (ds_fused) with_k(std::true_type{}, std::false_type{});
      else with_k(std::false_type{}, std::false_type{});
      done = true;
      summed = pf_fused || ds_fused;
      factored = pf_fused;
      return;
    }
  });
  if (!done) layernorm_backward_general(dx, dgamma, dbeta, dy, x, gamma, mean, rstd, N, C);
  // the paths without the factors or the sums: passes of their own over the updated dx
  if (pf && !factored) {
    dispatch_act(act_, [&](auto tag) {
      using T = typename decltype(tag)::type;
      row_factors_kernel<T><<<grid_for(static_cast<size_t>(N) * C, 256), 256, 0, stream_>>>(
          static_cast<T*>(dbranch), static_cast<const T*>(dx), bf.f, bf.rows_per, N, C);
      CUDA_CHECK_LAUNCH();
    });
  }
  if (dsum && !summed) column_sums_add(dsum, pf ? dbranch : dx, N, C);
}

// layernorm_backward_fp8: the fused kernel's F8 variant (8 warps, groups of 32 rows, the codes
// staged for the transpose), its partial rows reduced as layernorm_backward's; rows it does not
// take go through Backend's two ops.
void CudaBackend::layernorm_backward_fp8(void* dx, float* dgamma, float* dbeta, const void* dy,
                                         const void* x, const void* gamma, const float* mean,
                                         const float* rstd, int N, int C, float* dsum,
                                         void* dbranch, RowFactors bf, uint8_t* out,
                                         uint8_t* out_t, float* amax, const float* scale,
                                         Fp8Format f) {
  OpScope op_scope(*this, "layernorm_backward_fp8");
  check_fp8_cast_args(out, out_t, amax, N, C, scale);
  VG_CHECK(!bf.f || (dbranch && dbranch != dx), "layernorm_backward_fp8: row factors need dbranch");
  if (N <= 0 || C <= 0) return;
  const bool pf = bf.f != nullptr, ds = pf || dsum != nullptr;
  const int K = (C / 8 + 31) / 32;
  const bool fused = act_size() == 2 && C % 8 == 0 && K <= kLnBwdF8MaxPacks && aligned16(dx) &&
                     aligned16(dy) && aligned16(x) && aligned16(gamma) &&
                     (!pf || aligned16(dbranch)) && (!out || aligned8(out)) &&
                     (!out_t || aligned8(out_t));
  if (!fused) {
    Backend::layernorm_backward_fp8(dx, dgamma, dbeta, dy, x, gamma, mean, rstd, N, C, dsum,
                                    dbranch, bf, out, out_t, amax, scale, f);
    return;
  }
  const __nv_fp8_interpretation_t fmt = f == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (sizeof(T) == 2) {
      auto launch = [&](auto k_tag, auto ds_tag, auto pf_tag) {
        constexpr int KK = decltype(k_tag)::value;
        constexpr bool DS = decltype(ds_tag)::value, PF = decltype(pf_tag)::value;
        constexpr int W = kLnBwdF8Warps;
        auto kernel = layernorm_bwd_fused2_kernel<T, KK, DS, PF, true, W>;
        const int64_t groups = (static_cast<int64_t>(N) + kLnBwdF8Rows - 1) / kLnBwdF8Rows;
        const int blocks = static_cast<int>(std::min<int64_t>(
            groups, 132 * (ln_bwd2_blocks_per_sm(KK, DS, PF) * kLnBwd2Warps / W)));
        const size_t part = static_cast<size_t>(blocks) * C;
        float* pg = static_cast<float*>(scratch((DS ? 3 : 2) * part * sizeof(float)));
        float* pb = pg + part;
        float* pd = DS ? pb + part : nullptr;
        const size_t smem = ln_bwd_f8_smem(KK, C);
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
        kernel<<<blocks, 32 * W, smem, stream_>>>(
            static_cast<T*>(dx), pg, pb, pd, static_cast<const T*>(dy), static_cast<const T*>(x),
            static_cast<const T*>(gamma), mean, rstd, N, C, static_cast<T*>(dbranch), bf.f,
            bf.rows_per, out, out_t, amax, scale, fmt);
        CUDA_CHECK_LAUNCH();
        launch_layernorm_bwd_param_final(stream_, dgamma, dbeta, pg, pb, blocks, C,
                                         DS ? dsum : nullptr, pd);
        CUDA_CHECK_LAUNCH();
      };
      auto with_k = [&](auto ds_tag, auto pf_tag) {
        switch (K) {
          case 1: launch(std::integral_constant<int, 1>{}, ds_tag, pf_tag); break;
          case 2: launch(std::integral_constant<int, 2>{}, ds_tag, pf_tag); break;
          case 3: launch(std::integral_constant<int, 3>{}, ds_tag, pf_tag); break;
          default: launch(std::integral_constant<int, 4>{}, ds_tag, pf_tag); break;
        }
      };
      if (pf) with_k(std::true_type{}, std::true_type{});  // (pd unread without dsum)
      else if (ds) with_k(std::true_type{}, std::false_type{});
      else with_k(std::false_type{}, std::false_type{});
    }
  });
}

// The unfused LayerNorm backward: any width and alignment.
void CudaBackend::layernorm_backward_general(void* dx, float* dgamma, float* dbeta,
                                             const void* dy, const void* x, const void* gamma,
                                             const float* mean, const float* rstd, int N,
                                             int C) {
  const int chunks = (N + kLnRowsPerChunk - 1) / kLnRowsPerChunk;
  float* pg = static_cast<float*>(scratch(2 * static_cast<size_t>(chunks) * C * sizeof(float)));
  float* pb = pg + static_cast<size_t>(chunks) * C;
  dispatch_act(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int threads = 256, warps = threads / 32;
    layernorm_bwd_dx_kernel<<<(N + warps - 1) / warps, threads, 0, stream_>>>(
        static_cast<T*>(dx), static_cast<const T*>(dy), static_cast<const T*>(x),
        static_cast<const T*>(gamma), mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
    launch_layernorm_bwd_param_partial(stream_, pg, pb, static_cast<const T*>(dy),
                                       static_cast<const T*>(x), mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
  });
  launch_layernorm_bwd_param_final(stream_, dgamma, dbeta, pg, pb, chunks, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace vitgrid
