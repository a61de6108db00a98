// Pipeline parallelism: which blocks each stage holds (the partition), the order in which a
// stage runs its micro-batches (the schedule: GPipe, 1F1B, interleaved 1F1B), and the
// point-to-point plan that turns a schedule into one list of operations per stage.
//
// Everything here is a pure function of (schedule, P, V, M): every rank computes the whole
// plan itself, so no shapes or orders are exchanged at run time. The plan is built for the
// blocking send/recv of Collectives (MPI on the CPU, NCCL send/recv on the GPU), which may
// rendezvous: a send returns only once its receiver has posted the matching recv; a group of
// them (Collectives::group_begin / group_end) returns once all of them have.
// build_pipeline_plans orders the operations so that this can never deadlock (see the .cpp),
// check_pipeline_plans replays the plans under exactly these semantics and plan_bubble times
// them (the tests run both on many shapes).
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

struct PipeOp {
  PipeOpKind kind;
  int chunk = 0;     // local chunk of this stage the op belongs to (the receiver's for recv)
  int micro = 0;
  int slot = -1;     // activation set
  int peer = -1;     // pipeline rank of the other side (send / recv)
  int src_slot = -1; // CopyAct / CopyGrad source set
  bool frees = false;      // `slot` (or src_slot for copies) is free after this op
  bool joins = false;      // a message posted in one group with the message before it
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
  // true: messages marked `joins` are posted in one group with the one before them, which
  // completes when all of its messages have (the placement that sends right after the
  // producing compute and receives right before the consuming one); false: one message at a
  // time, each a rendezvous (the projection of the simulated execution, kept where the
  // grouped placement is not safe: most interleaved shapes)
  bool grouped = false;
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
// backward `cb`, messages are free and every send/recv is a rendezvous: a send and its recv
// complete when both sides have posted them (messages between a pair in order). In grouped
// plans a stage posts a group's messages together (ncclGroupStart/End, MPI Isend/Irecv +
// Waitall: PipelineRunner does this), and the group completes when every group tied to it by
// its messages has been posted (NCCL's lockstep; see check_pipeline_plans). -1 if the plans would deadlock. simulated_bubble is the
// schedule's own (free communication, no rendezvous); the placement can only add to it.
double plan_bubble(const PipelinePlans& plans, double cf = 1.0, double cb = 2.0);

// Replays the plans with blocking rendezvous send/recv (a send and its recv complete
// together, messages between a pair of ranks match in order; grouped plans post each run of
// messages at once and completes it together with every group its messages tie it to, as
// NCCL runs a group's messages in lockstep; a set that a send frees is free once its group
// completes) and checks that every operation
// runs, every message matches its receiver's expectation, each forward precedes its backward
// and slots are never used while free. Returns "" or what went wrong.
std::string check_pipeline_plans(const PipelinePlans& plans);

}  // namespace vitgrid
