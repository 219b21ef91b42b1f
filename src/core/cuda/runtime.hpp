// Core's CUDA runtime (CUDA builds only; public: the kernels in ops/cuda, the allocators and
// the communicators in parallel/ use it): the device count, DeviceGuard, and the per-GPU state
// every CUDA op uses: the compute stream and the library handles bound to it, created on first
// use of a device and kept for the process. Every handle has a move-only owner (Owned) whose
// destructor never throws. Host C++ only (no kernels here). Errors: core/cuda/check.hpp.
//
// Ordering rule: all Strata kernels, copies and cuBLAS/cuDNN calls on a GPU go to its compute
// stream, so they run in issue order without any synchronisation, and the caching allocator
// may hand a freed block out again at once. Work on any other stream (NCCL) must be ordered
// against the compute stream with events. One host thread at a time issues work to a device.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <array>
#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

#include "core/cuda/check.hpp"
#include "core/tensor.hpp"

namespace strata::cuda {

// Number of visible CUDA devices; 0 when there is no GPU or no driver.
int device_count();

// Makes `device` current for a scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { CUDA_CHECK_NOTHROW(cudaSetDevice(previous_)); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// Destroy one handle, reporting (never throwing) a failure; used by Owned.
void destroy(cudaStream_t h) noexcept;
void destroy(cudaEvent_t h) noexcept;
void destroy(cublasHandle_t h) noexcept;
void destroy(cublasLtHandle_t h) noexcept;
void destroy(cudnnHandle_t h) noexcept;
void destroy(cudnnTensorDescriptor_t h) noexcept;
void destroy(cudnnFilterDescriptor_t h) noexcept;
void destroy(cudnnConvolutionDescriptor_t h) noexcept;

// Move-only owner of one CUDA / cuBLAS / cuDNN handle (a pointer to an opaque struct).
// Converts to the raw handle, so it can be passed straight to the C APIs.
template <class H>
class Owned {
 public:
  Owned() = default;
  explicit Owned(H h) noexcept : h_(h) {}
  ~Owned() { reset(); }
  Owned(Owned&& other) noexcept : h_(std::exchange(other.h_, nullptr)) {}
  Owned& operator=(Owned&& other) noexcept {
    if (this != &other) {
      reset();
      h_ = std::exchange(other.h_, nullptr);
    }
    return *this;
  }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;

  H get() const noexcept { return h_; }
  operator H() const noexcept { return h_; }
  void reset() noexcept {
    if (h_ != nullptr) destroy(h_);
    h_ = nullptr;
  }

 private:
  H h_ = nullptr;
};

// A new event without timing (cheap), for ordering one stream after another.
Owned<cudaEvent_t> make_event();

// A cuDNN convolution algorithm chosen once for a ConvKey (direction, shapes, dtype, math
// mode; filled in by ops/cuda/dnn.cu) and reused for every later call with that key.
using ConvKey = std::array<int, 12>;
struct ConvAlgo {
  int algo = 0;  // cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t, by direction
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  size_t workspace_bytes = 0;
};

// One GPU's compute stream and the library handles bound to it.
class DeviceContext {
 public:
  explicit DeviceContext(int index);
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  // A device buffer of at least `bytes`, valid until the next call (grows on demand). The old
  // buffer goes back to the caching allocator, which is safe without a sync: its users are
  // queued on the compute stream before anything that could reuse the block.
  void* workspace(size_t bytes);

  const int device;
  Owned<cudaStream_t> compute;  // non-blocking: never waits for the legacy default stream
  Owned<cublasHandle_t> cublas;
  Owned<cublasLtHandle_t> cublas_lt;
  Owned<cudnnHandle_t> cudnn;

  std::mutex conv_mutex;  // guards conv_algos
  std::map<ConvKey, ConvAlgo> conv_algos;

 private:
  Tensor workspace_;  // u8 on this device
};

// The context of `device`, created on first use (thread-safe). Ops make the device current
// themselves (DeviceGuard) before using its handles.
DeviceContext& context(int device);
inline cudaStream_t compute_stream(int device) { return context(device).compute; }
// The device's shared cuBLAS/cuDNN workspace, grown to at least `bytes` (stream-ordered).
inline void* workspace(int device, size_t bytes) { return context(device).workspace(bytes); }

}  // namespace strata::cuda
