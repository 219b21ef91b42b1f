// CPU reductions and optimizer updates over flat buffers (the stage's parameter and gradient
// buffers, or a ZeRO shard of them). The update math is in ops/functors.hpp.
#include <cmath>

#include "core/ops/cpu/cpu_ops.hpp"
#include "core/ops/functors.hpp"

namespace strata::ops::cpu {

double sum_squares(const Tensor& x) {
  const float* p = x.data<float>();
  const int64_t n = x.numel();
  double acc = 0.0;
  if (n >= kParallelGrain && omp_get_max_threads() > 1) {
#pragma omp parallel for simd reduction(+ : acc) schedule(static)
    for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(p[i]) * p[i];
  } else {
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(p[i]) * p[i];
  }
  return acc;
}

bool all_finite(const Tensor& x) {
  // x * 0 is 0 for finite x and NaN for inf or NaN; the sum is NaN iff one of them is not finite.
  const float* p = x.data<float>();
  const int64_t n = x.numel();
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += p[i] * 0.0f;
  return acc == 0.0f;
}

void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, const SgdParams& p) {
  float* buf = p.momentum != 0.0f ? momentum_buf.data<float>() : nullptr;
  parallel_for(param.numel(), fn::SgdStep{param.data<float>(), grad.data<float>(), buf, p.lr, p.momentum, p.dampening,
                                          p.weight_decay, p.nesterov});
}

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                  const AdamWParams& p) {
  // Bias corrections in double, as torch computes them in Python.
  const double t = static_cast<double>(p.step);
  const double bc1 = 1.0 - std::pow(p.beta1, t);
  const double bc2 = 1.0 - std::pow(p.beta2, t);
  parallel_for(param.numel(),
               fn::AdamWStep{param.data<float>(), grad.data<float>(), exp_avg.data<float>(), exp_avg_sq.data<float>(),
                             1.0f - p.lr * p.weight_decay, static_cast<float>(p.beta1), static_cast<float>(p.beta2),
                             static_cast<float>(1.0 - p.beta1), static_cast<float>(1.0 - p.beta2),
                             static_cast<float>(p.lr / bc1), static_cast<float>(std::sqrt(bc2)), p.eps});
}

}  // namespace strata::ops::cpu
