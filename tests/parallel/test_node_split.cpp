// split_by_node under STRATA_RANKS_PER_NODE=2 (set by CTest for this test): every 2 consecutive
// world ranks are a node, for the world and for any communicator, and NodeSharedMemory, which
// asks the same split, is made only for groups inside one simulated node.
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "parallel/comm/shared_memory.hpp"
#include "parallel/runtime/mpi.hpp"

namespace strata::parallel {
namespace {

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// World ranks of `comm`'s members, in its rank order.
std::vector<int> members(MPI_Comm comm) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  std::vector<int> ranks(static_cast<size_t>(size));
  const int mine = world_rank();
  MPI_Allgather(&mine, 1, MPI_INT, ranks.data(), 1, MPI_INT, comm);
  return ranks;
}

TEST(NodeSplit, OverrideIsSet) {
  ASSERT_STREQ(std::getenv("STRATA_RANKS_PER_NODE"), "2");
  EXPECT_EQ(ranks_per_node_override(), 2);
}

TEST(NodeSplit, EveryTwoWorldRanksAreANode) {
  MPI_Comm node = split_by_node(MPI_COMM_WORLD);
  const int first = world_rank() / 2 * 2;
  std::vector<int> want{first};
  if (first + 1 < world_size()) want.push_back(first + 1);
  EXPECT_EQ(members(node), want);
  MPI_Comm_free(&node);
}

TEST(NodeSplit, SubCommunicatorsSplitByWorldRank) {
  // The odd and even world ranks: {0, 2} and {1, 3} on 4 ranks span both nodes, so each of
  // their ranks is alone on its node; on 2 ranks each group is one rank anyway.
  MPI_Comm parity = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() % 2, world_rank(), &parity);
  MPI_Comm node = split_by_node(parity);
  EXPECT_EQ(members(node), std::vector<int>{world_rank()});
  MPI_Comm_free(&node);
  MPI_Comm_free(&parity);
}

TEST(NodeSplit, SharedMemoryOnlyInsideASimulatedNode) {
  // The world spans two simulated nodes on 4 ranks: no shared memory; 2 ranks are one node.
  const auto world = NodeSharedMemory::create(MPI_COMM_WORLD);
  EXPECT_EQ(world != nullptr, world_size() == 2);
  // Each pair {0, 1}, {2, 3} is one node: shared memory.
  MPI_Comm pair = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() / 2, world_rank(), &pair);
  EXPECT_TRUE(NodeSharedMemory::create(pair) != nullptr);
  MPI_Comm_free(&pair);
}

}  // namespace
}  // namespace strata::parallel
