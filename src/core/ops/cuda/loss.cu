// CUDA softmax cross-entropy and accuracy counting: one block per row (sample) of (N, K)
// logits. The loss sum is reduced on the device in a fixed order and read back with one copy
// that waits for the compute stream only.
#include <climits>

#include "core/ops/cuda/cuda_ops.hpp"
#include "core/ops/cuda/launch.cuh"

namespace strata::ops::cuda {

namespace {

// Row r: max, sum of exp(x - max), probs = exp(x - max) / sum, and the row's loss (NaN with
// the row recorded in *bad_row when its label is outside [0, k): kernels cannot throw).
template <class T, class P>
__global__ void softmax_xent_kernel(const T* logits, const int32_t* labels, P* probs, int64_t k, double* row_loss,
                                    unsigned long long* bad_row) {
  __shared__ float shared[32];
  const int64_t r = blockIdx.x;
  const T* in = logits + r * k;
  P* out = probs + r * k;
  float mx = -INFINITY;  // fmaxf skips NaN, as the CPU's fmax
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) mx = fmaxf(mx, fn::to_f32(in[j]));
  mx = block_max(mx, shared);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) sum += expf(fn::to_f32(in[j]) - mx);
  sum = block_sum(sum, shared);
  const float inv = 1.0f / sum;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) out[j] = fn::from_f32<P>(expf(fn::to_f32(in[j]) - mx) * inv);
  if (threadIdx.x != 0) return;
  const int32_t label = labels[r];
  if (label >= 0 && label < k) {
    row_loss[r] = fn::xent_loss(sum, fn::to_f32(in[label]), mx);
  } else {
    row_loss[r] = NAN;
    atomicMin(bad_row, static_cast<unsigned long long>(r));
  }
}

// Row r: 1 into *correct when the first maximum (NaN skipped, as the CPU's `>` scan does
// unless x[0] is NaN, which then wins) is at the label.
template <class T>
__global__ void count_correct_kernel(const T* logits, const int32_t* labels, int64_t k, unsigned long long* correct) {
  __shared__ float shared_v[32];
  __shared__ int64_t shared_i[32];
  const int64_t r = blockIdx.x;
  const T* in = logits + r * k;
  // (best, at): at == k means "none yet"; ties go to the smaller index.
  float best = 0.0f;
  int64_t at = k;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
    const float v = fn::to_f32(in[j]);
    if (!isnan(v) && (at == k || v > best)) best = v, at = j;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, at, o);
    if (oi != k && (at == k || ov > best || (ov == best && oi < at))) best = ov, at = oi;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared_v[warp] = best, shared_i[warp] = at;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w)
    if (shared_i[w] != k && (at == k || shared_v[w] > best || (shared_v[w] == best && shared_i[w] < at)))
      best = shared_v[w], at = shared_i[w];
  if (isnan(fn::to_f32(in[0])) || at == k) at = 0;
  if (at == labels[r]) atomicAdd(correct, 1ull);
}

// The vocabulary-parallel pieces, one block per row.
template <class T>
__global__ void row_max_kernel(const T* x, int64_t k, float* mx, int32_t* argmax) {
  __shared__ float shared[32];
  __shared__ int first;
  const int64_t r = blockIdx.x;
  const T* in = x + r * k;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) m = fmaxf(m, fn::to_f32(in[j]));
  m = block_max(m, shared);
  if (threadIdx.x == 0) mx[r] = m, first = INT_MAX;
  if (argmax == nullptr) return;
  __syncthreads();
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x)
    if (fn::to_f32(in[j]) == m) {
      atomicMin(&first, static_cast<int>(j));  // the first maximum
      break;
    }
  __syncthreads();
  if (threadIdx.x == 0) argmax[r] = first == INT_MAX ? 0 : first;
}

template <class T>
__global__ void softmax_slice_stats_kernel(const T* x, const int32_t* labels, int64_t k, int64_t first, const float* mx,
                                           float* stats) {
  __shared__ float shared[32];
  const int64_t r = blockIdx.x;
  const T* in = x + r * k;
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) sum += expf(fn::to_f32(in[j]) - mx[r]);
  sum = block_sum(sum, shared);
  if (threadIdx.x != 0) return;
  const int64_t j = labels[r] - first;
  stats[2 * r] = sum;
  stats[2 * r + 1] = j >= 0 && j < k ? fn::to_f32(in[j]) : 0.0f;
}

template <class T, class P>
struct SoftmaxSlice {
  const T* x;
  const float* mx;
  const float* stats;
  P* probs;
  int64_t cols;
  __device__ void operator()(int64_t r, int64_t j) const {
    const int64_t i = r * cols + j;
    probs[i] = fn::from_f32<P>(expf(fn::to_f32(x[i]) - mx[r]) * (1.0f / stats[2 * r]));
  }
};

}  // namespace

double softmax_xent_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs) {
  // logits (N, K), probs (N, K) f32 or logits' dtype; labels (N)
  const int64_t n = logits.dim(0), k = logits.dim(1);
  if (n == 0) return 0.0;
  const OnDevice on(logits);
  // Scratch: [0] the sum, [1] the first bad row (all ones: none), then one loss per row.
  Tensor s = scratch(on, static_cast<size_t>(n + 2) * 8);
  double* sum = scratch_at<double>(s, 0);
  auto* bad_row = scratch_at<unsigned long long>(s, 8);
  double* row_loss = scratch_at<double>(s, 16);
  CUDA_CHECK(cudaMemsetAsync(bad_row, 0xff, 8, on.stream));
  with_float_type(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    with_float_type(probs.dtype(), [&](auto p_tag) {
      using P = decltype(p_tag);
      softmax_xent_kernel<<<static_cast<unsigned>(n), row_threads(k), 0, on.stream>>>(
          logits.data<T>(), labels.data<int32_t>(), probs.data<P>(), k, row_loss, bad_row);
      CUDA_CHECK(cudaGetLastError());
    });
  });
  detail::sum_kernel<<<1, 1024, 0, on.stream>>>(row_loss, n, sum);
  CUDA_CHECK(cudaGetLastError());
  struct {
    double sum;
    unsigned long long bad_row;
  } host{};
  read_back(on, &host, sum, sizeof(host));
  if (host.bad_row != ULLONG_MAX) {
    int32_t label = 0;
    read_back(on, &label, labels.data<int32_t>() + host.bad_row, sizeof(label));
    STRATA_THROW_INPUT("label ", label, " of sample ", host.bad_row, " is outside [0, ", k, ")");
  }
  return host.sum;
}

void softmax_xent_backward(const Tensor& probs, const Tensor& labels, const Tensor& dlogits, float scale, int64_t first,
                           int64_t vocab) {
  // Labels outside [0, vocab) were reported by the forward pass; here they match no column.
  (void)vocab;
  const int64_t n = probs.dim(0), k = probs.dim(1);
  const OnDevice on(dlogits);
  with_float_type(probs.dtype(), [&](auto p_tag) {
    using P = decltype(p_tag);
    with_float_type(dlogits.dtype(), [&](auto d_tag) {
      using D = decltype(d_tag);
      parallel_for_rows(
          on, n, k,
          fn::SoftmaxXentBackward<P, D>{probs.data<P>(), labels.data<int32_t>(), dlogits.data<D>(), k, first, scale});
    });
  });
}

void row_max(const Tensor& x, const Tensor& mx, const Tensor& argmax) {
  const int64_t n = x.dim(0), k = x.dim(1);
  if (n == 0) return;
  const OnDevice on(x);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    row_max_kernel<<<static_cast<unsigned>(n), row_threads(k), 0, on.stream>>>(
        x.data<T>(), k, mx.data<float>(), argmax.defined() ? argmax.data<int32_t>() : nullptr);
    CUDA_CHECK(cudaGetLastError());
  });
}

void softmax_slice_stats(const Tensor& x, const Tensor& labels, int64_t first, int64_t vocab, const Tensor& mx,
                         const Tensor& stats) {
  const int64_t n = x.dim(0), k = x.dim(1);
  if (n == 0) return;
  // The labels' range is checked on the host by the caller (layers::SoftmaxCrossEntropy), which
  // holds them there for the collectives.
  (void)vocab;
  const OnDevice on(x);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    softmax_slice_stats_kernel<<<static_cast<unsigned>(n), row_threads(k), 0, on.stream>>>(
        x.data<T>(), labels.data<int32_t>(), k, first, mx.data<float>(), stats.data<float>());
    CUDA_CHECK(cudaGetLastError());
  });
}

void softmax_slice(const Tensor& x, const Tensor& mx, const Tensor& stats, const Tensor& probs) {
  const int64_t n = x.dim(0), k = x.dim(1);
  const OnDevice on(probs);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    with_float_type(probs.dtype(), [&](auto p_tag) {
      using P = decltype(p_tag);
      parallel_for_rows(on, n, k,
                        SoftmaxSlice<T, P>{x.data<T>(), mx.data<float>(), stats.data<float>(), probs.data<P>(), k});
    });
  });
}

int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  const int64_t n = logits.dim(0), k = logits.dim(1);
  if (n == 0) return 0;
  const OnDevice on(logits);
  Tensor s = scratch(on, 8);
  auto* correct = scratch_at<unsigned long long>(s, 0);
  CUDA_CHECK(cudaMemsetAsync(correct, 0, 8, on.stream));
  with_float_type(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    count_correct_kernel<<<static_cast<unsigned>(n), row_threads(k), 0, on.stream>>>(
        logits.data<T>(), labels.data<int32_t>(), k, correct);
    CUDA_CHECK(cudaGetLastError());
  });
  unsigned long long host = 0;
  read_back(on, &host, correct, sizeof(host));
  return static_cast<int64_t>(host);
}

}  // namespace strata::ops::cuda
