// CPU kernels of the Llama family's ops: RMSNorm, rotary position embeddings (rotate-half
// layout) and the SwiGLU gate. Rows are independent in forward; parameter gradients are summed
// over rows in a fixed order, so results do not depend on the thread count.
#include <algorithm>
#include <cmath>

#include "core/ops/cpu/cpu_ops.hpp"

namespace strata::ops::cpu {

void rms_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd, float eps) {
  const int64_t f = x.dim(-1), m = f > 0 ? x.numel() / f : 0;
  const float* xp = x.data<float>();
  const float* gam = gamma.data<float>();
  float* yp = y.data<float>();
  parallel_rows(m, f, [&](int64_t r) {
    const float* in = xp + r * f;
    float* out = yp + r * f;
    double sq = 0.0;
    for (int64_t i = 0; i < f; ++i) sq += static_cast<double>(in[i]) * in[i];
    const float rs = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(f) + eps));
    for (int64_t i = 0; i < f; ++i) out[i] = in[i] * rs * gam[i];
    if (rstd.defined()) rstd.data<float>()[r] = rs;
  });
}

void rms_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& rstd, const Tensor& dx,
                       const Tensor& dgamma) {
  const int64_t f = x.dim(-1), m = f > 0 ? x.numel() / f : 0;
  const float* xp = x.data<float>();
  const float* gp = dy.data<float>();
  const float* gam = gamma.data<float>();
  if (dx.defined()) {
    // y = x r g with r = (mean(x^2) + eps)^-1/2: dx = r (dy g - x r^2 mean(dy g x)).
    parallel_rows(m, f, [&](int64_t r) {
      const float* in = xp + r * f;
      const float* g = gp + r * f;
      const float rs = rstd.data<float>()[r];
      double dot = 0.0;
      for (int64_t i = 0; i < f; ++i) dot += static_cast<double>(g[i]) * gam[i] * in[i];
      const float c = static_cast<float>(dot / static_cast<double>(f)) * rs * rs;
      float* out = dx.data<float>() + r * f;
      for (int64_t i = 0; i < f; ++i) out[i] = rs * (g[i] * gam[i] - in[i] * c);
    });
  }
  if (dgamma.defined()) {  // rows in order per column block: deterministic
    float* dg = dgamma.data<float>();
    constexpr int64_t kChunk = 64;
    parallel_rows((f + kChunk - 1) / kChunk, m * kChunk, [&](int64_t ch) {
      const int64_t c0 = ch * kChunk, c1 = std::min(f, c0 + kChunk);
      for (int64_t r = 0; r < m; ++r) {
        const float rs = rstd.data<float>()[r];
        for (int64_t i = c0; i < c1; ++i) dg[i] += gp[r * f + i] * xp[r * f + i] * rs;
      }
    });
  }
}

void rope(const Tensor& x, const Tensor& y, const std::vector<float>& inv_freq, int64_t first_position, bool inverse) {
  // x (B, H, T, Dh): pair i of a row is (i, i + Dh/2), rotated by angle (first_position + t) * inv_freq[i].
  const int64_t t = x.dim(2), dh = x.dim(3), half = dh / 2, rows = x.numel() / dh;
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  parallel_rows(rows, 4 * dh, [&](int64_t r) {
    const float pos = static_cast<float>(first_position + r % t);
    const float* in = xp + r * dh;
    float* out = yp + r * dh;
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];  // f32 as Hugging Face's rotary embedding computes it
      const float c = std::cos(angle), s = inverse ? -std::sin(angle) : std::sin(angle);
      const float a = in[i], b = in[i + half];  // read both first: y may be x
      out[i] = a * c - b * s;
      out[i + half] = b * c + a * s;
    }
  });
}

void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& y) {
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  float* out = y.data<float>();
  const int64_t n = gate.numel();
  parallel_for(n, [=](int64_t i) { out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i]; });
}

void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dy, const Tensor& dgate, const Tensor& dup) {
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  const float* d = dy.data<float>();
  float* dg = dgate.data<float>();
  float* du = dup.data<float>();
  const int64_t n = gate.numel();
  parallel_for(n, [=](int64_t i) {
    const float sig = 1.0f / (1.0f + std::exp(-g[i]));
    const float silu = g[i] * sig;
    du[i] = d[i] * silu;
    dg[i] = d[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));  // silu'(g) = sig (1 + g (1 - sig))
  });
}

}  // namespace strata::ops::cpu
