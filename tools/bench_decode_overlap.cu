// bench_decode_overlap: does nvJPEG's batched hardware decode overlap a busy GPU? A "training"
// thread runs chains of bf16 GEMMs (ViT-B/32-like shapes, 144 per step, eager or as one CUDA
// graph) on its stream; a decoder thread decodes batches of 256 JPEGs with nvjpegDecodeBatched
// (NVJPEG_BACKEND_HARDWARE) on another. Each variant prints the decoder's img/s and the GEMMs'
// TFLOP/s; variants: output RGB or YUV, stream priorities, the GEMMs confined to part of the SMs
// (a green context), caching allocators given to nvJPEG (nvjpegCreateEx, nvjpegCreateExV2),
// nvJPEG's own stream-ordered memory pools (NVJPEG_FLAGS_ENABLE_MEMORY_POOLS: cudaFreeAsync
// instead of frees that wait for the whole device), the hardware path's buffers sized ahead
// (nvjpegDecodeBatchedPreAllocate), the decoder in a green context of its own ("green"), and
// two decoders that are not the batched hardware one: nvJPEG's decoupled hybrid path on T host
// threads (Huffman on the CPU, IDCT on the GPU: "split"), and libjpeg-turbo's whole decode on T
// threads ("turbo", host only). With tools/ktrace's VITGRID_KTRACE_API=1 it shows where the
// decoding thread waits. tools/MEASURED.md ("H100: real images") has the figures.
//
//   nvcc -std=c++17 -O2 -arch=sm_90 tools/bench_decode_overlap.cu -o bench_decode_overlap \
//        -lcublas -lnvjpeg -lcuda -ljpeg
//   ./bench_decode_overlap DIR [NAME]  # DIR: a tree of JPEGs (the first 2048 found are used);
//                                      # NAME: only the variants whose name holds it
//                                      # (or one of its '|'-separated parts; "=X": named X)
// or `tools/gpu_check.sh decode_overlap`.
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvjpeg.h>
#include <cstdio>
#include <jpeglib.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <string>
#include <thread>
#include <vector>
#include <fstream>
#include <sstream>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
#define NJ(x) do { nvjpegStatus_t e = (x); if (e != NVJPEG_STATUS_SUCCESS) { printf("%s:%d nvjpeg %d\n", __FILE__, __LINE__, (int)e); exit(1);} } while (0)
#define CU(x) do { CUresult e = (x); if (e != CUDA_SUCCESS) { const char* s; cuGetErrorString(e, &s); printf("%s:%d %s\n", __FILE__, __LINE__, s); exit(1);} } while (0)
#define CB(x) do { cublasStatus_t e = (x); if (e != CUBLAS_STATUS_SUCCESS) { printf("%s:%d cublas %d\n", __FILE__, __LINE__, (int)e); exit(1);} } while (0)

using clk = std::chrono::steady_clock;
static double secs(clk::time_point a) { return std::chrono::duration<double>(clk::now() - a).count(); }

std::vector<std::string> files;
std::vector<std::vector<unsigned char>> blobs;

void load(const std::string& root, int maxn) {
  std::vector<std::string> stack{root};
  while (!stack.empty() && (int)files.size() < maxn) {
    std::string d = stack.back(); stack.pop_back();
    DIR* dp = opendir(d.c_str()); if (!dp) continue;
    while (dirent* e = readdir(dp)) {
      std::string n = e->d_name; if (n == "." || n == "..") continue;
      std::string p = d + "/" + n;
      if (e->d_type == DT_DIR) stack.push_back(p);
      else if ((int)files.size() < maxn) files.push_back(p);
    }
    closedir(dp);
  }
  for (auto& f : files) {
    std::ifstream in(f, std::ios::binary); std::stringstream ss; ss << in.rdbuf();
    std::string s = ss.str(); blobs.emplace_back(s.begin(), s.end());
  }
}

struct Opts { bool yuv = false; int dec_prio = 0; int gemm_prio = 0; int green_sms = 0; bool graph = false; bool ahead = false; int alloc = 0; int prealloc = 0; int own_ctx = 0; int split = 0; int roi = 0; int dec_green = 0; };
// dec_green S: the decoder thread works in a green context of S SMs (cuGreenCtxCreate, then
// cuCtxFromGreenCtx made current): the primary context's memory, its own SMs, run beside the
// primary context's GEMMs rather than time-sliced with them; do its frees wait for them too?
// split T: no batched decoder; T host threads each run nvJPEG's decoupled hybrid path per image
// (DALI's "mixed" decoder): nvjpegDecodeJpegHost (Huffman decode on the CPU) into a pinned
// buffer, then the transfer and nvjpegDecodeJpegDevice (IDCT, colour conversion on the GPU) on
// the thread's own stream; two states per thread alternate so the next image's host stage runs
// while the last one's device stage does. roi 1: only a centred box of 60% of each side is
// decoded (nvjpegDecodeParamsSetROI), as a RandomResizedCrop's region would be.
// own_ctx 1: the decoder thread works in a context of its own (cuCtxCreate), so the cuMemFree
// calls nvJPEG makes wait only for that context's work; 2: as 1, and each batch's pixels are
// copied into a buffer of the GEMMs' (primary) context with cuMemcpyPeerAsync, as a trainer
// would need them.

// alloc 3: no allocators given, NVJPEG_FLAGS_ENABLE_MEMORY_POOLS instead.
// Caching allocators for nvJPEG (alloc 1: nvjpegCreateEx's, 2: nvjpegCreateExV2's): a freed
// block goes to a free list by size class (powers of two) and is handed out again, so nvJPEG's
// frees never reach cudaFree / cudaFreeHost (both synchronise with the whole device).
#include <map>
#include <mutex>
struct Cache {
  std::mutex mu;
  std::multimap<size_t, void*> free_;
  std::map<void*, size_t> cls_;
  bool pinned;
  static size_t cls(size_t n) { size_t c = 256; while (c < n) c <<= 1; return c; }
  int get(void** p, size_t n) {
    std::lock_guard<std::mutex> l(mu);
    const size_t c = cls(n);
    auto it = free_.find(c);
    if (it != free_.end()) { *p = it->second; free_.erase(it); return 0; }
    cudaError_t e = pinned ? cudaHostAlloc(p, c, cudaHostAllocDefault) : cudaMalloc(p, c);
    if (e != cudaSuccess) return 1;
    cls_[*p] = c;
    return 0;
  }
  int put(void* p) {
    if (!p) return 0;
    std::lock_guard<std::mutex> l(mu);
    free_.emplace(cls_.at(p), p);
    return 0;
  }
};
Cache g_dev{{}, {}, {}, false}, g_pin{{}, {}, {}, true};
int dev_malloc1(void** p, size_t n) { return g_dev.get(p, n); }
int dev_free1(void* p) { return g_dev.put(p); }
int pin_malloc1(void** p, size_t n, unsigned) { return g_pin.get(p, n); }
int pin_free1(void* p) { return g_pin.put(p); }
int dev_malloc2(void*, void** p, size_t n, cudaStream_t) { return g_dev.get(p, n); }
int dev_free2(void*, void* p, size_t, cudaStream_t) { return g_dev.put(p); }
int pin_malloc2(void*, void** p, size_t n, cudaStream_t) { return g_pin.get(p, n); }
int pin_free2(void*, void* p, size_t, cudaStream_t) { return g_pin.put(p); }

// GEMM "training": returns TFLOP/s over the window
struct Gemm {
  cublasHandle_t h; cudaStream_t s; __nv_bfloat16 *a, *b, *c;
  int M = 12800, N = 3072, K = 768;
  void init(cudaStream_t st) {
    s = st; CB(cublasCreate(&h)); CB(cublasSetStream(h, s));
    CK(cudaMalloc(&a, (size_t)M * 3072 * 2)); CK(cudaMalloc(&b, (size_t)N * K * 2)); CK(cudaMalloc(&c, (size_t)M * N * 2));
    CK(cudaMemset(a, 0, (size_t)M * 3072 * 2)); CK(cudaMemset(b, 0, (size_t)N * K * 2));
  }
  // one "step": 48 GEMMs (12 blocks x fc1, fc2, qkv, proj-like shapes)
  double step() {
    float al = 1, be = 0; double fl = 0;
    for (int l = 0; l < 12; ++l) {
      int shapes[4][3] = {{3072, 768, M}, {768, 3072, M}, {2304, 768, M}, {768, 768, M}};
      for (auto& sh : shapes) for (int rep = 0; rep < 3; ++rep) {  // fwd + 2 bwd GEMMs
        CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, sh[0], sh[2], sh[1], &al, b, CUDA_R_16BF, sh[0], a, CUDA_R_16BF, sh[1], &be, c, CUDA_R_16BF, sh[0], CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        fl += 2.0 * sh[0] * sh[1] * sh[2];
      }
    }
    return fl;
  }
};

struct Dec {
  nvjpegHandle_t h; nvjpegJpegState_t st; cudaStream_t s; unsigned char* out = nullptr; size_t cap = 0;
  std::vector<nvjpegImage_t> im; std::vector<const unsigned char*> d; std::vector<size_t> l;
  bool yuv;
  int init_n = -1;
  int prealloc = 0;
  void init(cudaStream_t stream, bool y, int alloc) {
    s = stream; yuv = y;
    if (alloc == 1) {
      nvjpegDevAllocator_t da{dev_malloc1, dev_free1};
      nvjpegPinnedAllocator_t pa{pin_malloc1, pin_free1};
      NJ(nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, &da, &pa, 0, &h));
    } else if (alloc == 2) {
      nvjpegDevAllocatorV2_t da{dev_malloc2, dev_free2, nullptr};
      nvjpegPinnedAllocatorV2_t pa{pin_malloc2, pin_free2, nullptr};
      NJ(nvjpegCreateExV2(NVJPEG_BACKEND_HARDWARE, &da, &pa, 0, &h));
    } else if (alloc == 3) {
      NJ(nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, nullptr, nullptr, NVJPEG_FLAGS_ENABLE_MEMORY_POOLS,
                        &h));
    } else {
      NJ(nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, nullptr, nullptr, 0, &h));
    }
    NJ(nvjpegJpegStateCreate(h, &st));
  }
  int batch(int first, int n) {
    im.resize(n); d.resize(n); l.resize(n);
    std::vector<size_t> off(n + 1, 0);
    std::vector<std::array<int, 6>> dims(n);
    for (int k = 0; k < n; ++k) {
      auto& b = blobs[(first + k) % blobs.size()];
      d[k] = b.data(); l[k] = b.size();
      int nc; nvjpegChromaSubsampling_t css; int w[4], hh[4];
      NJ(nvjpegGetImageInfo(h, b.data(), b.size(), &nc, &css, w, hh));
      dims[k] = {w[0], hh[0], nc > 1 ? w[1] : 0, nc > 1 ? hh[1] : 0, 0, 0};
      size_t need = yuv ? (size_t)w[0] * hh[0] + 2 * (size_t)dims[k][2] * dims[k][3] : (size_t)w[0] * hh[0] * 3;
      off[k + 1] = off[k] + ((need + 255) & ~size_t(255));
    }
    if (off[n] > cap) { if (out) CK(cudaFree(out)); cap = off[n] * 2; CK(cudaMalloc(&out, cap)); }
    for (int k = 0; k < n; ++k) {
      memset(&im[k], 0, sizeof(nvjpegImage_t));
      unsigned char* p = out + off[k]; int W = dims[k][0], H = dims[k][1];
      im[k].channel[0] = p; im[k].pitch[0] = W;
      if (yuv) {
        im[k].channel[1] = p + (size_t)W * H; im[k].pitch[1] = dims[k][2];
        im[k].channel[2] = p + (size_t)W * H + (size_t)dims[k][2] * dims[k][3]; im[k].pitch[2] = dims[k][2];
      } else {
        for (int c = 1; c < 3; ++c) { im[k].channel[c] = p + c * (size_t)W * H; im[k].pitch[c] = W; }
      }
    }
    if (n != init_n) {  // once per batch size, as vitgrid's decoder does
      NJ(nvjpegDecodeBatchedInitialize(h, st, n, 1, yuv ? NVJPEG_OUTPUT_YUV : NVJPEG_OUTPUT_RGB));
      init_n = n;
      if (prealloc > 0)  // the hardware decoder's internal buffers for n images up to P x P
        NJ(nvjpegDecodeBatchedPreAllocate(h, st, n, prealloc, prealloc, NVJPEG_CSS_420,
                                          yuv ? NVJPEG_OUTPUT_YUV : NVJPEG_OUTPUT_RGB));
    }
    NJ(nvjpegDecodeBatched(h, st, d.data(), l.data(), im.data(), s));
    CK(cudaStreamSynchronize(s));
    return n;
  }
};


struct SplitThread {
  nvjpegJpegDecoder_t dec = nullptr;
  nvjpegJpegState_t st[2] = {};
  nvjpegBufferPinned_t pin[2] = {};
  nvjpegBufferDevice_t dbuf[2] = {};
  nvjpegJpegStream_t js = nullptr;
  nvjpegDecodeParams_t par = nullptr;
  cudaStream_t s = nullptr;
  cudaEvent_t ev[2] = {};
  unsigned char* out[2] = {};
  size_t cap = (size_t)3 << 24;
  long n = 0;
  void init(nvjpegHandle_t h, bool prio_high) {
    int lo, hi; CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    NJ(nvjpegDecoderCreate(h, NVJPEG_BACKEND_HYBRID, &dec));
    for (int k = 0; k < 2; ++k) {
      NJ(nvjpegDecoderStateCreate(h, dec, &st[k]));
      NJ(nvjpegBufferPinnedCreate(h, nullptr, &pin[k]));
      NJ(nvjpegBufferDeviceCreate(h, nullptr, &dbuf[k]));
      NJ(nvjpegStateAttachPinnedBuffer(st[k], pin[k]));
      NJ(nvjpegStateAttachDeviceBuffer(st[k], dbuf[k]));
      CK(cudaEventCreateWithFlags(&ev[k], cudaEventDisableTiming));
      CK(cudaMalloc(&out[k], cap));
    }
    NJ(nvjpegJpegStreamCreate(h, &js));
    NJ(nvjpegDecodeParamsCreate(h, &par));
    NJ(nvjpegDecodeParamsSetOutputFormat(par, NVJPEG_OUTPUT_RGB));
    CK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, prio_high ? hi : lo));
  }
  void one(nvjpegHandle_t h, const std::vector<unsigned char>& b, int roi) {
    const int k = (int)(n & 1);
    if (n >= 2) CK(cudaEventSynchronize(ev[k]));  // state k's last device stage is done
    NJ(nvjpegJpegStreamParse(h, b.data(), b.size(), 0, 0, js));
    unsigned w = 0, hh = 0; NJ(nvjpegJpegStreamGetFrameDimensions(js, &w, &hh));
    int x0 = 0, y0 = 0, rw = (int)w, rh = (int)hh;
    if (roi) { rw = (int)(w * 0.6); rh = (int)(hh * 0.6); x0 = ((int)w - rw) / 2; y0 = ((int)hh - rh) / 2; }
    NJ(nvjpegDecodeParamsSetROI(par, x0, y0, roi ? rw : -1, roi ? rh : -1));
    NJ(nvjpegDecodeJpegHost(h, dec, st[k], par, js));
    NJ(nvjpegDecodeJpegTransferToDevice(h, dec, st[k], js, s));
    nvjpegImage_t im; memset(&im, 0, sizeof im);
    for (int c = 0; c < 3; ++c) { im.channel[c] = out[k] + (size_t)c * rw * rh; im.pitch[c] = rw; }
    NJ(nvjpegDecodeJpegDevice(h, dec, st[k], &im, s));
    CK(cudaEventRecord(ev[k], s));
    ++n;
  }
  void destroy() {
    CK(cudaStreamSynchronize(s));
    for (int k = 0; k < 2; ++k) {
      NJ(nvjpegJpegStateDestroy(st[k])); NJ(nvjpegBufferPinnedDestroy(pin[k]));
      NJ(nvjpegBufferDeviceDestroy(dbuf[k])); CK(cudaEventDestroy(ev[k])); CK(cudaFree(out[k]));
    }
    NJ(nvjpegJpegStreamDestroy(js)); NJ(nvjpegDecodeParamsDestroy(par)); NJ(nvjpegDecoderDestroy(dec));
    CK(cudaStreamDestroy(s));
  }
};

// The split decoder's threads beside the GEMMs: returns img/s over `seconds`
double run_split(const Opts& o, std::atomic<bool>& stop) {
  nvjpegHandle_t h;
  nvjpegDevAllocator_t da{dev_malloc1, dev_free1};
  nvjpegPinnedAllocator_t pa{pin_malloc1, pin_free1};
  NJ(nvjpegCreateEx(NVJPEG_BACKEND_DEFAULT, &da, &pa, 0, &h));
  std::vector<SplitThread> th(o.split);
  for (auto& t : th) t.init(h, o.dec_prio != 0);
  for (int i = 0; i < 4; ++i) for (auto& t : th) t.one(h, blobs[i % blobs.size()], o.roi);  // warm
  CK(cudaDeviceSynchronize());
  for (auto& t : th) t.n = 0;
  std::vector<std::thread> ws;
  auto t0 = clk::now();
  for (int j = 0; j < o.split; ++j) ws.emplace_back([&, j] {
    CK(cudaSetDevice(0));
    size_t i = (size_t)j * 97;
    while (!stop) th[j].one(h, blobs[i++ % blobs.size()], o.roi);
    CK(cudaStreamSynchronize(th[j].s));
  });
  for (auto& w : ws) w.join();
  const double sec = secs(t0);
  long n = 0;
  for (auto& t : th) { n += t.n; t.destroy(); }
  NJ(nvjpegDestroy(h));
  return n / sec;
}


// libjpeg-turbo's whole decode (ISLOW, fancy upsampling, RGB: the host loader's settings) on T
// threads, for the split decoder's host stage to be compared with; img/s over `seconds`.
double run_turbo(int T, double seconds) {
  std::atomic<bool> stop{false};
  std::vector<long> n(T, 0);
  std::vector<std::thread> ws;
  auto t0 = clk::now();
  for (int j = 0; j < T; ++j) ws.emplace_back([&, j] {
    std::vector<unsigned char> out;
    size_t i = (size_t)j * 97;
    while (!stop) {
      const auto& b = blobs[i++ % blobs.size()];
      jpeg_decompress_struct c; jpeg_error_mgr e; c.err = jpeg_std_error(&e);
      jpeg_create_decompress(&c); jpeg_mem_src(&c, b.data(), b.size()); jpeg_read_header(&c, TRUE);
      c.out_color_space = JCS_RGB; c.dct_method = JDCT_ISLOW; c.do_fancy_upsampling = TRUE;
      jpeg_start_decompress(&c);
      out.resize((size_t)c.output_width * c.output_height * 3);
      while (c.output_scanline < c.output_height) {
        JSAMPROW r = out.data() + (size_t)c.output_scanline * c.output_width * 3;
        jpeg_read_scanlines(&c, &r, 1);
      }
      jpeg_finish_decompress(&c); jpeg_destroy_decompress(&c);
      ++n[j];
    }
  });
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& w : ws) w.join();
  long tot = 0; for (long v : n) tot += v;
  return tot / secs(t0);
}

const char* g_only = nullptr;  // argv[2]: run only the variants whose name holds it

// Whether the variant `name` runs: every one without NAME; else those whose name holds one of
// NAME's '|'-separated parts ("=X": the variant named X alone).
bool selected(const std::string& name) {
  if (!g_only) return true;
  std::stringstream alts(g_only);
  for (std::string a; std::getline(alts, a, '|');)
    if (a[0] == '=' ? a.substr(1) == name : name.find(a) != std::string::npos) return true;
  return false;
}

void run(const char* name, Opts o, bool do_dec, bool do_gemm, double seconds) {
  if (!selected(name)) return;
  int lo, hi; CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t gs = nullptr, ds = nullptr;
  if (o.green_sms > 0) {
    CUdevice dev; CU(cuDeviceGet(&dev, 0));
    CUdevResource all, part, rest; unsigned ng = 1;
    CU(cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM));
    CU(cuDevSmResourceSplitByCount(&part, &ng, &all, &rest, 0, o.green_sms));
    CUdevResourceDesc desc; CU(cuDevResourceGenerateDesc(&desc, &part, 1));
    CUgreenCtx g; CU(cuGreenCtxCreate(&g, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
    CUstream cs; CU(cuGreenCtxStreamCreate(&cs, g, CU_STREAM_NON_BLOCKING, o.gemm_prio ? hi : 0));
    gs = (cudaStream_t)cs;
    printf("  green context: %u SMs for the GEMMs (of %u)\n", part.sm.smCount, all.sm.smCount);
  } else {
    CK(cudaStreamCreateWithPriority(&gs, cudaStreamNonBlocking, o.gemm_prio ? hi : lo));
  }
  CK(cudaStreamCreateWithPriority(&ds, cudaStreamNonBlocking, o.dec_prio ? hi : lo));
  static Gemm gm; static bool ginit = false;
  if (!ginit) { gm.init(gs); ginit = true; } gm.s = gs; CB(cublasSetStream(gm.h, gs));
  Dec dc;
  CUcontext primary = nullptr, own = nullptr;
  CU(cuCtxGetCurrent(&primary));
  unsigned char* dst = nullptr;  // the primary context's copy of each batch (own_ctx 2)
  const size_t dst_cap = (size_t)512 << 20;
  if (o.own_ctx == 2) CK(cudaMalloc(&dst, dst_cap));
  CUgreenCtx dec_gctx = nullptr;
  auto dec_setup = [&] {
    if (o.dec_green) {
      CUdevice dev; CU(cuDeviceGet(&dev, 0));
      CUdevResource all, part, rest; unsigned ng = 1;
      CU(cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM));
      CU(cuDevSmResourceSplitByCount(&part, &ng, &all, &rest, 0, o.dec_green));
      CUdevResourceDesc desc; CU(cuDevResourceGenerateDesc(&desc, &part, 1));
      CU(cuGreenCtxCreate(&dec_gctx, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
      CUcontext gc; CU(cuCtxFromGreenCtx(&gc, dec_gctx)); CU(cuCtxSetCurrent(gc));
      CUstream cs; CU(cuGreenCtxStreamCreate(&cs, dec_gctx, CU_STREAM_NON_BLOCKING, 0));
      dc.s = (cudaStream_t)cs;
      dc.init(dc.s, o.yuv, o.alloc);
      printf("  decoder in a green context of %u SMs\n", part.sm.smCount);
    } else if (o.own_ctx) {
      CUdevice dev; CU(cuDeviceGet(&dev, 0));
      CU(cuCtxCreate(&own, nullptr, 0, dev));
      CU(cuCtxSetCurrent(own));
      CK(cudaStreamCreateWithFlags(&dc.s, cudaStreamNonBlocking));
      dc.init(dc.s, o.yuv, o.alloc);
    } else {
      dc.init(ds, o.yuv, o.alloc);
    }
    dc.prealloc = o.prealloc;
    dc.batch(0, 256); dc.batch(256, 256);  // warm
  };
  auto dec_batch = [&](int i) {
    const int n = dc.batch(i, 256);
    if (o.own_ctx == 2) {
      CU(cuMemcpyPeerAsync((CUdeviceptr)dst, primary, (CUdeviceptr)dc.out, own,
                           std::min(dc.cap, dst_cap), (CUstream)dc.s));
      CK(cudaStreamSynchronize(dc.s));
    }
    return n;
  };
  auto dec_teardown = [&] {
    NJ(nvjpegJpegStateDestroy(dc.st));
    NJ(nvjpegDestroy(dc.h));
    if (dc.out) CK(cudaFree(dc.out));
    if (o.dec_green) {
      CK(cudaStreamDestroy(dc.s));
      CU(cuCtxSetCurrent(primary));
      CU(cuGreenCtxDestroy(dec_gctx));
    }
    if (o.own_ctx) {
      CK(cudaStreamDestroy(dc.s));
      CU(cuCtxSetCurrent(primary));
      CU(cuCtxDestroy(own));
    }
  };
  std::atomic<int> ready{0};
  const bool dec_thread_ctx = o.own_ctx || o.dec_green;  // set up on the decoder's thread
  if (o.split) ready = 1;
  else if (!dec_thread_ctx || !do_dec) { dec_setup(); ready = 1; }
  gm.step(); CK(cudaStreamSynchronize(gs));
  std::atomic<bool> stop{false};
  double flops = 0, gsec = 0; long imgs = 0; double dsec = 0;
  std::thread tg, td;
  if (do_gemm) tg = std::thread([&] {
    CK(cudaSetDevice(0));
    auto t = clk::now();
    cudaGraphExec_t ge = nullptr; double gf = 0;
    if (o.graph) {
      cudaGraph_t g; CK(cudaStreamBeginCapture(gs, cudaStreamCaptureModeThreadLocal));
      gf = gm.step(); CK(cudaStreamEndCapture(gs, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
    }
    cudaEvent_t ev[2]; CK(cudaEventCreateWithFlags(&ev[0], cudaEventDisableTiming)); CK(cudaEventCreateWithFlags(&ev[1], cudaEventDisableTiming));
    long it = 0;
    while (!stop) {
      if (o.graph) { CK(cudaGraphLaunch(ge, gs)); flops += gf; } else flops += gm.step();
      if (o.ahead) { CK(cudaEventRecord(ev[it & 1], gs)); if (it > 0) CK(cudaEventSynchronize(ev[(it - 1) & 1])); }
      else CK(cudaStreamSynchronize(gs));
      ++it;
    }
    CK(cudaStreamSynchronize(gs));
    gsec = secs(t);
  });
  if (do_dec && o.split) td = std::thread([&] {
    CK(cudaSetDevice(0));
    const double rate = run_split(o, stop);
    dsec = 1; imgs = (long)rate;
  });
  else if (do_dec) td = std::thread([&] {
    CK(cudaSetDevice(0));
    if (dec_thread_ctx) { dec_setup(); ready = 1; }
    auto t = clk::now(); int i = 0;
    while (!stop) { imgs += dec_batch(i); i += 256; }
    dsec = secs(t);
    if (dec_thread_ctx) dec_teardown();
  });
  while (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  if (tg.joinable()) tg.join();
  if (td.joinable()) td.join();
  printf("%-44s decode %8.0f img/s   gemm %6.1f TFLOP/s\n", name, do_dec ? imgs / dsec : 0.0,
         do_gemm ? flops / gsec / 1e12 : 0.0);
  fflush(stdout);
  CK(cudaDeviceSynchronize());
  if (!o.split && (!dec_thread_ctx || !do_dec)) dec_teardown();
  if (dst) CK(cudaFree(dst));
  CK(cudaStreamDestroy(ds));
  if (o.green_sms == 0) CK(cudaStreamDestroy(gs));  // a green context's stream stays with it
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_decode_overlap JPEG_DIR\n");
    return 2;
  }
  load(argv[1], 2048);
  if (argc > 2) g_only = argv[2];
  if (blobs.empty()) {
    std::fprintf(stderr, "bench_decode_overlap: no files under %s\n", argv[1]);
    return 2;
  }
  printf("%zu files\n", blobs.size());
  CK(cudaSetDevice(0)); CK(cudaFree(0)); CU(cuInit(0));
  double T = 4;
  run("gemm alone", {}, false, true, T);
  run("gemm graph alone, ahead", {false,0,0,0,true,true}, false, true, T);
  run("RGB + gemm eager, ahead", {false,0,0,0,false,true}, true, true, T);
  run("RGB + gemm graph, ahead", {false,0,0,0,true,true}, true, true, T);
  run("RGB + gemm graph, ahead, cache1", {false,0,0,0,true,true,1}, true, true, T);
  run("RGB + gemm graph, ahead, cache2", {false,0,0,0,true,true,2}, true, true, T);
  run("RGB + gemm graph, ahead, prealloc 1024", {false,0,0,0,true,true,0,1024}, true, true, T);
  run("RGB + gemm graph, ahead, prealloc 2048", {false,0,0,0,true,true,0,2048}, true, true, T);
  run("RGB + gemm graph, sync", {false,0,0,0,true,false}, true, true, T);
  run("RGB high + gemm graph, ahead", {false,1,0,0,true,true}, true, true, T);
  run("YUV + gemm graph, ahead", {true,0,0,0,true,true}, true, true, T);
  run("RGB + gemm graph green 120, ahead", {false,1,0,120,true,true}, true, true, T);
  run("RGB own ctx alone", {false,0,0,0,false,false,0,0,1}, true, false, T);
  run("RGB own ctx + gemm graph, ahead", {false,0,0,0,true,true,0,0,1}, true, true, T);
  run("RGB own ctx + copy + gemm graph, ahead", {false,0,0,0,true,true,0,0,2}, true, true, T);
  run("RGB own ctx + copy + gemm eager, ahead", {false,0,0,0,false,true,0,0,2}, true, true, T);
  for (int sms : {8, 16}) {
    const std::string a = "RGB green " + std::to_string(sms) + " alone", b = "RGB green " + std::to_string(sms) + " + gemm graph, ahead";
    Opts g{}; g.dec_green = sms; run(a.c_str(), g, true, false, T);
    g.graph = true; g.ahead = true; run(b.c_str(), g, true, true, T);
    g.prealloc = 1024; const std::string c = b + ", prealloc 1024"; run(c.c_str(), g, true, true, T);
  }
  for (int nt : {1, 8, 16}) {
    const std::string nt_name = "turbo " + std::to_string(nt) + " alone";
    if (selected(nt_name)) printf("%-44s decode %8.0f img/s (libjpeg-turbo, whole image, host only)\n", nt_name.c_str(), run_turbo(nt, T));
    std::string n1 = "split " + std::to_string(nt) + " alone", n2 = "split " + std::to_string(nt) + " + gemm graph, ahead";
    std::string n3 = "split roi " + std::to_string(nt) + " + gemm graph, ahead";
    Opts a{}; a.split = nt; run(n1.c_str(), a, true, false, T);
    Opts b{}; b.split = nt; b.graph = true; b.ahead = true; run(n2.c_str(), b, true, true, T);
    Opts c = b; c.roi = 1; run(n3.c_str(), c, true, true, T);
  }
  // last: a library without the flag ends the program at the handle's creation
  run("RGB pools alone", {false,0,0,0,false,false,3}, true, false, T);
  run("RGB + gemm graph, ahead, pools", {false,0,0,0,true,true,3}, true, true, T);
  run("RGB + gemm graph, ahead, pools, prealloc 1024", {false,0,0,0,true,true,3,1024}, true, true, T);
  return 0;
  run("decode RGB alone", {}, true, false, T);
  run("decode YUV alone", {true}, true, false, T);
  run("RGB + gemm (equal prio)", {}, true, true, T);
  run("YUV + gemm (equal prio)", {true}, true, true, T);
  run("RGB, decoder stream high prio + gemm", {false, 1, 0}, true, true, T);
  run("YUV, decoder stream high prio + gemm", {true, 1, 0}, true, true, T);
  run("RGB + gemm in green ctx 124 SMs", {false, 1, 0, 124}, true, true, T);
  run("RGB + gemm in green ctx 116 SMs", {false, 1, 0, 116}, true, true, T);
  run("YUV + gemm in green ctx 124 SMs", {true, 1, 0, 124}, true, true, T);
  return 0;
}
