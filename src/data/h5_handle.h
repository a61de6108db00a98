// An HDF5 handle closed on scope exit, for the data layer's serial HDF5 readers (the caller
// holds hdf5_mutex(): the library is not thread-safe in this build).
#pragma once
#include <hdf5.h>

namespace vitgrid {

struct H5Handle {
  hid_t id = -1;
  herr_t (*close)(hid_t) = nullptr;
  H5Handle(hid_t i, herr_t (*c)(hid_t)) : id(i), close(c) {}
  ~H5Handle() {
    if (id >= 0) close(id);
  }
  H5Handle(const H5Handle&) = delete;
  H5Handle& operator=(const H5Handle&) = delete;
  hid_t release() {
    hid_t i = id;
    id = -1;
    return i;
  }
};

}  // namespace vitgrid
