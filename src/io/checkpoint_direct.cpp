// The checkpoint's bulk data written past HDF5 (checkpoint.direct_io): HDF5 lays the file out
// (every dataset contiguous and allocated at creation, never filled), the metadata is written
// and the file closed collectively, then each rank writes the bytes of its tensors at their
// file offsets with positioned writes: whole aligned pages with O_DIRECT from an aligned
// bounce buffer (no page cache: the disk's own rate, as FastPersist and torch's
// FileSystemWriter with O_DIRECT do), a range's unaligned edges buffered. Then fsync.
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
constexpr size_t kBounce = size_t(8) << 20;  // the O_DIRECT bounce buffer

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

std::string write_ranges(const std::string& path, const std::vector<FileRange>& ranges) {
  if (ranges.empty()) return "";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return errno_text("cannot open", path);
  // a file system without O_DIRECT (tmpfs) takes every byte buffered
  int dfd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_DIRECT);
  void* bounce = nullptr;
  if (dfd >= 0 && posix_memalign(&bounce, kPage, kBounce) != 0) {
    ::close(dfd);
    dfd = -1;
    bounce = nullptr;
  }
  std::string err;
  for (const FileRange& rg : ranges) {
    const char* src = static_cast<const char*>(rg.data);
    const size_t begin = rg.offset, end = rg.offset + rg.bytes;
    // [a, b): the whole pages inside the range, written direct; the edges buffered
    size_t a = (begin + kPage - 1) / kPage * kPage, b = end / kPage * kPage;
    if (dfd < 0 || a >= b) a = b = end;
    if (!pwrite_all(fd, src, a - begin, static_cast<off_t>(begin)) ||
        !pwrite_all(fd, src + (b - begin), end - b, static_cast<off_t>(b))) {
      err = errno_text("cannot write", path);
      break;
    }
    for (size_t at = a; at < b && err.empty(); at += kBounce) {
      const size_t n = std::min(kBounce, b - at);
      std::memcpy(bounce, src + (at - begin), n);
      if (!pwrite_all(dfd, static_cast<const char*>(bounce), n, static_cast<off_t>(at)))
        err = errno_text("cannot write", path);
    }
    if (!err.empty()) break;
  }
  std::free(bounce);
  if (dfd >= 0) ::close(dfd);
  if (err.empty() && ::fsync(fd) != 0) err = errno_text("cannot sync", path);
  if (::close(fd) != 0 && err.empty()) err = errno_text("cannot close", path);
  return err;
}

}  // namespace ckpt_detail
}  // namespace vitgrid
