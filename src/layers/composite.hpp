// Layers made of layers: Sequential and the residual block. Their children's parameters are
// named "<child>/<param>" under the composite, and children's contexts nest in the parent's.
#pragma once

#include <functional>

#include "layers/layer.hpp"

namespace strata::layers {

// The children of a composite layer, registered in the order of its param_specs(), and how they
// write their gradients when the composite streams its own (Layer::set_gradient_sink): each
// child, the last first, gets the sink itself if it is larger than a piece and streams too, or
// else one piece for all of its gradients, its views rebound there for its backward.
class ChildGradients {
 public:
  void add(Layer& child);
  // Binds each child to its views (what the composite's bind does) and keeps its parameters.
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads);
  // The composite's gradient_pieces(): a child's range, or its own pieces, last child first;
  // empty when all its gradients fit one piece.
  std::vector<GradientPiece> pieces(int64_t max_elements) const;
  // Runs `backward`, the backward of `child` (one of these), writing the child's gradients
  // through the composite's sink if it has one. Children with parameters must run last first.
  Tensor backward(const Layer& composite, Layer& child, const std::function<Tensor()>& backward);

 private:
  struct Child {
    Layer* layer = nullptr;
    size_t first_param = 0;  // in the composite's param_specs()
    std::vector<Tensor> params;
  };
  std::vector<Child> children_;
  size_t next_ = SIZE_MAX;  // the child whose backward comes next while streaming
};

class Sequential final : public Layer {
 public:
  Sequential(std::string name, std::vector<LayerPtr> children);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;
  void set_index(int index) override;
  std::vector<GradientPiece> gradient_pieces(int64_t max_elements) const override;
  bool empty() const { return children_.empty(); }

 private:
  std::vector<LayerPtr> children_;
  ChildGradients gradients_;
};

// y = relu(main(x) + shortcut(x)); the shortcut is the identity when it has no layers.
// CIFAR ResNet's basic block: main = conv3x3-bn-relu-conv3x3-bn, shortcut = conv1x1-bn when
// the shape changes.
class ResidualBlock final : public Layer {
 public:
  ResidualBlock(std::string name, std::vector<LayerPtr> main, std::vector<LayerPtr> shortcut);
  // The basic block of He et al. (2016) from in to out channels with the given stride.
  static LayerPtr basic(std::string name, int64_t in_channels, int64_t out_channels, int64_t stride);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;
  void set_index(int index) override;
  std::vector<GradientPiece> gradient_pieces(int64_t max_elements) const override;

 private:
  Sequential main_, shortcut_;
  ChildGradients gradients_;
};

}  // namespace strata::layers
