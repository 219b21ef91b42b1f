#include "core/allocator.hpp"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <new>

#include "core/error.hpp"

namespace strata {

namespace {
constexpr size_t kAlignment = 64;
}

HostCachingAllocator::~HostCachingAllocator() { release_cached(); }

size_t HostCachingAllocator::size_class(size_t bytes) {
  bytes = std::max<size_t>(bytes, kAlignment);
  // Eight classes per power of two: waste under 12.5%, few distinct sizes.
  const size_t top = std::bit_floor(bytes);
  const size_t step = std::max<size_t>(top / 8, kAlignment);
  return (bytes + step - 1) / step * step;
}

void HostCachingAllocator::set_limit(size_t bytes) {
  std::lock_guard lock(mutex_);
  limit_ = bytes;
}

void* HostCachingAllocator::allocate(size_t bytes) {
  const size_t size = size_class(bytes);
  {
    std::lock_guard lock(mutex_);
    // The cap (--device-memory on the CPU): an Input error, before any memory is touched.
    STRATA_REQUIRE(limit_ == 0 || stats_.bytes_in_use + size <= limit_, "--device-memory: ", size,
                   " more bytes would bring this rank to ", stats_.bytes_in_use + size, " bytes of tensors, over its ",
                   limit_, " (activations or workspace beyond what fitted at setup; see the plan, --dry-run)");
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.bytes_cached -= size;
      stats_.bytes_in_use += size;
      stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.bytes_in_use);
      ++stats_.cache_hits;
      return p;
    }
  }
  void* p = std::aligned_alloc(kAlignment, size);
  if (p == nullptr) {
    release_cached();  // give the cache back and try once more before failing
    p = std::aligned_alloc(kAlignment, size);
  }
  STRATA_CHECK(p != nullptr, "out of host memory allocating ", size, " bytes");
  std::lock_guard lock(mutex_);
  stats_.bytes_in_use += size;
  stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.bytes_in_use);
  ++stats_.system_allocs;
  return p;
}

void HostCachingAllocator::deallocate(void* ptr, size_t bytes) noexcept {
  if (ptr == nullptr) return;
  const size_t size = size_class(bytes);
  std::lock_guard lock(mutex_);
  free_[size].push_back(ptr);
  stats_.bytes_in_use -= size;
  stats_.bytes_cached += size;
}

void HostCachingAllocator::reset_peak() {
  std::lock_guard lock(mutex_);
  stats_.peak_in_use = stats_.bytes_in_use;
}

AllocatorStats HostCachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void HostCachingAllocator::release_cached() {
  std::lock_guard lock(mutex_);
  for (auto& [size, blocks] : free_) {
    for (void* p : blocks) std::free(p);
    stats_.bytes_cached -= size * blocks.size();
  }
  free_.clear();
}

HostCachingAllocator& host_allocator() {
  // Leaked on purpose: tensors held by static objects may be freed after main returns.
  static auto* allocator = new HostCachingAllocator();
  return *allocator;
}

void* MetaAllocator::allocate(size_t bytes) {
  in_use_ += HostCachingAllocator::size_class(bytes);
  peak_ = std::max(peak_, in_use_);
  return reinterpret_cast<void*>(kAlignment);  // never dereferenced: meta ops do nothing
}

void MetaAllocator::deallocate(void*, size_t bytes) noexcept { in_use_ -= HostCachingAllocator::size_class(bytes); }

MetaAllocator& meta_allocator() {
  static auto* allocator = new MetaAllocator();  // leaked like the host allocator
  return *allocator;
}

#if !STRATA_WITH_CUDA
Allocator& allocator_for(Device device) {
  if (device.is_meta()) return meta_allocator();
  STRATA_REQUIRE(device.is_cpu(), "device ", device.str(),
                 " requested, but this build of Strata has no CUDA support (configure with -DSTRATA_CUDA=ON)");
  return host_allocator();
}
#endif

}  // namespace strata
