// Test values for collectives, shared by the MPI and NCCL tests: each rank contributes small
// integers (exact in every dtype, so expected results are computed locally and compared
// exactly), read and written through doubles whatever the dtype.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "core/tensor.hpp"

namespace strata::parallel::testing_values {

inline const DType kAllTypes[] = {DType::F32, DType::BF16, DType::F16, DType::I32, DType::U8};
inline const DType kFloatTypes[] = {DType::F32, DType::BF16, DType::F16};
inline const int64_t kSizes[] = {0, 1, 3, 1000003};

// Rank r's element i: a small integer (exact in bf16, sums of 4 fit in u8), signed when the
// dtype is.
inline double contribution(DType t, int rank, int64_t i) {
  const double v = static_cast<double>((i * 7 + rank * 5) % 17);
  return t == DType::U8 ? v : v - 8.0;
}

inline double get(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::F32:
      return t.data<float>()[i];
    case DType::BF16:
      return t.data<bf16>()[i].to_float();
    case DType::F16:
      return t.data<f16>()[i].to_float();
    case DType::I32:
      return t.data<int32_t>()[i];
    case DType::U8:
      return t.data<uint8_t>()[i];
  }
  return 0;
}

inline void set(const Tensor& t, int64_t i, double v) {
  switch (t.dtype()) {
    case DType::F32:
      t.data<float>()[i] = static_cast<float>(v);
      break;
    case DType::BF16:
      t.data<bf16>()[i] = bf16::from_float(static_cast<float>(v));
      break;
    case DType::F16:
      t.data<f16>()[i] = f16::from_float(static_cast<float>(v));
      break;
    case DType::I32:
      t.data<int32_t>()[i] = static_cast<int32_t>(v);
      break;
    case DType::U8:
      t.data<uint8_t>()[i] = static_cast<uint8_t>(v);
      break;
  }
}

// A host tensor whose element i is contribution(rank, offset + i).
inline Tensor filled(DType type, int64_t n, int rank, int64_t offset = 0) {
  Tensor t = Tensor::empty({n}, type);
  for (int64_t i = 0; i < n; ++i) set(t, i, contribution(type, rank, offset + i));
  return t;
}

// Sum over ranks of contribution(r, offset + i).
inline double reference_sum(DType type, int size, int64_t offset, int64_t i) {
  double s = 0;
  for (int r = 0; r < size; ++r) s += contribution(type, r, offset + i);
  return s;
}

// Mismatches of host tensor t against expected(i), within `tolerance` (NaN is a mismatch);
// reports the first only, so a 1M-element failure does not print 1M lines.
template <class Expected>
int64_t count_wrong(const Tensor& t, Expected expected, double tolerance = 0) {
  int64_t wrong = 0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double want = expected(i), got = get(t, i);
    if (!(std::abs(got - want) <= tolerance)) {
      if (wrong == 0) ADD_FAILURE() << t.str() << "[" << i << "] = " << got << ", expected " << want;
      ++wrong;
    }
  }
  return wrong;
}

}  // namespace strata::parallel::testing_values
