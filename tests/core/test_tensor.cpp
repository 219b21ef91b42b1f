// Tensor: shapes, views sharing storage, copies, and the checks on misuse.
#include <gtest/gtest.h>

#include <limits>

#include "core/tensor.hpp"

using namespace strata;

TEST(Tensor, EmptyAndZeros) {
  Tensor t = Tensor::zeros({2, 3, 4});
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.ndim(), 3);
  EXPECT_EQ(t.dim(-1), 4);
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_EQ(t.str(), "f32[2, 3, 4]");
  for (int64_t i = 0; i < t.numel(); ++i) EXPECT_EQ(t.data<float>()[i], 0.0f);
  EXPECT_EQ(Tensor::empty({0, 5}).numel(), 0);
  EXPECT_FALSE(Tensor().defined());
}

TEST(Tensor, ViewsShareStorage) {
  Tensor t = Tensor::zeros({4, 3});
  Tensor r = t.reshape({12});
  Tensor s = t.slice(1, 3);  // rows 1 and 2
  Tensor v = t.view(5, {2});
  EXPECT_EQ(s.shape(), (Shape{2, 3}));
  s.data<float>()[0] = 7.0f;  // element (1, 0)
  v.data<float>()[1] = 9.0f;  // element 6 = (2, 0)
  EXPECT_EQ(r.data<float>()[3], 7.0f);
  EXPECT_EQ(t.data<float>()[6], 9.0f);
  EXPECT_TRUE(s.same_storage(t));
}

TEST(Tensor, CloneAndCopyAreDeep) {
  Tensor t = Tensor::zeros({3});
  t.data<float>()[1] = 2.0f;
  Tensor c = t.clone();
  EXPECT_FALSE(c.same_storage(t));
  t.data<float>()[1] = 5.0f;
  EXPECT_EQ(c.data<float>()[1], 2.0f);
  c.copy_from(t);
  EXPECT_EQ(c.data<float>()[1], 5.0f);
}

TEST(Tensor, MisuseThrows) {
  Tensor t = Tensor::zeros({2, 2});
  EXPECT_THROW(t.data<int32_t>(), Error);
  EXPECT_THROW(t.reshape({3}), Error);
  EXPECT_THROW(t.slice(1, 3), Error);
  EXPECT_THROW(t.view(3, {2}), Error);
  EXPECT_THROW(t.dim(2), Error);
  EXPECT_THROW(Tensor().raw(), Error);
  EXPECT_THROW(t.copy_from(Tensor::zeros({3})), Error);
}

// Sizes declared by files: a wrapped product must never pass for a small one.
TEST(Tensor, CheckedSizes) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(checked_mul(3, 4), 12);
  EXPECT_EQ(checked_mul(max, 1), max);
  EXPECT_EQ(checked_mul(max / 2 + 1, 2), std::nullopt);
  EXPECT_EQ(checked_mul(-1, 2), std::nullopt);
  EXPECT_EQ(checked_numel({2, 3, 4}, 4), 96);
  EXPECT_EQ(checked_numel({}), 1);
  EXPECT_EQ(checked_numel({5, 0, max}), 0);
  // The adversarial dataset of issue #19: wrapped to 1 value per sample before.
  EXPECT_EQ(checked_numel({2, 4294967295, 4294967297, 4294967295, 4294967297}), std::nullopt);
  EXPECT_EQ(checked_numel({int64_t{1} << 31, int64_t{1} << 31}, 4), std::nullopt);  // 2^64 bytes
  EXPECT_EQ(checked_numel({3, -1}), std::nullopt);
  // Shapes built by code: a bug, an internal error.
  try {
    shape_numel({4294967297, 4294967297});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Internal);
  }
  EXPECT_THROW(Tensor::empty({int64_t{1} << 62, 4}), Error);  // 2^64 elements
  EXPECT_THROW(Tensor::empty({int64_t{1} << 62}), Error);     // 2^64 bytes of f32
}
