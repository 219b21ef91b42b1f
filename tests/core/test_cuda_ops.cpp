// CUDA element-wise ops against the CPU reference. Skips, saying why, when this build has no
// CUDA or the machine has no GPU.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/ops.hpp"
#include "core/rng.hpp"
#if STRATA_WITH_CUDA
#include <cuda_runtime.h>

#include "core/ops/cuda/cuda_ops.hpp"
#endif

using namespace strata;

#if STRATA_WITH_CUDA
namespace {

Tensor host_rand(int64_t n, uint32_t seed, float lo = -3.0f, float hi = 3.0f) {
  Tensor t = Tensor::empty({n});
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = d(gen);
  return t;
}

Tensor to_device(const Tensor& h) {
  Tensor d = Tensor::empty(h.shape(), h.dtype(), Device::cuda(0));
  EXPECT_EQ(cudaMemcpy(d.raw(), h.raw(), h.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

Tensor to_host(const Tensor& d) {
  Tensor h = Tensor::empty(d.shape(), d.dtype());
  EXPECT_EQ(cudaMemcpy(h.raw(), d.raw(), d.nbytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// Device result within 1e-5 relative of the CPU result (erf/exp differ by an ulp or two).
void expect_matches(const Tensor& device, const Tensor& host) {
  Tensor got = to_host(device);
  for (int64_t i = 0; i < host.numel(); ++i) {
    const float want = host.data<float>()[i];
    ASSERT_NEAR(got.data<float>()[i], want, 1e-5f * (std::fabs(want) + 1e-3f)) << "element " << i;
  }
}

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (ops::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  }
  static constexpr int64_t kN = 100003;  // several blocks, ragged tail
};

}  // namespace

TEST_F(CudaOps, ElementwiseMatchesCpu) {
  Tensor a = host_rand(kN, 1), b = host_rand(kN, 2), dy = host_rand(kN, 3);
  Tensor da = to_device(a), db = to_device(b), ddy = to_device(dy);
  Tensor y = Tensor::empty({kN}), dyd = Tensor::empty({kN}, DType::F32, Device::cuda(0));

  ops::add(a, b, y);
  ops::add(da, db, dyd);
  expect_matches(dyd, y);

  ops::relu_forward(a, y);
  ops::relu_forward(da, dyd);
  expect_matches(dyd, y);
  Tensor relu_y = y.clone(), relu_yd = to_device(relu_y);
  ops::relu_backward(relu_y, dy, y);
  ops::relu_backward(relu_yd, ddy, dyd);
  expect_matches(dyd, y);

  ops::gelu_forward(a, y);
  ops::gelu_forward(da, dyd);
  expect_matches(dyd, y);
  ops::gelu_backward(a, dy, y);
  ops::gelu_backward(da, ddy, dyd);
  expect_matches(dyd, y);

  const ops::DropoutKey key{rng::derive_key(3, rng::kDropout), 5, 17};
  ops::dropout_forward(a.view(0, {101, 990}), y.view(0, {101, 990}), 0.25f, key);
  ops::dropout_forward(da.view(0, {101, 990}), dyd.view(0, {101, 990}), 0.25f, key);
  expect_matches(dyd.view(0, {101, 990}), y.view(0, {101, 990}));
  ops::dropout_backward(dy.view(0, {101, 990}), y.view(0, {101, 990}), 0.25f, key);
  ops::dropout_backward(ddy.view(0, {101, 990}), dyd.view(0, {101, 990}), 0.25f, key);
  expect_matches(dyd.view(0, {101, 990}), y.view(0, {101, 990}));

  ops::axpy(0.5f, a, b);
  ops::axpy(0.5f, da, db);
  expect_matches(db, b);
  ops::scale(b, -2.0f);
  ops::scale(db, -2.0f);
  expect_matches(db, b);
  ops::fill(b, 1.25f);
  ops::fill(db, 1.25f);
  expect_matches(db, b);
}

TEST_F(CudaOps, UnimplementedOpsSayso) {
  Tensor d = Tensor::zeros({4, 4}, DType::F32, Device::cuda(0));
  try {
    ops::gemm(d, false, d, false, Tensor::empty({4, 4}, DType::F32, Device::cuda(0)));
    FAIL() << "gemm on CUDA should throw until it is implemented";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not implemented on CUDA yet"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ops::add(d, Tensor::zeros({4, 4}), d), Error);  // mixed devices
}

TEST(CudaAllocator, CachesBlocks) {
  if (ops::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  Allocator& a = allocator_for(Device::cuda(0));
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
