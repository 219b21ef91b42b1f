// The CPU kernels behind ops.hpp (internal). Arguments are already checked by ops.cpp: shapes,
// dtypes and devices match, tensors are contiguous host memory. Same names as the public ops.
#pragma once

#include <omp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/ops.hpp"

namespace strata::ops::cpu {

// Below this many elements a loop stays on the calling thread: waking a team costs more.
constexpr int64_t kParallelGrain = 1 << 15;

// Applies f(i) for i in [0, n): the CPU launcher for the functors in ops/functors.hpp.
// f is taken by value: a local copy cannot alias the output, so its pointers stay in
// registers and the loop vectorises.
template <class F>
void parallel_for(int64_t n, const F f) {
  if (n >= kParallelGrain && omp_get_max_threads() > 1) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) f(i);
  } else {
    for (int64_t i = 0; i < n; ++i) f(i);
  }
}

// Calls f(lo, hi) on one contiguous span of [0, n) per OpenMP thread, or f(0, n) on the calling
// thread when n is small: for kernels written over a span (see STRATA_KERNEL_CLONES).
template <class F>
void parallel_spans(int64_t n, const F& f) {
  if (n < kParallelGrain || omp_get_max_threads() == 1) return f(int64_t{0}, n);
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    f(n * t / threads, n * (t + 1) / threads);
  }
}

// A span kernel compiled once per x86 vector width, AVX-512, AVX2 and baseline SSE2, of which the
// dynamic loader keeps the widest this CPU runs (GCC's target_clones: an ifunc resolved at load),
// so one portable binary runs 512-bit code where it can. None of the three may fuse a multiply
// and an add (their files build with -ffp-contract=off: AVX-512F has FMA), so an element-wise
// kernel gives the same bits on every CPU; ops::cpu_kernel_isa() names the one chosen. Not under
// ThreadSanitizer: the resolver runs while the loader relocates, before TSan's runtime is up,
// and TSan's instrumentation of it crashes the program there.
#if defined(__x86_64__) && !defined(__AVX512F__) && !defined(__SANITIZE_THREAD__)
#define STRATA_KERNEL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define STRATA_HAS_KERNEL_CLONES 1
#else
#define STRATA_KERNEL_CLONES  // built for one CPU (-march), not x86, or under TSan: one version
#define STRATA_HAS_KERNEL_CLONES 0
#endif

// Runs f(r) for independent rows r in [0, rows) (planes, channels), each worth `row_work`
// elements, in parallel when there is enough work in total.
template <class F>
void parallel_rows(int64_t rows, int64_t row_work, const F& f) {
  if (rows > 1 && rows * row_work >= kParallelGrain && omp_get_max_threads() > 1) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) f(r);
  } else {
    for (int64_t r = 0; r < rows; ++r) f(r);
  }
}

// The thread count of every CPU kernel: OpenMP's. OpenBLAS itself stays on one thread; GEMMs
// are split across the OpenMP threads by sgemm() below.
void set_num_threads(int threads);
// Flush-to-zero and denormals-are-zero (x86's MXCSR; nothing elsewhere) on this thread and every
// OpenMP thread; threads created later inherit it from their creator.
void set_flush_denormals(bool on);

// c (m, n) = alpha op(a) op(b) + beta c, row-major with leading dimensions, through OpenBLAS.
// Outside a parallel region a large product is cut into one block of rows (or of columns,
// whichever dimension is larger) per OpenMP thread, each an OpenBLAS call on that thread, so
// all work runs on one thread pool: OpenBLAS's own pthreads, spinning after a GEMM while
// OpenMP's threads spun after a loop, took turns with them for the same cores (the GPT step on
// 2 threads ran at 1.2x one thread instead of 1.9x). Inside a parallel region, or when small,
// one call on the calling thread. The blocks are fixed by the thread count, so results are
// deterministic for a given count (as OpenBLAS's threading was; both differ from one thread's
// in the last bits).
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
// The same product as one OpenBLAS call on the calling thread, whatever the thread count
// (attention's per-head products: results independent of the thread count).
void sgemm_one_thread(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
std::string blas_kernel_warning();
// "AVX512-BF16" or "AMX-BF16" when oneDNN runs bf16 matrix products on this CPU's bf16 units
// (DNNL_MAX_CPU_ISA may lower it); empty otherwise (ops.hpp: bf16_matrix_units).
std::string bf16_matrix_units();
// The version of the span kernels (STRATA_KERNEL_CLONES) this CPU runs (ops.hpp: cpu_kernel_isa).
std::string kernel_isa();
// c = alpha op(a) op(b) + beta c for bf16 a and b and an f32 or bf16 c, through oneDNN's matmul
// (bf16 products, f32 accumulation, c rounded once), cut into blocks of rows across the OpenMP
// threads (oneDNN runs its fast brgemm kernels only into a dense result). Only where
// bf16_matrix_units() is non-empty: elsewhere oneDNN emulates the bf16 instructions at a third of
// OpenBLAS's f32 rate.
void gemm_bf16(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha, float beta);
// The same on row-major pointers with leading dimensions, c f32 or bf16 (c_dtype).
void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const bf16* a, int64_t lda,
               const bf16* b, int64_t ldb, float beta, void* c, DType c_dtype, int64_t ldc);
// The same product on the calling thread, whatever the thread count (attention's tiles: results
// independent of it). Each thread keeps the oneDNN primitive of each shape it has run.
void gemm_bf16_one_thread(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const bf16* a,
                          int64_t lda, const bf16* b, int64_t ldb, float beta, void* c, DType c_dtype, int64_t ldc);
// Whether oneDNN runs that product (same arguments, less the pointers) with one of its brgemm
// kernels, the units at full rate. Where it does not (a result that is not dense, for one) it
// picks its generic gemm, 3-5x slower: attention's 64 x 64 x 32 tiles took 5-15 us there.
bool bf16_product_is_brgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, int64_t lda,
                            int64_t ldb, float beta, DType c_dtype, int64_t ldc);
// Whether the memory-efficient attention kernels run q's (B, H, T, Dh) heads in bf16 on the bf16
// units: q is bf16, the CPU has units, and oneDNN has brgemm kernels for every tile product
// (bf16_product_is_brgemm); else the heads are staged in f32 for OpenBLAS.
bool flash_tiles_on_units(const Tensor& q);

void fill(const Tensor& x, float value);
void cast(const Tensor& x, const Tensor& y);
// n elements of dtype `from` to dtype `to` on the calling thread (f32 <-> bf16 at the CPU's
// vector width).
void cast_span(const void* in, DType from, void* out, DType to, int64_t n);
// Row-at-a-time f32 staging, for kernels over long rows (the loss over a vocabulary) that would
// otherwise widen and round whole tensors through memory; the same bits as staging the tensor.
// f32_row: elements [first, first + n) of t in f32, t's own where t is f32, else widened into
// scratch. f32_out_row: where a kernel writes that row in f32 (t's own, or scratch), which
// store_row then rounds into t (nothing to do where t is f32); f32_inout_row: the same, holding
// the row's values.
const float* f32_row(const Tensor& t, int64_t first, int64_t n, std::vector<float>& scratch);
float* f32_inout_row(const Tensor& t, int64_t first, int64_t n, std::vector<float>& scratch);
float* f32_out_row(const Tensor& t, int64_t first, int64_t n, std::vector<float>& scratch);
void store_row(const float* v, const Tensor& t, int64_t first, int64_t n);
// axpy: x f32 into f32 y, or bf16 x into a bf16 or f32 y (axpy_takes says which; bf16 staged
// a block at a time); add: f32 or bf16 (all one dtype).
bool axpy_takes(DType x, DType y);
void axpy(float alpha, const Tensor& x, const Tensor& y);
void add(const Tensor& a, const Tensor& b, const Tensor& y);
void scale(const Tensor& x, float alpha);
void normalize_u8(const Tensor& x, const Tensor& y, float in_scale, const std::vector<float>& mean,
                  const std::vector<float>& std);
// f32, or bf16 staged a block at a time.
void relu_forward(const Tensor& x, const Tensor& y);
void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx);
void gelu_forward(const Tensor& x, const Tensor& y);
void gelu_backward(const Tensor& x, const Tensor& dy, const Tensor& dx);
void gelu_tanh_forward(const Tensor& x, const Tensor& y);
void gelu_tanh_backward(const Tensor& x, const Tensor& dy, const Tensor& dx);
void dropout_forward(const Tensor& x, const Tensor& y, float p, const DropoutKey& key);
void dropout_backward(const Tensor& dy, const Tensor& dx, float p, const DropoutKey& key);

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha, float beta);
// The softmax row loops of attention and the loss (attention.cpp), span kernels that give the
// same bits at every vector width. max_of: the maximum of n > 0 values.
float max_of(const float* x, int64_t n);
float exp_and_sum(const float* x, float* out, int64_t n, float m);
void softmax_backward_row(float* s, float* g, const float* f, int64_t n, float lse, float d);
void add_bias(const Tensor& y, const Tensor& bias);
void bias_grad(const Tensor& dy, const Tensor& db);

void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y, const Conv2dGeometry& g);
void conv2d_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                     const Tensor& db, const Conv2dGeometry& g);
// bf16 x, w, bias, y (dy, dx) on a CPU with bf16 units (bf16_matrix_units()): the columns are
// unfolded in bf16 and the products run on the units (gemm_bf16) into f32, to which the bias is
// added and which col2im folds, rounded once; dw and db f32 or bf16.
void conv2d_forward_bf16(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y,
                         const Conv2dGeometry& g);
void conv2d_backward_bf16(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                          const Tensor& db, const Conv2dGeometry& g);

// f32, or bf16 staged a plane at a time.
void max_pool2d_forward(const Tensor& x, const Tensor& y, const Tensor& argmax, const Pool2dGeometry& g);
void max_pool2d_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx, const Pool2dGeometry& g);
void avg_pool2d_forward(const Tensor& x, const Tensor& y, const Pool2dGeometry& g);
void avg_pool2d_backward(const Tensor& dy, const Tensor& dx, const Pool2dGeometry& g);
void global_avg_pool_forward(const Tensor& x, const Tensor& y);
void global_avg_pool_backward(const Tensor& dy, const Tensor& dx);

void batch_norm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                              const Tensor& save_mean, const Tensor& save_invstd, const Tensor& running_mean,
                              const Tensor& running_var, float momentum, float eps);
void batch_norm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& running_mean,
                             const Tensor& running_var, const Tensor& y, float eps);
void batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta);
void layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y, const Tensor& mean,
                        const Tensor& rstd, float eps);
void layer_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean, const Tensor& rstd,
                         const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta);

void embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe, const Tensor& y, int64_t first_token,
                       int64_t vocab);
void embedding_backward(const Tensor& tokens, const Tensor& dy, const Tensor& dwte, const Tensor& dwpe,
                        int64_t first_token);
// Pure copies of any dtype (bytes moved as they are).
void split_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v);
void merge_qkv(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv);
void merge_heads(const Tensor& x, const Tensor& y);
void split_heads(const Tensor& y, const Tensor& x);
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& probs, float p,
                       const DropoutKey& key);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& probs, const Tensor& dy,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, float p, const DropoutKey& key);
void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                             float p, const DropoutKey& key);
void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                              const Tensor& dy, const Tensor& dq, const Tensor& dk, const Tensor& dv, float p,
                              const DropoutKey& key);

// Llama (ops/cpu/llama.cpp).
void rms_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd, float eps);
void rms_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& rstd, const Tensor& dx,
                       const Tensor& dgamma);
void rope(const Tensor& x, const Tensor& y, const std::vector<float>& inv_freq, int64_t first_position, bool inverse);
void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& y);
void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dy, const Tensor& dgate, const Tensor& dup);

double softmax_xent_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs);
void softmax_xent_backward(const Tensor& probs, const Tensor& labels, const Tensor& dlogits, float scale, int64_t first,
                           int64_t vocab);
void row_max(const Tensor& x, const Tensor& mx, const Tensor& argmax);
void softmax_slice_stats(const Tensor& x, const Tensor& labels, int64_t first, int64_t vocab, const Tensor& mx,
                         const Tensor& stats);
void softmax_slice(const Tensor& x, const Tensor& mx, const Tensor& stats, const Tensor& probs);
int64_t count_correct(const Tensor& logits, const Tensor& labels);

double sum_squares(const Tensor& x);
bool all_finite(const Tensor& x);
void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, const SgdParams& p);
void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                  const AdamWParams& p);

}  // namespace strata::ops::cpu
