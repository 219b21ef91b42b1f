// BatchOrder: permutations cover each epoch, differ between epochs, depend only on the seed,
// drop the last partial batch, and slices of a batch are the same whoever asks.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "io/batch_order.hpp"
#include "io_test_util.hpp"

namespace strata::io {
namespace {

// The samples of all batches of an epoch, in order.
std::vector<int64_t> epoch_samples(const BatchOrder& s, int64_t epoch) {
  std::vector<int64_t> all, batch(static_cast<size_t>(s.global_batch()));
  for (int64_t step = 0; step < s.steps_per_epoch(); ++step) {
    s.batch(epoch, step, batch);
    all.insert(all.end(), batch.begin(), batch.end());
  }
  return all;
}

TEST(BatchOrder, DropLastCounts) {
  EXPECT_EQ(BatchOrder(100, 10, 1, true).steps_per_epoch(), 10);
  EXPECT_EQ(BatchOrder(105, 10, 1, true).steps_per_epoch(), 10);
  EXPECT_EQ(BatchOrder(7, 7, 1, true).steps_per_epoch(), 1);
  test::expect_input_error([] { BatchOrder(5, 8, 1, true); }, {"global batch 8", "5 samples"});
  test::expect_input_error([] { BatchOrder(5, 0, 1, true); }, {"global batch", ">= 1"});
}

TEST(BatchOrder, EachEpochIsDisjointBatchesWithinARange) {
  BatchOrder s(1003, 10, 42, true);
  for (int64_t epoch : {0, 1, 5}) {
    std::vector<int64_t> all = epoch_samples(s, epoch);
    ASSERT_EQ(all.size(), 1000u);
    std::set<int64_t> unique(all.begin(), all.end());
    EXPECT_EQ(unique.size(), all.size()) << "a sample repeats within epoch " << epoch;
    EXPECT_GE(*unique.begin(), 0);
    EXPECT_LT(*unique.rbegin(), 1003);
  }
  // The full permutation covers every sample exactly once.
  std::vector<int64_t> p = s.permutation(3);
  std::sort(p.begin(), p.end());
  for (int64_t i = 0; i < 1003; ++i) ASSERT_EQ(p[static_cast<size_t>(i)], i);
}

TEST(BatchOrder, ShuffledDiffersPerEpochAndSeedButIsDeterministic) {
  BatchOrder a(500, 50, 7, true), b(500, 50, 7, true), c(500, 50, 8, true);
  EXPECT_EQ(epoch_samples(a, 0), epoch_samples(b, 0));
  EXPECT_EQ(epoch_samples(a, 2), epoch_samples(b, 2));
  EXPECT_NE(epoch_samples(a, 0), epoch_samples(a, 1));
  EXPECT_NE(epoch_samples(a, 0), epoch_samples(c, 0));
  // Asking out of order (cache misses) gives the same answers.
  std::vector<int64_t> x(50), y(50);
  a.batch(3, 4, x);
  a.batch(0, 0, y);
  b.batch(3, 4, y);
  EXPECT_EQ(x, y);
}

TEST(BatchOrder, UnshuffledIsTheIdentity) {
  BatchOrder s(20, 4, 7, false);
  std::vector<int64_t> all = epoch_samples(s, 3);
  for (int64_t i = 0; i < 20; ++i) EXPECT_EQ(all[static_cast<size_t>(i)], i);
}

TEST(BatchOrder, SlicesConcatenateToTheGlobalBatch) {
  BatchOrder s(1000, 12, 3, true);
  std::vector<int64_t> whole(12);
  s.batch(1, 7, whole);
  for (int dp : {1, 2, 3, 4}) {
    std::vector<int64_t> joined;
    for (int r = 0; r < dp; ++r) {
      std::vector<int64_t> part(static_cast<size_t>(12 / dp));
      s.slice(1, 7, r * 12 / dp, part);
      joined.insert(joined.end(), part.begin(), part.end());
    }
    EXPECT_EQ(joined, whole) << "dp = " << dp;
  }
}

}  // namespace
}  // namespace strata::io
