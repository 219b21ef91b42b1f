// Element-wise math, written once. Each functor holds its pointers and scalars and computes
// element i (or element (r, j) of a (rows, cols) view); ops/cpu/*.cpp applies it with a
// (vectorisable, OpenMP) loop and ops/cuda/*.cu with one grid-stride launcher. Functors are
// templates over the storage type T (float, bf16, f16) and compute in float: to_f32 widens,
// from_f32 rounds to nearest even. For float both are the identity, so the CPU loops (float
// only) compile to what they were before. Keep the functors free of host-only calls (the
// make_* helpers build them on the host).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/dtype.hpp"
#include "core/ops.hpp"
#include "core/rng.hpp"

namespace strata::ops::fn {

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

template <class T>
struct Fill {
  T* y;
  T value;  // already rounded to T
  STRATA_HD void operator()(int64_t i) const { y[i] = value; }
};

template <class X, class Y>
struct Axpy {  // y += alpha * x; x and y may differ in dtype (low-precision x into f32 y)
  float alpha;
  const X* x;
  Y* y;
  STRATA_HD void operator()(int64_t i) const { y[i] = from_f32<Y>(to_f32(y[i]) + alpha * to_f32(x[i])); }
};

template <class T>
struct Scale {  // x *= alpha
  T* x;
  float alpha;
  STRATA_HD void operator()(int64_t i) const { x[i] = from_f32<T>(to_f32(x[i]) * alpha); }
};

template <class T>
struct Add {  // y = a + b
  const T* a;
  const T* b;
  T* y;
  STRATA_HD void operator()(int64_t i) const { y[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i])); }
};

template <class In, class Out>
struct Cast {
  const In* x;
  Out* y;
  STRATA_HD void operator()(int64_t i) const { y[i] = from_f32<Out>(to_f32(x[i])); }
};

// u8 pixels of one channel to float: y = (x * in_scale - mean) / std, computed as x * a + b.
template <class T>
struct NormalizeU8 {
  const uint8_t* x;
  T* y;
  float a, b;  // in_scale / std, -mean / std
  STRATA_HD void operator()(int64_t i) const { y[i] = from_f32<T>(static_cast<float>(x[i]) * a + b); }
};
template <class T>
inline NormalizeU8<T> make_normalize_u8(const uint8_t* x, T* y, float in_scale, float mean, float std) {
  return NormalizeU8<T>{x, y, in_scale / std, -mean / std};
}

// ---- activations -----------------------------------------------------------------------------

template <class T>
struct ReluForward {
  const T* x;
  T* y;
  STRATA_HD void operator()(int64_t i) const {
    const float v = to_f32(x[i]);
    y[i] = from_f32<T>(v <= 0.0f ? 0.0f : v);  // NaN stays NaN, as in torch: divergence must show
  }
};

template <class T>
struct ReluBackward {  // y is relu's output: y > 0 exactly where x > 0
  const T* y;
  const T* dy;
  T* dx;
  // Both loads unconditional: a select, not a branch, so the loop vectorises.
  STRATA_HD void operator()(int64_t i) const {
    const float g = to_f32(dy[i]);
    dx[i] = from_f32<T>(to_f32(y[i]) > 0.0f ? g : 0.0f);
  }
};

// Exact GELU: x * Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2. The GPU's kernels; the CPU's
// loops compute erf and exp with vectorisable polynomials instead (ops/cpu/vec_math.hpp).
constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

template <class T>
struct GeluForward {
  const T* x;
  T* y;
  STRATA_HD void operator()(int64_t i) const {
    const float v = to_f32(x[i]);
    y[i] = from_f32<T>(0.5f * v * (1.0f + erff(v * kInvSqrt2)));
  }
};

template <class T>
struct GeluBackward {  // d/dx x*Phi(x) = Phi(x) + x * phi(x)
  const T* x;
  const T* dy;
  T* dx;
  STRATA_HD void operator()(int64_t i) const {
    const float v = to_f32(x[i]);
    const float cdf = 0.5f * (1.0f + erff(v * kInvSqrt2));
    const float pdf = kInvSqrt2Pi * expf(-0.5f * v * v);
    dx[i] = from_f32<T>(to_f32(dy[i]) * (cdf + v * pdf));
  }
};

// GELU's tanh approximation (Hendrycks & Gimpel; GPT-2's and Hugging Face's "gelu_new"):
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in float like torch's. One functor for the
// CPU loop and the CUDA launcher.
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kGeluTanhCubic = 0.044715f;

template <class T>
struct GeluTanhForward {
  const T* x;
  T* y;
  STRATA_HD void operator()(int64_t i) const {
    const float v = to_f32(x[i]);
    y[i] = from_f32<T>(0.5f * v * (1.0f + tanhf(kSqrt2OverPi * (v + kGeluTanhCubic * v * v * v))));
  }
};

template <class T>
struct GeluTanhBackward {  // d/dx = (1 + t) / 2 + x (1 - t^2) / 2 * sqrt(2/pi) (1 + 3 * 0.044715 x^2)
  const T* x;
  const T* dy;
  T* dx;
  STRATA_HD void operator()(int64_t i) const {
    const float v = to_f32(x[i]);
    const float t = tanhf(kSqrt2OverPi * (v + kGeluTanhCubic * v * v * v));
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluTanhCubic * v * v);
    dx[i] = from_f32<T>(to_f32(dy[i]) * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du));
  }
};

// Inverted dropout; the mask is recomputed from (key, stream, global element index), so
// backward needs no stored mask, and host and device draw the same mask. Used for forward
// (x -> y) and backward (dy -> dx) alike.
template <class T>
struct Dropout {
  const T* x;
  T* y;
  float p;
  float scale;  // 1 / (1 - p), or 0 when p >= 1
  uint64_t key, stream;
  uint64_t first;       // first_sample * whole + offset: the global index of element 0
  int64_t part, whole;  // elements of a sample in x, and in the whole sample (equal: whole samples)
  STRATA_HD void operator()(int64_t i) const {
    const int64_t global = part == whole ? i : i / part * whole + i % part;
    const bool keep = rng::uniform(key, stream, first + static_cast<uint64_t>(global)) >= p;
    const float v = to_f32(x[i]) * scale;
    y[i] = from_f32<T>(keep ? v : 0.0f);
  }
};

// The dropout functor for x viewed as (samples, ...): element j of sample s has global index
// (first_sample + s) * sample_numel + j, whatever the batch split; of a sample's part (x holds
// elements [part_offset, part_offset + numel / samples) of each sample of sample_numel), its
// element j is the whole sample's part_offset + j.
template <class T>
inline Dropout<T> make_dropout(const T* x, T* y, int64_t numel, int64_t samples, float p, uint64_t key, uint64_t stream,
                               int64_t first_sample, int64_t sample_numel = 0, int64_t part_offset = 0) {
  const int64_t part = samples > 0 ? numel / samples : numel;
  const int64_t whole = sample_numel > 0 ? sample_numel : part;
  return Dropout<T>{x,
                    y,
                    p,
                    p < 1.0f ? 1.0f / (1.0f - p) : 0.0f,
                    key,
                    stream,
                    static_cast<uint64_t>(first_sample * whole + part_offset),
                    part > 0 ? part : 1,
                    part > 0 ? whole : 1};
}

// ---- dense, over (rows, cols) ----------------------------------------------------------------

template <class T>
struct AddBias {  // y (rows, cols) += bias (cols)
  T* y;
  const T* bias;
  int64_t cols;
  STRATA_HD void operator()(int64_t r, int64_t j) const {
    T& out = y[r * cols + j];
    out = from_f32<T>(to_f32(out) + to_f32(bias[j]));
  }
};

// ---- loss ------------------------------------------------------------------------------------

// -log softmax(x)[label] of a row from its max and its sum of exp(x - max), in double.
STRATA_HD inline double xent_loss(float sum_exp, float x_label, float max) {
  return log(static_cast<double>(sum_exp)) - (static_cast<double>(x_label) - max);
}

// dlogits (rows, cols) = (probs - onehot(labels)) * scale: probs * scale, minus scale at the
// label (a label outside [0, cols) subtracts nothing; the forward pass reports it).
template <class P, class D>
struct SoftmaxXentBackward {
  const P* probs;
  const int32_t* labels;
  D* dlogits;
  int64_t cols;
  int64_t first;  // the class of column 0 (a vocabulary-parallel slice's first)
  float scale;
  STRATA_HD void operator()(int64_t r, int64_t j) const {
    const int64_t i = r * cols + j;
    float d = to_f32(probs[i]) * scale;
    if (first + j == labels[r]) d -= scale;
    dlogits[i] = from_f32<D>(d);
  }
};

// ---- normalisation ---------------------------------------------------------------------------

// 1 / sqrt(var + eps) from a row's sum of squared deviations over n values, in double.
STRATA_HD inline float rstd_from_sq(double sq, int64_t n, float eps) {
  return static_cast<float>(1.0 / sqrt(sq / static_cast<double>(n) + eps));
}

// Layer norm for one element: xhat = (x - mean) * rstd, y = xhat * gamma + beta.
STRATA_HD inline float layer_norm_xhat(float x, float mean, float rstd) { return (x - mean) * rstd; }

// Layer norm's dx for one element: rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),
// dxhat = dy * gamma.
STRATA_HD inline float layer_norm_dx(float dxhat, float xhat, float rstd, float mean_g, float mean_gx) {
  return rstd * (dxhat - mean_g - xhat * mean_gx);
}

// ---- optimizers ------------------------------------------------------------------------------

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

// sgd_step over flat buffers (buf is null without momentum).
template <bool kMomentum, bool kNesterov>
struct SgdStep {
  float* p;
  const float* g;
  float* buf;
  SgdScalars s;
  STRATA_HD void operator()(int64_t i) const {
    float unused = 0.0f;  // stands in for buf[i] without momentum; never written then
    sgd_step<kMomentum, kNesterov>(p[i], g[i], kMomentum ? buf[i] : unused, s);
  }
};

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

// The AdamW functor for hp.step (1-based); bias corrections in double, as torch computes them
// in Python.
inline AdamWStep make_adamw_step(float* p, const float* g, float* m, float* v, const AdamWParams& hp) {
  const double t = static_cast<double>(hp.step);
  const double bc1 = 1.0 - std::pow(hp.beta1, t);
  const double bc2 = 1.0 - std::pow(hp.beta2, t);
  return AdamWStep{p,
                   g,
                   m,
                   v,
                   1.0f - hp.lr * hp.weight_decay,
                   static_cast<float>(hp.beta1),
                   static_cast<float>(hp.beta2),
                   static_cast<float>(1.0 - hp.beta1),
                   static_cast<float>(1.0 - hp.beta2),
                   static_cast<float>(hp.lr / bc1),
                   static_cast<float>(std::sqrt(bc2)),
                   hp.eps};
}

}  // namespace strata::ops::fn
