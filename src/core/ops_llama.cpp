// The Llama family's ops: RMSNorm, rotary position embeddings, the SwiGLU gate. Each checks its
// arguments, then dispatches on the device (ops.cpp explains the dtype rules). CPU only so far:
// on a GPU they stop with a clear error rather than run a second, untested copy of the math.
#include "core/ops/dispatch.hpp"

namespace strata::ops {

using namespace dispatch;

namespace {
// The CUDA kernels of these ops are still to be written.
[[noreturn]] void no_cuda(const Device& d, const char* op) {
  STRATA_THROW("ops::", op, " has no kernel for ", d.str(), " yet (the Llama ops run on the CPU)");
}

int64_t check_rms_input(const Tensor& x, const Tensor& y, const char* y_name) {
  check_float(x, "x");
  STRATA_CHECK(x.ndim() >= 1 && x.dim(-1) > 0, "RMSNorm input must be (..., F) with F > 0, got ", x.str());
  check_same_dtype(y, x, y_name);
  check_shape(y, x.shape(), y_name);
  return x.dim(-1);
}
}  // namespace

void rms_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd, float eps) {
  const int64_t f = check_rms_input(x, y, "y");
  check_defined(gamma, "gamma");
  check_optional_param(gamma, f, x, "gamma");
  if (rstd.defined()) check_f32(rstd, "rstd");
  STRATA_CHECK(!rstd.defined() || rstd.numel() == x.numel() / f, "rstd must hold one value per row, got ", rstd.str());
  const Device d = common_device({&x, &gamma, &y, &rstd});
  if (d.is_meta()) return meta_op({&x, &gamma, &y, &rstd}, true);
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) { cpu::rms_norm_forward(s.in(x), s.in(gamma), s.out(y), rstd, eps); });
  no_cuda(d, "rms_norm_forward");
}

void rms_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& rstd, const Tensor& dx,
                       const Tensor& dgamma) {
  const int64_t f = check_rms_input(x, dy, "dy");
  if (dx.defined()) check_rms_input(x, dx, "dx");
  check_defined(gamma, "gamma");
  check_optional_param(gamma, f, x, "gamma");
  check_optional_grad(dgamma, f, x, "dgamma");
  check_f32(rstd, "rstd");
  STRATA_CHECK(rstd.numel() == x.numel() / f, "rstd must hold one value per row, got ", rstd.str());
  const Device d = common_device({&x, &dy, &gamma, &rstd, &dx, &dgamma});
  if (d.is_meta()) return meta_op({&x, &dy, &gamma, &rstd, &dx, &dgamma}, true);
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) {
      cpu::rms_norm_backward(s.in(x), s.in(dy), s.in(gamma), rstd, s.out(dx), s.inout(dgamma));
    });
  no_cuda(d, "rms_norm_backward");
}

void rope(const Tensor& x, const Tensor& y, const std::vector<float>& inv_freq, int64_t first_position, bool inverse) {
  check_float(x, "x");
  STRATA_CHECK(x.ndim() == 4 && x.dim(3) % 2 == 0, "rope expects (B, H, T, Dh) with Dh even, got ", x.str());
  check_same_dtype(y, x, "y");
  check_shape(y, x.shape(), "y");
  STRATA_CHECK(static_cast<int64_t>(inv_freq.size()) == x.dim(3) / 2, "rope needs ", x.dim(3) / 2,
               " frequencies for heads of ", x.dim(3), ", got ", inv_freq.size());
  STRATA_CHECK(first_position >= 0, "rope: first position ", first_position);
  const Device d = common_device({&x, &y});
  if (d.is_meta()) return meta_op({&x, &y}, true);
  // In place works on every dtype: the kernel reads a pair before writing it, and staging widens x first.
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) { cpu::rope(s.in(x), s.out(y), inv_freq, first_position, inverse); });
  no_cuda(d, "rope");
}

void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& y) {
  check_float(gate, "gate");
  for (const auto& [t, name] : {std::pair{&up, "up"}, std::pair{&y, "y"}}) {
    check_same_dtype(*t, gate, name);
    check_shape(*t, gate.shape(), name);
  }
  const Device d = common_device({&gate, &up, &y});
  if (d.is_meta()) return meta_op({&gate, &up, &y}, true);
  if (d.is_cpu()) return on_cpu([&](F32Staging& s) { cpu::swiglu_forward(s.in(gate), s.in(up), s.out(y)); });
  no_cuda(d, "swiglu_forward");
}

void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dy, const Tensor& dgate, const Tensor& dup) {
  check_float(gate, "gate");
  for (const auto& [t, name] :
       {std::pair{&up, "up"}, std::pair{&dy, "dy"}, std::pair{&dgate, "dgate"}, std::pair{&dup, "dup"}}) {
    check_same_dtype(*t, gate, name);
    check_shape(*t, gate.shape(), name);
  }
  const Device d = common_device({&gate, &up, &dy, &dgate, &dup});
  if (d.is_meta()) return meta_op({&gate, &up, &dy, &dgate, &dup}, true);
  if (d.is_cpu())
    return on_cpu(
        [&](F32Staging& s) { cpu::swiglu_backward(s.in(gate), s.in(up), s.in(dy), s.out(dgate), s.out(dup)); });
  no_cuda(d, "swiglu_backward");
}

}  // namespace strata::ops
