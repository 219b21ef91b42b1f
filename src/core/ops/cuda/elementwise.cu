// CUDA element-wise ops: one grid-stride launcher applying the functors of ops/functors.hpp
// (the same math as the CPU loop; this file holds launches only).
#include <algorithm>

#include "core/ops/cuda/cuda_check.hpp"
#include "core/ops/cuda/cuda_ops.hpp"
#include "core/ops/functors.hpp"

namespace strata::ops::cuda {

namespace {

template <class F>
__global__ void apply_kernel(int64_t n, F f) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

// Applies f(i) for i in [0, n) on the device of `like`, on the default stream.
template <class F>
void parallel_for(const Tensor& like, int64_t n, const F& f) {
  if (n == 0) return;
  DeviceGuard guard(like.device().index);
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65536);  // grid-stride covers the rest
  apply_kernel<<<static_cast<unsigned>(blocks), kThreads>>>(n, f);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void fill(const Tensor& x, float value) { parallel_for(x, x.numel(), fn::Fill{x.data<float>(), value}); }

void axpy(float alpha, const Tensor& x, const Tensor& y) {
  parallel_for(y, x.numel(), fn::Axpy{alpha, x.data<float>(), y.data<float>()});
}

void add(const Tensor& a, const Tensor& b, const Tensor& y) {
  parallel_for(y, y.numel(), fn::Add{a.data<float>(), b.data<float>(), y.data<float>()});
}

void scale(const Tensor& x, float alpha) { parallel_for(x, x.numel(), fn::Scale{x.data<float>(), alpha}); }

void relu_forward(const Tensor& x, const Tensor& y) {
  parallel_for(y, x.numel(), fn::ReluForward{x.data<float>(), y.data<float>()});
}

void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) {
  parallel_for(dx, y.numel(), fn::ReluBackward{y.data<float>(), dy.data<float>(), dx.data<float>()});
}

void gelu_forward(const Tensor& x, const Tensor& y) {
  parallel_for(y, x.numel(), fn::GeluForward{x.data<float>(), y.data<float>()});
}

void gelu_backward(const Tensor& x, const Tensor& dy, const Tensor& dx) {
  parallel_for(dx, x.numel(), fn::GeluBackward{x.data<float>(), dy.data<float>(), dx.data<float>()});
}

void dropout_forward(const Tensor& x, const Tensor& y, float p, const DropoutKey& key) {
  parallel_for(y, x.numel(),
               fn::make_dropout(x.data<float>(), y.data<float>(), x.numel(), x.dim(0), p, key.key, key.stream,
                                key.first_sample));
}

// The same mask scales the incoming gradient.
void dropout_backward(const Tensor& dy, const Tensor& dx, float p, const DropoutKey& key) {
  parallel_for(dx, dy.numel(),
               fn::make_dropout(dy.data<float>(), dx.data<float>(), dy.numel(), dy.dim(0), p, key.key, key.stream,
                                key.first_sample));
}

}  // namespace strata::ops::cuda
