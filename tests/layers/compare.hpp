// Tensor comparison for the oracle tests: a norm-wise relative error and a per-element check,
// plus a record of the worst errors seen, printed when the test program ends.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>

#include "core/tensor.hpp"

namespace strata::testing {

struct Worst {
  double norm_rel = 0;  // ||a - b|| / max(||b||, tiny)
  double elem_abs = 0;  // max |a_i - b_i|
  std::string where_norm, where_elem;
};

inline Worst& worst() {
  static Worst w;
  return w;
}

// Prints the worst errors when the test program ends.
class WorstErrorReporter : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf("[ worst   ] norm-wise relative error %.3e (%s)\n", worst().norm_rel, worst().where_norm.c_str());
    std::printf("[ worst   ] element-wise absolute error %.3e (%s)\n", worst().elem_abs, worst().where_elem.c_str());
  }
};

struct Tolerance {
  double norm_rel;  // bound on ||a - b|| / max(||b||, tiny)
  double elem_rel;  // per element: |a_i - b_i| <= elem_rel * |b_i| + elem_abs_scale * ||b||_inf
  double elem_abs_scale;
};

// Asserts that `actual` matches `expected` (same shape, float32). The per-element check's
// absolute part scales with the tensor's largest element: a float32 result computed as a sum
// carries an absolute error proportional to the size of its terms, not of the result, so an
// element near zero through cancellation cannot be held to a purely relative bound.
inline void expect_close(const std::string& what, const Tensor& actual, const Tensor& expected, const Tolerance& tol) {
  ASSERT_EQ(actual.numel(), expected.numel()) << what << ": " << actual.str() << " vs " << expected.str();
  if (actual.shape() != expected.shape()) {
    // A reference scalar is stored as one element; otherwise the shapes must agree.
    ASSERT_EQ(shape_str(actual.shape()), shape_str(expected.shape())) << what;
  }
  const float* a = actual.data<float>();
  const float* b = expected.data<float>();
  double diff2 = 0, ref2 = 0, ref_inf = 0;
  for (int64_t i = 0; i < actual.numel(); ++i) {
    ASSERT_TRUE(std::isfinite(a[i])) << what << "[" << i << "] = " << a[i];
    const double d = static_cast<double>(a[i]) - b[i];
    diff2 += d * d;
    ref2 += static_cast<double>(b[i]) * b[i];
    ref_inf = std::max(ref_inf, std::abs(static_cast<double>(b[i])));
  }
  const double norm_rel = std::sqrt(diff2) / std::max(std::sqrt(ref2), 1e-30);
  EXPECT_LE(norm_rel, tol.norm_rel) << what << ": norm-wise relative error";
  if (norm_rel > worst().norm_rel) {
    worst().norm_rel = norm_rel;
    worst().where_norm = what;
  }
  int bad = 0;
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - b[i]);
    if (d > worst().elem_abs) {
      worst().elem_abs = d;
      worst().where_elem = what + "[" + std::to_string(i) + "]";
    }
    const double bound = tol.elem_rel * std::abs(static_cast<double>(b[i])) + tol.elem_abs_scale * ref_inf;
    if (d > bound && ++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "]: " << a[i] << " vs reference " << b[i] << " (|diff| " << d << " > "
                    << bound << ")";
  }
  EXPECT_EQ(bad, 0) << what << ": elements out of tolerance";
}

}  // namespace strata::testing
