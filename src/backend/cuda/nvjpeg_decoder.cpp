// NvjpegDecoder: the CUDA backend's ImageDecoder. A batch is decoded by one nvjpegDecodeBatched
// call (the hardware JPEG engines, NVJPG, with NVJPEG_BACKEND_HARDWARE on A100/H100; else the
// GPU-assisted hybrid or the default backend) into planar RGB in a device buffer, then
// cropped, resized (Pillow's filter, bit-exact on the same pixels) and mirrored by the two
// kernels of image_resize.cu, all on the decoder's own thread and stream; join() makes the
// backend's compute stream wait for it.
//
// Host side per batch: each JPEG's header is parsed (nvjpegJpegStreamParseHeader) to size the
// buffers and to refuse what the decoder in use cannot take (progressive, CMYK, truncated
// files, ...): those slots go back to the caller, who decodes them on the CPU. Buffers grow
// (rarely: to 5/4 of the need) and are never freed in steady state. Three "in flight" slots,
// each with its own nvJPEG state, planar buffer and pinned job table, let the next batches be
// enqueued while one decodes; a slot is reused only after its previous batch completed (on the
// host's word: the hardware engines write when called, not in stream order).
#include "nvjpeg_decoder.h"

#include <cuda_runtime.h>
#include <nvjpeg.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <cstring>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "vitgrid/backend/cuda/cuda_check.h"

namespace vitgrid {
namespace cuda {

namespace {

const char* nvjpeg_status_name(nvjpegStatus_t s) {
  switch (s) {
    case NVJPEG_STATUS_SUCCESS: return "NVJPEG_STATUS_SUCCESS";
    case NVJPEG_STATUS_NOT_INITIALIZED: return "NVJPEG_STATUS_NOT_INITIALIZED";
    case NVJPEG_STATUS_INVALID_PARAMETER: return "NVJPEG_STATUS_INVALID_PARAMETER";
    case NVJPEG_STATUS_BAD_JPEG: return "NVJPEG_STATUS_BAD_JPEG";
    case NVJPEG_STATUS_JPEG_NOT_SUPPORTED: return "NVJPEG_STATUS_JPEG_NOT_SUPPORTED";
    case NVJPEG_STATUS_ALLOCATOR_FAILURE: return "NVJPEG_STATUS_ALLOCATOR_FAILURE";
    case NVJPEG_STATUS_EXECUTION_FAILED: return "NVJPEG_STATUS_EXECUTION_FAILED";
    case NVJPEG_STATUS_ARCH_MISMATCH: return "NVJPEG_STATUS_ARCH_MISMATCH";
    case NVJPEG_STATUS_INTERNAL_ERROR: return "NVJPEG_STATUS_INTERNAL_ERROR";
    case NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED:
      return "NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED";
    case NVJPEG_STATUS_INCOMPLETE_BITSTREAM: return "NVJPEG_STATUS_INCOMPLETE_BITSTREAM";
  }
  return "unknown nvJPEG status";
}

}  // namespace

#define NVJPEG_CHECK(call)                                                                 \
  do {                                                                                     \
    nvjpegStatus_t vg_s_ = (call);                                                         \
    if (vg_s_ != NVJPEG_STATUS_SUCCESS)                                                    \
      VG_FAIL("nvJPEG error in " #call ": " << ::vitgrid::cuda::nvjpeg_status_name(vg_s_)  \
                                            << " (" << static_cast<int>(vg_s_) << ")");     \
  } while (0)

namespace {

constexpr int kSlots = 3;        // calls (decode_async / copy_async) in flight
constexpr int kMaxTaps = 200;    // larger filters (downscaling > ~50x) go to the CPU
constexpr size_t kAlign = 256;

size_t align_up(size_t n) { return (n + kAlign - 1) & ~(kAlign - 1); }

// Whether the file ends with EOI after its entropy-coded data: scanning back from the end,
// the first marker (0xFF followed by neither a stuffed 0x00, a restart marker nor fill) must
// be EOI. A truncated file ends inside a scan, where the first marker back is SOS; nvJPEG would
// decode the missing part as grey where libjpeg-turbo (the CPU path) refuses the file. Trailing
// bytes after EOI may hide it: such files are refused too (the CPU decodes them).
bool ends_with_eoi(const uint8_t* p, size_t n) {
  if (n < 4) return false;
  for (size_t i = n - 1; i-- > 0;) {
    if (p[i] != 0xFF) continue;
    const uint8_t m = p[i + 1];
    if (m == 0x00 || m == 0xFF || (m >= 0xD0 && m <= 0xD7)) continue;
    return m == 0xD9;
  }
  return false;
}

// nvJPEG's chroma subsampling as data/image_decode.h's (sub_h, sub_v); false if not a plain one.
bool css_factors(nvjpegChromaSubsampling_t css, int* h, int* v) {
  switch (css) {
    case NVJPEG_CSS_444: *h = 1, *v = 1; return true;
    case NVJPEG_CSS_422: *h = 2, *v = 1; return true;
    case NVJPEG_CSS_420: *h = 2, *v = 2; return true;
    case NVJPEG_CSS_440: *h = 1, *v = 2; return true;
    case NVJPEG_CSS_411: *h = 4, *v = 1; return true;
    case NVJPEG_CSS_GRAY: *h = 0, *v = 0; return true;
    default: return false;
  }
}

// The planar-RGB region one decoded image takes (three planes even for grayscale: nvJPEG's
// RGB output of a one-component image may fill all three).
size_t decoded_bytes(int W, int H) { return align_up(static_cast<size_t>(W) * H * 3); }

// The bytes of a host region's rows, from its first pixel to its last.
size_t region_bytes(const HostRegion& g) {
  return g.stride * static_cast<size_t>(g.h - 1) + static_cast<size_t>(g.w) * 3;
}

class NvjpegDecoder final : public ImageDecoder {
 public:
  NvjpegDecoder(int device, cudaStream_t join_stream, const NvjpegDecoderOptions& opts)
      : device_(device), join_(join_stream), opts_(opts) {}

  // False (and a line on stderr) when no nvJPEG backend can be created on this device.
  bool init() {
    CUDA_CHECK(cudaSetDevice(device_));
    if (!opts_.jpeg) {
      CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      for (Slot& s : slots_) CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
      return true;
    }
    const unsigned flags_pref = opts_.interpolate_chroma ? NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION
                                                         : NVJPEG_FLAGS_DEFAULT;
    std::vector<nvjpegBackend_t> order;
    if (opts_.prefer_hardware) order.push_back(NVJPEG_BACKEND_HARDWARE);
    order.push_back(NVJPEG_BACKEND_GPU_HYBRID);
    order.push_back(NVJPEG_BACKEND_DEFAULT);
    nvjpegStatus_t last = NVJPEG_STATUS_SUCCESS;
    for (nvjpegBackend_t b : order) {
      for (unsigned flags : {flags_pref, static_cast<unsigned>(NVJPEG_FLAGS_DEFAULT)}) {
        last = nvjpegCreateEx(b, nullptr, nullptr, flags, &handle_);
        if (last == NVJPEG_STATUS_SUCCESS) {
          backend_ = b;
          flags_ = flags;
          break;
        }
        handle_ = nullptr;
        if (flags == NVJPEG_FLAGS_DEFAULT) break;
      }
      if (handle_) break;
    }
    if (!handle_) {
      std::fprintf(stderr, "vitgrid: nvJPEG unavailable on device %d (%s): JPEGs decode on the host\n",
                   device_, nvjpeg_status_name(last));
      return false;
    }
    if (backend_ == NVJPEG_BACKEND_HARDWARE) {
      if (nvjpegGetHardwareDecoderInfo(handle_, &hw_engines_, &hw_cores_) != NVJPEG_STATUS_SUCCESS)
        hw_engines_ = hw_cores_ = 0;
    }
    NVJPEG_CHECK(nvjpegJpegStreamCreate(handle_, &parse_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (Slot& s : slots_) {
      NVJPEG_CHECK(nvjpegJpegStateCreate(handle_, &s.state));
      CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    }
    return true;
  }

  ~NvjpegDecoder() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    if (worker_.joinable()) worker_.join();  // finishes the tasks it was given
    // Destructors report, never abort (the job may be unwinding).
    cudaSetDevice(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    for (Slot& s : slots_) {
      if (s.state) nvjpegJpegStateDestroy(s.state);
      if (s.done) cudaEventDestroy(s.done);
      if (s.jobs_host) cudaFreeHost(s.jobs_host);
      if (s.staging) cudaFreeHost(s.staging);
    }
    for (Release& r : released_) cudaEventDestroy(r.event);
    for (Slot& s : slots_) release_buffer(reinterpret_cast<void**>(&s.decoded), &s.decoded_cap);
    release_buffer(reinterpret_cast<void**>(&tmp_), &tmp_cap_);
    size_t jobs_bytes = jobs_dev_cap_ * sizeof(ResizeJob);
    release_buffer(reinterpret_cast<void**>(&jobs_dev_), &jobs_bytes);
    if (parse_) nvjpegJpegStreamDestroy(parse_);
    if (handle_) nvjpegDestroy(handle_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  bool accepts(int components, bool progressive, int sub_h, int sub_v) const override {
    if (!handle_ || progressive) return false;
    if (components == 1) return true;
    if (components != 3) return false;  // CMYK / YCCK: not in nvjpegDecodeBatched's reach
    const bool plain = (sub_h == 1 || sub_h == 2) && (sub_v == 1 || sub_v == 2);
    if (plain) return true;
    // 4:1:1: the hybrid decoders take it, the hardware engine does not
    return backend_ != NVJPEG_BACKEND_HARDWARE && sub_h == 4 && sub_v == 1;
  }

  // The work of one decode_async, on the worker thread: returns the jobs it could not decode.
  std::vector<int> run_decode(const DecodeJob* jobs, int n, int S, int interp, uint8_t* out_dev) {
    VG_CHECK(n >= 0 && S > 0 && (interp == 0 || interp == 1) && (n == 0 || out_dev),
             "decode_async: n " << n << ", S " << S << ", interp " << interp);
    std::vector<int> refused;
    if (n == 0) return refused;
    if (!handle_) {  // resizing alone: every JPEG is the host's
      for (int i = 0; i < n; ++i) refused.push_back(i);
      return refused;
    }
    // ---- headers: what nvJPEG takes, and each image's size
    acc_.clear();
    for (int i = 0; i < n; ++i) {
      Accepted a;
      if (!inspect(jobs[i], S, interp, &a)) {
        refused.push_back(i);
        continue;
      }
      a.job = i;
      acc_.push_back(a);
    }
    // ---- buffers: decoded planes and the horizontal pass's rows, one region per image
    size_t dec_need = 0, tmp_need = 0;
    int kcap_h = 1, kcap_v = 1, max_rows = 1;
    for (Accepted& a : acc_) {
      a.dec_off = dec_need;
      dec_need += decoded_bytes(a.W, a.H);
      a.tmp_off = tmp_need;
      tmp_need += align_up(static_cast<size_t>(a.tmp_rows) * S * 3);
      kcap_h = std::max(kcap_h, a.kh);
      kcap_v = std::max(kcap_v, a.kv);
      max_rows = std::max(max_rows, a.tmp_rows);
    }
    Slot& slot = next_slot();  // after the host work above: it may wait for an older batch
    grow(reinterpret_cast<void**>(&slot.decoded), &slot.decoded_cap, dec_need);
    grow(reinterpret_cast<void**>(&tmp_), &tmp_cap_, tmp_need);
    // ---- decode: one batched call, the engines fed by subsampling then size (as NVIDIA's
    // own decoders order a batch); failed images found by retrying one at a time
    decode(slot, jobs, &refused);
    if (acc_.empty()) {
      std::sort(refused.begin(), refused.end());
      return refused;
    }
    // ---- crop / resize / flip into out_dev
    const int m = static_cast<int>(acc_.size());
    ensure_jobs(slot, m);
    for (int k = 0; k < m; ++k) {
      const Accepted& a = acc_[k];
      const DecodeJob& jb = jobs[a.job];
      ResizeJob& r = slot.jobs_host[k];
      r = ResizeJob{};
      uint8_t* base = slot.decoded + a.dec_off;
      r.plane = static_cast<size_t>(a.W) * a.H;
      r.pitch = a.W;
      r.src = base + static_cast<size_t>(a.cy) * a.W + a.cx;
      fill_resize_job(a, S, jb.slot, jb.flip, out_dev, &r);
    }
    enqueue_resize(slot, m, S, interp, kcap_h, kcap_v, max_rows, out_dev);
    std::sort(refused.begin(), refused.end());
    return refused;
  }

  bool resizes(double box_w, double box_h, int S, int interp) const override {
    if (!(box_w > 0 && box_h > 0) || S <= 0) return false;
    // the taps of one output: the box's extent over S per axis (Pillow's ksize, + 2), with
    // room for the whole-axis resize of a ResizeThenCrop box
    const int kh = resize_taps_bound(interp, 0, 0.0f, static_cast<float>(box_w), S);
    const int kv = resize_taps_bound(interp, 0, 0.0f, static_cast<float>(box_h), S);
    return std::max(kh, kv) + 2 <= kMaxTaps;
  }

  // The work of one resize_async, on the worker thread: the regions go through the slot's
  // pinned staging into its device buffer in one copy, then the resize kernels.
  void run_resize(const HostRegion* regs, int n, int S, int interp, uint8_t* out_dev) {
    VG_CHECK(n >= 0 && S > 0 && (interp == 0 || interp == 1) && (n == 0 || out_dev),
             "resize_async: n " << n << ", S " << S << ", interp " << interp);
    if (n == 0) return;
    acc_.clear();
    size_t dec_need = 0, tmp_need = 0;
    int kcap_h = 1, kcap_v = 1, max_rows = 1;
    for (int i = 0; i < n; ++i) {
      const HostRegion& g = regs[i];
      Accepted a;
      a.job = i;
      a.W = g.W, a.H = g.H;
      VG_CHECK(g.pixels && g.w > 0 && g.h > 0 && g.stride >= static_cast<size_t>(g.w) * 3 &&
                   g.x0 >= 0 && g.y0 >= 0 && g.x0 + g.w <= g.W && g.y0 + g.h <= g.H &&
                   geometry(g.mode, g.bx0, g.by0, g.bx1, g.by1, S, interp, &a),
               "resize_async: region " << i << " (" << g.w << " x " << g.h << " at " << g.x0 << ", "
                                       << g.y0 << " of " << g.W << " x " << g.H << ", mode "
                                       << g.mode << ") is not one the device resizes");
      a.dec_off = dec_need;
      dec_need += align_up(region_bytes(g));
      a.tmp_off = tmp_need;
      tmp_need += align_up(static_cast<size_t>(a.tmp_rows) * S * 3);
      kcap_h = std::max(kcap_h, a.kh);
      kcap_v = std::max(kcap_v, a.kv);
      max_rows = std::max(max_rows, a.tmp_rows);
      acc_.push_back(a);
    }
    Slot& slot = next_slot();
    if (slot.staging_bytes < dec_need) {
      if (slot.staging) CUDA_CHECK(cudaFreeHost(slot.staging));
      slot.staging_bytes = dec_need + dec_need / 4;
      CUDA_CHECK(cudaMallocHost(&slot.staging, slot.staging_bytes));
    }
    for (const Accepted& a : acc_) {
      const HostRegion& g = regs[a.job];
      std::memcpy(slot.staging + a.dec_off, g.pixels, region_bytes(g));
    }
    grow(reinterpret_cast<void**>(&slot.decoded), &slot.decoded_cap, dec_need);
    grow(reinterpret_cast<void**>(&tmp_), &tmp_cap_, tmp_need);
    CUDA_CHECK(
        cudaMemcpyAsync(slot.decoded, slot.staging, dec_need, cudaMemcpyHostToDevice, stream_));
    ensure_jobs(slot, n);
    for (int k = 0; k < n; ++k) {
      const Accepted& a = acc_[k];
      const HostRegion& g = regs[a.job];
      ResizeJob& r = slot.jobs_host[k];
      r = ResizeJob{};
      r.src = slot.decoded + a.dec_off;
      r.pitch = static_cast<int>(g.stride);
      r.step = 3;
      r.plane = 1;
      r.org_x = g.x0 - a.cx;
      r.org_y = g.y0 - a.cy;
      fill_resize_job(a, S, g.slot, g.flip, out_dev, &r);
    }
    enqueue_resize(slot, n, S, interp, kcap_h, kcap_v, max_rows, out_dev);
  }

  // The work of one copy_async, on the worker thread.
  void run_copy(const uint8_t* const* host_images, const int* slots, int n, int S,
                uint8_t* out_dev) {
    VG_CHECK(n >= 0 && S > 0, "copy_async: n " << n << ", S " << S);
    if (n == 0) return;
    Slot& slot = next_slot();
    const size_t img = static_cast<size_t>(S) * S * 3;
    const size_t need = img * n;
    if (slot.staging_bytes < need) {
      if (slot.staging) CUDA_CHECK(cudaFreeHost(slot.staging));
      slot.staging_bytes = need + need / 4;
      CUDA_CHECK(cudaMallocHost(&slot.staging, slot.staging_bytes));
    }
    for (int k = 0; k < n; ++k) std::memcpy(slot.staging + k * img, host_images[k], img);
    wait_release(out_dev);
    // consecutive slots go in one copy
    for (int k = 0; k < n;) {
      int e = k + 1;
      while (e < n && slots[e] == slots[e - 1] + 1) ++e;
      CUDA_CHECK(cudaMemcpyAsync(out_dev + static_cast<size_t>(slots[k]) * img,
                                 slot.staging + k * img, (e - k) * img, cudaMemcpyHostToDevice,
                                 stream_));
      k = e;
    }
    finish(slot);
  }

  // decode_async / copy_async hand their work to one worker thread, in order: nvJPEG's batched
  // hardware decode holds the calling thread until the engines are done (~17 ms per 256
  // ImageNet-sized images on an H100), which on the training thread would keep it from
  // enqueueing the next step. The bitstreams and host images stay the caller's until join().
  void decode_async(const DecodeJob* jobs, int n, int S, int interp, uint8_t* out_dev) override {
    VG_CHECK(n >= 0 && S > 0 && (interp == 0 || interp == 1) && (n == 0 || out_dev),
             "decode_async: n " << n << ", S " << S << ", interp " << interp);
    if (n == 0) return;
    std::vector<DecodeJob> copy(jobs, jobs + n);
    submit([this, copy, S, interp, out_dev] {
      for (int i : run_decode(copy.data(), static_cast<int>(copy.size()), S, interp, out_dev))
        refused_slots_.push_back(copy[i].slot);
    });
  }

  void resize_async(const HostRegion* regions, int n, int S, int interp,
                    uint8_t* out_dev) override {
    VG_CHECK(n >= 0 && S > 0 && (interp == 0 || interp == 1) && (n == 0 || out_dev),
             "resize_async: n " << n << ", S " << S << ", interp " << interp);
    if (n == 0) return;
    std::vector<HostRegion> copy(regions, regions + n);
    submit([this, copy, S, interp, out_dev] {
      run_resize(copy.data(), static_cast<int>(copy.size()), S, interp, out_dev);
    });
  }

  void copy_async(const uint8_t* const* host_images, const int* slots, int n, int S,
                  uint8_t* out_dev) override {
    VG_CHECK(n >= 0 && S > 0, "copy_async: n " << n << ", S " << S);
    if (n == 0) return;
    std::vector<const uint8_t*> images(host_images, host_images + n);
    std::vector<int> where(slots, slots + n);
    submit([this, images, where, S, out_dev] {
      run_copy(images.data(), where.data(), static_cast<int>(images.size()), S, out_dev);
    });
  }

  std::vector<int> join() override {
    std::unique_lock<std::mutex> lock(mu_);
    idle_.wait(lock, [&] { return tasks_.empty() && !busy_; });
    if (error_) {  // a task failed on the worker: its error is the caller's, once
      std::exception_ptr e = nullptr;
      std::swap(e, error_);
      refused_slots_.clear();
      std::rethrow_exception(e);
    }
    if (last_ >= 0) CUDA_CHECK(cudaStreamWaitEvent(join_, slots_[last_].done, 0));
    std::vector<int> refused;
    refused.swap(refused_slots_);
    std::sort(refused.begin(), refused.end());
    return refused;
  }

  void release_output(const uint8_t* out_dev) override {
    std::lock_guard<std::mutex> lock(release_mu_);
    Release* r = release_of(out_dev);
    if (!r) {
      released_.push_back(Release{out_dev, nullptr, false});
      r = &released_.back();
      CUDA_CHECK(cudaEventCreateWithFlags(&r->event, cudaEventDisableTiming));
    }
    CUDA_CHECK(cudaEventRecord(r->event, join_));
    r->pending = true;
  }

  std::string describe() const override {
    if (!handle_) return "Pillow resize on the GPU (no JPEG decoder)";
    std::ostringstream os;
    switch (backend_) {
      case NVJPEG_BACKEND_HARDWARE:
        os << "nvJPEG hardware engine";
        if (hw_engines_) os << " (" << hw_engines_ << " engines x " << hw_cores_ << " cores)";
        break;
      case NVJPEG_BACKEND_GPU_HYBRID: os << "nvJPEG hybrid (CUDA Huffman decode)"; break;
      default: os << "nvJPEG default (host Huffman decode, CUDA IDCT)"; break;
    }
    if (flags_ & NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION) os << ", interpolated chroma";
    os << "; Pillow resize on the GPU";
    return os.str();
  }

 private:
  struct Slot {
    nvjpegJpegState_t state = nullptr;
    cudaEvent_t done = nullptr;
    int init_batch = -1;             // the batch size `state` was initialised for
    bool pending = false;            // `done` recorded and not yet waited for on the host
    ResizeJob* jobs_host = nullptr;  // pinned
    int jobs_cap = 0;
    uint8_t* staging = nullptr;      // pinned, copy_async
    size_t staging_bytes = 0;
    // planar RGB of the call's images, one buffer per slot: nvJPEG's hardware engines write
    // their destination when nvjpegDecodeBatched is called, not in the stream's order, so the
    // buffer must be free on the host's word (next_slot() waits for the slot's last use) and
    // not merely on the stream's
    uint8_t* decoded = nullptr;
    size_t decoded_cap = 0;
  };
  struct Accepted {
    int job = 0;
    int W = 0, H = 0, gray = 0;
    int css = 0;
    int cx = 0, cy = 0, cw = 0, ch = 0;  // the source region the resize sees (mode 1: the cut)
    float bx0 = 0, by0 = 0, bx1 = 0, by1 = 0;  // the box within that region
    int rx = 0, ry = 0, ox = 0, oy = 0;        // ResizeJob's
    int tmp_rows = 0, kh = 0, kv = 0;
    size_t dec_off = 0, tmp_off = 0;
  };

  Slot& next_slot() {
    const int i = next_;
    next_ = (next_ + 1) % kSlots;
    Slot& s = slots_[i];
    if (s.pending) {
      CUDA_CHECK(cudaEventSynchronize(s.done));  // its nvJPEG state and pinned tables are free
      s.pending = false;
    }
    cur_ = i;
    return s;
  }

  void finish(Slot& s) {
    CUDA_CHECK(cudaEventRecord(s.done, stream_));
    s.pending = true;
    last_ = cur_;
  }

  // Writes into out_dev wait for the last release of that buffer (its last reader), not for
  // the other buffers' readers: batch k+1 is written while batch k computes.
  void wait_release(const uint8_t* out_dev) {
    std::lock_guard<std::mutex> lock(release_mu_);
    Release* r = release_of(out_dev);
    if (!r || !r->pending) return;
    CUDA_CHECK(cudaStreamWaitEvent(stream_, r->event, 0));
    r->pending = false;
  }
  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!worker_.joinable()) worker_ = std::thread([this] { work(); });
      tasks_.push_back(std::move(task));
    }
    wake_.notify_one();
  }

  void work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
      lock.unlock();
      std::exception_ptr failed = nullptr;
      try {
        CUDA_CHECK(cudaSetDevice(device_));  // per task: cheap, and its failure is reported
        task();
      } catch (...) {
        failed = std::current_exception();
      }
      lock.lock();
      if (failed && !error_) error_ = failed;
      busy_ = false;
      if (tasks_.empty()) idle_.notify_all();
    }
  }

  struct Release {
    const uint8_t* out = nullptr;
    cudaEvent_t event = nullptr;
    bool pending = false;
  };
  Release* release_of(const uint8_t* out_dev) {
    for (Release& r : released_)
      if (r.out == out_dev) return &r;
    return nullptr;
  }

  // Header checks; fills the image's size and the resize geometry. False: refused.
  bool inspect(const DecodeJob& jb, int S, int interp, Accepted* a) {
    if (!jb.data || !ends_with_eoi(jb.data, jb.size)) return false;
    if (nvjpegJpegStreamParseHeader(handle_, jb.data, jb.size, parse_) != NVJPEG_STATUS_SUCCESS)
      return false;
    nvjpegJpegEncoding_t enc = NVJPEG_ENCODING_UNKNOWN;
    unsigned comps = 0, w = 0, h = 0;
    nvjpegChromaSubsampling_t css = NVJPEG_CSS_UNKNOWN;
    if (nvjpegJpegStreamGetJpegEncoding(parse_, &enc) != NVJPEG_STATUS_SUCCESS ||
        nvjpegJpegStreamGetComponentsNum(parse_, &comps) != NVJPEG_STATUS_SUCCESS ||
        nvjpegJpegStreamGetFrameDimensions(parse_, &w, &h) != NVJPEG_STATUS_SUCCESS ||
        nvjpegJpegStreamGetChromaSubsampling(parse_, &css) != NVJPEG_STATUS_SUCCESS)
      return false;
    if (enc != NVJPEG_ENCODING_BASELINE_DCT && enc != NVJPEG_ENCODING_EXTENDED_SEQUENTIAL_DCT_HUFFMAN)
      return false;
    int sh = 0, sv = 0;
    if (!css_factors(css, &sh, &sv) || !accepts(static_cast<int>(comps), false, sh, sv)) return false;
    unsigned precision = 8;
    if (nvjpegJpegStreamGetSamplePrecision(parse_, &precision) == NVJPEG_STATUS_SUCCESS &&
        precision != 8)
      return false;
    if (backend_ == NVJPEG_BACKEND_HARDWARE) {
      int unsupported = -1;
      if (nvjpegDecodeBatchedSupported(handle_, parse_, &unsupported) != NVJPEG_STATUS_SUCCESS ||
          unsupported != 0)
        return false;
    }
    if (w == 0 || h == 0 || w > 65535 || h > 65535) return false;
    a->W = static_cast<int>(w);
    a->H = static_cast<int>(h);
    a->gray = comps == 1;
    a->css = static_cast<int>(css);
    return geometry(jb.mode, jb.x0, jb.y0, jb.x1, jb.y1, S, interp, a);
  }

  // The resize of box (x0, y0, x1, y1) of mode `mode` of the a->W x a->H image (data/
  // image_transform.cpp, per BoxMode): CropThenResize cuts the rounded box out; ResizeThenCrop
  // keeps the window [off, off + S) of the whole axis resized to r. False: refused.
  static bool geometry(int mode, double x0, double y0, double x1, double y1, int S, int interp,
                       Accepted* a) {
    a->cx = 0, a->cy = 0, a->cw = a->W, a->ch = a->H;
    a->rx = S, a->ry = S, a->ox = 0, a->oy = 0;
    if (mode == 1) {
      const int cx0 = static_cast<int>(std::nearbyint(x0)),
                cy0 = static_cast<int>(std::nearbyint(y0));
      const int cx1 = static_cast<int>(std::nearbyint(x1)),
                cy1 = static_cast<int>(std::nearbyint(y1));
      if (cx0 < 0 || cy0 < 0 || cx1 > a->W || cy1 > a->H || cx1 <= cx0 || cy1 <= cy0) return false;
      a->cx = cx0, a->cy = cy0, a->cw = cx1 - cx0, a->ch = cy1 - cy0;
      a->bx0 = 0, a->by0 = 0, a->bx1 = static_cast<float>(a->cw), a->by1 = static_cast<float>(a->ch);
    } else if (mode == 2) {
      auto window = [S](int in_size, double b0, double b1, int* r, int* off) {
        if (!(b1 > b0)) return false;
        *r = static_cast<int>(std::nearbyint(in_size * static_cast<double>(S) / (b1 - b0)));
        *off = static_cast<int>(std::nearbyint(b0 * *r / in_size));
        return *r >= S && *off >= 0 && *off + S <= *r;
      };
      if (!window(a->W, x0, x1, &a->rx, &a->ox) || !window(a->H, y0, y1, &a->ry, &a->oy))
        return false;
      a->bx0 = 0, a->by0 = 0, a->bx1 = static_cast<float>(a->W), a->by1 = static_cast<float>(a->H);
    } else if (mode == 0) {
      a->bx0 = static_cast<float>(x0), a->by0 = static_cast<float>(y0);
      a->bx1 = static_cast<float>(x1), a->by1 = static_cast<float>(y1);
      if (!(a->bx0 >= 0 && a->by0 >= 0 && a->bx1 <= a->W && a->by1 <= a->H && a->bx1 > a->bx0 &&
            a->by1 > a->by0))
        return false;
    } else {
      return false;
    }
    a->kh = resize_taps_bound(interp, a->cw, a->bx0, a->bx1, a->rx);
    a->kv = resize_taps_bound(interp, a->ch, a->by0, a->by1, a->ry);
    if (a->kh > kMaxTaps || a->kv > kMaxTaps) return false;
    a->tmp_rows = static_cast<int>(
        resize_tmp_rows_bound(interp, a->ch, a->by0, a->by1, a->ry, a->oy, S));
    return true;
  }

  // The slot's n resize jobs to the device and the resize kernels after them, once out_dev's
  // last reader is past; the slot is busy until they are done.
  void enqueue_resize(Slot& slot, int n, int S, int interp, int kcap_h, int kcap_v, int max_rows,
                      uint8_t* out_dev) {
    CUDA_CHECK(cudaMemcpyAsync(jobs_dev_, slot.jobs_host, n * sizeof(ResizeJob),
                               cudaMemcpyHostToDevice, stream_));
    wait_release(out_dev);
    launch_resize(jobs_dev_, n, S, interp, kcap_h, kcap_v, max_rows, stream_);
    finish(slot);
  }

  // The geometry, buffers and output of one image's ResizeJob (its source already set).
  void fill_resize_job(const Accepted& a, int S, int slot, int flip, uint8_t* out_dev,
                       ResizeJob* r) const {
    r->W = a.cw;
    r->H = a.ch;
    r->x0 = a.bx0, r->y0 = a.by0, r->x1 = a.bx1, r->y1 = a.by1;
    r->rx = a.rx, r->ry = a.ry, r->ox = a.ox, r->oy = a.oy;
    r->tmp = tmp_ + a.tmp_off;
    r->tmp_rows = a.tmp_rows;
    r->dst = out_dev + static_cast<size_t>(slot) * S * S * 3;
    r->gray = a.gray;
    r->flip = flip ? 1 : 0;
  }

  // nvjpegDecodeBatched of acc_ into slot.decoded; images it fails on are moved to *refused.
  void decode(Slot& slot, const DecodeJob* jobs, std::vector<int>* refused) {
    if (acc_.empty()) return;
    order_.resize(acc_.size());
    std::iota(order_.begin(), order_.end(), 0);
    std::sort(order_.begin(), order_.end(), [&](int p, int q) {
      const Accepted& a = acc_[p];
      const Accepted& b = acc_[q];
      if (a.css != b.css) return a.css < b.css;
      return static_cast<int64_t>(a.W) * a.H > static_cast<int64_t>(b.W) * b.H;
    });
    const int m = static_cast<int>(acc_.size());
    data_.resize(m);
    lengths_.resize(m);
    images_.resize(m);
    for (int k = 0; k < m; ++k) {
      const Accepted& a = acc_[order_[k]];
      data_[k] = jobs[a.job].data;
      lengths_[k] = jobs[a.job].size;
      nvjpegImage_t& im = images_[k];
      std::memset(&im, 0, sizeof(im));
      uint8_t* base = slot.decoded + a.dec_off;
      const size_t plane = static_cast<size_t>(a.W) * a.H;
      for (int c = 0; c < 3; ++c) {
        im.channel[c] = base + c * plane;
        im.pitch[c] = static_cast<size_t>(a.W);
      }
    }
    if (slot.init_batch != m) {
      NVJPEG_CHECK(nvjpegDecodeBatchedInitialize(handle_, slot.state, m, 1, NVJPEG_OUTPUT_RGB));
      slot.init_batch = m;
    }
    const nvjpegStatus_t st =
        nvjpegDecodeBatched(handle_, slot.state, data_.data(), lengths_.data(), images_.data(), stream_);
    if (st == NVJPEG_STATUS_SUCCESS) return;
    // One bad bitstream fails the whole call: find it (rare; the engines are then fed one
    // image per call until the batch is through).
    std::vector<char> bad(acc_.size(), 0);
    for (int k = 0; k < m; ++k) {
      NVJPEG_CHECK(nvjpegDecodeBatchedInitialize(handle_, slot.state, 1, 1, NVJPEG_OUTPUT_RGB));
      slot.init_batch = 1;
      if (nvjpegDecodeBatched(handle_, slot.state, &data_[k], &lengths_[k], &images_[k], stream_) !=
          NVJPEG_STATUS_SUCCESS)
        bad[order_[k]] = 1;
      CUDA_CHECK(cudaStreamSynchronize(stream_));  // the state is reused by the next image
    }
    size_t w = 0;
    for (size_t k = 0; k < acc_.size(); ++k) {
      if (bad[k]) {
        refused->push_back(acc_[k].job);
      } else {
        acc_[w++] = acc_[k];
      }
    }
    acc_.resize(w);
  }

  // A device buffer of at least `need` bytes; growing waits for the work that uses the old one.
  void grow(void** p, size_t* cap, size_t need) {
    if (need <= *cap) return;
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    release_buffer(p, cap);
    const size_t bytes = align_up(need + need / 4);
    CUDA_CHECK(cudaMalloc(p, bytes));
    *cap = bytes;
    if (opts_.count_memory) opts_.count_memory(static_cast<int64_t>(bytes));
  }

  void release_buffer(void** p, size_t* cap) {
    if (!*p) return;
    cudaFree(*p);
    if (opts_.count_memory) opts_.count_memory(-static_cast<int64_t>(*cap));
    *p = nullptr;
    *cap = 0;
  }

  void ensure_jobs(Slot& slot, int m) {
    if (slot.jobs_cap < m) {
      if (slot.jobs_host) CUDA_CHECK(cudaFreeHost(slot.jobs_host));
      slot.jobs_cap = m + m / 4;
      CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&slot.jobs_host),
                                slot.jobs_cap * sizeof(ResizeJob)));
    }
    if (jobs_dev_cap_ < m) {
      size_t bytes = jobs_dev_cap_ * sizeof(ResizeJob);
      grow(reinterpret_cast<void**>(&jobs_dev_), &bytes, m * sizeof(ResizeJob));
      jobs_dev_cap_ = static_cast<int>(bytes / sizeof(ResizeJob));
    }
  }

  const int device_;
  const cudaStream_t join_;
  const NvjpegDecoderOptions opts_;
  nvjpegHandle_t handle_ = nullptr;
  nvjpegBackend_t backend_ = NVJPEG_BACKEND_DEFAULT;
  unsigned flags_ = 0;
  unsigned hw_engines_ = 0, hw_cores_ = 0;
  nvjpegJpegStream_t parse_ = nullptr;  // header parsing (host only)
  cudaStream_t stream_ = nullptr;
  Slot slots_[kSlots];
  int next_ = 0, cur_ = 0, last_ = -1;
  std::vector<Release> released_;  // per output buffer (a few: the trainer's upload slots)
  std::mutex release_mu_;          // released_: the caller records, the worker waits
  // the worker thread and its queue; refused_slots_ is the worker's until join() takes it
  std::mutex mu_;
  std::condition_variable wake_, idle_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false, stop_ = false;
  std::thread worker_;
  std::vector<int> refused_slots_;
  std::exception_ptr error_ = nullptr;  // the first task's error, until join() rethrows it
  uint8_t* tmp_ = nullptr;      // the horizontal pass's rows
  size_t tmp_cap_ = 0;
  ResizeJob* jobs_dev_ = nullptr;
  int jobs_dev_cap_ = 0;
  // per-batch host arrays, kept to reuse their storage
  std::vector<Accepted> acc_;
  std::vector<int> order_;
  std::vector<const unsigned char*> data_;
  std::vector<size_t> lengths_;
  std::vector<nvjpegImage_t> images_;
};

}  // namespace

std::unique_ptr<ImageDecoder> make_nvjpeg_decoder(int device, cudaStream_t join_stream,
                                                  const NvjpegDecoderOptions& opts) {
  auto d = std::make_unique<NvjpegDecoder>(device, join_stream, opts);
  if (!d->init()) return nullptr;
  return d;
}

}  // namespace cuda
}  // namespace vitgrid
