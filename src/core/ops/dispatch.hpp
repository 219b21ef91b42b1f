// What the ops' front doors (ops.cpp, ops_conv_norm.cpp, ops_attention.cpp) share: argument
// checks, the f32 staging of CPU kernels, meta tensors for memory planning, and the dispatch to
// CUDA. Private to src/core.
#pragma once

#include <climits>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/allocator.hpp"
#include "core/ops.hpp"
#include "core/ops/cpu/cpu_ops.hpp"
#if STRATA_WITH_CUDA
#include "core/ops/cuda/cuda_ops.hpp"
#endif

namespace strata::ops::dispatch {

#if STRATA_WITH_CUDA
#define STRATA_CUDA_OP(device, op, ...) return cuda::op(__VA_ARGS__)
#else
#define STRATA_CUDA_OP(device, op, ...) \
  STRATA_THROW("ops::", #op, " on ", (device).str(), " in a build without CUDA (configure with -DSTRATA_CUDA=ON)")
#endif

inline bool is_float_type(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

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

inline void check_defined(const Tensor& t, const char* name) { STRATA_CHECK(t.defined(), name, " is undefined"); }

inline void check_f32(const Tensor& t, const char* name) {
  check_defined(t, name);
  STRATA_CHECK(t.dtype() == DType::F32, name, " must be f32, got ", t.str());
}

// Any float dtype (f32, bf16, f16).
inline void check_float(const Tensor& t, const char* name) {
  check_defined(t, name);
  STRATA_CHECK(is_float_type(t.dtype()), name, " must be a float tensor (f32, bf16 or f16), got ", t.str());
}

inline void check_shape(const Tensor& t, const Shape& shape, const char* name) {
  check_defined(t, name);
  STRATA_CHECK(t.shape() == shape, name, " must have shape ", shape_str(shape), ", got ", t.str());
}

inline void check_numel(const Tensor& t, const Tensor& like, const char* name) {
  STRATA_CHECK(t.numel() == like.numel(), name, " has ", t.numel(), " elements, expected ", like.numel(), " (", t.str(),
               " vs ", like.str(), ")");
}

// The compute dtype of `like` (an activation or a parameter).
inline void check_same_dtype(const Tensor& t, const Tensor& like, const char* name) {
  check_defined(t, name);
  STRATA_CHECK(t.dtype() == like.dtype(), name, " must be ", dtype_name(like.dtype()), " like the input, got ",
               t.str());
}

// Same dtype as `like` and the same element count.
inline void check_like(const Tensor& t, const Tensor& like, const char* name) {
  check_same_dtype(t, like, name);
  check_numel(t, like, name);
}

// A parameter gradient: f32, or the compute dtype of `activation`.
inline void check_grad_dtype(const Tensor& t, const Tensor& activation, const char* name) {
  STRATA_CHECK(t.dtype() == DType::F32 || t.dtype() == activation.dtype(), name, " must be f32 or ",
               dtype_name(activation.dtype()), ", got ", t.str());
}

// f32 with the same number of elements as `like`.
inline void check_f32_like(const Tensor& t, const Tensor& like, const char* name) {
  check_f32(t, name);
  check_numel(t, like, name);
}

// The device all defined tensors share.
inline Device common_device(std::initializer_list<const Tensor*> tensors) {
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

inline void check_blas_size(int64_t n, const char* what) {
  STRATA_CHECK(n >= 0 && n <= INT_MAX, what, " ", n, " exceeds the BLAS integer range");
}

// Optional per-channel / per-feature vector of the compute dtype of `like`: undefined or n
// elements.
inline void check_optional_param(const Tensor& t, int64_t n, const Tensor& like, const char* name) {
  if (!t.defined()) return;
  check_shape(t, Shape{n}, name);
  check_same_dtype(t, like, name);
}

// Optional parameter gradient vector: undefined, or n elements of f32 or the compute dtype.
inline void check_optional_grad(const Tensor& t, int64_t n, const Tensor& like, const char* name) {
  if (!t.defined()) return;
  check_shape(t, Shape{n}, name);
  check_grad_dtype(t, like, name);
}

// Optional f32 statistics vector of n elements.
inline void check_optional_stat(const Tensor& t, int64_t n, const char* name) {
  if (!t.defined()) return;
  check_shape(t, Shape{n}, name);
  check_f32(t, name);
}

// Meta tensors (memory planning): no kernel runs. Planning for the CPU, the op also allocates,
// for its duration, the f32 scratch that on_cpu's F32Staging gives its bf16/f16 tensors
// (`staged`: the CPU branch goes through on_cpu), so the plan's peak is the CPU allocator's.
inline void meta_op(std::initializer_list<const Tensor*> tensors, bool staged) {
  if (!staged || !meta_allocator().host_staging()) return;
  std::vector<Tensor> scratch;
  for (const Tensor* t : tensors)
    if (t->defined() && is_float_type(t->dtype()) && t->dtype() != DType::F32)
      scratch.push_back(Tensor::empty(t->shape(), DType::F32, Device::meta()));
}

}  // namespace strata::ops::dispatch
