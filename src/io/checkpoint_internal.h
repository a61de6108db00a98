// checkpoint.cpp's helpers that the read side (checkpoint_read.cpp) shares: file names, shard
// bounds and hyperslabs, the agreed verdicts of collective reads, and the per-dataset checksums.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <string>
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

// checkpoint_direct.cpp. Whether the selection of s is one contiguous range of its dataset in
// row-major order: its first element and its length, in elements.
bool contiguous_range(const TensorShard& s, int64_t* first, int64_t* elems);
// One range of a file and the bytes that go there.
struct FileRange {
  uint64_t offset = 0;
  const void* data = nullptr;
  size_t bytes = 0;
};
// Writes each range into the existing file `path` (whole pages with O_DIRECT where the file
// system takes it, the rest buffered), then fsyncs it; "" or what failed, naming the file.
std::string write_ranges(const std::string& path, const std::vector<FileRange>& ranges);

}  // namespace ckpt_detail
}  // namespace vitgrid
