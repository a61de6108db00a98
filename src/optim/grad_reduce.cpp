#include "vitgrid/optim/grad_reduce.h"

#include <algorithm>
#include <cstdlib>

#include "vitgrid/backend/backend.h"
#include "vitgrid/core/error.h"

namespace vitgrid {

std::vector<GradBucket> plan_grad_buckets(const std::vector<GradRange>& groups, size_t total,
                                          size_t bucket_elems, size_t quantum,
                                          size_t tail_elems) {
  quantum = std::max<size_t>(quantum, 1);
  VG_CHECK(total % quantum == 0, "gradient buffer of " << total << " elements for buckets of "
                                                       << quantum << "-element quanta");
  std::vector<GradRange> g = groups;
  std::sort(g.begin(), g.end(),
            [](const GradRange& a, const GradRange& b) { return a.offset > b.offset; });
  // bucket ends, from the end of the buffer down to 0
  std::vector<size_t> cuts = {total};
  if (bucket_elems > 0) {
    for (size_t i = 0; i < g.size(); ++i) {
      const GradRange& r = g[i];
      // the groups starting below tail_elems are reduced last: a bucket each (so the group
      // above them ends one too)
      const bool tail = r.offset < tail_elems || (i + 1 < g.size() && g[i + 1].offset < tail_elems);
      if (!tail && cuts.back() - std::min(cuts.back(), r.offset) < bucket_elems) continue;
      const size_t cut = (r.offset + quantum - 1) / quantum * quantum;
      if (cut > 0 && cut < cuts.back()) cuts.push_back(cut);
    }
  }
  if (cuts.back() != 0) cuts.push_back(0);
  std::vector<GradBucket> out;
  for (size_t i = cuts.size() - 1; i > 0; --i) out.push_back({cuts[i], cuts[i - 1] - cuts[i]});
  return out;
}

size_t ZeroShards::shard_elems() const {
  size_t n = 0;
  for (size_t k = 0; k < buckets.size(); ++k) n += piece_n(k);
  return n;
}

GradReducer::GradReducer(Collectives& coll, int data_size, int data_rank,
                         std::vector<GradBucket> buckets, bool zero)
    : coll_(coll), size_(data_size), rank_(data_rank), buckets_(std::move(buckets)), zero_(zero) {
  for (const GradBucket& b : buckets_)
    VG_CHECK(!zero_ || b.n % static_cast<size_t>(size_) == 0,
             "bucket of " << b.n << " elements over " << size_ << " data ranks");
  remaining_.resize(buckets_.size());
  started_.resize(buckets_.size());
  size_t largest = 0;
  for (const GradBucket& b : buckets_) largest = std::max(largest, b.n);
  if (size_ > 1) coll_.plan_reduce(largest, Axis::Data);
}

void GradReducer::reduce_in_act(Backend& be, void* stage) {
  VG_CHECK(!zero_, "gradient reduction in the act dtype with ZeRO-1");
  act_be_ = &be;
  stage_ = static_cast<char*>(stage);
}

void GradReducer::begin(float* grads) {
  grads_ = grads;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    remaining_[k] = buckets_[k].n;
    started_[k] = false;
  }
}

void GradReducer::start(size_t k) {
  const GradBucket& b = buckets_[k];
  started_[k] = true;
  if (zero_) {
    const size_t c = b.n / static_cast<size_t>(size_);
    coll_.start_reduce_scatter(grads_ + b.offset + static_cast<size_t>(rank_) * c,
                               grads_ + b.offset, c, Elem::F32, Axis::Data);
  } else if (act_be_) {
    void* st = stage_ + b.offset * act_be_->act_size();
    act_be_->cast_to_act(st, grads_ + b.offset, b.n);
    coll_.start_allreduce(st, b.n, Elem::Act, Axis::Data);
  } else {
    coll_.start_allreduce(grads_ + b.offset, b.n, Elem::F32, Axis::Data);
  }
}

void GradReducer::ready(size_t offset, size_t n) {
  const size_t end = offset + n;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    const GradBucket& b = buckets_[k];
    const size_t lo = std::max(offset, b.offset), hi = std::min(end, b.offset + b.n);
    if (lo >= hi || started_[k]) continue;
    VG_CHECK(remaining_[k] >= hi - lo, "gradient range reported twice");
    remaining_[k] -= hi - lo;
    if (remaining_[k] != 0) continue;
    if (!overlapping_ && overlap_hook_) overlap_hook_(true);
    overlapping_ = true;
    start(k);
  }
  coll_.progress();
}

void GradReducer::finish() {
  if (overlapping_ && overlap_hook_) overlap_hook_(false);
  overlapping_ = false;
  for (size_t k = buckets_.size(); k-- > 0;)
    if (!started_[k]) start(k);
  coll_.wait_all();
  if (act_be_ && !buckets_.empty())
    act_be_->cast_to_f32(grads_, stage_, buckets_.back().offset + buckets_.back().n);
}

ParamGather::ParamGather(Collectives& coll, const ZeroShards& shards, size_t act_size)
    : coll_(coll), shards_(shards), es_(act_size) {
  work_.resize(shards_.buckets.size());
  waited_.assign(shards_.buckets.size(), true);
}

void ParamGather::start(void* compute) {
  VG_CHECK(open_ == 0, "parameter gathers started twice");
  char* c = static_cast<char*>(compute);
  for (size_t k = 0; k < shards_.buckets.size(); ++k) {
    work_[k] = coll_.start_allgather(c + shards_.buckets[k].offset * es_,
                                     c + shards_.piece_offset(k) * es_, shards_.piece_n(k),
                                     Elem::Act, Axis::Data);
    waited_[k] = false;
  }
  open_ = shards_.buckets.size();
}

void ParamGather::need(size_t offset, size_t n) {
  if (open_ == 0) return;
  const size_t end = offset + n;
  for (size_t k = 0; k < shards_.buckets.size(); ++k) {
    const GradBucket& b = shards_.buckets[k];
    if (waited_[k] || b.offset >= end || b.offset + b.n <= offset) continue;
    coll_.wait(work_[k]);
    waited_[k] = true;
    --open_;
  }
}

void ParamGather::finish() {
  if (open_ == 0) return;
  coll_.wait_all();
  waited_.assign(waited_.size(), true);
  open_ = 0;
}

void ParamGather::gather_now(void* compute) {
  start(compute);
  finish();
}

}  // namespace vitgrid
