// Preemption: SIGTERM and SIGUSR1 (what SLURM sends with --signal=USR1@120 and before a time
// limit) set a flag; the training loop asks, once per step, whether any rank saw a signal, and
// if so every rank finishes the step, writes a checkpoint and exits with kExitRequeue, which
// the job scripts turn into `scontrol requeue`.
#pragma once
#include <mpi.h>

namespace vitgrid {

class PreemptionWatch {
 public:
  // Installs the handlers (once per process); restores the previous ones in the destructor.
  PreemptionWatch();
  ~PreemptionWatch();
  PreemptionWatch(const PreemptionWatch&) = delete;
  PreemptionWatch& operator=(const PreemptionWatch&) = delete;
  // Called by all ranks of comm: true on every rank if any rank has received a signal.
  bool requested(MPI_Comm comm) const;
  // The signal received on this rank (0 if none), for the log.
  static int signal_seen();
};

}  // namespace vitgrid
