#include "layers/loss.hpp"

#include "core/ops.hpp"

namespace strata::layers {

double SoftmaxCrossEntropy::forward(const Tensor& logits, const Tensor& labels, Context& ctx) const {
  // (B, T, V) logits with (B, T) labels are (B * T) rows of V classes.
  const int64_t classes = logits.shape().back();
  const Tensor rows = logits.ndim() == 2 ? logits : logits.reshape({logits.numel() / classes, classes});
  const Tensor row_labels = labels.ndim() == 1 ? labels : labels.reshape({labels.numel()});
  // Probabilities (and so the logits' gradient) in the logits' dtype: bf16/f16 under mixed
  // precision, where the backward of the layer below expects that dtype.
  Tensor probs = Tensor::empty(rows.shape(), logits.dtype(), logits.device());
  const double loss = ops::softmax_xent_forward(rows, row_labels, probs);
  ctx.saved = {probs, row_labels};
  ctx.input_shape = logits.shape();
  return loss;
}

Tensor SoftmaxCrossEntropy::backward(Context& ctx, float scale) const {
  const Tensor probs = ctx.saved.at(0);
  Tensor dlogits = Tensor::empty(probs.shape(), probs.dtype(), probs.device());
  ops::softmax_xent_backward(probs, ctx.saved.at(1), dlogits, scale);
  if (ctx.input_shape.size() != 2) dlogits = dlogits.reshape(ctx.input_shape);
  ctx.clear();
  return dlogits;
}

}  // namespace strata::layers
