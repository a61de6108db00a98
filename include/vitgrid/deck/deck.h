// The input deck: an INI file ([section] then key = value) parsed with Boost.ProgramOptions,
// with --section.key=value overrides on the command line (the command line wins). The schema in
// deck.cpp is the one place every key is declared, typed, defaulted and documented; help-deck
// and the README table are generated from it. Validation refuses bad decks before any work.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace vitgrid {

struct RunSection {
  std::string out_dir = "runs/default";
  uint64_t seed = 42;
  int64_t steps = 0;   // optimizer steps; 0 = use epochs
  double epochs = 0;   // alternative to steps (steps = ceil(epochs * train_size / global_batch))
  int log_every = 10;
  int eval_every = 0;  // optimizer steps between evals (0 = only at the end)
  int64_t eval_samples = 0;  // 0 = the whole eval split
};

struct ModelSection {
  std::string preset = "vit-lite-7/4";
  int image_size = 32;
  int patch_size = 4;
  int channels = 3;  // fixed at 3 for now (RGB), validated
  int hidden = 256;
  int depth = 7;
  int heads = 4;
  double mlp_ratio = 2.0;
  int num_classes = 10;
  double dropout = 0.0;  // pos / proj / mlp dropout (timm drop_rate and proj_drop)
  double drop_path = 0.0;  // stochastic depth of the last block (timm drop_path_rate)
  std::string gelu = "exact";  // exact | tanh
  bool checkpoint_activations = false;
  int checkpoint_blocks = -1;  // blocks recomputed per pipeline chunk (-1: all)
  bool keep_gelu_output = false;  // keep each block's GELU output instead of recomputing it
  int mlp_hidden() const { return static_cast<int>(hidden * mlp_ratio + 0.5); }
  int tokens() const { return (image_size / patch_size) * (image_size / patch_size) + 1; }
};

struct ParallelSection {
  int pipeline = 1;
  int tensor = 1;
  std::string tensor_mode = "1d";  // 1d | 2d | 2.5d | 3d (ignored when tensor = 1)
  int tensor_depth = 1;            // 2.5d depth
  bool sequence_parallel = false;  // 1d: the residual stream's samples split over tensor ranks
  int sequence_chunks = 2;         // ... its overlapped collectives in this many row chunks
  int micro_batches = 1;           // pipeline micro-batches
  std::string schedule = "1f1b";   // gpipe | 1f1b | interleaved
  int chunks = 1;                  // interleaved model chunks per stage
  std::string partition = "uniform";  // uniform | balanced | list:n0,n1,...
  int zero = 0;                    // 0 | 1 (optimizer state sharded over data)
  std::string grad_reduce = "fp32";  // fp32 | act: the data axis's gradient sums on the wire
  std::string zero_gather = "forward";  // forward | step: when ZeRO-1 gathers the 16-bit copy
  int data = 0;                    // derived: world / (pipeline * tensor); 0 in the deck = derive
};

struct DataSection {
  // raw images: synthetic | cifar10 | hdf5; encoded images (JPEG): tfrecord | folder | jpeg_h5
  std::string dataset = "synthetic";
  std::string path;                   // directory (cifar10, tfrecord, folder) or file (hdf5, jpeg_h5)
  std::string eval_path;              // hdf5 / jpeg_h5 eval file (optional; default: path's eval split)
  int64_t global_batch = 128;
  int grad_accum = 1;
  int64_t synthetic_train = 4096;  // synthetic train split size
  int64_t synthetic_eval = 1024;
  int crop_padding = 4;  // random crop with this zero padding (0 = off; raw images only)
  bool hflip = true;
  std::vector<float> mean = {0.4914f, 0.4822f, 0.4465f};
  std::vector<float> std = {0.2470f, 0.2435f, 0.2616f};
  double mixup_alpha = 0.0;     // 0 = off
  double cutmix_alpha = 0.0;    // 0 = off
  double mixup_prob = 1.0;      // probability that a unit is mixed at all
  double mixup_switch_prob = 0.5;  // with both alphas: probability of CutMix
  std::string mixup_mode = "batch";  // batch | pair | elem
  double label_smoothing = 0.0;
  int prefetch = 2;             // batches prepared ahead by the background thread
  int workers = 0;              // threads reading a batch's samples (0 = auto: cores per rank, <= 8)
  // encoded images
  static constexpr int kLabelOffsetAuto = -1000000;
  int label_offset = kLabelOffsetAuto;  // added to stored labels; auto: -1 tfrecord, else 0
  double eval_fraction = 0.0;   // folder without train/ and val/: held-out share per class
  std::string index_dir;        // tfrecord indexes written here (default: RUN_DIR/tfrecord-index)
  std::vector<float> rrc_scale = {0.08f, 1.0f};        // RandomResizedCrop area range
  std::vector<float> rrc_ratio = {0.75f, 1.3333333f};  // RandomResizedCrop aspect range
  std::string interpolation = "bicubic";  // bilinear | bicubic
  double crop_pct = 0.875;      // eval: resize the short side to image_size / crop_pct, centre crop
  bool dct_scale = true;        // CPU decoding: DCT-domain downscaling of crops >= 2x the output
  std::string decode = "auto";  // auto | host | device: where JPEGs are decoded
  double device_share = 1.0;    // with a device decoder: share of the JPEGs it is given
  std::string resize = "auto";  // auto | host | device: where host-decoded JPEGs are resized
};

struct OptimSection {
  std::string name = "adamw";  // adamw | lamb | sgd
  double lr = 1e-3;
  double min_lr = 0.0;
  double weight_decay = 0.05;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double momentum = 0.9;  // sgd
  bool nesterov = false;
  int64_t warmup_steps = 0;
  double warmup_epochs = 0;  // alternative, converted to steps
  std::string schedule = "cosine";  // cosine | linear | constant
  double clip_grad_norm = 0.0;      // 0 = off
  bool decay_norm_and_bias = false;  // weight decay on biases, norms, cls, pos (timm: off)
};

struct PrecisionSection {
  std::string mode = "fp32";  // fp32 | tf32 | bf16 | fp16 | fp16-naive | fp8
  double initial_scale = 65536.0;
  int growth_interval = 1000;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  // fp8: Transformer Engine's delayed scaling (model/fp8_scaling.h)
  int fp8_amax_history = 1024;
  int fp8_margin = 0;
  std::string fp8_amax_compute = "max";  // max | most_recent
  bool fp8_fast_accum = true;  // the forward's FP8 GEMMs without promoted accumulation
  bool fp8_fast_accum_dgrad = false;  // the data gradients' FP8 GEMMs the same
};

struct CheckpointSection {
  int64_t every_steps = 0;  // 0 = only at the end
  std::string resume = "none";  // none | auto
  std::string load;             // a checkpoint file to start from (eval/predict/fine-tune)
  int keep = 0;                 // keep the newest K (0 = all)
  // auto | true | false: written by a background thread from a host copy while training goes
  // on (auto: on the CUDA backend)
  std::string async = "auto";
  // the tensors' bytes written past HDF5 with O_DIRECT once it has laid out the file
  bool direct_io = true;
  // direct_io: threads per rank writing those bytes (requests in flight)
  int direct_threads = 4;
};

struct DeviceSection {
  std::string backend = "auto";  // auto | cuda | cpu
  double comm_timeout = 600.0;   // seconds a rank may wait in one collective (the watchdog)
  int gemm_tune = 0;             // cuBLASLt candidates timed per GEMM shape (0/1: heuristic)
  bool deterministic = true;     // false: attention backward with atomics (cuDNN)
  int data_comm_ctas = 0;        // NCCL thread blocks of the data axis (0: NCCL's choice)
  int pipe_comm_ctas = 0;        // NCCL thread blocks of each asynchronous pipeline link (0: NCCL's)
  int tensor_comm_ctas = 0;      // NCCL thread blocks of sequence parallelism's overlapped ones
  std::string tensor_comm = "copy_engine";  // sm | copy_engine: how those move data
  // auto | sm | copy_engine: how the data axis's reductions move data (auto: copy engines for
  // data parallelism alone on one node, else sm)
  std::string data_comm = "auto";
  int gemm_sm_margin = 0;        // SMs the GEMMs leave free while buckets are reduced
  bool cuda_graph = true;        // replay the step's micro-batches as CUDA graphs (see trainer)
  double bucket_mb = 25.0;       // MiB of fp32 gradients per data-parallel bucket (0: no overlap)
  std::string attention = "auto";   // auto | cudnn | flash | fallback | cudnn_forward: attention's path on GPUs
  std::string fused_gelu = "auto";  // auto | off | on: fc1 / fc2 GEMMs with GELU epilogues
  int fused_gelu_forward_config = -1;   // forced fused-GELU configuration ids (-1: chosen)
  int fused_gelu_backward_config = -1;
  bool tuning_log = false;       // each tuned GEMM / fused-GELU choice to stderr
  bool nccl_blocking = false;    // every NCCL call waits on the host (debugging)
};

struct Deck {
  RunSection run;
  ModelSection model;
  ParallelSection parallel;
  DataSection data;
  OptimSection optim;
  PrecisionSection precision;
  CheckpointSection checkpoint;
  DeviceSection device;
  std::string source;  // the deck file path
  // The resolved deck as INI text (every key, final values), printed at start and stored in
  // every output file; parsing it again yields the same Deck.
  std::string resolved_text() const;
};

// Upper bounds of the deck's sizes: a larger value can only be a typo, and the bounds keep
// every size derived from them (tokens, parameters, activation and batch bytes) from
// overflowing. Sizes derived from several keys are checked against kMaxRankBytes (per rank)
// and the kernels' 32-bit row counts.
constexpr int kMaxImageSize = 8192;                  // model.image_size, pixels
constexpr int kMaxHidden = 65536;                    // model.hidden
constexpr int kMaxDepth = 1024;                      // model.depth
constexpr double kMaxMlpRatio = 64;                  // model.mlp_ratio
constexpr int kMaxClasses = 1 << 24;                 // model.num_classes
constexpr int64_t kMaxGlobalBatch = 1 << 24;         // data.global_batch, grad_accum, micro_batches
constexpr int64_t kMaxSyntheticSamples = 1 << 30;    // data.synthetic_train / synthetic_eval
constexpr int kMaxPrefetch = 64;                     // data.prefetch, batches
constexpr int kMaxWorkers = 256;                     // data.workers, threads
constexpr double kMaxEpochs = 1e6;                   // run.epochs, optim.warmup_epochs
constexpr int64_t kMaxRankBytes = int64_t(1) << 50;  // 1 PiB: no machine holds more per rank

// Parses `deck_path` then `overrides` (each "--section.key=value"), applies the model preset
// (keys set in the deck or on the command line win over the preset), derives parallel.data
// from world_size and checks every rule. Throws UserError with one message naming the key and
// where it came from ("deck.ini:12" or "command line"). Pure: no MPI, no file writes.
Deck parse_deck(const std::string& deck_path, const std::vector<std::string>& overrides,
                int world_size);
// Same from INI text (tests). A leading UTF-8 byte-order mark is skipped.
Deck parse_deck_text(const std::string& text, const std::vector<std::string>& overrides,
                     int world_size, const std::string& source_name = "deck");
// The deck file's text. Throws UserError naming the file when it cannot be opened or read, is
// a directory, is not a regular file (a FIFO would block every rank forever) or is larger than
// kMaxDeckBytes.
std::string read_deck_file(const std::string& deck_path);
constexpr long long kMaxDeckBytes = 16ll << 20;
// "a FIFO", "a directory", "a character device", ... for an st_mode (messages).
std::string file_type_name(unsigned mode);

// Checks that touch the file system (dataset paths exist and are regular files, out_dir holds
// no other run unless resuming). With writes_out_dir (train, predict), run.out_dir is created if
// missing and must accept a new file (a probe file is created and removed). Throws UserError.
// Called on every rank by the app, which agrees on the verdict; it probes run.out_dir on one
// rank only (writes_out_dir false elsewhere).
void check_deck_paths(const Deck& d, bool training, bool writes_out_dir);
inline void check_deck_paths(const Deck& d, bool training) {
  check_deck_paths(d, training, training);
}

// Markdown table of every key: section, key, type, default, meaning.
std::string deck_reference();

struct ModelPreset {
  int image_size, patch_size, hidden, depth, heads;
  double mlp_ratio;
  int num_classes;
};
// "vit-tiny/16", "vit-small/16", "vit-base/16", "vit-base/32", "vit-large/16", "vit-large/32",
// "vit-lite-7/4", "vit-huge-4096"
// (the hybrid-parallel guide's large ViT), "custom" (no preset).
const std::map<std::string, ModelPreset>& model_presets();

}  // namespace vitgrid
