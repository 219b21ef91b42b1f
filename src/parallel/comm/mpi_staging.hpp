// Device tensors around MPI calls (MpiCommunicator): MPI here is not CUDA-aware, so a device
// tensor travels through pinned host memory from core (cuda::PinnedBuffer). The tensor is
// copied to it on the device's compute stream when the operation starts (the host waits for
// that stream before MPI reads the memory), and copied back asynchronously on the compute
// stream when the operation is found complete, so kernels launched afterwards see the result.
// CPU tensors are used in place. In a build without CUDA, a device tensor is an error.
#pragma once

#include <set>
#include <vector>

#include "core/tensor.hpp"

namespace strata::parallel {

// The staging of one MPI operation. Not thread-safe: the thread that calls MPI uses it.
class DeviceStaging {
 public:
  DeviceStaging();
  ~DeviceStaging();
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  // The host memory MPI reads and writes for t: t's own for a CPU tensor (no copy at all); for a
  // device tensor a pinned buffer, filled from the device when the operation reads t (`copy_in`:
  // queued on the compute stream, see wait_for_copies_in) and copied back by copy_back() if the
  // operation writes t (`copy_out`).
  void* host_memory(const Tensor& t, bool copy_in, bool copy_out);
  // Copies `part` of a device tensor into `host` (part of a staging buffer), like copy_in.
  void stage_part(const Tensor& part, void* host);
  // Before MPI reads staged memory: the copies (and the kernels that wrote the tensors before
  // them) are done. Synchronises only the compute streams of the devices involved.
  void wait_for_copies_in();
  // After completion (and any host-side finishing such as Avg's scaling): the results go back
  // to the device, asynchronously on the compute stream, so later kernels see them without the
  // host waiting; the pinned blocks are reused only after these copies. Releases the buffers.
  void copy_back();
  // Whether any device tensor is staged (and not yet copied back).
  bool any() const;

 private:
  struct Staged;  // a device tensor and its pinned buffer (CUDA builds)
  std::vector<Staged> staged_;
  std::set<int> staged_in_;  // devices whose compute stream holds copies to pinned memory
};

}  // namespace strata::parallel
