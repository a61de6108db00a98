// The op profile (backend/op_profile.h) on the CPU backend: off, nothing is recorded; on, each
// op the caller enqueues is one row (Linear rows named by shape), an op another op calls
// inside is not counted apart, and every scope opens and closes one range marker, profile on
// or off (on CUDA: NVTX).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend_test_util.h"
#include "vitgrid/backend/cpu/cpu_backend.h"

namespace {

using vitgrid::CpuBackend;
using vitgrid::Gelu;

std::vector<std::string> g_ranges;  // "+op" on push, "-" on pop
int g_open = 0;
void push(const char* op) {
  g_ranges.push_back(std::string("+") + op);
  ++g_open;
}
void pop() {
  g_ranges.push_back("-");
  --g_open;
}

TEST(OpProfile, RowsPerCallerOpAndBalancedRanges) {
  CpuBackend be;
  be.op_profile().set_ranges(push, pop);
  const int N = 6, in = 8, out = 4;
  auto x = vgtest::randn(size_t(N) * in, 1), W = vgtest::randn(size_t(out) * in, 2);
  auto b = vgtest::randn(out, 3), dy = vgtest::randn(size_t(N) * out, 4);
  std::vector<float> y(size_t(N) * out), dx(y.size()), db(out, 0.0f);
  auto run = [&] {
    be.linear_forward(y.data(), x.data(), W.data(), b.data(), N, in, out, nullptr, Gelu::Exact);
    // gelu_backward_bias calls gelu_backward inside: one row, the caller's
    be.gelu_backward_bias(dx.data(), y.data(), dy.data(), N, out, db.data(), Gelu::Exact);
  };
  run();  // off: ranges only
  EXPECT_TRUE(be.op_profile().times().empty());
  EXPECT_EQ(g_open, 0);
  const std::vector<std::string> off = g_ranges;
  ASSERT_GE(off.size(), 4u);
  EXPECT_EQ(off.front(), "+linear_forward");
  be.op_profile().set_enabled(true);
  for (int k = 0; k < 3; ++k) run();
  be.op_profile().set_enabled(false);
  EXPECT_EQ(g_open, 0);
  const auto& t = be.op_profile().times();
  ASSERT_EQ(t.size(), 2u) << be.op_profile().table(3);
  ASSERT_TRUE(t.count("linear_forward 8->4"));
  ASSERT_TRUE(t.count("gelu_backward + bias gradient"));
  EXPECT_EQ(t.at("linear_forward 8->4").calls, 3);
  EXPECT_EQ(t.at("gelu_backward + bias gradient").calls, 3);
  for (const auto& e : t) EXPECT_GE(e.second.seconds, 0.0);
  const std::string table = be.op_profile().table(3);
  EXPECT_NE(table.find("| linear_forward 8->4 | 1 |"), std::string::npos) << table;
  // the same ranges with the profile on as off, run after run
  EXPECT_EQ(g_ranges.size(), off.size() * 4);
  be.op_profile().reset();
  EXPECT_TRUE(be.op_profile().times().empty());
  be.op_profile().set_ranges(nullptr, nullptr);
}

}  // namespace
