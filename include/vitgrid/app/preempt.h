// Preemption: SIGTERM and SIGUSR1 (what SLURM sends with --signal=USR1@120, before a time
// limit and on scancel; what mpirun forwards) set a flag; the training loop asks, once per step, whether any rank saw a signal, and
// if so every rank finishes the step, writes a checkpoint and exits with kExitRequeue, which
// the job scripts turn into `scontrol requeue`.
#pragma once
#include <mpi.h>

#include <thread>

namespace vitgrid {

// Made first thing in main, before any other thread: blocks SIGTERM and SIGUSR1 in every
// thread and takes them on a thread of its own (sigwait), so that no library's thread (MPI's,
// NCCL's, CUDA's) is ever interrupted by one. While a PreemptionWatch exists a signal sets its
// flag; otherwise it ends the process as the signal's default action does.
class SignalThread {
 public:
  SignalThread();
  ~SignalThread();
  SignalThread(const SignalThread&) = delete;
  SignalThread& operator=(const SignalThread&) = delete;

 private:
  std::thread thread_;
};

class PreemptionWatch {
 public:
  // From construction to destruction, SIGTERM and SIGUSR1 set the flag (SignalThread).
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
