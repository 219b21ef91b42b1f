// Parity of the causal attention ops with PyTorch: tests/core/py/attention_oracle.py writes
// random inputs and torch's scaled dot-product attention of them (float64 reference: y, the
// row log-sum-exp and the gradients of sum(y * dy)); both implementations here must match
// within 1e-5 of each tensor's largest magnitude. The file is STRATA_ATTENTION_ORACLE (set by
// CTest, which runs the script first as the fixture attention_oracle).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/ops.hpp"

using namespace strata;

namespace {

std::vector<char> read_oracle() {
  const char* path = std::getenv("STRATA_ATTENTION_ORACLE");
  if (path == nullptr) return {};
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

struct Reader {
  const std::vector<char>& data;
  size_t at = 0;
  template <class T>
  T scalar() {
    T v;
    EXPECT_LE(at + sizeof(T), data.size());
    std::memcpy(&v, data.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  Tensor tensor(const Shape& shape) {
    Tensor t = Tensor::empty(shape);
    EXPECT_LE(at + t.nbytes(), data.size());
    std::memcpy(t.raw(), data.data() + at, t.nbytes());
    at += t.nbytes();
    return t;
  }
};

double rel_diff(const Tensor& got, const Tensor& want) {
  double scale = 1e-30, diff = 0.0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(want.data<float>()[i])));
    diff = std::max(diff, std::fabs(static_cast<double>(got.data<float>()[i]) - want.data<float>()[i]));
  }
  return diff / std::max(scale, 1e-2);  // dq, dk are all zero at T = 1: compare absolutely there
}

}  // namespace

TEST(AttentionParity, MatchesPyTorch) {
  const std::vector<char> data = read_oracle();
  if (data.empty()) GTEST_SKIP() << "no oracle file: run through CTest (STRATA_ATTENTION_ORACLE)";
  ASSERT_GE(data.size(), 12u);
  ASSERT_EQ(std::string(data.data(), 8), "STRATT01");
  Reader r{data, 8};
  const int32_t cases = r.scalar<int32_t>();
  ASSERT_GT(cases, 0);
  for (int32_t c = 0; c < cases; ++c) {
    const int64_t b = r.scalar<int32_t>(), h = r.scalar<int32_t>(), t = r.scalar<int32_t>(), dh = r.scalar<int32_t>();
    const Shape s{b, h, t, dh};
    SCOPED_TRACE("B=" + std::to_string(b) + " H=" + std::to_string(h) + " T=" + std::to_string(t) +
                 " Dh=" + std::to_string(dh));
    const Tensor q = r.tensor(s), k = r.tensor(s), v = r.tensor(s), dy = r.tensor(s);
    const Tensor y_ref = r.tensor(s), dq_ref = r.tensor(s), dk_ref = r.tensor(s), dv_ref = r.tensor(s);
    const Tensor lse_ref = r.tensor({b, h, t});
    for (const bool flash : {false, true}) {
      SCOPED_TRACE(flash ? "flash" : "plain");
      Tensor y = Tensor::empty(s), dq = Tensor::empty(s), dk = Tensor::empty(s), dv = Tensor::empty(s);
      if (flash) {
        Tensor lse = Tensor::empty({b, h, t});
        ops::flash_attention_forward(q, k, v, y, lse);
        ops::flash_attention_backward(q, k, v, y, lse, dy, dq, dk, dv);
        EXPECT_LT(rel_diff(lse, lse_ref), 1e-5);
      } else {
        Tensor probs = Tensor::empty({b, h, t, t});
        ops::attention_forward(q, k, v, y, probs);
        ops::attention_backward(q, k, v, probs, dy, dq, dk, dv);
      }
      EXPECT_LT(rel_diff(y, y_ref), 1e-5);
      EXPECT_LT(rel_diff(dq, dq_ref), 1e-5);
      EXPECT_LT(rel_diff(dk, dk_ref), 1e-5);
      EXPECT_LT(rel_diff(dv, dv_ref), 1e-5);
      std::printf("%s B=%lld H=%lld T=%lld Dh=%lld vs torch: y %.2e dq %.2e dk %.2e dv %.2e\n",
                  flash ? "flash" : "plain", static_cast<long long>(b), static_cast<long long>(h),
                  static_cast<long long>(t), static_cast<long long>(dh), rel_diff(y, y_ref), rel_diff(dq, dq_ref),
                  rel_diff(dk, dk_ref), rel_diff(dv, dv_ref));
    }
  }
  EXPECT_EQ(r.at, data.size());
}
