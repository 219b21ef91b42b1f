// CUDA memory (CUDA builds): a caching allocator per GPU (cudaMalloc/cudaFree synchronise the
// device and are slow, so freed blocks are kept in size-class free lists and handed out
// again), allocator_for() for every device, and the pinned host staging pool (allocator.hpp).
#include "core/cuda/allocator.hpp"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "core/allocator.hpp"
#include "core/cuda/check.hpp"
#include "core/cuda/runtime.hpp"

namespace strata {

namespace {

// Blocks are reused in stream order, without an event: every Strata kernel, copy and library
// call on a GPU runs on its compute stream (runtime.hpp), so work queued on a reused block runs
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
        count_in_use(size);
        return p;
      }
    }
    cuda::DeviceGuard guard(device_);
    void* p = nullptr;
    if (cudaMalloc(&p, size) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the error, give the cache back and try once more
      release_cached();
      CUDA_CHECK(cudaMalloc(&p, size));
    }
    std::lock_guard lock(mutex_);
    count_in_use(size);
    return p;
  }

  void deallocate(void* ptr, size_t bytes) noexcept override {
    if (ptr == nullptr) return;
    std::lock_guard lock(mutex_);
    const size_t size = HostCachingAllocator::size_class(bytes);
    in_use_ -= size;
    free_[size].push_back(ptr);
  }

  Device device() const override { return Device::cuda(device_); }
  size_t peak_in_use() const override {
    std::lock_guard lock(mutex_);
    return peak_;
  }

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
  void count_in_use(size_t size) {  // under mutex_
    in_use_ += size;
    peak_ = std::max(peak_, in_use_);
  }

  int device_;
  mutable std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;
  size_t in_use_ = 0, peak_ = 0;
};

}  // namespace

Allocator& allocator_for(Device device) {
  if (device.is_cpu()) return host_allocator();
  if (device.is_meta()) return meta_allocator();
  // One allocator per GPU, created once; leaked on purpose like the host allocator, because
  // tensors held by static objects may be freed after main returns.
  static std::vector<CudaCachingAllocator*>* allocators = [] {
    auto* v = new std::vector<CudaCachingAllocator*>();
    for (int i = 0; i < cuda::device_count(); ++i) v->push_back(new CudaCachingAllocator(i));
    return v;
  }();
  STRATA_REQUIRE(device.index >= 0 && device.index < static_cast<int>(allocators->size()), "device ", device.str(),
                 " requested, but this machine has ", allocators->size(), " CUDA device(s)");
  return *(*allocators)[static_cast<size_t>(device.index)];
}

namespace cuda {

namespace {

// The pinned blocks not in use, by size class; thread-safe.
class PinnedPool {
 public:
  using Block = PinnedBuffer::Block;

  Block take(size_t bytes) {
    const size_t size = HostCachingAllocator::size_class(bytes);
    Block block;
    {
      std::lock_guard lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        block = it->second.back();
        it->second.pop_back();
      }
    }
    if (block.ptr == nullptr) {
      block.bytes = size;
      CUDA_CHECK(cudaHostAlloc(&block.ptr, size, cudaHostAllocPortable));
    } else if (block.copied != nullptr) {
      CUDA_CHECK(cudaEventSynchronize(block.copied));  // usually long done
    }
    return block;
  }

  void give(Block block) noexcept {
    std::lock_guard lock(mutex_);
    free_[block.bytes].push_back(block);
  }

 private:
  std::mutex mutex_;
  std::map<size_t, std::vector<Block>> free_;
};

// Leaked on purpose (like the tensor allocators): buffers may be returned after main, when
// freeing pinned memory would fail.
PinnedPool& pinned_pool() {
  static PinnedPool* pool = new PinnedPool;
  return *pool;
}

}  // namespace

PinnedBuffer::PinnedBuffer(size_t bytes) : block_(pinned_pool().take(bytes)) {}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept : block_(std::exchange(other.block_, {})) {}

PinnedBuffer::~PinnedBuffer() {
  if (block_.ptr != nullptr) pinned_pool().give(block_);
}

void PinnedBuffer::read_by(cudaStream_t stream, int device) {
  if (block_.event_device != device) {
    if (block_.copied != nullptr) CUDA_CHECK_NOTHROW(cudaEventDestroy(block_.copied));
    block_.copied = nullptr;
    DeviceGuard guard(device);
    CUDA_CHECK(cudaEventCreateWithFlags(&block_.copied, cudaEventDisableTiming));
    block_.event_device = device;
  }
  CUDA_CHECK(cudaEventRecord(block_.copied, stream));
}

}  // namespace cuda

}  // namespace strata
