#include "vitgrid/core/watchdog.h"

#include "vitgrid/core/error.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

namespace vitgrid {
namespace {

using Clock = std::chrono::steady_clock;

// What the main thread waits in, and since when (0: not waiting). Written by the main thread,
// read by the watchdog; a torn pair at the moment a wait ends only delays the verdict.
std::atomic<const char*> g_what{nullptr};
std::atomic<const char*> g_where{""};
std::atomic<int64_t> g_since_ns{0};
thread_local int t_depth = 0;

struct Dog {
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
};
Dog* g_dog = nullptr;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

[[noreturn]] void bite(double waited, double timeout) {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const char* where = g_where.load();
  // the axis, when the call runs on one ("world" is the whole job)
  const bool axis = where[0] && std::string(where) != "world";
  std::fprintf(stderr,
               "vitgrid: error: rank %d on %s has waited %.0f s in %s%s%s%s (device.comm_timeout = "
               "%.0f s): a rank of the job stopped responding; ending the job\n",
               rank, host, waited, g_what.load(), axis ? " on the " : "", axis ? where : "",
               axis ? " axis" : "", timeout);
  std::fflush(stderr);
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  // The main thread is inside MPI: only with MPI_THREAD_MULTIPLE may this thread call it;
  // otherwise the launcher ends the job when this process exits without MPI_Finalize.
  if (level == MPI_THREAD_MULTIPLE) abort_job(1);
  std::_Exit(1);
}

}  // namespace

void start_watchdog(double timeout_s) {
  if (timeout_s <= 0.0 || g_dog) return;
  g_dog = new Dog;
  g_dog->thread = std::thread([timeout_s] {
    // check a few times per timeout, at least every second
    const auto tick = std::chrono::duration<double>(std::min(1.0, timeout_s / 4.0));
    std::unique_lock<std::mutex> lock(g_dog->mu);
    while (!g_dog->stop) {
      g_dog->cv.wait_for(lock, tick);
      const int64_t since = g_since_ns.load(std::memory_order_relaxed);
      if (since == 0) continue;
      const double waited = double(now_ns() - since) * 1e-9;
      if (waited > timeout_s) bite(waited, timeout_s);
    }
  });
}

void stop_watchdog() {
  if (!g_dog) return;
  {
    std::lock_guard<std::mutex> lock(g_dog->mu);
    g_dog->stop = true;
  }
  g_dog->cv.notify_all();
  g_dog->thread.join();
  delete g_dog;
  g_dog = nullptr;
}

WatchdogWait::WatchdogWait(const char* what, const char* where) : outer_(t_depth++ == 0) {
  if (!outer_) return;
  g_what.store(what, std::memory_order_relaxed);
  g_where.store(where, std::memory_order_relaxed);
  g_since_ns.store(now_ns(), std::memory_order_relaxed);
}

WatchdogWait::~WatchdogWait() {
  --t_depth;
  if (outer_) g_since_ns.store(0, std::memory_order_relaxed);
}

WatchdogOff::WatchdogOff() { ++t_depth; }  // every wait of this thread is then an inner one
WatchdogOff::~WatchdogOff() { --t_depth; }

}  // namespace vitgrid
