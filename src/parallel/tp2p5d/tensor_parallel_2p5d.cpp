// 2.5d tensor parallelism (Tesseract, Colossal-AI parallel_2p5d): tensor = d*q*q, d stacked
// q x q SUMMA grids. The batch is split over depth too (d*q sample blocks, block k*q + i),
// so a depth layer runs 2d SUMMA on its own samples; weights are replicated over depth and
// their gradients summed over the Depth axis (Shard::partial_over), as are the LayerNorm,
// embedding and head parameters' (over Col and Depth). The Linear and LayerNorm algorithms are
// tp2d's, which is written for any depth.
#include "../tp2d/tensor_parallel_2d.h"

namespace vitgrid {

std::unique_ptr<TensorParallel> make_tensor_parallel_2p5d(const ProcessGrid& grid, Backend& be,
                                                          Collectives& coll) {
  return make_tensor_parallel_summa(grid, be, coll, TensorMode::D2p5);
}

}  // namespace vitgrid
