// Input-pipeline throughput on its own: how many images per second one rank's loader delivers
// (dataset read + augmentation and Mixup draws; the normalise/crop/flip itself runs on the
// device in Backend::prepare_images, so it is timed separately here on the CPU reference).
//   bench_loader DECK [--batches=N] [--section.key=value ...]
// Compare with what the GPU consumes (vitgrid bench's img/s per rank).
#include <mpi.h>

#include <cstdio>
#include <string>
#include <vector>

#include "vitgrid/core/error.h"
#include "vitgrid/core/log.h"
#include "vitgrid/data/dataset.h"
#include "vitgrid/deck/deck.h"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  try {
    if (argc < 2) throw vitgrid::UserError("usage: bench_loader DECK [--batches=N] [overrides]");
    int batches = 20;
    std::vector<std::string> over;
    for (int i = 2; i < argc; ++i) {
      std::string a = argv[i];
      if (a.rfind("--batches=", 0) == 0)
        batches = std::stoi(a.substr(10));
      else
        over.push_back(a);
    }
    vitgrid::Deck d = vitgrid::parse_deck(argv[1], over, 1);
    std::shared_ptr<vitgrid::Dataset> ds = vitgrid::make_dataset(d, true);
    vitgrid::LoaderConfig c;
    c.seed = d.run.seed;
    c.global_batch = d.data.global_batch / d.data.grad_accum;
    c.crop_padding = d.data.crop_padding;
    c.hflip = d.data.hflip;
    c.mixup_alpha = d.data.mixup_alpha;
    c.num_classes = d.model.num_classes;
    c.prefetch = d.data.prefetch;
    c.workers = d.data.workers;
    vitgrid::DataLoader loader(ds, c);
    loader.next();  // the first batch includes thread start-up
    const double t0 = vitgrid::now_s();
    int64_t n = 0;
    std::shared_ptr<const vitgrid::HostBatch> last;
    for (int i = 0; i < batches; ++i) {
      last = loader.next();
      n += last->count;
    }
    const double dt = vitgrid::now_s() - t0;
    // the CPU reference of the device-side preparation, for scale
    const int S = ds->image_size();
    std::vector<float> out(static_cast<size_t>(last->count) * 3 * S * S);
    const double t1 = vitgrid::now_s();
    vitgrid::prepare_images_reference(out.data(), last->images.data(),
                                      last->partners.empty() ? nullptr : last->partners.data(),
                                      last->aug.data(), last->count, S, d.data.crop_padding,
                                      d.data.mean.data(), d.data.std.data());
    const double dp = vitgrid::now_s() - t1;
    std::printf("loader | %s | %dx%d | batch %lld | workers %d | mixup %.2f | %.0f img/s | CPU "
                "prepare_images reference %.0f img/s\n",
                ds->describe().c_str(), S, S, static_cast<long long>(c.global_batch), c.workers,
                c.mixup_alpha, n / dt, last->count / dp);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_loader: %s\n", e.what());
    rc = 2;
  }
  MPI_Finalize();
  return rc;
}
