// Private helpers of the io layer (not a public header): RAII HDF5 ids, the parallel file
// access property list shared by every vitgrid file, collective transfers, root attributes,
// existence probes that do not print HDF5's error stack, and the collective
// mkdir / rename steps that make files appear atomically.
//
// Every function here expects the caller to hold hdf5_mutex() (the public io functions take it
// once at their top); the recursive mutex makes nested locking harmless.
#pragma once
#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "vitgrid/io/hdf5_util.h"

namespace vitgrid {
namespace io_detail {

// Owns one HDF5 identifier of any kind (file, group, dataset, dataspace, datatype, attribute,
// property list) and closes it with the matching H5?close. Closing a file opened with the
// MPI-IO driver is collective, so a handle to such a file must be destroyed on all ranks.
class H5Id {
 public:
  H5Id() = default;
  explicit H5Id(hid_t id) : id_(id) {}
  ~H5Id() { reset(); }
  H5Id(H5Id&& o) noexcept : id_(o.release()) {}
  H5Id& operator=(H5Id&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.release();
    }
    return *this;
  }
  H5Id(const H5Id&) = delete;
  H5Id& operator=(const H5Id&) = delete;

  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }  // NOLINT: lets handles go straight into H5 calls
  bool valid() const { return id_ >= 0; }
  hid_t release() {
    hid_t t = id_;
    id_ = -1;
    return t;
  }
  // Closes the identifier; a file's close is collective. While an error unwinds the stack, a
  // file is abandoned instead (see abandon()).
  void reset();
  // Forgets the identifier without closing it: HDF5 closes what is left inside MPI_Finalize,
  // which only a job whose ranks all failed alike reaches (fail_agreed); a rank that failed
  // alone never waits in a collective close for ranks that are elsewhere.
  void abandon() { id_ = -1; }

 private:
  hid_t id_ = -1;
};

// File access list for one shared file on `comm`: MPI-IO driver with tuning hints, collective
// metadata reads and writes, aligned large objects.
H5Id parallel_fapl(MPI_Comm comm);
// Transfer list for collective raw-data reads/writes.
H5Id collective_dxpl();

// Called by all ranks of comm. Create (truncate) or open a shared file; an invalid handle is
// returned (on every rank, because the MPI-IO open is collective) when it fails.
H5Id create_parallel(MPI_Comm comm, const std::string& path);
H5Id open_parallel(MPI_Comm comm, const std::string& path, bool writable);

// Result of probing a path on rank 0, broadcast to all ranks (called by all ranks of comm).
// `damaged`: an HDF5 file whose metadata cannot all be read (*why says where). Files opened
// in parallel read their metadata collectively: rank 0 reads, the others wait for its
// broadcast, and a read that fails on rank 0 leaves them waiting for good inside HDF5. So
// before any collective open, rank 0 walks the whole file serially: every object header, every
// attribute, every dataset's storage inside the file (and the chunk indexes of chunked ones).
// What it could read, the collective open reads too.
enum class FileProbe : int { ok = 0, missing = 1, not_hdf5 = 2, damaged = 3 };
FileProbe probe_file(MPI_Comm comm, const std::string& path, std::string* why = nullptr);

// Attributes on an object (collective when the file is parallel: all ranks, same values).
// Writers replace an existing attribute of the same name.
void write_attr_string(hid_t obj, const std::string& name, const std::string& value);
void write_attr_int(hid_t obj, const std::string& name, int value);
void write_attr_ints(hid_t obj, const std::string& name, const std::vector<int>& values);
void write_attr_double(hid_t obj, const std::string& name, double value);
// Readers return false when the attribute does not exist (or has an unreadable type).
bool read_attr_string(hid_t obj, const std::string& name, std::string* value);
bool read_attr_ints(hid_t obj, const std::string& name, std::vector<int>* values);

// True when every component of the '/'-separated path exists under loc (H5Lexists alone fails
// rather than answering false when an intermediate group is missing).
bool path_exists(hid_t loc, const std::string& path);

// Dimensions of a dataset's dataspace (empty for a scalar).
std::vector<hsize_t> dataset_dims(hid_t dset);

std::string shape_str(const std::vector<int64_t>& shape);
std::string shape_str(const std::vector<hsize_t>& shape);

// Called by all ranks: agrees on `ok` (and the first failing rank's message) and, if any rank
// failed, throws the same UserError on every rank.
void throw_if_any_failed(MPI_Comm comm, bool ok, const std::string& msg);

// Called by all ranks: rank 0 creates dir (and parents) if missing; UserError on every rank if
// it cannot. `what` names the file the directory is for, for the message.
void make_dirs(MPI_Comm comm, const std::string& dir, const std::string& what);

// Called by all ranks after the file at `tmp` is closed: rank 0 renames it to `final_path`
// (replacing an older file of that name atomically); all ranks return once it is done.
void publish_file(MPI_Comm comm, const std::string& tmp, const std::string& final_path);

// FNV-1a, for cheap cross-rank consistency checks of collective arguments.
uint64_t fnv1a(uint64_t h, const void* data, size_t n);
// Called by all ranks: aborts (fail_one) when `h` differs between ranks, naming `what`; the
// collective calls that follow would otherwise hang or corrupt the file.
void check_same_on_all_ranks(MPI_Comm comm, uint64_t h, const char* what);

}  // namespace io_detail
}  // namespace vitgrid
