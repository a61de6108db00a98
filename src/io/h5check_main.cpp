// vitgrid-h5check FILE: walks an HDF5 file's metadata serially (io_detail::hdf5_metadata_problem)
// in a process of its own, for a rank that must not crash on a damaged file. Prints nothing
// and exits 0 when the file's metadata reads whole; prints where it does not and exits 1. No
// MPI: the library is linked, never initialised.
#include <cstdio>
#include <string>

#include "vitgrid/io/hdf5_util.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: vitgrid-h5check FILE\n");
    return 2;
  }
  const std::string why = vitgrid::io_detail::hdf5_metadata_problem(argv[1]);
  if (why.empty()) return 0;
  std::printf("%s\n", why.c_str());
  return 1;
}
