// All-reduce, reduce and all-gather of a range of a buffer from NodeSharedMemory::allocate(),
// which every rank of the group maps: for an all-reduce each rank sums its 1/n chunk of the
// range straight out of the peers' mappings (always in rank order, so every element has one
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
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "parallel/comm/shared_memory_internal.hpp"
#include "parallel/runtime/mpi.hpp"

namespace strata::parallel {

struct NodeSharedMemory::Op {
  // What `root` is for each kind: the rank that receives the sum (>= 0), or one of these.
  static constexpr int kAllReduce = -1, kAllGather = -2;
  uint64_t seq = 0;
  Tensor keep;            // keeps the segments mapped while the operation runs
  std::vector<char*> at;  // the range's first byte in every rank's mapping
  int64_t segment = 0, offset = 0;
  int64_t count = 0;  // f32 elements to reduce; all-gather: bytes of the whole range
  int root = kAllReduce;
  float scale = 1;  // 1 / size for an average
  int phase = 0;    // 0 queued, 1 arrived, 2 reduced (all-gather: chunks copied), 3 done, 4 complete
};

namespace {

constexpr int kComplete = 4;

class SharedWork final : public Work {
 public:
  SharedWork(NodeSharedMemory& group, std::shared_ptr<NodeSharedMemory::Op> op) : group_(group), op_(std::move(op)) {}
  // A dropped handle still completes: peers read this rank's memory until then.
  ~SharedWork() override {
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %d] shared-memory all-reduce: %s (ignored in a destructor)\n", process_rank(),
                   e.what());
    }
  }
  // A complete operation no longer needs its group (which completes everything before it goes).
  void wait() override {
    if (op_->phase != kComplete) group_.wait_for(*op_);
  }
  bool test() override {
    if (op_->phase != kComplete) group_.progress();
    return op_->phase == kComplete;
  }

 private:
  NodeSharedMemory& group_;
  std::shared_ptr<NodeSharedMemory::Op> op_;
};

}  // namespace

using shm_detail::registry;
using shm_detail::relax;
using shm_detail::SegmentRegistry;

WorkPtr NodeSharedMemory::all_reduce_async(const Tensor& t, bool average) {
  return start_reduce(t, Op::kAllReduce, average);
}

WorkPtr NodeSharedMemory::reduce_async(const Tensor& t, int root, bool average) {
  return start_reduce(t, root, average);
}

WorkPtr NodeSharedMemory::start_reduce(const Tensor& t, int root, bool average) {
  if (t.dtype() != DType::F32) return nullptr;
  auto op = std::make_shared<Op>();
  op->root = root;
  op->count = t.numel();
  op->scale = average ? 1.0f / static_cast<float>(size_) : 1.0f;
  return start(std::move(op), t);
}

WorkPtr NodeSharedMemory::all_gather_async(const Tensor& in, const Tensor& out) {
  if (in.dtype() != out.dtype() || out.numel() != in.numel() * size_ ||
      in.raw() != static_cast<const char*>(out.raw()) + static_cast<size_t>(rank_) * in.nbytes())
    return nullptr;
  auto op = std::make_shared<Op>();
  op->root = Op::kAllGather;
  op->count = static_cast<int64_t>(out.nbytes());
  return start(std::move(op), out);
}

WorkPtr NodeSharedMemory::start(std::shared_ptr<Op> op, const Tensor& t) {
  SegmentRegistry::Mapping m;
  if (!t.device().is_cpu() || !registry().find(id_, t.raw(), t.nbytes(), m)) return nullptr;
  op->seq = ++started_;
  op->keep = t;
  op->segment = m.segment;
  op->offset = static_cast<const char*>(t.raw()) - m.at[static_cast<size_t>(rank_)];
  for (char* base : m.at) op->at.push_back(base + op->offset);
  queue_.push_back(op);
  progress();  // publishes the arrival now if nothing is ahead of it
  return std::make_unique<SharedWork>(*this, std::move(op));
}

void NodeSharedMemory::progress() {
  if (!sends_.empty() || !recvs_.empty()) progress_messages();
  while (!queue_.empty()) {
    Op& op = *queue_.front();
    while (op.phase < kComplete && advance(op)) {
    }
    if (op.phase < kComplete) return;
    queue_.pop_front();
  }
}

void NodeSharedMemory::wait_for(const Op& op) {
  uint64_t spins = 0;
  for (progress(); op.phase < kComplete; progress()) relax(spins, comm_);
}

void NodeSharedMemory::sum_into_own(const Op& op, int64_t begin, int64_t end) {
  // Elements [begin, end) = sum over ranks in rank order, through a block on the stack: the
  // own values are read before they are overwritten.
  constexpr int64_t kBlock = 1024;
  float block[kBlock];
  const auto floats = [&](int r) { return reinterpret_cast<float*>(op.at[static_cast<size_t>(r)]); };
  float* out = floats(rank_);
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    const float* __restrict first = floats(0) + b;
    const float* __restrict second = floats(1) + b;
    for (int64_t i = 0; i < n; ++i) block[i] = first[i] + second[i];
    for (int r = 2; r < size_; ++r) {
      const float* __restrict next = floats(r) + b;
      for (int64_t i = 0; i < n; ++i) block[i] += next[i];
    }
    float* __restrict dst = out + b;
    for (int64_t i = 0; i < n; ++i) dst[i] = block[i] * op.scale;
  }
}

bool NodeSharedMemory::advance(Op& op) {
  Counters& mine = *counters_[static_cast<size_t>(rank_)];
  const auto everyone = [&](std::atomic<uint64_t> Counters::*counter) {
    return std::all_of(counters_.begin(), counters_.end(),
                       [&](const Counters* c) { return (c->*counter).load(std::memory_order_acquire) >= op.seq; });
  };
  // Chunk r of the range: 16-element (64-byte) aligned pieces, so no two ranks write one cache line.
  const int64_t per = ((op.count + size_ - 1) / size_ + 15) & ~int64_t{15};
  const auto lo = [&](int r) { return std::min(op.count, r * per); };
  const auto hi = [&](int r) { return std::min(op.count, (r + 1) * per); };
  switch (op.phase) {
    case 0:
      mine.segment.store(op.segment, std::memory_order_relaxed);
      mine.offset.store(op.offset, std::memory_order_relaxed);
      mine.count.store(op.count, std::memory_order_relaxed);
      mine.root.store(op.root, std::memory_order_relaxed);
      mine.arrived.store(op.seq, std::memory_order_release);
      break;
    case 1: {
      if (!everyone(&Counters::arrived)) return false;
      const auto what = [](int64_t root, int64_t count) {
        return root == Op::kAllGather   ? strata::detail::cat("all-gathers ", count, " bytes")
               : root == Op::kAllReduce ? strata::detail::cat("all-reduces ", count, " elements")
                                        : strata::detail::cat("reduces ", count, " elements to rank ", root);
      };
      for (int r = 0; r < size_; ++r) {
        const Counters& c = *counters_[static_cast<size_t>(r)];
        STRATA_CHECK(c.segment.load(std::memory_order_relaxed) == op.segment &&
                         c.offset.load(std::memory_order_relaxed) == op.offset &&
                         c.count.load(std::memory_order_relaxed) == op.count &&
                         c.root.load(std::memory_order_relaxed) == op.root,
                     "shared-memory operation ", op.seq, ": rank ", r, " ", what(c.root.load(), c.count.load()),
                     " at byte ", c.offset.load(), " of buffer ", c.segment.load(), ", rank ", rank_, " ",
                     what(op.root, op.count), " at byte ", op.offset, " of buffer ", op.segment);
      }
      if (op.root == Op::kAllGather) {  // every other rank's chunk, from its own mapping
        const int64_t chunk = op.count / size_;
        for (int r = 0; r < size_; ++r)
          if (r != rank_)
            std::memcpy(op.at[static_cast<size_t>(rank_)] + r * chunk, op.at[static_cast<size_t>(r)] + r * chunk,
                        static_cast<size_t>(chunk));
      } else if (op.root == Op::kAllReduce) {  // this rank's chunk
        sum_into_own(op, lo(rank_), hi(rank_));
      } else if (op.root == rank_) {  // a reduce: everything, on the root only
        sum_into_own(op, 0, op.count);
      }
      mine.reduced.store(op.seq, std::memory_order_release);
      break;
    }
    case 2:
      // Once everyone has reduced, the root of a reduce has read all ranges and an all-gather
      // is complete; an all-reduce copies the other chunks' sums.
      if (!everyone(&Counters::reduced)) return false;
      for (int r = 0; r < size_ && op.root == Op::kAllReduce; ++r)
        if (r != rank_ && hi(r) > lo(r))
          std::memcpy(op.at[static_cast<size_t>(rank_)] + lo(r) * static_cast<int64_t>(sizeof(float)),
                      op.at[static_cast<size_t>(r)] + lo(r) * static_cast<int64_t>(sizeof(float)),
                      static_cast<size_t>(hi(r) - lo(r)) * sizeof(float));
      mine.done.store(op.seq, std::memory_order_release);
      break;
    case 3:
      if (!everyone(&Counters::done)) return false;
      break;
  }
  ++op.phase;
  return true;
}

}  // namespace strata::parallel
