// TFRecord shards of tf.train.Example records (TensorFlow's build_imagenet_data.py layout):
// `train-00000-of-01024`, ..., `validation-00000-of-00128`, ... in one directory.
//
// Framing of each record: uint64 LE length, uint32 LE masked CRC32C of the 8 length bytes,
// `length` data bytes, uint32 LE masked CRC32C of the data, where
// masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8.
//
// Random access goes through one index per shard in DALI's tfrecord2idx text format: one line
// "offset size" per record (offset of the record's first byte, size of the whole framed
// record, 16 + length). An index is looked for beside the shard (`<shard>.idx`), then in
// index_dir; a valid one is used as is (the records must tile the shard exactly, which also
// catches an index of another version of the shard in most cases). Otherwise the shard is
// scanned (framing and both CRCs checked) and the index is written into index_dir under a
// temporary name then renamed, never beside the data, or kept in memory when index_dir is "".
//
// read() is one pread() of the framed record on a descriptor kept open per shard (no shared
// FILE*, no lock), the two CRCs checked, then the Example parsed with protobuf.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/crc.hpp>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tf_example.pb.h"
#include "vitgrid/core/error.h"
#include "vitgrid/data/image_source.h"

namespace vitgrid {
namespace {

namespace fs = std::filesystem;

using Crc32c = boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true>;

uint32_t masked_crc32c(const uint8_t* p, size_t n) {
  Crc32c c;
  c.process_bytes(p, n);
  const uint32_t crc = c.checksum();
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

uint64_t load_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int k = 7; k >= 0; --k) v = (v << 8) | p[k];
  return v;
}

uint32_t load_u32(const uint8_t* p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

constexpr uint64_t kFrame = 16;  // length + its CRC + the data's CRC

struct Record {
  uint64_t offset = 0, size = 0;  // whole framed record
};

// Reads exactly n bytes at off; false at end of file (short), throws on an I/O error.
bool pread_all(int fd, uint8_t* dst, size_t n, uint64_t off, const std::string& path) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, dst, n, (off_t)off);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw UserError(path + ": read at byte " + std::to_string(off) +
                      " failed: " + std::strerror(errno));
    }
    if (r == 0) return false;
    dst += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
  return true;
}

UserError record_error(const std::string& shard, uint64_t off, const std::string& what) {
  return UserError(shard + ": record at offset " + std::to_string(off) + ": " + what);
}

// Checks the framing and both CRCs of the framed record in buf (n bytes, read from `off`).
// Returns the data's length.
uint64_t check_frame(const uint8_t* buf, uint64_t n, const std::string& shard, uint64_t off) {
  if (n < kFrame) throw record_error(shard, off, "cut off (shorter than a record header)");
  const uint64_t len = load_u64(buf);
  if (load_u32(buf + 8) != masked_crc32c(buf, 8))
    throw record_error(shard, off, "bad CRC of the length field (damaged or not a TFRecord file)");
  if (len != n - kFrame)
    throw record_error(shard, off,
                       "length " + std::to_string(len) + " does not match the index (" +
                           std::to_string(n - kFrame) +
                           " data bytes): stale index or damaged shard");
  if (load_u32(buf + 12 + len) != masked_crc32c(buf + 12, len))
    throw record_error(shard, off, "bad CRC of the data (damaged record)");
  return len;
}

// Scans a whole shard: every record's framing and CRCs. Throws on a bad or cut-off record.
std::vector<Record> scan_shard(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw UserError(path + ": cannot open: " + std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (fstat(fd, &st) != 0) throw UserError(path + ": cannot stat: " + std::strerror(errno));
  const uint64_t fsize = (uint64_t)st.st_size;
  std::vector<Record> recs;
  std::vector<uint8_t> buf;
  uint64_t off = 0;
  while (off < fsize) {
    uint8_t head[12];
    if (fsize - off < 12 || !pread_all(fd, head, 12, off, path))
      throw record_error(path, off, "cut off (the file ends inside the record header)");
    if (load_u32(head + 8) != masked_crc32c(head, 8))
      throw record_error(path, off, "bad CRC of the length field (damaged or not a TFRecord file)");
    const uint64_t len = load_u64(head);
    if (len > fsize - off - 12 || fsize - off - 12 - len < 4)
      throw record_error(path, off,
                         "cut off (the record claims " + std::to_string(len) + " data bytes, " +
                             "the file ends " + std::to_string(fsize - off) + " bytes after it)");
    buf.resize((size_t)len + 4);
    if (!pread_all(fd, buf.data(), buf.size(), off + 12, path))
      throw record_error(path, off, "cut off (the file shrank while scanned)");
    if (load_u32(buf.data() + len) != masked_crc32c(buf.data(), len))
      throw record_error(path, off, "bad CRC of the data (damaged record)");
    recs.push_back({off, len + kFrame});
    off += len + kFrame;
  }
  return recs;
}

// Parses an index file; "" with `recs` filled when it is a valid index of a shard of `fsize`
// bytes (records in order, tiling the file exactly), else why not.
std::string read_index(const std::string& idx, uint64_t fsize, std::vector<Record>& recs) {
  recs.clear();
  std::ifstream in(idx);
  if (!in) return "cannot be read";
  std::string line;
  uint64_t expect = 0;
  int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::istringstream ls(line);
    long long o = -1, s = -1;
    std::string extra;
    if (!(ls >> o >> s) || (ls >> extra) || o < 0 || s < 0)
      return "line " + std::to_string(lineno) + " is not \"offset size\"";
    if ((uint64_t)o != expect)
      return "line " + std::to_string(lineno) + ": offset " + std::to_string(o) +
             " where the previous record ends at " + std::to_string(expect);
    if ((uint64_t)s < kFrame || (uint64_t)s > fsize - (uint64_t)o)
      return "line " + std::to_string(lineno) + ": size " + std::to_string(s) +
             " does not fit the shard (" + std::to_string(fsize) + " bytes)";
    recs.push_back({(uint64_t)o, (uint64_t)s});
    expect = (uint64_t)o + (uint64_t)s;
  }
  if (in.bad()) return "cannot be read";
  if (expect != fsize)
    return "its records end at byte " + std::to_string(expect) + " but the shard has " +
           std::to_string(fsize) + " bytes";
  return "";
}

// Writes the index atomically into index_dir (temporary name, then rename). "" or why not.
std::string write_index(const std::string& index_dir, const std::string& name,
                        const std::vector<Record>& recs) {
  std::error_code ec;
  fs::create_directories(index_dir, ec);
  if (ec) return "cannot create " + index_dir + ": " + ec.message();
  const std::string final_path = index_dir + "/" + name + ".idx";
  char host[64] = {0};
  gethostname(host, sizeof host - 1);
  const std::string tmp = final_path + ".tmp." + host + "." + std::to_string(getpid()) + "." +
                          std::to_string(std::random_device{}());
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return "cannot create " + tmp + ": " + std::strerror(errno);
    for (const Record& r : recs) out << r.offset << ' ' << r.size << '\n';
    out.flush();
    if (!out) {
      out.close();
      std::remove(tmp.c_str());
      return "cannot write " + tmp + " (disk full?)";
    }
  }
  if (std::rename(tmp.c_str(), final_path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    return "cannot rename " + tmp + " to " + final_path + ": " + why;
  }
  return "";
}

std::vector<std::string> list_shards(const std::string& dir, bool train) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw UserError("TFRecord directory " + dir + ": " +
                    (fs::exists(dir, ec) ? "not a directory" : "no such directory"));
  const std::string prefix = train ? "train-" : "validation-";
  std::vector<std::string> names;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.rfind(prefix, 0) != 0) continue;
    if (n.size() > 4 && n.compare(n.size() - 4, 4, ".idx") == 0) continue;  // DALI index beside
    std::error_code e2;
    if (!fs::is_regular_file(it->path(), e2)) continue;  // follows symlinks
    names.push_back(n);
  }
  if (ec) throw UserError("TFRecord directory " + dir + ": cannot list: " + ec.message());
  if (names.empty())
    throw UserError("TFRecord directory " + dir + ": no " + (train ? "train" : "validation") +
                    " shards (files named " + prefix + "*)");
  std::sort(names.begin(), names.end());
  return names;
}

struct IndexResult {
  std::vector<Record> recs;
  enum Kind { Beside, Cached, Built } kind = Built;
  std::string note;  // an invalid index found, a write that failed
};

// The index of one shard: beside it, else in index_dir, else scanned (and written to
// index_dir when `write` and index_dir is set).
IndexResult index_of(const std::string& dir, const std::string& name, const std::string& index_dir,
                     bool write) {
  const std::string path = dir + "/" + name;
  struct stat st;
  if (stat(path.c_str(), &st) != 0)
    throw UserError(path + ": cannot stat: " + std::strerror(errno));
  const uint64_t fsize = (uint64_t)st.st_size;
  IndexResult r;
  std::vector<std::string> candidates = {path + ".idx"};
  if (!index_dir.empty()) candidates.push_back(index_dir + "/" + name + ".idx");
  std::string invalid;
  for (size_t c = 0; c < candidates.size(); ++c) {
    std::error_code ec;
    if (!fs::exists(candidates[c], ec)) continue;
    const std::string why = read_index(candidates[c], fsize, r.recs);
    if (why.empty()) {
      r.kind = c == 0 ? IndexResult::Beside : IndexResult::Cached;
      if (!invalid.empty()) r.note = invalid + ": ignored, " + candidates[c] + " used";
      return r;
    }
    invalid += (invalid.empty() ? "" : "; ") + std::string("index ") + candidates[c] +
               " is invalid (" + why + ")";
  }
  if (!invalid.empty()) r.note = invalid + ": rebuilt";
  r.recs = scan_shard(path);
  r.kind = IndexResult::Built;
  if (write && !index_dir.empty()) {
    const std::string why = write_index(index_dir, name, r.recs);
    if (!why.empty())
      r.note += (r.note.empty() ? "" : "; ") + std::string("index of ") + name +
                " kept in memory only: " + why;
  }
  return r;
}

// Raises the soft limit on open files towards the hard one when `need` more descriptors are
// wanted (ImageNet has 1024 train shards; the usual soft limit is 1024).
void reserve_descriptors(size_t need) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  const rlim_t want = (rlim_t)need + 256;
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
    rl.rlim_cur = (rl.rlim_max == RLIM_INFINITY) ? want : std::min(want, rl.rlim_max);
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

class TfRecordSource final : public ImageSource {
 public:
  TfRecordSource(const std::string& dir, const ImageSourceOptions& o)
      : dir_(dir), train_(o.train), label_offset_(o.label_offset), K_(o.num_classes) {
    if (o.num_classes < 0)
      throw UserError("TFRecord " + dir + ": num_classes = " + std::to_string(o.num_classes) +
                      " must be >= 0");
    const std::vector<std::string> names = list_shards(dir, o.train);
    reserve_descriptors(names.size());
    shards_.resize(names.size());
    first_.assign(names.size() + 1, 0);
    for (size_t k = 0; k < names.size(); ++k) {
      Shard& s = shards_[k];
      s.name = names[k];
      s.path = dir + "/" + names[k];
      IndexResult r = index_of(dir, names[k], o.index_dir, true);
      s.recs = std::move(r.recs);
      ++kinds_[r.kind];
      if (!r.note.empty()) notes_ += (notes_.empty() ? "" : "; ") + r.note;
      s.fd = ::open(s.path.c_str(), O_RDONLY | O_CLOEXEC);
      if (s.fd < 0)
        throw UserError(s.path + ": cannot open: " + std::strerror(errno) +
                        (errno == EMFILE ? " (too many open files: raise `ulimit -n`)" : ""));
      first_[k + 1] = first_[k] + (int64_t)s.recs.size();
    }
    if (first_.back() == 0)
      throw UserError("TFRecord directory " + dir + ": the " + (train_ ? "train" : "validation") +
                      " shards hold no records");
  }

  ~TfRecordSource() override {
    for (Shard& s : shards_)
      if (s.fd >= 0) ::close(s.fd);
  }

  int64_t size() const override { return first_.back(); }
  int num_classes() const override { return K_; }
  std::vector<std::string> class_names() const override { return {}; }

  void read(int64_t i, std::vector<uint8_t>& bytes, int32_t& label) const override {
    size_t k = 0;
    const Record& r = locate(i, k);
    const Shard& s = shards_[k];
    std::vector<uint8_t> buf((size_t)r.size);
    if (!pread_all(s.fd, buf.data(), buf.size(), r.offset, s.path))
      throw record_error(s.path, r.offset, "cut off (the shard is shorter than its index says)");
    const uint64_t len = check_frame(buf.data(), r.size, s.path, r.offset);
    tensorflow::Example ex;
    if (len > (uint64_t)INT_MAX)
      throw record_error(s.path, r.offset,
                         "record of " + std::to_string(len) + " bytes: too large");
    if (!ex.ParseFromArray(buf.data() + 12, (int)len))
      throw record_error(s.path, r.offset, "not a tf.train.Example");
    const auto& f = ex.features().feature();
    const auto enc = f.find("image/encoded");
    if (enc == f.end() || enc->second.kind_case() != tensorflow::Feature::kBytesList ||
        enc->second.bytes_list().value_size() != 1)
      throw record_error(s.path, r.offset, "no bytes feature image/encoded");
    const auto lab = f.find("image/class/label");
    if (lab == f.end() || lab->second.kind_case() != tensorflow::Feature::kInt64List ||
        lab->second.int64_list().value_size() != 1)
      throw record_error(s.path, r.offset, "no int64 feature image/class/label");
    const int64_t stored = lab->second.int64_list().value(0);
    const int64_t l = stored + label_offset_;
    if (l < 0 || (K_ > 0 && l >= K_))
      throw record_error(s.path, r.offset,
                         "label " + std::to_string(l) + " (stored " + std::to_string(stored) +
                             (label_offset_ >= 0 ? " + " : " - ") +
                             std::to_string(std::abs(label_offset_)) + ") outside [0, " +
                             (K_ > 0 ? std::to_string(K_) : std::string("inf")) + ")" +
                             (K_ > 0 ? " (model.num_classes)" : "") + ": check the label offset");
    const std::string& b = enc->second.bytes_list().value(0);
    bytes.assign(b.begin(), b.end());
    label = (int32_t)l;
  }

  std::string where(int64_t i) const override {
    size_t k = 0;
    const Record& r = locate(i, k);
    return shards_[k].path + " record " + std::to_string(i - first_[k]) + " at offset " +
           std::to_string(r.offset);
  }

  std::string describe() const override {
    std::string d = "tfrecord(" + dir_ + ", " + (train_ ? "train" : "validation") + ", " +
                    std::to_string(shards_.size()) + " shards, " + std::to_string(size()) +
                    " records, classes=" + (K_ > 0 ? std::to_string(K_) : std::string("?")) +
                    ", label offset " + std::to_string(label_offset_) +
                    ", indexes: " + std::to_string(kinds_[IndexResult::Beside]) + " beside, " +
                    std::to_string(kinds_[IndexResult::Cached]) + " cached, " +
                    std::to_string(kinds_[IndexResult::Built]) + " built";
    if (!notes_.empty()) d += "; " + notes_;
    return d + ")";
  }

 private:
  struct Shard {
    std::string name, path;
    std::vector<Record> recs;
    int fd = -1;
  };

  const Record& locate(int64_t i, size_t& k) const {
    if (i < 0 || i >= size())
      throw std::out_of_range("TFRecord " + dir_ + ": index " + std::to_string(i) +
                              " outside [0, " + std::to_string(size()) + ")");
    k = (size_t)(std::upper_bound(first_.begin(), first_.end(), i) - first_.begin()) - 1;
    return shards_[k].recs[(size_t)(i - first_[k])];
  }

  std::string dir_;
  bool train_;
  int label_offset_;
  int K_;
  std::vector<Shard> shards_;
  std::vector<int64_t> first_;  // global index of each shard's first record; back() = size
  int64_t kinds_[3] = {0, 0, 0};
  std::string notes_;
};

}  // namespace

std::unique_ptr<ImageSource> open_tfrecord(const std::string& dir, const ImageSourceOptions& o) {
  return std::make_unique<TfRecordSource>(dir, o);
}

void tfrecord_build_indexes(const std::string& dir, const std::string& index_dir, bool train,
                            int part, int parts) {
  if (parts < 1 || part < 0 || part >= parts)
    throw std::invalid_argument("tfrecord_build_indexes: part " + std::to_string(part) + " of " +
                                std::to_string(parts));
  if (index_dir.empty()) return;
  const std::vector<std::string> names = list_shards(dir, train);
  for (size_t k = (size_t)part; k < names.size(); k += (size_t)parts) {
    IndexResult r = index_of(dir, names[k], index_dir, true);
    if (!r.note.empty())
      std::fprintf(stderr, "vitgrid: TFRecord %s: %s\n", dir.c_str(), r.note.c_str());
  }
}

}  // namespace vitgrid
