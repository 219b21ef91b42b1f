// BatchOrder: seeded per-epoch permutations, cached for the epoch being read.
#include "io/batch_order.hpp"

#include <numeric>
#include <utility>

#include "core/error.hpp"
#include "core/rng.hpp"

namespace strata::io {

BatchOrder::BatchOrder(int64_t num_samples, int64_t global_batch, uint64_t seed, bool shuffle)
    : num_samples_(num_samples),
      global_batch_(global_batch),
      key_(rng::derive_key(seed, rng::kShuffle)),
      shuffle_(shuffle) {
  STRATA_REQUIRE(global_batch >= 1, "the global batch must be >= 1; found ", global_batch);
  STRATA_REQUIRE(global_batch <= num_samples, "the global batch ", global_batch, " is larger than the dataset (",
                 num_samples, " samples)");
}

std::vector<int64_t> BatchOrder::permutation(int64_t epoch) const {
  std::vector<int64_t> p(static_cast<size_t>(num_samples_));
  std::iota(p.begin(), p.end(), int64_t{0});
  if (!shuffle_) return p;
  // Fisher-Yates from the top; the modulo bias is < n / 2^64, negligible.
  for (int64_t i = num_samples_ - 1; i > 0; --i) {
    const uint64_t r = rng::bits64(key_, static_cast<uint64_t>(epoch), static_cast<uint64_t>(i));
    std::swap(p[static_cast<size_t>(i)], p[r % static_cast<uint64_t>(i + 1)]);
  }
  return p;
}

void BatchOrder::slice(int64_t epoch, int64_t step_in_epoch, int64_t begin, std::span<int64_t> out) const {
  const int64_t size = static_cast<int64_t>(out.size());
  STRATA_CHECK(epoch >= 0 && step_in_epoch >= 0 && step_in_epoch < steps_per_epoch(), "batch (epoch ", epoch, ", step ",
               step_in_epoch, ") outside an epoch of ", steps_per_epoch(), " steps");
  STRATA_CHECK(begin >= 0 && begin + size <= global_batch_, "slice [", begin, ", ", begin + size,
               ") outside a global batch of ", global_batch_);
  std::lock_guard lock(mutex_);
  if (cached_epoch_ != epoch) {
    cached_ = permutation(epoch);
    cached_epoch_ = epoch;
  }
  const int64_t first = step_in_epoch * global_batch_ + begin;
  std::copy(cached_.begin() + first, cached_.begin() + first + size, out.begin());
}

void BatchOrder::batch(int64_t epoch, int64_t step_in_epoch, std::span<int64_t> out) const {
  STRATA_CHECK(static_cast<int64_t>(out.size()) == global_batch_, "batch() needs room for ", global_batch_,
               " indices; got ", out.size());
  slice(epoch, step_in_epoch, 0, out);
}

}  // namespace strata::io
