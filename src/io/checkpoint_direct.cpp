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

namespace vitgrid {
namespace ckpt_detail {

bool contiguous_range(const TensorShard& s, int64_t* first, int64_t* elems) {
  const size_t r = s.global_shape.size();
  // the selection as one box [lo, lo + len) per dimension, if it is one
  std::vector<int64_t> lo(r), len(r);
  for (size_t d = 0; d < r; ++d) {
    if (s.stride.empty() || s.block.empty() || s.count[d] == 1) {
      lo[d] = s.offset[d];
      len[d] = s.count[d] * (s.block.empty() ? 1 : s.block[d]);
    } else if (s.stride[d] == s.block[d]) {
      lo[d] = s.offset[d];
      len[d] = s.count[d] * s.block[d];
    } else {
      return false;  // blocks with gaps between them
    }
  }
  // row-major: one range when, past the first dimension with more than one index, every
  // dimension is whole
  size_t k = 0;
  while (k < r && len[k] == 1) ++k;
  for (size_t d = k + 1; d < r; ++d)
    if (lo[d] != 0 || len[d] != s.global_shape[d]) return false;
  int64_t f = 0, n = 1;
  for (size_t d = 0; d < r; ++d) {
    f = f * s.global_shape[d] + lo[d];
    n *= len[d];
  }
  *first = f;
  *elems = n;
  return true;
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
                           size_t piece_bytes)
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
    if (dfd_ < 0 || a >= b) a = b = end;
    if (a > begin) pieces_.push_back({begin, src, a - begin, false});
    if (end > b) pieces_.push_back({b, src + (b - begin), end - b, false});
    for (size_t at = a; at < b; at += piece_)
      pieces_.push_back({at, src + (at - begin), std::min(piece_, b - at), true});
  }
  // the largest first: the threads end together
  std::stable_sort(pieces_.begin(), pieces_.end(),
                   [](const Piece& x, const Piece& y) { return x.bytes > y.bytes; });
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
