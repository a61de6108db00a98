// predictions.h5 (DESIGN.md): logits and labels in dataset order, each rank writing its own
// rows collectively; published under its final name only once complete, like checkpoints.
#include <filesystem>

#include "h5_parallel.h"
#include "vitgrid/core/watchdog.h"
#include "vitgrid/io/metrics.h"

namespace vitgrid {

using io_detail::H5Id;

// Called by all ranks of comm (a rank without rows passes empty vectors).
void write_predictions(MPI_Comm comm, const std::string& path, const std::string& deck,
                       int64_t total, int num_classes, int64_t first_index,
                       const std::vector<float>& logits, const std::vector<int32_t>& labels) {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  WatchdogWait w("the collective HDF5 write of predictions.h5");
  const hsize_t rows = labels.size();
  const hsize_t k = static_cast<hsize_t>(num_classes);
  VG_CHECK(total >= 0 && num_classes > 0, "predictions: total " << total << ", classes " << num_classes);
  VG_CHECK(logits.size() == rows * k,
           "predictions: " << logits.size() << " logits for " << rows << " rows of " << k);
  VG_CHECK(rows == 0 || (first_index >= 0 && first_index + static_cast<int64_t>(rows) <= total),
           "predictions: rows [" << first_index << ", " << first_index + static_cast<int64_t>(rows)
                                 << ") outside [0, " << total << ")");
  uint64_t args[2] = {static_cast<uint64_t>(total), k};
  io_detail::check_same_on_all_ranks(comm, io_detail::fnv1a(1469598103934665603ull, args, sizeof(args)),
                                     "prediction shapes");

  io_detail::make_dirs(comm, std::filesystem::path(path).parent_path().string(), path);
  const std::string tmp = path + ".tmp";
  {
    H5Id file = io_detail::create_parallel(comm, tmp);
    io_detail::throw_if_any_failed(comm, file.valid(), "predictions '" + tmp + "': cannot create the file");
    H5Id dxpl = io_detail::collective_dxpl();
    H5Id dcpl(H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)));
    H5_CHECK(H5Pset_layout(dcpl, H5D_CONTIGUOUS));
    H5_CHECK(H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY));
    H5_CHECK(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));  // every row is written below

    const hsize_t n = static_cast<hsize_t>(total);
    float fdummy = 0.0f;
    int32_t idummy = 0;
    hsize_t one = 1;
    {
      hsize_t dims[2] = {n, k};
      H5Id fspace(H5_CHECK(H5Screate_simple(2, dims, nullptr)));
      H5Id dset(H5_CHECK(H5Dcreate2(file, "logits", H5T_IEEE_F32LE, fspace, H5P_DEFAULT, dcpl, H5P_DEFAULT)));
      hsize_t cnt = rows * k;
      H5Id mspace(H5_CHECK(H5Screate_simple(1, rows ? &cnt : &one, nullptr)));
      if (rows) {
        hsize_t off[2] = {static_cast<hsize_t>(first_index), 0}, c2[2] = {rows, k};
        H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, off, nullptr, c2, nullptr));
      } else {
        H5_CHECK(H5Sselect_none(fspace));
        H5_CHECK(H5Sselect_none(mspace));
      }
      H5_CHECK(H5Dwrite(dset, H5T_NATIVE_FLOAT, mspace, fspace, dxpl, rows ? logits.data() : &fdummy));
    }
    {
      H5Id fspace(H5_CHECK(H5Screate_simple(1, &n, nullptr)));
      H5Id dset(H5_CHECK(H5Dcreate2(file, "labels", H5T_STD_I32LE, fspace, H5P_DEFAULT, dcpl, H5P_DEFAULT)));
      H5Id mspace(H5_CHECK(H5Screate_simple(1, rows ? &rows : &one, nullptr)));
      if (rows) {
        hsize_t off = static_cast<hsize_t>(first_index);
        H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, &off, nullptr, &rows, nullptr));
      } else {
        H5_CHECK(H5Sselect_none(fspace));
        H5_CHECK(H5Sselect_none(mspace));
      }
      H5_CHECK(H5Dwrite(dset, H5T_NATIVE_INT32, mspace, fspace, dxpl, rows ? labels.data() : &idummy));
    }
    io_detail::write_attr_string(file, "deck", deck);
  }  // collective close
  io_detail::publish_file(comm, tmp, path);
}

}  // namespace vitgrid
