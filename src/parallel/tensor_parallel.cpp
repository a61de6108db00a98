// make_tensor_parallel: the one place that looks at the mode. Each mode lives in its folder.
#include "vitgrid/parallel/tensor_parallel.h"

#include "common/tp_common.h"
#include "vitgrid/core/error.h"

namespace vitgrid {

std::unique_ptr<TensorParallel> make_tensor_parallel(const ProcessGrid& grid, Backend& backend,
                                                     Collectives& coll) {
  const GridShape& s = grid.shape();
  if (s.tensor == 1) return make_tensor_parallel_none(grid, backend, coll);
  // Every mode runs on any backend and act dtype: activations (and their gradients) are
  // reduced in the act dtype (Backend::act_size() bytes per element), weight gradients and
  // LayerNorm statistics in fp32, and the split LayerNorm uses the backend's ops.
  switch (s.mode) {
    case TensorMode::D1:
      return make_tensor_parallel_1d(grid, backend, coll);
    case TensorMode::D2:
      return make_tensor_parallel_2d(grid, backend, coll);
    case TensorMode::D2p5:
      return make_tensor_parallel_2p5d(grid, backend, coll);
    case TensorMode::D3:
      return make_tensor_parallel_3d(grid, backend, coll);
    case TensorMode::None:
      break;
  }
  throw UserError("parallel.tensor_mode: parallel.tensor = " + std::to_string(s.tensor) +
                  " needs a tensor_mode (1d|2d|2.5d|3d)");
}

}  // namespace vitgrid
