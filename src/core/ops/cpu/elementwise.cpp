// CPU element-wise ops: the functors of ops/functors.hpp applied by parallel_for (GELU: its own
// vectorisable loops, vec_math.hpp), plus casts and u8 image normalisation.
#include <cstring>
#include <string>

#include "core/ops/cpu/cpu_ops.hpp"
#include "core/ops/cpu/vec_math.hpp"
#include "core/ops/functors.hpp"

namespace strata::ops::cpu {

void fill(const Tensor& x, float value) { parallel_for(x.numel(), fn::Fill<float>{x.data<float>(), value}); }

void axpy(float alpha, const Tensor& x, const Tensor& y) {
  parallel_for(x.numel(), fn::Axpy<float, float>{alpha, x.data<float>(), y.data<float>()});
}

void add(const Tensor& a, const Tensor& b, const Tensor& y) {
  parallel_for(y.numel(), fn::Add<float>{a.data<float>(), b.data<float>(), y.data<float>()});
}

void scale(const Tensor& x, float alpha) { parallel_for(x.numel(), fn::Scale<float>{x.data<float>(), alpha}); }

void relu_forward(const Tensor& x, const Tensor& y) {
  parallel_for(x.numel(), fn::ReluForward<float>{x.data<float>(), y.data<float>()});
}

void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) {
  parallel_for(y.numel(), fn::ReluBackward<float>{y.data<float>(), dy.data<float>(), dx.data<float>()});
}

// Exact GELU with vec_math.hpp's vectorisable erf and exp (the CUDA kernels keep the
// functors, which call erff and expf), compiled per vector width (STRATA_KERNEL_CLONES).
namespace {

STRATA_KERNEL_CLONES void gelu_forward_span(const float* in, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = in[i] * vec_math::gelu_terms(in[i]).cdf;
}

// d/dx x Phi(x) = Phi(x) + x phi(x)
STRATA_KERNEL_CLONES void gelu_backward_span(const float* in, const float* g, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const vec_math::GeluTerms t = vec_math::gelu_terms(in[i]);
    out[i] = g[i] * (t.cdf + in[i] * (vec_math::kInvSqrt2Pi * t.gauss));
  }
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

void gelu_forward(const Tensor& x, const Tensor& y) {
  const float* in = x.data<float>();
  float* out = y.data<float>();
  parallel_spans(x.numel(), [&](int64_t lo, int64_t hi) { gelu_forward_span(in + lo, out + lo, hi - lo); });
}

void gelu_backward(const Tensor& x, const Tensor& dy, const Tensor& dx) {
  const float* in = x.data<float>();
  const float* g = dy.data<float>();
  float* out = dx.data<float>();
  parallel_spans(x.numel(), [&](int64_t lo, int64_t hi) { gelu_backward_span(in + lo, g + lo, out + lo, hi - lo); });
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
void cast_as(const Tensor& x, const Tensor& y) {
  parallel_for(x.numel(), fn::Cast<In, Out>{x.data<In>(), y.data<Out>()});
}

template <class In>
void cast_from(const Tensor& x, const Tensor& y) {
  switch (y.dtype()) {
    case DType::F32:
      return cast_as<In, float>(x, y);
    case DType::BF16:
      return cast_as<In, bf16>(x, y);
    case DType::F16:
      return cast_as<In, f16>(x, y);
    default:
      STRATA_THROW("cast to ", dtype_name(y.dtype()), " is not supported");
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

void cast(const Tensor& x, const Tensor& y) {
  if (x.dtype() == y.dtype()) {
    if (x.numel() > 0 && x.raw() != y.raw()) std::memcpy(y.raw(), x.raw(), x.nbytes());
    return;
  }
  switch (x.dtype()) {
    case DType::F32:
      return cast_from<float>(x, y);
    case DType::BF16:
      return cast_from<bf16>(x, y);
    case DType::F16:
      return cast_from<f16>(x, y);
    default:
      STRATA_THROW("cast from ", dtype_name(x.dtype()), " is not supported");
  }
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
