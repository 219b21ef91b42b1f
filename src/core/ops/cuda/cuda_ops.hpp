// The CUDA kernels behind ops.hpp (internal; only in builds with STRATA_WITH_CUDA). Arguments
// are already checked by ops.cpp, including the dtype rules stated there: activations and
// parameters share one float dtype (f32, bf16 or f16); parameter gradients are f32 or that
// dtype; statistics (BatchNorm/LayerNorm mean, invstd, running stats) and optimizer buffers
// are f32. Every kernel runs on its device's compute stream (core/cuda/runtime.hpp); ops that
// return a host value synchronise that stream only.
#pragma once

#include "core/ops.hpp"

// Core's CUDA runtime (core/cuda/runtime.hpp): the kernels use its DeviceGuard,
// compute_stream, Owned, ... unqualified.
namespace strata::cuda {}
namespace strata::ops::cuda {
using namespace ::strata::cuda;
}  // namespace strata::ops::cuda

namespace strata::ops::cuda {

// Copies between any two devices (host <-> device, device <-> device); same dtype and numel.
// Host-to-device and device-to-device copies are asynchronous on the compute stream of the
// device involved; device-to-host copies synchronise that stream before returning.
void copy(const Tensor& src, const Tensor& dst);

void fill(const Tensor& x, float value);
void cast(const Tensor& x, const Tensor& y);
void axpy(float alpha, const Tensor& x, const Tensor& y);
void add(const Tensor& a, const Tensor& b, const Tensor& y);
void scale(const Tensor& x, float alpha);
void normalize_u8(const Tensor& x, const Tensor& y, float in_scale, const std::vector<float>& mean,
                  const std::vector<float>& std);

void relu_forward(const Tensor& x, const Tensor& y);
void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx);
void gelu_forward(const Tensor& x, const Tensor& y);
void gelu_backward(const Tensor& x, const Tensor& dy, const Tensor& dx);
void gelu_tanh_forward(const Tensor& x, const Tensor& y);
void gelu_tanh_backward(const Tensor& x, const Tensor& dy, const Tensor& dx);
void dropout_forward(const Tensor& x, const Tensor& y, float p, const DropoutKey& key);
void dropout_backward(const Tensor& dy, const Tensor& dx, float p, const DropoutKey& key);

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha, float beta);
void add_bias(const Tensor& y, const Tensor& bias);
void bias_grad(const Tensor& dy, const Tensor& db);

void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y, const Conv2dGeometry& g);
void conv2d_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                     const Tensor& db, const Conv2dGeometry& g);

void max_pool2d_forward(const Tensor& x, const Tensor& y, const Tensor& argmax, const Pool2dGeometry& g);
void max_pool2d_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx, const Pool2dGeometry& g);
void avg_pool2d_forward(const Tensor& x, const Tensor& y, const Pool2dGeometry& g);
void avg_pool2d_backward(const Tensor& dy, const Tensor& dx, const Pool2dGeometry& g);
void global_avg_pool_forward(const Tensor& x, const Tensor& y);
void global_avg_pool_backward(const Tensor& dy, const Tensor& dx);

void batch_norm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                              const Tensor& save_mean, const Tensor& save_invstd, const Tensor& running_mean,
                              const Tensor& running_var, float momentum, float eps);
void batch_norm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& running_mean,
                             const Tensor& running_var, const Tensor& y, float eps);
void batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta);
void layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y, const Tensor& mean,
                        const Tensor& rstd, float eps);
void layer_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean, const Tensor& rstd,
                         const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta);

void embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe, const Tensor& y, int64_t first_token,
                       int64_t vocab);
void embedding_backward(const Tensor& tokens, const Tensor& dy, const Tensor& dwte, const Tensor& dwpe,
                        int64_t first_token);
void split_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v);
void merge_qkv(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv);
void merge_heads(const Tensor& x, const Tensor& y);
void split_heads(const Tensor& y, const Tensor& x);
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& probs, float p,
                       const DropoutKey& key);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& probs, const Tensor& dy,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, float p, const DropoutKey& key);
void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                             float p, const DropoutKey& key);
void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                              const Tensor& dy, const Tensor& dq, const Tensor& dk, const Tensor& dv, float p,
                              const DropoutKey& key);

double softmax_xent_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs);
void softmax_xent_backward(const Tensor& probs, const Tensor& labels, const Tensor& dlogits, float scale, int64_t first,
                           int64_t vocab);
void row_max(const Tensor& x, const Tensor& mx, const Tensor& argmax);
void softmax_slice_stats(const Tensor& x, const Tensor& labels, int64_t first, int64_t vocab, const Tensor& mx,
                         const Tensor& stats);
void softmax_slice(const Tensor& x, const Tensor& mx, const Tensor& stats, const Tensor& probs);
int64_t count_correct(const Tensor& logits, const Tensor& labels);

double sum_squares(const Tensor& x);
bool all_finite(const Tensor& x);
void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, const SgdParams& p);
void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                  const AdamWParams& p);

}  // namespace strata::ops::cuda
