// Strata's own CUDA kernels against their CPU twins in the same binary, for f32, bf16 and f16.
// The CPU reference runs in f32 on the inputs rounded to the tested dtype, so both sides see
// the same values; results that are one f32 operation rounded once must match bit for bit,
// others within the stated per-dtype tolerance. Skips, saying why, when this build has no
// CUDA or the machine has no GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/ops.hpp"
#include "core/rng.hpp"
#if STRATA_WITH_CUDA
#include "core/cuda/runtime.hpp"
#include "core/cuda_test_util.hpp"
#include "core/ops/cuda/cuda_ops.hpp"
#endif

using namespace strata;

#if STRATA_WITH_CUDA
namespace {

using namespace cuda_test;

constexpr int64_t kN = 100003;  // several blocks and a ragged tail

// Uniform values in [lo, hi), representable in `dtype`, as a host f32 tensor.
Tensor host_rand(Shape shape, uint32_t seed, DType dtype = DType::F32, float lo = -3.0f, float hi = 3.0f) {
  return rand_host(std::move(shape), seed, dtype, lo, hi);
}

Tensor empty_gpu(Shape shape, DType dtype) { return Tensor::empty(std::move(shape), dtype, kGpu); }

// Relative tolerance of a result stored as `dtype`: one rounding to it (half an ulp, with
// margin), or for f32 the last bits where device math (FMA contraction, expf/erff) differs.
double rtol(DType t) {
  switch (t) {
    case DType::BF16:
      return 1.0 / 128;
    case DType::F16:
      return 1.0 / 1024;
    default:
      return 1e-5;
  }
}

double max_abs(const Tensor& t) {
  double m = 0.0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(static_cast<double>(t.data<float>()[i])));
  return m;
}

// |got - want| <= rtol * (|want| + floor) element-wise; got is on the GPU.
void expect_close(const Tensor& device, const Tensor& want, double tol, double floor, const std::string& what) {
  SCOPED_TRACE(what);
  Tensor got = to_host(device);
  ASSERT_EQ(got.numel(), want.numel());
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double g = got.data<float>()[i], w = want.data<float>()[i];
    ASSERT_LE(std::fabs(g - w), tol * (std::fabs(w) + floor)) << "element " << i << ": got " << g << ", want " << w;
  }
}

// The tensor's scale as the floor: for sums that may cancel to near zero.
void expect_close_scaled(const Tensor& device, const Tensor& want, double tol, const std::string& what) {
  expect_close(device, want, tol, std::max(max_abs(want), 1e-30), what);
}

// Bit-for-bit: the GPU result equals the f32 CPU result rounded once to the GPU's dtype.
void expect_exact(const Tensor& device, const Tensor& want_f32, const std::string& what) {
  SCOPED_TRACE(what);
  Tensor got = to_host(device), want = round_to(want_f32, device.dtype());
  ASSERT_EQ(got.numel(), want.numel());
  for (int64_t i = 0; i < want.numel(); ++i) {
    const float g = got.data<float>()[i], w = want.data<float>()[i];
    if (std::isnan(w)) {
      ASSERT_TRUE(std::isnan(g)) << "element " << i;
    } else {
      ASSERT_EQ(g, w) << "element " << i;
    }
  }
}

Tensor labels_of(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I32);
  std::copy(v.begin(), v.end(), t.data<int32_t>());
  return t;
}

Tensor random_labels(int64_t n, int32_t k, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> d(0, k - 1);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& l : v) l = d(gen);
  return labels_of(v);
}

// The dtypes of an accumulated gradient or stored statistic beside activations of dtype t.
std::vector<DType> f32_and(DType t) {
  if (t == DType::F32) return {DType::F32};
  return {DType::F32, t};
}

bool no_gpu() { return strata::cuda::device_count() == 0; }
constexpr const char* kNoGpu = "no CUDA device on this machine";

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (no_gpu()) GTEST_SKIP() << kNoGpu;
  }
};

// Each test for T = f32, bf16 and f16 (activations and parameters).
class CudaOpsT : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (no_gpu()) GTEST_SKIP() << kNoGpu;
  }
  static DType dtype() { return GetParam(); }
};

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) { return dtype_name(info.param); }

}  // namespace

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaOpsT, ::testing::Values(DType::F32, DType::BF16, DType::F16), dtype_param_name);

// ---- element-wise ----------------------------------------------------------------------------

// One f32 operation rounded once: exact; the erf/exp of GELU within tolerance.
TEST_P(CudaOpsT, ElementwiseMatchesCpu) {
  const DType t = dtype();
  Tensor a = host_rand({kN}, 1, t), b = host_rand({kN}, 2, t), dy = host_rand({kN}, 3, t);
  Tensor da = to_gpu(a, t), db = to_gpu(b, t), ddy = to_gpu(dy, t);
  Tensor y = Tensor::empty({kN}), dev_y = empty_gpu({kN}, t);

  ops::add(a, b, y);
  ops::add(da, db, dev_y);
  expect_exact(dev_y, y, "add");

  ops::relu_forward(a, y);
  ops::relu_forward(da, dev_y);
  expect_exact(dev_y, y, "relu_forward");
  Tensor relu_y = y.clone(), dev_relu_y = to_gpu(relu_y, t);
  ops::relu_backward(relu_y, dy, y);
  ops::relu_backward(dev_relu_y, ddy, dev_y);
  expect_exact(dev_y, y, "relu_backward");

  ops::gelu_forward(a, y);
  ops::gelu_forward(da, dev_y);
  expect_close(dev_y, y, rtol(t), 1.0, "gelu_forward");
  ops::gelu_backward(a, dy, y);
  ops::gelu_backward(da, ddy, dev_y);
  expect_close(dev_y, y, rtol(t), 1.0, "gelu_backward");
  ops::gelu_tanh_forward(a, y);
  ops::gelu_tanh_forward(da, dev_y);
  expect_close(dev_y, y, rtol(t), 1.0, "gelu_tanh_forward");
  ops::gelu_tanh_backward(a, dy, y);
  ops::gelu_tanh_backward(da, ddy, dev_y);
  expect_close(dev_y, y, rtol(t), 1.0, "gelu_tanh_backward");

  ops::scale(b, -0.375f);
  ops::scale(db, -0.375f);
  expect_exact(db, b, "scale");
  ops::fill(b, 0.1f);
  ops::fill(db, 0.1f);
  expect_exact(db, b, "fill");
}

// y += alpha * x for every pair of float dtypes (low-precision scratch into f32 gradients).
TEST_P(CudaOpsT, AxpyAcrossDtypes) {
  const DType tx = dtype();
  for (DType ty : {DType::F32, DType::BF16, DType::F16}) {
    Tensor x = host_rand({kN}, 4, tx), y = host_rand({kN}, 5, ty);
    Tensor dx = to_gpu(x, tx), dy = to_gpu(y, ty);
    ops::axpy(0.7f, x, y);
    ops::axpy(0.7f, dx, dy);
    expect_close(dy, y, rtol(ty), 1.0, std::string("axpy into ") + dtype_name(ty));
  }
}

// The same conversion code on both sides: bitwise equal, specials included.
TEST_F(CudaOps, CastBetweenFloatFormatsIsBitExact) {
  Tensor src = host_rand({kN}, 6, DType::F32, -70000.0f, 70000.0f);  // overflows f16 near the ends
  const float specials[] = {0.0f,
                            -0.0f,
                            1e-8f,
                            -3e-6f,
                            6.1e-5f,
                            65504.0f,
                            65520.0f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            1e-40f};
  for (size_t i = 0; i < std::size(specials); ++i) src.data<float>()[i] = specials[i];
  for (DType from : {DType::F32, DType::BF16, DType::F16}) {
    Tensor h_from = Tensor::empty({kN}, from);
    ops::cast(src, h_from);
    Tensor d_from = to_gpu(h_from);
    for (DType to : {DType::F32, DType::BF16, DType::F16}) {
      Tensor want = Tensor::empty({kN}, to), d_to = empty_gpu({kN}, to);
      ops::cast(h_from, want);
      ops::cast(d_from, d_to);
      Tensor got = Tensor::empty({kN}, to);
      ops::copy(d_to, got);
      EXPECT_EQ(std::memcmp(got.raw(), want.raw(), want.nbytes()), 0)
          << "cast " << dtype_name(from) << " -> " << dtype_name(to);
    }
  }
  // Same-dtype casts of non-float types are copies.
  Tensor ints = random_labels(1001, 1 << 30, 7), d_ints = to_gpu(ints), d_copy = empty_gpu({1001}, DType::I32);
  ops::cast(d_ints, d_copy);
  Tensor back = Tensor::empty({1001}, DType::I32);
  ops::copy(d_copy, back);
  EXPECT_EQ(std::memcmp(back.raw(), ints.raw(), ints.nbytes()), 0);
}

TEST_P(CudaOpsT, NormalizeU8MatchesCpu) {
  const DType t = dtype();
  Tensor x = Tensor::empty({5, 3, 7, 11}, DType::U8);
  std::mt19937 gen(8);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<uint8_t>()[i] = static_cast<uint8_t>(gen() & 0xff);
  Tensor dx = to_gpu(x);
  const std::vector<std::vector<float>> means = {{0.485f, 0.456f, 0.406f}, {0.5f}},
                                        stds = {{0.229f, 0.224f, 0.225f}, {0.25f}};
  for (size_t k = 0; k < means.size(); ++k) {
    Tensor y = Tensor::empty(x.shape()), dy = empty_gpu(x.shape(), t);
    ops::normalize_u8(x, y, 1.0f / 255, means[k], stds[k]);
    ops::normalize_u8(dx, dy, 1.0f / 255, means[k], stds[k]);
    expect_close(dy, y, rtol(t), 1.0, means[k].size() == 1 ? "one mean" : "per channel");
  }
}

// ---- dropout ---------------------------------------------------------------------------------

// The same Philox mask as the CPU, bit for bit, also for a slice of the batch computed alone.
TEST_P(CudaOpsT, DropoutMasksEqualTheCpu) {
  const DType t = dtype();
  const int64_t rows = 101, cols = 990;  // 99990 elements: a ragged tail
  Tensor x = host_rand({rows, cols}, 9, t, 0.5f, 2.0f), dy = host_rand({rows, cols}, 10, t, -2.0f, -0.5f);
  Tensor dev_x = to_gpu(x, t), ddy = to_gpu(dy, t);
  const ops::DropoutKey key{rng::derive_key(3, rng::kDropout), 5, 17};
  for (float p : {0.25f, 0.9f}) {
    Tensor y = Tensor::empty({rows, cols}), dev_y = empty_gpu({rows, cols}, t);
    ops::dropout_forward(x, y, p, key);
    ops::dropout_forward(dev_x, dev_y, p, key);
    expect_exact(dev_y, y, "dropout_forward");  // inputs are nonzero: zeros are exactly the mask
    ops::dropout_backward(dy, y, p, key);
    ops::dropout_backward(ddy, dev_y, p, key);
    expect_exact(dev_y, y, "dropout_backward");

    // Rows 40.. alone, with first_sample moved by 40: the same values.
    ops::dropout_forward(x, y, p, key);
    const ops::DropoutKey shifted{key.key, key.stream, key.first_sample + 40};
    Tensor part = empty_gpu({rows - 40, cols}, t);
    ops::dropout_forward(dev_x.slice(40, rows), part, p, shifted);
    expect_exact(part, y.slice(40, rows).clone(), "dropout of a batch slice");
  }
}

// ---- dense -----------------------------------------------------------------------------------

TEST_P(CudaOpsT, BiasAddMatchesCpu) {
  const DType t = dtype();
  Tensor y = host_rand({1001, 37}, 11, t), bias = host_rand({37}, 12, t);
  Tensor dev_y = to_gpu(y, t), dev_bias = to_gpu(bias, t);
  ops::add_bias(y, bias);
  ops::add_bias(dev_y, dev_bias);
  expect_exact(dev_y, y, "add_bias");
}

// db += column sums, into f32 or T; a tall case spreads the rows over many blocks.
TEST_P(CudaOpsT, BiasGradAccumulates) {
  const DType t = dtype();
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1001, 37}, {kN, 3}, {7, 300}}) {
    Tensor dy = host_rand({rows, cols}, 13, t), ddy = to_gpu(dy, t);
    for (DType g : f32_and(t)) {
      Tensor db = host_rand({cols}, 14, g, -10.0f, 10.0f), ddb = to_gpu(db, g);
      ops::bias_grad(dy, db);
      ops::bias_grad(ddy, ddb);
      // The CPU sums rows one by one in f32: its own error grows with the row count.
      const double tol = std::max(rtol(g), rows > 10000 ? 1e-4 : 1e-5);
      expect_close_scaled(ddb, db, tol, std::string("bias_grad into ") + dtype_name(g));
    }
  }
}

// ---- loss and metrics ------------------------------------------------------------------------

TEST_P(CudaOpsT, SoftmaxXentMatchesCpu) {
  const DType t = dtype();
  for (auto [n, k] : {std::pair<int64_t, int64_t>{67, 1000}, {300, 10}, {5, 300}}) {
    SCOPED_TRACE(std::to_string(n) + "x" + std::to_string(k));
    Tensor logits = host_rand({n, k}, 15, t, -8.0f, 8.0f), labels = random_labels(n, static_cast<int32_t>(k), 16);
    Tensor dlog = to_gpu(logits, t), dlab = to_gpu(labels);
    Tensor probs = Tensor::empty({n, k});
    const double want = ops::softmax_xent_forward(logits, labels, probs);
    for (DType p : f32_and(t)) {
      Tensor dprobs = empty_gpu({n, k}, p);
      const double got = ops::softmax_xent_forward(dlog, dlab, dprobs);
      EXPECT_NEAR(got, want, 1e-5 * std::fabs(want)) << "loss sum, probs " << dtype_name(p);
      expect_close(dprobs, probs, rtol(p), 1e-4, std::string("probs ") + dtype_name(p));

      // Backward from the probabilities as stored.
      Tensor stored = to_host(dprobs), dlogits = Tensor::empty({n, k}), ddlogits = empty_gpu({n, k}, t);
      const float scale = 1.0f / static_cast<float>(n);
      ops::softmax_xent_backward(stored, labels, dlogits, scale);
      ops::softmax_xent_backward(dprobs, dlab, ddlogits, scale);
      expect_close(ddlogits, dlogits, rtol(t), scale, "softmax_xent_backward");
    }
  }
}

TEST_F(CudaOps, SoftmaxXentRejectsBadLabels) {
  Tensor logits = to_gpu(host_rand({4, 10}, 17)), probs = empty_gpu({4, 10}, DType::F32);
  try {
    ops::softmax_xent_forward(logits, to_gpu(labels_of({1, 2, 10, 3})), probs);
    FAIL() << "label 10 of 10 classes should throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("label 10 of sample 2"), std::string::npos) << e.what();
  }
}

// Ties (a coarse grid of values) go to the first maximum, as on the CPU; NaN rows too.
TEST_P(CudaOpsT, CountCorrectMatchesCpu) {
  const DType t = dtype();
  for (auto [n, k] : {std::pair<int64_t, int64_t>{1000, 10}, {37, 1000}}) {
    Tensor logits = host_rand({n, k}, 18, t, -2.0f, 2.0f);
    for (int64_t i = 0; i < logits.numel(); ++i)
      logits.data<float>()[i] = std::round(logits.data<float>()[i] * 2.0f) / 2.0f;
    logits.data<float>()[0] = std::numeric_limits<float>::quiet_NaN();      // row 0: NaN first
    logits.data<float>()[k + 3] = std::numeric_limits<float>::quiet_NaN();  // row 1: NaN later
    Tensor labels = random_labels(n, static_cast<int32_t>(k), 19);
    // Half the labels at the CPU's argmax, so both outcomes are common.
    for (int64_t r = 0; r < n; r += 2) {
      const float* row = logits.data<float>() + r * k;
      int32_t best = 0;
      for (int32_t j = 1; j < k; ++j)
        if (row[j] > row[best]) best = j;
      labels.data<int32_t>()[r] = best;
    }
    EXPECT_EQ(ops::count_correct(to_gpu(logits, t), to_gpu(labels)), ops::count_correct(logits, labels));
  }
}

// ---- layer norm ------------------------------------------------------------------------------

TEST_P(CudaOpsT, LayerNormMatchesCpu) {
  const DType t = dtype();
  for (auto [m, f] : {std::pair<int64_t, int64_t>{97, 771}, {300, 10}}) {
    SCOPED_TRACE(std::to_string(m) + "x" + std::to_string(f));
    Tensor x = host_rand({m, f}, 20, t, -2.0f, 4.0f), gamma = host_rand({f}, 21, t, 0.5f, 1.5f),
           beta = host_rand({f}, 22, t), dy = host_rand({m, f}, 23, t);
    Tensor dev_x = to_gpu(x, t), dgam = to_gpu(gamma, t), dbet = to_gpu(beta, t), ddy = to_gpu(dy, t);
    for (bool affine : {true, false}) {
      const Tensor g = affine ? gamma : Tensor(), b = affine ? beta : Tensor();
      const Tensor dg = affine ? dgam : Tensor(), dbt = affine ? dbet : Tensor();
      Tensor y = Tensor::empty({m, f}), mean = Tensor::empty({m}), rstd = Tensor::empty({m});
      Tensor dev_y = empty_gpu({m, f}, t), dev_mean = empty_gpu({m}, DType::F32), dev_rstd = empty_gpu({m}, DType::F32);
      ops::layer_norm_forward(x, g, b, y, mean, rstd, 1e-5f);
      ops::layer_norm_forward(dev_x, dg, dbt, dev_y, dev_mean, dev_rstd, 1e-5f);
      expect_close(dev_y, y, rtol(t), 1.0, "y");
      expect_close(dev_mean, mean, 1e-6, 1e-3, "mean");  // both sum in double
      expect_close(dev_rstd, rstd, 1e-6, 0.0, "rstd");

      // Backward from the CPU's statistics, so that only the backward kernels differ.
      const Tensor dmean = to_gpu(mean), drstd = to_gpu(rstd);
      for (DType gt : f32_and(t)) {
        Tensor dx = Tensor::empty({m, f}), dgamma = host_rand({f}, 24, gt), dbeta = host_rand({f}, 25, gt);
        Tensor dev_dx = empty_gpu({m, f}, t), dev_dgamma = to_gpu(dgamma, gt), dev_dbeta = to_gpu(dbeta, gt);
        ops::layer_norm_backward(x, dy, g, mean, rstd, dx, dgamma, dbeta);
        ops::layer_norm_backward(dev_x, ddy, dg, dmean, drstd, dev_dx, dev_dgamma, dev_dbeta);
        expect_close_scaled(dev_dx, dx, rtol(t), "dx");
        expect_close_scaled(dev_dgamma, dgamma, rtol(gt), std::string("dgamma ") + dtype_name(gt));
        expect_close_scaled(dev_dbeta, dbeta, rtol(gt), std::string("dbeta ") + dtype_name(gt));
      }
    }
  }
}

// ---- reductions ------------------------------------------------------------------------------

TEST_P(CudaOpsT, SumSquaresAndAllFinite) {
  const DType t = dtype();
  for (int64_t n : {int64_t{1}, int64_t{1000}, kN, int64_t{3} << 20}) {
    Tensor x = host_rand({n}, 26, t), dx = to_gpu(x, t);
    // Squares of f32 values are exact in double: only the summation order differs.
    EXPECT_NEAR(ops::sum_squares(dx), ops::sum_squares(x), 1e-12 * ops::sum_squares(x)) << "n = " << n;
    EXPECT_TRUE(ops::all_finite(dx)) << "n = " << n;
  }
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (auto [at, v] : {std::pair<int64_t, float>{kN - 1, inf}, {kN / 2, nan}, {0, -inf}}) {
    Tensor x = host_rand({kN}, 27, t);
    x.data<float>()[at] = v;
    EXPECT_FALSE(ops::all_finite(to_gpu(x, t))) << v << " at " << at;
    EXPECT_FALSE(ops::all_finite(x));
  }
}

// ---- optimizers (f32) ------------------------------------------------------------------------

// The CPU's per-element step, fused in one launch: equal up to FMA contraction (~1e-6).
TEST_F(CudaOps, SgdMatchesCpu) {
  for (auto [momentum, nesterov] : {std::pair{0.0f, false}, {0.9f, false}, {0.9f, true}}) {
    SCOPED_TRACE(std::string("momentum ") + std::to_string(momentum) + (nesterov ? " nesterov" : ""));
    const ops::SgdParams p{0.1f, momentum, 0.0f, 1e-2f, nesterov};
    Tensor w = host_rand({kN}, 28, DType::F32, -1.0f, 1.0f), buf = Tensor::zeros({kN});
    Tensor dw = to_gpu(w), dbuf = to_gpu(buf);
    for (int step = 0; step < 3; ++step) {
      Tensor g = host_rand({kN}, 29 + step, DType::F32, -1.0f, 1.0f);
      ops::sgd_update(w, g, buf, p);
      ops::sgd_update(dw, to_gpu(g), dbuf, p);
    }
    expect_close_scaled(dw, w, 1e-6, "param");
    if (momentum != 0.0f) expect_close_scaled(dbuf, buf, 1e-6, "momentum");
  }
}

TEST_F(CudaOps, AdamWMatchesCpu) {
  Tensor w = host_rand({kN}, 32, DType::F32, -1.0f, 1.0f), m = Tensor::zeros({kN}), v = Tensor::zeros({kN});
  Tensor dw = to_gpu(w), dm = to_gpu(m), dv = to_gpu(v);
  ops::AdamWParams p;
  p.lr = 1e-2f;
  for (int64_t step = 1; step <= 3; ++step) {
    p.step = step;
    Tensor g = host_rand({kN}, 33 + static_cast<uint32_t>(step), DType::F32, -1.0f, 1.0f);
    ops::adamw_update(w, g, m, v, p);
    ops::adamw_update(dw, to_gpu(g), dm, dv, p);
  }
  expect_close_scaled(dw, w, 1e-6, "param");
  expect_close_scaled(dm, m, 1e-6, "exp_avg");
  expect_close_scaled(dv, v, 1e-6, "exp_avg_sq");
}

// ---- devices ---------------------------------------------------------------------------------

TEST_F(CudaOps, MixedDevicesAreRejected) {
  Tensor d = to_gpu(Tensor::zeros({4, 4}));
  EXPECT_THROW(ops::add(d, Tensor::zeros({4, 4}), d), Error);
}

TEST(CudaAllocator, CachesBlocks) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  Allocator& a = allocator_for(kGpu);
  void* p = a.allocate(1 << 20);
  a.deallocate(p, 1 << 20);
  void* q = a.allocate(1 << 20);
  EXPECT_EQ(p, q);
  a.deallocate(q, 1 << 20);
}

#else

TEST(CudaOps, SkippedWithoutCuda) {
  GTEST_SKIP() << "this build has no CUDA support (configure with -DSTRATA_CUDA=ON on a machine with nvcc)";
}

#endif
