// tensor = 1: the 1-rank layout every other mode must reproduce.
#include "vitgrid/core/error.h"
#include "vitgrid/parallel/tensor_parallel.h"

namespace vitgrid {
namespace {

class TensorParallelNone final : public TensorParallel {
 public:
  explicit TensorParallelNone(Backend& be) : be_(be) {}
  TensorMode mode() const override { return TensorMode::None; }
  Shard shard_linear_weight(int64_t out, int64_t in, LinearRole) const override {
    return {{0, 0}, {out, in}, {}};
  }
  Shard shard_linear_bias(int64_t out, LinearRole) const override { return {{0}, {out}, {}}; }
  Shard shard_hidden_vector(const std::vector<int64_t>& shape) const override {
    return {std::vector<int64_t>(shape.size(), 0), shape, {}};
  }
  int local_batch(int batch) const override { return batch; }
  int local_heads(int heads) const override { return heads; }
  void linear_forward(LinearRole, void* y, const void* x, const void* W, const void* b,
                      int rows, int in, int out, void* gelu_out, Gelu g) override {
    be_.linear_forward(y, x, W, b, rows, in, out, gelu_out, g);
  }
  void linear_backward(LinearRole, void* dx, float* dW, float* db, const void* dy,
                       const void* x, const void* W, int rows, int in, int out) override {
    be_.linear_backward(dx, dW, db, dy, x, W, rows, in, out);
  }
  void reduce_param_norms(std::vector<double>&) override {}
  void reduce_replicated_grads(float*, const std::vector<ParamInfo>&) override {}

 private:
  Backend& be_;
};

}  // namespace

std::unique_ptr<TensorParallel> make_tensor_parallel(const ProcessGrid& grid, Backend& backend,
                                                     Collectives& /*coll*/) {
  if (grid.shape().tensor != 1)
    throw UserError(std::string("parallel.tensor_mode = ") + tensor_mode_name(grid.shape().mode) +
                    " with parallel.tensor = " + std::to_string(grid.shape().tensor) +
                    ": tensor parallelism is not available in this build yet (tensor = 1 only)");
  return std::make_unique<TensorParallelNone>(backend);
}

}  // namespace vitgrid
