// Basic element types shared by every layer.
#pragma once
#include <cstddef>
#include <cstdint>

namespace vitgrid {

// Storage type of activations and compute weights. Gradients, master weights and optimizer
// state are always fp32.
enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };

inline size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }
inline const char* dtype_name(DType t) {
  return t == DType::F32 ? "fp32" : (t == DType::BF16 ? "bf16" : "fp16");
}

// A contiguous slice of a flat parameter buffer: one named parameter (or its local shard).
// The optimizers work on lists of these so that one multi-tensor launch updates everything.
struct ParamSlice {
  size_t offset = 0;          // element offset in the flat buffer
  size_t n = 0;               // elements
  float weight_decay = 0.0f;  // 0 for biases, norms, cls token, pos embed (when switched off)
};

}  // namespace vitgrid
