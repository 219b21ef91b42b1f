// Tests of the batch plan: global = micro x micro-batches x dp, with the one-line Input errors
// the train program shows for batch sizes that do not split.
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"
#include "parallel/data/batch_split.hpp"

namespace strata::parallel {
namespace {

// Asserts that split_batch rejects the sizes with an error of `kind` whose message
// contains `part`.
void expect_rejected(int64_t global, int64_t micro, int dp, const std::string& part,
                     ErrorKind kind = ErrorKind::Input) {
  try {
    const BatchSplit plan = split_batch(global, micro, dp);
    ADD_FAILURE() << "accepted global " << global << " micro " << micro << " dp " << dp << ": " << plan.count
                  << " micro-batches";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.message();
    EXPECT_NE(e.message().find(part), std::string::npos) << "message: " << e.message() << "\nmissing: " << part;
    EXPECT_EQ(e.message().find('\n'), std::string::npos) << "not one line: " << e.message();
  }
}

TEST(BatchSplit, MicroBatchZeroIsTheWholeLocalBatch) {
  EXPECT_EQ(split_batch(64, 0, 1), (BatchSplit{64, 1, 64, 64, 1}));
  EXPECT_EQ(split_batch(64, 0, 4), (BatchSplit{64, 4, 16, 16, 1}));
  EXPECT_EQ(split_batch(1, 0, 1), (BatchSplit{1, 1, 1, 1, 1}));
}

TEST(BatchSplit, MicroBatchesAccumulate) {
  EXPECT_EQ(split_batch(64, 8, 1), (BatchSplit{64, 1, 64, 8, 8}));
  EXPECT_EQ(split_batch(64, 4, 2), (BatchSplit{64, 2, 32, 4, 8}));
  EXPECT_EQ(split_batch(64, 16, 4), (BatchSplit{64, 4, 16, 16, 1}));
  EXPECT_EQ(split_batch(96, 1, 3), (BatchSplit{96, 3, 32, 1, 32}));
  for (int dp : {1, 2, 3, 4, 6, 8})
    for (int64_t micro : {1, 2, 4}) {
      const int64_t global = 24 * dp * micro;
      const BatchSplit p = split_batch(global, micro, dp);
      EXPECT_EQ(p.micro * p.count * p.dp, p.global);
      EXPECT_EQ(p.local * p.dp, p.global);
      EXPECT_EQ(p.count, 24);
    }
}

TEST(BatchSplit, GlobalBatchMustSplitOverTheReplicas) {
  expect_rejected(10, 0, 4, "--global-batch 10 must be divisible by the 4 data-parallel ranks");
  expect_rejected(7, 1, 2, "--global-batch 7 must be divisible by the 2 data-parallel ranks");
}

TEST(BatchSplit, LocalBatchMustBeAMultipleOfTheMicroBatch) {
  expect_rejected(64, 5, 2,
                  "--global-batch 64 must equal --micro-batch (5) x micro-batches x 2 data-parallel ranks; 32 "
                  "samples per replica is not a multiple of 5");
  // A micro-batch larger than the replica's share.
  expect_rejected(64, 32, 4,
                  "--global-batch 64 must equal --micro-batch (32) x micro-batches x 4 data-parallel ranks; 16 "
                  "samples per replica is not a multiple of 32");
}

TEST(BatchSplit, SizesMustBePositive) {
  expect_rejected(0, 0, 1, "--global-batch must be positive, found 0");
  expect_rejected(-8, 0, 2, "--global-batch must be positive, found -8");
  expect_rejected(64, -1, 1, "--micro-batch must be positive, found -1");
  expect_rejected(64, 0, 0, "dp must be at least 1", ErrorKind::Internal);
}

}  // namespace
}  // namespace strata::parallel
