// Rank 0 talks: one logger bound to a communicator prints on its rank 0 only.
#pragma once
#include <mpi.h>

#include <cstdio>
#include <string>

namespace vitgrid {

class Log {
 public:
  explicit Log(MPI_Comm comm = MPI_COMM_WORLD);
  bool is_root() const { return rank_ == 0; }
  // printf-style; prints only on rank 0 of the communicator, flushed.
  void operator()(const char* fmt, ...) const __attribute__((format(printf, 2, 3)));
  // prints a whole block (already formatted) on rank 0
  void block(const std::string& text) const;

 private:
  int rank_ = 0;
};

// Wall clock in seconds (monotonic).
double now_s();

}  // namespace vitgrid
