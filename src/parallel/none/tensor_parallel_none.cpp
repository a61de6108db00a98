// tensor = 1: the 1-rank layout every other mode must reproduce. Every call goes straight to
// the backend (the base's Stream description is trivial: no hidden split, no batch split).
#include "../common/tp_common.h"

namespace vitgrid {
namespace {

class TensorParallelNone final : public TensorParallelBase {
 public:
  TensorParallelNone(const ProcessGrid& grid, Backend& be, Collectives& coll)
      : TensorParallelBase(grid, be, coll, {}, false, Axis::Tensor, {}) {}
  TensorMode mode() const override { return TensorMode::None; }
  ActBlock act_block(ActLayout, int batch, int64_t width) const override {
    return stream_block(batch, width);
  }
  int local_heads(int heads) const override { return heads; }
  TpFusions fusions() const override {
    TpFusions f;
    f.gelu_bias_in_row_backward = f.row_bias_in_layernorm_backward = true;
    f.layernorm_row_factors = true;
    f.fp8 = f.fp8_gelu_in_dy_cast = f.fp8_keep_x_transposes = f.fp8_layernorm_cast = true;
    f.fp8_attention_dy_cast = f.fp8_layernorm_dy_cast = true;
    return f;
  }

 private:
  Shard parallel_weight(int64_t out, int64_t in, LinearRole, int) const override {
    return shard_linear_weight(out, in, LinearRole::Replicated, 1);
  }
  Shard parallel_bias(int64_t out, LinearRole, int) const override {
    return shard_linear_bias(out, LinearRole::Replicated, 1);
  }
  void parallel_forward(LinearRole, void* y, const void* x, const void* W, const void* b,
                        int rows, int in, int out, void* gelu_out, Gelu g, int) override {
    local_forward(y, x, W, b, rows, in, out, gelu_out, g);
  }
  void parallel_backward(LinearRole, void* dx, float* dW, float* db, const void* dy,
                         const void* x, const void* W, int rows, int in, int out, int,
                         const void* gelu_pre, Gelu g, float* gelu_db) override {
    local_backward(dx, dW, db, dy, x, W, rows, in, out, gelu_pre, g, gelu_db);
  }
};

}  // namespace

std::unique_ptr<TensorParallel> make_tensor_parallel_none(const ProcessGrid& grid, Backend& be,
                                                          Collectives& coll) {
  return std::make_unique<TensorParallelNone>(grid, be, coll);
}

}  // namespace vitgrid
