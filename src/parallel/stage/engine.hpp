// The stage engine: one rank's part of a training step, whatever the layout. It owns the rank's
// chunks (one data-parallel replica of each of its virtual stages, DataParallel), the tied
// embedding's cross-stage copy, the pipeline executor, the state gather and the one map between
// virtual stages and (pipeline rank, chunk); it runs a whole optimizer step — micro-batches
// through the schedule, loss, backward with overlapped gradient sync, the optimizer over every
// chunk, the end-of-step agreement of all ranks — and a forward-only pass for evaluation.
//
// This is the only implementation of the step: `train`, every benchmark (bench/) and the memory
// planner's activation run (plan_activations runs the same StageCallbacks on meta tensors) call it,
// so what the benchmarks measure is what `train` runs.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "layers/loss.hpp"
#include "layers/loss_scaler.hpp"
#include "layers/model.hpp"
#include "parallel/data/data_parallel.hpp"
#include "parallel/pipeline/executor.hpp"
#include "parallel/pipeline/partition.hpp"
#include "parallel/plan/memory_plan.hpp"
#include "parallel/runtime/process_grid.hpp"
#include "parallel/stage/fault_injection.hpp"
#include "parallel/stage/stage_map.hpp"
#include "parallel/stage/state_gather.hpp"
#include "parallel/stage/step.hpp"
#include "parallel/stage/tied_embedding.hpp"

namespace strata::parallel {

// Everything the engine takes from the configuration, whole.
struct EngineSettings {
  Layout layout;        // pp, dp, ZeRO, dtype, optimizer, buckets, micro-batches, schedule, chunks
  uint64_t seed = 0;    // parameter initialisation and dropout keys (the device is the grid's)
  float clip_grad = 0;  // global-norm clipping (0: off)
  layers::LossScaler scaler;
  double stand_in_ms = 0;  // benchmark aid: PipelineExecutor's stand-in compute per micro-batch
  FaultInjection faults;
};

// One step's outcome, the same on every rank.
struct StepResult {
  double loss = 0;       // mean over the global batch's targets
  bool stepped = true;   // false: the gradients overflowed (fp16) and the step was skipped
  bool stop = false;     // some rank asked to stop (a preemption signal)
  int64_t dp_bytes = 0;  // sent by this rank on its dp communicator during the step
  int64_t tp_bytes = 0;  // and on its tp communicator
};

// An evaluation's sums over every sample, the same on every rank.
struct EvalSums {
  double loss = 0;     // summed over the targets
  double correct = 0;  // targets predicted right
};

class StageEngine {
 public:
  // Collective over the grid. `model` is built for this rank's tensor-parallel group and cut into
  // `stages` (P x v virtual stages); the engine binds the layers of this rank's chunks.
  StageEngine(ProcessGrid& grid, layers::Model& model, std::vector<StageRange> stages, const EngineSettings& settings);
  StageEngine(const StageEngine&) = delete;
  StageEngine& operator=(const StageEngine&) = delete;

  // One optimizer step over this replica's slice of the global batch: x and y hold
  // micro_batches x micro samples (x read by the first stage only, y by the last), the first
  // being global sample `first_sample` (dropout keys). `step` counts from 0. `stop_requested`
  // says whether this rank was asked to stop, read just before the end-of-step agreement (so a
  // signal that arrives during the step stops after it); the result says whether any rank was
  // (agreed with the loss and the collective fingerprints in one all-gather). `record_timeline` keeps the schedule's
  // events for timeline().
  StepResult step(const Tensor& x, const Tensor& y, int64_t first_sample, int64_t step, float lr,
                  const std::function<bool()>& stop_requested = {}, bool record_timeline = false);

  // Reads samples [begin, end) into x (first stage only; undefined elsewhere) and y (every
  // stage may ask), host tensors of the right shape.
  using ReadSlice = std::function<void(int64_t begin, int64_t end, const Tensor& x, const Tensor& y)>;
  // Collective: the loss and correct targets of samples [0, n) through the pipeline, each
  // evaluated once (replica r takes a contiguous slice), with replica 0's buffers. Pieces of at
  // most a training micro-batch when `capped` (--device-memory), else of at most 256 samples
  // and ~64 MiB of outputs. `input_dtype`: the data's (tokens: i32).
  EvalSums evaluate(int64_t n, DType input_dtype, const ReadSlice& read, bool capped);

  // The deadline of every wait from now on (train's --timeout; setup runs under the watchdog's own).
  void set_wait_deadline(double seconds);
  // Seconds this process has been blocked so far: on pipeline messages, and in every other
  // group's collectives (the watchdog's count; the progress line's `pipeline` and `comm`).
  struct Blocked {
    double pipeline = 0, collectives = 0;
  };
  static Blocked blocked_seconds();

  // Every replica takes replica 0's parameters and the tied head its copy of wte: after
  // initialisation or loading.
  void synchronise_replicas();
  StateGather& state() { return *state_; }
  // Optimizer steps taken (bias correction), the same in every chunk.
  int64_t optimizer_steps() const;
  void set_optimizer_steps(int64_t steps);
  layers::LossScaler& scaler() { return scaler_; }

  const StageMap& map() const { return map_; }
  const Layout& layout() const { return settings_.layout; }
  // Targets per sample: 1 label, or a window's T next tokens.
  int64_t targets_per_sample() const { return targets_per_sample_; }
  // Trainable parameters of this rank's chunks (without padding).
  int64_t trainable_parameters() const;
  // Bytes this rank allocated: {parameters, gradients, optimizer state} (the plan's check).
  std::vector<int64_t> allocated_bytes() const;
  // The most micro-batches in flight at once so far.
  int peak_in_flight() const { return pipeline_->peak_in_flight(); }
  // Collective over the replica's pipeline group: stage 0 gets every stage's events of the last
  // recorded step (empty elsewhere).
  std::vector<TimelineEvent> gather_timeline();

 private:
  class Replicas;                            // the chunks as step_callbacks runs them
  Tensor to_compute(const Tensor& x) const;  // in the compute dtype on this rank's device
  Tensor to_device(const Tensor& t) const;
  DataParallel& chunk(int c) { return *chunks_[static_cast<size_t>(c)]; }

  ProcessGrid& grid_;
  const layers::Model& model_;
  EngineSettings settings_;
  StageMap map_;
  layers::LossScaler scaler_;
  int64_t targets_per_sample_ = 1;
  layers::SoftmaxCrossEntropy loss_;
  std::unique_ptr<TiedEmbedding> tied_;
  std::vector<std::unique_ptr<DataParallel>> chunks_;
  std::vector<DataParallel*> chunk_ptrs_;
  std::unique_ptr<PipelineExecutor> pipeline_;
  std::unique_ptr<StateGather> state_;
};

}  // namespace strata::parallel
