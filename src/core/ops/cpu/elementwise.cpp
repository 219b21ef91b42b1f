// CPU element-wise ops: the functors of ops/functors.hpp applied by parallel_for (GELU: its own
// vectorisable loops, vec_math.hpp, on f32 or bf16), plus casts and u8 image normalisation.
#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/ops/cpu/cpu_ops.hpp"
#include "core/ops/cpu/vec_math.hpp"
#include "core/ops/functors.hpp"

namespace strata::ops::cpu {

void fill(const Tensor& x, float value) { parallel_for(x.numel(), fn::Fill<float>{x.data<float>(), value}); }

void scale(const Tensor& x, float alpha) { parallel_for(x.numel(), fn::Scale<float>{x.data<float>(), alpha}); }

// The two casts of every bf16 op's f32 staging, at the CPU's vector width: the same bit
// operations as bf16's own (dtype.hpp), on every lane.
namespace {

[[gnu::always_inline]] inline void widen_bf16(const bf16* in, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = in[i].to_float();
}

[[gnu::always_inline]] inline void round_to_bf16(const float* in, bf16* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = bf16::from_float(in[i]);
}

STRATA_KERNEL_CLONES void widen_bf16_span(const bf16* in, float* out, int64_t n) { widen_bf16(in, out, n); }
STRATA_KERNEL_CLONES void round_to_bf16_span(const float* in, bf16* out, int64_t n) { round_to_bf16(in, out, n); }

// Exact GELU with vec_math.hpp's vectorisable erf and exp (the CUDA kernels keep the
// functors, which call erff and expf), compiled per vector width (STRATA_KERNEL_CLONES).
[[gnu::always_inline]] inline void gelu_forward_f32(const float* in, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = in[i] * vec_math::gelu_terms(in[i]).cdf;
}

// d/dx x Phi(x) = Phi(x) + x phi(x)
[[gnu::always_inline]] inline void gelu_backward_f32(const float* in, const float* g, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const vec_math::GeluTerms t = vec_math::gelu_terms(in[i]);
    out[i] = g[i] * (t.cdf + in[i] * (vec_math::kInvSqrt2Pi * t.gauss));
  }
}

// bf16 spans are staged in f32 a block at a time, in buffers that stay in L1: the bits of
// staging whole tensors, in one pass over memory instead of three.
constexpr int64_t kStagingBlock = 512;

// Widens a block of a (and of b, unless null) into f32, runs the f32 computation f(a, b, y, len)
// on the blocks and rounds its y into out. Always inlined, and each f with it (f is declared
// always_inline), so that f's loop is compiled in the calling target_clones version, at its
// vector width: a call to f would run baseline code.
template <class F>
[[gnu::always_inline]] inline void staged(const bf16* a, const bf16* b, bf16* out, int64_t n, F f) {
  float fa[kStagingBlock], fb[kStagingBlock], fy[kStagingBlock];
  for (int64_t lo = 0; lo < n; lo += kStagingBlock) {
    const int64_t len = std::min(kStagingBlock, n - lo);
    widen_bf16(a + lo, fa, len);
    if (b != nullptr) widen_bf16(b + lo, fb, len);
    f(fa, fb, fy, len);
    round_to_bf16(fy, out + lo, len);
  }
}

STRATA_KERNEL_CLONES void gelu_forward_span(const float* in, float* out, int64_t n) { gelu_forward_f32(in, out, n); }

STRATA_KERNEL_CLONES void gelu_forward_span(const bf16* in, bf16* out, int64_t n) {
  staged(
      in, nullptr, out, n, [](const float* x, const float*, float* y, int64_t len) __attribute__((always_inline)) {
        gelu_forward_f32(x, y, len);
      });
}

STRATA_KERNEL_CLONES void gelu_backward_span(const float* in, const float* g, float* out, int64_t n) {
  gelu_backward_f32(in, g, out, n);
}

STRATA_KERNEL_CLONES void gelu_backward_span(const bf16* in, const bf16* g, bf16* out, int64_t n) {
  staged(
      in, g, out, n, [](const float* x, const float* dy, float* dx, int64_t len) __attribute__((always_inline)) {
        gelu_backward_f32(x, dy, dx, len);
      });
}

template <class T>
void gelu_forward_as(const Tensor& x, const Tensor& y) {
  const T* in = x.data<T>();
  T* out = y.data<T>();
  parallel_spans(x.numel(), [&](int64_t lo, int64_t hi) { gelu_forward_span(in + lo, out + lo, hi - lo); });
}

template <class T>
void gelu_backward_as(const Tensor& x, const Tensor& dy, const Tensor& dx) {
  const T* in = x.data<T>();
  const T* g = dy.data<T>();
  T* out = dx.data<T>();
  parallel_spans(x.numel(), [&](int64_t lo, int64_t hi) { gelu_backward_span(in + lo, g + lo, out + lo, hi - lo); });
}

// The residual adds and gradient accumulations of a bf16 model, staged: the bits of the f32
// functors (fn::Add, fn::Axpy) on the widened values.
STRATA_KERNEL_CLONES void add_span(const bf16* a, const bf16* b, bf16* y, int64_t n) {
  staged(
      a, b, y, n, [](const float* fa, const float* fb, float* fy, int64_t len) __attribute__((always_inline)) {
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) fy[i] = fa[i] + fb[i];
      });
}

// y += alpha * x for bf16 x into a bf16 or an f32 y (a bf16 gradient into f32 accumulation).
STRATA_KERNEL_CLONES void axpy_span(float alpha, const bf16* x, bf16* y, int64_t n) {
  staged(
      x, y, y, n, [alpha](const float* fx, const float* fy, float* sum, int64_t len) __attribute__((always_inline)) {
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) sum[i] = fy[i] + alpha * fx[i];
      });
}

STRATA_KERNEL_CLONES void axpy_span(float alpha, const bf16* x, float* y, int64_t n) {
  float fx[kStagingBlock];
  for (int64_t lo = 0; lo < n; lo += kStagingBlock) {
    const int64_t len = std::min(kStagingBlock, n - lo);
    widen_bf16(x + lo, fx, len);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) y[lo + i] += alpha * fx[i];
  }
}

// ReLU of a bf16 model, staged: the f32 functors' bits (fn::ReluForward, fn::ReluBackward) on
// the widened values.
STRATA_KERNEL_CLONES void relu_forward_span(const bf16* x, bf16* y, int64_t n) {
  staged(
      x, nullptr, y, n, [](const float* f, const float*, float* r, int64_t len) __attribute__((always_inline)) {
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) r[i] = f[i] <= 0.0f ? 0.0f : f[i];  // NaN stays NaN
      });
}

STRATA_KERNEL_CLONES void relu_backward_span(const bf16* y, const bf16* dy, bf16* dx, int64_t n) {
  staged(
      y, dy, dx, n, [](const float* fy, const float* g, float* r, int64_t len) __attribute__((always_inline)) {
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) r[i] = fy[i] > 0.0f ? g[i] : 0.0f;
      });
}

}  // namespace

std::string kernel_isa() {
#if STRATA_HAS_KERNEL_CLONES
  __builtin_cpu_init();  // the predicates of target_clones' resolver
  return __builtin_cpu_supports("avx512f") ? "AVX-512" : __builtin_cpu_supports("avx2") ? "AVX2" : "SSE2";
#else
  return "the build's target (one version)";
#endif
}

void relu_forward(const Tensor& x, const Tensor& y) {
  if (x.dtype() == DType::F32) return parallel_for(x.numel(), fn::ReluForward<float>{x.data<float>(), y.data<float>()});
  const bf16* in = x.data<bf16>();
  bf16* out = y.data<bf16>();
  parallel_spans(x.numel(), [&](int64_t lo, int64_t hi) { relu_forward_span(in + lo, out + lo, hi - lo); });
}

void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) {
  if (y.dtype() == DType::F32)
    return parallel_for(y.numel(), fn::ReluBackward<float>{y.data<float>(), dy.data<float>(), dx.data<float>()});
  const bf16* py = y.data<bf16>();
  const bf16* g = dy.data<bf16>();
  bf16* out = dx.data<bf16>();
  parallel_spans(y.numel(), [&](int64_t lo, int64_t hi) { relu_backward_span(py + lo, g + lo, out + lo, hi - lo); });
}

bool axpy_takes(DType x, DType y) { return y == DType::F32 ? x != DType::F16 : x == DType::BF16 && y == DType::BF16; }

void axpy(float alpha, const Tensor& x, const Tensor& y) {
  if (x.dtype() == DType::F32)
    return parallel_for(x.numel(), fn::Axpy<float, float>{alpha, x.data<float>(), y.data<float>()});
  const bf16* in = x.data<bf16>();
  if (y.dtype() == DType::F32) {
    float* out = y.data<float>();
    return parallel_spans(x.numel(), [&](int64_t lo, int64_t hi) { axpy_span(alpha, in + lo, out + lo, hi - lo); });
  }
  bf16* out = y.data<bf16>();
  parallel_spans(x.numel(), [&](int64_t lo, int64_t hi) { axpy_span(alpha, in + lo, out + lo, hi - lo); });
}

void add(const Tensor& a, const Tensor& b, const Tensor& y) {
  if (y.dtype() == DType::F32)
    return parallel_for(y.numel(), fn::Add<float>{a.data<float>(), b.data<float>(), y.data<float>()});
  const bf16* pa = a.data<bf16>();
  const bf16* pb = b.data<bf16>();
  bf16* out = y.data<bf16>();
  parallel_spans(y.numel(), [&](int64_t lo, int64_t hi) { add_span(pa + lo, pb + lo, out + lo, hi - lo); });
}

void gelu_forward(const Tensor& x, const Tensor& y) {
  if (x.dtype() == DType::BF16) return gelu_forward_as<bf16>(x, y);
  gelu_forward_as<float>(x, y);
}

void gelu_backward(const Tensor& x, const Tensor& dy, const Tensor& dx) {
  if (x.dtype() == DType::BF16) return gelu_backward_as<bf16>(x, dy, dx);
  gelu_backward_as<float>(x, dy, dx);
}

void gelu_tanh_forward(const Tensor& x, const Tensor& y) {
  parallel_for(x.numel(), fn::GeluTanhForward<float>{x.data<float>(), y.data<float>()});
}

void gelu_tanh_backward(const Tensor& x, const Tensor& dy, const Tensor& dx) {
  parallel_for(x.numel(), fn::GeluTanhBackward<float>{x.data<float>(), dy.data<float>(), dx.data<float>()});
}

namespace {
fn::Dropout<float> dropout_functor(const Tensor& x, const Tensor& y, float p, const DropoutKey& key) {
  return fn::make_dropout(x.data<float>(), y.data<float>(), x.numel(), x.dim(0), p, key.key, key.stream,
                          key.first_sample, key.sample_numel, key.part_offset);
}

template <class In, class Out>
void cast_loop(const void* in, void* out, int64_t n) {
  const fn::Cast<In, Out> f{static_cast<const In*>(in), static_cast<Out*>(out)};
  for (int64_t i = 0; i < n; ++i) f(i);
}

template <class In>
void cast_span_from(const void* in, void* out, DType to, int64_t n) {
  switch (to) {
    case DType::F32:
      if constexpr (std::is_same_v<In, bf16>)
        return widen_bf16_span(static_cast<const bf16*>(in), static_cast<float*>(out), n);
      return cast_loop<In, float>(in, out, n);
    case DType::BF16:
      if constexpr (std::is_same_v<In, float>)
        return round_to_bf16_span(static_cast<const float*>(in), static_cast<bf16*>(out), n);
      return cast_loop<In, bf16>(in, out, n);
    case DType::F16:
      return cast_loop<In, f16>(in, out, n);
    default:
      STRATA_THROW("cast to ", dtype_name(to), " is not supported");
  }
}
}  // namespace

void dropout_forward(const Tensor& x, const Tensor& y, float p, const DropoutKey& key) {
  parallel_for(x.numel(), dropout_functor(x, y, p, key));
}

// The same mask scales the incoming gradient.
void dropout_backward(const Tensor& dy, const Tensor& dx, float p, const DropoutKey& key) {
  parallel_for(dy.numel(), dropout_functor(dy, dx, p, key));
}

void cast_span(const void* in, DType from, void* out, DType to, int64_t n) {
  if (from == to) {
    if (n > 0 && in != out) std::memcpy(out, in, static_cast<size_t>(n) * dtype_size(from));
    return;
  }
  switch (from) {
    case DType::F32:
      return cast_span_from<float>(in, out, to, n);
    case DType::BF16:
      return cast_span_from<bf16>(in, out, to, n);
    case DType::F16:
      return cast_span_from<f16>(in, out, to, n);
    default:
      STRATA_THROW("cast from ", dtype_name(from), " is not supported");
  }
}

void cast(const Tensor& x, const Tensor& y) {
  const auto* in = static_cast<const char*>(x.raw());
  auto* out = static_cast<char*>(y.raw());
  const int64_t in_size = static_cast<int64_t>(dtype_size(x.dtype())),
                out_size = static_cast<int64_t>(dtype_size(y.dtype()));
  parallel_spans(x.numel(), [&](int64_t lo, int64_t hi) {
    cast_span(in + lo * in_size, x.dtype(), out + lo * out_size, y.dtype(), hi - lo);
  });
}

const float* f32_row(const Tensor& t, int64_t first, int64_t n, std::vector<float>& scratch) {
  if (t.dtype() == DType::F32) return t.data<float>() + first;
  scratch.resize(static_cast<size_t>(n));
  cast_span(static_cast<const char*>(t.raw()) + first * static_cast<int64_t>(dtype_size(t.dtype())), t.dtype(),
            scratch.data(), DType::F32, n);
  return scratch.data();
}

float* f32_inout_row(const Tensor& t, int64_t first, int64_t n, std::vector<float>& scratch) {
  return const_cast<float*>(f32_row(t, first, n, scratch));  // t's own row, or scratch
}

float* f32_out_row(const Tensor& t, int64_t first, int64_t n, std::vector<float>& scratch) {
  if (t.dtype() == DType::F32) return t.data<float>() + first;
  scratch.resize(static_cast<size_t>(n));
  return scratch.data();
}

void store_row(const float* v, const Tensor& t, int64_t first, int64_t n) {
  if (t.dtype() != DType::F32)
    cast_span(v, DType::F32, static_cast<char*>(t.raw()) + first * static_cast<int64_t>(dtype_size(t.dtype())),
              t.dtype(), n);
}

void normalize_u8(const Tensor& x, const Tensor& y, float in_scale, const std::vector<float>& mean,
                  const std::vector<float>& std) {
  // x (N, C, ...): channels repeat every `inner` elements, C of them per sample.
  const int64_t channels = static_cast<int64_t>(mean.size());
  const int64_t n = x.dim(0);
  const int64_t inner = channels > 1 ? x.numel() / (n * channels) : (n > 0 ? x.numel() / n : 0);
  const uint8_t* src = x.data<uint8_t>();
  float* dst = y.data<float>();
  const int64_t rows = n * channels;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c = r % channels;
    const auto f = fn::make_normalize_u8(src + r * inner, dst + r * inner, in_scale, mean[static_cast<size_t>(c)],
                                         std[static_cast<size_t>(c)]);
    for (int64_t i = 0; i < inner; ++i) f(i);
  }
}

}  // namespace strata::ops::cpu
