#include "vitgrid/core/error.h"

#include "vitgrid/core/watchdog.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

namespace vitgrid {

namespace {
std::function<void()>& before_finalize() {
  static std::function<void()> f;
  return f;
}
}  // namespace

void set_before_finalize(std::function<void()> f) { before_finalize() = std::move(f); }

void fail_all(MPI_Comm comm, const std::string& msg, int code) {
  if (auto f = std::exchange(before_finalize(), nullptr)) f();
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  if (rank == 0) {
    std::fprintf(stderr, "vitgrid: error: %s\n", msg.c_str());
    std::fflush(stderr);
  }
  // Every rank reached here with the same verdict: finalize cleanly, same exit code.
  MPI_Barrier(comm);
  MPI_Finalize();
  std::exit(code);
}

namespace {
bool report_fatal(const char* file, int line, const std::string& msg) {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  int rank = -1, inited = 0;
  MPI_Initialized(&inited);
  if (inited) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "vitgrid: fatal on %s rank %d (%s:%d): %s\n", host, rank, file, line,
               msg.c_str());
  std::fflush(stderr);
  return inited != 0;
}
}  // namespace

void exit_after(double grace_s, int code) {
  std::thread([grace_s, code] {
    std::this_thread::sleep_for(std::chrono::duration<double>(grace_s));
    std::fprintf(stderr, "vitgrid: the end of the job did not complete within %.0f s: exiting\n",
                 grace_s);
    std::fflush(stderr);
    std::_Exit(code);
  }).detach();
}

void abort_job(int code, double grace_s) {
  exit_after(grace_s, code);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

void fail_one(const char* file, int line, const std::string& msg) {
  if (report_fatal(file, line, msg)) abort_job(1);
  std::abort();
}

void fail_one_with_cleanup(const char* file, int line, const std::string& msg,
                           const std::function<void()>& cleanup, double grace_s) {
  const bool inited = report_fatal(file, line, msg);
  exit_after(grace_s, 1);
  if (cleanup) cleanup();
  if (inited) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

namespace {
MPI_Comm g_error_comm = MPI_COMM_NULL;

// Waits for a non-blocking request until `deadline` (now_s clock); true if it completed.
bool wait_until(MPI_Request* r, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    int done = 0;
    MPI_Test(r, &done, MPI_STATUS_IGNORE);
    if (done) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}
}  // namespace

void open_error_channel(MPI_Comm world) {
  if (g_error_comm == MPI_COMM_NULL) MPI_Comm_dup(world, &g_error_comm);
}

bool unwinding() { return std::uncaught_exceptions() > 0; }

void fail_agreed(const std::string& msg, int code, double wait_s) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(wait_s * 1000.0));
  // Only failing ranks call this, so the reduction completes only if every rank failed; then
  // its result is the lowest of them, whose message is printed.
  int first = size;
  bool all = false;
  if (g_error_comm != MPI_COMM_NULL) {
    MPI_Request r = MPI_REQUEST_NULL;
    MPI_Iallreduce(&rank, &first, 1, MPI_INT, MPI_MIN, g_error_comm, &r);
    all = wait_until(&r, deadline);
  }
  if (!all) {
    // Some rank is elsewhere: this rank's own message, then the job ends.
    std::fprintf(stderr, "vitgrid: error: %s\n", msg.c_str());
    std::fflush(stderr);
    abort_job(code);
  }
  std::string text = msg;
  int len = rank == first ? static_cast<int>(msg.size()) : 0;
  MPI_Bcast(&len, 1, MPI_INT, first, g_error_comm);
  std::vector<char> buf(static_cast<size_t>(len) + 1, 0);
  if (rank == first) std::memcpy(buf.data(), msg.data(), static_cast<size_t>(len));
  MPI_Bcast(buf.data(), len, MPI_CHAR, first, g_error_comm);
  text.assign(buf.data(), static_cast<size_t>(len));
  if (rank == 0) {
    std::fprintf(stderr, "vitgrid: error: %s\n", text.c_str());
    std::fflush(stderr);
  }
  // Every rank is here with the same verdict: a clean finalize and the same exit code. Files
  // the unwinding left open are closed by HDF5 inside MPI_Finalize, alike on every rank; should
  // that not return, the job still ends.
  exit_after(30.0, code);
  MPI_Barrier(g_error_comm);
  MPI_Finalize();
  std::exit(code);
}

bool agree_error(MPI_Comm comm, bool ok, std::string* msg) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  // lowest failing rank
  WatchdogWait w("an MPI agreement on errors");
  int mine = ok ? size : rank, first = size;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == size) return false;
  if (msg) {
    int len = (rank == first) ? static_cast<int>(msg->size()) : 0;
    MPI_Bcast(&len, 1, MPI_INT, first, comm);
    std::vector<char> buf(len + 1, 0);
    if (rank == first) std::memcpy(buf.data(), msg->data(), len);
    MPI_Bcast(buf.data(), len, MPI_CHAR, first, comm);
    *msg = std::string(buf.data(), len);
  }
  return true;
}

}  // namespace vitgrid
