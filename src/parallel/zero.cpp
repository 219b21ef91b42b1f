// ZeRO stages 1 and 2: sharded optimizer state (and, for 2, gradients: see gradient_sync),
// all-gathered parameters.
#include "parallel/zero.hpp"

#include <algorithm>

#include "core/ops.hpp"

namespace strata::parallel {

int64_t shard_pad_multiple(int dp) { return kShardAlign * dp; }

Shard shard_of(int64_t used, int dp, int rank) {
  const int64_t per_rank = (used + dp - 1) / dp;
  Shard s;
  s.size = (per_rank + kShardAlign - 1) / kShardAlign * kShardAlign;
  // Alignment can leave the last ranks with less than S, or nothing at all.
  s.begin = std::min(rank * s.size, used);
  s.end = std::min((rank + 1) * s.size, used);
  return s;
}

namespace {

Shard whole_or_shard(int zero_stage, const Communicator& dp, const layers::ParameterStore& store) {
  STRATA_REQUIRE(zero_stage >= 0 && zero_stage <= 2, "--zero ", zero_stage, " is not implemented");
  if (zero_stage == 0) {
    const int64_t n = store.params().numel();
    return {n, 0, n};
  }
  const Shard s = shard_of(store.used_numel(), dp.size(), dp.rank());
  STRATA_CHECK(store.params().numel() == s.size * dp.size(), "ZeRO needs the store padded to ", dp.size(), " x ",
               s.size, " elements, it has ", store.params().numel());
  return s;
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(const layers::OptimizerConfig& config, int zero_stage, Communicator& dp,
                                   const layers::ParameterStore& store)
    : stage_(zero_stage),
      dp_(dp),
      shard_(whole_or_shard(zero_stage, dp, store)),
      inner_(config, shard_.numel(), store.params().device()) {}

Tensor ShardedOptimizer::owned(const Tensor& flat) const { return flat.view(shard_.begin, {shard_.numel()}); }

Tensor ShardedOptimizer::owned_grads(const Tensor& grads) const {
  // Stage 2's shard starts at this rank's first owned element.
  return stage_ == 2 ? grads.view(0, {shard_.numel()}) : owned(grads);
}

double ShardedOptimizer::grad_sum_squares(const Tensor& grads) {
  const double local = shard_.numel() > 0 ? ops::sum_squares(owned_grads(grads)) : 0.0;
  if (stage_ == 0 || dp_.size() == 1) return local;
  const Tensor t = Tensor::empty({1});
  t.data<float>()[0] = static_cast<float>(local);
  dp_.all_reduce(t, ReduceOp::Sum);
  return t.data<float>()[0];
}

void ShardedOptimizer::step(const Tensor& params, const Tensor& grads, float lr) {
  // Stage 1 keeps GradientSync's all-reduce, so grads hold the full sum here; stage 2 reduced
  // each bucket to its owners, so grads is the owned shard alone.
  if (shard_.numel() > 0) inner_.step(owned(params), owned_grads(grads), lr);
  if (stage_ == 0 || dp_.size() == 1) return;
  // Every chunk is S long (the store is padded), this rank's chunk is gathered in place.
  dp_.all_gather(params.view(dp_.rank() * shard_.size, {shard_.size}), params);
}

int64_t ShardedOptimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& [name, t] : inner_.state()) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

}  // namespace strata::parallel
