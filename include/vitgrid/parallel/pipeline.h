// Pipeline parallelism: which blocks each stage holds (the partition), the order in which a
// stage runs its micro-batches (the schedule: GPipe, 1F1B, interleaved 1F1B), and the
// point-to-point plan that turns a schedule into one list of operations per stage.
//
// Everything here is a pure function of (schedule, P, V, M): every rank computes the whole
// plan itself, so no shapes or orders are exchanged at run time. A plan uses one of the two
// ways Collectives moves point-to-point messages (PipelinePlans::messages):
// - Grouped: blocking send/recv, which may rendezvous (a send returns only once its receiver
//   has posted the matching recv); a group of them (Collectives::group_begin / group_end)
//   returns once all of them have. On the GPU they run on the compute stream, so no message
//   waits beside the compute.
// - Async: post_send / post_recv, each message on its own stream: a send never holds its
//   stage up, a receive is posted as soon as its buffer is free and only the compute that
//   needs the data waits for it. On the GPU a receive posted early waits on SMs beside the
//   compute, so this is the fallback for the orders the grouped placement cannot run at
//   their schedule's bubble (interleaved, unless it has one micro-batch per stage).
// build_pipeline_plans picks the placement (see the .cpp), check_pipeline_plans replays the
// plans under exactly their semantics and plan_bubble times them (the tests run both on many
// shapes: every schedule runs at the bubble of its own order).
//
// Virtual stages. With V model chunks per stage (interleaved), virtual stage k = c * P + s
// is chunk c of stage s (Megatron's layout): a micro-batch goes through stage 0..P-1 with
// chunk 0, then again with chunk 1, and so on. Without interleaving V = 1 and virtual stage
// = stage.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace vitgrid {

enum class PipeSchedule : int { GPipe = 0, OneFOneB = 1, Interleaved = 2 };
// "gpipe" | "1f1b" | "interleaved" (throws UserError naming parallel.schedule).
PipeSchedule parse_pipe_schedule(const std::string& s);
const char* pipe_schedule_name(PipeSchedule s);

// Counted forward cost of the model's parts (any unit, e.g. multiply-adds per sample): the
// patch embedding sits on virtual stage 0, the final norm + head + loss on the last.
struct PipeCost {
  double embed = 0.0;
  double block = 1.0;
  double head = 0.0;
};

// Blocks per virtual stage, P * V entries in virtual-stage order, each >= 1, summing to depth.
//   "uniform":         depth / (P*V) each (the deck layer checked divisibility);
//   "balanced":        contiguous blocks that minimise the most expensive virtual stage, the
//                      embedding and head counted by their cost (so with equal blocks the
//                      first and last stages give blocks away when the split is uneven);
//   "list:n0,n1,...":  as given.
// Throws UserError naming parallel.partition when the spec cannot be met.
std::vector<int> partition_blocks(const std::string& spec, int depth, int P, int V,
                                  const PipeCost& cost);

// One operation of a stage's plan.
enum class PipeOpKind : uint8_t {
  Forward,   // forward of (chunk, micro) in activation set `slot`
  Backward,  // backward of (chunk, micro) in set `slot`; leaves d(chunk input) in the set
  SendAct,   // send set `slot`'s chunk output to `peer` (pipeline rank)
  RecvAct,   // receive the chunk input of (chunk, micro) into set `slot` from `peer`
  SendGrad,  // send set `slot`'s d(chunk input) to `peer`
  RecvGrad,  // receive d(chunk output) of (chunk, micro) from `peer` (backward's buffer)
  CopyAct,   // same rank (P = 1, V > 1): set `src_slot`'s output becomes set `slot`'s input
  CopyGrad,  // same rank: set `src_slot`'s d(input) becomes d(output) for the next backward
};
const char* pipe_op_name(PipeOpKind k);
// a send or a receive (the rest run locally)
bool pipe_op_is_message(PipeOpKind k);
bool pipe_op_is_send(PipeOpKind k);  // SendAct or SendGrad
// the channel of an asynchronous message: 0 activations, 1 gradients (Collectives' channel)
int pipe_op_channel(PipeOpKind k);

struct PipeOp {
  PipeOpKind kind;
  int chunk = 0;     // local chunk of this stage the op belongs to (the receiver's for recv)
  int micro = 0;
  int slot = -1;     // activation set
  int peer = -1;     // pipeline rank of the other side (send / recv)
  int src_slot = -1; // CopyAct / CopyGrad source set
  bool frees = false;      // `slot` (or src_slot for copies) is free after this op
  bool joins = false;      // grouped: a message posted in one group with the message before it
  // Async: earlier ops of this stage (indices into the plan) that must be complete before
  // this op writes its buffer: for a receive, the last compute that used the set (or the
  // d(output) buffer) and the sends still reading it; for a forward or copy that fills a set
  // without a receive, the sends still reading it. Empty for a receive: the step's start.
  std::vector<int> after = {};
};

struct PipelinePlan {
  int stage = 0;
  std::vector<PipeOp> ops;
  int num_slots = 0;  // activation sets this stage needs at once
};

struct PipelinePlans {
  PipeSchedule schedule = PipeSchedule::OneFOneB;
  int P = 1, V = 1, M = 1;
  bool train = true;
  std::vector<PipelinePlan> stages;  // P entries
  // Grouped: messages marked `joins` are posted in one group with the one before them, which
  // completes when all of its messages have; the rest are single blocking messages. Async:
  // every message posted on its own (PipeOp::after).
  enum class Messages : uint8_t { Grouped, Async };
  Messages messages = Messages::Grouped;
  // Idle fraction of the schedule simulated with unit costs (forward 1, backward 2) and free
  // communication: the bubble the schedule itself implies, averaged over the stages.
  double simulated_bubble = 0.0;
};

// The plans of every stage. `train` false: forward only (eval / predict). V must be 1 unless
// the schedule is interleaved. Throws UserError (naming parallel.micro_batches) when the
// schedule cannot run these shapes (its order would wait on itself).
PipelinePlans build_pipeline_plans(PipeSchedule s, int P, int V, int M, bool train);

// The schedule's textbook bubble: (P-1)/M for GPipe and 1F1B, (P-1)/(V*M) interleaved.
double theoretical_bubble(PipeSchedule s, int P, int V, int M);

// The plans' idle fraction (averaged over the stages) when each forward costs `cf` and each
// backward `cb` and messages take no time, under the plans' semantics. Grouped: every
// send/recv is a rendezvous (messages between a pair in order); a stage posts a group's
// messages together (ncclGroupStart/End, MPI Isend/Irecv + Waitall: PipelineRunner does this)
// and the group completes when every group tied to it by its messages has been posted (NCCL's
// lockstep; see check_pipeline_plans). Async: a send starts once its data is computed and the
// channel's previous send is done, and completes when its receive is posted; a receive is
// posted once its `after` ops and the channel's previous receive are done. -1 if the plans
// would deadlock. simulated_bubble is the schedule's own (free communication, unlimited
// buffers); the placement can only add to it.
double plan_bubble(const PipelinePlans& plans, double cf = 1.0, double cb = 2.0);

// Replays the plans under those semantics and checks that every operation runs, every
// message matches its receiver's expectation (per pair, and per channel when asynchronous, in
// order), each forward precedes its backward and no set is used while free. Grouped: a set
// that a send frees is free once its group completes. Async: no set is filled while in use
// (in each stage's program order), and every buffer a receive fills is only written after the
// ops its `after` names. Returns "" or what went wrong.
std::string check_pipeline_plans(const PipelinePlans& plans);

}  // namespace vitgrid
