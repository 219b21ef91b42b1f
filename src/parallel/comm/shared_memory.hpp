// All-reduce, reduce and all-gather through shared memory, for a communicator whose ranks all
// run on one node (the data-parallel group of a one-node job, or of a stage), and point-to-point
// messages (the pipeline's activations and gradients) through mailboxes in it. A buffer from
// allocate() is one POSIX shared-memory segment per rank, mapped by every rank of the group, so
// reducing a range of it sends no messages: each rank reads its peers' data where it lies,
// where Open MPI's shared-memory transport moves every byte through an intermediate buffer
// first. Each protocol is explained at the top of the file that implements it:
// shared_memory_segments.cpp (the segments, their names in /dev/shm, the registry of mappings),
// shared_memory_collectives.cpp (the three counters that order a collective's phases) and
// shared_memory_mailboxes.cpp (the slots of the mailboxes, unexpected messages).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "parallel/comm/communicator.hpp"

namespace strata::parallel {

class NodeSharedMemory {
 public:
  // Collective over `comm`: whether it has two or more ranks, all on this node.
  static bool one_node(MPI_Comm comm);
  // Collective over `comm`: nullptr unless one_node(comm).
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
  // Collective: from now on a message of at most `max_bytes` (the largest over the ranks) goes
  // through mailboxes of `slots` slots per sender, fewer if they would exceed 64 MiB per rank.
  // False (on every rank alike, `why_not` saying why) if the segments could not be made.
  bool enable_messages(int64_t max_bytes, int slots, std::string& why_not);
  // This rank's bytes of shared memory, for the plan: the counters segment every group maps
  // (create), a buffer of `bytes` from allocate(), and the inbox enable_messages makes in a group
  // of `size` ranks (0 if it would not fit).
  static int64_t counters_bytes();
  static int64_t buffer_bytes(int64_t bytes);
  static int64_t mailbox_bytes(int64_t max_bytes, int slots, int size);
  // Starts sending `t` (a CPU tensor) to `peer`, or receiving into `t` from it, through the
  // mailboxes; nullptr when they are not enabled or `t` does not fit a slot (then MPI carries
  // it: both sides decide by the size alone). Messages from one peer with one tag are
  // received in the order they were sent, by the receives in the order they were started.
  WorkPtr send_async(const Tensor& t, int peer, int tag);
  WorkPtr recv_async(const Tensor& t, int peer, int tag);
  // Advances the started operations as far as they go without waiting.
  void progress();
  // Operations started and not complete.
  int in_flight() const { return static_cast<int>(queue_.size() + sends_.size() + recvs_.size()); }

  struct Op;  // one operation: its range in every rank's mapping and its phase (in the .cpp)
  struct Counters;
  struct Message;  // one send or receive through the mailboxes
  struct Slot;
  // Advances until `op` (or `m`) is complete (spinning, then yielding the core).
  void wait_for(const Op& op);
  void wait_for(const Message& m);

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
  // Slot k of the mailbox in `receiver`'s inbox that `sender` writes to.
  Slot& slot(int receiver, int sender, int k) const;
  // Queues a send (on sends_) or receive (recvs_); nullptr when `t` does not fit the mailboxes.
  WorkPtr start_message(std::deque<std::shared_ptr<Message>>& queue, const Tensor& t, int peer, int tag);
  // The oldest message from `peer` in this rank's inbox with `tag` (any if < 0), or nullptr;
  // `full`, if given, gets how many of the peer's slots hold a message. Only messages numbered
  // up to seen_ count.
  Slot* oldest_message(int peer, int tag, int* full = nullptr) const;
  // Copies waiting sends into free slots and waiting receives out of full ones, in order.
  void progress_messages();

  MPI_Comm comm_;  // the communicator's own duplicate, for the collectives of allocate()
  int rank_, size_;
  uint64_t id_;                      // names this group in the registry of mapped segments
  std::vector<Counters*> counters_;  // every rank's, mapped here (index = rank)
  char* own_counters_ = nullptr;
  uint64_t started_ = 0;  // operations started so far: the next one is started_ + 1
  std::deque<std::shared_ptr<Op>> queue_;
  // Mailboxes (enable_messages): every rank's inbox mapped here, the slots per sender, one
  // slot's size, messages copied into each peer's inbox so far, and the operations waiting.
  std::vector<char*> inboxes_;
  size_t inbox_bytes_ = 0;
  int slots_ = 0;
  int64_t slot_capacity_ = 0, slot_stride_ = 0;
  std::vector<uint64_t> sent_;
  std::vector<uint64_t> seen_;  // from each peer: messages 1..seen_ have been found in the slots
  std::deque<std::shared_ptr<Message>> sends_, recvs_;
  struct Unexpected {
    int peer = 0;
    int64_t tag = 0;
    std::vector<char> data;
  };
  std::deque<Unexpected> unexpected_;  // oldest first (per peer: older than its slots' messages)
};

// The most bytes of this rank's own shared-memory segments mapped at once (the gradient and
// parameter buffers that Communicator::allocate handed out; not part of the host allocator's).
size_t shared_memory_peak_bytes();

// Unlinks the names this process has created in /dev/shm and not yet unlinked, for a signal
// handler (or a deadline's thread) about to _exit: registered with the runtime's exit cleanups
// (mpi.hpp) by the first create(). A segment's name exists only while every
// rank of its group is inside create(), allocate() or enable_messages() (train calls them
// during setup) and not every rank has opened it yet; afterwards none of these segments has
// a name in /dev/shm, however the process ends. Async-signal-safe: fixed slots read with
// atomic loads, and shm_unlink, which POSIX does not list as async-signal-safe but which
// glibc (2.34 and later) implements as unlink(2) of "/dev/shm/" + name built on the stack.
void unlink_shared_segments_for_exit() noexcept;

}  // namespace strata::parallel
