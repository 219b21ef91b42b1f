// CPU normalisation: batch norm (per channel over N, H, W; PyTorch's biased variance to
// normalise, unbiased for the running estimate) and layer norm (per row of (M, F)).
// Statistics accumulate in double. Undefined gamma/beta mean 1 and 0 (no affine).
#include <cmath>
#include <vector>

#include "core/ops/cpu/cpu_ops.hpp"

namespace strata::ops::cpu {

namespace {
// x viewed as (N, C, inner): channel c's elements are N runs of `inner` contiguous values.
struct ChannelView {
  int64_t n, c, inner;
  explicit ChannelView(const Tensor& x) : n(x.dim(0)), c(x.dim(1)), inner(x.numel() / (x.dim(0) * x.dim(1))) {}
  int64_t count() const { return n * inner; }
};

inline float value_or(const Tensor& t, int64_t i, float fallback) {
  return t.defined() ? t.data<float>()[i] : fallback;
}

// y = (x - mean) * invstd * gamma + beta for channel ch.
void normalize_channel(const float* x, float* y, const ChannelView& v, int64_t ch, float mean, float invstd,
                       float gamma, float beta) {
  const float a = invstd * gamma, b = beta - mean * a;
  for (int64_t s = 0; s < v.n; ++s) {
    const int64_t base = (s * v.c + ch) * v.inner;
    for (int64_t i = 0; i < v.inner; ++i) y[base + i] = x[base + i] * a + b;
  }
}
}  // namespace

void batch_norm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                              const Tensor& save_mean, const Tensor& save_invstd, const Tensor& running_mean,
                              const Tensor& running_var, float momentum, float eps) {
  const ChannelView v(x);
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  parallel_rows(v.c, v.count(), [&](int64_t ch) {
    double sum = 0.0;
    for (int64_t s = 0; s < v.n; ++s) {
      const float* r = xp + (s * v.c + ch) * v.inner;
      for (int64_t i = 0; i < v.inner; ++i) sum += r[i];
    }
    const double mean = sum / static_cast<double>(v.count());
    double sq = 0.0;  // second pass: no cancellation
    for (int64_t s = 0; s < v.n; ++s) {
      const float* r = xp + (s * v.c + ch) * v.inner;
      for (int64_t i = 0; i < v.inner; ++i) sq += (r[i] - mean) * (r[i] - mean);
    }
    const double var = sq / static_cast<double>(v.count());
    const float invstd = static_cast<float>(1.0 / std::sqrt(var + eps));
    normalize_channel(xp, yp, v, ch, static_cast<float>(mean), invstd, value_or(gamma, ch, 1.0f),
                      value_or(beta, ch, 0.0f));
    if (save_mean.defined()) save_mean.data<float>()[ch] = static_cast<float>(mean);
    if (save_invstd.defined()) save_invstd.data<float>()[ch] = invstd;
    if (running_mean.defined()) {
      float& rm = running_mean.data<float>()[ch];
      rm = (1.0f - momentum) * rm + momentum * static_cast<float>(mean);
    }
    if (running_var.defined()) {
      const double unbiased = v.count() > 1 ? sq / static_cast<double>(v.count() - 1) : var;
      float& rv = running_var.data<float>()[ch];
      rv = (1.0f - momentum) * rv + momentum * static_cast<float>(unbiased);
    }
  });
}

void batch_norm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& running_mean,
                             const Tensor& running_var, const Tensor& y, float eps) {
  const ChannelView v(x);
  parallel_rows(v.c, v.count(), [&](int64_t ch) {
    const float invstd = 1.0f / std::sqrt(running_var.data<float>()[ch] + eps);
    normalize_channel(x.data<float>(), y.data<float>(), v, ch, running_mean.data<float>()[ch], invstd,
                      value_or(gamma, ch, 1.0f), value_or(beta, ch, 0.0f));
  });
}

void batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta) {
  const ChannelView v(x);
  const float* xp = x.data<float>();
  const float* gp = dy.data<float>();
  parallel_rows(v.c, v.count(), [&](int64_t ch) {
    const float mean = save_mean.data<float>()[ch], invstd = save_invstd.data<float>()[ch];
    double sum_dy = 0.0, sum_dy_xhat = 0.0;
    for (int64_t s = 0; s < v.n; ++s) {
      const int64_t base = (s * v.c + ch) * v.inner;
      for (int64_t i = 0; i < v.inner; ++i) {
        sum_dy += gp[base + i];
        sum_dy_xhat += gp[base + i] * ((xp[base + i] - mean) * invstd);
      }
    }
    if (dgamma.defined()) dgamma.data<float>()[ch] += static_cast<float>(sum_dy_xhat);
    if (dbeta.defined()) dbeta.data<float>()[ch] += static_cast<float>(sum_dy);
    if (!dx.defined()) return;
    // dx = gamma * invstd * (dy - mean(dy) - xhat * mean(dy * xhat))
    const float m = static_cast<float>(v.count());
    const float k = value_or(gamma, ch, 1.0f) * invstd;
    const float mean_dy = static_cast<float>(sum_dy) / m, mean_dy_xhat = static_cast<float>(sum_dy_xhat) / m;
    float* dp = dx.data<float>();
    for (int64_t s = 0; s < v.n; ++s) {
      const int64_t base = (s * v.c + ch) * v.inner;
      for (int64_t i = 0; i < v.inner; ++i) {
        const float xhat = (xp[base + i] - mean) * invstd;
        dp[base + i] = k * (gp[base + i] - mean_dy - xhat * mean_dy_xhat);
      }
    }
  });
}

// LayerNorm on any float dtypes, staged in f32 a row at a time (f32_row); the statistics are f32.
void layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y, const Tensor& mean,
                        const Tensor& rstd, float eps) {
  // x (M, F): statistics per row.
  const int64_t f = x.dim(-1), m = f > 0 ? x.numel() / f : 0;
  std::vector<float> gamma_scratch, beta_scratch;
  const float* gam = gamma.defined() ? f32_row(gamma, 0, f, gamma_scratch) : nullptr;
  const float* bet = beta.defined() ? f32_row(beta, 0, f, beta_scratch) : nullptr;
  parallel_rows(m, f, [&](int64_t r) {
    thread_local std::vector<float> in_row, out_row;
    const float* in = f32_row(x, r * f, f, in_row);
    float* out = f32_out_row(y, r * f, f, out_row);
    double sum = 0.0, sq = 0.0;
    for (int64_t i = 0; i < f; ++i) sum += in[i];
    const double mu = sum / static_cast<double>(f);
    for (int64_t i = 0; i < f; ++i) sq += (in[i] - mu) * (in[i] - mu);
    const float rs = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(f) + eps));
    const float muf = static_cast<float>(mu);
    for (int64_t i = 0; i < f; ++i) {
      const float xhat = (in[i] - muf) * rs;
      out[i] = xhat * (gam ? gam[i] : 1.0f) + (bet ? bet[i] : 0.0f);
    }
    store_row(out, y, r * f, f);
    if (mean.defined()) mean.data<float>()[r] = muf;
    if (rstd.defined()) rstd.data<float>()[r] = rs;
  });
}

void layer_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean, const Tensor& rstd,
                         const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta) {
  const int64_t f = x.dim(-1), m = f > 0 ? x.numel() / f : 0;
  std::vector<float> gamma_scratch, dgamma_scratch, dbeta_scratch, x_row, dy_row, dx_row;
  const float* gam = gamma.defined() ? f32_row(gamma, 0, f, gamma_scratch) : nullptr;
  float* dgp = dgamma.defined() ? f32_inout_row(dgamma, 0, f, dgamma_scratch) : nullptr;
  float* dbp = dbeta.defined() ? f32_inout_row(dbeta, 0, f, dbeta_scratch) : nullptr;
  // Rows in order: dgamma and dbeta sum over rows, and a fixed order keeps results bitwise stable.
  for (int64_t r = 0; r < m; ++r) {
    const float* in = f32_row(x, r * f, f, x_row);
    const float* g = f32_row(dy, r * f, f, dy_row);
    const float mu = mean.data<float>()[r], rs = rstd.data<float>()[r];
    double sum_g = 0.0, sum_g_xhat = 0.0;  // of dxhat = dy * gamma
    for (int64_t i = 0; i < f; ++i) {
      const float xhat = (in[i] - mu) * rs;
      const float dxhat = g[i] * (gam ? gam[i] : 1.0f);
      sum_g += dxhat;
      sum_g_xhat += dxhat * xhat;
      if (dgp) dgp[i] += g[i] * xhat;
      if (dbp) dbp[i] += g[i];
    }
    if (!dx.defined()) continue;
    const float mean_g = static_cast<float>(sum_g / static_cast<double>(f));
    const float mean_gx = static_cast<float>(sum_g_xhat / static_cast<double>(f));
    float* out = f32_out_row(dx, r * f, f, dx_row);
    for (int64_t i = 0; i < f; ++i) {
      const float xhat = (in[i] - mu) * rs;
      out[i] = rs * (g[i] * (gam ? gam[i] : 1.0f) - mean_g - xhat * mean_gx);
    }
    store_row(out, dx, r * f, f);
  }
  if (dgp) store_row(dgp, dgamma, 0, f);
  if (dbp) store_row(dbp, dbeta, 0, f);
}

}  // namespace strata::ops::cpu
