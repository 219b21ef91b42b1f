// Default threads and the oversubscription warning from affinity masks (pure arithmetic; the
// masks are what mpirun's binding or Slurm's --cpus-per-task give each rank of a node).
#include <gtest/gtest.h>

#include "parallel/runtime/cpu_threads.hpp"

namespace strata::parallel {
namespace {

TEST(CpuThreads, DefaultThreadsFollowTheMask) {
  // mpirun -np 2 on 2 cores binds each rank to a core: 1 thread each.
  EXPECT_EQ(default_threads({{0}, {1}}, 0), 1);
  EXPECT_EQ(default_threads({{0}, {1}}, 1), 1);
  // --oversubscribe -np 4 binds nothing: 2 cores among 4 ranks, at least 1.
  EXPECT_EQ(default_threads({{0, 1}, {0, 1}, {0, 1}, {0, 1}}, 2), 1);
  // Unbound on 16 cores, 4 ranks: 4 each, as cores / ranks was.
  const CpuSet all{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  EXPECT_EQ(default_threads({all, all, all, all}, 0), 4);
  // --map-by slot:PE=4 on 16 cores: each rank its 4 cores.
  EXPECT_EQ(default_threads({{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}, 3), 4);
  // Slurm -c 1 but a 2-core mask shared by two ranks: 1 each, never the 2 of the mask.
  EXPECT_EQ(default_threads({{0, 1}, {0, 1}}, 0), 1);
}

TEST(CpuThreads, CpuLists) {
  EXPECT_EQ(cpu_list({0, 1, 2, 3, 8}), "0-3,8");
  EXPECT_EQ(cpu_list({5}), "5");
  EXPECT_EQ(cpu_list({0, 2, 4, 5}), "0,2,4-5");
}

TEST(CpuThreads, OversubscribedGroupsAreNamed) {
  // Each rank its own core, one thread each: nothing to say.
  EXPECT_EQ(oversubscription({0, 1}, {{0}, {1}}, {1, 1}), "");
  // 4 ranks of one thread on 2 cores: the rank count was asked for (--oversubscribe), not threads.
  EXPECT_EQ(oversubscription({0, 1, 2, 3}, {{0, 1}, {0, 1}, {0, 1}, {0, 1}}, {1, 1, 1, 1}), "");
  // --threads 2 on two ranks both pinned to core 0 (the issue's --cpus-per-task=2 case).
  EXPECT_EQ(oversubscription({0, 1}, {{0}, {0}}, {2, 2}).substr(0, 34), "ranks 0, 1 run 4 threads on 1 core");
  // Two groups on one node: {4, 5} share cores 0-1 with 3 threads in all; {6} is alone and fine.
  const std::string line = oversubscription({4, 5, 6}, {{0, 1}, {1}, {2, 3}}, {2, 1, 2});
  EXPECT_EQ(line.substr(0, 38), "ranks 4, 5 run 3 threads on 2 cores (0") << line;
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  EXPECT_NE(line.find("--map-by slot:PE=N"), std::string::npos) << line;
}

}  // namespace
}  // namespace strata::parallel
