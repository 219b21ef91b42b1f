// Cutting a model's layer list into contiguous pipeline stages.
#pragma once

#include <string>
#include <vector>

#include "layers/model.hpp"

namespace strata::parallel {

struct StageRange {
  size_t begin = 0, end = 0;  // layers [begin, end)
};

// Estimated cost of one layer per sample: forward multiply-adds plus the elements it writes
// (so activations and pooling, which do no multiply-adds, are not free).
int64_t layer_cost(const layers::Model& model, size_t layer);

// The model cut into pp x virtual_stages contiguous stages (virtual stages of the interleaved
// schedule: chunk c of pipeline rank s is stage c·pp + s). `spec` is "balanced" (contiguous
// stages minimising the largest summed layer_cost) or pp·v - 1 increasing cut points "3,7"
// (stage s starts at the s-th cut). Throws an Input error with one line for more stages than
// layers or bad cut points.
std::vector<StageRange> partition_layers(const layers::Model& model, int pp, const std::string& spec,
                                         int virtual_stages = 1);

}  // namespace strata::parallel
