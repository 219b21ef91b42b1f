// CPU dense ops: GEMM through OpenBLAS (row-major cblas_sgemm), bias add and bias gradient.
#include <cblas.h>

#include "core/ops/cpu/cpu_ops.hpp"

namespace strata::ops::cpu {

void set_num_threads(int threads) {
  openblas_set_num_threads(threads);
  omp_set_num_threads(threads);
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
