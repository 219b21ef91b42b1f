// Pinned (page-locked) host memory for staging device tensors (CUDA builds only), e.g. around
// MPI calls, which are not CUDA-aware here: copies from pinned memory run at full PCIe /
// NVLink-C2C speed and asynchronously. Blocks come from a process-wide cache by size class
// (HostCachingAllocator::size_class) and are reused; a block whose last use was an
// asynchronous copy back to the device carries an event, and is handed out again only once
// that copy has finished. The device caching allocator behind allocator_for() lives in
// allocator.cpp next to this pool.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace strata::cuda {

// A pinned block of at least `bytes` for one use (move-only); back to the cache when it goes away.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes);
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&&) = delete;
  PinnedBuffer(const PinnedBuffer&) = delete;
  ~PinnedBuffer();

  void* data() const { return block_.ptr; }
  // Marks the block as read by an asynchronous copy just queued on `stream` of `device`: the
  // cache hands it out again only after that copy.
  void read_by(cudaStream_t stream, int device);

  struct Block {
    void* ptr = nullptr;
    size_t bytes = 0;
    cudaEvent_t copied = nullptr;  // recorded after the last asynchronous read of the block
    int event_device = -1;         // the device `copied` belongs to
  };

 private:
  Block block_;
};

}  // namespace strata::cuda
