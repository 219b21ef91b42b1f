#include "layers/loss.hpp"

#include "core/ops.hpp"

namespace strata::layers {

double SoftmaxCrossEntropy::forward(const Tensor& logits, const Tensor& labels, Context& ctx) const {
  // Probabilities (and so the logits' gradient) in the logits' dtype: bf16/f16 under mixed
  // precision, where the backward of the layer below expects that dtype.
  Tensor probs = Tensor::empty(logits.shape(), logits.dtype(), logits.device());
  const double loss = ops::softmax_xent_forward(logits, labels, probs);
  ctx.saved = {probs, labels};
  return loss;
}

Tensor SoftmaxCrossEntropy::backward(Context& ctx, float scale) const {
  const Tensor probs = ctx.saved.at(0);
  Tensor dlogits = Tensor::empty(probs.shape(), probs.dtype(), probs.device());
  ops::softmax_xent_backward(probs, ctx.saved.at(1), dlogits, scale);
  ctx.clear();
  return dlogits;
}

}  // namespace strata::layers
