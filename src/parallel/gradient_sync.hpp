// Data-parallel gradient sync: the flat gradient buffer is cut into buckets in reverse layer
// order (backward produces gradients from the last layer to the first), and each bucket's
// reduction over the data-parallel group starts as soon as backward has written all of its
// gradients, so communication overlaps the rest of backward.
//
// ZeRO 0 and 1: each bucket of the store's full gradient buffer is all-reduced, during the
// step's last backward only (earlier micro-batches accumulate locally).
// ZeRO 2: there is no full gradient buffer. Backward writes each bucket into one of two
// bucket-sized scratch slots (the layers' gradient views are rebound to it just before its
// layers run), the complete bucket is reduced piece by piece to the rank(s) whose shard it
// overlaps, and each owner adds its piece into a persistent accumulator of its own shard only:
// 4 * (S + 2 * largest bucket) bytes of gradients per rank. This runs for every micro-batch.
#pragma once

#include <array>
#include <vector>

#include "layers/model.hpp"
#include "parallel/communicator.hpp"

namespace strata::parallel {

struct Bucket {
  int64_t begin = 0, end = 0;  // element range of the flat gradient buffer
  size_t first_layer = 0;      // the lowest layer with gradients in it: done last in backward
};

// Cuts the gradients of a store into buckets of at least bucket_bytes (whole layers each,
// so a bucket is complete when its first layer's backward is), last layers first.
std::vector<Bucket> make_buckets(const layers::ParameterStore& store, int64_t bucket_bytes);
// The same from a layout's layer ranges and padded length (flat_numel), without a store.
std::vector<Bucket> make_buckets(const std::vector<layers::ParameterStore::LayerRange>& ranges, int64_t flat_numel,
                                 int64_t bucket_bytes);

class GradientSync {
 public:
  // ZeRO 0 (owner_shard_size = 0): all-reduces buckets of store.grads() in place.
  // ZeRO 1 (owner_shard_size = S): reduces each bucket's pieces in place to the ranks whose
  // shard [o*S, (o+1)*S) they overlap — only the owner steps a piece, so nobody else needs its
  // sum, and this sends half the bytes of an all-reduce (the all-gather of parameters the other
  // half).
  GradientSync(Communicator& dp, const layers::ParameterStore& store, int64_t bucket_bytes,
               int64_t owner_shard_size = 0);
  // ZeRO 2 and 3: `store` has no gradient buffer (allocate_grads = false) and is padded to dp shards
  // of `shard_size` elements; gradients of `model`'s layers go through the scratch slots into
  // shard_grads().
  GradientSync(Communicator& dp, const layers::Model& model, const layers::ParameterStore& store, int64_t bucket_bytes,
               int64_t shard_size);

  // Makes parameters (unless sharded: ZeRO 3) and buffers identical on every replica:
  // broadcast from replica 0.
  void broadcast_parameters();
  // Only the buffers (BatchNorm's running statistics): replica 0's, before an evaluation.
  void broadcast_buffers();
  // Before a backward whose gradients are synchronised (ZeRO 0/1: the step's last; ZeRO 2:
  // every one).
  void begin();
  // Backward of `layer` has written its gradients: starts every bucket that is now complete
  // and lets started ones progress.
  void layer_done(size_t layer);
  // Starts what is left and waits for all buckets: ZeRO 0/1 gradients are then summed over
  // replicas; ZeRO 2 has added this backward's reduced pieces into shard_grads().
  void finish();

  const std::vector<Bucket>& buckets() const { return buckets_; }
  bool sharded() const { return model_ != nullptr; }
  // ZeRO 2: this rank's gradient shard (S elements; element i is element rank*S + i of the
  // flat layout), summed over replicas and micro-batches. The caller zeroes it per step.
  const Tensor& shard_grads() const { return shard_grads_; }
  // Bytes of the gradient memory this object allocated (ZeRO 2: shard and slots; else 0).
  int64_t allocated_bytes() const;

 private:
  // One reduction of a bucket's piece to its owner; `into` is defined on the owner only.
  struct Piece {
    WorkPtr work;
    Tensor reduced, into;
  };
  // Starts a complete bucket's all-reduce (ZeRO 0) or its reduces to the owners (ZeRO 1, 2).
  void start(size_t bucket);
  // Starts the reduce of every piece of bucket `k`, stored in `data` (the bucket's elements),
  // to the owner of the shard it falls in; returns the pieces in owner order.
  std::vector<Piece> reduce_to_owners(size_t k, const Tensor& data);
  // ZeRO 2: points the bucket's layers' gradients at its slot, zeroed, once the slot is free.
  void bind_bucket(size_t bucket);
  // ZeRO 2: adds completed (or, with wait, all) pieces into the shard and forgets them.
  void retire(std::vector<Piece>& pieces, bool wait);

  Communicator& dp_;
  const layers::ParameterStore& store_;
  std::vector<Bucket> buckets_;
  std::vector<WorkPtr> work_;
  size_t next_ = 0;  // the next bucket to start, in order

  int64_t shard_size_ = 0;  // ZeRO 1 and 2: S, the elements of each rank's shard

  // ZeRO 2 only.
  const layers::Model* model_ = nullptr;
  Tensor shard_grads_;
  std::array<Tensor, 2> slots_;                     // bucket k is written into slots_[k % 2]
  std::array<std::vector<Piece>, 2> pending_;       // reductions still reading each slot
  std::vector<std::vector<size_t>> bucket_layers_;  // the layers whose gradients each bucket holds
};

}  // namespace strata::parallel
