// Memory for tensors. Host memory comes from a caching allocator: freed blocks are kept in
// size-class free lists and handed out again, because the first touch of fresh pages costs
// ~11 µs per 4 KiB here and a training step must not pay it (glibc returns blocks > 32 MiB
// to the OS on free, so without a cache every large activation would be fresh pages).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "core/dtype.hpp"

namespace strata {

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr, size_t bytes) noexcept = 0;
  virtual Device device() const = 0;
  // The most bytes (size classes) handed out at once so far: the memory a run needed.
  virtual size_t peak_in_use() const = 0;
};

struct AllocatorStats {
  size_t bytes_in_use = 0;  // handed out and not yet returned
  size_t bytes_cached = 0;  // held in free lists
  size_t peak_in_use = 0;
  uint64_t system_allocs = 0;  // blocks obtained from the system
  uint64_t cache_hits = 0;     // allocations served from a free list
};

// Thread-safe; blocks are 64-byte aligned and rounded up to a size class (at most 1/8 waste).
class HostCachingAllocator final : public Allocator {
 public:
  ~HostCachingAllocator() override;
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) noexcept override;
  Device device() const override { return Device::cpu(); }
  size_t peak_in_use() const override { return stats().peak_in_use; }

  // The size actually reserved for a request of `bytes`.
  static size_t size_class(size_t bytes);
  AllocatorStats stats() const;
  // Returns all cached blocks to the system.
  void release_cached();
  // The high-water mark starts again from what is in use now (after a start-up measurement
  // whose buffers are gone, so that the peak is the run's).
  void reset_peak();
  // At most `bytes` handed out at once (0: no limit); an allocation past it is an Input error
  // naming the sizes (--device-memory on the CPU device, so its behaviour is testable here).
  void set_limit(size_t bytes);

 private:
  mutable std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;
  AllocatorStats stats_;
  size_t limit_ = 0;
};

HostCachingAllocator& host_allocator();

// The meta device's allocator: hands out no memory (a fixed non-null address that nothing may
// read) and counts what the host cache would reserve (its size classes), so running layers on
// meta tensors measures a step's activations without allocating them (parallel::plan_activations).
// One thread at a time.
class MetaAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) noexcept override;
  Device device() const override { return Device::meta(); }
  size_t peak_in_use() const override { return peak_; }
  size_t in_use() const { return in_use_; }
  // Starts a new high-water mark at what is in use now.
  void reset_peak() { peak_ = in_use_; }
  // Whether meta ops count the f32 scratch the CPU kernels stage bf16/f16 tensors through
  // (planning for the CPU) or not (a GPU computes in the tensors' dtype).
  bool host_staging() const { return host_staging_; }
  void set_host_staging(bool on) { host_staging_ = on; }

 private:
  size_t in_use_ = 0, peak_ = 0;
  bool host_staging_ = true;
};

MetaAllocator& meta_allocator();

// The allocator for a device: the host cache for CPU, the CUDA caching allocator for GPUs, the
// counting meta allocator for meta tensors.
Allocator& allocator_for(Device device);

}  // namespace strata
