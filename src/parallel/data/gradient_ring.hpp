// ZeRO 2 and 3's gradient ring: there is no full gradient buffer. Backward writes the gradients
// into a ring of R = min(largest tile + one bucket, the whole buffer) elements, a tile being a
// layer's gradients or, for a layer larger than a bucket that can (Linear, an untied LM head), a
// bucket-sized piece of them that its backward writes and hands back before computing the next:
// two buckets when every large layer streams. Tiles are placed from the top down in backward
// order, so flat order holds inside the ring, and wrap to the top when the next one does not fit
// below (the part of the ring written since the last wrap is then reduced first). A complete
// bucket (bucket_reducer.hpp) is reduced piece by piece (split at wraps and at shards) to the
// rank(s) whose shard it overlaps, and each owner adds its pieces into a persistent accumulator
// of its own shard only: 4 * (S + R) bytes of gradients per rank. This runs for every
// micro-batch.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "layers/model.hpp"
#include "layers/parameter_store.hpp"
#include "parallel/comm/communicator.hpp"
#include "parallel/data/bucket_reducer.hpp"

namespace strata::parallel {

// ZeRO 2/3: a unit in which backward writes gradients into the ring: a layer's whole extent,
// or, for a layer that writes its gradients piece by piece (Layer::gradient_pieces, bucket-sized
// pieces), one piece widened to tile the extent (the highest up to its end, the lowest down to
// its begin). Tiles are in forward order and tile the flat buffer.
struct GradientTile {
  size_t layer = 0;
  int64_t begin = 0, end = 0;
  bool streamed = false;                       // a piece, written through the layer's GradientSink
  int64_t written_begin = 0, written_end = 0;  // streamed: the piece's elements, in [begin, end)
};

// Whole layers: the extents of `ranges` as tiles.
std::vector<GradientTile> whole_layer_tiles(const std::vector<layers::ParameterStore::LayerRange>& ranges,
                                            int64_t flat_numel);
// The tiles of a stage's layout (`entries`, padded to flat_numel): layers whose gradients are
// larger than a bucket are cut into pieces of about one bucket when they can be.
std::vector<GradientTile> gradient_tiles(const layers::Model& model, const std::vector<layers::ParamEntry>& entries,
                                         int64_t flat_numel, int64_t bucket_bytes);

// Elements of the gradient ring, min(largest tile + one bucket, the whole buffer): two buckets
// when every layer larger than a bucket streams. With `pinned` (a tied LM head on the stage of
// its embedding, the stage's first layer: a whole tile), the first tile keeps its own part of the
// ring for the whole backward — the head, which runs first, accumulates into the embedding's
// gradient, which runs last — and the others cycle through the rest: first tile + min(largest
// other + one bucket, the rest).
int64_t ring_elements(const std::vector<GradientTile>& tiles, int64_t bucket_bytes, bool pinned = false);

// Where a tile lives in the ring during one backward: its elements [begin, end) at ring elements
// [offset, offset + end - begin).
struct RingSlot : GradientTile {
  int64_t offset = 0;
  bool wraps = false;   // placed at the top again: what was written since the last wrap is reduced first
  bool pinned = false;  // the first tile, bound at the start of backward (ring_elements)
};

// The placement of every tile in a ring of `ring` elements, in backward order: each right below
// the one before, or at the top when it does not fit there. The same on every replica, so all
// start the same reduces in the same order.
// With `pinned`, the first tile sits at the ring's bottom (its own flat positions), marked pinned
// and wrapping (the others above it are reduced before it is), and the others cycle above.
std::vector<RingSlot> place_in_ring(const std::vector<GradientTile>& tiles, int64_t ring, bool pinned = false);

// Whether a stage's gradient ring pins its first extent: a layer in [begin, end) sharing the
// parameters of another (a tied LM head) that accumulates into its embedding's gradient directly (no copy:
// TiedEmbedding), the embedding being in the range too (it must be its first layer with parameters).
bool pins_tied_embedding(const layers::Model& model, size_t begin, size_t end);

class GradientRing final : public layers::GradientSink {
 public:
  // `store` has no gradient buffer (allocate_grads = false) and is padded to dp shards of
  // `shard_size` elements; gradients of `model`'s layers go through the ring into
  // shard_grads(). `pinned`: the first extent keeps its part of the ring (ring_elements).
  // Layers that stream their gradients write them through this object (GradientSink), one
  // bucket-sized piece at a time, each reduced while the next is computed.
  GradientRing(Communicator& dp, const layers::Model& model, const layers::ParameterStore& store, int64_t bucket_bytes,
               int64_t shard_size, bool pinned = false);
  ~GradientRing() override;
  GradientRing(const GradientRing&) = delete;
  GradientRing& operator=(const GradientRing&) = delete;

  // Before every backward (there is no full buffer to accumulate micro-batches in).
  void begin();
  // Backward of `layer` has written its gradients: starts every bucket that is now complete,
  // binds the next tile and lets started reductions progress.
  void layer_done(size_t layer);
  // Starts what is left and waits for all buckets: this backward's reduced pieces are then
  // added into shard_grads().
  void finish();
  // GradientSink: the ring range of the streaming layer's next piece, and its end.
  Tensor next_piece() override;
  void piece_written() override;

  // This rank's gradient shard (S elements; element i is element rank*S + i of the flat
  // layout), summed over replicas and micro-batches. The caller zeroes it per step.
  const Tensor& shard_grads() const { return shard_grads_; }
  // Bytes of the gradient memory this object allocated: the shard and the ring.
  int64_t allocated_bytes() const;

 private:
  // One reduction of a piece to its owner, reading ring elements [ring_begin, ring_end);
  // `into` is defined on the owner only.
  struct Piece {
    WorkPtr work;
    Tensor reduced, into;
    int64_t ring_begin = 0, ring_end = 0;
  };
  // BucketQueue's start: the reduces of each owner's piece of flat elements [from, to), read
  // from where the ring holds them.
  void start(int64_t from, int64_t to);
  // Binds the next tile's ring range, zeroed, once nothing reads it, to its layer's gradients
  // (unless the layer streams them and asks for it).
  void place_next();
  void bind_slot(const RingSlot& s);
  // Adds completed (or, with wait, all) pieces that read ring elements [lo, hi) into the shard
  // and forgets them.
  void retire(bool wait, int64_t lo = 0, int64_t hi = std::numeric_limits<int64_t>::max());

  Communicator& dp_;
  const layers::ParameterStore& store_;
  const layers::Model& model_;
  BucketQueue queue_;
  int64_t shard_size_ = 0;  // S, the elements of each rank's shard
  Tensor shard_grads_;
  Tensor ring_;
  std::vector<RingSlot> slots_;    // backward order
  std::vector<size_t> streaming_;  // layers writing through next_piece()
  size_t placed_ = 0;              // slots_ bound so far in this backward
  bool piece_out_ = false;         // next_piece() handed out slots_[placed_ - 1]
  int64_t ring_shift_ = 0;         // since the last wrap, flat element f is at ring element f - ring_shift_
  std::vector<Piece> pending_;     // reductions still reading the ring
};

}  // namespace strata::parallel
