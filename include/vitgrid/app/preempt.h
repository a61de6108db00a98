// Preemption: SIGTERM and SIGUSR1 (what SLURM sends with --signal=USR1@120, before a time
// limit and on scancel; what mpirun forwards) set a flag; the training loop asks, once per step, whether any rank saw a signal, and
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
  bool requested(MPI_Comm comm);
  // The signal some rank received (the highest number when several did), as agreed by the
  // last requested() that returned true; 0 before.
  int signal_seen() const { return agreed_; }

 private:
  int agreed_ = 0;
};

}  // namespace vitgrid
