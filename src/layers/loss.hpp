// Softmax cross-entropy on logits (B, K) and integer labels (B), or on a language model's
// logits (B, T, V) and labels (B, T), taken as B * T rows (the sum is then over tokens).
#pragma once

#include "layers/layer.hpp"

namespace strata::layers {

class SoftmaxCrossEntropy {
 public:
  // Returns the SUM of per-sample losses of this micro-batch; saves what backward needs.
  double forward(const Tensor& logits, const Tensor& labels, Context& ctx) const;
  // dlogits of the loss sum * scale; scale = 1 / global batch gives the mean over the batch
  // however it is split into micro-batches and ranks (1 / (global batch * T): over tokens).
  Tensor backward(Context& ctx, float scale) const;
};

}  // namespace strata::layers
