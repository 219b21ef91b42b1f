// ProcessGrid under real MPI (2 and 4 ranks): layout rank = stage * dp + replica, membership
// of the dp and pp sub-communicators, that a dp all-reduce mixes only the ranks of one stage,
// and that a pp which does not divide the world is an Input error on every rank. Grids of named
// axes (pp x dp x tp, tp fastest): coordinates, each axis' communicator and its members,
// rank_of round trips, describe(), and bad axis lists rejected the same way on every rank.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "parallel/mpi_world.hpp"
#include "parallel/runtime/mpi.hpp"
#include "parallel/runtime/process_grid.hpp"

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
    EXPECT_TRUE(e.message().starts_with(message)) << e.message();  // what follows: GridLayout's test
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

using Axes = std::vector<AxisSize>;

std::string axes_str(const Axes& axes) {
  std::string s;
  for (const auto& a : axes)
    s += std::string(axis_name(a.axis)) + " " + (a.size ? std::to_string(*a.size) : "rest") + "; ";
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
  const GridLayout& layout = grid.layout();
  ASSERT_EQ(layout.axes().size(), axes.size());
  EXPECT_EQ(layout.coords_of(rank), want_coords);
  EXPECT_EQ(layout.rank_of(want_coords), rank);
  for (int r = 0; r < size; ++r) EXPECT_EQ(layout.rank_of(layout.coords_of(r)), r);
  EXPECT_EQ(grid.world().size(), size);
  for (int i = 0; i < n; ++i) {
    const Axis name = axes[i].axis;
    SCOPED_TRACE(std::string("axis ") + axis_name(name));
    EXPECT_EQ(layout.axes()[i].axis, name);
    EXPECT_EQ(layout.axes()[i].size, axes[i].size);
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
    std::vector<int> coords = want_coords;
    for (int c = 0; c < *axes[i].size; ++c) {
      coords[i] = c;
      EXPECT_EQ(layout.rank_of(coords), want[c]);
    }
    coords[i] = *axes[i].size;
    EXPECT_THROW(layout.rank_of(coords), Error);
  }
  // Today's names follow the pp and dp axes; tp stays at this rank's coordinate.
  EXPECT_EQ(grid.stage(), grid.coord(Axis::Pipeline));
  EXPECT_EQ(grid.replica(), grid.coord(Axis::Data));
  EXPECT_EQ(grid.pp_size(), grid.size(Axis::Pipeline));
  EXPECT_EQ(grid.dp_size(), grid.size(Axis::Data));
  EXPECT_EQ(grid.rank_of(grid.stage(), grid.replica()), rank);
  EXPECT_EQ(&grid.pp(), &grid.comm(Axis::Pipeline));
  EXPECT_EQ(&grid.dp(), &grid.comm(Axis::Data));
  EXPECT_EQ(&grid.mpi_pp(), &grid.mpi_comm(Axis::Pipeline));
  EXPECT_EQ(&grid.mpi_dp(), &grid.mpi_comm(Axis::Data));
  EXPECT_THROW(layout.rank_of({}), Error);
  EXPECT_THROW(layout.coords_of(size), Error);

  // A tp all-reduce mixes only the ranks of my tp group.
  Tensor t = Tensor::empty({1}, DType::I32);
  t.data<int32_t>()[0] = rank;
  grid.comm(Axis::Tensor).all_reduce(t, ReduceOp::Sum);
  int want_sum = 0;
  for (int c = 0; c < grid.size(Axis::Tensor); ++c) want_sum += rank + (c - grid.coord(Axis::Tensor));
  EXPECT_EQ(t.data<int32_t>()[0], want_sum);
}

TEST(ProcessGrid, ThreeAxes) {
  const int size = world_size();
  check_axes({{Axis::Pipeline, 1}, {Axis::Data, 1}, {Axis::Tensor, size}});
  check_axes({{Axis::Pipeline, size}, {Axis::Data, 1}, {Axis::Tensor, 1}});
  check_axes({{Axis::Pipeline, 1}, {Axis::Data, size}, {Axis::Tensor, 1}});
  if (size == 4) {
    check_axes({{Axis::Pipeline, 2}, {Axis::Data, 1}, {Axis::Tensor, 2}});
    check_axes({{Axis::Pipeline, 1}, {Axis::Data, 2}, {Axis::Tensor, 2}});
    check_axes({{Axis::Pipeline, 2}, {Axis::Data, 2}, {Axis::Tensor, 1}});
  }
}

TEST(ProcessGrid, ThreeAxesLayout) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const int rank = world_rank();
  ProcessGrid grid(MPI_COMM_WORLD, {{Axis::Pipeline, 2}, {Axis::Data, 1}, {Axis::Tensor, 2}});
  EXPECT_EQ(grid.layout().coords_of(rank), (std::vector<int>{rank / 2, 0, rank % 2}));
  EXPECT_EQ(members(grid.comm(Axis::Tensor)), (std::vector<int32_t>{rank / 2 * 2, rank / 2 * 2 + 1}));
  EXPECT_EQ(members(grid.pp()), (std::vector<int32_t>{rank % 2, rank % 2 + 2}));
  EXPECT_EQ(members(grid.dp()), (std::vector<int32_t>{rank}));
  EXPECT_EQ(grid.layout().rank_of({1, 0, 0}), 2);
  EXPECT_EQ(grid.layout().rank_of({0, 0, 1}), 1);
  EXPECT_EQ(grid.layout().coords_of(3), (std::vector<int>{1, 0, 1}));
  // rank_of(stage, replica) keeps my tp coordinate.
  EXPECT_EQ(grid.rank_of(1, 0), 2 + rank % 2);
  EXPECT_EQ(grid.rank_of(0, 0), rank % 2);
  EXPECT_THROW(grid.rank_of(0, 1), Error);

  ProcessGrid wide(MPI_COMM_WORLD, {{Axis::Pipeline, 1}, {Axis::Data, 2}, {Axis::Tensor, 2}});
  EXPECT_EQ(wide.layout().coords_of(rank), (std::vector<int>{0, rank / 2, rank % 2}));
  EXPECT_EQ(members(wide.dp()), (std::vector<int32_t>{rank % 2, rank % 2 + 2}));
  EXPECT_EQ(members(wide.comm(Axis::Tensor)), (std::vector<int32_t>{rank / 2 * 2, rank / 2 * 2 + 1}));
  EXPECT_EQ(members(wide.pp()), (std::vector<int32_t>{rank}));
}

TEST(ProcessGrid, OpenAxisTakesTheRestOfTheWorld) {
  const int size = world_size();
  ProcessGrid grid(MPI_COMM_WORLD, {{Axis::Pipeline, 1}, {Axis::Data, std::nullopt}, {Axis::Tensor, 2}});
  EXPECT_EQ(grid.size(Axis::Data), size / 2);
  EXPECT_EQ(*grid.layout().axes()[1].size, size / 2);
  EXPECT_EQ(grid.dp().size(), size / 2);
  EXPECT_EQ(grid.comm(Axis::Tensor).size(), 2);
}

TEST(ProcessGrid, AxisTheGridDoesNotListHasSizeOne) {
  ProcessGrid grid(MPI_COMM_WORLD, 1);
  EXPECT_FALSE(grid.has(Axis::Tensor));
  EXPECT_TRUE(grid.has(Axis::Pipeline));
  EXPECT_EQ(grid.size(Axis::Tensor), 1);
  EXPECT_EQ(grid.coord(Axis::Tensor), 0);
  EXPECT_THROW(grid.comm(Axis::Tensor), Error);
  EXPECT_THROW(grid.mpi_comm(Axis::Tensor), Error);
  ProcessGrid dp_only(MPI_COMM_WORLD, {{Axis::Data, std::nullopt}});
  EXPECT_EQ(dp_only.stage(), 0);
  EXPECT_EQ(dp_only.pp_size(), 1);
  EXPECT_EQ(dp_only.replica(), world_rank());
  EXPECT_EQ(dp_only.rank_of(0, world_size() - 1), world_size() - 1);
  EXPECT_THROW(dp_only.pp(), Error);
}

TEST(ProcessGrid, Describe) {
  const int size = world_size();
  if (size == 4) {
    EXPECT_EQ(ProcessGrid(MPI_COMM_WORLD, {{Axis::Pipeline, 2}, {Axis::Data, 1}, {Axis::Tensor, 2}}).describe(),
              "process grid: pp 2 x dp 1 x tp 2 = 4 ranks, tp fastest\n"
              "  pp groups: [0 2] [1 3]\n"
              "  dp groups: [0] [1] [2] [3]\n"
              "  tp groups: [0 1] [2 3]");
    EXPECT_EQ(ProcessGrid(MPI_COMM_WORLD, {{Axis::Pipeline, 1}, {Axis::Data, 2}, {Axis::Tensor, 2}}).describe(),
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
  EXPECT_EQ(ProcessGrid(MPI_COMM_WORLD, {{Axis::Data, size}}).describe(),
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
    EXPECT_TRUE(e.message().starts_with(message)) << e.message();  // what follows: GridLayout's test
  }
}

TEST(ProcessGrid, BadAxesAreAnInputErrorOnEveryRank) {
  const int size = world_size();
  const std::string world = std::to_string(size) + " ranks of the world";
  const std::string s = std::to_string(size);
  expect_axes_error({}, "a process grid needs at least one axis");
  expect_axes_error({{Axis::Pipeline, 1}, {Axis::Data, size}, {Axis::Pipeline, 1}},
                    "process grid axis 'pp' is given twice");
  expect_axes_error({{Axis::Pipeline, 1}, {Axis::Data, std::nullopt}, {Axis::Tensor, std::nullopt}},
                    "process grid axes dp and tp both take the rest of the world; at most one may");
  expect_axes_error({{Axis::Pipeline, 1}, {Axis::Data, std::nullopt}, {Axis::Tensor, 0}}, "--tp 0 must be at least 1");
  expect_axes_error({{Axis::Pipeline, -2}, {Axis::Data, size}}, "--pp -2 must be at least 1");
  expect_axes_error({{Axis::Pipeline, 3}, {Axis::Data, std::nullopt}, {Axis::Tensor, 1}},
                    "--pp 3 does not divide the " + world);
  expect_axes_error({{Axis::Pipeline, 1}, {Axis::Data, std::nullopt}, {Axis::Tensor, 3}},
                    "--tp 3 does not divide the " + world);
  expect_axes_error({{Axis::Pipeline, 2}, {Axis::Data, std::nullopt}, {Axis::Tensor, size}},
                    "--pp 2 x --tp " + s + " does not divide the " + world);
  expect_axes_error({{Axis::Pipeline, size}, {Axis::Data, 2}, {Axis::Tensor, 1}},
                    "--pp " + s + " x --dp 2 x --tp 1 does not match the " + world);
  expect_axes_error({{Axis::Data, 1}}, "--dp 1 does not match the " + world);
  expect_axes_error({{Axis::Pipeline, 3}, {Axis::Tensor, size}}, "--pp 3 x --tp " + s + " does not match the " + world);
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

// The layout alone, without MPI: what --dry-run --world N plans with.
TEST(GridLayout, TrainsGridForAWorldThatWasNotLaunched) {
  const GridLayout g = GridLayout::train(2, 2, 8);  // pp 2 x dp 2 x tp 2
  EXPECT_EQ(g.size(Axis::Data), 2);
  for (int k = 0; k < 8; ++k) {
    EXPECT_EQ(g.stage(k), k / 4);
    EXPECT_EQ(g.replica(k), k / 2 % 2);
    EXPECT_EQ(g.tp_rank(k), k % 2);
    EXPECT_EQ(g.rank_of(g.coords_of(k)), k);
  }
  EXPECT_FALSE(GridLayout::train(2, 1, 4).has(Axis::Tensor));
  EXPECT_EQ(GridLayout::train(2, 1, 4).tp_rank(3), 0);
  try {
    GridLayout::train(3, 1, 8);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(),
              "--pp 3 does not divide the 8 ranks of the world: launch a multiple of 3 ranks (3, 6, 9, ...), or give "
              "sizes whose product divides 8 (1, 2, 4, 8)");
  }
}

}  // namespace
}  // namespace strata::parallel
