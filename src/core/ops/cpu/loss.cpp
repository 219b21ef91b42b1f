// CPU softmax cross-entropy (numerically stable, returns the SUM of per-sample losses) and
// accuracy counting. Rows are samples, columns classes; any float dtypes, computed in f32.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/ops/cpu/cpu_ops.hpp"

namespace strata::ops::cpu {

namespace {
int32_t checked_label(const int32_t* labels, int64_t r, int64_t k) {
  const int32_t l = labels[r];
  STRATA_REQUIRE(l >= 0 && l < k, "label ", l, " of sample ", r, " is outside [0, ", k, ")");
  return l;
}

// Every label in order, before any parallel loop: an exception must not leave an OpenMP region.
void check_labels(const int32_t* labels, int64_t n, int64_t k) {
  for (int64_t r = 0; r < n; ++r) checked_label(labels, r, k);
}
}  // namespace

// logits and probs (N, K) of any float dtypes; labels (N). Rows of bf16/f16 are staged in f32
// one at a time (f32_row), so a language model's (B * T, V) logits are never widened whole.
double softmax_xent_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs) {
  const int64_t n = logits.dim(0), k = logits.dim(1);
  const int32_t* lab = labels.data<int32_t>();
  check_labels(lab, n, k);
  // Rows in parallel (a language model has B * T rows of the vocabulary); each row's loss is
  // kept and the total summed in row order afterwards, so it does not depend on the threads.
  std::vector<double> row_loss(static_cast<size_t>(n));
  parallel_rows(n, k, [&](int64_t r) {
    thread_local std::vector<float> in_row, out_row;
    const float* in = f32_row(logits, r * k, k, in_row);
    float* out = f32_out_row(probs, r * k, k, out_row);
    // With a NaN logit the row's probabilities and loss are NaN whatever max_of returns.
    const float mx = max_of(in, k);
    const float sum = exp_and_sum(in, out, k, mx);  // at the CPU's vector width
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < k; ++j) out[j] *= inv;
    store_row(out, probs, r * k, k);
    // -log softmax[label] = log(sum) - (x[label] - max)
    row_loss[static_cast<size_t>(r)] =
        std::log(static_cast<double>(sum)) - (static_cast<double>(in[lab[r]]) - static_cast<double>(mx));
  });
  double total = 0.0;
  for (const double l : row_loss) total += l;
  return total;
}

void softmax_xent_backward(const Tensor& probs, const Tensor& labels, const Tensor& dlogits, float scale, int64_t first,
                           int64_t vocab) {
  const int64_t n = probs.dim(0), k = probs.dim(1);
  const int32_t* lab = labels.data<int32_t>();
  check_labels(lab, n, vocab);
  parallel_rows(n, k, [&](int64_t r) {
    thread_local std::vector<float> in_row, out_row;
    const float* p = f32_row(probs, r * k, k, in_row);
    float* d = f32_out_row(dlogits, r * k, k, out_row);
    for (int64_t j = 0; j < k; ++j) d[j] = p[j] * scale;
    const int64_t j = lab[r] - first;
    if (j >= 0 && j < k) d[j] -= scale;
    store_row(d, dlogits, r * k, k);
  });
}

// ---- the vocabulary-parallel pieces: rows staged in f32 one at a time, as above -------------

void row_max(const Tensor& x, const Tensor& mx, const Tensor& argmax) {
  const int64_t n = x.dim(0), k = x.dim(1);
  float* m = mx.data<float>();
  int32_t* at = argmax.defined() ? argmax.data<int32_t>() : nullptr;
  parallel_rows(n, k, [&](int64_t r) {
    thread_local std::vector<float> row;
    const float* in = f32_row(x, r * k, k, row);
    const float best = max_of(in, k);
    m[r] = best;
    if (at) at[r] = static_cast<int32_t>(std::find(in, in + k, best) - in);  // the first maximum
  });
}

void softmax_slice_stats(const Tensor& x, const Tensor& labels, int64_t first, int64_t vocab, const Tensor& mx,
                         const Tensor& stats) {
  const int64_t n = x.dim(0), k = x.dim(1);
  const int32_t* lab = labels.data<int32_t>();
  check_labels(lab, n, vocab);
  const float* m = mx.data<float>();
  float* s = stats.data<float>();
  parallel_rows(n, k, [&](int64_t r) {
    thread_local std::vector<float> in_row, exp_row;
    const float* in = f32_row(x, r * k, k, in_row);
    exp_row.resize(static_cast<size_t>(k));
    const int64_t j = lab[r] - first;
    s[2 * r] = exp_and_sum(in, exp_row.data(), k, m[r]);
    s[2 * r + 1] = j >= 0 && j < k ? in[j] : 0.0f;
  });
}

void softmax_slice(const Tensor& x, const Tensor& mx, const Tensor& stats, const Tensor& probs) {
  const int64_t n = x.dim(0), k = x.dim(1);
  const float* m = mx.data<float>();
  const float* s = stats.data<float>();
  parallel_rows(n, k, [&](int64_t r) {
    thread_local std::vector<float> in_row, out_row;
    const float* in = f32_row(x, r * k, k, in_row);
    float* out = f32_out_row(probs, r * k, k, out_row);
    exp_and_sum(in, out, k, m[r]);  // the exponentials the row's sum was made of
    const float inv = 1.0f / s[2 * r];
    for (int64_t j = 0; j < k; ++j) out[j] *= inv;
    store_row(out, probs, r * k, k);
  });
}

int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  const int64_t n = logits.dim(0), k = logits.dim(1);
  const int32_t* lab = labels.data<int32_t>();
  std::vector<float> row;
  int64_t correct = 0;
  for (int64_t r = 0; r < n; ++r) {
    const float* in = f32_row(logits, r * k, k, row);
    int64_t best = 0;  // first maximum, as torch.argmax
    for (int64_t j = 1; j < k; ++j)
      if (in[j] > in[best]) best = j;
    correct += best == lab[r];
  }
  return correct;
}

}  // namespace strata::ops::cpu
