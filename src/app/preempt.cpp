#include "vitgrid/app/preempt.h"

#include <atomic>
#include <csignal>

#include "vitgrid/core/watchdog.h"

namespace vitgrid {
namespace {

std::atomic<int> g_signal{0};
struct sigaction g_old_term, g_old_usr1;

extern "C" void on_preempt_signal(int sig) {
  // async-signal-safe: one lock-free store
  g_signal.store(sig, std::memory_order_relaxed);
}

}  // namespace

PreemptionWatch::PreemptionWatch() {
  struct sigaction sa {};
  sa.sa_handler = on_preempt_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // let blocking calls (file I/O, MPI progress) continue
  sigaction(SIGTERM, &sa, &g_old_term);
  sigaction(SIGUSR1, &sa, &g_old_usr1);
}

PreemptionWatch::~PreemptionWatch() {
  sigaction(SIGTERM, &g_old_term, nullptr);
  sigaction(SIGUSR1, &g_old_usr1, nullptr);
}

bool PreemptionWatch::requested(MPI_Comm comm) {
  int mine = g_signal.load(std::memory_order_relaxed), any = 0;
  WatchdogWait w("the MPI all-reduce of the preemption signal");
  MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, comm);
  if (any != 0) agreed_ = any;
  return any != 0;
}

}  // namespace vitgrid
