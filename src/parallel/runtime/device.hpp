// Which device each rank computes on and which transport carries its device tensors:
// `--device cpu|cuda` and `--comm auto|nccl|mpi`. One rank per GPU with NCCL (NCCL refuses two
// ranks of a communicator on one GPU); with MPI, ranks may share GPUs round-robin.
#pragma once

#include <mpi.h>

#include <string>

#include "core/dtype.hpp"

namespace strata::parallel {

class MpiRuntime;

// How device tensors travel between ranks: MPI through pinned host memory, or NCCL.
enum class Transport { Mpi, Nccl };

// "cpu" or "cuda" (input error otherwise, naming `flag`).
DeviceKind parse_device_kind(const std::string& text, const std::string& flag = "--device");
// "cpu" or "cuda", as parse_device_kind reads them.
const char* device_kind_name(DeviceKind kind);
// "mpi", "nccl" or "auto" (NCCL for CUDA, MPI for the CPU); input error otherwise.
Transport parse_transport(const std::string& text, DeviceKind kind, const std::string& flag = "--comm");
const char* transport_name(Transport transport);

// What a rank knows about its node when choosing a device; filled by select_device(MPI_Comm)
// and injectable in tests.
struct NodeGpus {
  std::string node;       // host name, for messages
  int local_rank = 0;     // rank among the ranks of this node
  int local_size = 1;     // ranks on this node
  int visible_gpus = 0;   // CUDA devices this rank sees (0: no GPU, or a build without CUDA)
  int distinct_gpus = 0;  // physical GPUs the node's ranks would use (by PCI bus id); 0: unknown
  bool cuda_build = false;
  std::string cuda_error;  // why CUDA saw no device, when it says more than "none" (e.g. an old driver)
};

// The device of this rank: the CPU, or GPU local_rank % visible_gpus. Input errors, the same on
// every rank of a node: CUDA asked of a build without CUDA or a node without GPUs; NCCL with the
// CPU; NCCL with more ranks on a node than GPUs they can use ("4 ranks on node n1 but only 2
// GPUs: ..."), where MPI shares them.
Device select_device(DeviceKind kind, Transport transport, const NodeGpus& node);

// The same over real MPI: collective over `world` (every rank must call it; it exchanges the
// chosen GPUs' PCI bus ids within each node, so ranks that see different GPUs through
// CUDA_VISIBLE_DEVICES count as distinct), then makes the chosen GPU current. Run it inside
// run_collectively so that all ranks agree on an error.
Device select_device(MPI_Comm world, DeviceKind kind, Transport transport);
Device select_device(const MpiRuntime& mpi, DeviceKind kind, Transport transport);

// This rank's memory high-water mark: its device allocator's and, on the CPU, the shared-memory
// buffers of its one-node groups (gradients and parameters), which are not allocator blocks.
int64_t peak_memory_bytes(Device device);
// --device-memory on the CPU: holds the host allocator to what `bytes` leaves beside the
// shared-memory buffers made so far (0: no cap). The GPU's memory is the driver's to refuse.
void cap_host_memory(Device device, int64_t bytes);

}  // namespace strata::parallel
