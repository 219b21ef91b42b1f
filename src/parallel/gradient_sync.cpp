#include "parallel/gradient_sync.hpp"

#include <algorithm>

namespace strata::parallel {

std::vector<Bucket> make_buckets(const layers::ParameterStore& store, int64_t bucket_bytes) {
  // Trainable range of each layer, in the store's (forward) order.
  struct LayerRange {
    size_t layer;
    int64_t begin, end;
  };
  std::vector<LayerRange> ranges;
  for (const layers::ParamEntry& e : store.entries()) {
    if (!e.trainable) continue;
    const int64_t end = e.offset + shape_numel(e.shape);
    if (!ranges.empty() && ranges.back().layer == e.layer)
      ranges.back().end = end;
    else
      ranges.push_back({e.layer, e.offset, end});
  }
  const int64_t total = store.grads().numel();
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

GradientSync::GradientSync(Communicator& dp, const layers::ParameterStore& store, int64_t bucket_bytes)
    : dp_(dp), store_(store), buckets_(make_buckets(store, bucket_bytes)) {}

void GradientSync::broadcast_parameters() {
  if (dp_.size() == 1) return;
  if (store_.params().numel() > 0) dp_.broadcast(store_.params(), 0);
  if (store_.buffers().numel() > 0) dp_.broadcast(store_.buffers(), 0);
}

void GradientSync::begin() {
  work_.clear();
  next_ = 0;
}

void GradientSync::layer_done(size_t layer) {
  if (dp_.size() == 1) return;
  // Backward runs from the last layer down, so buckets complete in order.
  while (next_ < buckets_.size() && layer <= buckets_[next_].first_layer) {
    const Bucket& b = buckets_[next_++];
    work_.push_back(dp_.all_reduce_async(store_.grads().view(b.begin, {b.end - b.begin}), ReduceOp::Sum));
  }
  dp_.progress();
}

void GradientSync::finish() {
  if (dp_.size() == 1) return;
  layer_done(0);  // anything not yet started (layers without parameters at the front)
  for (WorkPtr& w : work_) w->wait();
  work_.clear();
}

}  // namespace strata::parallel
