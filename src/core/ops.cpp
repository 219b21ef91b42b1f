// The ops' front door: checks every argument (shapes, dtypes, one device), then dispatches on
// the device to ops::cpu or ops::cuda. This file and its two siblings (ops_conv_norm.cpp:
// convolution, pooling, normalisation; ops_attention.cpp: embeddings, heads, attention) are the
// only places that branch on device; what they share is ops/dispatch.hpp.
//
// Dtype rules (mixed precision): activations and parameters share one float dtype T (f32,
// bf16 or f16); parameter gradients are f32 or T; statistics (batch/layer norm) and optimizer
// state are f32. CPU kernels compute in f32: low-precision tensors are widened into f32
// scratch and outputs rounded back (F32Staging; the loss, LayerNorm and the bias ops stage a
// row at a time themselves, cpu::f32_row, flash attention a head, GELU, ReLU, add and axpy a
// block), i.e. low-precision storage, f32 arithmetic, which is also what the CUDA kernels do
// (f32 accumulation). f32 tensors pass through as is.
// The one exception: bf16 GEMMs and convolutions on a CPU with bf16 units take their operands
// as they are (cpu::gemm_bf16: bf16 products, f32 sums), as cuBLAS does on the GPU.
#include "core/ops.hpp"

#include <omp.h>

#include <atomic>

#include "core/ops/dispatch.hpp"

namespace strata::ops {

using namespace dispatch;  // the shared checks and staging

namespace {

std::atomic<bool> g_allow_tf32{false};

}  // namespace

void set_num_threads(int threads) {
  STRATA_CHECK(threads >= 1, "thread count must be positive, got ", threads);
  cpu::set_num_threads(threads);
}

int num_threads() { return omp_get_max_threads(); }

void set_flush_denormals(bool on) { cpu::set_flush_denormals(on); }

std::string blas_kernel_warning() { return cpu::blas_kernel_warning(); }

std::string bf16_matrix_units() { return cpu::bf16_matrix_units(); }

std::string cpu_kernel_isa() { return cpu::kernel_isa(); }

void set_allow_tf32(bool allow) { g_allow_tf32 = allow; }
bool allow_tf32() { return g_allow_tf32; }

// ---- copies and simple element-wise --------------------------------------------------------

void copy(const Tensor& src, const Tensor& dst) {
  check_defined(src, "src");
  check_defined(dst, "dst");
  STRATA_CHECK(src.numel() == dst.numel(), "copy from ", src.str(), " to ", dst.str(), ": element counts differ");
  if (src.device() == dst.device()) return cast(src, dst);
  if (src.dtype() != dst.dtype()) {  // convert where the data is, then move it
    const Tensor converted = Tensor::empty(src.shape(), dst.dtype(), src.device());
    cast(src, converted);
    return copy(converted, dst);
  }
  STRATA_CUDA_OP(dst.device(), copy, src, dst);
}

void fill(const Tensor& x, float value) {
  check_float(x, "x");
  if (x.device().is_meta()) return meta_op({&x}, true);
  if (x.device().is_cpu()) return on_cpu([&](F32Staging& s) { cpu::fill(s.out(x), value); });
  STRATA_CUDA_OP(x.device(), fill, x, value);
}

void cast(const Tensor& x, const Tensor& y) {
  check_defined(x, "x");
  check_defined(y, "y");
  STRATA_CHECK(x.numel() == y.numel(), "cast from ", x.str(), " to ", y.str(), ": element counts differ");
  STRATA_CHECK(x.dtype() == y.dtype() || (is_float_type(x.dtype()) && is_float_type(y.dtype())), "cast from ",
               dtype_name(x.dtype()), " to ", dtype_name(y.dtype()), " is not supported");
  const Device d = common_device({&x, &y});
  if (d.is_meta()) return meta_op({&x, &y}, false);
  if (d.is_cpu()) return cpu::cast(x, y);
  STRATA_CUDA_OP(d, cast, x, y);
}

void axpy(float alpha, const Tensor& x, const Tensor& y) {
  check_float(y, "y");
  check_float(x, "x");
  check_numel(x, y, "x");
  const Device d = common_device({&x, &y});
  const bool direct = cpu::axpy_takes(x.dtype(), y.dtype());  // f32, or bf16 x staged a block at a time
  if (d.is_meta()) return meta_op({&x, &y}, !direct);
  if (d.is_cpu() && direct) return cpu::axpy(alpha, x, y);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::axpy(alpha, s.in(x), s.inout(y)); });
  STRATA_CUDA_OP(d, axpy, alpha, x, y);
}

void add(const Tensor& a, const Tensor& b, const Tensor& y) {
  check_float(y, "y");
  check_like(a, y, "a");
  check_like(b, y, "b");
  const Device d = common_device({&a, &b, &y});
  if (d.is_meta()) return meta_op({&a, &b, &y}, y.dtype() == DType::F16);
  if (d.is_cpu() && y.dtype() != DType::F16) return cpu::add(a, b, y);  // f32 or bf16 as they are
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::add(s.in(a), s.in(b), s.out(y)); });
  STRATA_CUDA_OP(d, add, a, b, y);
}

void scale(const Tensor& x, float alpha) {
  check_float(x, "x");
  if (x.device().is_meta()) return meta_op({&x}, true);
  if (x.device().is_cpu()) return on_cpu([&](F32Staging& s) { cpu::scale(s.inout(x), alpha); });
  STRATA_CUDA_OP(x.device(), scale, x, alpha);
}

void normalize_u8(const Tensor& x, const Tensor& y, float in_scale, const std::vector<float>& mean,
                  const std::vector<float>& std) {
  check_defined(x, "x");
  STRATA_CHECK(x.dtype() == DType::U8, "x must be u8, got ", x.str());
  check_float(y, "y");
  check_numel(y, x, "y");
  STRATA_CHECK(x.ndim() >= 2, "x must be (N, C, ...), got ", x.str());
  STRATA_CHECK(!mean.empty() && mean.size() == std.size(), "mean and std must have the same non-zero length, got ",
               mean.size(), " and ", std.size());
  STRATA_CHECK(mean.size() == 1 || static_cast<int64_t>(mean.size()) == x.dim(1), "mean/std hold ", mean.size(),
               " values for ", x.dim(1), " channels of ", x.str());
  const Device d = common_device({&x, &y});
  if (d.is_meta()) return meta_op({&x, &y}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::normalize_u8(x, s.out(y), in_scale, mean, std); });
  STRATA_CUDA_OP(d, normalize_u8, x, y, in_scale, mean, std);
}

// ---- activations -----------------------------------------------------------------------------

void relu_forward(const Tensor& x, const Tensor& y) {
  check_float(x, "x");
  check_like(y, x, "y");
  const Device d = common_device({&x, &y});
  if (d.is_meta()) return meta_op({&x, &y}, x.dtype() == DType::F16);
  if (d.is_cpu() && x.dtype() != DType::F16) return cpu::relu_forward(x, y);  // f32 or bf16 as they are
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::relu_forward(s.in(x), s.out(y)); });
  STRATA_CUDA_OP(d, relu_forward, x, y);
}

void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) {
  check_float(y, "y");
  check_like(dy, y, "dy");
  check_like(dx, y, "dx");
  const Device d = common_device({&y, &dy, &dx});
  if (d.is_meta()) return meta_op({&y, &dy, &dx}, y.dtype() == DType::F16);
  if (d.is_cpu() && y.dtype() != DType::F16) return cpu::relu_backward(y, dy, dx);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::relu_backward(s.in(y), s.in(dy), s.out(dx)); });
  STRATA_CUDA_OP(d, relu_backward, y, dy, dx);
}

void gelu_forward(const Tensor& x, const Tensor& y) {
  check_float(x, "x");
  check_like(y, x, "y");
  const Device d = common_device({&x, &y});
  if (d.is_meta()) return meta_op({&x, &y}, x.dtype() == DType::F16);
  if (d.is_cpu() && x.dtype() != DType::F16) return cpu::gelu_forward(x, y);  // f32 or bf16 as they are
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::gelu_forward(s.in(x), s.out(y)); });
  STRATA_CUDA_OP(d, gelu_forward, x, y);
}

void gelu_backward(const Tensor& x, const Tensor& dy, const Tensor& dx) {
  check_float(x, "x");
  check_like(dy, x, "dy");
  check_like(dx, x, "dx");
  const Device d = common_device({&x, &dy, &dx});
  if (d.is_meta()) return meta_op({&x, &dy, &dx}, x.dtype() == DType::F16);
  if (d.is_cpu() && x.dtype() != DType::F16) return cpu::gelu_backward(x, dy, dx);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::gelu_backward(s.in(x), s.in(dy), s.out(dx)); });
  STRATA_CUDA_OP(d, gelu_backward, x, dy, dx);
}

void gelu_tanh_forward(const Tensor& x, const Tensor& y) {
  check_float(x, "x");
  check_like(y, x, "y");
  const Device d = common_device({&x, &y});
  if (d.is_meta()) return meta_op({&x, &y}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::gelu_tanh_forward(s.in(x), s.out(y)); });
  STRATA_CUDA_OP(d, gelu_tanh_forward, x, y);
}

void gelu_tanh_backward(const Tensor& x, const Tensor& dy, const Tensor& dx) {
  check_float(x, "x");
  check_like(dy, x, "dy");
  check_like(dx, x, "dx");
  const Device d = common_device({&x, &dy, &dx});
  if (d.is_meta()) return meta_op({&x, &dy, &dx}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::gelu_tanh_backward(s.in(x), s.in(dy), s.out(dx)); });
  STRATA_CUDA_OP(d, gelu_tanh_backward, x, dy, dx);
}

namespace {
void check_dropout(const Tensor& x, const Tensor& y, float p, const DropoutKey& key) {
  check_float(x, "x");
  check_like(y, x, "y");
  STRATA_CHECK(x.ndim() >= 1, "dropout input must have a sample dimension, got ", x.str());
  STRATA_CHECK(p >= 0.0f && p <= 1.0f, "dropout probability must be in [0, 1], got ", p);
  STRATA_CHECK(key.first_sample >= 0, "first_sample must be >= 0, got ", key.first_sample);
  STRATA_CHECK(key.sample_numel == 0 ||
                   (key.part_offset >= 0 && x.dim(0) > 0 && key.part_offset + x.numel() / x.dim(0) <= key.sample_numel),
               "a dropout part of ", x.numel() / std::max<int64_t>(x.dim(0), 1), " elements at ", key.part_offset,
               " lies outside samples of ", key.sample_numel);
}
}  // namespace

void dropout_forward(const Tensor& x, const Tensor& y, float p, const DropoutKey& key) {
  check_dropout(x, y, p, key);
  const Device d = common_device({&x, &y});
  if (d.is_meta()) return meta_op({&x, &y}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::dropout_forward(s.in(x), s.out(y), p, key); });
  STRATA_CUDA_OP(d, dropout_forward, x, y, p, key);
}

void dropout_backward(const Tensor& dy, const Tensor& dx, float p, const DropoutKey& key) {
  check_dropout(dy, dx, p, key);
  const Device d = common_device({&dy, &dx});
  if (d.is_meta()) return meta_op({&dy, &dx}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::dropout_backward(s.in(dy), s.out(dx), p, key); });
  STRATA_CUDA_OP(d, dropout_backward, dy, dx, p, key);
}

// ---- dense -----------------------------------------------------------------------------------

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha, float beta) {
  check_float(a, "a");
  check_defined(b, "b");
  STRATA_CHECK(b.dtype() == a.dtype(), "gemm operands must share a dtype, got ", a.str(), " and ", b.str());
  check_defined(c, "c");
  check_grad_dtype(c, a, "c");
  STRATA_CHECK(a.ndim() == 2 && b.ndim() == 2 && c.ndim() == 2, "gemm needs 2-D tensors, got ", a.str(), ", ", b.str(),
               ", ", c.str());
  const int64_t m = trans_a ? a.dim(1) : a.dim(0), k = trans_a ? a.dim(0) : a.dim(1);
  const int64_t kb = trans_b ? b.dim(1) : b.dim(0), n = trans_b ? b.dim(0) : b.dim(1);
  STRATA_CHECK(k == kb && c.dim(0) == m && c.dim(1) == n, "gemm shapes do not match: op(a) ", m, "x", k, ", op(b) ", kb,
               "x", n, ", c ", c.str());
  for (int64_t dim : {m, n, k}) check_blas_size(dim, "gemm dimension");
  STRATA_CHECK(!c.same_storage(a) && !c.same_storage(b), "gemm output must not alias its inputs");
  const Device d = common_device({&a, &b, &c});
  // bf16 operands go to the CPU's bf16 units as they are (no f32 staging) where it has them.
  const bool bf16_units = a.dtype() == DType::BF16 && k > 0 && !cpu::bf16_matrix_units().empty();
  if (d.is_meta()) return meta_op({&a, &b, &c}, !bf16_units);
  if (d.is_cpu() && bf16_units) return cpu::gemm_bf16(a, trans_a, b, trans_b, c, alpha, beta);
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) {
      cpu::gemm(s.in(a), trans_a, s.in(b), trans_b, beta == 0.0f ? s.out(c) : s.inout(c), alpha, beta);
    });
  STRATA_CUDA_OP(d, gemm, a, trans_a, b, trans_b, c, alpha, beta);
}

namespace {
// y (..., F) and a vector v (F).
void check_rows_and_vec(const Tensor& y, const Tensor& v, const char* y_name, const char* v_name) {
  check_float(y, y_name);
  check_float(v, v_name);
  STRATA_CHECK(v.ndim() == 1 && y.ndim() >= 1 && y.dim(-1) == v.dim(0), v_name, " ", v.str(),
               " does not match the last dimension of ", y_name, " ", y.str());
}
}  // namespace

void add_bias(const Tensor& y, const Tensor& bias) {
  check_rows_and_vec(y, bias, "y", "bias");
  check_same_dtype(bias, y, "bias");
  const Device d = common_device({&y, &bias});
  if (d.is_meta()) return meta_op({&y, &bias}, false);
  if (d.is_cpu()) return cpu::add_bias(y, bias);  // stages a row at a time
  STRATA_CUDA_OP(d, add_bias, y, bias);
}

void bias_grad(const Tensor& dy, const Tensor& db) {
  check_rows_and_vec(dy, db, "dy", "db");
  check_grad_dtype(db, dy, "db");
  const Device d = common_device({&dy, &db});
  if (d.is_meta()) return meta_op({&dy, &db}, false);
  if (d.is_cpu()) return cpu::bias_grad(dy, db);  // stages a row at a time
  STRATA_CUDA_OP(d, bias_grad, dy, db);
}

// ---- loss and metrics ------------------------------------------------------------------------

namespace {
// logits (N, K) of a float dtype and labels i32 (N).
void check_logits_labels(const Tensor& logits, const Tensor& labels, const char* name) {
  check_float(logits, name);
  STRATA_CHECK(logits.ndim() == 2 && logits.dim(1) > 0, name, " must be (N, K) with K > 0, got ", logits.str());
  check_defined(labels, "labels");
  STRATA_CHECK(labels.dtype() == DType::I32 && labels.numel() == logits.dim(0), "labels must be i32 with ",
               logits.dim(0), " elements, got ", labels.str());
}
// Classes [first, first + k) inside a vocabulary of `vocab`.
void check_slice(int64_t first, int64_t k, int64_t vocab) {
  STRATA_CHECK(first >= 0 && first + k <= vocab, "classes [", first, ", ", first + k,
               ") are not inside a vocabulary of ", vocab);
}
// x (N, K) of a float dtype, mx f32 (N) and stats f32 (N, 2): the vocabulary-parallel pieces.
void check_row_stats(const Tensor& x, const Tensor& mx, const Tensor* stats) {
  check_float(x, "x");
  STRATA_CHECK(x.ndim() == 2 && x.dim(1) > 0, "x must be (N, K) with K > 0, got ", x.str());
  check_f32(mx, "mx");
  check_shape(mx, {x.dim(0)}, "mx");
  if (!stats) return;
  check_f32(*stats, "stats");
  check_shape(*stats, {x.dim(0), 2}, "stats");
}
}  // namespace

double softmax_xent_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs) {
  check_logits_labels(logits, labels, "logits");
  check_float(probs, "probs");
  check_shape(probs, logits.shape(), "probs");
  const Device d = common_device({&logits, &labels, &probs});
  if (d.is_meta()) return meta_op({&logits, &labels, &probs}, false), 0;
  if (d.is_cpu()) return cpu::softmax_xent_forward(logits, labels, probs);  // stages a row at a time
  STRATA_CUDA_OP(d, softmax_xent_forward, logits, labels, probs);
}

void softmax_xent_backward(const Tensor& probs, const Tensor& labels, const Tensor& dlogits, float scale, int64_t first,
                           int64_t vocab) {
  check_logits_labels(probs, labels, "probs");
  check_float(dlogits, "dlogits");
  check_shape(dlogits, probs.shape(), "dlogits");
  if (vocab == 0) vocab = probs.dim(1);
  check_slice(first, probs.dim(1), vocab);
  const Device d = common_device({&probs, &labels, &dlogits});
  if (d.is_meta()) return meta_op({&probs, &labels, &dlogits}, false);
  if (d.is_cpu()) return cpu::softmax_xent_backward(probs, labels, dlogits, scale, first, vocab);
  STRATA_CUDA_OP(d, softmax_xent_backward, probs, labels, dlogits, scale, first, vocab);
}

void row_max(const Tensor& x, const Tensor& mx, const Tensor& argmax) {
  check_row_stats(x, mx, nullptr);
  const Device d = common_device({&x, &mx});
  if (argmax.defined())
    STRATA_CHECK(argmax.dtype() == DType::I32 && argmax.numel() == x.dim(0) && argmax.device() == d,
                 "argmax must be i32 with ", x.dim(0), " elements on ", d.str(), ", got ", argmax.str());
  if (d.is_meta()) return meta_op({&x, &mx}, false);
  if (d.is_cpu()) return cpu::row_max(x, mx, argmax);
  STRATA_CUDA_OP(d, row_max, x, mx, argmax);
}

void softmax_slice_stats(const Tensor& x, const Tensor& labels, int64_t first, int64_t vocab, const Tensor& mx,
                         const Tensor& stats) {
  check_logits_labels(x, labels, "x");
  check_slice(first, x.dim(1), vocab);
  check_row_stats(x, mx, &stats);
  const Device d = common_device({&x, &labels, &mx, &stats});
  if (d.is_meta()) return meta_op({&x, &labels, &mx, &stats}, false);
  if (d.is_cpu()) return cpu::softmax_slice_stats(x, labels, first, vocab, mx, stats);
  STRATA_CUDA_OP(d, softmax_slice_stats, x, labels, first, vocab, mx, stats);
}

void softmax_slice(const Tensor& x, const Tensor& mx, const Tensor& stats, const Tensor& probs) {
  check_row_stats(x, mx, &stats);
  check_float(probs, "probs");
  check_shape(probs, x.shape(), "probs");
  const Device d = common_device({&x, &mx, &stats, &probs});
  if (d.is_meta()) return meta_op({&x, &mx, &stats, &probs}, false);
  if (d.is_cpu()) return cpu::softmax_slice(x, mx, stats, probs);
  STRATA_CUDA_OP(d, softmax_slice, x, mx, stats, probs);
}

int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  check_logits_labels(logits, labels, "logits");
  const Device d = common_device({&logits, &labels});
  if (d.is_meta()) return meta_op({&logits, &labels}, false), 0;
  if (d.is_cpu()) return cpu::count_correct(logits, labels);
  STRATA_CUDA_OP(d, count_correct, logits, labels);
}

// ---- reductions and optimizer updates over flat buffers --------------------------------------

double sum_squares(const Tensor& x) {
  check_float(x, "x");
  if (x.device().is_meta()) return meta_op({&x}, true), 0;
  if (x.device().is_cpu()) return on_cpu([&](F32Staging& s) { return cpu::sum_squares(s.in(x)); });
  STRATA_CUDA_OP(x.device(), sum_squares, x);
}

bool all_finite(const Tensor& x) {
  check_float(x, "x");
  if (x.device().is_meta()) return meta_op({&x}, true), true;
  if (x.device().is_cpu()) return on_cpu([&](F32Staging& s) { return cpu::all_finite(s.in(x)); });
  STRATA_CUDA_OP(x.device(), all_finite, x);
}

void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, const SgdParams& p) {
  check_f32(param, "param");
  check_f32_like(grad, param, "grad");
  STRATA_CHECK(p.momentum >= 0.0f && p.lr >= 0.0f && p.weight_decay >= 0.0f, "bad SGD parameters: lr ", p.lr,
               ", momentum ", p.momentum, ", weight_decay ", p.weight_decay);
  STRATA_CHECK(!p.nesterov || (p.momentum > 0.0f && p.dampening == 0.0f),
               "nesterov momentum requires momentum > 0 and dampening == 0");
  if (p.momentum != 0.0f) check_f32_like(momentum_buf, param, "momentum_buf");
  const Device d = common_device({&param, &grad, &momentum_buf});
  if (d.is_meta()) return meta_op({&param, &grad, &momentum_buf}, false);
  if (d.is_cpu()) return cpu::sgd_update(param, grad, momentum_buf, p);
  STRATA_CUDA_OP(d, sgd_update, param, grad, momentum_buf, p);
}

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                  const AdamWParams& p) {
  check_f32(param, "param");
  check_f32_like(grad, param, "grad");
  check_f32_like(exp_avg, param, "exp_avg");
  check_f32_like(exp_avg_sq, param, "exp_avg_sq");
  STRATA_CHECK(p.step >= 1, "AdamW step is 1-based, got ", p.step);
  STRATA_CHECK(p.beta1 >= 0.0f && p.beta1 < 1.0f && p.beta2 >= 0.0f && p.beta2 < 1.0f && p.eps >= 0.0f,
               "bad AdamW parameters: betas (", p.beta1, ", ", p.beta2, "), eps ", p.eps);
  const Device d = common_device({&param, &grad, &exp_avg, &exp_avg_sq});
  if (d.is_meta()) return meta_op({&param, &grad, &exp_avg, &exp_avg_sq}, false);
  if (d.is_cpu()) return cpu::adamw_update(param, grad, exp_avg, exp_avg_sq, p);
  STRATA_CUDA_OP(d, adamw_update, param, grad, exp_avg, exp_avg_sq, p);
}

}  // namespace strata::ops
