// What the GPT layers' files (gpt.cpp, gpt_attention.cpp) share: small helpers, not an interface.
#pragma once

#include <string>
#include <vector>

#include "core/error.hpp"
#include "layers/layer.hpp"
#include "layers/tensor_parallel.hpp"

namespace strata::layers::gpt_shared {

// The specs of `child`, named "<prefix>/<name>".
inline void append_specs(std::vector<ParamSpec>& specs, const std::string& prefix, const Layer& child) {
  for (ParamSpec s : child.param_specs()) {
    s.name = prefix + "/" + s.name;
    specs.push_back(std::move(s));
  }
}

// The group if it splits anything (null or one rank: the whole layer, today's code path).
inline TensorParallelGroup* splitting(TensorParallelGroup* tp) {
  return tp != nullptr && tp->size() > 1 ? tp : nullptr;
}

inline void require_sequence(const Layer& layer, const Shape& input, int64_t embed) {
  STRATA_REQUIRE(input.size() == 2 && input[1] == embed, "layer ", layer.name(), " (", layer.describe(),
                 ") expects a sequence [T, ", embed, "], found ", shape_str(input));
}

}  // namespace strata::layers::gpt_shared
