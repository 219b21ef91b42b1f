// CUDA layer norm over the last dimension of x viewed as (M, F): one block per row for the
// statistics and dx (sums in double, as on the CPU), deterministic column sums for dgamma and
// dbeta. Batch norm is in dnn.cu (cuDNN).
#include "core/ops/cuda/cuda_ops.hpp"
#include "core/ops/cuda/launch.cuh"

namespace strata::ops::cuda {

namespace {

template <class T>
__device__ float value_or(const T* p, int64_t i, float fallback) {
  return p ? fn::to_f32(p[i]) : fallback;
}

// Row r of x (M, F): mean, rstd = 1 / sqrt(biased var + eps) (two passes in double), and
// y = xhat * gamma + beta; mean/rstd stored when not null.
template <class T>
__global__ void layer_norm_forward_kernel(const T* x, const T* gamma, const T* beta, T* y, float* mean, float* rstd,
                                          int64_t f, float eps) {
  __shared__ double shared[32];
  const int64_t r = blockIdx.x;
  const T* in = x + r * f;
  T* out = y + r * f;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < f; i += blockDim.x) sum += fn::to_f32(in[i]);
  const double mu = block_sum(sum, shared) / static_cast<double>(f);
  double sq = 0.0;  // second pass: no cancellation
  for (int64_t i = threadIdx.x; i < f; i += blockDim.x) {
    const double d = fn::to_f32(in[i]) - mu;
    sq += d * d;
  }
  const float rs = fn::rstd_from_sq(block_sum(sq, shared), f, eps), muf = static_cast<float>(mu);
  for (int64_t i = threadIdx.x; i < f; i += blockDim.x)
    out[i] = fn::from_f32<T>(fn::layer_norm_xhat(fn::to_f32(in[i]), muf, rs) * value_or(gamma, i, 1.0f) +
                             value_or(beta, i, 0.0f));
  if (threadIdx.x == 0) {
    if (mean) mean[r] = muf;
    if (rstd) rstd[r] = rs;
  }
}

// Row r: dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * gamma.
template <class T>
__global__ void layer_norm_dx_kernel(const T* x, const T* dy, const T* gamma, const float* mean, const float* rstd,
                                     T* dx, int64_t f) {
  __shared__ double shared[32];
  const int64_t r = blockIdx.x;
  const T* in = x + r * f;
  const T* g = dy + r * f;
  const float mu = mean[r], rs = rstd[r];
  double sum_g = 0.0, sum_gx = 0.0;
  for (int64_t i = threadIdx.x; i < f; i += blockDim.x) {
    const float xhat = fn::layer_norm_xhat(fn::to_f32(in[i]), mu, rs);
    const float dxhat = fn::to_f32(g[i]) * value_or(gamma, i, 1.0f);
    sum_g += dxhat;
    sum_gx += dxhat * xhat;
  }
  const float mean_g = static_cast<float>(block_sum(sum_g, shared) / static_cast<double>(f));
  const float mean_gx = static_cast<float>(block_sum(sum_gx, shared) / static_cast<double>(f));
  T* out = dx + r * f;
  for (int64_t i = threadIdx.x; i < f; i += blockDim.x) {
    const float xhat = fn::layer_norm_xhat(fn::to_f32(in[i]), mu, rs);
    out[i] = fn::from_f32<T>(fn::layer_norm_dx(fn::to_f32(g[i]) * value_or(gamma, i, 1.0f), xhat, rs, mean_g, mean_gx));
  }
}

template <class T>
struct DyXhat {  // dgamma's summand: dy * xhat at (r, j)
  const T* x;
  const T* dy;
  const float* mean;
  const float* rstd;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t j) const {
    const int64_t i = r * cols + j;
    return fn::to_f32(dy[i]) * fn::layer_norm_xhat(fn::to_f32(x[i]), mean[r], rstd[r]);
  }
};

template <class T>
const T* data_or_null(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

}  // namespace

void layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y, const Tensor& mean,
                        const Tensor& rstd, float eps) {
  const int64_t f = x.dim(-1), m = f > 0 ? x.numel() / f : 0;
  if (m == 0) return;
  const OnDevice on(y);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    layer_norm_forward_kernel<<<static_cast<unsigned>(m), row_threads(f), 0, on.stream>>>(
        x.data<T>(), data_or_null<T>(gamma), data_or_null<T>(beta), y.data<T>(),
        mean.defined() ? mean.data<float>() : nullptr, rstd.defined() ? rstd.data<float>() : nullptr, f, eps);
    CUDA_CHECK(cudaGetLastError());
  });
}

void layer_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean, const Tensor& rstd,
                         const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta) {
  const int64_t f = x.dim(-1), m = f > 0 ? x.numel() / f : 0;
  if (m == 0) return;
  const OnDevice on(dy);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data<T>();
    const T* gp = dy.data<T>();
    const float* mu = mean.data<float>();
    const float* rs = rstd.data<float>();
    if (dx.defined()) {
      layer_norm_dx_kernel<<<static_cast<unsigned>(m), row_threads(f), 0, on.stream>>>(xp, gp, data_or_null<T>(gamma),
                                                                                       mu, rs, dx.data<T>(), f);
      CUDA_CHECK(cudaGetLastError());
    }
    if (dgamma.defined()) {
      with_float_type(dgamma.dtype(), [&](auto g_tag) {
        using G = decltype(g_tag);
        column_sum(on, m, f, DyXhat<T>{xp, gp, mu, rs, f}, dgamma.data<G>());
      });
    }
    if (dbeta.defined()) {
      with_float_type(dbeta.dtype(), [&](auto g_tag) {
        using G = decltype(g_tag);
        column_sum(on, m, f, ReadAt<T>{gp, f}, dbeta.data<G>());
      });
    }
  });
}

}  // namespace strata::ops::cuda
