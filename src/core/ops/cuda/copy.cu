// Copies between devices (host <-> device, device <-> device), ordered on the compute streams.
#include <cstring>

#include "core/cuda/check.hpp"
#include "core/cuda/runtime.hpp"
#include "core/ops/cuda/cuda_ops.hpp"

namespace strata::ops::cuda {

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

}  // namespace strata::ops::cuda
