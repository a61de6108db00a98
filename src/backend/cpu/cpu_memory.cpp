// CpuBackend: construction, memory accounting, copies and dtype casts.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "vitgrid/backend/cpu/cpu_backend.h"
#include "vitgrid/backend/cpu/emulate16.h"
#include "vitgrid/core/error.h"
#include "vitgrid/core/log.h"

namespace vitgrid {

CpuBackend::CpuBackend(DType act) : act_(act) {}

CpuBackend::~CpuBackend() {
  // Buffers still alive belong to callers that outlive us only by mistake; free them so a
  // long test run does not leak, since nobody can release them through us afterwards.
  for (auto& kv : live_) std::free(kv.first);
}

void CpuBackend::round_act(float* p, size_t n) const { round_buffer(act_, p, n); }

void* CpuBackend::alloc(size_t bytes) {
  // 64-byte alignment (a cache line, an AVX-512 vector) and a size rounded up to it, as
  // aligned_alloc requires; a zero-byte request still returns a distinct valid pointer.
  const size_t sz = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, sz);
  if (!p) {
    std::ostringstream os;
    os << "cpu backend: out of memory allocating " << bytes << " bytes (" << current_bytes_
       << " bytes already allocated)";
    throw UserError(os.str());
  }
  std::lock_guard<std::mutex> lock(mem_mutex_);
  live_[p] = sz;
  ++allocations_;
  current_bytes_ += sz;
  if (current_bytes_ > peak_bytes_) peak_bytes_ = current_bytes_;
  return p;
}

void CpuBackend::release(void* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mem_mutex_);
  auto it = live_.find(p);
  // Releasing a pointer we did not hand out is a programming error that would corrupt the heap.
  VG_CHECK(it != live_.end(), "cpu backend: release of a pointer not from alloc()");
  current_bytes_ -= it->second;
  live_.erase(it);
  std::free(p);
}

size_t CpuBackend::peak_memory_bytes() const {
  std::lock_guard<std::mutex> lock(mem_mutex_);
  return peak_bytes_;
}

int CpuBackend::mark() {
  marks_.push_back(now_s());
  return static_cast<int>(marks_.size()) - 1;
}

double CpuBackend::seconds_between(int a, int b) {
  VG_CHECK(a >= 0 && b >= 0 && size_t(std::max(a, b)) < marks_.size(),
           "cpu backend: marks " << a << ", " << b << " of " << marks_.size());
  return marks_[b] - marks_[a];
}

void* CpuBackend::staging(int slot, size_t bytes) {
  VG_CHECK(slot >= 0, "cpu backend: staging slot " << slot);
  if (static_cast<size_t>(slot) >= staging_.size()) staging_.resize(slot + 1);
  if (staging_[slot].size() < bytes) staging_[slot].resize(bytes);
  return staging_[slot].data();
}

void CpuBackend::upload_async(int slot, void* dst, size_t bytes) {
  VG_CHECK(slot >= 0 && static_cast<size_t>(slot) < staging_.size() && staging_[slot].size() >= bytes,
           "cpu backend: upload of " << bytes << " bytes from staging slot " << slot);
  if (bytes) std::memcpy(dst, staging_[slot].data(), bytes);
}

size_t CpuBackend::current_memory_bytes() const {
  std::lock_guard<std::mutex> lock(mem_mutex_);
  return current_bytes_;
}

void CpuBackend::copy_to_device(void* dst, const void* src_host, size_t bytes) {
  OpScope op_scope(*this, "copy_to_device");
  if (bytes) std::memcpy(dst, src_host, bytes);
}
void CpuBackend::copy_to_host(void* dst_host, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst_host, src, bytes);
}
void CpuBackend::copy(void* dst, const void* src, size_t bytes) {
  OpScope op_scope(*this, "copy");
  // memmove: callers may copy within one planned buffer, possibly overlapping.
  if (bytes && dst != src) std::memmove(dst, src, bytes);
}
void CpuBackend::zero(void* p, size_t bytes) {
  OpScope op_scope(*this, "zero");
  if (bytes) std::memset(p, 0, bytes);
}

void CpuBackend::cast_to_act(void* dst_act, const float* src, size_t n) {
  OpScope op_scope(*this, "cast_to_act");
  float* d = static_cast<float*>(dst_act);
  if (d != src) std::memmove(d, src, n * sizeof(float));
  round_act(d, n);
}

void CpuBackend::cast_to_f32(float* dst, const void* src_act, size_t n) {
  OpScope op_scope(*this, "cast_to_f32");
  // Act values are already representable (rounded when written), so this is a plain copy.
  if (dst != src_act) std::memmove(dst, src_act, n * sizeof(float));
}

}  // namespace vitgrid
