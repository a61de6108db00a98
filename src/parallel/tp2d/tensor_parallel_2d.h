// The SUMMA strategy of tp2d/, shared with 2.5d (tp2p5d/): q x q grids stacked over the
// TensorDepth axis (size 1 in 2d).
#pragma once
#include "../common/tp_common.h"

namespace vitgrid {

std::unique_ptr<TensorParallel> make_tensor_parallel_summa(const ProcessGrid& grid, Backend& be,
                                                           Collectives& coll, TensorMode mode);

}  // namespace vitgrid
