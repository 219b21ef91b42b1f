// Model: shape inference, forward/backward over a range of layers, the summary.
#include "layers/model.hpp"

#include <algorithm>
#include <sstream>

#include "core/trace.hpp"

namespace strata::layers {

Model::Model(std::vector<LayerPtr> layers, Shape input_shape, int num_classes, TensorParallelGroup* tp)
    : layers_(std::move(layers)), num_classes_(num_classes), tp_(tp != nullptr && tp->size() > 1 ? tp : nullptr) {
  shapes_.push_back(std::move(input_shape));
  for (size_t i = 0; i < layers_.size(); ++i) {
    layers_[i]->set_index(static_cast<int>(i));
    shapes_.push_back(layers_[i]->output_shape(shapes_.back()));
    const std::vector<ParamSpec> specs = layers_[i]->param_specs();
    trainable_.push_back(std::any_of(specs.begin(), specs.end(), [](const ParamSpec& s) { return s.trainable; }));
  }
  // A classifier's output is (K); a language model's (T, V), its classes the vocabulary; with
  // tp, this rank's slice (T, ceil(V / T)) (the last slices padded).
  const Shape& out = shapes_.back();
  const bool sequence = !shapes_.front().empty() && out.size() == 2 && out[0] == shapes_.front()[0];
  if (tp_) {
    const int64_t slice = rows_per_piece(num_classes, tp_->size());
    STRATA_REQUIRE(sequence && out[1] == slice, "the tensor-parallel model's output shape is ", shape_str(out),
                   " but a vocabulary slice of ", num_classes, " tokens over --tp ", tp_->size(), " needs [",
                   shapes_.front().empty() ? 0 : shapes_.front()[0], ", ", slice, "]");
    return;
  }
  STRATA_REQUIRE(out == Shape{num_classes} || (sequence && out[1] == num_classes), "the model's output shape is ",
                 shape_str(out), " but the dataset has ", num_classes, " classes");
}

std::string Model::summary() const {
  std::ostringstream os;
  int64_t total = 0;
  // A run of layers alike (a 48-block GPT's blocks) is one line: "1-48  h0..h47 (x48)  ...".
  for (size_t i = 0; i < layers_.size();) {
    int64_t params = 0;
    for (const ParamSpec& s : layers_[i]->param_specs())
      if (s.trainable) params += shape_numel(s.shape);
    const std::string what =
        detail::cat(layers_[i]->describe(), "  ", shape_str(shapes_[i]), " -> ", shape_str(shapes_[i + 1]));
    size_t end = i + 1;
    while (end < layers_.size() && shapes_[end] == shapes_[i] && shapes_[end + 1] == shapes_[i + 1] &&
           layers_[end]->describe() == layers_[i]->describe())
      ++end;
    const size_t n = end - i;
    total += params * static_cast<int64_t>(n);
    if (n == 1)
      os << "  " << i << "  " << layers_[i]->name() << "  " << what << "  params " << params << "\n";
    else
      os << "  " << i << "-" << end - 1 << "  " << layers_[i]->name() << ".." << layers_[end - 1]->name() << " (x" << n
         << ")  " << what << "  params " << params << " each\n";
    i = end;
  }
  os << "  total trainable parameters: " << total;
  return os.str();
}

Tensor Model::forward(const Tensor& x, std::vector<Context>& ctx, const StepInfo& info, size_t begin,
                      size_t end) const {
  end = std::min(end, layers_.size());
  ctx.resize(layers_.size());
  Tensor h = x;
  for (size_t i = begin; i < end; ++i) {
    const trace::Span span(trace::Track::Compute, layers_[i]->name());
    h = layers_[i]->forward(h, ctx[i], info);
  }
  return h;
}

Tensor Model::backward(const Tensor& dy, std::vector<Context>& ctx, size_t begin, size_t end,
                       const std::function<void(size_t)>& after_layer, bool input_grad) const {
  end = std::min(end, layers_.size());
  // Without input_grad, nothing below the lowest layer with parameters needs a gradient.
  size_t stop = begin;
  if (!input_grad) {
    stop = end;
    for (size_t i = begin; i < end && stop == end; ++i)
      if (trainable_[i]) stop = i;
  }
  Tensor g = dy;
  for (size_t i = end; i-- > stop;) {
    ctx[i].input_grad = input_grad || i > stop;
    {
      const trace::Span span(trace::Track::Compute, layers_[i]->name());
      g = layers_[i]->backward(g, ctx[i]);
    }
    if (after_layer) after_layer(i);
  }
  for (size_t i = begin; i < stop; ++i) ctx[i].clear();
  return input_grad ? g : Tensor();
}

}  // namespace strata::layers
