#include "parallel/runtime/cpu_threads.hpp"

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <numeric>

#include "core/error.hpp"

namespace strata::parallel {

namespace {

bool overlap(const CpuSet& a, const CpuSet& b) {
  for (size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    if (a[i] == b[j]) return true;
    a[i] < b[j] ? ++i : ++j;
  }
  return false;
}

}  // namespace

CpuSet own_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  STRATA_CHECK(sched_getaffinity(0, sizeof set, &set) == 0, "sched_getaffinity failed");
  CpuSet cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

int default_threads(const std::vector<CpuSet>& masks, int me) {
  const CpuSet& mine = masks[static_cast<size_t>(me)];
  const auto sharing = std::count_if(masks.begin(), masks.end(), [&](const CpuSet& m) { return overlap(m, mine); });
  return std::max(1, static_cast<int>(mine.size() / static_cast<size_t>(std::max<int64_t>(sharing, 1))));
}

std::string cpu_list(const CpuSet& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    out += detail::cat(out.empty() ? "" : ",", cpus[i], j > i ? detail::cat("-", cpus[j]) : std::string());
    i = j + 1;
  }
  return out;
}

std::string oversubscription(const std::vector<int>& ranks, const std::vector<CpuSet>& masks,
                             const std::vector<int>& threads) {
  // Groups of ranks whose masks overlap, transitively (a union-find over the ranks).
  const size_t n = masks.size();
  std::vector<size_t> group(n);
  std::iota(group.begin(), group.end(), size_t{0});
  const auto root = [&](size_t i) {
    while (group[i] != i) i = group[i];
    return i;
  };
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j)
      if (overlap(masks[i], masks[j])) group[root(j)] = root(i);
  std::string lines;
  for (size_t g = 0; g < n; ++g) {
    if (root(g) != g) continue;
    std::vector<int> members;
    CpuSet cores;
    int total = 0;
    for (size_t i = 0; i < n; ++i) {
      if (root(i) != g) continue;
      members.push_back(ranks[i]);
      cores.insert(cores.end(), masks[i].begin(), masks[i].end());
      total += threads[i];
    }
    std::sort(cores.begin(), cores.end());
    cores.erase(std::unique(cores.begin(), cores.end()), cores.end());
    // One thread per rank: more ranks than cores was asked for (mpirun --oversubscribe).
    if (total <= static_cast<int>(cores.size()) || total <= static_cast<int>(members.size())) continue;
    std::string names;
    for (int r : members) names += detail::cat(names.empty() ? "" : ", ", r);
    lines += detail::cat(lines.empty() ? "" : "\n", members.size() == 1 ? "rank " : "ranks ", names, " run ", total,
                         " threads on ", cores.size(), cores.size() == 1 ? " core (" : " cores (", cpu_list(cores),
                         "): threads wait for each other; give each rank its own cores (mpirun --map-by "
                         "slot:PE=N --bind-to core, srun --cpus-per-task=N --cpu-bind=cores) or fewer --threads");
  }
  return lines;
}

}  // namespace strata::parallel
