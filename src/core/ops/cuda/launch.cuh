// Launchers shared by Strata's own CUDA kernels: every launch goes to the device's compute
// stream (core/cuda/runtime.hpp). parallel_for / parallel_for_rows apply the functors of
// ops/functors.hpp; column_sum and the block reductions are deterministic (fixed shapes and
// summation order, no floating-point atomics), so a run repeats bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/check.hpp"
#include "core/cuda/runtime.hpp"
#include "core/ops/functors.hpp"
#include "core/tensor.hpp"

namespace strata::ops::cuda {

// The device of a tensor, current for this scope, and its compute stream.
struct OnDevice {
  explicit OnDevice(const Tensor& t) : device(t.device().index), guard(device), stream(compute_stream(device)) {}
  int device;
  DeviceGuard guard;
  cudaStream_t stream;
};

// Calls f(T{}) with T the storage type of a float dtype: f32 -> float, bf16, f16.
template <class F>
decltype(auto) with_float_type(DType t, F&& f) {
  switch (t) {
    case DType::F32:
      return f(float{});
    case DType::BF16:
      return f(bf16{});
    case DType::F16:
      return f(f16{});
    default:
      STRATA_THROW("CUDA op on ", dtype_name(t), ": only f32, bf16 and f16 are supported");
  }
}

// Device scratch memory for one op (from the caching allocator; freeing it while kernels that
// use it are queued is safe because every later user runs on the same stream).
inline Tensor scratch(const OnDevice& on, size_t bytes) {
  return Tensor::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, DType::U8, Device::cuda(on.device));
}
template <class T>
T* scratch_at(const Tensor& s, size_t byte_offset) {
  return reinterpret_cast<T*>(static_cast<char*>(s.raw()) + byte_offset);
}

// Copies `bytes` from the device to host memory and waits for the compute stream (only it):
// the ops that return a host value end here.
inline void read_back(const OnDevice& on, void* host, const void* device, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, on.stream));
  CUDA_CHECK(cudaStreamSynchronize(on.stream));
}

namespace detail {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;  // grid-stride loops cover the rest

inline unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::min((n + kThreads - 1) / kThreads, kMaxBlocks));
}

template <class F>
__global__ void apply_kernel(int64_t n, F f) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

// f(r, j) over a (rows, cols) grid, flattened; (r, j) advance by the stride without dividing
// in the loop.
template <class F>
__global__ void apply_rows_kernel(int64_t rows, int64_t cols, F f) {
  const int64_t n = rows * cols, stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int64_t r = i / cols, j = i - r * cols;
  const int64_t dr = stride / cols, dj = stride - dr * cols;
  for (; i < n; i += stride) {
    f(r, j);
    r += dr;
    j += dj;
    if (j >= cols) {
      j -= cols;
      ++r;
    }
  }
}

}  // namespace detail

// Applies f(i) for i in [0, n) on the compute stream.
template <class F>
void parallel_for(const OnDevice& on, int64_t n, const F& f) {
  if (n <= 0) return;
  detail::apply_kernel<<<detail::grid_for(n), detail::kThreads, 0, on.stream>>>(n, f);
  CUDA_CHECK(cudaGetLastError());
}

// Applies f(r, j) for every element of a (rows, cols) view on the compute stream.
template <class F>
void parallel_for_rows(const OnDevice& on, int64_t rows, int64_t cols, const F& f) {
  if (rows <= 0 || cols <= 0) return;
  detail::apply_rows_kernel<<<detail::grid_for(rows * cols), detail::kThreads, 0, on.stream>>>(rows, cols, f);
  CUDA_CHECK(cudaGetLastError());
}

// Adapts an element functor f(i) to runs of `cols` elements spaced `stride` apart: element j
// of run r is r * stride + j (one channel of (N, C, inner) images, say).
template <class F>
struct StridedRows {
  F f;
  int64_t stride;
  __device__ void operator()(int64_t r, int64_t j) const { f(r * stride + j); }
};

// value(r, j) of a (rows, cols) tensor in f32: a column_sum summand.
template <class T>
struct ReadAt {
  const T* x;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t j) const { return fn::to_f32(x[r * cols + j]); }
};

// ---- block reductions (blockDim.x a multiple of 32, at most 1024) ------------------------------

// Butterfly reductions leave the same value in every lane (each step adds the same pair in
// both partners), so every thread gets the same, bitwise-reproducible result.
template <class T>
__device__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block, returned to every thread. `shared` holds 32 values; the leading
// __syncthreads lets a kernel reuse it for consecutive reductions.
template <class T>
__device__ T block_sum(T v, T* shared) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  return warp_sum(lane < static_cast<int>(blockDim.x >> 5) ? shared[lane] : T(0));
}

__device__ inline float block_max(float v, float* shared) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  return warp_max(lane < static_cast<int>(blockDim.x >> 5) ? shared[lane] : -INFINITY);
}

// Threads for a kernel that gives one block to each row of `cols` elements.
inline int row_threads(int64_t cols) { return static_cast<int>(std::clamp<int64_t>((cols + 31) / 32 * 32, 32, 256)); }

namespace detail {

// One block writes the sum of x[0, n) to *out, in a fixed order (launch with 1024 threads).
template <class T>
__global__ void sum_kernel(const T* x, int64_t n, T* out) {
  __shared__ T shared[32];
  T acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += x[i];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) *out = acc;
}

// Column sums, stage 1: block (32, kColRows) sums rows [y * chunk, (y + 1) * chunk) of 32
// columns of value(r, j) into partial[y][j].
constexpr int kColRows = 8;
template <class V>
__global__ void column_partial_kernel(int64_t rows, int64_t cols, int64_t chunk, V value, float* partial) {
  __shared__ float shared[kColRows][33];
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * chunk, end = begin + chunk < rows ? begin + chunk : rows;
  float acc = 0.0f;
  if (j < cols)
    for (int64_t r = begin + threadIdx.y; r < end; r += kColRows) acc += value(r, j);
  shared[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || j >= cols) return;
  for (int k = 1; k < kColRows; ++k) acc += shared[k][threadIdx.x];
  partial[blockIdx.y * cols + j] = acc;
}

// Stage 2: out[j] += sum over the chunks' partials, in chunk order.
template <class G>
__global__ void column_finish_kernel(const float* partial, int64_t chunks, int64_t cols, G* out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  float acc = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) acc += partial[c * cols + j];
  out[j] = fn::from_f32<G>(fn::to_f32(out[j]) + acc);
}

}  // namespace detail

// out[j] (cols; f32, bf16 or f16) += sum over r of value(r, j), in f32. Row chunks depend on
// the shape only, so the result is the same on every GPU and every run.
template <class G, class V>
void column_sum(const OnDevice& on, int64_t rows, int64_t cols, const V& value, G* out) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t col_blocks = (cols + 31) / 32;
  // At least 256 rows per chunk, and about 4096 blocks in all at most.
  const int64_t chunks =
      std::clamp<int64_t>(std::min((rows + 255) / 256, (4096 + col_blocks - 1) / col_blocks), 1, 65535);
  const int64_t chunk = (rows + chunks - 1) / chunks;
  Tensor partial = scratch(on, static_cast<size_t>(chunks * cols) * sizeof(float));
  float* p = scratch_at<float>(partial, 0);
  detail::column_partial_kernel<<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(chunks)),
                                  dim3(32, detail::kColRows), 0, on.stream>>>(rows, cols, chunk, value, p);
  CUDA_CHECK(cudaGetLastError());
  detail::column_finish_kernel<<<static_cast<unsigned>((cols + detail::kThreads - 1) / detail::kThreads),
                                 detail::kThreads, 0, on.stream>>>(p, chunks, cols, out);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace strata::ops::cuda
