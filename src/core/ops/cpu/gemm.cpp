// CPU dense ops: GEMM through OpenBLAS (row-major cblas_sgemm), bias add and bias gradient.
#include <cblas.h>

#include <cstdlib>
#include <string>

#include "core/ops/cpu/cpu_ops.hpp"

namespace strata::ops::cpu {

void set_num_threads(int threads) {
  openblas_set_num_threads(threads);
  omp_set_num_threads(threads);
}

std::string blas_kernel_warning() {
  const std::string kernels = openblas_get_corename();
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  if (kernels != "Prescott" || (coretype != nullptr && *coretype != '\0')) return "";
  __builtin_cpu_init();
  const char* better = __builtin_cpu_supports("avx512bw") ? "SkylakeX"
                       : __builtin_cpu_supports("avx2")   ? "Haswell"
                                                          : nullptr;
  if (better == nullptr) return "";
  return std::string(
             "OpenBLAS does not recognise this CPU and runs its generic Prescott kernels (GEMM 3-4x slower); "
             "start with OPENBLAS_CORETYPE=") +
         better + " (mpirun -x OPENBLAS_CORETYPE=" + better + ")";
}

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha, float beta) {
  // op(a) (M, K), op(b) (K, N), c (M, N); lda/ldb are the stored row lengths.
  const int m = static_cast<int>(c.dim(0)), n = static_cast<int>(c.dim(1));
  const int k = static_cast<int>(trans_a ? a.dim(0) : a.dim(1));
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha,
              a.data<float>(), static_cast<int>(a.dim(1)), b.data<float>(), static_cast<int>(b.dim(1)), beta,
              c.data<float>(), n);
}

void add_bias(const Tensor& y, const Tensor& bias) {
  // y (N, F) += bias (F)
  const int64_t f = bias.numel(), rows = f > 0 ? y.numel() / f : 0;
  float* out = y.data<float>();
  const float* b = bias.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = out + r * f;
    for (int64_t j = 0; j < f; ++j) row[j] += b[j];
  }
}

void bias_grad(const Tensor& dy, const Tensor& db) {
  // db (F) += column sums of dy (N, F); row by row so the inner loop is contiguous.
  const int64_t f = db.numel(), rows = f > 0 ? dy.numel() / f : 0;
  const float* g = dy.data<float>();
  float* out = db.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = g + r * f;
    for (int64_t j = 0; j < f; ++j) out[j] += row[j];
  }
}

}  // namespace strata::ops::cpu
