// Counter-based random numbers (Philox-4x32-10, Salmon et al. 2011). A value depends only on
// (key, counter), never on call order, so dropout masks and shuffles are the same whatever
// number of ranks computes them, and the same on host and device.
#pragma once

#include <cstdint>

#include "core/dtype.hpp"

namespace strata::rng {

struct Philox {
  // Four 32-bit outputs for the 128-bit counter (c0..c3) under the 64-bit key.
  STRATA_HD static void generate(uint64_t key, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t out[4]) {
    uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
    for (int round = 0; round < 10; ++round) {
      const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
      const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
      c1 = static_cast<uint32_t>(p1);
      c3 = static_cast<uint32_t>(p0);
      c0 = n0;
      c2 = n2;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
  }
};

// Mixes a seed with a purpose tag (e.g. "dropout", "shuffle") into an independent key.
STRATA_HD inline uint64_t derive_key(uint64_t seed, uint64_t tag) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (tag + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform float in [0, 1) with 24 random bits.
STRATA_HD inline float to_unit_float(uint32_t x) { return static_cast<float>(x >> 8) * (1.0f / 16777216.0f); }

// The i-th uniform value of stream (key, stream): a pure function of its arguments.
STRATA_HD inline float uniform(uint64_t key, uint64_t stream, uint64_t i) {
  uint32_t out[4];
  Philox::generate(key, static_cast<uint32_t>(i >> 2), static_cast<uint32_t>(i >> 34), static_cast<uint32_t>(stream),
                   static_cast<uint32_t>(stream >> 32), out);
  return to_unit_float(out[i & 3]);
}

// The i-th 64-bit random integer of stream (key, stream).
STRATA_HD inline uint64_t bits64(uint64_t key, uint64_t stream, uint64_t i) {
  uint32_t out[4];
  Philox::generate(key, static_cast<uint32_t>(i >> 1), static_cast<uint32_t>(i >> 33), static_cast<uint32_t>(stream),
                   static_cast<uint32_t>(stream >> 32), out);
  const int h = static_cast<int>(i & 1) * 2;
  return (static_cast<uint64_t>(out[h]) << 32) | out[h + 1];
}

// Purpose tags for derive_key: one per consumer, so streams never collide.
enum Tag : uint64_t { kInit = 1, kShuffle = 2, kDropout = 3, kSynthetic = 4, kSample = 5 };

}  // namespace strata::rng
