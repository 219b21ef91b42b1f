// Bucketed gradient sync: all-reduce per bucket (ZeRO 0/1) or reduce to the shard owners
// through two scratch slots (ZeRO 2).
#include "parallel/gradient_sync.hpp"

#include <algorithm>

#include "core/ops.hpp"

namespace strata::parallel {

std::vector<Bucket> make_buckets(const layers::ParameterStore& store, int64_t bucket_bytes) {
  // flat_numel: grads and params may not exist in full (ZeRO 2, 3)
  return make_buckets(store.layer_ranges(), store.flat_numel(), bucket_bytes);
}

std::vector<Bucket> make_buckets(const std::vector<layers::ParameterStore::LayerRange>& ranges, int64_t flat_numel,
                                 int64_t bucket_bytes) {
  const int64_t total = flat_numel;
  const int64_t min_elements = std::max<int64_t>(bucket_bytes / static_cast<int64_t>(sizeof(float)), 1);
  std::vector<Bucket> buckets;
  int64_t end = total;  // the last bucket also covers the alignment padding at the end
  for (size_t k = ranges.size(); k-- > 0;) {
    const bool first = k == 0;
    if (end - ranges[k].begin >= min_elements || first) {
      // Bucket boundaries sit on layer starts; the first bucket reaches down to element 0.
      const int64_t begin = first ? 0 : ranges[k].begin;
      buckets.push_back({begin, end, ranges[k].layer});
      end = begin;
    }
  }
  return buckets;
}

GradientSync::GradientSync(Communicator& dp, const layers::ParameterStore& store, int64_t bucket_bytes,
                           int64_t owner_shard_size)
    : dp_(dp), store_(store), buckets_(make_buckets(store, bucket_bytes)), shard_size_(owner_shard_size) {}

GradientSync::GradientSync(Communicator& dp, const layers::Model& model, const layers::ParameterStore& store,
                           int64_t bucket_bytes, int64_t shard_size)
    : GradientSync(dp, store, bucket_bytes) {
  STRATA_CHECK(!store.grads().defined(), "ZeRO 2 keeps no full gradient buffer, but the store has one");
  STRATA_CHECK(store.flat_numel() == shard_size * dp.size(), "ZeRO 2 needs the store padded to ", dp.size(), " x ",
               shard_size, " elements, it has ", store.flat_numel());
  model_ = &model;
  shard_size_ = shard_size;
  shard_grads_ = Tensor::zeros({shard_size}, DType::F32, store.params().device());
  int64_t largest = 0;
  bucket_layers_.resize(buckets_.size());
  for (size_t k = 0; k < buckets_.size(); ++k) {
    largest = std::max(largest, buckets_[k].end - buckets_[k].begin);
    for (const layers::ParamEntry& e : store.entries()) {
      std::vector<size_t>& layers = bucket_layers_[k];
      if (e.trainable && e.offset >= buckets_[k].begin && e.offset < buckets_[k].end &&
          (layers.empty() || layers.back() != e.layer))
        layers.push_back(e.layer);
    }
  }
  // From the communicator: on one node, shared memory that the reduces read in place.
  for (Tensor& slot : slots_) slot = dp.allocate(largest, DType::F32, store.params().device());
}

void GradientSync::broadcast_parameters() {
  if (dp_.size() == 1) return;
  // ZeRO 3: each replica holds a different shard, initialised identically by construction.
  if (!store_.sharded_params() && store_.params().numel() > 0) dp_.broadcast(store_.params(), 0);
  broadcast_buffers();
}

void GradientSync::broadcast_buffers() {
  if (dp_.size() > 1 && store_.buffers().numel() > 0) dp_.broadcast(store_.buffers(), 0);
}

int64_t GradientSync::allocated_bytes() const {
  int64_t bytes = static_cast<int64_t>(shard_grads_.nbytes());
  for (const Tensor& slot : slots_) bytes += static_cast<int64_t>(slot.nbytes());
  return bytes;
}

void GradientSync::begin() {
  work_.clear();
  next_ = 0;
  if (sharded()) bind_bucket(0);
}

void GradientSync::bind_bucket(size_t k) {
  if (k >= buckets_.size()) return;
  // The slot is free once the reductions of the bucket before last (which used it) are done.
  std::vector<Piece>& previous = pending_[k % 2];
  retire(previous, /*wait=*/true);
  const Bucket& b = buckets_[k];
  // Layers accumulate into their gradient views, so the slot starts at zero.
  const Tensor slot = slots_[k % 2].view(0, {b.end - b.begin});
  slot.fill_zero();
  for (size_t layer : bucket_layers_[k]) store_.bind_grads(*model_, layer, slot, b.begin);
}

std::vector<GradientSync::Piece> GradientSync::reduce_to_owners(size_t k, const Tensor& data) {
  // One reduce per owner whose shard [o*S, (o+1)*S) overlaps the bucket; every replica starts
  // them in the same order, as collectives on one communicator must be.
  const Bucket& b = buckets_[k];
  std::vector<Piece> pieces;
  for (int o = 0; o < dp_.size(); ++o) {
    const int64_t lo = std::max(b.begin, o * shard_size_), hi = std::min(b.end, (o + 1) * shard_size_);
    if (lo >= hi) continue;
    const Tensor piece = data.view(lo - b.begin, {hi - lo});
    Piece p{dp_.reduce_async(piece, o, ReduceOp::Sum), piece, Tensor()};
    if (sharded() && o == dp_.rank()) p.into = shard_grads_.view(lo - o * shard_size_, {hi - lo});
    pieces.push_back(std::move(p));
  }
  return pieces;
}

void GradientSync::start(size_t k) {
  const Bucket& b = buckets_[k];
  if (!sharded()) {
    const Tensor grads = store_.grads().view(b.begin, {b.end - b.begin});
    if (shard_size_ == 0) {
      work_.push_back(dp_.all_reduce_async(grads, ReduceOp::Sum));
    } else {  // ZeRO 1: the owner's piece is summed in place in its full gradient buffer
      for (Piece& p : reduce_to_owners(k, grads)) work_.push_back(std::move(p.work));
    }
    return;
  }
  for (Piece& p : reduce_to_owners(k, slots_[k % 2])) pending_[k % 2].push_back(std::move(p));
  // The next bucket's layers run next: point their gradients at the other slot now.
  bind_bucket(k + 1);
}

void GradientSync::retire(std::vector<Piece>& pieces, bool wait) {
  // A reduced piece is added to the owner's shard as soon as it is complete, once: the
  // accumulator sums micro-batches, the slot is reused for the next bucket.
  std::erase_if(pieces, [wait](Piece& p) {
    if (wait)
      p.work->wait();
    else if (!p.work->test())
      return false;
    if (p.into.defined()) ops::axpy(1.0f, p.reduced, p.into);
    return true;
  });
}

void GradientSync::layer_done(size_t layer) {
  // ZeRO 2 goes through the slots even on one rank (a reduce to itself).
  if (dp_.size() == 1 && !sharded()) return;
  // Backward runs from the last layer down, so buckets complete in order.
  while (next_ < buckets_.size() && layer <= buckets_[next_].first_layer) start(next_++);
  dp_.progress();
  for (std::vector<Piece>& pieces : pending_) retire(pieces, /*wait=*/false);
}

void GradientSync::finish() {
  if (dp_.size() == 1 && !sharded()) return;
  layer_done(0);  // anything not yet started (layers without parameters at the front)
  for (WorkPtr& w : work_) w->wait();
  work_.clear();
  for (std::vector<Piece>& pieces : pending_) retire(pieces, /*wait=*/true);
}

}  // namespace strata::parallel
