// The pipeline axis's asynchronous messages (grid.h: post_send / post_recv, fences) on NCCL
// point-to-point links, each on its link's stream, their Works are events; a member of
// NcclCollectives (nccl_collectives_impl.h), whose watchdog (nccl_watch.cpp) follows them.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>
#include <vector>

#include "nccl_collectives_impl.h"

namespace vitgrid {

// The links: per channel, one two-rank communicator per sending rank (its key 0 makes the
// sender rank 0 there), split from the axis's by every rank of it in the same order. Each
// is connected at once with a one-byte message: NCCL connects a pair at its first message
// and holds the host until the peer's first message arrives, so links first used in
// opposite orders on two ranks (as asynchronous messages are) would wait for each other
// there. They are destroyed in the same order too.
void NcclCollectives::open_links(Axis a) {
  VG_CHECK(a == Axis::Pipeline, "point-to-point links over axis " << axis_name(a)
                                    << ": NCCL links exist on the pipeline axis only");
  ncclComm_t pc = comm(a);
  if (!pc || links_open_.load(std::memory_order_acquire)) return;
  void* one = nullptr;
  CUDA_CHECK(cudaMalloc(&one, 1));
  const int P = sizes_[static_cast<int>(a)];
  const int me = pipe_rank_;
  int least = 0, greatest = 0;
  CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  for (int ch = 0; ch < kChannels; ++ch)
    for (int src = 0; src < P; ++src) {
      const int dst = ch == 0 ? (src + 1) % P : (src + P - 1) % P;
      const bool member = me == src || me == dst;
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      if (pipe_ctas_ > 0) {
        config.minCTAs = 1;
        config.maxCTAs = pipe_ctas_;
      }
      ncclComm_t c = nullptr;
      NCCL_CHECK(ncclCommSplit(pc, member ? 0 : NCCL_SPLIT_NOCOLOR, me == src ? 0 : 1, &c, &config));
      if (!member) continue;
      Link& l = links_[ch][me == src ? 0 : 1];
      l.comm = c;
      l.peer = me == src ? dst : src;
      // messages are latency-bound hand-offs between stages: first in line for SMs
      CUDA_CHECK(cudaStreamCreateWithPriority(&l.stream, cudaStreamNonBlocking, greatest));
      CUDA_CHECK(cudaEventCreateWithFlags(&l.done, cudaEventDisableTiming));
      if (me == src) NCCL_CHECK(ncclSend(one, 1, ncclUint8, 1, c, l.stream));
      else NCCL_CHECK(ncclRecv(one, 1, ncclUint8, 0, c, l.stream));
      CUDA_CHECK(cudaStreamSynchronize(l.stream));
      link_order_.push_back(&l);
    }
  CUDA_CHECK(cudaFree(one));
  links_open_.store(true, std::memory_order_release);  // the watchdog may look at them now
}

Work NcclCollectives::post_send(const void* buf, size_t bytes, int peer, int channel, Axis a) {
  Link& l = link(channel, 0, peer, a);
  CUDA_CHECK(cudaEventRecord(ready_ev_, stream_));  // the data is computed
  CUDA_CHECK(cudaStreamWaitEvent(l.stream, ready_ev_, 0));
  NCCL_CHECK(ncclSend(buf, bytes, ncclUint8, 1, l.comm, l.stream));
  const size_t t = message_ticket(l.stream);
  // blocking mode waits for receives only: a send waits for its peer's receive, which may
  // come after this rank's own next receive (that is what the channels are for)
  if (!blocking_) track(l.stream, bit(a), "pipeline send");
  return {Work::Kind::Message, t};
}

Work NcclCollectives::post_recv(void* buf, size_t bytes, int peer, int channel, Axis a,
                                const std::vector<Work>& after) {
  Link& l = link(channel, 1, peer, a);
  if (after.empty()) {
    CUDA_CHECK(cudaEventRecord(ready_ev_, stream_));
    CUDA_CHECK(cudaStreamWaitEvent(l.stream, ready_ev_, 0));
  }
  for (const Work& w : after) {
    VG_CHECK(w.kind == Work::Kind::Message && w.id < msg_n_,
             "post_recv after a Work that is no message of " << msg_n_ << " (kind "
                                                             << static_cast<int>(w.kind)
                                                             << ", id " << w.id << ")");
    CUDA_CHECK(cudaStreamWaitEvent(l.stream, msg_ev_[w.id], 0));
  }
  NCCL_CHECK(ncclRecv(buf, bytes, ncclUint8, 0, l.comm, l.stream));
  const size_t t = message_ticket(l.stream);
  track(l.stream, bit(a), "pipeline recv");
  return {Work::Kind::Message, t};
}

void NcclCollectives::wait_message(size_t t) {
  VG_CHECK(t < msg_n_, "wait for message " << t << " of " << msg_n_);
  CUDA_CHECK(cudaStreamWaitEvent(stream_, msg_ev_[t], 0));
}

Work NcclCollectives::fence() { return {Work::Kind::Message, message_ticket(stream_)}; }
void NcclCollectives::wait_messages() {
  for (auto& dir : links_)
    for (Link& l : dir) {
      if (!l.stream) continue;
      CUDA_CHECK(cudaEventRecord(l.done, l.stream));
      CUDA_CHECK(cudaStreamWaitEvent(stream_, l.done, 0));
    }
  msg_n_ = 0;
}

NcclCollectives::Link& NcclCollectives::link(int channel, int dir, int peer, Axis a) {
  VG_CHECK(a == Axis::Pipeline, "point-to-point messages over axis " << axis_name(a)
                                    << ": NCCL links exist on the pipeline axis only");
  VG_CHECK(channel >= 0 && channel < kChannels, "message channel " << channel);
  Link& l = links_[channel][dir];
  VG_CHECK(l.comm && l.peer == peer,
           (dir == 0 ? "send to" : "receive from") << " pipeline rank " << peer << " on channel " << channel
           << ": " << (link_order_.empty() ? std::string("open_links was not called")
                                           : "that channel's link " + std::string(dir == 0 ? "goes to " : "comes from ") +
                                                 std::to_string(l.peer) +
                                                 " (channel 0 flows to the next rank, channel 1 to the previous one)"));
  return l;
}

// A new message's Work id: an event recorded on `st` now.
size_t NcclCollectives::message_ticket(cudaStream_t st) {
  if (msg_n_ == msg_ev_.size()) {
    msg_ev_.push_back(nullptr);
    CUDA_CHECK(cudaEventCreateWithFlags(&msg_ev_.back(), cudaEventDisableTiming));
  }
  CUDA_CHECK(cudaEventRecord(msg_ev_[msg_n_], st));
  return msg_n_++;
}

}  // namespace vitgrid
