// The ops: one function per kernel family. Each checks its arguments, then dispatches on the
// tensors' device to ops/cpu/*.cpp or ops/cuda/*.cu. Layers call only these.
//
// Conventions
// - Tensors are contiguous, row-major float32 unless stated; images are (N, C, H, W).
// - Outputs are passed in, allocated by the caller with the right shape; they are overwritten.
// - Parameter gradients (dw, db, dgamma, ...) are ACCUMULATED (+=) so that micro-batches add
//   up in the flat gradient buffer; the caller zeroes it once per optimizer step.
// - An undefined tensor (Tensor()) for an optional output means "not needed".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace strata::ops {

// Threads for this rank's kernels: OpenMP's, which also run the GEMMs, cut into blocks;
// OpenBLAS itself stays on one thread (one thread pool, see ops/cpu/cpu_ops.hpp). Call once at start.
void set_num_threads(int threads);
int num_threads();
// Denormal floats flushed to zero, as operands and results, in the CPU kernels (x86's FTZ and DAZ)
// on this thread, the OpenMP threads and threads started after: a denormal costs a microcode
// assist of ~100 cycles per operation, which made a diverging run 2.7x slower per step. Call after
// set_num_threads. Off unless called (IEEE gradual underflow, as PyTorch's default).
void set_flush_denormals(bool on);
// Empty, or one line when the CPU BLAS runs slower kernels than this CPU could: OpenBLAS
// 0.3.21 (Debian 12) does not know CPUs newer than it (e.g. Emerald Rapids, model 207) and
// falls back to its generic Prescott (SSE3) kernels, 3-4x slower GEMM than its AVX-512 ones.
// OPENBLAS_CORETYPE, read when the library loads, is the fix; the message names the value.
std::string blas_kernel_warning();
// The CPU's bf16 matrix units that bf16 GEMMs run on ("AVX512-BF16" or "AMX-BF16", through oneDNN:
// bf16 products summed in f32, about 2x the f32 GEMM rate on AVX512-BF16), or empty: then bf16
// GEMMs widen their operands to f32 for OpenBLAS, as every other CPU op does. oneDNN's
// DNNL_MAX_CPU_ISA (e.g. AVX512_CORE) turns the units off for a process.
std::string bf16_matrix_units();
// The vector width the hot element-wise CPU kernels (GELU) run at on this CPU: "AVX-512", "AVX2" or
// "SSE2", chosen when the program loads from versions compiled for each (same bits on all three);
// "the build's target (one version)" when built for one CPU (-DSTRATA_MARCH) or under TSan.
std::string cpu_kernel_isa();

// GPU matrix products in f32 may use TF32 tensor cores (off by default, as in PyTorch's
// matmul; no effect on the CPU or on bf16/f16).
void set_allow_tf32(bool allow);
bool allow_tf32();

// ---- copies and simple element-wise --------------------------------------------------------

// dst = src between any two devices and float dtypes (same number of elements; non-float
// dtypes must match).
void copy(const Tensor& src, const Tensor& dst);
void fill(const Tensor& x, float value);
// y = x, converting between any two of f32 / bf16 / f16 (and same-dtype copies of any dtype).
void cast(const Tensor& x, const Tensor& y);
// y = alpha * x + y
void axpy(float alpha, const Tensor& x, const Tensor& y);
// y = a + b
void add(const Tensor& a, const Tensor& b, const Tensor& y);
// x *= alpha
void scale(const Tensor& x, float alpha);
// u8 images to float: y = (x * in_scale - mean[c]) / std[c], c the channel of (N, C, ...)
// layout; mean/std hold C or 1 values.
void normalize_u8(const Tensor& x, const Tensor& y, float in_scale, const std::vector<float>& mean,
                  const std::vector<float>& std);

// ---- activations -----------------------------------------------------------------------------

void relu_forward(const Tensor& x, const Tensor& y);
// dx = dy where y > 0 (y is relu's output)
void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx);
// Exact GELU, x * Phi(x) (PyTorch's default, approximate='none').
void gelu_forward(const Tensor& x, const Tensor& y);
void gelu_backward(const Tensor& x, const Tensor& dy, const Tensor& dx);
// GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GPT-2's "gelu_new",
// PyTorch's approximate='tanh').
void gelu_tanh_forward(const Tensor& x, const Tensor& y);
void gelu_tanh_backward(const Tensor& x, const Tensor& dy, const Tensor& dx);

// Inverted dropout: y = x * keep / (1 - p). The keep decision for element j of sample s is
// uniform(key, stream, (first_sample + s) * sample_numel + j) >= p, so it depends only on
// (key, stream, global sample index), not on batch split or rank count.
struct DropoutKey {
  uint64_t key = 0;     // rng::derive_key(seed, kDropout) mixed with the layer's index
  uint64_t stream = 0;  // the optimizer step
  int64_t first_sample = 0;
  // x holds a part of each sample (sequence parallelism: this rank's positions): the whole
  // sample's elements and where the part starts in it, so element j of the part draws as the
  // whole sample's element part_offset + j. 0, 0: x's samples are whole.
  int64_t sample_numel = 0, part_offset = 0;
  // Attention only: the layer's heads and the first of those the op's q, k, v hold (a
  // tensor-parallel slice), so a mask does not depend on how heads are split. 0, 0: all of them.
  int64_t heads = 0, first_head = 0;
};
void dropout_forward(const Tensor& x, const Tensor& y, float p, const DropoutKey& key);
void dropout_backward(const Tensor& dy, const Tensor& dx, float p, const DropoutKey& key);

// ---- dense -----------------------------------------------------------------------------------

// c = alpha * op(a) @ op(b) + beta * c for 2-D row-major tensors, op = transpose if trans_*.
void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha = 1.0f,
          float beta = 0.0f);
// y (N, F) += bias (F) broadcast over rows.
void add_bias(const Tensor& y, const Tensor& bias);
// db (F) += sum over rows of dy (N, F).
void bias_grad(const Tensor& dy, const Tensor& db);

// ---- convolution -----------------------------------------------------------------------------

struct Conv2dGeometry {
  int64_t in_channels = 0, out_channels = 0;
  int64_t kernel_h = 0, kernel_w = 0;
  int64_t stride = 1, padding = 0;
  int64_t in_h = 0, in_w = 0;
  int64_t out_h() const { return (in_h + 2 * padding - kernel_h) / stride + 1; }
  int64_t out_w() const { return (in_w + 2 * padding - kernel_w) / stride + 1; }
};
// x (N, C, H, W), w (O, C, KH, KW), bias (O) or undefined, y (N, O, OH, OW).
void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y, const Conv2dGeometry& g);
// dx is overwritten (skipped if undefined); dw and db (if defined) accumulate.
void conv2d_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                     const Tensor& db, const Conv2dGeometry& g);

// ---- pooling ---------------------------------------------------------------------------------

struct Pool2dGeometry {
  int64_t kernel = 2, stride = 2, padding = 0;
  int64_t in_h = 0, in_w = 0;
  int64_t out_h() const { return (in_h + 2 * padding - kernel) / stride + 1; }
  int64_t out_w() const { return (in_w + 2 * padding - kernel) / stride + 1; }
};
// argmax (i32, shape of y) records the flat input index (within one H*W plane) of each max.
void max_pool2d_forward(const Tensor& x, const Tensor& y, const Tensor& argmax, const Pool2dGeometry& g);
void max_pool2d_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx, const Pool2dGeometry& g);
// Average over the window, padding counted as zeros (PyTorch's count_include_pad=True).
void avg_pool2d_forward(const Tensor& x, const Tensor& y, const Pool2dGeometry& g);
void avg_pool2d_backward(const Tensor& dy, const Tensor& dx, const Pool2dGeometry& g);
// (N, C, H, W) -> (N, C)
void global_avg_pool_forward(const Tensor& x, const Tensor& y);
void global_avg_pool_backward(const Tensor& dy, const Tensor& dx);

// ---- normalisation ---------------------------------------------------------------------------

// Training mode: per-channel batch statistics over (N, H, W). Saves mean and 1/sqrt(var + eps)
// (C each) for backward; updates running stats as PyTorch does (unbiased variance, running =
// (1 - momentum) * running + momentum * batch).
void batch_norm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                              const Tensor& save_mean, const Tensor& save_invstd, const Tensor& running_mean,
                              const Tensor& running_var, float momentum, float eps);
void batch_norm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& running_mean,
                             const Tensor& running_var, const Tensor& y, float eps);
void batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta);
// Over the last dimension of x viewed as (M, F); mean and rstd have M elements.
void layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y, const Tensor& mean,
                        const Tensor& rstd, float eps);
void layer_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean, const Tensor& rstd,
                         const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta);

// ---- language models -------------------------------------------------------------------------

// tokens i32 (B, T), wte (V, D), wpe (Tmax >= T, D) -> y (B, T, D) = wte[token] + wpe[t].
// An Input error names the first token outside [0, vocab) (vocab 0: V). A vocabulary-parallel
// slice (tensor parallelism) passes its rows' first token and the whole vocabulary: wte's row
// r is token first_token + r, and tokens outside [first_token, first_token + V) add zero; wpe
// may be undefined (no position term).
void embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe, const Tensor& y,
                       int64_t first_token = 0, int64_t vocab = 0);
// dwte[token - first_token] += dy[b, t] for the tokens wte's rows hold, and dwpe[t] += dy[b, t],
// summed in a fixed order (deterministic). Either gradient may be undefined.
void embedding_backward(const Tensor& tokens, const Tensor& dy, const Tensor& dwte, const Tensor& dwpe,
                        int64_t first_token = 0);

// qkv (B, T, 3 * H * Dh) as the fused projection writes it (q | k | v, each head-major) ->
// q, k, v (B, H, T, Dh); and the reverse for their gradients (dqkv overwritten).
void split_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v);
void merge_qkv(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv);
// x (B, H, T, Dh) -> y (B, T, H * Dh), and back.
void merge_heads(const Tensor& x, const Tensor& y);
void split_heads(const Tensor& y, const Tensor& x);

// Causal scaled dot-product attention per (batch, head): position i attends to j <= i with
// softmax(q k^T / sqrt(Dh)); q, y are (B, H, T, Dh), k and v (B, Hkv, T, Dh) with Hkv dividing H:
// grouped-query attention, query head h reading kv head h / (H / Hkv) (Hugging Face's
// repeat_interleave of the kv heads; Hkv = H: multi-head, 1: multi-query). The kv heads are read
// in place by their group, never copied per query head; dk, dv sum over the group. Dropout on the attention
// probabilities with probability p (0: none): the keep decision for (sample b, head h, i, j)
// is uniform(key, stream, ((first_sample + b) * H + h) * T * T + i * T + j) >= p, the same in
// both implementations below, so they agree whatever the batch split.
// Plain: materialises the probabilities (B, H, T, T) in `probs` (before dropout), kept for
// backward; O(T^2) memory per head.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& probs,
                       float p = 0.0f, const DropoutKey& key = {});
// dq, dk, dv overwritten.
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& probs, const Tensor& dy,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, float p = 0.0f,
                        const DropoutKey& key = {});
// Memory-efficient (FlashAttention's algorithm): tiles of keys with an online softmax, O(T)
// extra memory per head; saves only each row's log-sum-exp `lse` (B, H, T) and recomputes the
// probabilities tile by tile in backward (which also needs the output y).
void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                             float p = 0.0f, const DropoutKey& key = {});
void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                              const Tensor& dy, const Tensor& dq, const Tensor& dk, const Tensor& dv, float p = 0.0f,
                              const DropoutKey& key = {});

// ---- Llama family (ops_llama.cpp; CPU only so far) -------------------------------------------

// RMSNorm over the last dimension of x viewed as (M, F): y = x / sqrt(mean(x^2) + eps) * gamma
// (F); rstd (M elements, f32) saves 1 / sqrt(mean(x^2) + eps) for backward (may be undefined
// in forward). Backward: dx overwritten (skipped if undefined), dgamma accumulated.
void rms_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd, float eps);
void rms_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& rstd, const Tensor& dx,
                       const Tensor& dgamma);
// Rotary position embedding of x (B, H, T, Dh) into y (may be x), in Hugging Face's rotate-half
// layout: element i < Dh/2 pairs with i + Dh/2, and the pair of row t turns by the angle
// (first_position + t) * inv_freq[i] (computed in f32, as transformers does):
//   y[i] = x[i] cos - x[i + Dh/2] sin,  y[i + Dh/2] = x[i + Dh/2] cos + x[i] sin.
// inverse turns by minus the angle: the backward of a rotation is its inverse. inv_freq holds
// Dh/2 frequencies (layers::rope_frequencies).
void rope(const Tensor& x, const Tensor& y, const std::vector<float>& inv_freq, int64_t first_position = 0,
          bool inverse = false);
// SwiGLU's gate: y = silu(gate) * up, all of one shape; backward overwrites dgate and dup.
void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& y);
void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dy, const Tensor& dgate, const Tensor& dup);

// ---- loss and metrics ------------------------------------------------------------------------

// logits (N, K), labels i32 (N). Writes softmax probabilities (N, K) and returns the SUM of
// per-sample losses (the caller divides by the global batch).
double softmax_xent_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs);
// dlogits = (probs - onehot(labels)) * scale. probs may hold classes [first, first + K) of a
// vocabulary of `vocab` (0: K) with labels in [0, vocab): the vocabulary-parallel loss's slice.
void softmax_xent_backward(const Tensor& probs, const Tensor& labels, const Tensor& dlogits, float scale,
                           int64_t first = 0, int64_t vocab = 0);
// The vocabulary-parallel cross-entropy's pieces (layers::SoftmaxCrossEntropy with tp: x (N, K)
// holds classes [first, first + K) of a vocabulary of `vocab`, and the caller combines the
// ranks' row statistics with collectives between the calls). Rows are staged in f32 one at a
// time, so bf16 logits are never widened whole.
// mx f32 (N): each row's maximum; argmax i32 (N), where defined: the column of its first maximum.
void row_max(const Tensor& x, const Tensor& mx, const Tensor& argmax = {});
// stats f32 (N, 2): per row, the sum of exp(x - mx) over this slice, and x at the label's column
// where this slice holds it (0 elsewhere); labels i32 (N) in [0, vocab).
void softmax_slice_stats(const Tensor& x, const Tensor& labels, int64_t first, int64_t vocab, const Tensor& mx,
                         const Tensor& stats);
// probs = exp(x - mx) / stats[:, 0], stats[:, 0] being the whole row's sum (over every slice).
void softmax_slice(const Tensor& x, const Tensor& mx, const Tensor& stats, const Tensor& probs);
// Number of rows whose argmax equals the label.
int64_t count_correct(const Tensor& logits, const Tensor& labels);

// ---- reductions and optimizer updates over flat buffers --------------------------------------

// sum of x^2 in double precision.
double sum_squares(const Tensor& x);
// True when every element is finite.
bool all_finite(const Tensor& x);

struct SgdParams {
  float lr = 0.01f, momentum = 0.0f, dampening = 0.0f, weight_decay = 0.0f;
  bool nesterov = false;
};
// torch.optim.SGD semantics; momentum_buf is undefined when momentum == 0.
void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, const SgdParams& p);

struct AdamWParams {
  float lr = 1e-3f, eps = 1e-8f, weight_decay = 1e-2f;
  double beta1 = 0.9, beta2 = 0.999;  // double so that 1 - beta is exact, as in torch
  int64_t step = 1;                   // 1-based, for bias correction
};
// torch.optim.AdamW semantics (decoupled weight decay).
void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                  const AdamWParams& p);

}  // namespace strata::ops
