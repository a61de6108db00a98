// MPI-aware GoogleTest main (after GROMACS testutils): MPI is initialised once; only rank 0
// prints and writes XML; a failure on any rank fails the test on every rank because ranks
// agree on the verdict with an all-reduce after each test (no collective runs after a rank
// has failed without the others knowing). The exit code is agreed too.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

class MpiListener : public ::testing::EmptyTestEventListener {
 public:
  explicit MpiListener(::testing::TestEventListener* inner) : inner_(inner) {}
  ~MpiListener() override { delete inner_; }
  void OnTestProgramStart(const ::testing::UnitTest& u) override { inner_->OnTestProgramStart(u); }
  void OnTestIterationStart(const ::testing::UnitTest& u, int i) override { inner_->OnTestIterationStart(u, i); }
  void OnEnvironmentsSetUpStart(const ::testing::UnitTest& u) override { inner_->OnEnvironmentsSetUpStart(u); }
  void OnEnvironmentsSetUpEnd(const ::testing::UnitTest& u) override { inner_->OnEnvironmentsSetUpEnd(u); }
  void OnTestStart(const ::testing::TestInfo& t) override { inner_->OnTestStart(t); }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    // every rank reports its own failures, tagged with the rank
    if (r.failed()) {
      int rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank,
                   r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
      std::fflush(stderr);
    }
  }
  void OnTestEnd(const ::testing::TestInfo& t) override { inner_->OnTestEnd(t); }
  void OnTestCaseEnd(const ::testing::TestCase& c) override { inner_->OnTestCaseEnd(c); }
  void OnEnvironmentsTearDownStart(const ::testing::UnitTest& u) override { inner_->OnEnvironmentsTearDownStart(u); }
  void OnEnvironmentsTearDownEnd(const ::testing::UnitTest& u) override { inner_->OnEnvironmentsTearDownEnd(u); }
  void OnTestIterationEnd(const ::testing::UnitTest& u, int i) override { inner_->OnTestIterationEnd(u, i); }
  void OnTestProgramEnd(const ::testing::UnitTest& u) override { inner_->OnTestProgramEnd(u); }

 private:
  ::testing::TestEventListener* inner_;
};

// After each test: all ranks agree. A test that failed only on rank 3 fails on rank 0 too, so
// the summary printed by rank 0 is right.
class AgreeListener : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& t) override {
    int mine = t.result()->Failed() ? 1 : 0, any = 0;
    MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (any && !mine) ADD_FAILURE() << "failed on another rank";
  }
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ::testing::InitGoogleTest(&argc, argv);
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    delete listeners.Release(listeners.default_xml_generator());
    listeners.Append(new MpiListener(new ::testing::EmptyTestEventListener));
  }
  listeners.Append(new AgreeListener);
  int rc = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  // VG_GTEST_SKIP_RC: the exit code when every selected test skipped itself (GTEST_SKIP), for
  // ctest entries that name it as SKIP_RETURN_CODE (e.g. tests that need root); unset, a run
  // whose tests all skipped passes
  const auto& u = *::testing::UnitTest::GetInstance();
  int skipped = u.test_to_run_count() > 0 && u.skipped_test_count() == u.test_to_run_count();
  MPI_Allreduce(MPI_IN_PLACE, &skipped, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  MPI_Finalize();
  const char* skip_rc = std::getenv("VG_GTEST_SKIP_RC");
  if (!any && skipped && skip_rc && *skip_rc) return std::atoi(skip_rc);
  return any ? 1 : 0;
}
