// The ops on bf16/f16 tensors (CPU): low-precision storage with f32 arithmetic, so each op on
// rounded inputs must give exactly the f32 op's result on the same values, rounded once; f32
// gradient buffers accumulate low-precision contributions unrounded. And the dtype rules. bf16
// GEMMs on a CPU with bf16 units sum in the units' order instead: within f32's summation bound.
// CTest runs this file twice, the second time with the units turned off (DNNL_MAX_CPU_ISA).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/ops.hpp"

using namespace strata;

namespace {

Tensor rand_f32(Shape shape, uint32_t seed) {
  Tensor t = Tensor::empty(std::move(shape));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = d(gen);
  return t;
}

Tensor converted(const Tensor& t, DType dtype) {
  Tensor out = Tensor::empty(t.shape(), dtype);
  ops::cast(t, out);
  return out;
}

// Bitwise equality of two tensors of one dtype.
void expect_same_bits(const Tensor& got, const Tensor& want, const char* what) {
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.numel(), want.numel()) << what;
  EXPECT_EQ(std::memcmp(got.raw(), want.raw(), got.nbytes()), 0) << what << " differs from the rounded f32 result";
}

class LowPrecision : public ::testing::TestWithParam<DType> {
 protected:
  // A random tensor already representable in the low-precision dtype: (low, its f32 value).
  std::pair<Tensor, Tensor> rounded(Shape shape, uint32_t seed) const {
    Tensor low = converted(rand_f32(std::move(shape), seed), GetParam());
    return {low, converted(low, DType::F32)};
  }
};

}  // namespace

TEST_P(LowPrecision, ElementwiseAndActivationsRoundOnce) {
  const DType dt = GetParam();
  auto [x, xf] = rounded({1037}, 1);
  auto [b, bf] = rounded({1037}, 2);
  Tensor y = Tensor::empty({1037}, dt), yf = Tensor::empty({1037});
  ops::gelu_forward(x, y);
  ops::gelu_forward(xf, yf);
  expect_same_bits(y, converted(yf, dt), "gelu");
  ops::gelu_backward(x, b, y);
  ops::gelu_backward(xf, bf, yf);
  expect_same_bits(y, converted(yf, dt), "gelu_backward");
  ops::add(x, b, y);
  ops::add(xf, bf, yf);
  expect_same_bits(y, converted(yf, dt), "add");
  // axpy into the low-precision dtype and into f32 (a gradient into f32 accumulation).
  Tensor acc = y.clone(), accf = converted(y, DType::F32);
  ops::axpy(-0.37f, x, acc);
  ops::axpy(-0.37f, xf, accf);
  expect_same_bits(acc, converted(accf, dt), "axpy");
  Tensor acc32 = rand_f32({1037}, 3), acc32f = acc32.clone();
  ops::axpy(1.5f, x, acc32);
  ops::axpy(1.5f, xf, acc32f);
  expect_same_bits(acc32, acc32f, "axpy into f32");
  ops::relu_backward(x, b, y);
  ops::relu_backward(xf, bf, yf);
  expect_same_bits(y, converted(yf, dt), "relu_backward");
  ops::dropout_forward(x, y, 0.3f, {7, 1, 0});
  ops::dropout_forward(xf, yf, 0.3f, {7, 1, 0});
  expect_same_bits(y, converted(yf, dt), "dropout");
}

// The bias ops stage a row at a time (bias_grad into an f32 or a low-precision gradient).
TEST_P(LowPrecision, BiasOpsRoundOnce) {
  const DType dt = GetParam();
  auto [y, yf] = rounded({61, 17}, 8);
  auto [bias, biasf] = rounded({17}, 9);
  ops::add_bias(y, bias);
  ops::add_bias(yf, biasf);
  expect_same_bits(y, converted(yf, dt), "add_bias");
  yf = converted(y, DType::F32);
  Tensor db = rand_f32({17}, 10), dbf = db.clone();
  ops::bias_grad(y, db);
  ops::bias_grad(yf, dbf);
  expect_same_bits(db, dbf, "bias_grad into f32");
  Tensor dbl = converted(rand_f32({17}, 11), dt), dblf = converted(dbl, DType::F32);
  ops::bias_grad(y, dbl);
  ops::bias_grad(yf, dblf);
  expect_same_bits(dbl, converted(dblf, dt), "bias_grad into the low-precision dtype");
}

// Casts run at the CPU's vector width: the same bits as the scalar conversions (dtype.hpp, tested
// exhaustively against their definition in test_dtype), for every bf16 and for f32 patterns
// around each rounding case (ties, NaN payloads, infinities, subnormals, the largest finite).
TEST(Casts, MatchTheScalarConversions) {
  Tensor all_bf16 = Tensor::empty({1 << 16}, DType::BF16), widened = Tensor::empty({1 << 16});
  for (uint32_t b = 0; b < (1u << 16); ++b) all_bf16.data<bf16>()[b].bits = static_cast<uint16_t>(b);
  ops::cast(all_bf16, widened);
  for (uint32_t b = 0; b < (1u << 16); ++b) {
    const float want = all_bf16.data<bf16>()[b].to_float();
    ASSERT_EQ(std::memcmp(&widened.data<float>()[b], &want, 4), 0) << std::hex << b;
  }
  std::vector<uint32_t> patterns;
  std::mt19937 gen(12);
  for (uint32_t high = 0; high < (1u << 16); high += 7)  // each low half that rounds differently
    for (uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, static_cast<uint32_t>(gen() & 0xffff)})
      patterns.push_back(high << 16 | low);
  for (uint32_t special :
       {0x7f7fffffu, 0x7f7f8000u, 0x7f800000u, 0x7f800001u, 0x7fc00000u, 0xffffffffu, 0x00000001u, 0x807fffffu})
    patterns.push_back(special);
  const auto n = static_cast<int64_t>(patterns.size());
  Tensor f = Tensor::empty({n}), rounded_bf16 = Tensor::empty({n}, DType::BF16);
  std::memcpy(f.raw(), patterns.data(), f.nbytes());
  ops::cast(f, rounded_bf16);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(rounded_bf16.data<bf16>()[i].bits, bf16::from_float(f.data<float>()[i]).bits)
        << std::hex << patterns[static_cast<size_t>(i)];
}

// Each element of the exact product's error bound: |computed - exact| <= slack * sum_k |a||b| in f32
// (any summation order of k terms) plus `rel` of the exact value (the output's one rounding).
void expect_within_product_bound(const Tensor& got, const std::vector<double>& exact,
                                 const std::vector<double>& abs_sum, int64_t k, double rel, const char* what) {
  const double f32_slack = static_cast<double>(k + 1) * std::ldexp(1.0, -24);
  const Tensor g = converted(got, DType::F32);
  for (size_t i = 0; i < exact.size(); ++i)
    ASSERT_LE(std::fabs(g.data<float>()[i] - exact[i]), rel * std::fabs(exact[i]) + 2 * f32_slack * abs_sum[i])
        << what << " element " << i;
}

TEST_P(LowPrecision, GemmWritesLowPrecisionOrAccumulatesF32) {
  const DType dt = GetParam();
  const int64_t m = 13, n = 17, k = 29;
  auto [a, af] = rounded({m, k}, 3);
  auto [w, wf] = rounded({n, k}, 4);
  Tensor c = Tensor::empty({m, n}, dt), cf = Tensor::empty({m, n});
  ops::gemm(a, false, w, true, c);
  ops::gemm(af, false, wf, true, cf);
  // Parameter gradients: f32 buffers accumulate the low-precision operands' product unrounded.
  Tensor dw = rand_f32({n, k}, 5), dwf = dw.clone(), dw0 = dw.clone();
  ops::gemm(c, true, a, false, dw, 1.0f, 1.0f);
  ops::gemm(converted(c, DType::F32), true, af, false, dwf, 1.0f, 1.0f);
  if (dt == DType::F16 || ops::bf16_matrix_units().empty()) {
    // f32 arithmetic on the widened operands: exactly the f32 GEMM, rounded once.
    expect_same_bits(c, converted(cf, dt), "gemm into a low-precision c");
    expect_same_bits(dw, dwf, "gemm accumulated into f32");
    return;
  }
  // bf16 on the CPU's bf16 units (oneDNN): the same exact products, summed in f32 in the units'
  // own order, so within f32's summation bound of the exact product rather than bitwise the
  // f32 GEMM's; c is rounded once to bf16 (relative 2^-8).
  std::vector<double> exact(static_cast<size_t>(m * n)), abs_sum(exact.size());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t l = 0; l < k; ++l) {
        const double p = static_cast<double>(af.data<float>()[i * k + l]) * wf.data<float>()[j * k + l];
        exact[static_cast<size_t>(i * n + j)] += p;
        abs_sum[static_cast<size_t>(i * n + j)] += std::fabs(p);
      }
  expect_within_product_bound(c, exact, abs_sum, k, std::ldexp(1.0, -8), "gemm into a bf16 c");
  const Tensor cw = converted(c, DType::F32);  // dw += c^T a, over the m rows
  std::vector<double> exact_dw(static_cast<size_t>(n * k)), abs_dw(exact_dw.size());
  for (int64_t j = 0; j < n; ++j)
    for (int64_t l = 0; l < k; ++l) {
      double sum = dw0.data<float>()[j * k + l], abs = std::fabs(sum);
      for (int64_t i = 0; i < m; ++i) {
        const double p = static_cast<double>(cw.data<float>()[i * n + j]) * af.data<float>()[i * k + l];
        sum += p;
        abs += std::fabs(p);
      }
      exact_dw[static_cast<size_t>(j * k + l)] = sum;
      abs_dw[static_cast<size_t>(j * k + l)] = abs;
    }
  expect_within_product_bound(dw, exact_dw, abs_dw, m + 1, 0.0, "gemm accumulated into f32");
}

// bf16 GEMMs use the CPU's bf16 units wherever it has them, unless DNNL_MAX_CPU_ISA caps oneDNN
// below them (this file's second CTest entry): a lost fast path fails here, not in a benchmark.
TEST(Bf16MatrixUnits, UsedWhereTheCpuHasThem) {
  __builtin_cpu_init();
  const bool capped = std::getenv("DNNL_MAX_CPU_ISA") != nullptr;
  const bool expected = __builtin_cpu_supports("avx512bf16") && !capped;
  EXPECT_EQ(!ops::bf16_matrix_units().empty(), expected) << "units: '" << ops::bf16_matrix_units() << "'";
}

// A convolution's outputs and gradients in double from its definition, with the sums of the
// terms' magnitudes (expect_within_product_bound): y = b + w * x, dx = w^T * dy, dw = dy * x.
struct ConvSums {
  std::vector<double> y, y_abs, dx, dx_abs, dw, dw_abs;
};
ConvSums conv_sums(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& dy, const ops::Conv2dGeometry& g) {
  const int64_t n = x.dim(0), c = g.in_channels, o = g.out_channels, kh = g.kernel_h, kw = g.kernel_w;
  const int64_t h = g.in_h, wd = g.in_w, oh = g.out_h(), ow = g.out_w();
  ConvSums s;
  s.y.assign(static_cast<size_t>(n * o * oh * ow), 0.0);
  s.dx.assign(static_cast<size_t>(x.numel()), 0.0);
  s.dw.assign(static_cast<size_t>(w.numel()), 0.0);
  s.y_abs = s.y, s.dx_abs = s.dx, s.dw_abs = s.dw;
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  const float* dyp = dy.data<float>();
  for (int64_t ni = 0; ni < n; ++ni)
    for (int64_t oi = 0; oi < o; ++oi)
      for (int64_t yi = 0; yi < oh; ++yi)
        for (int64_t xi = 0; xi < ow; ++xi) {
          const size_t out = static_cast<size_t>(((ni * o + oi) * oh + yi) * ow + xi);
          s.y[out] = b.data<float>()[oi], s.y_abs[out] = std::fabs(s.y[out]);
          for (int64_t ci = 0; ci < c; ++ci)
            for (int64_t ky = 0; ky < kh; ++ky)
              for (int64_t kx = 0; kx < kw; ++kx) {
                const int64_t iy = yi * g.stride - g.padding + ky, ix = xi * g.stride - g.padding + kx;
                if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
                const size_t in = static_cast<size_t>(((ni * c + ci) * h + iy) * wd + ix);
                const size_t wi = static_cast<size_t>(((oi * c + ci) * kh + ky) * kw + kx);
                const double p = static_cast<double>(wp[wi]) * xp[in];
                const double gx = static_cast<double>(wp[wi]) * dyp[out];
                const double gw = static_cast<double>(dyp[out]) * xp[in];
                s.y[out] += p, s.y_abs[out] += std::fabs(p);
                s.dx[in] += gx, s.dx_abs[in] += std::fabs(gx);
                s.dw[wi] += gw, s.dw_abs[wi] += std::fabs(gw);
              }
        }
  return s;
}

TEST_P(LowPrecision, ConvolutionPoolingAndNorms) {
  const DType dt = GetParam();
  auto [x, xf] = rounded({2, 3, 7, 6}, 6);
  auto [bias, biasf] = rounded({4}, 8);
  // (kernel h, kernel w, stride, padding): the general unfold, the "same"-width one, a pointwise
  // convolution (the sample as its own columns) and a strided one.
  const int64_t shapes[][4] = {{3, 2, 1, 1}, {3, 3, 1, 1}, {1, 1, 1, 0}, {3, 3, 2, 1}};
  for (const auto& [kh, kw, stride, padding] : shapes) {
    SCOPED_TRACE(::testing::Message() << "kernel " << kh << "x" << kw << ", stride " << stride << ", padding "
                                      << padding);
    ops::Conv2dGeometry g;
    g.in_channels = 3, g.out_channels = 4, g.kernel_h = kh, g.kernel_w = kw, g.stride = stride, g.padding = padding,
    g.in_h = 7, g.in_w = 6;
    auto [w, wf] = rounded({4, 3, kh, kw}, 7);
    const Shape ys{2, 4, g.out_h(), g.out_w()};
    Tensor y = Tensor::empty(ys, dt), yf = Tensor::empty(ys);
    ops::conv2d_forward(x, w, bias, y, g);
    ops::conv2d_forward(xf, wf, biasf, yf, g);

    auto [dy, dyf] = rounded(ys, 9);
    Tensor dx = Tensor::empty(x.shape(), dt), dxf = Tensor::empty(x.shape());
    Tensor dw = Tensor::zeros(w.shape()), dwf = Tensor::zeros(w.shape()), db = Tensor::zeros({4}), dbf = db.clone();
    ops::conv2d_backward(x, w, dy, dx, dw, db, g);
    ops::conv2d_backward(xf, wf, dyf, dxf, dwf, dbf, g);
    expect_same_bits(db, dbf, "conv2d db (f32)");  // sums of dy, in the same order either way
    if (dt == DType::F16 || ops::bf16_matrix_units().empty()) {
      expect_same_bits(y, converted(yf, dt), "conv2d_forward");
      expect_same_bits(dx, converted(dxf, dt), "conv2d dx");
      expect_same_bits(dw, dwf, "conv2d dw (f32)");
      continue;
    }
    // bf16 on the CPU's bf16 units: exact products summed in f32 in the units' order, then
    // rounded once, as the GEMMs' (above): within f32's summation bound of the exact sums, taken
    // here in double straight from the convolution's definition.
    const ConvSums exact = conv_sums(xf, wf, biasf, dyf, g);
    const double rounding = std::ldexp(1.0, -8);
    expect_within_product_bound(y, exact.y, exact.y_abs, 3 * kh * kw + 1, rounding, "conv2d_forward (bf16 units)");
    expect_within_product_bound(dx, exact.dx, exact.dx_abs, 4 * kh * kw, rounding, "conv2d dx (bf16 units)");
    expect_within_product_bound(dw, exact.dw, exact.dw_abs, ys[0] * g.out_h() * g.out_w(), 0.0,
                                "conv2d dw (f32, bf16 units)");
  }

  ops::Pool2dGeometry pg;
  pg.in_h = 7, pg.in_w = 6;
  const Shape ps{2, 3, pg.out_h(), pg.out_w()};
  Tensor p = Tensor::empty(ps, dt), pf = Tensor::empty(ps), am = Tensor::empty(ps, DType::I32),
         amf = Tensor::empty(ps, DType::I32);
  ops::max_pool2d_forward(x, p, am, pg);
  ops::max_pool2d_forward(xf, pf, amf, pg);
  expect_same_bits(p, converted(pf, dt), "max_pool2d");
  expect_same_bits(am, amf, "max_pool2d argmax");
  // Backward scatters dy to the argmax, overlapping windows adding in f32 before the one rounding.
  ops::Pool2dGeometry over;
  over.kernel = 3, over.stride = 1, over.padding = 1, over.in_h = 7, over.in_w = 6;
  const Shape os{2, 3, over.out_h(), over.out_w()};
  Tensor po = Tensor::empty(os, dt), pof = Tensor::empty(os), ao = Tensor::empty(os, DType::I32),
         aof = Tensor::empty(os, DType::I32);
  ops::max_pool2d_forward(x, po, ao, over);
  ops::max_pool2d_forward(xf, pof, aof, over);
  expect_same_bits(po, converted(pof, dt), "max_pool2d, overlapping windows");
  expect_same_bits(ao, aof, "max_pool2d argmax, overlapping windows");
  auto [gp, gpf] = rounded(os, 12);
  Tensor dpx = Tensor::empty(x.shape(), dt), dpxf = Tensor::empty(x.shape());
  ops::max_pool2d_backward(gp, ao, dpx, over);
  ops::max_pool2d_backward(gpf, aof, dpxf, over);
  expect_same_bits(dpx, converted(dpxf, dt), "max_pool2d_backward, overlapping windows");

  // Batch norm: parameters in the compute dtype, statistics in f32.
  auto [gamma, gammaf] = rounded({3}, 10);
  auto [beta, betaf] = rounded({3}, 11);
  Tensor bn = Tensor::empty(x.shape(), dt), bnf = Tensor::empty(x.shape());
  Tensor mean = Tensor::empty({3}), invstd = Tensor::empty({3}), meanf = Tensor::empty({3}),
         invstdf = Tensor::empty({3});
  Tensor rm = Tensor::zeros({3}), rv = Tensor::zeros({3}), rmf = Tensor::zeros({3}), rvf = Tensor::zeros({3});
  ops::batch_norm_forward_train(x, gamma, beta, bn, mean, invstd, rm, rv, 0.1f, 1e-5f);
  ops::batch_norm_forward_train(xf, gammaf, betaf, bnf, meanf, invstdf, rmf, rvf, 0.1f, 1e-5f);
  expect_same_bits(bn, converted(bnf, dt), "batch_norm y");
  expect_same_bits(rv, rvf, "batch_norm running_var (f32)");
}

// LayerNorm stages a row at a time; statistics f32, gradients of gamma and beta f32 or low.
TEST_P(LowPrecision, LayerNormRoundsOnce) {
  const DType dt = GetParam();
  auto [x, xf] = rounded({13, 37}, 14);
  auto [gamma, gammaf] = rounded({37}, 15);
  auto [beta, betaf] = rounded({37}, 16);
  Tensor y = Tensor::empty(x.shape(), dt), yf = Tensor::empty(x.shape());
  Tensor mean = Tensor::empty({13}), rstd = Tensor::empty({13}), meanf = Tensor::empty({13}),
         rstdf = Tensor::empty({13});
  ops::layer_norm_forward(x, gamma, beta, y, mean, rstd, 1e-5f);
  ops::layer_norm_forward(xf, gammaf, betaf, yf, meanf, rstdf, 1e-5f);
  expect_same_bits(y, converted(yf, dt), "layer_norm y");
  expect_same_bits(mean, meanf, "layer_norm mean (f32)");
  expect_same_bits(rstd, rstdf, "layer_norm rstd (f32)");

  auto [dy, dyf] = rounded(x.shape(), 17);
  Tensor dx = Tensor::empty(x.shape(), dt), dxf = Tensor::empty(x.shape());
  Tensor dgamma = rand_f32({37}, 18), dgammaf = dgamma.clone();
  Tensor dbeta = converted(rand_f32({37}, 19), dt), dbetaf = converted(dbeta, DType::F32);
  ops::layer_norm_backward(x, dy, gamma, mean, rstd, dx, dgamma, dbeta);
  ops::layer_norm_backward(xf, dyf, gammaf, meanf, rstdf, dxf, dgammaf, dbetaf);
  expect_same_bits(dx, converted(dxf, dt), "layer_norm dx");
  expect_same_bits(dgamma, dgammaf, "layer_norm dgamma (f32)");
  expect_same_bits(dbeta, converted(dbetaf, dt), "layer_norm dbeta (low precision)");
}

TEST_P(LowPrecision, LossAndOverflowDetection) {
  const DType dt = GetParam();
  for (const int64_t k : {7, 1500}) {  // short rows, and rows as long as a vocabulary
    auto [logits, logitsf] = rounded({5, k}, 12);
    Tensor labels = Tensor::empty({5}, DType::I32);
    for (int i = 0; i < 5; ++i) labels.data<int32_t>()[i] = static_cast<int32_t>((3 * i) % k);
    Tensor probs = Tensor::empty({5, k}, dt), probsf = Tensor::empty({5, k});
    EXPECT_EQ(ops::softmax_xent_forward(logits, labels, probs), ops::softmax_xent_forward(logitsf, labels, probsf));
    expect_same_bits(probs, converted(probsf, dt), "softmax probabilities");
    EXPECT_EQ(ops::count_correct(logits, labels), ops::count_correct(logitsf, labels));
    Tensor dlogits = Tensor::empty({5, k}, dt), dlogitsf = Tensor::empty({5, k});
    ops::softmax_xent_backward(probs, labels, dlogits, 0.2f);
    ops::softmax_xent_backward(converted(probs, DType::F32), labels, dlogitsf, 0.2f);
    expect_same_bits(dlogits, converted(dlogitsf, dt), "softmax cross-entropy gradient");
  }

  Tensor g = converted(rand_f32({100}, 13), dt);
  EXPECT_TRUE(ops::all_finite(g));
  ops::fill(g.view(57, {1}), std::numeric_limits<float>::infinity());
  EXPECT_FALSE(ops::all_finite(g));
  // 70000 is beyond f16's range (65504): an f16 activation gradient that large is an overflow.
  Tensor big = Tensor::empty({1});
  big.data<float>()[0] = 70000.0f;
  EXPECT_EQ(ops::all_finite(converted(big, dt)), dt == DType::BF16);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LowPrecision, ::testing::Values(DType::BF16, DType::F16),
                         [](const auto& param_info) { return std::string(dtype_name(param_info.param)); });

TEST(MixedPrecisionRules, MismatchedDtypesAreRejected) {
  const Tensor a = Tensor::empty({4, 4}, DType::BF16), b = Tensor::empty({4, 4}), c = Tensor::empty({4, 4});
  EXPECT_THROW(ops::gemm(a, false, b, false, c), Error);                                  // operands differ
  EXPECT_THROW(ops::relu_forward(a, c), Error);                                           // output differs
  EXPECT_THROW(ops::gemm(a, false, a, false, Tensor::empty({4, 4}, DType::F16)), Error);  // c neither f32 nor bf16
  EXPECT_THROW(ops::sgd_update(a, b, Tensor(), {}), Error);                               // master weights are f32
  EXPECT_NO_THROW(ops::gemm(a, false, a, false, c));                                      // f32 accumulation target
}
