// CPU 2-D convolution: im2col + OpenBLAS GEMM, one sample at a time. Measured on the CNN
// benchmark (batch 64, 1 thread), per-sample GEMMs beat batching samples into one wide column
// matrix by 1.1-2.4x: the wide matrix falls out of cache and needs a (N,O)<->(O,N) reshuffle of
// y and dy. Backward: dW += dY_n @ col_n^T, dcol = W^T @ dY_n, then col2im. 1x1 convolutions
// with stride 1 and no padding use the sample itself as the column matrix.

#include <algorithm>
#include <cstring>

#include "core/ops/cpu/cpu_ops.hpp"

namespace strata::ops::cpu {

namespace {

// First and one-past-last output column whose input column ow*stride - pad + k lies in
// [0, in): outside it the image is padding.
inline void valid_range(int64_t in, int64_t out, int64_t stride, int64_t pad, int64_t k, int64_t& lo, int64_t& hi) {
  const int64_t off = k - pad;  // input index = o * stride + off
  lo = off >= 0 ? 0 : (-off + stride - 1) / stride;
  hi = in - off <= 0 ? 0 : (in - off - 1) / stride + 1;
  hi = std::min(hi, out);
  lo = std::min(lo, hi);
}

// Stride 1 and OW == W: column row (kh, kw) of a plane is the plane shifted by
// off = (kh - p) * W + (kw - p), except rows that fall into the vertical padding and columns
// outside [lo, hi) (horizontal padding, where the shift wraps into the neighbouring row).
// That turns OH short copies into one long one plus a fix-up of the border columns.
template <bool kToCol>
void unfold_same_width(float* plane, float* crow, const Conv2dGeometry& g, int64_t kh, int64_t kw, int64_t lo,
                       int64_t hi) {
  const int64_t h = g.in_h, w = g.in_w, p = g.padding, oh_n = g.out_h(), ohw = oh_n * w;
  const int64_t off = (kh - p) * w + (kw - p);
  const int64_t oh_lo = std::clamp<int64_t>(p - kh, 0, oh_n), oh_hi = std::clamp<int64_t>(h + p - kh, oh_lo, oh_n);
  // Shifted indices must stay inside the plane; what the clip drops is border columns anyway.
  const int64_t i0 = std::max(oh_lo * w, -off), i1 = std::max(i0, std::min(oh_hi * w, h * w - off));
  auto zero_borders = [&] {
    for (int64_t oh = oh_lo; oh < oh_hi; ++oh) {
      for (int64_t ow = 0; ow < lo; ++ow) crow[oh * w + ow] = 0.0f;
      for (int64_t ow = hi; ow < w; ++ow) crow[oh * w + ow] = 0.0f;
    }
  };
  if constexpr (kToCol) {
    std::fill(crow, crow + i0, 0.0f);
    std::memcpy(crow + i0, plane + i0 + off, static_cast<size_t>(i1 - i0) * sizeof(float));
    std::fill(crow + i1, crow + ohw, 0.0f);
    zero_borders();
  } else {
    zero_borders();  // crow is scratch (dcol): padding positions must not be added
    for (int64_t i = i0; i < i1; ++i) plane[i + off] += crow[i];
  }
}

// kToCol: col (C*KH*KW rows of length ld, this sample's columns at offset 0) = unfold(x).
// Otherwise col2im: x (C, H, W) += fold(col). One routine so the index math exists once.
template <bool kToCol>
void unfold(float* x, float* col, int64_t ld, const Conv2dGeometry& g) {
  const int64_t oh_n = g.out_h(), ow_n = g.out_w(), h = g.in_h, w = g.in_w, s = g.stride, p = g.padding;
  const int64_t rows = g.in_channels * g.kernel_h * g.kernel_w;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t kw = r % g.kernel_w, kh = (r / g.kernel_w) % g.kernel_h, c = r / (g.kernel_w * g.kernel_h);
    int64_t lo, hi;
    valid_range(w, ow_n, s, p, kw, lo, hi);
    float* plane = x + c * h * w;
    float* crow = col + r * ld;
    if (s == 1 && ow_n == w) {  // "same" width (3x3 pad 1, ...): one long shifted copy per row
      unfold_same_width<kToCol>(plane, crow, g, kh, kw, lo, hi);
      continue;
    }
    for (int64_t oh = 0; oh < oh_n; ++oh) {
      float* dst = crow + oh * ow_n;  // (OW) slice of the column row
      const int64_t ih = oh * s - p + kh;
      if (ih < 0 || ih >= h) {
        if constexpr (kToCol) std::memset(dst, 0, static_cast<size_t>(ow_n) * sizeof(float));
        continue;
      }
      float* row = plane + ih * w;
      const int64_t off = kw - p;  // row[ow * s + off] is what output column ow sees
      if constexpr (kToCol) {
        // Rows are short (OW values): inline loops beat memcpy/memset calls here.
        for (int64_t ow = 0; ow < lo; ++ow) dst[ow] = 0.0f;
        if (s == 1) {
          const float* src = row + lo + off;
          for (int64_t i = 0; i < hi - lo; ++i) dst[lo + i] = src[i];
        } else {
          for (int64_t ow = lo; ow < hi; ++ow) dst[ow] = row[ow * s + off];
        }
        for (int64_t ow = hi; ow < ow_n; ++ow) dst[ow] = 0.0f;
      } else if (s == 1) {
        float* xr = row + lo + off;
        const float* d = dst + lo;
        for (int64_t i = 0; i < hi - lo; ++i) xr[i] += d[i];
      } else {
        for (int64_t ow = lo; ow < hi; ++ow) row[ow * s + off] += dst[ow];
      }
    }
  }
}

struct ConvPlan {
  int64_t n, kkc, ohw, x_numel, y_numel;
  bool pointwise;  // 1x1, stride 1, no padding: a sample's column matrix is the sample itself
};

ConvPlan plan(const Tensor& x, const Conv2dGeometry& g) {
  ConvPlan pl;
  pl.n = x.dim(0);
  pl.kkc = g.in_channels * g.kernel_h * g.kernel_w;
  pl.ohw = g.out_h() * g.out_w();
  pl.x_numel = g.in_channels * g.in_h * g.in_w;
  pl.y_numel = g.out_channels * pl.ohw;
  pl.pointwise = g.kernel_h == 1 && g.kernel_w == 1 && g.stride == 1 && g.padding == 0;
  return pl;
}

// Sample n's column matrix (kkc, OH*OW): unfolded into scratch, or the sample itself.
const float* columns(const ConvPlan& pl, const float* x, int64_t n, float* scratch, const Conv2dGeometry& g) {
  const float* xn = x + n * pl.x_numel;
  if (pl.pointwise) return xn;
  unfold<true>(const_cast<float*>(xn), scratch, pl.ohw, g);
  return scratch;
}

}  // namespace

void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y, const Conv2dGeometry& g) {
  const ConvPlan pl = plan(x, g);
  const int64_t o = g.out_channels;
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  const float* bp = bias.defined() ? bias.data<float>() : nullptr;
  float* yp = y.data<float>();
  Tensor col = pl.pointwise ? Tensor() : Tensor::empty({pl.kkc, pl.ohw});
  for (int64_t n = 0; n < pl.n; ++n) {
    const float* cols = columns(pl, xp, n, col.defined() ? col.data<float>() : nullptr, g);
    float* yn = yp + n * pl.y_numel;  // (O, OH*OW) = W (O, kkc) @ col (kkc, OH*OW)
    sgemm(false, false, o, pl.ohw, pl.kkc, 1.0f, wp, pl.kkc, cols, pl.ohw, 0.0f, yn, pl.ohw);
    if (!bp) continue;
    for (int64_t c = 0; c < o; ++c) {
      float* row = yn + c * pl.ohw;
      const float b = bp[c];
      for (int64_t i = 0; i < pl.ohw; ++i) row[i] += b;
    }
  }
}

void conv2d_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                     const Tensor& db, const Conv2dGeometry& g) {
  const ConvPlan pl = plan(x, g);
  const int64_t o = g.out_channels;
  const float* dyp = dy.data<float>();
  if (!dw.defined() && !dx.defined() && !db.defined()) return;
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  Tensor col = pl.pointwise ? Tensor() : Tensor::empty({pl.kkc, pl.ohw});
  float* scratch = col.defined() ? col.data<float>() : nullptr;
  const int64_t ohw = pl.ohw, kkc = pl.kkc;
  for (int64_t n = 0; n < pl.n; ++n) {
    const float* dyn = dyp + n * pl.y_numel;  // (O, OH*OW)
    if (db.defined()) {                       // db (O) += row sums of dY_n; done here so dY_n is in cache for the GEMMs
      float* dbp = db.data<float>();
      for (int64_t c = 0; c < o; ++c) {
        const float* r = dyn + c * pl.ohw;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < pl.ohw; ++i) acc += r[i];
        dbp[c] += acc;
      }
    }
    if (dw.defined()) {  // dW (O, kkc) += dY_n (O, OH*OW) @ col_n^T
      const float* cols = columns(pl, xp, n, scratch, g);
      sgemm(false, true, o, kkc, ohw, 1.0f, dyn, ohw, cols, ohw, 1.0f, dw.data<float>(), kkc);
    }
    if (dx.defined()) {  // dcol (kkc, OH*OW) = W^T @ dY_n, folded back into dx_n
      float* dxn = dx.data<float>() + n * pl.x_numel;
      float* dcol = pl.pointwise ? dxn : scratch;
      sgemm(true, false, kkc, ohw, o, 1.0f, wp, kkc, dyn, ohw, 0.0f, dcol, ohw);
      if (!pl.pointwise) {
        std::memset(dxn, 0, static_cast<size_t>(pl.x_numel) * sizeof(float));
        unfold<false>(dxn, dcol, pl.ohw, g);
      }
    }
  }
}

}  // namespace strata::ops::cpu
