// BatchOrder: which global samples form global batch k. The batch depends only on (seed,
// epoch, step), never on how many ranks read it; data-parallel rank r of dp then reads the
// contiguous slice [r*B/dp, (r+1)*B/dp) of it.
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

namespace strata::io {

class BatchOrder {
 public:
  // Drop-last: an epoch is num_samples / global_batch full batches. Input error when the
  // global batch is < 1 or larger than the dataset.
  BatchOrder(int64_t num_samples, int64_t global_batch, uint64_t seed, bool shuffle);

  int64_t num_samples() const { return num_samples_; }
  int64_t global_batch() const { return global_batch_; }
  int64_t steps_per_epoch() const { return num_samples_ / global_batch_; }

  // The global_batch sample indices of batch `step_in_epoch` of `epoch` (out.size() must be
  // global_batch).
  void batch(int64_t epoch, int64_t step_in_epoch, std::span<int64_t> out) const;
  // Positions [begin, begin + out.size()) of that batch: one rank's slice.
  void slice(int64_t epoch, int64_t step_in_epoch, int64_t begin, std::span<int64_t> out) const;

  // The permutation of epoch `epoch`: Fisher-Yates driven by
  // rng::bits64(derive_key(seed, kShuffle), epoch, i); the identity when !shuffle.
  std::vector<int64_t> permutation(int64_t epoch) const;

 private:
  int64_t num_samples_, global_batch_;
  uint64_t key_;
  bool shuffle_;
  // The current epoch's permutation, cached; the mutex makes slice() thread-safe.
  mutable std::mutex mutex_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_;
};

}  // namespace strata::io
