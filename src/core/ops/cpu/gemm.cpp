// CPU dense ops: GEMM through OpenBLAS (row-major cblas_sgemm) and, for bf16 operands on a CPU
// with bf16 units, oneDNN's matmul; both split across the OpenMP threads the same way. Bias add
// and bias gradient.
#include <cblas.h>
#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <string>
#include <unordered_map>

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

// Calls block(row0, rows, col0, cols) for the parts of the (m, n) product c, one per OpenMP
// thread (sgemm's comment says how they are cut; only by rows where rows_only), or once for all
// of it on the calling thread.
template <class Block>
void split_product(int64_t m, int64_t n, int64_t k, const Block& block, bool rows_only = false) {
  if (m == 0 || n == 0) return;
  const bool by_rows = rows_only || m >= n;
  const int64_t total = by_rows ? m : n;
  const int64_t threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t parts = std::min(threads, total / kBlockAlign);
  if (parts < 2 || static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) <= kParallelMnk) {
    block(0, m, 0, n);
    return;
  }
  const int64_t size = ((total + parts - 1) / parts + kBlockAlign - 1) / kBlockAlign * kBlockAlign;
#pragma omp parallel for schedule(static) num_threads(static_cast <int>(parts))
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t lo = std::min(total, p * size), hi = std::min(total, lo + size);
    if (hi <= lo) continue;
    if (by_rows)
      block(lo, hi - lo, 0, n);
    else
      block(0, m, lo, hi - lo);
  }
}

const dnnl::engine& dnnl_cpu() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// A oneDNN matmul of one shape, compiled once per thread: building the primitive (descriptors,
// implementation dispatch, oneDNN's own cache lookup) costs ~10 us, more than a 64^3 attention
// tile's product on the bf16 units; executing a kept one costs little more than the product.
struct Bf16Matmul {
  dnnl::matmul primitive;
  dnnl::memory a, b, c;
  bool brgemm;  // one of oneDNN's brgemm kernels runs it (impl_info_str "brg:...")
};

struct Bf16MatmulShape {
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;
  DType c_dtype;
  bool operator==(const Bf16MatmulShape& o) const {
    return ta == o.ta && tb == o.tb && m == o.m && n == o.n && k == o.k && lda == o.lda && ldb == o.ldb &&
           ldc == o.ldc && alpha == o.alpha && beta == o.beta && c_dtype == o.c_dtype;
  }
};

struct Bf16MatmulShapeHash {
  size_t operator()(const Bf16MatmulShape& s) const {
    size_t h = std::hash<int64_t>()(s.m);
    for (const int64_t v : {s.n, s.k, s.lda, s.ldb, s.ldc, int64_t{s.ta} * 2 + s.tb, static_cast<int64_t>(s.c_dtype)})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h * 1000003u ^ std::hash<float>()(s.alpha) ^ std::hash<float>()(s.beta) << 1;
  }
};

Bf16Matmul make_bf16_matmul(const Bf16MatmulShape& s) {
  using dims = dnnl::memory::dims;
  using dt = dnnl::memory::data_type;
  const dnnl::memory::desc ad({s.m, s.k}, dt::bf16, s.ta ? dims{1, s.lda} : dims{s.lda, 1});
  const dnnl::memory::desc bd({s.k, s.n}, dt::bf16, s.tb ? dims{1, s.ldb} : dims{s.ldb, 1});
  const dnnl::memory::desc cd({s.m, s.n}, s.c_dtype == DType::F32 ? dt::f32 : dt::bf16, dims{s.ldc, 1});
  dnnl::primitive_attr attr;
  if (s.alpha != 1.0f) attr.set_output_scales(0, {s.alpha});
  if (s.beta != 0.0f) {
    dnnl::post_ops sum;
    sum.append_sum(s.beta);
    attr.set_post_ops(sum);
  }
  const dnnl::engine& engine = dnnl_cpu();
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), attr, engine);
  return {dnnl::matmul(pd), dnnl::memory(ad, engine, DNNL_MEMORY_NONE), dnnl::memory(bd, engine, DNNL_MEMORY_NONE),
          dnnl::memory(cd, engine, DNNL_MEMORY_NONE), std::string(pd.impl_info_str()).rfind("brg", 0) == 0};
}

// oneDNN threads a primitive over omp_get_max_threads() outside a parallel region, both when it
// is built (its blocking) and when it runs: one thread for both, while this lives.
struct OneOmpThread {
  const int threads = omp_get_max_threads();
  OneOmpThread() { omp_set_num_threads(1); }
  ~OneOmpThread() { omp_set_num_threads(threads); }
};

// This thread's primitive for a shape, built at its first use. A run meets a handful of shapes
// (its layers', attention's tiles); the bound only keeps a program that varies them without end
// from growing.
Bf16Matmul& kept_matmul(const Bf16MatmulShape& shape) {
  constexpr size_t kMaxShapes = 256;
  thread_local std::unordered_map<Bf16MatmulShape, Bf16Matmul, Bf16MatmulShapeHash> kept;
  auto it = kept.find(shape);
  if (it == kept.end()) {
    if (kept.size() >= kMaxShapes) kept.clear();
    it = kept.emplace(shape, make_bf16_matmul(shape)).first;
  }
  return it->second;
}

}  // namespace

void gemm_bf16_one_thread(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const bf16* a, int64_t lda,
                          const bf16* b, int64_t ldb, float beta, void* c, DType c_dtype, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const OneOmpThread one_thread;
  Bf16Matmul& mm = kept_matmul({ta, tb, m, n, k, lda, ldb, ldc, alpha, beta, c_dtype});
  mm.a.set_data_handle(const_cast<bf16*>(a));
  mm.b.set_data_handle(const_cast<bf16*>(b));
  mm.c.set_data_handle(c);
  thread_local dnnl::stream stream(dnnl_cpu());
  mm.primitive.execute(stream, {{DNNL_ARG_SRC, mm.a}, {DNNL_ARG_WEIGHTS, mm.b}, {DNNL_ARG_DST, mm.c}});
}

bool bf16_product_is_brgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, int64_t lda, int64_t ldb,
                            float beta, DType c_dtype, int64_t ldc) {
  const OneOmpThread one_thread;
  return kept_matmul({ta, tb, m, n, k, lda, ldb, ldc, alpha, beta, c_dtype}).brgemm;
}

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  split_product(m, n, k, [&](int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
    sgemm_one_thread(trans_a, trans_b, rows, cols, k, alpha, trans_a ? a + r0 : a + r0 * lda, lda,
                     trans_b ? b + c0 * ldb : b + c0, ldb, beta, c + r0 * ldc + c0, ldc);
  });
}

std::string bf16_matrix_units() {
  static const std::string isa = [] {
    try {
      switch (dnnl::get_effective_cpu_isa()) {
        case dnnl::cpu_isa::avx512_core_bf16:
          return std::string("AVX512-BF16");
        case dnnl::cpu_isa::avx512_core_amx:
          return std::string("AMX-BF16");
        default:
          return std::string();
      }
    } catch (const dnnl::error&) {
      return std::string();
    }
  }();
  return isa;
}

void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const bf16* a, int64_t lda,
               const bf16* b, int64_t ldb, float beta, void* c, DType c_dtype, int64_t ldc) {
  const size_t c_size = dtype_size(c_dtype);
  auto* pc = static_cast<char*>(c);
  std::atomic<bool> failed{false};
  std::string error;
  // Cut by rows only: oneDNN 2.6 runs its brgemm kernels only into a dense result, and a block of
  // columns of c is not one (its generic gemm ran the tied head's logits 3x slower on 2 threads).
  split_product(
      m, n, k,
      [&](int64_t r0, int64_t rows, int64_t /*c0*/, int64_t /*cols*/) {
        try {  // an exception must not leave an OpenMP region
          gemm_bf16_one_thread(trans_a, trans_b, rows, n, k, alpha, trans_a ? a + r0 : a + r0 * lda, lda, b, ldb, beta,
                               pc + static_cast<size_t>(r0 * ldc) * c_size, c_dtype, ldc);
        } catch (const dnnl::error& e) {
          if (!failed.exchange(true)) error = e.what();
        }
      },
      /*rows_only=*/true);
  if (failed) STRATA_THROW("oneDNN bf16 matmul ", m, "x", n, "x", k, " failed: ", error);
}

void gemm_bf16(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha, float beta) {
  const int64_t m = c.dim(0), n = c.dim(1), k = trans_a ? a.dim(0) : a.dim(1);
  gemm_bf16(trans_a, trans_b, m, n, k, alpha, a.data<bf16>(), a.dim(1), b.data<bf16>(), b.dim(1), beta, c.raw(),
            c.dtype(), n);
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

// Both on any float dtypes, staged in f32 a row at a time (f32_row).
void add_bias(const Tensor& y, const Tensor& bias) {
  // y (N, F) += bias (F)
  const int64_t f = bias.numel(), rows = f > 0 ? y.numel() / f : 0;
  std::vector<float> bias_scratch;
  const float* b = f32_row(bias, 0, f, bias_scratch);
  parallel_rows(rows, f, [&](int64_t r) {
    thread_local std::vector<float> scratch;
    float* row = f32_inout_row(y, r * f, f, scratch);
    for (int64_t j = 0; j < f; ++j) row[j] += b[j];
    store_row(row, y, r * f, f);
  });
}

void bias_grad(const Tensor& dy, const Tensor& db) {
  // db (F) += column sums of dy (N, F); row by row so the inner loop is contiguous, on one
  // thread so that the sums do not depend on the thread count.
  const int64_t f = db.numel(), rows = f > 0 ? dy.numel() / f : 0;
  std::vector<float> sum_scratch, row_scratch;
  float* out = f32_inout_row(db, 0, f, sum_scratch);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = f32_row(dy, r * f, f, row_scratch);
    for (int64_t j = 0; j < f; ++j) out[j] += row[j];
  }
  store_row(out, db, 0, f);
}

}  // namespace strata::ops::cpu
