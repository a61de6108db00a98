// Error paths (LAMMPS style):
//  * fail_all(): a collective error that every rank of the communicator reaches in the same
//    state (deck validation, dataset checks). Rank 0 prints one message, all ranks exit with
//    the same non-zero code. Called by all ranks of `comm`.
//  * fail_one(): a local fatal error that only this rank saw (a CUDA error, a failed read).
//    Prints host, rank, file and line, then MPI_Abort so no rank hangs.
// One check macro per library reports the library's own error string.
#pragma once
#include <mpi.h>

#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>

namespace vitgrid {

// Exit code used for user errors (bad deck, dataset, checkpoint), agreed on every rank.
constexpr int kExitUserError = 2;
// Exit code used after a preemption signal once the checkpoint is written (job scripts requeue).
constexpr int kExitRequeue = 3;

// A user-facing error (bad input). Thrown by validation code; the app turns it into fail_all
// once every rank has agreed that somebody failed (see agree_error()).
class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& what) : std::runtime_error(what) {}
};

[[noreturn]] void fail_all(MPI_Comm comm, const std::string& msg, int code = kExitUserError);
// MPI work of another thread that must end before MPI_Finalize (the background checkpoint
// writer: its collectives run on every rank's writer, whatever the main threads do): fail_all
// runs it first. One slot; an empty function clears it.
void set_before_finalize(std::function<void()> f);
// Starts a thread that exits the process with `code` after grace_s seconds (saying so): the
// deadline of an end of the job that may block.
void exit_after(double grace_s, int code);
// Ends the job from this rank: MPI_Abort, a request to the launcher to end every rank, which an
// MPI can leave unanswered while a peer is stopped or lost; should it not have ended this
// process within grace_s, the process exits with `code` itself, and the launcher ends the other
// ranks as for any rank gone without MPI_Finalize. (From a thread other than the one inside
// MPI, only with MPI_THREAD_MULTIPLE.)
[[noreturn]] void abort_job(int code, double grace_s = 10.0);
[[noreturn]] void fail_one(const char* file, int line, const std::string& msg);
// fail_one for a rank that must first release something that can block (NCCL communicators
// whose kernels wait on a dead or diverged peer: ncclCommAbort, and MPI_Abort after it, may not
// return). Prints the message, starts exit_after(grace_s, 1), runs `cleanup`, then MPI_Abort.
// The job ends within grace_s whatever blocks.
[[noreturn]] void fail_one_with_cleanup(const char* file, int line, const std::string& msg,
                                        const std::function<void()>& cleanup, double grace_s);

// ---- errors that escape the work (the app's guard)
// A UserError thrown where every rank throws it (after io_detail::throw_if_any_failed, a deck
// check) and an error only one rank saw (a read failure, a full disk) both end up in the
// app's top-level catch, after the stack has unwound. There the ranks cannot know which case
// they are in, and a collective on the world communicator could match another rank's
// unrelated collective. So they meet on a channel of their own:
//
// Called by all ranks of `world` once, before any work: a duplicate of world that only
// fail_agreed() communicates on.
void open_error_channel(MPI_Comm world);
// Called by a rank that caught an error the work did not handle. Waits up to `wait_s` seconds
// for every rank of the world to report one too: then rank 0 prints the lowest failing
// rank's message once ("vitgrid: error: ...") and every rank exits with `code` after
// MPI_Finalize. If some rank does not come (it is blocked in a collective waiting for this
// one, or it finished), this rank prints its own message and ends the job with MPI_Abort
// (`code`): one message, the same exit code, no hang either way.
[[noreturn]] void fail_agreed(const std::string& msg, int code, double wait_s = 10.0);
// True while an exception unwinds the stack: destructors then skip their collective calls
// (a rank that alone failed would wait in them for ranks that never come, or match their
// unrelated collectives); fail_agreed() settles how the job ends.
bool unwinding();

// Called by all ranks of comm: returns true if any rank passed ok=false. The message of the
// lowest failing rank is returned in *msg on every rank. Never hangs when only some ranks fail,
// because every rank reaches this call.
bool agree_error(MPI_Comm comm, bool ok, std::string* msg);

}  // namespace vitgrid

#define VG_FAIL(msg_expr)                                     \
  do {                                                        \
    std::ostringstream vg_os_;                                \
    vg_os_ << msg_expr;                                       \
    ::vitgrid::fail_one(__FILE__, __LINE__, vg_os_.str());    \
  } while (0)

#define VG_CHECK(cond, msg_expr)                                        \
  do {                                                                  \
    if (!(cond)) VG_FAIL("check failed: " #cond ": " << msg_expr);      \
  } while (0)

#define MPI_CHECK(call)                                                          \
  do {                                                                           \
    int vg_rc_ = (call);                                                         \
    if (vg_rc_ != MPI_SUCCESS) {                                                 \
      char vg_buf_[MPI_MAX_ERROR_STRING];                                        \
      int vg_len_ = 0;                                                           \
      MPI_Error_string(vg_rc_, vg_buf_, &vg_len_);                               \
      VG_FAIL("MPI error in " #call ": " << std::string(vg_buf_, vg_len_));      \
    }                                                                            \
  } while (0)
