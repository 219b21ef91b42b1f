// CPU dense ops: GEMM through OpenBLAS (row-major cblas_sgemm, split across the OpenMP threads),
// bias add and bias gradient.
#include <cblas.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/ops/cpu/cpu_ops.hpp"

namespace strata::ops::cpu {

void set_num_threads(int threads) {
  openblas_set_num_threads(1);  // one thread pool: see sgemm
  omp_set_num_threads(threads);
}

void set_flush_denormals(bool on) {
#if defined(__x86_64__) || defined(__i386__)
  const auto apply = [on] {
    constexpr unsigned kFtzDaz = 0x8040;  // MXCSR bit 15: flush to zero; bit 6: denormals are zero
    _mm_setcsr(on ? (_mm_getcsr() | kFtzDaz) : (_mm_getcsr() & ~kFtzDaz));
  };
  apply();
#pragma omp parallel
  apply();
#else
  (void)on;
#endif
}

void sgemm_one_thread(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                      const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  // Also without set_num_threads (tests, tools): OpenBLAS's own pool must stay unused.
  static const bool single_threaded_blas = (openblas_set_num_threads(1), true);
  (void)single_threaded_blas;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

namespace {

// Products below this many multiply-adds stay on one thread (OpenBLAS's own threshold: 4 x 65536).
constexpr double kParallelMnk = 262144.0;
constexpr int64_t kBlockAlign = 16;  // rows or columns per block: a multiple of the kernels' unrolling

}  // namespace

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const bool by_rows = m >= n;
  const int64_t total = by_rows ? m : n;
  const int64_t threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t parts = std::min(threads, total / kBlockAlign);
  if (parts < 2 || static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) <= kParallelMnk) {
    sgemm_one_thread(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const int64_t block = ((total + parts - 1) / parts + kBlockAlign - 1) / kBlockAlign * kBlockAlign;
#pragma omp parallel for schedule(static) num_threads(static_cast <int>(parts))
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t lo = std::min(total, p * block), hi = std::min(total, lo + block);
    if (hi <= lo) continue;
    if (by_rows)  // rows lo..hi of op(a) and c
      sgemm_one_thread(trans_a, trans_b, hi - lo, n, k, alpha, trans_a ? a + lo : a + lo * lda, lda, b, ldb, beta,
                       c + lo * ldc, ldc);
    else  // columns lo..hi of op(b) and c
      sgemm_one_thread(trans_a, trans_b, m, hi - lo, k, alpha, a, lda, trans_b ? b + lo * ldb : b + lo, ldb, beta,
                       c + lo, ldc);
  }
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
  sgemm(trans_a, trans_b, m, n, k, alpha, a.data<float>(), a.dim(1), b.data<float>(), b.dim(1), beta, c.data<float>(),
        n);
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
