// Upper bounds of a run's counts (docs/options.md): far above any real run, low
// enough that products such as steps x global batch (the loader's sample positions) stay within
// int64. The options are held to them, and so are the same numbers read back from a checkpoint.
#pragma once

#include <cstdint>

namespace strata::limits {

constexpr int64_t kMaxSteps = int64_t{1} << 36;      // steps and step counts: 6.9e10
constexpr int64_t kMaxEpochs = int64_t{1} << 20;     // 1,048,576
constexpr int64_t kMaxBatch = int64_t{1} << 24;      // samples per step: 16,777,216
constexpr int64_t kMaxModelSize = int64_t{1} << 24;  // a width, depth, hidden size or class count

}  // namespace strata::limits
