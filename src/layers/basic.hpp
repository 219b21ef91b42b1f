// The layers: dense, convolution, pooling, activations, dropout, normalisation, flatten.
// Each calls ops::… only; the ops dispatch to CPU or CUDA.
#pragma once

#include "core/ops.hpp"
#include "layers/layer.hpp"

namespace strata::layers {

// How a Linear is split over a tensor-parallel group (Megatron-LM's pair: a column-parallel
// layer feeds a row-parallel one, so the pair costs one all-reduce forward and one backward).
//   Column: each rank holds out/T output features (W rows, the bias likewise) and outputs its
//           slice (..., out/T); forward needs no communication; backward all-reduces dx.
//   Row:    each rank holds in/T input features (W columns) and takes its slice (..., in/T) as
//           input; y = all_reduce(x_local W_local^T) + b, the bias replicated; backward is local
//           (dx is the input slice's gradient; db the same on every rank).
enum class TensorParallelMode { None, Column, Row };

// The gradient pieces of a linear map's weight (rows x cols) and bias (rows, if any; after the
// weight, aligned) when they are larger than max_elements: the bias, then the weight in blocks
// of whole rows from the last down (at least one row each). Empty otherwise.
std::vector<GradientPiece> linear_gradient_pieces(int64_t rows, int64_t cols, bool bias, int64_t max_elements);
// Writes dW += dy^T x (dy (N, rows), x (N, cols)) and db += the sum of dy's rows through `sink`,
// in the pieces above.
void write_linear_gradient_pieces(GradientSink& sink, const std::vector<GradientPiece>& pieces, const Tensor& dy,
                                  const Tensor& x);

// y = x W^T + b; x (B, in), W (out, in) as in torch.nn.Linear. Inputs with more dimensions
// (B, T, in) are mapped along the last one, as (B * T, in). The bias takes no weight decay.
class Linear final : public Layer {
 public:
  Linear(std::string name, int64_t in_features, int64_t out_features, bool bias = true);
  // GPT-2's init and parameter groups instead of PyTorch's defaults: weight ~ N(0, std^2),
  // bias 0 and without weight decay (ParamSpec::no_weight_decay).
  void set_gpt_init(double std);
  // Splits this layer (in_features and out_features stay the full sizes) over `tp`; a null
  // group or one of size 1 leaves it whole. Column: `segments` equal blocks of the outputs are
  // each split (c_attn's q | k | v: 3), so a rank's outputs are its piece of every block. The
  // split sizes must divide evenly (checked: an Input error).
  // replicas (Column only): consecutive ranks holding the same piece (TensorSplit::replicas), so
  // the outputs are split tp / replicas ways.
  void set_tensor_parallel(TensorParallelMode mode, TensorParallelGroup* tp, int segments = 1, int replicas = 1);
  // Column-parallel maps of one input (q, k, v; SwiGLU's gate and up) join their input gradients
  // with one all-reduce, made by the layer that owns them: backward then leaves dx local.
  // With sequence parallelism (TensorParallelGroup::sequence_parallel) such an owner gathers
  // the maps' input itself (one all-gather for all) and scatters their summed input gradient.
  void set_local_input_grad() { local_input_grad_ = true; }
  // Sequence parallelism: a column-parallel map (not joined by an owner) takes this rank's part
  // (B, T/tp, in) of the sequence and gathers the whole; a row-parallel one outputs this rank's
  // part of the summed result (B, T/tp, out). Backward the other way round.
  bool gathers_input() const;
  bool scatters_output() const;
  // What forward saved for backward is the input: an owner gathering the maps' input keeps its
  // part instead and gives the maps the whole again before backward (x: (B, T, in) or (N, in)).
  static void release_input(Context& ctx) { ctx.saved.clear(); }
  static void restore_input(Context& ctx, const Tensor& x);
  TensorParallelMode tensor_parallel_mode() const { return mode_; }
  // This rank's output / input features: out/T for Column, in/T for Row, else the full sizes.
  int64_t local_out() const;
  int64_t local_in() const;
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;
  std::vector<GradientPiece> gradient_pieces(int64_t max_elements) const override;  // linear_gradient_pieces

 private:
  TensorSplit split(int dim) const;
  int64_t in_, out_;
  bool has_bias_;
  Init init_ = Init::FanInUniform;
  double std_ = 0.0;
  TensorParallelMode mode_ = TensorParallelMode::None;
  TensorParallelGroup* tp_ = nullptr;
  int segments_ = 1;
  int replicas_ = 1;
  bool local_input_grad_ = false;
  Tensor w_, b_, dw_, db_;
};

// 2-D convolution, weight (out, in, k, k) as in torch.nn.Conv2d.
class Conv2d final : public Layer {
 public:
  Conv2d(std::string name, int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride = 1,
         int64_t padding = 0, bool bias = true);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;

 private:
  ops::Conv2dGeometry geometry(const Shape& batch_input) const;
  int64_t in_, out_, kernel_, stride_, padding_;
  bool has_bias_;
  Tensor w_, b_, dw_, db_;
};

enum class PoolKind { Max, Avg };

class Pool2d final : public Layer {
 public:
  Pool2d(std::string name, PoolKind kind, int64_t kernel, int64_t stride, int64_t padding = 0);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;

 private:
  ops::Pool2dGeometry geometry(const Shape& batch_input) const;
  PoolKind kind_;
  int64_t kernel_, stride_, padding_;
};

// (B, C, H, W) -> (B, C)
class GlobalAvgPool final : public Layer {
 public:
  using Layer::Layer;
  std::string describe() const override { return "global_avg_pool"; }
  Shape output_shape(const Shape& input) const override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
};

// GELU: exact, x Phi(x); GELUTanh: its tanh approximation (GPT-2's "gelu_new").
enum class Activation { ReLU, GELU, GELUTanh };

class ActivationLayer final : public Layer {
 public:
  ActivationLayer(std::string name, Activation kind) : Layer(std::move(name)), kind_(kind) {}
  std::string describe() const override {
    return kind_ == Activation::ReLU ? "relu" : kind_ == Activation::GELU ? "gelu" : "gelu_tanh";
  }
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;

 private:
  Activation kind_;
};

// Inverted dropout; the mask is a pure function of (seed, step, layer, global sample index),
// so it is the same however the batch is split across ranks and micro-batches.
class Dropout final : public Layer {
 public:
  Dropout(std::string name, float p);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  // Runs on this rank's part of each sequence when `tp` is sequence-parallel: each element draws
  // the whole sequence's mask at its position, so the masks do not depend on tp.
  void set_sequence_parallel(TensorParallelGroup* tp) { sp_ = sequence_parallel_group(tp); }

 private:
  ops::DropoutKey key(const StepInfo& info, const Tensor& x) const;
  float p_;
  TensorParallelGroup* sp_ = nullptr;
};

// (B, d1, d2, ...) -> (B, d1*d2*...)
class Flatten final : public Layer {
 public:
  using Layer::Layer;
  std::string describe() const override { return "flatten"; }
  Shape output_shape(const Shape& input) const override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
};

// Per-channel batch normalisation of (B, C, H, W). Statistics are local to the micro-batch
// (as torch.nn.BatchNorm2d without SyncBatchNorm); running statistics are buffers.
class BatchNorm2d final : public Layer {
 public:
  BatchNorm2d(std::string name, int64_t channels, float momentum = 0.1f, float eps = 1e-5f);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;

 private:
  int64_t channels_;
  float momentum_, eps_;
  Tensor gamma_, beta_, running_mean_, running_var_, dgamma_, dbeta_;
};

// Normalises over the last dimension, as torch.nn.LayerNorm(features).
class LayerNorm final : public Layer {
 public:
  LayerNorm(std::string name, int64_t features, float eps = 1e-5f);
  // Puts weight and bias in the no-weight-decay group (ParamSpec::no_weight_decay; GPT).
  void set_no_weight_decay() { no_weight_decay_ = true; }
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  float eps() const { return eps_; }
  // Runs on this rank's part of the sequence when `tp` is sequence-parallel: the gradients of
  // weight and bias are then summed over the group (sum_sequence_parallel_grads).
  void set_sequence_parallel(TensorParallelGroup* tp) { sp_ = sequence_parallel_group(tp); }

 private:
  int64_t features_;
  float eps_;
  bool no_weight_decay_ = false;
  TensorParallelGroup* sp_ = nullptr;
  Tensor gamma_, beta_, dgamma_, dbeta_;
};

}  // namespace strata::layers
