// Where a training step's time goes, op by op. Every op of a backend that launches work opens
// an OpScope named after it as its first statement. On CUDA each scope is an NVTX range
// (Nsight Systems shows the ops above their kernels, and tools/ktrace's timeline can be read
// against them), whether profiling is on or not. With the device's OpProfile enabled
// (`vitgrid bench --profile`) the outermost scope of a thread also synchronises the device
// before and after the op and adds the time to the op's row: each op's time is its own.
#pragma once
#include <map>
#include <string>

namespace vitgrid {

class Device;

struct OpTime {
  double seconds = 0.0;
  long calls = 0;
};

class OpProfile {
 public:
  bool enabled() const { return on_; }
  void set_enabled(bool on) { on_ = on; }
  const std::map<std::string, OpTime>& times() const { return t_; }
  void reset() { t_.clear(); }
  // Formatted table: op, calls per step, ms per step, share of the timed total.
  std::string table(int steps) const;
  // Range markers (NVTX on CUDA; none on the CPU), set once by the backend.
  using RangeFn = void (*)(const char*);
  void set_ranges(RangeFn push, void (*pop)()) {
    push_ = push;
    pop_ = pop;
  }

 private:
  friend class OpScope;
  bool on_ = false;
  std::map<std::string, OpTime> t_;
  RangeFn push_ = nullptr;
  void (*pop_)() = nullptr;
};

// The profile row of a Linear op: "linear_forward 768->3072 +gelu".
inline std::string linear_row(const char* op, int in, int out, const char* extra) {
  return std::string(op) + " " + std::to_string(in) + "->" + std::to_string(out) + extra;
}

class OpScope {
 public:
  OpScope(Device& d, const char* op);
  ~OpScope() noexcept(false);  // (synchronising may report a device error)
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;
  // Whether this scope is timed: an op with a more telling row name (its shape) sets it then.
  bool timing() const { return timed_; }
  void rename(std::string row) { row_ = std::move(row); }

 private:
  Device& d_;
  OpProfile& p_;
  std::string row_;
  double t0_ = 0.0;
  bool counted_ = false;  // (profiling on) counted in its thread's depth of open scopes
  bool timed_ = false;    // the outermost: synchronised and timed
};

}  // namespace vitgrid
