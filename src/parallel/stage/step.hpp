// What one micro-batch of a training step runs on a rank's chunks — forward, the loss on the
// last virtual stage, backward — written once: the stage engine runs it on its data-parallel
// replicas, the memory planner on a model bound to meta tensors (plan_activations), both through
// the same PipelineExecutor, which decides when each callback runs.
#pragma once

#include <functional>
#include <vector>

#include "layers/layer.hpp"
#include "layers/loss.hpp"
#include "parallel/pipeline/executor.hpp"

namespace strata::parallel {

// A rank's chunks (virtual stages), whatever holds their layers.
class ChunkRunner {
 public:
  virtual ~ChunkRunner() = default;
  // Chunk `chunk`'s forward of x, saving in ctx what backward needs.
  virtual Tensor forward(int chunk, const Tensor& x, std::vector<layers::Context>& ctx,
                         const layers::StepInfo& info) = 0;
  // Chunk `chunk`'s backward from dy; `last_of_step`: no backward of this chunk follows in the
  // step. Returns the input's gradient where `input_grad`.
  virtual Tensor backward(int chunk, const Tensor& dy, std::vector<layers::Context>& ctx, bool last_of_step,
                          bool input_grad) = 0;
};

// The step's micro-batches, as the first and the last virtual stage read them.
struct MicroBatches {
  std::function<Tensor(int micro)> input;   // the model's input of micro-batch `micro`
  std::function<Tensor(int micro)> labels;  // its targets
  int64_t size = 1;                         // samples per micro-batch
};

// The executor's callbacks for one step. `step`: the forward passes' mode, seed, step and the
// global index of micro-batch 0's first sample (dropout keys: micro-batch m starts m x size
// later). The loss of each micro-batch is added to `loss_sum`; its gradient is scaled by
// `loss_scale`. The first virtual stage computes no input gradient.
StageCallbacks step_callbacks(const PipelineExecutor& executor, ChunkRunner& chunks,
                              const layers::SoftmaxCrossEntropy& loss, const MicroBatches& data,
                              const layers::StepInfo& step, float loss_scale, double& loss_sum);

}  // namespace strata::parallel
