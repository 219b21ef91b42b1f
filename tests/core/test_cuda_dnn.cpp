// Core's CUDA runtime (device contexts, pinned staging buffers) and the library-backed CUDA
// ops (copy, cuBLAS GEMM, cuDNN convolution and batch norm, our pooling kernels) against the
// CPU ops in the same binary, for f32, bf16 and f16, on ragged shapes, with pre-filled
// parameter gradients to check that they accumulate.
//
// The CPU reference runs in f32 on the same inputs rounded to the tested dtype. Every element
// must be within rtol * (|want| + max|want|) of it, with rtol by result dtype:
//   f32 1e-5 (1e-4 for cuDNN: Winograd / FFT algorithms and float reductions round
//   differently from OpenBLAS and the CPU's double sums), f16 2e-3 (11-bit significand),
//   bf16 1e-2 (8-bit significand).
// Pooling sums in the CPU's order, so its f32 results and argmax are compared exactly.
// Skips, saying why, when this build has no CUDA or the machine has no GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "core/ops.hpp"
#if STRATA_WITH_CUDA
#include "core/cuda/allocator.hpp"
#include "core/cuda/runtime.hpp"
#include "core/cuda_test_util.hpp"
#include "core/ops/cuda/cuda_ops.hpp"
#endif

using namespace strata;

#if STRATA_WITH_CUDA
namespace {

using cuda_test::kGpu;
using cuda_test::to_gpu;
using cuda_test::to_host;

constexpr DType kFloatTypes[] = {DType::F32, DType::BF16, DType::F16};

double tol(DType t) { return t == DType::F32 ? 1e-5 : t == DType::F16 ? 2e-3 : 1e-2; }
// cuDNN results (convolution, batch norm) in dtype t.
double lib_tol(DType t) { return t == DType::F32 ? 1e-4 : tol(t); }

// Gradient / output dtypes allowed with data dtype t: t itself, and f32 for bf16 and f16.
std::vector<DType> t_and_f32(DType t) { return t == DType::F32 ? std::vector{t} : std::vector{t, DType::F32}; }

// Host f32 values in [lo, hi), rounded to `dtype` (so the CPU sees exactly what the GPU sees).
Tensor rand_host(Shape shape, uint32_t seed, DType dtype = DType::F32, float lo = -1.0f, float hi = 1.0f) {
  return cuda_test::rand_host(std::move(shape), seed, dtype, lo, hi);
}

// The GPU result `got` against the host f32 reference `want` (NaN matches NaN).
::testing::AssertionResult close(const Tensor& got_dev, const Tensor& want, double rtol) {
  const Tensor got = to_host(got_dev);
  if (got.numel() != want.numel())
    return ::testing::AssertionFailure() << "got " << got.str() << ", want " << want.str();
  double scale = 1e-30;
  for (int64_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::fabs(double{want.data<float>()[i]}));
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double g = got.data<float>()[i], w = want.data<float>()[i];
    if (std::isnan(g) && std::isnan(w)) continue;
    if (!(std::fabs(g - w) <= rtol * (std::fabs(w) + scale)))
      return ::testing::AssertionFailure() << "element " << i << " of " << want.str() << ": got " << g << ", want " << w
                                           << " (rtol " << rtol << ", scale " << scale << ")";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult equal_i32(const Tensor& got_dev, const Tensor& want) {
  const Tensor got = to_host(got_dev);
  for (int64_t i = 0; i < want.numel(); ++i)
    if (got.data<int32_t>()[i] != want.data<int32_t>()[i])
      return ::testing::AssertionFailure()
             << "element " << i << ": got " << got.data<int32_t>()[i] << ", want " << want.data<int32_t>()[i];
  return ::testing::AssertionSuccess();
}

class CudaDnn : public ::testing::Test {
 protected:
  void SetUp() override {
    if (strata::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine (device_count() == 0)";
  }
};

// Restores the TF32 setting when a test ends, even on failure.
struct Tf32Scope {
  explicit Tf32Scope(bool allow) : previous(ops::allow_tf32()) { ops::set_allow_tf32(allow); }
  ~Tf32Scope() { ops::set_allow_tf32(previous); }
  bool previous;
};

}  // namespace

// ---- context and copies ----------------------------------------------------------------------

TEST_F(CudaDnn, ContextIsCreatedOnceWithItsHandles) {
  strata::cuda::DeviceContext& ctx = strata::cuda::context(0);
  EXPECT_EQ(&ctx, &strata::cuda::context(0));
  EXPECT_NE(ctx.compute.get(), nullptr);
  EXPECT_NE(ctx.cublas.get(), nullptr);
  EXPECT_NE(ctx.cudnn.get(), nullptr);
  EXPECT_EQ(strata::cuda::compute_stream(0), ctx.compute.get());
  void* small = strata::cuda::workspace(0, 1000);
  EXPECT_NE(small, nullptr);
  EXPECT_EQ(strata::cuda::workspace(0, 10), small);  // never shrinks
  EXPECT_NE(strata::cuda::workspace(0, 1 << 22), nullptr);
}

TEST_F(CudaDnn, PinnedBuffersAreCachedAndWaitForTheirCopyBack) {
  const size_t bytes = 3000;
  void* first = nullptr;
  {
    strata::cuda::PinnedBuffer buffer(bytes);
    first = buffer.data();
    ASSERT_NE(first, nullptr);
    cudaPointerAttributes attributes{};
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, first), cudaSuccess);
    EXPECT_EQ(attributes.type, cudaMemoryTypeHost);  // page-locked
    // An asynchronous copy reads the block: it is handed out again only after that copy.
    float* values = static_cast<float*>(first);
    for (size_t i = 0; i < bytes / sizeof(float); ++i) values[i] = static_cast<float>(i);
    const Tensor dev = Tensor::empty({static_cast<int64_t>(bytes / sizeof(float))}, DType::F32, kGpu);
    const cudaStream_t stream = strata::cuda::compute_stream(0);
    ASSERT_EQ(cudaMemcpyAsync(dev.raw(), first, dev.nbytes(), cudaMemcpyHostToDevice, stream), cudaSuccess);
    buffer.read_by(stream, 0);
    strata::cuda::PinnedBuffer moved(std::move(buffer));  // the block travels with the owner
    EXPECT_EQ(moved.data(), first);
  }
  strata::cuda::PinnedBuffer again(bytes - 100);  // the same size class: the cached block
  EXPECT_EQ(again.data(), first);
}

TEST_F(CudaDnn, CopyRoundTripsBetweenHostAndDevice) {
  const int64_t n = 100003;  // ragged
  const Tensor host = rand_host({n}, 1);
  const Tensor dev = to_gpu(host, DType::F32);
  EXPECT_TRUE(close(dev, host, 0.0));
  // Device to device, into a view at an offset.
  const Tensor big = Tensor::empty({n + 7}, DType::F32, kGpu);
  ops::copy(dev, big.view(7, {n}));
  EXPECT_TRUE(close(big.view(7, {n}), host, 0.0));
  // Host into a device view, and i32 data.
  Tensor labels = Tensor::empty({1001}, DType::I32);
  for (int64_t i = 0; i < labels.numel(); ++i) labels.data<int32_t>()[i] = static_cast<int32_t>(i * 7 - 3000);
  const Tensor dl = Tensor::empty({1001}, DType::I32, kGpu);
  ops::copy(labels, dl);
  EXPECT_TRUE(equal_i32(dl, labels));
}

TEST_F(CudaDnn, CopyBetweenTwoDevices) {
  if (strata::cuda::device_count() < 2) GTEST_SKIP() << "needs two CUDA devices, this machine has one";
  const Tensor host = rand_host({4099}, 2);
  const Tensor a = to_gpu(host, DType::F32), b = Tensor::empty({4099}, DType::F32, Device::cuda(1));
  ops::copy(a, b);
  EXPECT_TRUE(close(b, host, 0.0));
}

// ---- GEMM ------------------------------------------------------------------------------------

TEST_F(CudaDnn, GemmMatchesCpuForEveryDtypeAndTranspose) {
  const int64_t m = 37, n = 53, k = 71;
  uint32_t seed = 10;
  for (DType t : kFloatTypes) {
    for (DType ct : t_and_f32(t)) {
      for (int trans = 0; trans < 4; ++trans) {
        for (float beta : {0.0f, 1.0f}) {
          const bool ta = trans & 1, tb = trans & 2;
          SCOPED_TRACE(testing::Message() << dtype_name(t) << " -> " << dtype_name(ct) << " trans_a " << ta
                                          << " trans_b " << tb << " beta " << beta);
          const Tensor a = rand_host(ta ? Shape{k, m} : Shape{m, k}, ++seed, t);
          const Tensor b = rand_host(tb ? Shape{n, k} : Shape{k, n}, ++seed, t);
          const Tensor c0 = rand_host({m, n}, ++seed, ct);  // accumulated into when beta == 1
          Tensor want = c0.clone();
          ops::gemm(a, ta, b, tb, want, 0.75f, beta);
          const Tensor c = to_gpu(c0, ct);
          ops::gemm(to_gpu(a, t), ta, to_gpu(b, t), tb, c, 0.75f, beta);
          // Low-precision products are exact in f32 and summed in f32: an f32 c is nearly exact.
          EXPECT_TRUE(close(c, want, ct == DType::F32 ? (t == DType::F32 ? 1e-5 : 1e-4) : tol(ct)));
        }
      }
    }
  }
}

TEST_F(CudaDnn, GemmUsesTf32OnlyWhenAllowed) {
  const int64_t m = 64, n = 48, k = 96;
  const Tensor a = rand_host({m, k}, 3), b = rand_host({k, n}, 4);
  Tensor want = Tensor::empty({m, n});
  ops::gemm(a, false, b, false, want);
  const Tensor c = Tensor::empty({m, n}, DType::F32, kGpu);
  {
    Tf32Scope tf32(true);
    ops::gemm(to_gpu(a, DType::F32), false, to_gpu(b, DType::F32), false, c);
    EXPECT_TRUE(close(c, want, 5e-3));  // TF32 keeps 10 significand bits
  }
  ops::gemm(to_gpu(a, DType::F32), false, to_gpu(b, DType::F32), false, c);
  EXPECT_TRUE(close(c, want, 1e-5));
}

// ---- convolution -----------------------------------------------------------------------------

TEST_F(CudaDnn, ConvMatchesCpuAndAccumulatesGradients) {
  struct Case {
    int64_t n, c, o, h, w, kh, kw, stride, pad;
  };
  const Case cases[] = {{2, 3, 5, 13, 11, 3, 3, 1, 1},  // "same" 3x3
                        {3, 4, 6, 9, 10, 1, 1, 1, 0},   // pointwise
                        {2, 3, 4, 12, 9, 5, 3, 2, 2}};  // non-square kernel, stride, padding
  uint32_t seed = 100;
  int variant = 0;
  for (const Case& cs : cases) {
    ops::Conv2dGeometry g;
    g.in_channels = cs.c;
    g.out_channels = cs.o;
    g.kernel_h = cs.kh;
    g.kernel_w = cs.kw;
    g.stride = cs.stride;
    g.padding = cs.pad;
    g.in_h = cs.h;
    g.in_w = cs.w;
    const Shape ys{cs.n, cs.o, g.out_h(), g.out_w()};
    for (DType t : kFloatTypes) {
      for (DType gt : t_and_f32(t)) {
        ++variant;
        const bool with_bias = variant % 2 == 0, with_dx = variant % 3 != 0;
        SCOPED_TRACE(testing::Message() << dtype_name(t) << " grads " << dtype_name(gt) << " input " << cs.n << "x"
                                        << cs.c << "x" << cs.h << "x" << cs.w << " kernel " << cs.kh << "x" << cs.kw
                                        << " bias " << with_bias << " dx " << with_dx);
        const Tensor x = rand_host({cs.n, cs.c, cs.h, cs.w}, ++seed, t);
        const Tensor w = rand_host({cs.o, cs.c, cs.kh, cs.kw}, ++seed, t);
        const Tensor bias = with_bias ? rand_host({cs.o}, ++seed, t) : Tensor();
        const Tensor dy = rand_host(ys, ++seed, t);
        const Tensor dw0 = rand_host(w.shape(), ++seed, gt), db0 = rand_host({cs.o}, ++seed, gt);

        Tensor y = Tensor::empty(ys), dx = Tensor::empty(x.shape()), dw = dw0.clone(), db = db0.clone();
        ops::conv2d_forward(x, w, bias, y, g);
        ops::conv2d_backward(x, w, dy, with_dx ? dx : Tensor(), dw, db, g);

        const Tensor gx = to_gpu(x, t), gw = to_gpu(w, t), gdy = to_gpu(dy, t);
        const Tensor gy = Tensor::empty(ys, t, kGpu), gdx = Tensor::empty(x.shape(), t, kGpu);
        const Tensor gdw = to_gpu(dw0, gt), gdb = to_gpu(db0, gt);
        ops::conv2d_forward(gx, gw, with_bias ? to_gpu(bias, t) : Tensor(), gy, g);
        ops::conv2d_backward(gx, gw, gdy, with_dx ? gdx : Tensor(), gdw, gdb, g);
        EXPECT_TRUE(close(gy, y, lib_tol(t))) << "y";
        if (with_dx) {
          EXPECT_TRUE(close(gdx, dx, lib_tol(t))) << "dx";
        }
        // bf16/f16 filter gradients are rounded to the data dtype before an f32 dw adds them.
        EXPECT_TRUE(close(gdw, dw, lib_tol(t))) << "dw";
        EXPECT_TRUE(close(gdb, db, lib_tol(gt))) << "db";
      }
    }
  }
  EXPECT_FALSE(strata::cuda::context(0).conv_algos.empty()) << "algorithms are cached per shape";
}

// ---- pooling ---------------------------------------------------------------------------------

TEST_F(CudaDnn, PoolingMatchesCpuIncludingArgmax) {
  const ops::Pool2dGeometry geoms[] = {{2, 2, 0, 7, 9},   // the CPU's 2x2 fast path, odd sizes
                                       {3, 2, 1, 10, 7},  // padding, clipped windows
                                       {3, 1, 1, 5, 6}};  // overlapping windows
  uint32_t seed = 200;
  for (const ops::Pool2dGeometry& g : geoms) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(testing::Message() << dtype_name(t) << " kernel " << g.kernel << " stride " << g.stride
                                      << " padding " << g.padding << " input " << g.in_h << "x" << g.in_w);
      const int64_t n = 2, c = 3;
      const Shape xs{n, c, g.in_h, g.in_w}, ys{n, c, g.out_h(), g.out_w()};
      // Values on a coarse grid: many ties, which must break the same way (first maximum).
      Tensor x = rand_host(xs, ++seed, t);
      for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = std::round(x.data<float>()[i] * 2.0f) / 2.0f;
      const Tensor dy = rand_host(ys, ++seed, t);
      const Tensor gx = to_gpu(x, t), gdy = to_gpu(dy, t);

      Tensor y = Tensor::empty(ys), arg = Tensor::empty(ys, DType::I32), dx = Tensor::empty(xs);
      const Tensor gy = Tensor::empty(ys, t, kGpu), garg = Tensor::empty(ys, DType::I32, kGpu);
      const Tensor gdx = Tensor::empty(xs, t, kGpu);
      ops::max_pool2d_forward(x, y, arg, g);
      ops::max_pool2d_forward(gx, gy, garg, g);
      EXPECT_TRUE(close(gy, y, 0.0)) << "max y";
      EXPECT_TRUE(equal_i32(garg, arg)) << "argmax";
      ops::max_pool2d_backward(dy, arg, dx, g);
      ops::max_pool2d_backward(gdy, garg, gdx, g);
      EXPECT_TRUE(close(gdx, dx, t == DType::F32 ? 0.0 : tol(t))) << "max dx";

      ops::avg_pool2d_forward(x, y, g);
      ops::avg_pool2d_forward(gx, gy, g);
      EXPECT_TRUE(close(gy, y, t == DType::F32 ? 0.0 : tol(t))) << "avg y";
      ops::avg_pool2d_backward(dy, dx, g);
      ops::avg_pool2d_backward(gdy, gdx, g);
      EXPECT_TRUE(close(gdx, dx, t == DType::F32 ? 0.0 : tol(t))) << "avg dx";

      Tensor pooled = Tensor::empty({n, c});
      const Tensor dpooled = rand_host({n, c}, ++seed, t), gpooled = Tensor::empty({n, c}, t, kGpu);
      ops::global_avg_pool_forward(x, pooled);
      ops::global_avg_pool_forward(gx, gpooled);
      EXPECT_TRUE(close(gpooled, pooled, tol(t))) << "global y";
      ops::global_avg_pool_backward(dpooled, dx);
      ops::global_avg_pool_backward(to_gpu(dpooled, t), gdx);
      EXPECT_TRUE(close(gdx, dx, tol(t))) << "global dx";
    }
  }
}

TEST_F(CudaDnn, MaxPoolPropagatesNanLikeCpu) {
  const ops::Pool2dGeometry g{3, 2, 1, 6, 5};
  Tensor x = rand_host({1, 2, 6, 5}, 300);
  x.data<float>()[7] = std::numeric_limits<float>::quiet_NaN();
  x.data<float>()[40] = -std::numeric_limits<float>::infinity();
  const Shape ys{1, 2, g.out_h(), g.out_w()};
  Tensor y = Tensor::empty(ys), arg = Tensor::empty(ys, DType::I32);
  const Tensor gy = Tensor::empty(ys, DType::F32, kGpu), garg = Tensor::empty(ys, DType::I32, kGpu);
  ops::max_pool2d_forward(x, y, arg, g);
  ops::max_pool2d_forward(to_gpu(x, DType::F32), gy, garg, g);
  EXPECT_TRUE(close(gy, y, 0.0));
  EXPECT_TRUE(equal_i32(garg, arg));
}

// ---- batch norm ------------------------------------------------------------------------------

TEST_F(CudaDnn, BatchNormMatchesCpu) {
  const Shape shapes[] = {{4, 6, 5, 3}, {5, 7}};  // images, and (N, C) features
  const float momentum = 0.1f, eps = 1e-3f;       // eps far from cuDNN's usual 1e-5 on purpose
  uint32_t seed = 400;
  int variant = 0;
  for (const Shape& xs : shapes) {
    const int64_t c = xs[1];
    for (DType t : kFloatTypes) {
      for (DType gt : t_and_f32(t)) {
        const bool affine = ++variant % 2 == 1;
        SCOPED_TRACE(testing::Message() << dtype_name(t) << " grads " << dtype_name(gt) << " input " << shape_str(xs)
                                        << " affine " << affine);
        const Tensor x = rand_host(xs, ++seed, t, -2.0f, 3.0f), dy = rand_host(xs, ++seed, t);
        const Tensor gamma = affine ? rand_host({c}, ++seed, t, 0.5f, 1.5f) : Tensor();
        const Tensor beta = affine ? rand_host({c}, ++seed, t) : Tensor();
        const Tensor rm0 = rand_host({c}, ++seed), rv0 = rand_host({c}, ++seed, DType::F32, 0.5f, 1.5f);
        const Tensor dg0 = rand_host({c}, ++seed, gt), db0 = rand_host({c}, ++seed, gt);
        auto gpu_opt = [&](const Tensor& h) { return h.defined() ? to_gpu(h, t) : Tensor(); };

        // Training forward: output, saved statistics and running statistics.
        Tensor y = Tensor::empty(xs), mean = Tensor::empty({c}), invstd = Tensor::empty({c});
        Tensor rm = rm0.clone(), rv = rv0.clone();
        ops::batch_norm_forward_train(x, gamma, beta, y, mean, invstd, rm, rv, momentum, eps);
        const Tensor gx = to_gpu(x, t), gy = Tensor::empty(xs, t, kGpu);
        const Tensor gmean = Tensor::empty({c}, DType::F32, kGpu), ginvstd = Tensor::empty({c}, DType::F32, kGpu);
        const Tensor grm = to_gpu(rm0, DType::F32), grv = to_gpu(rv0, DType::F32);
        ops::batch_norm_forward_train(gx, gpu_opt(gamma), gpu_opt(beta), gy, gmean, ginvstd, grm, grv, momentum, eps);
        EXPECT_TRUE(close(gy, y, lib_tol(t))) << "train y";
        EXPECT_TRUE(close(gmean, mean, 1e-4)) << "save_mean";
        EXPECT_TRUE(close(ginvstd, invstd, 1e-4)) << "save_invstd";
        EXPECT_TRUE(close(grm, rm, 1e-4)) << "running_mean";
        EXPECT_TRUE(close(grv, rv, 1e-4)) << "running_var (unbiased)";

        // Evaluation forward on the same running statistics.
        ops::batch_norm_forward_eval(x, gamma, beta, rm, rv, y, eps);
        ops::batch_norm_forward_eval(gx, gpu_opt(gamma), gpu_opt(beta), to_gpu(rm, DType::F32), to_gpu(rv, DType::F32),
                                     gy, eps);
        EXPECT_TRUE(close(gy, y, lib_tol(t))) << "eval y";

        // Backward from the CPU's saved statistics, accumulating into pre-filled gradients.
        Tensor dx = Tensor::empty(xs), dg = dg0.clone(), db = db0.clone();
        ops::batch_norm_backward(x, dy, gamma, mean, invstd, dx, dg, db);
        const Tensor gdx = Tensor::empty(xs, t, kGpu), gdg = to_gpu(dg0, gt), gdb = to_gpu(db0, gt);
        ops::batch_norm_backward(gx, to_gpu(dy, t), gpu_opt(gamma), to_gpu(mean, DType::F32),
                                 to_gpu(invstd, DType::F32), gdx, gdg, gdb);
        EXPECT_TRUE(close(gdx, dx, lib_tol(t))) << "dx";
        EXPECT_TRUE(close(gdg, dg, lib_tol(gt))) << "dgamma";
        EXPECT_TRUE(close(gdb, db, lib_tol(gt))) << "dbeta";

        // Without dx, only the parameter gradients (accumulated again).
        ops::batch_norm_backward(x, dy, gamma, mean, invstd, Tensor(), dg, db);
        ops::batch_norm_backward(gx, to_gpu(dy, t), gpu_opt(gamma), to_gpu(mean, DType::F32),
                                 to_gpu(invstd, DType::F32), Tensor(), gdg, gdb);
        EXPECT_TRUE(close(gdg, dg, lib_tol(gt))) << "dgamma without dx";
        EXPECT_TRUE(close(gdb, db, lib_tol(gt))) << "dbeta without dx";
      }
    }
  }
}

TEST_F(CudaDnn, BatchNormOfOneValuePerChannelUpdatesRunningStatsLikeCpu) {
  // N * H * W == 1: the unbiased variance is undefined; the CPU falls back to the biased one (0).
  const Shape xs{1, 3, 1, 1};
  const Tensor x = rand_host(xs, 500), rm0 = rand_host({3}, 501), rv0 = rand_host({3}, 502, DType::F32, 0.5f, 1.5f);
  Tensor y = Tensor::empty(xs), rm = rm0.clone(), rv = rv0.clone();
  ops::batch_norm_forward_train(x, Tensor(), Tensor(), y, Tensor(), Tensor(), rm, rv, 0.25f, 1e-5f);
  const Tensor gy = Tensor::empty(xs, DType::F32, kGpu), grm = to_gpu(rm0, DType::F32), grv = to_gpu(rv0, DType::F32);
  ops::batch_norm_forward_train(to_gpu(x, DType::F32), Tensor(), Tensor(), gy, Tensor(), Tensor(), grm, grv, 0.25f,
                                1e-5f);
  EXPECT_TRUE(close(gy, y, 1e-5));
  EXPECT_TRUE(close(grm, rm, 1e-5));
  EXPECT_TRUE(close(grv, rv, 1e-5));
}

#else

TEST(CudaDnn, SkippedWithoutCuda) {
  GTEST_SKIP() << "this build has no CUDA support (configure with -DSTRATA_CUDA=ON on a machine with nvcc)";
}

#endif
