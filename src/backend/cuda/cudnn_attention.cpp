// cuDNN fused scaled-dot-product attention through the cudnn_frontend graph API (see
// cudnn_attention.h for the contract and layouts). Built only when CMake found the frontend's
// headers (VITGRID_HAVE_CUDNN_FRONTEND); otherwise the stubs at the end say "not available".
//
// Per shape (act dtype, B, T, H, hd) two graphs are built once and cached: the forward
// (sdpa node, generate_stats: O and the fp32 log-sum-exp) and the backward (sdpa_backward
// node, cuDNN's deterministic algorithm unless the backend allows atomics: dQ, dK, dV). Each
// goes validate ->
// build_operation_graph -> execution plans from heuristics mode A, then the fallback list ->
// check_support -> build_plans (heuristics' first working plan). Any failure, including a
// thrown exception, marks the shape unsupported with the reason, and the backend takes the
// flash kernels for it; a failure to *execute* a built plan is fatal (VG_FAIL), like any
// other CUDA error. The handle is made on the first shape that needs it, on the backend's
// stream, so graphs execute in order with every other op.
#include "cudnn_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cuda_backend_impl.h"

#if defined(VITGRID_HAVE_CUDNN_FRONTEND) && VITGRID_HAVE_CUDNN_FRONTEND
#define VG_CUDNN_SDPA 1
// The frontend's JSON (de)serialisation is not needed here and costs half its compile time.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>
#else
#define VG_CUDNN_SDPA 0
#endif

namespace vitgrid {

void cuda::CudnnAttentionDelete::operator()(CudnnAttention* p) const { delete p; }

namespace cuda {

bool CudnnAttention::eligible(DType act, int hd) {
  return act != DType::F32 && (hd == 64 || hd == 80 || hd == 128);
}

#if VG_CUDNN_SDPA

namespace fe = cudnn_frontend;

namespace {

// Tensor uids of the variant packs.
enum : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV };

struct Shape {
  int act, B, T, H, hd;
  bool operator<(const Shape& o) const {
    return std::tie(act, B, T, H, hd) < std::tie(o.act, o.B, o.T, o.H, o.hd);
  }
};

struct Entry {
  bool ok = false;
  std::string why;  // reason when !ok
  std::shared_ptr<fe::graph::Graph> fwd, bwd;
  size_t ws = 0;  // max of the two graphs' workspaces
};

fe::DataType_t io_type(DType act) {
  return act == DType::BF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
}

// The scale of the other paths, bit for bit.
float attn_scale(int hd) { return 1.0f / std::sqrt(static_cast<float>(hd)); }

// [B,H,T,hd] views of the backend's layouts (elements).
struct Views {
  std::vector<int64_t> dim, qkv_stride, out_stride, stats_dim, stats_stride;
  Views(int64_t B, int64_t T, int64_t H, int64_t hd) {
    const int64_t C = H * hd, C3 = 3 * C;
    dim = {B, H, T, hd};
    qkv_stride = {T * C3, hd, C3, 1};
    out_stride = {T * C, hd, C, 1};
    stats_dim = {B, H, T, 1};
    stats_stride = {H * T, T, 1, 1};
  }
};

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name,
                                                    int64_t uid, const std::vector<int64_t>& dim,
                                                    const std::vector<int64_t>& stride) {
  return g.tensor(
      fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride));
}

std::shared_ptr<fe::graph::Graph> new_graph(DType act) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(io_type(act))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Graph> forward_graph(DType act, const Views& v, int hd) {
  auto g = new_graph(act);
  auto Q = input(*g, "Q", kQ, v.dim, v.qkv_stride);
  auto K = input(*g, "K", kK, v.dim, v.qkv_stride);
  auto V = input(*g, "V", kV, v.dim, v.qkv_stride);
  auto opts = fe::graph::SDPA_attributes()
                  .set_name("vitgrid_sdpa_fwd")
                  .set_generate_stats(true)
                  .set_attn_scale(attn_scale(hd));
  auto outs = g->sdpa(Q, K, V, opts);
  outs[0]->set_output(true).set_uid(kO).set_dim(v.dim).set_stride(v.out_stride);
  outs[1]
      ->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(v.stats_dim)
      .set_stride(v.stats_stride);
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(DType act, const Views& v, int hd,
                                                bool deterministic) {
  auto g = new_graph(act);
  auto Q = input(*g, "Q", kQ, v.dim, v.qkv_stride);
  auto K = input(*g, "K", kK, v.dim, v.qkv_stride);
  auto V = input(*g, "V", kV, v.dim, v.qkv_stride);
  auto O = input(*g, "O", kO, v.dim, v.out_stride);
  auto dO = input(*g, "dO", kdO, v.dim, v.out_stride);
  auto St = input(*g, "Stats", kStats, v.stats_dim, v.stats_stride);
  St->set_data_type(fe::DataType_t::FLOAT);
  auto opts = fe::graph::SDPA_backward_attributes()
                  .set_name("vitgrid_sdpa_bwd")
                  .set_attn_scale(attn_scale(hd))
                  .set_deterministic_algorithm(deterministic);
  auto grads = g->sdpa_backward(Q, K, V, O, dO, St, opts);
  grads[0]->set_output(true).set_uid(kdQ).set_dim(v.dim).set_stride(v.qkv_stride);
  grads[1]->set_output(true).set_uid(kdK).set_dim(v.dim).set_stride(v.qkv_stride);
  grads[2]->set_output(true).set_uid(kdV).set_dim(v.dim).set_stride(v.qkv_stride);
  return g;
}

// Runs the build steps; "" on success, else the failing step and cuDNN's message.
std::string build(fe::graph::Graph& g, cudnnHandle_t handle, size_t* ws) {
  auto fail = [](const char* step, fe::error_t e) {
    return std::string(step) + ": " + e.get_message();
  };
  fe::error_t e = g.validate();
  if (e.is_bad()) return fail("validate", e);
  e = g.build_operation_graph(handle);
  if (e.is_bad()) return fail("build_operation_graph", e);
  e = g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
  if (e.is_bad()) return fail("create_execution_plans", e);
  e = g.check_support();
  if (e.is_bad()) return fail("check_support", e);
  e = g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
  if (e.is_bad()) return fail("build_plans", e);
  int64_t bytes = 0;
  e = g.get_workspace_size(bytes);
  if (e.is_bad()) return fail("get_workspace_size", e);
  *ws = static_cast<size_t>(std::max<int64_t>(bytes, 0));
  return "";
}

std::string shape_name(const Shape& s) {
  return std::string(dtype_name(static_cast<DType>(s.act))) + " B=" + std::to_string(s.B) +
         " T=" + std::to_string(s.T) + " H=" + std::to_string(s.H) + " hd=" + std::to_string(s.hd);
}

}  // namespace

struct CudnnAttention::Impl {
  int device;
  cudaStream_t stream;
  bool verbose;
  bool deterministic;
  std::mutex mu;
  cudnnHandle_t handle = nullptr;
  std::string handle_error;  // set when cudnnCreate failed: every shape is unsupported
  // Declared after the handle: the graphs (and their plans) go before it does.
  std::map<Shape, Entry> cache;
  // Workspace sizes handed out by workspace_bytes(), per (act, T, H, hd) (B = 0) and batch.
  std::map<Shape, std::map<int, size_t>> granted;

  Impl(int d, cudaStream_t s, bool v, bool det)
      : device(d), stream(s), verbose(v), deterministic(det) {}
  ~Impl() {
    cache.clear();
    if (handle) cudnnDestroy(handle);
  }

  bool make_handle() {
    if (handle) return true;
    if (!handle_error.empty()) return false;
    cudnnStatus_t st = cudnnCreate(&handle);
    if (st == CUDNN_STATUS_SUCCESS) st = cudnnSetStream(handle, stream);
    if (st != CUDNN_STATUS_SUCCESS) {
      handle_error = std::string("cudnnCreate/cudnnSetStream: ") + cudnnGetErrorString(st);
      if (handle) cudnnDestroy(handle);
      handle = nullptr;
      return false;
    }
    return true;
  }

  Entry& get(const Shape& s) {  // with mu held
    auto it = cache.find(s);
    if (it != cache.end()) return it->second;
    Entry& e = cache[s];
    CUDA_CHECK(cudaSetDevice(device));
    if (s.B <= 0 || s.T <= 0 || s.H <= 0 || !eligible(static_cast<DType>(s.act), s.hd)) {
      e.why = "shape outside the cuDNN path";
    } else if (!make_handle()) {
      e.why = handle_error;
    } else {
      const DType act = static_cast<DType>(s.act);
      const Views v(s.B, s.T, s.H, s.hd);
      size_t wf = 0, wb = 0;
      try {
        e.fwd = forward_graph(act, v, s.hd);
        e.why = build(*e.fwd, handle, &wf);
        if (!e.why.empty()) {
          e.why = "forward " + e.why;
        } else {
          e.bwd = backward_graph(act, v, s.hd, deterministic);
          e.why = build(*e.bwd, handle, &wb);
          if (!e.why.empty()) e.why = "backward " + e.why;
        }
      } catch (const std::exception& x) {
        e.why = std::string("exception: ") + x.what();
      }
      e.ok = e.why.empty();
      if (e.ok) {
        e.ws = std::max(wf, wb);
      } else {
        e.fwd.reset();
        e.bwd.reset();
      }
    }
    if (!e.ok && verbose) {
      std::fprintf(stderr,
                   "vitgrid: device.attention = cudnn: cuDNN SDPA does not take %s (%s); the "
                   "flash kernels run this shape\n",
                   shape_name(s).c_str(), e.why.c_str());
    }
    return e;
  }

  bool usable(const Shape& s) {  // with mu held
    const Entry& e = get(s);
    if (!e.ok) return false;
    auto g = granted.find(Shape{s.act, 0, s.T, s.H, s.hd});
    if (g == granted.end()) return true;
    size_t bound = std::numeric_limits<size_t>::max();
    for (auto it = g->second.lower_bound(s.B); it != g->second.end(); ++it) {
      bound = std::min(bound, it->second);
    }
    return e.ws <= bound;
  }

  void run(const fe::graph::Graph& g, std::unordered_map<int64_t, void*>& pack, void* ws,
           const Shape& s, const char* what) {
    fe::error_t e = g.execute(handle, pack, ws);
    if (e.is_bad()) {
      VG_FAIL("cuDNN SDPA " << what << " failed for " << shape_name(s) << ": " << e.get_message());
    }
  }
};

bool CudnnAttention::available() { return true; }

CudnnAttention::CudnnAttention(int device, cudaStream_t stream, bool verbose, bool deterministic)
    : impl_(std::make_unique<Impl>(device, stream, verbose, deterministic)) {}

CudnnAttention::~CudnnAttention() = default;

bool CudnnAttention::supported(DType act, int B, int T, int H, int hd) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->get(Shape{static_cast<int>(act), B, T, H, hd}).ok;
}

size_t CudnnAttention::workspace_bytes(DType act, int B, int T, int H, int hd, size_t floor) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Entry& e = impl_->get(Shape{static_cast<int>(act), B, T, H, hd});
  const size_t bytes = e.ok ? std::max(floor, e.ws) : floor;
  size_t& g = impl_->granted[Shape{static_cast<int>(act), 0, T, H, hd}][B];
  g = std::max(g, bytes);
  return bytes;
}

bool CudnnAttention::usable(DType act, int B, int T, int H, int hd) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->usable(Shape{static_cast<int>(act), B, T, H, hd});
}

std::string CudnnAttention::reject_reason(DType act, int B, int T, int H, int hd) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const auto it = impl_->cache.find(Shape{static_cast<int>(act), B, T, H, hd});
  return it == impl_->cache.end() ? std::string() : it->second.why;
}

void CudnnAttention::forward(DType act, void* out, float* stats, const void* qkv, int B, int T,
                             int H, int hd, void* workspace) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Shape s{static_cast<int>(act), B, T, H, hd};
  const Entry& e = impl_->get(s);
  VG_CHECK(e.ok, "cuDNN SDPA forward on an unsupported shape " << shape_name(s));
  const size_t C = static_cast<size_t>(H) * hd * dtype_size(act);  // bytes
  char* base = static_cast<char*>(const_cast<void*>(qkv));
  std::unordered_map<int64_t, void*> pack = {
      {kQ, base}, {kK, base + C}, {kV, base + 2 * C}, {kO, out}, {kStats, stats}};
  impl_->run(*e.fwd, pack, workspace, s, "forward");
}

void CudnnAttention::backward(DType act, void* dqkv, const void* dout, const void* qkv,
                              const void* out, const float* stats, int B, int T, int H, int hd,
                              void* workspace) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Shape s{static_cast<int>(act), B, T, H, hd};
  const Entry& e = impl_->get(s);
  VG_CHECK(e.ok, "cuDNN SDPA backward on an unsupported shape " << shape_name(s));
  const size_t C = static_cast<size_t>(H) * hd * dtype_size(act);  // bytes
  char* base = static_cast<char*>(const_cast<void*>(qkv));
  char* dbase = static_cast<char*>(dqkv);
  std::unordered_map<int64_t, void*> pack = {{kQ, base},
                                             {kK, base + C},
                                             {kV, base + 2 * C},
                                             {kO, const_cast<void*>(out)},
                                             {kdO, const_cast<void*>(dout)},
                                             {kStats, const_cast<float*>(stats)},
                                             {kdQ, dbase},
                                             {kdK, dbase + C},
                                             {kdV, dbase + 2 * C}};
  impl_->run(*e.bwd, pack, workspace, s, "backward");
}

#else  // no cudnn_frontend at build time: the path does not exist

struct CudnnAttention::Impl {};

bool CudnnAttention::available() { return false; }
CudnnAttention::CudnnAttention(int, cudaStream_t, bool, bool) {}
CudnnAttention::~CudnnAttention() = default;
bool CudnnAttention::supported(DType, int, int, int, int) { return false; }
size_t CudnnAttention::workspace_bytes(DType, int, int, int, int, size_t floor) { return floor; }
bool CudnnAttention::usable(DType, int, int, int, int) { return false; }
std::string CudnnAttention::reject_reason(DType, int, int, int, int) {
  return "built without cudnn_frontend";
}
void CudnnAttention::forward(DType, void*, float*, const void*, int, int, int, int, void*) {
  VG_FAIL("cuDNN SDPA forward called in a build without cudnn_frontend");
}
void CudnnAttention::backward(DType, void*, const void*, const void*, const void*, const float*,
                              int, int, int, int, void*) {
  VG_FAIL("cuDNN SDPA backward called in a build without cudnn_frontend");
}

#endif

}  // namespace cuda
}  // namespace vitgrid
