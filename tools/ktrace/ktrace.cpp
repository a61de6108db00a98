// vitgrid_ktrace: a kernel timeline for nodes without Nsight Systems. Preload it into any CUDA
// process (each MPI rank writes its own file):
//   VITGRID_KTRACE=DIR mpirun -np 4 -x LD_PRELOAD=build/lib/libvitgrid_ktrace.so -x VITGRID_KTRACE
//     build/bin/vitgrid bench inputs/bench_vit_b16.ini
// It records every kernel the GPU runs, CUDA graph replays included, through CUPTI's activity
// API (CONCURRENT_KERNEL: kernels are not serialised), and every copy (MEMCPY, MEMCPY2: the
// copy engines' work, NCCL's copy-engine collectives among it), and at exit writes
// DIR/ktrace.<pid>.tsv, one line per record: start and end (ns, the device's timestamps, one
// clock per node), device, stream, graph id (0: not from a graph) and the kernel's (mangled)
// name, or for a copy "memcpy:KIND BYTES" (KIND: HtoD, DtoH, DtoD, PtoP, ...). Unset
// VITGRID_KTRACE: records nothing. tools/ktrace_report.py reads the files.
// VITGRID_KTRACE_API=1 also records every CUDA driver and runtime API call (libraries' calls
// included) as "api:driver NAME" / "api:runtime NAME", its host thread's id in the stream
// column (low 32 bits) and device 0: which call of which thread waits, and for how long.
#include <cupti.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

struct Kernel {
  uint64_t start, end;
  uint32_t device, stream, graph;
  std::string name;
};

std::mutex g_mutex;
std::vector<Kernel>* g_kernels = nullptr;  // leaked on purpose: written at exit
bool g_on = false;
constexpr size_t kBufferBytes = 16u << 20;

std::string copy_name(uint8_t kind, uint64_t bytes) {
  static const char* const kKinds[] = {"Unknown", "HtoD", "DtoH", "HtoA", "AtoH", "AtoA",
                                       "AtoD",    "DtoA", "DtoD", "HtoH", "PtoP"};
  const char* k = kind < sizeof(kKinds) / sizeof(kKinds[0]) ? kKinds[kind] : "Unknown";
  return std::string("memcpy:") + k + " " + std::to_string(bytes);
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* r = nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(r);
      g_kernels->push_back(
          {k->start, k->end, k->deviceId, k->streamId, k->graphId, k->name ? k->name : "?"});
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(r);
      g_kernels->push_back({m->start, m->end, m->deviceId, m->streamId, m->graphId,
                            copy_name(m->copyKind, m->bytes)});
    } else if (r->kind == CUPTI_ACTIVITY_KIND_DRIVER || r->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(r);
      const bool drv = r->kind == CUPTI_ACTIVITY_KIND_DRIVER;
      const char* name = nullptr;
      if (cuptiGetCallbackName(drv ? CUPTI_CB_DOMAIN_DRIVER_API : CUPTI_CB_DOMAIN_RUNTIME_API,
                               a->cbid, &name) != CUPTI_SUCCESS || !name)
        name = "?";
      g_kernels->push_back({a->start, a->end, 0, static_cast<uint32_t>(a->threadId), 0,
                            std::string(drv ? "api:driver " : "api:runtime ") + name});
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY2) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpyPtoP4*>(r);
      g_kernels->push_back({m->start, m->end, m->deviceId, m->streamId, m->graphId,
                            copy_name(m->copyKind, m->bytes)});
    }
  }
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped) == CUPTI_SUCCESS && dropped)
    std::fprintf(stderr, "vitgrid_ktrace: %zu records dropped\n", dropped);
  std::free(buffer);
}

void write_trace() {
  if (!g_on) return;
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  const char* dir = std::getenv("VITGRID_KTRACE");
  const std::string path = std::string(dir) + "/ktrace." + std::to_string(getpid()) + ".tsv";
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "vitgrid_ktrace: cannot write %s\n", path.c_str());
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(f, "start\tend\tdevice\tstream\tgraph\tname\n");
  for (const Kernel& k : *g_kernels)
    std::fprintf(f, "%llu\t%llu\t%u\t%u\t%u\t%s\n", static_cast<unsigned long long>(k.start),
                 static_cast<unsigned long long>(k.end), k.device, k.stream, k.graph,
                 k.name.c_str());
  std::fclose(f);
  std::fprintf(stderr, "vitgrid_ktrace: %zu kernels -> %s\n", g_kernels->size(), path.c_str());
}

__attribute__((constructor)) void start_trace() {
  const char* dir = std::getenv("VITGRID_KTRACE");
  if (!dir || !*dir) return;
  g_kernels = new std::vector<Kernel>();
  g_kernels->reserve(1u << 20);
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "vitgrid_ktrace: CUPTI refused the kernel activity; no trace\n");
    return;
  }
  if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY2) != CUPTI_SUCCESS)
    std::fprintf(stderr, "vitgrid_ktrace: CUPTI refused the copy activities; kernels only\n");
  const char* api = std::getenv("VITGRID_KTRACE_API");
  if (api && std::string(api) == "1" &&
      (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER) != CUPTI_SUCCESS ||
       cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME) != CUPTI_SUCCESS))
    std::fprintf(stderr, "vitgrid_ktrace: CUPTI refused the API activities\n");
  g_on = true;
  std::atexit(write_trace);
}

}  // namespace
