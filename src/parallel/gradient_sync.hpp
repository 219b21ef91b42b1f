// Data-parallel gradient sync: the flat gradient buffer is cut into buckets in reverse layer
// order (backward produces gradients from the last layer to the first), and each bucket's
// all-reduce over the data-parallel group starts as soon as backward has written all of its
// gradients, so communication overlaps the rest of backward.
#pragma once

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

class GradientSync {
 public:
  GradientSync(Communicator& dp, const layers::ParameterStore& store, int64_t bucket_bytes);

  // Makes parameters and buffers identical on every replica: broadcast from replica 0.
  void broadcast_parameters();
  // Before the backward of a step's last micro-batch.
  void begin();
  // Backward of `layer` has written its gradients: starts every bucket that is now complete
  // and lets started ones progress.
  void layer_done(size_t layer);
  // Starts what is left and waits for all buckets: gradients are then summed over replicas.
  void finish();

  const std::vector<Bucket>& buckets() const { return buckets_; }

 private:
  Communicator& dp_;
  const layers::ParameterStore& store_;
  std::vector<Bucket> buckets_;
  std::vector<WorkPtr> work_;
  size_t next_ = 0;  // the next bucket to start, in order
};

}  // namespace strata::parallel
