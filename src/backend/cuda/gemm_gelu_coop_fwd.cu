// Cooperative forward kernels of the fused GEMM + exact GELU (gemm_gelu.h; the templates in
// gemm_gelu_kernels.cuh, the id order in gemm_gelu.cu). sm_90a, CUTLASS only.
#include "gemm_gelu_kernels.cuh"

namespace vitgrid {
namespace cuda {
namespace gemm_gelu_detail {
namespace {

constexpr GemmGeluKernel kBf16[] = {
    entry<Coop<128, 256, 2, 1>, cutlass::bfloat16_t, true>("coop 128x256x64 cluster 2x1"),
    entry<Coop<128, 256, 1, 2>, cutlass::bfloat16_t, true>("coop 128x256x64 cluster 1x2"),
    entry<Coop<256, 128, 1, 2>, cutlass::bfloat16_t, true>("coop 256x128x64 cluster 1x2"),
};
constexpr GemmGeluKernel kF16[] = {
    entry<Coop<128, 256, 2, 1>, cutlass::half_t, true>("coop 128x256x64 cluster 2x1"),
};

}  // namespace

const GemmGeluKernel* kernels_coop_fwd(DType act, int* n) {
  return table_for(act, n, kBf16, kF16);
}

}  // namespace gemm_gelu_detail
}  // namespace cuda
}  // namespace vitgrid
