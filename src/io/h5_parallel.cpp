#include "h5_parallel.h"

#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <vector>

#include "vitgrid/core/watchdog.h"

namespace vitgrid {
namespace io_detail {

void H5Id::reset() {
  if (id_ < 0) return;
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  if (unwinding() && H5Iget_type(id_) == H5I_FILE) return abandon();
  herr_t rc = 0;
  switch (H5Iget_type(id_)) {
    case H5I_FILE: rc = H5Fclose(id_); break;
    case H5I_GROUP: rc = H5Gclose(id_); break;
    case H5I_DATASET: rc = H5Dclose(id_); break;
    case H5I_DATASPACE: rc = H5Sclose(id_); break;
    case H5I_DATATYPE: rc = H5Tclose(id_); break;
    case H5I_ATTR: rc = H5Aclose(id_); break;
    case H5I_GENPROP_LST: rc = H5Pclose(id_); break;
    default: rc = H5Idec_ref(id_); break;
  }
  id_ = -1;
  // A failed close of a file means its last metadata never reached the disk: fatal, unless a
  // SoftFailures scope takes it as an answer (a full disk).
  if (rc < 0) h5_failed("H5?close", __FILE__, __LINE__);
}

H5Id parallel_fapl(MPI_Comm comm) {
  H5Id fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)));
  // MPI-IO hints: collective buffering gathers the many small, strided hyperslab pieces of a
  // sharded tensor onto a few aggregator ranks that issue large contiguous file writes, which
  // is what parallel file systems are fast at. ROMIO reads these keys; OMPIO ignores them, so
  // they are harmless wherever the MPI picks the other component.
  MPI_Info info;
  MPI_CHECK(MPI_Info_create(&info));
  MPI_CHECK(MPI_Info_set(info, "romio_cb_write", "enable"));
  MPI_CHECK(MPI_Info_set(info, "romio_cb_read", "enable"));
  MPI_CHECK(MPI_Info_set(info, "cb_buffer_size", "16777216"));
  H5_CHECK(H5Pset_fapl_mpio(fapl, comm, info));  // duplicates comm and info
  MPI_CHECK(MPI_Info_free(&info));
  // Metadata (object headers, B-trees, attributes) read once by rank 0 and broadcast, and
  // flushed collectively, instead of every rank hitting the file system for the same bytes.
  H5_CHECK(H5Pset_all_coll_metadata_ops(fapl, true));
  H5_CHECK(H5Pset_coll_metadata_write(fapl, true));
  // Objects of 64 KiB and more start on 1 MiB boundaries, so big tensors line up with file
  // system stripes and no two writers share a stripe at a tensor's edge. Small metadata stays
  // packed.
  H5_CHECK(H5Pset_alignment(fapl, 64 * 1024, 1024 * 1024));
  return fapl;
}

H5Id collective_dxpl() {
  H5Id dxpl(H5_CHECK(H5Pcreate(H5P_DATASET_XFER)));
  H5_CHECK(H5Pset_dxpl_mpio(dxpl, H5FD_MPIO_COLLECTIVE));
  return dxpl;
}

H5Id create_parallel(MPI_Comm comm, const std::string& path) {
  H5Id fapl = parallel_fapl(comm);
  H5ErrorSilencer quiet;
  return H5Id(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl));
}

H5Id open_parallel(MPI_Comm comm, const std::string& path, bool writable) {
  H5Id fapl = parallel_fapl(comm);
  H5ErrorSilencer quiet;
  return H5Id(H5Fopen(path.c_str(), writable ? H5F_ACC_RDWR : H5F_ACC_RDONLY, fapl));
}

FileProbe probe_file(MPI_Comm comm, const std::string& path, std::string* why) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  int result = 0;
  std::string reason;
  if (rank == 0) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      result = static_cast<int>(FileProbe::missing);
    } else {
      // Serial checks on one rank: cheap, and they keep a garbage or damaged file from ever
      // reaching the collective open.
      H5ErrorSilencer quiet;
      if (H5Fis_hdf5(path.c_str()) <= 0) {
        result = static_cast<int>(FileProbe::not_hdf5);
      } else {
        reason = hdf5_metadata_problem_isolated(path);
        if (!reason.empty()) result = static_cast<int>(FileProbe::damaged);
      }
    }
  }
  int msg[2] = {result, static_cast<int>(reason.size())};
  watched("the MPI broadcast of rank 0's look at an HDF5 file",
          [&] { MPI_CHECK(MPI_Bcast(msg, 2, MPI_INT, 0, comm)); });
  reason.resize(static_cast<size_t>(msg[1]));
  if (msg[1] > 0)
    watched("the MPI broadcast of rank 0's look at an HDF5 file",
            [&] { MPI_CHECK(MPI_Bcast(&reason[0], msg[1], MPI_CHAR, 0, comm)); });
  if (why) *why = reason;
  return static_cast<FileProbe>(msg[0]);
}

namespace {

void delete_attr_if_exists(hid_t obj, const std::string& name) {
  if (H5_CHECK(H5Aexists(obj, name.c_str())) > 0) H5_CHECK(H5Adelete(obj, name.c_str()));
}

H5Id vlen_string_type() {
  H5Id t(H5_CHECK(H5Tcopy(H5T_C_S1)));
  H5_CHECK(H5Tset_size(t, H5T_VARIABLE));
  H5_CHECK(H5Tset_cset(t, H5T_CSET_UTF8));
  return t;
}

}  // namespace

void write_attr_string(hid_t obj, const std::string& name, const std::string& value) {
  delete_attr_if_exists(obj, name);
  // Variable-length UTF-8: the attribute holds a heap reference, so a long deck never runs
  // into the 64 KiB object-header limit, and h5py reads it back as str.
  H5Id type = vlen_string_type();
  H5Id space(H5_CHECK(H5Screate(H5S_SCALAR)));
  H5Id attr(H5_CHECK(H5Acreate2(obj, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT)));
  const char* p = value.c_str();
  H5_CHECK(H5Awrite(attr, type, &p));
}

void write_attr_int(hid_t obj, const std::string& name, int value) {
  delete_attr_if_exists(obj, name);
  H5Id space(H5_CHECK(H5Screate(H5S_SCALAR)));
  H5Id attr(H5_CHECK(
      H5Acreate2(obj, name.c_str(), H5T_STD_I32LE, space, H5P_DEFAULT, H5P_DEFAULT)));
  H5_CHECK(H5Awrite(attr, H5T_NATIVE_INT, &value));
}

void write_attr_ints(hid_t obj, const std::string& name, const std::vector<int>& values) {
  delete_attr_if_exists(obj, name);
  hsize_t n = values.size();
  H5Id space(H5_CHECK(H5Screate_simple(1, &n, nullptr)));
  H5Id attr(H5_CHECK(
      H5Acreate2(obj, name.c_str(), H5T_STD_I32LE, space, H5P_DEFAULT, H5P_DEFAULT)));
  int dummy = 0;
  H5_CHECK(H5Awrite(attr, H5T_NATIVE_INT, values.empty() ? &dummy : values.data()));
}

void write_attr_double(hid_t obj, const std::string& name, double value) {
  delete_attr_if_exists(obj, name);
  H5Id space(H5_CHECK(H5Screate(H5S_SCALAR)));
  H5Id attr(H5_CHECK(
      H5Acreate2(obj, name.c_str(), H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT)));
  H5_CHECK(H5Awrite(attr, H5T_NATIVE_DOUBLE, &value));
}

bool read_attr_string(hid_t obj, const std::string& name, std::string* value) {
  H5ErrorSilencer quiet;
  if (H5Aexists(obj, name.c_str()) <= 0) return false;
  H5Id attr(H5Aopen(obj, name.c_str(), H5P_DEFAULT));
  if (!attr.valid()) return false;
  H5Id ftype(H5Aget_type(attr));
  if (!ftype.valid() || H5Tget_class(ftype) != H5T_STRING) return false;
  H5Id space(H5Aget_space(attr));
  if (H5Sget_simple_extent_npoints(space) != 1) return false;
  if (H5Tis_variable_str(ftype) > 0) {
    H5Id mtype = vlen_string_type();
    char* p = nullptr;
    if (H5Aread(attr, mtype, &p) < 0) return false;
    *value = p ? std::string(p) : std::string();
    if (p) H5free_memory(p);
  } else {
    // fixed-length strings (written by other tools, e.g. h5py with numpy bytes)
    size_t n = H5Tget_size(ftype);
    H5Id mtype(H5Tcopy(H5T_C_S1));
    H5Tset_size(mtype, n);
    std::vector<char> buf(n + 1, 0);
    if (H5Aread(attr, mtype, buf.data()) < 0) return false;
    *value = std::string(buf.data(), strnlen(buf.data(), n));
  }
  return true;
}

bool read_attr_ints(hid_t obj, const std::string& name, std::vector<int>* values) {
  H5ErrorSilencer quiet;
  if (H5Aexists(obj, name.c_str()) <= 0) return false;
  H5Id attr(H5Aopen(obj, name.c_str(), H5P_DEFAULT));
  if (!attr.valid()) return false;
  H5Id ftype(H5Aget_type(attr));
  if (!ftype.valid() || H5Tget_class(ftype) != H5T_INTEGER) return false;
  H5Id space(H5Aget_space(attr));
  hssize_t n = H5Sget_simple_extent_npoints(space);
  if (n < 0) return false;
  values->assign(static_cast<size_t>(n), 0);
  int dummy = 0;
  return H5Aread(attr, H5T_NATIVE_INT, n ? values->data() : &dummy) >= 0;
}

bool path_exists(hid_t loc, const std::string& path) {
  H5ErrorSilencer quiet;
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t slash = path.find('/', pos);
    std::string prefix = path.substr(0, slash);
    if (!prefix.empty() && prefix.back() != '/' && H5Lexists(loc, prefix.c_str(), H5P_DEFAULT) <= 0)
      return false;
    if (slash == std::string::npos) break;
    pos = slash + 1;
  }
  return true;
}

std::vector<hsize_t> dataset_dims(hid_t dset) {
  H5Id space(H5_CHECK(H5Dget_space(dset)));
  int nd = H5_CHECK(H5Sget_simple_extent_ndims(space));
  std::vector<hsize_t> dims(nd);
  if (nd > 0) H5_CHECK(H5Sget_simple_extent_dims(space, dims.data(), nullptr));
  return dims;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string shape_str(const std::vector<hsize_t>& shape) {
  return shape_str(std::vector<int64_t>(shape.begin(), shape.end()));
}

void throw_if_any_failed(MPI_Comm comm, bool ok, const std::string& msg) {
  std::string m = msg;
  if (agree_error(comm, ok, &m)) throw UserError(m);
}

void make_dirs(MPI_Comm comm, const std::string& dir, const std::string& what) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  bool ok = true;
  std::string msg;
  if (rank == 0 && !dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec || !std::filesystem::is_directory(dir)) {
      ok = false;
      msg = "cannot create directory '" + dir + "' for '" + what + "': " + ec.message();
    }
  }
  // agree_error is an all-reduce: nobody creates a file before the directory exists
  throw_if_any_failed(comm, ok, msg);
}

void publish_file(MPI_Comm comm, const std::string& tmp, const std::string& final_path) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  bool ok = true;
  std::string msg;
  if (rank == 0 && std::rename(tmp.c_str(), final_path.c_str()) != 0) {
    ok = false;
    msg = "cannot rename '" + tmp + "' to '" + final_path + "': " + std::strerror(errno);
  }
  // the all-reduce inside doubles as the barrier: no rank returns before the final name exists
  throw_if_any_failed(comm, ok, msg);
}

uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

void check_same_on_all_ranks(MPI_Comm comm, uint64_t h, const char* what) {
  uint64_t lo = 0, hi = 0;
  watched("the MPI all-reduce that checks the ranks call HDF5 alike",
          [&] { MPI_CHECK(MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, comm)); });
  watched("the MPI all-reduce that checks the ranks call HDF5 alike",
          [&] { MPI_CHECK(MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, comm)); });
  if (lo != hi) VG_FAIL(what << " differ between ranks (collective HDF5 calls need identical arguments)");
}

}  // namespace io_detail
}  // namespace vitgrid
