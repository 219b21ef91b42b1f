// Helpers of the GPU tests (CUDA builds only): random host data representable in a dtype, and
// copies to and from GPU 0 (ops::copy, which orders with the compute stream).
#pragma once

#include <random>

#include "core/ops.hpp"

namespace strata::cuda_test {

inline const Device kGpu = Device::cuda(0);

// A host f32 tensor as `dtype` and back: the values a `dtype` tensor can hold.
inline Tensor round_to(const Tensor& t, DType dtype) {
  if (dtype == DType::F32) return t;
  Tensor low = Tensor::empty(t.shape(), dtype), back = Tensor::empty(t.shape());
  ops::cast(t, low);
  ops::cast(low, back);
  return back;
}

// Uniform host f32 values in [lo, hi), representable in `dtype` (so the CPU sees exactly what
// the GPU sees).
inline Tensor rand_host(Shape shape, uint32_t seed, DType dtype, float lo, float hi) {
  Tensor t = Tensor::empty(std::move(shape));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = d(gen);
  return round_to(t, dtype);
}

// A host tensor on the GPU, converted to `dtype` (any float dtype for float tensors).
inline Tensor to_gpu(const Tensor& host, DType dtype) {
  Tensor d = Tensor::empty(host.shape(), dtype, kGpu);
  ops::copy(host, d);
  return d;
}
inline Tensor to_gpu(const Tensor& host) { return to_gpu(host, host.dtype()); }

// A GPU tensor on the host, widened to f32 when it holds bf16 or f16.
inline Tensor to_host(const Tensor& dev) {
  const DType dtype = dev.dtype() == DType::BF16 || dev.dtype() == DType::F16 ? DType::F32 : dev.dtype();
  Tensor h = Tensor::empty(dev.shape(), dtype);
  ops::copy(dev, h);
  return h;
}

}  // namespace strata::cuda_test
