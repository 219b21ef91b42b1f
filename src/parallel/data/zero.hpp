// ZeRO (Rajbhandari et al. 2020) over a stage's flat buffers. A shard is a contiguous range
// of the flat trainable buffer owned by one rank of the stage's data-parallel group: with N
// used elements and dp ranks, S = align_up(ceil(N / dp), 16) elements (64 bytes) and rank r
// owns [r*S, min((r+1)*S, N)), so the last rank's shard may be shorter or empty. The store
// pads params and grads to dp*S elements so every all-gather chunk has the same size.
//
// Stage 0 is plain data parallelism: one shard is the whole buffer. Stage 1 shards the
// optimizer state. Stage 2 also shards the gradients: backward writes them into the GradientRing's
// ring (the largest tile + one bucket: about two buckets when the large layers write their
// gradients piece by piece), each bucket is reduced to the owners and only this
// rank's S-element gradient shard is kept, which is what step() and grad_sum_squares() then
// receive. Stage 3 also shards the parameters: the store holds only this rank's S elements,
// ParameterGather broadcasts each layer's pieces from their owners into a window just before
// the layer runs (forward and backward), and the step updates the shard with no all-gather
// after it.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "layers/model.hpp"
#include "layers/optimizer.hpp"
#include "layers/parameter_store.hpp"
#include "parallel/comm/communicator.hpp"

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

// Who owns what of one stage's flat layout (`used` elements) under ZeRO stage `zero` over `dp`
// replicas: the one place a ZeRO stage is interpreted. DataParallel holds its stage's; the
// checkpoint gather asks it about every stage.
class Ownership {
 public:
  // Internal error unless 0 <= zero <= 3 (the flag is validated with the configuration).
  Ownership(int zero, int dp, int64_t used);

  // The stages are 0 (none) to kMaxStage.
  static constexpr int kMaxStage = 3;
  // What stage `zero` shards: the optimizer state from 1 on, the gradients from 2 on, the
  // parameters at 3 (for a plan that has no Ownership yet; an Ownership answers the same).
  static bool shards_state(int zero) { return zero >= 1; }
  static bool shards_grads(int zero) { return zero >= 2; }
  static bool shards_params(int zero) { return zero == 3; }
  // Stages 1 and 2 all-gather the updated parameter shards after each step.
  static bool gathers_params_after_step(int zero) { return zero == 1 || zero == 2; }

  int zero() const { return zero_; }
  int dp() const { return dp_; }
  int64_t used() const { return used_; }
  bool shards_state() const { return shards_state(zero_); }
  bool shards_grads() const { return shards_grads(zero_); }
  bool shards_params() const { return shards_params(zero_); }
  bool gathers_params_after_step() const { return gathers_params_after_step(zero_); }
  // The ParameterStore pad_multiple: dp equal shards with ZeRO, 64-byte alignment without.
  int64_t pad_multiple() const;
  // Replica r's shard of the used elements (whatever the stage: stage 0 reduces nothing to it).
  Shard shard(int replica) const { return shard_of(used_, dp_, replica); }
  // The flat range of optimizer state replica r holds: its shard with ZeRO, every used element
  // without (each replica holds a copy; replica 0's is the one saved).
  Shard state(int replica) const;
  // Replicas whose state() together covers every element once: dp with ZeRO, 1 without.
  int state_owners() const { return shards_state() ? dp_ : 1; }

 private:
  int zero_, dp_;
  int64_t used_;
};

class ShardedOptimizer {
 public:
  // An optimizer for this rank's shard of `store` (ZeRO 1-3) or of all of it (0), over the
  // data-parallel group `dp`. With ZeRO the store's layout must be padded to dp * S
  // (Ownership::pad_multiple).
  //
  // `grads` below is the flat gradient buffer (stages 0, 1) or this rank's gradient shard of
  // S elements (stages 2, 3: GradientRing::shard_grads()); `params` is the flat parameter
  // buffer, or with stage 3 this rank's S-element parameter shard.
  ShardedOptimizer(const layers::OptimizerConfig& config, const Ownership& ownership, Communicator& dp,
                   const layers::ParameterStore& store);

  // Sum of squares of this stage's gradients (replicas hold the same summed gradients):
  // each rank adds up its own shard and the shards are all-reduced over dp, so it stays right
  // once gradients are sharded (stage 2). The caller adds the other pipeline stages and
  // tensor-parallel ranks; `count_replicated` false (tp ranks but the first) leaves out the
  // parameters every tp rank holds whole, so the sum over tp counts them once.
  double grad_sum_squares(const Tensor& grads, bool count_replicated = true);
  // The view of the flat parameter buffer that this rank updates.
  Tensor owned(const Tensor& flat) const;
  // The view of `grads` that this rank steps with (its owned range).
  Tensor owned_grads(const Tensor& grads) const;
  // Updates the owned range of params from grads (already summed over replicas), then
  // (stages 1, 2) all-gathers the updated shards in place so every replica holds all parameters.
  // Parameters marked no_weight_decay are stepped with weight decay 0 (the parameter groups of
  // layers::Optimizer); the owned range is cut into segments at their boundaries.
  void step(const Tensor& params, const Tensor& grads, float lr);

  const Shard& shard() const { return shard_; }
  // Bytes of optimizer state this rank allocated (the real tensors).
  int64_t state_bytes() const;
  // This rank's optimizer state by name ("momentum", "exp_avg", ...; "master" with mixed
  // precision): flat f32 tensors of shard().numel() elements, element 0 = flat element
  // shard().begin. For checkpoints.
  std::vector<std::pair<std::string, Tensor>> state() const;
  // Mixed precision: the f32 master weights of the owned range (undefined when the
  // parameters are f32 themselves). The step updates them and rounds them into the
  // low-precision parameters, so small updates are not lost to bf16/f16 rounding.
  const Tensor& master() const { return master_; }
  // Sets the owned part of the master weights from the full f32 values of entry e (loading a
  // checkpoint); no-op without master weights.
  void set_master(const layers::ParamEntry& e, const Tensor& full);
  // Optimizer steps taken, saved and restored by checkpoints. A rank with an empty shard
  // never steps its inner optimizer, so the count is kept here for every rank alike.
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t steps);

 private:
  Ownership ownership_;
  Communicator& dp_;
  Shard shard_;
  layers::Optimizer inner_;  // state for shard_ only
  // The elements of shard_ (relative to its start) that are tensor-parallel shards.
  std::vector<std::pair<int64_t, int64_t>> split_ranges_;
  Tensor master_;  // f32 copy of the owned parameters when they are stored in bf16/f16
  int64_t steps_ = 0;
};

// ZeRO 3: gathers a stage's sharded parameters layer by layer into two window slots: layer j
// (forward order) into slot j % 2, each slot as large as the largest layer it takes. A pass (one forward or backward
// over the stage's layers) visits the layers with trainable parameters in order; next() waits for the current layer's
// window, starts the gather of the layer after it into the other slot (prefetch) and binds the layer's parameters to
// its window. Every replica runs the same passes, so the broadcasts on `dp` are started in the same order everywhere,
// as collectives must be. A tied head (layers::LMHead reading its Embedding's wte, on the same stage) is one more
// visit at the head's place: the Embedding's range is gathered into the head's slot and bound as the Embedding's
// views, which the head reads; no copy of wte (its gradient stays pinned in the GradientRing).
class ParameterGather {
 public:
  // `store` holds this rank's shard (allocate_params = false) of a layout padded to
  // dp * shard_size elements.
  ParameterGather(Communicator& dp, const layers::Model& model, const layers::ParameterStore& store, int64_t shard_size,
                  size_t begin, size_t end);

  using Range = layers::ParameterStore::LayerRange;
  // One visit of a pass: while layer `runs` runs, `params` (some layer's range) is bound.
  struct Visit {
    size_t runs;
    Range params;
  };
  // The visits of stage [begin, end) in forward order: each layer with parameters its own range,
  // a tied head its embedding's.
  static std::vector<Visit> visits(const layers::Model& model, size_t begin, size_t end,
                                   const std::vector<Range>& ranges);

  bool has_params(size_t layer) const;
  // Starts a pass: forward (lowest layer first) or backward; starts the first layer's gather.
  void begin_pass(bool backward);
  // Binds the pass's next layer to its window (see above).
  void next();
  // Backward: `layer` has run; readies the next lower layer with parameters, if any.
  void layer_done(size_t layer);
  // The full values of a trainable entry, gathered from their owners (collective over dp).
  Tensor gather(const layers::ParamEntry& e);
  // Bytes of the two window slots.
  int64_t allocated_bytes() const;
  // Elements of the two window slots for a stage's visits: the largest range at even and at odd
  // positions (forward order), the ranges each slot takes.
  static std::array<int64_t, 2> window_elements(const std::vector<Visit>& visits);

 private:
  // Starts the broadcasts of flat elements [begin, end) from their owners into `out`.
  std::vector<WorkPtr> start(int64_t begin, int64_t end, const Tensor& out);

  Communicator& dp_;
  const layers::Model& model_;
  const layers::ParameterStore& store_;
  int64_t shard_size_;
  std::vector<Visit> visits_;  // in forward order
  std::array<Tensor, 2> slots_;
  std::array<std::vector<WorkPtr>, 2> pending_;  // gathers still writing each slot
  bool backward_ = false;
  size_t pos_ = 0;  // next() readies the pass's pos_-th layer
};

}  // namespace strata::parallel
