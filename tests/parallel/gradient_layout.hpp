// The flat layout the gradient tests cut up (test_bucket_reducer, test_gradient_ring): layers
// 1, 3, 4, 5 have parameters (0, 2 have none), with alignment gaps after layers 1 and 4, padded
// to 464 elements: extents [0, 112), [112, 400), [400, 416), [416, 464).
#pragma once

#include <cstdint>
#include <vector>

#include "layers/model.hpp"
#include "layers/parameter_store.hpp"

namespace strata::parallel::testing_layout {

using Ranges = std::vector<layers::ParameterStore::LayerRange>;

inline const Ranges kRanges = {{1, 0, 100}, {3, 112, 400}, {4, 400, 410}, {5, 416, 420}};
constexpr int64_t kFlat = 464;
constexpr int64_t kBucketBytes = 64 * 4;  // 64 elements

}  // namespace strata::parallel::testing_layout
