// The input deck: parsing, presets, overrides, the resolved round trip, and one test per
// refusal, each checking that the message names the key and where it came from.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "vitgrid/core/error.h"
#include "vitgrid/deck/deck.h"

namespace vitgrid {
namespace {

namespace fs = std::filesystem;

// The message of the UserError the deck raises, or "<accepted>".
std::string refusal(const std::string& text, const std::vector<std::string>& overrides = {},
                    int world = 1) {
  try {
    parse_deck_text(text, overrides, world, "deck.ini");
  } catch (const UserError& e) {
    return e.what();
  }
  return "<accepted>";
}

#define EXPECT_HAS(haystack, needle)                              \
  do {                                                            \
    const std::string vg_h_ = (haystack);                         \
    EXPECT_NE(vg_h_.find(needle), std::string::npos)              \
        << "expected to find '" << (needle) << "' in: " << vg_h_; \
  } while (0)

const char* kMinimal = "[run]\nsteps = 10\n";

const char* kFull = R"(# a complete deck
[run]
out_dir = runs/full   # trailing comment
seed = 7
steps = 500
log_every = 5
eval_every = 100
eval_samples = 2000

[model]
preset = custom
image_size = 64
patch_size = 8
hidden = 192
depth = 6
heads = 6
mlp_ratio = 3.0
num_classes = 100
dropout = 0.1
gelu = tanh
checkpoint_activations = yes

[parallel]
pipeline = 2
tensor = 2
tensor_mode = 1d
micro_batches = 4
schedule = gpipe
partition = list:2,4
zero = 1

[data]
dataset = cifar10
path = /data/cifar-10-batches-bin
global_batch = 256
grad_accum = 2
crop_padding = 0
hflip = off
mean = 0.5, 0.5, 0.5
std = 0.25,0.25 , 0.25
mixup_alpha = 0.8
label_smoothing = 0.1
prefetch = 3

[optim]
name = lamb
lr = 2e-3
min_lr = 1e-5
weight_decay = 0.1
beta1 = 0.85
beta2 = 0.98
eps = 1e-6
warmup_steps = 50
schedule = linear
clip_grad_norm = 1.0
decay_norm_and_bias = TRUE

[precision]
mode = bf16
initial_scale = 1024
growth_interval = 200

[checkpoint]
every_steps = 100
resume = auto
keep = 3

[device]
backend = cpu
)";

TEST(Deck, ParsesFullDeck) {
  Deck d = parse_deck_text(kFull, {}, 8, "full.ini");
  EXPECT_EQ(d.source, "full.ini");
  EXPECT_EQ(d.run.out_dir, "runs/full");
  EXPECT_EQ(d.run.seed, 7u);
  EXPECT_EQ(d.run.steps, 500);
  EXPECT_EQ(d.run.log_every, 5);
  EXPECT_EQ(d.run.eval_every, 100);
  EXPECT_EQ(d.run.eval_samples, 2000);
  EXPECT_EQ(d.model.preset, "custom");
  EXPECT_EQ(d.model.image_size, 64);
  EXPECT_EQ(d.model.patch_size, 8);
  EXPECT_EQ(d.model.hidden, 192);
  EXPECT_EQ(d.model.depth, 6);
  EXPECT_EQ(d.model.heads, 6);
  EXPECT_DOUBLE_EQ(d.model.mlp_ratio, 3.0);
  EXPECT_EQ(d.model.mlp_hidden(), 576);
  EXPECT_EQ(d.model.tokens(), 65);
  EXPECT_EQ(d.model.num_classes, 100);
  EXPECT_DOUBLE_EQ(d.model.dropout, 0.1);
  EXPECT_EQ(d.model.gelu, "tanh");
  EXPECT_TRUE(d.model.checkpoint_activations);
  EXPECT_EQ(d.parallel.pipeline, 2);
  EXPECT_EQ(d.parallel.tensor, 2);
  EXPECT_EQ(d.parallel.data, 2);  // derived: 8 / (2 * 2)
  EXPECT_EQ(d.parallel.micro_batches, 4);
  EXPECT_EQ(d.parallel.schedule, "gpipe");
  EXPECT_EQ(d.parallel.partition, "list:2,4");
  EXPECT_EQ(d.parallel.zero, 1);
  EXPECT_EQ(d.data.dataset, "cifar10");
  EXPECT_EQ(d.data.path, "/data/cifar-10-batches-bin");
  EXPECT_EQ(d.data.global_batch, 256);
  EXPECT_EQ(d.data.grad_accum, 2);
  EXPECT_EQ(d.data.crop_padding, 0);
  EXPECT_FALSE(d.data.hflip);
  EXPECT_EQ(d.data.mean, (std::vector<float>{0.5f, 0.5f, 0.5f}));
  EXPECT_EQ(d.data.std, (std::vector<float>{0.25f, 0.25f, 0.25f}));
  EXPECT_DOUBLE_EQ(d.data.mixup_alpha, 0.8);
  EXPECT_DOUBLE_EQ(d.data.label_smoothing, 0.1);
  EXPECT_EQ(d.data.prefetch, 3);
  EXPECT_EQ(d.optim.name, "lamb");
  EXPECT_DOUBLE_EQ(d.optim.lr, 2e-3);
  EXPECT_DOUBLE_EQ(d.optim.min_lr, 1e-5);
  EXPECT_DOUBLE_EQ(d.optim.beta1, 0.85);
  EXPECT_DOUBLE_EQ(d.optim.beta2, 0.98);
  EXPECT_DOUBLE_EQ(d.optim.eps, 1e-6);
  EXPECT_EQ(d.optim.warmup_steps, 50);
  EXPECT_EQ(d.optim.schedule, "linear");
  EXPECT_DOUBLE_EQ(d.optim.clip_grad_norm, 1.0);
  EXPECT_TRUE(d.optim.decay_norm_and_bias);
  EXPECT_EQ(d.precision.mode, "bf16");
  EXPECT_DOUBLE_EQ(d.precision.initial_scale, 1024);
  EXPECT_EQ(d.precision.growth_interval, 200);
  EXPECT_EQ(d.checkpoint.every_steps, 100);
  EXPECT_EQ(d.checkpoint.resume, "auto");
  EXPECT_EQ(d.checkpoint.keep, 3);
  EXPECT_EQ(d.device.backend, "cpu");
}

TEST(Deck, DefaultsNeedOnlyALength) {
  Deck d = parse_deck_text(kMinimal, {}, 1);
  const Deck defaults;
  EXPECT_EQ(d.model.preset, "vit-lite-7/4");
  EXPECT_EQ(d.model.hidden, 256);
  EXPECT_EQ(d.model.depth, 7);
  EXPECT_EQ(d.parallel.data, 1);
  EXPECT_EQ(d.data.global_batch, defaults.data.global_batch);
  EXPECT_EQ(d.data.mean, defaults.data.mean);
  EXPECT_EQ(d.optim.name, "adamw");
  EXPECT_EQ(d.source, "deck");
}

TEST(Deck, ParsesDeckFile) {
  const fs::path p = fs::temp_directory_path() / ("vg_deck_" + std::to_string(getpid()) + ".ini");
  { std::ofstream(p) << "[run]\nsteps = 3\n[model]\nhidden = abc\n"; }
  try {
    parse_deck(p.string(), {}, 1);
    ADD_FAILURE() << "accepted a bad deck";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()),
              p.string() + ":4: model.hidden: expected an integer, got 'abc'");
  }
  { std::ofstream(p) << "[run]\nsteps = 3\n"; }
  EXPECT_EQ(parse_deck(p.string(), {}, 1).run.steps, 3);
  fs::remove(p);
  try {
    parse_deck(p.string(), {}, 1);
    ADD_FAILURE() << "accepted a missing deck";
  } catch (const UserError& e) {
    EXPECT_HAS(e.what(), p.string());
  }
}

TEST(Deck, PresetFillsModelKeys) {
  Deck d = parse_deck_text("[run]\nsteps = 1\n[model]\npreset = vit-base/16\n", {}, 1);
  EXPECT_EQ(d.model.image_size, 224);
  EXPECT_EQ(d.model.patch_size, 16);
  EXPECT_EQ(d.model.hidden, 768);
  EXPECT_EQ(d.model.depth, 12);
  EXPECT_EQ(d.model.heads, 12);
  EXPECT_DOUBLE_EQ(d.model.mlp_ratio, 4.0);
  EXPECT_EQ(d.model.num_classes, 1000);

  // Every preset parses and matches the table.
  for (const auto& kv : model_presets()) {
    if (kv.first == "custom") continue;
    Deck p = parse_deck_text(kMinimal, {"--model.preset=" + kv.first}, 1);
    EXPECT_EQ(p.model.hidden, kv.second.hidden) << kv.first;
    EXPECT_EQ(p.model.depth, kv.second.depth) << kv.first;
    EXPECT_EQ(p.model.heads, kv.second.heads) << kv.first;
    EXPECT_EQ(p.model.num_classes, kv.second.num_classes) << kv.first;
  }
  const ModelPreset& huge = model_presets().at("vit-huge-4096");
  EXPECT_EQ(huge.hidden, 4096);
  EXPECT_EQ(huge.depth, 32);
  EXPECT_EQ(huge.heads, 64);
  const ModelPreset& lite = model_presets().at("vit-lite-7/4");
  EXPECT_EQ(lite.image_size, 32);
  EXPECT_EQ(lite.patch_size, 4);
  EXPECT_DOUBLE_EQ(lite.mlp_ratio, 2.0);
}

TEST(Deck, ExplicitModelKeysBeatPreset) {
  // deck key beats the preset, command-line key beats it too, the rest come from the preset
  Deck d = parse_deck_text(
      "[run]\nsteps = 1\n[model]\npreset = vit-small/16\nhidden = 192\n"
      "heads = 3\n",
      {"--model.depth=4", "--model.num_classes=10"}, 1);
  EXPECT_EQ(d.model.hidden, 192);
  EXPECT_EQ(d.model.heads, 3);
  EXPECT_EQ(d.model.depth, 4);
  EXPECT_EQ(d.model.num_classes, 10);
  EXPECT_EQ(d.model.image_size, 224);
  EXPECT_DOUBLE_EQ(d.model.mlp_ratio, 4.0);
  // the preset itself from the command line, the deck's explicit key still wins
  Deck e = parse_deck_text("[run]\nsteps = 1\n[model]\nhidden = 96\nheads = 3\n",
                           {"--model.preset=vit-tiny/16"}, 1);
  EXPECT_EQ(e.model.preset, "vit-tiny/16");
  EXPECT_EQ(e.model.hidden, 96);
  EXPECT_EQ(e.model.depth, 12);
  // custom applies nothing
  Deck c = parse_deck_text("[run]\nsteps = 1\n[model]\npreset = custom\nhidden = 64\n", {}, 1);
  EXPECT_EQ(c.model.hidden, 64);
  EXPECT_EQ(c.model.depth, Deck().model.depth);
}

TEST(Deck, CommandLineBeatsDeck) {
  const char* text = "[run]\nsteps = 10\nseed = 1\n[optim]\nlr = 0.1\nname = sgd\n";
  Deck d = parse_deck_text(text, {"--run.seed=99", "--optim.lr", "0.5", "--run.steps=20"}, 1);
  EXPECT_EQ(d.run.seed, 99u);
  EXPECT_DOUBLE_EQ(d.optim.lr, 0.5);
  EXPECT_EQ(d.run.steps, 20);
  EXPECT_EQ(d.optim.name, "sgd");  // untouched deck value stays
  // an empty string value is allowed and clears a path
  Deck e =
      parse_deck_text("[run]\nsteps = 1\n[checkpoint]\nload = x.h5\n", {"--checkpoint.load="}, 1);
  EXPECT_EQ(e.checkpoint.load, "");
}

TEST(Deck, ResolvedTextRoundTrips) {
  for (int world : {1, 8}) {
    const std::string text = world == 1 ? std::string(kMinimal) : std::string(kFull);
    Deck d = parse_deck_text(text, {"--optim.weight_decay=0.3", "--data.std=0.2,0.3,0.4"}, world,
                             "orig.ini");
    const std::string r1 = d.resolved_text();
    Deck again = parse_deck_text(r1, {}, world, "orig.ini");
    EXPECT_EQ(again.resolved_text(), r1);
    EXPECT_DOUBLE_EQ(again.optim.weight_decay, 0.3);
    EXPECT_EQ(again.data.std, (std::vector<float>{0.2f, 0.3f, 0.4f}));
    EXPECT_EQ(again.parallel.data, d.parallel.data);
    EXPECT_EQ(again.model.hidden, d.model.hidden);
    EXPECT_HAS(r1, "# source: orig.ini");
    EXPECT_HAS(r1, "[precision]\nmode = ");
    EXPECT_HAS(r1, "weight_decay = 0.3\n");
  }
  // every section in the fixed order
  const std::string r = parse_deck_text(kMinimal, {}, 1).resolved_text();
  size_t last = 0;
  for (const char* s : {"[run]", "[model]", "[parallel]", "[data]", "[optim]", "[precision]",
                        "[checkpoint]", "[device]"}) {
    size_t at = r.find(s);
    ASSERT_NE(at, std::string::npos) << s;
    EXPECT_GT(at, last) << s;
    last = at;
  }
}

TEST(Deck, ReferenceListsEveryKey) {
  const std::string ref = deck_reference();
  EXPECT_EQ(ref.rfind("| section | key | type | default | meaning |", 0), 0u);
  // every key the resolved deck writes is in the table
  const std::string r = parse_deck_text(kMinimal, {}, 1).resolved_text();
  std::string section;
  size_t rows = 0, start = 0;
  while (start < r.size()) {
    size_t nl = r.find('\n', start);
    std::string line = r.substr(start, nl - start);
    start = nl + 1;
    if (line.empty() || line[0] == '#') continue;
    if (line[0] == '[') {
      section = line.substr(1, line.size() - 2);
      continue;
    }
    const std::string key = line.substr(0, line.find(' '));
    EXPECT_HAS(ref, "| " + section + " | " + key + " |");
    ++rows;
  }
  EXPECT_GT(rows, 60u);
  EXPECT_HAS(ref, "fp32\\|tf32\\|bf16\\|fp16\\|fp16-naive\\|fp8");
  EXPECT_HAS(ref, "`vit-lite-7/4`");
}

// ---- refusals: syntax, keys, values

TEST(DeckRefusal, UnknownKeyInDeckNamesLine) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\nhiden = 3\n"),
            "deck.ini:4: unknown key 'model.hiden'");
}

TEST(DeckRefusal, UnknownKeyOnCommandLine) {
  EXPECT_EQ(refusal(kMinimal, {"--model.hiden=3"}), "command line: unknown key 'model.hiden'");
  // no prefix guessing: a truncated key is unknown, not a silent match
  EXPECT_EQ(refusal(kMinimal, {"--model.hid=3"}), "command line: unknown key 'model.hid'");
  EXPECT_HAS(refusal(kMinimal, {"model.hidden=3"}), "command line: expected --section.key=value");
  EXPECT_HAS(refusal(kMinimal, {"--model.hidden"}), "command line: model.hidden: missing value");
  EXPECT_HAS(refusal(kMinimal, {"--run.seed=1", "--run.seed=2"}), "run.seed: given twice");
  EXPECT_HAS(refusal(kMinimal, {"--data.path=a#b"}), "data.path: '#'");
}

TEST(DeckRefusal, DuplicateKeyNamesBothLines) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n\n[run]\nsteps = 2\n"),
            "deck.ini:5: run.steps: given twice (first at line 2)");
}

TEST(DeckRefusal, SyntaxErrors) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[modle]\n"), "deck.ini:3: unknown section [modle]");
  EXPECT_HAS(refusal("[run]\nsteps 1\n"), "deck.ini:2: expected 'key = value'");
  EXPECT_HAS(refusal("steps = 1\n"), "deck.ini:1: key 'steps' outside any [section]");
  EXPECT_HAS(refusal("[run\nsteps = 1\n"), "deck.ini:1: malformed section header");
}

TEST(DeckRefusal, BadIntegerNamesKeyAndLine) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\n\n\n\n\n\n\n\n\nhidden = abc\n"),
            "deck.ini:12: model.hidden: expected an integer, got 'abc'");
  EXPECT_EQ(refusal(kMinimal, {"--model.depth=1.5"}),
            "command line: model.depth: expected an integer, got '1.5'");
  EXPECT_EQ(refusal("[run]\nsteps = 1\nseed = -4\n"),
            "deck.ini:3: run.seed: expected a non-negative integer, got '-4'");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\nhidden = 99999999999\n"),
            "deck.ini:4: model.hidden: expected an integer, got '99999999999'");
}

TEST(DeckRefusal, BadNumberAndBool) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[optim]\nlr = fast\n"),
            "deck.ini:4: optim.lr: expected a finite number, got 'fast'");
  EXPECT_HAS(refusal("[run]\nsteps = 1\n[optim]\nlr = nan\n"), "deck.ini:4: optim.lr");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[data]\nhflip = maybe\n"),
            "deck.ini:4: data.hflip: expected a boolean (true/false, 1/0, yes/no, on/off), got "
            "'maybe'");
}

TEST(DeckRefusal, NegativeSizes) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\ndepth = -2\n"),
            "deck.ini:4: model.depth: must be > 0, got -2");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\nhidden = 0\n"),
            "deck.ini:4: model.hidden: must be > 0, got 0");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[data]\nglobal_batch = -8\n"),
            "deck.ini:4: data.global_batch: must be > 0, got -8");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[parallel]\npipeline = 0\n"),
            "deck.ini:4: parallel.pipeline: must be > 0, got 0");
  EXPECT_EQ(refusal("[run]\nsteps = -1\n"), "deck.ini:2: run.steps: must be >= 0, got -1");
  EXPECT_HAS(refusal(kMinimal, {"--data.crop_padding=-1"}), "command line: data.crop_padding");
  EXPECT_HAS(refusal(kMinimal, {"--model.channels=1"}), "command line: model.channels: must be 3");
}

TEST(DeckRefusal, DeviceRanges) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[device]\ndata_comm_ctas = 65\n"),
            "deck.ini:4: device.data_comm_ctas: must be between 0 and 64 (0: NCCL's choice)");
  EXPECT_HAS(refusal(kMinimal, {"--device.data_comm_ctas=-1"}),
             "command line: device.data_comm_ctas: must be between 0 and 64");
  EXPECT_HAS(refusal(kMinimal, {"--device.gemm_tune=17"}),
             "command line: device.gemm_tune: must be between 0 and 16");
  EXPECT_HAS(refusal(kMinimal, {"--device.deterministic=maybe"}), "device.deterministic");
  EXPECT_HAS(refusal(kMinimal, {"--device.pipe_comm_ctas=65"}),
             "command line: device.pipe_comm_ctas: must be between 0 and 64");
  EXPECT_HAS(refusal(kMinimal, {"--device.tensor_comm_ctas=-2"}),
             "command line: device.tensor_comm_ctas: must be between 0 and 64");
  EXPECT_HAS(refusal(kMinimal, {"--device.gemm_sm_margin=65"}),
             "command line: device.gemm_sm_margin: must be between 0 and 64");
}

TEST(DeckRefusal, Fp8ScalingRangesAndTensorModes) {
  EXPECT_HAS(refusal(kMinimal, {"--precision.fp8_amax_history=0"}),
             "command line: precision.fp8_amax_history: must be > 0");
  EXPECT_HAS(refusal(kMinimal, {"--precision.fp8_margin=-1"}),
             "command line: precision.fp8_margin: must be >= 0");
  EXPECT_HAS(refusal(kMinimal, {"--precision.mode=fp8", "--parallel.tensor=8",
                                "--parallel.tensor_mode=3d"}, 8),
             "precision.mode: fp8 runs the Linears in tensor mode none or 1d");
}

TEST(DeckRefusal, GradReduceInActNeeds16BitAndNoZero) {
  EXPECT_HAS(refusal(kMinimal, {"--parallel.grad_reduce=act"}),
             "parallel.grad_reduce: act needs a 16-bit precision.mode (bf16, fp16, fp16-naive, "
             "fp8), got fp32");
  EXPECT_HAS(refusal(kMinimal, {"--parallel.grad_reduce=act", "--precision.mode=bf16",
                                "--parallel.zero=1"}),
             "parallel.grad_reduce: act is for all-reduced gradients");
  EXPECT_HAS(refusal(kMinimal, {"--parallel.grad_reduce=bf16"}), "parallel.grad_reduce");
  EXPECT_HAS(refusal(kMinimal, {"--device.data_comm=dma"}), "device.data_comm");
  EXPECT_HAS(refusal(kMinimal, {"--device.data_comm=copy_engine", "--parallel.grad_reduce=act",
                                "--precision.mode=bf16"}),
             "device.data_comm: copy_engine sums the gradients in fp32");
}

struct EnumCase {
  const char* section;
  const char* key;
  const char* bad;
  const char* choices;
};

TEST(DeckRefusal, EnumStringsAreValidated) {
  const EnumCase cases[] = {
      {"precision", "mode", "fp4", "fp32|tf32|bf16|fp16|fp16-naive|fp8"},
      {"precision", "fp8_amax_compute", "mean", "max|most_recent"},
      {"optim", "name", "adam", "adamw|lamb|sgd"},
      {"optim", "schedule", "step", "cosine|linear|constant"},
      {"data", "dataset", "imagenet", "synthetic|cifar10|hdf5|tfrecord|folder|jpeg_h5"},
      {"parallel", "tensor_mode", "4d", "1d|2d|2.5d|3d"},
      {"parallel", "schedule", "zb", "gpipe|1f1b|interleaved"},
      {"parallel", "partition", "even", "uniform|balanced|list:n0,n1,..."},
      {"checkpoint", "resume", "yes", "none|auto"},
      {"device", "backend", "rocm", "auto|cuda|cpu"},
      {"model", "gelu", "relu", "exact|tanh"},
  };
  for (const EnumCase& c : cases) {
    const std::string text =
        std::string("[run]\nsteps = 1\n[") + c.section + "]\n" + c.key + " = " + c.bad + "\n";
    EXPECT_EQ(refusal(text), std::string("deck.ini:4: ") + c.section + "." + c.key +
                                 ": expected one of " + c.choices + ", got '" + c.bad + "'");
  }
  // and every listed value is accepted
  for (const char* m : {"fp32", "tf32", "bf16", "fp16", "fp16-naive", "fp8"})
    EXPECT_EQ(parse_deck_text(kMinimal, {std::string("--precision.mode=") + m}, 1).precision.mode,
              m);
}

TEST(DeckRefusal, MeanAndStdLists) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[data]\nmean = 0.5, 0.5\n"),
            "deck.ini:4: data.mean: needs 3 comma-separated values (one per channel), got 2");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[data]\nstd = 0.2, 0, 0.2\n"),
            "deck.ini:4: data.std: entries must be > 0, got 0");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[data]\nmean = 0.5, x, 0.5\n"),
            "deck.ini:4: data.mean: expected comma-separated numbers, got '0.5, x, 0.5'");
}

TEST(DeckRefusal, UnknownPresetNamesLine) {
  const std::string m = refusal("[run]\nsteps = 1\n[model]\npreset = vit-giant\n");
  EXPECT_EQ(m.rfind("deck.ini:4: model.preset: unknown preset 'vit-giant' (known: ", 0), 0u) << m;
  EXPECT_HAS(m, "vit-huge-4096");
}

TEST(DeckRefusal, PresetValueErrorPointsAtPreset) {
  // vit-tiny/16 has 3 heads: not divisible by q = 2 of a 2d layout
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\npreset = vit-tiny/16\n[data]\nglobal_batch = 8\n",
                    {"--parallel.tensor=4", "--parallel.tensor_mode=2d"}, 4),
            "deck.ini:4 (from model.preset 'vit-tiny/16'): model.heads: 3 is not divisible by "
            "q = 2 of the 2d tensor layout");
}

// ---- refusals: run length

TEST(DeckRefusal, StepsAndEpochsBothOrNeither) {
  EXPECT_HAS(refusal("[run]\nsteps = 10\nepochs = 2\n"),
             "deck.ini:2: run.steps: run.steps (10) and run.epochs (2, deck.ini:3) are both set");
  EXPECT_EQ(refusal("[run]\nseed = 1\n"),
            "deck.ini (default value): run.steps: set run.steps or run.epochs to a positive value");
  EXPECT_EQ(parse_deck_text("[run]\nepochs = 1.5\n", {}, 1).run.epochs, 1.5);
}

TEST(DeckRefusal, EvalEveryAndKeepNonNegative) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\neval_every = -5\n"),
            "deck.ini:3: run.eval_every: must be >= 0, got -5");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[checkpoint]\nkeep = -1\n"),
            "deck.ini:4: checkpoint.keep: must be >= 0, got -1");
}

// ---- refusals: the grid

TEST(DeckRefusal, PipelineTimesTensorMustDivideWorld) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[parallel]\ntensor = 3\n", {}, 4),
            "deck.ini:4: parallel.tensor: 3 does not divide the world size (4 ranks)");
  EXPECT_HAS(refusal("[run]\nsteps = 1\n[parallel]\npipeline = 3\n", {}, 4),
             "deck.ini:4: parallel.pipeline: parallel.pipeline (3) x parallel.tensor (1) does not "
             "divide the world size (4 ranks)");
}

TEST(DeckRefusal, ExplicitDataMustMatchDerived) {
  EXPECT_EQ(parse_deck_text("[run]\nsteps = 1\n[parallel]\ndata = 4\n", {}, 4).parallel.data, 4);
  EXPECT_HAS(refusal("[run]\nsteps = 1\n[parallel]\ndata = 2\n", {}, 4),
             "deck.ini:4: parallel.data: is 2 but world (4) / (pipeline 1 x tensor 1) = 4");
}

TEST(DeckRefusal, TensorSizePerMode) {
  const char* base = "[run]\nsteps = 1\n[parallel]\n";
  EXPECT_HAS(refusal(std::string(base) + "tensor = 2\ntensor_mode = 2d\n", {}, 2),
             "deck.ini:4: parallel.tensor: 2 is not a square");
  EXPECT_HAS(refusal(std::string(base) + "tensor = 8\ntensor_mode = 3d\n", {}, 8), "<accepted>");
  EXPECT_HAS(refusal(std::string(base) + "tensor = 4\ntensor_mode = 3d\n", {}, 4),
             "deck.ini:4: parallel.tensor: 4 is not a cube");
  EXPECT_HAS(
      refusal(std::string(base) + "tensor = 8\ntensor_mode = 2.5d\ntensor_depth = 3\n", {}, 8),
      "deck.ini:6: parallel.tensor_depth: 3 does not divide parallel.tensor (8)");
  EXPECT_HAS(
      refusal(std::string(base) + "tensor = 8\ntensor_mode = 2.5d\ntensor_depth = 1\n", {}, 8),
      "deck.ini:4: parallel.tensor: 8 / parallel.tensor_depth (1) is not a square");
  EXPECT_EQ(parse_deck_text(
                std::string(base) + "tensor = 8\ntensor_mode = 2.5d\ntensor_depth = 2\n", {}, 8)
                .parallel.tensor,
            8);
  // 1d takes any size that divides the heads and the MLP
  EXPECT_EQ(parse_deck_text(kMinimal, {"--parallel.tensor=2"}, 2).parallel.tensor, 2);
}

TEST(DeckRefusal, TensorDivisibilityOfTheModel) {
  // 1d: heads % t, mlp % t
  EXPECT_EQ(
      refusal("[run]\nsteps = 1\n[model]\nhidden = 384\nheads = 6\n", {"--parallel.tensor=4"}, 4),
      "deck.ini:5: model.heads: 6 is not divisible by parallel.tensor (4) for 1d tensor "
      "parallelism");
  EXPECT_HAS(refusal("[run]\nsteps = 1\n[model]\nmlp_ratio = 2.01\n", {"--parallel.tensor=4"}, 4),
             "deck.ini:4: model.mlp_ratio: MLP width 515 is not divisible by parallel.tensor (4)");
  // 2d / 2.5d: hidden, heads, mlp % q
  const std::vector<std::string> two_d = {"--parallel.tensor=4", "--parallel.tensor_mode=2d"};
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\nhidden = 255\nheads = 5\n", two_d, 4),
            "deck.ini:4: model.hidden: 255 is not divisible by q = 2 of the 2d tensor layout");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\nhidden = 250\nheads = 5\n", two_d, 4),
            "deck.ini:5: model.heads: 5 is not divisible by q = 2 of the 2d tensor layout");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\nmlp_ratio = 2.0039\n",
                    {"--parallel.tensor=4", "--parallel.tensor_mode=2.5d"}, 4),
            "deck.ini:4: model.mlp_ratio: MLP width 513 is not divisible by q = 2 of the 2.5d "
            "tensor layout");
  // 3d: hidden % q^2, mlp % q^2, heads % q
  const std::vector<std::string> three_d = {"--parallel.tensor=8", "--parallel.tensor_mode=3d"};
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\nhidden = 258\nheads = 6\n", three_d, 8),
            "deck.ini:4: model.hidden: 258 is not divisible by q*q = 4 of the 3d tensor layout");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\nmlp_ratio = 2.01\n", three_d, 8),
            "deck.ini:4: model.mlp_ratio: MLP width 515 is not divisible by q*q = 4 of the 3d "
            "tensor layout");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\nhidden = 252\nheads = 7\n", three_d, 8),
            "deck.ini:5: model.heads: 7 is not divisible by q = 2 of the 3d tensor layout");
}

TEST(DeckRefusal, GlobalBatchDivisibility) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[data]\nglobal_batch = 126\n", {}, 4),
            "deck.ini:4: data.global_batch: 126 is not divisible by parallel.data (4) x "
            "data.grad_accum (1) x parallel.micro_batches (1) = 4");
  EXPECT_HAS(refusal("[run]\nsteps = 1\n[data]\nglobal_batch = 20\ngrad_accum = 3\n", {}, 1),
             "deck.ini:4: data.global_batch: 20 is not divisible by");
}

TEST(DeckRefusal, MicroBatchesMustDividePerRankBatch) {
  EXPECT_HAS(refusal("[run]\nsteps = 1\n[parallel]\nmicro_batches = 3\n", {}, 1),
             "deck.ini:4: parallel.micro_batches: 3 does not divide the per-rank batch 128");
}

TEST(DeckRefusal, MicroBatchSplitByTensorLayout) {
  // 2d q=2: micro-batch must be divisible by q
  EXPECT_HAS(refusal("[run]\nsteps = 1\n[data]\nglobal_batch = 5\n",
                     {"--parallel.tensor=4", "--parallel.tensor_mode=2d"}, 4),
             "deck.ini:4: data.global_batch: the micro-batch of 5 samples");
  // 2.5d d=2 q=2: by d*q = 4
  EXPECT_HAS(
      refusal("[run]\nsteps = 1\n[data]\nglobal_batch = 6\n",
              {"--parallel.tensor=8", "--parallel.tensor_mode=2.5d", "--parallel.tensor_depth=2"},
              8),
      "is not divisible by 4, which 2.5d tensor parallelism splits it by");
  // 3d q=2: by q*q = 4
  EXPECT_HAS(refusal("[run]\nsteps = 1\n[data]\nglobal_batch = 6\n",
                     {"--parallel.tensor=8", "--parallel.tensor_mode=3d"}, 8),
             "deck.ini:4: data.global_batch: the micro-batch of 6 samples");
  EXPECT_EQ(parse_deck_text("[run]\nsteps = 1\n[data]\nglobal_batch = 8\n",
                            {"--parallel.tensor=8", "--parallel.tensor_mode=3d"}, 8)
                .data.global_batch,
            8);
}

TEST(DeckRefusal, HeadsMustDivideHidden) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\nhidden = 100\nheads = 3\n"),
            "deck.ini:5: model.heads: 3 does not divide model.hidden (100)");
}

TEST(DeckRefusal, PatchMustDivideImage) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\nimage_size = 32\npatch_size = 6\n"),
            "deck.ini:5: model.patch_size: 6 does not divide model.image_size (32)");
  // the patch size came from the preset: the message says so
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\nimage_size = 30\n"),
            "deck.ini (from the default model.preset 'vit-lite-7/4'): model.patch_size: 4 does "
            "not divide model.image_size (30)");
}

TEST(DeckRefusal, RangesOfRatesAndFactors) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\ndropout = 1\n"),
            "deck.ini:4: model.dropout: must be in [0,1), got 1");
  EXPECT_EQ(refusal(kMinimal, {"--model.dropout=1.5"}),
            "command line: model.dropout: must be in [0,1), got 1.5");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\ndrop_path = -0.1\n"),
            "deck.ini:4: model.drop_path: must be in [0,1), got -0.1");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[data]\nlabel_smoothing = -0.1\n"),
            "deck.ini:4: data.label_smoothing: must be in [0,1), got -0.1");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[data]\nmixup_alpha = -1\n"),
            "deck.ini:4: data.mixup_alpha: must be >= 0, got -1");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[optim]\nlr = 0\n"),
            "deck.ini:4: optim.lr: must be > 0, got 0");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[optim]\nbeta1 = 1\n"),
            "deck.ini:4: optim.beta1: must be in [0,1), got 1");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[optim]\nbeta2 = 1.5\n"),
            "deck.ini:4: optim.beta2: must be in [0,1), got 1.5");
}

TEST(DeckRefusal, CheckpointBlocks) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[model]\ncheckpoint_activations = true\n"
                    "checkpoint_blocks = -2\n"),
            "deck.ini:5: model.checkpoint_blocks: must be -1 (every block) or a block count >= "
            "0, got -2");
  EXPECT_EQ(refusal(kMinimal, {"--model.checkpoint_blocks=3"}),
            "command line: model.checkpoint_blocks: = 3 needs model.checkpoint_activations = "
            "true (it says how many blocks of each stage are recomputed)");
  const Deck d = parse_deck_text(
      "[run]\nsteps = 1\n[model]\ncheckpoint_activations = true\ncheckpoint_blocks = 2\n", {},
      1);
  EXPECT_EQ(d.model.checkpoint_blocks, 2);
}

TEST(DeckRefusal, SequenceParallelNeeds1dAndDivisibleMicroBatch) {
  EXPECT_EQ(refusal(kMinimal, {"--parallel.sequence_parallel=true"}),
            "command line: parallel.sequence_parallel: needs 1d tensor parallelism "
            "(parallel.tensor > 1, tensor_mode = 1d); got tensor 1, tensor_mode 1d");
  EXPECT_HAS(refusal(kMinimal,
                     {"--parallel.sequence_parallel=true", "--parallel.tensor=4",
                      "--parallel.tensor_mode=2d"},
                     4),
             "needs 1d tensor parallelism (parallel.tensor > 1, tensor_mode = 1d); got tensor 4, "
             "tensor_mode 2d");
  // the micro-batch's samples are split over the tensor ranks, as in 2d
  EXPECT_HAS(refusal(kMinimal,
                     {"--parallel.sequence_parallel=true", "--parallel.tensor=4",
                      "--data.global_batch=6"},
                     4),
             "is not divisible by 4, which 1d sequence-parallel tensor parallelism splits it by");
  const Deck d = parse_deck_text(kMinimal, {"--parallel.sequence_parallel=true",
                                             "--parallel.tensor=2", "--data.global_batch=8"}, 2);
  EXPECT_TRUE(d.parallel.sequence_parallel);
  EXPECT_EQ(d.parallel.sequence_chunks, 2);
  EXPECT_HAS(refusal(kMinimal, {"--parallel.sequence_chunks=9"}),
             "command line: parallel.sequence_chunks: must be between 1 and 8, got 9");
  EXPECT_HAS(refusal(kMinimal, {"--parallel.sequence_chunks=0"}),
             "command line: parallel.sequence_chunks: must be between 1 and 8, got 0");
}

TEST(DeckRefusal, UniformPartitionNeedsDivisibleDepth) {
  // vit-lite-7/4 has 7 blocks: 2 stages cannot share them uniformly
  EXPECT_HAS(refusal("[run]\nsteps = 1\n[parallel]\npipeline = 2\n", {}, 2),
             "(from the default model.preset 'vit-lite-7/4'): model.depth: 7 blocks cannot be "
             "split evenly over parallel.pipeline (2)");
  EXPECT_EQ(
      parse_deck_text("[run]\nsteps = 1\n[parallel]\npipeline = 2\npartition = balanced\n", {}, 2)
          .parallel.pipeline,
      2);
}

TEST(DeckRefusal, InterleavedSchedule) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[parallel]\nschedule = interleaved\n"),
            "deck.ini (default value): parallel.chunks: the interleaved schedule needs >= 2 "
            "chunks per stage, got 1");
  EXPECT_HAS(refusal("[run]\nsteps = 1\n[model]\ndepth = 6\n[parallel]\npipeline = 2\n"
                     "schedule = interleaved\nchunks = 2\npartition = balanced\n",
                     {}, 2),
             "deck.ini:4: model.depth: 6 blocks cannot be split evenly over parallel.pipeline (2) "
             "x parallel.chunks (2) = 4 stages");
  EXPECT_EQ(parse_deck_text("[run]\nsteps = 1\n[model]\ndepth = 8\n[parallel]\npipeline = 2\n"
                            "schedule = interleaved\nchunks = 2\nmicro_batches = 4\n",
                            {}, 2)
                .parallel.chunks,
            2);
}

TEST(DeckRefusal, ChunksOnlyForInterleaved) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[parallel]\nchunks = 2\n"),
            "deck.ini:4: parallel.chunks: must be 1 unless parallel.schedule = interleaved, got 2");
}

TEST(DeckRefusal, PartitionList) {
  const char* base = "[run]\nsteps = 1\n[parallel]\npipeline = 2\n";
  EXPECT_EQ(parse_deck_text(std::string(base) + "partition = list:3,4\n", {}, 2).parallel.partition,
            "list:3,4");
  EXPECT_EQ(refusal(std::string(base) + "partition = list:1,2,4\n", {}, 2),
            "deck.ini:5: parallel.partition: has 3 entries but parallel.pipeline x "
            "parallel.chunks = 2");
  EXPECT_EQ(refusal(std::string(base) + "partition = list:3,3\n", {}, 2),
            "deck.ini:5: parallel.partition: entries sum to 6 but model.depth is 7");
  EXPECT_EQ(refusal(std::string(base) + "partition = list:3,x\n", {}, 2),
            "deck.ini:5: parallel.partition: list entries must be positive integers, got 'x' in "
            "'list:3,x'");
}

TEST(DeckRefusal, DatasetNeedsPath) {
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[data]\ndataset = cifar10\n"),
            "deck.ini (default value): data.path: must name the CIFAR-10 directory for "
            "data.dataset = cifar10");
  EXPECT_EQ(refusal("[run]\nsteps = 1\n[data]\ndataset = hdf5\npath =\n"),
            "deck.ini:5: data.path: must name the HDF5 file for data.dataset = hdf5");
}

// ---- the deck file itself

TEST(DeckFile, ByteOrderMarkIsSkipped) {
  // "[run]" after a UTF-8 BOM is still the first section header
  Deck d = parse_deck_text("\xEF\xBB\xBF[run]\nsteps = 4\n", {}, 1);
  EXPECT_EQ(d.run.steps, 4);
}

TEST(DeckFile, ControlCharactersAreRefusedWithTheLine) {
  EXPECT_EQ(refusal(std::string("[run]\nsteps = 1\nout_dir = a\0b\n", 30)),
            "deck.ini:3: control character 0x00 at column 12 (the deck must be a text file; is "
            "this a binary file?)");
  EXPECT_HAS(refusal("[run]\x01\nsteps = 1\n"), "deck.ini:1: control character 0x01");
  // tabs are blanks, a CR may end a line
  EXPECT_EQ(refusal("[run]\r\nsteps\t=\t1\r\n"), "<accepted>");
  EXPECT_HAS(refusal({"[run]\nsteps = 1\n"}, {"--run.out_dir=a\x01"}),
             "command line: run.out_dir: control characters");
}

TEST(DeckFile, LongTextIsClippedInMessages) {
  const std::string key(5000, 'k');
  const std::string msg = refusal("[run]\n" + key + " = 1\n");
  EXPECT_HAS(msg, "deck.ini:2: unknown key 'run.kkkk");
  EXPECT_HAS(msg, "... (5004 characters)");
  EXPECT_LT(msg.size(), 300u);
  EXPECT_LT(refusal("[run]\nsteps = " + std::string(100000, '9') + "\n").size(), 300u);
}

class DeckFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/vg_deck_files_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  static std::string read_refusal(const std::string& path) {
    try {
      read_deck_file(path);
    } catch (const UserError& e) {
      return e.what();
    }
    return "<accepted>";
  }
  fs::path dir_;
};

TEST_F(DeckFiles, DirectoryIsNamedAsSuch) {
  EXPECT_EQ(read_refusal(dir_.string()),
            "deck '" + dir_.string() + "': is a directory, not a deck file");
}

TEST_F(DeckFiles, FifoIsRefusedWithoutBlocking) {
  // Opening a FIFO with no writer blocks forever; the refusal must come at once.
  const std::string fifo = (dir_ / "deck.ini").string();
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(read_refusal(fifo), "deck '" + fifo +
                                    "': is not a regular file (a FIFO); every rank reads the "
                                    "deck, so it must be a file");
  EXPECT_HAS(read_refusal("/dev/zero"), "is not a regular file (a character device)");
}

TEST_F(DeckFiles, MissingAndOversizedDecks) {
  EXPECT_EQ(read_refusal((dir_ / "none.ini").string()),
            "deck '" + (dir_ / "none.ini").string() +
                "': cannot open the file: No such file or directory");
  const fs::path big = dir_ / "big.ini";
  { std::ofstream(big) << "[run]\nsteps = 1\n"; }
  fs::resize_file(big, kMaxDeckBytes + 1);
  EXPECT_HAS(read_refusal(big.string()), "a deck is a small text file");
  fs::resize_file(big, 16);
  EXPECT_EQ(read_deck_file(big.string()), "[run]\nsteps = 1\n");
}

// ---- sizes: bounds of single keys, then sizes derived from several, in 64-bit arithmetic

TEST(DeckRefusal, SizesBeyondAnythingPlausible) {
  EXPECT_EQ(refusal(kMinimal, {"--model.image_size=1000000"}),
            "command line: model.image_size: must be at most 8192 pixels, got 1000000");
  EXPECT_EQ(refusal(kMinimal, {"--data.synthetic_train=8589934592"}),
            "command line: data.synthetic_train: must be at most 1073741824 samples, got "
            "8589934592");
  EXPECT_HAS(refusal(kMinimal, {"--data.synthetic_eval=2000000000"}),
             "data.synthetic_eval: must be at most");
  EXPECT_HAS(refusal(kMinimal, {"--model.hidden=131072", "--model.heads=1"}),
             "model.hidden: must be at most 65536");
  EXPECT_HAS(refusal(kMinimal, {"--model.depth=100000"}),
             "model.depth: must be at most 1024 blocks");
  // mlp_ratio is converted to an int width: refused before that conversion overflows
  EXPECT_HAS(refusal(kMinimal, {"--model.mlp_ratio=1e300"}), "model.mlp_ratio: must be at most 64");
  EXPECT_HAS(refusal(kMinimal, {"--model.num_classes=2147483647"}),
             "model.num_classes: must be at most");
  EXPECT_HAS(refusal(kMinimal, {"--data.global_batch=9223372036854775807"}),
             "data.global_batch: must be at most 16777216 samples");
  EXPECT_HAS(refusal(kMinimal, {"--data.crop_padding=33"}),
             "data.crop_padding: must be at most 32");
  EXPECT_HAS(refusal(kMinimal, {"--data.workers=100000"}), "data.workers: must be at most 256");
  EXPECT_HAS(refusal(kMinimal, {"--data.prefetch=2147483647"}),
             "data.prefetch: must be at most 64");
  EXPECT_HAS(refusal("[run]\nepochs = 1e300\n"), "deck.ini:2: run.epochs: must be at most 1000000");
  EXPECT_HAS(refusal(kMinimal, {"--optim.warmup_epochs=1e300"}),
             "optim.warmup_epochs: must be at most");
  // the largest values are still accepted on their own
  EXPECT_EQ(refusal(kMinimal, {"--data.synthetic_train=1073741824"}), "<accepted>");
}

TEST(DeckRefusal, ParallelProductsDoNotWrap) {
  // 2^30 stages x tensor 4 is 2^32: 0 in 32-bit ints, and world % 0 is a division by zero
  EXPECT_HAS(refusal(kMinimal, {"--parallel.pipeline=1073741824", "--parallel.tensor=4"}, 4),
             "parallel.pipeline: parallel.pipeline (1073741824) x parallel.tensor (4) does not "
             "divide the world size (4 ranks)");
  EXPECT_HAS(refusal(kMinimal, {"--parallel.schedule=interleaved", "--parallel.chunks=2147483647"}),
             "parallel.chunks: 2147483647 chunks per stage exceed model.depth (7 blocks)");
}

TEST(DeckRefusal, DerivedSizesAreOverflowChecked) {
  // 8192 / 1 pixels: 67108865 tokens; 8 samples x 2 heads x T^2 x 4 bytes = 2.9e17
  EXPECT_EQ(
      refusal(kMinimal, {"--model.preset=custom", "--model.image_size=8192", "--model.patch_size=1",
                         "--model.hidden=16", "--model.heads=2", "--data.global_batch=8"}),
      "command line: model.image_size: the attention scores of the micro-batch of 8 samples "
      "x 2 heads x 67108865 tokens (model.image_size 8192 / model.patch_size 1, squared, + "
      "1) squared take 2.88e+17 bytes per rank, more than any machine holds (1.13e+15 "
      "bytes)");
  // the Linear layers' rows: 2^24 samples x 197 tokens > 2^31 (named: the batch, the key set
  // here, not the preset's image size)
  EXPECT_HAS(refusal("[run]\nsteps = 1\n[model]\npreset = vit-base/16\n",
                     {"--data.global_batch=16777216"}),
             "command line: data.global_batch: the micro-batch of 16777216 samples x 197 tokens");
  // 65536 wide, 1024 deep, MLP x 64: 5.8e14 parameters, 9.3e15 bytes of training state
  const std::string huge = refusal(kMinimal, {"--model.hidden=65536", "--model.depth=1024",
                                              "--model.mlp_ratio=64", "--model.heads=64"});
  EXPECT_HAS(huge, "command line: model.hidden: the model has ");
  EXPECT_HAS(huge, "parameters (model.hidden 65536, model.depth 1024, MLP width 4194304");
  EXPECT_HAS(huge, "per rank, more than any machine holds");
  // the largest presets are fine
  EXPECT_EQ(refusal(kMinimal, {"--model.preset=vit-huge-4096", "--data.global_batch=4096"}),
            "<accepted>");
}

// ---- check_deck_paths

class DeckPaths : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/vg_deck_paths_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  static void touch(const fs::path& p) { std::ofstream(p) << "x"; }
  Deck deck(const std::vector<std::string>& extra) {
    return deck_in((dir_ / "run").string(), extra);
  }
  static Deck deck_in(const std::string& out_dir, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> ov = {"--run.out_dir=" + out_dir};
    ov.insert(ov.end(), extra.begin(), extra.end());
    return parse_deck_text(kMinimal, ov, 1, "paths.ini");
  }
  static std::string refusal_of(const Deck& d, bool training) {
    try {
      check_deck_paths(d, training);
    } catch (const UserError& e) {
      return e.what();
    }
    return "<accepted>";
  }
  fs::path dir_;
};

TEST_F(DeckPaths, SyntheticFreshRunIsAccepted) {
  EXPECT_EQ(refusal_of(deck({}), true), "<accepted>");
}

TEST_F(DeckPaths, MissingCifarDirectory) {
  const std::string missing = (dir_ / "nope").string();
  EXPECT_HAS(refusal_of(deck({"--data.dataset=cifar10", "--data.path=" + missing}), true),
             "paths.ini: data.path: CIFAR-10 directory '" + missing + "' does not exist");
}

TEST_F(DeckPaths, CifarChecksOnlyTheSplitsNeeded) {
  const fs::path c = dir_ / "cifar";
  fs::create_directories(c);
  touch(c / "test_batch.bin");
  for (int i : {1, 2, 4, 5}) touch(c / ("data_batch_" + std::to_string(i) + ".bin"));
  const Deck d = deck({"--data.dataset=cifar10", "--data.path=" + c.string()});
  EXPECT_HAS(refusal_of(d, true), "lacks data_batch_3.bin");
  EXPECT_EQ(refusal_of(d, false), "<accepted>");  // eval reads only test_batch.bin
  touch(c / "data_batch_3.bin");
  EXPECT_EQ(refusal_of(d, true), "<accepted>");
  fs::remove(c / "test_batch.bin");
  EXPECT_HAS(refusal_of(d, false), "lacks test_batch.bin");
}

TEST_F(DeckPaths, Hdf5AndCheckpointFilesMustExist) {
  const std::string h5 = (dir_ / "train.h5").string();
  EXPECT_HAS(refusal_of(deck({"--data.dataset=hdf5", "--data.path=" + h5}), true),
             "data.path: HDF5 dataset '" + h5 + "' does not exist");
  touch(h5);
  EXPECT_EQ(refusal_of(deck({"--data.dataset=hdf5", "--data.path=" + h5}), true), "<accepted>");
  const std::string ck = (dir_ / "step.h5").string();
  EXPECT_HAS(refusal_of(deck({"--checkpoint.load=" + ck}), false),
             "checkpoint.load: checkpoint '" + ck + "' does not exist");
}

TEST_F(DeckPaths, ExistingRunInOutDir) {
  const fs::path run = dir_ / "run";
  fs::create_directories(run / "checkpoints");
  EXPECT_EQ(refusal_of(deck({}), true), "<accepted>");  // an empty checkpoints/ is no run
  touch(run / "checkpoints" / "step_00000010.h5");
  EXPECT_EQ(refusal_of(deck({}), true),
            "paths.ini: run.out_dir '" + run.string() +
                "' holds another run (checkpoints/); choose another out_dir or set "
                "checkpoint.resume = auto");
  touch(run / "metrics.h5");
  EXPECT_EQ(refusal_of(deck({}), true),
            "paths.ini: run.out_dir '" + run.string() +
                "' holds another run (metrics.h5); choose another out_dir or set "
                "checkpoint.resume = auto");
  // resuming, or not training, is fine
  EXPECT_EQ(refusal_of(deck({"--checkpoint.resume=auto"}), true), "<accepted>");
  EXPECT_EQ(refusal_of(deck({}), false), "<accepted>");
}

}  // namespace
}  // namespace vitgrid

namespace vitgrid {
namespace {

// run.out_dir is created and written to at check time, so an unusable one is refused with the
// OS's reason before any work (it used to end in an uncaught exception after setup).
TEST_F(DeckPaths, OutDirIsCreatedAndProbed) {
  const fs::path fresh = dir_ / "a" / "b";
  EXPECT_EQ(refusal_of(deck_in(fresh.string()), true), "<accepted>");
  EXPECT_TRUE(fs::is_directory(fresh));
  EXPECT_TRUE(fs::is_empty(fresh));  // the probe file is gone
  // predict writes predictions.h5: checked too; eval writes nothing
  const fs::path p = dir_ / "p";
  EXPECT_EQ(refusal_of(deck_in(p.string()), false), "<accepted>");
  EXPECT_FALSE(fs::exists(p));
  try {
    check_deck_paths(deck_in(p.string()), false, true);
  } catch (const UserError& e) {
    ADD_FAILURE() << e.what();
  }
  EXPECT_TRUE(fs::is_directory(p));
}

TEST_F(DeckPaths, UnusableOutDirNamesKeyAndReason) {
  touch(dir_ / "file");
  const std::string under_file = (dir_ / "file" / "x").string();
  EXPECT_EQ(refusal_of(deck_in(under_file), true),
            "paths.ini: run.out_dir: '" + under_file + "' cannot be created: Not a directory");
  const std::string long_name = (dir_ / std::string(300, 'a')).string();
  EXPECT_EQ(refusal_of(deck_in(long_name), true),
            "paths.ini: run.out_dir: '" + long_name + "' cannot be created: File name too long");
  // /proc cannot take new entries, not even from root (whom permission bits do not stop)
  EXPECT_HAS(refusal_of(deck_in("/proc/vitgrid_x"), true),
             "run.out_dir: '/proc/vitgrid_x' cannot be created: ");
  EXPECT_HAS(refusal_of(deck_in("/proc"), true),
             "run.out_dir: '/proc' is not writable (creating a file in it failed: ");
  const fs::path ck = dir_ / "run";
  fs::create_directories(ck);
  touch(ck / "checkpoints");
  EXPECT_HAS(refusal_of(deck({"--checkpoint.resume=auto"}), true),
             "checkpoints' exists and is not a directory");
}

TEST_F(DeckPaths, ReadOnlyOutDirForUsersWhomBitsStop) {
  // A 0555 directory: refused for an ordinary user; root may still write it, and then the
  // probe rightly accepts it. Either way the verdict is what creating a file really does.
  const fs::path ro = dir_ / "ro";
  fs::create_directories(ro);
  fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                          fs::perms::group_exec | fs::perms::others_read | fs::perms::others_exec);
  const std::string got = refusal_of(deck_in(ro.string()), true);
  if (geteuid() == 0)
    EXPECT_EQ(got, "<accepted>");
  else
    EXPECT_EQ(got, "paths.ini: run.out_dir: '" + ro.string() +
                       "' is not writable (creating a file in it failed: Permission denied)");
  fs::permissions(ro, fs::perms::owner_all);
}

TEST_F(DeckPaths, DataFilesMustBeRegularFiles) {
  EXPECT_EQ(refusal_of(deck({"--data.dataset=hdf5", "--data.path=/dev/zero"}), true),
            "paths.ini: data.path: HDF5 dataset '/dev/zero' is not a regular file (a character "
            "device)");
  const fs::path fifo = dir_ / "fifo.h5";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_HAS(refusal_of(deck({"--data.dataset=hdf5", "--data.path=" + fifo.string()}), true),
             "' is not a regular file (a FIFO)");
  EXPECT_HAS(refusal_of(deck({"--checkpoint.load=" + fifo.string()}), false),
             "checkpoint.load: checkpoint '" + fifo.string() + "' is not a regular file (a FIFO)");
  const fs::path c = dir_ / "cifar";
  fs::create_directories(c);
  ASSERT_EQ(mkfifo((c / "test_batch.bin").c_str(), 0600), 0);
  EXPECT_EQ(refusal_of(deck({"--data.dataset=cifar10", "--data.path=" + c.string()}), false),
            "paths.ini: data.path: CIFAR-10 file '" + (c / "test_batch.bin").string() +
                "' is not a regular file (a FIFO)");
}

}  // namespace
}  // namespace vitgrid
