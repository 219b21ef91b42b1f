// DataParallel: one pipeline stage replicated over a data-parallel group, and the one owner of
// everything the ZeRO stage decides. Given the stage's layers, the dp communicator and the
// ZeRO stage it lays out the flat buffers (ParameterStore), builds the gradient reduction
// (BucketReducer; GradientRing under ZeRO 2/3), the ZeRO-3 parameter gather and the sharded
// optimizer; runs the stage's forward and backward with their hooks (buckets started as layers
// finish, ZeRO-3 windows gathered just in time); steps the optimizer; and answers "who owns
// what" (Ownership) for checkpoints and memory tables. Nothing outside it branches on the ZeRO
// stage.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "layers/loss_scaler.hpp"
#include "layers/model.hpp"
#include "layers/optimizer.hpp"
#include "layers/parameter_store.hpp"
#include "parallel/comm/communicator.hpp"
#include "parallel/data/bucket_reducer.hpp"
#include "parallel/data/gradient_ring.hpp"
#include "parallel/data/zero.hpp"
#include "parallel/pipeline/partition.hpp"
#include "parallel/plan/layout.hpp"

namespace strata::parallel {

class DataParallel {
 public:
  // Collective over `dp` (the full buffers may be shared memory it hands out). `stage`: the
  // layers [begin, end) of `model` this stage holds.
  // From `layout`: the ZeRO stage, bucket bytes, dtype and optimizer; `seed` initialises the
  // parameters on `device`.
  DataParallel(Communicator& dp, const layers::Model& model, StageRange stage, const Layout& layout, uint64_t seed,
               Device device);

  const Ownership& ownership() const { return ownership_; }
  // The Ownership of another stage of the same model under this group's ZeRO stage and size.
  Ownership ownership_of(StageRange stage) const;
  const layers::ParameterStore& store() const { return *store_; }
  const ShardedOptimizer& optimizer() const { return *optimizer_; }
  ShardedOptimizer& optimizer() { return *optimizer_; }
  Communicator& comm() { return dp_; }

  // Zeroes the gradients the step accumulates: the flat buffer (ZeRO 0, 1) or this replica's
  // shard (2, 3).
  void zero_grads();
  // Forward through the stage's layers; with ZeRO 3 one layer at a time, each bound to its
  // gathered parameters just before it runs.
  Tensor forward(const Tensor& x, std::vector<layers::Context>& ctx, const layers::StepInfo& info);
  // Backward through the stage's layers. The step's last backward (`last_of_step`) reduces the
  // gradient buckets over the replicas as layers finish (ZeRO 2 and 3: every backward, since
  // there is no full buffer to accumulate in), then waits for what backward did not hide (the
  // watchdog counts that wait: watchdog::waited_seconds). Returns the input's gradient where `input_grad`.
  Tensor backward(const Tensor& dy, std::vector<layers::Context>& ctx, bool last_of_step, bool input_grad);
  // Runs in the step's last backward as soon as a layer has written its gradients, before
  // they are reduced over the replicas (TiedEmbedding adds the head's gradient to wte's).
  void set_before_reduce(std::function<void(size_t layer)> hook) { before_reduce_ = std::move(hook); }
  // The optimizer step after the step's backwards, of this stage alone (optimizer_step below
  // steps a rank's chunks together).
  bool step(float lr, layers::LossScaler& scaler, float clip, Communicator& world, Communicator& pipeline,
            Communicator* tensor_parallel = nullptr, bool inject_overflow = false);

  // Every replica takes replica 0's parameters (unless sharded) and buffers.
  void broadcast_parameters();
  // Only the buffers (BatchNorm statistics), before an evaluation.
  void broadcast_buffers();
  // The full value of entry e (collective over dp for sharded parameters; the stored dtype).
  Tensor full_value(const layers::ParamEntry& e);
  // Sets entry e (and its f32 master copy) from its full value, keeping this replica's part.
  void set_value(const layers::ParamEntry& e, const Tensor& full);

  // Bytes this rank allocated: parameters (+ buffers, + ZeRO-3 windows), gradients (+ ZeRO-2/3
  // ring), optimizer state (+ master weights).
  int64_t parameter_bytes() const;
  int64_t gradient_bytes() const;
  int64_t optimizer_bytes() const { return optimizer_->state_bytes(); }

 private:
  friend bool optimizer_step(std::span<DataParallel* const>, float, layers::LossScaler&, float, Communicator&,
                             Communicator&, Communicator*, bool);
  const Tensor& grads() const;

  Communicator& dp_;
  const layers::Model& model_;
  StageRange stage_;
  Ownership ownership_;
  std::unique_ptr<layers::ParameterStore> store_;
  std::unique_ptr<ShardedOptimizer> optimizer_;
  // Exactly one of the two reduces the gradients over the replicas, by the ZeRO stage.
  std::unique_ptr<BucketReducer> reducer_;   // ZeRO 0, 1: buckets of the full gradient buffer
  std::unique_ptr<GradientRing> ring_;       // ZeRO 2, 3: no full buffer, a ring into the shard
  std::unique_ptr<ParameterGather> gather_;  // ZeRO 3 only
  std::function<void(size_t)> before_reduce_;
};

// The optimizer step of a rank's stages after the step's backwards: its one stage, or with the
// interleaved schedule its chunks (virtual stages), each with its own DataParallel. With loss
// scaling the owned gradients are checked for inf/NaN (agreed over `world`, so every rank skips
// alike) and unscaled; `clip` > 0 clips to the global norm over all chunks, the `pipeline`
// stages and the `tensor_parallel` ranks (if any; parameters they all hold whole count once).
// Returns whether it stepped. `inject_overflow`: a testing aid that puts an inf into this
// rank's gradients.
bool optimizer_step(std::span<DataParallel* const> chunks, float lr, layers::LossScaler& scaler, float clip,
                    Communicator& world, Communicator& pipeline, Communicator* tensor_parallel = nullptr,
                    bool inject_overflow = false);

}  // namespace strata::parallel
