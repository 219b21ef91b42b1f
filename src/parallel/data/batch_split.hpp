// Batch arithmetic of a training step, checked once: the global batch is split evenly over the
// dp data-parallel replicas, and each replica's share (local) into `count` micro-batches of
// `micro` samples that run forward/backward one at a time while gradients accumulate:
// global = micro x count x dp.
#pragma once

#include <cstdint>

namespace strata::parallel {

struct BatchSplit {
  int64_t global = 0;  // samples per optimizer step, all replicas together (--global-batch)
  int64_t dp = 1;      // data-parallel replicas
  int64_t local = 0;   // samples per replica per step: global / dp
  int64_t micro = 0;   // samples per forward/backward (--micro-batch)
  int64_t count = 0;   // micro-batches per replica per step: local / micro
  bool operator==(const BatchSplit&) const = default;
};

// The plan for --global-batch `global_batch` and --micro-batch `micro_batch` (0: one
// micro-batch of the whole local batch, no accumulation) over `dp` >= 1 replicas. Input errors
// (one line, naming the flags): a global batch that is not positive or not divisible by dp, a
// negative micro-batch, or a local batch that is not a multiple of the micro-batch.
BatchSplit split_batch(int64_t global_batch, int64_t micro_batch, int dp);

}  // namespace strata::parallel
