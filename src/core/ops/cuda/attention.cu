// CUDA language-model ops: token + position embedding, the head layout copies, and causal
// attention (plain and memory-efficient). Straightforward kernels, correct first: one block
// per (query row, batch * head) or (key row, batch * head), f32 arithmetic on any float
// storage type. No floating-point atomics anywhere, so every result repeats bit for bit:
// - embedding backward: one block per vocabulary row scans the tokens in order (chunks
//   without a hit are skipped with one __syncthreads_or), one thread per (t, column) of wpe;
// - plain attention keeps the probabilities (B, H, T, T); backward writes dS to scratch and
//   then reduces columns per key row;
// - memory-efficient attention walks tiles of blockDim keys with an online softmax (O(Dh +
//   blockDim) shared memory per block, only lse saved); backward recomputes P per tile, once
//   for dq (per query row) and once for dk, dv (per key row), FlashAttention-2's D_i =
//   rowsum(dy * y) in a first kernel.
#include <climits>

#include "core/ops/cuda/cuda_ops.hpp"
#include "core/ops/cuda/launch.cuh"
#include "core/rng.hpp"

namespace strata::ops::cuda {

namespace {

constexpr int kThreads = 128;  // attention blocks: keys (or queries) per tile
constexpr int kEmbedThreads = 256;
constexpr int kEmbedCols = 8;  // columns per thread per pass in the wte gradient
constexpr size_t kMaxShared = 48 * 1024;

// ---- embedding -------------------------------------------------------------------------------

// wte's row w is token first + w (a vocabulary-parallel slice); other tokens add zero; wpe may
// be null.
template <class T>
__global__ void embedding_forward_kernel(const int32_t* tok, const T* wte, const T* wpe, T* y, int64_t n, int64_t t,
                                         int64_t d, int64_t first, int64_t rows, int64_t vocab,
                                         unsigned long long* bad) {
  const int64_t total = n * d, stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t r = i / d, c = i - r * d;
    const int32_t token = tok[r];
    if (token < 0 || token >= vocab) {
      y[i] = fn::from_f32<T>(NAN);
      if (c == 0) atomicMin(bad, static_cast<unsigned long long>(r));
      continue;
    }
    const int64_t w = token - first;
    const float e = w >= 0 && w < rows ? fn::to_f32(wte[w * d + c]) : 0.0f;
    y[i] = fn::from_f32<T>(wpe ? e + fn::to_f32(wpe[(r % t) * d + c]) : e);
  }
}

// dwpe[t][c] += sum over b of dy[b][t][c], samples in order.
template <class T, class G>
__global__ void embedding_wpe_grad_kernel(const T* dy, G* dwpe, int64_t b, int64_t t, int64_t d) {
  const int64_t total = t * d, stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    float acc = 0.0f;
    for (int64_t s = 0; s < b; ++s) acc += fn::to_f32(dy[s * total + i]);
    dwpe[i] = fn::from_f32<G>(fn::to_f32(dwpe[i]) + acc);
  }
}

// Block w: dwte[w] (dwte's row w, token first + w) += dy at every position holding that token,
// positions in order.
template <class T, class G>
__global__ void embedding_wte_grad_kernel(const int32_t* tok, const T* dy, G* dwte, int64_t n, int64_t d,
                                          int64_t first) {
  __shared__ int hits[kEmbedThreads];
  const int64_t v = first + static_cast<int64_t>(blockIdx.x);
  const int64_t pass = static_cast<int64_t>(blockDim.x) * kEmbedCols;
  for (int64_t base = 0; base < d; base += pass) {
    float acc[kEmbedCols] = {};
    for (int64_t n0 = 0; n0 < n; n0 += blockDim.x) {
      const int64_t i = n0 + threadIdx.x;
      const int hit = i < n && tok[i] == v;
      hits[threadIdx.x] = hit;
      if (!__syncthreads_or(hit)) continue;  // uniform: no position of this chunk holds v
      const int64_t m = min(static_cast<int64_t>(blockDim.x), n - n0);
      for (int64_t s = 0; s < m; ++s) {
        if (!hits[s]) continue;
        const T* row = dy + (n0 + s) * d;
        for (int c = 0; c < kEmbedCols; ++c) {
          const int64_t col = base + threadIdx.x + static_cast<int64_t>(c) * blockDim.x;
          if (col < d) acc[c] += fn::to_f32(row[col]);
        }
      }
      __syncthreads();  // before `hits` is overwritten
    }
    for (int c = 0; c < kEmbedCols; ++c) {
      const int64_t col = base + threadIdx.x + static_cast<int64_t>(c) * blockDim.x;
      if (col < d) {
        G& out = dwte[static_cast<int64_t>(blockIdx.x) * d + col];  // the slice's row, not the token
        out = fn::from_f32<G>(fn::to_f32(out) + acc[c]);
      }
    }
  }
}

// ---- head layout -----------------------------------------------------------------------------

// Element (b, h, t, e) of the head-major (B, H, T, Dh) tensor <-> column col + h * Dh + e of
// row (b, t) of the token-major (B, T, stride) tensor.
template <class T>
__global__ void heads_copy_kernel(const T* src, T* dst, int64_t b, int64_t h, int64_t t, int64_t dh, int64_t stride,
                                  int64_t col, bool to_heads) {
  const int64_t total = b * h * t * dh, step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t e = i % dh, ti = (i / dh) % t, hi = (i / (dh * t)) % h, bi = i / (dh * t * h);
    const int64_t tm = (bi * t + ti) * stride + col + hi * dh + e;
    if (to_heads)
      dst[i] = src[tm];
    else
      dst[tm] = src[i];
  }
}

void heads_copy(const Tensor& src, const Tensor& dst, const Tensor& heads, int64_t stride, int64_t col, bool to_heads) {
  const int64_t total = heads.numel();
  if (total == 0) return;
  const OnDevice on(dst);
  with_float_type(heads.dtype(), [&](auto tag) {
    using T = decltype(tag);
    heads_copy_kernel<<<detail::grid_for(total), detail::kThreads, 0, on.stream>>>(
        src.data<T>(), dst.data<T>(), heads.dim(0), heads.dim(1), heads.dim(2), heads.dim(3), stride, col, to_heads);
    CUDA_CHECK(cudaGetLastError());
  });
}

// ---- attention -------------------------------------------------------------------------------

// The attention-dropout mask: factor 1 / (1 - p) where (b, h, i, j) is kept, 0 where dropped,
// from the global index ((first_sample + b) * H + h) * T * T + i * T + j (ops.hpp), h and H
// counting the layer's heads (DropoutKey::first_head, heads) when q holds a slice of them.
struct Dropout {
  bool active;
  float p, scale;
  uint64_t key, stream;
  int64_t first, heads, all_heads, first_head, t;  // heads: the op's; all_heads: the layer's
  __device__ float factor(int64_t bh, int64_t i, int64_t j) const {
    if (!active) return 1.0f;
    const int64_t b = bh / heads, h = bh - b * heads;
    const uint64_t index = static_cast<uint64_t>(((first + b) * all_heads + first_head + h) * t * t + i * t + j);
    return rng::uniform(key, stream, index) >= p ? scale : 0.0f;
  }
};

Dropout make_dropout(float p, const DropoutKey& key, int64_t heads, int64_t t) {
  return Dropout{p > 0.0f,         p,     p < 1.0f ? 1.0f / (1.0f - p) : 0.0f, key.key,        key.stream,
                 key.first_sample, heads, key.heads ? key.heads : heads,       key.first_head, t};
}

template <class T>
__device__ float dot_row(const float* a, const T* b, int64_t n) {
  float acc = 0.0f;
  for (int64_t e = 0; e < n; ++e) acc += a[e] * fn::to_f32(b[e]);
  return acc;
}

template <class T>
__device__ void load_row(float* dst, const T* src, int64_t n) {
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) dst[e] = fn::to_f32(src[e]);
}

// Plain forward, block (i, bh): probabilities of row i, then y_i = sum_j P_ij f_ij v_j.
// Shared: q_i (dh) and the row (t).
template <class T, class P>
__global__ void attention_forward_kernel(const T* q, const T* k, const T* v, T* y, P* probs, int64_t t, int64_t dh,
                                         float scale, Dropout drop) {
  extern __shared__ float sh[];
  __shared__ float red[32];
  float* qs = sh;
  float* row = sh + dh;
  const int64_t i = blockIdx.x, bh = blockIdx.y, off = bh * t * dh;
  load_row(qs, q + off + i * dh, dh);
  __syncthreads();
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
    row[j] = dot_row(qs, k + off + j * dh, dh) * scale;
    mx = fmaxf(mx, row[j]);
  }
  mx = block_max(mx, red);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
    row[j] = expf(row[j] - mx);
    sum += row[j];
  }
  const float inv = 1.0f / block_sum(sum, red);
  P* prow = probs + (bh * t + i) * t;
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) {
    if (j <= i) {
      const float pr = row[j] * inv;
      prow[j] = fn::from_f32<P>(pr);
      row[j] = pr * drop.factor(bh, i, j);
    } else {
      prow[j] = fn::from_f32<P>(0.0f);
    }
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) {
    float acc = 0.0f;
    for (int64_t j = 0; j <= i; ++j) acc += row[j] * fn::to_f32(v[off + j * dh + e]);
    y[off + i * dh + e] = fn::from_f32<T>(acc);
  }
}

// Plain backward, block (i, bh): dS_i (to scratch ds) and dq_i. Shared: dy_i (dh), dS_i (t).
template <class T, class P>
__global__ void attention_backward_rows_kernel(const T* k, const T* v, const P* probs, const T* dy, T* dq, float* ds,
                                               int64_t t, int64_t dh, float scale, Dropout drop) {
  extern __shared__ float sh[];
  __shared__ float red[32];
  float* gs = sh;
  float* row = sh + dh;
  const int64_t i = blockIdx.x, bh = blockIdx.y, off = bh * t * dh;
  const P* prow = probs + (bh * t + i) * t;
  load_row(gs, dy + off + i * dh, dh);
  __syncthreads();
  float partial = 0.0f;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
    row[j] = dot_row(gs, v + off + j * dh, dh) * drop.factor(bh, i, j);  // dP_ij
    partial += fn::to_f32(prow[j]) * row[j];
  }
  const float di = block_sum(partial, red);
  float* dsrow = ds + (bh * t + i) * t;
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) {
    const float s = j <= i ? fn::to_f32(prow[j]) * (row[j] - di) : 0.0f;
    if (j <= i) row[j] = s;
    dsrow[j] = s;
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) {
    float acc = 0.0f;
    for (int64_t j = 0; j <= i; ++j) acc += row[j] * fn::to_f32(k[off + j * dh + e]);
    dq[off + i * dh + e] = fn::from_f32<T>(acc * scale);
  }
}

// Plain backward, block (j, bh): dv_j = sum_i P_ij f_ij dy_i and dk_j = scale sum_i dS_ij q_i
// over i >= j. Shared: the two columns (t each).
template <class T, class P>
__global__ void attention_backward_cols_kernel(const T* q, const P* probs, const T* dy, const float* ds, T* dk, T* dv,
                                               int64_t t, int64_t dh, float scale, Dropout drop) {
  extern __shared__ float sh[];
  float* pcol = sh;
  float* scol = sh + t;
  const int64_t j = blockIdx.x, bh = blockIdx.y, off = bh * t * dh;
  for (int64_t i = j + threadIdx.x; i < t; i += blockDim.x) {
    pcol[i] = fn::to_f32(probs[(bh * t + i) * t + j]) * drop.factor(bh, i, j);
    scol[i] = ds[(bh * t + i) * t + j];
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) {
    float acc_v = 0.0f, acc_k = 0.0f;
    for (int64_t i = j; i < t; ++i) {
      acc_v += pcol[i] * fn::to_f32(dy[off + i * dh + e]);
      acc_k += scol[i] * fn::to_f32(q[off + i * dh + e]);
    }
    dv[off + j * dh + e] = fn::from_f32<T>(acc_v);
    dk[off + j * dh + e] = fn::from_f32<T>(acc_k * scale);
  }
}

// Memory-efficient forward, block (i, bh): tiles of blockDim keys, online softmax.
// Shared: q_i (dh), the output accumulator (dh, element e owned by thread e % blockDim), the
// tile's weights (blockDim).
template <class T>
__global__ void flash_forward_kernel(const T* q, const T* k, const T* v, T* y, float* lse, int64_t t, int64_t dh,
                                     float scale, Dropout drop) {
  extern __shared__ float sh[];
  __shared__ float red[32];
  float* qs = sh;
  float* acc = sh + dh;
  float* w = sh + 2 * dh;
  const int64_t i = blockIdx.x, bh = blockIdx.y, off = bh * t * dh;
  load_row(qs, q + off + i * dh, dh);
  for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) acc[e] = 0.0f;
  __syncthreads();
  float m = -INFINITY, l = 0.0f;
  for (int64_t j0 = 0; j0 <= i; j0 += blockDim.x) {
    const int64_t j = j0 + threadIdx.x;
    const bool valid = j <= i;
    const float s = valid ? dot_row(qs, k + off + j * dh, dh) * scale : -INFINITY;
    const float m_new = fmaxf(m, block_max(s, red));  // finite: key j0 <= i is in the tile
    const float alpha = expf(m - m_new);
    const float e_s = valid ? expf(s - m_new) : 0.0f;
    l = l * alpha + block_sum(e_s, red);
    w[threadIdx.x] = valid ? e_s * drop.factor(bh, i, j) : 0.0f;
    __syncthreads();
    const int64_t n = min(static_cast<int64_t>(blockDim.x), i - j0 + 1);
    for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) {
      float a = acc[e] * alpha;
      for (int64_t c = 0; c < n; ++c) a += w[c] * fn::to_f32(v[off + (j0 + c) * dh + e]);
      acc[e] = a;
    }
    m = m_new;
    __syncthreads();  // before w is overwritten
  }
  const float inv = 1.0f / l;
  for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) y[off + i * dh + e] = fn::from_f32<T>(acc[e] * inv);
  if (threadIdx.x == 0) lse[bh * t + i] = m + logf(l);
}

// D_i = dy_i . y_i, block (i, bh).
template <class T>
__global__ void flash_row_term_kernel(const T* y, const T* dy, float* drow, int64_t t, int64_t dh) {
  __shared__ float red[32];
  const int64_t i = blockIdx.x, bh = blockIdx.y, at = (bh * t + i) * dh;
  float partial = 0.0f;
  for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) partial += fn::to_f32(dy[at + e]) * fn::to_f32(y[at + e]);
  const float di = block_sum(partial, red);
  if (threadIdx.x == 0) drow[bh * t + i] = di;
}

// Memory-efficient backward for dq, block (i, bh): keys j <= i in tiles.
// Shared: q_i, dy_i, the accumulator (dh each), the tile's dS (blockDim).
template <class T>
__global__ void flash_backward_dq_kernel(const T* q, const T* k, const T* v, const float* lse, const T* dy,
                                         const float* drow, T* dq, int64_t t, int64_t dh, float scale, Dropout drop) {
  extern __shared__ float sh[];
  float* qs = sh;
  float* gs = sh + dh;
  float* acc = sh + 2 * dh;
  float* w = sh + 3 * dh;
  const int64_t i = blockIdx.x, bh = blockIdx.y, off = bh * t * dh;
  load_row(qs, q + off + i * dh, dh);
  load_row(gs, dy + off + i * dh, dh);
  for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) acc[e] = 0.0f;
  __syncthreads();
  const float li = lse[bh * t + i], di = drow[bh * t + i];
  for (int64_t j0 = 0; j0 <= i; j0 += blockDim.x) {
    const int64_t j = j0 + threadIdx.x;
    float dsv = 0.0f;
    if (j <= i) {
      const float pr = expf(dot_row(qs, k + off + j * dh, dh) * scale - li);
      dsv = pr * (dot_row(gs, v + off + j * dh, dh) * drop.factor(bh, i, j) - di);
    }
    w[threadIdx.x] = dsv;
    __syncthreads();
    const int64_t n = min(static_cast<int64_t>(blockDim.x), i - j0 + 1);
    for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) {
      float a = acc[e];
      for (int64_t c = 0; c < n; ++c) a += w[c] * fn::to_f32(k[off + (j0 + c) * dh + e]);
      acc[e] = a;
    }
    __syncthreads();
  }
  for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) dq[off + i * dh + e] = fn::from_f32<T>(acc[e] * scale);
}

// Memory-efficient backward for dk and dv, block (j, bh): queries i >= j in tiles.
// Shared: k_j, v_j, the two accumulators (dh each), the tile's P f and dS (blockDim each).
template <class T>
__global__ void flash_backward_dkdv_kernel(const T* q, const T* k, const T* v, const float* lse, const T* dy,
                                           const float* drow, T* dk, T* dv, int64_t t, int64_t dh, float scale,
                                           Dropout drop) {
  extern __shared__ float sh[];
  float* ks = sh;
  float* vs = sh + dh;
  float* acc_k = sh + 2 * dh;
  float* acc_v = sh + 3 * dh;
  float* wp = sh + 4 * dh;
  float* wd = wp + blockDim.x;
  const int64_t j = blockIdx.x, bh = blockIdx.y, off = bh * t * dh;
  load_row(ks, k + off + j * dh, dh);
  load_row(vs, v + off + j * dh, dh);
  for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) acc_k[e] = acc_v[e] = 0.0f;
  __syncthreads();
  for (int64_t i0 = j; i0 < t; i0 += blockDim.x) {
    const int64_t i = i0 + threadIdx.x;
    float pv = 0.0f, dsv = 0.0f;
    if (i < t) {
      const float pr = expf(dot_row(ks, q + off + i * dh, dh) * scale - lse[bh * t + i]);
      const float f = drop.factor(bh, i, j);
      pv = pr * f;
      dsv = pr * (dot_row(vs, dy + off + i * dh, dh) * f - drow[bh * t + i]);
    }
    wp[threadIdx.x] = pv;
    wd[threadIdx.x] = dsv;
    __syncthreads();
    const int64_t n = min(static_cast<int64_t>(blockDim.x), t - i0);
    for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) {
      float a_k = acc_k[e], a_v = acc_v[e];
      for (int64_t c = 0; c < n; ++c) {
        a_v += wp[c] * fn::to_f32(dy[off + (i0 + c) * dh + e]);
        a_k += wd[c] * fn::to_f32(q[off + (i0 + c) * dh + e]);
      }
      acc_k[e] = a_k;
      acc_v[e] = a_v;
    }
    __syncthreads();
  }
  for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) {
    dk[off + j * dh + e] = fn::from_f32<T>(acc_k[e] * scale);
    dv[off + j * dh + e] = fn::from_f32<T>(acc_v[e]);
  }
}

// (B, H, T, Dh) of q, the launch grid (T, B * H) and the softmax scale.
struct Geometry {
  int64_t bh, t, dh;
  float scale;
  explicit Geometry(const Tensor& q)
      : bh(q.dim(0) * q.dim(1)), t(q.dim(2)), dh(q.dim(3)), scale(1.0f / sqrtf(static_cast<float>(q.dim(3)))) {}
  bool empty() const { return bh == 0 || t == 0; }
  dim3 grid() const {
    STRATA_CHECK(bh <= 65535 && t <= INT_MAX, "attention on CUDA: B * H = ", bh, " must be at most 65535");
    return dim3(static_cast<unsigned>(t), static_cast<unsigned>(bh));
  }
  size_t shared(int64_t floats) const {
    const size_t bytes = static_cast<size_t>(floats) * sizeof(float);
    STRATA_CHECK(bytes <= kMaxShared, "attention on CUDA needs ", bytes,
                 " bytes of shared memory per block here (T = ", t, ", Dh = ", dh,
                 "); the plain kernels hold a row of T values: use the memory-efficient ones for long sequences");
    return bytes;
  }
};

}  // namespace

// ---- embedding -------------------------------------------------------------------------------

void embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe, const Tensor& y, int64_t first_token,
                       int64_t vocab) {
  const int64_t n = tokens.numel(), t = tokens.dim(1), d = wte.dim(1);
  if (n == 0 || d == 0) return;
  const OnDevice on(y);
  Tensor s = scratch(on, 8);
  auto* bad = scratch_at<unsigned long long>(s, 0);
  CUDA_CHECK(cudaMemsetAsync(bad, 0xff, 8, on.stream));
  with_float_type(wte.dtype(), [&](auto tag) {
    using T = decltype(tag);
    embedding_forward_kernel<<<detail::grid_for(n * d), detail::kThreads, 0, on.stream>>>(
        tokens.data<int32_t>(), wte.data<T>(), wpe.defined() ? wpe.data<T>() : nullptr, y.data<T>(), n, t, d,
        first_token, wte.dim(0), vocab, bad);
    CUDA_CHECK(cudaGetLastError());
  });
  unsigned long long host = 0;
  read_back(on, &host, bad, sizeof(host));
  if (host != ULLONG_MAX) {
    int32_t token = 0;
    read_back(on, &token, tokens.data<int32_t>() + host, sizeof(token));
    STRATA_THROW_INPUT("token ", token, " at (", static_cast<int64_t>(host) / t, ", ", static_cast<int64_t>(host) % t,
                       ") is outside [0, ", vocab, ")");
  }
}

// Tokens outside wte's rows add nothing to dwte (embedding_forward has reported those outside
// the vocabulary).
void embedding_backward(const Tensor& tokens, const Tensor& dy, const Tensor& dwte, const Tensor& dwpe,
                        int64_t first_token) {
  const int64_t b = tokens.dim(0), t = tokens.dim(1), n = tokens.numel(), d = dy.dim(2);
  if (n == 0 || d == 0) return;
  const OnDevice on(dy);
  with_float_type(dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (dwpe.defined()) {
      with_float_type(dwpe.dtype(), [&](auto g_tag) {
        using G = decltype(g_tag);
        embedding_wpe_grad_kernel<<<detail::grid_for(t * d), detail::kThreads, 0, on.stream>>>(dy.data<T>(),
                                                                                               dwpe.data<G>(), b, t, d);
        CUDA_CHECK(cudaGetLastError());
      });
    }
    if (dwte.defined() && dwte.dim(0) > 0) {
      STRATA_CHECK(dwte.dim(0) <= INT_MAX, "vocabulary of ", dwte.dim(0), " rows is too large");
      with_float_type(dwte.dtype(), [&](auto g_tag) {
        using G = decltype(g_tag);
        embedding_wte_grad_kernel<<<static_cast<unsigned>(dwte.dim(0)), kEmbedThreads, 0, on.stream>>>(
            tokens.data<int32_t>(), dy.data<T>(), dwte.data<G>(), n, d, first_token);
        CUDA_CHECK(cudaGetLastError());
      });
    }
  });
}

// ---- head layout -----------------------------------------------------------------------------

void split_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t c = q.dim(1) * q.dim(3);
  heads_copy(qkv, q, q, 3 * c, 0, true);
  heads_copy(qkv, k, q, 3 * c, c, true);
  heads_copy(qkv, v, q, 3 * c, 2 * c, true);
}

void merge_qkv(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv) {
  const int64_t c = dq.dim(1) * dq.dim(3);
  heads_copy(dq, dqkv, dq, 3 * c, 0, false);
  heads_copy(dk, dqkv, dq, 3 * c, c, false);
  heads_copy(dv, dqkv, dq, 3 * c, 2 * c, false);
}

void merge_heads(const Tensor& x, const Tensor& y) { heads_copy(x, y, x, x.dim(1) * x.dim(3), 0, false); }

void split_heads(const Tensor& y, const Tensor& x) { heads_copy(y, x, x, x.dim(1) * x.dim(3), 0, true); }

// ---- attention -------------------------------------------------------------------------------

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& probs, float p,
                       const DropoutKey& key) {
  const Geometry g(q);
  if (g.empty()) return;
  const OnDevice on(y);
  const Dropout drop = make_dropout(p, key, q.dim(1), g.t);
  const size_t shared = g.shared(g.dh + g.t);
  with_float_type(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    with_float_type(probs.dtype(), [&](auto p_tag) {
      using P = decltype(p_tag);
      attention_forward_kernel<<<g.grid(), kThreads, shared, on.stream>>>(
          q.data<T>(), k.data<T>(), v.data<T>(), y.data<T>(), probs.data<P>(), g.t, g.dh, g.scale, drop);
      CUDA_CHECK(cudaGetLastError());
    });
  });
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& probs, const Tensor& dy,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, float p, const DropoutKey& key) {
  const Geometry g(q);
  if (g.empty()) return;
  const OnDevice on(dq);
  const Dropout drop = make_dropout(p, key, q.dim(1), g.t);
  const size_t rows_shared = g.shared(g.dh + g.t), cols_shared = g.shared(2 * g.t);
  Tensor s = scratch(on, static_cast<size_t>(g.bh * g.t * g.t) * sizeof(float));
  float* ds = scratch_at<float>(s, 0);
  with_float_type(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    with_float_type(probs.dtype(), [&](auto p_tag) {
      using P = decltype(p_tag);
      attention_backward_rows_kernel<<<g.grid(), kThreads, rows_shared, on.stream>>>(
          k.data<T>(), v.data<T>(), probs.data<P>(), dy.data<T>(), dq.data<T>(), ds, g.t, g.dh, g.scale, drop);
      CUDA_CHECK(cudaGetLastError());
      attention_backward_cols_kernel<<<g.grid(), kThreads, cols_shared, on.stream>>>(
          q.data<T>(), probs.data<P>(), dy.data<T>(), ds, dk.data<T>(), dv.data<T>(), g.t, g.dh, g.scale, drop);
      CUDA_CHECK(cudaGetLastError());
    });
  });
}

void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                             float p, const DropoutKey& key) {
  const Geometry g(q);
  if (g.empty()) return;
  const OnDevice on(y);
  const Dropout drop = make_dropout(p, key, q.dim(1), g.t);
  const size_t shared = g.shared(2 * g.dh + kThreads);
  with_float_type(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    flash_forward_kernel<<<g.grid(), kThreads, shared, on.stream>>>(q.data<T>(), k.data<T>(), v.data<T>(), y.data<T>(),
                                                                    lse.data<float>(), g.t, g.dh, g.scale, drop);
    CUDA_CHECK(cudaGetLastError());
  });
}

void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                              const Tensor& dy, const Tensor& dq, const Tensor& dk, const Tensor& dv, float p,
                              const DropoutKey& key) {
  const Geometry g(q);
  if (g.empty()) return;
  const OnDevice on(dq);
  const Dropout drop = make_dropout(p, key, q.dim(1), g.t);
  const size_t dq_shared = g.shared(3 * g.dh + kThreads), dkdv_shared = g.shared(4 * g.dh + 2 * kThreads);
  Tensor s = scratch(on, static_cast<size_t>(g.bh * g.t) * sizeof(float));
  float* drow = scratch_at<float>(s, 0);
  with_float_type(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    flash_row_term_kernel<<<g.grid(), row_threads(g.dh), 0, on.stream>>>(y.data<T>(), dy.data<T>(), drow, g.t, g.dh);
    CUDA_CHECK(cudaGetLastError());
    flash_backward_dq_kernel<<<g.grid(), kThreads, dq_shared, on.stream>>>(q.data<T>(), k.data<T>(), v.data<T>(),
                                                                           lse.data<float>(), dy.data<T>(), drow,
                                                                           dq.data<T>(), g.t, g.dh, g.scale, drop);
    CUDA_CHECK(cudaGetLastError());
    flash_backward_dkdv_kernel<<<g.grid(), kThreads, dkdv_shared, on.stream>>>(
        q.data<T>(), k.data<T>(), v.data<T>(), lse.data<float>(), dy.data<T>(), drow, dk.data<T>(), dv.data<T>(), g.t,
        g.dh, g.scale, drop);
    CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace strata::ops::cuda
