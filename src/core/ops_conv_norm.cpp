// Convolution, pooling and normalisation: each op checks its arguments, then dispatches on the device (ops.cpp
// explains the dtype rules).
#include "core/ops/dispatch.hpp"

namespace strata::ops {

using namespace dispatch;  // the shared checks and staging

// ---- convolution -----------------------------------------------------------------------------

namespace {
void check_conv(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dGeometry& g, const char* y_name) {
  STRATA_CHECK(
      g.in_channels > 0 && g.out_channels > 0 && g.kernel_h > 0 && g.kernel_w > 0 && g.stride > 0 && g.padding >= 0,
      "bad conv geometry: channels ", g.in_channels, "->", g.out_channels, ", kernel ", g.kernel_h, "x", g.kernel_w,
      ", stride ", g.stride, ", padding ", g.padding);
  STRATA_CHECK(g.out_h() > 0 && g.out_w() > 0, "conv output would be empty for input ", g.in_h, "x", g.in_w);
  check_float(x, "x");
  STRATA_CHECK(x.ndim() == 4, "conv input must be (N, C, H, W), got ", x.str());
  const int64_t n = x.dim(0);
  check_shape(x, Shape{n, g.in_channels, g.in_h, g.in_w}, "x");
  check_same_dtype(w, x, "w");
  check_shape(w, Shape{g.out_channels, g.in_channels, g.kernel_h, g.kernel_w}, "w");
  check_same_dtype(y, x, y_name);
  check_shape(y, Shape{n, g.out_channels, g.out_h(), g.out_w()}, y_name);
  check_blas_size(g.in_channels * g.kernel_h * g.kernel_w, "conv C*KH*KW");
  check_blas_size(n * g.out_h() * g.out_w(), "conv N*OH*OW");
}
// bf16 convolutions on a CPU with bf16 units take their operands as they are (cpu::gemm_bf16, as
// ops::gemm); elsewhere, and in f16, they are staged in f32.
bool bf16_on_units(const Tensor& x) { return x.dtype() == DType::BF16 && !cpu::bf16_matrix_units().empty(); }

}  // namespace

void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y, const Conv2dGeometry& g) {
  check_conv(x, w, y, g, "y");
  check_optional_param(bias, g.out_channels, x, "bias");
  const Device d = common_device({&x, &w, &bias, &y});
  const bool units = bf16_on_units(x);
  if (d.is_meta()) return meta_op({&x, &w, &bias, &y}, !units);
  if (d.is_cpu() && units) return cpu::conv2d_forward_bf16(x, w, bias, y, g);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::conv2d_forward(s.in(x), s.in(w), s.in(bias), s.out(y), g); });
  STRATA_CUDA_OP(d, conv2d_forward, x, w, bias, y, g);
}

void conv2d_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                     const Tensor& db, const Conv2dGeometry& g) {
  check_conv(x, w, dy, g, "dy");
  if (dx.defined()) {
    check_same_dtype(dx, x, "dx");
    check_shape(dx, x.shape(), "dx");
  }
  if (dw.defined()) {
    check_grad_dtype(dw, x, "dw");
    check_shape(dw, w.shape(), "dw");
  }
  check_optional_grad(db, g.out_channels, x, "db");
  const Device d = common_device({&x, &w, &dy, &dx, &dw, &db});
  const bool units = bf16_on_units(x);
  if (d.is_meta()) return meta_op({&x, &w, &dy, &dx, &dw, &db}, !units);
  if (d.is_cpu() && units) return cpu::conv2d_backward_bf16(x, w, dy, dx, dw, db, g);
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) {
      cpu::conv2d_backward(s.in(x), s.in(w), s.in(dy), s.out(dx), s.inout(dw), s.inout(db), g);
    });
  STRATA_CUDA_OP(d, conv2d_backward, x, w, dy, dx, dw, db, g);
}

// ---- pooling ---------------------------------------------------------------------------------

namespace {
// x (N, C, H, W) and y (N, C, OH, OW) of one float dtype for geometry g.
void check_pool(const Tensor& x, const Tensor& y, const Pool2dGeometry& g, const char* x_name, const char* y_name) {
  STRATA_CHECK(g.kernel > 0 && g.stride > 0 && g.padding >= 0 && 2 * g.padding <= g.kernel,
               "bad pool geometry: kernel ", g.kernel, ", stride ", g.stride, ", padding ", g.padding,
               " (padding must be at most half the kernel)");
  STRATA_CHECK(g.out_h() > 0 && g.out_w() > 0, "pool output would be empty for input ", g.in_h, "x", g.in_w);
  check_float(x, x_name);
  STRATA_CHECK(x.ndim() == 4, x_name, " must be (N, C, H, W), got ", x.str());
  check_shape(x, Shape{x.dim(0), x.dim(1), g.in_h, g.in_w}, x_name);
  check_same_dtype(y, x, y_name);
  check_shape(y, Shape{x.dim(0), x.dim(1), g.out_h(), g.out_w()}, y_name);
}

void check_argmax(const Tensor& argmax, const Tensor& y) {
  check_defined(argmax, "argmax");
  STRATA_CHECK(argmax.dtype() == DType::I32 && argmax.shape() == y.shape(), "argmax must be i32 shaped like ", y.str(),
               ", got ", argmax.str());
}
}  // namespace

void max_pool2d_forward(const Tensor& x, const Tensor& y, const Tensor& argmax, const Pool2dGeometry& g) {
  check_pool(x, y, g, "x", "y");
  check_argmax(argmax, y);
  const Device d = common_device({&x, &y, &argmax});
  if (d.is_meta()) return meta_op({&x, &y, &argmax}, x.dtype() == DType::F16);
  if (d.is_cpu() && x.dtype() != DType::F16) return cpu::max_pool2d_forward(x, y, argmax, g);  // a plane at a time
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::max_pool2d_forward(s.in(x), s.out(y), argmax, g); });
  STRATA_CUDA_OP(d, max_pool2d_forward, x, y, argmax, g);
}

void max_pool2d_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx, const Pool2dGeometry& g) {
  check_pool(dx, dy, g, "dx", "dy");
  check_argmax(argmax, dy);
  const Device d = common_device({&dy, &argmax, &dx});
  if (d.is_meta()) return meta_op({&dy, &argmax, &dx}, dy.dtype() == DType::F16);
  if (d.is_cpu() && dy.dtype() != DType::F16) return cpu::max_pool2d_backward(dy, argmax, dx, g);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::max_pool2d_backward(s.in(dy), argmax, s.out(dx), g); });
  STRATA_CUDA_OP(d, max_pool2d_backward, dy, argmax, dx, g);
}

void avg_pool2d_forward(const Tensor& x, const Tensor& y, const Pool2dGeometry& g) {
  check_pool(x, y, g, "x", "y");
  const Device d = common_device({&x, &y});
  if (d.is_meta()) return meta_op({&x, &y}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::avg_pool2d_forward(s.in(x), s.out(y), g); });
  STRATA_CUDA_OP(d, avg_pool2d_forward, x, y, g);
}

void avg_pool2d_backward(const Tensor& dy, const Tensor& dx, const Pool2dGeometry& g) {
  check_pool(dx, dy, g, "dx", "dy");
  const Device d = common_device({&dy, &dx});
  if (d.is_meta()) return meta_op({&dy, &dx}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::avg_pool2d_backward(s.in(dy), s.out(dx), g); });
  STRATA_CUDA_OP(d, avg_pool2d_backward, dy, dx, g);
}

namespace {
void check_global_pool(const Tensor& x, const Tensor& y, const char* x_name, const char* y_name) {
  check_float(x, x_name);
  STRATA_CHECK(x.ndim() == 4, x_name, " must be (N, C, H, W), got ", x.str());
  check_same_dtype(y, x, y_name);
  check_shape(y, Shape{x.dim(0), x.dim(1)}, y_name);
}
}  // namespace

void global_avg_pool_forward(const Tensor& x, const Tensor& y) {
  check_global_pool(x, y, "x", "y");
  const Device d = common_device({&x, &y});
  if (d.is_meta()) return meta_op({&x, &y}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::global_avg_pool_forward(s.in(x), s.out(y)); });
  STRATA_CUDA_OP(d, global_avg_pool_forward, x, y);
}

void global_avg_pool_backward(const Tensor& dy, const Tensor& dx) {
  check_global_pool(dx, dy, "dx", "dy");
  const Device d = common_device({&dy, &dx});
  if (d.is_meta()) return meta_op({&dy, &dx}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::global_avg_pool_backward(s.in(dy), s.out(dx)); });
  STRATA_CUDA_OP(d, global_avg_pool_backward, dy, dx);
}

// ---- normalisation ---------------------------------------------------------------------------

namespace {
// x (N, C, ...) with y shaped like x; returns C.
int64_t check_bn_input(const Tensor& x, const Tensor& y, const char* y_name) {
  check_float(x, "x");
  STRATA_CHECK(x.ndim() >= 2 && x.dim(0) > 0, "batch norm input must be (N, C, ...) with N > 0, got ", x.str());
  check_like(y, x, y_name);
  check_shape(y, x.shape(), y_name);
  return x.dim(1);
}
}  // namespace

void batch_norm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                              const Tensor& save_mean, const Tensor& save_invstd, const Tensor& running_mean,
                              const Tensor& running_var, float momentum, float eps) {
  const int64_t c = check_bn_input(x, y, "y");
  check_optional_param(gamma, c, x, "gamma");
  check_optional_param(beta, c, x, "beta");
  for (auto [t, name] : {std::pair{&save_mean, "save_mean"},
                         {&save_invstd, "save_invstd"},
                         {&running_mean, "running_mean"},
                         {&running_var, "running_var"}})
    check_optional_stat(*t, c, name);
  const Device d = common_device({&x, &gamma, &beta, &y, &save_mean, &save_invstd, &running_mean, &running_var});
  if (d.is_meta()) return meta_op({&x, &gamma, &beta, &y, &save_mean, &save_invstd, &running_mean, &running_var}, true);
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) {
      cpu::batch_norm_forward_train(s.in(x), s.in(gamma), s.in(beta), s.out(y), save_mean, save_invstd, running_mean,
                                    running_var, momentum, eps);
    });
  STRATA_CUDA_OP(d, batch_norm_forward_train, x, gamma, beta, y, save_mean, save_invstd, running_mean, running_var,
                 momentum, eps);
}

void batch_norm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& running_mean,
                             const Tensor& running_var, const Tensor& y, float eps) {
  const int64_t c = check_bn_input(x, y, "y");
  check_optional_param(gamma, c, x, "gamma");
  check_optional_param(beta, c, x, "beta");
  check_defined(running_mean, "running_mean");
  check_defined(running_var, "running_var");
  check_optional_stat(running_mean, c, "running_mean");
  check_optional_stat(running_var, c, "running_var");
  const Device d = common_device({&x, &gamma, &beta, &running_mean, &running_var, &y});
  if (d.is_meta()) return meta_op({&x, &gamma, &beta, &running_mean, &running_var, &y}, true);
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) {
      cpu::batch_norm_forward_eval(s.in(x), s.in(gamma), s.in(beta), running_mean, running_var, s.out(y), eps);
    });
  STRATA_CUDA_OP(d, batch_norm_forward_eval, x, gamma, beta, running_mean, running_var, y, eps);
}

void batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta) {
  const int64_t c = check_bn_input(x, dy, "dy");
  if (dx.defined()) check_bn_input(x, dx, "dx");
  check_defined(save_mean, "save_mean");
  check_defined(save_invstd, "save_invstd");
  check_optional_stat(save_mean, c, "save_mean");
  check_optional_stat(save_invstd, c, "save_invstd");
  check_optional_param(gamma, c, x, "gamma");
  check_optional_grad(dgamma, c, x, "dgamma");
  check_optional_grad(dbeta, c, x, "dbeta");
  const Device d = common_device({&x, &dy, &gamma, &save_mean, &save_invstd, &dx, &dgamma, &dbeta});
  if (d.is_meta()) return meta_op({&x, &dy, &gamma, &save_mean, &save_invstd, &dx, &dgamma, &dbeta}, true);
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) {
      cpu::batch_norm_backward(s.in(x), s.in(dy), s.in(gamma), save_mean, save_invstd, s.out(dx), s.inout(dgamma),
                               s.inout(dbeta));
    });
  STRATA_CUDA_OP(d, batch_norm_backward, x, dy, gamma, save_mean, save_invstd, dx, dgamma, dbeta);
}

namespace {
// x (..., F) viewed as (M, F), y like x; returns F.
int64_t check_ln_input(const Tensor& x, const Tensor& y, const char* y_name) {
  check_float(x, "x");
  STRATA_CHECK(x.ndim() >= 1 && x.dim(-1) > 0, "layer norm input must be (..., F) with F > 0, got ", x.str());
  check_like(y, x, y_name);
  check_shape(y, x.shape(), y_name);
  return x.dim(-1);
}

// Per-row statistics: f32 with m elements (any shape), optional unless `required`.
void check_row_stats(const Tensor& t, int64_t m, const char* name, bool required) {
  if (!required && !t.defined()) return;
  check_f32(t, name);
  STRATA_CHECK(t.numel() == m, name, " must hold one value per row (", m, "), got ", t.str());
}
}  // namespace

void layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y, const Tensor& mean,
                        const Tensor& rstd, float eps) {
  const int64_t f = check_ln_input(x, y, "y"), m = x.numel() / f;
  check_optional_param(gamma, f, x, "gamma");
  check_optional_param(beta, f, x, "beta");
  check_row_stats(mean, m, "mean", false);
  check_row_stats(rstd, m, "rstd", false);
  const Device d = common_device({&x, &gamma, &beta, &y, &mean, &rstd});
  if (d.is_meta()) return meta_op({&x, &gamma, &beta, &y, &mean, &rstd}, false);
  if (d.is_cpu()) return cpu::layer_norm_forward(x, gamma, beta, y, mean, rstd, eps);  // stages a row at a time
  STRATA_CUDA_OP(d, layer_norm_forward, x, gamma, beta, y, mean, rstd, eps);
}

void layer_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean, const Tensor& rstd,
                         const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta) {
  const int64_t f = check_ln_input(x, dy, "dy"), m = x.numel() / f;
  if (dx.defined()) check_ln_input(x, dx, "dx");
  check_row_stats(mean, m, "mean", true);
  check_row_stats(rstd, m, "rstd", true);
  check_optional_param(gamma, f, x, "gamma");
  check_optional_grad(dgamma, f, x, "dgamma");
  check_optional_grad(dbeta, f, x, "dbeta");
  const Device d = common_device({&x, &dy, &gamma, &mean, &rstd, &dx, &dgamma, &dbeta});
  if (d.is_meta()) return meta_op({&x, &dy, &gamma, &mean, &rstd, &dx, &dgamma, &dbeta}, false);
  if (d.is_cpu()) return cpu::layer_norm_backward(x, dy, gamma, mean, rstd, dx, dgamma, dbeta);
  STRATA_CUDA_OP(d, layer_norm_backward, x, dy, gamma, mean, rstd, dx, dgamma, dbeta);
}

}  // namespace strata::ops
