// CUDA device memory: a caching allocator per GPU (cudaMalloc/cudaFree synchronise the device
// and are slow, so freed blocks are kept in size-class free lists and handed out again), the
// device count, copies between devices, and allocator_for() for every device in CUDA builds.
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/allocator.hpp"
#include "core/ops/cuda/context.hpp"
#include "core/ops/cuda/cuda_check.hpp"
#include "core/ops/cuda/cuda_ops.hpp"

namespace strata {

namespace {

// Blocks are reused in stream order, without an event: every Strata kernel, copy and library
// call on a GPU runs on its compute stream (context.hpp), so work queued on a reused block runs
// after all work queued on it before it was freed, even if that has not finished yet. Anything
// using device memory on another stream (NCCL) must make the compute stream wait for it (an
// event) before its tensors are freed.
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
    // A cached block may still be read or written by queued work (see above): let the device
    // drain before giving blocks back. Only on an out-of-memory retry, never in a normal step.
    if (!free_.empty()) CUDA_CHECK_NOTHROW(cudaDeviceSynchronize());
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

void copy(const Tensor& src, const Tensor& dst) {
  const size_t bytes = src.nbytes();
  if (bytes == 0) return;
  const Device from = src.device(), to = dst.device();
  if (from.is_cpu() && to.is_cpu()) {
    std::memmove(dst.raw(), src.raw(), bytes);
    return;
  }
  if (from.is_cpu()) {
    // Host memory is pageable (host caching allocator): the driver stages it before returning,
    // so the host buffer may be reused at once while the transfer stays queued on the stream.
    DeviceGuard guard(to.index);
    CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), bytes, cudaMemcpyHostToDevice, compute_stream(to.index)));
    return;
  }
  if (to.is_cpu()) {
    // The caller reads the host buffer next: wait for this stream only, not the whole device.
    DeviceGuard guard(from.index);
    const cudaStream_t stream = compute_stream(from.index);
    CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), bytes, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  if (from == to) {
    DeviceGuard guard(to.index);
    CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), bytes, cudaMemcpyDeviceToDevice, compute_stream(to.index)));
    return;
  }
  // Across GPUs: the copy runs on the destination's stream after the source's queued work
  // (event), and the source's stream waits for the copy before it may reuse src's memory.
  const cudaStream_t src_stream = compute_stream(from.index), dst_stream = compute_stream(to.index);
  Owned<cudaEvent_t> src_ready, copied;
  {
    DeviceGuard guard(from.index);
    src_ready = make_event();
    CUDA_CHECK(cudaEventRecord(src_ready, src_stream));
  }
  DeviceGuard guard(to.index);
  copied = make_event();
  CUDA_CHECK(cudaStreamWaitEvent(dst_stream, src_ready, 0));
  CUDA_CHECK(cudaMemcpyPeerAsync(dst.raw(), to.index, src.raw(), from.index, bytes, dst_stream));
  CUDA_CHECK(cudaEventRecord(copied, dst_stream));
  CUDA_CHECK(cudaStreamWaitEvent(src_stream, copied, 0));
  // Destroying a recorded event is fine: waits already queued keep their meaning.
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
