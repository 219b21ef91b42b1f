// Tensor: shapes, views sharing storage, copies, and the checks on misuse.
#include <gtest/gtest.h>

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
