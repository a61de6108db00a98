// metrics.h5 (layout: vitgrid/io/metrics.h): one file, written by rank 0 alone through the
// serial (sec2) driver while the run goes on, and flushed after every append so plotting tools
// (h5py) can read it mid-run. The other ranks send rank 0 their per-rank values (an
// MPI_Gather at each flush) and never touch HDF5 for it.
//
// Why rank 0 alone: the metrics are a few hundred bytes per step, so parallel I/O buys
// nothing, and a parallel-HDF5 write that fails on one rank (a full disk) leaves the ranks in
// different collectives inside HDF5 (a flush waits for good in MPI_Barrier on one rank and
// MPI_Bcast on another); no check between HDF5 calls can prevent a divergence inside one call.
// Here every public call is rank 0's serial work followed by one agreement on the writer's
// communicator (agree_error): a failure on rank 0 (cannot create or open, damaged file, a
// write or flush that fails) becomes the same UserError on every rank. While rank 0 writes, an
// io_detail::SoftFailures scope records a failed HDF5 call instead of aborting. Before it
// writes, rank 0 reserves the blocks the write may need (reserve()): a write that fails
// half-way leaves HDF5 metadata pointing at bytes never written (a damaged file), so on a full
// disk or a quota the write is refused before it starts and the file stays as the last flush
// left it. A write that fails all the same (a file system that cannot reserve) is agreed alike;
// rank 0 then closes the file without writing to it again (close_file).
#include "vitgrid/io/metrics.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "metrics_internal.h"
#include "h5_parallel.h"
#include "vitgrid/core/test_hooks.h"
#include "vitgrid/core/watchdog.h"

namespace vitgrid {

MetricsWriter::MetricsWriter(MPI_Comm comm, const std::string& path, const std::string& deck,
                             const std::vector<int>& grid, const std::string& tensor_mode,
                             const std::string& backend, bool append, int64_t resume_step)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.comm = comm;
  m.path = path;
  MPI_Comm_rank(comm, &m.rank);
  MPI_Comm_size(comm, &m.world);
  const std::string parent = std::filesystem::path(path).parent_path().string();
  m.dir = parent.empty() ? "." : parent;

  io_detail::make_dirs(comm, parent, path);
  std::string why;
  io_detail::FileProbe probe;
  {
    // rank 0 reads the file (serially) inside probe_file
    std::unique_lock<std::recursive_mutex> lock(hdf5_mutex(), std::defer_lock);
    if (m.rank == 0) lock.lock();
    probe = io_detail::probe_file(comm, path, &why);
  }
  if (append && probe == io_detail::FileProbe::not_hdf5)
    throw UserError("metrics file '" + path + "' exists but is not an HDF5 file; cannot append");
  if (append && probe == io_detail::FileProbe::damaged)
    throw UserError("metrics file '" + path + "' is damaged (" + why +
                    "); cannot append: move it away to continue the run");

  const bool appending = append && probe == io_detail::FileProbe::ok;
  std::string err;
  if (m.rank == 0) {
    // This run is a segment of its own (its layout may differ from the last one's); the
    // per-rank tables are as wide as the largest segment left in the file.
    auto new_width = [&] {
      int64_t w = m.world;
      for (int64_t s : m.seg_world) w = std::max(w, s);
      return static_cast<hsize_t>(w);
    };
    // the attributes' values (strings on the global heap) and this run's segment row
    const hsize_t attr_bytes = 2 * (deck.size() + tensor_mode.size() + backend.size() + 64) + 4096;
    if (appending) {
      err = m.root_work("cannot append to it", [&] {
        H5Id fapl = writer_fapl();
        m.file = H5Id(H5_CHECK(H5Fopen(path.c_str(), H5F_ACC_RDWR, fapl)));
        m.stop_if_failed();
        m.open_datasets();
        m.open_segments();
        const hsize_t train_keep = m.kept_rows(m.train[0], resume_step);
        const hsize_t eval_keep = m.kept_rows(m.eval[0], resume_step);
        const hsize_t seg_keep =
            m.has_segments ? m.kept_rows(m.seg[kSegFirstStep], resume_step) : 0;
        m.stop_if_failed();
        // Room for everything this call writes, checked before the first change: widened
        // tables, tables copied into extendible ones, the segment row, the attributes.
        std::vector<int64_t> kept_worlds(
            m.seg_world.begin(),
            m.seg_world.begin() + std::min<size_t>(seg_keep, m.seg_world.size()));
        int64_t w_after = m.world;
        for (int64_t s : (m.has_segments ? kept_worlds : std::vector<int64_t>{m.old_world}))
          w_after = std::max(w_after, s);
        hsize_t need = attr_bytes;
        for (size_t i = 0; i < kNumTrain; ++i) {
          if (!kTrain[i].per_rank) continue;
          const hsize_t w = std::max<hsize_t>(m.width, static_cast<hsize_t>(w_after));
          // a copy: the kept rows, and up to a chunk (4096 cells) more on each side
          need += m.fixed_width ? (train_keep * w + 2 * 4096) * sizeof(double) + kPerChunkIndex
                                : chunk_growth(m.train[i], {train_keep, w});
        }
        if (m.has_segments) {
          for (size_t i = 0; i < kNumSeg; ++i)
            need += chunk_growth(m.seg[i], i == kSegGrid ? std::vector<hsize_t>{seg_keep + 1, 3}
                                                         : std::vector<hsize_t>{seg_keep + 1});
        } else {
          need += kNewFileBytes;
        }
        m.stop_if_failed();
        m.reserve(need);

        m.truncate_to(train_keep, eval_keep, seg_keep);
        const hsize_t w = new_width();
        if (w < m.width && !m.fixed_width) m.set_width(w);
        m.continue_old_layout();
        m.add_segment(resume_step + 1, m.world, grid, tensor_mode);
        m.set_width(new_width());
        m.write_root_attributes(deck, grid, tensor_mode, backend);
        H5_CHECK(H5Fflush(m.file, H5F_SCOPE_GLOBAL));
      });
    } else {
      err = m.root_work("cannot create the file", [&] {
        // H5Fcreate writes the superblock at once (and HDF5 1.10 leaks what a failed create
        // made): the free space first, the room reserved once the file exists
        m.check_free(kNewFileBytes + attr_bytes);
        H5Id fapl = writer_fapl();
        std::error_code ec;
        const bool existed = std::filesystem::exists(path, ec);
        m.file = H5Id(H5_CHECK(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl)));
        // this call's own file (or what it made of an older one): nothing of it is worth keeping
        m.remove_on_failure = m.file.valid() || !existed;
        m.stop_if_failed();
        m.reserve(kNewFileBytes + attr_bytes);
        m.create_datasets();
        m.create_segments();
        m.stop_if_failed();
        m.add_segment(resume_step + 1, m.world, grid, tensor_mode);
        m.set_width(new_width());
        m.write_root_attributes(deck, grid, tensor_mode, backend);
        H5_CHECK(H5Fflush(m.file, H5F_SCOPE_GLOBAL));
      });
    }
  }
  m.settle(err);
}

// Called by all ranks of comm: writes the rows still buffered (collective: rank 0 gathers),
// then rank 0 closes the file. While an error unwinds the stack there is no flush (this rank
// may be the only one failing, and the others would never come to the gather): rank 0 closes
// its file as the last flush left it (a serial file: no other rank takes part), the rows
// buffered since are lost, and fail_agreed decides the rest.
MetricsWriter::~MetricsWriter() {
  if (!impl_) return;
  Impl& m = *impl_;
  if (!unwinding() && !m.failed) {
    try {
      flush();
    } catch (const UserError& e) {
      // agreed on every rank; a destructor cannot throw
      if (m.rank == 0) {
        std::fprintf(stderr, "vitgrid: warning: %s\n", e.what());
        std::fflush(stderr);
      }
    }
  }
  if (m.rank == 0 && !m.close_file() && !unwinding() && !m.failed) {
    std::fprintf(stderr, "vitgrid: warning: metrics file '%s': closing it failed\n",
                 m.path.c_str());
    std::fflush(stderr);
  }
}

void MetricsWriter::add_train(const TrainRow& r) { impl_->train_buf.push_back(r); }
void MetricsWriter::add_eval(const EvalRow& r) { impl_->eval_buf.push_back(r); }

// Called by all ranks of comm, each having added the same number of rows.
void MetricsWriter::flush() {
  Impl& m = *impl_;
  // Row counts must agree, or the gather below would not match between ranks: check with one
  // small all-reduce rather than hanging.
  uint64_t counts[2] = {m.train_buf.size(), m.eval_buf.size()};
  uint64_t h = io_detail::fnv1a(1469598103934665603ull, counts, sizeof(counts));
  io_detail::check_same_on_all_ranks(m.comm, h, "metrics row counts");
  if (counts[0] == 0 && counts[1] == 0) return;
  if (m.failed) throw UserError(m.failure);

  // Each rank's step times, then its device memory, its replaced images and its input waits;
  // rank 0 receives them rank after rank.
  const size_t n = counts[0];
  std::vector<double> mine(kNumPerRank * n), all;
  for (size_t i = 0; i < n; ++i) {
    mine[i] = m.train_buf[i].step_time_s;
    mine[n + i] = m.train_buf[i].device_mem_bytes;
    mine[2 * n + i] = m.train_buf[i].bad_images;
    mine[3 * n + i] = m.train_buf[i].input_wait_s;
  }
  if (m.rank == 0) all.resize(kNumPerRank * n * static_cast<size_t>(m.world));
  if (n > 0) {
    WatchdogWait w("the MPI gather of the metrics rows");
    MPI_CHECK(MPI_Gather(mine.data(), static_cast<int>(kNumPerRank * n), MPI_DOUBLE, all.data(),
                         static_cast<int>(kNumPerRank * n), MPI_DOUBLE, 0, m.comm));
  }
  std::string err;
  if (m.rank == 0) err = m.root_work("cannot write", [&] { m.write_rows(all); });
  m.train_buf.clear();
  m.eval_buf.clear();
  m.settle(err);
}

// Called by all ranks of comm; rank 0's value is written.
void MetricsWriter::set_attribute(const std::string& name, const std::string& value) {
  Impl& m = *impl_;
  if (m.failed) throw UserError(m.failure);
  std::string err;
  if (m.rank == 0)
    err = m.root_work("cannot write", [&] {
      m.reserve(2 * (name.size() + value.size()) + 4096);
      io_detail::write_attr_string(m.file, name, value);
      H5_CHECK(H5Fflush(m.file, H5F_SCOPE_GLOBAL));
    });
  m.settle(err);
}

// Called by all ranks of comm; rank 0's value is written.
void MetricsWriter::set_attribute(const std::string& name, double value) {
  Impl& m = *impl_;
  if (m.failed) throw UserError(m.failure);
  std::string err;
  if (m.rank == 0)
    err = m.root_work("cannot write", [&] {
      m.reserve(2 * name.size() + 4096);
      io_detail::write_attr_double(m.file, name, value);
      H5_CHECK(H5Fflush(m.file, H5F_SCOPE_GLOBAL));
    });
  m.settle(err);
}

}  // namespace vitgrid
