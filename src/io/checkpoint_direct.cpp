// The checkpoint's bulk data written past HDF5 (checkpoint.direct_io): HDF5 lays the file out
// (every dataset contiguous and allocated at creation, never filled), and while it goes on
// with the checksums and the metadata, threads of each rank write the bytes of its tensors at
// their file offsets with positioned writes: whole aligned pages with O_DIRECT from aligned
// buffers (no page cache: the disk's own rate, as FastPersist and torch's FileSystemWriter
// with O_DIRECT do; several requests in flight per rank), a range's unaligned edges buffered.
// Once HDF5 has closed the file, the writers are joined and the file fsynced.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "checkpoint_internal.h"
#include "vitgrid/core/watchdog.h"

namespace vitgrid {
namespace ckpt_detail {

void file_runs(const TensorShard& s, std::vector<std::pair<int64_t, int64_t>>* runs) {
  runs->clear();
  const size_t r = s.global_shape.size();
  if (r == 0) {
    runs->push_back({0, 1});
    return;
  }
  // per dimension: the selected coordinates as segments [start, start + len), in selection
  // order, adjacent ones merged
  const bool is_strided = strided(s);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> seg(r);
  for (size_t d = 0; d < r; ++d) {
    const int64_t n = is_strided ? s.count[d] : 1;
    for (int64_t c = 0; c < n; ++c) {
      const int64_t st = is_strided ? s.offset[d] + c * s.stride[d] : s.offset[d];
      const int64_t len = is_strided ? s.block[d] : s.count[d];
      if (len <= 0) return;  // nothing selected
      if (!seg[d].empty() && seg[d].back().first + seg[d].back().second == st)
        seg[d].back().second += len;
      else
        seg[d].push_back({st, len});
    }
    if (seg[d].empty()) return;
  }
  auto whole = [&](size_t d) {
    return seg[d].size() == 1 && seg[d][0].first == 0 && seg[d][0].second == s.global_shape[d];
  };
  // j: the last dimension not taken whole; the dimensions after it make each run longer
  size_t j = r;
  while (j > 0 && whole(j - 1)) --j;
  if (j == 0) {  // the whole tensor
    int64_t n = 1;
    for (int64_t e : s.global_shape) n *= e;
    runs->push_back({0, n});
    return;
  }
  --j;
  int64_t inner = 1;
  for (size_t d = j + 1; d < r; ++d) inner *= s.global_shape[d];
  // the coordinates of the dimensions before j, each tuple in row-major order
  std::vector<std::vector<int64_t>> coords(j);
  for (size_t d = 0; d < j; ++d)
    for (const auto& g : seg[d])
      for (int64_t k = 0; k < g.second; ++k) coords[d].push_back(g.first + k);
  std::vector<size_t> pos(j, 0);
  for (;;) {
    int64_t base = 0;
    for (size_t d = 0; d < j; ++d) base = base * s.global_shape[d] + coords[d][pos[d]];
    for (const auto& g : seg[j])
      runs->push_back({(base * s.global_shape[j] + g.first) * inner, g.second * inner});
    size_t d = j;
    while (d > 0 && ++pos[d - 1] == coords[d - 1].size()) pos[--d] = 0;
    if (d == 0) return;
  }
}

std::vector<int64_t> chunk_proposal(const TensorShard& s, size_t min_run_bytes) {
  const size_t r = s.global_shape.size();
  if (!s.write || s.elements() == 0) return {};
  std::vector<int64_t> none(r, 0);
  if (r == 0) return none;
  std::vector<std::pair<int64_t, int64_t>> runs;
  file_runs(s, &runs);
  const bool is_strided = strided(s);
  // the blocks: several along the first axis at most (a strided qkv's q, k, v), each then one
  // contiguous piece of s.data
  const int64_t blocks = is_strided ? s.count[0] : 1;
  if (runs.size() <= static_cast<size_t>(blocks) ||
      static_cast<size_t>(s.elements()) * sizeof(float) >= runs.size() * min_run_bytes)
    return none;
  std::vector<int64_t> chunk(r);
  int64_t bytes = sizeof(float);
  for (size_t d = 0; d < r; ++d) {
    chunk[d] = is_strided ? s.block[d] : s.count[d];
    if (chunk[d] <= 0 || s.global_shape[d] % chunk[d] != 0 || s.offset[d] % chunk[d] != 0)
      return none;
    if (is_strided && (d > 0 ? s.count[d] != 1 : s.stride[0] % chunk[0] != 0)) return none;
    bytes *= chunk[d];
  }
  if (bytes >= (int64_t(1) << 32)) return none;  // HDF5's largest chunk is 4 GiB - 1
  return chunk;
}

std::vector<std::vector<int64_t>> agree_chunk_shapes(MPI_Comm comm,
                                                     const std::vector<TensorShard>& shards,
                                                     size_t min_run_bytes) {
  // one MIN all-reduce over (proposal, -proposal) per dimension: equal everywhere iff
  // min == max; a rank writing nothing of a tensor proposes (+inf, -inf)
  std::vector<int64_t> v;
  for (const TensorShard& s : shards) {
    const std::vector<int64_t> p = chunk_proposal(s, min_run_bytes);
    for (size_t d = 0; d < s.global_shape.size(); ++d) {
      v.push_back(p.empty() ? INT64_MAX : p[d]);
      v.push_back(p.empty() ? INT64_MAX : -p[d]);
    }
  }
  if (!v.empty())
    watched("an MPI all-reduce of the checkpoint I/O", [&] {
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_INT64_T,
                              MPI_MIN, comm));
    });
  std::vector<std::vector<int64_t>> out(shards.size());
  size_t k = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const size_t r = shards[i].global_shape.size();
    bool chunked = r > 0;
    std::vector<int64_t> c(r);
    for (size_t d = 0; d < r; ++d, k += 2) {
      c[d] = v[k];
      chunked = chunked && v[k] > 0 && v[k] != INT64_MAX && v[k] == -v[k + 1];
    }
    if (chunked) out[i] = std::move(c);
  }
  return out;
}

void direct_ranges(const TensorShard& s, const std::vector<int64_t>& chunk,
                   const std::vector<uint64_t>& addr, std::vector<FileRange>* out) {
  if (!s.write || s.elements() == 0) return;
  if (chunk.empty()) {
    VG_CHECK(addr.size() == 1, "tensor '" << s.name << "' has no file offset");
    std::vector<std::pair<int64_t, int64_t>> runs;
    file_runs(s, &runs);
    const float* from = s.data;
    for (const auto& run : runs) {
      out->push_back({addr[0] + uint64_t(run.first) * sizeof(float), from,
                      size_t(run.second) * sizeof(float)});
      from += run.second;
    }
    VG_CHECK(from - s.data == s.elements(),
             "shard '" << s.name << "': its file runs do not cover its elements");
    return;
  }
  const size_t r = s.global_shape.size();
  const bool is_strided = strided(s);
  int64_t per = 1;
  for (int64_t c : chunk) per *= c;
  const int64_t blocks = is_strided ? s.count[0] : 1;
  VG_CHECK(per * blocks == s.elements(), "shard '" << s.name << "' does not fit its chunks");
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t index = 0;
    for (size_t d = 0; d < r; ++d) {
      const int64_t at = s.offset[d] + (d == 0 && is_strided ? b * s.stride[0] : 0);
      VG_CHECK(at % chunk[d] == 0, "shard '" << s.name << "' does not fit its chunks");
      index = index * (s.global_shape[d] / chunk[d]) + at / chunk[d];
    }
    VG_CHECK(static_cast<size_t>(index) < addr.size(),
             "shard '" << s.name << "': chunk " << index << " has no file offset");
    out->push_back({addr[index], s.data + b * per, size_t(per) * sizeof(float)});
  }
}

namespace {
constexpr size_t kPage = 4096;

std::string errno_text(const char* what, const std::string& path) {
  return std::string(what) + " '" + path + "': " + std::strerror(errno);
}

bool pwrite_all(int fd, const char* p, size_t n, off_t at) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, at);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (w == 0) errno = EIO;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
    at += w;
  }
  return true;
}
}  // namespace

DirectWriter::DirectWriter(const std::string& path, std::vector<FileRange> ranges, int threads,
                           size_t piece_bytes, size_t min_direct)
    : path_(path), piece_(std::max(piece_bytes / kPage, size_t(1)) * kPage) {
  if (ranges.empty()) return;
  fd_ = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd_ < 0) {
    error_ = errno_text("cannot open", path);
    return;
  }
  // a file system without O_DIRECT (tmpfs) takes every byte buffered
  dfd_ = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_DIRECT);
  for (const FileRange& rg : ranges) {
    const char* src = static_cast<const char*>(rg.data);
    const size_t begin = rg.offset, end = rg.offset + rg.bytes;
    // [a, b): the whole pages inside the range, written direct; the edges buffered
    size_t a = (begin + kPage - 1) / kPage * kPage, b = end / kPage * kPage;
    if (dfd_ < 0 || a >= b || b - a < min_direct) a = b = end;
    if (a > begin) pieces_.push_back({begin, src, a - begin, false});
    if (end > b) pieces_.push_back({b, src + (b - begin), end - b, false});
    for (size_t at = a; at < b; at += piece_)
      pieces_.push_back({at, src + (at - begin), std::min(piece_, b - at), true});
  }
  // The buffered pieces first, in file order (copies into the page cache: quick), their
  // writeback started as soon as they are in (sync_file_range) so that it runs beside the
  // direct writes; then the direct ones, the largest first: the threads end together.
  std::stable_sort(pieces_.begin(), pieces_.end(), [](const Piece& x, const Piece& y) {
    if (x.direct != y.direct) return !x.direct;
    return x.direct ? x.bytes > y.bytes : x.offset < y.offset;
  });
  buffered_ = static_cast<size_t>(
      std::count_if(pieces_.begin(), pieces_.end(), [](const Piece& p) { return !p.direct; }));
  const size_t n = std::min<size_t>(std::max(threads, 1), pieces_.size());
  for (size_t k = 0; k < n; ++k) threads_.emplace_back([this] { work(); });
}

void DirectWriter::fail(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_.empty()) error_ = why;
  stop_.store(true);
}

void DirectWriter::work() {
  void* bounce = nullptr;
  if (dfd_ >= 0 && posix_memalign(&bounce, kPage, piece_) != 0) {
    fail("cannot allocate the O_DIRECT buffer for '" + path_ + "'");
    return;
  }
  for (size_t i; !stop_.load() && (i = next_.fetch_add(1)) < pieces_.size();) {
    const Piece& p = pieces_[i];
    bool ok;
    if (p.direct) {
      std::memcpy(bounce, p.data, p.bytes);
      ok = pwrite_all(dfd_, static_cast<const char*>(bounce), p.bytes, static_cast<off_t>(p.offset));
    } else {
      ok = pwrite_all(fd_, p.data, p.bytes, static_cast<off_t>(p.offset));
    }
    if (!ok) fail(errno_text("cannot write", path_));
    // the last buffered piece is in: the page cache's writeback begins beside the direct ones
    if (ok && i + 1 == buffered_) ::sync_file_range(fd_, 0, 0, SYNC_FILE_RANGE_WRITE);
  }
  std::free(bounce);
}

void DirectWriter::join() {
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

std::string DirectWriter::finish() {
  join();
  std::string err = error_;
  if (fd_ >= 0) {
    if (err.empty() && ::fsync(fd_) != 0) err = errno_text("cannot sync", path_);
    if (::close(fd_) != 0 && err.empty()) err = errno_text("cannot close", path_);
    fd_ = -1;
  }
  if (dfd_ >= 0) ::close(dfd_);
  dfd_ = -1;
  return err;
}

DirectWriter::~DirectWriter() {
  stop_.store(true);
  join();
  if (fd_ >= 0) ::close(fd_);
  if (dfd_ >= 0) ::close(dfd_);
}

}  // namespace ckpt_detail
}  // namespace vitgrid
