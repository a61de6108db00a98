#include "vitgrid/core/error.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace vitgrid {

void fail_all(MPI_Comm comm, const std::string& msg, int code) {
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

void fail_one(const char* file, int line, const std::string& msg) {
  if (report_fatal(file, line, msg)) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

void fail_one_with_cleanup(const char* file, int line, const std::string& msg,
                           const std::function<void()>& cleanup, double grace_s) {
  const bool inited = report_fatal(file, line, msg);
  std::thread([grace_s] {
    std::this_thread::sleep_for(std::chrono::duration<double>(grace_s));
    std::fprintf(stderr, "vitgrid: the abort did not complete within %.0f s: exiting\n", grace_s);
    std::fflush(stderr);
    std::_Exit(1);
  }).detach();
  if (cleanup) cleanup();
  if (inited) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

bool agree_error(MPI_Comm comm, bool ok, std::string* msg) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  // lowest failing rank
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
