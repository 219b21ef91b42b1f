// Softmax cross-entropy on logits (B, K) and integer labels (B), or on a language model's
// logits (B, T, V) and labels (B, T), taken as B * T rows (the sum is then over tokens).
// Vocabulary-parallel (Megatron-LM's parallel cross-entropy): with a tensor-parallel group of
// T > 1 ranks, rank r holds columns [r V/T, (r+1) V/T) of the logits and the full logits are
// never formed: the row maxima are all-gathered, then one all-reduce sums each row's
// sum exp(x - max) and its target logit (held by one rank); the ops (ops::row_max,
// softmax_slice_stats, softmax_slice) stage bf16 logits a row at a time, as the whole loss's do.
#pragma once

#include "layers/layer.hpp"

namespace strata::layers {

class SoftmaxCrossEntropy {
 public:
  // tp: the group the logits' vocabulary is split over (the LMHead's); null or size 1: whole
  // logits, exactly today's computation.
  explicit SoftmaxCrossEntropy(TensorParallelGroup* tp = nullptr);
  // Returns the SUM of per-sample losses of this micro-batch (the same value on every tp
  // rank); saves what backward needs. Labels index the full vocabulary (checked against it).
  double forward(const Tensor& logits, const Tensor& labels, Context& ctx) const;
  // dlogits of the loss sum * scale; scale = 1 / global batch gives the mean over the batch
  // however it is split into micro-batches and ranks (1 / (global batch * T): over tokens).
  // With tp: this rank's columns (softmax - onehot on its slice).
  Tensor backward(Context& ctx, float scale) const;
  // Rows whose argmax over the full vocabulary equals the label (ties: the lowest index, as
  // ops::count_correct); the same count on every tp rank. logits as forward's.
  int64_t count_correct(const Tensor& logits, const Tensor& labels) const;

 private:
  // The class of this rank's first column, and the whole vocabulary, for logits of `cols` columns.
  int64_t first_class(int64_t cols) const;
  int64_t vocab(int64_t cols) const;

  TensorParallelGroup* tp_;
};

}  // namespace strata::layers
