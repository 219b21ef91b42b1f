#include "parallel/pipeline/partition.hpp"

#include <algorithm>
#include <limits>
#include <sstream>

namespace strata::parallel {

int64_t layer_cost(const layers::Model& model, size_t layer) {
  return model.layer(layer).flops(model.shape(layer)) + shape_numel(model.shape(layer + 1));
}

namespace {

std::vector<StageRange> balanced(const layers::Model& model, int stages) {
  const size_t n = model.size();
  std::vector<int64_t> prefix(n + 1, 0);
  for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + layer_cost(model, i);
  // best[s][i]: the smallest possible largest-stage cost of layers [0, i) in s stages.
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  const size_t p = static_cast<size_t>(stages);
  std::vector<std::vector<int64_t>> best(p + 1, std::vector<int64_t>(n + 1, kInf));
  std::vector<std::vector<size_t>> cut(p + 1, std::vector<size_t>(n + 1, 0));
  best[0][0] = 0;
  for (size_t s = 1; s <= p; ++s)
    for (size_t i = s; i <= n; ++i)
      for (size_t j = s - 1; j < i; ++j) {  // the last stage is [j, i), non-empty
        if (best[s - 1][j] == kInf) continue;
        const int64_t cost = std::max(best[s - 1][j], prefix[i] - prefix[j]);
        if (cost < best[s][i]) {
          best[s][i] = cost;
          cut[s][i] = j;
        }
      }
  std::vector<StageRange> ranges(p);
  size_t end = n;
  for (size_t s = p; s >= 1; --s) {
    ranges[s - 1] = {cut[s][end], end};
    end = cut[s][end];
  }
  return ranges;
}

std::vector<StageRange> cut(const layers::Model& model, int pp, int virtual_stages, const std::string& spec) {
  const size_t n = model.size();
  STRATA_REQUIRE(pp >= 1, "--pp must be at least 1, found ", pp);
  STRATA_REQUIRE(virtual_stages >= 1, "--virtual-stages must be at least 1, found ", virtual_stages);
  const int stages = pp * virtual_stages;
  // "--pp 4", or "--pp 2 x --virtual-stages 3 (6 stages)".
  const std::string flags =
      virtual_stages == 1 ? detail::cat("--pp ", pp)
                          : detail::cat("--pp ", pp, " x --virtual-stages ", virtual_stages, " (", stages, " stages)");
  STRATA_REQUIRE(static_cast<size_t>(stages) <= n, flags, " needs at least ", stages, " layers, but the model has ", n);
  if (spec == "balanced") return balanced(model, stages);

  std::vector<size_t> cuts;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    STRATA_REQUIRE(used == item.size() && v > 0 && static_cast<size_t>(v) < n,
                   "--partition cut points must be layer indices in 1..", n - 1, " (or 'balanced'), found '", item,
                   "' in '", spec, "'");
    STRATA_REQUIRE(cuts.empty() || static_cast<size_t>(v) > cuts.back(),
                   "--partition cut points must increase, found '", spec, "'");
    cuts.push_back(static_cast<size_t>(v));
  }
  STRATA_REQUIRE(cuts.size() + 1 == static_cast<size_t>(stages), "--partition '", spec, "' makes ", cuts.size() + 1,
                 " stages but ",
                 virtual_stages == 1 ? detail::cat("--pp is ", pp) : detail::cat(flags, " needs ", stages), " (give ",
                 stages - 1, " cut points or 'balanced')");
  std::vector<StageRange> ranges;
  size_t begin = 0;
  for (size_t c : cuts) {
    ranges.push_back({begin, c});
    begin = c;
  }
  ranges.push_back({begin, n});
  return ranges;
}

}  // namespace

std::vector<StageRange> partition_layers(const layers::Model& model, int pp, const std::string& spec,
                                         int virtual_stages) {
  return cut(model, pp, virtual_stages, spec);
}

}  // namespace strata::parallel
