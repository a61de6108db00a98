// Golden dump: runs vitgrid's ViT (CPU backend, fp32, one process) on one fixed batch and
// writes everything an independent PyTorch model needs to reproduce it -- parameters under
// their timm names and shapes, the inputs, vitgrid's logits, loss and every parameter
// gradient -- to one HDF5 file. check_golden.py then recomputes the same batch in float64
// with reference_vit.py and compares.
//
// Cases written (layout read by check_golden.py):
//   /params/<name> /grads/<name> /images /labels /logits /loss   hard labels, smoothing 0.1,
//                                                                  exact GELU
//   /soft/targets /soft/logits /soft/loss /soft/grads/<name>      same parameters and images,
//                                                                  row-stochastic soft targets
//                                                                  (the Mixup path), smoothing 0
//   /tanh/params/<name> /tanh/grads/<name> /tanh/logits /tanh/loss  a second model with the tanh
//                                                                  GELU and its own parameters;
//                                                                  same images/labels, smoothing 0.1
// Every case group carries attributes smoothing (double) and gelu ("exact" / "tanh"); the root
// carries the model config.
//
// Usage: golden_dump OUT.h5   (single process; mpirun not needed)
#include <hdf5.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/grid/grid.h"
#include "vitgrid/io/hdf5_util.h"
#include "vitgrid/model/vit.h"
#include "vitgrid/parallel/tensor_parallel.h"

using namespace vitgrid;

namespace {

constexpr int kBatch = 5;
constexpr uint64_t kInitSeed = 1234;

// ---- small HDF5 writers (serial file, default driver: this is one process)

hid_t make_group(hid_t parent, const char* name) {
  return H5_CHECK(H5Gcreate2(parent, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
}

template <typename T>
void write_array(hid_t loc, const std::string& name, const std::vector<int64_t>& shape,
                 const T* data, hid_t mem_type, hid_t file_type) {
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  // rank-0 shape = scalar dataspace
  hid_t space = dims.empty() ? H5_CHECK(H5Screate(H5S_SCALAR))
                             : H5_CHECK(H5Screate_simple(static_cast<int>(dims.size()),
                                                         dims.data(), nullptr));
  hid_t ds = H5_CHECK(H5Dcreate2(loc, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT,
                                 H5P_DEFAULT));
  H5_CHECK(H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data));
  H5_CHECK(H5Dclose(ds));
  H5_CHECK(H5Sclose(space));
}

void write_f32(hid_t loc, const std::string& name, const std::vector<int64_t>& shape,
               const float* data) {
  write_array(loc, name, shape, data, H5T_NATIVE_FLOAT, H5T_IEEE_F32LE);
}

void write_i32(hid_t loc, const std::string& name, const std::vector<int64_t>& shape,
               const int32_t* data) {
  write_array(loc, name, shape, data, H5T_NATIVE_INT32, H5T_STD_I32LE);
}

void write_f64_scalar(hid_t loc, const std::string& name, double v) {
  write_array(loc, name, {}, &v, H5T_NATIVE_DOUBLE, H5T_IEEE_F64LE);
}

void attr_i64(hid_t loc, const char* name, int64_t v) {
  hid_t space = H5_CHECK(H5Screate(H5S_SCALAR));
  hid_t a = H5_CHECK(H5Acreate2(loc, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT));
  H5_CHECK(H5Awrite(a, H5T_NATIVE_INT64, &v));
  H5_CHECK(H5Aclose(a));
  H5_CHECK(H5Sclose(space));
}

void attr_f64(hid_t loc, const char* name, double v) {
  hid_t space = H5_CHECK(H5Screate(H5S_SCALAR));
  hid_t a = H5_CHECK(H5Acreate2(loc, name, H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT));
  H5_CHECK(H5Awrite(a, H5T_NATIVE_DOUBLE, &v));
  H5_CHECK(H5Aclose(a));
  H5_CHECK(H5Sclose(space));
}

void attr_str(hid_t loc, const char* name, const std::string& v) {
  hid_t type = H5_CHECK(H5Tcopy(H5T_C_S1));
  H5_CHECK(H5Tset_size(type, v.size()));
  H5_CHECK(H5Tset_strpad(type, H5T_STR_NULLTERM));
  hid_t space = H5_CHECK(H5Screate(H5S_SCALAR));
  hid_t a = H5_CHECK(H5Acreate2(loc, name, type, space, H5P_DEFAULT, H5P_DEFAULT));
  H5_CHECK(H5Awrite(a, type, v.data()));
  H5_CHECK(H5Aclose(a));
  H5_CHECK(H5Sclose(space));
  H5_CHECK(H5Tclose(type));
}

// ---- model helpers

// Writes each parameter's slice of a flat fp32 backend buffer (master or grads) as its own
// dataset, named and shaped as timm's state_dict entry.
void dump_flat(Backend& be, const ViT& vit, const float* dev_buf, hid_t group) {
  std::vector<float> host(vit.num_local_params());
  be.copy_to_host(host.data(), dev_buf, host.size() * sizeof(float));
  for (const ParamInfo& p : vit.params()) {
    write_f32(group, p.name, p.global_shape, host.data() + p.offset);
  }
}

// Replaces every parameter with values from a fixed mt19937. timm's init (zero biases, unit
// LayerNorm gains, weights of std 0.02) would leave most of the model untested: a dropped bias
// or LayerNorm affine term changes nothing when they are 0 / 1, and with 0.02 weights the
// attention logits are ~1e-2 so softmax is near uniform and a mixed-up head or token layout
// barely moves the output. Weights of std 1/sqrt(fan_in) keep activations O(1) and attention
// logits O(1) (softmax far from uniform, not saturated); biases, gains, cls and pos get O(0.1-1)
// offsets so each parameter's gradient is non-trivial.
// The embedding (patch_embed, cls_token, pos_embed) is the exception: it is scaled to ~0.01 so
// the residual stream entering block 0 has variance ~2e-4. There LayerNorm's eps = 1e-6 is a
// ~0.3% effect (eps 1e-5 would be ~2%); at O(1) variance a wrong eps would change the outputs by
// less than the tolerances and go unnoticed. Later blocks see O(1) streams again.
void randomize_params(Backend& be, ViT& vit, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> host(vit.num_local_params(), 0.0f);
  be.copy_to_host(host.data(), vit.master(), host.size() * sizeof(float));
  for (const ParamInfo& p : vit.params()) {
    const std::string& n = p.name;
    auto ends_with = [&](const char* s) {
      const size_t k = std::strlen(s);
      return n.size() >= k && n.compare(n.size() - k, k, s) == 0;
    };
    const bool is_norm = n == "norm.weight" || n == "norm.bias" ||
                         n.find(".norm1.") != std::string::npos ||
                         n.find(".norm2.") != std::string::npos;
    const bool is_embed =
        n == "cls_token" || n == "pos_embed" || n.rfind("patch_embed.", 0) == 0;
    int64_t fan_in = 1;
    for (size_t d = 1; d < p.global_shape.size(); ++d) fan_in *= p.global_shape[d];
    const float unit = 1.0f / std::sqrt(static_cast<float>(fan_in));  // O(1) outputs
    float mean = 0.0f, sd = 0.2f;  // biases, LayerNorm shifts
    if (is_norm && ends_with(".weight")) {
      mean = 1.0f;  // gains around 1, far enough from it that a missing gain shows
    } else if (is_embed) {
      sd = n == "patch_embed.proj.weight" ? 0.01f * unit : 0.01f;  // see above: ~0.01 stream
    } else if (ends_with(".weight")) {
      sd = unit;
    }
    for (size_t e = 0; e < p.numel; ++e) host[p.offset + e] = mean + sd * normal(gen);
  }
  be.copy_to_device(vit.master(), host.data(), host.size() * sizeof(float));
  vit.sync_compute_params();
}

struct CaseResult {
  std::vector<float> logits;
  double loss_mean = 0.0;
};

CaseResult run_case(ViT& vit, const DeviceBatch& batch, float smoothing, int64_t step = 0) {
  CaseResult r;
  vit.zero_grads();
  // grad_scale 1/B: the gradients are those of the batch-mean loss, as PyTorch's mean reduction
  const double loss_sum =
      vit.forward_backward(batch, smoothing, 1.0f / static_cast<float>(batch.count), step, 0);
  r.loss_mean = loss_sum / batch.count;
  vit.logits_to_host(r.logits, batch.count);
  return r;
}

void write_case(hid_t group, Backend& be, ViT& vit, const CaseResult& r, int B,
                float smoothing) {
  write_f32(group, "logits", {B, vit.config().classes}, r.logits.data());
  write_f64_scalar(group, "loss", r.loss_mean);
  hid_t g = make_group(group, "grads");
  dump_flat(be, vit, vit.grads(), g);
  H5_CHECK(H5Gclose(g));
  attr_f64(group, "smoothing", smoothing);
  attr_str(group, "gelu", vit.config().gelu == Gelu::Tanh ? "tanh" : "exact");
}

void write_params(hid_t group, Backend& be, ViT& vit) {
  hid_t g = make_group(group, "params");
  dump_flat(be, vit, vit.master(), g);
  H5_CHECK(H5Gclose(g));
}

int run(const char* out_path, const char* backend) {
  ProcessGrid grid(MPI_COMM_WORLD, GridShape{});
  if (grid.world_size() != 1) {
    std::fprintf(stderr, "golden_dump: run it as one process\n");
    return 1;
  }
  // fp32 without TF32: the golden tolerances are fp32 tolerances on either backend
  auto be = make_backend(backend, 0, DType::F32);
  auto coll = make_mpi_collectives(grid);
  auto tp = make_tensor_parallel(grid, *be, *coll);

  ViTConfig cfg;
  cfg.image = 16;
  cfg.patch = 4;
  cfg.channels = 3;
  cfg.hidden = 48;
  cfg.depth = 2;
  cfg.heads = 3;  // head dim 16
  cfg.mlp = 96;
  cfg.classes = 7;
  cfg.dropout = 0.0f;
  cfg.gelu = Gelu::Exact;
  const int B = kBatch, K = cfg.classes, S = cfg.image;

  // Every parameter must be whole on one rank: the dump writes local slices as global tensors.
  ViT vit(cfg, *be, *tp, B);
  for (const ParamInfo& p : vit.params()) {
    if (p.shard.count != p.global_shape) {
      std::fprintf(stderr, "golden_dump: %s is sharded on one rank\n", p.name.c_str());
      return 1;
    }
  }
  vit.init_params(kInitSeed);  // also sets the dropout seed; values are replaced next
  randomize_params(*be, vit, 20240601u);

  // Inputs: normalised images ~ N(0,1), labels uniform in [0,K), soft targets row-stochastic.
  std::mt19937 gen(777);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int32_t> label_dist(0, K - 1);
  std::uniform_real_distribution<float> unif(0.0f, 1.0f);
  std::vector<float> images(static_cast<size_t>(B) * cfg.channels * S * S);
  for (float& v : images) v = normal(gen);
  std::vector<int32_t> labels(B);
  for (int32_t& l : labels) l = label_dist(gen);
  std::vector<float> soft(static_cast<size_t>(B) * K);
  for (int b = 0; b < B; ++b) {
    double s = 0.0;
    for (int k = 0; k < K; ++k) s += soft[b * K + k] = unif(gen) + 0.01f;
    for (int k = 0; k < K; ++k) soft[b * K + k] = static_cast<float>(soft[b * K + k] / s);
  }

  void* d_images = be->alloc(images.size() * sizeof(float));
  auto* d_labels = static_cast<int32_t*>(be->alloc(labels.size() * sizeof(int32_t)));
  auto* d_soft = static_cast<float*>(be->alloc(soft.size() * sizeof(float)));
  be->copy_to_device(d_images, images.data(), images.size() * sizeof(float));
  be->copy_to_device(d_labels, labels.data(), labels.size() * sizeof(int32_t));
  be->copy_to_device(d_soft, soft.data(), soft.size() * sizeof(float));

  DeviceBatch hard{d_images, d_labels, nullptr, B, 0};
  DeviceBatch mixed{d_images, d_labels, d_soft, B, 0};

  hid_t file = H5_CHECK(H5Fcreate(out_path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  attr_i64(file, "image", cfg.image);
  attr_i64(file, "patch", cfg.patch);
  attr_i64(file, "channels", cfg.channels);
  attr_i64(file, "hidden", cfg.hidden);
  attr_i64(file, "depth", cfg.depth);
  attr_i64(file, "heads", cfg.heads);
  attr_i64(file, "mlp", cfg.mlp);
  attr_i64(file, "classes", cfg.classes);
  attr_f64(file, "ln_eps", cfg.ln_eps);
  attr_i64(file, "batch", B);
  attr_i64(file, "seed", static_cast<int64_t>(kInitSeed));
  write_f32(file, "images", {B, cfg.channels, S, S}, images.data());
  write_i32(file, "labels", {B}, labels.data());

  // case 1: hard labels, label smoothing 0.1
  write_params(file, *be, vit);
  {
    const float smoothing = 0.1f;
    CaseResult r = run_case(vit, hard, smoothing);
    write_case(file, *be, vit, r, B, smoothing);
  }
  // case 2: same parameters, soft targets, no smoothing (run_case re-zeroes the gradients)
  {
    const float smoothing = 0.0f;
    hid_t g = make_group(file, "soft");
    write_f32(g, "targets", {B, K}, soft.data());
    CaseResult r = run_case(vit, mixed, smoothing);
    write_case(g, *be, vit, r, B, smoothing);
    H5_CHECK(H5Gclose(g));
  }
  // case 3: tanh GELU, a second model with its own parameters
  {
    ViTConfig tcfg = cfg;
    tcfg.gelu = Gelu::Tanh;
    ViT tvit(tcfg, *be, *tp, B);
    tvit.init_params(kInitSeed);
    randomize_params(*be, tvit, 99991u);
    const float smoothing = 0.1f;
    hid_t g = make_group(file, "tanh");
    write_params(g, *be, tvit);
    CaseResult r = run_case(tvit, hard, smoothing);
    write_case(g, *be, tvit, r, B, smoothing);
    H5_CHECK(H5Gclose(g));
  }
  // case 4: drop path (stochastic depth) at 0.6 (block 1's rate; block 0's is 0), the first step
  // whose draw keeps and drops samples in both of block 1's branches: the masks (1 kept, 0
  // dropped; [depth, 2 branches, B]) go with the case for the reference to apply
  {
    ViTConfig pcfg = cfg;
    pcfg.drop_path = 0.6f;
    ViT pvit(pcfg, *be, *tp, B);
    pvit.init_params(kInitSeed);
    randomize_params(*be, pvit, 4242u);
    std::vector<float> masks(static_cast<size_t>(pcfg.depth) * 2 * B);
    int64_t step = 0;
    for (;; ++step) {
      bool mixed = true;
      for (int l = 0; l < pcfg.depth; ++l)
        for (int br = 0; br < 2; ++br) {
          int kept = 0;
          for (int b = 0; b < B; ++b) {
            const bool k = pvit.drop_path_kept(step, l, br, b);  // hard's first position is 0
            masks[(static_cast<size_t>(l) * 2 + br) * B + b] = k ? 1.0f : 0.0f;
            kept += k;
          }
          if (pcfg.drop_path_rate(l) > 0.0f) mixed = mixed && kept > 0 && kept < B;
        }
      if (mixed) break;
    }
    const float smoothing = 0.1f;
    hid_t g = make_group(file, "drop_path");
    write_params(g, *be, pvit);
    write_f32(g, "drop_path_masks", {pcfg.depth, 2, B}, masks.data());
    attr_f64(g, "drop_path", pcfg.drop_path);
    CaseResult r = run_case(pvit, hard, smoothing, step);
    write_case(g, *be, pvit, r, B, smoothing);
    H5_CHECK(H5Gclose(g));
  }
  H5_CHECK(H5Fclose(file));

  be->release(d_soft);
  be->release(d_labels);
  be->release(d_images);
  std::printf("golden_dump: wrote %s (%lld parameters)\n", out_path,
              static_cast<long long>(vit.num_global_params()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 1;
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: golden_dump OUT.h5 [cpu|cuda]\n");
  } else {
    try {
      rc = run(argv[1], argc == 3 ? argv[2] : "cpu");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "golden_dump: %s\n", e.what());
      rc = 1;
    }
  }
  MPI_Finalize();
  return rc;
}
