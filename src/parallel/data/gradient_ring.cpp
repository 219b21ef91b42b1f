// ZeRO 2/3's gradient ring: the placement of the layers' gradients in it, and the reduction of
// its buckets to the shard owners, added into each owner's gradient shard.
#include "parallel/data/gradient_ring.hpp"

#include <algorithm>

#include "core/ops.hpp"
#include "layers/parameter_store.hpp"

namespace strata::parallel {

std::vector<GradientTile> whole_layer_tiles(const std::vector<layers::ParameterStore::LayerRange>& ranges,
                                            int64_t flat_numel) {
  std::vector<GradientTile> tiles;
  for (const auto& e : layer_extents(ranges, flat_numel)) tiles.push_back({e.layer, e.begin, e.end});
  return tiles;
}

std::vector<GradientTile> gradient_tiles(const layers::Model& model, const std::vector<layers::ParamEntry>& entries,
                                         int64_t flat_numel, int64_t bucket_bytes) {
  std::vector<GradientTile> tiles;
  for (const GradientTile& whole : whole_layer_tiles(layers::ParameterStore::layer_ranges(entries), flat_numel)) {
    const layers::Layer& layer = model.layer(whole.layer);
    const std::vector<layers::GradientPiece> pieces = layer.gradient_pieces(bucket_elements(bucket_bytes));
    if (pieces.empty()) {
      tiles.push_back(whole);
      continue;
    }
    // The layer's trainable entries; pieces count from the first one's offset.
    std::vector<const layers::ParamEntry*> params;
    for (const layers::ParamEntry& e : entries)
      if (e.layer == whole.layer && e.trainable) params.push_back(&e);
    const int64_t base = params.front()->offset;
    // Pieces come down the flat layout; each tile reaches up to the one above it.
    const size_t first = tiles.size();
    int64_t top = whole.end;
    for (const layers::GradientPiece& p : pieces) {
      const int64_t lo = base + p.begin, hi = base + p.end;
      STRATA_CHECK(p.begin >= 0 && p.begin < p.end && hi <= top, "layer ", layer.name(), ": gradient piece [", p.begin,
                   ", ", p.end, ") is not below the pieces before it");
      tiles.push_back({whole.layer, lo, top, true, lo, hi});
      top = lo;
    }
    tiles.back().begin = whole.begin;
    std::reverse(tiles.begin() + static_cast<std::ptrdiff_t>(first), tiles.end());
    // Every gradient element is written by some piece.
    for (const layers::ParamEntry* e : params) {
      int64_t covered = e->offset;  // tiles are in flat order now
      for (size_t k = first; k < tiles.size(); ++k)
        if (tiles[k].written_begin <= covered && tiles[k].written_end > covered) covered = tiles[k].written_end;
      STRATA_CHECK(covered >= e->offset + shape_numel(e->shape), "layer ", layer.name(), "'s gradient pieces miss ",
                   e->name, " from element ", covered - e->offset);
    }
  }
  return tiles;
}

int64_t ring_elements(const std::vector<GradientTile>& tiles, int64_t bucket_bytes, bool pinned) {
  if (tiles.empty()) return 0;
  const int64_t flat_numel = tiles.back().end;
  const int64_t base = pinned ? tiles.front().end : 0;  // the pinned first tile
  int64_t largest = 0;
  for (size_t k = pinned ? 1 : 0; k < tiles.size(); ++k) largest = std::max(largest, tiles[k].end - tiles[k].begin);
  if (largest == 0) return base;
  // The largest tile while the bucket above it is still being reduced; never more than the
  // whole buffer, which holds every tile without a wrap.
  return base + std::min(largest + bucket_elements(bucket_bytes), flat_numel - base);
}

std::vector<RingSlot> place_in_ring(const std::vector<GradientTile>& tiles, int64_t ring, bool pinned) {
  std::vector<RingSlot> slots;
  const int64_t bottom = pinned && !tiles.empty() ? tiles.front().end : 0;  // the others cycle above it
  int64_t top = ring;  // the lowest ring element taken since the last wrap
  for (size_t k = tiles.size(); k-- > 0;) {
    const GradientTile& t = tiles[k];
    const int64_t n = t.end - t.begin;
    if (pinned && k == 0) {  // at its own flat positions; the part above is reduced before it
      STRATA_CHECK(!t.streamed, "layer ", t.layer, "'s pinned gradients cannot be written in pieces");
      slots.push_back({t, 0, true, true});
      break;
    }
    STRATA_CHECK(n <= ring - bottom, "layer ", t.layer, "'s ", n, " gradients do not fit the ring's ", ring - bottom);
    // Descending positions keep flat order inside the ring, so a bucket is one piece of it
    // unless a wrap splits it.
    const bool wraps = n > top - bottom;
    if (wraps) top = ring;
    top -= n;
    slots.push_back({t, top, wraps});
  }
  return slots;
}

bool pins_tied_embedding(const layers::Model& model, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const layers::Layer& head = model.layer(i);
    const layers::Layer* tied = head.shares_parameters_with();
    bool here = false;  // a head tied across stages has a copy (TiedEmbedding): nothing to pin
    for (size_t k = begin; k < end; ++k) here = here || &model.layer(k) == tied;
    if (!here) continue;
    size_t first = begin;  // the stage's first layer with parameters
    while (first < end && model.layer(first).param_specs().empty()) ++first;
    STRATA_CHECK(first < end && &model.layer(first) == tied, "layer ", head.name(), " reads the gradient of ",
                 tied->name(), ", which is not its stage's first layer with parameters");
    return true;
  }
  return false;
}

GradientRing::GradientRing(Communicator& dp, const layers::Model& model, const layers::ParameterStore& store,
                           int64_t bucket_bytes, int64_t shard_size, bool pinned)
    : dp_(dp),
      store_(store),
      model_(model),
      queue_(store, bucket_bytes, [this](int64_t from, int64_t to) { start(from, to); }),
      shard_size_(shard_size) {
  STRATA_CHECK(!store.grads().defined(), "ZeRO 2 keeps no full gradient buffer, but the store has one");
  STRATA_CHECK(store.flat_numel() == shard_size * dp.size(), "ZeRO 2 needs the store padded to ", dp.size(), " x ",
               shard_size, " elements, it has ", store.flat_numel());
  shard_grads_ = Tensor::zeros({shard_size}, DType::F32, store.params().device());
  const std::vector<GradientTile> tiles = gradient_tiles(model, store.entries(), store.flat_numel(), bucket_bytes);
  const int64_t ring = ring_elements(tiles, bucket_bytes, pinned);
  slots_ = place_in_ring(tiles, ring, pinned);
  for (const GradientTile& t : tiles)
    if (t.streamed && (streaming_.empty() || streaming_.back() != t.layer)) streaming_.push_back(t.layer);
  // From the communicator: on one node, shared memory that the reduces read in place.
  ring_ = dp.allocate(ring, DType::F32, store.params().device());
  // Last, once nothing can throw: the destructor, which takes the sinks back, runs only for a
  // constructed object.
  for (size_t layer : streaming_) model.layer(layer).set_gradient_sink(this, bucket_elements(bucket_bytes));
}

GradientRing::~GradientRing() {
  for (size_t layer : streaming_) model_.layer(layer).set_gradient_sink(nullptr, 0);
}

int64_t GradientRing::allocated_bytes() const {
  return static_cast<int64_t>(shard_grads_.nbytes()) + static_cast<int64_t>(ring_.nbytes());
}

void GradientRing::begin() {
  queue_.rewind();
  placed_ = 0;
  piece_out_ = false;
  if (!slots_.empty() && slots_.back().pinned) bind_slot(slots_.back());  // before the tied head writes it
  place_next();
}

void GradientRing::bind_slot(const RingSlot& s) {
  const int64_t n = s.end - s.begin;
  retire(/*wait=*/true, s.offset, s.offset + n);  // all started: no replica waits on another's future
  // Layers accumulate into their gradient views, so the range starts at zero.
  const Tensor grads = ring_.view(s.offset, {n});
  grads.fill_zero();
  if (!s.streamed) store_.bind_grads(model_, s.layer, grads, s.begin);
}

void GradientRing::place_next() {
  if (placed_ == slots_.size()) return;
  const RingSlot& s = slots_[placed_++];
  // Every layer placed since the last wrap is done (the layer above this one was the last):
  // their elements are final, so what of them is not reduced yet is, before being overwritten.
  if (s.wraps) queue_.start_down_to(s.end);
  ring_shift_ = s.begin - s.offset;
  if (!s.pinned) bind_slot(s);  // the pinned one was bound at begin() and holds the tied head's part
}

Tensor GradientRing::next_piece() {
  STRATA_CHECK(placed_ > 0 && slots_[placed_ - 1].streamed && !piece_out_,
               "a gradient piece was asked for outside its layer's turn in backward");
  piece_out_ = true;
  const RingSlot& s = slots_[placed_ - 1];
  return ring_.view(s.offset + s.written_begin - s.begin, {s.written_end - s.written_begin});
}

void GradientRing::piece_written() {
  STRATA_CHECK(piece_out_, "a gradient piece was written that was not asked for");
  piece_out_ = false;
  // Everything from the piece's tile up is final: the buckets there are complete.
  queue_.start_above(slots_[placed_ - 1].begin);
  place_next();
  dp_.progress();
  retire(/*wait=*/false);
}

void GradientRing::start(int64_t from, int64_t to) {
  for (int o = 0; o < dp_.size(); ++o) {  // in owner order, the same on every replica
    const int64_t piece_lo = std::max(from, o * shard_size_), piece_hi = std::min(to, (o + 1) * shard_size_);
    if (piece_lo >= piece_hi) continue;
    const int64_t at = piece_lo - ring_shift_;
    const Tensor piece = ring_.view(at, {piece_hi - piece_lo});
    Piece p{dp_.reduce_async(piece, o, ReduceOp::Sum), piece, Tensor(), at, at + piece.numel()};
    if (o == dp_.rank()) p.into = shard_grads_.view(piece_lo - o * shard_size_, {piece_hi - piece_lo});
    pending_.push_back(std::move(p));
  }
}

void GradientRing::retire(bool wait, int64_t lo, int64_t hi) {
  // A reduced piece is added to the owner's shard as soon as it is complete, once: the
  // accumulator sums micro-batches, the ring is reused by the next layers.
  std::erase_if(pending_, [wait, lo, hi](Piece& p) {
    if (p.ring_end <= lo || p.ring_begin >= hi) return false;
    if (wait)
      p.work->wait();
    else if (!p.work->test())
      return false;
    if (p.into.defined()) ops::axpy(1.0f, p.reduced, p.into);
    return true;
  });
}

void GradientRing::layer_done(size_t layer) {
  // Even on one rank (a reduce to itself): the shard is filled through the ring.
  queue_.start_completed(layer);
  // The layer bound last is done: the next one down runs next.
  if (placed_ > 0 && layer <= slots_[placed_ - 1].layer) place_next();
  dp_.progress();
  retire(/*wait=*/false);
}

void GradientRing::finish() {
  layer_done(0);  // anything not yet started (layers without parameters at the front)
  retire(/*wait=*/true);
}

}  // namespace strata::parallel
