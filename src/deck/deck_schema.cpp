// The deck's schema (one row per key, VG_FIELD), the value formats, the resolved dump and the
// Markdown reference.
#include <algorithm>
#include <cctype>
#include <sstream>
#include <string>
#include <vector>

#include "deck_internal.h"

namespace vitgrid {
namespace deck_detail {

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
               "stochastic depth (timm drop_path_rate), in [0,1): each block's attention and MLP "
               "branches drop whole samples, at a rate rising linearly from 0 at the first block "
               "to this at the last"),
      VG_FIELD(model, gelu, "exact|tanh", "GELU form: exact (erf, timm default) or tanh"),
      VG_FIELD(model, checkpoint_activations, "",
               "recompute each block in the backward pass to save activation memory"),
      VG_FIELD(model, checkpoint_blocks, "",
               "with checkpoint_activations: recompute only the first n blocks of each pipeline "
               "stage (of each virtual stage when interleaved) and keep the others' activations, "
               "trading memory for speed (Megatron's recompute-method block); -1: every block"),
      VG_FIELD(model, keep_gelu_output, "",
               "keep each block's GELU output for the backward instead of recomputing it (batch x "
               "tokens x mlp more activations per block, one elementwise pass less; ignored for "
               "the checkpointed blocks)"),
      // [parallel]
      VG_FIELD(parallel, pipeline, "", "pipeline stages"),
      VG_FIELD(parallel, tensor, "", "ranks in the tensor-parallel group"),
      VG_FIELD(parallel, tensor_mode, "1d|2d|2.5d|3d",
               "tensor-parallel layout: 1d [t], 2d [q,q], 2.5d [d,q,q], 3d [q,q,q]"),
      VG_FIELD(parallel, tensor_depth, "", "depth d of the 2.5d layout (tensor = d*q*q)"),
      VG_FIELD(
          parallel, sequence_parallel, "",
          "1d: split the residual stream's samples over the tensor ranks (Megatron's sequence "
          "parallelism): LayerNorms, residual adds, dropout, patch embedding and head on 1/tensor "
          "of the micro-batch, each Column Linear's input all-gathered and each Row Linear's "
          "output reduce-scattered instead of all-reduced; the micro-batch must divide by tensor"),
      VG_FIELD(parallel, sequence_chunks, "1..8",
               "with sequence_parallel: split each overlapped all-gather (before the Column "
               "Linears' forward and the Row Linears' backward) and, with tensor > 2, each Row "
               "forward's reduce-scatter into this many row chunks, so each GEMM waits only for "
               "the chunk it needs and the reduce-scatter of one chunk runs beside the next "
               "chunk's GEMMs (1: whole)"),
      VG_FIELD(parallel, micro_batches, "", "pipeline micro-batches per optimizer step"),
      VG_FIELD(parallel, schedule, "gpipe|1f1b|interleaved", "pipeline schedule"),
      VG_FIELD(parallel, chunks, "", "model chunks per stage (interleaved schedule only, >= 2)"),
      VG_FIELD(parallel, partition, "uniform|balanced|list:",
               "blocks per stage: uniform | balanced | list:n0,n1,... (pipeline*chunks entries)"),
      VG_FIELD(parallel, zero, "",
               "ZeRO stage: 0 = off, 1 = optimizer state (with bf16/fp16 the fp32 master weights "
               "too) sharded over data"),
      VG_FIELD(parallel, grad_reduce, "fp32|act",
               "data-parallel gradient sums in fp32, or in the 16-bit act dtype of bf16/fp16 (half "
               "the bytes, as DDP's bf16_compress_hook; gradients stay fp32 around it)"),
      VG_FIELD(parallel, zero_gather, "forward|step",
               "ZeRO-1 with bf16/fp16: the updated parameters are all-gathered bucket by bucket "
               "during the next step's forward, each bucket just before its layers (forward), or "
               "all at the end of the update (step)"),
      VG_FIELD(parallel, data, "",
               "data-parallel replicas; derived as world / (pipeline * tensor), 0 = derive"),
      // [data]
      VG_FIELD(data, dataset, "synthetic|cifar10|hdf5|tfrecord|folder|jpeg_h5",
               "dataset kind: raw images (synthetic, cifar10, hdf5) or encoded JPEGs (tfrecord "
               "shards, an ImageFolder tree, packed jpeg_h5)"),
      VG_FIELD(data, path, "",
               "CIFAR-10 binary directory, HDF5 file, TFRecord shard directory, ImageFolder root "
               "or jpeg_h5 file"),
      VG_FIELD(data, eval_path, "",
               "hdf5 / jpeg_h5 eval file (default: the eval split of data.path)"),
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
      VG_FIELD(data, mixup_mode, "batch|pair|elem",
               "one mixing draw per global batch, per pair of samples, or per sample (timm's "
               "modes; the partner is the other sample of the pair: positions 2k and 2k+1)"),
      VG_FIELD(data, label_smoothing, "", "label smoothing in [0,1)"),
      VG_FIELD(data, prefetch, "", "batches prepared ahead by the background thread"),
      VG_FIELD(data, workers, "",
               "threads reading one batch's samples (0 = auto: cores per rank, at most 16)"),
      VG_FIELD(data, label_offset, "",
               "added to stored labels (encoded sources; default -1 for tfrecord, whose labels are "
               "1-based, else 0)"),
      VG_FIELD(data, eval_fraction, "",
               "folder without train/ and val/: the held-out share of each class for evaluation"),
      VG_FIELD(data, index_dir, "",
               "where missing TFRecord indexes (DALI's tfrecord2idx format) are written (default: "
               "RUN_DIR/tfrecord-index)"),
      VG_FIELD(data, rrc_scale, "", "RandomResizedCrop area range, 2 comma-separated floats"),
      VG_FIELD(data, rrc_ratio, "",
               "RandomResizedCrop aspect-ratio range, 2 comma-separated floats"),
      VG_FIELD(data, interpolation, "bilinear|bicubic",
               "resize filter of the crops (Pillow's, antialiased)"),
      VG_FIELD(data, crop_pct, "",
               "eval: the short side is resized to image_size / crop_pct, then centre-cropped"),
      VG_FIELD(data, dct_scale, "",
               "CPU decoding: decode at 1/2, 1/4 or 1/8 scale (DCT domain) when the crop stays >= "
               "2x the output"),
      VG_FIELD(data, decode, "auto|host|device",
               "where JPEGs are decoded: host = the loader's threads (libjpeg-turbo); device = "
               "the GPU (nvJPEG), data.device_share of them; auto = host (measured faster on "
               "H100s with 16 cores per GPU)"),
      VG_FIELD(data, device_share, "",
               "data.decode = device: the share of each batch's JPEGs given to the GPU's decoder "
               "(0 to 1); the loader's threads decode the rest at the same time"),
      VG_FIELD(data, resize, "auto|host|device",
               "where the JPEGs the loader's threads decode are cropped, resized and flipped: "
               "host = those threads; device = the GPU (Pillow's filter, the same pixels), the "
               "threads then only decode; auto = device on GPUs"),
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
      VG_FIELD(precision, mode, "fp32|tf32|bf16|fp16|fp16-naive|fp8",
               "compute precision (fp32 master weights in every mode); fp16 and fp16-naive "
               "(Colossal-AI NAIVE: every activation fp16) both keep activations in fp16 with "
               "dynamic loss scaling and compute the same; fp8: bf16 with the block Linears' "
               "GEMMs in FP8 (E4M3 activations and weights, E5M2 gradients, Transformer "
               "Engine's hybrid recipe with delayed scaling; GPUs with FP8 tensor cores, "
               "emulated exactly on the CPU; tensor mode none or 1d)"),
      VG_FIELD(precision, fp8_amax_history, "",
               "fp8: steps of amax history a scale is taken from (Transformer Engine's "
               "amax_history_len)"),
      VG_FIELD(precision, fp8_margin, "", "fp8: scale = fp8 max / 2^margin / amax (>= 0)"),
      VG_FIELD(precision, fp8_amax_compute, "max|most_recent",
               "fp8: the amax a scale is taken from: the history's maximum, or the last step's"),
      VG_FIELD(precision, fp8_fast_accum, "",
               "fp8 on GPUs: the forward's GEMMs (E4M3 x E4M3) accumulate in the tensor cores "
               "alone (cuBLASLt's FAST_ACCUM, as Transformer Engine's and torchao's forward "
               "GEMMs do), not promoted to fp32 every few steps of K; the gradients' GEMMs "
               "promote (but see fp8_fast_accum_dgrad). The CPU's emulation sums exactly "
               "either way"),
      VG_FIELD(precision, fp8_fast_accum_dgrad, "",
               "fp8 on GPUs: the data gradients' GEMMs (dx = dy W, E5M2 x E4M3, K = the "
               "Linear's output width) accumulate in the tensor cores alone as well; off in "
               "Transformer Engine's and torchao's recipes. The weight gradients' GEMMs (K = "
               "the tokens of the micro-batch) always promote"),
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
      VG_FIELD(checkpoint, async, "auto|true|false",
               "true: the state is copied to page-locked host memory and a background thread "
               "writes the file while training goes on (one write in flight; the last "
               "checkpoint and a preemption's wait for theirs); auto: true on the CUDA backend"),
      VG_FIELD(checkpoint, direct_io, "",
               "true: rank 0 lays the file out (serial HDF5) and each rank writes its tensors' "
               "bytes at their offsets with O_DIRECT (no page cache; a tensor split along its "
               "columns stored in chunks of one rank's block, so each part is one write) and "
               "fsyncs; false: HDF5's collective writes, every tensor contiguous"),
      VG_FIELD(checkpoint, direct_threads, "",
               "with direct_io: threads per rank writing its tensors' bytes, each with one 8 MiB "
               "request in flight; they start once rank 0 has laid the file out and run beside "
               "the checksums"),
      // [device]
      VG_FIELD(device, backend, "auto|cuda|cpu",
               "compute backend (auto: cuda when a GPU is present)"),
      VG_FIELD(
          device, comm_timeout, "",
          "seconds a rank may wait in one collective or message (MPI on the host, NCCL on GPUs) "
          "before the watchdog names it and ends the job: a rank that stopped responding (a frozen "
          "process, a lost node) never leaves the others waiting for good"),
      VG_FIELD(device, gemm_tune, "0..16",
               "time this many cuBLASLt algorithms per GEMM shape at its first use and keep the "
               "fastest; the data axis's ranks choose together, on the slowest rank's timings (0: "
               "the heuristic's choice, bit-reproducible runs)"),
      VG_FIELD(device, data_comm_ctas, "0..64",
               "thread blocks (SMs) the data-parallel gradient reduction's NCCL kernels may take "
               "from the backward they overlap (0: NCCL's choice)"),
      VG_FIELD(device, pipe_comm_ctas, "0..64",
               "thread blocks (SMs) each asynchronous pipeline message's NCCL kernel may take (the "
               "placement used where the grouped one cannot run the schedule at its bubble: "
               "interleaved, unless parallel.micro_batches equals parallel.pipeline); its receive "
               "waits on them beside the compute, and the GEMMs leave 4 x this many SMs free (0: "
               "NCCL's choice, the GEMMs leave 8)"),
      VG_FIELD(device, tensor_comm_ctas, "0..64",
               "with device.tensor_comm = sm: thread blocks (SMs) of 1d sequence parallelism's "
               "overlapped collectives over the tensor axis (each Column Linear's input gathered "
               "beside its data-gradient GEMM and its gradient reduce-scattered beside the "
               "weight-gradient GEMM; the gathers of the forward and of the Row Linears' output "
               "gradients beside the GEMMs of this rank's own rows); the GEMMs meanwhile leave as "
               "many SMs free (0: NCCL's choice, the GEMMs leave 8)"),
      VG_FIELD(
          device, tensor_comm, "sm|copy_engine",
          "how 1d sequence parallelism's overlapped collectives move data on GPUs: NCCL's kernels "
          "on SMs (sm, device.tensor_comm_ctas), or copy engines (copy_engine: their buffers NCCL "
          "symmetric memory, each gather an in-place all-gather, each reduce-scatter with tensor = "
          "2 an exchange of the peer's rows' partial sums and an add, else an all-to-all and a "
          "local sum, under NCCL's zero-CTA policy: no SMs taken from the GEMMs beside them)"),
      VG_FIELD(device, data_comm, "auto|sm|copy_engine",
               "how the data-parallel gradient reduction moves data on GPUs: NCCL's kernels on SMs "
               "(sm), or copy engines (copy_engine: the gradients in NCCL symmetric memory, an "
               "all-to-all, a local sum and an all-gather under NCCL's zero-CTA policy; fp32 sums; "
               "set gemm_sm_margin = 0 with it); auto: copy_engine where it was measured fastest "
               "(data parallelism alone, every rank on one node, fp32 sums, no ZeRO, "
               "data_comm_ctas and gemm_sm_margin 0), else sm"),
      VG_FIELD(device, gemm_sm_margin, "0..64",
               "SMs the GEMMs leave free while gradient buckets are reduced during the backward, "
               "for the reduction's kernels (0: none; cuBLASLt's SM count target)"),
      VG_FIELD(device, deterministic, "",
               "bit-identical reruns; false lets cuDNN's attention backward accumulate with "
               "atomics (faster, last-bit differences run to run)"),
      VG_FIELD(device, cuda_graph, "",
               "capture each micro-batch's forward, backward, reductions and gradient norm as a "
               "CUDA graph and replay it (single pipeline stage; same results as eager)"),
      VG_FIELD(device, bucket_mb, "",
               "MiB of fp32 gradients per data-parallel reduction bucket, each reduced during the "
               "backward once complete (the buckets set the reduction's order, so the last bits of "
               "the sums; 0: one reduction after the backward)"),
      VG_FIELD(device, attention, "auto|cudnn|flash|fallback|cudnn_forward",
               "attention on GPUs: cuDNN's fused SDPA (cudnn: needs a build with cudnn_frontend), "
               "vitgrid's own flash kernels, or the materialised cuBLASLt + softmax path; auto "
               "takes flash where one CTA holds a whole head (head dim 64, at most 224 tokens: "
               "faster than cuDNN there), else cuDNN where the build has it and cuDNN accepts "
               "the shape, else flash, else the fallback (fp32 and other head dims always take "
               "the fallback); cudnn_forward: cuDNN's forward where it accepts the shape, the "
               "backward as auto's (both save the same log-sum-exp)"),
      VG_FIELD(device, fused_gelu, "auto|off|on",
               "fc1's forward and fc2's data gradient as CUTLASS GEMMs with exact-GELU epilogues "
               "(sm_90, bf16/fp16): auto takes per shape the fastest of the unfused path and the "
               "fused configurations, timed when device.gemm_tune > 1, else unfused; on always "
               "fuses (timed likewise, else configuration 0); off never"),
      VG_FIELD(device, fused_gelu_forward_config, "",
               "with device.fused_gelu = auto or on: the fused forward's configuration id, untimed "
               "(-1: chosen as device.fused_gelu says)"),
      VG_FIELD(device, fused_gelu_backward_config, "",
               "with device.fused_gelu = auto or on: the fused backward's configuration id, "
               "untimed (-1: chosen as device.fused_gelu says)"),
      VG_FIELD(
          device, tuning_log, "",
          "print each tuned choice to stderr: with device.gemm_tune > 1 each GEMM shape's cuBLASLt "
          "algorithm (its time, the heuristic's first candidate's, and with data parallelism this "
          "rank's own pick where it differs), and each fused-GELU decision with its timings"),
      VG_FIELD(device, nccl_blocking, "",
               "every NCCL call waits for completion on the host (debugging; normally calls return "
               "once enqueued and a watchdog thread follows them)"),
  };
  return fields;
}
#undef VG_FIELD

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

}  // namespace deck_detail

using namespace deck_detail;

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
