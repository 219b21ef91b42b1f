// The language-model ops: embedding, the head layout copies, and causal attention (plain and
// memory-efficient), checked against
// - a naive double-precision reference written here (forward, backward and the dropout mask,
//   drawn with rng::uniform from the index formula of ops.hpp);
// - central finite differences of the float32 forward;
// - each other: the memory-efficient kernels must match the plain ones within 1e-6 of the
//   largest magnitude, with and without dropout, on ragged sequence lengths;
// - themselves: two runs, and runs on 1 and 2 threads, are bit-identical.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/ops.hpp"
#include "core/ops/cpu/cpu_ops.hpp"
#include "core/ops/cpu/vec_math.hpp"
#include "core/rng.hpp"
#include "core/tensor_test_util.hpp"

using namespace strata;

namespace {

using test::rand_tensor;
using test::values;

// max |got - want| / max(max |want|, floor): relative to the tensor's scale; the floor lets an
// all-zero reference (dq, dk at T = 1: a softmax over one key) compare absolutely.
double rel_diff(const Tensor& got, const std::vector<double>& want, double floor = 1e-2) {
  double scale = floor, diff = 0.0;
  const float* g = got.data<float>();
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::fabs(want[i]));
    diff = std::max(diff, std::fabs(g[i] - want[i]));
  }
  return diff / scale;
}

// t's values in another dtype (ops::cast).
Tensor as(const Tensor& t, DType dtype) {
  Tensor out = Tensor::empty(t.shape(), dtype);
  ops::cast(t, out);
  return out;
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

struct Shape4 {
  int64_t b, h, t, dh;
  Shape heads() const { return {b, h, t, dh}; }
};

// Attention's inputs and outputs for one shape.
struct Problem {
  Shape4 s;
  Tensor q, k, v, dy;
  Problem(Shape4 shape, uint32_t seed, float spread = 1.0f) : s(shape) {
    q = rand_tensor(s.heads(), seed, -spread, spread);
    k = rand_tensor(s.heads(), seed + 1, -spread, spread);
    v = rand_tensor(s.heads(), seed + 2);
    dy = rand_tensor(s.heads(), seed + 3);
  }
};

struct Result {
  Tensor y, dq, dk, dv, saved;  // saved: probs (plain) or lse (flash)
};

Result run_plain(const Problem& pr, float p, const ops::DropoutKey& key) {
  Result r;
  r.y = Tensor::empty(pr.s.heads());
  r.saved = Tensor::empty({pr.s.b, pr.s.h, pr.s.t, pr.s.t});
  ops::attention_forward(pr.q, pr.k, pr.v, r.y, r.saved, p, key);
  r.dq = Tensor::empty(pr.s.heads()), r.dk = Tensor::empty(pr.s.heads()), r.dv = Tensor::empty(pr.s.heads());
  ops::attention_backward(pr.q, pr.k, pr.v, r.saved, pr.dy, r.dq, r.dk, r.dv, p, key);
  return r;
}

Result run_flash(const Problem& pr, float p, const ops::DropoutKey& key) {
  Result r;
  r.y = Tensor::empty(pr.s.heads());
  r.saved = Tensor::empty({pr.s.b, pr.s.h, pr.s.t});
  ops::flash_attention_forward(pr.q, pr.k, pr.v, r.y, r.saved, p, key);
  r.dq = Tensor::empty(pr.s.heads()), r.dk = Tensor::empty(pr.s.heads()), r.dv = Tensor::empty(pr.s.heads());
  ops::flash_attention_backward(pr.q, pr.k, pr.v, r.y, r.saved, pr.dy, r.dq, r.dk, r.dv, p, key);
  return r;
}

// The naive reference in double: y, lse, and the gradients of sum(y * dy). q and dy have H heads,
// k and v Hkv (query head h reads kv head h / (H / Hkv)). Where y_stored is given, backward's row
// term D_i is dy_i . y_stored_i, as the kernels compute it from the y they are given, instead of
// sum_j P_ij dP_ij. The *_abs fields hold each output's sum of absolute terms (the products'
// magnitudes, which bound their rounding errors).
struct Reference {
  std::vector<double> y, lse, probs, dq, dk, dv;
  std::vector<double> y_abs, dq_abs, dk_abs, dv_abs;
};

Reference reference(const Tensor& qt, const Tensor& kt, const Tensor& vt, const Tensor& dyt, float p,
                    const ops::DropoutKey& key, const Tensor* y_stored = nullptr) {
  const int64_t B = qt.dim(0), H = qt.dim(1), Hkv = kt.dim(1), T = qt.dim(2), Dh = qt.dim(3);
  const auto q = values(qt), k = values(kt), v = values(vt), g = values(dyt);
  const std::vector<double> ys = y_stored ? values(*y_stored) : std::vector<double>();
  Reference ref;
  for (auto* x : {&ref.y, &ref.dq, &ref.y_abs, &ref.dq_abs}) x->assign(q.size(), 0.0);
  for (auto* x : {&ref.dk, &ref.dv, &ref.dk_abs, &ref.dv_abs}) x->assign(k.size(), 0.0);
  ref.lse.assign(static_cast<size_t>(B * H * T), 0.0);
  ref.probs.assign(static_cast<size_t>(B * H * T * T), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(Dh)), keep_scale = p < 1.0f ? 1.0 / (1.0 - p) : 0.0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t bh = b * H + h, off = bh * T * Dh, kv_off = (b * Hkv + h / (H / Hkv)) * T * Dh;
      auto at = [&](const std::vector<double>& x, int64_t row, int64_t d) { return x[off + row * Dh + d]; };
      auto kv_at = [&](const std::vector<double>& x, int64_t row, int64_t d) { return x[kv_off + row * Dh + d]; };
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> s(i + 1), f(i + 1), pr_row(i + 1);
        double mx = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          s[j] = 0.0;
          for (int64_t d = 0; d < Dh; ++d) s[j] += at(q, i, d) * kv_at(k, j, d);
          s[j] *= scale;
          mx = std::max(mx, s[j]);
          const uint64_t index = static_cast<uint64_t>(((key.first_sample + b) * H + h) * T * T + i * T + j);
          f[j] = p > 0.0f ? (rng::uniform(key.key, key.stream, index) >= p ? keep_scale : 0.0) : 1.0;
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - mx);
        ref.lse[bh * T + i] = mx + std::log(sum);
        for (int64_t j = 0; j <= i; ++j) {
          pr_row[j] = std::exp(s[j] - mx) / sum;
          ref.probs[(bh * T + i) * T + j] = pr_row[j];
        }
        // y_i = sum_j P_ij f_ij v_j; dP_ij = f_ij dy_i . v_j; dS = P (dP - sum_j P dP).
        std::vector<double> dp(i + 1);
        double row_term = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          double gv = 0.0;
          for (int64_t d = 0; d < Dh; ++d) {
            const double pf = pr_row[j] * f[j];
            ref.y[off + i * Dh + d] += pf * kv_at(v, j, d);
            ref.y_abs[off + i * Dh + d] += pf * std::fabs(kv_at(v, j, d));
            ref.dv[kv_off + j * Dh + d] += pf * at(g, i, d);
            ref.dv_abs[kv_off + j * Dh + d] += pf * std::fabs(at(g, i, d));
            gv += at(g, i, d) * kv_at(v, j, d);
          }
          dp[j] = f[j] * gv;
          row_term += pr_row[j] * dp[j];
        }
        if (y_stored) {
          row_term = 0.0;
          for (int64_t d = 0; d < Dh; ++d) row_term += at(g, i, d) * ys[off + i * Dh + d];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double ds = pr_row[j] * (dp[j] - row_term) * scale;
          for (int64_t d = 0; d < Dh; ++d) {
            ref.dq[off + i * Dh + d] += ds * kv_at(k, j, d);
            ref.dq_abs[off + i * Dh + d] += std::fabs(ds * kv_at(k, j, d));
            ref.dk[kv_off + j * Dh + d] += ds * at(q, i, d);
            ref.dk_abs[kv_off + j * Dh + d] += std::fabs(ds * at(q, i, d));
          }
        }
      }
    }
  }
  return ref;
}

Reference reference(const Problem& pr, float p, const ops::DropoutKey& key) {
  return reference(pr.q, pr.k, pr.v, pr.dy, p, key);
}

const ops::DropoutKey kKey{rng::derive_key(42, rng::kDropout), 7, 3};

}  // namespace

// ---- against the double-precision reference --------------------------------------------------

TEST(Attention, PlainAndFlashMatchTheReference) {
  for (const Shape4 s : {Shape4{2, 3, 5, 4}, Shape4{1, 2, 13, 8}, Shape4{2, 1, 70, 16}}) {
    for (const float p : {0.0f, 0.25f}) {
      SCOPED_TRACE("T=" + std::to_string(s.t) + " Dh=" + std::to_string(s.dh) + " p=" + std::to_string(p));
      const Problem pr(s, 11, 2.0f);
      const Reference ref = reference(pr, p, kKey);
      for (const bool flash : {false, true}) {
        SCOPED_TRACE(flash ? "flash" : "plain");
        const Result r = flash ? run_flash(pr, p, kKey) : run_plain(pr, p, kKey);
        EXPECT_LT(rel_diff(r.y, ref.y), 1e-5);
        EXPECT_LT(rel_diff(r.dq, ref.dq), 1e-5);
        EXPECT_LT(rel_diff(r.dk, ref.dk), 1e-5);
        EXPECT_LT(rel_diff(r.dv, ref.dv), 1e-5);
        EXPECT_LT(rel_diff(r.saved, flash ? ref.lse : ref.probs), 1e-5);
      }
    }
  }
}

// Central differences of L = sum(y * r) through the float32 plain forward. Round-off: L sums
// B*H*T*Dh = 2*2*6*4 terms of O(1), each y carrying ~1e-7 relative error, so a difference
// quotient with h = 1e-2 carries ~ sqrt(96) * 1e-7 / 2e-2 ~ 5e-5; truncation is h^2 |L'''| / 6
// ~ 2e-5 for these O(1) inputs. The tolerance 1e-2 relative + 1e-3 absolute is two orders
// above both, while a wrong term, scale or index gives O(1) errors.
TEST(Attention, PlainBackwardMatchesFiniteDifferences) {
  const Shape4 s{2, 2, 6, 4};
  for (const float p : {0.0f, 0.3f}) {
    SCOPED_TRACE("p=" + std::to_string(p));
    Problem pr(s, 21, 1.5f);
    const Result r = run_plain(pr, p, kKey);
    auto loss = [&]() {
      Tensor y = Tensor::empty(s.heads()), probs = Tensor::empty({s.b, s.h, s.t, s.t});
      ops::attention_forward(pr.q, pr.k, pr.v, y, probs, p, kKey);
      double l = 0.0;
      for (int64_t i = 0; i < y.numel(); ++i) l += static_cast<double>(y.data<float>()[i]) * pr.dy.data<float>()[i];
      return l;
    };
    const float h = 1e-2f;
    for (auto [x, grad, name] : {std::tuple{&pr.q, &r.dq, "dq"}, {&pr.k, &r.dk, "dk"}, {&pr.v, &r.dv, "dv"}}) {
      for (int64_t i = 0; i < x->numel(); ++i) {
        float& xi = x->data<float>()[i];
        const float saved = xi;
        xi = saved + h;
        const double up = loss();
        xi = saved - h;
        const double down = loss();
        xi = saved;
        const double numeric = (up - down) / (2.0 * h), analytic = grad->data<float>()[i];
        ASSERT_LE(std::fabs(analytic - numeric), 1e-2 * std::max(std::fabs(analytic), std::fabs(numeric)) + 1e-3)
            << name << "[" << i << "] analytic " << analytic << " numeric " << numeric;
      }
    }
  }
}

// ---- the softmax row kernels give the same bits at every vector width ----------------------------

// ops::cpu::max_of, exp_and_sum and softmax_backward_row run at this CPU's widest vector width
// (ops::cpu_kernel_isa); the same arithmetic one element at a time in baseline x86-64 code (this
// file) gives the same bits, so every CPU computes attention alike.
TEST(Attention, SoftmaxRowKernelsGiveTheSameBitsAtEveryVectorWidth) {
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (const int64_t n : {1, 7, 16, 31, 64, 100, 257}) {
    std::vector<float> s(static_cast<size_t>(n)), g(s.size()), f(s.size());
    for (size_t c = 0; c < s.size(); ++c) s[c] = normal(gen), g[c] = normal(gen), f[c] = c % 3 ? 1.25f : 0.0f;
    const float m = *std::max_element(s.begin(), s.end()), lse = m + 1.5f, d = 0.3f;
    EXPECT_EQ(ops::cpu::max_of(s.data(), n), m) << "n " << n;
    std::vector<float> got(s.size());
    const float sum = ops::cpu::exp_and_sum(s.data(), got.data(), n, m);
    float lanes[16] = {}, want_sum = 0.0f;
    int64_t c = 0;
    for (; c + 16 <= n; c += 16)
      for (int64_t l = 0; l < 16; ++l) lanes[l] += ops::cpu::vec_math::exp_nonpositive(s[c + l] - m);
    for (const float lane : lanes) want_sum += lane;
    for (; c < n; ++c) want_sum += ops::cpu::vec_math::exp_nonpositive(s[c] - m);
    EXPECT_EQ(std::bit_cast<uint32_t>(sum), std::bit_cast<uint32_t>(want_sum)) << "n " << n;
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]),
                std::bit_cast<uint32_t>(ops::cpu::vec_math::exp_nonpositive(s[i] - m)));
    for (const bool dropout : {false, true}) {
      std::vector<float> gs = s, gg = g;
      ops::cpu::softmax_backward_row(gs.data(), gg.data(), dropout ? f.data() : nullptr, n, lse, d);
      for (int64_t i = 0; i < n; ++i) {
        const float p = ops::cpu::vec_math::exp_nonpositive(s[i] - lse), fi = dropout ? f[i] : 1.0f;
        ASSERT_EQ(std::bit_cast<uint32_t>(gs[i]), std::bit_cast<uint32_t>(p * fi)) << "n " << n << " i " << i;
        ASSERT_EQ(std::bit_cast<uint32_t>(gg[i]), std::bit_cast<uint32_t>(p * (g[i] * fi - d)))
            << "n " << n << " i " << i << " on " << ops::cpu_kernel_isa();
      }
    }
  }
}

// ---- memory-efficient == plain ----------------------------------------------------------------

TEST(Attention, FlashMatchesPlain) {
  for (const int64_t t : {1, 7, 64, 257, 1024}) {
    for (const int64_t dh : {8, 64}) {
      for (const float p : {0.0f, 0.1f}) {
        SCOPED_TRACE("T=" + std::to_string(t) + " Dh=" + std::to_string(dh) + " p=" + std::to_string(p));
        const Problem pr({2, 2, t, dh}, static_cast<uint32_t>(t * 100 + dh), 2.0f);
        const Result plain = run_plain(pr, p, kKey), flash = run_flash(pr, p, kKey);
        // At T = 1, dq and dk are exactly 0 (a softmax over one key): both compute it as a
        // difference of O(1) terms (dy . v - D), so they compare against the O(1) scale of
        // the inputs there, relative to the gradients' own scale everywhere else.
        const double floor = t == 1 ? 1.0 : 1e-2;
        // Each element sums up to T terms (and Dh-long dot products) in another order in the two
        // kernels (tiles against whole rows): their difference is a walk of roundings, ~sqrt(T)
        // f32 units relative; 8 sqrt(max(T, 16)) units bounds it with room (measured: at most
        // 0.16 of it, at T = 7; 1.0e-6 = 0.07 of it at T = 1024).
        const double tol = 8.0 * std::sqrt(static_cast<double>(std::max<int64_t>(t, 16))) * std::ldexp(1.0, -24);
        EXPECT_LT(rel_diff(flash.y, values(plain.y)), tol);
        EXPECT_LT(rel_diff(flash.dq, values(plain.dq), floor), tol);
        EXPECT_LT(rel_diff(flash.dk, values(plain.dk), floor), tol);
        EXPECT_LT(rel_diff(flash.dv, values(plain.dv)), tol);
        std::printf("T=%4lld Dh=%2lld p=%.1f  flash vs plain: y %.2e dq %.2e dk %.2e dv %.2e\n",
                    static_cast<long long>(t), static_cast<long long>(dh), p, rel_diff(flash.y, values(plain.y)),
                    rel_diff(flash.dq, values(plain.dq), floor), rel_diff(flash.dk, values(plain.dk), floor),
                    rel_diff(flash.dv, values(plain.dv)));
      }
    }
  }
}

// The mask depends on the global sample: the second sample alone (first_sample + 1) gives
// the same result as in the full batch.
TEST(Attention, DropoutMaskIsAFunctionOfTheGlobalSample) {
  const Problem pr({2, 2, 33, 8}, 5);
  const Result full = run_flash(pr, 0.2f, kKey), plain_full = run_plain(pr, 0.2f, kKey);
  Problem second = pr;
  second.s.b = 1;
  second.q = pr.q.slice(1, 2), second.k = pr.k.slice(1, 2), second.v = pr.v.slice(1, 2), second.dy = pr.dy.slice(1, 2);
  const ops::DropoutKey shifted{kKey.key, kKey.stream, kKey.first_sample + 1};
  for (const bool flash : {false, true}) {
    const Result alone = flash ? run_flash(second, 0.2f, shifted) : run_plain(second, 0.2f, shifted);
    const Result& ref = flash ? full : plain_full;
    EXPECT_TRUE(bit_equal(alone.y, ref.y.slice(1, 2)));
    EXPECT_TRUE(bit_equal(alone.dq, ref.dq.slice(1, 2)));
    EXPECT_TRUE(bit_equal(alone.dk, ref.dk.slice(1, 2)));
  }
  // A different stream (optimizer step) draws a different mask.
  const Result other = run_flash(pr, 0.2f, {kKey.key, kKey.stream + 1, kKey.first_sample});
  EXPECT_FALSE(bit_equal(other.y, full.y));
}

// Heads [h0, h0 + n) of (B, H, T, Dh), a tensor-parallel rank's slice.
Tensor head_slice(const Tensor& x, int64_t h0, int64_t n) {
  const int64_t b = x.dim(0), h = x.dim(1), rows = x.dim(2) * x.dim(3);
  Tensor out = Tensor::empty({b, n, x.dim(2), x.dim(3)});
  for (int64_t i = 0; i < b; ++i)
    std::memcpy(out.data<float>() + i * n * rows, x.data<float>() + (i * h + h0) * rows,
                static_cast<size_t>(n * rows) * sizeof(float));
  return out;
}

// A slice of the heads keyed with DropoutKey::heads / first_head (tensor parallelism) draws the
// whole layer's mask for those heads: the same bits as the slice of the full run; without the
// offset it draws another mask.
TEST(Attention, DropoutMaskOfAHeadSliceIsTheWholeLayers) {
  const Problem pr({2, 4, 21, 8}, 9);
  for (const bool flash : {false, true}) {
    const Result full = flash ? run_flash(pr, 0.3f, kKey) : run_plain(pr, 0.3f, kKey);
    for (const int64_t h0 : {0, 2}) {
      Problem part = pr;
      part.s.h = 2;
      part.q = head_slice(pr.q, h0, 2), part.k = head_slice(pr.k, h0, 2), part.v = head_slice(pr.v, h0, 2);
      part.dy = head_slice(pr.dy, h0, 2);
      ops::DropoutKey key = kKey;
      key.heads = 4;
      key.first_head = h0;
      const Result alone = flash ? run_flash(part, 0.3f, key) : run_plain(part, 0.3f, key);
      EXPECT_TRUE(bit_equal(alone.y, head_slice(full.y, h0, 2))) << "flash " << flash << " heads from " << h0;
      EXPECT_TRUE(bit_equal(alone.dq, head_slice(full.dq, h0, 2))) << "flash " << flash << " heads from " << h0;
      EXPECT_TRUE(bit_equal(alone.dv, head_slice(full.dv, h0, 2))) << "flash " << flash << " heads from " << h0;
      if (h0 == 2) {  // the slice's own heads 0, 1 are the layer's 0, 1: a different mask
        const Result unkeyed = flash ? run_flash(part, 0.3f, kKey) : run_plain(part, 0.3f, kKey);
        EXPECT_FALSE(bit_equal(unkeyed.y, alone.y));
      }
    }
  }
  // A slice that does not fit the layer's heads is refused.
  ops::DropoutKey bad = kKey;
  bad.heads = 4;
  bad.first_head = 3;
  EXPECT_THROW(run_flash(pr, 0.3f, bad), Error);  // heads 3..6 of 4
}

// Two runs are bit-identical. The memory-efficient kernels are also independent of the thread
// count (heads are independent, and its 64 x 64 tile products are below OpenBLAS's threading
// threshold); the plain ones are not guaranteed to be: OpenBLAS may round its whole-head
// products differently on 1 and on 2 threads (~1e-7 relative).
TEST(Attention, DeterministicAcrossRunsAndThreadCounts) {
  const Problem pr({2, 3, 150, 64}, 9);
  const int threads = ops::num_threads();
  for (const bool flash : {false, true}) {
    const Result a = flash ? run_flash(pr, 0.1f, kKey) : run_plain(pr, 0.1f, kKey);
    const Result b = flash ? run_flash(pr, 0.1f, kKey) : run_plain(pr, 0.1f, kKey);
    ops::set_num_threads(threads == 1 ? 2 : 1);
    const Result c = flash ? run_flash(pr, 0.1f, kKey) : run_plain(pr, 0.1f, kKey);
    ops::set_num_threads(threads);
    for (const Result* o : {&b, &c}) {
      if (o == &c && !flash) continue;
      SCOPED_TRACE(std::string(flash ? "flash" : "plain") + (o == &b ? " again" : " other thread count"));
      EXPECT_TRUE(bit_equal(a.y, o->y));
      EXPECT_TRUE(bit_equal(a.saved, o->saved));
      EXPECT_TRUE(bit_equal(a.dq, o->dq));
      EXPECT_TRUE(bit_equal(a.dk, o->dk));
      EXPECT_TRUE(bit_equal(a.dv, o->dv));
    }
  }
}

// bf16 tensors whose tiles do not run on bf16 units, staged in f32 a head at a time: bitwise the
// f32 kernel on the widened values, outputs rounded once, with grouped kv heads too.
TEST(Attention, Bf16IsTheF32KernelOnTheWidenedValuesRoundedOnce) {
  if (ops::cpu::flash_tiles_on_units(Tensor::empty({1, 4, 40, 16}, DType::BF16)))
    GTEST_SKIP() << "these tiles run on the bf16 units: the test below covers them";
  for (const int64_t kv_heads : {4, 2}) {
    SCOPED_TRACE(kv_heads);
    const Shape qs{1, 4, 40, 16}, kvs{1, kv_heads, 40, 16};
    const Tensor q = as(rand_tensor(qs, 17), DType::BF16), k = as(rand_tensor(kvs, 18), DType::BF16),
                 v = as(rand_tensor(kvs, 19), DType::BF16), dy = as(rand_tensor(qs, 20), DType::BF16);
    Tensor y = Tensor::empty(qs, DType::BF16), yf = Tensor::empty(qs), lse = Tensor::empty({1, 4, 40}),
           lsef = Tensor::empty({1, 4, 40});
    ops::flash_attention_forward(q, k, v, y, lse, 0.1f, kKey);
    ops::flash_attention_forward(as(q, DType::F32), as(k, DType::F32), as(v, DType::F32), yf, lsef, 0.1f, kKey);
    EXPECT_TRUE(bit_equal(y, as(yf, DType::BF16)));
    EXPECT_TRUE(bit_equal(lse, lsef));
    Tensor dq = Tensor::empty(qs, DType::BF16), dk = Tensor::empty(kvs, DType::BF16),
           dv = Tensor::empty(kvs, DType::BF16);
    Tensor dqf = Tensor::empty(qs), dkf = Tensor::empty(kvs), dvf = Tensor::empty(kvs);
    ops::flash_attention_backward(q, k, v, y, lse, dy, dq, dk, dv, 0.1f, kKey);
    ops::flash_attention_backward(as(q, DType::F32), as(k, DType::F32), as(v, DType::F32), as(y, DType::F32), lse,
                                  as(dy, DType::F32), dqf, dkf, dvf, 0.1f, kKey);
    EXPECT_TRUE(bit_equal(dq, as(dqf, DType::BF16)));
    EXPECT_TRUE(bit_equal(dk, as(dkf, DType::BF16)));
    EXPECT_TRUE(bit_equal(dv, as(dvf, DType::BF16)));
    if (kv_heads == 4) {
      Tensor probs = Tensor::empty({1, 4, 40, 40}, DType::BF16);  // plain keeps bf16 probabilities
      ops::attention_forward(q, k, v, y, probs, 0.0f, kKey);
    }
  }
}

// bf16 tensors on a CPU with bf16 units: every tile product runs on them, the probabilities and
// dS rounded to bf16 before they are multiplied (as FlashAttention does on GPUs), all sums in f32.
// Each output is then within one bf16 rounding (u = 2^-8) of the absolute sum of its terms, plus
// its own final rounding (u |exact|), plus f32-level slack (1e-5 of the tensor's largest value);
// the reference takes the bf16 inputs exactly and, for backward's D_i, the y the kernel is given.
// CTest also runs this file with the units turned off (DNNL_MAX_CPU_ISA), where the test above
// covers bf16.
TEST(Attention, Bf16OnTheUnitsIsWithinOneRoundingOfItsTiles) {
  for (const int64_t t : {40, 130})
    if (!ops::cpu::flash_tiles_on_units(Tensor::empty({2, 4, t, 64}, DType::BF16)))
      GTEST_SKIP() << "no bf16 units, or oneDNN has no fast kernels for these tiles: bf16 attention is staged in f32";
  const double u = std::ldexp(1.0, -8);
  const auto expect_within = [&](const Tensor& got, const std::vector<double>& want, const std::vector<double>& abs,
                                 const char* name) {
    const Tensor g = as(got, DType::F32);
    double scale = 0.0;
    for (const double w : want) scale = std::max(scale, std::fabs(w));
    int64_t worst = 0;
    double worst_ratio = 0.0;
    for (int64_t i = 0; i < g.numel(); ++i) {
      const double bound = u * abs[i] + u * std::fabs(want[i]) + 1e-5 * scale;
      const double ratio = std::fabs(g.data<float>()[i] - want[i]) / bound;
      if (ratio > worst_ratio) worst_ratio = ratio, worst = i;
    }
    EXPECT_LE(worst_ratio, 1.0) << name << "[" << worst << "] " << g.data<float>()[worst] << " vs " << want[worst];
    std::printf("%s: worst error %.2f of its bound\n", name, worst_ratio);
  };
  for (const int64_t kv_heads : {4, 2}) {
    for (const int64_t t : {40, 130}) {
      for (const float p : {0.0f, 0.1f}) {
        SCOPED_TRACE("kv heads " + std::to_string(kv_heads) + " T " + std::to_string(t) + " p " + std::to_string(p));
        const Shape qs{2, 4, t, 64}, kvs{2, kv_heads, t, 64};
        const Tensor q = as(rand_tensor(qs, 17, -2.0f, 2.0f), DType::BF16),
                     k = as(rand_tensor(kvs, 18, -2.0f, 2.0f), DType::BF16), v = as(rand_tensor(kvs, 19), DType::BF16),
                     dy = as(rand_tensor(qs, 20), DType::BF16);
        Tensor y = Tensor::empty(qs, DType::BF16), lse = Tensor::empty({2, 4, t});
        ops::flash_attention_forward(q, k, v, y, lse, p, kKey);
        Tensor dq = Tensor::empty(qs, DType::BF16), dk = Tensor::empty(kvs, DType::BF16),
               dv = Tensor::empty(kvs, DType::BF16);
        ops::flash_attention_backward(q, k, v, y, lse, dy, dq, dk, dv, p, kKey);
        const Tensor y_given = as(y, DType::F32);
        const Reference ref =
            reference(as(q, DType::F32), as(k, DType::F32), as(v, DType::F32), as(dy, DType::F32), p, kKey, &y_given);
        EXPECT_LT(rel_diff(lse, ref.lse), 1e-5);  // exact products summed in f32
        expect_within(y, ref.y, ref.y_abs, "y");
        expect_within(dq, ref.dq, ref.dq_abs, "dq");
        expect_within(dk, ref.dk, ref.dk_abs, "dk");
        expect_within(dv, ref.dv, ref.dv_abs, "dv");
      }
    }
  }
}

TEST(Attention, RejectsBadArguments) {
  const Problem pr({1, 2, 8, 4}, 1);
  Tensor y = Tensor::empty(pr.s.heads()), lse = Tensor::empty({1, 2, 8}), probs = Tensor::empty({1, 2, 8, 7});
  EXPECT_THROW(ops::attention_forward(pr.q, pr.k, pr.v, y, probs), Error);
  EXPECT_THROW(ops::flash_attention_forward(pr.q, pr.k, pr.v, y, lse, 1.5f), Error);
  EXPECT_THROW(ops::flash_attention_forward(pr.q, pr.k, pr.v, pr.q, lse), Error);  // y aliases q
  EXPECT_THROW(ops::flash_attention_forward(pr.q, pr.k.reshape({2, 8, 4}), pr.v, y, lse), Error);
}

// ---- embedding ---------------------------------------------------------------------------------

TEST(Embedding, ForwardAndBackwardByHand) {
  const int64_t V = 5, D = 3, B = 2, T = 3, Tmax = 4;
  Tensor tokens = Tensor::empty({B, T}, DType::I32);
  const int32_t tok[] = {4, 1, 4, 0, 4, 2};  // token 4 three times, 3 never
  std::copy(tok, tok + 6, tokens.data<int32_t>());
  Tensor wte = Tensor::empty({V, D}), wpe = Tensor::empty({Tmax, D});
  for (int64_t i = 0; i < V * D; ++i) wte.data<float>()[i] = static_cast<float>(i);              // wte[v][c] = 3v + c
  for (int64_t i = 0; i < Tmax * D; ++i) wpe.data<float>()[i] = 100.0f * static_cast<float>(i);  // 300t + 100c
  Tensor y = Tensor::empty({B, T, D});
  ops::embedding_forward(tokens, wte, wpe, y);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < D; ++c)
        EXPECT_EQ(y.data<float>()[(b * T + t) * D + c], 3.0f * tok[b * T + t] + c + 300.0f * t + 100.0f * c);

  // dy[b][t][c] = 1000b + 10t + c; gradients accumulate onto 0.5.
  Tensor dy = Tensor::empty({B, T, D});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < D; ++c) dy.data<float>()[(b * T + t) * D + c] = 1000.0f * b + 10.0f * t + c;
  Tensor dwte = Tensor::empty({V, D}), dwpe = Tensor::empty({Tmax, D});
  ops::fill(dwte, 0.5f);
  ops::fill(dwpe, 0.5f);
  ops::embedding_backward(tokens, dy, dwte, dwpe);
  auto g = [](int b, int t, int c) { return 1000.0f * b + 10.0f * t + c; };
  for (int c = 0; c < D; ++c) {
    // token 4 at (0,0), (0,2), (1,1); 1 at (0,1); 0 at (1,0); 2 at (1,2); 3 nowhere.
    EXPECT_EQ(dwte.data<float>()[4 * D + c], 0.5f + g(0, 0, c) + g(0, 2, c) + g(1, 1, c));
    EXPECT_EQ(dwte.data<float>()[1 * D + c], 0.5f + g(0, 1, c));
    EXPECT_EQ(dwte.data<float>()[0 * D + c], 0.5f + g(1, 0, c));
    EXPECT_EQ(dwte.data<float>()[2 * D + c], 0.5f + g(1, 2, c));
    EXPECT_EQ(dwte.data<float>()[3 * D + c], 0.5f);
    for (int t = 0; t < T; ++t) EXPECT_EQ(dwpe.data<float>()[t * D + c], 0.5f + g(0, t, c) + g(1, t, c));
    EXPECT_EQ(dwpe.data<float>()[3 * D + c], 0.5f);  // position 3 >= T untouched
  }
  // Either table alone (the other undefined).
  ops::embedding_backward(tokens, dy, Tensor(), dwpe);
  EXPECT_EQ(dwpe.data<float>()[0], 0.5f + 2.0f * (g(0, 0, 0) + g(1, 0, 0)));
}

// A vocabulary slice (tensor parallelism): rows [first, first + rows) of wte, the others adding
// zero; the slices' outputs summed (wpe added by one of them) are the whole table's exactly,
// and each slice's dwte is its rows of the whole dwte.
TEST(Embedding, VocabularySlicesAddUpToTheWholeTable) {
  const int64_t V = 12, D = 5, B = 2, T = 7, parts = 3, rows = V / parts;
  Tensor tokens = Tensor::empty({B, T}, DType::I32);
  for (int64_t i = 0; i < B * T; ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>((i * 5 + 3) % V);
  const Tensor wte = rand_tensor({V, D}, 4), wpe = rand_tensor({T, D}, 5), dy = rand_tensor({B, T, D}, 6);
  Tensor y = Tensor::empty({B, T, D}), dwte = Tensor::zeros({V, D}), dwpe = Tensor::zeros({T, D});
  ops::embedding_forward(tokens, wte, wpe, y);
  ops::embedding_backward(tokens, dy, dwte, dwpe);
  Tensor sum = Tensor::zeros({B, T, D});
  for (int64_t r = 0; r < parts; ++r) {
    const Tensor part = wte.slice(r * rows, (r + 1) * rows);
    Tensor yr = Tensor::empty({B, T, D}), dpart = Tensor::zeros({rows, D}), dpe = Tensor::zeros({T, D});
    ops::embedding_forward(tokens, part, r == 0 ? wpe : Tensor(), yr, r * rows, V);
    ops::axpy(1.0f, yr, sum);
    ops::embedding_backward(tokens, dy, dpart, dpe, r * rows);
    EXPECT_TRUE(bit_equal(dpart, dwte.slice(r * rows, (r + 1) * rows))) << "slice " << r;
    EXPECT_TRUE(bit_equal(dpe, dwpe)) << "slice " << r;
  }
  EXPECT_TRUE(bit_equal(sum, y));
  // Tokens are checked against the whole vocabulary, not the slice's rows.
  tokens.data<int32_t>()[3] = static_cast<int32_t>(V);
  Tensor yr = Tensor::empty({B, T, D});
  EXPECT_THROW(ops::embedding_forward(tokens, wte.slice(0, rows), Tensor(), yr, 0, V), Error);
  tokens.data<int32_t>()[3] = 0;
  EXPECT_THROW(ops::embedding_forward(tokens, wte.slice(0, rows), Tensor(), yr, -1, V), Error);
  // A padded last slice (a vocabulary tp does not divide) ends past V: its rows past V are
  // never looked up, and its real rows are as in the whole table.
  const Tensor padded = Tensor::zeros({rows, D});
  ops::copy(wte.slice(V - rows + 1, V), padded.slice(0, rows - 1));
  Tensor whole = Tensor::empty({B, T, D}), tail = Tensor::empty({B, T, D});
  const Tensor last = Tensor::zeros({V, D});
  ops::copy(wte.slice(V - rows + 1, V), last.slice(V - rows + 1, V));
  ops::embedding_forward(tokens, last, Tensor(), whole);
  ops::embedding_forward(tokens, padded, Tensor(), tail, V - rows + 1, V);
  EXPECT_TRUE(bit_equal(tail, whole));
}

TEST(Embedding, TokenOutsideTheVocabularyIsAnInputError) {
  Tensor tokens = Tensor::empty({2, 2}, DType::I32);
  const int32_t tok[] = {0, 1, 5, 7};
  std::copy(tok, tok + 4, tokens.data<int32_t>());
  Tensor wte = rand_tensor({5, 4}, 1), wpe = rand_tensor({2, 4}, 2), y = Tensor::empty({2, 2, 4});
  try {
    ops::embedding_forward(tokens, wte, wpe, y);
    FAIL() << "no error for token 5 with V = 5";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    EXPECT_NE(e.message().find("token 5 at (1, 0)"), std::string::npos) << e.message();
  }
  tokens.data<int32_t>()[2] = -1;
  EXPECT_THROW(ops::embedding_forward(tokens, wte, wpe, y), Error);
  Tensor short_wpe = rand_tensor({1, 4}, 3);  // Tmax < T
  tokens.data<int32_t>()[2] = 2, tokens.data<int32_t>()[3] = 3;
  EXPECT_THROW(ops::embedding_forward(tokens, wte, short_wpe, y), Error);
  ops::embedding_forward(tokens, wte, wpe, y);
}

// ---- head layout -------------------------------------------------------------------------------

TEST(HeadLayout, SplitMergeRoundTrips) {
  const int64_t B = 2, T = 5, H = 3, Dh = 4, C = H * Dh;
  Tensor qkv = rand_tensor({B, T, 3 * C}, 3);
  Tensor q = Tensor::empty({B, H, T, Dh}), k = Tensor::empty({B, H, T, Dh}), v = Tensor::empty({B, H, T, Dh});
  ops::split_qkv(qkv, q, k, v);
  const float* src = qkv.data<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < Dh; ++d) {
          const int64_t at = ((b * H + h) * T + t) * Dh + d, from = (b * T + t) * 3 * C + h * Dh + d;
          ASSERT_EQ(q.data<float>()[at], src[from]);
          ASSERT_EQ(k.data<float>()[at], src[from + C]);
          ASSERT_EQ(v.data<float>()[at], src[from + 2 * C]);
        }
  Tensor back = Tensor::empty({B, T, 3 * C});
  ops::merge_qkv(q, k, v, back);
  EXPECT_TRUE(bit_equal(back, qkv));

  Tensor merged = Tensor::empty({B, T, C}), again = Tensor::empty({B, H, T, Dh});
  ops::merge_heads(v, merged);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < Dh; ++d)
          ASSERT_EQ(merged.data<float>()[(b * T + t) * C + h * Dh + d],
                    v.data<float>()[((b * H + h) * T + t) * Dh + d]);
  ops::split_heads(merged, again);
  EXPECT_TRUE(bit_equal(again, v));

  // Any float dtype moves as is.
  Tensor low = Tensor::empty({B, H, T, Dh}, DType::F16), low_merged = Tensor::empty({B, T, C}, DType::F16);
  Tensor low_back = Tensor::empty({B, H, T, Dh}, DType::F16);
  ops::cast(v, low);
  ops::merge_heads(low, low_merged);
  ops::split_heads(low_merged, low_back);
  EXPECT_TRUE(bit_equal(low_back, low));
  EXPECT_THROW(ops::merge_heads(v, Tensor::empty({B, T, C + 1})), Error);
}
