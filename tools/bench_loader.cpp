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
// Compare with what the GPU consumes (vitgrid bench's img/s per rank).
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/backend/image_decoder.h"
#include "vitgrid/core/error.h"
#include "vitgrid/core/log.h"
#include "vitgrid/data/dataset.h"
#include "vitgrid/deck/deck.h"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  try {
    if (argc < 2)
      throw vitgrid::UserError("usage: bench_loader DECK [--batches=N] [--decode=host|device] [overrides]");
    int batches = 20;
    std::string decode = "host", resize = "host";
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
    vitgrid::Deck d = vitgrid::parse_deck(argv[1], over, 1);
    std::shared_ptr<vitgrid::Dataset> ds = vitgrid::make_dataset(d, true);
    const int S = ds->image_size();
    vitgrid::LoaderConfig c = vitgrid::make_loader_config(d, true, 0, 1, d.data.workers);
    c.global_batch = d.data.global_batch / d.data.grad_accum;
    c.grad_accum = 1;
    std::unique_ptr<vitgrid::Backend> be;
    vitgrid::ImageDecoder* dec = nullptr;
    uint8_t* out = nullptr;
    if (decode == "device" || resize == "device") {
      be = vitgrid::make_backend("cuda", 0, vitgrid::DType::F32);
      dec = be->image_decoder(decode == "device");
      if (!dec)
        throw vitgrid::UserError("--decode/--resize=device: the backend has no image decoder");
      if (decode == "device")
        c.real.device_accepts = [dec](int comps, bool prog, int sh, int sv) {
          return dec->accepts(comps, prog, sh, sv);
        };
      if (resize == "device") {
        const int interp = c.real.interp;
        c.real.device_resizes = [dec, S, interp](double w, double h) {
          return dec->resizes(w, h, S, interp);
        };
      }
      out = static_cast<uint8_t*>(be->alloc(static_cast<size_t>(c.global_batch) * S * S * 3));
    }
    vitgrid::DataLoader loader(ds, c);
    int64_t bad = 0;
    double host_s = 0.0, wait_s = 0.0;  // in the decoder's calls; waiting for the device
    // one batch through the device's decoder, complete on the device before the next
    auto to_device = [&](const vitgrid::HostBatch& hb) {
      const double t0 = vitgrid::now_s();
      vitgrid::decode_batch_on_device(*dec, hb, S, c.real.interp, out);
      vitgrid::finish_batch_on_device(*dec, loader, hb, S, c.num_classes, out, &bad,
                                      [](const std::vector<int32_t>&, const std::vector<float>&) {});
      const double t1 = vitgrid::now_s();
      be->synchronize();
      host_s += t1 - t0;
      wait_s += vitgrid::now_s() - t1;
    };
    auto first = loader.next();  // the first batch includes thread start-up
    if (dec) to_device(*first);
    host_s = wait_s = 0.0;
    const double t0 = vitgrid::now_s();
    int64_t n = 0, on_device = 0;
    std::shared_ptr<const vitgrid::HostBatch> last;
    for (int i = 0; i < batches; ++i) {
      last = loader.next();
      if (dec) to_device(*last);
      n += last->count;
      on_device += static_cast<int64_t>(last->views.size());
    }
    const double dt = vitgrid::now_s() - t0;
    if (ds->encoded()) {
      char timing[128] = "";
      if (dec)
        std::snprintf(timing, sizeof timing, " | per batch: %.1f ms in the decoder's calls, %.1f ms waiting for the device",
                      1e3 * host_s / batches, 1e3 * wait_s / batches);
      std::printf(
          "input | %s | %dx%d | batch %lld | workers %d | decode %s | resize %s | %.1f%% "
          "decoded on the device | %.0f img/s%s\n",
          ds->describe().c_str(), S, S, static_cast<long long>(c.global_batch), c.workers,
          decode == "device" ? dec->describe().c_str() : "host (libjpeg-turbo)", resize.c_str(),
          100.0 * on_device / std::max<int64_t>(1, n), n / dt, timing);
    } else {
      // the CPU reference of the device-side preparation, for scale
      std::vector<float> ref(static_cast<size_t>(last->count) * 3 * S * S);
      const double t1 = vitgrid::now_s();
      vitgrid::prepare_images_reference(ref.data(), last->images.data(), last->aug.data(),
                                        last->count, S, d.data.crop_padding, d.data.mean.data(),
                                        d.data.std.data());
      const double dp = vitgrid::now_s() - t1;
      std::printf("loader | %s | %dx%d | batch %lld | workers %d | mixup %.2f | %.0f img/s | CPU "
                  "prepare_images reference %.0f img/s\n",
                  ds->describe().c_str(), S, S, static_cast<long long>(c.global_batch), c.workers,
                  c.mix.mixup_alpha, n / dt, last->count / dp);
    }
    if (out) be->release(out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_loader: %s\n", e.what());
    rc = 2;
  }
  MPI_Finalize();
  return rc;
}
