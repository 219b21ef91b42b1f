// Pooling math, written once for ops/cpu/pool.cpp and ops/cuda/dnn.cu (core-private): the
// clipped window of an output position, the outputs whose window covers an input position,
// the average's divisor (padding counts as zeros), and the max and the sum over a window in
// the order and with the tie rule both devices share. STRATA_HD: host and device code. Only
// the loops around them differ: the CPU scatters gradients, the GPU gathers them.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.hpp"
#include "core/ops.hpp"
#include "core/ops/functors.hpp"

namespace strata::ops::pool {

// Input rows [h0, h1) and columns [w0, w1) of one output position's window.
struct Window {
  int64_t h0, h1, w0, w1;
};

struct PoolDims {
  int64_t h, w, oh, ow, kernel, stride, padding;
  explicit PoolDims(const Pool2dGeometry& g)
      : h(g.in_h), w(g.in_w), oh(g.out_h()), ow(g.out_w()), kernel(g.kernel), stride(g.stride), padding(g.padding) {}
  // Input rows (or columns) [lo, hi) of output position o's window, clipped to the image.
  STRATA_HD void window(int64_t o, int64_t in, int64_t& lo, int64_t& hi) const {
    const int64_t start = o * stride - padding;
    lo = start > 0 ? start : 0;
    hi = start + kernel < in ? start + kernel : in;
  }
  STRATA_HD Window window(int64_t out_h, int64_t out_w) const {
    Window win;
    window(out_h, h, win.h0, win.h1);
    window(out_w, w, win.w0, win.w1);
    return win;
  }
  // Outputs [lo, hi] whose window covers input row (or column) i: o * stride - padding <= i
  // < o * stride - padding + kernel.
  STRATA_HD void covering(int64_t i, int64_t out, int64_t& lo, int64_t& hi) const {
    const int64_t first = i + padding - kernel + 1;
    lo = first <= 0 ? 0 : (first + stride - 1) / stride;
    hi = (i + padding) / stride;
    if (hi > out - 1) hi = out - 1;
  }
  // The average's factor: always 1 / kernel^2, padding counted as zeros (count_include_pad).
  STRATA_HD float inv_area() const { return 1.0f / static_cast<float>(kernel * kernel); }
};

// The maximum of `win` in one (h, w-wide) plane and its flat index in the plane, rows then
// columns: the first maximum wins and NaN propagates, as in PyTorch. Selects, not branches.
template <class T>
STRATA_HD inline void window_max(const T* in, int64_t w, const Window& win, float& best, int64_t& best_i) {
  best = -INFINITY;
  best_i = win.h0 * w + win.w0;
  for (int64_t ih = win.h0; ih < win.h1; ++ih) {
    for (int64_t iw = win.w0; iw < win.w1; ++iw) {
      const float v = fn::to_f32(in[ih * w + iw]);
      const bool take = v > best || v != v;
      best = take ? v : best;
      best_i = take ? ih * w + iw : best_i;
    }
  }
}

// The sum of `win` in one plane, in f32, rows then columns.
template <class T>
STRATA_HD inline float window_sum(const T* in, int64_t w, const Window& win) {
  float sum = 0.0f;
  for (int64_t ih = win.h0; ih < win.h1; ++ih)
    for (int64_t iw = win.w0; iw < win.w1; ++iw) sum += fn::to_f32(in[ih * w + iw]);
  return sum;
}

}  // namespace strata::ops::pool
