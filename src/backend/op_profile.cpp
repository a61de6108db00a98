// OpScope and the --profile table (backend/op_profile.h).
#include "vitgrid/backend/op_profile.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <vector>

#include "vitgrid/backend/backend.h"
#include "vitgrid/core/log.h"

namespace vitgrid {

namespace {
thread_local int t_depth = 0;  // open timed scopes of this thread (ops calling ops)
}

OpScope::OpScope(Device& d, const char* op) : d_(d), p_(d.op_profile()) {
  if (p_.push_) p_.push_(op);
  if (!p_.on_) return;
  counted_ = true;
  if (t_depth++ > 0) return;
  timed_ = true;
  row_ = op;
  d_.synchronize();
  t0_ = now_s();
}

OpScope::~OpScope() noexcept(false) {
  if (counted_) --t_depth;
  if (p_.pop_) p_.pop_();
  if (timed_ && std::uncaught_exceptions() == 0) {  // (an op that threw is not timed)
    d_.synchronize();
    OpTime& t = p_.t_[row_];
    t.seconds += now_s() - t0_;
    ++t.calls;
  }
}

std::string OpProfile::table(int steps) const {
  std::vector<std::pair<std::string, OpTime>> v(t_.begin(), t_.end());
  std::sort(v.begin(), v.end(),
            [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  double total = 0.0;
  for (const auto& e : v) total += e.second.seconds;
  std::string s = "| op | calls/step | ms/step | share |\n|---|---|---|---|\n";
  char buf[160];
  for (const auto& e : v) {
    std::snprintf(buf, sizeof buf, "| %s | %.0f | %.3f | %.1f%% |\n", e.first.c_str(),
                  double(e.second.calls) / steps, 1e3 * e.second.seconds / steps,
                  100.0 * e.second.seconds / std::max(total, 1e-12));
    s += buf;
  }
  std::snprintf(buf, sizeof buf, "| total (synchronised per op) | | %.3f | 100%% |\n",
                1e3 * total / steps);
  s += buf;
  return s;
}

}  // namespace vitgrid
