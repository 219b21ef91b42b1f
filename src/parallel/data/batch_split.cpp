#include "parallel/data/batch_split.hpp"

#include "core/error.hpp"

namespace strata::parallel {

BatchSplit split_batch(int64_t global_batch, int64_t micro_batch, int dp) {
  STRATA_CHECK(dp >= 1, "split_batch: dp must be at least 1, got ", dp);
  STRATA_REQUIRE(global_batch > 0, "--global-batch must be positive, found ", global_batch);
  STRATA_REQUIRE(micro_batch >= 0, "--micro-batch must be positive, found ", micro_batch);
  BatchSplit plan;
  plan.global = global_batch;
  plan.dp = dp;
  STRATA_REQUIRE(global_batch % dp == 0, "--global-batch ", global_batch, " must be divisible by the ", dp,
                 " data-parallel ranks");
  plan.local = global_batch / dp;
  plan.micro = micro_batch > 0 ? micro_batch : plan.local;
  STRATA_REQUIRE(plan.local % plan.micro == 0, "--global-batch ", global_batch, " must equal --micro-batch (",
                 plan.micro, ") x micro-batches x ", dp, " data-parallel ranks; ", plan.local,
                 " samples per replica is not a multiple of ", plan.micro);
  plan.count = plan.local / plan.micro;
  return plan;
}

}  // namespace strata::parallel
