// Threads and cores, MPI-free (the runtime gathers the masks of a node's ranks): how many threads a rank runs by
// default, and whether the ranks' threads oversubscribe the cores they may run on. A rank's CPU affinity mask is what
// mpirun's binding
// (--bind-to core, --map-by slot:PE=N) or Slurm's --cpus-per-task gave it; ranks of a node
// whose masks overlap share those cores.
#pragma once

#include <string>
#include <vector>

namespace strata::parallel {

using CpuSet = std::vector<int>;  // CPU numbers, ascending

// This process's affinity mask (sched_getaffinity).
CpuSet own_cpus();

// The default thread count of node-local rank `me` among ranks with masks `masks`: the CPUs of
// its mask divided among the ranks whose masks overlap it (itself included), at least 1. Bound
// to one core each: 1. Unbound (every mask = all cores): cores / ranks, as without masks.
int default_threads(const std::vector<CpuSet>& masks, int me);

// Ranks of one node (world ranks `ranks`, masks, threads): for each group of ranks whose masks
// overlap (transitively), if their threads outnumber the CPUs of the group's union and some
// rank runs more than one, one line naming them, e.g. "ranks 0, 1 run 4 threads on 1 core (0):
// ..."; empty if none do (one thread per rank on fewer cores is mpirun --oversubscribe's choice).
std::string oversubscription(const std::vector<int>& ranks, const std::vector<CpuSet>& masks,
                             const std::vector<int>& threads);

// "0-3,8" for {0, 1, 2, 3, 8}.
std::string cpu_list(const CpuSet& cpus);

}  // namespace strata::parallel
