// Philox-4x32-10 against the Random123 known-answer vectors, and the counter-based
// properties the rest of Strata relies on.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "core/rng.hpp"

using namespace strata;

namespace {
struct Kat {
  uint32_t ctr[4];
  uint32_t key[2];
  uint32_t expected[4];
};
// Random123 kat_vectors, "philox4x32 10" lines: counter, key, output.
constexpr Kat kKats[] = {
    {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
     {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
     {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};
}  // namespace

TEST(Philox, KnownAnswerVectors) {
  for (const Kat& k : kKats) {
    const uint64_t key = (static_cast<uint64_t>(k.key[1]) << 32) | k.key[0];
    uint32_t out[4];
    rng::Philox::generate(key, k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3], out);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], k.expected[i]) << "word " << i;
  }
}

TEST(Philox, ValuesDependOnlyOnTheirArguments) {
  const uint64_t key = rng::derive_key(42, rng::kDropout);
  std::vector<float> forward, backward;
  for (uint64_t i = 0; i < 1000; ++i) forward.push_back(rng::uniform(key, 7, i));
  for (uint64_t i = 1000; i-- > 0;) backward.push_back(rng::uniform(key, 7, i));
  for (size_t i = 0; i < 1000; ++i) EXPECT_EQ(forward[i], backward[999 - i]);
  // Streams and keys are independent.
  EXPECT_NE(rng::uniform(key, 7, 3), rng::uniform(key, 8, 3));
  EXPECT_NE(rng::derive_key(42, rng::kDropout), rng::derive_key(42, rng::kShuffle));
  EXPECT_NE(rng::derive_key(42, rng::kDropout), rng::derive_key(43, rng::kDropout));
}

TEST(Philox, UniformIsInUnitIntervalWithTheRightMean) {
  const uint64_t key = rng::derive_key(1, rng::kSynthetic);
  double sum = 0.0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const float u = rng::uniform(key, 0, static_cast<uint64_t>(i));
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);  // 5 sigma is ~0.0046
  EXPECT_EQ(rng::to_unit_float(0xffffffffu), 16777215.0f / 16777216.0f);
}

TEST(Philox, Bits64CoversBothWords) {
  std::set<uint64_t> seen;
  for (uint64_t i = 0; i < 1000; ++i) seen.insert(rng::bits64(5, 0, i));
  EXPECT_EQ(seen.size(), 1000u);
}
