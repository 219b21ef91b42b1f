// ZeRO (Rajbhandari et al. 2020) over a stage's flat buffers. A shard is a contiguous range
// of the flat trainable buffer owned by one rank of the stage's data-parallel group: with N
// used elements and dp ranks, S = align_up(ceil(N / dp), 16) elements (64 bytes) and rank r
// owns [r*S, min((r+1)*S, N)), so the last rank's shard may be shorter or empty. The store
// pads params and grads to dp*S elements so every all-gather chunk has the same size.
//
// Stage 0 is plain data parallelism: one shard is the whole buffer. Stage 1 shards the
// optimizer state. Stage 2 also shards the gradients: GradientSync reduces each bucket to the
// owners and keeps only this rank's S-element gradient shard, which is what step() and
// grad_sum_squares() then receive. Stage 3 (parameters gathered around each layer) is to come.
#pragma once

#include <cstdint>

#include "layers/model.hpp"
#include "layers/optimizer.hpp"
#include "parallel/communicator.hpp"

namespace strata::parallel {

constexpr int64_t kShardAlign = 16;  // elements: 64 bytes of f32

struct Shard {
  int64_t size = 0;            // S: the elements every rank's chunk spans (padded buffer = dp * S)
  int64_t begin = 0, end = 0;  // this rank's owned range, end - begin <= size (may be empty)
  int64_t numel() const { return end - begin; }
};

// The ParameterStore pad_multiple that makes a buffer of N used elements dp * S long:
// align_up(N, 16 * dp) == dp * align_up(ceil(N / dp), 16).
int64_t shard_pad_multiple(int dp);
// Rank `rank`'s shard of `used` elements over `dp` ranks.
Shard shard_of(int64_t used, int dp, int rank);

class ShardedOptimizer {
 public:
  // An optimizer for this rank's shard of `store` (zero_stage 1, 2) or of all of it (0), over
  // the data-parallel group `dp`. For stages 1 and 2 the store must be padded to dp * S
  // (shard_pad_multiple).
  //
  // `grads` below is the flat gradient buffer (stages 0, 1) or this rank's gradient shard of
  // S elements (stage 2, GradientSync::shard_grads()).
  ShardedOptimizer(const layers::OptimizerConfig& config, int zero_stage, Communicator& dp,
                   const layers::ParameterStore& store);

  // Sum of squares of this stage's gradients (replicas hold the same summed gradients):
  // each rank adds up its own shard and the shards are all-reduced over dp, so it stays right
  // once gradients are sharded (stage 2). The caller adds the other pipeline stages.
  double grad_sum_squares(const Tensor& grads);
  // The view of the flat parameter buffer that this rank updates.
  Tensor owned(const Tensor& flat) const;
  // The view of `grads` that this rank steps with (its owned range).
  Tensor owned_grads(const Tensor& grads) const;
  // Updates the owned range of params from grads (already summed over replicas), then
  // all-gathers the updated shards in place so every replica holds all parameters.
  void step(const Tensor& params, const Tensor& grads, float lr);

  int zero_stage() const { return stage_; }
  const Shard& shard() const { return shard_; }
  // Bytes of optimizer state this rank allocated (the real tensors).
  int64_t state_bytes() const;

 private:
  int stage_;
  Communicator& dp_;
  Shard shard_;
  layers::Optimizer inner_;  // state for shard_ only
};

}  // namespace strata::parallel
