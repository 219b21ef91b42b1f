// ProcessGrid under real MPI (2 and 4 ranks): layout rank = stage * dp + replica, membership
// of the dp and pp sub-communicators, that a dp all-reduce mixes only the ranks of one stage,
// and that a pp which does not divide the world is an Input error on every rank. Grids of named
// axes (pp x dp x tp, tp fastest): coordinates, each axis' communicator and its members,
// rank_of round trips, describe(), and bad axis lists rejected the same way on every rank.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "parallel/mpi.hpp"
#include "parallel/mpi_world.hpp"
#include "parallel/process_grid.hpp"

namespace strata::parallel {
namespace {

using namespace testing_world;

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

// --- Grids of named axes.

using Axes = std::vector<ProcessGrid::Axis>;

std::string axes_str(const Axes& axes) {
  std::string s;
  for (const auto& a : axes) s += a.name + " " + (a.size ? std::to_string(*a.size) : "rest") + "; ";
  return s;
}

// Checks a grid of `axes` (every size given) against row-major arithmetic done here.
void check_axes(const Axes& axes) {
  SCOPED_TRACE(axes_str(axes));
  const int rank = world_rank(), size = world_size();
  const int n = static_cast<int>(axes.size());
  std::vector<int> stride(n, 1), want_coords(n);
  for (int i = n - 2; i >= 0; --i) stride[i] = stride[i + 1] * *axes[i + 1].size;
  for (int i = 0; i < n; ++i) want_coords[i] = rank / stride[i] % *axes[i].size;

  ProcessGrid grid(MPI_COMM_WORLD, axes);
  ASSERT_EQ(grid.axes().size(), axes.size());
  EXPECT_EQ(grid.coords(), want_coords);
  EXPECT_EQ(grid.rank_of(grid.coords()), rank);
  for (int r = 0; r < size; ++r) EXPECT_EQ(grid.rank_of(grid.coords_of(r)), r);
  EXPECT_EQ(grid.world().size(), size);
  for (int i = 0; i < n; ++i) {
    const std::string& name = axes[i].name;
    SCOPED_TRACE("axis " + name);
    EXPECT_EQ(grid.axes()[i].name, name);
    EXPECT_EQ(grid.axes()[i].size, axes[i].size);
    EXPECT_TRUE(grid.has(name));
    EXPECT_EQ(grid.size(name), *axes[i].size);
    EXPECT_EQ(grid.coord(name), want_coords[i]);
    EXPECT_EQ(grid.comm(name).size(), *axes[i].size);
    EXPECT_EQ(grid.comm(name).rank(), want_coords[i]);
    EXPECT_EQ(grid.mpi_comm(name).size(), *axes[i].size);
    EXPECT_EQ(grid.mpi_comm(name).rank(), want_coords[i]);
    // Members: my rank with this axis' coordinate running through its values.
    std::vector<int32_t> want;
    for (int c = 0; c < *axes[i].size; ++c) want.push_back(rank + (c - want_coords[i]) * stride[i]);
    EXPECT_EQ(members(grid.comm(name)), want);
    EXPECT_EQ(members(grid.mpi_comm(name)), want);
    std::vector<int> coords = grid.coords();
    for (int c = 0; c < *axes[i].size; ++c) {
      coords[i] = c;
      EXPECT_EQ(grid.rank_of(coords), want[c]);
    }
    coords[i] = *axes[i].size;
    EXPECT_THROW(grid.rank_of(coords), Error);
  }
  // Today's names follow the pp and dp axes; tp stays at this rank's coordinate.
  EXPECT_EQ(grid.stage(), grid.coord("pp"));
  EXPECT_EQ(grid.replica(), grid.coord("dp"));
  EXPECT_EQ(grid.pp_size(), grid.size("pp"));
  EXPECT_EQ(grid.dp_size(), grid.size("dp"));
  EXPECT_EQ(grid.rank_of(grid.stage(), grid.replica()), rank);
  EXPECT_EQ(&grid.pp(), &grid.comm("pp"));
  EXPECT_EQ(&grid.dp(), &grid.comm("dp"));
  EXPECT_EQ(&grid.mpi_pp(), &grid.mpi_comm("pp"));
  EXPECT_EQ(&grid.mpi_dp(), &grid.mpi_comm("dp"));
  EXPECT_THROW(grid.rank_of({}), Error);
  EXPECT_THROW(grid.coords_of(size), Error);
  EXPECT_THROW(grid.size("xx"), Error);

  // A tp all-reduce mixes only the ranks of my tp group.
  Tensor t = Tensor::empty({1}, DType::I32);
  t.data<int32_t>()[0] = rank;
  grid.comm("tp").all_reduce(t, ReduceOp::Sum);
  int want_sum = 0;
  for (int c = 0; c < grid.size("tp"); ++c) want_sum += rank + (c - grid.coord("tp"));
  EXPECT_EQ(t.data<int32_t>()[0], want_sum);
}

TEST(ProcessGrid, ThreeAxes) {
  const int size = world_size();
  check_axes({{"pp", 1}, {"dp", 1}, {"tp", size}});
  check_axes({{"pp", size}, {"dp", 1}, {"tp", 1}});
  check_axes({{"pp", 1}, {"dp", size}, {"tp", 1}});
  if (size == 4) {
    check_axes({{"pp", 2}, {"dp", 1}, {"tp", 2}});
    check_axes({{"pp", 1}, {"dp", 2}, {"tp", 2}});
    check_axes({{"pp", 2}, {"dp", 2}, {"tp", 1}});
  }
}

TEST(ProcessGrid, ThreeAxesLayout) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const int rank = world_rank();
  ProcessGrid grid(MPI_COMM_WORLD, {{"pp", 2}, {"dp", 1}, {"tp", 2}});
  EXPECT_EQ(grid.coords(), (std::vector<int>{rank / 2, 0, rank % 2}));
  EXPECT_EQ(members(grid.comm("tp")), (std::vector<int32_t>{rank / 2 * 2, rank / 2 * 2 + 1}));
  EXPECT_EQ(members(grid.pp()), (std::vector<int32_t>{rank % 2, rank % 2 + 2}));
  EXPECT_EQ(members(grid.dp()), (std::vector<int32_t>{rank}));
  EXPECT_EQ(grid.rank_of({1, 0, 0}), 2);
  EXPECT_EQ(grid.rank_of({0, 0, 1}), 1);
  EXPECT_EQ(grid.coords_of(3), (std::vector<int>{1, 0, 1}));
  // rank_of(stage, replica) keeps my tp coordinate.
  EXPECT_EQ(grid.rank_of(1, 0), 2 + rank % 2);
  EXPECT_EQ(grid.rank_of(0, 0), rank % 2);
  EXPECT_THROW(grid.rank_of(0, 1), Error);

  ProcessGrid wide(MPI_COMM_WORLD, {{"pp", 1}, {"dp", 2}, {"tp", 2}});
  EXPECT_EQ(wide.coords(), (std::vector<int>{0, rank / 2, rank % 2}));
  EXPECT_EQ(members(wide.dp()), (std::vector<int32_t>{rank % 2, rank % 2 + 2}));
  EXPECT_EQ(members(wide.comm("tp")), (std::vector<int32_t>{rank / 2 * 2, rank / 2 * 2 + 1}));
  EXPECT_EQ(members(wide.pp()), (std::vector<int32_t>{rank}));
}

TEST(ProcessGrid, OpenAxisTakesTheRestOfTheWorld) {
  const int size = world_size();
  ProcessGrid grid(MPI_COMM_WORLD, {{"pp", 1}, {"dp", std::nullopt}, {"tp", 2}});
  EXPECT_EQ(grid.size("dp"), size / 2);
  EXPECT_EQ(*grid.axes()[1].size, size / 2);
  EXPECT_EQ(grid.dp().size(), size / 2);
  EXPECT_EQ(grid.comm("tp").size(), 2);
}

TEST(ProcessGrid, AxisTheGridDoesNotListHasSizeOne) {
  ProcessGrid grid(MPI_COMM_WORLD, 1);
  EXPECT_FALSE(grid.has("tp"));
  EXPECT_TRUE(grid.has("pp"));
  EXPECT_EQ(grid.size("tp"), 1);
  EXPECT_EQ(grid.coord("tp"), 0);
  EXPECT_THROW(grid.comm("tp"), Error);
  EXPECT_THROW(grid.mpi_comm("tp"), Error);
  EXPECT_THROW(grid.has("xx"), Error);
  ProcessGrid dp_only(MPI_COMM_WORLD, {{"dp", std::nullopt}});
  EXPECT_EQ(dp_only.stage(), 0);
  EXPECT_EQ(dp_only.pp_size(), 1);
  EXPECT_EQ(dp_only.replica(), world_rank());
  EXPECT_EQ(dp_only.rank_of(0, world_size() - 1), world_size() - 1);
  EXPECT_THROW(dp_only.pp(), Error);
}

TEST(ProcessGrid, Describe) {
  const int size = world_size();
  if (size == 4) {
    EXPECT_EQ(ProcessGrid(MPI_COMM_WORLD, {{"pp", 2}, {"dp", 1}, {"tp", 2}}).describe(),
              "process grid: pp 2 x dp 1 x tp 2 = 4 ranks, tp fastest\n"
              "  pp groups: [0 2] [1 3]\n"
              "  dp groups: [0] [1] [2] [3]\n"
              "  tp groups: [0 1] [2 3]");
    EXPECT_EQ(ProcessGrid(MPI_COMM_WORLD, {{"pp", 1}, {"dp", 2}, {"tp", 2}}).describe(),
              "process grid: pp 1 x dp 2 x tp 2 = 4 ranks, tp fastest\n"
              "  pp groups: [0] [1] [2] [3]\n"
              "  dp groups: [0 2] [1 3]\n"
              "  tp groups: [0 1] [2 3]");
    EXPECT_EQ(ProcessGrid(MPI_COMM_WORLD, 2).describe(),
              "process grid: pp 2 x dp 2 = 4 ranks, dp fastest\n"
              "  pp groups: [0 2] [1 3]\n"
              "  dp groups: [0 1] [2 3]");
  }
  if (size == 2) {
    EXPECT_EQ(ProcessGrid(MPI_COMM_WORLD, 1).describe(),
              "process grid: pp 1 x dp 2 = 2 ranks, dp fastest\n"
              "  pp groups: [0] [1]\n"
              "  dp groups: [0 1]");
  }
  EXPECT_EQ(ProcessGrid(MPI_COMM_WORLD, {{"dp", size}}).describe(),
            "process grid: dp " + std::to_string(size) + " = " + std::to_string(size) + " ranks\n  dp groups: [0 1" +
                (size == 4 ? " 2 3]" : "]"));
}

// Every rank throws the same Input error, before any communication: nobody hangs.
void expect_axes_error(const Axes& axes, const std::string& message) {
  SCOPED_TRACE(axes_str(axes));
  try {
    ProcessGrid grid(MPI_COMM_WORLD, axes);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    EXPECT_EQ(e.message(), message);
  }
}

TEST(ProcessGrid, BadAxesAreAnInputErrorOnEveryRank) {
  const int size = world_size();
  const std::string world = std::to_string(size) + " ranks of the world";
  const std::string s = std::to_string(size);
  expect_axes_error({}, "a process grid needs at least one axis");
  expect_axes_error({{"pp", 1}, {"xx", size}}, "unknown process grid axis 'xx' (known: pp, dp, tp)");
  expect_axes_error({{"pp", 1}, {"dp", size}, {"pp", 1}}, "process grid axis 'pp' is given twice");
  expect_axes_error({{"pp", 1}, {"dp", std::nullopt}, {"tp", std::nullopt}},
                    "process grid axes dp and tp both take the rest of the world; at most one may");
  expect_axes_error({{"pp", 1}, {"dp", std::nullopt}, {"tp", 0}}, "--tp 0 must be at least 1");
  expect_axes_error({{"pp", -2}, {"dp", size}}, "--pp -2 must be at least 1");
  expect_axes_error({{"pp", 3}, {"dp", std::nullopt}, {"tp", 1}}, "--pp 3 does not divide the " + world);
  expect_axes_error({{"pp", 1}, {"dp", std::nullopt}, {"tp", 3}}, "--tp 3 does not divide the " + world);
  expect_axes_error({{"pp", 2}, {"dp", std::nullopt}, {"tp", size}},
                    "--pp 2 x --tp " + s + " does not divide the " + world);
  expect_axes_error({{"pp", size}, {"dp", 2}, {"tp", 1}},
                    "--pp " + s + " x --dp 2 x --tp 1 does not match the " + world);
  expect_axes_error({{"dp", 1}}, "--dp 1 does not match the " + world);
  expect_axes_error({{"pp", 3}, {"tp", size}}, "--pp 3 x --tp " + s + " does not match the " + world);
  // The world is still in step: a collective after the errors completes.
  MpiCommunicator world_comm(MPI_COMM_WORLD, "world");
  world_comm.barrier();
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
