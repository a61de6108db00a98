#include "vitgrid/core/log.h"

#include <chrono>
#include <cstdarg>

namespace vitgrid {

Log::Log(MPI_Comm comm) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) MPI_Comm_rank(comm, &rank_);
}

void Log::operator()(const char* fmt, ...) const {
  if (rank_ != 0) return;
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stdout, fmt, ap);
  va_end(ap);
  std::fflush(stdout);
}

void Log::block(const std::string& text) const {
  if (rank_ != 0) return;
  std::fwrite(text.data(), 1, text.size(), stdout);
  if (!text.empty() && text.back() != '\n') std::fputc('\n', stdout);
  std::fflush(stdout);
}

double now_s() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

}  // namespace vitgrid
