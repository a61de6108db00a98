// The communication watchdog. A rank that stops (a frozen process, a node the launcher has not
// yet noticed is gone) leaves every other rank waiting in its next collective for good: MPI
// has no timeout of its own. Each rank runs one watchdog thread; the main thread marks its
// blocking communication calls with a WatchdogWait. When one has waited longer than the
// timeout (the deck's device.comm_timeout), the watchdog prints which call on which rank and
// for how long, then ends the job (MPI_Abort): the ranks still alive all reach the same
// verdict, the stopped one is killed by the launcher.
//
// (GPU collectives have their own watchdog in the NCCL layer, which polls their completion.)
#pragma once

namespace vitgrid {

// Starts the watchdog thread of this rank (timeout_s <= 0: none). Once per process.
void start_watchdog(double timeout_s);
// Stops it (joins the thread); safe without a start.
void stop_watchdog();

// Marks the calling thread as blocked in a communication call for its lifetime: `what` names
// the call, `where` the axis it runs on ("" or "world": the whole job); both must outlive the
// wait (string literals, axis_name()). Nested
// waits keep the outermost. Costs two relaxed atomic stores when nothing is wrong.
class WatchdogWait {
 public:
  explicit WatchdogWait(const char* what, const char* where = "");
  ~WatchdogWait();
  WatchdogWait(const WatchdogWait&) = delete;
  WatchdogWait& operator=(const WatchdogWait&) = delete;

 private:
  bool outer_;
};

// For its lifetime, the WatchdogWaits of the calling thread are not watched: a thread other
// than the main one (the background checkpoint writer, whose long collective writes are
// normal) does not take the watchdog's one slot; the main thread watches its wait for that
// thread instead.
class WatchdogOff {
 public:
  WatchdogOff();
  ~WatchdogOff();
  WatchdogOff(const WatchdogOff&) = delete;
  WatchdogOff& operator=(const WatchdogOff&) = delete;
};

// Runs `call` (one blocking communication call) under a WatchdogWait named `what`.
template <class F>
decltype(auto) watched(const char* what, F&& call) {
  WatchdogWait w(what);
  return call();
}

}  // namespace vitgrid
