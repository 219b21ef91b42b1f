// Device selection: which GPU (or the CPU) each rank uses, checked before anything starts.
#include "parallel/runtime/device.hpp"

#include <algorithm>
#include <set>
#include <vector>

#include "core/allocator.hpp"
#include "parallel/comm/shared_memory.hpp"
#include "parallel/runtime/mpi.hpp"

#if STRATA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace strata::parallel {

DeviceKind parse_device_kind(const std::string& text, const std::string& flag) {
  if (text == "cpu") return DeviceKind::CPU;
  if (text == "cuda") return DeviceKind::CUDA;
  STRATA_THROW_INPUT(flag, " must be cpu or cuda, found '", text, "'");
}

const char* device_kind_name(DeviceKind kind) { return kind == DeviceKind::CUDA ? "cuda" : "cpu"; }

Transport parse_transport(const std::string& text, DeviceKind kind, const std::string& flag) {
  if (text == "mpi") return Transport::Mpi;
  if (text == "nccl") return Transport::Nccl;
  if (text == "auto") return kind == DeviceKind::CUDA ? Transport::Nccl : Transport::Mpi;
  STRATA_THROW_INPUT(flag, " must be auto, nccl or mpi, found '", text, "'");
}

const char* transport_name(Transport transport) { return transport == Transport::Nccl ? "nccl" : "mpi"; }

Device select_device(DeviceKind kind, Transport transport, const NodeGpus& node) {
  if (kind == DeviceKind::CPU) {
    STRATA_REQUIRE(transport == Transport::Mpi,
                   "--comm nccl needs --device cuda (NCCL moves GPU memory); use --comm mpi or auto with --device cpu");
    return Device::cpu();
  }
  STRATA_REQUIRE(node.cuda_build,
                 "--device cuda: this build of Strata has no CUDA (configure with -DSTRATA_CUDA=ON where nvcc is "
                 "installed), or use --device cpu");
  STRATA_REQUIRE(node.visible_gpus > 0, "--device cuda: no CUDA device on node ", node.node, " (",
                 node.cuda_error.empty() ? "no GPU or driver, or CUDA_VISIBLE_DEVICES hides them" : node.cuda_error,
                 "); use --device cpu");
  if (transport == Transport::Nccl) {
    // Under CUDA_VISIBLE_DEVICES per rank every rank sees "GPU 0", yet they differ: count the
    // physical GPUs the node's ranks would use when known.
    const int gpus = node.distinct_gpus > 0 ? node.distinct_gpus : node.visible_gpus;
    STRATA_REQUIRE(node.local_size <= gpus, node.local_size, " ranks on node ", node.node, " but only ", gpus,
                   gpus == 1 ? " GPU" : " GPUs", ": NCCL needs one GPU per rank; start at most ", gpus,
                   gpus == 1 ? " rank" : " ranks", " per node, or use --comm mpi to share a GPU");
  }
  return Device::cuda(node.local_rank % node.visible_gpus);
}

Device select_device(MPI_Comm world, DeviceKind kind, Transport transport) {
  NodeGpus node;
  node.cuda_build = STRATA_WITH_CUDA != 0;
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  MPI_CHECK(MPI_Get_processor_name(name, &length));
  node.node.assign(name, static_cast<size_t>(length));
  MPI_Comm local = split_by_node(world);
  MPI_CHECK(MPI_Comm_rank(local, &node.local_rank));
  MPI_CHECK(MPI_Comm_size(local, &node.local_size));
  // Every rank of the node takes part in the exchange, GPU or not, before anyone can throw.
  if (kind == DeviceKind::CUDA) {
    constexpr int kBusIdBytes = 32;
    std::vector<char> mine(kBusIdBytes, '\0');
#if STRATA_WITH_CUDA
    if (const cudaError_t rc = cudaGetDeviceCount(&node.visible_gpus); rc != cudaSuccess) {
      (void)cudaGetLastError();  // no driver or no GPU: reported below as an input error
      node.visible_gpus = 0;
      if (rc != cudaErrorNoDevice) node.cuda_error = cudaGetErrorString(rc);  // e.g. driver older than CUDA 13
    }
    if (node.visible_gpus > 0 &&
        cudaDeviceGetPCIBusId(mine.data(), kBusIdBytes - 1, node.local_rank % node.visible_gpus) != cudaSuccess) {
      (void)cudaGetLastError();
      mine.assign(kBusIdBytes, '\0');
    }
#endif
    std::vector<char> all(static_cast<size_t>(kBusIdBytes) * static_cast<size_t>(node.local_size));
    const int rc = MPI_Allgather(mine.data(), kBusIdBytes, MPI_CHAR, all.data(), kBusIdBytes, MPI_CHAR, local);
    std::set<std::string> distinct;
    bool known = rc == MPI_SUCCESS;
    for (int r = 0; known && r < node.local_size; ++r) {
      const std::string id(all.data() + static_cast<size_t>(r) * kBusIdBytes);
      known = !id.empty();
      distinct.insert(id);
    }
    node.distinct_gpus = known ? static_cast<int>(distinct.size()) : 0;
  }
  MPI_Comm_free(&local);
  const Device device = select_device(kind, transport, node);
#if STRATA_WITH_CUDA
  if (device.is_cuda()) {
    const cudaError_t rc = cudaSetDevice(device.index);
    STRATA_CHECK(rc == cudaSuccess, "cudaSetDevice(", device.index, "): ", cudaGetErrorString(rc));
  }
#endif
  return device;
}

Device select_device(const MpiRuntime& mpi, DeviceKind kind, Transport transport) {
  (void)mpi;  // the runtime exists: MPI is initialised; the node is found again over the world
  return select_device(MPI_COMM_WORLD, kind, transport);
}

int64_t peak_memory_bytes(Device device) {
  return static_cast<int64_t>(allocator_for(device).peak_in_use() + (device.is_cpu() ? shared_memory_peak_bytes() : 0));
}

void cap_host_memory(Device device, int64_t bytes) {
  if (!device.is_cpu()) return;
  host_allocator().set_limit(
      bytes > 0 ? static_cast<size_t>(std::max<int64_t>(1, bytes - static_cast<int64_t>(shared_memory_peak_bytes())))
                : 0);
}

}  // namespace strata::parallel
