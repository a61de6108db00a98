// A Backend decorator that times every op (synchronising after each, so each op's time is its
// own), for `vitgrid bench --profile`: the table of where a training step's time goes.
#pragma once
#include <map>
#include <memory>
#include <string>

#include "vitgrid/backend/backend.h"

namespace vitgrid {

struct OpTime {
  double seconds = 0.0;
  long calls = 0;
};

class ProfiledBackend;
// Wraps `inner`; the returned object forwards every call.
std::unique_ptr<ProfiledBackend> make_profiled(std::unique_ptr<Backend> inner);

class ProfiledBackend : public Backend {
 public:
  virtual const std::map<std::string, OpTime>& times() const = 0;
  virtual void reset() = 0;
  // Off (the default): plain forwarding, no synchronisation. On: every op is timed.
  virtual void set_enabled(bool on) = 0;
  // Formatted table: op, calls per step, ms per step, share of the timed total.
  std::string table(int steps) const;
};

}  // namespace vitgrid
