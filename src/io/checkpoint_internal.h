// checkpoint.cpp's helpers that the read side (checkpoint_read.cpp) shares: file names, shard
// bounds and hyperslabs, the agreed verdicts of collective reads, and the per-dataset checksums.
#pragma once
#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "h5_parallel.h"
#include "vitgrid/io/checkpoint.h"

namespace vitgrid {
namespace ckpt_detail {

std::string join_path(const std::string& dir, const std::string& name);
// Parses "step_<digits>.h5" (and nothing else: a ".h5.tmp" is an unfinished write).
bool parse_step_file_name(const std::string& name, int64_t* step);
void check_shard_bounds(const TensorShard& s);
// Whether s selects strided blocks (stride and block given; check_shard_bounds: both or none).
bool strided(const TensorShard& s);
// Names and global shapes must match on every rank, since dataset creation and the
// collective transfers pair up call by call.
uint64_t shard_signature(const std::vector<TensorShard>& shards);
// File and memory dataspaces selecting this rank's hyperslab, or nothing (the rank still
// takes part in the collective transfer).
std::pair<io_detail::H5Id, io_detail::H5Id> shard_spaces(const TensorShard& s, bool active);
// The first failing rank's message (every rank gets the same), or "" when all are ok: called by
// all ranks of comm after each step of a read that can fail on one rank only.
std::string first_failure(MPI_Comm comm, bool ok, std::string msg);
// Every dataset of the file (model, optim, state), in name order; false if the file's links
// cannot be walked (damaged metadata).
bool all_datasets(hid_t file, std::vector<std::string>* names);
// "" or a message naming the first dataset whose checksum fails, the same on every rank.
std::string verify_datasets(MPI_Comm comm, hid_t file, const std::string& what,
                            const std::vector<std::string>& names);

// checkpoint_direct.cpp. The selection of s as runs of consecutive elements of its dataset in
// row-major order, (first element, length), in the order of s.data: one run for a whole
// tensor or a block of rows, one per row piece for a split along a later dimension, one per
// block of a strided selection.
void file_runs(const TensorShard& s, std::vector<std::pair<int64_t, int64_t>>* runs);
// One range of a file and the bytes that go there.
struct FileRange {
  uint64_t offset = 0;
  const void* data = nullptr;
  size_t bytes = 0;
};

// direct_io: how a tensor is stored so that each rank's part of it is few, long file ranges.
// A part made of many short runs (a split along a later axis: 1d's Row Linears, 2d/2.5d/3d
// blocks) asks for chunks the shape of one of its blocks, so that the part is one chunk per
// block, each contiguous in the file; a part that is already one run per block (whole tensors,
// row blocks, 1d's strided qkv) asks for contiguous storage. Returns, for this rank: {} when it
// writes nothing of s, all zeros for contiguous, else the chunk shape (every dimension > 0).
// `min_run_bytes`: runs at least this long are long enough.
std::vector<int64_t> chunk_proposal(const TensorShard& s, size_t min_run_bytes);
// Called by all ranks of comm: each tensor's chunk shape, empty for contiguous storage. A
// tensor is chunked only when every rank writing part of it proposes the same shape.
std::vector<std::vector<int64_t>> agree_chunk_shapes(MPI_Comm comm,
                                                     const std::vector<TensorShard>& shards,
                                                     size_t min_run_bytes = size_t(1) << 20);
// This rank's part of s as file ranges, appended to out: `addr` is the dataset's file offset
// (contiguous, `chunk` empty) or every chunk's, row-major over the chunk grid (`chunk` as
// agree_chunk_shapes gave it, which this rank's selection then fits block by block).
void direct_ranges(const TensorShard& s, const std::vector<int64_t>& chunk,
                   const std::vector<uint64_t>& addr, std::vector<FileRange>* out);
// Writes ranges into the existing file `path` on `threads` threads, from construction on:
// whole pages with O_DIRECT where the file system takes it (each thread copies up to
// `piece_bytes`, a multiple of 4096, at a time into its own aligned buffer, so `threads`
// requests are in flight), the unaligned edges buffered, and a range with fewer whole pages
// than `min_direct` bytes buffered whole (the row pieces of a tensor split along its columns:
// the page cache joins the ranks' pieces into long writes at the fsync). The ranges must not overlap and stay valid until finish() or the destructor. The
// file may still be open elsewhere (HDF5 writing its metadata) while the threads run; finish()
// is called once that is closed: it waits for the threads, fsyncs the file (what every writer
// put there) and returns "" or what failed, naming the file. The destructor without finish()
// stops the threads after their current request and joins them.
class DirectWriter {
 public:
  DirectWriter(const std::string& path, std::vector<FileRange> ranges, int threads,
               size_t piece_bytes = size_t(8) << 20, size_t min_direct = size_t(1) << 20);
  ~DirectWriter();
  DirectWriter(const DirectWriter&) = delete;
  DirectWriter& operator=(const DirectWriter&) = delete;
  std::string finish();

 private:
  struct Piece {
    uint64_t offset;
    const char* data;
    size_t bytes;
    bool direct;
  };
  void work();
  void fail(const std::string& why);
  void join();

  std::string path_;
  size_t piece_;
  int fd_ = -1, dfd_ = -1;  // buffered; O_DIRECT (-1 where the file system refuses it)
  std::vector<Piece> pieces_;  // the buffered ones first
  size_t buffered_ = 0;
  std::atomic<size_t> next_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::string error_;
  std::vector<std::thread> threads_;
};

}  // namespace ckpt_detail
}  // namespace vitgrid
