// Softmax's exp (of a non-positive argument), and exact GELU's Phi(x) = (1 + erf(x / sqrt 2)) / 2
// and exp(-x^2 / 2), for the CPU loops, written so that GCC vectorises them: glibc's erff and
// expf are scalar calls, and erff's cost depends on the input (GELU forward + backward of a
// 2048 x 1024 activation on one core: 29 ms for N(0, 0.32^2) inputs, 48 ms for N(0, 1), 87 ms
// for N(0, 9); torch's GELU 13 ms; now 17 ms for any input). Polynomials fitted for this in
// float arithmetic:
// - erf(a) = a P(a^2) for a = |z| < 1 (relative error ~1.5e-7 in float);
// - erfc(a) = exp(-a^2) R(1 / (1 + a / 2)) for a >= 1, a clamped to 4 (erf(4) is 1 in float);
//   Phi of a negative x comes from erfc directly, without the cancellation of 1 + erf(z);
// - exp(-s): s = (k ln 2 + r), |r| <= ln 2 / 2 (Cody-Waite), degree-6 polynomial, times 2^k.
// Over every 7th float in [-30, 30], GELU(x) and its derivative are within 1.4e-7 and 1.8e-7
// of the exact values times max(|x|, 1) (glibc's erff/expf: 1.1e-7 and 1.4e-7), and 98.8% and
// 98.5% of them within 1 ulp of the correctly rounded value (glibc: 98.8% and 98.6%).
// Selects are bit operations (GCC sinks arithmetic into real branches and then, under
// -ftrapping-math, does not vectorise them); no FMA, so the vector and scalar iterations round
// alike and results do not depend on the thread count. Always inlined: into each compiled
// version of a span kernel (cpu_ops.hpp: STRATA_KERNEL_CLONES), so they run at its vector width.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace strata::ops::cpu::vec_math {

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

// For x >= +0 or NaN the int32 patterns order like the values (NaN above every value).
[[gnu::always_inline]] inline bool below(float nonnegative, float bound) {
  return std::bit_cast<int32_t>(nonnegative) < std::bit_cast<int32_t>(bound);
}
[[gnu::always_inline]] inline bool sign_bit(float x) { return std::bit_cast<int32_t>(x) < 0; }
// c ? a : b without a branch.
[[gnu::always_inline]] inline float select(bool c, float a, float b) {
  const int32_t m = -static_cast<int32_t>(c);
  return std::bit_cast<float>((std::bit_cast<int32_t>(a) & m) | (std::bit_cast<int32_t>(b) & ~m));
}

// exp(-s) for s >= 0; 0 where it would leave float's normal range (s >= 87) and for NaN.
[[gnu::always_inline]] inline float exp_neg(float s) {
  const bool in_range = below(s, 87.0f);
  const float y = select(in_range, -s, -87.0f);
  const float kf = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(y / ln 2): 1.5 * 2^23
  const float r = (y - kf * 0.693359375f) - kf * -2.12194440e-4f;           // y - k ln 2, ln 2 in two parts
  float p = 0.0013829411f;
  p = p * r + 0.008374778f;
  p = p * r + 0.04166836f;
  p = p * r + 0.16666421f;
  p = p * r + 0.4999999f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float e = p * std::bit_cast<float>((static_cast<int32_t>(kf) + 127) << 23);  // p 2^k, k in [-126, 0]
  return select(in_range, e, 0.0f);
}

// exp(y) for y <= 0 (softmax's exp(x - max)), NaN for NaN: exp_neg, as fast, but a NaN logit
// still makes its row NaN, as std::exp did (a loss must not hide it).
[[gnu::always_inline]] inline float exp_nonpositive(float y) {
  const float e = exp_neg(-y);
  return select(y == y, e, y);
}

struct GeluTerms {
  float cdf;    // Phi(x)
  float gauss;  // exp(-x^2 / 2); phi(x) = gauss / sqrt(2 pi)
};

[[gnu::always_inline]] inline GeluTerms gelu_terms(float x) {
  const float z = x * kInvSqrt2;
  const float a = std::fabs(z);
  const float s = z * z;
  const float e = exp_neg(s);
  float p = 7.89821e-05f;  // erf(a) / a in a^2, for a < 1
  p = p * s + -0.0008024354f;
  p = p * s + 0.0051900535f;
  p = p * s + -0.02685481f;
  p = p * s + 0.11283612f;
  p = p * s + -0.3761263f;
  p = p * s + 1.1283792f;
  const float erf_small = std::copysign(a * p, z);
  const float t = 1.0f / (1.0f + 0.5f * select(below(a, 4.0f), a, 4.0f));
  float q = -0.060900025f;  // erfc(a) exp(a^2) in t, for a in [1, 4]
  q = q * t + -0.035451833f;
  q = q * t + 0.3770227f;
  q = q * t + 0.118587434f;
  q = q * t + 0.32462308f;
  q = q * t + 0.27479437f;
  q = q * t + 0.00051480695f;
  const float half_erfc = 0.5f * (e * q);  // Phi(-a)
  const float cdf_small = 0.5f * (1.0f + erf_small), cdf_large = select(sign_bit(z), half_erfc, 1.0f - half_erfc);
  return {select(below(a, 1.0f), cdf_small, cdf_large), e};
}

}  // namespace strata::ops::cpu::vec_math
