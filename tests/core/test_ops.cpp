// Every op against a naive, obviously-correct loop written here (in double where it sums),
// on odd shapes: non-square images and kernels, stride, padding, ragged sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/ops.hpp"
#include "core/ops/cpu/vec_math.hpp"
#include "core/rng.hpp"
#include "core/tensor_test_util.hpp"

using namespace strata;

namespace {

using test::rand_tensor;
using test::values;

// |got - want| <= rtol * (|want| + max|want|): relative, with the tensor's scale as the floor
// for elements that are sums cancelling to near zero.
void expect_close(const Tensor& got, const std::vector<double>& want, double rtol = 1e-5) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size()));
  double scale = 1e-30;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  const float* g = got.data<float>();
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_LE(std::fabs(g[i] - want[i]), rtol * (std::fabs(want[i]) + scale))
        << "element " << i << " got " << g[i] << " want " << want[i];
}

Tensor labels_of(std::vector<int32_t> v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I32);
  std::copy(v.begin(), v.end(), t.data<int32_t>());
  return t;
}

}  // namespace

// ---- element-wise ----------------------------------------------------------------------------

TEST(Ops, SimpleElementwise) {
  const int64_t n = 1037;
  Tensor a = rand_tensor({n}, 1), b = rand_tensor({n}, 2), y = Tensor::empty({n});
  std::vector<double> va = values(a), vb = values(b), want(n);
  ops::add(a, b, y);
  for (int64_t i = 0; i < n; ++i) want[i] = va[i] + vb[i];
  expect_close(y, want);
  ops::axpy(0.5f, a, b);
  for (int64_t i = 0; i < n; ++i) want[i] = vb[i] + 0.5 * va[i];
  expect_close(b, want);
  ops::scale(a, -3.0f);
  for (int64_t i = 0; i < n; ++i) want[i] = -3.0 * va[i];
  expect_close(a, want);
  ops::fill(y, 2.5f);
  expect_close(y, std::vector<double>(n, 2.5));
}

TEST(Ops, ReluAndGelu) {
  Tensor x = rand_tensor({3, 257}, 3, -4.0f, 4.0f), dy = rand_tensor({3, 257}, 4);
  Tensor y = Tensor::empty(x.shape()), dx = Tensor::empty(x.shape());
  const auto vx = values(x), vdy = values(dy);
  std::vector<double> want(vx.size()), want_dx(vx.size());
  ops::relu_forward(x, y);
  for (size_t i = 0; i < vx.size(); ++i) want[i] = std::max(vx[i], 0.0);
  expect_close(y, want);
  ops::relu_backward(y, dy, dx);
  for (size_t i = 0; i < vx.size(); ++i) want_dx[i] = vx[i] > 0 ? vdy[i] : 0.0;
  expect_close(dx, want_dx);

  ops::gelu_forward(x, y);
  ops::gelu_backward(x, dy, dx);
  for (size_t i = 0; i < vx.size(); ++i) {
    const double cdf = 0.5 * (1.0 + std::erf(vx[i] / std::sqrt(2.0)));
    const double pdf = std::exp(-0.5 * vx[i] * vx[i]) / std::sqrt(2.0 * M_PI);
    want[i] = vx[i] * cdf;
    want_dx[i] = vdy[i] * (cdf + vx[i] * pdf);
  }
  expect_close(y, want);
  expect_close(dx, want_dx);
}

// GELU's tanh approximation against the formula in double (GPT-2's gelu_new).
TEST(Ops, GeluTanh) {
  Tensor x = rand_tensor({3, 257}, 5, -6.0f, 6.0f), dy = rand_tensor({3, 257}, 6);
  Tensor y = Tensor::empty(x.shape()), dx = Tensor::empty(x.shape());
  const auto vx = values(x), vdy = values(dy);
  std::vector<double> want(vx.size()), want_dx(vx.size());
  ops::gelu_tanh_forward(x, y);
  ops::gelu_tanh_backward(x, dy, dx);
  const double k = std::sqrt(2.0 / M_PI);
  for (size_t i = 0; i < vx.size(); ++i) {
    const double v = vx[i], t = std::tanh(k * (v + 0.044715 * v * v * v));
    want[i] = 0.5 * v * (1.0 + t);
    want_dx[i] = vdy[i] * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * v * v));
  }
  expect_close(y, want);
  expect_close(dx, want_dx);
}

// The CPU's GELU computes erf and exp with its own polynomials (ops/cpu/vec_math.hpp): within
// float precision of the exact function everywhere, tails, zeros and non-finite values included.
TEST(Ops, GeluIsWithinFloatPrecisionOfTheExactFunction) {
  std::vector<float> xs;
  for (float v = -40.0f; v <= 40.0f; v += 0.000731f) xs.push_back(v);  // ~110k values, both regions of erf
  for (float v : {0.0f, -0.0f, 1e-30f, -1e-30f, 1.0f, -1.0f, 1.41421354f, -1.41421354f, 5.656854f, -5.656854f, 13.0f,
                  -13.0f, 1e30f, -1e30f})
    xs.push_back(v);
  const int64_t n = static_cast<int64_t>(xs.size());
  Tensor x = Tensor::empty({n}), y = Tensor::empty({n}), ones = Tensor::empty({n}), dx = Tensor::empty({n});
  std::copy(xs.begin(), xs.end(), x.data<float>());
  ops::fill(ones, 1.0f);
  ops::gelu_forward(x, y);
  ops::gelu_backward(x, ones, dx);
  for (int64_t i = 0; i < n; ++i) {
    const double v = xs[static_cast<size_t>(i)];
    const double cdf = 0.5 * std::erfc(-v / std::sqrt(2.0));
    const double pdf = std::exp(-0.5 * v * v) / std::sqrt(2.0 * M_PI);
    const double scale = std::max(std::fabs(v), 1.0);
    ASSERT_LE(std::fabs(y.data<float>()[i] - v * cdf), 2e-7 * scale) << "gelu(" << v << ")";
    ASSERT_LE(std::fabs(dx.data<float>()[i] - (cdf + v * pdf)), 2.5e-7 * scale) << "gelu'(" << v << ")";
  }
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  Tensor special = Tensor::empty({3}), out = Tensor::empty({3});
  std::copy_n(std::vector<float>{inf, -inf, nan}.begin(), 3, special.data<float>());
  ops::gelu_forward(special, out);
  EXPECT_EQ(out.data<float>()[0], inf);
  EXPECT_TRUE(std::isnan(out.data<float>()[1]));  // -inf * Phi(-inf) = -inf * 0, as with erff
  EXPECT_TRUE(std::isnan(out.data<float>()[2]));
}

// GELU runs at the widest vector width this CPU has (ops::cpu_kernel_isa), compiled without FMA,
// so it gives the bits of the same arithmetic done one element at a time in baseline x86-64 code:
// this file's loop. Any thread count, any span boundary.
TEST(Ops, GeluGivesTheSameBitsAtEveryVectorWidth) {
  const int64_t n = 100003;  // not a multiple of any vector width
  Tensor x = rand_tensor({n}, 17), dy = rand_tensor({n}, 18), y = Tensor::empty({n}), dx = Tensor::empty({n});
  for (int64_t i = 0; i < n; i += 7) x.data<float>()[i] *= 9.0f;  // both regions of erf, tails
  for (const int threads : {1, 2, 3}) {
    ops::set_num_threads(threads);
    ops::gelu_forward(x, y);
    ops::gelu_backward(x, dy, dx);
    for (int64_t i = 0; i < n; ++i) {
      const float v = x.data<float>()[i];
      const ops::cpu::vec_math::GeluTerms t = ops::cpu::vec_math::gelu_terms(v);
      const float want_y = v * t.cdf;
      const float want_dx = dy.data<float>()[i] * (t.cdf + v * (ops::cpu::vec_math::kInvSqrt2Pi * t.gauss));
      ASSERT_EQ(std::bit_cast<uint32_t>(y.data<float>()[i]), std::bit_cast<uint32_t>(want_y))
          << "gelu(" << v << ") on " << ops::cpu_kernel_isa() << ", " << threads << " threads";
      ASSERT_EQ(std::bit_cast<uint32_t>(dx.data<float>()[i]), std::bit_cast<uint32_t>(want_dx))
          << "gelu'(" << v << ") on " << ops::cpu_kernel_isa() << ", " << threads << " threads";
    }
  }
  ops::set_num_threads(1);
}

TEST(Ops, DropoutMaskIsAFunctionOfTheGlobalSample) {
  const int64_t n = 6, f = 50;
  const float p = 0.3f;
  Tensor x = rand_tensor({n, f}, 5), y = Tensor::empty({n, f});
  const ops::DropoutKey key{rng::derive_key(9, rng::kDropout), 11, 100};
  ops::dropout_forward(x, y, p, key);
  const auto vx = values(x);
  std::vector<double> want(vx.size());
  int64_t kept = 0;
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t j = 0; j < f; ++j) {
      const bool keep = rng::uniform(key.key, key.stream, static_cast<uint64_t>((100 + s) * f + j)) >= p;
      want[s * f + j] = keep ? vx[s * f + j] / (1.0 - p) : 0.0;
      kept += keep;
    }
  }
  expect_close(y, want);
  EXPECT_GT(kept, 150);  // ~210 expected
  EXPECT_LT(kept, 270);
  // Samples 2..5 computed alone (first_sample + 2) give the same values: split-invariant.
  Tensor y2 = Tensor::empty({4, f});
  ops::dropout_forward(x.slice(2, 6), y2, p, {key.key, key.stream, 102});
  expect_close(y2, std::vector<double>(want.begin() + 2 * f, want.end()));
  // A part of every sample (sequence parallelism: elements [20, 30) of each of the 50) draws the
  // whole samples' mask at its place.
  const int64_t part = 10, at = 20;
  Tensor xp = Tensor::empty({n, part}), yp = Tensor::empty({n, part});
  std::vector<double> want_part;
  for (int64_t s = 0; s < n; ++s)
    for (int64_t j = 0; j < part; ++j) {
      xp.data<float>()[s * part + j] = x.data<float>()[s * f + at + j];
      want_part.push_back(want[s * f + at + j]);
    }
  ops::DropoutKey part_key = key;
  part_key.sample_numel = f;
  part_key.part_offset = at;
  ops::dropout_forward(xp, yp, p, part_key);
  expect_close(yp, want_part);
  // Backward regenerates the same mask.
  Tensor dx = Tensor::empty({n, f});
  ops::dropout_backward(x, dx, p, key);
  expect_close(dx, want);
  // p = 0 is the identity, p = 1 drops everything.
  ops::dropout_forward(x, y, 0.0f, key);
  expect_close(y, vx);
  ops::dropout_forward(x, y, 1.0f, key);
  expect_close(y, std::vector<double>(vx.size(), 0.0));
}

TEST(Ops, CastBetweenFloatFormats) {
  Tensor x = rand_tensor({2, 33}, 6, -1000.0f, 1000.0f);
  Tensor h = Tensor::empty(x.shape(), DType::F16), b = Tensor::empty(x.shape(), DType::BF16);
  Tensor back = Tensor::empty(x.shape());
  ops::cast(x, h);
  ops::cast(x, b);
  for (int64_t i = 0; i < x.numel(); ++i) {
    EXPECT_EQ(h.data<f16>()[i].bits, f16::from_float(x.data<float>()[i]).bits);
    EXPECT_EQ(b.data<bf16>()[i].bits, bf16::from_float(x.data<float>()[i]).bits);
  }
  ops::cast(h, b);  // f16 -> bf16 goes through float
  for (int64_t i = 0; i < x.numel(); ++i)
    EXPECT_EQ(b.data<bf16>()[i].bits, bf16::from_float(h.data<f16>()[i].to_float()).bits);
  ops::cast(h, back);
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_EQ(back.data<float>()[i], h.data<f16>()[i].to_float());
  // Same-dtype copies work for any dtype.
  Tensor i32 = Tensor::empty({5}, DType::I32), j32 = Tensor::empty({5}, DType::I32);
  for (int i = 0; i < 5; ++i) i32.data<int32_t>()[i] = i * 1000003;
  ops::cast(i32, j32);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(j32.data<int32_t>()[i], i * 1000003);
  EXPECT_THROW(ops::cast(i32, x.view(0, {5})), Error);
}

TEST(Ops, NormalizeU8) {
  const int64_t n = 2, c = 3, hw = 7;
  Tensor x = Tensor::empty({n, c, hw}, DType::U8), y = Tensor::empty({n, c, hw});
  for (int64_t i = 0; i < x.numel(); ++i) x.data<uint8_t>()[i] = static_cast<uint8_t>((i * 37) % 256);
  const std::vector<float> mean = {0.5f, 0.4f, 0.3f}, stdv = {0.2f, 0.25f, 0.3f};
  ops::normalize_u8(x, y, 1.0f / 255, mean, stdv);
  std::vector<double> want(x.numel());
  for (int64_t i = 0; i < x.numel(); ++i) {
    const int64_t ch = (i / hw) % c;
    want[i] = (x.data<uint8_t>()[i] / 255.0 - mean[ch]) / stdv[ch];
  }
  expect_close(y, want);
  ops::normalize_u8(x, y, 1.0f, {10.0f}, {2.0f});  // one value for all channels
  for (int64_t i = 0; i < x.numel(); ++i) want[i] = (x.data<uint8_t>()[i] - 10.0) / 2.0;
  expect_close(y, want);
}

// ---- dense -----------------------------------------------------------------------------------

TEST(Ops, GemmAllTransposes) {
  const int64_t m = 5, n = 7, k = 3;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      Tensor a = ta ? rand_tensor({k, m}, 7) : rand_tensor({m, k}, 7);
      Tensor b = tb ? rand_tensor({n, k}, 8) : rand_tensor({k, n}, 8);
      Tensor c = rand_tensor({m, n}, 9);
      const auto vc = values(c);
      std::vector<double> want(m * n);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (int64_t l = 0; l < k; ++l) {
            const double av = ta ? a.data<float>()[l * m + i] : a.data<float>()[i * k + l];
            const double bv = tb ? b.data<float>()[j * k + l] : b.data<float>()[l * n + j];
            s += av * bv;
          }
          want[i * n + j] = 2.0 * s + 0.5 * vc[i * n + j];
        }
      }
      ops::gemm(a, ta, b, tb, c, 2.0f, 0.5f);
      expect_close(c, want);
    }
  }
  EXPECT_THROW(ops::gemm(rand_tensor({2, 3}, 1), false, rand_tensor({2, 3}, 1), false, Tensor::empty({2, 3})), Error);
}

// On several threads a large product is cut into blocks of rows or columns, one OpenBLAS call
// per thread (ops/cpu/gemm.cpp): every block right, whichever dimension is cut, with the
// transposes, leading dimensions and accumulation (beta), and the same bits on every run.
TEST(Ops, GemmSplitAcrossThreadsIsCompleteAndDeterministic) {
  struct Case {
    int64_t m, n, k;
  };
  const int threads = ops::num_threads();
  for (const Case& cs : {Case{301, 67, 90}, Case{40, 517, 130}, Case{2048, 33, 8}, Case{17, 3000, 9}}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const auto [m, n, k] = cs;
        Tensor a = ta ? rand_tensor({k, m}, 13) : rand_tensor({m, k}, 13);
        Tensor b = tb ? rand_tensor({n, k}, 14) : rand_tensor({k, n}, 14);
        const Tensor c0 = rand_tensor({m, n}, 15);
        const auto vc = values(c0);
        std::vector<double> want(static_cast<size_t>(m * n));
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            double acc = 0;
            for (int64_t l = 0; l < k; ++l)
              acc += static_cast<double>(ta ? a.data<float>()[l * m + i] : a.data<float>()[i * k + l]) *
                     (tb ? b.data<float>()[j * k + l] : b.data<float>()[l * n + j]);
            want[static_cast<size_t>(i * n + j)] = 1.5 * acc - 0.5 * vc[static_cast<size_t>(i * n + j)];
          }
        std::vector<std::vector<float>> runs;
        for (const int t : {2, 3, 3}) {
          ops::set_num_threads(t);
          Tensor c = Tensor::empty({m, n});
          ops::copy(c0, c);
          ops::gemm(a, ta, b, tb, c, 1.5f, -0.5f);
          SCOPED_TRACE(::testing::Message()
                       << m << "x" << n << "x" << k << " ta " << ta << " tb " << tb << ", " << t << " threads");
          expect_close(c, want);
          runs.emplace_back(c.data<float>(), c.data<float>() + c.numel());
        }
        EXPECT_EQ(runs[1], runs[2]);
      }
    }
  }
  ops::set_num_threads(threads);
}

TEST(Ops, BiasAddAndGradAccumulate) {
  Tensor y = rand_tensor({4, 3, 5}, 10), bias = rand_tensor({5}, 11), db = rand_tensor({5}, 12);
  const auto vy = values(y), vb = values(bias), vdb = values(db);
  ops::add_bias(y, bias);
  std::vector<double> want(vy.size()), want_db(vdb);
  for (size_t i = 0; i < vy.size(); ++i) want[i] = vy[i] + vb[i % 5];
  expect_close(y, want);
  ops::bias_grad(y, db);
  for (size_t i = 0; i < vy.size(); ++i) want_db[i % 5] += want[i];
  expect_close(db, want_db);
}

// ---- convolution -----------------------------------------------------------------------------

namespace {
struct ConvCase {
  int64_t n, c, o, h, w, kh, kw, stride, pad;
};

void check_conv(const ConvCase& k, bool with_bias) {
  ops::Conv2dGeometry g{k.c, k.o, k.kh, k.kw, k.stride, k.pad, k.h, k.w};
  const int64_t oh = g.out_h(), ow = g.out_w();
  Tensor x = rand_tensor({k.n, k.c, k.h, k.w}, 20), w = rand_tensor({k.o, k.c, k.kh, k.kw}, 21);
  Tensor bias = with_bias ? rand_tensor({k.o}, 22) : Tensor();
  Tensor y = Tensor::empty({k.n, k.o, oh, ow}), dy = rand_tensor({k.n, k.o, oh, ow}, 23);
  Tensor dx = rand_tensor(x.shape(), 24), dw = rand_tensor(w.shape(), 25), db = rand_tensor({k.o}, 26);
  std::vector<double> want_y(y.numel()), want_dx(x.numel(), 0.0), want_dw = values(dw), want_db = values(db);
  const std::vector<double> dw0 = values(dw);
  const float* X = x.data<float>();
  const float* W = w.data<float>();
  const float* DY = dy.data<float>();
  for (int64_t n = 0; n < k.n; ++n)
    for (int64_t o = 0; o < k.o; ++o)
      for (int64_t i = 0; i < oh; ++i)
        for (int64_t j = 0; j < ow; ++j) {
          const int64_t yi = ((n * k.o + o) * oh + i) * ow + j;
          double s = with_bias ? bias.data<float>()[o] : 0.0;
          for (int64_t c = 0; c < k.c; ++c)
            for (int64_t a = 0; a < k.kh; ++a)
              for (int64_t b = 0; b < k.kw; ++b) {
                const int64_t ih = i * k.stride - k.pad + a, iw = j * k.stride - k.pad + b;
                if (ih < 0 || ih >= k.h || iw < 0 || iw >= k.w) continue;
                const int64_t xi = ((n * k.c + c) * k.h + ih) * k.w + iw;
                const int64_t wi = ((o * k.c + c) * k.kh + a) * k.kw + b;
                s += static_cast<double>(X[xi]) * W[wi];
                want_dx[xi] += static_cast<double>(W[wi]) * DY[yi];
                want_dw[wi] += static_cast<double>(X[xi]) * DY[yi];
              }
          want_y[yi] = s;
          want_db[o] += DY[yi];
        }
  ops::conv2d_forward(x, w, bias, y, g);
  expect_close(y, want_y);
  ops::conv2d_backward(x, w, dy, dx, dw, with_bias ? db : Tensor(), g);
  expect_close(dx, want_dx);
  expect_close(dw, want_dw);
  if (with_bias) expect_close(db, want_db);
  // dx and dw are optional.
  Tensor dw2 = Tensor::zeros(w.shape());
  ops::conv2d_backward(x, w, dy, Tensor(), dw2, Tensor(), g);
  for (size_t i = 0; i < want_dw.size(); ++i) want_dw[i] -= dw0[i];
  expect_close(dw2, want_dw);
}
}  // namespace

TEST(Ops, Conv2dStridePaddingNonSquare) {
  check_conv({2, 3, 4, 7, 5, 3, 2, 2, 1}, true);   // non-square image and kernel, stride 2, pad 1
  check_conv({3, 2, 5, 6, 6, 3, 3, 1, 1}, true);   // the CNN's 3x3/1 pad 1
  check_conv({1, 4, 3, 9, 8, 5, 5, 3, 2}, false);  // stride 3, pad 2, no bias
  check_conv({2, 5, 6, 4, 3, 1, 1, 1, 0}, true);   // 1x1: the pointwise path
  check_conv({2, 2, 3, 5, 7, 2, 2, 2, 0}, true);   // stride 2, no padding
  check_conv({2, 3, 4, 6, 5, 3, 1, 1, 0}, true);   // 3x1: same width, shorter height
  check_conv({1, 2, 3, 5, 6, 5, 5, 1, 2}, true);   // 5x5 pad 2 on an image barely larger than the kernel
  check_conv({1, 2, 2, 2, 3, 3, 3, 1, 1}, true);   // 3x3 pad 1 on a 2x3 image: padding rows everywhere
}

TEST(Ops, Conv2dRejectsBadShapes) {
  ops::Conv2dGeometry g{3, 4, 3, 3, 1, 1, 8, 8};
  Tensor x = Tensor::empty({2, 3, 8, 8}), w = Tensor::empty({4, 3, 3, 3});
  EXPECT_THROW(ops::conv2d_forward(x, w, Tensor(), Tensor::empty({2, 4, 7, 8}), g), Error);
  EXPECT_THROW(ops::conv2d_forward(x, Tensor::empty({4, 2, 3, 3}), Tensor(), Tensor::empty({2, 4, 8, 8}), g), Error);
  EXPECT_THROW(ops::conv2d_forward(x, w, Tensor::empty({5}), Tensor::empty({2, 4, 8, 8}), g), Error);
}

// ---- pooling ---------------------------------------------------------------------------------

namespace {
void check_pools(int64_t n, int64_t c, int64_t h, int64_t w, ops::Pool2dGeometry g) {
  g.in_h = h;
  g.in_w = w;
  const int64_t oh = g.out_h(), ow = g.out_w();
  Tensor x = rand_tensor({n, c, h, w}, 30), dy = rand_tensor({n, c, oh, ow}, 31);
  Tensor y = Tensor::empty({n, c, oh, ow}), arg = Tensor::empty({n, c, oh, ow}, DType::I32);
  Tensor dx = rand_tensor(x.shape(), 32);
  std::vector<double> want_max(y.numel()), want_avg(y.numel()), want_dmax(x.numel(), 0.0), want_davg(x.numel(), 0.0);
  std::vector<int32_t> want_arg(y.numel());
  for (int64_t q = 0; q < n * c; ++q)
    for (int64_t i = 0; i < oh; ++i)
      for (int64_t j = 0; j < ow; ++j) {
        const int64_t yi = (q * oh + i) * ow + j;
        double best = -std::numeric_limits<double>::infinity(), sum = 0;
        int32_t best_at = -1;
        for (int64_t a = 0; a < g.kernel; ++a)
          for (int64_t b = 0; b < g.kernel; ++b) {
            const int64_t ih = i * g.stride - g.padding + a, iw = j * g.stride - g.padding + b;
            if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;  // padding: -inf for max, 0 for avg
            const double v = x.data<float>()[q * h * w + ih * w + iw];
            sum += v;
            if (v > best) best = v, best_at = static_cast<int32_t>(ih * w + iw);
          }
        want_max[yi] = best;
        want_arg[yi] = best_at;
        want_avg[yi] = sum / static_cast<double>(g.kernel * g.kernel);
        want_dmax[q * h * w + best_at] += dy.data<float>()[yi];
        for (int64_t a = 0; a < g.kernel; ++a)
          for (int64_t b = 0; b < g.kernel; ++b) {
            const int64_t ih = i * g.stride - g.padding + a, iw = j * g.stride - g.padding + b;
            if (ih >= 0 && ih < h && iw >= 0 && iw < w)
              want_davg[q * h * w + ih * w + iw] += dy.data<float>()[yi] / static_cast<double>(g.kernel * g.kernel);
          }
      }
  ops::max_pool2d_forward(x, y, arg, g);
  expect_close(y, want_max);
  for (int64_t i = 0; i < y.numel(); ++i) ASSERT_EQ(arg.data<int32_t>()[i], want_arg[i]);
  ops::max_pool2d_backward(dy, arg, dx, g);
  expect_close(dx, want_dmax);
  ops::avg_pool2d_forward(x, y, g);
  expect_close(y, want_avg);
  ops::avg_pool2d_backward(dy, dx, g);
  expect_close(dx, want_davg);
}
}  // namespace

TEST(Ops, Pool2d) {
  check_pools(2, 3, 7, 9, {3, 2, 1});  // overlapping windows with padding, odd sizes
  check_pools(2, 2, 8, 6, {2, 2, 0});  // the 2x2/2 fast path
  check_pools(1, 2, 7, 5, {2, 2, 0});  // 2x2/2 with a dropped last row/column
  check_pools(1, 1, 6, 6, {2, 1, 1});  // stride 1, padded
}

TEST(Ops, ReluPropagatesNanAsTorch) {  // torch.relu(nan) = nan; its gradient there is 0
  Tensor x = Tensor::empty({3}), y = Tensor::empty({3}), dy = Tensor::empty({3}), dx = Tensor::empty({3});
  x.data<float>()[0] = std::nanf("");
  x.data<float>()[1] = -2.0f;
  x.data<float>()[2] = 3.0f;
  ops::fill(dy, 1.0f);
  ops::relu_forward(x, y);
  EXPECT_TRUE(std::isnan(y.data<float>()[0]));
  EXPECT_EQ(y.data<float>()[1], 0.0f);
  EXPECT_EQ(y.data<float>()[2], 3.0f);
  ops::relu_backward(y, dy, dx);
  EXPECT_EQ(dx.data<float>()[0], 0.0f);
  EXPECT_EQ(dx.data<float>()[1], 0.0f);
  EXPECT_EQ(dx.data<float>()[2], 1.0f);
}

TEST(Ops, MaxPoolPropagatesNan) {
  Tensor x = Tensor::zeros({1, 1, 2, 2}), y = Tensor::empty({1, 1, 1, 1}),
         arg = Tensor::empty({1, 1, 1, 1}, DType::I32);
  x.data<float>()[2] = std::nanf("");
  x.data<float>()[3] = 5.0f;
  ops::max_pool2d_forward(x, y, arg, {2, 2, 0, 2, 2});
  EXPECT_TRUE(std::isnan(y.data<float>()[0]));
}

TEST(Ops, GlobalAvgPool) {
  Tensor x = rand_tensor({3, 4, 5, 3}, 33), y = Tensor::empty({3, 4}), dy = rand_tensor({3, 4}, 34);
  Tensor dx = Tensor::empty(x.shape());
  std::vector<double> want(12, 0.0), want_dx(x.numel());
  for (int64_t i = 0; i < x.numel(); ++i) {
    want[i / 15] += x.data<float>()[i] / 15.0;
    want_dx[i] = dy.data<float>()[i / 15] / 15.0;
  }
  ops::global_avg_pool_forward(x, y);
  expect_close(y, want);
  ops::global_avg_pool_backward(dy, dx);
  expect_close(dx, want_dx);
}

// ---- normalisation ---------------------------------------------------------------------------

TEST(Ops, BatchNormTrainEvalBackward) {
  const int64_t n = 3, c = 4, hw = 10, m = n * hw;
  Tensor x = rand_tensor({n, c, 2, 5}, 40, -2.0f, 3.0f), gamma = rand_tensor({c}, 41), beta = rand_tensor({c}, 42);
  Tensor y = Tensor::empty(x.shape()), mean = Tensor::empty({c}), invstd = Tensor::empty({c});
  Tensor rm = rand_tensor({c}, 43), rv = rand_tensor({c}, 44, 0.5f, 2.0f);
  const auto vrm = values(rm), vrv = values(rv);
  const float momentum = 0.1f, eps = 1e-5f;
  ops::batch_norm_forward_train(x, gamma, beta, y, mean, invstd, rm, rv, momentum, eps);
  Tensor dy = rand_tensor(x.shape(), 45), dx = Tensor::empty(x.shape());
  Tensor dgamma = rand_tensor({c}, 46), dbeta = rand_tensor({c}, 47);
  std::vector<double> want_y(x.numel()), want_dx(x.numel()), want_dg = values(dgamma), want_db = values(dbeta);
  std::vector<double> want_mean(c), want_invstd(c), want_rm(c), want_rv(c);
  auto at = [&](int64_t s, int64_t ch, int64_t i) { return (s * c + ch) * hw + i; };
  for (int64_t ch = 0; ch < c; ++ch) {
    double mu = 0, var = 0;
    for (int64_t s = 0; s < n; ++s)
      for (int64_t i = 0; i < hw; ++i) mu += x.data<float>()[at(s, ch, i)] / m;
    for (int64_t s = 0; s < n; ++s)
      for (int64_t i = 0; i < hw; ++i) var += std::pow(x.data<float>()[at(s, ch, i)] - mu, 2) / m;
    const double is = 1.0 / std::sqrt(var + eps), g = gamma.data<float>()[ch];
    want_mean[ch] = mu;
    want_invstd[ch] = is;
    want_rm[ch] = (1 - momentum) * vrm[ch] + momentum * mu;
    want_rv[ch] = (1 - momentum) * vrv[ch] + momentum * var * m / (m - 1);
    double sdy = 0, sdyx = 0;
    for (int64_t s = 0; s < n; ++s)
      for (int64_t i = 0; i < hw; ++i) {
        const int64_t k = at(s, ch, i);
        const double xh = (x.data<float>()[k] - mu) * is;
        want_y[k] = xh * g + beta.data<float>()[ch];
        sdy += dy.data<float>()[k];
        sdyx += dy.data<float>()[k] * xh;
      }
    want_dg[ch] += sdyx;
    want_db[ch] += sdy;
    for (int64_t s = 0; s < n; ++s)
      for (int64_t i = 0; i < hw; ++i) {
        const int64_t k = at(s, ch, i);
        const double xh = (x.data<float>()[k] - mu) * is;
        want_dx[k] = g * is / m * (m * dy.data<float>()[k] - sdy - xh * sdyx);
      }
  }
  expect_close(y, want_y);
  expect_close(mean, want_mean);
  expect_close(invstd, want_invstd);
  expect_close(rm, want_rm);
  expect_close(rv, want_rv);
  ops::batch_norm_backward(x, dy, gamma, mean, invstd, dx, dgamma, dbeta);
  expect_close(dx, want_dx, 1e-4);  // dx subtracts means of similar size: a few ulps more
  expect_close(dgamma, want_dg);
  expect_close(dbeta, want_db);

  ops::batch_norm_forward_eval(x, gamma, beta, rm, rv, y, eps);
  for (int64_t k = 0; k < x.numel(); ++k) {
    const int64_t ch = (k / hw) % c;
    want_y[k] = (x.data<float>()[k] - want_rm[ch]) / std::sqrt(want_rv[ch] + eps) * gamma.data<float>()[ch] +
                beta.data<float>()[ch];
  }
  expect_close(y, want_y);
}

TEST(Ops, LayerNormForwardBackward) {
  const int64_t rows = 6, f = 37;
  Tensor x = rand_tensor({2, 3, f}, 50, -2.0f, 3.0f), gamma = rand_tensor({f}, 51), beta = rand_tensor({f}, 52);
  Tensor y = Tensor::empty(x.shape()), mean = Tensor::empty({2, 3}), rstd = Tensor::empty({2, 3});
  const float eps = 1e-5f;
  ops::layer_norm_forward(x, gamma, beta, y, mean, rstd, eps);
  Tensor dy = rand_tensor(x.shape(), 53), dx = Tensor::empty(x.shape());
  Tensor dg = rand_tensor({f}, 54), db = rand_tensor({f}, 55);
  std::vector<double> want_y(x.numel()), want_dx(x.numel()), want_dg = values(dg), want_db = values(db);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data<float>() + r * f;
    const float* gr = dy.data<float>() + r * f;
    double mu = 0, var = 0;
    for (int64_t i = 0; i < f; ++i) mu += xr[i] / static_cast<double>(f);
    for (int64_t i = 0; i < f; ++i) var += (xr[i] - mu) * (xr[i] - mu) / f;
    const double rs = 1.0 / std::sqrt(var + eps);
    EXPECT_NEAR(mean.data<float>()[r], mu, 1e-6);
    EXPECT_NEAR(rstd.data<float>()[r], rs, 1e-5 * rs);
    double s1 = 0, s2 = 0;
    for (int64_t i = 0; i < f; ++i) {
      const double xh = (xr[i] - mu) * rs, dxh = gr[i] * gamma.data<float>()[i];
      want_y[r * f + i] = xh * gamma.data<float>()[i] + beta.data<float>()[i];
      want_dg[i] += gr[i] * xh;
      want_db[i] += gr[i];
      s1 += dxh;
      s2 += dxh * xh;
    }
    for (int64_t i = 0; i < f; ++i) {
      const double xh = (xr[i] - mu) * rs, dxh = gr[i] * gamma.data<float>()[i];
      want_dx[r * f + i] = rs * (dxh - s1 / f - xh * s2 / f);
    }
  }
  expect_close(y, want_y);
  ops::layer_norm_backward(x, dy, gamma, mean, rstd, dx, dg, db);
  expect_close(dx, want_dx, 1e-4);
  expect_close(dg, want_dg);
  expect_close(db, want_db);
}

// ---- loss and metrics ------------------------------------------------------------------------

TEST(Ops, SoftmaxXentAndCountCorrect) {
  const int64_t n = 5, k = 7;
  Tensor logits = rand_tensor({n, k}, 60, -5.0f, 5.0f);
  logits.data<float>()[0] = 80.0f;  // large logits must not overflow
  Tensor labels = labels_of({0, 3, 6, 2, 2});
  Tensor probs = Tensor::empty({n, k}), dl = Tensor::empty({n, k});
  const double loss = ops::softmax_xent_forward(logits, labels, probs);
  std::vector<double> want_p(n * k), want_d(n * k);
  double want_loss = 0;
  int64_t want_correct = 0;
  for (int64_t r = 0; r < n; ++r) {
    const float* z = logits.data<float>() + r * k;
    const double mx = *std::max_element(z, z + k);
    double s = 0;
    for (int64_t j = 0; j < k; ++j) s += std::exp(z[j] - mx);
    const int32_t l = labels.data<int32_t>()[r];
    want_loss += -(z[l] - mx - std::log(s));
    for (int64_t j = 0; j < k; ++j) {
      want_p[r * k + j] = std::exp(z[j] - mx) / s;
      want_d[r * k + j] = (want_p[r * k + j] - (j == l)) * 0.25;
    }
    want_correct += (std::max_element(z, z + k) - z) == l;
  }
  EXPECT_NEAR(loss, want_loss, 1e-5 * std::fabs(want_loss));
  expect_close(probs, want_p);
  ops::softmax_xent_backward(probs, labels, dl, 0.25f);
  expect_close(dl, want_d);
  EXPECT_EQ(ops::count_correct(logits, labels), want_correct);
  // Ties go to the first maximum, as torch.argmax.
  Tensor tie = Tensor::zeros({1, 3});
  EXPECT_EQ(ops::count_correct(tie, labels_of({0})), 1);
  EXPECT_EQ(ops::count_correct(tie, labels_of({1})), 0);
  EXPECT_THROW(ops::softmax_xent_forward(logits, labels_of({0, 1, 2, 3, 7}), probs), Error);
}

// A language model's loss has B * T rows, computed in parallel: the same bits on 1 and 2
// threads, and a NaN logit still makes its row's loss and probabilities NaN.
TEST(Ops, SoftmaxXentDoesNotDependOnTheThreadCount) {
  const int64_t n = 64, k = 1000;
  Tensor logits = rand_tensor({n, k}, 61, -8.0f, 8.0f);
  std::vector<int32_t> l(n);
  for (int64_t r = 0; r < n; ++r) l[static_cast<size_t>(r)] = static_cast<int32_t>((r * 37) % k);
  const Tensor labels = labels_of(l);
  const int threads = ops::num_threads();
  std::vector<double> losses;
  std::vector<std::vector<float>> probs, grads;
  for (const int t : {1, 2}) {
    ops::set_num_threads(t);
    Tensor p = Tensor::empty({n, k}), d = Tensor::empty({n, k});
    losses.push_back(ops::softmax_xent_forward(logits, labels, p));
    ops::softmax_xent_backward(p, labels, d, 1.0f / n);
    probs.emplace_back(p.data<float>(), p.data<float>() + p.numel());
    grads.emplace_back(d.data<float>(), d.data<float>() + d.numel());
  }
  ops::set_num_threads(threads);
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(probs[0], probs[1]);
  EXPECT_EQ(grads[0], grads[1]);
  logits.data<float>()[3 * k + 5] = std::nanf("");
  Tensor p = Tensor::empty({n, k});
  EXPECT_TRUE(std::isnan(ops::softmax_xent_forward(logits, labels, p)));
  EXPECT_TRUE(std::isnan(p.data<float>()[3 * k]));
  EXPECT_FALSE(std::isnan(p.data<float>()[2 * k]));
}

// ---- reductions and optimizers ---------------------------------------------------------------

TEST(Ops, SumSquaresAndAllFinite) {
  Tensor x = rand_tensor({100003}, 70);
  double want = 0;
  for (int64_t i = 0; i < x.numel(); ++i) want += static_cast<double>(x.data<float>()[i]) * x.data<float>()[i];
  EXPECT_NEAR(ops::sum_squares(x), want, 1e-12 * want);
  EXPECT_TRUE(ops::all_finite(x));
  x.data<float>()[77777] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(ops::all_finite(x));
  x.data<float>()[77777] = -std::numeric_limits<float>::infinity();
  EXPECT_FALSE(ops::all_finite(x));
  x.data<float>()[77777] = std::nanf("");
  EXPECT_FALSE(ops::all_finite(x));
  x.data<float>()[77777] = std::numeric_limits<float>::max();
  EXPECT_TRUE(ops::all_finite(x));
}

TEST(Ops, SgdMatchesTorchAlgorithm) {
  const ops::SgdParams cases[] = {{0.1f, 0.0f, 0.0f, 0.0f, false},
                                  {0.1f, 0.9f, 0.0f, 0.01f, false},
                                  {0.05f, 0.9f, 0.0f, 0.0f, true},
                                  {0.05f, 0.8f, 0.0f, 0.1f, true}};
  for (const auto& p : cases) {
    const int64_t n = 101;
    Tensor param = rand_tensor({n}, 80), buf = Tensor::zeros({n});
    std::vector<double> ref_p = values(param), ref_buf(n);
    bool first = true;
    for (int step = 0; step < 3; ++step) {
      Tensor grad = rand_tensor({n}, 81 + step);
      ops::sgd_update(param, grad, p.momentum != 0 ? buf : Tensor(), p);
      // torch.optim.SGD, literally (buffer created by clone on the first step).
      for (int64_t i = 0; i < n; ++i) {
        double d = grad.data<float>()[i] + p.weight_decay * ref_p[i];
        if (p.momentum != 0) {
          ref_buf[i] = first ? d : p.momentum * ref_buf[i] + (1 - p.dampening) * d;
          d = p.nesterov ? d + p.momentum * ref_buf[i] : ref_buf[i];
        }
        ref_p[i] -= p.lr * d;
      }
      first = false;
      expect_close(param, ref_p);
    }
  }
  Tensor a = Tensor::zeros({3});
  EXPECT_THROW(ops::sgd_update(a, a, Tensor(), {0.1f, 0.9f}), Error);  // momentum needs a buffer
}

TEST(Ops, AdamWMatchesTorchAlgorithm) {
  const int64_t n = 97;
  const ops::AdamWParams base{1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1};
  Tensor param = rand_tensor({n}, 90), m = Tensor::zeros({n}), v = Tensor::zeros({n});
  std::vector<double> rp = values(param), rm(n, 0.0), rv(n, 0.0);
  for (int64_t t = 1; t <= 4; ++t) {
    Tensor grad = rand_tensor({n}, 91 + static_cast<uint32_t>(t));
    ops::AdamWParams p = base;
    p.step = t;
    ops::adamw_update(param, grad, m, v, p);
    const double b1 = p.beta1, b2 = p.beta2, bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (int64_t i = 0; i < n; ++i) {
      const double g = grad.data<float>()[i];
      rp[i] *= 1 - static_cast<double>(p.lr) * p.weight_decay;
      rm[i] = b1 * rm[i] + (1 - b1) * g;
      rv[i] = b2 * rv[i] + (1 - b2) * g * g;
      const double denom = std::sqrt(rv[i]) / std::sqrt(bc2) + p.eps;
      rp[i] -= p.lr / bc1 * rm[i] / denom;
    }
    expect_close(param, rp);
    expect_close(m, rm);
    expect_close(v, rv);
  }
}

// ---- argument checks -------------------------------------------------------------------------

TEST(Ops, ChecksShapesAndDtypes) {
  Tensor a = Tensor::zeros({4}), b = Tensor::zeros({5}), i = Tensor::zeros({4}, DType::I32);
  EXPECT_THROW(ops::add(a, b, a), Error);
  EXPECT_THROW(ops::relu_forward(a, i), Error);
  EXPECT_THROW(ops::fill(Tensor(), 1.0f), Error);
  EXPECT_THROW(ops::add_bias(Tensor::zeros({2, 3}), Tensor::zeros({2})), Error);
  EXPECT_THROW(ops::dropout_forward(a, a, 1.5f, {}), Error);
  EXPECT_THROW(ops::max_pool2d_forward(Tensor::zeros({1, 1, 4, 4}), Tensor::zeros({1, 1, 2, 2}),
                                       Tensor::zeros({1, 1, 2, 2}), {2, 2, 0, 4, 4}),
               Error);  // argmax must be i32
}

// --flush-denormals: results below the smallest normal float become zero (FTZ) and denormal
// operands count as zero (DAZ) on every thread of the kernels, and gradual underflow is back
// when it is off. On x86 only (elsewhere the call changes nothing).
TEST(Ops, FlushDenormals) {
#if defined(__x86_64__) || defined(__i386__)
  const int threads = ops::num_threads();
  ops::set_num_threads(2);
  const int64_t n = 1 << 20;                                           // large enough to be cut across the threads
  const float tiny = std::numeric_limits<float>::denorm_min() * 1000;  // a denormal, ~1.4e-42
  const auto scaled = [&](float value, float alpha) {
    const Tensor x = Tensor::empty({n});
    std::fill_n(x.data<float>(), n, value);
    ops::scale(x, alpha);
    return values(x);
  };
  const auto all_equal = [](const std::vector<double>& v, float want) {
    return std::all_of(v.begin(), v.end(), [&](double f) { return f == static_cast<double>(want); });
  };
  ops::set_flush_denormals(true);
  EXPECT_TRUE(all_equal(scaled(1e-20f, 1e-20f), 0.0f)) << "a denormal result not flushed";
  EXPECT_TRUE(all_equal(scaled(tiny, 1e10f), 0.0f)) << "a denormal operand not taken as zero";
  ops::set_flush_denormals(false);
  const std::vector<double> gradual = scaled(1e-20f, 1e-20f);
  EXPECT_TRUE(all_equal(gradual, 1e-20f * 1e-20f) && gradual[0] > 0) << "gradual underflow not restored";
  EXPECT_TRUE(all_equal(scaled(tiny, 1e10f), tiny * 1e10f));
  ops::set_num_threads(threads);
#else
  GTEST_SKIP() << "flush-to-zero is x86's MXCSR";
#endif
}
