// The input deck: schema, INI and command-line parsing, model presets, derivation, validation,
// the resolved dump and the Markdown reference.
//
// Parsing happens in two passes over the same text. Our own scan walks the INI line by line so
// that every key is known with its line number (Boost.ProgramOptions does not report lines), and
// refuses syntax errors, unknown keys and duplicates with "deck.ini:12: ..." messages. Boost's
// parse_config_file(allow_unregistered = false) then parses the text against the same schema
// and supplies the values; anything it still objects to is reported with the deck's name.
// Values are kept as strings until every source has been merged (deck, then command line, then
// the preset fills whatever model key neither of them set), and converted once, so a conversion
// error always knows where the offending string came from.
#include "vitgrid/deck/deck.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "vitgrid/core/error.h"

namespace po = boost::program_options;

namespace vitgrid {
namespace {

// ---------------------------------------------------------------------------------------------
// The schema: one row per key. The C++ type of each field is deduced from the Deck member, so
// the table cannot disagree with deck.h; defaults are read from a default-constructed Deck for
// the same reason.

enum class Kind { Int, Int64, UInt64, Double, Bool, String, FloatList };

template <class T>
constexpr Kind kind_of();
template <>
constexpr Kind kind_of<int>() {
  return Kind::Int;
}
template <>
constexpr Kind kind_of<int64_t>() {
  return Kind::Int64;
}
template <>
constexpr Kind kind_of<uint64_t>() {
  return Kind::UInt64;
}
template <>
constexpr Kind kind_of<double>() {
  return Kind::Double;
}
template <>
constexpr Kind kind_of<bool>() {
  return Kind::Bool;
}
template <>
constexpr Kind kind_of<std::string>() {
  return Kind::String;
}
template <>
constexpr Kind kind_of<std::vector<float>>() {
  return Kind::FloatList;
}

struct Field {
  const char* section;
  const char* key;
  Kind kind;
  // For enum-like strings: the accepted values separated by '|' ("" = free text). An entry
  // ending in ':' accepts that prefix followed by anything (parallel.partition's "list:").
  const char* choices;
  const char* help;
  void* (*member)(Deck&);

  std::string name() const { return std::string(section) + "." + key; }
};

#define VG_FIELD(sec, k, choices, help)                                                           \
  Field {                                                                                         \
#sec, #k, kind_of < std::decay_t < decltype(std::declval <Deck&>().sec.k)>>(), choices, help, \
        [](Deck & d) -> void* { return &d.sec.k; }                                                \
  }

const std::vector<Field>& schema() {
  static const std::vector<Field> fields = {
      // [run]
      VG_FIELD(run, out_dir, "", "run directory: metrics.h5, checkpoints/, predictions.h5"),
      VG_FIELD(run, seed, "", "seed of every random stream (init, data order, mixup, dropout)"),
      VG_FIELD(run, steps, "", "optimizer steps to train (exactly one of steps / epochs is > 0)"),
      VG_FIELD(run, epochs, "", "epochs to train, alternative to run.steps"),
      VG_FIELD(run, log_every, "",
               "optimizer steps between log lines; metrics.h5 has a row per step, written to "
               "the file at each log line, evaluation and the end"),
      VG_FIELD(run, eval_every, "", "optimizer steps between evaluations (0 = only at the end)"),
      VG_FIELD(run, eval_samples, "", "samples used per evaluation (0 = the whole eval split)"),
      // [model]
      VG_FIELD(model, preset, "",
               "vit-tiny/16 | vit-small/16 | vit-base/16 | vit-base/32 | vit-large/16 | "
               "vit-large/32 | vit-lite-7/4 | "
               "vit-huge-4096 | custom; fills the model keys not given explicitly"),
      VG_FIELD(model, image_size, "", "input image side in pixels"),
      VG_FIELD(model, patch_size, "", "patch side in pixels (divides image_size)"),
      VG_FIELD(model, channels, "", "input channels (3: RGB)"),
      VG_FIELD(model, hidden, "", "embedding width"),
      VG_FIELD(model, depth, "", "transformer blocks"),
      VG_FIELD(model, heads, "", "attention heads (divide hidden)"),
      VG_FIELD(model, mlp_ratio, "", "MLP hidden width / hidden"),
      VG_FIELD(model, num_classes, "", "classifier outputs"),
      VG_FIELD(model, dropout, "", "dropout after pos-embed, attention proj and MLP, in [0,1)"),
      VG_FIELD(model, drop_path, "",
               "stochastic depth (timm drop_path_rate), in [0,1): each block's attention and MLP branches drop whole samples, at a rate rising linearly from 0 at the first block to this at the last"),
      VG_FIELD(model, gelu, "exact|tanh", "GELU form: exact (erf, timm default) or tanh"),
      VG_FIELD(model, checkpoint_activations, "",
               "recompute each block in the backward pass to save activation memory"),
      VG_FIELD(model, checkpoint_blocks, "",
               "with checkpoint_activations: recompute only the first n blocks of each pipeline stage (of each virtual stage when interleaved) and keep the others' activations, trading memory for speed (Megatron's recompute-method block); -1: every block"),
      VG_FIELD(model, keep_gelu_output, "",
               "keep each block's GELU output for the backward instead of recomputing it (batch x tokens x mlp more activations per block, one elementwise pass less; ignored for the checkpointed blocks)"),
      // [parallel]
      VG_FIELD(parallel, pipeline, "", "pipeline stages"),
      VG_FIELD(parallel, tensor, "", "ranks in the tensor-parallel group"),
      VG_FIELD(parallel, tensor_mode, "1d|2d|2.5d|3d",
               "tensor-parallel layout: 1d [t], 2d [q,q], 2.5d [d,q,q], 3d [q,q,q]"),
      VG_FIELD(parallel, tensor_depth, "", "depth d of the 2.5d layout (tensor = d*q*q)"),
      VG_FIELD(parallel, sequence_parallel, "",
               "1d: split the residual stream's samples over the tensor ranks (Megatron's sequence parallelism): LayerNorms, residual adds, dropout, patch embedding and head on 1/tensor of the micro-batch, each Column Linear's input all-gathered and each Row Linear's output reduce-scattered instead of all-reduced; the micro-batch must divide by tensor"),
      VG_FIELD(parallel, sequence_chunks, "1..8",
               "with sequence_parallel: split each overlapped all-gather (before the Column Linears' forward and the Row Linears' backward) and, with tensor > 2, each Row forward's reduce-scatter into this many row chunks, so each GEMM waits only for the chunk it needs and the reduce-scatter of one chunk runs beside the next chunk's GEMMs (1: whole)"),
      VG_FIELD(parallel, micro_batches, "", "pipeline micro-batches per optimizer step"),
      VG_FIELD(parallel, schedule, "gpipe|1f1b|interleaved", "pipeline schedule"),
      VG_FIELD(parallel, chunks, "", "model chunks per stage (interleaved schedule only, >= 2)"),
      VG_FIELD(parallel, partition, "uniform|balanced|list:",
               "blocks per stage: uniform | balanced | list:n0,n1,... (pipeline*chunks entries)"),
      VG_FIELD(parallel, zero, "",
               "ZeRO stage: 0 = off, 1 = optimizer state (with bf16/fp16 the fp32 master weights too) sharded over data"),
      VG_FIELD(parallel, grad_reduce, "fp32|act",
               "data-parallel gradient sums in fp32, or in the 16-bit act dtype of bf16/fp16 (half the bytes, as DDP's bf16_compress_hook; gradients stay fp32 around it)"),
      VG_FIELD(parallel, zero_gather, "forward|step",
               "ZeRO-1 with bf16/fp16: the updated parameters are all-gathered bucket by bucket during the next step's forward, each bucket just before its layers (forward), or all at the end of the update (step)"),
      VG_FIELD(parallel, data, "",
               "data-parallel replicas; derived as world / (pipeline * tensor), 0 = derive"),
      // [data]
      VG_FIELD(data, dataset, "synthetic|cifar10|hdf5|tfrecord|folder|jpeg_h5", "dataset kind: raw images (synthetic, cifar10, hdf5) or encoded JPEGs (tfrecord shards, an ImageFolder tree, packed jpeg_h5)"),
      VG_FIELD(data, path, "", "CIFAR-10 binary directory, HDF5 file, TFRecord shard directory, ImageFolder root or jpeg_h5 file"),
      VG_FIELD(data, eval_path, "", "hdf5 / jpeg_h5 eval file (default: the eval split of data.path)"),
      VG_FIELD(data, global_batch, "", "samples per optimizer step over all replicas"),
      VG_FIELD(data, grad_accum, "", "gradient accumulation steps per optimizer step"),
      VG_FIELD(data, synthetic_train, "", "synthetic train split size"),
      VG_FIELD(data, synthetic_eval, "", "synthetic eval split size"),
      VG_FIELD(data, crop_padding, "", "random crop with this zero padding (0 = off)"),
      VG_FIELD(data, hflip, "", "random horizontal flip"),
      VG_FIELD(data, mean, "", "per-channel normalisation mean, 3 comma-separated floats"),
      VG_FIELD(data, std, "", "per-channel normalisation std, 3 comma-separated floats > 0"),
      VG_FIELD(data, mixup_alpha, "", "Mixup Beta(alpha, alpha) parameter (0 = off)"),
      VG_FIELD(data, cutmix_alpha, "", "CutMix Beta(alpha, alpha) parameter (0 = off)"),
      VG_FIELD(data, mixup_prob, "", "probability that a batch / pair / sample is mixed at all"),
      VG_FIELD(data, mixup_switch_prob, "", "with Mixup and CutMix both on: probability of CutMix"),
      VG_FIELD(data, mixup_mode, "batch|pair|elem", "one mixing draw per global batch, per pair of samples, or per sample (timm's modes; the partner is the other sample of the pair: positions 2k and 2k+1)"),
      VG_FIELD(data, label_smoothing, "", "label smoothing in [0,1)"),
      VG_FIELD(data, prefetch, "", "batches prepared ahead by the background thread"),
      VG_FIELD(data, workers, "", "threads reading one batch's samples (0 = auto: cores per rank, at most 16)"),
      VG_FIELD(data, label_offset, "", "added to stored labels (encoded sources; default -1 for tfrecord, whose labels are 1-based, else 0)"),
      VG_FIELD(data, eval_fraction, "", "folder without train/ and val/: the held-out share of each class for evaluation"),
      VG_FIELD(data, index_dir, "", "where missing TFRecord indexes (DALI's tfrecord2idx format) are written (default: RUN_DIR/tfrecord-index)"),
      VG_FIELD(data, rrc_scale, "", "RandomResizedCrop area range, 2 comma-separated floats"),
      VG_FIELD(data, rrc_ratio, "", "RandomResizedCrop aspect-ratio range, 2 comma-separated floats"),
      VG_FIELD(data, interpolation, "bilinear|bicubic", "resize filter of the crops (Pillow's, antialiased)"),
      VG_FIELD(data, crop_pct, "", "eval: the short side is resized to image_size / crop_pct, then centre-cropped"),
      VG_FIELD(data, dct_scale, "", "CPU decoding: decode at 1/2, 1/4 or 1/8 scale (DCT domain) when the crop stays >= 2x the output"),
      VG_FIELD(data, decode, "auto|host|device", "where JPEGs are decoded: on the device (nvJPEG) where the backend can, or on the host (libjpeg-turbo)"),
      // [optim]
      VG_FIELD(optim, name, "adamw|lamb|sgd", "optimizer"),
      VG_FIELD(optim, lr, "", "peak learning rate (> 0)"),
      VG_FIELD(optim, min_lr, "", "learning rate at the end of the schedule"),
      VG_FIELD(optim, weight_decay, "", "decoupled weight decay"),
      VG_FIELD(optim, beta1, "", "AdamW/LAMB first-moment decay in [0,1)"),
      VG_FIELD(optim, beta2, "", "AdamW/LAMB second-moment decay in [0,1)"),
      VG_FIELD(optim, eps, "", "AdamW/LAMB denominator epsilon"),
      VG_FIELD(optim, momentum, "", "SGD momentum in [0,1)"),
      VG_FIELD(optim, nesterov, "", "SGD Nesterov momentum"),
      VG_FIELD(optim, warmup_steps, "", "linear warm-up steps"),
      VG_FIELD(optim, warmup_epochs, "", "linear warm-up in epochs, alternative to warmup_steps"),
      VG_FIELD(optim, schedule, "cosine|linear|constant", "learning-rate decay after warm-up"),
      VG_FIELD(optim, clip_grad_norm, "", "clip the global gradient norm to this (0 = off)"),
      VG_FIELD(optim, decay_norm_and_bias, "",
               "apply weight decay to biases, norms, cls token and pos embedding (timm: off)"),
      // [precision]
      VG_FIELD(precision, mode, "fp32|tf32|bf16|fp16|fp16-naive",
               "compute precision (fp32 master weights in every mode); fp16 and fp16-naive (Colossal-AI NAIVE: every activation fp16) both keep activations in fp16 with dynamic loss scaling and compute the same"),
      VG_FIELD(precision, initial_scale, "", "fp16 initial loss scale"),
      VG_FIELD(precision, growth_interval, "",
               "fp16 steps without overflow before the scale grows"),
      VG_FIELD(precision, growth_factor, "", "fp16 loss-scale growth factor (> 1)"),
      VG_FIELD(precision, backoff_factor, "", "fp16 loss-scale factor after an overflow, in (0,1)"),
      // [checkpoint]
      VG_FIELD(checkpoint, every_steps, "",
               "optimizer steps between checkpoints (0 = only at the end)"),
      VG_FIELD(checkpoint, resume, "none|auto",
               "auto: continue from the newest complete checkpoint"),
      VG_FIELD(checkpoint, load, "", "checkpoint file to start from (eval, predict, fine-tune)"),
      VG_FIELD(checkpoint, keep, "", "keep the newest K checkpoints (0 = all)"),
      // [device]
      VG_FIELD(device, backend, "auto|cuda|cpu",
               "compute backend (auto: cuda when a GPU is present)"),
      VG_FIELD(device, comm_timeout, "",
               "seconds a rank may wait in one collective or message (MPI on the host, NCCL on GPUs) before the watchdog names it and ends the job: a rank that stopped responding (a frozen process, a lost node) never leaves the others waiting for good"),
      VG_FIELD(device, gemm_tune, "0..16",
               "time this many cuBLASLt algorithms per GEMM shape at its first use and keep the fastest; the data axis's ranks choose together, on the slowest rank's timings (0: the heuristic's choice, bit-reproducible runs)"),
      VG_FIELD(device, data_comm_ctas, "0..64",
               "thread blocks (SMs) the data-parallel gradient reduction's NCCL kernels may take from the backward they overlap (0: NCCL's choice)"),
      VG_FIELD(device, pipe_comm_ctas, "0..64",
               "thread blocks (SMs) each asynchronous pipeline message's NCCL kernel may take (the placement used where the grouped one cannot run the schedule at its bubble: interleaved, unless parallel.micro_batches equals parallel.pipeline); its receive waits on them beside the compute, and the GEMMs leave 4 x this many SMs free (0: NCCL's choice, the GEMMs leave 8)"),
      VG_FIELD(device, tensor_comm_ctas, "0..64",
               "with device.tensor_comm = sm: thread blocks (SMs) of 1d sequence parallelism's overlapped collectives over the tensor axis (each Column Linear's input gathered beside its data-gradient GEMM and its gradient reduce-scattered beside the weight-gradient GEMM; the gathers of the forward and of the Row Linears' output gradients beside the GEMMs of this rank's own rows); the GEMMs meanwhile leave as many SMs free (0: NCCL's choice, the GEMMs leave 8)"),
      VG_FIELD(device, tensor_comm, "sm|copy_engine",
               "how 1d sequence parallelism's overlapped collectives move data on GPUs: NCCL's kernels on SMs (sm, device.tensor_comm_ctas), or copy engines (copy_engine: their buffers NCCL symmetric memory, each gather an in-place all-gather, each reduce-scatter with tensor = 2 an exchange of the peer's rows' partial sums and an add, else an all-to-all and a local sum, under NCCL's zero-CTA policy: no SMs taken from the GEMMs beside them)"),
      VG_FIELD(device, data_comm, "sm|copy_engine",
               "how the data-parallel gradient reduction moves data on GPUs: NCCL's kernels on SMs (sm), or copy engines (copy_engine: the gradients in NCCL symmetric memory, an all-to-all, a local sum and an all-gather under NCCL's zero-CTA policy; fp32 sums; set gemm_sm_margin = 0 with it)"),
      VG_FIELD(device, gemm_sm_margin, "0..64",
               "SMs the GEMMs leave free while gradient buckets are reduced during the backward, for the reduction's kernels (0: none; cuBLASLt's SM count target)"),
      VG_FIELD(device, deterministic, "",
               "bit-identical reruns; false lets cuDNN's attention backward accumulate with atomics (faster, last-bit differences run to run)"),
      VG_FIELD(device, cuda_graph, "",
               "capture each micro-batch's forward, backward, reductions and gradient norm as a CUDA graph and replay it (single pipeline stage; same results as eager)"),
      VG_FIELD(device, bucket_mb, "",
               "MiB of fp32 gradients per data-parallel reduction bucket, each reduced during the backward once complete (the buckets set the reduction's order, so the last bits of the sums; 0: one reduction after the backward)"),
      VG_FIELD(device, attention, "auto|cudnn|flash|fallback",
               "attention on GPUs: cuDNN's fused SDPA (cudnn: needs a build with cudnn_frontend), vitgrid's own flash kernels, or the materialised cuBLASLt + softmax path; auto takes cuDNN where the build has it and cuDNN accepts the shape, else flash, else the fallback (fp32 and other head dims always take the fallback)"),
      VG_FIELD(device, fused_gelu, "auto|off|on",
               "fc1's forward and fc2's data gradient as CUTLASS GEMMs with exact-GELU epilogues (sm_90, bf16/fp16): auto takes per shape the fastest of the unfused path and the fused configurations, timed when device.gemm_tune > 1, else unfused; on always fuses (timed likewise, else configuration 0); off never"),
      VG_FIELD(device, fused_gelu_forward_config, "",
               "with device.fused_gelu = auto or on: the fused forward's configuration id, untimed (-1: chosen as device.fused_gelu says)"),
      VG_FIELD(device, fused_gelu_backward_config, "",
               "with device.fused_gelu = auto or on: the fused backward's configuration id, untimed (-1: chosen as device.fused_gelu says)"),
      VG_FIELD(device, tuning_log, "",
               "print each tuned choice to stderr: with device.gemm_tune > 1 each GEMM shape's cuBLASLt algorithm (its time, the heuristic's first candidate's, and with data parallelism this rank's own pick where it differs), and each fused-GELU decision with its timings"),
      VG_FIELD(device, nccl_blocking, "",
               "every NCCL call waits for completion on the host (debugging; normally calls return once enqueued and a watchdog thread follows them)"),
  };
  return fields;
}
#undef VG_FIELD

// Sections in the order resolved_text() writes them.
const char* const kSections[] = {"run",   "model",     "parallel",   "data",
                                 "optim", "precision", "checkpoint", "device"};

// "uniform|balanced|list:" -> "uniform|balanced|list:n0,n1,..." for messages and the reference.
std::string display_choices(const std::string& choices) {
  std::string out = choices;
  if (!out.empty() && out.back() == ':') out += "n0,n1,...";
  return out;
}

const Field* find_field(const std::string& name) {
  for (const Field& f : schema())
    if (f.name() == name) return &f;
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Small string helpers.

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// User text quoted in a message, cut short: a mistyped 1 MB line must not become a 1 MB
// message.
std::string clip(const std::string& s) {
  constexpr size_t kShown = 100;
  if (s.size() <= kShown + 20) return s;
  return s.substr(0, kShown) + "... (" + std::to_string(s.size()) + " characters)";
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t p = s.find(sep, start);
    out.push_back(trim(s.substr(start, p == std::string::npos ? std::string::npos : p - start)));
    if (p == std::string::npos) break;
    start = p + 1;
  }
  return out;
}

// Shortest text that reads back to the same value (so resolved_text round-trips exactly).
template <class T>
std::string shortest(T v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

template <class T>
bool parse_integer(const std::string& s, T* out) {
  if (s.empty()) return false;
  const char* b = s.data();
  const char* e = b + s.size();
  if (*b == '+') ++b;  // from_chars refuses a leading '+', people write it
  auto r = std::from_chars(b, e, *out);
  return r.ec == std::errc() && r.ptr == e;
}

template <class T>
bool parse_real(const std::string& s, T* out) {
  if (s.empty()) return false;
  const char* b = s.data();
  const char* e = b + s.size();
  if (*b == '+') ++b;
  auto r = std::from_chars(b, e, *out);
  return r.ec == std::errc() && r.ptr == e && std::isfinite(*out);
}

// ---------------------------------------------------------------------------------------------
// Where each value came from, for error messages.

struct Origin {
  enum Kind { Default, Deck, CommandLine, Preset } kind = Default;
  int line = 0;  // deck line (Deck)
};

struct RawValue {
  std::string value;
  Origin origin;
};

class Parser {
 public:
  Parser(std::string source, int world) : source_(std::move(source)), world_(world) {}

  Deck run(const std::string& text, const std::vector<std::string>& overrides) {
    scan_ini(text);
    boost_parse_ini(text);
    scan_command_line(overrides);
    Deck d;
    d.source = source_;
    apply_preset(&d);
    for (const auto& kv : explicit_) assign(&d, kv.first, kv.second.value);
    derive_and_validate(&d);
    return d;
  }

 private:
  // ---- locations
  std::string where(const std::string& key) const {
    auto it = origins_.find(key);
    Origin o = it == origins_.end() ? Origin{} : it->second;
    switch (o.kind) {
      case Origin::Deck:
        return source_ + ":" + std::to_string(o.line);
      case Origin::CommandLine:
        return "command line";
      case Origin::Preset: {
        auto p = origins_.find("model.preset");
        if (p == origins_.end())  // the preset itself is the default one
          return source_ + " (from the default model.preset '" + preset_ + "')";
        return where("model.preset") + " (from model.preset '" + preset_ + "')";
      }
      case Origin::Default:
        break;
    }
    return source_ + " (default value)";
  }
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const {
    throw UserError(where(key) + ": " + key + ": " + msg);
  }
  void require(bool cond, const std::string& key, const std::string& msg) const {
    if (!cond) fail(key, msg);
  }

  // A deck is text: a NUL or other control byte means a binary file (or a corrupted one), and
  // would also cut the message short where it is printed as a C string. Tabs are blanks; a
  // carriage return may end a line (CRLF files).
  void check_text(const std::string& raw, int lineno) const {
    for (size_t i = 0; i < raw.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(raw[i]);
      const bool control = c < 0x20 || c == 0x7f;
      if (!control || c == '\t' || (c == '\r' && i + 1 == raw.size())) continue;
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", c);
      throw UserError(source_ + ":" + std::to_string(lineno) + ": control character " + hex +
                      " at column " + std::to_string(i + 1) +
                      " (the deck must be a text file; is this a binary file?)");
    }
  }

  // ---- pass 1: our scan of the INI text (lines, sections, unknown keys, duplicates)
  void scan_ini(const std::string& text) {
    std::istringstream in(text);
    std::string raw, section;
    int lineno = 0;
    std::map<std::string, int> seen;
    while (std::getline(in, raw)) {
      ++lineno;
      check_text(raw, lineno);
      std::string s = raw;
      // Boost's config-file grammar: '#' starts a comment anywhere on the line.
      size_t hash = s.find('#');
      if (hash != std::string::npos) s.resize(hash);
      s = trim(s);
      if (s.empty()) continue;
      const std::string at = source_ + ":" + std::to_string(lineno) + ": ";
      if (s.front() == '[') {
        if (s.back() != ']') throw UserError(at + "malformed section header '" + clip(s) + "'");
        section = trim(s.substr(1, s.size() - 2));
        bool known = std::any_of(std::begin(kSections), std::end(kSections),
                                 [&](const char* x) { return section == x; });
        if (!known) throw UserError(at + "unknown section [" + clip(section) + "]");
        continue;
      }
      size_t eq = s.find('=');
      if (eq == std::string::npos)
        throw UserError(at + "expected 'key = value' or '[section]', got '" + clip(s) + "'");
      std::string key = trim(s.substr(0, eq));
      std::string value = trim(s.substr(eq + 1));
      if (key.empty()) throw UserError(at + "missing key before '='");
      if (section.empty()) throw UserError(at + "key '" + clip(key) + "' outside any [section]");
      std::string name = section + "." + key;
      if (!find_field(name)) throw UserError(at + "unknown key '" + clip(name) + "'");
      auto prev = seen.find(name);
      if (prev != seen.end())
        throw UserError(at + name + ": given twice (first at line " + std::to_string(prev->second) +
                        ")");
      seen[name] = lineno;
      explicit_[name] = RawValue{value, Origin{Origin::Deck, lineno}};
      origins_[name] = Origin{Origin::Deck, lineno};
    }
  }

  static po::options_description boost_schema() {
    po::options_description desc("vitgrid deck");
    // Every value is taken as text: conversion is ours, so its errors can name the line.
    for (const Field& f : schema())
      desc.add_options()(f.name().c_str(), po::value<std::string>(), f.help);
    return desc;
  }

  // ---- pass 2: Boost parses the same text against the schema and supplies the values.
  void boost_parse_ini(const std::string& text) {
    po::variables_map vm;
    try {
      std::istringstream in(text);
      po::store(po::parse_config_file(in, boost_schema(), /*allow_unregistered=*/false), vm);
    } catch (const po::error& e) {
      // The scan above refuses everything Boost refuses, so this is a safety net.
      throw UserError(source_ + ": " + e.what());
    }
    for (auto& kv : explicit_) {
      auto it = vm.find(kv.first);
      if (it == vm.end())
        throw UserError(where(kv.first) + ": " + kv.first + ": value not understood");
      kv.second.value = it->second.as<std::string>();
    }
  }

  // ---- command line: "--section.key=value" (or "--section.key value")
  void scan_command_line(const std::vector<std::string>& args) {
    std::vector<std::string> normalized;
    std::set<std::string> seen;
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      if (a.rfind("--", 0) != 0 || a.size() == 2)
        throw UserError("command line: expected --section.key=value, got '" + clip(a) + "'");
      std::string name, value;
      size_t eq = a.find('=');
      if (eq != std::string::npos) {
        name = a.substr(2, eq - 2);
        value = a.substr(eq + 1);
      } else {
        name = a.substr(2);
        if (!find_field(name)) throw UserError("command line: unknown key '" + clip(name) + "'");
        if (i + 1 >= args.size())
          throw UserError("command line: " + name + ": missing value (use --" + name + "=VALUE)");
        value = args[++i];
      }
      if (!find_field(name)) throw UserError("command line: unknown key '" + clip(name) + "'");
      if (!seen.insert(name).second) throw UserError("command line: " + name + ": given twice");
      // The resolved deck is INI text: a value it cannot carry would not read back the same.
      if (value.find('#') != std::string::npos || value.find('\n') != std::string::npos)
        throw UserError("command line: " + name +
                        ": '#' and newlines are not allowed in values (the deck format treats '#' "
                        "as a comment)");
      if (std::any_of(value.begin(), value.end(), [](char ch) {
            const unsigned char c = static_cast<unsigned char>(ch);
            return (c < 0x20 && c != '\t') || c == 0x7f;
          }))
        throw UserError("command line: " + name + ": control characters are not allowed in values");
      value = trim(value);
      // Boost's adjacent form has no spelling for an empty value ("--k=" is refused), so an
      // empty value travels as the next token instead.
      if (value.empty()) {
        normalized.push_back("--" + name);
        normalized.push_back("");
      } else {
        normalized.push_back("--" + name + "=" + value);
      }
      explicit_[name] = RawValue{value, Origin{Origin::CommandLine, 0}};
      origins_[name] = Origin{Origin::CommandLine, 0};
    }
    // Boost parses the normalised arguments against the same schema (no prefix guessing, so a
    // truncated key is an unknown key, not a silent match).
    try {
      namespace cls = po::command_line_style;
      po::variables_map vm;
      po::store(po::command_line_parser(normalized)
                    .options(boost_schema())
                    .style(cls::allow_long | cls::long_allow_adjacent | cls::long_allow_next)
                    .run(),
                vm);
      for (const auto& kv : vm) explicit_[kv.first].value = kv.second.as<std::string>();
    } catch (const po::error& e) {
      throw UserError(std::string("command line: ") + e.what());
    }
  }

  // ---- presets: fill the model keys that neither the deck nor the command line set
  void apply_preset(Deck* d) {
    auto it = explicit_.find("model.preset");
    preset_ = it == explicit_.end() ? d->model.preset : it->second.value;
    const auto& presets = model_presets();
    auto p = presets.find(preset_);
    if (p == presets.end()) {
      std::string names;
      for (const auto& kv : presets) names += (names.empty() ? "" : ", ") + kv.first;
      fail("model.preset", "unknown preset '" + clip(preset_) + "' (known: " + names + ")");
    }
    d->model.preset = preset_;
    if (preset_ == "custom") return;
    const ModelPreset& m = p->second;
    auto fill = [&](const char* key, auto value, auto* field) {
      if (explicit_.count(key)) return;
      *field = value;
      origins_[key] = Origin{Origin::Preset, 0};
    };
    fill("model.image_size", m.image_size, &d->model.image_size);
    fill("model.patch_size", m.patch_size, &d->model.patch_size);
    fill("model.hidden", m.hidden, &d->model.hidden);
    fill("model.depth", m.depth, &d->model.depth);
    fill("model.heads", m.heads, &d->model.heads);
    fill("model.mlp_ratio", m.mlp_ratio, &d->model.mlp_ratio);
    fill("model.num_classes", m.num_classes, &d->model.num_classes);
  }

  // ---- conversion of one explicit value into its field
  void assign(Deck* d, const std::string& name, const std::string& v) {
    const Field* f = find_field(name);
    void* p = f->member(*d);
    auto bad = [&](const char* what) {
      fail(name, std::string("expected ") + what + ", got '" + clip(v) + "'");
    };
    switch (f->kind) {
      case Kind::Int:
        if (!parse_integer(v, static_cast<int*>(p))) bad("an integer");
        break;
      case Kind::Int64:
        if (!parse_integer(v, static_cast<int64_t*>(p))) bad("an integer");
        break;
      case Kind::UInt64:
        if (!parse_integer(v, static_cast<uint64_t*>(p))) bad("a non-negative integer");
        break;
      case Kind::Double:
        if (!parse_real(v, static_cast<double*>(p))) bad("a finite number");
        break;
      case Kind::Bool: {
        const std::string l = lower(v);
        bool* b = static_cast<bool*>(p);
        if (l == "true" || l == "1" || l == "yes" || l == "on")
          *b = true;
        else if (l == "false" || l == "0" || l == "no" || l == "off")
          *b = false;
        else
          bad("a boolean (true/false, 1/0, yes/no, on/off)");
        break;
      }
      case Kind::String: {
        std::string* s = static_cast<std::string*>(p);
        if (*f->choices && !accepts(f->choices, v))
          fail(name, "expected one of " + display_choices(f->choices) + ", got '" + clip(v) + "'");
        *s = v;
        break;
      }
      case Kind::FloatList: {
        std::vector<float> vals;
        for (const std::string& item : split(v, ',')) {
          float x = 0;
          if (!parse_real(item, &x)) bad("comma-separated numbers");
          vals.push_back(x);
        }
        *static_cast<std::vector<float>*>(p) = vals;
        break;
      }
    }
  }

  static bool accepts(const std::string& choices, const std::string& v) {
    for (const std::string& c : split(choices, '|')) {
      if (!c.empty() && c.back() == ':') {
        if (v.rfind(c, 0) == 0) return true;
      } else if (v == c) {
        return true;
      }
    }
    return false;
  }

  // ---- derivation and every consistency rule
  void derive_and_validate(Deck* dp) {
    Deck& d = *dp;
    auto positive = [&](const char* key, double v) {
      if (!(v > 0)) fail(key, std::string("must be > 0, got ") + shortest(v));
    };
    auto non_negative = [&](const char* key, double v) {
      if (!(v >= 0)) fail(key, std::string("must be >= 0, got ") + shortest(v));
    };
    auto unit_interval = [&](const char* key, double v) {  // [0,1)
      if (!(v >= 0 && v < 1)) fail(key, std::string("must be in [0,1), got ") + shortest(v));
    };
    // Upper bounds where a larger value can only be a typo (an extra digit, a value meant for
    // another key). They also keep every size derived from these keys, in the checks below and
    // in the layers after the deck, far from integer overflow.
    auto at_most = [&](const char* key, double v, double max, const char* unit = "") {
      // integers as integers: "got 1000000", not "got 1e+06"
      auto text = [](double x) {
        return x == std::floor(x) && std::fabs(x) < 9007199254740992.0
                   ? std::to_string(static_cast<int64_t>(x))
                   : shortest(x);
      };
      if (v > max) fail(key, "must be at most " + text(max) + unit + ", got " + text(v));
    };

    // [run]
    non_negative("run.steps", static_cast<double>(d.run.steps));
    non_negative("run.epochs", d.run.epochs);
    if (d.run.steps > 0 && d.run.epochs > 0)
      fail("run.steps", "run.steps (" + std::to_string(d.run.steps) + ") and run.epochs (" +
                            shortest(d.run.epochs) + ", " + where("run.epochs") +
                            ") are both set; set only one");
    if (d.run.steps == 0 && d.run.epochs == 0)
      fail("run.steps", "set run.steps or run.epochs to a positive value");
    // (the step count derived from epochs must fit 64 bits whatever the dataset size)
    at_most("run.epochs", d.run.epochs, kMaxEpochs);
    positive("run.log_every", d.run.log_every);
    non_negative("run.eval_every", d.run.eval_every);
    non_negative("run.eval_samples", static_cast<double>(d.run.eval_samples));
    require(!d.run.out_dir.empty(), "run.out_dir", "must not be empty");

    // [model]
    ModelSection& m = d.model;
    positive("model.image_size", m.image_size);
    positive("model.patch_size", m.patch_size);
    require(m.channels == 3, "model.channels",
            "must be 3 (RGB inputs), got " + std::to_string(m.channels));
    positive("model.hidden", m.hidden);
    positive("model.depth", m.depth);
    positive("model.heads", m.heads);
    positive("model.mlp_ratio", m.mlp_ratio);
    positive("model.num_classes", m.num_classes);
    at_most("model.image_size", m.image_size, kMaxImageSize, " pixels");
    at_most("model.hidden", m.hidden, kMaxHidden);
    at_most("model.depth", m.depth, kMaxDepth, " blocks");
    at_most("model.mlp_ratio", m.mlp_ratio, kMaxMlpRatio);  // before mlp_hidden() converts it
    at_most("model.num_classes", m.num_classes, kMaxClasses);
    unit_interval("model.dropout", m.dropout);
    unit_interval("model.drop_path", m.drop_path);
    require(m.image_size % m.patch_size == 0, "model.patch_size",
            std::to_string(m.patch_size) + " does not divide model.image_size (" +
                std::to_string(m.image_size) + ")");
    require(m.hidden % m.heads == 0, "model.heads",
            std::to_string(m.heads) + " does not divide model.hidden (" + std::to_string(m.hidden) +
                ")");
    require(m.mlp_hidden() > 0, "model.mlp_ratio", "gives an empty MLP");
    require(m.checkpoint_blocks >= -1, "model.checkpoint_blocks",
            "must be -1 (every block) or a block count >= 0, got " +
                std::to_string(m.checkpoint_blocks));
    require(m.checkpoint_blocks == -1 || m.checkpoint_activations, "model.checkpoint_blocks",
            "= " + std::to_string(m.checkpoint_blocks) +
                " needs model.checkpoint_activations = true (it says how many blocks of each "
                "stage are recomputed)");

    // [data] (alone)
    DataSection& dt = d.data;
    if (dt.dataset != "synthetic")
      require(!dt.path.empty(), "data.path",
              "must name the " + std::string(dt.dataset == "cifar10"    ? "CIFAR-10 directory"
                                             : dt.dataset == "hdf5"     ? "HDF5 file"
                                             : dt.dataset == "tfrecord" ? "TFRecord shard directory"
                                             : dt.dataset == "folder"   ? "ImageFolder root"
                                                                        : "jpeg_h5 file") +
                  " for data.dataset = " + dt.dataset);
    if (dt.label_offset == DataSection::kLabelOffsetAuto) dt.label_offset = dt.dataset == "tfrecord" ? -1 : 0;
    require(std::abs(dt.label_offset) <= 1000000 - 1, "data.label_offset",
            "must be within +-999999, got " + std::to_string(dt.label_offset));
    require(dt.eval_fraction >= 0.0 && dt.eval_fraction < 1.0, "data.eval_fraction",
            "must be in [0, 1), got " + shortest(dt.eval_fraction));
    require(dt.rrc_scale.size() == 2 && dt.rrc_scale[0] > 0 && dt.rrc_scale[0] <= dt.rrc_scale[1] &&
                dt.rrc_scale[1] <= 1.0f,
            "data.rrc_scale", "needs 2 values 0 < lo <= hi <= 1");
    require(dt.rrc_ratio.size() == 2 && dt.rrc_ratio[0] > 0 && dt.rrc_ratio[0] <= dt.rrc_ratio[1],
            "data.rrc_ratio", "needs 2 values 0 < lo <= hi");
    require(dt.crop_pct > 0.0 && dt.crop_pct <= 1.0, "data.crop_pct",
            "must be in (0, 1], got " + shortest(dt.crop_pct));
    positive("data.global_batch", static_cast<double>(dt.global_batch));
    positive("data.grad_accum", dt.grad_accum);
    at_most("data.grad_accum", dt.grad_accum, static_cast<double>(kMaxGlobalBatch));
    positive("data.synthetic_train", static_cast<double>(dt.synthetic_train));
    positive("data.synthetic_eval", static_cast<double>(dt.synthetic_eval));
    at_most("data.global_batch", static_cast<double>(dt.global_batch), kMaxGlobalBatch, " samples");
    // The sampler holds a permutation of the train split, 8 bytes per sample, on every rank.
    at_most("data.synthetic_train", static_cast<double>(dt.synthetic_train), kMaxSyntheticSamples,
            " samples");
    at_most("data.synthetic_eval", static_cast<double>(dt.synthetic_eval), kMaxSyntheticSamples,
            " samples");
    non_negative("data.crop_padding", dt.crop_padding);
    // a crop of padding alone sees no image
    at_most("data.crop_padding", dt.crop_padding, m.image_size,
            " (model.image_size; a wider padding crops nothing but zeros)");
    non_negative("data.prefetch", dt.prefetch);
    at_most("data.prefetch", dt.prefetch, kMaxPrefetch, " batches");  // each one held in memory
    non_negative("data.workers", dt.workers);
    at_most("data.workers", dt.workers, kMaxWorkers, " threads");
    require(
        dt.mean.size() == 3, "data.mean",
        "needs 3 comma-separated values (one per channel), got " + std::to_string(dt.mean.size()));
    require(
        dt.std.size() == 3, "data.std",
        "needs 3 comma-separated values (one per channel), got " + std::to_string(dt.std.size()));
    for (float s : dt.std) require(s > 0, "data.std", "entries must be > 0, got " + shortest(s));
    non_negative("data.mixup_alpha", dt.mixup_alpha);
    non_negative("data.cutmix_alpha", dt.cutmix_alpha);
    require(dt.mixup_prob >= 0.0 && dt.mixup_prob <= 1.0, "data.mixup_prob",
            "must be in [0, 1], got " + shortest(dt.mixup_prob));
    require(dt.mixup_switch_prob >= 0.0 && dt.mixup_switch_prob <= 1.0, "data.mixup_switch_prob",
            "must be in [0, 1], got " + shortest(dt.mixup_switch_prob));
    unit_interval("data.label_smoothing", dt.label_smoothing);

    // [optim]
    OptimSection& o = d.optim;
    positive("optim.lr", o.lr);
    non_negative("optim.min_lr", o.min_lr);
    require(o.min_lr <= o.lr, "optim.min_lr",
            shortest(o.min_lr) + " exceeds optim.lr (" + shortest(o.lr) + ")");
    non_negative("optim.weight_decay", o.weight_decay);
    unit_interval("optim.beta1", o.beta1);
    unit_interval("optim.beta2", o.beta2);
    positive("optim.eps", o.eps);
    unit_interval("optim.momentum", o.momentum);
    non_negative("optim.warmup_steps", static_cast<double>(o.warmup_steps));
    non_negative("optim.warmup_epochs", o.warmup_epochs);
    at_most("optim.warmup_epochs", o.warmup_epochs, kMaxEpochs);
    if (o.warmup_steps > 0 && o.warmup_epochs > 0)
      fail("optim.warmup_steps", "optim.warmup_steps and optim.warmup_epochs (" +
                                     where("optim.warmup_epochs") + ") are both set; set only one");
    non_negative("optim.clip_grad_norm", o.clip_grad_norm);

    // [precision]
    PrecisionSection& pr = d.precision;
    positive("precision.initial_scale", pr.initial_scale);
    positive("precision.growth_interval", pr.growth_interval);
    require(pr.growth_factor > 1, "precision.growth_factor",
            "must be > 1, got " + shortest(pr.growth_factor));
    require(pr.backoff_factor > 0 && pr.backoff_factor < 1, "precision.backoff_factor",
            "must be in (0,1), got " + shortest(pr.backoff_factor));

    // [checkpoint]
    non_negative("checkpoint.every_steps", static_cast<double>(d.checkpoint.every_steps));
    non_negative("checkpoint.keep", d.checkpoint.keep);

    // [device]
    positive("device.comm_timeout", d.device.comm_timeout);
    if (d.device.data_comm_ctas < 0 || d.device.data_comm_ctas > 64) {
      fail("device.data_comm_ctas", "must be between 0 and 64 (0: NCCL's choice)");
    }
    if (d.device.pipe_comm_ctas < 0 || d.device.pipe_comm_ctas > 64) {
      fail("device.pipe_comm_ctas", "must be between 0 and 64 (0: NCCL's choice)");
    }
    if (d.device.tensor_comm_ctas < 0 || d.device.tensor_comm_ctas > 64) {
      fail("device.tensor_comm_ctas", "must be between 0 and 64 (0: NCCL's choice)");
    }
    if (d.device.gemm_sm_margin < 0 || d.device.gemm_sm_margin > 64) {
      fail("device.gemm_sm_margin", "must be between 0 and 64 (SMs left to the reduction)");
    }
    if (d.device.gemm_tune < 0 || d.device.gemm_tune > 16) {
      fail("device.gemm_tune", "must be between 0 and 16 (GEMM algorithms timed per shape)");
    }
    non_negative("device.bucket_mb", d.device.bucket_mb);
    at_most("device.bucket_mb", d.device.bucket_mb, 1048576.0, " MiB");
    if (d.device.fused_gelu_forward_config < -1) {
      fail("device.fused_gelu_forward_config",
           "must be a configuration id >= 0, or -1 (chosen as device.fused_gelu says)");
    }
    if (d.device.fused_gelu_backward_config < -1) {
      fail("device.fused_gelu_backward_config",
           "must be a configuration id >= 0, or -1 (chosen as device.fused_gelu says)");
    }

    // [parallel]: the grid
    ParallelSection& p = d.parallel;
    positive("parallel.pipeline", p.pipeline);
    positive("parallel.tensor", p.tensor);
    positive("parallel.tensor_depth", p.tensor_depth);
    positive("parallel.micro_batches", p.micro_batches);
    at_most("parallel.micro_batches", p.micro_batches, static_cast<double>(kMaxGlobalBatch));
    positive("parallel.chunks", p.chunks);
    require(p.zero == 0 || p.zero == 1, "parallel.zero",
            "must be 0 or 1, got " + std::to_string(p.zero));
    if (d.device.data_comm == "copy_engine") {
      require(p.grad_reduce == "fp32", "device.data_comm",
              "copy_engine sums the gradients in fp32: it needs parallel.grad_reduce = fp32");
    }
    if (p.grad_reduce == "act") {
      const std::string& m = d.precision.mode;
      require(m == "bf16" || m == "fp16" || m == "fp16-naive", "parallel.grad_reduce",
              "act needs a 16-bit precision.mode (bf16, fp16, fp16-naive), got " + m);
      require(p.zero == 0, "parallel.grad_reduce",
              "act is for all-reduced gradients; ZeRO-1 (parallel.zero = 1) reduce-scatters "
              "them in fp32");
    }
    non_negative("parallel.data", p.data);
    if (world_ < 1) throw UserError("world size must be >= 1, got " + std::to_string(world_));
    require(world_ % p.tensor == 0, "parallel.tensor",
            std::to_string(p.tensor) + " does not divide the world size (" +
                std::to_string(world_) + " ranks)");
    // (64-bit product: a huge pipeline count must be refused, not wrap around)
    require(world_ % (static_cast<int64_t>(p.pipeline) * p.tensor) == 0, "parallel.pipeline",
            "parallel.pipeline (" + std::to_string(p.pipeline) + ") x parallel.tensor (" +
                std::to_string(p.tensor) + ") does not divide the world size (" +
                std::to_string(world_) + " ranks)");
    const int derived = world_ / (p.pipeline * p.tensor);
    require(p.data == 0 || p.data == derived, "parallel.data",
            "is " + std::to_string(p.data) + " but world (" + std::to_string(world_) +
                ") / (pipeline " + std::to_string(p.pipeline) + " x tensor " +
                std::to_string(p.tensor) + ") = " + std::to_string(derived) +
                "; leave it 0 to derive it");
    p.data = derived;

    // The tensor layout: q is the side of the square / cube; split_q is what each rank's
    // activations are split by along the batch (see below).
    const int t = p.tensor;
    int q = 1, batch_split = 1;
    require(p.sequence_chunks >= 1 && p.sequence_chunks <= 8, "parallel.sequence_chunks",
            "must be between 1 and 8, got " + std::to_string(p.sequence_chunks));
    require(!p.sequence_parallel || (t > 1 && p.tensor_mode == "1d"), "parallel.sequence_parallel",
            "needs 1d tensor parallelism (parallel.tensor > 1, tensor_mode = 1d); got tensor " +
                std::to_string(t) + ", tensor_mode " + p.tensor_mode);
    if (t > 1 && p.tensor_mode == "1d") {
      if (p.sequence_parallel) batch_split = t;
      require(m.heads % t == 0, "model.heads",
              std::to_string(m.heads) + " is not divisible by parallel.tensor (" +
                  std::to_string(t) + ") for 1d tensor parallelism");
      require(m.mlp_hidden() % t == 0, "model.mlp_ratio",
              "MLP width " + std::to_string(m.mlp_hidden()) +
                  " is not divisible by parallel.tensor (" + std::to_string(t) + ")");
    } else if (t > 1 && p.tensor_mode == "2d") {
      q = exact_root(t, 2);
      require(q > 0, "parallel.tensor",
              std::to_string(t) + " is not a square (2d needs tensor = q*q)");
      batch_split = q;
    } else if (t > 1 && p.tensor_mode == "2.5d") {
      const int dd = p.tensor_depth;
      require(t % dd == 0, "parallel.tensor_depth",
              std::to_string(dd) + " does not divide parallel.tensor (" + std::to_string(t) +
                  "); 2.5d needs tensor = depth*q*q");
      q = exact_root(t / dd, 2);
      require(q > 0, "parallel.tensor",
              std::to_string(t) + " / parallel.tensor_depth (" + std::to_string(dd) +
                  ") is not a square; 2.5d needs tensor = depth*q*q");
      batch_split = dd * q;
    } else if (t > 1 && p.tensor_mode == "3d") {
      q = exact_root(t, 3);
      require(q > 0, "parallel.tensor",
              std::to_string(t) + " is not a cube (3d needs tensor = q*q*q)");
      batch_split = q * q;
    }
    if (t > 1 && (p.tensor_mode == "2d" || p.tensor_mode == "2.5d")) {
      divisible_by_q("model.hidden", m.hidden, q, "q", p.tensor_mode);
      divisible_by_q("model.heads", m.heads, q, "q", p.tensor_mode);
      divisible_by_q("model.mlp_ratio", m.mlp_hidden(), q, "q", p.tensor_mode, "MLP width ");
    } else if (t > 1 && p.tensor_mode == "3d") {
      divisible_by_q("model.hidden", m.hidden, q * q, "q*q", p.tensor_mode);
      divisible_by_q("model.heads", m.heads, q, "q", p.tensor_mode);
      divisible_by_q("model.mlp_ratio", m.mlp_hidden(), q * q, "q*q", p.tensor_mode, "MLP width ");
    }

    // The batch: global = data x grad_accum x micro_batches x micro-batch, and in 2d/2.5d/3d
    // each micro-batch's activations are split over the batch dimension too.
    const int64_t replicas_x_accum = static_cast<int64_t>(p.data) * dt.grad_accum;
    const std::string product = "parallel.data (" + std::to_string(p.data) +
                                ") x data.grad_accum (" + std::to_string(dt.grad_accum) +
                                ") x parallel.micro_batches (" + std::to_string(p.micro_batches) +
                                ")";
    require(dt.global_batch % replicas_x_accum == 0, "data.global_batch",
            std::to_string(dt.global_batch) + " is not divisible by " + product + " = " +
                std::to_string(replicas_x_accum * p.micro_batches));
    const int64_t per_rank = dt.global_batch / replicas_x_accum;
    require(per_rank % p.micro_batches == 0, "parallel.micro_batches",
            std::to_string(p.micro_batches) + " does not divide the per-rank batch " +
                std::to_string(per_rank) + " (data.global_batch " +
                std::to_string(dt.global_batch) + " / (" + product + " without micro-batches))");
    // Mixing pairs the samples at stream positions 2k and 2k+1: a rank's batch must hold both.
    require(!(dt.mixup_alpha > 0 || dt.cutmix_alpha > 0) || per_rank % 2 == 0, "data.global_batch",
            "Mixup / CutMix mix the samples of a pair, so the per-rank batch " +
                std::to_string(per_rank) + " (data.global_batch / (parallel.data x data.grad_accum)) must be even");
    const int64_t micro = per_rank / p.micro_batches;
    require(micro % batch_split == 0, "data.global_batch",
            "the micro-batch of " + std::to_string(micro) + " samples (" +
                std::to_string(dt.global_batch) + " / (" + product + ")) is not divisible by " +
                std::to_string(batch_split) + ", which " +
                (p.sequence_parallel ? "1d sequence-parallel" : p.tensor_mode) +
                " tensor parallelism splits it by");

    // The pipeline.
    const bool interleaved = p.schedule == "interleaved";
    if (interleaved)
      require(
          p.chunks >= 2, "parallel.chunks",
          "the interleaved schedule needs >= 2 chunks per stage, got " + std::to_string(p.chunks));
    else
      require(p.chunks == 1, "parallel.chunks",
              "must be 1 unless parallel.schedule = interleaved, got " + std::to_string(p.chunks));
    require(p.chunks <= m.depth, "parallel.chunks",
            std::to_string(p.chunks) + " chunks per stage exceed model.depth (" +
                std::to_string(m.depth) + " blocks)");
    // p.pipeline divides the world size and p.chunks <= model.depth, so this cannot overflow
    const int stages = p.pipeline * p.chunks;
    require(stages <= m.depth, "parallel.pipeline",
            std::to_string(stages) + " pipeline stages x chunks exceed model.depth (" +
                std::to_string(m.depth) + " blocks)");
    if (p.partition == "uniform" || interleaved)
      require(m.depth % stages == 0, "model.depth",
              std::to_string(m.depth) + " blocks cannot be split evenly over parallel.pipeline (" +
                  std::to_string(p.pipeline) + ") x parallel.chunks (" + std::to_string(p.chunks) +
                  ") = " + std::to_string(stages) + " stages" +
                  (interleaved ? "" : "; use parallel.partition = balanced or list:n0,n1,..."));
    if (p.partition.rfind("list:", 0) == 0) {
      std::vector<std::string> items = split(p.partition.substr(5), ',');
      int sum = 0;
      for (const std::string& s : items) {
        int n = 0;
        if (!parse_integer(s, &n) || n < 1)
          fail("parallel.partition",
               "list entries must be positive integers, got '" + s + "' in '" + p.partition + "'");
        sum += n;
      }
      require(static_cast<int>(items.size()) == stages, "parallel.partition",
              "has " + std::to_string(items.size()) +
                  " entries but parallel.pipeline x "
                  "parallel.chunks = " +
                  std::to_string(stages));
      require(sum == m.depth, "parallel.partition",
              "entries sum to " + std::to_string(sum) + " but model.depth is " +
                  std::to_string(m.depth));
    }
    check_derived_sizes(d, per_rank, micro);
  }

  // The first of `keys` the deck or the command line set (the likeliest culprit of a size
  // derived from all of them), else the first.
  std::string blame(std::initializer_list<const char*> keys) const {
    for (const char* k : keys) {
      auto it = origins_.find(k);
      if (it != origins_.end() &&
          (it->second.kind == Origin::Deck || it->second.kind == Origin::CommandLine))
        return k;
    }
    return *keys.begin();
  }

  // a * b * ... in 64 bits; -1 when it overflows (every factor is >= 0 here).
  static int64_t product(std::initializer_list<int64_t> factors) {
    int64_t r = 1;
    for (int64_t f : factors)
      if (__builtin_mul_overflow(r, f, &r)) return -1;
    return r;
  }
  static int64_t sum(std::initializer_list<int64_t> terms) {
    int64_t r = 0;
    for (int64_t t : terms)
      if (t < 0 || __builtin_add_overflow(r, t, &r)) return -1;
    return r;
  }

  // Sizes derived from several keys, each within its own bound above: computed with overflow
  // checks and refused, naming a key that feeds them, when they overflow, exceed the 32-bit row
  // counts the kernels take, or exceed what any machine holds (kMaxRankBytes per rank).
  // Nothing is allocated before this passes, so an absurd deck never reaches an allocation
  // whose size has wrapped around.
  void check_derived_sizes(const Deck& d, int64_t per_rank, int64_t micro) const {
    const ModelSection& m = d.model;
    const ParallelSection& p = d.parallel;
    const int64_t S = m.image_size, P = m.patch_size, H = m.hidden, M = m.mlp_hidden();
    const int64_t K = m.num_classes, heads = m.heads;
    const int64_t T = (S / P) * (S / P) + 1;  // <= 8192^2 + 1
    const std::string tokens = std::to_string(T) + " tokens (model.image_size " +
                               std::to_string(S) + " / model.patch_size " + std::to_string(P) +
                               ", squared, + 1)";
    const std::string micro_s = "the micro-batch of " + std::to_string(micro) + " samples";
    auto bytes = [](int64_t b) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.3g", double(b));
      return std::string(buf) + " bytes";
    };
    auto too_big = [&](int64_t v) { return v < 0 || v > kMaxRankBytes; };
    const std::string limit =
        " per rank, more than any machine holds (" + bytes(kMaxRankBytes) + ")";

    // The kernels take row counts as 32-bit ints: micro-batch x tokens rows in every Linear,
    // x heads in the attention's softmax.
    const int64_t rows = product({micro, T}), att_rows = product({micro, heads, T});
    if (rows < 0 || rows > INT_MAX)
      fail(blame({"model.image_size", "model.patch_size", "data.global_batch",
                  "parallel.micro_batches"}),
           micro_s + " x " + tokens + " gives " + (rows < 0 ? "more" : std::to_string(rows)) +
               " activation rows, more than the kernels' limit of " + std::to_string(INT_MAX));
    if (att_rows < 0 || att_rows > INT_MAX)
      fail(blame({"model.heads", "model.image_size", "model.patch_size", "data.global_batch",
                  "parallel.micro_batches"}),
           micro_s + " x " + std::to_string(heads) + " heads x " + tokens + " gives " +
               (att_rows < 0 ? "more" : std::to_string(att_rows)) +
               " attention rows, more than the kernels' limit of " + std::to_string(INT_MAX));
    // the attention matrices of every head for the micro-batch, in fp32
    const int64_t att_bytes = product({micro, heads, T, T, 4});
    if (too_big(att_bytes))
      fail(blame({"model.image_size", "model.patch_size", "model.heads", "data.global_batch"}),
           "the attention scores of " + micro_s + " x " + std::to_string(heads) + " heads x " +
               tokens + " squared take " +
               (att_bytes < 0 ? "more than 2^63 bytes" : bytes(att_bytes)) + limit);

    // Parameters: patch embedding, cls and position, per block two norms, qkv, proj and the
    // MLP, the final norm and the head. Training keeps ~16 bytes per parameter (fp32 weights,
    // gradients and two optimizer moments), over pipeline x tensor ranks.
    const int64_t block = sum({product({4, H}), product({3, H, H}), product({3, H}),
                               product({H, H}), H, product({2, H, M}), M, H});
    const int64_t params = sum({product({3, P, P, H}), H, H, product({T, H}),
                                product({m.depth, block}), product({2, H}), product({H, K}), K});
    const int64_t state = product({params, 16});
    const int64_t state_rank = state < 0 ? -1 : state / (int64_t(p.pipeline) * p.tensor);
    if (too_big(state_rank))
      fail(blame({"model.hidden", "model.depth", "model.mlp_ratio", "model.num_classes",
                  "model.image_size", "model.preset"}),
           "the model has " +
               (params < 0 ? std::string("more than 2^63") : std::to_string(params)) +
               " parameters (model.hidden " + std::to_string(H) + ", model.depth " +
               std::to_string(m.depth) + ", MLP width " + std::to_string(M) +
               ", model.num_classes " + std::to_string(K) + "): their training state takes " +
               (state_rank < 0 ? "more than 2^63 bytes" : bytes(state_rank)) + limit);

    // Activations a stage keeps per micro-batch: ~8 hidden-wide and 2 MLP-wide fp32 tensors
    // per block (a lower estimate: enough to tell the absurd).
    const int64_t stage_blocks = (m.depth + p.pipeline - 1) / p.pipeline;
    const int64_t acts =
        product({micro, T, sum({product({8, H}), product({2, M})}), 4, stage_blocks});
    if (too_big(acts))
      fail(blame({"data.global_batch", "model.image_size", "model.patch_size", "model.hidden",
                  "model.depth"}),
           "the activations of " + micro_s + " x " + tokens + " x model.hidden " +
               std::to_string(H) + " in " + std::to_string(stage_blocks) +
               " blocks per stage take " + (acts < 0 ? "more than 2^63 bytes" : bytes(acts)) +
               limit);

    // The batch on the host (uint8 images) and on the device (fp32 images), and Mixup's soft
    // targets.
    const int64_t images = product({per_rank, S, S, 3});
    const int64_t device_images = product({per_rank, S, S, 3, 4});
    const int64_t soft = product({per_rank, K, 4});
    if (too_big(images) || too_big(device_images))
      fail(blame({"data.global_batch", "model.image_size"}),
           "the per-rank batch of " + std::to_string(per_rank) + " images of " + std::to_string(S) +
               "x" + std::to_string(S) + " pixels takes " +
               (device_images < 0 ? "more than 2^63 bytes" : bytes(device_images)) + limit);
    if (too_big(soft))
      fail(blame({"model.num_classes", "data.global_batch"}),
           "the per-rank batch of " + std::to_string(per_rank) + " samples x " + std::to_string(K) +
               " classes of soft targets takes " +
               (soft < 0 ? "more than 2^63 bytes" : bytes(soft)) + limit);
  }

  void divisible_by_q(const char* key, int value, int div, const char* divname,
                      const std::string& mode, const std::string& what = "") const {
    if (value % div != 0)
      fail(key, what + std::to_string(value) + " is not divisible by " + divname + " = " +
                    std::to_string(div) + " of the " + mode + " tensor layout");
  }

  // The integer r with r^k == n, or 0 when n is not a perfect power.
  static int exact_root(int n, int k) {
    for (int r = 1;; ++r) {
      int64_t pw = 1;
      for (int i = 0; i < k; ++i) pw *= r;
      if (pw == n) return r;
      if (pw > n) return 0;
    }
  }

  std::string source_;
  int world_;
  std::string preset_;
  std::map<std::string, RawValue> explicit_;  // merged deck + command line, by "section.key"
  std::map<std::string, Origin> origins_;
};

// The value of one field as the deck would spell it.
std::string format_value(const Field& f, const Deck& d) {
  void* p = f.member(const_cast<Deck&>(d));  // read-only use
  switch (f.kind) {
    case Kind::Int:
      return std::to_string(*static_cast<int*>(p));
    case Kind::Int64:
      return std::to_string(*static_cast<int64_t*>(p));
    case Kind::UInt64:
      return std::to_string(*static_cast<uint64_t*>(p));
    case Kind::Double:
      return shortest(*static_cast<double*>(p));
    case Kind::Bool:
      return *static_cast<bool*>(p) ? "true" : "false";
    case Kind::String:
      return *static_cast<std::string*>(p);
    case Kind::FloatList: {
      std::string out;
      for (float x : *static_cast<std::vector<float>*>(p))
        out += (out.empty() ? "" : ", ") + shortest(x);
      return out;
    }
  }
  return "";
}

const char* kind_name(const Field& f) {
  if (*f.choices) return "enum";
  switch (f.kind) {
    case Kind::Int:
    case Kind::Int64:
      return "int";
    case Kind::UInt64:
      return "uint";
    case Kind::Double:
      return "float";
    case Kind::Bool:
      return "bool";
    case Kind::String:
      return "string";
    case Kind::FloatList:
      return "float list";
  }
  return "";
}

}  // namespace

const std::map<std::string, ModelPreset>& model_presets() {
  // {image_size, patch_size, hidden, depth, heads, mlp_ratio, num_classes}
  static const std::map<std::string, ModelPreset> presets = {
      {"vit-tiny/16", {224, 16, 192, 12, 3, 4.0, 1000}},
      {"vit-small/16", {224, 16, 384, 12, 6, 4.0, 1000}},
      {"vit-base/16", {224, 16, 768, 12, 12, 4.0, 1000}},
      {"vit-large/16", {224, 16, 1024, 24, 16, 4.0, 1000}},
      {"vit-base/32", {224, 32, 768, 12, 12, 4.0, 1000}},
      {"vit-large/32", {224, 32, 1024, 24, 16, 4.0, 1000}},
      {"vit-lite-7/4", {32, 4, 256, 7, 4, 2.0, 10}},
      // the hybrid-parallel guide's large ViT
      {"vit-huge-4096", {224, 16, 4096, 32, 64, 4.0, 1000}},
      // no preset: the model keys keep their defaults unless the deck sets them
      {"custom", {0, 0, 0, 0, 0, 0.0, 0}},
  };
  return presets;
}

Deck parse_deck_text(const std::string& text, const std::vector<std::string>& overrides,
                     int world_size, const std::string& source_name) {
  // Editors on Windows start UTF-8 files with a byte-order mark; it is no part of the first
  // line ("[run]" must still read as a section header).
  static const std::string kBom = "\xEF\xBB\xBF";
  if (text.compare(0, kBom.size(), kBom) == 0)
    return Parser(source_name, world_size).run(text.substr(kBom.size()), overrides);
  return Parser(source_name, world_size).run(text, overrides);
}

Deck parse_deck(const std::string& deck_path, const std::vector<std::string>& overrides,
                int world_size) {
  return parse_deck_text(read_deck_file(deck_path), overrides, world_size, deck_path);
}

std::string read_deck_file(const std::string& deck_path) {
  const std::string at = "deck '" + deck_path + "': ";
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever (every
  // rank hangs before any check); the type is checked on the open descriptor, so no name can
  // change under us between the check and the read.
  const int fd = ::open(deck_path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw UserError(at + "cannot open the file: " + std::strerror(errno));
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) throw UserError(at + "cannot stat the file: " + std::strerror(errno));
  // A directory opens fine and reads as nothing, which would surface as a confusing "set
  // run.steps" about a deck that was never read.
  if (S_ISDIR(st.st_mode)) throw UserError(at + "is a directory, not a deck file");
  if (!S_ISREG(st.st_mode))
    throw UserError(at + "is not a regular file (" + file_type_name(st.st_mode) +
                    "); every rank reads the deck, so it must be a file");
  if (st.st_size > kMaxDeckBytes)
    throw UserError(at + "is " + std::to_string((long long)st.st_size) +
                    " bytes; a deck is a small text file (at most " +
                    std::to_string(kMaxDeckBytes) + " bytes)");
  std::string text((size_t)st.st_size, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t r = ::read(fd, &text[got], text.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw UserError(at + "read error: " + std::strerror(errno));
    if (r == 0) break;  // shrank while we read: parse what is there
    got += (size_t)r;
  }
  text.resize(got);
  return text;
}

std::string file_type_name(unsigned mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISREG(mode)) return "a regular file";
  return "not a regular file";
}

std::string Deck::resolved_text() const {
  std::string src = source;
  std::replace(src.begin(), src.end(), '\n', ' ');
  std::ostringstream out;
  out << "# vitgrid resolved deck: every key with its final value\n";
  out << "# source: " << src << "\n";
  for (const char* section : kSections) {
    out << "\n[" << section << "]\n";
    for (const Field& f : schema())
      if (std::string(f.section) == section)
        out << f.key << " = " << format_value(f, *this) << "\n";
  }
  return out.str();
}

std::string deck_reference() {
  const Deck defaults;
  std::ostringstream out;
  out << "| section | key | type | default | meaning |\n";
  out << "|---|---|---|---|---|\n";
  auto escape = [](std::string s) {  // a '|' would end the Markdown cell
    std::string r;
    for (char c : s) {
      if (c == '|') r += "\\";
      r += c;
    }
    return r;
  };
  for (const Field& f : schema()) {
    std::string type = kind_name(f);
    if (*f.choices) type += ": " + display_choices(f.choices);
    std::string def = format_value(f, defaults);
    out << "| " << f.section << " | " << f.key << " | " << escape(type) << " | `"
        << (def.empty() ? std::string(" ") : def) << "` | " << escape(f.help) << " |\n";
  }
  return out.str();
}

}  // namespace vitgrid
