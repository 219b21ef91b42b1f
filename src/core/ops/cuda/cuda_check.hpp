// CUDA_CHECK: turn a failed CUDA runtime call into a strata::Error naming the call and the
// CUDA error; CUDA_CHECK_NOTHROW reports to stderr instead, for destructors.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#include "core/error.hpp"

#define CUDA_CHECK(expr)                                                                                         \
  do {                                                                                                           \
    const cudaError_t strata_err_ = (expr);                                                                      \
    if (strata_err_ != cudaSuccess) [[unlikely]]                                                                 \
      STRATA_THROW("CUDA error ", cudaGetErrorName(strata_err_), " (", cudaGetErrorString(strata_err_), ") in ", \
                   #expr);                                                                                       \
  } while (0)

#define CUDA_CHECK_NOTHROW(expr)                                                                                  \
  do {                                                                                                            \
    const cudaError_t strata_err_ = (expr);                                                                       \
    if (strata_err_ != cudaSuccess)                                                                               \
      std::fprintf(stderr, "%s:%d [rank %d] CUDA error %s in %s (ignored in a destructor)\n", __FILE__, __LINE__, \
                   ::strata::process_rank(), cudaGetErrorName(strata_err_), #expr);                               \
  } while (0)

namespace strata::ops::cuda {

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

}  // namespace strata::ops::cuda
