// Buckets of the flat gradient buffer, the order in which their reductions start, and ZeRO 0/1's
// reduction of them in the full gradient buffer.
#include "parallel/data/bucket_reducer.hpp"

#include <algorithm>
#include <utility>

#include "layers/parameter_store.hpp"
#include "parallel/runtime/watchdog.hpp"

namespace strata::parallel {

std::vector<Bucket> make_buckets(const layers::ParameterStore& store, int64_t bucket_bytes) {
  // flat_numel: grads and params may not exist in full (ZeRO 2, 3)
  return make_buckets(store.layer_ranges(), store.flat_numel(), bucket_bytes);
}

std::vector<layers::ParameterStore::LayerRange> layer_extents(
    const std::vector<layers::ParameterStore::LayerRange>& ranges, int64_t flat_numel) {
  STRATA_CHECK(ranges.empty() || ranges.back().end <= flat_numel, "layers end at element ", ranges.back().end,
               ", past the flat buffer's ", flat_numel);
  std::vector<layers::ParameterStore::LayerRange> extents = ranges;
  for (size_t k = 0; k < extents.size(); ++k) {
    extents[k].begin = k == 0 ? 0 : ranges[k].begin;
    extents[k].end = k + 1 < ranges.size() ? ranges[k + 1].begin : flat_numel;
  }
  return extents;
}

int64_t bucket_elements(int64_t bucket_bytes) {
  return std::max<int64_t>(bucket_bytes / static_cast<int64_t>(sizeof(float)), 1);
}

std::vector<Bucket> make_buckets(const std::vector<layers::ParameterStore::LayerRange>& ranges, int64_t flat_numel,
                                 int64_t bucket_bytes) {
  const std::vector<layers::ParameterStore::LayerRange> extents = layer_extents(ranges, flat_numel);
  const int64_t size = bucket_elements(bucket_bytes);
  std::vector<Bucket> buckets;
  size_t k = extents.size();  // the extent holding the bucket's first element (extents tile the buffer)
  for (int64_t end = extents.empty() ? 0 : flat_numel; end > 0;) {
    const int64_t begin = std::max<int64_t>(end - size, 0);
    while (extents[k - 1].begin > begin) --k;
    buckets.push_back({begin, end, extents[k - 1].layer});
    end = begin;
  }
  return buckets;
}

BucketQueue::BucketQueue(const layers::ParameterStore& store, int64_t bucket_bytes, Start start)
    : buckets_(make_buckets(store, bucket_bytes)), flat_numel_(store.flat_numel()), start_(std::move(start)) {}

void BucketQueue::rewind() {
  next_ = 0;
  started_ = flat_numel_;
}

void BucketQueue::start_completed(size_t layer) {
  // Backward runs from the last layer down, so buckets complete in order.
  while (next_ < buckets_.size() && layer <= buckets_[next_].first_layer) start_down_to(buckets_[next_].begin);
}

void BucketQueue::start_above(int64_t from) {
  while (next_ < buckets_.size() && buckets_[next_].begin >= from) start_down_to(buckets_[next_].begin);
}

void BucketQueue::start_down_to(int64_t lo) {
  while (started_ > lo) {
    const Bucket& b = buckets_[next_];
    const watchdog::InBucket in_bucket(static_cast<int>(next_) + 1);  // names it in watchdog reports
    const int64_t from = std::max(lo, b.begin), to = started_;
    start_(from, to);
    started_ = from;
    if (from == b.begin) ++next_;
  }
}

BucketReducer::BucketReducer(Communicator& dp, const layers::ParameterStore& store, int64_t bucket_bytes,
                             int64_t owner_shard_size)
    : dp_(dp),
      store_(store),
      queue_(store, bucket_bytes, [this](int64_t from, int64_t to) { start(from, to); }),
      shard_size_(owner_shard_size) {}

void BucketReducer::begin() {
  work_.clear();
  queue_.rewind();
}

void BucketReducer::start(int64_t from, int64_t to) {
  if (shard_size_ == 0) {
    work_.push_back(dp_.all_reduce_async(store_.grads().view(from, {to - from}), ReduceOp::Sum));
    return;
  }
  for (int o = 0; o < dp_.size(); ++o) {  // in owner order, the same on every replica
    const int64_t piece_lo = std::max(from, o * shard_size_), piece_hi = std::min(to, (o + 1) * shard_size_);
    if (piece_lo >= piece_hi) continue;
    // The owner's piece is summed in place in its full gradient buffer.
    work_.push_back(dp_.reduce_async(store_.grads().view(piece_lo, {piece_hi - piece_lo}), o, ReduceOp::Sum));
  }
}

void BucketReducer::layer_done(size_t layer) {
  if (dp_.size() == 1) return;
  queue_.start_completed(layer);
  dp_.progress();
}

void BucketReducer::finish() {
  if (dp_.size() == 1) return;
  layer_done(0);  // anything not yet started (layers without parameters at the front)
  for (WorkPtr& w : work_) w->wait();
  work_.clear();
}

}  // namespace strata::parallel
