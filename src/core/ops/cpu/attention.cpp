// CPU language-model ops: token + position embedding, the head layout copies, and causal
// scaled dot-product attention in two forms, parallel over (batch, head):
// - plain: the (T, T) probabilities of each head are materialised (OpenBLAS sgemm for q k^T,
//   p v and the backward products) and kept for backward;
// - memory-efficient (FlashAttention-2's algorithm): query tiles of kTile rows against key
//   tiles of kTile columns with an online softmax; only each row's log-sum-exp is saved, and
//   backward recomputes the probabilities tile by tile with D_i = rowsum(dy * y). bf16 heads on
//   a CPU with bf16 units stay bf16 and every tile product runs on the units where oneDNN has
//   fast kernels for the tiles (flash_tiles_on_units); otherwise a head is staged in f32 at a
//   time and its products run through OpenBLAS.
// Both draw the same attention-dropout mask from (key, stream, global index); everything is
// sequential within one head, so results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "core/ops/cpu/cpu_ops.hpp"
#include "core/ops/cpu/vec_math.hpp"
#include "core/rng.hpp"

namespace strata::ops::cpu {

// The softmax loops of a row, as span kernels at the CPU's vector width (STRATA_KERNEL_CLONES;
// this file builds without FP contraction), written so that their bits do not depend on it.

// out = exp(x - m), for m >= every x (out may be x); returns the sum, added in 16 fixed lanes and
// then in order (any vector width holds whole lanes, so the order is the same on every CPU).
STRATA_KERNEL_CLONES float exp_and_sum(const float* x, float* out, int64_t n, float m) {
  constexpr int64_t kLanes = 16;
  float lanes[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      const float e = vec_math::exp_nonpositive(x[c + l] - m);
      out[c + l] = e;
      lanes[l] += e;
    }
  }
  float sum = 0.0f;
  for (const float lane : lanes) sum += lane;
  for (; c < n; ++c) {
    out[c] = vec_math::exp_nonpositive(x[c] - m);
    sum += out[c];
  }
  return sum;
}

// max(x[0..n)), n > 0, in 16 fixed lanes (a vector maximum: GCC does not vectorise a max
// reduction without -ffinite-math-only). A maximum is exact in any order; with a NaN in x the
// softmax that subtracts it is NaN whatever it returns.
STRATA_KERNEL_CLONES float max_of(const float* x, int64_t n) {
  constexpr int64_t kLanes = 16;
  float m = x[0];
  int64_t c = 0;
  if (n >= kLanes) {
    float lanes[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = x[l];
    for (c = kLanes; c + kLanes <= n; c += kLanes) {
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], x[c + l]);
    }
    for (const float lane : lanes) m = std::max(m, lane);
  }
  for (; c < n; ++c) m = std::max(m, x[c]);
  return m;
}

// The memory-efficient backward's row of a tile: P = exp(s - lse) from the scores, then with
// the dropout factors f (nullptr: none) s = P f (what multiplied v) and g = P (g f - d) (dS from
// d(dropped P)).
STRATA_KERNEL_CLONES void softmax_backward_row(float* s, float* g, const float* f, int64_t n, float lse, float d) {
  if (f == nullptr) {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) {
      const float p = vec_math::exp_nonpositive(s[c] - lse);
      s[c] = p;
      g[c] = p * (g[c] - d);
    }
    return;
  }
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    const float p = vec_math::exp_nonpositive(s[c] - lse);
    s[c] = p * f[c];
    g[c] = p * (g[c] * f[c] - d);
  }
}

namespace {

// ---- embedding helpers -----------------------------------------------------------------------

void check_token_values(const Tensor& tokens, int64_t vocab) {
  const int32_t* tok = tokens.data<int32_t>();
  const int64_t t = tokens.dim(1), n = tokens.numel();
  for (int64_t i = 0; i < n; ++i)
    STRATA_REQUIRE(tok[i] >= 0 && tok[i] < vocab, "token ", tok[i], " at (", i / t, ", ", i % t, ") is outside [0, ",
                   vocab, ")");
}

// ---- head layout -----------------------------------------------------------------------------

// Copies run r of `count` runs: run (b, h, t) of `row` bytes between the (B, H, T, row) layout
// and a (B, T, stride) layout where it starts at column `col` (bytes) of row (b, t).
struct HeadRuns {
  int64_t b, h, t, row, stride;
  // Byte offsets of run (b, h, t) in the head-major and in the token-major layout.
  int64_t head_major(int64_t bi, int64_t hi, int64_t ti) const { return ((bi * h + hi) * t + ti) * row; }
  int64_t token_major(int64_t bi, int64_t hi, int64_t ti, int64_t col) const {
    return (bi * t + ti) * stride + col + hi * row;
  }
};

// to_heads: token-major -> head-major, else back.
void copy_heads(const char* src, char* dst, const HeadRuns& r, int64_t col, bool to_heads) {
  parallel_rows(r.b * r.t, r.h * r.row / 4, [&](int64_t bt) {
    const int64_t bi = bt / r.t, ti = bt % r.t;
    for (int64_t hi = 0; hi < r.h; ++hi) {
      const int64_t hm = r.head_major(bi, hi, ti), tm = r.token_major(bi, hi, ti, col);
      if (to_heads)
        std::memcpy(dst + hm, src + tm, static_cast<size_t>(r.row));
      else
        std::memcpy(dst + tm, src + hm, static_cast<size_t>(r.row));
    }
  });
}

// ---- attention helpers -----------------------------------------------------------------------

// Query rows and key columns per tile of the memory-efficient kernels, by head type: on one core
// (B 8, H 4, Dh 64) OpenBLAS's f32 products ran T = 256 ... 2048 fastest in tiles of 64, the bf16
// units in tiles of 128 (1.3x 64's speed at T = 1024, as fast as 256).
template <class T>
constexpr int64_t kTile = std::is_same_v<T, bf16> ? 128 : 64;

// c (m, n) = alpha * op(a) op(b) + beta * c, row-major with leading dimensions: one OpenBLAS
// call on this thread, so a head's results do not depend on the thread count.
void mm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
        int64_t ldb, float beta, float* c, int64_t ldc) {
  sgemm_one_thread(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

std::unique_ptr<float[]> buffer(int64_t n) { return std::unique_ptr<float[]>(new float[static_cast<size_t>(n)]); }

// The attention-dropout mask of one head: factor(i, j) is 1 / (1 - p) where (i, j) is kept,
// 0 where dropped; element (i, j) of head (b, h) has the global index
// ((first_sample + b) * H + h) * T * T + i * T + j, h and H counting the layer's heads
// (DropoutKey::first_head, heads) when the op holds a tensor-parallel slice of them.
struct HeadDropout {
  bool active;
  float p, scale;
  uint64_t key, stream, base, t;

  HeadDropout(float p_, const DropoutKey& k, int64_t bi, int64_t hi, int64_t heads, int64_t t_)
      : active(p_ > 0.0f),
        p(p_),
        scale(p_ < 1.0f ? 1.0f / (1.0f - p_) : 0.0f),
        key(k.key),
        stream(k.stream),
        base(
            static_cast<uint64_t>(((k.first_sample + bi) * (k.heads ? k.heads : heads) + k.first_head + hi) * t_ * t_)),
        t(static_cast<uint64_t>(t_)) {}

  // f[c] = factor(i, j0 + c) for c in [0, n): one Philox call per 4 consecutive indices,
  // the values rng::uniform(key, stream, index) would give.
  void row(int64_t i, int64_t j0, int64_t n, float* f) const {
    uint64_t idx = base + static_cast<uint64_t>(i) * t + static_cast<uint64_t>(j0);
    int64_t c = 0;
    while (c < n) {
      uint32_t out[4];
      rng::Philox::generate(key, static_cast<uint32_t>(idx >> 2), static_cast<uint32_t>(idx >> 34),
                            static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32), out);
      for (uint64_t lane = idx & 3; lane < 4 && c < n; ++lane, ++c, ++idx)
        f[c] = rng::to_unit_float(out[lane]) >= p ? scale : 0.0f;
    }
  }
};

// q's heads (B, H, T, Dh) and k's (B, Hkv, T, Dh): query head h of sample b reads kv head
// h / group of that sample (grouped-query attention; group 1: multi-head).
struct Heads {
  int64_t b, h, hkv, t, dh, group;
  float scale;  // 1 / sqrt(Dh)
  Heads(const Tensor& q, const Tensor& k)
      : b(q.dim(0)),
        h(q.dim(1)),
        hkv(k.dim(1)),
        t(q.dim(2)),
        dh(q.dim(3)),
        group(q.dim(1) / k.dim(1)),
        scale(1.0f / std::sqrt(static_cast<float>(q.dim(3)))) {}
  int64_t count() const { return b * h; }
  // The kv head (b * Hkv + h / group) that query head bh = b * H + h reads.
  int64_t kv_of(int64_t bh) const { return bh / h * hkv + bh % h / group; }
  // The query heads reading kv head bkv = b * Hkv + j: [first, first + group).
  int64_t first_query(int64_t bkv) const { return bkv / hkv * h + bkv % hkv * group; }
  HeadDropout dropout(int64_t bh, float p, const DropoutKey& key) const { return {p, key, bh / h, bh % h, h, t}; }
};

float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

float dot(const bf16* a, const bf16* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i].to_float() * b[i].to_float();
  return acc;
}

// ---- the memory-efficient kernels' heads and tile operands ------------------------------------
// Heads are T: float (f32 tensors, or bf16 and f16 ones staged in f32 a head at a time; products
// through OpenBLAS) or bf16 (bf16 tensors on a CPU with bf16 units: read in place, products on
// the units through oneDNN, f32 sums). Scores, probabilities and their gradients are f32 tiles;
// over bf16 heads a tile is rounded to bf16 before it is multiplied, as FlashAttention does on
// GPUs, so that every product runs on the units.

// Elements [first, first + n) of a head, as T.
template <class T>
const T* head(const Tensor& t, int64_t first, int64_t n, std::vector<float>& scratch);
template <>
const float* head<float>(const Tensor& t, int64_t first, int64_t n, std::vector<float>& scratch) {
  return f32_row(t, first, n, scratch);
}
template <>
const bf16* head<bf16>(const Tensor& t, int64_t first, int64_t /*n*/, std::vector<float>& /*scratch*/) {
  return t.data<bf16>() + first;
}

// The same product of bf16 operands on the bf16 units, into an f32 c.
void mm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const bf16* a, int64_t lda, const bf16* b,
        int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm_bf16_one_thread(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, DType::F32, ldc);
}

// An f32 tile s (rows, cols), dense, as an operand of a product over T heads: itself, or rounded
// to bf16 into `rounded`. (Tiles are dense, their rows cols apart: oneDNN runs its fast kernels
// only into a dense result.)
const float* operand(const float* s, int64_t /*rows*/, int64_t /*cols*/, std::vector<float>& /*rounded*/) { return s; }
const bf16* operand(const float* s, int64_t rows, int64_t cols, std::vector<bf16>& rounded) {
  rounded.resize(static_cast<size_t>(rows * cols));
  cast_span(s, DType::F32, rounded.data(), DType::BF16, rows * cols);
  return rounded.data();
}

}  // namespace

// ---- embedding -------------------------------------------------------------------------------

void embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe, const Tensor& y, int64_t first_token,
                       int64_t vocab) {
  const int64_t t = tokens.dim(1), n = tokens.numel(), d = wte.dim(1), rows = wte.dim(0);
  check_token_values(tokens, vocab);
  const int32_t* tok = tokens.data<int32_t>();
  const float* te = wte.data<float>();
  const float* pe = wpe.defined() ? wpe.data<float>() : nullptr;
  float* out = y.data<float>();
  parallel_rows(n, d, [&](int64_t i) {
    const int64_t r = tok[i] - first_token;  // wte's row, if it holds this token
    float* row = out + i * d;
    if (r < 0 || r >= rows)
      std::fill(row, row + d, 0.0f);
    else
      std::copy(te + r * d, te + (r + 1) * d, row);
    if (pe)
      for (int64_t c = 0; c < d; ++c) row[c] += pe[(i % t) * d + c];
  });
}

void embedding_backward(const Tensor& tokens, const Tensor& dy, const Tensor& dwte, const Tensor& dwpe,
                        int64_t first_token) {
  const int64_t b = tokens.dim(0), t = tokens.dim(1), n = tokens.numel(), d = dy.dim(2);
  const float* g = dy.data<float>();
  if (dwpe.defined()) {  // row t owned by one thread, samples added in order
    float* out = dwpe.data<float>();
    parallel_rows(t, b * d, [&](int64_t ti) {
      float* row = out + ti * d;
      for (int64_t bi = 0; bi < b; ++bi) {
        const float* src = g + (bi * t + ti) * d;
        for (int64_t c = 0; c < d; ++c) row[c] += src[c];
      }
    });
  }
  if (dwte.defined()) {
    // Column chunks owned by one thread each; every element sums its positions in order, so
    // the result does not depend on the chunking (no atomics).
    const int32_t* tok = tokens.data<int32_t>();
    float* out = dwte.data<float>();
    const int64_t rows = dwte.dim(0);
    constexpr int64_t kChunk = 64;
    const int64_t chunks = (d + kChunk - 1) / kChunk;
    parallel_rows(chunks, n * kChunk, [&](int64_t ch) {
      const int64_t c0 = ch * kChunk, c1 = std::min(d, c0 + kChunk);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = tok[i] - first_token;  // forward reported tokens outside the vocabulary
        if (r < 0 || r >= rows) continue;
        float* row = out + r * d;
        const float* src = g + i * d;
        for (int64_t c = c0; c < c1; ++c) row[c] += src[c];
      }
    });
  }
}

// ---- head layout -----------------------------------------------------------------------------

void split_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t es = static_cast<int64_t>(dtype_size(q.dtype()));
  const int64_t h = q.dim(1), dh = q.dim(3);
  const HeadRuns r{q.dim(0), h, q.dim(2), dh * es, 3 * h * dh * es};
  const char* src = static_cast<const char*>(qkv.raw());
  copy_heads(src, static_cast<char*>(q.raw()), r, 0, true);
  copy_heads(src, static_cast<char*>(k.raw()), r, h * dh * es, true);
  copy_heads(src, static_cast<char*>(v.raw()), r, 2 * h * dh * es, true);
}

void merge_qkv(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv) {
  const int64_t es = static_cast<int64_t>(dtype_size(dq.dtype()));
  const int64_t h = dq.dim(1), dh = dq.dim(3);
  const HeadRuns r{dq.dim(0), h, dq.dim(2), dh * es, 3 * h * dh * es};
  char* dst = static_cast<char*>(dqkv.raw());
  copy_heads(static_cast<const char*>(dq.raw()), dst, r, 0, false);
  copy_heads(static_cast<const char*>(dk.raw()), dst, r, h * dh * es, false);
  copy_heads(static_cast<const char*>(dv.raw()), dst, r, 2 * h * dh * es, false);
}

void merge_heads(const Tensor& x, const Tensor& y) {
  const int64_t es = static_cast<int64_t>(dtype_size(x.dtype()));
  const HeadRuns r{x.dim(0), x.dim(1), x.dim(2), x.dim(3) * es, x.dim(1) * x.dim(3) * es};
  copy_heads(static_cast<const char*>(x.raw()), static_cast<char*>(y.raw()), r, 0, false);
}

void split_heads(const Tensor& y, const Tensor& x) {
  const int64_t es = static_cast<int64_t>(dtype_size(x.dtype()));
  const HeadRuns r{x.dim(0), x.dim(1), x.dim(2), x.dim(3) * es, x.dim(1) * x.dim(3) * es};
  copy_heads(static_cast<const char*>(y.raw()), static_cast<char*>(x.raw()), r, 0, true);
}

// ---- plain attention -------------------------------------------------------------------------

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& probs, float p,
                       const DropoutKey& key) {
  const Heads hd(q, k);
  const int64_t t = hd.t, dh = hd.dh;
  if (hd.count() == 0 || t == 0) return;
  parallel_rows(hd.count(), t * t * dh, [&](int64_t bh) {
    const float* qh = q.data<float>() + bh * t * dh;
    const float* kh = k.data<float>() + hd.kv_of(bh) * t * dh;
    const float* vh = v.data<float>() + hd.kv_of(bh) * t * dh;
    float* yh = y.data<float>() + bh * t * dh;
    float* ph = probs.data<float>() + bh * t * t;
    const HeadDropout drop = hd.dropout(bh, p, key);
    mm(false, true, t, t, dh, hd.scale, qh, dh, kh, dh, 0.0f, ph, t);  // scores, then probabilities in place
    auto dropped = drop.active ? buffer(t * t) : nullptr;
    for (int64_t i = 0; i < t; ++i) {
      float* row = ph + i * t;
      float mx = row[0];
      for (int64_t j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
      const float inv = 1.0f / exp_and_sum(row, row, i + 1, mx);
      for (int64_t j = 0; j <= i; ++j) row[j] *= inv;
      std::fill(row + i + 1, row + t, 0.0f);
      if (!dropped) continue;
      float* d = dropped.get() + i * t;
      drop.row(i, 0, i + 1, d);
      for (int64_t j = 0; j <= i; ++j) d[j] *= row[j];
      std::fill(d + i + 1, d + t, 0.0f);
    }
    mm(false, false, t, dh, t, 1.0f, dropped ? dropped.get() : ph, t, vh, dh, 0.0f, yh, dh);
  });
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& probs, const Tensor& dy,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, float p, const DropoutKey& key) {
  const Heads hd(q, k);
  const int64_t t = hd.t, dh = hd.dh;
  if (hd.count() == 0 || t == 0) return;
  // One task per kv head: its query heads in order, dk and dv summed over them (no races).
  parallel_rows(hd.b * hd.hkv, hd.group * t * t * dh, [&](int64_t bkv) {
    const int64_t kv_off = bkv * t * dh;
    const float* kh = k.data<float>() + kv_off;
    const float* vh = v.data<float>() + kv_off;
    auto ds = buffer(t * t);
    auto dropped = p > 0.0f ? buffer(t * t) : nullptr;
    auto factor = p > 0.0f ? buffer(t) : nullptr;
    for (int64_t g = 0; g < hd.group; ++g) {
      const int64_t bh = hd.first_query(bkv) + g, off = bh * t * dh;
      const float* qh = q.data<float>() + off;
      const float* gh = dy.data<float>() + off;
      const float* ph = probs.data<float>() + bh * t * t;
      const HeadDropout drop = hd.dropout(bh, p, key);
      // d(dropped probabilities) = dy v^T; then dP = that * mask, dS = P * (dP - rowsum(P * dP)).
      mm(false, true, t, t, dh, 1.0f, gh, dh, vh, dh, 0.0f, ds.get(), t);
      for (int64_t i = 0; i < t; ++i) {
        const float* pr = ph + i * t;
        float* gr = ds.get() + i * t;
        if (drop.active) {
          float* d = dropped.get() + i * t;
          drop.row(i, 0, i + 1, factor.get());
          for (int64_t j = 0; j <= i; ++j) {
            d[j] = pr[j] * factor[j];
            gr[j] *= factor[j];
          }
          std::fill(d + i + 1, d + t, 0.0f);
        }
        const float di = dot(pr, gr, i + 1);
        for (int64_t j = 0; j <= i; ++j) gr[j] = pr[j] * (gr[j] - di);
        std::fill(gr + i + 1, gr + t, 0.0f);
      }
      const float beta = g == 0 ? 0.0f : 1.0f;  // the group's first query head overwrites dk, dv
      mm(true, false, t, dh, t, 1.0f, drop.active ? dropped.get() : ph, t, gh, dh, beta, dv.data<float>() + kv_off, dh);
      mm(false, false, t, dh, t, hd.scale, ds.get(), t, kh, dh, 0.0f, dq.data<float>() + off, dh);
      mm(true, false, t, dh, t, hd.scale, ds.get(), t, qh, dh, beta, dk.data<float>() + kv_off, dh);
    }
  });
}

// ---- memory-efficient attention --------------------------------------------------------------

namespace {

template <class T>
void flash_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse, float p,
                   const DropoutKey& key) {
  const Heads hd(q, k);
  const int64_t t = hd.t, dh = hd.dh;
  if (hd.count() == 0 || t == 0) return;
  constexpr int64_t tile = kTile<T>;
  parallel_rows(hd.count(), t * t * dh, [&](int64_t bh) {
    const int64_t off = bh * t * dh, n = t * dh;
    thread_local std::vector<float> q_head, k_head, v_head, y_head;  // staged heads (head<float>)
    thread_local std::vector<T> rounded;                             // operand()'s
    const T* qh = head<T>(q, off, n, q_head);
    const T* kh = head<T>(k, hd.kv_of(bh) * n, n, k_head);
    const T* vh = head<T>(v, hd.kv_of(bh) * n, n, v_head);
    float* yh = f32_out_row(y, off, n, y_head);
    float* lh = lse.data<float>() + bh * t;
    const HeadDropout drop = hd.dropout(bh, p, key);
    // Per head: a score tile, the output accumulator of a query tile, its running max and sum.
    auto s = buffer(tile * tile), acc = buffer(tile * dh), mrow = buffer(tile), lrow = buffer(tile),
         factor = buffer(tile);
    for (int64_t i0 = 0; i0 < t; i0 += tile) {
      const int64_t nr = std::min(tile, t - i0);
      std::fill(acc.get(), acc.get() + nr * dh, 0.0f);
      std::fill(mrow.get(), mrow.get() + nr, -std::numeric_limits<float>::infinity());
      std::fill(lrow.get(), lrow.get() + nr, 0.0f);
      for (int64_t j0 = 0; j0 < i0 + nr; j0 += tile) {  // key tiles up to the last query row
        const int64_t nc = std::min(tile, t - j0);
        mm(false, true, nr, nc, dh, hd.scale, qh + i0 * dh, dh, kh + j0 * dh, dh, 0.0f, s.get(), nc);
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t i = i0 + r, valid = std::clamp<int64_t>(i - j0 + 1, 0, nc);  // causal: j <= i
          float* sr = s.get() + r * nc;
          if (valid > 0) {
            const float mt = max_of(sr, valid);
            const float mnew = std::max(mrow[r], mt), alpha = vec_math::exp_nonpositive(mrow[r] - mnew);
            if (alpha != 1.0f) {
              lrow[r] *= alpha;
              float* ar = acc.get() + r * dh;
              for (int64_t c = 0; c < dh; ++c) ar[c] *= alpha;
            }
            mrow[r] = mnew;
            lrow[r] += exp_and_sum(sr, sr, valid, mnew);
            if (drop.active) {
              drop.row(i, j0, valid, factor.get());
              for (int64_t c = 0; c < valid; ++c) sr[c] *= factor[c];
            }
          }
          std::fill(sr + valid, sr + nc, 0.0f);
        }
        mm(false, false, nr, dh, nc, 1.0f, operand(s.get(), nr, nc, rounded), nc, vh + j0 * dh, dh, 1.0f, acc.get(),
           dh);
      }
      for (int64_t r = 0; r < nr; ++r) {
        const float inv = 1.0f / lrow[r];
        const float* ar = acc.get() + r * dh;
        float* yr = yh + (i0 + r) * dh;
        for (int64_t c = 0; c < dh; ++c) yr[c] = ar[c] * inv;
        lh[i0 + r] = mrow[r] + std::log(lrow[r]);
      }
    }
    store_row(yh, y, off, n);
  });
}

}  // namespace

bool flash_tiles_on_units(const Tensor& q) {
  if (q.dtype() != DType::BF16 || bf16_matrix_units().empty()) return false;
  const int64_t dh = q.dim(3), n = std::min(kTile<bf16>, q.dim(2));
  const float scale = Heads(q, q).scale;
  const auto brgemm = [&](bool ta, bool tb, int64_t rows, int64_t cols, int64_t depth, float alpha, int64_t lda,
                          int64_t ldb, float beta, int64_t ldc) {
    return bf16_product_is_brgemm(ta, tb, rows, cols, depth, alpha, lda, ldb, beta, DType::F32, ldc);
  };
  return brgemm(false, true, n, n, dh, scale, dh, dh, 0.0f, n) &&   // s = scale q k^T
         brgemm(false, true, n, n, dh, 1.0f, dh, dh, 0.0f, n) &&    // d(P) = dy v^T
         brgemm(false, false, n, dh, n, 1.0f, n, dh, 1.0f, dh) &&   // acc += P v
         brgemm(true, false, n, dh, n, 1.0f, n, dh, 1.0f, dh) &&    // dv += P^T dy
         brgemm(false, false, n, dh, n, scale, n, dh, 1.0f, dh) &&  // dq += scale dS k
         brgemm(true, false, n, dh, n, scale, n, dh, 1.0f, dh);     // dk += scale dS^T q
}

void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                             float p, const DropoutKey& key) {
  if (flash_tiles_on_units(q)) return flash_forward<bf16>(q, k, v, y, lse, p, key);
  flash_forward<float>(q, k, v, y, lse, p, key);
}

namespace {

template <class T>
void flash_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                    const Tensor& dy, const Tensor& dq, const Tensor& dk, const Tensor& dv, float p,
                    const DropoutKey& key) {
  const Heads hd(q, k);
  const int64_t t = hd.t, dh = hd.dh;
  if (hd.count() == 0 || t == 0) return;
  constexpr int64_t tile = kTile<T>;
  // One task per kv head: its query heads in order, dk and dv summed over them (no races).
  parallel_rows(hd.b * hd.hkv, hd.group * t * t * dh, [&](int64_t bkv) {
    const int64_t kv_off = bkv * t * dh, n = t * dh;
    // Staged heads (head<float>) and the gradients' f32 sums.
    thread_local std::vector<float> k_head, v_head, dk_head, dv_head, q_head, y_head, dy_head, dq_head;
    thread_local std::vector<T> rounded_p, rounded_g;  // operand()'s
    const T* kh = head<T>(k, kv_off, n, k_head);
    const T* vh = head<T>(v, kv_off, n, v_head);
    float* dkh = f32_out_row(dk, kv_off, n, dk_head);
    float* dvh = f32_out_row(dv, kv_off, n, dv_head);
    std::fill(dkh, dkh + t * dh, 0.0f);
    std::fill(dvh, dvh + t * dh, 0.0f);
    auto drow = buffer(t), s = buffer(tile * tile), g = buffer(tile * tile), factor = buffer(tile);
    for (int64_t qi = 0; qi < hd.group; ++qi) {
      const int64_t bh = hd.first_query(bkv) + qi, off = bh * t * dh;
      const T* qh = head<T>(q, off, n, q_head);
      const T* yh = head<T>(y, off, n, y_head);
      const T* gh = head<T>(dy, off, n, dy_head);
      const float* lh = lse.data<float>() + bh * t;
      float* dqh = f32_out_row(dq, off, n, dq_head);
      const HeadDropout drop = hd.dropout(bh, p, key);
      // D_i = rowsum(dy * y) = rowsum(P * dP): the softmax backward's row term, without P.
      for (int64_t i = 0; i < t; ++i) drow[i] = dot(gh + i * dh, yh + i * dh, dh);
      std::fill(dqh, dqh + t * dh, 0.0f);
      for (int64_t j0 = 0; j0 < t; j0 += tile) {
        const int64_t nc = std::min(tile, t - j0);
        for (int64_t i0 = j0 / tile * tile; i0 < t; i0 += tile) {  // query tiles with rows >= j0
          const int64_t nr = std::min(tile, t - i0);
          mm(false, true, nr, nc, dh, hd.scale, qh + i0 * dh, dh, kh + j0 * dh, dh, 0.0f, s.get(), nc);
          mm(false, true, nr, nc, dh, 1.0f, gh + i0 * dh, dh, vh + j0 * dh, dh, 0.0f, g.get(), nc);
          for (int64_t r = 0; r < nr; ++r) {
            const int64_t i = i0 + r, valid = std::clamp<int64_t>(i - j0 + 1, 0, nc);
            float* sr = s.get() + r * nc;  // P, then the dropped P
            float* gr = g.get() + r * nc;  // d(dropped P), then dS
            if (drop.active) drop.row(i, j0, valid, factor.get());
            softmax_backward_row(sr, gr, drop.active ? factor.get() : nullptr, valid, lh[i], drow[i]);
            std::fill(sr + valid, sr + nc, 0.0f);
            std::fill(gr + valid, gr + nc, 0.0f);
          }
          const T* probs_tile = operand(s.get(), nr, nc, rounded_p);
          const T* ds_tile = operand(g.get(), nr, nc, rounded_g);
          mm(true, false, nc, dh, nr, 1.0f, probs_tile, nc, gh + i0 * dh, dh, 1.0f, dvh + j0 * dh, dh);
          mm(false, false, nr, dh, nc, hd.scale, ds_tile, nc, kh + j0 * dh, dh, 1.0f, dqh + i0 * dh, dh);
          mm(true, false, nc, dh, nr, hd.scale, ds_tile, nc, qh + i0 * dh, dh, 1.0f, dkh + j0 * dh, dh);
        }
      }
      store_row(dqh, dq, off, n);
    }
    store_row(dkh, dk, kv_off, n);
    store_row(dvh, dv, kv_off, n);
  });
}

}  // namespace

void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                              const Tensor& dy, const Tensor& dq, const Tensor& dk, const Tensor& dv, float p,
                              const DropoutKey& key) {
  if (flash_tiles_on_units(q)) return flash_backward<bf16>(q, k, v, y, lse, dy, dq, dk, dv, p, key);
  flash_backward<float>(q, k, v, y, lse, dy, dq, dk, dv, p, key);
}

}  // namespace strata::ops::cpu
