// All-reduce, reduce and all-gather through shared memory, for a communicator whose ranks all
// run on one node (the data-parallel group of a one-node job, or of a stage). A buffer from
// allocate() is one POSIX shared-memory segment per rank, mapped by every rank of the group, so
// reducing a range of it sends no messages: for an all-reduce each rank sums its 1/n chunk of
// the range straight out of the peers' mappings (always in rank order, so every element has one
// rounding sequence), then copies the other chunks' sums from their owners; for a reduce
// (ZeRO's reduce of a bucket's pieces to their owners) the root sums the whole range and
// nothing is copied; for an in-place all-gather (ZeRO's parameters after the sharded step) each
// rank copies the other ranks' chunks from their mappings. Open MPI's shared-memory transport
// moves every byte through an intermediate buffer first; here each byte is read where it lies.
// Measured on the 2-core development machine, 7.45 MB of f32 on 2 ranks: 0.57 ms against 1.15
// ms for MPI_Allreduce (docs/benchmarks.md, "Collectives").
//
// Three counters per rank order the phases of operation s (operations run strictly one after
// another, in the order they were started, the same on every rank): arrived = s (this rank's
// gradients for the range are written), reduced = s (its chunk, or as root the range, holds the
// sum; all-gather: it holds every chunk), done = s (it has copied the other chunks: nobody
// reads its memory for s any more). A rank writes only its own counters. Waiting spins on them
// and yields the core when it spins long (oversubscribed runs).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"

namespace strata::parallel {

class NodeSharedMemory {
 public:
  // Collective over `comm`: nullptr unless every rank of it is on this node (and there are
  // at least two).
  static std::unique_ptr<NodeSharedMemory> create(MPI_Comm comm);
  ~NodeSharedMemory();
  NodeSharedMemory(const NodeSharedMemory&) = delete;
  NodeSharedMemory& operator=(const NodeSharedMemory&) = delete;

  // Collective: a zeroed CPU tensor of `numel` elements in a segment mapped by every rank of
  // the group. Undefined (on every rank alike) when some rank could not create or map its
  // segment, e.g. /dev/shm too small; then `why_not` says what failed.
  Tensor allocate(int64_t numel, DType dtype, std::string& why_not);
  // Whether `t` lies in a buffer from allocate() (of this group).
  bool holds(const Tensor& t) const;
  // Starts the in-place all-reduce (sum, or average) of `t`: f32, inside a buffer from
  // allocate(), the same range on every rank. nullptr when `t` is not such a tensor.
  WorkPtr all_reduce_async(const Tensor& t, bool average);
  // Starts the reduce of `t` into `t` on `root` (the others' `t` are only read), as above.
  WorkPtr reduce_async(const Tensor& t, int root, bool average);
  // Starts the in-place all-gather into `out` (any dtype, inside a buffer from allocate(), the
  // same range on every rank) of `in`, which must be chunk `rank` of it. nullptr otherwise.
  WorkPtr all_gather_async(const Tensor& in, const Tensor& out);
  // Advances the started operations as far as they go without waiting.
  void progress();
  // Operations started and not complete.
  int in_flight() const { return static_cast<int>(queue_.size()); }

  struct Op;  // one operation: its range in every rank's mapping and its phase (in the .cpp)
  struct Counters;
  // Advances until `op` is complete (spinning, then yielding the core).
  void wait_for(const Op& op);

 private:
  NodeSharedMemory(MPI_Comm comm, int rank, int size);
  // Queues an all-reduce (root < 0) or a reduce; nullptr when `t` is not in a shared buffer.
  WorkPtr start_reduce(const Tensor& t, int root, bool average);
  // Queues `op` (range and kind set) for the range `t` of a shared buffer; nullptr if it is not in one.
  WorkPtr start(std::shared_ptr<Op> op, const Tensor& t);
  // Takes the first operation one phase further; false when it has to wait for a peer.
  bool advance(Op& op);
  // Own elements [begin, end) of op's range = the sum over ranks (times op.scale).
  void sum_into_own(const Op& op, int64_t begin, int64_t end);

  MPI_Comm comm_;  // the communicator's own duplicate, for the collectives of allocate()
  int rank_, size_;
  uint64_t id_;                      // names this group in the registry of mapped segments
  std::vector<Counters*> counters_;  // every rank's, mapped here (index = rank)
  char* own_counters_ = nullptr;
  uint64_t started_ = 0;  // operations started so far: the next one is started_ + 1
  std::deque<std::shared_ptr<Op>> queue_;
};

}  // namespace strata::parallel
