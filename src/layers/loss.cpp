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

// t on the host (t itself when it is there, or on meta, where the planner runs), and back on a
// device. The collectives carry a few floats per row, on the host as the labels' checks.
Tensor on_host(const Tensor& t) {
  if (t.device().is_cpu() || t.device().is_meta()) return t;
  Tensor h = Tensor::empty(t.shape(), t.dtype());
  ops::copy(t, h);
  return h;
}
Tensor on_device(const Tensor& host, Device device) {
  if (device.is_cpu() || host.device() == device) return host;
  Tensor d = Tensor::empty(host.shape(), host.dtype(), device);
  ops::copy(host, d);
  return d;
}

// Labels i32 (N) for N rows of a vocabulary of `vocab`; the message ops' check gives.
void check_labels(const Tensor& labels, int64_t rows, int64_t vocab) {
  STRATA_REQUIRE(labels.dtype() == DType::I32 && labels.numel() == rows, "labels must be i32 with one per row (", rows,
                 "), found ", labels.str());
  const int32_t* lab = labels.data<int32_t>();
  for (int64_t r = 0; r < rows; ++r)
    STRATA_REQUIRE(lab[r] >= 0 && lab[r] < vocab, "label ", lab[r], " of sample ", r, " is outside [0, ", vocab, ")");
}

// Each row's maximum over the whole vocabulary, on the host: the ranks' row maxima
// (ops::row_max of their slices) all-gathered, N floats each (a maximum is exact in any order,
// so every rank gets the same bits). owner, where given: per row, the lowest rank holding that
// maximum (argmax ties go to the lowest index); argmax: this slice's first maximum's column.
Tensor global_max(TensorParallelGroup& tp, const Tensor& x, std::vector<int>* owner = nullptr,
                  const Tensor& argmax = {}) {
  const int64_t rows = x.dim(0);
  const Tensor local = Tensor::empty({rows}, DType::F32, x.device());
  ops::row_max(x, local, argmax);
  const Tensor local_host = on_host(local);
  const Tensor all = Tensor::empty({tp.size(), rows}, DType::F32, local_host.device());
  tp.all_gather(local_host, all);
  if (x.device().is_meta()) return Tensor::empty({rows}, DType::F32, x.device());
  const float* a = all.data<float>();
  Tensor mx = Tensor::empty({rows});
  float* m = mx.data<float>();
  if (owner) owner->assign(static_cast<size_t>(rows), 0);
  for (int64_t r = 0; r < rows; ++r) {
    m[r] = a[r];
    for (int k = 1; k < tp.size(); ++k)
      if (a[k * rows + r] > m[r]) {
        m[r] = a[k * rows + r];
        if (owner) (*owner)[static_cast<size_t>(r)] = k;
      }
  }
  return mx;
}

}  // namespace

SoftmaxCrossEntropy::SoftmaxCrossEntropy(TensorParallelGroup* tp)
    : tp_(tp != nullptr && tp->size() > 1 ? tp : nullptr) {}

int64_t SoftmaxCrossEntropy::first_class(int64_t cols) const { return tp_ ? tp_->rank() * cols : 0; }
int64_t SoftmaxCrossEntropy::vocab(int64_t cols) const { return tp_ ? tp_->size() * cols : cols; }

double SoftmaxCrossEntropy::forward(const Tensor& logits, const Tensor& labels, Context& ctx) const {
  const Tensor rows = as_rows(logits);
  const Tensor row_labels = as_row_labels(labels);
  // Probabilities (and so the logits' gradient) in the logits' dtype: bf16/f16 under mixed
  // precision, where the backward of the layer below expects that dtype.
  Tensor probs = Tensor::empty(rows.shape(), logits.dtype(), logits.device());
  ctx.saved = {probs, row_labels};
  ctx.input_shape = logits.shape();
  if (!tp_) return ops::softmax_xent_forward(rows, row_labels, probs);

  // Megatron's parallel cross-entropy: the row maxima all-gathered, then per row this slice's
  // sum of exp(x - max) and the target logit where this slice holds it (0 elsewhere), summed by
  // one all-reduce; each rank then writes its slice of the probabilities.
  const int64_t n = rows.dim(0), cols = rows.dim(1);
  const Device device = rows.device();
  if (!device.is_meta()) check_labels(on_host(row_labels), n, vocab(cols));
  const Tensor mx_host = global_max(*tp_, rows);
  const Tensor mx = on_device(mx_host, device);
  const Tensor stats = Tensor::empty({n, 2}, DType::F32, device);
  ops::softmax_slice_stats(rows, row_labels, first_class(cols), vocab(cols), mx, stats);
  const Tensor stats_host = on_host(stats);
  tp_->all_reduce_sum(stats_host);
  ops::softmax_slice(rows, mx, on_device(stats_host, device), probs);
  if (device.is_meta()) return 0;
  const float* s = stats_host.data<float>();
  const float* m = mx_host.data<float>();
  double total = 0.0;
  for (int64_t r = 0; r < n; ++r)  // -log softmax[label] = log(sum) - (x[label] - max), as without tp
    total += std::log(static_cast<double>(s[2 * r])) - (static_cast<double>(s[2 * r + 1]) - static_cast<double>(m[r]));
  return total;
}

Tensor SoftmaxCrossEntropy::backward(Context& ctx, float scale) const {
  const Tensor probs = ctx.saved.at(0);
  Tensor dlogits = Tensor::empty(probs.shape(), probs.dtype(), probs.device());
  const int64_t cols = probs.dim(1);  // softmax - onehot, the label's column on the slice holding it
  ops::softmax_xent_backward(probs, ctx.saved.at(1), dlogits, scale, first_class(cols), vocab(cols));
  if (ctx.input_shape.size() != 2) dlogits = dlogits.reshape(ctx.input_shape);
  ctx.clear();
  return dlogits;
}

int64_t SoftmaxCrossEntropy::count_correct(const Tensor& logits, const Tensor& labels) const {
  const Tensor rows = as_rows(logits);
  const Tensor row_labels = as_row_labels(labels);
  if (!tp_) return ops::count_correct(rows, row_labels);
  const int64_t n = rows.dim(0), cols = rows.dim(1), first = first_class(cols);
  const Tensor lab_host = on_host(row_labels);
  check_labels(lab_host, n, vocab(cols));
  // The row's argmax is on the lowest rank holding its maximum, at that rank's first maximum;
  // that rank alone counts the row, and the counts are summed.
  std::vector<int> owner;
  const Tensor argmax = Tensor::empty({n}, DType::I32, rows.device());
  global_max(*tp_, rows, &owner, argmax);
  const Tensor argmax_host = on_host(argmax);
  const int32_t* at = argmax_host.data<int32_t>();
  const int32_t* lab = lab_host.data<int32_t>();
  Tensor count = Tensor::zeros({1}, DType::I32);
  int32_t& mine = count.data<int32_t>()[0];
  for (int64_t r = 0; r < n; ++r) mine += owner[static_cast<size_t>(r)] == tp_->rank() && first + at[r] == lab[r];
  tp_->all_reduce_sum(count);
  return count.data<int32_t>()[0];
}

}  // namespace strata::layers
