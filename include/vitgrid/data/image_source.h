// Sources of encoded images (real data): each yields (encoded bytes, label) by global index, so
// the sampler, decoding and augmentation are shared by all of them.
//
//  * tfrecord: the shards of TensorFlow's build_imagenet_data.py / imagenet-tools, as
//    Colossal-AI's examples read them through DALI: `train-00000-of-01024`, ...,
//    `validation-00000-of-00128`, ... in one directory. Each record is a tf.train.Example
//    (parsed with protobuf) holding `image/encoded` (bytes) and `image/class/label` (int64,
//    1-based in those scripts: the label used is label + label_offset). Record framing:
//    uint64 length, masked CRC32C of the length, data, masked CRC32C of the data; both CRCs are
//    checked. Random access goes through an index per shard in DALI's tfrecord2idx text format
//    (one line "offset size" per record), read when present beside the shard or in the cache
//    directory, else built once and written to the cache directory (never beside the data).
//  * folder: torchvision's ImageFolder layout: class = sorted sub-folder name, samples sorted by
//    path within a class. With `train/` and `val/` sub-directories those are the splits;
//    otherwise the tree is one set and a deterministic hold-out of `eval_fraction` of each class
//    (the last ones in sorted order) is the eval split.
//  * jpeg_h5: one HDF5 file per split (vitgrid_dataset pack writes them): /jpeg uint8
//    [total_bytes] (the encoded files back to back), /offsets int64 [N+1], /labels int64 [N],
//    /classes strings [K], root attributes num_classes and source. Each rank reads only its
//    samples with positioned reads.
// Errors in the data (a missing or unreadable file, a bad CRC, a cut-off record, a malformed
// Example, a label out of range) throw UserError naming the file (and record offset).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace vitgrid {

class ImageSource {
 public:
  virtual ~ImageSource() = default;
  virtual int64_t size() const = 0;
  virtual int num_classes() const = 0;
  // Class names by label (WordNet ids for ImageNet folders); may be empty where the source has
  // none (TFRecord shards carry only numbers).
  virtual std::vector<std::string> class_names() const = 0;
  // The encoded bytes and the label (in [0, num_classes)) of sample i in [0, size()).
  // Thread-safe: the loader's workers call it concurrently.
  virtual void read(int64_t i, std::vector<uint8_t>& bytes, int32_t& label) const = 0;
  // Where sample i lives, for messages: a path, or "shard record k at offset X".
  virtual std::string where(int64_t i) const = 0;
  virtual std::string describe() const = 0;
};

struct ImageSourceOptions {
  bool train = true;
  int label_offset = 0;          // added to stored labels (tfrecord: -1 for 1-based labels)
  double eval_fraction = 0.0;    // folder without train/ and val/: held-out share per class
  std::string index_dir;         // tfrecord: where missing indexes are written (run dir / cache)
  std::string eval_path;         // jpeg_h5: eval file (default: path's X_train.h5 -> X_val.h5)
  // The deck's model.num_classes. TFRecord shards do not record the class count: with K > 0 a
  // label outside [0, K) after label_offset is refused by read() (UserError naming the shard
  // and the record's offset) and num_classes() is K; with 0 only negative labels are refused
  // and num_classes() is 0 (unknown: the tool's pack finds it from the labels). The folder
  // and jpeg_h5 sources know their class count and ignore it.
  int num_classes = 0;
};

// Throw UserError naming what is wrong (missing directory, no shards, ...).
std::unique_ptr<ImageSource> open_tfrecord(const std::string& dir, const ImageSourceOptions& o);
std::unique_ptr<ImageSource> open_image_folder(const std::string& root, const ImageSourceOptions& o);
std::unique_ptr<ImageSource> open_jpeg_h5(const std::string& path, const ImageSourceOptions& o);

// Builds the missing (or invalid) TFRecord indexes of one split (train: train-*, else
// validation-*) of `dir` into `index_dir`, scanning each shard once (framing and both CRCs
// checked). This process takes the shards k (in sorted order) with k % parts == part, so the
// app calls it on every rank with (rank, world) and then a barrier before open_tfrecord: each
// shard is scanned once in the job instead of once per rank. Indexes are written under a
// temporary name and renamed (never half-written), only into index_dir (never beside the
// data); with index_dir empty it does nothing. Throws UserError naming the shard and record
// offset on bad data (the caller agrees on errors across ranks before its barrier). No MPI.
void tfrecord_build_indexes(const std::string& dir, const std::string& index_dir, bool train,
                            int part, int parts);

}  // namespace vitgrid
