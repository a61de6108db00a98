// Data-parallel gradient reduction in buckets, overlapped with the backward pass.
//
// The flat fp32 gradient buffer is cut into buckets (contiguous ranges made of whole gradient
// groups: a few blocks each, ~bucket_bytes), planned from the end of the buffer because the
// backward produces the head first and the patch embedding last. The model's gradient-ready
// hook reports groups as the step's last backward finishes them; a bucket whose every element
// is reported is reduced at once (Collectives::start_*), while the backward continues. The
// reduction is fp32 whatever the precision mode, unless reduce_in_act() asks for the act dtype
// (parallel.grad_reduce = act).
//
// zero = 0: each bucket is all-reduced in place. zero = 1 (ZeRO-1): each bucket is
// reduce-scattered in place: data rank r owns the r-th 1/D of every bucket (its "piece"), and
// only the pieces hold the reduced gradient afterwards; the rest of the buffer holds
// unspecified values. Buckets are then multiples of D * 16 elements (the buffer is padded so).
#pragma once
#include <cstddef>
#include <functional>
#include <vector>

#include "vitgrid/grid/grid.h"

namespace vitgrid {

class Backend;

struct GradBucket {
  size_t offset = 0;  // first element in the flat buffer
  size_t n = 0;       // elements (a multiple of quantum)
};

// Range of the flat buffer reported final by the model, in any order (ViT::grad_groups()).
struct GradRange {
  size_t offset = 0, n = 0;
};

// Buckets tiling [0, total): walking the groups from the end of the buffer, a bucket closes
// once it holds at least bucket_elems elements, at the start of the group it reached rounded
// up to a multiple of `quantum` (so it never waits for an earlier group). total must be a
// multiple of quantum. bucket_elems == 0: one bucket. Groups starting below tail_elems (the
// last the backward finishes) get a bucket each whatever their size: the reduction nothing
// overlaps any more, after the backward, is then the last group's only.
std::vector<GradBucket> plan_grad_buckets(const std::vector<GradRange>& groups, size_t total,
                                          size_t bucket_elems, size_t quantum,
                                          size_t tail_elems = 0);

// ZeRO-1 shard geometry: data rank `rank` of `size` owns piece k = elements
// [buckets[k].offset + rank * buckets[k].n / size, + buckets[k].n / size) of each bucket;
// its optimizer state holds the pieces back to back (shard offset of piece k: the sum of the
// earlier pieces' sizes).
struct ZeroShards {
  int size = 1, rank = 0;
  std::vector<GradBucket> buckets;
  size_t piece_n(size_t k) const { return buckets[k].n / static_cast<size_t>(size); }
  size_t piece_offset(size_t k) const {
    return buckets[k].offset + static_cast<size_t>(rank) * piece_n(k);
  }
  size_t shard_elems() const;
};

class GradReducer {
 public:
  // Every rank of the data axis builds it with the same buckets (the same stage layout).
  // zero: reduce-scatter (ZeRO-1) instead of all-reduce.
  GradReducer(Collectives& coll, int data_size, int data_rank, std::vector<GradBucket> buckets,
              bool zero);
  // Before the step's last batch: nothing reported yet.
  void begin(float* grads);
  // The hook body: [offset, offset + n) of the gradient buffer is final; reduces the buckets
  // that became complete. Called by every data rank in the same order.
  void ready(size_t offset, size_t n);
  // After the backward: reduces the buckets not started yet (all of them when nothing was
  // reported), waits for every reduction. Called by every data rank.
  void finish();
  const std::vector<GradBucket>& buckets() const { return buckets_; }
  // hook(true) when a step's first bucket starts while the backward still runs, hook(false)
  // when finish() is called: the span in which the reductions share the device with the
  // backward's kernels (the trainer narrows the GEMMs meanwhile: device.gemm_sm_margin).
  void set_overlap_hook(std::function<void(bool)> hook) { overlap_hook_ = std::move(hook); }
  // All-reduce in the backend's act dtype instead of fp32 (half the bytes with bf16/fp16): a
  // bucket is cast into `stage` (act dtype, as many elements as the gradient buffer, at the
  // same offsets) on the backend's stream and reduced there; finish() casts the reduced
  // buffer back into the fp32 gradients. Not with zero.
  void reduce_in_act(Backend& be, void* stage);

 private:
  void start(size_t k);

  Collectives& coll_;
  int size_, rank_;
  std::vector<GradBucket> buckets_;
  bool zero_;
  float* grads_ = nullptr;
  std::vector<size_t> remaining_;
  std::vector<bool> started_;
  std::function<void(bool)> overlap_hook_;
  bool overlapping_ = false;
  Backend* act_be_ = nullptr;  // reduce_in_act
  char* stage_ = nullptr;
};

// ZeRO-1 with a 16-bit compute copy (parallel.zero_gather = forward): the all-gather of the
// parameters the optimizer updated (each rank cast its pieces into the compute copy), bucket
// by bucket during the next step's forward instead of at the end of the update. start(), in
// the step's first micro-batch, starts every bucket's gather in buffer order (the forward's:
// the patch embedding first); the model's parameter hook calls need(offset, n) before a
// forward reads [offset, offset + n) of the compute copy, which orders that read after the
// gathers of the buckets it touches (CUDA: a stream wait, no host wait); finish() covers any
// bucket no forward asked for. Every rank of the data axis makes the same calls in the same
// order (start and finish; need's waits are local).
class ParamGather {
 public:
  // act_size: the backend's (Backend::act_size(), the compute copy's elements)
  ParamGather(Collectives& coll, const ZeroShards& shards, size_t act_size);
  // Starts the gathers into `compute` (act dtype, the model's flat layout).
  void start(void* compute);
  // The hook body: [offset, offset + n) of the compute copy is about to be read.
  void need(size_t offset, size_t n);
  // Orders later work after every gather started (Collectives::wait_all when a bucket was not
  // needed yet; nothing when every one was).
  void finish();
  // start() then finish(): the whole copy gathered now (before an evaluation).
  void gather_now(void* compute);

 private:
  Collectives& coll_;
  ZeroShards shards_;
  size_t es_;
  std::vector<Work> work_;
  std::vector<bool> waited_;
  size_t open_ = 0;  // buckets started and not waited for
};

}  // namespace vitgrid
