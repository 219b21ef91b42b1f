// DeviceStaging: device tensors through core's pinned host memory around MPI calls.
#include "parallel/comm/mpi_staging.hpp"

#include "core/error.hpp"

#if STRATA_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda/allocator.hpp"
#include "core/cuda/check.hpp"
#include "core/cuda/runtime.hpp"
#endif

namespace strata::parallel {

#if STRATA_WITH_CUDA
// A device tensor of an operation and the host memory MPI uses in its place.
struct DeviceStaging::Staged {
  Tensor device;
  cuda::PinnedBuffer host;
  bool copy_back = false;  // the operation writes it: copy the host memory back when complete
};
#else
struct DeviceStaging::Staged {};
#endif

DeviceStaging::DeviceStaging() = default;
DeviceStaging::~DeviceStaging() = default;

void* DeviceStaging::host_memory(const Tensor& t, bool copy_in, bool copy_out) {
  if (t.device().is_cpu() || t.nbytes() == 0) return t.raw();
#if STRATA_WITH_CUDA
  const int device = t.device().index;
  Staged& s = staged_.emplace_back(Staged{t, cuda::PinnedBuffer(t.nbytes()), copy_out});
  if (copy_in) {
    cuda::DeviceGuard guard(device);
    CUDA_CHECK(
        cudaMemcpyAsync(s.host.data(), t.raw(), t.nbytes(), cudaMemcpyDeviceToHost, cuda::compute_stream(device)));
    staged_in_.insert(device);
  }
  return s.host.data();
#else
  STRATA_THROW("MpiCommunicator got a tensor on ", t.device().str(), " in a build without CUDA");
#endif
}

void DeviceStaging::stage_part(const Tensor& part, void* host) {
#if STRATA_WITH_CUDA
  if (part.nbytes() == 0) return;
  const int device = part.device().index;
  cuda::DeviceGuard guard(device);
  CUDA_CHECK(cudaMemcpyAsync(host, part.raw(), part.nbytes(), cudaMemcpyDeviceToHost, cuda::compute_stream(device)));
  staged_in_.insert(device);
#endif
}

void DeviceStaging::wait_for_copies_in() {
#if STRATA_WITH_CUDA
  for (int device : staged_in_) CUDA_CHECK(cudaStreamSynchronize(cuda::compute_stream(device)));
  staged_in_.clear();
#endif
}

void DeviceStaging::copy_back() {
#if STRATA_WITH_CUDA
  for (Staged& s : staged_) {
    if (!s.copy_back) continue;
    const int device = s.device.device().index;
    cuda::DeviceGuard guard(device);
    const cudaStream_t stream = cuda::compute_stream(device);
    CUDA_CHECK(cudaMemcpyAsync(s.device.raw(), s.host.data(), s.device.nbytes(), cudaMemcpyHostToDevice, stream));
    s.host.read_by(stream, device);
  }
  staged_.clear();
#endif
}

bool DeviceStaging::any() const { return !staged_.empty(); }

}  // namespace strata::parallel
