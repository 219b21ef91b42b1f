// The device count; DeviceContext: one per GPU, created lazily; the handle owners' destroy
// functions.
#include "core/cuda/runtime.hpp"

#include <memory>
#include <mutex>

#include "core/cuda/check.hpp"

namespace strata::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no GPU: not an error for a CPU run
    return 0;
  }
  return n;
}

void destroy(cudaStream_t h) noexcept { CUDA_CHECK_NOTHROW(cudaStreamDestroy(h)); }
void destroy(cudaEvent_t h) noexcept { CUDA_CHECK_NOTHROW(cudaEventDestroy(h)); }
void destroy(cublasHandle_t h) noexcept { CUBLAS_CHECK_NOTHROW(cublasDestroy(h)); }
void destroy(cublasLtHandle_t h) noexcept { CUBLAS_CHECK_NOTHROW(cublasLtDestroy(h)); }
void destroy(cudnnHandle_t h) noexcept { CUDNN_CHECK_NOTHROW(cudnnDestroy(h)); }
void destroy(cudnnTensorDescriptor_t h) noexcept { CUDNN_CHECK_NOTHROW(cudnnDestroyTensorDescriptor(h)); }
void destroy(cudnnFilterDescriptor_t h) noexcept { CUDNN_CHECK_NOTHROW(cudnnDestroyFilterDescriptor(h)); }
void destroy(cudnnConvolutionDescriptor_t h) noexcept { CUDNN_CHECK_NOTHROW(cudnnDestroyConvolutionDescriptor(h)); }

Owned<cudaEvent_t> make_event() {
  cudaEvent_t e = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return Owned<cudaEvent_t>(e);
}

DeviceContext::DeviceContext(int index) : device(index) {
  DeviceGuard guard(index);
  // Each handle is owned as soon as it exists, so a failure below frees the earlier ones.
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  compute = Owned<cudaStream_t>(stream);
  cublasHandle_t blas = nullptr;
  CUBLAS_CHECK(cublasCreate(&blas));
  cublas = Owned<cublasHandle_t>(blas);
  CUBLAS_CHECK(cublasSetStream(cublas, compute));
  cublasLtHandle_t lt = nullptr;
  CUBLAS_CHECK(cublasLtCreate(&lt));
  cublas_lt = Owned<cublasLtHandle_t>(lt);  // cuBLASLt takes its stream per call
  cudnnHandle_t dnn = nullptr;
  CUDNN_CHECK(cudnnCreate(&dnn));
  cudnn = Owned<cudnnHandle_t>(dnn);
  CUDNN_CHECK(cudnnSetStream(cudnn, compute));
}

void* DeviceContext::workspace(size_t bytes) {
  if (bytes == 0) return workspace_.defined() ? workspace_.raw() : nullptr;
  if (!workspace_.defined() || workspace_.nbytes() < bytes) {
    workspace_ = Tensor();  // give the old block back first: the allocator may hand it out again
    workspace_ = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8, Device::cuda(device));
  }
  return workspace_.raw();
}

DeviceContext& context(int device) {
  struct Slot {
    std::once_flag once;
    DeviceContext* ctx = nullptr;
  };
  // Leaked on purpose, like the allocators: at exit the CUDA runtime may be unloaded before
  // static destructors run, and destroying handles then fails; the driver frees them anyway.
  static const int count = device_count();
  static Slot* slots = new Slot[static_cast<size_t>(count > 0 ? count : 1)];
  STRATA_CHECK(device >= 0 && device < count, "CUDA device ", device, " requested, but this machine has ", count);
  Slot& slot = slots[device];
  std::call_once(slot.once, [&] { slot.ctx = new DeviceContext(device); });  // retried if it throws
  return *slot.ctx;
}

}  // namespace strata::cuda
