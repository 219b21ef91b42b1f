// CPU 2-D convolution: im2col + OpenBLAS GEMM, one sample at a time. Measured on the CNN
// benchmark (batch 64, 1 thread), per-sample GEMMs beat batching samples into one wide column
// matrix by 1.1-2.4x: the wide matrix falls out of cache and needs a (N,O)<->(O,N) reshuffle of
// y and dy. Backward: dW += dY_n @ col_n^T, dcol = W^T @ dY_n, then col2im. 1x1 convolutions
// with stride 1 and no padding use the sample itself as the column matrix. bf16 on a CPU with
// bf16 units: the same loops, columns unfolded in bf16, the products through oneDNN
// (gemm_bf16) into f32.

#include <algorithm>
#include <cstring>
#include <vector>

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
template <bool kToCol, class T>
void unfold_same_width(T* plane, T* crow, const Conv2dGeometry& g, int64_t kh, int64_t kw, int64_t lo, int64_t hi) {
  const int64_t h = g.in_h, w = g.in_w, p = g.padding, oh_n = g.out_h(), ohw = oh_n * w;
  const int64_t off = (kh - p) * w + (kw - p);
  const int64_t oh_lo = std::clamp<int64_t>(p - kh, 0, oh_n), oh_hi = std::clamp<int64_t>(h + p - kh, oh_lo, oh_n);
  // Shifted indices must stay inside the plane; what the clip drops is border columns anyway.
  const int64_t i0 = std::max(oh_lo * w, -off), i1 = std::max(i0, std::min(oh_hi * w, h * w - off));
  auto zero_borders = [&] {
    for (int64_t oh = oh_lo; oh < oh_hi; ++oh) {
      for (int64_t ow = 0; ow < lo; ++ow) crow[oh * w + ow] = T{};
      for (int64_t ow = hi; ow < w; ++ow) crow[oh * w + ow] = T{};
    }
  };
  if constexpr (kToCol) {
    std::fill(crow, crow + i0, T{});
    std::memcpy(crow + i0, plane + i0 + off, static_cast<size_t>(i1 - i0) * sizeof(T));
    std::fill(crow + i1, crow + ohw, T{});
    zero_borders();
  } else {
    zero_borders();  // crow is scratch (dcol): padding positions must not be added
    for (int64_t i = i0; i < i1; ++i) plane[i + off] += crow[i];
  }
}

// kToCol: col (C*KH*KW rows of length ld, this sample's columns at offset 0) = unfold(x), for
// f32 or bf16 (copies). Otherwise col2im: x (C, H, W) += fold(col), in f32. One routine so the
// index math exists once.
template <bool kToCol, class T>
void unfold(T* x, T* col, int64_t ld, const Conv2dGeometry& g) {
  const int64_t oh_n = g.out_h(), ow_n = g.out_w(), h = g.in_h, w = g.in_w, s = g.stride, p = g.padding;
  const int64_t rows = g.in_channels * g.kernel_h * g.kernel_w;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t kw = r % g.kernel_w, kh = (r / g.kernel_w) % g.kernel_h, c = r / (g.kernel_w * g.kernel_h);
    int64_t lo, hi;
    valid_range(w, ow_n, s, p, kw, lo, hi);
    T* plane = x + c * h * w;
    T* crow = col + r * ld;
    if (s == 1 && ow_n == w) {  // "same" width (3x3 pad 1, ...): one long shifted copy per row
      unfold_same_width<kToCol>(plane, crow, g, kh, kw, lo, hi);
      continue;
    }
    for (int64_t oh = 0; oh < oh_n; ++oh) {
      T* dst = crow + oh * ow_n;  // (OW) slice of the column row
      const int64_t ih = oh * s - p + kh;
      if (ih < 0 || ih >= h) {
        if constexpr (kToCol) std::fill(dst, dst + ow_n, T{});
        continue;
      }
      T* row = plane + ih * w;
      const int64_t off = kw - p;  // row[ow * s + off] is what output column ow sees
      if constexpr (kToCol) {
        // Rows are short (OW values): inline loops beat memcpy/memset calls here.
        for (int64_t ow = 0; ow < lo; ++ow) dst[ow] = T{};
        if (s == 1) {
          const T* src = row + lo + off;
          for (int64_t i = 0; i < hi - lo; ++i) dst[lo + i] = src[i];
        } else {
          for (int64_t ow = lo; ow < hi; ++ow) dst[ow] = row[ow * s + off];
        }
        for (int64_t ow = hi; ow < ow_n; ++ow) dst[ow] = T{};
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
template <class T>
const T* columns(const ConvPlan& pl, const T* x, int64_t n, T* scratch, const Conv2dGeometry& g) {
  const T* xn = x + n * pl.x_numel;
  if (pl.pointwise) return xn;
  unfold<true>(const_cast<T*>(xn), scratch, pl.ohw, g);
  return scratch;
}

// y (O, OH*OW) of one sample += bias[c] on channel c's row.
void add_channel_bias(float* y, const float* bias, int64_t o, int64_t ohw) {
  for (int64_t c = 0; c < o; ++c) {
    float* row = y + c * ohw;
    const float b = bias[c];
    for (int64_t i = 0; i < ohw; ++i) row[i] += b;
  }
}

// db (O) += the row sums of one sample's dY (O, OH*OW), each row summed on its own (f32).
void add_channel_sums(const float* dy, int64_t o, int64_t ohw, float* db) {
  for (int64_t c = 0; c < o; ++c) {
    const float* r = dy + c * ohw;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < ohw; ++i) acc += r[i];
    db[c] += acc;
  }
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
    if (bp) add_channel_bias(yn, bp, o, pl.ohw);
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
    // db (O) += row sums of dY_n; done here so dY_n is in cache for the GEMMs
    if (db.defined()) add_channel_sums(dyn, o, ohw, db.data<float>());
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

// ---- bf16 on the CPU's bf16 units ------------------------------------------------------------
// The same loops with the column matrices in bf16 and the products through gemm_bf16 into f32
// scratch (per sample, kept across calls: kernel scratch, as f32_row's).

void conv2d_forward_bf16(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y,
                         const Conv2dGeometry& g) {
  const ConvPlan pl = plan(x, g);
  const int64_t o = g.out_channels;
  const bf16* xp = x.data<bf16>();
  const bf16* wp = w.data<bf16>();
  bf16* yp = y.data<bf16>();
  std::vector<float> bias_scratch;
  const float* bp = bias.defined() ? f32_row(bias, 0, o, bias_scratch) : nullptr;
  thread_local std::vector<bf16> col;
  thread_local std::vector<float> out;
  col.resize(pl.pointwise ? 0 : static_cast<size_t>(pl.kkc * pl.ohw));
  out.resize(static_cast<size_t>(pl.y_numel));
  for (int64_t n = 0; n < pl.n; ++n) {
    const bf16* cols = columns(pl, xp, n, col.data(), g);
    // (O, OH*OW) = W (O, kkc) @ col (kkc, OH*OW), in f32; the bias added there; rounded once.
    gemm_bf16(false, false, o, pl.ohw, pl.kkc, 1.0f, wp, pl.kkc, cols, pl.ohw, 0.0f, out.data(), DType::F32, pl.ohw);
    if (bp) add_channel_bias(out.data(), bp, o, pl.ohw);
    cast_span(out.data(), DType::F32, yp + n * pl.y_numel, DType::BF16, pl.y_numel);
  }
}

void conv2d_backward_bf16(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                          const Tensor& db, const Conv2dGeometry& g) {
  const ConvPlan pl = plan(x, g);
  const int64_t o = g.out_channels, ohw = pl.ohw, kkc = pl.kkc;
  if (!dw.defined() && !dx.defined() && !db.defined()) return;
  const bf16* xp = x.data<bf16>();
  const bf16* wp = w.data<bf16>();
  const bf16* dyp = dy.data<bf16>();
  // dW and db accumulate over the samples in f32: in place where they are f32, else in scratch
  // rounded once at the end.
  std::vector<float> dw_scratch, db_scratch, dy_row;
  float* dwp = dw.defined() ? f32_inout_row(dw, 0, dw.numel(), dw_scratch) : nullptr;
  float* dbp = db.defined() ? f32_inout_row(db, 0, o, db_scratch) : nullptr;
  thread_local std::vector<bf16> col;
  thread_local std::vector<float> dcol, dxf;
  col.resize(pl.pointwise ? 0 : static_cast<size_t>(kkc * ohw));
  dcol.resize(static_cast<size_t>(kkc * ohw));
  dxf.resize(pl.pointwise ? 0 : static_cast<size_t>(pl.x_numel));
  for (int64_t n = 0; n < pl.n; ++n) {
    const bf16* dyn = dyp + n * pl.y_numel;  // (O, OH*OW)
    if (dbp) add_channel_sums(f32_row(dy, n * pl.y_numel, pl.y_numel, dy_row), o, ohw, dbp);
    if (dwp) {  // dW (O, kkc) += dY_n (O, OH*OW) @ col_n^T
      const bf16* cols = columns(pl, xp, n, col.data(), g);
      gemm_bf16(false, true, o, kkc, ohw, 1.0f, dyn, ohw, cols, ohw, 1.0f, dwp, DType::F32, kkc);
    }
    if (dx.defined()) {  // dcol (kkc, OH*OW) = W^T @ dY_n in f32, folded back, rounded into dx_n
      gemm_bf16(true, false, kkc, ohw, o, 1.0f, wp, kkc, dyn, ohw, 0.0f, dcol.data(), DType::F32, ohw);
      const float* dxn = dcol.data();
      if (!pl.pointwise) {
        std::fill(dxf.begin(), dxf.end(), 0.0f);
        unfold<false>(dxf.data(), dcol.data(), ohw, g);
        dxn = dxf.data();
      }
      cast_span(dxn, DType::F32, dx.data<bf16>() + n * pl.x_numel, DType::BF16, pl.x_numel);
    }
  }
  if (dwp) store_row(dwp, dw, 0, dw.numel());
  if (dbp) store_row(dbp, db, 0, o);
}

}  // namespace strata::ops::cpu
