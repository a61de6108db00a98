// Checkpoints: one shared HDF5 file per step, written collectively (DESIGN.md):
//   /model/<timm name>           fp32, global (unsharded) shape
//   /optim/<timm name>/<state>   fp32, global shape (exp_avg, exp_avg_sq, momentum_buffer)
//   /state/<name>                scalars / small vectors (step, epoch, cursor, loss scale ...)
//   root attributes: deck, grid, world_size, tensor_mode, version, complete (written last)
// Written as step_<8 digits>.h5.tmp, marked complete, then renamed; a file without
// complete = 1 is never loaded.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace vitgrid {

// One rank's part of one global tensor: the hyperslab [offset, offset+count) of the global
// shape, held in `data` (host fp32, row-major over count). Ranks holding a replica of the same
// part set write = false except one, so each element is written once. A rank with no part
// passes count with a zero (it still takes part in the collective calls).
struct TensorShard {
  std::string name;  // e.g. "model/blocks.0.attn.qkv.weight" or "optim/blocks.0.attn.qkv.weight/exp_avg"
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offset;
  std::vector<int64_t> count;
  // Optional HDF5-style strided selection: `count` blocks of `block` elements spaced `stride`
  // per dimension (e.g. a tensor-parallel shard of qkv.weight holds its heads' rows of q, k
  // and v: three blocks). Empty: one contiguous block of `count`. data holds the selected
  // elements in row-major file order.
  std::vector<int64_t> stride;
  std::vector<int64_t> block;
  float* data = nullptr;
  bool write = true;
  // Reading: a tensor the file may lack (state of a mode an earlier run did not use, as FP8's
  // scaling): missing, it is skipped and `found` set false (data untouched); present, it must
  // fit like any other.
  bool optional = false;
  bool found = true;
  // The elements of the selection (the product of count, times block when strided).
  int64_t elements() const {
    int64_t n = 1;
    for (size_t d = 0; d < count.size(); ++d) n *= count[d] * (block.empty() ? 1 : block[d]);
    return n;
  }
};

struct CheckpointMeta {
  std::string deck;             // resolved deck text
  std::vector<int> grid;        // pipeline, data, tensor
  std::string tensor_mode;
  std::string backend;
  int world_size = 1;
  // small named state: step, epoch, cursor, loss scale, scaler good steps, rng ...
  std::map<std::string, std::vector<double>> state;
};

// "step_00000020.h5": the file name of step 20's checkpoint in its directory.
std::string step_file_name(int64_t step);

// Called by all ranks of comm. Writes dir/step_<8 digits>.h5 atomically; keeps the newest
// `keep` complete checkpoints when keep > 0. Returns the path. Every shard's name and global
// shape must be identical on all ranks (same order). direct_threads > 0 (checkpoint.direct_io):
// rank 0 lays the file out with serial HDF5, then every tensor goes past HDF5, written by that
// many threads per rank (positioned O_DIRECT writes beside the checksums, then fsync;
// checkpoint_direct.cpp); a tensor whose parts would be many short runs (split along its
// columns) is stored in chunks of one rank's block. 0: every tensor contiguous, through HDF5's
// collective writes. The same values and names either way.
// `times` (optional): where this rank's write spent its time, in seconds.
struct CheckpointWriteTimes {
  double hash = 0.0;     // the checksums (threads over this rank's tensors, one all-reduce)
  double hdf5 = 0.0;     // HDF5: creating, writing what goes through it, flushing, closing
  double direct = 0.0;   // direct_io: the wait for this rank's direct writes after the close
                         // (they run from the layout on), the fsync, the agreement
  double publish = 0.0;  // the rename, keep-K pruning
};
std::string write_checkpoint(MPI_Comm comm, const std::string& dir, int64_t step,
                             const std::vector<TensorShard>& shards, const CheckpointMeta& meta,
                             int keep = 0, int direct_threads = 0,
                             CheckpointWriteTimes* times = nullptr);

// Called by all ranks of comm. Reads each shard's hyperslab from `path` into shard.data; the
// global shape stored must equal the shard's global_shape. Fills meta (deck, grid, state).
// Throws UserError naming the file and dataset when the file is missing, incomplete, damaged
// anywhere (every dataset is verified against its checksum first, not only those read), or a
// tensor is absent or of the wrong shape; never aborts on a damaged file.
void read_checkpoint(MPI_Comm comm, const std::string& path, std::vector<TensorShard>& shards,
                     CheckpointMeta* meta);

// Integrity: every dataset carries a `checksum` attribute (uint64: the sum over elements i, in
// global row-major order, of mix64(i * 0x9E3779B97F4A7C15 ^ bits(x_i)) mod 2^64, bits the raw
// IEEE pattern). verify_checkpoint checks all of them; throws UserError naming file and
// dataset. Called by all ranks of comm.
void verify_checkpoint(MPI_Comm comm, const std::string& path);

// checkpoint.resume = auto. Called by all ranks of comm. Reads (as read_checkpoint) the newest
// checkpoint in `dir` that is complete, verifies and fits `shards`, and returns its path; ""
// when `dir` holds no checkpoint file at all (unfinished .tmp writes are named in a warning).
// Every newer one passed over is named in a warning with the reason, then renamed
// <name>.rejected, since this run writes that step again. When checkpoint files exist but none
// can be resumed from, throws UserError naming each and why: a fresh start would overwrite
// them.
std::string resume_checkpoint(MPI_Comm comm, const std::string& dir,
                              std::vector<TensorShard>& shards, CheckpointMeta* meta);

}  // namespace vitgrid
