// Data-parallel gradient reduction in buckets: the flat gradient buffer is cut into fixed-size
// buckets from its end (backward produces gradients from the last layer to the first), and each
// bucket's reduction over the data-parallel group starts as soon as backward has written all of
// its gradients, so communication overlaps the rest of backward. A large layer spans several
// buckets, several small layers share one.
//
// BucketReducer is ZeRO 0 and 1: each bucket of the store's full gradient buffer is all-reduced
// (ZeRO 1: reduced to the owners of its pieces), during the step's last backward only (earlier
// micro-batches accumulate locally). ZeRO 2 and 3 keep no full gradient buffer: GradientRing
// (gradient_ring.hpp) reduces the same buckets, in the same order (BucketQueue), out of a ring.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "layers/model.hpp"
#include "layers/parameter_store.hpp"
#include "parallel/comm/communicator.hpp"

namespace strata::parallel {

// A layer's extent in the flat gradient buffer: its trainable elements and the alignment
// padding after them, up to the next layer's (the first layer's from element 0, the last's to
// the padded end), so the extents tile the buffer. Forward order.
std::vector<layers::ParameterStore::LayerRange> layer_extents(
    const std::vector<layers::ParameterStore::LayerRange>& ranges, int64_t flat_numel);

struct Bucket {
  int64_t begin = 0, end = 0;  // element range of the flat gradient buffer
  size_t first_layer = 0;      // the lowest layer whose extent overlaps it: done last in backward
};

// Cuts the flat gradient buffer [0, flat_numel) into buckets of bucket_bytes / 4 elements from
// its end, last elements first; the last one cut (from element 0) may be shorter. A bucket is
// complete when its first layer's backward is. No layers, no buckets.
std::vector<Bucket> make_buckets(const layers::ParameterStore& store, int64_t bucket_bytes);
// The same from a layout's layer ranges and padded length (flat_numel), without a store.
std::vector<Bucket> make_buckets(const std::vector<layers::ParameterStore::LayerRange>& ranges, int64_t flat_numel,
                                 int64_t bucket_bytes);

// Elements of a bucket of bucket_bytes (at least one): also the most a streamed piece holds.
int64_t bucket_elements(int64_t bucket_bytes);

// The buckets of one backward and how far their reductions have been started. Every replica
// starts them bucket by bucket from the top, as backward completes them, because collectives
// on one communicator must start in the same order everywhere. What starting a range means is
// the owner's `start` (BucketReducer: in the full gradient buffer; GradientRing: in its ring).
class BucketQueue {
 public:
  // Starts the reductions of flat elements [from, to), a part of one bucket.
  using Start = std::function<void(int64_t from, int64_t to)>;

  BucketQueue(const layers::ParameterStore& store, int64_t bucket_bytes, Start start);
  BucketQueue(const BucketQueue&) = delete;  // `start` belongs to its owner
  BucketQueue& operator=(const BucketQueue&) = delete;

  const std::vector<Bucket>& buckets() const { return buckets_; }
  // Before a backward: nothing started.
  void rewind();
  // Backward of `layer` has written its gradients: starts every bucket that is now complete.
  void start_completed(size_t layer);
  // Starts every bucket that lies wholly in flat elements [from, ...).
  void start_above(int64_t from);
  // Starts flat elements [lo, ...) not started yet, bucket by bucket from the top (part of a
  // bucket when lo is inside it), each bucket named in watchdog reports while it is started.
  void start_down_to(int64_t lo);

 private:
  std::vector<Bucket> buckets_;
  int64_t flat_numel_ = 0;
  Start start_;
  size_t next_ = 0;      // the highest bucket not yet wholly started
  int64_t started_ = 0;  // flat elements from here on have their reductions started
};

class BucketReducer {
 public:
  // ZeRO 0 (owner_shard_size = 0): all-reduces buckets of store.grads() in place.
  // ZeRO 1 (owner_shard_size = S): reduces each bucket's pieces in place to the ranks whose
  // shard [o*S, (o+1)*S) they overlap — only the owner steps a piece, so nobody else needs its
  // sum, and this sends half the bytes of an all-reduce (the all-gather of parameters the other
  // half).
  BucketReducer(Communicator& dp, const layers::ParameterStore& store, int64_t bucket_bytes,
                int64_t owner_shard_size = 0);
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;

  // Before the step's last backward, whose gradients are synchronised.
  void begin();
  // Backward of `layer` has written its gradients: starts every bucket that is now complete
  // and lets started ones progress.
  void layer_done(size_t layer);
  // Starts what is left and waits for all buckets: the gradients are then summed over replicas
  // (ZeRO 1: each owner's pieces).
  void finish();

  const std::vector<Bucket>& buckets() const { return queue_.buckets(); }

 private:
  // Starts the reductions of flat elements [from, to): an all-reduce (ZeRO 0) or a reduce of
  // each owner's piece (ZeRO 1).
  void start(int64_t from, int64_t to);

  Communicator& dp_;
  const layers::ParameterStore& store_;
  BucketQueue queue_;
  int64_t shard_size_ = 0;  // ZeRO 1: S, the elements of each rank's shard (ZeRO 0: 0)
  std::vector<WorkPtr> work_;
};

}  // namespace strata::parallel
