// ZeRO stages 1 and 2: sharded optimizer state (and, for 2, gradients: see gradient_ring.hpp),
// all-gathered parameters. Stage 3: sharded parameters, gathered per layer (ParameterGather).
#include "parallel/data/zero.hpp"

#include <algorithm>

#include "core/ops.hpp"
#include "layers/parameter_store.hpp"

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

Ownership::Ownership(int zero, int dp, int64_t used) : zero_(zero), dp_(dp), used_(used) {
  STRATA_CHECK(zero >= 0 && zero <= kMaxStage && dp >= 1 && used >= 0, "no ZeRO stage ", zero, " over ", dp,
               " replicas");
}

int64_t Ownership::pad_multiple() const { return shards_state() ? shard_pad_multiple(dp_) : kShardAlign; }

Shard Ownership::state(int replica) const { return shards_state() ? shard(replica) : Shard{used_, 0, used_}; }

namespace {

Shard whole_or_shard(const Ownership& ownership, const Communicator& dp, const layers::ParameterStore& store) {
  if (!ownership.shards_state()) {  // the whole padded buffer: one fused step over all of it
    const int64_t n = store.params().numel();
    return {n, 0, n};
  }
  const Shard s = ownership.shard(dp.rank());
  STRATA_CHECK(store.flat_numel() == s.size * dp.size(), "ZeRO needs the store padded to ", dp.size(), " x ", s.size,
               " elements, it has ", store.flat_numel());
  return s;
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(const layers::OptimizerConfig& config, const Ownership& ownership, Communicator& dp,
                                   const layers::ParameterStore& store)
    : ownership_(ownership),
      dp_(dp),
      shard_(whole_or_shard(ownership, dp, store)),
      inner_(config, shard_.numel(), store.params().device()) {
  // None for models without parameter groups: then one update over the whole shard.
  inner_.set_no_decay(layers::no_decay_ranges(store.entries(), shard_.begin, shard_.end));
  for (const layers::ParamEntry& e : store.entries())
    if (const layers::Overlap o = layers::overlap(e, shard_.begin, shard_.end);
        e.trainable && e.split.split() && e.split.primary() && o.size)  // a replicated kv head counts once
      split_ranges_.emplace_back(o.in_range, o.size);
  const Tensor& params = store.params();
  if (params.dtype() == DType::F32) return;
  // The masters start from the (rounded) initial parameters, identical on every replica.
  master_ = Tensor::empty({shard_.numel()}, DType::F32, params.device());
  ops::cast(owned(params), master_);
}

std::vector<std::pair<std::string, Tensor>> ShardedOptimizer::state() const {
  std::vector<std::pair<std::string, Tensor>> state = inner_.state();
  if (master_.defined()) state.emplace_back("master", master_);
  return state;
}

void ShardedOptimizer::set_master(const layers::ParamEntry& e, const Tensor& full) {
  const layers::Overlap o = layers::overlap(e, shard_.begin, shard_.end);
  if (!master_.defined() || !e.trainable || o.size == 0) return;
  ops::copy(full.view(o.in_entry, {o.size}), master_.view(o.in_range, {o.size}));
}

Tensor ShardedOptimizer::owned(const Tensor& flat) const {
  // Stage 3's parameter shard starts at this rank's first owned element.
  return flat.view(ownership_.shards_params() ? 0 : shard_.begin, {shard_.numel()});
}

Tensor ShardedOptimizer::owned_grads(const Tensor& grads) const {
  // Stage 2's and 3's gradient shard starts at this rank's first owned element.
  return ownership_.shards_grads() ? grads.view(0, {shard_.numel()}) : owned(grads);
}

double ShardedOptimizer::grad_sum_squares(const Tensor& grads, bool count_replicated) {
  double local = 0;
  if (shard_.numel() > 0 && count_replicated) {
    local = ops::sum_squares(owned_grads(grads));
  } else if (shard_.numel() > 0) {
    const Tensor owned = owned_grads(grads);
    for (const auto& [begin, size] : split_ranges_) local += ops::sum_squares(owned.view(begin, {size}));
  }
  if (!ownership_.shards_state() || dp_.size() == 1) return local;
  std::vector<double> sum{local};
  all_reduce_sum(dp_, sum);
  return sum[0];
}

void ShardedOptimizer::set_steps_taken(int64_t steps) {
  steps_ = steps;
  inner_.set_steps_taken(steps);
}

void ShardedOptimizer::step(const Tensor& params, const Tensor& grads, float lr) {
  ++steps_;
  // Stage 1 keeps the BucketReducer's all-reduce, so grads hold the full sum here; stage 2 reduced
  // each bucket to its owners, so grads is the owned shard alone.
  if (shard_.numel() > 0 && master_.defined()) {
    inner_.step(master_, owned_grads(grads), lr);
    ops::cast(master_, owned(params));  // round once per step; the all-gather moves bf16/f16
  } else if (shard_.numel() > 0) {
    inner_.step(owned(params), owned_grads(grads), lr);
  }
  // Stage 3 keeps parameters sharded: layers gather them when they run.
  if (!ownership_.gathers_params_after_step() || dp_.size() == 1) return;
  // Every chunk is S long (the store is padded), this rank's chunk is gathered in place.
  dp_.all_gather(params.view(dp_.rank() * shard_.size, {shard_.size}), params);
}

int64_t ShardedOptimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& [name, t] : state()) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

ParameterGather::ParameterGather(Communicator& dp, const layers::Model& model, const layers::ParameterStore& store,
                                 int64_t shard_size, size_t begin, size_t end)
    : dp_(dp),
      model_(model),
      store_(store),
      shard_size_(shard_size),
      visits_(visits(model, begin, end, store.layer_ranges())) {
  STRATA_CHECK(
      store.sharded_params() && store.params().numel() == shard_size && store.flat_numel() == shard_size * dp.size(),
      "ZeRO 3 needs a store holding one of ", dp.size(), " parameter shards of ", shard_size, " elements");
  // Visit j (forward order) always uses slot j % 2, in both passes: each slot is as large as the
  // largest range of its parity, not of all (a GPT's embedding is one slot's alone).
  const std::array<int64_t, 2> largest = window_elements(visits_);
  for (size_t k = 0; k < 2; ++k)
    slots_[k] = Tensor::zeros({largest[k]}, store.params().dtype(), store.params().device());
}

std::vector<ParameterGather::Visit> ParameterGather::visits(const layers::Model& model, size_t begin, size_t end,
                                                            const std::vector<Range>& ranges) {
  std::vector<Visit> out;
  for (size_t i = begin; i < end; ++i) {
    const layers::Layer* reads = model.layer(i).shares_parameters_with();
    for (const Range& r : ranges)
      if (r.layer == i || (reads && &model.layer(r.layer) == reads)) out.push_back({i, r});
  }
  return out;
}

std::array<int64_t, 2> ParameterGather::window_elements(const std::vector<Visit>& visits) {
  std::array<int64_t, 2> largest{0, 0};
  for (size_t j = 0; j < visits.size(); ++j)
    largest[j % 2] = std::max(largest[j % 2], visits[j].params.end - visits[j].params.begin);
  return largest;
}

bool ParameterGather::has_params(size_t layer) const {
  return std::any_of(visits_.begin(), visits_.end(), [layer](const Visit& v) { return v.runs == layer; });
}

int64_t ParameterGather::allocated_bytes() const {
  return static_cast<int64_t>(slots_[0].nbytes() + slots_[1].nbytes());
}

std::vector<WorkPtr> ParameterGather::start(int64_t begin, int64_t end, const Tensor& out) {
  // One broadcast per owner o whose shard [o*S, (o+1)*S) overlaps the range; the owner's piece
  // is copied into `out` first, since a broadcast sends the root's buffer in place.
  std::vector<WorkPtr> work;
  for (int o = 0; o < dp_.size(); ++o) {
    const int64_t lo = std::max(begin, o * shard_size_), hi = std::min(end, (o + 1) * shard_size_);
    if (lo >= hi) continue;
    const Tensor piece = out.view(lo - begin, {hi - lo});
    if (o == dp_.rank()) piece.copy_from(store_.params().view(lo - o * shard_size_, {hi - lo}));
    work.push_back(dp_.broadcast_async(piece, o));
  }
  return work;
}

void ParameterGather::begin_pass(bool backward) {
  backward_ = backward;
  pos_ = 0;
  if (visits_.empty()) return;
  const size_t first = backward ? visits_.size() - 1 : 0;
  const Range& r = visits_[first].params;
  pending_[first % 2] = start(r.begin, r.end, slots_[first % 2]);
}

void ParameterGather::next() {
  if (pos_ >= visits_.size()) return;  // a stage without trainable parameters
  // The pass's k-th visit is visit j in forward order, and lives in slot j % 2.
  const auto forward_index = [this](size_t k) { return backward_ ? visits_.size() - 1 - k : k; };
  const size_t j = forward_index(pos_);
  const Range& r = visits_[j].params;
  for (WorkPtr& w : pending_[j % 2]) w->wait();
  pending_[j % 2].clear();
  // Prefetch: the other slot held the visit before this one, whose layer has already run.
  if (pos_ + 1 < visits_.size()) {
    const size_t n = forward_index(pos_ + 1);
    pending_[n % 2] = start(visits_[n].params.begin, visits_[n].params.end, slots_[n % 2]);
  }
  store_.bind_params(model_, r.layer, slots_[j % 2], r.begin);
  ++pos_;
}

void ParameterGather::layer_done(size_t layer) {
  if (backward_ && pos_ < visits_.size() && has_params(layer)) next();
}

Tensor ParameterGather::gather(const layers::ParamEntry& e) {
  const Tensor t = Tensor::empty(e.shape, store_.params().dtype(), store_.params().device());
  for (WorkPtr& w : start(e.offset, e.offset + shape_numel(e.shape), t.reshape({t.numel()}))) w->wait();
  return t;
}

}  // namespace strata::parallel
