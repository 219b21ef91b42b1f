// Sequential and residual composites.
#include "layers/composite.hpp"

#include "core/ops.hpp"
#include "layers/basic.hpp"

namespace strata::layers {

void ChildGradients::add(Layer& child) {
  const size_t first =
      children_.empty() ? 0 : children_.back().first_param + children_.back().layer->param_specs().size();
  children_.push_back({&child, first, {}});
}

void ChildGradients::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  for (Child& c : children_) {
    const size_t n = c.layer->param_specs().size();
    c.layer->bind(params.subspan(c.first_param, n), grads.subspan(c.first_param, n));
    c.params.assign(params.begin() + static_cast<std::ptrdiff_t>(c.first_param),
                    params.begin() + static_cast<std::ptrdiff_t>(c.first_param + n));
  }
}

std::vector<GradientPiece> ChildGradients::pieces(int64_t max_elements) const {
  std::vector<ParamSpec> specs;  // the composite's
  for (const Child& c : children_)
    for (ParamSpec& spec : c.layer->param_specs()) specs.push_back(std::move(spec));
  const TrainableLayout layout = trainable_layout(specs);
  if (layout.size <= max_elements) return {};
  std::vector<GradientPiece> pieces;
  for (size_t k = children_.size(); k-- > 0;) {
    const Child& c = children_[k];
    const TrainableLayout own = trainable_layout(c.layer->param_specs());
    if (own.size == 0) continue;
    int64_t begin = 0;  // where the child's first trainable parameter is in the composite's layout
    for (size_t i = 0; i < own.offsets.size(); ++i)
      if (own.offsets[i] == 0) begin = layout.offsets[c.first_param + i];
    const std::vector<GradientPiece> inner = c.layer->gradient_pieces(max_elements);
    if (inner.empty()) pieces.push_back({begin, begin + own.size});
    for (const GradientPiece& p : inner) pieces.push_back({begin + p.begin, begin + p.end});
  }
  return pieces;
}

Tensor ChildGradients::backward(const Layer& composite, Layer& child, const std::function<Tensor()>& backward) {
  GradientSink* sink = composite.gradient_sink();
  if (sink == nullptr) return backward();
  const std::vector<ParamSpec> specs = child.param_specs();
  const TrainableLayout own = trainable_layout(specs);
  if (own.size == 0) return backward();
  // Pieces go down the layout: the children with parameters run last first, once each.
  const auto with_params = [&](size_t below) {
    for (size_t k = below; k-- > 0;)
      if (trainable_layout(children_[k].layer->param_specs()).size > 0) return k;
    return SIZE_MAX;
  };
  if (next_ == SIZE_MAX) next_ = with_params(children_.size());
  Child& c = children_.at(next_);
  STRATA_CHECK(c.layer == &child, "layer ", composite.name(), ": the backward of ", child.name(),
               " ran before that of ", c.layer->name(), ", whose gradients come first");
  next_ = with_params(next_);

  const int64_t limit = composite.gradient_piece_limit();
  if (!child.gradient_pieces(limit).empty()) {  // it writes its own pieces through the sink
    struct Unset {
      Layer& layer;
      ~Unset() { layer.set_gradient_sink(nullptr, 0); }
    } unset{child};
    child.set_gradient_sink(sink, limit);
    return backward();
  }
  const Tensor piece = sink->next_piece();
  STRATA_CHECK(piece.numel() == own.size, "layer ", child.name(), ": a gradient piece of ", piece.numel(),
               " elements for its ", own.size);
  std::vector<Tensor> grads;
  for (size_t i = 0; i < specs.size(); ++i)
    grads.push_back(specs[i].trainable ? piece.view(own.offsets[i], specs[i].shape) : Tensor());
  child.bind(c.params, grads);
  Tensor dx = backward();
  sink->piece_written();
  return dx;
}

Sequential::Sequential(std::string name, std::vector<LayerPtr> children)
    : Layer(std::move(name)), children_(std::move(children)) {
  for (const LayerPtr& child : children_) gradients_.add(*child);
}

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

void Sequential::bind(std::span<const Tensor> params, std::span<const Tensor> grads) { gradients_.bind(params, grads); }

std::vector<GradientPiece> Sequential::gradient_pieces(int64_t max_elements) const {
  return gradients_.pieces(max_elements);
}

Tensor Sequential::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  ctx.children.resize(children_.size());
  Tensor h = x;
  for (size_t i = 0; i < children_.size(); ++i) h = children_[i]->forward(h, ctx.children[i], info);
  return h;
}

Tensor Sequential::backward(const Tensor& dy, Context& ctx) {
  Tensor g = dy;
  for (size_t i = children_.size(); i-- > 0;)
    g = gradients_.backward(*this, *children_[i], [&] { return children_[i]->backward(g, ctx.children[i]); });
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
    : Layer(std::move(name)), main_("main", std::move(main)), shortcut_("shortcut", std::move(shortcut)) {
  gradients_.add(main_);
  gradients_.add(shortcut_);
}

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
  gradients_.bind(params, grads);
}

std::vector<GradientPiece> ResidualBlock::gradient_pieces(int64_t max_elements) const {
  return gradients_.pieces(max_elements);
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
  // The shortcut first: its parameters come after the main path's (streamed gradients go down).
  const Tensor dx_shortcut =
      gradients_.backward(*this, shortcut_, [&] { return shortcut_.backward(dsum, ctx.children[1]); });
  Tensor dx = gradients_.backward(*this, main_, [&] { return main_.backward(dsum, ctx.children[0]); });
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
