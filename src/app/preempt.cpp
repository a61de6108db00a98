#include "vitgrid/app/preempt.h"

#include <pthread.h>

#include <atomic>
#include <csignal>
#include <thread>

#include "vitgrid/core/watchdog.h"

namespace vitgrid {
namespace {

// SIGTERM and SIGUSR1 are blocked in every thread (SignalThread's constructor runs first thing
// in main, so the threads MPI, NCCL, CUDA and vitgrid start later inherit the mask) and taken by
// one thread with sigwait(): a signal never interrupts a call in a library's thread (a poll or
// a wait that does not restart), wherever the kernel would have delivered it.
std::atomic<int> g_signal{0};
std::atomic<bool> g_watching{false}, g_stopping{false};

sigset_t preemption_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGUSR1);
  return set;
}

void wait_for_signals() {
  const sigset_t set = preemption_signals();
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    if (g_stopping.load()) return;
    if (g_watching.load()) {
      g_signal.store(sig);
      continue;
    }
    // no training loop to stop at a step's end: the signal's default action (the process ends)
    std::signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    pthread_kill(pthread_self(), sig);
  }
}

}  // namespace

SignalThread::SignalThread() {
  const sigset_t set = preemption_signals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  thread_ = std::thread(wait_for_signals);
}

SignalThread::~SignalThread() {
  g_stopping.store(true);
  pthread_kill(thread_.native_handle(), SIGUSR1);
  thread_.join();
}

PreemptionWatch::PreemptionWatch() { g_watching.store(true); }

PreemptionWatch::~PreemptionWatch() { g_watching.store(false); }

bool PreemptionWatch::requested(MPI_Comm comm) {
  int mine = g_signal.load(std::memory_order_relaxed), any = 0;
  WatchdogWait w("the MPI all-reduce of the preemption signal");
  MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, comm);
  if (any != 0) agreed_ = any;
  return any != 0;
}

}  // namespace vitgrid
