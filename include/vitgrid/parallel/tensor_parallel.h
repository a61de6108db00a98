// The tensor-parallel seam. The model is written once against this interface; each mode
// (none, 1d, 2d, 2.5d, 3d) is one implementation in its own folder under src/parallel/,
// chosen once from the deck. A strategy decides how every parameter is sharded, how large
// the local activations are, and which collectives a Linear, a LayerNorm and the loss need.
//
// This interface is what the model calls; the strategy calls the backend and the grid's
// Collectives. Kernels never know about ranks and the model never calls MPI.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/grid/grid.h"

namespace vitgrid {

// How a Linear's weight is split (Megatron 1d: qkv/fc1 column, proj/fc2 row).
enum class LinearRole : int { Column = 0, Row = 1, Replicated = 2 };

// Where a parameter's local shard sits in the global tensor: the checkpoint hyperslab.
struct Shard {
  std::vector<int64_t> offset;
  std::vector<int64_t> count;
  // Axes over which this shard is replicated (its gradient is summed over them after the
  // data-parallel reduction, and only coordinate 0 of them writes it to a checkpoint).
  std::vector<Axis> replicated_over;
  // Optional strided selection (HDF5 semantics: `count` blocks of `block` spaced `stride`),
  // e.g. a 1d shard of qkv.weight is three row blocks, one each of q, k and v. Empty: one
  // contiguous block of `count`.
  std::vector<int64_t> stride;
  std::vector<int64_t> block;
};

struct ParamInfo;

class TensorParallel {
 public:
  virtual ~TensorParallel() = default;
  virtual TensorMode mode() const = 0;
  // The local shard of a parameter of global shape `shape` used in role `role` ("weight" of a
  // Linear [out, in], its "bias" [out], or a per-hidden vector such as a LayerNorm's).
  virtual Shard shard_linear_weight(int64_t out, int64_t in, LinearRole role) const = 0;
  virtual Shard shard_linear_bias(int64_t out, LinearRole role) const = 0;
  virtual Shard shard_hidden_vector(const std::vector<int64_t>& shape) const = 0;
  // Local sizes of the activation dims the model allocates.
  virtual int local_batch(int batch) const = 0;
  virtual int local_heads(int heads) const = 0;

  // y = x W^T + b for a Linear of global [out, in]; rows = local rows (batch * tokens).
  virtual void linear_forward(LinearRole role, void* y, const void* x, const void* W,
                              const void* b, int rows, int in, int out, void* gelu_out,
                              Gelu g) = 0;
  virtual void linear_backward(LinearRole role, void* dx, float* dW, float* db, const void* dy,
                               const void* x, const void* W, int rows, int in, int out) = 0;
  // Sum of squares of the whole (unsharded) parameters: per-slice local sums reduced over the
  // axes each parameter is sharded on, so LAMB trust ratios and clipping use true norms.
  virtual void reduce_param_norms(std::vector<double>& sq) = 0;
  // Sums, over the tensor sub-axes in each parameter's Shard::replicated_over, the partial
  // gradients of replicated parameters (e.g. LayerNorm weights when the batch is split).
  virtual void reduce_replicated_grads(float* grads, const std::vector<ParamInfo>& params) = 0;
};

// none (tensor = 1): every call goes straight to the backend.
std::unique_ptr<TensorParallel> make_tensor_parallel(const ProcessGrid& grid, Backend& backend,
                                                     Collectives& coll);

}  // namespace vitgrid
