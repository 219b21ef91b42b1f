// The CUDA kernels behind ops.hpp (internal; only in builds with STRATA_WITH_CUDA). Arguments
// are already checked by ops.cpp. Element-wise only for now; the rest throws in the dispatch.
#pragma once

#include "core/ops.hpp"

namespace strata::ops::cuda {

// Number of visible CUDA devices; 0 when there is no GPU or no driver.
int device_count();

void fill(const Tensor& x, float value);
void axpy(float alpha, const Tensor& x, const Tensor& y);
void add(const Tensor& a, const Tensor& b, const Tensor& y);
void scale(const Tensor& x, float alpha);
void relu_forward(const Tensor& x, const Tensor& y);
void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx);
void gelu_forward(const Tensor& x, const Tensor& y);
void gelu_backward(const Tensor& x, const Tensor& dy, const Tensor& dx);
void dropout_forward(const Tensor& x, const Tensor& y, float p, const DropoutKey& key);
void dropout_backward(const Tensor& dy, const Tensor& dx, float p, const DropoutKey& key);

}  // namespace strata::ops::cuda
