// Input-pipeline throughput on its own: how many images per second one rank's loader delivers.
// Raw sources: dataset read + augmentation and Mixup draws (the normalise/crop/flip runs on the
// device in Backend::prepare_images, timed separately here on the CPU reference). Encoded
// sources (JPEG): read, header, RandomResizedCrop draw, then
//   --decode=host    libjpeg-turbo decode + crop + resize + flip on the loader's workers
//   --decode=device  the device's batched decoder (nvJPEG) for the JPEGs it takes, the rest on
//                    the host; each batch is complete on the device before the next is counted
//   --resize=device  what the host decodes is cropped, resized and flipped on the device (the
//                    workers only decode); --resize=host (the default here): on the workers
//   bench_loader DECK [--batches=N] [--decode=host|device] [--resize=host|device]
//                [--section.key=value ...]
// Compare with what the GPU consumes (vitgrid bench's img/s per rank). Under mpirun every rank
// runs its own loader at the same time (the node's cores shared as in training; each rank
// reads its own samples, a batch of the deck's global batch each, on the GPU of its node-local
// rank), prints its rate, and rank 0 the sum: `mpirun -np <GPUs> bench_loader ...` tells
// whether a node's CPUs keep all of its GPUs fed. A failure anywhere ends every rank with exit
// 2, the lowest failing rank naming it.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/image_decoder.h"
#include "vitgrid/core/error.h"
#include "vitgrid/core/log.h"
#include "vitgrid/data/dataset.h"
#include "vitgrid/deck/deck.h"

namespace {

// Every rank's verdict after a phase without collectives: 0 when no rank failed, else 2 with
// the lowest failing rank's message printed.
int agree(int failed, const std::string& what, int rank) {
  int first = failed ? rank : INT_MAX;
  MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (first == INT_MAX) return 0;
  if (first == rank) std::fprintf(stderr, "bench_loader: %s\n", what.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1, local = 0, local_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  {
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
  }
  std::string error;
  int batches = 20;
  std::string decode = "host", resize = "host";
  vitgrid::Deck d;
  std::shared_ptr<vitgrid::Dataset> ds;
  vitgrid::LoaderConfig c;
  std::unique_ptr<vitgrid::Backend> be;
  vitgrid::ImageDecoder* dec = nullptr;
  uint8_t* out = nullptr;
  std::unique_ptr<vitgrid::DataLoader> loader;
  int S = 0;
  int64_t bad = 0;
  double host_s = 0.0, wait_s = 0.0;  // in the decoder's calls; waiting for the device
  // one batch through the device's decoder, complete on the device before the next
  auto to_device = [&](const vitgrid::HostBatch& hb) {
    const double t0 = vitgrid::now_s();
    vitgrid::decode_batch_on_device(*dec, hb, S, c.real.interp, out);
    vitgrid::finish_batch_on_device(*dec, *loader, hb, S, c.num_classes, out, &bad,
                                    [](const std::vector<int32_t>&, const std::vector<float>&) {});
    const double t1 = vitgrid::now_s();
    be->synchronize();
    host_s += t1 - t0;
    wait_s += vitgrid::now_s() - t1;
  };
  int failed = 0;
  try {
    const char* usage =
        "usage: bench_loader DECK [--batches=N] [--decode=host|device] [--resize=host|device] "
        "[--section.key=value ...]";
    if (argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
      if (rank == 0)
        std::printf(
            "%s\n(mpirun -np <GPUs per node>: every rank's loader at once, rank 0 the sum)\n",
            usage);
      MPI_Finalize();
      return 0;
    }
    if (argc < 2) throw vitgrid::UserError(usage);
    std::vector<std::string> over;
    for (int i = 2; i < argc; ++i) {
      std::string a = argv[i];
      if (a.rfind("--batches=", 0) == 0)
        batches = std::stoi(a.substr(10));
      else if (a.rfind("--decode=", 0) == 0)
        decode = a.substr(9);
      else if (a.rfind("--resize=", 0) == 0)
        resize = a.substr(9);
      else
        over.push_back(a);
    }
    if ((decode != "host" && decode != "device") || (resize != "host" && resize != "device"))
      throw vitgrid::UserError("--decode and --resize take host or device");
    d = vitgrid::parse_deck(argv[1], over, 1);
    ds = vitgrid::make_dataset(d, true);
    S = ds->image_size();
    // each rank a batch of the deck's global batch (per accumulation step), its own samples
    const int64_t per_rank = d.data.global_batch / d.data.grad_accum;
    // data.workers = 0: the rank's share of the node's cores, as vitgrid train
    c = vitgrid::make_loader_config(d, true, rank, size, vitgrid::loader_workers(d, local_size));
    c.global_batch = per_rank * size;
    c.grad_accum = 1;
    if (decode == "device" || resize == "device") {
      be = vitgrid::make_backend("cuda", local, vitgrid::DType::F32);
      dec = be->image_decoder(decode == "device");
      if (!dec)
        throw vitgrid::UserError("--decode/--resize=device: the backend has no image decoder");
      vitgrid::use_device_decoder(c, dec, decode == "device", resize == "device", S);
      out = static_cast<uint8_t*>(be->alloc(static_cast<size_t>(per_rank) * S * S * 3));
    }
    loader = std::make_unique<vitgrid::DataLoader>(ds, c);
    auto first = loader->next();  // the first batch includes thread start-up
    if (dec) to_device(*first);
  } catch (const std::exception& e) {
    failed = 1;
    error = e.what();
  }
  int rc = agree(failed, error, rank);
  if (rc == 0) {
    host_s = wait_s = 0.0;
    MPI_Barrier(MPI_COMM_WORLD);  // every rank's loader at once from here
    const double t0 = vitgrid::now_s();
    int64_t n = 0, on_device = 0;
    std::shared_ptr<const vitgrid::HostBatch> last;
    try {
      for (int i = 0; i < batches; ++i) {
        last = loader->next();
        if (dec) to_device(*last);
        n += last->count;
        on_device += static_cast<int64_t>(last->views.size());
      }
    } catch (const std::exception& e) {
      failed = 1;
      error = e.what();
    }
    const double dt = vitgrid::now_s() - t0;
    rc = agree(failed, error, rank);
    if (rc == 0) {
      double ips = n / dt, total = 0.0;
      char who[48] = "";
      if (size > 1) std::snprintf(who, sizeof who, " | rank %d of %d", rank, size);
      if (ds->encoded()) {
        char timing[128] = "";
        if (dec)
          std::snprintf(
              timing, sizeof timing,
              " | per batch: %.1f ms in the decoder's calls, %.1f ms waiting for the device",
              1e3 * host_s / batches, 1e3 * wait_s / batches);
        std::printf(
            "input%s | %s | %dx%d | batch %lld | workers %d | decode %s | resize %s | %.1f%% "
            "decoded on the device | %.0f img/s%s\n",
            who, ds->describe().c_str(), S, S, static_cast<long long>(last->count), c.workers,
            decode == "device" ? dec->describe().c_str() : "host (libjpeg-turbo)", resize.c_str(),
            100.0 * on_device / std::max<int64_t>(1, n), ips, timing);
      } else {
        // the CPU reference of the device-side preparation, for scale
        std::vector<float> ref(static_cast<size_t>(last->count) * 3 * S * S);
        const double t1 = vitgrid::now_s();
        vitgrid::prepare_images_reference(ref.data(), last->images.data(), last->aug.data(),
                                          last->count, S, d.data.crop_padding, d.data.mean.data(),
                                          d.data.std.data());
        const double dp = vitgrid::now_s() - t1;
        std::printf(
            "loader%s | %s | %dx%d | batch %lld | workers %d | mixup %.2f | %.0f img/s | CPU "
            "prepare_images reference %.0f img/s\n",
            who, ds->describe().c_str(), S, S, static_cast<long long>(last->count), c.workers,
            c.mix.mixup_alpha, ips, last->count / dp);
      }
      std::fflush(stdout);
      MPI_Reduce(&ips, &total, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
      if (rank == 0 && size > 1)
        std::printf("%s | all %d ranks at once | %.0f img/s (%.0f per rank)\n",
                    ds->encoded() ? "input" : "loader", size, total, total / size);
    }
  }
  loader.reset();
  if (out) be->release(out);
  be.reset();
  MPI_Finalize();
  return rc;
}
