// The Layer contract: explicit forward and backward, no tape. What backward needs is saved in
// a Context that the caller owns, one per micro-batch, so several micro-batches can be in
// flight at once (pipeline schedules). Parameters are views into a stage's flat buffers.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "layers/tensor_parallel.hpp"

namespace strata::layers {

enum class Mode { Train, Eval };

// What a forward pass needs besides its input: the mode and the keys of random streams.
struct StepInfo {
  Mode mode = Mode::Train;
  uint64_t seed = 0;
  int64_t step = 0;          // optimizer step: keys dropout masks
  int64_t first_sample = 0;  // global index of this micro-batch's first sample
};

// One layer's saved state for one micro-batch.
struct Context {
  std::vector<Tensor> saved;
  std::vector<Context> children;  // for composite layers
  StepInfo info;
  Shape input_shape;  // the batch input shape, for layers that only reshape or pool
  // Set by the caller before backward: false when nobody needs dx (the model's input), so
  // layers with parameters skip computing it and return an undefined tensor.
  bool input_grad = true;
  void clear() {
    saved.clear();
    children.clear();
  }
};

// How a parameter starts. FanInUniform is PyTorch's default for Linear and Conv weights and
// biases: U(-1/sqrt(fan_in), 1/sqrt(fan_in)). Normal is N(0, std^2) (GPT-2's init), drawn by
// Box-Muller from the same counter-based uniforms (model.cpp: initialise).
enum class Init { FanInUniform, Zeros, Ones, Normal };

struct ParamSpec {
  std::string name;  // relative to the layer: "weight", "conv1/weight"
  Shape shape;
  Init init = Init::Zeros;
  int64_t fan_in = 0;
  bool trainable = true;  // false for buffers (BatchNorm running statistics): saved, not optimised
  double std = 0.0;       // Init::Normal's standard deviation
  // AdamW/SGD parameter groups (nanoGPT's rule): weight decay applies only to the weights of
  // Linear-like maps (2-D and up); biases, normalisation scales/shifts and embeddings set this
  // and are stepped with weight_decay 0 (layers::Optimizer::set_no_decay).
  bool no_weight_decay = false;
  // A tensor-parallel shard: `shape` is this rank's part of the full tensor (tensor_parallel.hpp).
  // Initial values are the full tensor's at the shard's positions, so they do not depend on T.
  TensorSplit split{};
};

class Layer {
 public:
  explicit Layer(std::string name) : name_(std::move(name)) {}
  virtual ~Layer() = default;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  // The layer's stable name in its model ("conv1"), used for checkpoints.
  const std::string& name() const { return name_; }
  // What the store puts before the layer's ParamSpec names: "<name>/", or "" for a layer
  // whose parameter names are already model-level (the GPT embedding's "wte/weight").
  virtual std::string param_prefix() const { return name_ + "/"; }
  // e.g. "conv2d(1->32, k3 s1 p1)"
  virtual std::string describe() const = 0;
  // Per-sample output shape for a per-sample input shape. Throws an Input error when the
  // input does not fit (so a bad model/dataset pair is reported before training).
  virtual Shape output_shape(const Shape& input) const = 0;
  virtual std::vector<ParamSpec> param_specs() const { return {}; }
  // Views into the flat buffers, in param_specs() order; grads[i] is undefined for buffers.
  virtual void bind(std::span<const Tensor> params, std::span<const Tensor> grads) {}
  // x: (B, input...) -> (B, output...).
  virtual Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) = 0;
  // Accumulates parameter gradients and returns dx (undefined if !ctx.input_grad and the layer
  // skips it). Consumes ctx.
  virtual Tensor backward(const Tensor& dy, Context& ctx) = 0;
  // The layer whose parameters this one also uses (a tied LM head: the token embedding), or
  // null. Tied layers must share a pipeline stage and their views must not be rebound.
  virtual const Layer* shares_parameters_with() const { return nullptr; }
  // Forward multiply-adds per sample, for partitioning and reports.
  virtual int64_t flops(const Shape& input) const { return 0; }

  // Position in the model; keys this layer's random streams.
  int index() const { return index_; }
  virtual void set_index(int index) { index_ = index; }

 private:
  std::string name_;
  int index_ = 0;
};

using LayerPtr = std::unique_ptr<Layer>;

// The batch shape (B, sample...) of a per-sample shape.
Shape batch_shape(int64_t batch, const Shape& sample);

}  // namespace strata::layers
