// Layers made of layers: Sequential and the residual block. Their children's parameters are
// named "<child>/<param>" under the composite, and children's contexts nest in the parent's.
#pragma once

#include "layers/layer.hpp"

namespace strata::layers {

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
  bool empty() const { return children_.empty(); }

 private:
  std::vector<LayerPtr> children_;
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

 private:
  Sequential main_, shortcut_;
};

}  // namespace strata::layers
