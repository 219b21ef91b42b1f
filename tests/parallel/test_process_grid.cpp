// ProcessGrid under real MPI (2 and 4 ranks): layout rank = stage * dp + replica, membership
// of the dp and pp sub-communicators, that a dp all-reduce mixes only the ranks of one stage,
// and that a pp which does not divide the world is an Input error on every rank.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "parallel/mpi.hpp"
#include "parallel/process_grid.hpp"

namespace strata::parallel {
namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int s = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

// The world ranks of the members of `comm`, in the communicator's rank order.
std::vector<int32_t> members(Communicator& comm) {
  Tensor mine = Tensor::empty({1}, DType::I32);
  mine.data<int32_t>()[0] = world_rank();
  Tensor all = Tensor::empty({comm.size()}, DType::I32);
  comm.all_gather(mine, all);
  return {all.data<int32_t>(), all.data<int32_t>() + comm.size()};
}

void check_grid(int pp) {
  SCOPED_TRACE("pp " + std::to_string(pp));
  const int rank = world_rank(), size = world_size();
  ProcessGrid grid(MPI_COMM_WORLD, pp);
  const int dp = size / pp;
  EXPECT_EQ(grid.pp_size(), pp);
  EXPECT_EQ(grid.dp_size(), dp);
  EXPECT_EQ(grid.stage(), rank / dp);
  EXPECT_EQ(grid.replica(), rank % dp);
  EXPECT_EQ(grid.rank_of(grid.stage(), grid.replica()), rank);
  EXPECT_EQ(grid.world().size(), size);
  EXPECT_EQ(grid.world().rank(), rank);
  EXPECT_EQ(grid.dp().size(), dp);
  EXPECT_EQ(grid.dp().rank(), grid.replica());
  EXPECT_EQ(grid.pp().size(), pp);
  EXPECT_EQ(grid.pp().rank(), grid.stage());

  std::vector<int32_t> want_dp, want_pp;
  for (int r = 0; r < dp; ++r) want_dp.push_back(grid.rank_of(grid.stage(), r));
  for (int s = 0; s < pp; ++s) want_pp.push_back(grid.rank_of(s, grid.replica()));
  EXPECT_EQ(members(grid.dp()), want_dp);
  EXPECT_EQ(members(grid.pp()), want_pp);
  EXPECT_EQ(members(grid.world()).size(), static_cast<size_t>(size));

  // A dp all-reduce mixes only the replicas of my stage.
  Tensor t = Tensor::empty({1}, DType::I32);
  t.data<int32_t>()[0] = rank;
  grid.dp().all_reduce(t, ReduceOp::Sum);
  int want = 0;
  for (int r = 0; r < dp; ++r) want += grid.stage() * dp + r;
  EXPECT_EQ(t.data<int32_t>()[0], want);

  // Messages along the pipeline: stage s sends its world rank to stage s + 1.
  if (pp > 1) {
    Tensor v = Tensor::empty({1}, DType::I32);
    if (grid.stage() + 1 < pp) {
      v.data<int32_t>()[0] = rank;
      grid.pp().send(v, grid.stage() + 1, 0);
    }
    if (grid.stage() > 0) {
      grid.pp().recv(v, grid.stage() - 1, 0);
      EXPECT_EQ(v.data<int32_t>()[0], grid.rank_of(grid.stage() - 1, grid.replica()));
    }
  }
}

TEST(ProcessGrid, DataParallelOnly) { check_grid(1); }
TEST(ProcessGrid, TwoStages) { check_grid(2); }
TEST(ProcessGrid, PipelineOnly) { check_grid(world_size()); }

TEST(ProcessGrid, Layout) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  ProcessGrid grid(MPI_COMM_WORLD, 2);
  EXPECT_EQ(grid.rank_of(0, 0), 0);
  EXPECT_EQ(grid.rank_of(0, 1), 1);
  EXPECT_EQ(grid.rank_of(1, 0), 2);
  EXPECT_EQ(grid.rank_of(1, 1), 3);
  EXPECT_THROW(grid.rank_of(2, 0), Error);
}

// Every rank throws the same Input error, before any communication: nobody hangs.
void expect_input_error(int pp, const std::string& message) {
  try {
    ProcessGrid grid(MPI_COMM_WORLD, pp);
    ADD_FAILURE() << "pp " << pp << " accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    EXPECT_EQ(e.message(), message);
  }
}

TEST(ProcessGrid, BadPpIsAnInputErrorOnEveryRank) {
  const int size = world_size();
  expect_input_error(3, "--pp 3 does not divide the " + std::to_string(size) + " ranks of the world");
  expect_input_error(0, "--pp 0 must be at least 1");
  expect_input_error(-1, "--pp -1 must be at least 1");
  expect_input_error(size + 1, "--pp " + std::to_string(size + 1) + " does not divide the " + std::to_string(size) +
                                   " ranks of the world");
  // The world is still in step: a collective after the errors completes.
  MpiCommunicator world(MPI_COMM_WORLD, "world");
  world.barrier();
}

// A setup part that fails on the last rank only (a stage's checkpoint tensor): that rank
// rethrows its error, the others throw PeerFailed instead of going on into the next collective,
// and run_collectively returns the failing rank's exit code on every rank.
TEST(ProcessGrid, AgreeEndsAPartThatFailedOnOneRankEverywhere) {
  const int rank = world_rank(), last = world_size() - 1;
  const auto part = [&] {
    if (rank == last) STRATA_THROW_INPUT("bad tensor on rank ", last);
  };
  if (rank == last)
    EXPECT_THROW(agree(MPI_COMM_WORLD, part), Error);
  else
    EXPECT_THROW(agree(MPI_COMM_WORLD, part), PeerFailed);
  testing::internal::CaptureStderr();
  const int code = run_collectively(MPI_COMM_WORLD, [&] {
    agree(MPI_COMM_WORLD, part);
    ADD_FAILURE() << "the phase went on after a failed part";
  });
  const std::string printed = testing::internal::GetCapturedStderr();
  EXPECT_EQ(code, kExitBadInput);
  EXPECT_EQ(printed, rank == last ? "error: bad tensor on rank " + std::to_string(last) + "\n" : "");
  EXPECT_NO_THROW(agree(MPI_COMM_WORLD, [] {}));  // all ranks still in step
}

}  // namespace
}  // namespace strata::parallel
