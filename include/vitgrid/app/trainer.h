// The training loop and its eval / predict siblings. Owns the grid, backend, collectives,
// model, optimizer, data loaders and output writers of one run.
#pragma once
#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "vitgrid/deck/deck.h"

namespace vitgrid {

class Trainer {
 public:
  // Called by all ranks. Builds everything; bad input (dataset, checkpoint, GPU count) ends
  // the job here with one message and the same exit code on every rank.
  Trainer(MPI_Comm world, const Deck& deck);
  ~Trainer();
  int train();
  int evaluate_only();
  int predict();
  // Throughput: `warmup` untimed then `steps` timed training steps on one fixed synthetic
  // batch (no input pipeline in the loop), full optimizer step included. Prints images/s,
  // step time, model TFLOP/s, MFU against `peak_tflops` per device (0: the GPU's on the cuda
  // backend, none on the CPU) and peak memory.
  // With `profile`, 3 more steps time every op (synchronised) and print the table. With
  // `checkpoint`, one checkpoint of the state after the timed steps is written as train()
  // writes them (into run.out_dir) and timed, and the disk's own write rate measured beside it.
  int bench(int warmup, int steps, double peak_tflops, bool profile, bool checkpoint = false);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vitgrid
