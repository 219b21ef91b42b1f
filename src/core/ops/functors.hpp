// Element-wise math, written once. Each functor holds its pointers and scalars and computes
// element i; ops/cpu/elementwise.cpp applies it with a (vectorisable, OpenMP) loop and
// ops/cuda/elementwise.cu with one grid-stride launcher. Keep these free of host-only calls.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/dtype.hpp"
#include "core/rng.hpp"

namespace strata::ops::fn {

struct Fill {
  float* y;
  float value;
  STRATA_HD void operator()(int64_t i) const { y[i] = value; }
};

struct Axpy {  // y += alpha * x
  float alpha;
  const float* x;
  float* y;
  STRATA_HD void operator()(int64_t i) const { y[i] += alpha * x[i]; }
};

struct Scale {  // x *= alpha
  float* x;
  float alpha;
  STRATA_HD void operator()(int64_t i) const { x[i] *= alpha; }
};

struct Add {  // y = a + b
  const float* a;
  const float* b;
  float* y;
  STRATA_HD void operator()(int64_t i) const { y[i] = a[i] + b[i]; }
};

struct ReluForward {
  const float* x;
  float* y;
  STRATA_HD void operator()(int64_t i) const { y[i] = x[i] > 0.0f ? x[i] : 0.0f; }
};

struct ReluBackward {  // y is relu's output: y > 0 exactly where x > 0
  const float* y;
  const float* dy;
  float* dx;
  // Both loads unconditional: a select, not a branch, so the loop vectorises.
  STRATA_HD void operator()(int64_t i) const {
    const float g = dy[i];
    dx[i] = y[i] > 0.0f ? g : 0.0f;
  }
};

// Exact GELU: x * Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2.
constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

struct GeluForward {
  const float* x;
  float* y;
  STRATA_HD void operator()(int64_t i) const {
    const float v = x[i];
    y[i] = 0.5f * v * (1.0f + erff(v * kInvSqrt2));
  }
};

struct GeluBackward {  // d/dx x*Phi(x) = Phi(x) + x * phi(x)
  const float* x;
  const float* dy;
  float* dx;
  STRATA_HD void operator()(int64_t i) const {
    const float v = x[i];
    const float cdf = 0.5f * (1.0f + erff(v * kInvSqrt2));
    const float pdf = kInvSqrt2Pi * expf(-0.5f * v * v);
    dx[i] = dy[i] * (cdf + v * pdf);
  }
};

// Inverted dropout; the mask is recomputed from (key, stream, global element index), so
// backward needs no stored mask. Used for forward (x -> y) and backward (dy -> dx) alike.
struct Dropout {
  const float* x;
  float* y;
  float p;
  float scale;  // 1 / (1 - p), or 0 when p >= 1
  uint64_t key, stream;
  uint64_t first;  // first_sample * sample_numel: the global index of element 0
  STRATA_HD void operator()(int64_t i) const {
    const bool keep = rng::uniform(key, stream, first + static_cast<uint64_t>(i)) >= p;
    const float v = x[i] * scale;
    y[i] = keep ? v : 0.0f;
  }
};

// The dropout functor for x viewed as (samples, ...): element j of sample s has global index
// (first_sample + s) * sample_numel + j, whatever the batch split.
inline Dropout make_dropout(const float* x, float* y, int64_t numel, int64_t samples, float p, uint64_t key,
                            uint64_t stream, int64_t first_sample) {
  const int64_t sample_numel = samples > 0 ? numel / samples : numel;
  return Dropout{
      x, y, p, p < 1.0f ? 1.0f / (1.0f - p) : 0.0f, key, stream, static_cast<uint64_t>(first_sample * sample_numel)};
}

// torch.optim.SGD for one element. The momentum buffer starts at zero, so the first step
// gives buf = (1 - dampening) * d_p: torch's first-step clone(d_p) exactly when dampening == 0
// (torch also ignores dampening on that first step; with dampening > 0 they differ there).
struct SgdScalars {
  float lr, momentum, dampening, weight_decay;
};
// One element; `buf` is its momentum (untouched without momentum). The variants are template
// parameters so that the loop has no per-element branch and vectorises.
template <bool kMomentum, bool kNesterov>
STRATA_HD inline void sgd_step(float& p, float g, float& buf, const SgdScalars& s) {
  float d = g + s.weight_decay * p;
  if constexpr (kMomentum) {
    const float b = s.momentum * buf + (1.0f - s.dampening) * d;
    buf = b;
    d = kNesterov ? d + s.momentum * b : b;
  }
  p -= s.lr * d;
}

// torch.optim.AdamW for one element, in torch's order of operations.
struct AdamWStep {
  float* p;
  const float* g;
  float* m;
  float* v;
  float decay;  // 1 - lr * weight_decay
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;  // computed in double: 1 - 0.999f is not 0.001f
  float step_size;                         // lr / (1 - beta1^t)
  float bc2_sqrt;                          // sqrt(1 - beta2^t)
  float eps;
  STRATA_HD void operator()(int64_t i) const {
    const float gi = g[i];
    const float mi = m[i] * beta1 + one_minus_beta1 * gi;
    const float vi = v[i] * beta2 + one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    p[i] = p[i] * decay - step_size * (mi / denom);
  }
};

// Float conversion to and from the storage types.
template <class T>
STRATA_HD inline float to_f32(T v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return v.to_float();
}
template <class T>
STRATA_HD inline T from_f32(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return T::from_float(v);
}

template <class In, class Out>
struct Cast {
  const In* x;
  Out* y;
  STRATA_HD void operator()(int64_t i) const { y[i] = from_f32<Out>(to_f32(x[i])); }
};

}  // namespace strata::ops::fn
