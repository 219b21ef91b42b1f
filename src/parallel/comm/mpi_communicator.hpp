// MpiCommunicator: the Communicator interface over MPI and host memory. Every collective is
// an MPI non-blocking call on a private duplicate of the given communicator; the returned
// Work wraps its MPI_Request. Open MPI's non-blocking collectives advance only inside MPI
// calls, so a trainer that overlaps gradient sync with backward calls progress() between
// layers (measured against a communication thread: see mpi_communicator.cpp).
//
// With every rank on one node, allocate() hands out shared memory, and all-reduces and reduces
// of f32 ranges of it, and in-place all-gathers into it, skip MPI (shared_memory.hpp): they run
// in the order they were started, as do the MPI operations, but the two kinds are not ordered
// against each other. After reserve_messages(), sends and receives of CPU tensors that fit its
// size skip MPI as well.
//
// Device tensors (CUDA builds; `--comm mpi` on GPUs, which lets ranks share a GPU) are staged
// through core's cached pinned host memory (mpi_staging.hpp): copied from the device on its
// compute stream when the operation starts (the host waits for that stream), and copied back
// asynchronously on the compute stream when the operation is found complete (wait(), test(),
// or a dropped handle), so kernels launched afterwards see the result. CPU tensors are used in
// place.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "parallel/comm/communicator.hpp"

namespace strata::parallel {

class NodeSharedMemory;
namespace watchdog {
struct Channel;
}
struct MpiOpState;  // one started operation: its request, buffers and completion step (in the .cpp)

class MpiCommunicator final : public Communicator {
 public:
  // Duplicates `comm` (MPI_Comm_dup, collective over `comm`), so Strata's messages never
  // match anyone else's; errors on the duplicate come back as codes (MPI_ERRORS_RETURN).
  // `shared_memory` false: allocate() and reserve_messages() change nothing (everything goes
  // through MPI).
  MpiCommunicator(MPI_Comm comm, std::string name, bool shared_memory = true);
  // Waits for operations still in flight, then frees the duplicate; never throws.
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // The private duplicate (for code that needs a raw MPI call on the same group).
  MPI_Comm comm() const { return comm_; }
  // Its identity and collective fingerprint, for raw MPI calls recorded by the watchdog (runtime/host_values.hpp).
  const std::shared_ptr<watchdog::Channel>& channel() const { return channel_; }

  WorkPtr all_reduce_async(const Tensor& t, ReduceOp op) override;
  WorkPtr reduce_scatter_async(const Tensor& in, const Tensor& out, ReduceOp op) override;
  // `in` may be chunk rank() of `out` (gathers in place).
  WorkPtr all_gather_async(const Tensor& in, const Tensor& out) override;
  WorkPtr reduce_async(const Tensor& t, int root, ReduceOp op) override;
  WorkPtr broadcast_async(const Tensor& t, int root) override;
  WorkPtr send_async(const Tensor& t, int peer, int tag) override;
  WorkPtr recv_async(const Tensor& t, int peer, int tag) override;
  WorkPtr barrier_async() override;
  // MPI_Testsome over this communicator's outstanding requests: drives libnbc's schedules
  // and the shared-memory transport one step further. Cheap (~1 µs) when nothing is ready.
  void progress() override;
  // CPU tensors of a group on one node: shared memory (the first call sets it up); else, or if
  // /dev/shm cannot hold it (rank 0 says so once), ordinary memory.
  Tensor allocate(int64_t numel, DType dtype, Device device) override;
  void reserve_messages(int64_t max_bytes, int slots) override;
  // Whether `t` lies in shared memory from allocate(), so its all-reduce, reduce and all-gather skip MPI.
  bool in_shared_memory(const Tensor& t) const;
  // Whether this group's CPU buffers and messages go through shared memory: every rank on one
  // node (split_by_node) and shared memory allowed. Collective the first time; maps nothing.
  bool node_local();

  // Operations started and not yet seen complete (for tests and diagnostics).
  int in_flight() const;
  // Bytes this rank sends, counted when an operation starts, as the textbook algorithm sends
  // them (n = size(), nothing on one rank): all-reduce 2(n-1)/n x size (ring); reduce: size on
  // every rank but the root (the root only receives); broadcast: size at the root;
  // all-gather: (n-1)/n x output; reduce-scatter: (n-1)/n x input; send: size.
  int64_t bytes_sent() const override { return bytes_sent_; }

 private:
  WorkPtr track(std::shared_ptr<MpiOpState> state);
  // Wraps a started operation (flight-recorder entry `seq`) so its waits run under the watchdog.
  static WorkPtr watched(WorkPtr work, uint64_t seq);
  // Adds bytes * numerator / denominator to bytes_sent_.
  void count_sent(size_t bytes, int numerator, int denominator);

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::string name_;
  int rank_ = 0;
  int size_ = 1;
  int64_t bytes_sent_ = 0;
  std::shared_ptr<watchdog::Channel> channel_;  // identity and fingerprint (watchdog.hpp)
  // Started operations; progress() tests them, completed ones are dropped on the next start.
  std::vector<std::shared_ptr<MpiOpState>> pending_;
  // The one-node group (created collectively on the first call), or nullptr.
  NodeSharedMemory* node_group();

  bool use_shared_memory_;                    // the constructor's choice
  bool shared_checked_ = false;               // allocate() or reserve_messages() has looked for a one-node group
  std::unique_ptr<NodeSharedMemory> shared_;  // set when it found one
  int one_node_ = -1;                         // node_local(): -1 not yet asked
};

}  // namespace strata::parallel
