// Parallel-HDF5 helpers: one shared file, collective metadata, collective transfers.
#pragma once
#include <hdf5.h>
#include <mpi.h>

#include <mutex>
#include <sstream>
#include <string>

#include "vitgrid/core/error.h"

#define H5_CHECK(call)                                                        \
  ([&]() {                                                                    \
    auto vg_h5_ = (call);                                                     \
    if (vg_h5_ < 0) VG_FAIL("HDF5 call failed: " #call);                     \
    return vg_h5_;                                                            \
  }())

namespace vitgrid {

// HDF5 (Debian's parallel build) is not thread-safe: every HDF5 call in this process (the
// data loader's thread and the main thread) holds this lock.
std::recursive_mutex& hdf5_mutex();

}  // namespace vitgrid
