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

// A piece of a layer's parameter gradients: elements [begin, end) of the layer's part of the
// flat layout (trainable_offsets), which may span several of its parameters.
struct GradientPiece {
  int64_t begin = 0, end = 0;
};

// Where a layer writes its parameter gradients piece by piece (ZeRO 2/3: a gradient ring smaller
// than the layer's gradients, each piece reduced while backward writes the next).
class GradientSink {
 public:
  virtual ~GradientSink() = default;
  // Zeroed memory for the layer's next piece, in gradient_pieces() order.
  virtual Tensor next_piece() = 0;
  // The piece from next_piece() is written; it is reduced from here on.
  virtual void piece_written() = 0;
};

class Layer;

// A layer that multiplies by another layer's weight instead of one of its own (GPT-2's tied LM
// head uses the token embedding's wte). Parallel code asks it for the pair and, where the two
// layers cannot share views (another pipeline stage or chunk), gives it a copy of the weight and
// of its gradient and keeps them in step (parallel::TiedEmbedding).
class TiedWeight {
 public:
  virtual ~TiedWeight() = default;
  // The layer whose parameter the weight is.
  virtual const Layer& weight_owner() const = 0;
  // That parameter's name in the parameter store ("wte/weight") and its shape on this rank (a
  // tensor-parallel rank's rows).
  virtual std::string weight_name() const = 0;
  virtual Shape weight_shape() const = 0;
  // The owner's gradient of the weight as bound now: where the copy's gradient is added.
  virtual const Tensor& owner_weight_grad() const = 0;
  // From now on the layer reads `w` and accumulates into `dw` (both weight_shape()) instead of
  // the owner's views; it then shares nothing (Layer::shares_parameters_with() is null).
  virtual void use_copy(Tensor w, Tensor dw) = 0;
};

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
// Box-Muller from the same counter-based uniforms (parameter_store.cpp: initialise).
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

// Flat buffers start every tensor on a 16-element (64-byte) boundary (ParameterStore).
constexpr int64_t kParamAlignment = 16;
inline int64_t align_param(int64_t n) { return (n + kParamAlignment - 1) / kParamAlignment * kParamAlignment; }

// Where each trainable parameter of a layer's specs starts in its part of the flat layout,
// relative to the first (buffers, which live elsewhere: -1); element `size` ends the last one.
struct TrainableLayout {
  std::vector<int64_t> offsets;
  int64_t size = 0;
};
inline TrainableLayout trainable_layout(const std::vector<ParamSpec>& specs) {
  TrainableLayout t;
  int64_t cursor = 0;
  for (const ParamSpec& s : specs) {
    t.offsets.push_back(s.trainable ? cursor : -1);
    if (!s.trainable) continue;
    t.size = cursor + shape_numel(s.shape);
    cursor = align_param(t.size);
  }
  return t;
}

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
  // The other layer's weight this one multiplies by (a tied LM head's), whether shared or
  // copied, or null.
  virtual TiedWeight* tied_weight() { return nullptr; }
  // Whether the input is i32 token ids (B, T...) rather than activations (a token embedding).
  virtual bool takes_token_ids() const { return false; }
  // The elements one sample's forward and backward all-reduce over the tensor-parallel group in
  // this layer (`recomputed`: its forward runs twice), as built for its group, an all-gather or a
  // reduce-scatter counting as half an all-reduce of its whole tensor (the bytes each rank
  // sends); the layout search counts tensor-parallel traffic by these. 0 for a layer that is not split.
  virtual int64_t tp_all_reduced_elements(const Shape& input, bool recomputed) const { return 0; }
  // Forward multiply-adds per sample, for partitioning and reports.
  virtual int64_t flops(const Shape& input) const { return 0; }
  // The pieces of at most about max_elements each (at least one row of a weight, or a whole
  // sublayer that cannot be cut) in which backward can write the parameter gradients, in the
  // order it writes them (down the flat layout: the last parameter first); empty if it writes
  // them whole.
  virtual std::vector<GradientPiece> gradient_pieces(int64_t max_elements) const { return {}; }
  // With a sink (for a layer whose gradient_pieces(max_elements) are not empty), backward writes
  // the parameter gradients through it, in those pieces, instead of into the bound views; null:
  // into the views.
  void set_gradient_sink(GradientSink* sink, int64_t max_elements) {
    gradient_sink_ = sink;
    gradient_piece_limit_ = max_elements;
  }
  GradientSink* gradient_sink() const { return gradient_sink_; }
  int64_t gradient_piece_limit() const { return gradient_piece_limit_; }

  // Position in the model; keys this layer's random streams.
  int index() const { return index_; }
  virtual void set_index(int index) { index_ = index; }

 private:
  std::string name_;
  int index_ = 0;
  GradientSink* gradient_sink_ = nullptr;
  int64_t gradient_piece_limit_ = 0;
};

using LayerPtr = std::unique_ptr<Layer>;

// The batch shape (B, sample...) of a per-sample shape.
Shape batch_shape(int64_t batch, const Shape& sample);

}  // namespace strata::layers
