// bf16 and f16 conversions: exhaustive round trips over all 65536 bit patterns, and float ->
// 16-bit rounding checked against independent oracles (the compiler's _Float16 for f16; a
// nearest-of-two-candidates search in double for bf16).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"

using namespace strata;

namespace {
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t f16_oracle(float f) {
  const _Float16 h = static_cast<_Float16>(f);  // IEEE round-to-nearest-even in libgcc
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
// bf16 by definition: the nearer of the two bf16 neighbours of f, ties to the even one.
uint16_t bf16_oracle(float f) {
  const uint32_t u = bits_of(f);
  if (std::isnan(f)) return 0;  // NaN is checked separately
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  if ((u & 0xffffu) == 0) return lo;
  const uint16_t hi = static_cast<uint16_t>(lo + 1);  // next magnitude up (may be inf)
  const double d_lo = std::fabs(static_cast<double>(f) - float_of(static_cast<uint32_t>(lo) << 16));
  const double d_hi = std::fabs(static_cast<double>(float_of(static_cast<uint32_t>(hi) << 16)) - f);
  if (std::isinf(float_of(static_cast<uint32_t>(hi) << 16))) {
    // Beyond the largest finite bf16: the rounding boundary is max + half an ulp.
    return (u & 0xffffu) >= 0x8000u ? hi : lo;
  }
  if (d_lo != d_hi) return d_lo < d_hi ? lo : hi;
  return (lo & 1) ? hi : lo;
}
std::vector<float> interesting_floats() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          65504.0f,
                          65519.99f,
                          65520.0f,
                          65536.0f,
                          1e-8f,
                          2.9802322e-8f,
                          5.9604645e-8f,
                          6.1035156e-5f,
                          6.097555e-5f,
                          3.0e38f,
                          3.4028235e38f,
                          1.0f + 1.0f / 2048,
                          1.0f + 3.0f / 2048,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::denorm_min()};
  // Every half-way point and its neighbours between consecutive f16 values over the whole range.
  for (uint32_t h = 0; h < 0x7c00u; h += 7) {
    const float a = f16{static_cast<uint16_t>(h)}.to_float(), b = f16{static_cast<uint16_t>(h + 1)}.to_float();
    const float mid = static_cast<float>((static_cast<double>(a) + b) / 2);
    v.insert(v.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f), -mid});
  }
  std::mt19937 gen(123);
  for (int i = 0; i < 200000; ++i) v.push_back(float_of(gen()));
  return v;
}
}  // namespace

TEST(F16, ExhaustiveRoundTripAndValue) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const f16 h{static_cast<uint16_t>(b)};
    const float f = h.to_float();
    _Float16 ref;
    const uint16_t b16 = static_cast<uint16_t>(b);
    std::memcpy(&ref, &b16, 2);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(static_cast<float>(ref))) << std::hex << b;
      EXPECT_TRUE(std::isnan(f16::from_float(f).to_float())) << std::hex << b;
      continue;
    }
    ASSERT_EQ(bits_of(f), bits_of(static_cast<float>(ref))) << std::hex << b;
    ASSERT_EQ(f16::from_float(f).bits, b) << std::hex << b;  // includes subnormals, +-0, +-inf
  }
}

TEST(F16, RoundingMatchesIeee) {
  for (float f : interesting_floats()) {
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16::from_float(f).to_float()));
      continue;
    }
    ASSERT_EQ(f16::from_float(f).bits, f16_oracle(f)) << f << " bits " << std::hex << bits_of(f);
  }
}

TEST(BF16, ExhaustiveRoundTrip) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const bf16 h{static_cast<uint16_t>(b)};
    const float f = h.to_float();
    EXPECT_EQ(bits_of(f), b << 16);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16::from_float(f).to_float())) << std::hex << b;
    } else {
      ASSERT_EQ(bf16::from_float(f).bits, b) << std::hex << b;
    }
  }
}

TEST(BF16, RoundingMatchesNearestEven) {
  for (float f : interesting_floats()) {
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16::from_float(f).to_float()));
      continue;
    }
    ASSERT_EQ(bf16::from_float(f).bits, bf16_oracle(f)) << f << " bits " << std::hex << bits_of(f);
  }
  // Signalling NaN with payload only in the low half must stay NaN.
  EXPECT_TRUE(std::isnan(bf16::from_float(float_of(0x7f800001u)).to_float()));
}

TEST(Precision, ParseAndNameRoundTrip) {
  EXPECT_EQ(parse_precision("fp32"), DType::F32);
  EXPECT_EQ(parse_precision("bf16"), DType::BF16);
  EXPECT_EQ(parse_precision("fp16"), DType::F16);
  for (const char* name : {"fp32", "bf16", "fp16"}) EXPECT_STREQ(precision_name(parse_precision(name)), name);
  EXPECT_STREQ(precision_name(DType::I32), "i32");
  for (const char* bad : {"f32", "FP32", "fp64", ""}) {
    try {
      parse_precision(bad, "--precision");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Input);
      EXPECT_EQ(e.message(), std::string("--precision must be fp32, bf16 or fp16, found '") + bad + "'");
    }
  }
}
