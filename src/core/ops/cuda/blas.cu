// CUDA GEMM through cuBLAS (cublasGemmEx) on the compute stream: f32, bf16 and f16 inputs,
// always accumulating in f32; TF32 tensor cores for f32 only when ops::allow_tf32().
#include <algorithm>

#include "core/cuda/check.hpp"
#include "core/cuda/runtime.hpp"
#include "core/ops/cuda/cuda_ops.hpp"

namespace strata::ops::cuda {

namespace {
cudaDataType_t blas_type(DType t) {
  switch (t) {
    case DType::F32:
      return CUDA_R_32F;
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    default:
      STRATA_THROW("cuBLAS GEMM does not take ", dtype_name(t), " tensors");
  }
}
}  // namespace

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha, float beta) {
  // Row-major op(a) (M, K) @ op(b) (K, N) = c (M, N). cuBLAS is column-major, where our
  // row-major c is c^T (N, M) = op(b)^T @ op(a)^T: pass b first, then a, with unchanged
  // transpose flags, and each leading dimension is the stored row length.
  const int m = static_cast<int>(c.dim(0)), n = static_cast<int>(c.dim(1));
  const int k = static_cast<int>(trans_a ? a.dim(0) : a.dim(1));
  if (m == 0 || n == 0) return;
  const int device = c.device().index;
  DeviceGuard guard(device);
  DeviceContext& ctx = context(device);
  // Every dtype sums in f32; TF32 only rounds f32 inputs, so it changes nothing for bf16/f16.
  const cublasComputeType_t compute =
      a.dtype() == DType::F32 && ops::allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const auto ld = [](const Tensor& t) { return std::max(1, static_cast<int>(t.dim(1))); };  // >= 1 even if empty
  CUBLAS_CHECK(cublasGemmEx(ctx.cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m,
                            k, &alpha, b.raw(), blas_type(b.dtype()), ld(b), a.raw(), blas_type(a.dtype()), ld(a),
                            &beta, c.raw(), blas_type(c.dtype()), n, compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace strata::ops::cuda
