// Ping-pong backward kernels of the fused GEMM + exact GELU (gemm_gelu.h; the templates in
// gemm_gelu_kernels.cuh, the id order in gemm_gelu.cu). sm_90a, CUTLASS only.
#include "gemm_gelu_kernels.cuh"

namespace vitgrid {
namespace cuda {
namespace gemm_gelu_detail {
namespace {

constexpr GemmGeluKernel kBf16[] = {
    entry<Pingpong<128, 128, 2, 1>, cutlass::bfloat16_t, false>("pingpong 128x128x64 cluster 2x1"),
    entry<Pingpong<128, 128, 2, 1, 64>, cutlass::bfloat16_t, false>(
        "pingpong 128x128x64 cluster 2x1 epi 64x64"),
    entry<Pingpong<64, 256, 2, 1>, cutlass::bfloat16_t, false>("pingpong 64x256x64 cluster 2x1"),
};

}  // namespace

const GemmGeluKernel* kernels_pingpong_bwd(DType act, int* n) {
  return table_for(act, n, kBf16);
}

}  // namespace gemm_gelu_detail
}  // namespace cuda
}  // namespace vitgrid
