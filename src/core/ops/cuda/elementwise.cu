// CUDA element-wise ops, casts, u8 normalisation, bias add and bias gradient: the functors of
// ops/functors.hpp (the same math as the CPU loops) launched on the compute stream, for f32,
// bf16 and f16 storage. This file holds launches only.
#include "core/ops/cuda/cuda_ops.hpp"
#include "core/ops/cuda/launch.cuh"

namespace strata::ops::cuda {

void fill(const Tensor& x, float value) {
  const OnDevice on(x);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, x.numel(), fn::Fill<T>{x.data<T>(), fn::from_f32<T>(value)});
  });
}

void cast(const Tensor& x, const Tensor& y) {
  if (x.numel() == 0) return;
  const OnDevice on(y);
  if (x.dtype() == y.dtype()) {
    if (x.raw() != y.raw())
      CUDA_CHECK(cudaMemcpyAsync(y.raw(), x.raw(), x.nbytes(), cudaMemcpyDeviceToDevice, on.stream));
    return;
  }
  with_float_type(x.dtype(), [&](auto in_tag) {
    using In = decltype(in_tag);
    with_float_type(y.dtype(), [&](auto out_tag) {
      using Out = decltype(out_tag);
      parallel_for(on, x.numel(), fn::Cast<In, Out>{x.data<In>(), y.data<Out>()});
    });
  });
}

// x and y may differ in dtype: low-precision scratch gradients accumulate into f32.
void axpy(float alpha, const Tensor& x, const Tensor& y) {
  const OnDevice on(y);
  with_float_type(x.dtype(), [&](auto x_tag) {
    using X = decltype(x_tag);
    with_float_type(y.dtype(), [&](auto y_tag) {
      using Y = decltype(y_tag);
      parallel_for(on, x.numel(), fn::Axpy<X, Y>{alpha, x.data<X>(), y.data<Y>()});
    });
  });
}

void add(const Tensor& a, const Tensor& b, const Tensor& y) {
  const OnDevice on(y);
  with_float_type(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, y.numel(), fn::Add<T>{a.data<T>(), b.data<T>(), y.data<T>()});
  });
}

void scale(const Tensor& x, float alpha) {
  const OnDevice on(x);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, x.numel(), fn::Scale<T>{x.data<T>(), alpha});
  });
}

void normalize_u8(const Tensor& x, const Tensor& y, float in_scale, const std::vector<float>& mean,
                  const std::vector<float>& std) {
  // x (N, C, ...): one launch per channel (C is small), over N runs of `inner` pixels.
  const int64_t channels = static_cast<int64_t>(mean.size()), n = x.dim(0);
  if (x.numel() == 0) return;
  const OnDevice on(y);
  const uint8_t* src = x.data<uint8_t>();
  with_float_type(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* dst = y.data<T>();
    if (channels == 1) {
      parallel_for(on, x.numel(), fn::make_normalize_u8(src, dst, in_scale, mean[0], std[0]));
      return;
    }
    const int64_t inner = x.numel() / (n * channels);
    for (int64_t c = 0; c < channels; ++c) {
      const size_t k = static_cast<size_t>(c);
      const auto f = fn::make_normalize_u8(src + c * inner, dst + c * inner, in_scale, mean[k], std[k]);
      parallel_for_rows(on, n, inner, StridedRows<decltype(f)>{f, channels * inner});
    }
  });
}

void relu_forward(const Tensor& x, const Tensor& y) {
  const OnDevice on(y);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, x.numel(), fn::ReluForward<T>{x.data<T>(), y.data<T>()});
  });
}

void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) {
  const OnDevice on(dx);
  with_float_type(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, y.numel(), fn::ReluBackward<T>{y.data<T>(), dy.data<T>(), dx.data<T>()});
  });
}

void gelu_forward(const Tensor& x, const Tensor& y) {
  const OnDevice on(y);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, x.numel(), fn::GeluForward<T>{x.data<T>(), y.data<T>()});
  });
}

void gelu_backward(const Tensor& x, const Tensor& dy, const Tensor& dx) {
  const OnDevice on(dx);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, x.numel(), fn::GeluBackward<T>{x.data<T>(), dy.data<T>(), dx.data<T>()});
  });
}

void gelu_tanh_forward(const Tensor& x, const Tensor& y) {
  const OnDevice on(y);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, x.numel(), fn::GeluTanhForward<T>{x.data<T>(), y.data<T>()});
  });
}

void gelu_tanh_backward(const Tensor& x, const Tensor& dy, const Tensor& dx) {
  const OnDevice on(dx);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, x.numel(), fn::GeluTanhBackward<T>{x.data<T>(), dy.data<T>(), dx.data<T>()});
  });
}

namespace {
// The same counter-based mask as the CPU (rng.hpp): forward and backward alike.
void dropout(const Tensor& x, const Tensor& y, float p, const DropoutKey& key) {
  const OnDevice on(y);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, x.numel(),
                 fn::make_dropout(x.data<T>(), y.data<T>(), x.numel(), x.dim(0), p, key.key, key.stream,
                                  key.first_sample, key.sample_numel, key.part_offset));
  });
}
}  // namespace

void dropout_forward(const Tensor& x, const Tensor& y, float p, const DropoutKey& key) { dropout(x, y, p, key); }

// The same mask scales the incoming gradient.
void dropout_backward(const Tensor& dy, const Tensor& dx, float p, const DropoutKey& key) { dropout(dy, dx, p, key); }

void add_bias(const Tensor& y, const Tensor& bias) {
  // y (rows, F) += bias (F)
  const int64_t f = bias.numel(), rows = f > 0 ? y.numel() / f : 0;
  const OnDevice on(y);
  with_float_type(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for_rows(on, rows, f, fn::AddBias<T>{y.data<T>(), bias.data<T>(), f});
  });
}

void bias_grad(const Tensor& dy, const Tensor& db) {
  // db (F; f32 or dy's dtype) += column sums of dy (rows, F)
  const int64_t f = db.numel(), rows = f > 0 ? dy.numel() / f : 0;
  const OnDevice on(db);
  with_float_type(dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    with_float_type(db.dtype(), [&](auto g_tag) {
      using G = decltype(g_tag);
      column_sum(on, rows, f, ReadAt<T>{dy.data<T>(), f}, db.data<G>());
    });
  });
}

}  // namespace strata::ops::cuda
