// metrics.h5, written by rank 0 alone while training: extendible chunked datasets
//   /train/step /train/loss /train/lr /train/grad_norm /train/images_per_s /train/loss_scale
//     one row per step (int64 step, float64 values);
//   /train/step_time_s, /train/device_mem_bytes, /train/bad_images and /train/input_wait_s
//     [steps, width]: rank r's value in column r,
//     width the largest world size of the file's segments, NaN in the columns beyond the ranks
//     of the segment a row belongs to;
//   /eval/step /eval/loss /eval/top1 /eval/top5, one row per evaluation;
//   /segments/first_step /segments/world_size (int64 [segments]), /segments/grid (int64
//     [segments, 3]: pipeline, data, tensor), /segments/tensor_mode (16-byte strings): one row
//     per run that wrote the file, the first one and each resumed one, whatever its layout;
//     a segment's rows are the steps from its first_step to the next segment's;
//   root attributes deck, world_size, grid, tensor_mode, backend (the last segment's), version.
// A file without /segments (written before it existed) is continued too: its per-rank tables
// are copied into extendible ones and its root attributes become its first segment.
// Rows are buffered on every rank and appended by flush() (every rank must call it): the
// other ranks send rank 0 their per-rank values (MPI_Gather), and rank 0 writes the file
// through the serial HDF5 driver; nothing else touches it. A parallel file would gain nothing
// for a few hundred bytes a step, and a write failing inside a parallel HDF5 call (a full disk)
// can leave the ranks waiting in different collectives for good; here every call ends with one
// agreement on the writer's communicator, so a failure on rank 0 is the same UserError on
// every rank, never a hang or an abort.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace vitgrid {

struct TrainRow {
  int64_t step;
  double loss, lr, grad_norm, images_per_s, loss_scale;
  double step_time_s;       // this rank's
  double device_mem_bytes;  // this rank's
  double bad_images = 0;    // this rank's undecodable images replaced so far (encoded sources)
  double input_wait_s = 0;  // this rank's training thread waiting for input during the step
};
struct EvalRow {
  int64_t step;
  double loss, top1, top5;
};

class MetricsWriter {
 public:
  // Called by all ranks. Creates the file, or, when append is true and it exists, opens it and
  // truncates rows (and segments) after `resume_step` (so a resumed run continues the same
  // file, on any world size). `resume_step`: the steps done before this run (0 for a fresh
  // one); this run's segment starts at resume_step + 1. A file that cannot be created or
  // appended to (not HDF5, damaged, of another layout, no space left on device) is a
  // UserError on every rank naming the file; a file this call created is removed then.
  MetricsWriter(MPI_Comm comm, const std::string& path, const std::string& deck,
                const std::vector<int>& grid, const std::string& tensor_mode,
                const std::string& backend, bool append, int64_t resume_step);
  // Called by all ranks: flushes the rows still buffered (a failure there is a warning: a
  // destructor cannot throw), then rank 0 closes the file. While an exception unwinds the
  // stack there is no flush (it is collective); rank 0 closes the file as the last flush left
  // it.
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  // Every rank adds the same rows (rank-local fields differ: rank 0 writes its own values of
  // the others, and every rank's step_time_s and device_mem_bytes). flush() is called by all
  // ranks; once a call has failed (the same UserError on every rank), later ones throw it
  // again and nothing more is written.
  void add_train(const TrainRow& r);
  void add_eval(const EvalRow& r);
  void flush();
  // A named scalar attribute on the root (e.g. checkpoint bandwidth, peak memory). Called by
  // all ranks; rank 0's value is written.
  void set_attribute(const std::string& name, double value);
  void set_attribute(const std::string& name, const std::string& value);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// predictions.h5: /logits [N, K] fp32 and /labels [N] in dataset order, root attribute deck.
// Called by all ranks of comm; each rank passes its rows and their first dataset index.
void write_predictions(MPI_Comm comm, const std::string& path, const std::string& deck,
                       int64_t total, int num_classes, int64_t first_index,
                       const std::vector<float>& logits, const std::vector<int32_t>& labels);

}  // namespace vitgrid
