// Dataset from the deck, checked against the model it will feed.
//
// HDF5 evaluation file, in this order:
//   1. data.eval_path when set;
//   2. else, when data.path is "X_train.h5" (what tools/vitgrid_dataset writes) and "X_eval.h5"
//      exists, that file;
//   3. else the train file itself, with a warning printed once (rank 0): evaluating on the
//      training data still measures fit, but it is not a held-out score.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <set>
#include <string>
#include <thread>

#include "vitgrid/core/error.h"
#include "vitgrid/core/log.h"
#include "vitgrid/data/dataset.h"
#include "vitgrid/data/image_source.h"
#include "vitgrid/data/image_transform.h"
#include "vitgrid/deck/deck.h"

namespace vitgrid {
namespace {

bool is_file(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string hdf5_eval_file(const DataSection& d) {
  if (!d.eval_path.empty()) return d.eval_path;
  const std::string suffix = "_train.h5";
  if (d.path.size() > suffix.size() &&
      d.path.compare(d.path.size() - suffix.size(), suffix.size(), suffix) == 0) {
    std::string ev = d.path.substr(0, d.path.size() - suffix.size()) + "_eval.h5";
    if (is_file(ev)) return ev;
  }
  Log()("warning: data.eval_path is not set and no X_eval.h5 beside data.path = %s: evaluating "
        "on the training file\n", d.path.c_str());
  return d.path;
}

int interp_of(const DataSection& d) {
  return static_cast<int>(d.interpolation == "bilinear" ? Interp::Bilinear : Interp::Bicubic);
}

}  // namespace

std::string tfrecord_index_dir(const Deck& deck) {
  return deck.data.index_dir.empty() ? deck.run.out_dir + "/tfrecord-index" : deck.data.index_dir;
}

int loader_workers(const Deck& deck, int local_ranks) {
  if (deck.data.workers > 0) return deck.data.workers;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, std::min(16, cores / std::max(1, local_ranks)));
}

LoaderConfig make_loader_config(const Deck& deck, bool train, int data_rank, int data_size,
                                int workers) {
  const DataSection& d = deck.data;
  LoaderConfig c;
  c.seed = deck.run.seed;
  c.global_batch = d.global_batch;
  c.grad_accum = d.grad_accum;
  c.data_rank = data_rank;
  c.data_size = data_size;
  c.crop_padding = d.crop_padding;
  c.hflip = d.hflip;
  c.mix.mixup_alpha = d.mixup_alpha;
  c.mix.cutmix_alpha = d.cutmix_alpha;
  c.mix.prob = d.mixup_prob;
  c.mix.switch_prob = d.mixup_switch_prob;
  c.mix.mode = d.mixup_mode == "pair" ? MixMode::Pair : d.mixup_mode == "elem" ? MixMode::Elem : MixMode::Batch;
  c.num_classes = deck.model.num_classes;
  c.prefetch = d.prefetch;
  c.workers = workers;
  c.train = train;
  c.eval_samples = deck.run.eval_samples;
  c.real.scale_lo = d.rrc_scale[0];
  c.real.scale_hi = d.rrc_scale[1];
  c.real.ratio_lo = d.rrc_ratio[0];
  c.real.ratio_hi = d.rrc_ratio[1];
  c.real.interp = interp_of(d);
  c.real.crop_pct = d.crop_pct;
  c.real.dct_scale = d.dct_scale;
  c.real.device_share = d.device_share;
  return c;
}

std::unique_ptr<Dataset> make_dataset(const Deck& deck, bool train) {
  const DataSection& d = deck.data;
  std::unique_ptr<Dataset> ds;
  if (d.dataset == "synthetic") {
    ds = make_synthetic(deck.run.seed, train, train ? d.synthetic_train : d.synthetic_eval,
                        deck.model.image_size, deck.model.num_classes);
  } else if (d.dataset == "cifar10") {
    if (d.path.empty()) throw UserError("data.path must name the CIFAR-10 binary directory");
    ds = make_cifar10(d.path, train);
  } else if (d.dataset == "hdf5") {
    if (d.path.empty()) throw UserError("data.path must name the HDF5 image file");
    ds = make_hdf5_images(train ? d.path : hdf5_eval_file(d));
  } else if (d.dataset == "tfrecord" || d.dataset == "folder" || d.dataset == "jpeg_h5") {
    ImageSourceOptions o;
    o.train = train;
    o.label_offset = d.label_offset;
    o.eval_fraction = d.eval_fraction;
    o.index_dir = tfrecord_index_dir(deck);
    o.eval_path = d.eval_path;
    o.num_classes = deck.model.num_classes;
    std::unique_ptr<ImageSource> src = d.dataset == "tfrecord" ? open_tfrecord(d.path, o)
                                       : d.dataset == "folder" ? open_image_folder(d.path, o)
                                                               : open_jpeg_h5(d.path, o);
    ds = make_encoded_dataset(std::move(src), deck.model.image_size,
                              interp_of(d), d.crop_pct);
  } else {
    throw UserError("data.dataset = " + d.dataset +
                    " is not one of synthetic, cifar10, hdf5, tfrecord, folder, jpeg_h5");
  }
  // Once per process: the train and the eval split may be the same file.
  static std::set<std::string> warned;
  const std::string w = ds->warning();
  if (!w.empty() && warned.insert(w).second) Log()("warning: %s\n", w.c_str());
  // The training sampler holds a permutation of the split, 8 bytes per sample, on every rank,
  // allocated by the loader's thread where a failure could not be agreed on: check it here
  // against the memory a rank can have, the host's or the process limit (ulimit -v), if lower.
  if (train) {
    const double perm = 8.0 * double(ds->size());
    double mem = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
    const char* what = "this host's";
    struct rlimit rl;
    if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        (mem <= 0 || double(rl.rlim_cur) < mem)) {
      mem = double(rl.rlim_cur);
      what = "the process's address-space limit of";
    }
    if (mem > 0 && perm > mem / 2) {
      char buf[200];
      std::snprintf(buf, sizeof buf, "%.1f GiB on every rank, more than half %s %.1f GiB",
                    perm / 1073741824.0, what, mem / 1073741824.0);
      throw UserError(std::string(d.dataset == "synthetic" ? "data.synthetic_train" : "data.path") +
                      ": " + ds->describe() + " has " + std::to_string(ds->size()) +
                      " samples: the sampler's permutation of them takes " + buf);
    }
  }
  if (!ds->encoded() && ds->image_size() != deck.model.image_size)
    throw UserError("model.image_size = " + std::to_string(deck.model.image_size) + " but " +
                    ds->describe() + " holds " + std::to_string(ds->image_size()) + "x" +
                    std::to_string(ds->image_size()) + " images");
  if (ds->num_classes() != deck.model.num_classes)
    throw UserError("model.num_classes = " + std::to_string(deck.model.num_classes) + " but " +
                    ds->describe() + " has " + std::to_string(ds->num_classes()) + " classes");
  return ds;
}

}  // namespace vitgrid
