// A thin main: MPI up, the application in a scope (its destructors run before
// MPI_Finalize), MPI down.
#include <mpi.h>

#include <cstdio>

#include "vitgrid/app/app.h"
#include "vitgrid/app/preempt.h"

int main(int argc, char** argv) {
  // before MPI starts its threads: they inherit the blocked preemption signals
  vitgrid::SignalThread signals;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  {
    rc = vitgrid::run_app(argc, argv);
  }
  MPI_Finalize();
  return rc;
}
