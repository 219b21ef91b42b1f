// CUDA reductions and optimizer updates over flat buffers. Each update is one fused launch of
// the CPU's per-element step (ops/functors.hpp); the reductions read back one value and wait
// for the compute stream only.
#include "core/ops/cuda/cuda_ops.hpp"
#include "core/ops/cuda/launch.cuh"

namespace strata::ops::cuda {

namespace {

// Stage 1 of sum_squares: block b's sum of x^2 in double into partial[b].
template <class T>
__global__ void sum_squares_kernel(const T* x, int64_t n, double* partial) {
  __shared__ double shared[32];
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  double acc = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = fn::to_f32(x[i]);
    acc += v * v;
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// *flag = 1 when some element is inf or NaN (every writer stores the same value).
template <class T>
__global__ void all_finite_kernel(const T* x, int64_t n, int* flag) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  bool finite = true;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    finite &= isfinite(fn::to_f32(x[i]));
  if (!finite) *flag = 1;
}

// Blocks for the reductions: a function of n only, so sums repeat bitwise on any GPU.
unsigned reduce_blocks(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + 4 * detail::kThreads - 1) / (4 * detail::kThreads), 1, 1024));
}

}  // namespace

double sum_squares(const Tensor& x) {
  const int64_t n = x.numel();
  if (n == 0) return 0.0;
  const OnDevice on(x);
  const unsigned blocks = reduce_blocks(n);
  Tensor s = scratch(on, (blocks + 1) * sizeof(double));  // [0] the sum, then the partials
  double* sum = scratch_at<double>(s, 0);
  double* partial = sum + 1;
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    sum_squares_kernel<<<blocks, detail::kThreads, 0, on.stream>>>(x.data<T>(), n, partial);
    CUDA_CHECK(cudaGetLastError());
  });
  detail::sum_kernel<<<1, 1024, 0, on.stream>>>(partial, static_cast<int64_t>(blocks), sum);
  CUDA_CHECK(cudaGetLastError());
  double host = 0.0;
  read_back(on, &host, sum, sizeof(host));
  return host;
}

bool all_finite(const Tensor& x) {
  const int64_t n = x.numel();
  if (n == 0) return true;
  const OnDevice on(x);
  Tensor s = scratch(on, sizeof(int));
  int* flag = scratch_at<int>(s, 0);
  CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), on.stream));
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    all_finite_kernel<<<reduce_blocks(n), detail::kThreads, 0, on.stream>>>(x.data<T>(), n, flag);
    CUDA_CHECK(cudaGetLastError());
  });
  int host = 0;
  read_back(on, &host, flag, sizeof(host));
  return host == 0;
}

void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, const SgdParams& p) {
  const fn::SgdScalars s{p.lr, p.momentum, p.dampening, p.weight_decay};
  float* w = param.data<float>();
  const float* g = grad.data<float>();
  const int64_t n = param.numel();
  const OnDevice on(param);
  if (p.momentum == 0.0f)
    parallel_for(on, n, fn::SgdStep<false, false>{w, g, nullptr, s});
  else if (p.nesterov)
    parallel_for(on, n, fn::SgdStep<true, true>{w, g, momentum_buf.data<float>(), s});
  else
    parallel_for(on, n, fn::SgdStep<true, false>{w, g, momentum_buf.data<float>(), s});
}

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                  const AdamWParams& p) {
  const OnDevice on(param);
  parallel_for(
      on, param.numel(),
      fn::make_adamw_step(param.data<float>(), grad.data<float>(), exp_avg.data<float>(), exp_avg_sq.data<float>(), p));
}

}  // namespace strata::ops::cuda
