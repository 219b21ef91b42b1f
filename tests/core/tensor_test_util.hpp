// Random host tensors and their values in double, for the op tests.
#pragma once

#include <random>
#include <vector>

#include "core/tensor.hpp"

namespace strata::test {

// f32 (shape) with values uniform in [lo, hi), reproducible from `seed`.
inline Tensor rand_tensor(Shape shape, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  Tensor t = Tensor::empty(std::move(shape));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = d(gen);
  return t;
}

inline std::vector<double> values(const Tensor& t) {
  return std::vector<double>(t.data<float>(), t.data<float>() + t.numel());
}

}  // namespace strata::test
