// Error checks for the CUDA runtime and its libraries (CUDA builds only). CUDA_CHECK,
// CUBLAS_CHECK and CUDNN_CHECK turn a failed call into a strata::Error naming the call and the
// library's own message; the _NOTHROW variants report to stderr instead, for destructors.
// (NCCL_CHECK is the NCCL communicator's, parallel/comm/nccl_communicator.hpp.)
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cstdio>
#include <string>

#include "core/error.hpp"

namespace strata::cuda::detail {
// cuDNN 9 keeps a per-thread message with more detail than the status name (may be empty).
inline std::string cudnn_last_error() {
  char message[512] = {};
  cudnnGetLastErrorString(message, sizeof(message));
  return message;
}
}  // namespace strata::cuda::detail

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

#define CUBLAS_CHECK(expr)                                                                                            \
  do {                                                                                                                \
    const cublasStatus_t strata_status_ = (expr);                                                                     \
    if (strata_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                                         \
      STRATA_THROW("cuBLAS error ", cublasGetStatusName(strata_status_), " (", cublasGetStatusString(strata_status_), \
                   ") in ", #expr);                                                                                   \
  } while (0)

#define CUBLAS_CHECK_NOTHROW(expr)                                                                                  \
  do {                                                                                                              \
    const cublasStatus_t strata_status_ = (expr);                                                                   \
    if (strata_status_ != CUBLAS_STATUS_SUCCESS)                                                                    \
      std::fprintf(stderr, "%s:%d [rank %d] cuBLAS error %s in %s (ignored in a destructor)\n", __FILE__, __LINE__, \
                   ::strata::process_rank(), cublasGetStatusName(strata_status_), #expr);                           \
  } while (0)

#define CUDNN_CHECK(expr)                                                                    \
  do {                                                                                       \
    const cudnnStatus_t strata_status_ = (expr);                                             \
    if (strata_status_ != CUDNN_STATUS_SUCCESS) [[unlikely]]                                 \
      STRATA_THROW("cuDNN error ", cudnnGetErrorString(strata_status_), " in ", #expr, ": ", \
                   ::strata::cuda::detail::cudnn_last_error());                              \
  } while (0)

#define CUDNN_CHECK_NOTHROW(expr)                                                                                  \
  do {                                                                                                             \
    const cudnnStatus_t strata_status_ = (expr);                                                                   \
    if (strata_status_ != CUDNN_STATUS_SUCCESS)                                                                    \
      std::fprintf(stderr, "%s:%d [rank %d] cuDNN error %s in %s (ignored in a destructor)\n", __FILE__, __LINE__, \
                   ::strata::process_rank(), cudnnGetErrorString(strata_status_), #expr);                          \
  } while (0)
