// Softmax cross-entropy: whole logits through the ops, or a vocabulary slice per tp rank
// (Megatron-LM's parallel cross-entropy) with two small collectives per micro-batch.
#include "layers/loss.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/allocator.hpp"
#include "core/ops.hpp"

namespace strata::layers {

namespace {

// (B, T, V) logits with (B, T) labels are (B * T) rows of V classes.
Tensor as_rows(const Tensor& logits) {
  const int64_t classes = logits.shape().back();
  return logits.ndim() == 2 ? logits : logits.reshape({logits.numel() / classes, classes});
}
Tensor as_row_labels(const Tensor& labels) { return labels.ndim() == 1 ? labels : labels.reshape({labels.numel()}); }

// A host f32 copy (the tensor itself when it already is one). The parallel cross-entropy's
// per-row arithmetic runs on the host: its inputs are (rows x V/T) and the two collectives
// carry 3 floats per row.
Tensor host_f32(const Tensor& t) {
  if (t.device().is_cpu() && t.dtype() == DType::F32) return t;
  Tensor h = Tensor::empty(t.shape());
  ops::copy(t, h);
  return h;
}
// Whether the parallel path's host f32 copies of the logits and probabilities (host_f32, and
// its f32 probabilities and gradient) exist in the run a meta tensor plans: on a CPU device in
// bf16/f16. (A GPU's host copies are not device memory.)
bool planned_host_copies(const Tensor& meta) { return meta_allocator().host_staging() && meta.dtype() != DType::F32; }
Tensor host_labels(const Tensor& t) {
  if (t.device().is_cpu()) return t;
  Tensor h = Tensor::empty(t.shape(), t.dtype());
  ops::copy(t, h);
  return h;
}

// Labels i32 (N) for N rows of a vocabulary of `vocab`; the message ops' check gives.
const int32_t* checked_labels(const Tensor& labels, int64_t rows, int64_t vocab) {
  STRATA_REQUIRE(labels.dtype() == DType::I32 && labels.numel() == rows, "labels must be i32 with one per row (", rows,
                 "), found ", labels.str());
  const int32_t* lab = labels.data<int32_t>();
  for (int64_t r = 0; r < rows; ++r)
    STRATA_REQUIRE(lab[r] >= 0 && lab[r] < vocab, "label ", lab[r], " of sample ", r, " is outside [0, ", vocab, ")");
  return lab;
}

// Each row's maximum over the whole vocabulary: the ranks' row maxima all-gathered (N floats
// each; a maximum is exact in any order, so every rank gets the same bits). Also returns, per
// row, the lowest rank holding that maximum (argmax ties go to the lowest index).
std::vector<float> global_max(TensorParallelGroup& tp, const float* x, int64_t rows, int64_t cols,
                              std::vector<int>* owner = nullptr) {
  Tensor local = Tensor::empty({rows});
  float* m = local.data<float>();
  for (int64_t r = 0; r < rows; ++r) m[r] = *std::max_element(x + r * cols, x + (r + 1) * cols);
  Tensor all = Tensor::empty({tp.size(), rows});
  tp.all_gather(local, all);
  const float* a = all.data<float>();
  std::vector<float> mx(a, a + rows);
  if (owner) owner->assign(static_cast<size_t>(rows), 0);
  for (int k = 1; k < tp.size(); ++k)
    for (int64_t r = 0; r < rows; ++r)
      if (a[k * rows + r] > mx[r]) {
        mx[r] = a[k * rows + r];
        if (owner) (*owner)[r] = k;
      }
  return mx;
}

}  // namespace

SoftmaxCrossEntropy::SoftmaxCrossEntropy(TensorParallelGroup* tp)
    : tp_(tp != nullptr && tp->size() > 1 ? tp : nullptr) {}

double SoftmaxCrossEntropy::forward(const Tensor& logits, const Tensor& labels, Context& ctx) const {
  const Tensor rows = as_rows(logits);
  const Tensor row_labels = as_row_labels(labels);
  // Probabilities (and so the logits' gradient) in the logits' dtype: bf16/f16 under mixed
  // precision, where the backward of the layer below expects that dtype.
  Tensor probs = Tensor::empty(rows.shape(), logits.dtype(), logits.device());
  ctx.saved = {probs, row_labels};
  ctx.input_shape = logits.shape();
  if (!tp_) return ops::softmax_xent_forward(rows, row_labels, probs);
  if (rows.device().is_meta()) {  // planned (parallel::plan_activations): the host f32 copies below
    if (planned_host_copies(rows)) {
      const Tensor x_host = Tensor::empty(rows.shape(), DType::F32, Device::meta());
      const Tensor p_host = Tensor::empty(rows.shape(), DType::F32, Device::meta());
    }
    return 0;
  }

  const int64_t n = rows.dim(0), cols = rows.dim(1), first = tp_->rank() * cols;
  const Tensor x_host = host_f32(rows), lab_host = host_labels(row_labels);
  const int32_t* lab = checked_labels(lab_host, n, cols * tp_->size());
  const float* x = x_host.data<float>();
  const std::vector<float> mx = global_max(*tp_, x, n, cols);
  // Per row: this slice's sum of exp(x - max) and the target logit if this slice holds it
  // (0 elsewhere); one all-reduce gives the row's sum and its target logit on every rank.
  // On the host in f32, probs itself is written: no second (rows x V/T) buffer.
  const bool in_place = probs.device().is_cpu() && probs.dtype() == DType::F32;
  Tensor p_host = in_place ? probs : Tensor::empty({n, cols});
  Tensor sums = Tensor::empty({n, 2});
  float* p = p_host.data<float>();
  float* s = sums.data<float>();
  for (int64_t r = 0; r < n; ++r) {
    float sum = 0.0f;
    for (int64_t j = 0; j < cols; ++j) {
      p[r * cols + j] = std::exp(x[r * cols + j] - mx[r]);
      sum += p[r * cols + j];
    }
    const int64_t j = lab[r] - first;
    s[2 * r] = sum;
    s[2 * r + 1] = j >= 0 && j < cols ? x[r * cols + j] : 0.0f;
  }
  tp_->all_reduce_sum(sums);
  double total = 0.0;
  for (int64_t r = 0; r < n; ++r) {
    const float inv = 1.0f / s[2 * r];
    for (int64_t j = 0; j < cols; ++j) p[r * cols + j] *= inv;
    // -log softmax[label] = log(sum) - (x[label] - max), as ops::softmax_xent_forward.
    total += std::log(static_cast<double>(s[2 * r])) - (static_cast<double>(s[2 * r + 1]) - static_cast<double>(mx[r]));
  }
  if (!in_place) ops::copy(p_host, probs);
  ctx.saved[1] = lab_host;
  return total;
}

Tensor SoftmaxCrossEntropy::backward(Context& ctx, float scale) const {
  const Tensor probs = ctx.saved.at(0);
  Tensor dlogits = Tensor::empty(probs.shape(), probs.dtype(), probs.device());
  if (!tp_) {
    ops::softmax_xent_backward(probs, ctx.saved.at(1), dlogits, scale);
  } else if (probs.device().is_meta()) {  // planned: the host f32 copy below
    if (planned_host_copies(probs)) Tensor::empty(probs.shape(), DType::F32, Device::meta());
  } else {
    // softmax - onehot on this slice: the label's column only on the rank that holds it.
    const int64_t n = probs.dim(0), cols = probs.dim(1), first = tp_->rank() * cols;
    const bool in_place = dlogits.device().is_cpu() && dlogits.dtype() == DType::F32;
    Tensor d = in_place ? dlogits : Tensor::empty(probs.shape());
    ops::copy(probs, d);
    float* g = d.data<float>();
    const int32_t* lab = ctx.saved.at(1).data<int32_t>();
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < cols; ++j) g[r * cols + j] *= scale;
      const int64_t j = lab[r] - first;
      if (j >= 0 && j < cols) g[r * cols + j] -= scale;
    }
    if (!in_place) ops::copy(d, dlogits);
  }
  if (ctx.input_shape.size() != 2) dlogits = dlogits.reshape(ctx.input_shape);
  ctx.clear();
  return dlogits;
}

int64_t SoftmaxCrossEntropy::count_correct(const Tensor& logits, const Tensor& labels) const {
  const Tensor rows = as_rows(logits);
  const Tensor row_labels = as_row_labels(labels);
  if (!tp_) return ops::count_correct(rows, row_labels);
  const int64_t n = rows.dim(0), cols = rows.dim(1), first = tp_->rank() * cols;
  const Tensor x_host = host_f32(rows), lab_host = host_labels(row_labels);
  const int32_t* lab = checked_labels(lab_host, n, cols * tp_->size());
  const float* x = x_host.data<float>();
  // The row's argmax is on the lowest rank holding its maximum, at that rank's first maximum;
  // that rank alone counts the row, and the counts are summed.
  std::vector<int> owner;
  global_max(*tp_, x, n, cols, &owner);
  Tensor count = Tensor::zeros({1}, DType::I32);
  int32_t& mine = count.data<int32_t>()[0];
  for (int64_t r = 0; r < n; ++r) {
    if (owner[r] != tp_->rank()) continue;
    const float* in = x + r * cols;
    const int64_t best = std::max_element(in, in + cols) - in;  // the first maximum
    mine += first + best == lab[r];
  }
  tp_->all_reduce_sum(count);
  return count.data<int32_t>()[0];
}

}  // namespace strata::layers
