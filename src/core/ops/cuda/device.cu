// CUDA device memory: a caching allocator per GPU (cudaMalloc/cudaFree synchronise the device
// and are slow, so freed blocks are kept in size-class free lists and handed out again), the
// device count, and allocator_for() for every device in CUDA builds.
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/allocator.hpp"
#include "core/ops/cuda/cuda_check.hpp"
#include "core/ops/cuda/cuda_ops.hpp"

namespace strata {

namespace {

// Blocks are reused without an event: all of Strata's kernels run on one stream per device, so
// a kernel that gets a reused block is ordered after every kernel that used it before.
class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int device) : device_(device) {}
  ~CudaCachingAllocator() override { release_cached(); }
  CudaCachingAllocator(const CudaCachingAllocator&) = delete;
  CudaCachingAllocator& operator=(const CudaCachingAllocator&) = delete;

  void* allocate(size_t bytes) override {
    const size_t size = HostCachingAllocator::size_class(bytes);
    {
      std::lock_guard lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        return p;
      }
    }
    ops::cuda::DeviceGuard guard(device_);
    void* p = nullptr;
    if (cudaMalloc(&p, size) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the error, give the cache back and try once more
      release_cached();
      CUDA_CHECK(cudaMalloc(&p, size));
    }
    return p;
  }

  void deallocate(void* ptr, size_t bytes) noexcept override {
    if (ptr == nullptr) return;
    std::lock_guard lock(mutex_);
    free_[HostCachingAllocator::size_class(bytes)].push_back(ptr);
  }

  Device device() const override { return Device::cuda(device_); }

  void release_cached() noexcept {
    std::lock_guard lock(mutex_);
    int previous = 0;
    CUDA_CHECK_NOTHROW(cudaGetDevice(&previous));
    CUDA_CHECK_NOTHROW(cudaSetDevice(device_));
    for (auto& [size, blocks] : free_)
      for (void* p : blocks) CUDA_CHECK_NOTHROW(cudaFree(p));
    free_.clear();
    CUDA_CHECK_NOTHROW(cudaSetDevice(previous));
  }

 private:
  int device_;
  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;
};

}  // namespace

namespace ops::cuda {
int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no GPU: not an error for a CPU run
    return 0;
  }
  return n;
}
}  // namespace ops::cuda

Allocator& allocator_for(Device device) {
  if (device.is_cpu()) return host_allocator();
  // One allocator per GPU, created once; leaked on purpose like the host allocator, because
  // tensors held by static objects may be freed after main returns.
  static std::vector<CudaCachingAllocator*>* allocators = [] {
    auto* v = new std::vector<CudaCachingAllocator*>();
    for (int i = 0; i < ops::cuda::device_count(); ++i) v->push_back(new CudaCachingAllocator(i));
    return v;
  }();
  STRATA_REQUIRE(device.index >= 0 && device.index < static_cast<int>(allocators->size()), "device ", device.str(),
                 " requested, but this machine has ", allocators->size(), " CUDA device(s)");
  return *(*allocators)[static_cast<size_t>(device.index)];
}

}  // namespace strata
