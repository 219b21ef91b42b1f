// The ops' front door: checks every argument (shapes, dtypes, one device), then dispatches on
// the device to ops::cpu or ops::cuda. This file is the only place that branches on device.
//
// Dtype rules (mixed precision): activations and parameters share one float dtype T (f32,
// bf16 or f16); parameter gradients are f32 or T; statistics (batch/layer norm) and optimizer
// state are f32. CPU kernels compute in f32: low-precision tensors are widened into f32
// scratch and outputs rounded back (F32Staging), i.e. low-precision storage, f32 arithmetic,
// which is also what the CUDA kernels do (f32 accumulation). f32 tensors pass through as is.
#include "core/ops.hpp"

#include <omp.h>

#include <atomic>
#include <climits>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "core/allocator.hpp"
#include "core/ops/cpu/cpu_ops.hpp"
#if STRATA_WITH_CUDA
#include "core/ops/cuda/cuda_ops.hpp"
#endif

namespace strata::ops {

namespace {

#if STRATA_WITH_CUDA
#define STRATA_CUDA_OP(device, op, ...) return cuda::op(__VA_ARGS__)
#else
#define STRATA_CUDA_OP(device, op, ...) \
  STRATA_THROW("ops::", #op, " on ", (device).str(), " in a build without CUDA (configure with -DSTRATA_CUDA=ON)")
#endif

bool is_float_type(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

// Runs CPU kernels (which take f32) on tensors of any float dtype: inputs are widened into f32
// scratch, outputs written to f32 scratch and rounded into their tensors by commit(). Tensors
// that are f32 (or not float at all, like labels and argmax) are handed through unchanged.
class F32Staging {
 public:
  Tensor in(const Tensor& t) {
    if (!needs_staging(t)) return t;
    Tensor wide = Tensor::empty(t.shape());
    cpu::cast(t, wide);
    return wide;
  }
  // Written by the kernel (its old contents are not read).
  Tensor out(const Tensor& t) {
    if (!needs_staging(t)) return t;
    Tensor wide = Tensor::empty(t.shape());
    results_.emplace_back(wide, t);
    return wide;
  }
  // Read and written (accumulated gradients, in-place updates).
  Tensor inout(const Tensor& t) {
    if (!needs_staging(t)) return t;
    Tensor wide = in(t);
    results_.emplace_back(wide, t);
    return wide;
  }
  void commit() {
    for (const auto& [wide, t] : results_) cpu::cast(wide, t);
  }

 private:
  static bool needs_staging(const Tensor& t) {
    return t.defined() && (t.dtype() == DType::BF16 || t.dtype() == DType::F16);
  }
  std::vector<std::pair<Tensor, Tensor>> results_;
};

// Calls kernel(staging) and commits the staged outputs; returns what the kernel returns.
template <class Kernel>
auto on_cpu(const Kernel& kernel) {
  F32Staging staging;
  if constexpr (std::is_void_v<decltype(kernel(staging))>) {
    kernel(staging);
    staging.commit();
  } else {
    auto result = kernel(staging);
    staging.commit();
    return result;
  }
}

void check_defined(const Tensor& t, const char* name) { STRATA_CHECK(t.defined(), name, " is undefined"); }

void check_f32(const Tensor& t, const char* name) {
  check_defined(t, name);
  STRATA_CHECK(t.dtype() == DType::F32, name, " must be f32, got ", t.str());
}

// Any float dtype (f32, bf16, f16).
void check_float(const Tensor& t, const char* name) {
  check_defined(t, name);
  STRATA_CHECK(is_float_type(t.dtype()), name, " must be a float tensor (f32, bf16 or f16), got ", t.str());
}

void check_shape(const Tensor& t, const Shape& shape, const char* name) {
  check_defined(t, name);
  STRATA_CHECK(t.shape() == shape, name, " must have shape ", shape_str(shape), ", got ", t.str());
}

void check_numel(const Tensor& t, const Tensor& like, const char* name) {
  STRATA_CHECK(t.numel() == like.numel(), name, " has ", t.numel(), " elements, expected ", like.numel(), " (", t.str(),
               " vs ", like.str(), ")");
}

// The compute dtype of `like` (an activation or a parameter).
void check_same_dtype(const Tensor& t, const Tensor& like, const char* name) {
  check_defined(t, name);
  STRATA_CHECK(t.dtype() == like.dtype(), name, " must be ", dtype_name(like.dtype()), " like the input, got ",
               t.str());
}

// Same dtype as `like` and the same element count.
void check_like(const Tensor& t, const Tensor& like, const char* name) {
  check_same_dtype(t, like, name);
  check_numel(t, like, name);
}

// A parameter gradient: f32, or the compute dtype of `activation`.
void check_grad_dtype(const Tensor& t, const Tensor& activation, const char* name) {
  STRATA_CHECK(t.dtype() == DType::F32 || t.dtype() == activation.dtype(), name, " must be f32 or ",
               dtype_name(activation.dtype()), ", got ", t.str());
}

// f32 with the same number of elements as `like`.
void check_f32_like(const Tensor& t, const Tensor& like, const char* name) {
  check_f32(t, name);
  check_numel(t, like, name);
}

// The device all defined tensors share.
Device common_device(std::initializer_list<const Tensor*> tensors) {
  const Tensor* first = nullptr;
  for (const Tensor* t : tensors) {
    if (!t->defined()) continue;
    if (first == nullptr) {
      first = t;
    } else {
      STRATA_CHECK(t->device() == first->device(), "tensors on different devices: ", first->device().str(), " and ",
                   t->device().str());
    }
  }
  return first ? first->device() : Device::cpu();
}

void check_blas_size(int64_t n, const char* what) {
  STRATA_CHECK(n >= 0 && n <= INT_MAX, what, " ", n, " exceeds the BLAS integer range");
}

// Optional per-channel / per-feature vector of the compute dtype of `like`: undefined or n
// elements.
void check_optional_param(const Tensor& t, int64_t n, const Tensor& like, const char* name) {
  if (!t.defined()) return;
  check_shape(t, Shape{n}, name);
  check_same_dtype(t, like, name);
}

// Optional parameter gradient vector: undefined, or n elements of f32 or the compute dtype.
void check_optional_grad(const Tensor& t, int64_t n, const Tensor& like, const char* name) {
  if (!t.defined()) return;
  check_shape(t, Shape{n}, name);
  check_grad_dtype(t, like, name);
}

// Optional f32 statistics vector of n elements.
void check_optional_stat(const Tensor& t, int64_t n, const char* name) {
  if (!t.defined()) return;
  check_shape(t, Shape{n}, name);
  check_f32(t, name);
}

// Meta tensors (memory planning): no kernel runs. Planning for the CPU, the op also allocates,
// for its duration, the f32 scratch that on_cpu's F32Staging gives its bf16/f16 tensors
// (`staged`: the CPU branch goes through on_cpu), so the plan's peak is the CPU allocator's.
void meta_op(std::initializer_list<const Tensor*> tensors, bool staged) {
  if (!staged || !meta_allocator().host_staging()) return;
  std::vector<Tensor> scratch;
  for (const Tensor* t : tensors)
    if (t->defined() && is_float_type(t->dtype()) && t->dtype() != DType::F32)
      scratch.push_back(Tensor::empty(t->shape(), DType::F32, Device::meta()));
}

std::atomic<bool> g_allow_tf32{false};

}  // namespace

void set_num_threads(int threads) {
  STRATA_CHECK(threads >= 1, "thread count must be positive, got ", threads);
  cpu::set_num_threads(threads);
}

int num_threads() { return omp_get_max_threads(); }

std::string blas_kernel_warning() { return cpu::blas_kernel_warning(); }

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
  if (d.is_meta()) return meta_op({&x, &y}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::axpy(alpha, s.in(x), s.inout(y)); });
  STRATA_CUDA_OP(d, axpy, alpha, x, y);
}

void add(const Tensor& a, const Tensor& b, const Tensor& y) {
  check_float(y, "y");
  check_like(a, y, "a");
  check_like(b, y, "b");
  const Device d = common_device({&a, &b, &y});
  if (d.is_meta()) return meta_op({&a, &b, &y}, true);
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
  if (d.is_meta()) return meta_op({&x, &y}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::relu_forward(s.in(x), s.out(y)); });
  STRATA_CUDA_OP(d, relu_forward, x, y);
}

void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) {
  check_float(y, "y");
  check_like(dy, y, "dy");
  check_like(dx, y, "dx");
  const Device d = common_device({&y, &dy, &dx});
  if (d.is_meta()) return meta_op({&y, &dy, &dx}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::relu_backward(s.in(y), s.in(dy), s.out(dx)); });
  STRATA_CUDA_OP(d, relu_backward, y, dy, dx);
}

void gelu_forward(const Tensor& x, const Tensor& y) {
  check_float(x, "x");
  check_like(y, x, "y");
  const Device d = common_device({&x, &y});
  if (d.is_meta()) return meta_op({&x, &y}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::gelu_forward(s.in(x), s.out(y)); });
  STRATA_CUDA_OP(d, gelu_forward, x, y);
}

void gelu_backward(const Tensor& x, const Tensor& dy, const Tensor& dx) {
  check_float(x, "x");
  check_like(dy, x, "dy");
  check_like(dx, x, "dx");
  const Device d = common_device({&x, &dy, &dx});
  if (d.is_meta()) return meta_op({&x, &dy, &dx}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::gelu_backward(s.in(x), s.in(dy), s.out(dx)); });
  STRATA_CUDA_OP(d, gelu_backward, x, dy, dx);
}

namespace {
void check_dropout(const Tensor& x, const Tensor& y, float p, const DropoutKey& key) {
  check_float(x, "x");
  check_like(y, x, "y");
  STRATA_CHECK(x.ndim() >= 1, "dropout input must have a sample dimension, got ", x.str());
  STRATA_CHECK(p >= 0.0f && p <= 1.0f, "dropout probability must be in [0, 1], got ", p);
  STRATA_CHECK(key.first_sample >= 0, "first_sample must be >= 0, got ", key.first_sample);
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
  if (d.is_meta()) return meta_op({&a, &b, &c}, true);
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
  if (d.is_meta()) return meta_op({&y, &bias}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::add_bias(s.inout(y), s.in(bias)); });
  STRATA_CUDA_OP(d, add_bias, y, bias);
}

void bias_grad(const Tensor& dy, const Tensor& db) {
  check_rows_and_vec(dy, db, "dy", "db");
  check_grad_dtype(db, dy, "db");
  const Device d = common_device({&dy, &db});
  if (d.is_meta()) return meta_op({&dy, &db}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::bias_grad(s.in(dy), s.inout(db)); });
  STRATA_CUDA_OP(d, bias_grad, dy, db);
}

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
}  // namespace

void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y, const Conv2dGeometry& g) {
  check_conv(x, w, y, g, "y");
  check_optional_param(bias, g.out_channels, x, "bias");
  const Device d = common_device({&x, &w, &bias, &y});
  if (d.is_meta()) return meta_op({&x, &w, &bias, &y}, true);
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
  if (d.is_meta()) return meta_op({&x, &w, &dy, &dx, &dw, &db}, true);
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
  if (d.is_meta()) return meta_op({&x, &y, &argmax}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::max_pool2d_forward(s.in(x), s.out(y), argmax, g); });
  STRATA_CUDA_OP(d, max_pool2d_forward, x, y, argmax, g);
}

void max_pool2d_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx, const Pool2dGeometry& g) {
  check_pool(dx, dy, g, "dx", "dy");
  check_argmax(argmax, dy);
  const Device d = common_device({&dy, &argmax, &dx});
  if (d.is_meta()) return meta_op({&dy, &argmax, &dx}, true);
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
  if (d.is_meta()) return meta_op({&x, &gamma, &beta, &y, &mean, &rstd}, true);
  if (d.is_cpu())
    return on_cpu(
        [&](F32Staging& s) { cpu::layer_norm_forward(s.in(x), s.in(gamma), s.in(beta), s.out(y), mean, rstd, eps); });
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
  if (d.is_meta()) return meta_op({&x, &dy, &gamma, &mean, &rstd, &dx, &dgamma, &dbeta}, true);
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) {
      cpu::layer_norm_backward(s.in(x), s.in(dy), s.in(gamma), mean, rstd, s.out(dx), s.inout(dgamma), s.inout(dbeta));
    });
  STRATA_CUDA_OP(d, layer_norm_backward, x, dy, gamma, mean, rstd, dx, dgamma, dbeta);
}

// ---- language models -------------------------------------------------------------------------

namespace {
// tokens i32 (B, T); returns nothing, checks the shape only (values are checked by the kernels).
void check_tokens(const Tensor& tokens) {
  check_defined(tokens, "tokens");
  STRATA_CHECK(tokens.dtype() == DType::I32 && tokens.ndim() == 2, "tokens must be i32 (B, T), got ", tokens.str());
}

// A position table (Tmax, D) with Tmax >= t.
void check_position_table(const Tensor& wpe, int64_t t, int64_t d, const char* name) {
  STRATA_CHECK(wpe.ndim() == 2 && wpe.dim(0) >= t && wpe.dim(1) == d, name, " must be (Tmax >= ", t, ", ", d, "), got ",
               wpe.str());
}

// q (B, H, T, Dh) of a float dtype; k, v, y (and the gradients) the same shape and dtype.
void check_heads(const Tensor& q, std::initializer_list<std::pair<const Tensor*, const char*>> like) {
  check_float(q, "q");
  STRATA_CHECK(q.ndim() == 4, "attention tensors must be (B, H, T, Dh), got q ", q.str());
  for (const auto& [t, name] : like) {
    check_same_dtype(*t, q, name);
    check_shape(*t, q.shape(), name);
  }
}

void check_attention_dropout(float p, const DropoutKey& key, const Tensor& q) {
  STRATA_CHECK(p >= 0.0f && p <= 1.0f, "attention dropout probability must be in [0, 1], got ", p);
  STRATA_CHECK(key.first_sample >= 0, "first_sample must be >= 0, got ", key.first_sample);
  // A slice of the layer's heads must lie inside them (heads 0: q holds all of them).
  STRATA_CHECK(key.heads == 0 ? key.first_head == 0 : key.first_head >= 0 && key.first_head + q.dim(1) <= key.heads,
               "attention dropout key: heads ", key.first_head, "..", key.first_head + q.dim(1), " of ", key.heads);
}

// probs (B, H, T, T): f32 or the dtype of q.
void check_probs(const Tensor& probs, const Tensor& q) {
  check_defined(probs, "probs");
  check_grad_dtype(probs, q, "probs");
  check_shape(probs, Shape{q.dim(0), q.dim(1), q.dim(2), q.dim(2)}, "probs");
}

// lse f32 (B, H, T).
void check_lse(const Tensor& lse, const Tensor& q) {
  check_f32(lse, "lse");
  check_shape(lse, Shape{q.dim(0), q.dim(1), q.dim(2)}, "lse");
}

// Outputs must not share storage with the inputs (the kernels read inputs after writing).
void check_no_alias(std::initializer_list<const Tensor*> outputs, std::initializer_list<const Tensor*> inputs) {
  for (const Tensor* o : outputs)
    for (const Tensor* i : inputs)
      STRATA_CHECK(!o->defined() || !i->defined() || !o->same_storage(*i),
                   "attention outputs must not share storage with its inputs (", o->str(), " and ", i->str(), ")");
}
}  // namespace

void embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe, const Tensor& y, int64_t first_token,
                       int64_t vocab) {
  check_tokens(tokens);
  check_float(wte, "wte");
  STRATA_CHECK(wte.ndim() == 2, "wte must be (V, D), got ", wte.str());
  const int64_t b = tokens.dim(0), t = tokens.dim(1), d = wte.dim(1);
  if (vocab == 0) vocab = wte.dim(0);
  STRATA_CHECK(first_token >= 0 && first_token + wte.dim(0) <= vocab, "wte's ", wte.dim(0), " rows from token ",
               first_token, " do not fit a vocabulary of ", vocab);
  if (wpe.defined()) {
    check_same_dtype(wpe, wte, "wpe");
    check_position_table(wpe, t, d, "wpe");
  }
  check_same_dtype(y, wte, "y");
  check_shape(y, Shape{b, t, d}, "y");
  const Device dev = common_device({&tokens, &wte, &wpe, &y});
  if (dev.is_meta()) return meta_op({&tokens, &wte, &wpe, &y}, true);
  if (dev.is_cpu())
    return on_cpu([&](F32Staging& s) {
      cpu::embedding_forward(tokens, s.in(wte), wpe.defined() ? s.in(wpe) : Tensor(), s.out(y), first_token, vocab);
    });
  STRATA_CUDA_OP(dev, embedding_forward, tokens, wte, wpe, y, first_token, vocab);
}

void embedding_backward(const Tensor& tokens, const Tensor& dy, const Tensor& dwte, const Tensor& dwpe,
                        int64_t first_token) {
  check_tokens(tokens);
  check_float(dy, "dy");
  const int64_t b = tokens.dim(0), t = tokens.dim(1);
  STRATA_CHECK(dy.ndim() == 3 && dy.dim(0) == b && dy.dim(1) == t, "dy must be (", b, ", ", t, ", D), got ", dy.str());
  const int64_t d = dy.dim(2);
  STRATA_CHECK(first_token >= 0, "first_token must be >= 0, got ", first_token);
  if (dwte.defined()) {
    check_grad_dtype(dwte, dy, "dwte");
    STRATA_CHECK(dwte.ndim() == 2 && dwte.dim(1) == d, "dwte must be (V, ", d, "), got ", dwte.str());
  }
  if (dwpe.defined()) {
    check_grad_dtype(dwpe, dy, "dwpe");
    check_position_table(dwpe, t, d, "dwpe");
  }
  const Device dev = common_device({&tokens, &dy, &dwte, &dwpe});
  if (dev.is_meta()) return meta_op({&tokens, &dy, &dwte, &dwpe}, true);
  if (dev.is_cpu())
    return on_cpu(
        [&](F32Staging& s) { cpu::embedding_backward(tokens, s.in(dy), s.inout(dwte), s.inout(dwpe), first_token); });
  STRATA_CUDA_OP(dev, embedding_backward, tokens, dy, dwte, dwpe, first_token);
}

namespace {
// qkv (B, T, 3 * H * Dh) and q, k, v (B, H, T, Dh) of one float dtype.
void check_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v, const char* qkv_name,
               const char* q_name, const char* k_name, const char* v_name) {
  check_float(q, q_name);
  STRATA_CHECK(q.ndim() == 4, q_name, " must be (B, H, T, Dh), got ", q.str());
  check_same_dtype(k, q, k_name);
  check_shape(k, q.shape(), k_name);
  check_same_dtype(v, q, v_name);
  check_shape(v, q.shape(), v_name);
  check_same_dtype(qkv, q, qkv_name);
  check_shape(qkv, Shape{q.dim(0), q.dim(2), 3 * q.dim(1) * q.dim(3)}, qkv_name);
}

// x (B, H, T, Dh) and y (B, T, H * Dh) of one float dtype.
void check_heads_layout(const Tensor& x, const Tensor& y) {
  check_float(x, "x");
  STRATA_CHECK(x.ndim() == 4, "x must be (B, H, T, Dh), got ", x.str());
  check_same_dtype(y, x, "y");
  check_shape(y, Shape{x.dim(0), x.dim(2), x.dim(1) * x.dim(3)}, "y");
}
}  // namespace

void split_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v) {
  check_qkv(qkv, q, k, v, "qkv", "q", "k", "v");
  const Device d = common_device({&qkv, &q, &k, &v});
  if (d.is_meta()) return meta_op({&qkv, &q, &k, &v}, false);
  if (d.is_cpu()) return cpu::split_qkv(qkv, q, k, v);  // a copy: any float dtype as is
  STRATA_CUDA_OP(d, split_qkv, qkv, q, k, v);
}

void merge_qkv(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv) {
  check_qkv(dqkv, dq, dk, dv, "dqkv", "dq", "dk", "dv");
  const Device d = common_device({&dq, &dk, &dv, &dqkv});
  if (d.is_meta()) return meta_op({&dq, &dk, &dv, &dqkv}, false);
  if (d.is_cpu()) return cpu::merge_qkv(dq, dk, dv, dqkv);
  STRATA_CUDA_OP(d, merge_qkv, dq, dk, dv, dqkv);
}

void merge_heads(const Tensor& x, const Tensor& y) {
  check_heads_layout(x, y);
  const Device d = common_device({&x, &y});
  if (d.is_meta()) return meta_op({&x, &y}, false);
  if (d.is_cpu()) return cpu::merge_heads(x, y);
  STRATA_CUDA_OP(d, merge_heads, x, y);
}

void split_heads(const Tensor& y, const Tensor& x) {
  check_heads_layout(x, y);
  const Device d = common_device({&y, &x});
  if (d.is_meta()) return meta_op({&y, &x}, false);
  if (d.is_cpu()) return cpu::split_heads(y, x);
  STRATA_CUDA_OP(d, split_heads, y, x);
}

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& probs, float p,
                       const DropoutKey& key) {
  check_heads(q, {{&k, "k"}, {&v, "v"}, {&y, "y"}});
  check_probs(probs, q);
  check_attention_dropout(p, key, q);
  check_no_alias({&y, &probs}, {&q, &k, &v});
  const Device d = common_device({&q, &k, &v, &y, &probs});
  if (d.is_meta()) return meta_op({&q, &k, &v, &y, &probs}, true);
  if (d.is_cpu())
    return on_cpu(
        [&](F32Staging& s) { cpu::attention_forward(s.in(q), s.in(k), s.in(v), s.out(y), s.out(probs), p, key); });
  STRATA_CUDA_OP(d, attention_forward, q, k, v, y, probs, p, key);
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& probs, const Tensor& dy,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, float p, const DropoutKey& key) {
  check_heads(q, {{&k, "k"}, {&v, "v"}, {&dy, "dy"}, {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}});
  check_probs(probs, q);
  check_attention_dropout(p, key, q);
  check_no_alias({&dq, &dk, &dv}, {&q, &k, &v, &probs, &dy});
  const Device d = common_device({&q, &k, &v, &probs, &dy, &dq, &dk, &dv});
  if (d.is_meta()) return meta_op({&q, &k, &v, &probs, &dy, &dq, &dk, &dv}, true);
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) {
      cpu::attention_backward(s.in(q), s.in(k), s.in(v), s.in(probs), s.in(dy), s.out(dq), s.out(dk), s.out(dv), p,
                              key);
    });
  STRATA_CUDA_OP(d, attention_backward, q, k, v, probs, dy, dq, dk, dv, p, key);
}

void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                             float p, const DropoutKey& key) {
  check_heads(q, {{&k, "k"}, {&v, "v"}, {&y, "y"}});
  check_lse(lse, q);
  check_attention_dropout(p, key, q);
  check_no_alias({&y, &lse}, {&q, &k, &v});
  const Device d = common_device({&q, &k, &v, &y, &lse});
  if (d.is_meta()) return meta_op({&q, &k, &v, &y, &lse}, true);
  if (d.is_cpu())
    return on_cpu(
        [&](F32Staging& s) { cpu::flash_attention_forward(s.in(q), s.in(k), s.in(v), s.out(y), lse, p, key); });
  STRATA_CUDA_OP(d, flash_attention_forward, q, k, v, y, lse, p, key);
}

void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                              const Tensor& dy, const Tensor& dq, const Tensor& dk, const Tensor& dv, float p,
                              const DropoutKey& key) {
  check_heads(q, {{&k, "k"}, {&v, "v"}, {&y, "y"}, {&dy, "dy"}, {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}});
  check_lse(lse, q);
  check_attention_dropout(p, key, q);
  check_no_alias({&dq, &dk, &dv}, {&q, &k, &v, &y, &lse, &dy});
  const Device d = common_device({&q, &k, &v, &y, &lse, &dy, &dq, &dk, &dv});
  if (d.is_meta()) return meta_op({&q, &k, &v, &y, &lse, &dy, &dq, &dk, &dv}, true);
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) {
      cpu::flash_attention_backward(s.in(q), s.in(k), s.in(v), s.in(y), lse, s.in(dy), s.out(dq), s.out(dk), s.out(dv),
                                    p, key);
    });
  STRATA_CUDA_OP(d, flash_attention_backward, q, k, v, y, lse, dy, dq, dk, dv, p, key);
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
}  // namespace

double softmax_xent_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs) {
  check_logits_labels(logits, labels, "logits");
  check_float(probs, "probs");
  check_shape(probs, logits.shape(), "probs");
  const Device d = common_device({&logits, &labels, &probs});
  if (d.is_meta()) return meta_op({&logits, &labels, &probs}, true), 0;
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) { return cpu::softmax_xent_forward(s.in(logits), labels, s.out(probs)); });
  STRATA_CUDA_OP(d, softmax_xent_forward, logits, labels, probs);
}

void softmax_xent_backward(const Tensor& probs, const Tensor& labels, const Tensor& dlogits, float scale) {
  check_logits_labels(probs, labels, "probs");
  check_float(dlogits, "dlogits");
  check_shape(dlogits, probs.shape(), "dlogits");
  const Device d = common_device({&probs, &labels, &dlogits});
  if (d.is_meta()) return meta_op({&probs, &labels, &dlogits}, true);
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) { cpu::softmax_xent_backward(s.in(probs), labels, s.out(dlogits), scale); });
  STRATA_CUDA_OP(d, softmax_xent_backward, probs, labels, dlogits, scale);
}

int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  check_logits_labels(logits, labels, "logits");
  const Device d = common_device({&logits, &labels});
  if (d.is_meta()) return meta_op({&logits, &labels}, true), 0;
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { return cpu::count_correct(s.in(logits), labels); });
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
