#include "vitgrid/io/hdf5_util.h"

namespace vitgrid {

std::recursive_mutex& hdf5_mutex() {
  static std::recursive_mutex m;
  return m;
}

}  // namespace vitgrid
