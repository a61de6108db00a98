// The backend factory: the one place that knows which backends this build has.
#include <memory>
#include <string>

#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/core/error.h"

#ifdef VITGRID_HAVE_CUDA
#include "vitgrid/backend/cuda/cuda_backend.h"
#endif

namespace vitgrid {

std::unique_ptr<Backend> make_backend(const std::string& kind, int device, DType act,
                                      const BackendOptions& opts) {
  if (kind == "cpu") {
    // One core per rank, nothing to select; TF32 does not exist on the CPU (fp32 GEMMs are
    // always full fp32 there), and every CPU op is deterministic.
    (void)device;
    (void)opts;
    return std::make_unique<CpuBackend>(act);
  }
  if (kind == "cuda") {
#ifdef VITGRID_HAVE_CUDA
    return make_cuda_backend(device, act, opts);
#else
    throw UserError("device.backend = cuda but this vitgrid was built without CUDA");
#endif
  }
  throw UserError("device.backend = '" + kind + "' is not a backend (expected cpu or cuda)");
}

bool cuda_available() {
#ifdef VITGRID_HAVE_CUDA
  return cuda_device_count() > 0;
#else
  return false;
#endif
}

}  // namespace vitgrid
