// The driver: deck -> grid -> backend -> model -> data -> loop -> outputs.
#pragma once
#include <string>
#include <vector>

namespace vitgrid {

// Runs one vitgrid command line (train | eval | predict | help-deck | version) on
// MPI_COMM_WORLD; returns the process exit code (the same on every rank). MPI must be
// initialised (MPI_THREAD_MULTIPLE) by the caller and finalised after this returns and every
// object it made has been destroyed.
int run_app(int argc, char** argv);

}  // namespace vitgrid
