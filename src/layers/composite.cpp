// Sequential and residual composites.
#include "layers/composite.hpp"

#include "core/ops.hpp"
#include "layers/basic.hpp"

namespace strata::layers {

Sequential::Sequential(std::string name, std::vector<LayerPtr> children)
    : Layer(std::move(name)), children_(std::move(children)) {}

std::string Sequential::describe() const {
  std::string s = "sequential(";
  for (size_t i = 0; i < children_.size(); ++i) s += (i ? ", " : "") + children_[i]->describe();
  return s + ")";
}

Shape Sequential::output_shape(const Shape& input) const {
  Shape s = input;
  for (const auto& child : children_) s = child->output_shape(s);
  return s;
}

std::vector<ParamSpec> Sequential::param_specs() const {
  std::vector<ParamSpec> specs;
  for (const auto& child : children_)
    for (ParamSpec spec : child->param_specs()) {
      spec.name = child->name() + "/" + spec.name;
      specs.push_back(std::move(spec));
    }
  return specs;
}

void Sequential::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  size_t offset = 0;
  for (const auto& child : children_) {
    const size_t n = child->param_specs().size();
    child->bind(params.subspan(offset, n), grads.subspan(offset, n));
    offset += n;
  }
}

Tensor Sequential::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  ctx.children.resize(children_.size());
  Tensor h = x;
  for (size_t i = 0; i < children_.size(); ++i) h = children_[i]->forward(h, ctx.children[i], info);
  return h;
}

Tensor Sequential::backward(const Tensor& dy, Context& ctx) {
  Tensor g = dy;
  for (size_t i = children_.size(); i-- > 0;) g = children_[i]->backward(g, ctx.children[i]);
  ctx.clear();
  return g;
}

int64_t Sequential::flops(const Shape& input) const {
  int64_t total = 0;
  Shape s = input;
  for (const auto& child : children_) {
    total += child->flops(s);
    s = child->output_shape(s);
  }
  return total;
}

void Sequential::set_index(int index) {
  Layer::set_index(index);
  // Children get distinct indices so their random streams differ.
  for (size_t i = 0; i < children_.size(); ++i) children_[i]->set_index(index * 1024 + static_cast<int>(i) + 1);
}

ResidualBlock::ResidualBlock(std::string name, std::vector<LayerPtr> main, std::vector<LayerPtr> shortcut)
    : Layer(std::move(name)), main_("main", std::move(main)), shortcut_("shortcut", std::move(shortcut)) {}

LayerPtr ResidualBlock::basic(std::string name, int64_t in_channels, int64_t out_channels, int64_t stride) {
  std::vector<LayerPtr> main;
  main.push_back(std::make_unique<Conv2d>("conv1", in_channels, out_channels, 3, stride, 1, false));
  main.push_back(std::make_unique<BatchNorm2d>("bn1", out_channels));
  main.push_back(std::make_unique<ActivationLayer>("relu1", Activation::ReLU));
  main.push_back(std::make_unique<Conv2d>("conv2", out_channels, out_channels, 3, 1, 1, false));
  main.push_back(std::make_unique<BatchNorm2d>("bn2", out_channels));
  std::vector<LayerPtr> shortcut;
  if (stride != 1 || in_channels != out_channels) {
    shortcut.push_back(std::make_unique<Conv2d>("conv", in_channels, out_channels, 1, stride, 0, false));
    shortcut.push_back(std::make_unique<BatchNorm2d>("bn", out_channels));
  }
  return std::make_unique<ResidualBlock>(std::move(name), std::move(main), std::move(shortcut));
}

std::string ResidualBlock::describe() const {
  return "residual(" + main_.describe() + (shortcut_.empty() ? "" : " + " + shortcut_.describe()) + ")";
}

Shape ResidualBlock::output_shape(const Shape& input) const {
  const Shape main = main_.output_shape(input);
  const Shape shortcut = shortcut_.output_shape(input);
  STRATA_REQUIRE(main == shortcut, "residual block ", name(), ": main path gives ", shape_str(main),
                 " but shortcut gives ", shape_str(shortcut));
  return main;
}

std::vector<ParamSpec> ResidualBlock::param_specs() const {
  std::vector<ParamSpec> specs = main_.param_specs();
  for (ParamSpec spec : shortcut_.param_specs()) {
    spec.name = "shortcut/" + spec.name;
    specs.push_back(std::move(spec));
  }
  return specs;
}

void ResidualBlock::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  const size_t n = main_.param_specs().size();
  main_.bind(params.first(n), grads.first(n));
  shortcut_.bind(params.subspan(n), grads.subspan(n));
}

Tensor ResidualBlock::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  ctx.children.resize(2);
  const Tensor main = main_.forward(x, ctx.children[0], info);
  const Tensor shortcut = shortcut_.forward(x, ctx.children[1], info);
  Tensor y = Tensor::empty(main.shape(), main.dtype(), main.device());
  ops::add(main, shortcut, y);
  ops::relu_forward(y, y);
  if (info.mode == Mode::Train) ctx.saved = {y};
  return y;
}

Tensor ResidualBlock::backward(const Tensor& dy, Context& ctx) {
  Tensor dsum = Tensor::empty(dy.shape(), dy.dtype(), dy.device());
  ops::relu_backward(ctx.saved.at(0), dy, dsum);
  Tensor dx = main_.backward(dsum, ctx.children[0]);
  const Tensor dx_shortcut = shortcut_.backward(dsum, ctx.children[1]);
  ops::axpy(1.0f, dx_shortcut, dx);
  ctx.clear();
  return dx;
}

int64_t ResidualBlock::flops(const Shape& input) const { return main_.flops(input) + shortcut_.flops(input); }

void ResidualBlock::set_index(int index) {
  Layer::set_index(index);
  main_.set_index(index * 2);
  shortcut_.set_index(index * 2 + 1);
}

}  // namespace strata::layers
