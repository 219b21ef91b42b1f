// GoogleTest main for tests that run under mpiexec: initialises MPI (parallel::MpiRuntime),
// runs the tests on every rank, and agrees on one result so every rank exits with the same
// code. Rank 0 prints gtest's usual output; other ranks print only their failures, with
// their rank, so a failure that happens on rank 3 alone is still seen.
#include <gtest/gtest.h>

#include <cstdio>

#include "parallel/runtime/mpi.hpp"

namespace {

// The output of ranks other than 0: failed assertions only.
class FailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.summary());
    std::fflush(stderr);
  }
  void OnTestEnd(const testing::TestInfo& info) override {
    if (info.result()->Failed())
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  strata::parallel::MpiRuntime mpi(argc, argv);
  testing::InitGoogleTest(&argc, argv);
  if (mpi.rank() != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(mpi.rank()));
  }
  const int mine = RUN_ALL_TESTS();
  // The job fails if any rank failed; every rank returns the same code.
  int any = 0;
  MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any != 0 && mine == 0 && mpi.rank() == 0) std::fprintf(stderr, "tests failed on another rank\n");
  return any != 0 ? 1 : 0;
}
