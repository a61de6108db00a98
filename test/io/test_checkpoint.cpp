// Checkpoints: written by one split of every tensor, read back by another; metadata, pruning,
// latest-complete lookup and every refusal, each agreed on all ranks.
#include <gtest/gtest.h>

#include <deque>
#include <fstream>

#include "checkpoint_internal.h"
#include "io_test_util.h"
#include "vitgrid/io/checkpoint.h"
#include "vitgrid/io/metrics.h"

namespace {

using vgtest::rank_of;
using vgtest::size_of;

struct TensorDef {
  std::string name;
  std::vector<int64_t> shape;
};

// Exact in fp32 for the sizes used here, so comparisons are exact.
float value_of(size_t tensor, int64_t flat) { return static_cast<float>(tensor) * 1000.0f + 0.25f * flat; }

// Shards plus the buffers they point into (deque: stable addresses).
struct ShardSet {
  std::vector<vitgrid::TensorShard> shards;
  std::deque<std::vector<float>> bufs;
};

// Block `part` of `parts` over n (uneven; empty when n < parts).
std::pair<int64_t, int64_t> block(int64_t n, int parts, int part) {
  return {n * part / parts, n * (part + 1) / parts};
}

// This rank's shard of `def` split along `axis` into block `part` of `parts` (axis -1: the whole
// tensor). fill: store the expected values; otherwise a sentinel the read must overwrite.
void add_shard(ShardSet* set, size_t tensor_index, const TensorDef& def, int axis, int part,
               int parts, bool fill, bool write = true) {
  vitgrid::TensorShard s;
  s.name = def.name;
  s.global_shape = def.shape;
  s.offset.assign(def.shape.size(), 0);
  s.count = def.shape;
  if (axis >= 0) {
    auto b = block(def.shape[axis], parts, part);
    s.offset[axis] = b.first;
    s.count[axis] = b.second - b.first;
  }
  int64_t n = 1;
  for (auto c : s.count) n *= c;
  set->bufs.emplace_back(static_cast<size_t>(n), -12345.0f);
  auto& buf = set->bufs.back();
  if (fill) {
    // walk the hyperslab in row-major order, computing each element's global flat index
    const size_t nd = def.shape.size();
    std::vector<int64_t> idx(nd, 0);
    for (int64_t i = 0; i < n; ++i) {
      int64_t flat = 0;
      for (size_t d = 0; d < nd; ++d) flat = flat * def.shape[d] + s.offset[d] + idx[d];
      buf[i] = value_of(tensor_index, flat);
      for (int d = static_cast<int>(nd) - 1; d >= 0; --d) {
        if (++idx[d] < s.count[d]) break;
        idx[d] = 0;
      }
    }
  }
  s.data = buf.empty() ? nullptr : buf.data();
  s.write = write;
  set->shards.push_back(s);
}

// Expected contents of a shard, via the same walk.
void expect_shard_values(const vitgrid::TensorShard& s, size_t tensor_index) {
  ShardSet expect;
  add_shard(&expect, tensor_index, {s.name, s.global_shape}, -1, 0, 1, false);
  auto& e = expect.shards[0];
  e.offset = s.offset;
  e.count = s.count;
  const size_t nd = s.global_shape.size();
  int64_t n = 1;
  for (auto c : s.count) n *= c;
  std::vector<int64_t> idx(nd, 0);
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t flat = 0;
    for (size_t d = 0; d < nd; ++d) flat = flat * s.global_shape[d] + s.offset[d] + idx[d];
    if (s.data[i] != value_of(tensor_index, flat) && bad++ < 5)
      ADD_FAILURE() << s.name << " element " << i << " (global " << flat << "): " << s.data[i]
                    << " != " << value_of(tensor_index, flat);
    for (int d = static_cast<int>(nd) - 1; d >= 0; --d) {
      if (++idx[d] < s.count[d]) break;
      idx[d] = 0;
    }
  }
}

const std::vector<TensorDef> kTensors = {
    {"model/patch_embed.proj.weight", {7, 5}},
    {"model/blocks.0.attn.qkv.weight", {6, 9}},
    {"model/cls_token", {1, 1, 8}},
    {"model/pos_embed", {2, 3, 4}},
    {"model/norm.bias", {10}},
    {"model/head.bias", {3}},
    {"optim/blocks.0.attn.qkv.weight/exp_avg", {6, 9}},
    // over 64 KiB: aligned to 1 MiB in the file, whole pages written with O_DIRECT (direct_io)
    {"model/blocks.0.mlp.fc1.weight", {96, 301}},
    // split along its columns evenly on 1 to 4 ranks: with direct_io, in chunks of one
    // rank's columns, so that each rank's part is one range of the file
    {"model/blocks.0.mlp.fc2.weight", {64, 24}},
};
// split axis per tensor when writing and when reading (-1: replicated / whole)
const int kWriteAxis[] = {0, 1, 2, 0, -1, 0, 0, 0, 1};
const int kReadAxis[] = {1, 0, 2, 2, 0, 0, 1, 1, 0};

ShardSet make_write_set() {
  ShardSet set;
  const int r = rank_of(), p = size_of();
  for (size_t t = 0; t < kTensors.size(); ++t) {
    // the replicated tensor: every rank holds it all, only the last rank writes it
    bool write = kWriteAxis[t] >= 0 || r == p - 1;
    add_shard(&set, t, kTensors[t], kWriteAxis[t], r, p, true, write);
  }
  return set;
}

ShardSet make_read_set() {
  ShardSet set;
  const int r = rank_of(), p = size_of();
  // reversed block order for reads, so no rank reads what it wrote on a 1-D split
  for (size_t t = 0; t < kTensors.size(); ++t) add_shard(&set, t, kTensors[t], kReadAxis[t], p - 1 - r, p, false);
  return set;
}

vitgrid::CheckpointMeta make_meta(int64_t step) {
  vitgrid::CheckpointMeta m;
  m.deck = "[run]\nsteps = 10\nout_dir = runs/x\n\n[model]\npreset = vit_tiny_patch16_224\n";
  m.grid = {1, size_of(), 1};
  m.tensor_mode = "1d";
  m.backend = "cpu";
  m.world_size = size_of();
  m.state["step"] = {static_cast<double>(step)};
  m.state["epoch"] = {2.0};
  m.state["loss_scale"] = {65536.0};
  m.state["rng/philox"] = {1.0, 2.0, 3.0, 4.5};
  m.state["empty"] = {};
  return m;
}

// Rank 0: copies a checkpoint and removes its `complete` attribute with the HDF5 API.
void make_incomplete_copy(const std::string& from, const std::string& to) {
  if (rank_of() == 0) {
    std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing);
    std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
    vitgrid::io_detail::H5Id f(H5Fopen(to.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    ASSERT_TRUE(f.valid());
    ASSERT_GE(H5Adelete(f, "complete"), 0);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

void write_garbage(const std::string& path, size_t bytes) {
  if (rank_of() == 0) {
    std::ofstream o(path, std::ios::binary);
    for (size_t i = 0; i < bytes; ++i) o.put(static_cast<char>((i * 131 + 7) & 0xff));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  for (auto& e : std::filesystem::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// direct_threads 0: every tensor through HDF5's collective writes; 1 or 3: the tensors whose
// part is one file range on every rank written past HDF5 (O_DIRECT, by that many threads per
// rank beside the checksums and metadata), the others (split along a later axis) through
// HDF5, in the same file
class CheckpointIo : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(DirectIo, CheckpointIo, ::testing::Values(0, 1, 3));

TEST_P(CheckpointIo, RoundTripAcrossSplits) {
  vgtest::SharedTmpDir tmp;
  ShardSet w = make_write_set();
  std::string path = vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp / "ckpt", 7, w.shards,
                                               make_meta(7), 0, GetParam());
  EXPECT_EQ(path, tmp / "ckpt/step_00000007.h5");
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  ShardSet r = make_read_set();
  vitgrid::read_checkpoint(MPI_COMM_WORLD, path, r.shards, nullptr);
  for (size_t t = 0; t < kTensors.size(); ++t) expect_shard_values(r.shards[t], t);

  // independent check of the global layout: rank 0 reads each whole dataset serially
  if (rank_of() == 0) {
    for (size_t t = 0; t < kTensors.size(); ++t) {
      std::vector<hsize_t> dims;
      auto v = vgtest::read_all<float>(path, kTensors[t].name, H5T_NATIVE_FLOAT, &dims);
      EXPECT_EQ(std::vector<hsize_t>(kTensors[t].shape.begin(), kTensors[t].shape.end()), dims)
          << kTensors[t].name;
      for (size_t i = 0; i < v.size(); ++i)
        ASSERT_EQ(v[i], value_of(t, static_cast<int64_t>(i))) << kTensors[t].name << " at " << i;
    }
    // the storage: contiguous, but the evenly column-split tensor under direct_io on several
    // ranks, in chunks of one rank's columns
    std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
    vitgrid::io_detail::H5Id f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
    for (size_t t = 0; t < kTensors.size(); ++t) {
      vitgrid::io_detail::H5Id d(H5Dopen2(f, kTensors[t].name.c_str(), H5P_DEFAULT));
      vitgrid::io_detail::H5Id dcpl(H5Dget_create_plist(d));
      const bool chunked = GetParam() > 0 && size_of() > 1 && kTensors[t].name.find("fc2") != std::string::npos;
      ASSERT_EQ(H5Pget_layout(dcpl), chunked ? H5D_CHUNKED : H5D_CONTIGUOUS) << kTensors[t].name;
      if (!chunked) continue;
      hsize_t c[2] = {0, 0};
      ASSERT_EQ(H5Pget_chunk(dcpl, 2, c), 2);
      EXPECT_EQ(c[0], 64u);
      EXPECT_EQ(c[1], static_cast<hsize_t>(24 / size_of()));
    }
  }
}

// A .tmp left by a killed run whose rank 0 still holds it open (a process not yet gone: here
// this process, through HDF5, which refuses to truncate a file it has open) is replaced by a
// new file, not truncated: the write succeeds and reads back whole; the old one stays open.
TEST(CheckpointIo, StaleTmpStillOpenIsReplaced) {
  vgtest::SharedTmpDir tmp;
  const std::string dir = tmp / "ckpt", stale = dir + "/step_00000007.h5.tmp";
  vitgrid::io_detail::H5Id held;
  if (rank_of() == 0) {
    std::filesystem::create_directories(dir);
    std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
    held = vitgrid::io_detail::H5Id(H5Fcreate(stale.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT,
                                              H5P_DEFAULT));
    ASSERT_TRUE(held.valid());
  }
  MPI_Barrier(MPI_COMM_WORLD);
  ShardSet w = make_write_set();
  const std::string path =
      vitgrid::write_checkpoint(MPI_COMM_WORLD, dir, 7, w.shards, make_meta(7), 0, 2);
  EXPECT_FALSE(std::filesystem::exists(stale));
  ShardSet r = make_read_set();
  vitgrid::read_checkpoint(MPI_COMM_WORLD, path, r.shards, nullptr);
  for (size_t t = 0; t < kTensors.size(); ++t) expect_shard_values(r.shards[t], t);
  if (rank_of() == 0) {
    std::lock_guard<std::recursive_mutex> lock(vitgrid::hdf5_mutex());
    held.reset();
  }
}

// The chunk shape a part asks for, and its ranges in the chunks: a 2d-mode qkv-like part,
// three strided blocks of rows, each a column block (6 runs of 4 floats), asks for chunks of one
// block and writes three whole chunks; a part not on the chunk grid, or already one run per
// block, stays contiguous.
TEST(DirectLayout, ChunksOfOneBlock) {
  using vitgrid::ckpt_detail::chunk_proposal;
  std::vector<float> data(24);
  vitgrid::TensorShard s;
  s.name = "model/blocks.0.attn.qkv.weight";
  s.global_shape = {12, 8};
  s.offset = {2, 4};
  s.stride = {4, 1};
  s.block = {2, 4};
  s.count = {3, 1};
  s.data = data.data();
  EXPECT_EQ(chunk_proposal(s, 1 << 20), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(chunk_proposal(s, 8), (std::vector<int64_t>{0, 0}));  // runs long enough
  std::vector<uint64_t> addr(12);
  for (size_t i = 0; i < addr.size(); ++i) addr[i] = 1000 * (i + 1);
  std::vector<vitgrid::ckpt_detail::FileRange> ranges;
  vitgrid::ckpt_detail::direct_ranges(s, {2, 4}, addr, &ranges);
  ASSERT_EQ(ranges.size(), 3u);
  for (int b = 0; b < 3; ++b) {
    EXPECT_EQ(ranges[b].offset, addr[(1 + 2 * b) * 2 + 1]) << b;  // chunk (1 + 2b, 1) of 6 x 2
    EXPECT_EQ(ranges[b].data, data.data() + 8 * b);
    EXPECT_EQ(ranges[b].bytes, 32u);
  }
  vitgrid::TensorShard off = s;
  off.offset = {1, 4};  // rows 1-2: across two chunks of 2 rows
  EXPECT_EQ(chunk_proposal(off, 1 << 20), (std::vector<int64_t>{0, 0}));
  vitgrid::TensorShard rows = s;
  rows.offset = {2, 0};
  rows.block = {2, 8};  // whole rows: one run per block
  EXPECT_EQ(chunk_proposal(rows, 1 << 20), (std::vector<int64_t>{0, 0}));
  vitgrid::TensorShard idle = s;
  idle.write = false;
  EXPECT_TRUE(chunk_proposal(idle, 1 << 20).empty());
}

// The direct writer alone, on each rank's own file: ranges with unaligned edges, adjacent
// ones sharing a page, several pieces each, written by 4 threads with 64 KiB requests (ranges
// under 16 KiB of whole pages buffered); every byte lands at its offset and the bytes between
// ranges stay as they were.
TEST(DirectWriter, ConcurrentPiecesLandAtTheirOffsets) {
  vgtest::SharedTmpDir tmp;
  const std::string path = tmp / ("direct." + std::to_string(rank_of()));
  const size_t size = size_t(3) << 20;
  std::vector<char> before(size, char(0xEE));
  {
    std::ofstream f(path, std::ios::binary);
    f.write(before.data(), static_cast<std::streamsize>(size));
  }
  // [offset, bytes): page-aligned, unaligned at both ends, adjacent, tiny, inside one page
  const std::vector<std::pair<size_t, size_t>> spans = {
      {0, 4096 * 40},     {4096 * 40, 1000},         {4096 * 40 + 1000, 700001},
      {1 << 21, 12},      {(1 << 21) + 4100, 5000}, {(1 << 21) + 20000, (1 << 20) - 30000}};
  std::vector<std::vector<char>> data;
  std::vector<vitgrid::ckpt_detail::FileRange> ranges;
  uint64_t x = 0x9E3779B97F4A7C15ull * (rank_of() + 1);
  for (const auto& sp : spans) {
    data.emplace_back(sp.second);
    for (char& c : data.back()) c = static_cast<char>((x = x * 6364136223846793005ull + 1) >> 56);
    ranges.push_back({sp.first, data.back().data(), sp.second});
  }
  vitgrid::ckpt_detail::DirectWriter w(path, ranges, 4, 64 << 10, 16 << 10);
  EXPECT_EQ(w.finish(), "");
  std::vector<char> expect = before;
  for (size_t k = 0; k < spans.size(); ++k)
    std::copy(data[k].begin(), data[k].end(), expect.begin() + spans[k].first);
  std::ifstream f(path, std::ios::binary);
  std::vector<char> got(size + 1);
  f.read(got.data(), static_cast<std::streamsize>(got.size()));
  ASSERT_EQ(static_cast<size_t>(f.gcount()), size);
  got.resize(size);
  for (size_t i = 0; i < size; ++i) ASSERT_EQ(got[i], expect[i]) << "byte " << i;
}

// A file that cannot be opened is named in the error; a writer dropped without finish() stops
// and joins (no thread left writing into a file about to be removed).
TEST(DirectWriter, FailuresNameTheFileAndDropStops) {
  vgtest::SharedTmpDir tmp;
  std::vector<char> buf(size_t(4) << 20, 'x');
  const std::string missing = tmp / ("absent/direct." + std::to_string(rank_of()));
  vitgrid::ckpt_detail::DirectWriter bad(missing, {{0, buf.data(), buf.size()}}, 2);
  const std::string err = bad.finish();
  EXPECT_NE(err.find("cannot open '" + missing + "'"), std::string::npos) << err;
  const std::string path = tmp / ("dropped." + std::to_string(rank_of()));
  std::ofstream(path).put('a');
  {
    vitgrid::ckpt_detail::DirectWriter dropped(path, {{0, buf.data(), buf.size()}}, 3, 4096);
  }
  EXPECT_LE(std::filesystem::file_size(path), buf.size());
}

TEST(Checkpoint, MetaStateAndAttributes) {
  vgtest::SharedTmpDir tmp;
  ShardSet w = make_write_set();
  auto meta = make_meta(123);
  std::string path = vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp.path(), 123, w.shards, meta);

  ShardSet r = make_read_set();
  vitgrid::CheckpointMeta got;
  got.state["stale"] = {9.0};  // must be replaced, not merged
  vitgrid::read_checkpoint(MPI_COMM_WORLD, path, r.shards, &got);
  EXPECT_EQ(got.deck, meta.deck);
  EXPECT_EQ(got.grid, meta.grid);
  EXPECT_EQ(got.tensor_mode, "1d");
  EXPECT_EQ(got.backend, "cpu");
  EXPECT_EQ(got.world_size, size_of());
  EXPECT_EQ(got.state, meta.state);

  if (rank_of() == 0) {
    EXPECT_EQ(vgtest::read_int_attr(path, "complete"), std::vector<int>{1});
    EXPECT_EQ(vgtest::read_int_attr(path, "world_size"), std::vector<int>{size_of()});
    EXPECT_EQ(vgtest::read_string_attr(path, "version"), "0.1.0");
    auto step = vgtest::read_all<double>(path, "/state/step", H5T_NATIVE_DOUBLE);
    EXPECT_EQ(step, std::vector<double>{123.0});
  }
}

TEST(Checkpoint, KeepPrunesOlderAndLeavesNoTmp) {
  vgtest::SharedTmpDir tmp;
  ShardSet w = make_write_set();
  for (int64_t s = 1; s <= 5; ++s) {
    vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp.path(), s * 100, w.shards, make_meta(s * 100), 2);
    if (rank_of() == 0) {
      auto names = list_dir(tmp.path());
      for (auto& n : names) EXPECT_EQ(n.find(".tmp"), std::string::npos) << n;
      EXPECT_EQ(names.size(), static_cast<size_t>(std::min<int64_t>(s, 2)));
    }
  }
  if (rank_of() == 0) {
    EXPECT_EQ(list_dir(tmp.path()), (std::vector<std::string>{"step_00000400.h5", "step_00000500.h5"}));
  }
  // keep = 0 keeps everything
  vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp.path(), 600, w.shards, make_meta(600), 0);
  if (rank_of() == 0) {
    EXPECT_EQ(list_dir(tmp.path()).size(), 3u);
  }
  // a run restarted from an older step: its new checkpoint survives pruning next to newer ones
  vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp.path(), 450, w.shards, make_meta(450), 2);
  if (rank_of() == 0) {
    EXPECT_EQ(list_dir(tmp.path()), (std::vector<std::string>{"step_00000450.h5", "step_00000600.h5"}));
  }
}

// Rank 0: a copy of `from` with the byte at `offset` inverted (cut to `offset` bytes when
// `truncate`).
void damaged_copy(const std::string& from, const std::string& to, size_t offset,
                  bool truncate = false) {
  if (rank_of() == 0) {
    std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing);
    if (truncate) {
      std::filesystem::resize_file(to, offset);
    } else {
      std::fstream f(to, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(static_cast<std::streamoff>(offset));
      char c = 0;
      f.get(c);
      f.seekp(static_cast<std::streamoff>(offset));
      f.put(static_cast<char>(~c));
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Offset of the first occurrence of `what` in the file at or after `from` (rank 0 reads).
size_t find_bytes(const std::string& path, const std::string& what, size_t from = 0) {
  uint64_t at = 0;
  if (rank_of() == 0) {
    std::ifstream f(path, std::ios::binary);
    std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t p = all.find(what, from);
    at = p == std::string::npos ? 0 : p;
  }
  MPI_Bcast(&at, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return static_cast<size_t>(at);
}

TEST(Checkpoint, ResumeFallsBackAndKeepsWhatItRejects) {
  vgtest::SharedTmpDir tmp;
  ShardSet r = make_read_set();
  vitgrid::CheckpointMeta m;
  // nothing to resume from: a missing or empty directory
  EXPECT_EQ(vitgrid::resume_checkpoint(MPI_COMM_WORLD, tmp / "does_not_exist", r.shards, &m), "");
  EXPECT_EQ(vitgrid::resume_checkpoint(MPI_COMM_WORLD, tmp.path(), r.shards, &m), "");

  ShardSet w = make_write_set();
  vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp.path(), 10, w.shards, make_meta(10));
  std::string p20 = vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp.path(), 20, w.shards, make_meta(20));
  EXPECT_EQ(vitgrid::resume_checkpoint(MPI_COMM_WORLD, tmp.path(), r.shards, &m), p20);
  EXPECT_EQ(m.state["step"], std::vector<double>{20.0});
  for (size_t t = 0; t < kTensors.size(); ++t) expect_shard_values(r.shards[t], t);

  // newer candidates, each unusable in its own way
  make_incomplete_copy(p20, tmp / "step_00000030.h5");
  if (rank_of() == 0) std::filesystem::copy_file(p20, tmp / "step_00000040.h5.tmp");
  write_garbage(tmp / "step_00000050.h5", 3000);
  // a flipped bit in the data of a tensor this run does not read (the optimizer's): the whole
  // file is verified, not only what is read
  {
    ShardSet m60 = make_write_set();
    for (auto& s : m60.shards) {
      int64_t n = 1;
      for (auto c : s.count) n *= c;
      if (s.name.rfind("optim/", 0) == 0 && s.data)
        for (int64_t i = 0; i < n; ++i) s.data[i] = 1234.5f;
    }
    std::string p =
        vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp / "m", 60, m60.shards, make_meta(60));
    const float v = 1234.5f;
    damaged_copy(p, tmp / "step_00000060.h5",
                 find_bytes(p, std::string(reinterpret_cast<const char*>(&v), 4)));
  }
  // an object header of a dataset damaged (HDF5 signatures "OHDR" / "TREE" / "SNOD")
  for (const char* sig : {"TREE", "SNOD"}) {
    const size_t at = find_bytes(p20, sig, 64);
    ASSERT_GT(at, 0u) << sig;
  }
  damaged_copy(p20, tmp / "step_00000070.h5", find_bytes(p20, "SNOD", 64) + 1);
  if (rank_of() == 0) std::filesystem::create_directory(tmp / "step_00000080.h5");
  MPI_Barrier(MPI_COMM_WORLD);

  ShardSet r2 = make_read_set();
  EXPECT_EQ(vitgrid::resume_checkpoint(MPI_COMM_WORLD, tmp.path(), r2.shards, &m), p20);
  for (size_t t = 0; t < kTensors.size(); ++t) expect_shard_values(r2.shards[t], t);
  if (rank_of() == 0) {
    // the rejected ones are kept under another name (this run writes their steps again);
    // the unfinished write is left alone
    EXPECT_EQ(list_dir(tmp.path()),
              (std::vector<std::string>{"m", "step_00000010.h5", "step_00000020.h5",
                                        "step_00000030.h5.rejected", "step_00000040.h5.tmp",
                                        "step_00000050.h5.rejected", "step_00000060.h5.rejected",
                                        "step_00000070.h5.rejected", "step_00000080.h5.rejected"}));
  }
}

TEST(Checkpoint, ResumeRefusesRatherThanOverwrite) {
  vgtest::SharedTmpDir tmp;
  ShardSet w = make_write_set();
  std::string p10 =
      vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp / "a", 10, w.shards, make_meta(10));
  // only incomplete checkpoints (their tensors intact): a fresh start would write over them
  if (rank_of() == 0) std::filesystem::create_directory(tmp / "b");
  make_incomplete_copy(p10, tmp / "b/step_00000010.h5");
  make_incomplete_copy(p10, tmp / "b/step_00000020.h5");
  auto resume = [&](const std::string& dir, std::vector<vitgrid::TensorShard> shards) {
    return [dir, shards]() mutable {
      vitgrid::CheckpointMeta m;
      vitgrid::resume_checkpoint(MPI_COMM_WORLD, dir, shards, &m);
    };
  };
  ShardSet r = make_read_set();
  vgtest::expect_user_error_everywhere(
      resume(tmp / "b", r.shards),
      {"none of the 2 checkpoint file(s)", "step_00000020.h5' is incomplete",
       "step_00000010.h5' is incomplete", "would overwrite them"});
  if (rank_of() == 0) {
    EXPECT_EQ(list_dir(tmp / "b"),
              (std::vector<std::string>{"step_00000010.h5", "step_00000020.h5"}));
  }
  // a checkpoint of another model (a tensor of another shape): refused, not overwritten
  ShardSet wrong = make_read_set();
  add_shard(&wrong, 98, {"model/patch_embed.proj.weight", {5, 7}}, 1, rank_of(), size_of(), false);
  wrong.shards.erase(wrong.shards.begin());
  vgtest::expect_user_error_everywhere(
      resume(tmp / "a", wrong.shards),
      {"none of the 1 checkpoint file(s)", "has shape [7, 5], expected [5, 7]"});
  // `checkpoints` is a file
  write_garbage(tmp / "c", 10);
  vgtest::expect_user_error_everywhere(resume(tmp / "c", r.shards), {"is not a directory"});
}

// A checkpoint damaged anywhere (every 61st byte of its first 24 KiB inverted in turn, and
// cuts at several lengths) is either read whole and right (the byte was unused) or refused
// with a UserError on every rank; it never aborts or hangs.
TEST(Checkpoint, DamagedAnywhereIsRefusedNotFatal) {
  vgtest::SharedTmpDir tmp;
  ShardSet w = make_write_set();
  std::string good =
      vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp / "g", 5, w.shards, make_meta(5));
  uint64_t size = 0;
  if (rank_of() == 0) size = std::filesystem::file_size(good);
  MPI_Bcast(&size, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  int refused = 0, loaded = 0;
  auto attempt = [&](const std::string& path) {
    ShardSet r = make_read_set();
    vitgrid::CheckpointMeta m;
    try {
      vitgrid::read_checkpoint(MPI_COMM_WORLD, path, r.shards, &m);
      ++loaded;
      for (size_t t = 0; t < kTensors.size(); ++t) expect_shard_values(r.shards[t], t);
    } catch (const vitgrid::UserError& e) {
      ++refused;
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  };
  const size_t span = std::min<size_t>(size, 24 * 1024);
  for (size_t off = 0; off < span; off += 61) {
    damaged_copy(good, tmp / "d.h5", off);
    attempt(tmp / "d.h5");
  }
  for (size_t cut :
       {size_t(0), size_t(512), size_t(4096), span / 2, static_cast<size_t>(size - 1)}) {
    damaged_copy(good, tmp / "t.h5", cut, true);
    attempt(tmp / "t.h5");
  }
  EXPECT_GT(refused, 10);
  EXPECT_GT(refused + loaded, static_cast<int>(span / 61));
}

// A checkpoint found by the fault corpus's checkpoint fuzzer (28 bytes of a B-tree overwritten)
// on which HDF5 1.10.8 does not fail but crashes (SIGSEGV in H5Lvisit): its metadata is walked
// in a checker process, so the job refuses it with one message instead of dying.
TEST(Checkpoint, AFileThatCrashesHdf5IsRefused) {
  if (vgtest::source_dir().empty()) GTEST_SKIP() << "no VITGRID_SOURCE_DIR";
  const std::string path = vgtest::source_dir() + "/test/io/data/checkpoint_crashes_hdf5.h5";
  ShardSet r = make_read_set();
  vgtest::expect_user_error_everywhere(
      [&] {
        vitgrid::CheckpointMeta m;
        vitgrid::read_checkpoint(MPI_COMM_WORLD, path, r.shards, &m);
      },
      {path, "damaged"});
}

TEST(Checkpoint, RefusalsAreUserErrorsOnEveryRank) {
  vgtest::SharedTmpDir tmp;
  ShardSet w = make_write_set();
  std::string good = vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp.path(), 1, w.shards, make_meta(1));

  auto read = [&](const std::string& path, std::vector<vitgrid::TensorShard> shards) {
    return [path, shards]() mutable {
      vitgrid::CheckpointMeta m;
      vitgrid::read_checkpoint(MPI_COMM_WORLD, path, shards, &m);
    };
  };
  ShardSet r = make_read_set();

  std::string missing = tmp / "step_00000099.h5";
  vgtest::expect_user_error_everywhere(read(missing, r.shards), {missing, "no such file"});

  std::string garbage = tmp / "garbage.h5";
  write_garbage(garbage, 5000);
  vgtest::expect_user_error_everywhere(read(garbage, r.shards), {garbage, "not an HDF5 file"});

  std::string incomplete = tmp / "incomplete.h5";
  make_incomplete_copy(good, incomplete);
  vgtest::expect_user_error_everywhere(read(incomplete, r.shards),
                                       {incomplete, "is incomplete (no 'complete' attribute)"});

  // HDF5 signature intact, the rest cut off
  std::string truncated = tmp / "truncated.h5";
  if (rank_of() == 0) {
    std::filesystem::copy_file(good, truncated);
    std::filesystem::resize_file(truncated, 2048);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  vgtest::expect_user_error_everywhere(read(truncated, r.shards), {truncated});

  // a tensor the file lacks (a model with one more parameter)
  ShardSet extra = make_read_set();
  add_shard(&extra, 99, {"model/blocks.1.mlp.fc1.weight", {4, 4}}, 0, rank_of(), size_of(), false);
  vgtest::expect_user_error_everywhere(read(good, extra.shards),
                                       {good, "'/model/blocks.1.mlp.fc1.weight' is missing"});

  // a tensor of another shape (a different model preset)
  ShardSet wrong = make_read_set();
  add_shard(&wrong, 98, {"model/patch_embed.proj.weight", {5, 7}}, 1, rank_of(), size_of(), false);
  wrong.shards.erase(wrong.shards.begin());
  vgtest::expect_user_error_everywhere(
      read(good, wrong.shards),
      {good, "'/model/patch_embed.proj.weight' has shape [7, 5], expected [5, 7]"});

  // after all that, a good read still works (no rank left behind in a collective)
  vitgrid::read_checkpoint(MPI_COMM_WORLD, good, r.shards, nullptr);
  for (size_t t = 0; t < kTensors.size(); ++t) expect_shard_values(r.shards[t], t);
}

// An optional tensor (state of a mode an earlier run did not use, as FP8's scaling): missing,
// the read goes on with `found` false and the buffer untouched, on every rank; present, it is
// read like any other; present at another shape, refused like any other.
TEST(Checkpoint, OptionalTensorsMayBeMissing) {
  vgtest::SharedTmpDir tmp;
  ShardSet w = make_write_set();
  const std::string good =
      vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp.path(), 1, w.shards, make_meta(1));

  ShardSet r = make_read_set();
  add_shard(&r, 99, {"fp8/scale", {6}}, 0, rank_of(), size_of(), false);
  r.shards.back().optional = true;
  const std::vector<float> before = r.bufs.back();
  vitgrid::read_checkpoint(MPI_COMM_WORLD, good, r.shards, nullptr);
  EXPECT_FALSE(r.shards.back().found);
  EXPECT_EQ(r.bufs.back(), before);
  for (size_t t = 0; t < kTensors.size(); ++t) {
    EXPECT_TRUE(r.shards[t].found);
    expect_shard_values(r.shards[t], t);
  }
  // an optional tensor the file holds is read
  ShardSet opt = make_read_set();
  opt.shards.front().optional = true;
  vitgrid::read_checkpoint(MPI_COMM_WORLD, good, opt.shards, nullptr);
  EXPECT_TRUE(opt.shards.front().found);
  expect_shard_values(opt.shards.front(), 0);
  // ... and must fit
  ShardSet wrong = make_read_set();
  add_shard(&wrong, 98, {"model/patch_embed.proj.weight", {5, 7}}, 1, rank_of(), size_of(), false);
  wrong.shards.erase(wrong.shards.begin());
  wrong.shards.back().optional = true;
  vgtest::expect_user_error_everywhere(
      [&]() mutable { vitgrid::read_checkpoint(MPI_COMM_WORLD, good, wrong.shards, nullptr); },
      {good, "'/model/patch_embed.proj.weight' has shape [7, 5], expected [5, 7]"});
}

// tools/inspect_checkpoint.py on a real checkpoint, an incomplete one and a non-checkpoint.
TEST(Checkpoint, InspectTool) {
  vgtest::SharedTmpDir tmp;
  ShardSet w = make_write_set();
  auto meta = make_meta(42);
  std::string good = vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp.path(), 42, w.shards, meta);
  make_incomplete_copy(good, tmp / "incomplete.h5");
  write_garbage(tmp / "garbage.h5", 100);
  {
    vitgrid::MetricsWriter mw(MPI_COMM_WORLD, tmp / "metrics.h5", "deck", {1, size_of(), 1}, "1d", "cpu", false, 0);
  }
  if (rank_of() != 0) return;
  if (vgtest::python3().empty() || vgtest::source_dir().empty()) GTEST_SKIP() << "no python3";
  const std::string tool = vgtest::python3() + " " + vgtest::source_dir() + "/tools/inspect_checkpoint.py ";
  std::string out;
  ASSERT_EQ(vgtest::run_command(tool + good + " 2>&1", &out), 0) << out;
  int64_t total = 0;
  for (auto& t : kTensors)
    if (t.name.rfind("model/", 0) == 0) {
      int64_t n = 1;
      for (auto d : t.shape) n *= d;
      total += n;
    }
  for (const std::string& needle :
       {std::string("complete: yes"), std::string("step: 42"), std::string("world_size: ") + std::to_string(size_of()),
        std::string("tensor_mode: 1d"), std::string("model/blocks.0.attn.qkv.weight"), std::string("(6, 9)"),
        std::string("parameters: ") + std::to_string(total)})
    EXPECT_NE(out.find(needle), std::string::npos) << "missing '" << needle << "' in:\n" << out;
  ASSERT_EQ(vgtest::run_command(tool + "--deck " + good + " 2>&1", &out), 0) << out;
  EXPECT_NE(out.find(meta.deck), std::string::npos) << out;
  EXPECT_EQ(vgtest::run_command(tool + (tmp / "incomplete.h5") + " 2>&1", &out), 2) << out;
  EXPECT_NE(out.find("incomplete"), std::string::npos) << out;
  EXPECT_EQ(vgtest::run_command(tool + (tmp / "garbage.h5") + " 2>&1", &out), 2) << out;
  EXPECT_NE(out.find("garbage.h5"), std::string::npos) << out;
  EXPECT_EQ(vgtest::run_command(tool + (tmp / "metrics.h5") + " 2>&1", &out), 2) << out;
  EXPECT_NE(out.find("not a vitgrid checkpoint"), std::string::npos) << out;
}

}  // namespace

namespace {
// A tensor-parallel qkv shard: rank r of P holds rows [j*R + r*R/P, j*R + (r+1)*R/P) of each of
// the three R-row blocks (q, k, v): one strided selection (stride R, 3 blocks of R/P rows).
// Strided shards (1d's qkv rows: 3 blocks per rank; columns in 2 blocks per rank), through
// HDF5's writes (0) and the direct writes (2 threads: a run per block, per row)
class StridedShards : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(DirectIo, StridedShards, ::testing::Values(0, 2));

TEST_P(StridedShards, RoundTrip) {
  vgtest::SharedTmpDir tmp;
  const int P = size_of(), r = rank_of();
  const int64_t R = 4 * P, C = 5, rows = R / P;
  vitgrid::TensorShard s;
  s.name = "model/blocks.0.attn.qkv.weight";
  s.global_shape = {3 * R, C};
  s.offset = {r * rows, 0};
  s.stride = {R, 1};
  s.count = {3, 1};
  s.block = {rows, C};
  std::vector<float> buf(static_cast<size_t>(3 * rows * C));
  for (int64_t j = 0; j < 3; ++j)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t c = 0; c < C; ++c)
        buf[(j * rows + i) * C + c] = value_of(0, (j * R + r * rows + i) * C + c);
  s.data = buf.data();
  // columns 2r, 2r+1 and 2P+2r, 2P+2r+1 of every row (one rank: all 4, adjacent blocks)
  const int64_t W = 4 * P;
  vitgrid::TensorShard t;
  t.name = "model/blocks.0.mlp.fc2.weight";
  t.global_shape = {6, W};
  t.offset = {0, 2 * r};
  t.stride = {1, 2 * P};
  t.count = {1, 2};
  t.block = {6, 2};
  std::vector<float> tbuf;
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t c : {2 * r, 2 * r + 1, 2 * P + 2 * r, 2 * P + 2 * r + 1})
      tbuf.push_back(value_of(1, i * W + c));
  t.data = tbuf.data();
  std::string path = vitgrid::write_checkpoint(MPI_COMM_WORLD, tmp / "ck", 1, {s, t},
                                               make_meta(1), 0, GetParam());
  // read each whole tensor contiguously on every rank: the global layout is timm's
  std::vector<float> all(static_cast<size_t>(3 * R * C), -1.0f), tall(size_t(6 * W), -1.0f);
  vitgrid::TensorShard w;
  w.name = s.name;
  w.global_shape = s.global_shape;
  w.offset = {0, 0};
  w.count = {3 * R, C};
  w.data = all.data();
  vitgrid::TensorShard tw = w;
  tw.name = t.name;
  tw.global_shape = t.global_shape;
  tw.count = {6, W};
  tw.data = tall.data();
  std::vector<vitgrid::TensorShard> ws{w, tw};
  vitgrid::read_checkpoint(MPI_COMM_WORLD, path, ws, nullptr);
  for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], value_of(0, int64_t(i))) << i;
  for (size_t i = 0; i < tall.size(); ++i) ASSERT_EQ(tall[i], value_of(1, int64_t(i))) << i;
  // and strided back into poisoned buffers
  std::vector<float> back(buf.size(), -7.0f), tback(tbuf.size(), -7.0f);
  s.data = back.data();
  t.data = tback.data();
  std::vector<vitgrid::TensorShard> ss{s, t};
  vitgrid::read_checkpoint(MPI_COMM_WORLD, path, ss, nullptr);
  EXPECT_EQ(back, buf);
  EXPECT_EQ(tback, tbuf);
}
}  // namespace
